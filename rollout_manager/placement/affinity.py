"""Affinity: send a trajectory's next turn, and a GRPO group's other samples, where their prefix is cached.

SGLang keeps a radix cache of the prefixes it has computed. An agent loop sends each turn as its own
``/generate`` whose ``input_ids`` extend the previous turn's context, and the n samples of one GRPO
prompt share that prompt: on the instance that served the earlier request, only the new tokens are
prefilled; anywhere else, all of them. So the manager remembers which instance served which key and
prefers it for the next request with that key, while it is usable and not overloaded.

Keys, looked up in this order:

- the caller's trajectory key (``trajectory_key`` in the body, or the ``X-Trajectory-Key`` header;
  the manager strips it before the engine sees the body);
- the exact prompt (a hash of all of ``input_ids``): the GRPO siblings of a sample already placed;
- the longest block-aligned prefix of ``input_ids`` (every ``block_tokens``) that was the context of
  a finished sequence and covers at least ``min_match`` of the input: the next turn of a
  conversation sent without a key. A shorter match (a shared system prompt) says nothing.

Pure code, no I/O: the dispatcher and the simulator (``benchmarks/bench_affinity.py``) use it alike.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from rollout_manager.instances.registry import Instance, Kind, State
from rollout_manager.placement.instance_load import InstanceLoad
from rollout_manager.placement.policy import PlacementPolicy
from rollout_manager.placement.throughput_aware import ThroughputAware

KEY_FIELD = "trajectory_key"  # the body key the manager reads (and strips) for a request's affinity key

__all__ = ["AffinityKeys", "AffinityTable", "AffinitySettings", "KEY_FIELD", "KEY_HEADER", "FALLBACK_REASONS",
           "block_hashes", "fallback_reason", "overloaded"]

KEY_HEADER = "X-Trajectory-Key"
KEY_MAX_LEN = 512
# Why a remembered instance was not used: it is gone, out of service, failing, too loaded, or the local
# window gave the work to a local instance first.
FALLBACK_REASONS = ("dead", "draining", "syncing", "failing", "overloaded", "local_first")


@dataclass(frozen=True)
class AffinitySettings:
    capacity: int = 65536  # entries kept (least recently used dropped first)
    block_tokens: int = 64
    min_match: float = 0.5
    # Overloaded: the policy calls it full, or its expected finish is worse than this many times the best.
    max_slowdown: float = 2.0

    def __post_init__(self) -> None:
        if self.capacity < 1 or self.block_tokens < 1:
            raise ValueError("capacity and block_tokens must be >= 1")
        if not 0.0 <= self.min_match <= 1.0:
            raise ValueError("min_match must be within [0, 1]")
        if self.max_slowdown < 1.0:
            raise ValueError("max_slowdown must be >= 1")


def _chain(ids: Sequence[int], block: int, start: int = 0, h: int = 0) -> list[tuple[int, int]]:
    """``(length, hash)`` of every block-aligned prefix, shortest first; chained, so O(len(ids)).

    ``ids`` may be the tail of a longer input that begins after the prefix of ``start`` tokens (a
    multiple of ``block``) whose hash is ``h``: the prefix is not hashed again."""
    out = []
    end = start
    for chunk in zip(*[iter(ids)] * block):  # each whole block as a tuple, cut at C speed (no slice copies)
        h = hash((h, chunk))
        end += block
        out.append((end, h))
    return out


def block_hashes(ids: Sequence[int], block: int, known: Sequence[int] = ()) -> list[int]:
    """The chained hash of every whole block of ``ids``, as :class:`AffinityKeys` holds them, hashing only the
    blocks after ``known``: the hashes of a prefix of ``ids`` made before (a chat session's earlier turn,
    whose prompt the next one extends), so a turn hashes its new ids, not its history."""
    start = len(known) * block
    return [*known, *(h for _, h in _chain(ids[start:], block, start, known[-1] if known else 0))]


class AffinityKeys(NamedTuple):
    """What one request can be recognised by (a named tuple: one is built per sequence)."""

    trajectory: str | None
    length: int
    prompt: int  # hash of the whole input
    blocks: tuple[tuple[int, int], ...]  # block-aligned prefixes of the input, shortest first
    tail: tuple[int, ...] = ()  # the input after its last whole block

    @classmethod
    def of(cls, input_ids: Sequence[int], trajectory: str | None, block: int,
           hashes: Sequence[int] | None = None) -> AffinityKeys:
        """``hashes``: :func:`block_hashes` of ``input_ids`` made by the caller (used when there is one per
        whole block), so they are not made again."""
        if hashes is not None and len(hashes) == len(input_ids) // block:
            blocks = list(zip(range(block, (len(hashes) + 1) * block, block), hashes))
        else:
            blocks = _chain(input_ids, block)
        head = blocks[-1][1] if blocks else 0
        tail = tuple(input_ids[len(blocks) * block:])
        return cls(trajectory, len(input_ids), hash((len(input_ids), head, tail)), tuple(blocks), tail)


class AffinityTable:
    """Key -> the instance that last served it; bounded (LRU), entries of dead instances dropped."""

    def __init__(self, settings: AffinitySettings | None = None) -> None:
        self.settings = settings or AffinitySettings()
        self._map: OrderedDict[tuple[str, Any], str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def keys(self, input_ids: Sequence[int], trajectory: str | None,
             hashes: Sequence[int] | None = None) -> AffinityKeys:
        return AffinityKeys.of(input_ids, trajectory, self.settings.block_tokens, hashes)

    def _get(self, key: tuple[str, Any]) -> str | None:
        inst = self._map.get(key)
        if inst is not None:
            self._map.move_to_end(key)
        return inst

    def _set(self, key: tuple[str, Any], instance_id: str) -> None:
        self._map[key] = instance_id
        self._map.move_to_end(key)
        while len(self._map) > self.settings.capacity:
            self._map.popitem(last=False)

    def lookup(self, keys: AffinityKeys) -> str | None:
        """The instance that holds this request's prefix, if one is remembered."""
        if keys.trajectory is not None:
            inst = self._get(("t", keys.trajectory))
            if inst is not None:
                return inst
        inst = self._get(("p", keys.prompt))
        if inst is not None:
            return inst
        floor = self.settings.min_match * keys.length
        for length, h in reversed(keys.blocks):
            if length < floor:
                break
            inst = self._get(("b", h))
            if inst is not None:
                return inst
        return None

    def placed(self, keys: AffinityKeys, instance_id: str) -> None:
        """The request went to ``instance_id``: its siblings and next turn should follow."""
        if keys.trajectory is not None:
            self._set(("t", keys.trajectory), instance_id)
        self._set(("p", keys.prompt), instance_id)

    def finished(self, keys: AffinityKeys, output_ids: Sequence[int], instance_id: str) -> None:
        """The request's last segment ran on ``instance_id``, which now caches its input and
        ``output_ids``: a next turn extending them finds it by their longest block-aligned prefix.
        The input's own blocks are hashed already (``keys``); only what follows them is."""
        if keys.trajectory is not None:
            self._set(("t", keys.trajectory), instance_id)
        start, h = keys.blocks[-1] if keys.blocks else (0, 0)
        blocks = _chain([*keys.tail, *output_ids], self.settings.block_tokens, start, h)
        last = blocks[-1][1] if blocks else (h if keys.blocks else None)
        if last is not None:
            self._set(("b", last), instance_id)

    def forget_instance(self, instance_id: str) -> int:
        """Drop every entry that points at ``instance_id`` (it is gone); returns how many."""
        stale = [k for k, v in self._map.items() if v == instance_id]
        for k in stale:
            del self._map[k]
        return len(stale)


def _finish_s(c: InstanceLoad, tokens: int) -> float:
    rate = c.token_rate or 0.0
    return (c.in_flight_tokens + tokens) / rate if rate > 0 else math.inf


def overloaded(preferred: InstanceLoad, candidates: Sequence[InstanceLoad], tokens: int, policy: PlacementPolicy,
               max_slowdown: float) -> bool:
    """Whether ``preferred`` is too loaded to take a request for its cache's sake.

    From what the policy already measures: it is full under the policy's own rule, or its expected
    finish for the request (in-flight token budget over measured rate) is worse than ``max_slowdown``
    times the best candidate's. Without measured rates, in-flight requests stand in for the finish.
    """
    if isinstance(policy, ThroughputAware) and policy.is_full(preferred, tokens):
        return True
    mine = _finish_s(preferred, tokens)
    # One pass over the candidates (every placement with a preference runs this over the whole pool).
    best = math.inf  # the best measured finish
    fewest = preferred.in_flight_requests if not candidates else candidates[0].in_flight_requests
    for c in candidates:
        rate = c.token_rate
        if rate is not None and rate > 0:
            finish = (c.in_flight_tokens + tokens) / rate
            if finish < best:
                best = finish
        if c.in_flight_requests < fewest:
            fewest = c.in_flight_requests
    if math.isfinite(mine) and math.isfinite(best):
        return mine > max_slowdown * best
    return preferred.in_flight_requests + 1 > max_slowdown * (fewest + 1)


def fallback_reason(preferred: Instance | None, chosen: Instance) -> str:
    """Why the request went to ``chosen`` rather than ``preferred`` (one of :data:`FALLBACK_REASONS`)."""
    if preferred is None or preferred.state == State.DEAD:
        return "dead"
    if preferred.state in (State.DRAINING, State.EVACUATING):
        return "draining"
    if preferred.state in (State.SYNCING, State.PENDING):
        return "syncing"
    if preferred.health.consecutive_failures > 0:
        return "failing"
    if chosen.kind == Kind.LOCAL and preferred.kind == Kind.REMOTE:
        return "local_first"
    return "overloaded"
