"""Evacuation's lifecycle in one process (a manager behind its real HTTP app, no engines): only a cancelled notice
takes a box out of evacuating, into syncing when a weight version came out meanwhile."""

from __future__ import annotations

from rollout_manager.instances.registry import Kind, State


async def test_a_cancelled_notice_returns_a_box_that_missed_a_version_through_syncing(api) -> None:
    manager, client = api
    inst = manager.registry.add("127.0.0.1", 9, Kind.REMOTE)
    assert manager.registry.transition(inst, State.ACTIVE, "test: healthy")
    r = await client.post("/evacuate_instance", json={"endpoint": "http://127.0.0.1:9", "deadline_s": 60})
    assert r.status == 200, await r.text()
    assert inst.state == State.EVACUATING
    # nothing but its evacuation brings it back: a weight push that ended, an activation that failed
    assert not manager.registry.transition(inst, State.ACTIVE, "test: a push ended")
    assert not manager.registry.transition(inst, State.SYNCING, "test: an activation failed")
    manager.version.current = 1  # a version came out while it was evacuating (it got no push)
    r = await client.post("/cancel_evacuation", json={"endpoint": "127.0.0.1:9"})
    body = await r.json()
    assert r.status == 200 and body["state"] == "syncing", body
    assert inst.state == State.SYNCING and "evacuation cancelled" in manager.registry.events[-1].reason
    r = await client.post("/cancel_evacuation", json={"endpoint": "127.0.0.1:9"})
    assert r.status == 409 and "not evacuating" in (await r.json())["error"]

