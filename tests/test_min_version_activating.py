"""``min_weight_version`` against a box in the middle of a staged activation (issue 31, items 2-3).

From the pause on, the manager names the box at the new version (``Instance.weight_version``) while
``BoxVersions`` says it still serves the old one until the load is done. A sequence that asked for the new
version must not be placed there in that window: the request may reach SGLang before its pause and make
tokens with the old weights. In process over a fake engine that serves the old version until the test
finishes the activation.
"""

from __future__ import annotations

import asyncio
from typing import Any

from support import async_wait_until
from test_min_weight_version import activate, body, fleet, versions  # noqa: F401 (fleet: the fixture)

from rollout_manager.rollout.request import decode


async def test_a_box_still_loading_the_version_does_not_take_a_request_that_needs_it(fleet: Any) -> None:  # noqa: F811
    generator, registry, fakes = fleet
    (inst,) = activate(registry, fakes[:1], [0])
    inst.versions.activating, inst.versions.serving_before = 1, 0  # what sync.py sets from the pause on
    inst.weight_version = 1
    task = asyncio.ensure_future(generator.generate(decode(body(4, min_weight_version=1))))
    try:
        capacity = generator.dispatcher.capacity
        await async_wait_until(lambda: fakes[0].requests or capacity.waiting, 10.0, interval_s=0.01,
                               message="the request placed or queued")
        assert not fakes[0].requests, "sent to a box that still serves version 0 (its activation has not loaded)"
        fakes[0].weight_version = "1"  # the activation is done: the box serves version 1
        inst.versions.activating = inst.versions.serving_before = None
        generator.dispatcher.recovered(inst)  # what WeightSync.on_serving does in the manager
        out = await asyncio.wait_for(task, 10)
    finally:
        task.cancel()
    assert versions(out) == [1]
