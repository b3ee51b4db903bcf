"""An answer's text read into OpenAI's message: ``content``, ``tool_calls`` and ``reasoning_content``.

The per-family knowledge is data, not code: the model's response schema (transformers' ``response_schema``,
from the tokenizer's ``tokenizer_config.json``) or, for a tokenizer that carries none, the hermes one the
product ships (``hermes_response_schema.json``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks as Qwen2.5's and Qwen3's templates teach their models, and Qwen3's ``<think> ... </think>``
reasoning). The parsing is transformers' (``parse_response``, through the tokenizer the front loaded, see
:meth:`.Renderer.read`). This module only turns the parsed message into OpenAI's shape, with the rules
SGLang 0.5.23's ``serving_chat`` applies around its detectors: a call to a function the request did not
declare is dropped; ``arguments`` is the object re-serialized (``ensure_ascii=False``); an answer the
schema cannot parse (a call that is not JSON) is all content, with no call; calls found turn a ``stop``
finish into ``tool_calls``; with ``parallel_tool_calls: false`` only the first call is kept.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout_manager.sglang.openai_turn import CallTag, ForcedCalls

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, serialized

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Parsed:
    """An answer's text as content, calls and reasoning; ``content`` None when the answer was calls only."""

    content: str | None
    calls: list[ToolCall]
    reasoning: str | None = None


Reader = Callable[[str], dict[str, Any]]  # a text -> the parsed message (transformers' parse_response)


def _call_objects(found: Any) -> list[dict[str, Any]]:
    """The parsed calls as ``{"name", "arguments"}`` objects: a schema may give a call flat, nested under
    ``function`` (as OpenAI's shape and some schemas' transforms do), or a list of calls per block."""
    out = []
    for item in found if isinstance(found, list) else [found]:
        if isinstance(item, list):
            out += _call_objects(item)
        elif isinstance(item, dict):
            fn = item.get("function")
            out.append(fn if isinstance(fn, dict) else item)
    return out


def _arguments(obj: dict[str, Any]) -> str:
    args = obj.get("arguments") or obj.get("parameters") or {}
    if isinstance(args, str):  # a schema that keeps the arguments as text
        try:
            args = json.loads(args)
        except ValueError:
            return args
    return json.dumps(args, ensure_ascii=False)


def parse(text: str, read: Reader, tool_names: frozenset[str] | None, parallel: bool = True) -> Parsed:
    """A whole answer's text -> content, reasoning and the calls to declared functions (``tool_names``
    None: the request declared none, so calls are not read and an answer that holds some stays whole)."""
    try:
        message = read(text)
    except (ValueError, TypeError):  # the schema could not parse it (a call not JSON): all content
        return Parsed(text, [])
    found = _call_objects(message.get("tool_calls") or [])
    if found and tool_names is None:
        return Parsed(text, [])
    calls = [ToolCall(f"call_{uuid.uuid4().hex[:24]}", str(obj["name"]), _arguments(obj))
             for obj in found if obj.get("name") in (tool_names or ())]
    if not parallel:
        calls = calls[:1]
    thinking, content = message.get("thinking"), message.get("content")
    content = content if isinstance(content, str) else ""
    reasoning = thinking if isinstance(thinking, str) and thinking else None
    return Parsed(content or (None if calls else ""), calls, reasoning)


def forced(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool) -> ForcedCalls | None:
    """What ``tool_choice`` ``"required"`` or a named function asks of the boxes: an answer that starts with
    a call, in the hermes format as Qwen2.5's and Qwen3's templates write it (``<tool_call>\n{"name": ...,
    "arguments": ...}\n</tool_call>``), to one of the declared functions (the named one), its arguments
    following the function's schema; one call when ``parallel`` is false. None for ``auto`` and ``none``."""
    if not tools or tool_choice in (None, "auto", "none"):
        return None
    named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    tags = tuple(CallTag(f'{OPEN}\n{{"name": "{fn["name"]}", "arguments": ', fn.get("parameters") or {"type": "object"},
                         f"}}\n{CLOSE}")
                 for fn in (t["function"] for t in tools) if named is None or fn["name"] == named)
    return ForcedCalls(tags, OPEN, one=not parallel)


def finish_reason(finish: str | None, calls: list[ToolCall]) -> str | None:
    return "tool_calls" if calls and finish == "stop" else finish
