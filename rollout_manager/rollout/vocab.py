"""Token ids a caller may send: below the smallest vocabulary the pool serves.

Real SGLang (0.5.23) does not refuse an input id at or past its model's vocabulary: its scheduler
crashes on it, and the box with it. So a ``/generate`` (single, batched, NDJSON, fast lane) is refused
with 400 at the door when its ``input_ids`` hold such an id, before anything is placed. The bound is the
smallest vocabulary size known: each registered instance's (``Instance.engine.vocab_size``) and the configured
``engine_vocab_size``; with none known nothing is refused here.
"""

from __future__ import annotations

from typing import Any

from rollout_manager.errors import InvalidField
from rollout_manager.instances.registry import Event, Instance, Registry
from rollout_manager.instances.served_ids import below


class VocabBound:
    """The smallest known vocabulary size, recomputed only after the registry changed.

    An instance's size is set when it registers or first becomes ready; both are followed by a registry
    event, which marks the bound stale, so a request costs a scan of its ids, not of the pool.
    """

    def __init__(self, registry: Registry, configured: int = 0) -> None:
        self.registry = registry
        self.configured = configured if configured > 0 else None
        self._bound: int | None = None
        self._stale = True
        registry.listeners.append(self._changed)

    def _changed(self, inst: Instance, event: Event) -> None:
        self._stale = True

    def bound(self) -> int | None:
        """Every input id must be below this (None: no vocabulary known)."""
        if self._stale:
            sizes = [i.engine.vocab_size for i in self.registry if i.engine.vocab_size]
            if self.configured is not None:
                sizes.append(self.configured)
            self._bound = min(sizes, default=None)
            self._stale = False
        return self._bound

    def check(self, input_ids: Any, field: str = "input_ids") -> None:
        """Raise :class:`InvalidField` (400, naming ``field`` and the bound) when validated ``input_ids``
        (one sequence, or a batch's list of them) hold an id at or past :meth:`bound`."""
        bound = self.bound()
        if bound is None or not input_ids:
            return
        batched = isinstance(input_ids[0], list)
        for n, ids in enumerate(input_ids if batched else [input_ids]):
            if ids and not below(ids, bound):
                at = next(k for k, t in enumerate(ids) if t >= bound)
                where = f"{field}[{n}][{at}]" if batched else f"{field}[{at}]"
                raise InvalidField(
                    f"field '{where}': token id {ids[at]} is outside the vocabulary: input_ids must be below "
                    f"{bound}, the smallest vocabulary size of the registered instances (and engine_vocab_size)")
