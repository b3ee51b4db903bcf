"""Report each step's timings to the manager (``POST /update_metrics``), which adapts its local budget, and
the step's per-box log-prob mismatch (``POST /update_mismatch``, figures from :mod:`trainer_plugin.mismatch`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from .client import ManagerClient


async def post_step_metrics(client: ManagerClient, *, step_time_s: float, trainer_bubble_time_s: float,
                            step_throughput: float) -> dict[str, Any]:
    """Post the step's figures; returns the manager's answer (log it: it has the new local budget,
    ``remote_idle_s`` and the generation counters)."""
    return await client.update_metrics(step_time_s=step_time_s, trainer_bubble_time_s=trainer_bubble_time_s,
                                       step_throughput=step_throughput)


def post_step_metrics_sync(manager_url: str, **figures: float) -> dict[str, Any]:
    """The same from synchronous code (see :func:`call_sync`)."""
    return call_sync(manager_url, lambda client: post_step_metrics(client, **figures))


def post_mismatch_sync(manager_url: str, body: dict[str, Any]) -> dict[str, Any]:
    """``POST /update_mismatch`` from synchronous code (see :func:`call_sync`)."""
    return call_sync(manager_url, lambda client: client.update_mismatch(body))


def call_sync(manager_url: str, call: Callable[[ManagerClient], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """One manager call from synchronous code (opens and closes its own connection); from a thread whose
    event loop is running (where ``asyncio.run`` is refused) it runs on a short-lived thread."""

    async def run() -> dict[str, Any]:
        async with ManagerClient(manager_url) as client:
            return await call(client)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run()).result()


def as_log_metrics(answer: dict[str, Any], prefix: str = "rollout_manager/") -> dict[str, float]:
    """Flatten the answer into ``{name: number}`` for the trainer's logger."""
    out: dict[str, float] = {}
    for key, value in answer.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[f"{prefix}{key}/{sub}"] = float(v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = float(value)
    return out


@dataclass
class StepTimer:
    """Measures a step and the trainer's bubble (time spent waiting for rollouts).

    ``timer.start_step()``; wrap each wait for generation in ``with timer.waiting(): ...``;
    ``figures = timer.end_step(samples)`` -> the three numbers ``/update_metrics`` takes
    (throughput = samples per second of step time).
    """

    _step_started: float | None = None
    _bubble: float = 0.0
    _wait_started: float | None = None
    history: list[dict[str, float]] = field(default_factory=list)

    @property
    def in_step(self) -> bool:
        return self._step_started is not None

    def start_step(self) -> None:
        self._step_started = time.monotonic()
        self._bubble = 0.0
        self._wait_started = None

    def begin_wait(self) -> None:
        """The trainer starts waiting for rollouts (for waits that do not fit a ``with`` block)."""
        self._wait_started = time.monotonic()

    def end_wait(self) -> None:
        if self._wait_started is not None:
            self._bubble += time.monotonic() - self._wait_started
            self._wait_started = None

    def waiting(self) -> _Wait:
        return _Wait(self)

    def end_step(self, samples: int) -> dict[str, float]:
        if self._step_started is None:
            raise RuntimeError("end_step() without start_step()")
        elapsed = time.monotonic() - self._step_started
        figures = {"step_time_s": elapsed, "trainer_bubble_time_s": min(self._bubble, elapsed),
                   "step_throughput": samples / elapsed if elapsed > 0 else 0.0}
        self.history.append(figures)
        self._step_started = None
        return figures


class _Wait:
    def __init__(self, timer: StepTimer):
        self.timer = timer

    def __enter__(self) -> None:
        self.timer.begin_wait()

    def __exit__(self, *exc: Any) -> None:
        self.timer.end_wait()
