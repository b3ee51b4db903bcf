"""The README's first command, shortened: the whole system on this machine, then nothing left behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def processes_with(marker: str, value: str) -> list[int]:
    """Pids whose environment carries ``marker=value`` (the demo's children inherit it)."""
    needle = f"{marker}={value}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_demo_trains_survives_a_killed_box_and_leaves_nothing_behind(tmp_path):
    run_id = uuid.uuid4().hex
    proc = subprocess.run(
        [sys.executable, "-m", "rollout_manager", "demo", "--steps", "3", "--kill-step", "2",
         "--logdir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=170, env={**os.environ, "RM_DEMO_RUN_ID": run_id},
    )
    out = proc.stdout
    assert proc.returncode == 0, f"{out}\n{proc.stderr}"
    steps = re.findall(r"^step +(\d+) +reward [\d.]+ +rollouts (\d+) .* continued +(\d+) +push v(\d+)", out, re.M)
    assert [(int(s), int(r), int(v)) for s, r, _, v in steps] == [(1, 32, 1), (2, 32, 2), (3, 32, 3)]
    assert int(steps[1][2]) > 0, "the box killed in step 2 had sequences to continue"
    assert re.search(r"step 2: killed box 127\.0\.0\.1:\d+ mid-generation; started 127\.0\.0\.1:\d+", out)
    # The fresh box was bootstrapped and is at the last version, like the survivor.
    final = re.search(r"every box at v3: (.*)$", out, re.M).group(1).split()
    assert len(final) == 2 and all(x.endswith(":active@v3") for x in final)
    assert processes_with("RM_DEMO_RUN_ID", run_id) == []
