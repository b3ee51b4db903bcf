"""A relay carrying out, on its own sequences, what the control process's trust verdicts do to one process's
(docs/relays.md, docs/reliability.md).

The control process probes the boxes and quarantines them; the sequences and the delivered answers are the
relays'. From the fleet stream (``mirror.TrustView`` in each instance's view) a relay:

- marks what a box made so far in its sequences when a probe of it is announced, and tells the control process,
  which sends the probe only then (or after a bounded wait): a pass vouches for exactly that, as in one process;
- vouches for the marked tokens when the probe passed;
- when the box is quarantined: cuts its running sequences back to their last vouched token and moves them on,
  and lists its delivered unvouched answers as distrusted (reported to the control process, which lists them in
  the one ``/distrusted_samples`` the trainer reads); when its tokens are trusted again, stops.
"""

from __future__ import annotations

from collections.abc import Callable

from rollout_manager.instances.mirror import NO_TRUST, InstanceView
from rollout_manager.instances.registry import Event, Instance, Registry, State
from rollout_manager.instances.relay_messages import DistrustedItem
from rollout_manager.rollout.migration import Migrator

Marked = Callable[[str, int], None]  # (instance id, probe number): tell the control process


class TrustFollower:
    def __init__(self, registry: Registry, migrator: Migrator, tell_marked: Marked) -> None:
        self.migrator = migrator
        self.tell_marked = tell_marked
        self._marks: dict[str, tuple[int, Callable[[], int]]] = {}  # instance -> (probe number, its mark)
        self._reported = 0  # distrusted samples numbered up to here were reported
        registry.listeners.append(self._on_event)

    def _on_event(self, inst: Instance, event: Event) -> None:
        if event.new == State.DEAD:
            self._marks.pop(inst.id, None)
            self.migrator.provisional.forget(inst.id)

    def on_view(self, inst: Instance, before: InstanceView | None, view: InstanceView) -> None:
        """``inst``'s view changed (``mirror.follow``): act on what its trust part says that is new."""
        old = NO_TRUST if before is None else before.trust
        new = view.trust
        provisional = self.migrator.provisional
        if new.passed > old.passed:
            mark = self._marks.get(inst.id)
            if mark is not None and mark[0] == new.passed:
                del self._marks[inst.id]
                mark[1]()
            if new.distrusting is None:
                provisional.trust_again(inst.id)
        if new.sent > old.sent:
            self._marks[inst.id] = (new.sent, self.migrator.mark(inst, new.version))
            self.tell_marked(inst.id, new.sent)
        newly_quarantined = view.quarantined is not None and (before is None or before.quarantined is None)
        if newly_quarantined:
            self.migrator.evict(inst, f"quarantined: {view.quarantined}", True)
        if new.distrusting is not None and (new.distrusting != old.distrusting or newly_quarantined):
            provisional.distrust(inst.id, new.distrusting, quarantined=newly_quarantined)
        elif new.distrusting is None and old.distrusting is not None:
            provisional.trust_again(inst.id)

    def distrusted(self) -> tuple[list[DistrustedItem], Callable[[], None]]:
        """The distrusted samples listed here and not reported yet, and what to call once the report arrived."""
        provisional = self.migrator.provisional
        upto = provisional.numbered

        def arrived() -> None:
            self._reported = max(self._reported, upto)

        return provisional.listed_after(self._reported), arrived
