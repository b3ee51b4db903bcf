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
         '"arguments":', '{"city":', '"paris"}}', '"rome"}}', "sunny", "rainy", "weather", "in", "paris", "rome"]
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
