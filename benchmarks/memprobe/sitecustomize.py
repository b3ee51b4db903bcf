"""Loaded into the manager by ``bench_scale.py --trace-memory`` (this directory goes first on its
PYTHONPATH): traces Python allocations and, on a signal, writes what each source file holds.

SIGUSR1 takes the baseline (the idle manager); SIGUSR2 writes ``$MEMPROBE_OUT`` (JSON: bytes held per
source file above the baseline, the biggest lines, and the biggest allocation sites by traceback, up to
``$MEMPROBE_FRAMES`` frames deep, 1 by default), then touches ``$MEMPROBE_OUT.done``. Allocations by C
code (uvloop's transports and timers) are charged to the innermost Python frame, often asyncio's
runner. Not part of the product: nothing in rollout_manager/ knows of it.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import tracemalloc

if os.environ.get("MEMPROBE_OUT"):
    tracemalloc.start(int(os.environ.get("MEMPROBE_FRAMES", "1")))
    _base: dict[str, tracemalloc.Snapshot] = {}

    def _snapshot() -> tracemalloc.Snapshot:
        gc.collect()
        return tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])

    def _on_signal(sig: int, _frame: object) -> None:
        if sig == signal.SIGUSR1:
            _base["idle"] = _snapshot()
            return
        out, snap = os.environ["MEMPROBE_OUT"], _snapshot()
        base = _base.get("idle")
        by_file = snap.compare_to(base, "filename") if base else snap.statistics("filename")
        by_line = snap.compare_to(base, "lineno") if base else snap.statistics("lineno")
        by_site = snap.compare_to(base, "traceback") if base else snap.statistics("traceback")
        data = {"files": {str(s.traceback[0].filename): getattr(s, "size_diff", s.size) for s in by_file},
                "lines": [[str(s.traceback[0]), getattr(s, "size_diff", s.size)] for s in by_line[:10]],
                "sites": [[[str(f) for f in s.traceback], getattr(s, "size_diff", s.size)] for s in by_site[:25]]}
        with open(out, "w") as f:
            json.dump(data, f)
        open(out + ".done", "w").close()

    signal.signal(signal.SIGUSR1, _on_signal)
    signal.signal(signal.SIGUSR2, _on_signal)
