"""Memory per token in flight (issue 28): a sequence's tokens cost the manager about 4 bytes each while
it runs, and nothing of the bytes read or the chunks parsed stays while the stream waits for more."""

from __future__ import annotations

import asyncio
import gc
import time
import tracemalloc
from array import array
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from rollout_manager import jsonutil
from rollout_manager.rollout.answers import final_output, partial_output
from rollout_manager.rollout.progress import BadChunk, SequenceProgress, token_array
from rollout_manager.rollout.sequence import SequenceState
from rollout_manager.sglang import wire
from rollout_manager.sglang.client import CallBounds, stream_generate
from rollout_manager.sglang.finish import NO_META
from rollout_manager.sglang.generate_request import SequenceBody, continuation, encode
from rollout_manager.sglang.sse import sse_frame
from rollout_manager.sglang.wire import GenerateChunk

CHUNK = 1000  # ids per frame (the manager asks for a chunk per 64 tokens; larger frames are harsher)
FRAMES = 200
HELD = CHUNK * FRAMES  # tokens the stream holds in flight before its last frame


def _frame(ids: list[int], total: int, last: bool) -> bytes:
    meta = {"id": "m", "finish_reason": wire.finish_reason(wire.LENGTH, length=total) if last else None,
            "prompt_tokens": 3, "weight_version": "0", "completion_tokens": total, "cached_tokens": 0}
    return sse_frame({"text": None, "output_ids": ids, "meta_info": meta})


@pytest.fixture
async def held_stream() -> AsyncIterator[tuple[str, asyncio.Event]]:
    """An engine that sends :data:`HELD` tokens (incremental chunks, all in one write), then waits for
    the event before its last token and ``[DONE]``."""
    release = asyncio.Event()

    async def generate(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        # ids past 256: Python caches small ints, real vocabularies' ids are mostly larger
        await resp.write(b"".join(_frame([1000 + (k * CHUNK + i) % 50_000 for i in range(CHUNK)], (k + 1) * CHUNK,
                                         False) for k in range(FRAMES)))
        await release.wait()
        await resp.write(_frame([7], HELD + 1, True) + wire.DONE_FRAME)
        return resp

    app = web.Application()
    app.router.add_post(wire.GENERATE, generate)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield f"http://127.0.0.1:{server.port}", release
    finally:
        release.set()
        await server.close()


async def test_tokens_in_flight_cost_about_four_bytes_each(held_stream: tuple[str, asyncio.Event]) -> None:
    url, release = held_stream
    seq = SequenceState(body=SequenceBody.of({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": HELD + 1}}),
                        rid="m")
    progress = SequenceProgress(seq.output_ids, seq.logprobs, limit=HELD + 1, vocab_size=2**20)

    async with aiohttp.ClientSession() as session:
        async def consume() -> None:
            body = continuation(seq.body, seq.output_ids, rid="m")
            async for chunk in stream_generate(session, url, body, CallBounds(5.0, 30.0)):
                progress.apply(chunk)
                del chunk  # as the manager's relay does (rollout.generation)

        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            task = asyncio.ensure_future(consume())
            deadline = time.monotonic() + 30
            while progress.made < HELD:  # the stream now waits for the engine's last frame
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.01)
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        release.set()
        await asyncio.wait_for(task, 30)

    # The tokens (4 bytes each, plus the array's growth room), and no more than a connection's worth beside:
    # a list of ints costs about 40 bytes a token, and the last read's bytes and parsed chunks several more.
    assert held / HELD < 6, f"{held / HELD:.1f} bytes per token in flight"
    assert held - seq.output_ids.buffer_info()[1] * 4 < 200_000, f"{held} bytes held beside the tokens"
    assert isinstance(seq.output_ids, array) and seq.output_ids.itemsize == 4
    assert seq.output_ids.tolist() == [1000 + i % 50_000 for i in range(HELD)] + [7]


def test_results_and_partial_chunks_are_json_lists() -> None:
    """Callers get lists of ints, whatever the manager keeps inside."""
    ids = token_array([5, 300, 70_000])
    body = SequenceBody.of({"input_ids": [1, 2], "return_logprob": False})
    final = final_output(body, rid="r", output_ids=ids, logprobs=[], finish=None, engine_meta=NO_META,
                              segments=[], text=None, e2e_latency=0.0, index=None).to_json()
    partial = partial_output(body, rid="r", output_ids=ids, logprobs=[], weight_version="0", index=None).to_json()
    cont = continuation(body, ids, rid="r~1")
    for out in (final["output_ids"], partial["output_ids"], cont.input_ids):
        assert type(out) is list
    assert jsonutil.loads(jsonutil.dumps(final))["output_ids"] == [5, 300, 70_000]
    assert jsonutil.loads(encode(cont))["input_ids"] == [1, 2, 5, 300, 70_000]


def test_bad_ids_are_refused_before_anything_is_kept() -> None:
    p = SequenceProgress(token_array([9]), limit=10, vocab_size=100)
    for ids, why in (([1, True], "not an integer"), ([1, -1], "outside the vocabulary"),
                     ([1, 100], "outside the vocabulary"), ([1.0], "not an integer"), ([2**40], "outside")):
        with pytest.raises(BadChunk, match=why):
            p.apply(GenerateChunk.of({"output_ids": ids, "meta_info": {"completion_tokens": len(ids)}}))
        assert p.output_ids.tolist() == [9] and p.made == 0
