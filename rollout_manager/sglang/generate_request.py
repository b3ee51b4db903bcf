"""SGLang's ``/generate`` request as the manager holds it: one typed body per sequence.

A caller's body is read into :class:`SequenceBody` values once, at the door (a batch becomes one per
item, split as SGLang splits it), and turned back into JSON once, for the engine (:func:`encode`,
:func:`encode_batch`). In between the rollout flow reads attributes, never SGLang's keys: only this
module spells them. The fields the manager reads or rewrites are typed; every other field goes to the
engine as the caller sent it (``rest``, at the top level and inside ``sampling_params``), so what an
engine receives means what the caller asked, plus the manager's changes (seed, budget, interval, rid).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import msgspec

from rollout_manager import jsonutil
from rollout_manager.sglang.wire import DEFAULT_MAX_NEW_TOKENS

_NONE: dict[str, Any] = {}  # the shared ``rest`` of a body with no other fields (never written to)
_SAMPLING_KEYS = frozenset({"max_new_tokens", "min_new_tokens", "sampling_seed", "stream_interval"})
_BODY_KEYS = frozenset({"input_ids", "sampling_params", "rid", "stream", "return_logprob"})


class Sampling(msgspec.Struct, frozen=True, gc=False):
    """A sequence's ``sampling_params``: what the manager reads or rewrites, and the rest as sent."""

    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS  # None: no limit (the engine stops at its context)
    min_new_tokens: int | None = None  # None: not given
    sampling_seed: Any = None  # None: not given (the rollout flow gives each sequence one)
    stream_interval: Any = None  # the caller's; None: not given
    rest: dict[str, Any] = _NONE

    @property
    def parallel(self) -> bool:
        """Whether SGLang expands this into several samples (``n`` > 1), per batch rather than per item."""
        return bool(self.rest.get("n", 1) != 1)

    @classmethod
    def of(cls, params: Any) -> Sampling:
        """Validated ``sampling_params`` (an object, or null/absent) as typed."""
        if not params:
            return _DEFAULT_SAMPLING
        get = params.get
        rest = {k: v for k, v in params.items() if k not in _SAMPLING_KEYS}
        return cls(get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS), get("min_new_tokens"), get("sampling_seed"),
                   get("stream_interval"), rest or _NONE)

    def to_json(self) -> dict[str, Any]:
        out = dict(self.rest)
        out["max_new_tokens"] = self.max_new_tokens
        if self.min_new_tokens is not None:
            out["min_new_tokens"] = self.min_new_tokens
        if self.sampling_seed is not None:
            out["sampling_seed"] = self.sampling_seed
        if self.stream_interval is not None:
            out["stream_interval"] = self.stream_interval
        return out


_DEFAULT_SAMPLING = Sampling()


class SequenceBody(msgspec.Struct, frozen=True, gc=False):
    """One sequence's ``/generate`` body (a caller's, or one the manager sends an engine)."""

    input_ids: list[int]
    sampling: Sampling = _DEFAULT_SAMPLING
    rid: str | None = None  # None: not given (the rollout flow names the sequence)
    stream: bool = False
    return_logprob: bool | None = None  # None: not given
    rest: dict[str, Any] = _NONE  # every other field, passed through as sent

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.return_logprob)

    @classmethod
    def of(cls, data: dict[str, Any]) -> SequenceBody:
        """A validated single-sequence body as typed (see :func:`sequences`)."""
        (body,), _ = sequences(data)
        return body

    def to_json(self) -> dict[str, Any]:
        out = dict(self.rest)
        out["input_ids"] = self.input_ids
        out["sampling_params"] = self.sampling.to_json()
        out["stream"] = self.stream
        if self.rid is not None:
            out["rid"] = self.rid
        if self.return_logprob is not None:
            out["return_logprob"] = self.return_logprob
        return out


def sequences(data: dict[str, Any], skip: Collection[str] = ()) -> tuple[list[SequenceBody], bool]:
    """A validated ``/generate`` body -> one body per sequence, and whether it was a batch.

    ``skip`` names fields that are not SGLang's (the manager's own), left out of what goes on. A batch
    is split as SGLang splits it: per-item lists give each item its own value, a single string ``rid``
    names item ``i`` ``f"{rid}_{i}"``, and every other field applies to every item.
    """
    rest = {k: v for k, v in data.items() if k not in _BODY_KEYS and k not in skip} or _NONE
    ids = data["input_ids"]
    stream = data.get("stream") is True
    params, rid, logprob = data.get("sampling_params"), data.get("rid"), data.get("return_logprob")
    if not (ids and type(ids[0]) is list):
        return [SequenceBody(ids, Sampling.of(params), rid, stream, logprob, rest)], False
    per_item = params if isinstance(params, list) else None
    shared = Sampling.of(params) if per_item is None else _DEFAULT_SAMPLING
    return [SequenceBody(
        item, shared if per_item is None else Sampling.of(per_item[i]),
        rid[i] if isinstance(rid, list) else (None if rid is None else f"{rid}_{i}"), stream,
        logprob[i] if isinstance(logprob, list) else logprob, rest) for i, item in enumerate(ids)], True


def continuation(body: SequenceBody, made: Sequence[int], *, rid: str, stream_interval: int | None = None,
                 keep_caller_interval: bool = False, stream: bool = True, seed: Any = None) -> SequenceBody:
    """The body that continues a single sequence on an engine from the tokens already made.

    ``input_ids`` grows by ``made`` and ``max_new_tokens`` shrinks by ``len(made)``, never past the
    original budget, so the context never overflows and no token is produced twice. A null
    ``max_new_tokens`` (no limit) stays null: SGLang then stops where the context ends, which is the
    same place for the continued request as for the original one.

    ``stream_interval`` (when given) becomes ``sampling_params.stream_interval``, which SGLang 0.5.23
    uses before its server-wide ``--stream-interval``: the engine then sends a chunk every that many
    tokens, so the manager parses that many times fewer frames. ``keep_caller_interval`` leaves a
    caller's own value in place (a streaming caller chose how often it wants chunks). With
    ``stream=False`` the engine answers once, at the end (no interval is set). ``seed`` (when given)
    becomes ``sampling_params.sampling_seed``.
    """
    s = body.sampling
    n = len(made)
    interval = s.stream_interval
    if stream and stream_interval is not None and not (keep_caller_interval and interval is not None):
        interval = int(stream_interval)
    sampling = msgspec.structs.replace(
        s, max_new_tokens=None if s.max_new_tokens is None else max(s.max_new_tokens - n, 0),
        min_new_tokens=None if s.min_new_tokens is None else max(s.min_new_tokens - n, 0), stream_interval=interval,
        sampling_seed=s.sampling_seed if seed is None else seed)
    return msgspec.structs.replace(body, input_ids=[*body.input_ids, *made] if n else body.input_ids,
                                   sampling=sampling, rid=rid, stream=stream)


def encode(body: SequenceBody | Sequence[SequenceBody]) -> bytes:
    """The JSON an engine is sent: for one sequence, or for several as one batch (:func:`encode_batch`)."""
    return jsonutil.dumps(body.to_json()) if isinstance(body, SequenceBody) else encode_batch(body)


def joinable(body: SequenceBody) -> bool:
    """Whether a non-streaming engine body may join a batch (:func:`encode`): SGLang expands
    ``n`` > 1 (parallel sampling) per batch, not per item, so such a body goes alone."""
    return not body.stream and not body.sampling.parallel and body.rid is not None


def join_key(body: SequenceBody) -> tuple[Any, ...]:
    """What bodies must share to join one batch: everything but ``input_ids``, ``sampling_params``
    and ``rid`` (which SGLang takes as one value per item)."""
    return (body.stream, body.return_logprob, body.rest)


def encode_batch(bodies: Sequence[SequenceBody]) -> bytes:
    """One batched ``/generate`` body for bodies with the same :func:`join_key`: ``input_ids``,
    ``sampling_params`` and ``rid`` become per-item lists (the inverse of :func:`sequences`)."""
    out = bodies[0].to_json()
    out["input_ids"] = [b.input_ids for b in bodies]
    out["sampling_params"] = [b.sampling.to_json() for b in bodies]
    out["rid"] = [b.rid for b in bodies]
    return jsonutil.dumps(out)
