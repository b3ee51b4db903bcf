"""Make the tiny random model real SGLang serves in the real_sglang tests: ``python real_sglang_model.py DIR [ARCH]``.

Qwen2 (default), Llama or Qwen3-MoE (``qwen3_moe``: every layer a mixture of :data:`MOE_EXPERTS` experts,
:data:`MOE_TOP_K` chosen per token, saved with per-expert names ``model.layers.L.mlp.experts.E.*``), vocab
1,024, hidden 64, 2 layers, float32, saved with ``save_pretrained``, and a
byte-level BPE tokenizer trained here with ``tokenizers`` on a made-up corpus (nothing can come from a model
hub). Run with .venv-sglang's interpreter and ``SGLANG_USE_CPU_ENGINE=1`` (transformers imports torchvision
there, which needs the hook), so the files are written by the transformers version SGLang reads them with.
Deterministic: the same seed gives the same weights and the same tokenizer.
"""

from __future__ import annotations

import sys
from pathlib import Path

VOCAB = 1024
CONTEXT = 1024  # max_position_embeddings: SGLang's context length for this model
EOS_ID = 0  # "<|endoftext|>", the tokenizer's first (special) token
LAYERS = 2
MOE_EXPERTS = 8
MOE_TOP_K = 2
ARCHS = ("qwen2", "llama", "qwen3_moe")


def make(out: Path, arch: str = "qwen2", seed: int = 0) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    out.mkdir(parents=True, exist_ok=True)
    words = ["alpha", "beta", "gamma", "delta", "rollout", "manager", "token", "weight", "push", "sequence",
             "the", "a", "of", "and", "box", "trainer"]
    corpus = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) + f" {i}" for i in range(2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT, eos_token_id=EOS_ID,
                 bos_token_id=EOS_ID, tie_word_embeddings=False)
    model: torch.nn.Module
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape))
    else:  # norm_topk_prob as Qwen3-30B-A3B sets it: the chosen experts' weights renormalised to sum to 1
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **shape, head_dim=16, num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K, moe_intermediate_size=32,
            norm_topk_prob=True))
    model.to(torch.float32).save_pretrained(out)


if __name__ == "__main__":
    make(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "qwen2")
