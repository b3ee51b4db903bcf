"""The OpenAI request bodies the front takes, typed with msgspec; a refused body names its field.

Field names and defaults follow SGLang 0.5.23's OpenAI protocol (``sglang/srt/entrypoints/openai/
protocol.py``: ``CompletionRequest.max_tokens`` defaults to 16, ``ChatCompletionRequest.max_tokens`` to none,
``logprobs`` is an int on completions and a bool on chat). Fields the front does not act on yet are
refused by :func:`check_unsupported` rather than silently dropped. ``session_id`` is the manager's own
(docs/agents.md).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar

import msgspec

from rollout_manager.openai_front.errors import OpenAIError, invalid

T = TypeVar("T")
Positive = Annotated[int, msgspec.Meta(ge=1)]
TokenId = Annotated[int, msgspec.Meta(ge=0)]
SessionId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
MAX_N = 64
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class _Common(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: Positive | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    # SGLang's extras, as its protocol names them
    top_k: int | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    return_routed_experts: bool = False  # R3: the experts each position was routed to (MoE boxes)
    # the manager's own: ties turns into one ledger (the X-Session-Id header stands in for it)
    session_id: SessionId | None = None
    # fields accepted by OpenAI's API that the front refuses for now (see check_unsupported)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @property
    def stops(self) -> list[str] | None:
        return [self.stop] if isinstance(self.stop, str) else self.stop

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class ChatRequest(_Common, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]]
    max_completion_tokens: Positive | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    @property
    def budget(self) -> int | None:
        """``max_completion_tokens`` is OpenAI's newer name; given both, it wins (as SGLang does)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def top_count(self) -> int:
        """How many most likely tokens to report beside each sampled one."""
        return (self.top_logprobs or 0) if self.logprobs else 0


class CompletionRequest(_Common, kw_only=True):
    """``POST /v1/completions``: ``prompt`` is text, a list of texts, token ids or a list of id lists."""

    prompt: str | list[Any]  # its items are checked by prompts() (msgspec takes one list type in a union)
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=5)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @property
    def budget(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens  # SGLang's (and OpenAI's) default

    @property
    def top_count(self) -> int:
        """``logprobs`` N on a completion: the N most likely tokens beside each sampled one (0: its own only)."""
        return self.logprobs or 0


def prompts(prompt: str | list[Any]) -> list[str] | list[list[int]]:
    """A completion's ``prompt`` as texts or id lists; a 400 naming ``prompt`` for any other shape."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("prompt", "prompt must not be empty")
    if all(type(p) is str for p in prompt):
        return list(prompt)
    if all(type(t) is int for t in prompt):
        prompt = [prompt]
    if all(type(p) is list and p and all(type(t) is int and t >= 0 for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise invalid("prompt", "prompt must be a string, a list of strings, a list of token ids (integers >= 0) "
                  "or a list of non-empty token-id lists")


_AT = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def decode_body(data: Any, typ: type[T]) -> T:
    """Decoded JSON -> ``typ``; raises a 400 :class:`OpenAIError` whose ``param`` is the field msgspec
    refused (``messages[0].role`` style, as OpenAI names nested fields)."""
    if type(data) is not dict:
        raise invalid(None, "the body must be a JSON object")
    try:
        return msgspec.convert(data, typ)
    except msgspec.ValidationError as exc:
        text = str(exc)
        missing = _MISSING.search(text)
        at = _AT.search(text)
        path = (at.group(1) if at else "") or None
        if missing:
            path = f"{path}.{missing.group(1)}" if path else missing.group(1)
        raise invalid(path and re.sub(r"\.?\[", "[", path), text) from None


def check_messages(messages: list[dict[str, Any]]) -> None:
    """Roles and contents the chat template can render; raises a 400 naming ``messages[i]...``."""
    if not messages:
        raise invalid("messages", "messages must hold at least one message")
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"messages[{i}].role", f"role {role!r} is not one of {sorted(ROLES)}")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise invalid(f"messages[{i}].content", "content must be a string, a list of parts or null")
        if isinstance(content, list) and any(type(p) is not dict or p.get("type") != "text" for p in content):
            raise invalid(f"messages[{i}].content", "only text parts are supported")
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise invalid(f"messages[{i}].tool_call_id", "a tool message needs the tool_call_id it answers")
        calls = m.get("tool_calls")
        if calls is not None and (role != "assistant" or type(calls) is not list):
            raise invalid(f"messages[{i}].tool_calls", "tool_calls must be a list, on an assistant message")
        for j, call in enumerate(calls or []):
            fn = call.get("function") if type(call) is dict else None
            if type(fn) is not dict or not isinstance(fn.get("name"), str):
                raise invalid(f"messages[{i}].tool_calls[{j}].function", "a tool call's function must be an object "
                              "with a name")
            if not isinstance(fn.get("arguments"), (str, dict)):
                raise invalid(f"messages[{i}].tool_calls[{j}].function.arguments", "a tool call's arguments must be "
                              "a JSON object or its text")


_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> None:
    """``tools`` as OpenAI defines them (``{"type": "function", "function": {"name", "description",
    "parameters"}}``, names unique) and a ``tool_choice`` that names one of them; a 400 naming the field."""
    names: set[str] = set()
    for i, tool in enumerate(tools or []):
        if type(tool) is not dict or tool.get("type") != "function":
            raise invalid(f"tools[{i}].type", "a tool must be {\"type\": \"function\", \"function\": {...}}")
        fn = tool.get("function")
        if type(fn) is not dict:
            raise invalid(f"tools[{i}].function", "a tool's function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise invalid(f"tools[{i}].function.name", "a function's name must be 1 to 64 of a-z, A-Z, 0-9, _ and -")
        if name in names:
            raise invalid(f"tools[{i}].function.name", f"two tools are named {name!r}")
        names.add(name)
        if fn.get("parameters") is not None and type(fn["parameters"]) is not dict:
            raise invalid(f"tools[{i}].function.parameters", "a function's parameters must be a JSON Schema object")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise invalid(f"tools[{i}].function.description", "a function's description must be a string")
    if tool_choice is None or tool_choice in ("auto", "none"):
        return
    if tool_choice == "required":
        if not names:
            raise invalid("tool_choice", "tool_choice 'required' needs tools")
        return
    fn = tool_choice.get("function") if type(tool_choice) is dict else None
    if type(fn) is not dict or tool_choice.get("type") != "function" or not isinstance(fn.get("name"), str):
        raise invalid("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if fn["name"] not in names:
        raise invalid("tool_choice", f"tool_choice names {fn['name']!r}, which is not among the tools")


def check_unsupported(body: ChatRequest | CompletionRequest) -> None:
    """Refuse, naming the field, what the front cannot honour yet, rather than answer as if it had."""
    if body.frequency_penalty or body.presence_penalty:
        raise invalid("frequency_penalty" if body.frequency_penalty else "presence_penalty",
                      "output penalties are not supported by this front yet", "unsupported")
    if body.logit_bias:
        raise invalid("logit_bias", "logit_bias is not supported by this front yet", "unsupported")
    if isinstance(body, ChatRequest):
        if body.top_logprobs and not body.logprobs:
            raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    else:
        if body.echo:
            raise invalid("echo", "echo is not supported by this front yet", "unsupported")
        if body.suffix:
            raise invalid("suffix", "suffix is not supported", "unsupported")
        if body.best_of not in (None, 1, body.n):
            raise invalid("best_of", "best_of other than n is not supported", "unsupported")


def not_found_model(name: str, served: str) -> OpenAIError:
    return OpenAIError(404, f"the model {name!r} does not exist; this manager serves {served!r}", "model",
                       "model_not_found")
