"""``rollout-manager serve`` options a script relies on: an OS-chosen port, and help that lists every flag."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request

import pytest
from support import PY, ROOT, Proc, wait_until

pytestmark = pytest.mark.slow  # every test here starts real processes


def test_bind_port_0_listens_on_a_free_port_and_logs_it(tmp_path):
    proc = Proc([PY, "-m", "rollout_manager", "serve", "--bind", "127.0.0.1:0"], tmp_path / "manager.log")
    try:
        found = wait_until(lambda: re.search(r"listening on http://127\.0\.0\.1:(\d+)", proc.log())
                           or proc.popen.poll() is not None, 30, interval_s=0.05,
                           message=lambda: f"the listening line; log:\n{proc.log()}")
        assert proc.popen.poll() is None, proc.log()
        port = int(found.group(1))
        assert port != 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            assert r.status == 200
    finally:
        proc.stop()


def test_serve_help_explains_its_flags():
    out = subprocess.run([sys.executable, "-m", "rollout_manager", "serve", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30).stdout
    flat = " ".join(out.split())
    assert "--log-level {debug,info,warning,error} log threshold (default info" in flat
    assert "--log-format {text,json} text lines, or one JSON object per line" in flat
    assert "port 0: any free port" in flat
