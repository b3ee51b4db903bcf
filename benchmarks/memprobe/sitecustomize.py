"""Loaded into the manager by ``bench_scale.py --trace-memory`` (this directory goes first on its
PYTHONPATH): traces Python allocations and, on a signal, writes what each source file holds.

SIGUSR1 takes the baseline (the idle manager); SIGUSR2 writes ``$MEMPROBE_OUT`` (JSON: bytes held per
source file above the baseline, the biggest lines, and the biggest allocation sites by traceback, up to
``$MEMPROBE_FRAMES`` frames deep, 1 by default), then touches ``$MEMPROBE_OUT.done``. With
``MEMPROBE_TRACE=0`` (``--allocator-stats``) nothing is traced and the allocators' own accounts are taken
at both moments instead (tracemalloc's hooks would hide pymalloc's), so the manager runs at full speed. Allocations by C
code (uvloop's transports and timers) are charged to the innermost Python frame, often asyncio's
runner. Not part of the product: nothing in rollout_manager/ knows of it.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import re
import signal
import sys
import tempfile
import tracemalloc


def _allocator() -> dict[str, int]:
    """What the allocators hold beside live objects: pymalloc's blocks (live, free in used pools, whole
    empty pools, from ``sys._debugmallocstats``) and glibc malloc's in-use and free bytes (``mallinfo2``)."""
    with tempfile.TemporaryFile() as f:
        libc = ctypes.CDLL(None)
        saved = os.dup(2)
        libc.fflush(None)
        os.dup2(f.fileno(), 2)
        try:
            sys._debugmallocstats()
            libc.fflush(None)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        text = f.read().decode(errors="replace")

    def num(pattern: str) -> int:
        m = re.search(pattern, text, re.M)
        return int(m.group(1).replace(",", "")) if m else 0

    out = {"pymalloc_live": num(r"^# bytes in allocated blocks\s*=\s*([\d,]+)"),
           "pymalloc_free_blocks": num(r"^# bytes in available blocks\s*=\s*([\d,]+)"),
           "pymalloc_empty_pools": num(r"^\d+ unused pools \* \d+ bytes\s*=\s*([\d,]+)"),
           "pymalloc_arenas": num(r"^\d+ arenas \* \d+ bytes/arena\s*=\s*([\d,]+)")}
    try:
        class MallInfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in
                        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
        mallinfo2 = ctypes.CDLL(None).mallinfo2
        mallinfo2.restype = MallInfo2
        info = mallinfo2()
        out.update(malloc_in_use=info.uordblks + info.hblkhd, malloc_free=info.fordblks)
    except AttributeError:  # not glibc >= 2.33
        pass
    return out


if os.environ.get("MEMPROBE_OUT"):
    _trace = os.environ.get("MEMPROBE_TRACE", "1") == "1"  # 0: allocator accounts only (no tracemalloc)
    if _trace:
        tracemalloc.start(int(os.environ.get("MEMPROBE_FRAMES", "1")))
    _base: dict[str, tracemalloc.Snapshot] = {}
    _allocator_idle: dict[str, int] = {}

    def _snapshot() -> tracemalloc.Snapshot:
        gc.collect()
        return tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])

    def _on_signal(sig: int, _frame: object) -> None:
        if sig == signal.SIGUSR1:
            gc.collect()
            if _trace:
                _base["idle"] = _snapshot()
            else:  # tracemalloc's hooks hide pymalloc from sys._debugmallocstats
                _allocator_idle.update(_allocator())
            return
        gc.collect()
        out: str = os.environ["MEMPROBE_OUT"]
        data: dict[str, object] = {}
        if not _trace:
            data["allocator"] = {"idle": _allocator_idle, "held": _allocator()}
        else:
            snap = _snapshot()
            base = _base.get("idle")
            by_file = snap.compare_to(base, "filename") if base else snap.statistics("filename")
            by_line = snap.compare_to(base, "lineno") if base else snap.statistics("lineno")
            by_site = snap.compare_to(base, "traceback") if base else snap.statistics("traceback")
            data.update(files={str(s.traceback[0].filename): getattr(s, "size_diff", s.size) for s in by_file},
                        lines=[[str(s.traceback[0]), getattr(s, "size_diff", s.size)] for s in by_line[:10]],
                        sites=[[[str(f) for f in s.traceback], getattr(s, "size_diff", s.size)]
                               for s in by_site[:25]])
        with open(out, "w") as f:
            json.dump(data, f)
        open(out + ".done", "w").close()

    signal.signal(signal.SIGUSR1, _on_signal)
    signal.signal(signal.SIGUSR2, _on_signal)
