"""A sequence's parts each have one writer (as an instance's do: tests/test_instance_parts.py); a refusal is a value.

``SequenceState`` keeps what pieces, tail migration, the length model and routed experts need in parts of their
own, not in flat fields: each part's fields are assigned in one module only, and the part itself is put on the
sequence in one module only (tail migration's part is not even aliased outside migration.py). Read with ``ast``:
a part's fields are caught where they are assigned through the sequence (``seq.pieces.size = ...``) or through
a name bound to the part (``part = seq.migration``), and so are the part slots themselves (``seq.track = ...``);
``self`` inside the part's own class is its owner. Only modules that name ``SequenceState`` (strict typing names
it wherever a sequence is handled) are read: a chunk's own ``meta.experts`` is not a sequence's.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from ast_writes import assigned

from rollout_manager.instances.registry import Kind, Registry
from rollout_manager.placement.lengths import Track
from rollout_manager.rollout.pieces import Pieces
from rollout_manager.rollout.request import decode
from rollout_manager.rollout.sequence import Migration, Refusal, Segment, SequenceState
from rollout_manager.sglang.errors import EngineError
from rollout_manager.sglang.routed_experts import RoutedExperts

ROOT = Path(__file__).resolve().parents[1] / "rollout_manager"
OWNER = "rollout/migration.py"


def _is_migration(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "migration"


def writes(path: Path) -> list[str]:
    """Assignments to a field of some ``x.migration``, or an alias of one (``part = seq.migration``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            continue
        for t in assigned(node):
            if isinstance(t, ast.Attribute) and _is_migration(t.value):
                found.append(f"{node.lineno}: {ast.unparse(t)}")
        if node.value is not None and _is_migration(node.value):
            found.append(f"{node.lineno}: alias of {ast.unparse(node.value)}")
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


# slot on SequenceState -> (the part's class, the module that writes its fields, the module that sets the slot)
PARTS: dict[str, tuple[type, str, str]] = {
    "migration": (Migration, "rollout/migration.py", "rollout/sequence.py"),
    "pieces": (Pieces, "rollout/pieces.py", "rollout/sequence.py"),
    "experts": (RoutedExperts, "sglang/routed_experts.py", "rollout/sequence.py"),
    "track": (Track, "placement/lengths.py", "rollout/generation.py"),
}


def _slot(node: ast.expr) -> str | None:
    """The part ``node`` names when it reads one off something other than ``self`` (``seq.pieces``)."""
    if isinstance(node, ast.Attribute) and node.attr in PARTS and not (
            isinstance(node.value, ast.Name) and node.value.id == "self"):
        return node.attr
    return None


def part_writes(source: str) -> list[tuple[int, str, str]]:
    """(line, target, what) of every write to a part: ``what`` is the slot (``track``) for a part put on a
    sequence, ``slot.field`` (``pieces.size``) for a field of a part assigned from outside the part itself."""
    found = []
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = list(ast.walk(func)) if isinstance(func, ast.Module) else [n for s in func.body for n in ast.walk(s)]
        aliases = {}  # name -> the part it was bound to in this function (part = seq.migration)
        for node in body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                slot = _slot(node.value)
                if slot is not None:
                    aliases[node.targets[0].id] = slot
        for node in body:
            for t in assigned(node):
                if not isinstance(t, ast.Attribute):
                    continue
                slot = _slot(t)
                if slot is not None:
                    found.append((node.lineno, ast.unparse(t), slot))
                    continue
                owner = _slot(t.value) or (aliases.get(t.value.id) if isinstance(t.value, ast.Name) else None)
                if owner is not None and t.attr in {f.name for f in dataclasses.fields(PARTS[owner][0])}:
                    found.append((node.lineno, ast.unparse(t), f"{owner}.{t.attr}"))
    return sorted(set(found))


def test_each_part_of_a_sequence_is_written_by_its_owner_only() -> None:
    strays, seen = [], set()
    for path in sorted(ROOT.rglob("*.py")):
        module = path.relative_to(ROOT).as_posix()
        source = path.read_text(encoding="utf-8")
        if "SequenceState" not in source:
            continue
        for line, target, what in part_writes(source):
            slot, _, name = what.partition(".")
            _, fields_by, slot_by = PARTS[slot]
            owner = fields_by if name else slot_by
            seen.add((module, what))
            if module != owner:
                strays.append(f"{module}:{line}: {target} (written by {owner} only)")
    assert strays == []
    # the check sees the owners' own writes through the sequence
    assert ("rollout/generation.py", "track") in seen and ("rollout/migration.py", "migration.moves") in seen


def test_the_check_finds_a_stray_write() -> None:
    source = ("def f(seq):\n    seq.pieces.size = 3\n    part = seq.migration\n    part.moves += 1\n"
              "    seq.track = None\n    seq.segments = []\n    seg.end = 4\n")
    assert part_writes(source) == [(2, "seq.pieces.size", "pieces.size"), (4, "part.moves", "migration.moves"),
                              (5, "seq.track", "track")]


# SequenceState's fields: identity, what it made and where, how it ends, and one slot per part. A new need wants
# a part of its own (with a row in PARTS), not another flat field.
MAX_FIELDS = 23


def test_the_sequence_keeps_its_parts_whole_not_flat() -> None:
    """What pieces, tail migration, tracking and routed experts need is a part each, not fields of the sequence."""
    names = {f.name for f in dataclasses.fields(SequenceState)}
    assert set(PARTS) <= names
    for part in (Pieces, Migration):
        assert not names & {f.name for f in dataclasses.fields(part)}, f"{part.__name__}'s fields are flat"
    assert len(names) <= MAX_FIELDS, f"SequenceState grew flat: {len(names)} fields"


def test_pieces_are_written_through_their_methods() -> None:
    pieces = Pieces()
    pieces.next(64)
    assert (pieces.size, pieces.crossed, pieces.at_boundary, pieces.tally) == (64, 0, False, None)
    pieces.left_boundary()
    pieces.restart()
    assert pieces.tally is None and not pieces.at_boundary


def test_a_cut_back_cuts_the_routed_experts_with_the_tokens() -> None:
    """The rows of the forwards that made the kept tokens stay (re-encoded where the cut falls inside a part);
    the sequence's own experts part is cut through its method, never edited from outside."""
    seq = SequenceState(decode({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8},
                                "return_routed_experts": True}).sequences[0].body, "r")
    experts = seq.experts
    assert experts is not None and (experts.start, experts.end) == (0, 0)
    row = 8  # bytes a row: 2 layers x top-1 x int32
    experts.add(bytes(range(6 * row)), 7)  # positions 0..5: the prompt's 3 forwards and 3 tokens'
    experts.add(bytes(range(100, 100 + 2 * row)), 9)  # positions 6..7
    seq.output_ids.extend([5, 6, 7, 8, 9, 10])
    seq.segments[:] = [Segment("a", "a:1", "0", 0, 6, "running")]
    seq.versions[:] = [0]
    seq.cut_back(2, "quarantined")  # keeps tokens 0..1, made by the forwards at positions 2 and 3
    assert experts.end == 4 and experts.rows == bytes(range(4 * row))
    assert list(seq.output_ids) == [5, 6]
