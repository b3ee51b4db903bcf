"""One box's weight versions beyond the one it serves (``Instance.weight_version``): what it is receiving,
what it holds staged, what it is activating, and how long it stopped generating for each version."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KEEP_VERSIONS = 8  # paused seconds are kept for this many recent versions


@dataclass
class BoxVersions:
    staging: int | None = None  # a push of this version is on its way into the box's receiver buffer
    staged: int | None = None  # verified in the receiver's buffer, beside the served version
    activating: int | None = None  # generation paused, this version loading
    # Seconds the box generated nothing because of each version's update: the activation pause (staged),
    # or the whole time out of service (drain: drain, transfer, verify and load).
    paused_s: dict[int, float] = field(default_factory=dict)

    def record_pause(self, version: int, seconds: float) -> None:
        self.paused_s[version] = round(self.paused_s.get(version, 0.0) + seconds, 6)
        for old in sorted(self.paused_s)[:-KEEP_VERSIONS]:
            del self.paused_s[old]

    def to_dict(self, active: int) -> dict[str, Any]:
        return {"active": active, "staging": self.staging, "staged": self.staged, "activating": self.activating,
                "paused_s": {str(v): s for v, s in sorted(self.paused_s.items())}}
