"""A manager, a trainer-side sender and CPU-engine boxes for the end-to-end weight tests (delta pushes,
peer bootstrap), and the checks they share: what an engine holds against what the trainer staged."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import torch
from support import Box, async_wait_until, free_port

from rollout_manager.cpu_engine.model import tensor_checksum
from rollout_manager.weights.sender_agent import SenderAgent

SENDER_IPS = ["127.0.0.1"]
Fleet = tuple[Any, SenderAgent, Callable[..., Awaitable[Box]]]


async def engine_checksums(url: str) -> dict[str, str]:
    """The engine's per-tensor checksums of what it serves."""
    async with aiohttp.ClientSession() as s, s.get(url + "/debug/state_dict_checksum") as r:
        return dict((await r.json())["tensors"])


def expected_checksums(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """What an engine that loaded ``weights`` reports (it holds them in float32)."""
    return {n: tensor_checksum(t.to(torch.float32)) for n, t in weights.items()}


async def publish(m: Any, sender: SenderAgent, step: int, *,
                  make: Callable[[int], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stage ``make(step)`` as version ``step`` and wait until every instance has it."""
    ws = make(step)
    await asyncio.to_thread(sender.stage, ws, step)
    status, res = await m.post("/update_weight_version", {"wait_for_instances": "all", "timeout_s": 60})
    assert status == 200 and not res["timed_out"], res
    return ws


@asynccontextmanager
async def weight_fleet(start_manager: Callable[..., Awaitable[Any]], tmp_path: Path, model: dict[str, int],
                       transport: str, **settings: str) -> AsyncIterator[Fleet]:
    """A manager (fast retries, ``settings`` on top), one sender on 127.0.0.1 with 4 engines, and
    ``add_box(*receiver_flags)``, which starts a box and waits until it is active. All stopped at the end."""
    sender_port = free_port()
    fast = {"weight_push_retry_s": "0.2", "weight_push_max_attempts": "2"}  # ``settings`` may override them
    m = await start_manager(weight_sender_base_port=str(sender_port), allowed_sender_ips="127.0.0.0/8",
                            weight_transport=transport, **{**fast, **settings})
    sender = SenderAgent(SENDER_IPS, sender_port).start()
    boxes: list[Box] = []

    async def active(box: Box) -> bool:
        return bool(await m.state_of(box.endpoint) == "active")

    async def add_box(*flags: str) -> Box:
        box = Box(tmp_path, json.dumps(model), *flags)
        boxes.append(box)
        await box.ready()
        await m.register(box, wait_active=False)
        await async_wait_until(lambda: active(box), timeout_s=60, message="box active")
        return box

    try:
        status, _ = await m.put_senders([SENDER_IPS], 1, engines=4)
        assert status == 200
        yield m, sender, add_box
    finally:  # boxes first: nothing may outlive the test, whatever failed
        for box in boxes:
            box.stop()
        sender.stop()
