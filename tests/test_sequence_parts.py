"""A sequence's migration part is written by tail migration alone (rollout/sequence.py); a refusal is a value."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from rollout_manager.instances.registry import Kind, Registry
from rollout_manager.rollout.sequence import Refusal
from rollout_manager.sglang.errors import EngineError

ROOT = Path(__file__).resolve().parents[1] / "rollout_manager"
OWNER = "rollout/migration.py"


def _is_migration(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "migration"


def writes(path: Path) -> list[str]:
    """Assignments to a field of some ``x.migration``, or an alias of one (``part = seq.migration``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Attribute) and _is_migration(t.value):
                    found.append(f"{node.lineno}: {ast.unparse(t)}")
        if value is not None and _is_migration(value):
            found.append(f"{node.lineno}: alias of {ast.unparse(value)}")
    return found


def test_only_tail_migration_writes_a_sequences_migration_part() -> None:
    strays = [f"{path.relative_to(ROOT).as_posix()}:{w}" for path in sorted(ROOT.rglob("*.py"))
              if path.relative_to(ROOT).as_posix() != OWNER for w in writes(path)]
    assert strays == []
    assert writes(ROOT / OWNER), "the check finds the owner's own writes"


def test_a_refusal_is_a_frozen_value() -> None:
    inst = Registry().add("127.0.0.1", 30000, Kind.REMOTE)
    refusal = Refusal(inst, EngineError(400, "input too long", "BadRequestError"))
    assert refusal == Refusal(inst, EngineError(400, "input too long", "BadRequestError"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        refusal.error = EngineError(400, "other")  # type: ignore[misc]
