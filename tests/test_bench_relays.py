"""benchmarks/bench_relays.py's arithmetic: which of a manager's processes a command line is, and the plan it
prints (relays for a fleet's tokens, what the control process spends and how many boxes it serves)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_relays import ControlCosts, median_worst, relays_needed, role_of

SERVE = ["/venv/bin/python", "-m", "rollout_manager", "serve", "--bind", "127.0.0.1:1", "--set", "relays=2"]


@pytest.mark.parametrize(("args", "role"), [
    (SERVE, "supervisor"),
    ([*SERVE, "--run-id", "x", "--role", "control", "--bind", "127.0.0.1:2"], "control"),
    ([*SERVE, "--role", "relay", "--relay-index", "1", "--relay-private", "127.0.0.1:3"], "relay 1"),
    ([*SERVE, "--role", "single"], "single"),
    (["/venv/bin/python", "benchmarks/bench_scale.py", "--serve-fake", "32"], None),
    ([], None),
])
def test_a_process_is_named_by_its_role(args, role):
    assert role_of(args) == role


def test_relays_needed_rounds_up_to_whole_cores():
    assert relays_needed(50e6, 0.6e-6) == 30
    assert relays_needed(50e6, 0.61e-6) == 31
    assert relays_needed(50e6, 0.6e-6, busy=0.5) == 60


def test_the_control_process_spends_per_box_per_relay_per_report_and_per_sequence():
    costs = ControlCosts(box_s=40e-6, box_relay_s=10e-6, report_s=400e-6, sequence_s=2e-6)
    # 1,000 boxes with 3 relays: boxes 1000 x (40 + 3 x 10) us, reports 3 x 2 x 400 us, 5,000 sequences x 2 us
    assert costs.per_second(1000, 3, 5000) == pytest.approx(0.070 + 0.0024 + 0.010)
    assert costs.boxes_per_core(3) == int((1 - 0.0024) / 70e-6)
    assert costs.boxes_per_core(0) == 25_000
    assert ControlCosts(0.0, 0.0, 0.0, 0.0).boxes_per_core(5) == sys.maxsize  # no cost per box: no bound from it
    saving = ControlCosts(box_s=40e-6, box_relay_s=10e-6, report_s=400e-6, sequence_s=2e-6, token_s=1e-8)
    assert saving.per_second(1000, 3, 5000, 1e6) == pytest.approx(costs.per_second(1000, 3, 5000) + 0.01)


def test_median_and_worst():
    assert median_worst([1.0, 3.0, 2.0]) == (2.0, 3.0)
    assert median_worst([1.0, 3.0, 2.0], higher_is_worse=False) == (2.0, 1.0)
