"""The bounds of a ``/generate`` call to an instance (:class:`~.sglang.relay.CallBounds`), one per instance.

Built per attempt they cost a frozen object and a closure for as long as each sequence streams; they
depend only on the instance and the generation settings, so each instance's are built once.
"""

from __future__ import annotations

from rollout_manager.instances.registry import Instance
from rollout_manager.rollout.generation_settings import GenerationSettings
from rollout_manager.sglang.client import CallBounds, SGLangClient
from rollout_manager.sglang.deadline import BoxBytes


class CallBoundsCache:
    """One :class:`CallBounds` per (instance, settings); a settings object replaced (tests do) or an
    instance registered again under its id gets new ones."""

    def __init__(self, client: SGLangClient) -> None:
        self.client = client
        self._by_id: dict[str, tuple[Instance, GenerationSettings, CallBounds]] = {}

    def of(self, inst: Instance, s: GenerationSettings, instances: int) -> CallBounds:
        """``inst``'s bounds under ``s``; ``instances``: how many are registered (entries of instances
        gone since are dropped once they outnumber them)."""
        cached = self._by_id.get(inst.id)
        if cached is not None and cached[0] is inst and cached[1] is s:
            return cached[2]
        load = inst.load
        bounds = CallBounds(s.connect_timeout_s, s.stall_timeout_s, s.first_byte_timeout_s, s.max_frame_bytes,
                            activity=lambda: load.last_chunk_at, limits=self.client.limits,
                            headers=self.client.generate_headers, box_bytes=BoxBytes(s.max_instance_buffer_bytes))
        if len(self._by_id) > 4 * (instances + 64):
            self._by_id.clear()
        self._by_id[inst.id] = (inst, s, bounds)
        return bounds
