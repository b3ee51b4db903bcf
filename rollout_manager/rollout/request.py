"""A ``/generate`` request as the rollout flow takes it: decoded once, at the door, into typed sequences.

The HTTP handler, the fast lane and each ``/batch_generate_requests`` item validate a caller's body
(``api.schemas``) and hand it to :func:`decode`; from there on the flow works on these values and the
caller's dict is dropped. The manager's own fields (``trajectory_key``, ``min_weight_version``) are
taken out here; what is SGLang's is :class:`.generate_request.SequenceBody`'s.
"""

from __future__ import annotations

from typing import Any

import msgspec

from rollout_manager.sglang.generate_request import SequenceBody, sequences

# The manager's own top-level /generate fields (never sent to SGLang), see docs/http-api.md.
KEY_FIELD = "trajectory_key"  # affinity: requests with one key go where their context is cached
MIN_VERSION_FIELD = "min_weight_version"  # place only on instances at this weight version or newer
_OWN_FIELDS = (KEY_FIELD, MIN_VERSION_FIELD)


class SequenceRequest(msgspec.Struct, frozen=True, gc=False):
    """One sequence to run: its body, its affinity key, and the oldest weight version it may run on."""

    body: SequenceBody
    trajectory_key: str | None = None
    min_version: int = 0  # 0: any


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


def decode(data: dict[str, Any], trajectory_header: str | None = None) -> Request:
    """A validated ``/generate`` body (and the ``X-Trajectory-Key`` header, which stands in when the body
    has no key) -> the typed request. A key string applies to every sequence of a batch (one
    trajectory's samples), a list gives one per sequence."""
    bodies, batched = sequences(data, _OWN_FIELDS)
    key = data[KEY_FIELD] if KEY_FIELD in data else trajectory_header
    floor = int(data.get(MIN_VERSION_FIELD) or 0)
    if isinstance(key, list):
        items = [SequenceRequest(b, None if k is None else str(k), floor) for b, k in zip(bodies, key)]
    else:
        key = None if key is None else str(key)
        items = [SequenceRequest(b, key, floor) for b in bodies]
    return Request(items, batched, bodies[0].stream)


def single(body: SequenceBody, trajectory_key: str | None = None, min_version: int = 0) -> Request:
    """A request of one sequence built in code (the manager's own callers and tests)."""
    return Request([SequenceRequest(body, trajectory_key, min_version)], False, body.stream)
