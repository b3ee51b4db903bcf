"""An instance's parts each have one writer, and the status shape built from them stays as it was."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from ast_writes import assigned

from rollout_manager.instances.instance import EngineFacts
from rollout_manager.instances.registry import Kind, Registry

ROOT = Path(__file__).resolve().parents[1]
REGISTRY, HEALTH, CAPACITY = "instances/registry.py", "instances/health.py", "placement/capacity.py"
# Each part's fields, by the one module of rollout_manager/ that may assign them (see instances/instance.py).
OWNER = {
    **dict.fromkeys(("state", "state_since", "waiting_for", "last_error", "last_error_at", "weight_version",
                     "sender", "group", "box_token_digest", "declared_vocab_size", "versions", "load", "health"),
                    REGISTRY),
    **dict.fromkeys(("in_flight", "in_flight_tokens", "max_in_flight", "last_chunk_at"), CAPACITY),
    **dict.fromkeys(("consecutive_failures", "failures_total", "engine"), HEALTH),
}
# Same names on other objects: a segment's own weight version, what a policy sees of an instance (InstanceLoad).
NOT_AN_INSTANCE = {("rollout/attempt_segments.py", "seg.weight_version"),
                   ("placement/fleet_model.py", "load.in_flight_tokens"),
                   ("placement/fleet_model.py", "load.max_in_flight")}


def assignments(path: Path) -> list[tuple[int, str, str]]:
    """(line, target, field) of every assignment to one of OWNER's names on something other than ``self``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        for t in assigned(node):
            if isinstance(t, ast.Attribute) and t.attr in OWNER \
                    and not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                found.append((node.lineno, ast.unparse(t), t.attr))
    return found


def test_each_part_of_an_instance_is_written_by_its_owner_only() -> None:
    strays = []
    for path in sorted((ROOT / "rollout_manager").rglob("*.py")) + sorted((ROOT / "trainer_plugin").rglob("*.py")):
        if "Instance" not in path.read_text():  # strict typing names the type wherever one is handled
            continue  # (a connection's own ``state`` is not an instance's)
        module = path.relative_to(ROOT / "rollout_manager").as_posix() if "rollout_manager" in path.parts else str(path)
        for line, target, name in assignments(path):
            if OWNER[name] != module and (module, target) not in NOT_AN_INSTANCE:
                strays.append(f"{module}:{line}: {target} (owned by {OWNER[name]})")
    assert strays == []
    assert assignments(ROOT / "rollout_manager" / CAPACITY), "the check finds the owner's own writes"


def test_engine_facts_are_replaced_whole_never_edited() -> None:
    facts = EngineFacts(vocab_size=100)
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts.vocab_size = 50  # type: ignore[misc]


def test_identity_is_set_at_registration_and_the_status_shape_is_unchanged() -> None:
    registry = Registry(clock=lambda: 5.0, wall=lambda: 1000.0)
    inst = registry.add("127.0.0.1", 30000, Kind.REMOTE, 17000, 18000, declared_vocab_size=512,
                        box_token_digest="d" * 64)
    second = registry.add("127.0.0.1", 30001, Kind.REMOTE)
    assert (inst.order, second.order) == (1, 2)
    assert inst.box_token_digest == "d" * 64 and inst.declared_vocab_size == 512
    assert inst.engine == EngineFacts(vocab_size=512)  # what the launcher declared, until the engine says more
    registry.set_error(inst, "boom")
    assert (inst.last_error, inst.last_error_at) == ("boom", 1000.0)
    status = inst.to_dict(7.5)
    assert list(status) == [
        "id", "endpoint", "host", "port", "kind",
        "preemptible", "price_per_hour",  # what the box said it is at registration (issue 50)
        "state", "state_for_s", "weight_version", "sender", "group",
        "mooncake_handshake_port", "weight_receiver_port", "in_flight", "in_flight_tokens",
        "consecutive_failures", "failures_total", "last_error", "last_error_at", "waiting_for",
        "quarantined",  # taken out of service by the quarantine (issue 39)
        "streaming",
        "server_stream_interval", "max_running_requests", "vocab_size",
        "vocab_checked", "ids_served",  # what the trust probe may send it (issue 46)
        "routed_experts",
        "speculative_algorithm",  # --speculative-algorithm from /server_info (issue 40)
        "max_in_flight",
        "trust",  # the trust probe's record (issue 39): provisional until a probe at its version passed
    ]
    assert status["trust"]["state"] == "provisional" and status["trust"]["probes"] == 0
    assert status["state_for_s"] == 2.5 and status["vocab_size"] == 512 and status["in_flight"] == 0
    assert status["endpoint"] == "127.0.0.1:30000" and inst.url == "http://127.0.0.1:30000"
