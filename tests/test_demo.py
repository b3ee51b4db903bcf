"""The README's first command, shortened: the whole system on this machine, then nothing left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from support import Proc, wait_until

pytestmark = pytest.mark.slow  # every test here starts real processes

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
    proc = subprocess.run(  # no --logdir: the default one, under TMPDIR, is kept and named (issue 16 bug 7)
        [sys.executable, "-m", "rollout_manager", "demo", "--steps", "3", "--kill-step", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=170,
        env={**os.environ, "RM_DEMO_RUN_ID": run_id, "TMPDIR": str(tmp_path)},
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
    logdirs = list(tmp_path.glob("rollout-manager-demo-*"))
    assert len(logdirs) == 1 and any(logdirs[0].iterdir()), "the printed log directory is kept"
    assert f"logs kept in {logdirs[0]}" in proc.stderr
    assert list(tmp_path.glob("launch_sglang.*")) == []  # the boxes' launchers leave nothing in TMPDIR


def test_demo_help_is_plain_text_with_every_default():
    out = subprocess.run([sys.executable, "-m", "rollout_manager", "demo", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60).stdout
    assert "``" not in out and "scripts/launch_sglang.sh --engine cpu" in out
    options = {chunk.split()[0]: " ".join(chunk.split()) for chunk in out.split("\n  --")[1:]}
    for flag, default in [("steps", "8"), ("model-size", "tiny"), ("max-new-tokens", "24"), ("lr", "0.03")]:
        assert options[flag].endswith(f"(default: {default})"), options[flag]
    assert all(len(text.split()) > 2 for text in options.values()), options  # every flag explained


def _demo_until(tmp_path: Path, run_id: str, line: str) -> Proc:
    """Start the demo and wait until its output shows ``line``."""
    demo = Proc([sys.executable, "-m", "rollout_manager", "demo", "--steps", "50", "--kill-step", "0",
                 "--logdir", str(tmp_path / "logs")], tmp_path / "demo.out", env={"RM_DEMO_RUN_ID": run_id})
    wait_until(lambda: line in demo.log() or demo.popen.poll() is not None, 90, interval_s=0.1,
               message=f"{line!r} in the demo's output")
    assert demo.popen.poll() is None, demo.log()
    return demo


@pytest.mark.parametrize("during_shutdown", [False, True], ids=["running", "during-shutdown"])
def test_sighup_stops_the_demo_and_everything_it_started(tmp_path, during_shutdown):
    """A closed terminal (SIGHUP), also while the demo already shuts down, leaves nothing running."""
    run_id = uuid.uuid4().hex
    demo = _demo_until(tmp_path, run_id, "rollout boxes active")
    try:
        assert len(processes_with("RM_DEMO_RUN_ID", run_id)) > 3  # manager, boxes and their children
        if during_shutdown:
            demo.signal(signal.SIGTERM)
            wait_until(lambda: "interrupted" in demo.log(), 10, interval_s=0.02, message="the demo to begin stopping")
        demo.signal(signal.SIGHUP)
        demo.wait(60)
        wait_until(lambda: processes_with("RM_DEMO_RUN_ID", run_id) == [], 30, interval_s=0.1,
                   message=lambda: f"nothing left of the demo; left: {processes_with('RM_DEMO_RUN_ID', run_id)}")
    finally:
        for pid in processes_with("RM_DEMO_RUN_ID", run_id):  # what a failed run left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        demo.stop()
