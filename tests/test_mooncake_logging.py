"""Mooncake's native (glog) start-up chatter stays off the terminal: only our own lines reach stderr."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from support import PY, ROOT

from rollout_manager.weights.mooncake_engine import mooncake_available

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not mooncake_available(), reason="mooncake is not installed")]

SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="ours: %(message)s")
from rollout_manager.weights.mooncake_engine import MooncakeEngine
a, b = MooncakeEngine("127.0.0.1").start(), MooncakeEngine("127.0.0.1").start()
logging.getLogger("test").info("engines at %d and %d", a.rpc_port, b.rpc_port)
a.close(); b.close()
"""
GLOG = re.compile(r"^[IWEF]\\d{4} |InitGoogleLogging|transfer_metadata\\.cpp", re.M)


def test_starting_engines_writes_no_glog_lines_to_stderr():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOG_", "MC_LOG"))}
    proc = subprocess.run([PY, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "ours: engines at" in proc.stderr  # our own logging still reaches stderr
    assert not GLOG.search(proc.stderr), proc.stderr
