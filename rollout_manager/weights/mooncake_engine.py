"""A thin wrapper around Mooncake's ``TransferEngine`` in P2P-handshake mode (no metadata server).

Runs in: box, trainer.

``mooncake`` is imported only when an engine starts, so this package imports without it.

Facts about mooncake-transfer-engine 0.3.13 that shape this wrapper (read from its source and
measured here):

- ``initialize(host, "P2PHANDSHAKE", protocol, device)`` auto-discovers transports: it installs RDMA
  whenever an RDMA NIC is present, whatever ``protocol`` says, unless ``MC_FORCE_TCP`` is *set* (any
  value, "0" included). So ``protocol="tcp"`` sets ``MC_FORCE_TCP=1`` for the duration of start-up and
  ``protocol="rdma"`` clears it, for the duration of start-up only (it is read there and nowhere else),
  so TCP and RDMA engines can live in one process.
- Other ``MC_*`` knobs are read at various times, some lazily at the first transfer
  (``MC_TCP_SLICE_SIZE`` is a process-wide static read once; ``MC_TCP_PROTO`` is read per call), so
  ``env`` is written into the process environment for good: it is process-wide, last writer wins.
- The synchronous calls (``transfer_sync_write``, ``batch_transfer_sync_write``,
  ``get_batch_transfer_status``) busy-poll the completion in the calling thread: one core spins for
  the whole transfer. :meth:`MooncakeEngine.write_many` therefore submits with
  ``transfer_submit_write`` and polls ``transfer_check_status`` with short sleeps, which measured
  faster on a 2-core box and leaves the CPU to the engine's own I/O thread.
- Each engine's TCP transport runs one asio I/O thread (send and receive), moving 64 KiB per step,
  with up to ``MC_TCP_LANES_PER_PEER`` (default 4) connections per peer. Several engines in one
  process give several I/O threads.
- Writing to a peer address outside its registered memory fails at once with -1.
- Its TCP transport drops a connection that made no progress for 30 s, failing its transfers (-1;
  its log: "no transfer progress within 30s; dropping connection"), e.g. to a receiver stopped with
  SIGSTOP. RDMA was not measured here.
  A caller's own deadline (``write_many(..., timeout_s=)``) can be shorter; the transfers it gives up
  on are still Mooncake's, so a reaper thread polls them until they end, which frees their batch ids,
  and memory is unregistered only once they did (:data:`ORPHAN_SETTLE_S` at most).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from rollout_manager.weights.parallel import run_in_threads

P2P_HANDSHAKE = "P2PHANDSHAKE"

# Knobs worth knowing (passed through ``env``); see the module docstring.
KNOWN_ENV_KNOBS = (
    "MC_FORCE_TCP",                  # presence forces the TCP transport even with RDMA NICs
    "MC_TCP_LANES_PER_PEER",         # TCP connections per peer (default 4, max 16)
    "MC_TCP_SLICE_SIZE",             # bytes per TCP read/write step (default 64 KiB)
    "MC_TCP_ENABLE_CONNECTION_POOL",
    "MC_TRANSFER_TIMEOUT",           # seconds (min 5) before a sync transfer gives up, plus 1 s/GiB
    "MC_HANDSHAKE_CONNECT_TIMEOUT",
    "MC_TE_FILTERS",
    "MC_TCP_BIND_ADDRESS",
    "MC_RDMA_BIND_ADDRESS",
    "MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT",
    "MC_LOG_LEVEL",                  # e.g. ERROR: quiet the INFO/WARNING glog chatter
)

_env_lock = threading.Lock()
# How long unregistering memory (or closing) waits for transfers a deadline gave up on to end: past
# Mooncake's own 30 s no-progress cut on TCP, with room to spare.
ORPHAN_SETTLE_S = 60.0
_REAP_INTERVAL_S = 0.05

log = logging.getLogger("rollout_manager.weights.mooncake")

# Mooncake logs through glog, straight to fd 2 and before glog is initialised, so neither Python's
# logging nor GLOG_minloglevel reaches it. MC_LOG_LEVEL=ERROR (unless the user chose a level) drops its
# INFO/WARNING lines; the rest, written while an engine starts (a harmless "Local segment descriptor not
# found" among them), is caught and passed to our log at debug level, so a terminal shows only our lines.
_GLOG_LINE = re.compile(r"^([IWEF]\d{4} |WARNING: Logging before InitGoogleLogging)")


def _quiet_native_logging() -> None:
    if not any(k in os.environ for k in ("MC_LOG_LEVEL", "GLOG_minloglevel", "GLOG_v")):
        os.environ["MC_LOG_LEVEL"] = "ERROR"


@contextlib.contextmanager
def _native_stderr_to_log() -> Iterator[None]:
    """Catch what native code writes to fd 2 during the block; glog lines go to our log at debug,
    anything else (our own lines from other threads) back to stderr."""
    with tempfile.TemporaryFile() as capture:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            for line in capture.read().decode(errors="replace").splitlines():
                if _GLOG_LINE.match(line):
                    log.debug("mooncake: %s", line)
                elif line:
                    print(line, file=sys.stderr)


class TransferError(RuntimeError):
    """A Mooncake call returned a failure code."""

    def __init__(self, op: str, code: int, target: str | None = None, detail: str = ""):
        self.op = op
        self.code = code
        self.target = target
        msg = f"mooncake {op} failed with code {code}"
        if target:
            msg += f" (target {target})"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)


@contextlib.contextmanager
def _scoped_env(env: Mapping[str, str | None]) -> Iterator[None]:
    """Set (value) or unset (None) environment variables for the block, then restore them."""
    with _env_lock:
        saved = {k: os.environ.get(k) for k in env}
        try:
            for k, v in env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = str(v)
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _import_engine_class() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("mooncake transfer engine is not installed "
                           "(pip install mooncake-transfer-engine, or -non-cuda on CPU boxes)") from e
    return TransferEngine


def mooncake_available() -> bool:
    try:
        _import_engine_class()
    except RuntimeError:
        return False
    return True


class MooncakeEngine:
    """One Mooncake transfer engine bound to one interface (``hostname``), P2P handshake.

    ``protocol``: "tcp" or "rdma" (``device_name`` then lists the RDMA NICs, comma-separated, empty
    for all). ``env``: extra ``MC_*`` settings (None unsets one), written into the process
    environment when the engine starts (process-wide, see the module docstring). ``force_tcp``
    overrides the protocol's choice of ``MC_FORCE_TCP``.
    """

    def __init__(self, hostname: str, protocol: str = "tcp", device_name: str = "", *,
                 metadata_server: str = P2P_HANDSHAKE, env: Mapping[str, str | None] | None = None,
                 force_tcp: bool | None = None, poll_interval_s: float = 0.0005):
        self.hostname = hostname
        self.protocol = protocol
        self.device_name = device_name
        self.metadata_server = metadata_server
        self.env = dict(env or {})
        # None: follow the protocol (tcp forces TCP, anything else lets auto-discovery pick RDMA).
        self.force_tcp = (protocol == "tcp") if force_tcp is None else force_tcp
        self.poll_interval_s = poll_interval_s
        self._engine: Any = None
        self._registered: dict[int, int] = {}
        # Transfers a caller's deadline gave up on, still running in Mooncake (see the module docstring).
        self._orphans: list[int] = []
        self._orphans_changed = threading.Condition()
        self._reaper: threading.Thread | None = None
        self._rpc_port: int | None = None

    # -- life cycle ---------------------------------------------------------------------------------
    def start(self) -> MooncakeEngine:
        if self._engine is not None:
            return self
        cls = _import_engine_class()
        persistent = {k: v for k, v in self.env.items() if k != "MC_FORCE_TCP"}
        if persistent:
            with _env_lock:
                for k, v in persistent.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = str(v)
        scoped = {"MC_FORCE_TCP": self.env.get("MC_FORCE_TCP", "1" if self.force_tcp else None)}
        _quiet_native_logging()
        with _scoped_env(scoped), _native_stderr_to_log():
            engine = cls()
            code = engine.initialize(self.hostname, self.metadata_server, self.protocol, self.device_name)
        if code != 0:
            raise RuntimeError(f"mooncake TransferEngine.initialize({self.hostname!r}, {self.metadata_server!r}, "
                               f"{self.protocol!r}, {self.device_name!r}) returned {code}")
        self._engine = engine
        self._rpc_port = int(engine.get_rpc_port())
        return self

    def close(self) -> None:
        """Unregister memory and drop the engine (its destructor stops its threads)."""
        if self._engine is None:
            return
        self.settle(ORPHAN_SETTLE_S)
        engine, self._engine = self._engine, None
        for addr in list(self._registered):
            with contextlib.suppress(Exception):
                engine.unregister_memory(addr)
        self._registered.clear()
        del engine

    def __enter__(self) -> MooncakeEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def started(self) -> bool:
        return self._engine is not None

    @property
    def raw(self) -> Any:
        """The underlying ``mooncake.engine.TransferEngine``."""
        if self._engine is None:
            raise RuntimeError("engine not started")
        return self._engine

    @property
    def rpc_port(self) -> int:
        if self._rpc_port is None:
            raise RuntimeError("engine not started")
        return self._rpc_port

    @property
    def session_id(self) -> str:
        """What peers pass as ``target``: ``"host:rpc_port"``."""
        return f"{self.hostname}:{self.rpc_port}"

    # -- memory -------------------------------------------------------------------------------------
    def register(self, addr: int, length: int) -> None:
        code = self.raw.register_memory(int(addr), int(length))
        if code != 0:
            raise TransferError("register_memory", code, detail=f"addr=0x{addr:x} length={length}")
        self._registered[int(addr)] = int(length)

    def unregister(self, addr: int) -> None:
        self.settle(ORPHAN_SETTLE_S)  # a transfer given up on may still read this memory
        code = self.raw.unregister_memory(int(addr))
        self._registered.pop(int(addr), None)
        if code != 0:
            raise TransferError("unregister_memory", code, detail=f"addr=0x{addr:x}")

    @property
    def registered(self) -> dict[int, int]:
        return dict(self._registered)

    # -- transfers ----------------------------------------------------------------------------------
    def write(self, target: str, local_addr: int, remote_addr: int, length: int) -> None:
        """One blocking write (Mooncake's own sync call: it spins a core while it waits)."""
        code = self.raw.transfer_sync_write(target, int(local_addr), int(remote_addr), int(length))
        if code < 0:
            raise TransferError("transfer_sync_write", code, target,
                                f"local=0x{local_addr:x} remote=0x{remote_addr:x} length={length}")

    def submit_write(self, target: str, local_addr: int, remote_addr: int, length: int) -> int:
        """Start one write; returns a handle for :meth:`poll` / :meth:`wait`."""
        handle = self.raw.transfer_submit_write(target, int(local_addr), int(remote_addr), int(length))
        if handle in (-1, 0, (1 << 64) - 1):
            raise TransferError("transfer_submit_write", -1, target,
                                f"local=0x{local_addr:x} remote=0x{remote_addr:x} length={length}")
        return int(handle)

    def poll(self, handle: int) -> int:
        """1 done, 0 running, -1 failed, -2 timed out; the handle is freed unless it is still running.

        Mooncake's ``transfer_check_status`` frees the batch id on 1 and -1 but not on -2, and has no
        call to free it; ``get_batch_transfer_status`` frees a timed-out batch once its tasks are done.
        """
        code = int(self.raw.transfer_check_status(handle))
        if code == -2:
            self._free_timed_out(handle)
        return code

    def _free_timed_out(self, handle: int) -> None:
        with contextlib.suppress(Exception):  # best effort: a batch still busy stays Mooncake's
            self.raw.get_batch_transfer_status([handle])

    def wait(self, handles: Sequence[int], target: str | None = None, timeout_s: float | None = None) -> None:
        """Poll until every handle is done; sleeps between polls instead of spinning.

        On a failure the remaining handles are still waited for (their memory is in use), then the
        first failure is raised.
        """
        pending = list(handles)
        failure: int | None = None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        sleep = self.poll_interval_s / 4
        while pending:
            still = []
            for h in pending:
                code = self.poll(h)
                if code == 0:
                    still.append(h)
                elif code < 0 and failure is None:  # -1 failed, -2 timed out
                    failure = code
            pending = still
            if not pending:
                break
            if deadline is not None and time.monotonic() > deadline:
                self._orphan(pending)
                raise TransferError("wait", -2, target, f"{len(pending)} transfers still running after {timeout_s}s "
                                    "(released: freed once Mooncake ends them)")
            time.sleep(sleep)
            sleep = min(sleep * 2, self.poll_interval_s)
        if failure is not None:
            raise TransferError("transfer", failure, target)

    # -- transfers given up on -----------------------------------------------------------------------
    @property
    def orphans(self) -> int:
        """Transfers a deadline gave up on that Mooncake still runs."""
        with self._orphans_changed:
            return len(self._orphans)

    def _orphan(self, handles: Sequence[int]) -> None:
        with self._orphans_changed:
            self._orphans.extend(handles)
            if self._reaper is None or not self._reaper.is_alive():
                self._reaper = threading.Thread(target=self._reap, name="mooncake-reaper", daemon=True)
                self._reaper.start()

    def _reap(self) -> None:
        """Poll the orphans until each ends (a poll that sees the end frees its batch id)."""
        while True:
            with self._orphans_changed:
                handles = list(self._orphans)
            if not handles:
                return
            ended = {h for h in handles if self._engine is None or self.poll(h) != 0}
            with self._orphans_changed:
                self._orphans = [h for h in self._orphans if h not in ended]
                if ended:
                    self._orphans_changed.notify_all()
                if not self._orphans:
                    return
            time.sleep(_REAP_INTERVAL_S)

    def settle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every orphaned transfer to end; False (logged) if some did not."""
        with self._orphans_changed:
            if self._orphans_changed.wait_for(lambda: not self._orphans, timeout_s):
                return True
            left = len(self._orphans)
        log.warning("%d transfer(s) given up on still run in Mooncake after %gs", left, timeout_s)
        return False

    def write_many(self, target: str, items: Sequence[tuple[int, int, int]], *, mode: str = "poll",
                   timeout_s: float | None = None) -> None:
        """Write ``[(local_addr, remote_addr, length), ...]`` to one peer, all in flight together.

        ``mode``: "poll" (submit each, poll with sleeps; the default and fastest here), "batch"
        (``batch_transfer_sync_write``), "async_batch" (``batch_transfer_async_write`` +
        ``get_batch_transfer_status``) or "threads" (one ``transfer_sync_write`` per item, each in
        its own thread); the last three spin a core per waiting call.
        """
        if not items:
            return
        locals_ = [int(i[0]) for i in items]
        remotes = [int(i[1]) for i in items]
        lengths = [int(i[2]) for i in items]
        if mode == "poll":
            handles = []
            try:
                for loc, rem, n in zip(locals_, remotes, lengths):
                    handles.append(self.submit_write(target, loc, rem, n))
            except TransferError:
                with contextlib.suppress(TransferError):
                    self.wait(handles, target, timeout_s)
                raise
            self.wait(handles, target, timeout_s)
        elif mode == "batch":
            code = self.raw.batch_transfer_sync_write(target, locals_, remotes, lengths)
            if code < 0:
                raise TransferError("batch_transfer_sync_write", code, target, f"{len(items)} writes")
        elif mode == "async_batch":
            batch = self.raw.batch_transfer_async_write(target, locals_, remotes, lengths)
            if not batch or batch < 0:
                raise TransferError("batch_transfer_async_write", -1, target, f"{len(items)} writes")
            code = self.raw.get_batch_transfer_status([batch])
            if code < 0:
                raise TransferError("get_batch_transfer_status", code, target, f"{len(items)} writes")
        elif mode == "threads":
            run_in_threads([functools.partial(self.write, target, loc, rem, n)
                            for loc, rem, n in zip(locals_, remotes, lengths)], name="mooncake-write")
        else:
            raise ValueError(f"unknown write mode {mode!r}")

    def __repr__(self) -> str:
        state = self.session_id if self.started else "not started"
        return f"MooncakeEngine({self.hostname!r}, {self.protocol!r}, {state})"
