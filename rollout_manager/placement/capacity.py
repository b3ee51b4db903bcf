"""Capacity: how many sequences may run where, what is reserved, and who waits for room.

Admission is bounded here, whatever the policy says: an instance gets at most its own
``max_running_requests`` (what SGLang runs at once; more would only queue inside the engine, where a
failure loses them and its connections pile up) and the whole pool at most ``max_in_flight_total``
(each sequence in flight holds one of the manager's connections and its buffers). Past either bound
requests wait in the queue kept here, first come first served (under makespan longest predicted first).

The counters (``in_flight``, ``waiting``, ``held_by_batches``, ``windowed``) and each instance's ``Load`` are
written by this module's methods only (tests/test_placement_parts.py checks it); everyone else reads them.
The dispatcher decides where a sequence goes and reserves it here.
"""

from __future__ import annotations

from collections.abc import Callable

from rollout_manager.instances.registry import Instance, Registry, State
from rollout_manager.osutil import open_file_limit
from rollout_manager.placement.waiting import Waiter, WaitQueue

# In flight on an instance that reports no max_running_requests (an SGLang older than the field, a
# stand-in engine): SGLang's own default on a mid-sized GPU is of this order.
DEFAULT_INSTANCE_MAX_IN_FLIGHT = 1024
# The most sequences in flight at once when no bound is configured, whatever the open-file limit: each
# costs the manager tens of kB (a connection, its buffers, the sequence), and one event loop relays them.
MAX_IN_FLIGHT_TOTAL_CEILING = 65536


def default_max_in_flight_total(soft_open_files: int | None = None) -> int:
    """The overall bound when none is configured: what the open-file limit leaves for connections to
    instances. Half of it is callers' (api.connections); of the other half a reserve stays for health
    probes, weight agents and logs."""
    soft = open_file_limit()[0] if soft_open_files is None else soft_open_files
    if soft <= 0:  # unlimited or unknown
        return MAX_IN_FLIGHT_TOTAL_CEILING
    return max(min(soft // 2 - min(soft // 8, 1024), MAX_IN_FLIGHT_TOTAL_CEILING), 16)


class Capacity:
    def __init__(self, registry: Registry, *, max_in_flight_per_instance: int = 0, max_in_flight_total: int = 0,
                 longest_first: bool = False, share: tuple[int, int] = (0, 1)) -> None:
        """``max_in_flight_per_instance``: 0 takes each instance's own ``max_running_requests`` (or
        :data:`DEFAULT_INSTANCE_MAX_IN_FLIGHT` where it reports none); N caps every instance at N too.
        ``share``: (i, n), this process is relay i of n (docs/relays.md): it may fill its part of each bound, the
        parts summing to the bound, so the relays together never put more on an instance than one process would.
        ``max_in_flight_total``: 0 takes :func:`default_max_in_flight_total`. ``longest_first``: the queue
        offers the longest predicted request first (the makespan policy)."""
        self.registry = registry
        self.max_in_flight_per_instance = max_in_flight_per_instance
        self.share = share
        self.max_in_flight_total = max_in_flight_total or default_max_in_flight_total()
        self.in_flight = 0  # sequences placed on an instance and not yet released, over every instance
        self.held_by_batches = 0  # requests a batch accepted and holds back until it has room (run_batch)
        self.windowed = 0  # sequences of batched /generate requests started and not yet ended (rollout.window)
        self.waiting = 0  # requests parked in Dispatcher.acquire() because no instance can take them now
        self._queue = WaitQueue(longest_first=longest_first)  # those requests (placement.waiting)

    # ------------------------------------------------------------ bounds
    def bound_of(self, inst: Instance) -> int:
        """The most sequences ``inst`` may have in flight from here (see ``__init__``)."""
        own = inst.engine.max_running_requests
        cap = self.max_in_flight_per_instance
        whole = (cap or DEFAULT_INSTANCE_MAX_IN_FLIGHT) if own is None else min(own, cap) if cap else own
        index, relays = self.share
        if relays == 1:
            return whole
        # The remainder goes to a different relay on each instance, so no relay gets more of every box.
        return whole // relays + ((index + inst.order) % relays < whole % relays)

    def rebound(self, inst: Instance) -> None:
        """``inst`` changed state or reported its engine again: its bound as ``Load.max_in_flight`` shows it."""
        inst.load.max_in_flight = self.bound_of(inst)

    def pool_bound(self) -> int:
        """Sequences the active pool can run at once: the instances' bounds, within the overall one."""
        # the registry's kept active tuple (a batch asks on every turn it starts requests in), not a new list
        active = State.ACTIVE
        return min(sum(self.bound_of(i) for i in self.registry.active() if i.state is active),
                   self.max_in_flight_total)

    def admission_status(self) -> dict[str, int]:
        """The bounds and who waits on them (status page, ``/get_instances_status``)."""
        return {"in_flight": self.in_flight, "max_in_flight_total": self.max_in_flight_total,
                "capacity": self.pool_bound(), "waiting_for_instance": self.waiting,
                "held_by_batches": self.held_by_batches, "requests_waiting": self.waiting + self.held_by_batches}

    def requests_waiting(self) -> int:
        """Requests waiting for a slot: parked in the queue, or held back by their batch until it has room."""
        return self.waiting + self.held_by_batches

    # ------------------------------------------------------------ reservations
    def reserve(self, inst: Instance, tokens: int) -> None:
        """A sequence placed on ``inst`` with a budget of ``tokens``."""
        load = inst.load
        load.in_flight += 1
        load.in_flight_tokens += tokens
        self.in_flight += 1

    def claim(self, inst: Instance, tokens: int, over: int = 0) -> bool:
        """:meth:`reserve` unless ``inst`` is ``over`` past its bound or the pool past the overall one."""
        if inst.load.in_flight >= self.bound_of(inst) + over or self.in_flight >= self.max_in_flight_total + over:
            return False
        self.reserve(inst, tokens)
        return True

    def made(self, inst: Instance, tokens: int, chunk_at: float) -> None:
        """A chunk with ``tokens`` new tokens came from ``inst`` at ``chunk_at``: they are reserved no longer."""
        load = inst.load
        load.last_chunk_at = chunk_at
        if tokens:
            load.in_flight_tokens = max(load.in_flight_tokens - tokens, 0)

    def unreserve(self, inst: Instance, tokens: int) -> None:
        """``tokens`` of what a sequence reserved on ``inst`` will not be made there after all."""
        load = inst.load
        load.in_flight_tokens = max(load.in_flight_tokens - tokens, 0)

    def release(self, inst: Instance, tokens_left: int) -> None:
        """A sequence left ``inst`` (finished or failed) with ``tokens_left`` of its budget unused."""
        load = inst.load
        if load.in_flight > 0:
            self.in_flight = max(self.in_flight - 1, 0)
        load.in_flight = max(load.in_flight - 1, 0)
        load.in_flight_tokens = max(load.in_flight_tokens - tokens_left, 0)

    # ------------------------------------------------------------ requests batches hold back
    def hold(self, count: int) -> None:
        """A batch accepted ``count`` requests it starts as room comes (``rollout.batch``, ``rollout.window``)."""
        self.held_by_batches += count

    def unhold(self, count: int) -> None:
        """``count`` held requests started, or their batch ended before starting them."""
        self.held_by_batches -= count

    def start_windowed(self) -> None:
        """A held request of a start window began (``rollout.window``): it counts in the shared window."""
        self.held_by_batches -= 1
        self.windowed += 1

    def end_windowed(self) -> None:
        self.windowed -= 1

    # ------------------------------------------------------------ the waiting queue
    def park(self, waiter: Waiter) -> None:
        """``waiter`` waits for an instance (``Dispatcher.acquire``)."""
        self._queue.add(waiter)
        self.waiting += 1

    def unpark(self, waiter: Waiter) -> None:
        """``waiter``'s wait is over, placed or not."""
        self.waiting -= 1
        self._queue.leave(waiter)

    def queued(self) -> bool:
        """Whether any request waits in the queue."""
        return bool(self._queue)

    def place(self, try_one: Callable[[Waiter], Instance | None], closed: Callable[[], Exception | None]) -> None:
        """Place queued requests in order until one cannot be placed (``WaitQueue.place``)."""
        self._queue.place(try_one, closed)

    def head(self) -> Waiter | None:
        """The request the queue offers next, if any."""
        return self._queue.head()

    def waiters(self) -> list[Waiter]:
        """Requests parked for an instance, in the order they are offered."""
        return self._queue.waiters()
