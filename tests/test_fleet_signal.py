"""The scaling signal end to end: a manager and a CPU engine over real HTTP; the boxes wanted show in /metrics and
in /get_instances_status while a step runs, and go to zero once it is over."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families
from support import async_wait_until

WANTED = "rollout_manager_fleet_boxes_wanted"
KIND = "preemptible_1.5_per_hour"  # what the box registered: preemptible, and its price


async def gauges(m) -> dict[tuple[str, str], float]:
    """(sample name, kind label) -> value of the fleet_* samples."""
    async with m.session.get(m.url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    return {(s.name, s.labels.get("kind", s.labels.get("where", ""))): s.value
            for f in text_string_to_metric_families(text) if f.name.startswith("rollout_manager_fleet")
            for s in f.samples}


async def test_boxes_wanted_appear_while_a_step_runs_and_go_to_zero_after_it(start_manager, start_engines) -> None:
    m = await start_manager(scale_target_step_s="120")
    # Two sequences at a time on the box: the other six wait in the manager, as a step's queue does.
    (engine,) = await start_engines(["--max-running-requests", "2", "--token-delay-s", "0.01"])
    status, answer = await m.post("/register_rollout_instance", {"host": "127.0.0.1", "port": engine.port,
                                                                 "preemptible": True, "price_per_hour": 1.5})
    assert status == 200, answer
    await async_wait_until(lambda: m._is_active(engine.endpoint), message="the box active")
    params = {"max_new_tokens": 80, "temperature": 0.0, "ignore_eos": True}
    step = asyncio.gather(*(m.post("/generate", {"input_ids": [5 + k, 6, 7], "sampling_params": params})
                            for k in range(8)))
    try:
        seen: dict[str, object] = {}

        async def busy() -> bool:
            g = await gauges(m)
            st = (await m.get("/get_instances_status"))[1]["fleet_demand"]
            seen.update(g=g, st=st)
            return g.get((WANTED, KIND), 0) >= 1 and st["waiting_sequences"] > 0

        await async_wait_until(busy, 30.0, message=lambda: f"the step's demand never showed: {seen}")
        g, st = seen["g"], seen["st"]
        assert g[("rollout_manager_fleet_boxes", KIND)] == 1  # type: ignore[index]
        assert g[("rollout_manager_fleet_target_seconds", "")] == 120  # type: ignore[index]
        assert g[("rollout_manager_fleet_predicted_tokens", "waiting")] > 0  # type: ignore[index]
        (kind,) = st["kinds"]  # type: ignore[index]
        assert kind["kind"] == KIND and kind["preemptible"] and kind["price_per_hour"] == 1.5
        assert kind["boxes"] == 1 and kind["wanted"] >= 1
        assert st["target_s"] == 120 and st["wanted_boxes"] >= 1  # type: ignore[index]
    finally:
        answers = await step
    assert all(status == 200 for status, _ in answers), answers

    async def drained() -> bool:
        g = await gauges(m)
        st = (await m.get("/get_instances_status"))[1]["fleet_demand"]
        seen.update(g=g, st=st)
        return g.get((WANTED, KIND)) == 0 and st["wanted_boxes"] == 0 and st["waiting_sequences"] == 0

    await async_wait_until(drained, 10.0, message=lambda: f"the demand did not go to zero: {seen}")
    assert seen["st"]["kinds"][0]["boxes"] == 1  # type: ignore[index]  # the box is still there, just not wanted
