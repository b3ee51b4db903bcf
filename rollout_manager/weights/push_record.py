"""What one weight push to one instance did: one type for both ways a version arrives (from the
instance's sender, or from a peer that holds it), kept for ``/get_instances_status`` and fed to the
metrics; serialized once, at the HTTP edge (:meth:`WeightPush.to_json`).

Runs in: manager.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class WeightPush:
    instance: str
    endpoint: str
    version: int
    sender: int  # the trainer node that holds the version (a peer's pull names its puller's group)
    group: int
    ip: str
    transport: str
    mode: str  # "full", "delta" or "delta+repair" (a delta whose bad shards were rewritten in full)
    source: str  # "sender:<n>" or "peer:<endpoint>"
    bytes: int  # sent over the link
    full_bytes: int  # the whole version's size
    transfer_s: float
    gbps: float
    verify_s: float
    load_s: float
    apply_s: float | None  # applying a delta (None: none was applied)
    reloaded: int | None  # tensors loaded into SGLang
    total_s: float  # prepare, transfer, verify and load
    at: float  # wall-clock time it finished
    checksums_from: str | None = None  # a peer's pull: "manager" (the trainer's sums) or "peer"
    peer_failed: str | None = None  # the peer that failed before the sender delivered it, and why

    @property
    def from_peer(self) -> bool:
        return self.source.startswith("peer:")

    def to_json(self) -> dict[str, Any]:
        """The status page's entry; the two optional keys only where they say something."""
        out = asdict(self)
        for key in ("checksums_from", "peer_failed"):
            if out[key] is None:
                del out[key]
        return out
