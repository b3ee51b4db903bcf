"""A weight push's record (weights.push_record.WeightPush): the status page's entry keeps its keys."""

from __future__ import annotations

import dataclasses

from rollout_manager.weights.push_record import WeightPush

KEYS = {"instance", "endpoint", "version", "sender", "group", "ip", "transport", "mode", "source", "bytes",
        "full_bytes", "transfer_s", "gbps", "verify_s", "load_s", "apply_s", "reloaded", "total_s", "at"}


def test_the_status_entry_names_the_optional_keys_only_where_they_say_something() -> None:
    push = WeightPush("i1", "h:1", 3, 0, 1, "10.0.0.1", "mooncake", "full", "sender:0", 100, 100, 0.5, 2e-7,
                      0.1, 0.2, None, 7, 0.9, 1.0)
    assert set(push.to_json()) == KEYS and not push.from_peer
    fallback = dataclasses.replace(push, peer_failed="h:2: timed out")
    assert fallback.to_json()["peer_failed"] == "h:2: timed out" and set(fallback.to_json()) == KEYS | {"peer_failed"}
    pulled = dataclasses.replace(push, source="peer:h:2", checksums_from="manager")
    assert pulled.from_peer and set(pulled.to_json()) == KEYS | {"checksums_from"}
