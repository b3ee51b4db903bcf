"""Push one staged buffer to one receiver as ``num_shards`` parallel writes.

Runs in: box, trainer.

Works with any :class:`~rollout_manager.weights.transport.Transport` (:class:`MooncakeEngine`,
:class:`TcpEngine`); it uses ``write_many(target, [(local, remote, length), ...])`` only. Given one
engine, all shards go through it in one ``write_many`` (every shard in flight at once). Given
several engines (e.g. one Mooncake engine per shard, all bound to the group's interface), shards are
dealt round-robin and each engine runs in its own thread; each Mooncake engine brings its own I/O
thread, which is what lifts Mooncake TCP towards plain TCP (see benchmarks/bench_weight_transfer.py).
Likewise ``target_session`` may be a list of the receiver's engines' session ids (the receiver
registered the same buffer with each), dealt to shards round-robin.

Checksums are per shard over the source bytes, in the shard order of ``split_shards``; the receiver
recomputes them with :func:`verify_shards`. The same version goes to many receivers, so compute them
once (:func:`shard_checksums` or the first push) and pass them to the later pushes.
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_manager.weights.parallel import run_in_threads
from rollout_manager.weights.shards import DEFAULT_ALGORITHM, Shard, shard_checksums, split_shards
from rollout_manager.weights.transport import Transport


@dataclass
class PushResult:
    bytes: int
    seconds: float
    checksums: list[str]
    shards: list[Shard] = field(default_factory=list)
    checksum_seconds: float = 0.0

    @property
    def gbps(self) -> float:
        """GB/s (10^9 bytes per second) of the transfer itself."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def source_view(addr: int, length: int) -> memoryview:
    """Read-only view of raw memory, for checksumming a registered buffer by address."""
    if length == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * length).from_address(addr)).cast("B").toreadonly()


def push_buffer(engines: Transport | Sequence[Transport], src_addr: int, total: int,
                target_session: str | Sequence[str], dst_addr: int, num_shards: int, *,
                align: int = 256, checksums: Sequence[str] | None = None, compute_checksums: bool = True,
                algorithm: str | None = None, mode: str | None = None,
                timeout_s: float | None = None, only: Sequence[int] | None = None) -> PushResult:
    """Write ``[src_addr, src_addr + total)`` to ``[dst_addr, dst_addr + total)`` at the target.

    ``checksums``: precomputed per-shard checksums to hand back as they are (skips hashing).
    ``compute_checksums=False`` skips them altogether. ``mode`` is passed to ``write_many``
    (Mooncake: "poll", "batch", "async_batch"). ``only``: write just these shards (a repair); the
    checksums and shards returned are still those of every shard. Raises ``TransferError`` on the first failed shard,
    after every engine's in-flight writes have finished.
    """
    shards = split_shards(total, num_shards, align)
    engine_list: list[Transport] = list(engines) if isinstance(engines, Sequence) else [engines]
    targets = [target_session] if isinstance(target_session, str) else list(target_session)
    if not engine_list or not targets:
        raise ValueError("need at least one engine and one target session")

    sums: list[str] = list(checksums) if checksums is not None else []
    checksum_seconds = 0.0
    if checksums is None and compute_checksums and shards:
        t0 = time.perf_counter()
        sums = shard_checksums(source_view(src_addr, total), shards, algorithm=algorithm or DEFAULT_ALGORITHM)
        checksum_seconds = time.perf_counter() - t0
    if checksums is not None and len(sums) != len(shards):
        raise ValueError(f"{len(sums)} checksums for {len(shards)} shards")

    # Shard i goes through engine i % E to target i % T; group the work per (engine, target).
    plan: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    chosen = set(range(len(shards)) if only is None else only)
    if not chosen <= set(range(len(shards))):
        raise ValueError(f"shards {sorted(chosen)} asked for, the push has {len(shards)}")
    sent = 0
    for i, (off, length) in enumerate(shards):
        if i not in chosen:
            continue
        sent += length
        key = (i % len(engine_list), i % len(targets))
        plan.setdefault(key, []).append((src_addr + off, dst_addr + off, length))
    kwargs: dict[str, Any] = {}
    if mode is not None:
        kwargs["mode"] = mode
    if timeout_s is not None:
        kwargs["timeout_s"] = timeout_s

    t0 = time.perf_counter()
    if len(plan) == 1:
        ((e, t), items), = plan.items()
        engine_list[e].write_many(targets[t], items, **kwargs)
    elif plan:
        run_in_threads([functools.partial(engine_list[e].write_many, targets[t], items, **kwargs)
                        for (e, t), items in plan.items()], name="push")
    seconds = time.perf_counter() - t0
    return PushResult(bytes=sent, seconds=seconds, checksums=sums, shards=shards,
                      checksum_seconds=checksum_seconds)
