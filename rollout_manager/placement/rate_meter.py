"""Each instance's token rate, measured from the manager's own streams, and the batch model a lone
sequence's rate is read through.

The manager relays every chunk, so it measures what each instance delivers without asking SGLang (0.5.23's
``/server_info`` has no rates). Pure: time is an argument, so the daemon and the simulators
(``benchmarks/sim_pool.py``) measure alike.
"""

from __future__ import annotations

import math

__all__ = ["TokenRateMeter", "lone_rate_weight", "per_sequence_rate"]


class TokenRateMeter:
    """Exponentially weighted aggregate token rate of one instance, on a *busy-time* clock.

    Why busy time: the figure the scheduler needs is capacity (tokens/s the instance delivers while
    it has work), not utilisation. Time with nothing in flight says nothing about capacity, so the
    clock stops while idle and the estimate stays frozen instead of decaying to zero between
    batches. Time with work in flight but no tokens (a stall, a slow prefill) is real evidence of a
    slow instance, so the clock runs and the estimate decays toward the truth.

    Maths: ``S`` is the token count decayed by ``exp(-busy_dt / tau)``; for a constant rate ``r``
    after busy time ``T``, ``S = r * tau * (1 - exp(-T / tau))``, so dividing by that factor gives an
    unbiased estimate from the first second on (a plain average while ``T << tau``, an EWMA with time
    constant ``tau`` later). The rate is unknown (None) until ``min_busy_s`` of busy time was seen.

    Call :meth:`set_in_flight` whenever the instance's in-flight count changes and :meth:`observe`
    for every streamed chunk (tokens newly produced, summed over its sequences); observe a
    request's last chunk before lowering the count, so its tokens land in busy time.
    """

    # Chunks observed within this many seconds of the last fold are summed and folded in together (by
    # the next observe past it, set_in_flight, or read by rate()): the fold spreads tokens over the
    # interval anyway, and relaying thousands of chunks a second, one fold each was measurable.
    FOLD_S = 0.01

    def __init__(self, tau_s: float = 5.0, min_busy_s: float = 1.0) -> None:
        if tau_s <= 0 or min_busy_s < 0:
            raise ValueError("tau_s must be > 0 and min_busy_s >= 0")
        self.tau_s = tau_s
        self.min_busy_s = min_busy_s
        self._decayed_tokens = 0.0
        self._busy_s = 0.0
        self._busy = False
        self._last: float | None = None
        self._pending = 0.0  # tokens observed since the last fold, while busy

    @property
    def busy(self) -> bool:
        return self._busy

    def _elapsed_busy(self, now: float) -> float:
        if not self._busy or self._last is None:
            return 0.0
        return max(0.0, now - self._last)

    def _advance(self, now: float) -> None:
        if self._pending:
            self._fold(0.0, now)
            return
        dt = self._elapsed_busy(now)
        if dt > 0:
            self._decayed_tokens *= math.exp(-dt / self.tau_s)
            self._busy_s += dt
        if self._last is None or now > self._last:
            self._last = now

    def _spread(self, tokens: float, dt: float) -> float:
        """What ``tokens`` made evenly over the last ``dt`` busy seconds count for now."""
        return tokens * -math.expm1(-dt / self.tau_s) * self.tau_s / dt if dt > 0 else tokens

    def set_in_flight(self, count: int, now: float) -> None:
        """Start or stop the busy clock: the instance is busy while ``count > 0``. A count that leaves
        it busy (or idle) changes nothing: the clock is read from the last fold whenever needed."""
        busy = count > 0
        if busy != self._busy:
            self._advance(now)
            self._busy = busy

    def observe(self, tokens: float, now: float) -> None:
        """Record ``tokens`` generated (over all its sequences) since the previous call.

        They were made across the busy interval since then, not at ``now``, so they get that
        interval's mean decay; counting them as fresh would bias the rate up by ~dt/(2*tau).
        """
        # Runs for every relayed chunk: mostly a sum (see FOLD_S), else one transcendental call.
        last = self._last
        if self._busy and last is not None and now > last:
            if now - last < self.FOLD_S:
                self._pending += max(0, tokens)
                return
            self._fold(tokens, now)
            return
        if last is None or now > last:
            self._last = now
        self._decayed_tokens += max(0, tokens)

    def _fold(self, tokens: float, now: float) -> None:
        """Fold the pending tokens and ``tokens`` in, spread over the busy time since the last fold."""
        tokens = max(0, tokens) + self._pending
        self._pending = 0.0
        dt = self._elapsed_busy(now)
        if dt > 0:
            self._decayed_tokens = self._decayed_tokens * math.exp(-dt / self.tau_s) + self._spread(tokens, dt)
            self._busy_s += dt
        else:
            self._decayed_tokens += tokens
        if self._last is None or now > self._last:
            self._last = now

    def rate(self, now: float) -> float | None:
        """Tokens/s while busy, or None before ``min_busy_s`` of busy time. Does not mutate."""
        dt = self._elapsed_busy(now)
        busy_s = self._busy_s + dt
        if busy_s <= 0 or busy_s < self.min_busy_s - 1e-9:  # tolerate float clock sums
            return None
        tokens = self._decayed_tokens * math.exp(-dt / self.tau_s) + self._spread(self._pending, dt)
        return tokens / (self.tau_s * -math.expm1(-busy_s / self.tau_s))


# The batch model shared by tail migration, the dispatcher's lone-rate meters and the simulator: an instance running
# ``n`` sequences makes ``lone * n / (1 + (n - 1) / batch_half)`` tokens/s in total, so each of them
# gets ``lone / (1 + (n - 1) / batch_half)``: a lone sequence runs at ``lone``, and at
# ``n = batch_half + 1`` each runs at half that. Aggregate throughput saturates at
# ``lone * batch_half`` (memory-bound decode on a GPU: ``batch_half`` of the order of 100; the CPU
# engine computes each sequence alone, so its aggregate is flat: ``batch_half = 1``).


def per_sequence_rate(lone_rate: float, n: int, batch_half: float) -> float:
    """Tokens/s each of ``n`` sequences gets on an instance whose lone sequence gets ``lone_rate``."""
    return lone_rate / (1.0 + (max(n, 1) - 1) / batch_half)


def lone_rate_weight(n: int, batch_half: float) -> float:
    """Turns tokens a batch of ``n`` made into what a lone sequence would have made in that time.

    Feeding ``tokens * lone_rate_weight(n)`` to a :class:`TokenRateMeter` measures the instance's
    lone-sequence rate whatever its batch was, which is what a migration needs to know about an
    instance that is nearly idle now but was full a moment ago.
    """
    n = max(n, 1)
    return (1.0 + (n - 1) / batch_half) / n
