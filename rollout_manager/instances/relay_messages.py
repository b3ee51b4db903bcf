"""What a relay and its control process say to each other (``relay_hub`` on one side, ``control_link`` on
the other): typed, so both sides decode exactly what the other encodes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from rollout_manager.instances.mirror import InstanceView


class RelayHello(msgspec.Struct, frozen=True):
    """A relay connecting: who it is and the fleet it last saw."""

    relay: int
    pid: int
    weight_version: int
    instances: list[InstanceView] = []


class RelayLoad(msgspec.Struct, frozen=True):
    """A relay's own figures, read when it reports."""

    in_flight: int = 0  # sequences it runs on instances
    waiting: int = 0  # requests it holds for room
    finished: int = 0  # sequences it finished since it started
    streamed_tokens: int = 0
    cpu_s: float = 0.0  # its process's CPU time since it started
    instances: dict[str, int] = {}  # sequences it runs on each instance (those with any)
    saving: int = 0  # running sequences with tokens saved in the control process (rollout.checkpoints)


class SavedSegment(msgspec.Struct, frozen=True, array_like=True):
    """One segment of a saved sequence (``rollout.sequence.Segment``'s identity and span)."""

    instance: str
    endpoint: str
    weight_version: str | None
    start: int
    end: int


class SavedTokens(msgspec.Struct, frozen=True):
    """A running sequence's tokens from ``start`` on, saved outside its relay (``rollout.checkpoints``): the
    control process appends them to what it holds under ``key``; ``segments`` and ``versions`` are whole."""

    key: str
    start: int
    ids: bytes  # the token ids as 4-byte unsigned ints in this machine's order (base64 in JSON): no int objects
    logprobs: list[Any] = []  # the engine's entries for ``ids`` (empty when the caller asked for none)

    @property
    def count(self) -> int:
        """How many token ids ``ids`` holds."""
        return len(self.ids) // 4
    segments: list[SavedSegment] = []
    versions: list[int] = []


class DistrustedItem(msgspec.Struct, frozen=True, array_like=True):
    """A delivered answer's segment listed as distrusted, before it is numbered (``rollout.provisional``): a relay
    reports its own, and the control process lists them in the one ``/distrusted_samples`` the trainer reads."""

    request_id: str
    instance: str
    endpoint: str
    weight_version: str | None
    start: int
    end: int
    first: int
    reason: str
    at: float


class Marked(msgspec.Struct, frozen=True):
    """A relay marked what ``instance`` made so far for its trust probe number ``sent``: the probe may go."""

    relay: int
    instance: str
    sent: int


class RelayReport(msgspec.Struct, frozen=True):
    """A relay's periodic report: failures and recoveries it saw per instance id, its own figures, and the
    tokens its running sequences made since the last report (``saved``; ``done``: keys finished or given up)."""

    relay: int
    pid: int
    load: RelayLoad = RelayLoad()
    failures: list[tuple[str, str]] = []  # (instance id, reason), in the order seen
    successes: list[str] = []  # instance ids that answered after failing
    saved: list[SavedTokens] = []
    done: list[str] = []
    distrusted: list[DistrustedItem] = []  # listed since the last report
    lengths: list[tuple[int, int]] = []  # (prompt key, length) of the sequences it finished since the last report


@dataclass
class Outgoing:
    """What a relay's next report carries of its saved sequences, and what the relay does with the outcome:
    ``arrived(missing)`` once the control process has it (``missing``: keys it holds nothing of, to send whole
    next time), ``lost()`` when it did not arrive (nothing moved on; the done keys are said again). ``more``: tokens
    to save were left for the next report (one carries a bounded number), which goes at once."""

    saved: list[SavedTokens]
    done: list[str]
    arrived: Callable[[list[str]], None]
    lost: Callable[[], None]
    more: bool = False


class Claim(msgspec.Struct, frozen=True):
    """A relay asking for the saved tokens of the sequences a caller sent again."""

    relay: int
    keys: list[str]
