"""Placement's two parts each write their own figures: capacity its counters, the fleet model its learned ones.

``Dispatcher`` decides; ``placement/capacity.py`` keeps what is in flight, reserved and waiting, and
``placement/fleet_model.py`` what the policies read of each box. Their counters are plain attributes (read on
every placement), so this test holds the rule the methods stand for: no other module assigns them, the batches
that hold requests back (``rollout/batch.py``, ``rollout/window.py``) and tail migration included.
"""

from __future__ import annotations

import ast
from pathlib import Path

from ast_writes import assigned

from rollout_manager.instances.registry import Kind, Registry, State
from rollout_manager.placement.ask import Ask
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.least_in_flight import LeastInFlight

ROOT = Path(__file__).resolve().parents[1] / "rollout_manager"
CAPACITY, FLEET = "placement/capacity.py", "placement/fleet_model.py"
OWNER = {**dict.fromkeys(("in_flight", "held_by_batches", "windowed", "waiting", "max_in_flight_total",
                          "max_in_flight_per_instance"), CAPACITY),
         **dict.fromkeys(("streamed_tokens", "last_predicted", "batch_half", "meters", "lone_meters", "speeds",
                          "remembered_speeds", "work"), FLEET)}
# An instance's own Load.in_flight (capacity's too, tests/test_instance_parts.py) is written as ``load.in_flight``.
_LOAD_NAMES = {"load", "own"}


def writes(path: Path) -> list[tuple[int, str, str]]:
    """(line, target, name) of every assignment to one of OWNER's names on something other than ``self``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        for t in assigned(node):
            if isinstance(t, ast.Attribute) and t.attr in OWNER \
                    and not (isinstance(t.value, ast.Name) and t.value.id in {"self", *_LOAD_NAMES}) \
                    and not (isinstance(t.value, ast.Attribute) and t.value.attr == "load"):
                found.append((node.lineno, ast.unparse(t), t.attr))
    return found


def test_capacity_and_the_fleet_model_write_their_own_figures_only() -> None:
    strays = []
    for path in sorted(ROOT.rglob("*.py")):
        if "dispatcher" not in path.read_text(encoding="utf-8").lower():
            continue  # only a module that holds a dispatcher can reach its parts
        module = path.relative_to(ROOT).as_posix()
        strays += [f"{module}:{line}: {target} (owned by {OWNER[name]})"
                   for line, target, name in writes(path) if OWNER[name] != module]
    assert strays == []


def test_the_check_finds_a_stray_write(tmp_path: Path) -> None:
    stray = tmp_path / "stray.py"
    stray.write_text("def f(dispatcher):\n    dispatcher.capacity.held_by_batches += 1\n    inst.load.in_flight = 0\n")
    assert writes(stray) == [(2, "dispatcher.capacity.held_by_batches", "held_by_batches")]


def test_the_dispatcher_reserves_through_capacity_and_teaches_the_fleet_model() -> None:
    clock = [0.0]
    registry = Registry(clock=lambda: clock[0])
    d = Dispatcher(registry, LeastInFlight(), clock=lambda: clock[0], max_in_flight_total=8)
    a = registry.add("127.0.0.1", 30000, Kind.REMOTE)
    assert registry.transition(a, State.ACTIVE, "test: healthy")
    assert d.try_acquire(Ask(100)) is a
    assert (d.capacity.in_flight, a.load.in_flight, a.load.in_flight_tokens) == (1, 1, 100)
    clock[0] = 1.0
    d.progress(a, 10, clock[0])
    assert (a.load.in_flight_tokens, a.load.last_chunk_at, d.fleet.streamed_tokens) == (90, 1.0, 10)
    assert d.fleet.meter(a).rate(clock[0]) is not None
    d.capacity.hold(3)
    assert d.capacity.requests_waiting() == 3 and d.capacity.admission_status()["held_by_batches"] == 3
    d.capacity.unhold(3)
    d.release(a, 90)
    assert (d.capacity.in_flight, a.load.in_flight, a.load.in_flight_tokens) == (0, 0, 0)
