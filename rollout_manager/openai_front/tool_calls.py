"""Tool calls in a model's answer, hermes-style (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
as Qwen2.5's and Qwen3's templates teach their models), read into OpenAI's ``tool_calls``.

What it reads follows SGLang 0.5.23's ``HermesDetector`` (``sglang/srt/function_call/hermes_detector.py``) and
``serving_chat._process_tool_calls``: each ``<tool_call>`` block (an unclosed last one too) holds one JSON
object or a list of them; a call to a function the request did not declare is dropped; ``arguments`` is the
object re-serialized (``ensure_ascii=False``); a block that is not JSON leaves the whole text as content
and no call; calls found turn a ``stop`` finish into ``tool_calls``. Two choices of the front's own: the
content is the text before the first block with trailing whitespace removed (SGLang strips both ends; only
the trailing end can be known while streaming, and a stream must give the same content as a whole
answer), and with ``parallel_tool_calls: false`` only the first call is kept (SGLang can only enforce it
with a grammar). The manager cannot import SGLang (the daemon's light install), so this is its own code.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from rollout_manager.sglang.openai_turn import CallTag, ForcedCalls

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, serialized

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Parsed:
    """An answer's text as content and calls; ``content`` None when the answer was calls only."""

    content: str | None
    calls: list[ToolCall]


def _objects(raw: str) -> list[Any]:
    parsed = json.loads(raw.strip())
    return parsed if isinstance(parsed, list) else [parsed]


def parse(text: str, tool_names: frozenset[str], parallel: bool = True) -> Parsed:
    """A whole answer's text -> content and the calls to declared functions."""
    at = text.find(OPEN)
    if at < 0:
        return Parsed(text, [])
    try:
        objects = [obj for m in _BLOCK.finditer(text) for obj in _objects(m.group(1) or m.group(2) or "null")
                   if obj is not None]
    except ValueError:  # not JSON: the whole text stays content (SGLang's detector does the same)
        return Parsed(text, [])
    calls = []
    for obj in objects:
        if not isinstance(obj, dict) or obj.get("name") not in tool_names:
            continue
        args = obj.get("parameters") or obj.get("arguments") or {}
        calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", str(obj["name"]), json.dumps(args, ensure_ascii=False)))
    if not parallel:
        calls = calls[:1]
    return Parsed(text[:at].rstrip() or (None if calls else ""), calls)


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


def _partial_suffix(text: str, token: str) -> int:
    """How many of ``text``'s last characters could start ``token``."""
    for n in range(min(len(text), len(token) - 1), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0


class StreamingContent:
    """The content a stream may send as it grows, so that its deltas add up to :func:`parse`'s content: text
    is held back from the first ``<tool_call>`` on (parsed once the answer is whole), and also any tail that
    could still become one (``<tool_`` ...) or that is trailing whitespace."""

    def __init__(self) -> None:
        self.sent = 0  # characters of the text sent as content so far
        self.in_call = False

    def ready(self, text: str) -> str:
        """The new content ``text`` (the whole answer so far) allows."""
        if self.in_call:
            return ""
        at = text.find(OPEN)
        if at >= 0:
            self.in_call = True
            safe = text[:at].rstrip()
        else:
            safe = text[:len(text) - _partial_suffix(text, OPEN)].rstrip()
        out = safe[self.sent:] if len(safe) > self.sent else ""
        self.sent = max(self.sent, len(safe))
        return out

    def rest(self, content: str | None) -> str:
        """The content not sent yet, once the answer is whole and parsed (``content``: :func:`parse`'s)."""
        return (content or "")[self.sent:]
