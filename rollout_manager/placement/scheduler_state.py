"""What the scheduler learned, in a file, so that a restarted daemon does not start from nothing.

The prompts of an RL job come back every epoch, and their earlier lengths are what lets placement put the
long ones first (``placement.lengths``); the boxes' speed curves (``placement.box_speed``) are what tells it
where they run fastest. A manager restarted with the trainer (a resume from a checkpoint, an upgrade, a
crash) would otherwise meet every prompt as new and every box as unmeasured. Both are needed together: in
``benchmarks/sim_tail.py``, a restart that kept the lengths but not the speeds placed the known-long
samples blind to the boxes' speeds and made the next step longer than a restart that kept nothing.

The file is a :class:`SchedulerState` in msgpack: the length model's history and each measured box's curve
under its endpoint (its instance id is new after a restart; a box that registers again at that address
starts from its curve, and its own streams outweigh it within seconds). It is read once at start and
written every ``interval_s`` when it changed since the last write, and at shutdown; a write goes
to a temporary file beside it, flushed to disk, then renamed over it, so a crash mid-write leaves the last
good file. A missing file is an empty start; an unreadable one, or one whose prompt keys come from another
Python version, is logged, shown in the status and replaced by the next write. Nothing here stops the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from rollout_manager.placement.box_speed import BoxCurve
from rollout_manager.placement.lengths import LengthHistory, LengthModel

log = logging.getLogger("rollout_manager.placement.scheduler_state")

__all__ = ["SchedulerState", "StateFile", "StateStatus"]


class SchedulerState(msgspec.Struct, frozen=True):
    """The file's contents: the length model's history (None where lengths were not predicted) and the
    measured boxes' step curves."""

    lengths: LengthHistory | None
    boxes: list[BoxCurve]


class StateStatus(msgspec.Struct, frozen=True):
    """``/get_instances_status``'s ``scheduler_state``: the file, what the start read from it, the last write
    (wall-clock time, prompts and boxes written), and the last read's or write's error (None: it worked)."""

    path: str
    restored_prompts: int
    restored_boxes: int
    saved_at: float | None
    saved_prompts: int
    saved_boxes: int
    error: str | None


class StateFile:
    """Keeps the scheduler's learned state in ``path``: :meth:`load` once, :meth:`start` the periodic writes,
    :meth:`close` at shutdown (a last write). ``curves`` gives the measured boxes' curves now, ``remember``
    takes those read at start (the dispatcher's ``speed_curves`` and ``remember_speeds``)."""

    def __init__(self, path: str | os.PathLike[str], lengths: LengthModel | None,
                 curves: Callable[[], list[BoxCurve]], remember: Callable[[list[BoxCurve]], None],
                 interval_s: float = 60.0) -> None:
        self.path = Path(path)
        self.lengths = lengths
        self.curves = curves
        self.remember = remember
        self.interval_s = interval_s
        self.restored_prompts = self.restored_boxes = 0
        self.saved_at: float | None = None
        self.saved_prompts = self.saved_boxes = 0
        self.error: str | None = None
        self._written: bytes | None = None  # what the file holds (as read or last written)
        self._task: asyncio.Task[None] | None = None

    def load(self) -> None:
        """Restore the length model and remember the boxes' curves from the file (a missing or unusable
        file: nothing restored)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            log.info("scheduler state: %s does not exist yet; starting without one", self.path)
            return
        except OSError as exc:
            self._unusable(f"cannot be read: {exc.strerror or exc}")
            return
        try:
            state = msgspec.msgpack.decode(data, type=SchedulerState)
            prompts = self.lengths.restore(state.lengths) if self.lengths and state.lengths else 0
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            self._unusable(f"is not a scheduler state this daemon can use: {exc}")
            return
        self.remember(state.boxes)
        self.restored_prompts, self.restored_boxes = prompts, len(state.boxes)
        self._written = data
        log.info("scheduler state: %d prompt(s) and %d box curve(s) restored from %s", prompts,
                 len(state.boxes), self.path)

    def _unusable(self, why: str) -> None:
        self.error = f"{self.path} {why}"
        log.warning("scheduler state: %s; starting without it (the next write replaces it)", self.error)

    def start(self) -> None:
        """Write every ``interval_s`` from now on (inside the running event loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._every_interval(), name="scheduler-state")

    async def _every_interval(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.save()

    async def save(self) -> bool:
        """Write the state if it differs from what the file holds; whether it was written. It is taken on
        the event loop (it changes there) and written in a thread."""
        state = SchedulerState(self.lengths.export() if self.lengths else None, self.curves())
        data = msgspec.msgpack.encode(state)
        if data == self._written or (self._written is None and not state.boxes
                                     and not (state.lengths and state.lengths.finished)):
            return False
        try:
            await asyncio.to_thread(write_atomically, self.path, data)
        except OSError as exc:
            self.error = f"{self.path} cannot be written: {exc.strerror or exc}"
            log.warning("scheduler state: %s", self.error)
            return False
        self._written = data
        self.saved_at, self.error = time.time(), None
        self.saved_prompts = len(state.lengths.prompts) if state.lengths else 0
        self.saved_boxes = len(state.boxes)
        return True

    async def close(self) -> None:
        """Stop the periodic writes and write once more."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.save()

    def status(self) -> StateStatus:
        return StateStatus(str(self.path), self.restored_prompts, self.restored_boxes, self.saved_at,
                           self.saved_prompts, self.saved_boxes, self.error)


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` into ``path`` through a temporary file in the same directory, renamed over it once on disk."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
