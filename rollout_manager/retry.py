"""One retry loop, with exponential backoff and jitter, for blocking and for async calls.

Many clients retrying the same manager together (every rollout box of a job registering after the
manager restarted, every trainer rank reconnecting) would otherwise retry in lockstep: each delay is
drawn at random from its upper ``jitter`` fraction, so they spread out. Standard library only (the
rollout box's launcher uses it before anything heavy is imported).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Delays ``first_s``, ``first_s * factor``, ... up to ``max_s``, each cut by up to ``jitter`` of
    itself; at most ``attempts`` tries (None: no count), none after ``deadline_s`` seconds (None: no
    deadline; the last sleep is cut so that the last try is at the deadline)."""

    first_s: float
    max_s: float
    factor: float = 2.0
    jitter: float = 0.2
    attempts: int | None = None
    deadline_s: float | None = None

    def delay(self, attempt: int) -> float:
        """The sleep after try number ``attempt`` (1-based), jitter drawn."""
        base = min(self.first_s * self.factor ** (attempt - 1), self.max_s)
        return base * (1.0 - self.jitter * random.random())


@dataclass
class _Tries:
    policy: Backoff
    started: float
    attempt: int = 0

    def next_sleep(self) -> float | None:
        """How long to sleep before the next try, or None when there is none."""
        p = self.policy
        if p.attempts is not None and self.attempt >= p.attempts:
            return None
        delay = p.delay(self.attempt)
        if p.deadline_s is not None:
            left = self.started + p.deadline_s - time.monotonic()
            if left <= 0:
                return None
            delay = min(delay, left)
        return delay


# Told (attempt, sleep_s, outcome: the result or the exception) before each sleep.
OnRetry = Callable[[int, float, object], None]


def retry(call: Callable[[], T], policy: Backoff, *, retry_on: tuple[type[BaseException], ...] = (),
          again: Callable[[T], bool] | None = None, on_retry: OnRetry | None = None) -> T:
    """``call()`` until it returns a result ``again`` does not want retried; an exception in ``retry_on``
    is retried too. When the tries run out, the last result is returned or the last exception raised.
    ``on_retry(attempt, sleep_s, outcome)`` is told before each sleep (to log it)."""
    tries = _Tries(policy, time.monotonic())
    while True:
        tries.attempt += 1
        try:
            result = call()
        except retry_on as exc:
            sleep = tries.next_sleep()
            if sleep is None:
                raise
            outcome: T | BaseException = exc
        else:
            if again is None or not again(result):
                return result
            sleep = tries.next_sleep()
            if sleep is None:
                return result
            outcome = result
        if on_retry is not None:
            on_retry(tries.attempt, sleep, outcome)
        time.sleep(sleep)


async def retry_async(call: Callable[[], Awaitable[T]], policy: Backoff, *,
                      retry_on: tuple[type[BaseException], ...] = (), again: Callable[[T], bool] | None = None,
                      on_retry: OnRetry | None = None) -> T:
    """:func:`retry` for a coroutine function; sleeps with ``asyncio.sleep``."""
    tries = _Tries(policy, time.monotonic())
    while True:
        tries.attempt += 1
        try:
            result = await call()
        except retry_on as exc:
            sleep = tries.next_sleep()
            if sleep is None:
                raise
            outcome: T | BaseException = exc
        else:
            if again is None or not again(result):
                return result
            sleep = tries.next_sleep()
            if sleep is None:
                return result
            outcome = result
        if on_retry is not None:
            on_retry(tries.attempt, sleep, outcome)
        await asyncio.sleep(sleep)
