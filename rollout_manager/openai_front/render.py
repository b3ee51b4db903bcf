"""Chat messages as the model's own template renders them, and ids back to text: transformers' tokenizer
loaded from ``openai_tokenizer_path`` (the files the boxes load), never a template written here.

transformers is an optional dependency (a verl trainer's install has it), imported on first use, not at start:
a manager without the front configured never pays for it, and the base install stays the daemon alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path
from typing import Any

from rollout_manager.openai_front.errors import OpenAIError, invalid

_MARK = "\u2063ASSISTANT-CONTENT\u2063"  # a text no template writes by itself
# The response schema for a tokenizer that carries none: hermes-style calls and ``<think>`` reasoning.
HERMES_SCHEMA = Path(__file__).with_name("hermes_response_schema.json")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as chat templates take them: an assistant's tool-call ``arguments`` given as JSON text
    become the object (templates write them with ``tojson``), as SGLang's
    ``normalize_assistant_tool_call_arguments`` does; text that is not a JSON object is a 400 naming it.
    The caller's messages are not changed (the ledger compares them as sent)."""
    out = messages
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if not calls or not any(isinstance(c["function"].get("arguments"), str) for c in calls):
            continue
        fixed = []
        for j, call in enumerate(calls):
            fn = call["function"]
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    args = None
                if type(args) is not dict:
                    raise invalid(f"messages[{i}].tool_calls[{j}].function.arguments",
                                  "a tool call's arguments must be a JSON object")
            fixed.append({**call, "function": {**fn, "arguments": args}})
        if out is messages:
            out = list(messages)
        out[i] = {**m, "tool_calls": fixed}
    return out


def _rust_encoder(tok: Any) -> Any:
    """The Rust ``tokenizers`` call that transformers' ``encode`` makes for ``tok``, made directly: a batch
    encoder without offsets (``encode_batch_fast``; the ids are the same, and a turn's new message costs
    about half), on a copy of the backend set as transformers sets it per call (no truncation, no padding,
    special tokens split as ``split_special_tokens`` says). None where ``tok`` is not transformers' Rust
    backend with its own ``encode`` path (a Python tokenizer, or a class that overrides it): then
    transformers' ``encode`` is called."""
    try:
        base = importlib.import_module("transformers.tokenization_utils_base").PreTrainedTokenizerBase
        backend = importlib.import_module("transformers.tokenization_utils_tokenizers").TokenizersBackend
        rust = importlib.import_module("tokenizers").Tokenizer
    except (ImportError, AttributeError):
        return None
    cls = type(tok)
    if not (isinstance(tok, backend) and cls.encode is base.encode and cls._encode_plus is backend._encode_plus
            and isinstance(getattr(tok, "_tokenizer", None), rust)):
        return None
    own = rust.from_str(tok._tokenizer.to_str())
    own.no_truncation()
    own.no_padding()
    own.encode_special_tokens = bool(getattr(tok, "split_special_tokens", False))
    return getattr(own, "encode_batch_fast", own.encode_batch)


class Renderer:
    """One tokenizer and its chat template; every method is synchronous CPU work."""

    def __init__(self, path: str) -> None:
        try:
            transformers = importlib.import_module("transformers")
        except ImportError:
            raise ValueError("the OpenAI front's tokenizer needs transformers, not installed here: "
                             "pip install transformers") from None
        self.tok: Any = transformers.AutoTokenizer.from_pretrained(path)
        if not getattr(self.tok, "chat_template", None):
            raise ValueError(f"the tokenizer at {path} has no chat template")
        if not hasattr(self.tok, "parse_response"):
            raise ValueError("the OpenAI front reads answers with transformers' parse_response, which this "
                             "transformers lacks: pip install 'transformers>=5'")
        own = getattr(self.tok, "response_schema", None)
        self.schema: dict[str, Any] = own if isinstance(own, dict) else json.loads(HERMES_SCHEMA.read_text())
        # Every chat answer is read for reasoning when the schema yields it; the shipped schema's only when
        # the tokenizer has ``</think>`` as a token (a reasoning model's; transformers' server asks the same),
        # so a model that never reasons streams its answers as they are made.
        self.reads_reasoning = "thinking" in self.schema.get("properties", {}) and (
            isinstance(own, dict) or self._has_token("</think>"))
        if '"transform"' in json.dumps(self.schema) and importlib.util.find_spec("jmespath") is None:
            raise ValueError(f"the response schema of the tokenizer at {path} uses jmespath transforms: "
                             "pip install jmespath")
        self._rust = _rust_encoder(self.tok)

    def _has_token(self, token: str) -> bool:
        found = self.tok.convert_tokens_to_ids(token)
        return isinstance(found, int) and found != self.tok.unk_token_id

    def read(self, text: str) -> dict[str, Any]:
        """An answer's text parsed with the response schema by transformers (``parse_response``): a message
        dict (``content``, ``thinking``, ``tool_calls`` as the schema yields them); ValueError or TypeError
        when the schema cannot parse it."""
        out = self.tok.parse_response(text, self.schema)
        if not isinstance(out, dict):
            raise TypeError(f"the response schema gave {type(out).__name__}, not a message")
        return out

    def chat_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  generation_prompt: bool) -> str:
        """The conversation as the template writes it (a 400 naming ``messages`` if the template refuses)."""
        try:
            text = self.tok.apply_chat_template(template_messages(messages), tools=tools, tokenize=False,
                                                add_generation_prompt=generation_prompt)
        except Exception as exc:  # jinja's TemplateError and the template's own raise_exception
            raise OpenAIError(400, f"the model's chat template refused the messages: {exc}", "messages",
                              "template_error") from None
        return str(text)

    def encode(self, text: str) -> list[int]:
        """Text -> ids, with no special tokens added (a rendered template writes its own)."""
        if self._rust is not None:
            return list(self._rust([text], add_special_tokens=False)[0].ids)
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """Ids -> the text a caller sees (special tokens skipped, as SGLang's default)."""
        return str(self.tok.decode(ids, skip_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        return str(self.tok.decode([token_id], skip_special_tokens=False))

    def after_answer(self, new: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str | None:
        """What the template writes after an assistant answer's text when ``new`` follows it: the answer's
        closing (``<|im_end|>\n`` in ChatML), the new messages, the generation prompt. Rendered after a
        stand-in conversation (a user message and an answer whose text is a marker), so the cost is the new
        messages', not the history's. None when the template does not write the answer's text as given."""
        stand_in = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
        text = self.chat_text([*stand_in, *new], tools, True)
        at = text.find(_MARK)
        return text[at + len(_MARK):] if at >= 0 and text.count(_MARK) == 1 else None

    @property
    def vocab_size(self) -> int:
        return len(self.tok)
