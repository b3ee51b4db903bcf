"""The front's tokenizer calls the Rust ``tokenizers`` backend directly (``render._rust_encoder``): the ids
must be exactly transformers' own ``encode``'s, for the test families' word-level tokenizers and for a
byte-level BPE one (merges across spaces, bytes of any text), special tokens split or not."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai_tokenizer import CHATML, DROPS_REASONING, LLAMA3, make

from rollout_manager.openai_front import render
from rollout_manager.openai_front.render import Renderer

TEXTS = [
    "",
    "<|im_start|>user\nhello you<|im_end|>\n<|im_start|>assistant\n",
    "<|im_end|>\n<|im_start|>user\nwhat is the answer again please<|im_end|>\n<|im_start|>assistant\n<think>",
    '<|start_header_id|>assistant<|end_header_id|>\n\n<|python_tag|>{"name": "get_weather", "parameters": '
    '{"city": "paris"}}<|eot_id|>',
    "  leading and   inner  spaces, unknown words, tabs\tand\nnewlines\n\n",
    "unicode: d\u00e9j\u00e0 vu \u2014 \u4f60\u597d \U0001f600, <|im_end|> inside<|im_start|>text",
]


def bpe(out: Path) -> Path:
    """A byte-level BPE tokenizer (as GPT-2, Llama 3 and Qwen ship) trained on a few lines, ChatML on it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello you are a helpful agent", "what is the weather in paris and rome",
                             "the answer is sunny, again please", "  spaces\tand\nnewlines"] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    return out


@pytest.mark.parametrize("family", ["chatml", "drops_reasoning", "llama3", "bpe"])
def test_the_direct_rust_call_gives_transformers_ids(tmp_path: Path, family: str) -> None:
    path = bpe(tmp_path) if family == "bpe" else make(
        tmp_path, {"chatml": CHATML, "drops_reasoning": DROPS_REASONING, "llama3": LLAMA3}[family])
    renderer = Renderer(str(path))
    assert renderer._rust is not None  # the direct call is the one under test
    for text in TEXTS:
        assert renderer.encode(text) == renderer.tok.encode(text, add_special_tokens=False), text
    rendered = renderer.chat_text([{"role": "system", "content": "you are a helpful agent"},
                                   {"role": "user", "content": "what is the weather in paris"}], None, True)
    assert renderer.encode(rendered) == renderer.tok.encode(rendered, add_special_tokens=False)


def test_special_tokens_split_as_the_tokenizer_says(tmp_path: Path) -> None:
    tok = Renderer(str(make(tmp_path))).tok
    tok.split_special_tokens = True  # as a tokenizer loaded with split_special_tokens=True has it
    encode = render._rust_encoder(tok)
    assert encode is not None
    text = "<|im_start|>user\nhello<|im_end|>\n"
    assert encode([text], add_special_tokens=False)[0].ids == tok.encode(text, add_special_tokens=False)
    tok.split_special_tokens = False
    assert render._rust_encoder(tok)([text], add_special_tokens=False)[0].ids == tok.encode(
        text, add_special_tokens=False) != encode([text], add_special_tokens=False)[0].ids
