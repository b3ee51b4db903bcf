"""A ``/generate`` request as the rollout flow takes it: decoded once, at the door, into typed sequences.

The HTTP handler, the fast lane and each ``/batch_generate_requests`` item hand a caller's body (decoded
JSON) to :func:`decode`, which checks it and types it in one pass (msgspec, against :class:`OneSequenceBody`
or :class:`BatchedBody`): from there on the flow works on these values and the caller's dict is dropped. A
refused body is described as the API always described it (``validation.explain``). The manager's own
fields (``trajectory_key``, ``group_key``, ``min_weight_version``) are taken out here; what is SGLang's is
:class:`.generate_request.SequenceBody`'s.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from rollout_manager.errors import InvalidField
from rollout_manager.instances.relay_messages import SavedTokens
from rollout_manager.placement.affinity import (
    KEY_FIELD,  # affinity: requests with one key go where their context is cached
)
from rollout_manager.sglang.generate_request import (
    BatchIds,
    Count,
    GenerateFields,
    Ids,
    SequenceBody,
    TokenIds,
    is_batch,
    split,
)
from rollout_manager.sglang.wire import PER_ITEM_KEYS, PER_ITEM_LIST_KEYS, per_item
from rollout_manager.validation import Problem, describe, explain, join

# The manager's own top-level /generate fields (never sent to SGLang), see docs/http-api.md.
MIN_VERSION_FIELD = "min_weight_version"  # place only on instances at this weight version or newer
GROUP_FIELD = "group_key"  # the sequence's group (a GRPO prompt's samples): its length is predicted from theirs
TrajectoryKey = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
_TEXT = ("'text' input is not supported: the manager continues sequences token by token, so send "
         "'input_ids' (tokenize on the trainer side)")


class CallerBody(GenerateFields[Ids], kw_only=True):
    """A caller's ``/generate`` body: SGLang's, and the manager's own fields (stripped before the engine
    sees the body). ``trajectory_key``: requests with one key, e.g. the turns of one agent trajectory, go
    to the instance whose prefix cache holds their context. ``min_weight_version``: place the sequences
    only on instances at this weight version or newer; none such: they wait as for capacity
    (``wait_timeout_s``), then 503. ``group_key``: the sequences of one group (verl's ``uid``: a GRPO
    prompt's samples), whose lengths predict each other's (``placement.lengths``); without one, the samples
    of one prompt are a group."""

    trajectory_key: TrajectoryKey | list[TrajectoryKey | None] | None = None
    group_key: TrajectoryKey | list[TrajectoryKey | None] | None = None
    min_weight_version: Count | None = None


class OneSequenceBody(CallerBody[TokenIds], kw_only=True):
    """A ``/generate`` body of one sequence (``input_ids``: its token ids; no ``text``, the trainer
    tokenizes). SGLang's other fields pass through unchanged; ``trajectory_key`` and ``min_weight_version``
    are the manager's own (affinity; the oldest weight version to run on)."""


class BatchedBody(CallerBody[BatchIds], kw_only=True):
    """A ``/generate`` body of several sequences (``input_ids``: a list of prompts), split as SGLang
    splits it: a per-item field may be a list of one value per prompt. SGLang's other fields pass
    through unchanged; ``trajectory_key`` and ``min_weight_version`` are the manager's own."""


_FIELDS = frozenset(OneSequenceBody.__struct_fields__)
MAX_ITEMS = 100_000  # requests in one /batch_generate_requests body
MAX_ID_LENGTH = 512
RequestId = Annotated[
    Annotated[str, msgspec.Meta(max_length=MAX_ID_LENGTH)] | int,
    msgspec.Meta(description="the caller's id for the request, echoed in its result line; compared as a JSON "
                             "value, so 1 and \"1\" are two different ids")]
_ItemCount = Annotated[list[Any], msgspec.Meta(min_length=1, max_length=MAX_ITEMS)]
_PER_ITEM = (*PER_ITEM_KEYS, KEY_FIELD, GROUP_FIELD)


class SequenceRequest(msgspec.Struct, frozen=True, gc=False):
    """One sequence to run: its body, its affinity key, the oldest weight version it may run on, and its
    group (None: its prompt's samples)."""

    body: SequenceBody
    trajectory_key: str | None = None
    min_version: int = 0  # 0: any
    group_key: str | None = None
    # On a relay: the key its tokens are saved under outside it, and the tokens saved by a relay that ran it
    # before (rollout.checkpoints; None: not saved, nothing saved).
    resume_key: str | None = None
    resumed: SavedTokens | None = None


class Request(msgspec.Struct, frozen=True, gc=False):
    """A caller's ``/generate``: its sequences (one, or a batch's items in order)."""

    sequences: list[SequenceRequest]
    batched: bool = False
    stream: bool = False

    @property
    def input_ids(self) -> list[int] | list[list[int]]:
        """The prompts in the shape the caller sent them (a list of lists for a batch)."""
        if self.batched:
            return [s.body.input_ids for s in self.sequences]
        return self.sequences[0].body.input_ids


def decode(data: Any, trajectory_header: str | None = None) -> Request:
    """A caller's ``/generate`` body (decoded JSON; and the ``X-Trajectory-Key`` header, which stands in
    when the body has no key) -> the typed request; raises :class:`InvalidField` (400) naming what is
    wrong. A key string applies to every sequence of a batch (one trajectory's samples), a list gives
    one per sequence."""
    body = checked(data)
    if isinstance(body, list):
        raise InvalidField(join(describe(loc, msg) for loc, msg in body))
    return _request(body, data, trajectory_header)


def decode_items(data: Any) -> list[tuple[Any, Request]]:
    """A ``/batch_generate_requests`` body (decoded JSON: ``[[id, generate_body], ...]``) -> each id with
    its typed request; raises :class:`InvalidField` (400) naming what is wrong, the position as written.
    Ids must be unique, compared as JSON values: the integer 1 and the string "1" are two requests."""
    if type(data) is not list:
        raise InvalidField("the body must be a JSON list of [id, request] pairs")
    problems = explain(data, _ItemCount) if not 1 <= len(data) <= MAX_ITEMS else []
    typed: list[tuple[Any, CallerBody[Any], dict[str, Any]]] = []
    for i, item in enumerate(data if not problems else ()):
        if type(item) is not list:
            problems.append(((i,), "Input should be a valid tuple"))
            continue
        if len(item) > 2:
            problems.append(((i,), f"Tuple should have at most 2 items after validation, not {len(item)}"))
            continue
        rid = item[0] if item else None
        if item and not (type(rid) is int or (type(rid) is str and len(rid) <= MAX_ID_LENGTH)):
            problems += explain(rid, RequestId, (i, 0))
        problems += [((i, k), "Field required") for k in range(len(item), 2)]
        if len(item) == 2:
            body = checked(item[1])
            if isinstance(body, list):
                problems += [((i, 1, *loc), msg) for loc, msg in body]
            elif not problems:
                typed.append((rid, body, item[1]))
    if problems:
        raise InvalidField(join(describe(loc, msg) for loc, msg in problems))
    seen: set[tuple[type, Any]] = set()
    for rid, _, _ in typed:
        key = (type(rid), rid)
        if key in seen:
            raise InvalidField(f"request id {rid!r} appears more than once")
        seen.add(key)
    return [(rid, _request(body, raw)) for rid, body, raw in typed]


def _request(body: CallerBody[Any], data: dict[str, Any], trajectory_header: str | None = None) -> Request:
    bodies, batched = split(body, data, _FIELDS)
    key = body.trajectory_key if KEY_FIELD in data else trajectory_header
    floor = body.min_weight_version or 0
    keys = key if isinstance(key, list) else [key] * len(bodies)
    group = body.group_key
    groups = group if isinstance(group, list) else [group] * len(bodies)
    return Request([SequenceRequest(b, k, floor, g) for b, k, g in zip(bodies, keys, groups)], batched, body.stream)


def checked(data: Any) -> CallerBody[Any] | list[Problem]:
    """``data`` as typed, or what is wrong with it (where, and what)."""
    if type(data) is dict and "text" in data:
        return [((), _TEXT)]
    typ = BatchedBody if type(data) is dict and is_batch(data.get("input_ids")) else OneSequenceBody
    try:
        body: CallerBody[Any] = msgspec.convert(data, typ, strict=True)
    except msgspec.ValidationError:
        return explain(data, typ) or [((), "the body was refused")]  # explain words what msgspec refused
    batched = typ is BatchedBody
    n = len(body.input_ids)
    for name in _PER_ITEM:
        value = getattr(body, name)
        if isinstance(value, list):
            if not batched:
                return [((), f"'{name}' is a list but input_ids is a single sequence")]
            if len(value) != n:
                return [((), f"'{name}' has {len(value)} items for {n} sequences")]
    if batched:
        for name in PER_ITEM_LIST_KEYS:  # passed through, but split per item: the count must match
            value = data.get(name)
            if per_item(name, value) and len(value) != n:
                return [((), f"'{name}' has {len(value)} items for {n} sequences")]
    if body.return_routed_experts:  # SGLang refuses a start past a prompt: refused here, before any engine
        start = body.routed_experts_start_len
        shortest = min(map(len, body.input_ids)) if batched else n
        if start > shortest:
            return [(("routed_experts_start_len",), f"{start} is past the end of a prompt of {shortest} token(s)")]
    return body


def single(body: SequenceBody, trajectory_key: str | None = None, min_version: int = 0) -> Request:
    """A request of one sequence built in code (the manager's own callers and tests)."""
    return Request([SequenceRequest(body, trajectory_key, min_version)], False, body.stream)
