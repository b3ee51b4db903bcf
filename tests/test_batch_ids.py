"""``/batch_generate_requests`` answers every id exactly once, whatever its request does: a result, the
manager's refusal with its status, 500 for anything unexpected or an answer that cannot be encoded; and a
caller that goes away cancels what still runs, which then answers nothing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any

from test_batch_window import generator

from rollout_manager.instances.registry import Registry
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.least_in_flight import LeastInFlight
from rollout_manager.rollout.batch import run_batch_ndjson
from rollout_manager.rollout.generation import GenerationFailed
from rollout_manager.rollout.request import Request, decode


async def test_every_id_is_answered_once_and_a_cancelled_request_not_at_all() -> None:
    g = generator(Dispatcher(Registry(), LeastInFlight()))
    forever = asyncio.Event()
    started: list[int] = []

    async def run(kind: int, answer: Callable[[Any], None] | None) -> Any:
        assert answer is not None
        started.append(kind)
        await asyncio.sleep(0)  # each one ends after it started running, as a sequence does
        if kind == 0:
            answer({"output_ids": [7]})
            return {}
        if kind == 1:
            raise GenerationFailed(503, "no instance")
        if kind == 2:
            raise RuntimeError("a bug")
        if kind == 3:
            answer({"unencodable": object()})
            return {}
        if kind == 5:  # a batched request's list: returned, not handed over
            return [{"output_ids": [8]}]
        await forever.wait()  # kind 4: still running when the caller goes away

    def generate(request: Request, answer: Callable[[Any], None] | None = None) -> Coroutine[Any, Any, Any]:
        return run(request.sequences[0].body.input_ids[0], answer)

    g.generate = generate  # type: ignore[method-assign]
    items = [(f"r{k}", decode({"input_ids": [k % 6, 1]})) for k in range(24)]
    lines: list[dict[str, Any]] = []
    results = run_batch_ndjson(g, items, max_unsent_bytes=1 << 20)
    while len(lines) < 20:
        lines += [json.loads(line) for line in (await results.__anext__()).splitlines()]
    await results.aclose()  # the caller went away: the four requests still running are cancelled
    await asyncio.sleep(0)

    by_id = {line["id"]: line for line in lines}
    assert len(lines) == len(by_id) == 20 and sorted(started) == sorted(k % 6 for k in range(24))
    for k in range(24):
        line = by_id.get(f"r{k}")
        if k % 6 == 0:
            assert line == {"id": f"r{k}", "success": True, "data": {"output_ids": [7]}}
        elif k % 6 == 1:
            assert line == {"id": f"r{k}", "success": False, "status_code": 503, "error": "no instance"}
        elif k % 6 == 2:
            assert line == {"id": f"r{k}", "success": False, "status_code": 500, "error": "internal error: a bug"}
        elif k % 6 == 3:
            assert line is not None and line["success"] is False and line["status_code"] == 500
        elif k % 6 == 5:
            assert line == {"id": f"r{k}", "success": True, "data": [{"output_ids": [8]}]}
        else:
            assert line is None
    assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
