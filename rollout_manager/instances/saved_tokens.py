"""The tokens of the relays' running sequences, held by the control process (``rollout.checkpoints``): what a
relay that dies would otherwise take with it.

Each key's tokens grow by the pieces its relay reports, and are dropped when the relay says it ended. A key nobody
reports on for ``ttl_s`` (its caller gave up, or sent nothing again) is dropped, and so is the oldest while more
than ``max_tokens`` are held: a bound on the control process's memory whatever the relays send.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from rollout_manager.instances.relay_messages import SavedSegment, SavedTokens

# 4-byte unsigned token ids, as the relays' sequences keep them (rollout.progress.token_array)
TOKENS = "I" if array("I").itemsize == 4 else "L"


@dataclass
class _Held:
    relay: int
    ids: array[int] = field(default_factory=lambda: array(TOKENS))
    logprobs: list[Any] = field(default_factory=list)
    segments: list[SavedSegment] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    at: float = 0.0


class SavedStore:
    def __init__(self, ttl_s: float = 600.0, max_tokens: int = 256 * 1024 * 1024,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_tokens = max_tokens
        self.clock = clock
        self._held: OrderedDict[str, _Held] = OrderedDict()  # least recently reported first
        self.tokens = 0
        self.claimed = 0  # sequences handed to a relay that got them again
        self.dropped = 0  # keys dropped by age or by the bound

    def apply(self, relay: int, saved: Iterable[SavedTokens], done: Iterable[str]) -> list[str]:
        """A relay's report; returns the keys whose piece did not start where what is held ends (held nothing:
        this process started again), for the relay to send whole."""
        now, missing = self.clock(), []
        for key in done:
            self._drop(key)
        for piece in saved:
            held = self._held.get(piece.key)
            if held is None:
                if piece.start != 0:
                    missing.append(piece.key)
                    continue
                held = self._held[piece.key] = _Held(relay)
            elif piece.start > len(held.ids):
                missing.append(piece.key)
                continue
            self.tokens -= len(held.ids)
            del held.ids[piece.start:]
            del held.logprobs[piece.start:]
            held.ids.frombytes(piece.ids)
            if piece.logprobs:
                held.logprobs.extend(piece.logprobs)
            held.segments, held.versions, held.relay, held.at = piece.segments, piece.versions, relay, now
            self.tokens += len(held.ids)
            self._held.move_to_end(piece.key)
        self._expire(now)
        return missing

    def claim(self, relay: int, keys: Iterable[str]) -> dict[str, SavedTokens]:
        """The saved tokens of ``keys`` (those held), now ``relay``'s."""
        out = {}
        for key in keys:
            held = self._held.get(key)
            if held is None or not held.ids:
                continue
            held.relay, held.at = relay, self.clock()
            logprobs = held.logprobs if len(held.logprobs) == len(held.ids) else []
            out[key] = SavedTokens(key, 0, held.ids.tobytes(), logprobs, held.segments, held.versions)
        self.claimed += len(out)
        return out

    def _drop(self, key: str) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self.tokens -= len(held.ids)

    def _expire(self, now: float) -> None:
        while self._held:
            key, oldest = next(iter(self._held.items()))
            if now - oldest.at <= self.ttl_s and self.tokens <= self.max_tokens:
                return
            self._drop(key)
            self.dropped += 1

    def status(self) -> dict[str, Any]:
        return {"sequences": len(self._held), "tokens": self.tokens, "claimed": self.claimed,
                "dropped": self.dropped}
