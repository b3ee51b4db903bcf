"""One box's weight versions beyond the one it serves (``Instance.weight_version``): what it is receiving,
what it holds staged, what it is activating, and how long it stopped generating for each version."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KEEP_VERSIONS = 32  # paused seconds are kept for this many recent versions


@dataclass
class BoxVersions:
    staging: int | None = None  # a push of this version is on its way into the box's receiver buffer
    staged: int | None = None  # verified in the receiver's buffer, beside the served version
    activating: int | None = None  # generation paused, this version loading
    # While activating, ``Instance.weight_version`` already names the version being loaded (chunks carrying it
    # arrive as soon as generation continues, before the activation's answer); this is the one served until then.
    serving_before: int | None = None
    # Seconds the box generated nothing because of each version's update: the activation pause (staged),
    # or the whole time out of service (drain: drain, transfer, verify and load).
    paused_s: dict[int, float] = field(default_factory=dict)

    def record_pause(self, version: int, seconds: float) -> None:
        self.paused_s[version] = round(self.paused_s.get(version, 0.0) + seconds, 6)
        for old in sorted(self.paused_s)[:-KEEP_VERSIONS]:
            del self.paused_s[old]

    def serving(self, weight_version: int) -> int:
        """The version the box serves now, given ``Instance.weight_version``."""
        return self.serving_before if self.activating is not None and self.serving_before is not None \
            else weight_version

    def to_dict(self, weight_version: int) -> dict[str, Any]:
        return {"active": self.serving(weight_version), "staging": self.staging, "staged": self.staged,
                "activating": self.activating, "paused_s": {str(v): s for v, s in sorted(self.paused_s.items())}}
