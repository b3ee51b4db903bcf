"""Coalescing verl's per-sample generate calls into batch requests (trainer_plugin.request_batcher).

Real manager and CPU engine processes on 127.0.0.1; the outputs are checked against the engine's
reference model, so a batched call must give exactly what a single /generate gives.
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
from support import async_wait_until

from rollout_manager.cpu_engine.model import build_model, reference_generate
from trainer_plugin.client import ManagerClient, ManagerHTTPError
from trainer_plugin.request_batcher import RequestBatcher

GREEDY = {"temperature": 0.0}
pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:Ray state API is no longer experimental:DeprecationWarning")]


@pytest.fixture(scope="module")
def model():
    return build_model(0)


async def serving(start_manager, start_engines, *flag_sets):
    m = await start_manager()
    engines = await start_engines(*flag_sets)
    await m.register(*engines)
    return m, engines


def body(prompt, max_new_tokens):
    return {"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": max_new_tokens},
            "return_logprob": True}


async def test_concurrent_calls_go_out_as_one_batch_with_exact_results(start_manager, start_engines, model):
    m, _ = await serving(start_manager, start_engines, [], [])
    prompts = [[(i * 7 + j) % 200 + 1 for j in range(3 + i % 4)] for i in range(24)]
    async with ManagerClient(m.url) as client:
        batcher = RequestBatcher(client, window_s=0.05)
        results = await asyncio.gather(*(batcher.generate(body(p, 6)) for p in prompts))
        assert (batcher.batches_sent, batcher.requests_sent) == (1, 24)
        for prompt, result in zip(prompts, results):
            ids, lps = reference_generate(model, prompt, 6)
            assert result["output_ids"] == ids
            assert [x[0] for x in result["meta_info"]["output_token_logprobs"]] == pytest.approx(lps, abs=1e-4)
            assert result["meta_info"]["segments"][0]["weight_version"] == "0"

        # max_batch splits what gathered; a later call opens a new window
        small = RequestBatcher(client, window_s=0.05, max_batch=4)
        await asyncio.gather(*(small.generate(body(p, 2)) for p in prompts[:10]))
        assert (small.batches_sent, small.requests_sent) == (3, 10)
        await small.generate(body(prompts[0], 2))
        assert small.batches_sent == 4
        # and so does a prompt-token budget (it keeps a batch body inside the manager's size limit)
        by_tokens = RequestBatcher(client, window_s=0.05, max_batch_tokens=10)
        await asyncio.gather(*(by_tokens.generate(body([1, 2, 3, 4], 2)) for _ in range(6)))
        assert (by_tokens.batches_sent, by_tokens.requests_sent) == (3, 6)  # 4 + 4 + 4 > 10: two per batch
        await by_tokens.close()
        await batcher.close()
        await small.close()


async def test_each_caller_gets_its_own_result_as_soon_as_it_is_done(start_manager, start_engines):
    m, _ = await serving(start_manager, start_engines, ["--token-delay-s", "0.01"])
    async with ManagerClient(m.url) as client:
        batcher = RequestBatcher(client, window_s=0.05)
        done_order: list[str] = []

        async def call(name, n):
            result = await batcher.generate(body([1, 2, 3], n))
            done_order.append(name)
            return result

        long = asyncio.ensure_future(call("long", 120))
        short = asyncio.ensure_future(call("short", 3))
        bad = asyncio.ensure_future(batcher.generate(body([1, 100000], 3)))  # not a token id: the engine says 400
        assert len((await short)["output_ids"]) == 3
        assert not long.done()  # the short one did not wait for its batch-mate
        with pytest.raises(ManagerHTTPError) as err:
            await bad
        assert err.value.status == 400 and "token id" in str(err.value)
        assert len((await long)["output_ids"]) == 120
        assert done_order == ["short", "long"] and batcher.batches_sent == 1
        await batcher.close()


async def test_cancelled_callers_leave_and_a_batch_nobody_waits_for_is_aborted(start_manager, start_engines):
    m, (engine,) = await serving(start_manager, start_engines, ["--token-delay-s", "0.02"])

    async def in_flight():
        status = await m.status()
        return sum(i["in_flight"] for i in status["instances"])

    async with ManagerClient(m.url) as client:
        batcher = RequestBatcher(client, window_s=0.02)
        calls = [asyncio.ensure_future(batcher.generate(body([5, 6, 7], 500))) for _ in range(3)]
        await async_wait_until(lambda: _equals(in_flight, 3), message="3 sequences running")
        calls[0].cancel()
        # the stream still carries the other two, so nothing is aborted (one sequence runs on unawaited)
        assert await in_flight() == 3 and not calls[1].done()
        for call in calls[1:]:
            call.cancel()
        await async_wait_until(lambda: _equals(in_flight, 0), message="the manager aborted the abandoned batch")
        assert all(c.cancelled() for c in calls)
        # the batcher still works afterwards
        assert len((await batcher.generate(body([5, 6, 7], 2)))["output_ids"]) == 2
        await batcher.close()


async def _equals(fn, value):
    return await fn() == value


@pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl 0.9.1 is not installed")
async def test_proxy_batches_verl_generate_calls(start_manager, start_engines, model):
    from trainer_plugin.proxy import ManagerProxyServer

    m, _ = await serving(start_manager, start_engines, [])
    params = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    batched = ManagerProxyServer(m.url, prompt_length=8, response_length=5, batch_window_s=0.05)
    single = ManagerProxyServer(m.url, prompt_length=8, response_length=5, batch_window_s=0)
    try:
        prompts = [[i + 1, i + 2] for i in range(8)]
        outs = await asyncio.gather(*(batched.generate(p, params, f"r{i}") for i, p in enumerate(prompts)))
        assert batched.batching_stats() == {"batches": 1, "requests": 8}
        for p, out in zip(prompts, outs):
            assert out.token_ids == reference_generate(model, p, 5)[0]
            assert out.extra_fields["global_steps"] == 0
        one = await single.generate(prompts[0], params, "s0")
        assert one.token_ids == outs[0].token_ids and single.batching_stats() == {"batches": 0, "requests": 0}
    finally:
        await batched.close()
        await single.close()
