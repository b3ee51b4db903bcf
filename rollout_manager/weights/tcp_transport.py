"""Plain multi-stream TCP transport with the same shape as :class:`MooncakeEngine`.

Runs in: box, trainer.

The baseline the Mooncake transport is measured against (docs/benchmarks.md, "Weight transfer") and
a fallback transport: ``TcpEngine(hostname).start()`` listens on ``hostname:port`` (``session_id``);
``register(addr, length)`` exposes a memory range; a peer's
``write``/``write_many`` lands payloads straight in it with ``recv_into`` on a memoryview (no
intermediate copy in Python). A sender keeps up to ``streams`` persistent connections per target and
spreads the bytes of one ``write_many`` over all of them, so one large shard still uses every stream.

Wire format, per write on a connection (little endian):
    sender -> ``b"RMW1"``, remote_addr u64, length u64
    receiver -> 1 byte: 0 accepted, 1 rejected (range not registered); on rejection nothing follows
    sender -> ``length`` payload bytes
    receiver -> 1 byte: 0 once every byte is in memory
A write is complete only when the last byte landed, as with Mooncake. Blocking sockets in threads.
A sender's ``write_many(..., timeout_s=T)`` ends within about T seconds whatever the receiver does: a
receiver that stops reading without closing (blackholed) would otherwise hold the sending thread until
the kernel gives up on the connection, which on a quiet link is never. A connection cut by the deadline
is closed, not pooled, so no later write inherits its half-sent frame.

``rate_bytes_per_s`` caps what one engine sends, over all its streams together, to emulate a slow
link (a WAN between clusters) on loopback: benchmarks only.
"""

from __future__ import annotations

import contextlib
import ctypes
import queue
import socket
import struct
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from rollout_manager.weights.mooncake_engine import TransferError

_MAGIC = b"RMW1"
_HEADER = struct.Struct("<4sQQ")
_ACCEPT, _REJECT = b"\x00", b"\x01"
_SOCK_BUF = 0  # 0: leave buffer sizes to kernel autotuning (setting them disables it)
DEFAULT_STREAMS = 4
DEFAULT_PIECE = 64 << 20  # work-queue granularity when one write is spread over several streams
_RECV_STEP = 16 << 20     # bytes per recv_into call (with MSG_WAITALL)
_PACE_STEP = 256 << 10    # bytes sent per paced step under a rate cap


class _Pacer:
    """Shared send-rate cap: every chunk books the next free slot of the link, then waits for it."""

    def __init__(self, rate_bytes_per_s: float):
        if rate_bytes_per_s <= 0:
            raise ValueError("rate_bytes_per_s must be positive")
        self.rate = float(rate_bytes_per_s)
        self._next = 0.0
        self._lock = threading.Lock()

    def send(self, sock: socket.socket, data: memoryview, deadline: float | None = None) -> None:
        for off in range(0, len(data), _PACE_STEP):
            chunk = data[off: off + _PACE_STEP]
            with self._lock:
                start = max(time.monotonic(), self._next)
                self._next = start + len(chunk) / self.rate
            delay = start - time.monotonic()
            if deadline is not None and start > deadline:
                raise TimeoutError("the paced send would pass the write's deadline")
            if delay > 0:
                time.sleep(delay)
            sock.settimeout(_left(deadline))
            sock.sendall(chunk)


def _left(deadline: float | None) -> float | None:
    """Seconds to the deadline, as a socket timeout (None: no deadline); raises once it has passed."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the write's deadline passed")
    return left


def _memory(addr: int, length: int) -> memoryview:
    """A writable memoryview over raw memory (the caller vouches for the range)."""
    if length == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * length).from_address(addr)).cast("B")


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        step = min(n - got, _RECV_STEP)
        r = sock.recv_into(view[got: got + step], step, socket.MSG_WAITALL)
        if r == 0:
            raise ConnectionError("peer closed the connection mid-transfer")
        got += r


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if _SOCK_BUF:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)


class TcpEngine:
    """Sender and receiver of raw memory ranges over plain TCP (blocking sockets, threads)."""

    def __init__(self, hostname: str, port: int = 0, *, streams: int = DEFAULT_STREAMS,
                 piece_bytes: int = DEFAULT_PIECE, connect_timeout_s: float = 5.0, listen: bool = True,
                 rate_bytes_per_s: float | None = None):
        if streams < 1:
            raise ValueError("streams must be >= 1")
        self.hostname = hostname
        self.streams = streams
        self.piece_bytes = piece_bytes
        self.connect_timeout_s = connect_timeout_s
        self._listen = listen
        self._pacer = _Pacer(rate_bytes_per_s) if rate_bytes_per_s else None
        self._port = port
        self._server: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conn_threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self._regions: dict[int, memoryview] = {}
        self._lock = threading.Lock()
        self._pools: dict[str, queue.SimpleQueue[socket.socket]] = {}
        self._pool_socks: list[socket.socket] = []
        self._closed = False
        self._started = False

    # -- life cycle ---------------------------------------------------------------------------------
    def start(self) -> TcpEngine:
        if self._started:
            return self
        if self._listen:
            srv = socket.create_server((self.hostname, self._port), backlog=64)
            self._server = srv
            self._port = srv.getsockname()[1]
            self._accept_thread = threading.Thread(target=self._accept_loop, name=f"tcp-accept-{self._port}",
                                                   daemon=True)
            self._accept_thread.start()
        self._started = True
        return self

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            socks = list(self._conns) + list(self._pool_socks)
            self._pools.clear()
            self._pool_socks.clear()
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.shutdown(socket.SHUT_RDWR)
            self._server.close()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5)
        for t in list(self._conn_threads):
            t.join(timeout=5)
        self._regions.clear()

    def __enter__(self) -> TcpEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def port(self) -> int:
        return self._port

    @property
    def session_id(self) -> str:
        if not self._started:
            raise RuntimeError("engine not started")
        return f"{self.hostname}:{self._port}"

    # -- memory -------------------------------------------------------------------------------------
    def register(self, addr: int, length: int) -> None:
        with self._lock:
            self._regions[int(addr)] = _memory(int(addr), int(length))

    def unregister(self, addr: int) -> None:
        with self._lock:
            self._regions.pop(int(addr), None)

    def _region_view(self, addr: int, length: int) -> memoryview | None:
        with self._lock:
            for base, view in self._regions.items():
                if base <= addr and addr + length <= base + len(view):
                    return view[addr - base: addr - base + length]
        return None

    # -- receiving ----------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._server is not None
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            _tune(conn)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
                t = threading.Thread(target=self._serve, args=(conn,), daemon=True, name="tcp-recv")
                self._conn_threads = [x for x in self._conn_threads if x.is_alive()] + [t]
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        header = bytearray(_HEADER.size)
        hv = memoryview(header)
        try:
            while True:
                try:
                    _recv_exact(conn, hv)
                except ConnectionError:
                    return
                magic, addr, length = _HEADER.unpack(header)
                if magic != _MAGIC:
                    return
                view = self._region_view(addr, length)
                if view is None:
                    conn.sendall(_REJECT)
                    continue
                conn.sendall(_ACCEPT)
                _recv_exact(conn, view)
                conn.sendall(_ACCEPT)
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    # -- sending ------------------------------------------------------------------------------------
    def _connect(self, target: str) -> socket.socket:
        host, _, port = target.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=self.connect_timeout_s)
        except OSError as e:
            raise TransferError("connect", -1, target, str(e)) from e
        sock.settimeout(None)
        _tune(sock)
        with self._lock:
            self._pool_socks.append(sock)
        return sock

    def _checkout(self, target: str) -> socket.socket:
        with self._lock:
            if self._closed:
                raise RuntimeError("engine closed")
            pool = self._pools.setdefault(target, queue.SimpleQueue())
        try:
            return pool.get_nowait()
        except queue.Empty:
            return self._connect(target)

    def _checkin(self, target: str, sock: socket.socket) -> None:
        with self._lock:
            pool = self._pools.get(target)
        if pool is None:
            sock.close()
        else:
            pool.put(sock)

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            if sock in self._pool_socks:
                self._pool_socks.remove(sock)
        sock.close()

    def _send_one(self, sock: socket.socket, target: str, src: memoryview, remote_addr: int,
                  deadline: float | None) -> None:
        """One frame; every blocking call on ``sock`` is bounded by ``deadline`` (TimeoutError)."""
        sock.settimeout(_left(deadline))
        sock.sendall(_HEADER.pack(_MAGIC, remote_addr, len(src)))
        sock.settimeout(_left(deadline))
        if sock.recv(1) != _ACCEPT:
            raise TransferError("write", -1, target,
                                f"peer rejected remote range 0x{remote_addr:x}+{len(src)} (not registered)")
        if self._pacer is None:
            sock.settimeout(_left(deadline))
            sock.sendall(src)  # the timeout bounds the whole call (Python >= 3.5)
        else:
            self._pacer.send(sock, src, deadline)
        sock.settimeout(_left(deadline))
        if sock.recv(1) != _ACCEPT:
            raise TransferError("write", -1, target, "peer closed before acknowledging the payload")

    def write(self, target: str, local_addr: int, remote_addr: int, length: int) -> None:
        self.write_many(target, [(local_addr, remote_addr, length)], streams=1)

    def write_many(self, target: str, items: Sequence[tuple[int, int, int]], *, streams: int | None = None,
                   mode: str | None = None, timeout_s: float | None = None) -> None:
        """Write every ``(local_addr, remote_addr, length)`` to ``target`` over up to ``streams``
        parallel connections; pieces of at most ``piece_bytes`` are pulled from a shared queue.
        ``timeout_s``: the whole call's deadline (None: none); past it every stream's connection is
        closed and ``TransferError`` (code -2) raised. ``mode`` exists for parity with :class:`MooncakeEngine`."""
        del mode
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        k = streams or self.streams
        work: queue.SimpleQueue[tuple[memoryview, int]] = queue.SimpleQueue()
        total = sum(int(i[2]) for i in items)
        piece = max(1, min(self.piece_bytes, -(-total // k))) if total else 1
        count = 0
        for local_addr, remote_addr, length in items:
            src = self._region_view(int(local_addr), int(length))
            if src is None:
                raise TransferError("write", -1, target,
                                    f"local range 0x{int(local_addr):x}+{length} is not registered here")
            for off in range(0, int(length), piece):
                work.put((src[off: off + piece], int(remote_addr) + off))
                count += 1
        if count == 0:
            return
        k = min(k, count)

        def run() -> None:
            sock = self._checkout(target)
            try:
                while True:
                    try:
                        src, remote = work.get_nowait()
                    except queue.Empty:
                        break
                    self._send_one(sock, target, src, remote, deadline)
            except TimeoutError as exc:
                self._drop(sock)
                raise TransferError("write", -2, target, f"not done within {timeout_s:g}s ({exc}); "
                                    "the receiver stopped taking bytes") from exc
            except BaseException:
                self._drop(sock)
                raise
            self._checkin(target, sock)

        if k == 1:
            run()
            return
        with ThreadPoolExecutor(max_workers=k, thread_name_prefix="tcp-send") as pool:
            futures = [pool.submit(run) for _ in range(k)]
            errors = [f.exception() for f in futures]
        for e in errors:
            if e is not None:
                if isinstance(e, OSError):
                    raise TransferError("write", -1, target, str(e)) from e
                raise e

    def __repr__(self) -> str:
        where = f"{self.hostname}:{self._port}" if self._started else "not started"
        return f"TcpEngine({where}, streams={self.streams})"
