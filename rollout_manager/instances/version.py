"""The weight version the fleet serves: an instance takes work only at it (remote ones sync first)."""

from __future__ import annotations

from rollout_manager.instances.registry import Instance, Kind


class WeightVersion:
    """The current weight version. Weight sync alone moves it (on ``/update_weight_version``); the
    health monitor reads it to decide whether a new instance serves at once or syncs first."""

    def __init__(self, current: int = 0) -> None:
        self.current = current

    def behind(self, inst: Instance) -> bool:
        """A remote instance below the current version; local ones are the trainer's to update."""
        return inst.kind == Kind.REMOTE and inst.weight_version < self.current
