"""rollout_manager.retry: the one retry loop (backoff with jitter, a try count, a deadline)."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollout_manager.retry import Backoff, retry, retry_async


def test_delays_grow_to_the_cap_and_jitter_spreads_them_below_it() -> None:
    b = Backoff(0.1, 0.4, jitter=0.5)
    drawn = [b.delay(n) for n in range(1, 6) for _ in range(200)]
    for n, cap in enumerate([0.1, 0.2, 0.4, 0.4, 0.4]):
        mine = drawn[n * 200:(n + 1) * 200]
        assert all(cap * 0.5 <= d <= cap for d in mine)
        assert len(set(mine)) > 100  # not lockstep
    assert Backoff(0.1, 0.4, jitter=0.0).delay(3) == pytest.approx(0.4)


def test_exceptions_are_retried_up_to_the_count_then_raised() -> None:
    calls, told = [], []

    def flaky() -> int:
        calls.append(1)
        raise ConnectionError(f"try {len(calls)}")

    with pytest.raises(ConnectionError, match="try 3"):
        retry(flaky, Backoff(0.001, 0.001, attempts=3), retry_on=(ConnectionError,),
              on_retry=lambda n, s, e: told.append((n, str(e))))
    assert told == [(1, "try 1"), (2, "try 2")]
    with pytest.raises(ValueError):  # not in retry_on: at once
        retry(lambda: int("x"), Backoff(0.001, 0.001, attempts=3), retry_on=(ConnectionError,))


def test_unwanted_results_are_retried_until_the_deadline_then_returned() -> None:
    answers = iter([503, 503, 200])
    assert retry(lambda: next(answers), Backoff(0.001, 0.001), again=lambda s: s >= 500) == 200
    t0 = time.monotonic()
    assert retry(lambda: 503, Backoff(0.01, 0.05, deadline_s=0.2), again=lambda s: s >= 500) == 503
    assert 0.2 <= time.monotonic() - t0 < 2.0  # the last try is at the deadline, not past it
    assert retry(lambda: 503, Backoff(1.0, 1.0, deadline_s=0.0), again=lambda s: s >= 500) == 503  # one try


def test_async_calls_share_the_loop() -> None:
    answers = iter([None, None, "up"])

    async def probe() -> str | None:
        return next(answers)

    assert asyncio.run(retry_async(probe, Backoff(0.001, 0.001), again=lambda h: h is None)) == "up"
