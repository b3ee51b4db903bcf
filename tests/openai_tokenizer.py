"""A tiny word-level tokenizer for the OpenAI front's tests: 256 tokens (the CPU engine's tiny vocabulary,
so every id the engine samples decodes), ChatML's special tokens and a ChatML chat template set on it, as a
hermes-style model ships one: with ``tools`` it writes them into the system message, an assistant's
``tool_calls`` as ``<tool_call>`` JSON blocks and ``tool`` messages as ``<tool_response>`` blocks in a user
turn, as Qwen2.5's template does (a word per JSON piece is in the vocabulary, so a tool call the engine is
made to write decodes to text the hermes parser reads). Made here with ``tokenizers`` and saved with
transformers' ``save_pretrained``: the manager loads it as it would a model's (``AutoTokenizer.from_pretrained``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB = 256
EOS = "<|im_end|>"
SPECIAL = ["<|endoftext|>", "<|im_start|>", EOS, "<unk>"]
CHATML = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}
    {{- '# Tools\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}
    {{- '\n</tools>\nFor each function call, return a json object within <tool_call></tool_call> tags<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'system' and loop.first and tools %}
    {%- elif message['role'] == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message['content'] %}{{- '\n' + message['content'] }}{%- endif %}
        {%- for call in message['tool_calls'] or [] %}
            {%- if call['function'] is defined %}{%- set call = call['function'] %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' + call['name'] + '", "arguments": ' }}
            {{- call['arguments'] | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message['role'] == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
WORDS = ["system", "user", "assistant", "tool", "hello", "you", "are", "a", "helpful", "agent", "what", "is", "the",
         "answer", "again", "please", "<think>", "</think>",
         # a hermes-style tool call, a word per piece of its JSON, as the template and the parser write them
         "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", '{"name":', '"get_weather",',
         '"arguments":', '{"city":', '"paris"}}', '"rome"}}', "sunny", "rainy", "weather", "in", "paris", "rome",
         # the Llama 3.x-style family below: its header and end tokens, a JSON call's "parameters"
         "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>", '"parameters":']
# A second family: ChatML whose template drops an earlier answer's reasoning (``<think> ... </think>``), as
# reasoning models' templates do; re-rendering a conversation then changes the ids the model sampled.
DROPS_REASONING = ("{% for message in messages %}{% set content = message['content'] %}"
                   "{% if message['role'] == 'assistant' and not loop.last %}"
                   "{% set content = content.split('</think>')[-1] %}{% endif %}"
                   "<|im_start|>{{ message['role'] }}\n{{ content }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# A third family, another call format: Llama 3.x's (headers, ``<|eot_id|>`` ends a turn, a call is a JSON
# object ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``, several joined by
# ``;``, a tool's result in an ``ipython`` turn), with ``<think>`` reasoning as a reasoning model distilled
# on Llama writes it. Its tokenizer carries its own response schema (``tokenizer_config.json``).
LLAMA3_EOS = "<|eot_id|>"
LLAMA3 = r"""
{%- for message in messages %}
    {%- if loop.first and tools %}
        {{- '<|start_header_id|>system<|end_header_id|>\n\nYou may call these functions:' }}
        {%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}{{- '<|eot_id|>' }}
    {%- endif %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' + (message['content'] or '') }}
        {%- for call in message['tool_calls'] or [] %}
            {%- if call['function'] is defined %}{%- set call = call['function'] %}{%- endif %}
            {%- if not loop.first %}{{- ' ;' }}{%- endif %}
            {{- ' {"name": "' + call['name'] + '", "parameters": ' + call['arguments'] | tojson + '}' }}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- elif message['role'] == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""
LLAMA3_SCHEMA = {
    "type": "object",
    "properties": {
        "role": {"const": "assistant"},
        "thinking": {"type": "string", "x-regex": r"^\s*(?:<think>)?\s*(.*?)\s*</think>"},
        "content": {"type": "string",
                    "x-regex": r'^(?:.*?</think>\s*)?(.*?)(?:\s*(?:<\|python_tag\|>\s*)?\{"name":.*)?\Z'},
        "tool_calls": {"type": "array", "x-regex": r"^(?:.*?</think>)?(.*)\Z",
                       "x-regex-iterator": r'(\{"name":.*?\})\s*(?:;|\Z)',
                       "items": {"type": "any", "x-parser": "json"}},
    },
}


def make(out: Path, template: str = CHATML, response_schema: dict[str, Any] | None = None) -> Path:
    """The tokenizer with ``template``; ``response_schema``: the one its ``tokenizer_config.json`` carries
    (none: the front reads answers with its hermes one). The Llama 3.x family's end token is ``<|eot_id|>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIAL + WORDS
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    llama = template == LLAMA3
    specials = ["<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>"] if llama else ["<|im_start|>"]
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token=LLAMA3_EOS if llama else EOS,
                                   pad_token="<|endoftext|>", additional_special_tokens=specials)
    fast.chat_template = template
    if response_schema is not None:
        fast.response_schema = response_schema
    fast.save_pretrained(out)
    return out


def eos_id() -> int:
    return SPECIAL.index(EOS)


def llama3_eos_id() -> int:
    return len(SPECIAL) + WORDS.index(LLAMA3_EOS)
