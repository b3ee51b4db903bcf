"""The length model's history in a file, so that a restarted daemon knows the prompts' lengths.

The prompts of an RL job come back every epoch, and their earlier lengths are what lets placement put the
long ones first (``rollout.lengths``); a manager restarted with the trainer (resume from a checkpoint, an
upgrade, a crash) would otherwise meet every prompt as new and schedule like a first epoch. The file is
the model's :class:`~rollout_manager.rollout.lengths.LengthHistory` in msgpack, read once at start and
written every ``interval_s`` when something finished since the last write, and at shutdown. A write goes
to a temporary file beside it, flushed to disk, then renamed over it, so a crash mid-write leaves the last
good file. A missing file is an empty start; an unreadable one, or one from another Python version (its
prompt keys differ), is logged and replaced by the next write. Nothing here ever stops the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path

import msgspec

from rollout_manager.rollout.lengths import LengthHistory, LengthModel

log = logging.getLogger("rollout_manager.rollout.length_store")

__all__ = ["LengthStore", "StoreStatus"]


class StoreStatus(msgspec.Struct, frozen=True):
    """``/get_instances_status``'s ``lengths.history_file``: the file, what the start read from it, and the
    last write (wall-clock time, prompts written) or the last error."""

    path: str
    restored_prompts: int
    saved_at: float | None
    saved_prompts: int
    error: str | None


class LengthStore:
    """Keeps ``model``'s history in ``path``: :meth:`load` once, :meth:`start` the periodic writes,
    :meth:`close` at shutdown (a last write)."""

    def __init__(self, path: str | os.PathLike[str], model: LengthModel, interval_s: float = 60.0) -> None:
        self.path = Path(path)
        self.model = model
        self.interval_s = interval_s
        self.restored = 0
        self.saved_at: float | None = None
        self.saved_prompts = 0
        self.error: str | None = None
        self._saved_finished: int | None = None  # the model's finished count at the last write
        self._task: asyncio.Task[None] | None = None
        self._decoder = msgspec.msgpack.Decoder(LengthHistory)

    def load(self) -> int:
        """Restore the model from the file; the prompts restored (0 for a missing or unusable file)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            log.info("length history: %s does not exist yet; starting without one", self.path)
            return 0
        except OSError as exc:
            return self._unusable(f"cannot be read: {exc.strerror or exc}")
        try:
            self.restored = self.model.restore(self._decoder.decode(data))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            return self._unusable(f"is not a length history this daemon can use: {exc}")
        self._saved_finished = self.model.finished
        log.info("length history: %d prompt(s) restored from %s", self.restored, self.path)
        return self.restored

    def _unusable(self, why: str) -> int:
        self.error = f"{self.path} {why}"
        log.warning("length history: %s; starting without it (the next write replaces it)", self.error)
        return 0

    def start(self) -> None:
        """Write every ``interval_s`` from now on (inside the running event loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._every_interval(), name="length-store")

    async def _every_interval(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.save()

    async def save(self) -> bool:
        """Write the history if a sequence finished since the last write; whether it was written. The
        model is read on the event loop (it changes there); the file is written in a thread."""
        if self.model.finished == self._saved_finished:
            return False
        history = self.model.export()
        data = msgspec.msgpack.encode(history)
        try:
            await asyncio.to_thread(write_atomically, self.path, data)
        except OSError as exc:
            if self.error is None or "cannot be written" not in self.error:
                log.warning("length history: %s cannot be written: %s", self.path, exc.strerror or exc)
            self.error = f"{self.path} cannot be written: {exc.strerror or exc}"
            return False
        self._saved_finished = history.finished
        self.saved_at, self.saved_prompts, self.error = time.time(), len(history.prompts), None
        return True

    async def close(self) -> None:
        """Stop the periodic writes and write once more."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.save()

    def status(self) -> StoreStatus:
        return StoreStatus(str(self.path), self.restored, self.saved_at, self.saved_prompts, self.error)


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
