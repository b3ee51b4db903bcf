"""A tiny word-level tokenizer for the OpenAI front's tests: 256 tokens (the CPU engine's tiny vocabulary,
so every id the engine samples decodes), ChatML's special tokens and a ChatML chat template set on it, as a
hermes-style model ships one. Made here with ``tokenizers`` and saved with transformers' ``save_pretrained``:
the manager loads it as it would a model's (``AutoTokenizer.from_pretrained``)."""

from __future__ import annotations

from pathlib import Path

VOCAB = 256
EOS = "<|im_end|>"
SPECIAL = ["<|endoftext|>", "<|im_start|>", EOS, "<unk>"]
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ["system", "user", "assistant", "tool", "hello", "you", "are", "a", "helpful", "agent", "what", "is", "the",
         "answer", "again", "please", "<think>", "</think>"]
# A second family: ChatML whose template drops an earlier answer's reasoning (``<think> ... </think>``), as
# reasoning models' templates do; re-rendering a conversation then changes the ids the model sampled.
DROPS_REASONING = ("{% for message in messages %}{% set content = message['content'] %}"
                   "{% if message['role'] == 'assistant' and not loop.last %}"
                   "{% set content = content.split('</think>')[-1] %}{% endif %}"
                   "<|im_start|>{{ message['role'] }}\n{{ content }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make(out: Path, template: str = CHATML) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIAL + WORDS
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token=EOS, pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = template
    fast.save_pretrained(out)
    return out


def eos_id() -> int:
    return SPECIAL.index(EOS)
