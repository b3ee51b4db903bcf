"""Differential contract tests: the same request goes to real SGLang 0.5.23 (on CPU, started through
scripts/launch_sglang.sh) and to the project's CPU engine, and both must answer with the same status and
the same shape. Each test also asserts what SGLang does, so both cannot be wrong the same way.

Two pairs of engines, one per streaming mode (incremental chunks, the launcher's default; cumulative
chunks, SGLang's own default), each started once for the module. The real servers are registered with a
manager whose health probes are rare, so nothing but the test's own requests runs on them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from real_sglang import Daemon, RealBox, start_box, start_cpu_engine, start_manager

from rollout_manager.cpu_engine.model import build_model
from rollout_manager.sglang import tensor_payload, wire

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow]

CONTEXT = 1024  # the tiny model's context length (tests/real_sglang_model.py); the CPU engine is told the same
LONG = 1000  # tokens of a request that is still running when the test acts on it
PROMPT = [5, 6, 7]  # ids inside both vocabularies (CPU engine 256, real model 1,024)


@dataclass
class Pair:
    """One real SGLang and one CPU engine in the same streaming mode."""

    real: str
    cpu: str

    def both(self) -> list[tuple[str, str]]:
        return [("real", self.real), ("cpu", self.cpu)]


@pytest.fixture(scope="module")
def contract_manager(tmp_path_factory: pytest.TempPathFactory) -> Any:
    manager = start_manager(tmp_path_factory.mktemp("contract"), health_check_interval_s="600")
    try:
        yield manager
    finally:
        manager.stop()


def _pair(model_dir: Path, manager: Daemon, log_dir: Path, incremental: bool) -> Any:
    flags = ("--incremental-streaming-output",) if incremental else ()
    cpu_url, cpu = start_cpu_engine(log_dir, "--context-length", str(CONTEXT), *flags)
    box: RealBox | None = None
    try:
        # Both told the context length, so both report the flag in /server_info.
        box = start_box(model_dir, manager.url, log_dir, "--context-length", str(CONTEXT),
                        name="incremental" if incremental else "cumulative",
                        launcher_flags=() if incremental else ("--no-incremental-streaming",))
        yield Pair(box.url, cpu_url), box
    finally:
        if box is not None:
            box.stop()
        cpu.stop()


@pytest.fixture(scope="module")
def incremental(real_sglang_model: Path, contract_manager: Daemon, tmp_path_factory: pytest.TempPathFactory) -> Any:
    yield from _pair(real_sglang_model, contract_manager, tmp_path_factory.mktemp("incremental"), True)


@pytest.fixture(scope="module")
def cumulative(real_sglang_model: Path, contract_manager: Daemon, tmp_path_factory: pytest.TempPathFactory) -> Any:
    yield from _pair(real_sglang_model, contract_manager, tmp_path_factory.mktemp("cumulative"), False)


@pytest.fixture
def pair(incremental: tuple[Pair, RealBox]) -> Pair:
    return incremental[0]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        yield s


# ------------------------------------------------------------------ requests and shapes


def greedy(n: int, **params: Any) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **params}


async def call(s: aiohttp.ClientSession, url: str, path: str, body: Any = None) -> tuple[int, Any]:
    method = "GET" if body is None else "POST"
    async with s.request(method, url + path, json=body) as r:
        text = await r.text()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text


Action = Callable[[], Awaitable[Any]]


async def stream(s: aiohttp.ClientSession, url: str, body: dict[str, Any],
                 on_first: Action | None = None) -> tuple[int, list[Any], Any]:
    """POST a streaming /generate; ``on_first`` runs once the first chunk is in (the request is running),
    while the stream goes on being read. Returns (status, frames with "[DONE]" kept, what on_first returned)."""
    frames: list[Any] = []
    acted: asyncio.Task[Any] | None = None
    async with s.post(url + "/generate", json={**body, "stream": True}) as r:
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            frames.append(payload if payload == "[DONE]" else json.loads(payload))
            if on_first is not None and acted is None:
                acted = asyncio.ensure_future(on_first())
    return r.status, frames, (await acted) if acted is not None else None


async def running(s: aiohttp.ClientSession, url: str) -> bool:
    """SGLang's Prometheus gauge (both engines export it) says a request is running or queued."""
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    return any(line.split()[-1] not in ("0", "0.0") for line in text.splitlines()
               if line.startswith(("sglang:num_running_reqs", "sglang:num_queue_reqs")))


async def when_running(s: aiohttp.ClientSession, url: str, task: asyncio.Future[Any], timeout_s: float = 30) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await running(s, url):
        assert not task.done(), f"the request finished before it was seen running: {task.result()}"
        assert asyncio.get_running_loop().time() < deadline, "the request was never seen running"
        await asyncio.sleep(0.005)


def finish(out: dict[str, Any]) -> dict[str, Any] | None:
    return out["meta_info"]["finish_reason"]


def finish_shape(fin: dict[str, Any] | None) -> Any:
    """A finish_reason without its free text."""
    if fin is None:
        return None
    return {k: (v if k in ("type", "length", "status_code") else type(v).__name__) for k, v in fin.items()
            if not (k in ("status_code", "err_type") and v is None)}


def output_shape(out: dict[str, Any]) -> dict[str, Any]:
    """What a caller relies on in one /generate output, with the values that differ by model erased."""
    meta = out["meta_info"]
    shape: dict[str, Any] = {
        "keys": sorted(k for k in out if k in ("text", "output_ids", "meta_info", "index")),
        "n": len(out["output_ids"]),
        "finish": finish_shape(meta["finish_reason"]),
        "prompt_tokens": meta["prompt_tokens"],
        "completion_tokens": meta["completion_tokens"],
        "weight_version": meta["weight_version"],
        "weight_versions": meta.get("weight_versions"),
        "index": out.get("index"),
    }
    if "output_token_logprobs" in meta:
        shape["logprobs"] = [[type(lp).__name__, type(t).__name__, tx] for lp, t, tx in meta["output_token_logprobs"]]
    return shape


def error_shape(status: int, answer: Any) -> Any:
    """A refusal without its message text: the status and where the message sits."""
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        return status, "error.message", isinstance(answer["error"].get("message"), str)
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        return status, "error", True
    if isinstance(answer, dict) and "success" in answer:
        return status, "success", answer["success"]
    return status, type(answer).__name__


async def both(pair: Pair, scenario: Callable[[str], Awaitable[Any]]) -> Any:
    """Run a scenario against real SGLang, then the CPU engine; assert the same result; return it."""
    real = await scenario(pair.real)
    cpu = await scenario(pair.cpu)
    assert cpu == real, f"CPU engine differs from real SGLang:\n real: {real}\n cpu:  {cpu}"
    return real


# ------------------------------------------------------------------ /generate


async def test_generate_non_streaming(pair: Pair, http: aiohttp.ClientSession) -> None:
    async def scenario(url: str) -> Any:
        status, out = await call(http, url, "/generate", {"input_ids": PROMPT, "sampling_params": greedy(5)})
        return status, output_shape(out)

    status, shape = await both(pair, scenario)
    assert status == 200 and shape["n"] == 5 and shape["finish"] == {"type": "length", "length": 5}


async def test_generate_batch_non_streaming(pair: Pair, http: aiohttp.ClientSession) -> None:
    async def scenario(url: str) -> Any:
        status, outs = await call(http, url, "/generate", {"input_ids": [PROMPT, [8, 9]], "sampling_params": greedy(3)})
        return status, [output_shape(o) for o in outs]

    status, shapes = await both(pair, scenario)
    assert status == 200 and [s["prompt_tokens"] for s in shapes] == [3, 2]


async def test_return_logprob(pair: Pair, http: aiohttp.ClientSession) -> None:
    async def scenario(url: str) -> Any:
        status, out = await call(http, url, "/generate", {"input_ids": PROMPT, "sampling_params": greedy(3),
                                                          "return_logprob": True})
        return status, output_shape(out)

    status, shape = await both(pair, scenario)
    assert status == 200 and shape["logprobs"] == [["float", "int", None]] * 3


async def test_weight_versions_span_on_the_final_output(pair: Pair, http: aiohttp.ClientSession) -> None:
    """SGLang 0.5.23 reports which weight version made which tokens: ``weight_versions`` spans on the
    final output (the CPU engine lacked them)."""
    async def scenario(url: str) -> Any:
        status, out = await call(http, url, "/generate", {"input_ids": PROMPT, "sampling_params": greedy(4)})
        return status, out["meta_info"].get("weight_versions"), out["meta_info"]["weight_version"]

    status, spans, version = await both(pair, scenario)
    assert status == 200 and spans == [{"version": version, "start": 0, "end": 4}]


def stream_shape(frames: list[Any]) -> list[Any]:
    return ["[DONE]" if f == "[DONE]" else output_shape(f) if "meta_info" in f else {"error": error_shape(0, f)}
            for f in frames]


def without_chunk_size(shape: dict[str, Any]) -> dict[str, Any]:
    """An incremental chunk's shape without how many ids it carries: SGLang coalesces tokens into fewer
    chunks whenever its detokenizer or the reader falls behind the decoder, so that count is timing."""
    return {k: v for k, v in shape.items() if k != "n"}


async def test_stream_incremental(pair: Pair, http: aiohttp.ClientSession) -> None:
    async def scenario(url: str) -> Any:
        status, frames, _ = await stream(http, url, {"input_ids": PROMPT, "sampling_params": greedy(4)})
        _, whole = await call(http, url, "/generate", {"input_ids": PROMPT, "sampling_params": greedy(4)})
        ids = [t for f in frames if f != "[DONE]" for t in f["output_ids"]]
        # Chunks are deltas; how many there are depends on timing (SGLang may send fewer than tokens).
        final = without_chunk_size(stream_shape(frames)[-2])
        return status, final, ids == whole["output_ids"] and frames[-1] == "[DONE]"

    status, final, same = await both(pair, scenario)
    assert status == 200 and same and final["finish"] == {"type": "length", "length": 4}


async def test_stream_cumulative(cumulative: tuple[Pair, RealBox], http: aiohttp.ClientSession) -> None:
    pair = cumulative[0]

    async def scenario(url: str) -> Any:
        status, frames, _ = await stream(http, url, {"input_ids": PROMPT, "sampling_params": greedy(4)})
        _, whole = await call(http, url, "/generate", {"input_ids": PROMPT, "sampling_params": greedy(4)})
        outs = [f["output_ids"] for f in frames[:-1]]
        # Every chunk repeats the whole output so far (how many chunks there are depends on timing).
        growing = all(b[:len(a)] == a and len(b) > len(a) for a, b in zip(outs, outs[1:]))
        return status, stream_shape(frames)[-2], growing and outs[-1] == whole["output_ids"], frames[-1]

    status, final, same, done = await both(pair, scenario)
    assert status == 200 and same and done == "[DONE]" and final["n"] == 4


async def test_stream_batch_carries_index(pair: Pair, http: aiohttp.ClientSession) -> None:
    async def scenario(url: str) -> Any:
        status, frames, _ = await stream(http, url, {"input_ids": [PROMPT, [8, 9]], "sampling_params": greedy(2)})
        per_index: dict[int, list[Any]] = {}
        for f in frames[:-1]:
            per_index.setdefault(f["index"], []).append(f)
        # Per index: its final chunk's shape and all its ids (how they split into chunks is timing).
        outcome = {i: (without_chunk_size(output_shape(fs[-1])), sum(len(f["output_ids"]) for f in fs))
                   for i, fs in per_index.items()}
        return status, sorted(outcome.items()), frames[-1]

    status, per_index, last = await both(pair, scenario)
    assert status == 200 and [i for i, _ in per_index] == [0, 1] and last == "[DONE]"


async def test_stream_interval_per_request(pair: Pair, http: aiohttp.ClientSession) -> None:
    async def scenario(url: str) -> Any:
        body = {"input_ids": PROMPT, "sampling_params": greedy(7, stream_interval=3)}
        status, frames, _ = await stream(http, url, body)
        sizes = [s["n"] for s in stream_shape(frames)[:-1]]
        return status, {sum(sizes[:i + 1]) for i in range(len(sizes))}

    # Where each chunk ends, in tokens. The CPU engine sends the first token at once, then every 3; real
    # SGLang sends at the same points but coalesces chunks when its detokenizer or the reader falls behind
    # (under load [1, 3, 3] arrives as [4, 3]), so its ends are some of the CPU engine's, always the last.
    real_status, real_ends = await scenario(pair.real)
    cpu_status, cpu_ends = await scenario(pair.cpu)
    assert real_status == cpu_status == 200
    assert cpu_ends == {1, 4, 7}
    assert 7 in real_ends and real_ends <= cpu_ends, f"real SGLang's chunk ends {real_ends} are not the CPU engine's"


# ------------------------------------------------------------------ refusals


async def test_unknown_sampling_key_refused(pair: Pair, http: aiohttp.ClientSession) -> None:
    async def scenario(url: str) -> Any:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "seed": 1}}
        bad = await call(http, url, "/generate", body)
        return error_shape(*bad), "sampling_seed" in bad[1]["error"]

    assert await both(pair, scenario) == ((400, "error", True), True)


async def test_max_new_tokens_zero(pair: Pair, http: aiohttp.ClientSession) -> None:
    async def scenario(url: str) -> Any:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}}
        status, out = await call(http, url, "/generate", body)
        s_status, frames, _ = await stream(http, url, body)
        return status, output_shape(out), s_status, stream_shape(frames)

    status, shape, s_status, frames = await both(pair, scenario)
    assert status == s_status == 200 and shape["n"] == 0 and shape["finish"] == {"type": "length", "length": 0}
    assert len(frames) == 2


async def test_input_over_the_context_length_refused_with_400(pair: Pair, http: aiohttp.ClientSession) -> None:
    """Non-streaming: 400; streaming: an error frame (code 400) inside a 200 stream; in a batch the whole
    request is refused the same way."""
    too_long = [(i % 200) + 1 for i in range(CONTEXT + 3)]

    async def scenario(url: str) -> Any:
        single = await call(http, url, "/generate", {"input_ids": too_long, "sampling_params": {"max_new_tokens": 2}})
        batch = await call(http, url, "/generate", {"input_ids": [too_long, PROMPT],
                                                     "sampling_params": {"max_new_tokens": 2}})
        s_status, frames, _ = await stream(http, url, {"input_ids": too_long, "sampling_params": {"max_new_tokens": 2}})
        b_status, b_frames, _ = await stream(http, url, {"input_ids": [PROMPT, too_long],
                                                          "sampling_params": {"max_new_tokens": 2}})
        codes = [f["error"]["code"] for f in frames + b_frames if isinstance(f, dict) and "error" in f]
        return error_shape(*single), error_shape(*batch), s_status, b_status, codes, frames[-1], b_frames[-1]

    single, batch, s_status, b_status, codes, last, b_last = await both(pair, scenario)
    assert single == batch == (400, "error.message", True)
    assert s_status == b_status == 200 and codes == [400, 400] and last == b_last == "[DONE]"


async def test_input_plus_max_new_tokens_over_the_context_refused(pair: Pair, http: aiohttp.ClientSession) -> None:
    async def scenario(url: str) -> Any:
        body = {"input_ids": [(i % 200) + 1 for i in range(CONTEXT - 24)], "sampling_params": {"max_new_tokens": 100}}
        return error_shape(*await call(http, url, "/generate", body))

    assert await both(pair, scenario) == (400, "error.message", True)


# ------------------------------------------------------------------ aborts, pause and continue


def long_body(rid: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"input_ids": PROMPT, "sampling_params": greedy(LONG)}
    if rid is not None:
        body["rid"] = rid
    return body


def aborted_shape(status: int, frames: list[Any]) -> Any:
    outs = [f for f in frames if f != "[DONE]"]
    n = sum(len(f["output_ids"]) for f in outs)
    return status, finish_shape(finish(outs[-1])), 0 < n < LONG, frames[-1]


async def test_abort_request_ends_a_stream_with_its_partial_output(pair: Pair, http: aiohttp.ClientSession) -> None:
    async def scenario(url: str) -> Any:
        status, frames, acted = await stream(http, url, long_body("abort-stream"),
                                             lambda: call(http, url, "/abort_request", {"rid": "abort-stream"}))
        return acted[0], aborted_shape(status, frames)

    acted, shape = await both(pair, scenario)
    assert acted == 200 and shape == (200, {"type": "abort", "message": "str"}, True, "[DONE]")


async def test_abort_request_non_streaming_returns_partial_ids(pair: Pair, http: aiohttp.ClientSession) -> None:
    async def scenario(url: str) -> Any:
        task = asyncio.ensure_future(call(http, url, "/generate", long_body("abort-plain")))
        await when_running(http, url, task)
        acted = await call(http, url, "/abort_request", {"rid": "abort-plain"})
        status, out = await task
        return acted[0], status, finish_shape(finish(out)), 0 < len(out["output_ids"]) < LONG

    assert await both(pair, scenario) == (200, 200, {"type": "abort", "message": "str"}, True)


async def test_abort_one_request_inside_a_batch(pair: Pair, http: aiohttp.ClientSession) -> None:
    async def scenario(url: str) -> Any:
        body = {"input_ids": [PROMPT, [8, 9]], "sampling_params": greedy(300), "rid": ["batch-0", "batch-1"]}
        status, frames, acted = await stream(http, url, body,
                                             lambda: call(http, url, "/abort_request", {"rid": "batch-1"}))
        last = {f["index"]: finish_shape(finish(f)) for f in frames if f != "[DONE]" and finish(f) is not None}
        return status, acted[0], last

    status, acted, last = await both(pair, scenario)
    assert status == acted == 200
    assert last == {0: {"type": "length", "length": 300}, 1: {"type": "abort", "message": "str"}}


async def test_abort_all(pair: Pair, http: aiohttp.ClientSession) -> None:
    async def scenario(url: str) -> Any:
        status, frames, acted = await stream(http, url, long_body(),
                                             lambda: call(http, url, "/abort_request", {"abort_all": True}))
        return acted[0], aborted_shape(status, frames)

    acted, shape = await both(pair, scenario)
    assert acted == 200 and shape[1] == {"type": "abort", "message": "str"}


async def test_pause_generation_default_mode_aborts_in_flight_requests(pair: Pair, http: aiohttp.ClientSession) -> None:
    async def scenario(url: str) -> Any:
        try:
            status, frames, acted = await stream(http, url, long_body(),
                                                 lambda: call(http, url, "/pause_generation", {}))
        finally:
            resumed = await call(http, url, "/continue_generation", {})
        after = await call(http, url, "/generate", {"input_ids": PROMPT, "sampling_params": greedy(2)})
        return acted, aborted_shape(status, frames), resumed, after[0]

    acted, shape, resumed, after = await both(pair, scenario)
    assert acted == (200, {"message": "Generation paused successfully.", "status": "ok"})
    assert shape == (200, {"type": "abort", "message": "str"}, True, "[DONE]")
    assert resumed == (200, {"message": "Generation continued successfully.", "status": "ok"}) and after == 200


async def test_pause_in_place_then_continue_finishes_the_request(pair: Pair, http: aiohttp.ClientSession) -> None:
    async def scenario(url: str) -> Any:
        async def pause_and_continue() -> Any:
            paused = await call(http, url, "/pause_generation", {"mode": "in_place"})
            flush_while_paused = await call(http, url, "/flush_cache", {})
            return paused[0], flush_while_paused[0], (await call(http, url, "/continue_generation", {}))[0]

        status, frames, acted = await stream(http, url, {"input_ids": PROMPT, "sampling_params": greedy(200)},
                                             pause_and_continue)
        return status, acted, finish_shape(finish(frames[-2]))

    status, acted, fin = await both(pair, scenario)
    assert status == 200 and acted[0] == acted[2] == 200 and fin == {"type": "length", "length": 200}


async def test_a_load_inside_a_retract_pause_flushes_and_the_request_continues_under_the_new_version(
        pair: Pair, http: aiohttp.ClientSession, real_sglang_model: Path) -> None:
    """Staged activation's sequence (weights/activation.py): pause in 'retract' mode while a request runs, then
    the flush, a weight-update session, a load with a version, continue. Paused, the weight calls run at once
    (no waiting for the running request); 'retract' moved it to the waiting queue, so a flush without a timeout
    succeeds (one with a timeout waits for the queue to empty, and times out); the request then finishes every
    token, its chunks after the swap carry the new version."""
    async def scenario(url: str) -> Any:
        async def activate() -> Any:
            payload = [tensor_payload.serialize_named_tensors(own_tensor(url, pair, real_sglang_model))]
            load = wire.update_weights_from_tensor_body(payload, flush_cache=False, weight_version=None)
            steps = [await call(http, url, "/pause_generation", {"mode": "retract"}),
                     await call(http, url, "/begin_weight_update", {}),
                     await call(http, url, "/update_weights_from_tensor", load),
                     await call(http, url, "/end_weight_update", {}),
                     await call(http, url, "/flush_cache?timeout=0.5", {}),  # waits for the queue too: refused
                     await call(http, url, "/flush_cache", {}),
                     await call(http, url, "/update_weight_version",
                                {"new_version": "v-retract", "abort_all_requests": False}),
                     await call(http, url, "/continue_generation", {})]
            return [status for status, _ in steps]

        status, frames, acted = await stream(http, url, {"input_ids": PROMPT, "sampling_params": greedy(300)},
                                             activate)
        outs = [f for f in frames if f != "[DONE]"]
        versions = [f["meta_info"]["weight_version"] for f in outs]
        spans = outs[-1]["meta_info"].get("weight_versions") or []
        k = spans[0]["end"] if spans else None
        return (acted, status, finish_shape(finish(outs[-1])), versions[-1], versions[0] != "v-retract",
                [sp["version"] for sp in spans], k is not None and 0 < k < 300)

    acted, status, fin, last, first_old, span_versions, inside = await both(pair, scenario)
    assert acted == [200, 200, 200, 200, 400, 200, 200, 200] and status == 200
    assert fin == {"type": "length", "length": 300}
    assert last == "v-retract" and first_old and span_versions[-1] == "v-retract" and inside


async def test_an_in_place_pause_refuses_a_flush_and_a_load_that_asks_for_one(
        pair: Pair, http: aiohttp.ClientSession, real_sglang_model: Path) -> None:
    """'in_place' keeps the running request with its cache: a flush is refused, and so is a load that asks
    for one (the weights are in, the call fails); a load without the flush succeeds, and after continue
    the request finishes."""
    async def scenario(url: str) -> Any:
        async def activate() -> Any:
            payload = [tensor_payload.serialize_named_tensors(own_tensor(url, pair, real_sglang_model))]
            flushing = wire.update_weights_from_tensor_body(payload, flush_cache=True, weight_version=None)
            plain = wire.update_weights_from_tensor_body(payload, flush_cache=False, weight_version=None)
            steps = [await call(http, url, "/pause_generation", {"mode": "in_place"}),
                     await call(http, url, "/flush_cache", {}),
                     await call(http, url, "/begin_weight_update", {}),
                     await call(http, url, "/update_weights_from_tensor", flushing),
                     await call(http, url, "/update_weights_from_tensor", plain),
                     await call(http, url, "/end_weight_update", {}),
                     await call(http, url, "/continue_generation", {})]
            return [status for status, _ in steps]

        status, frames, acted = await stream(http, url, {"input_ids": PROMPT, "sampling_params": greedy(300)},
                                             activate)
        return acted, status, finish_shape(finish(frames[-2]))

    acted, status, fin = await both(pair, scenario)
    assert acted == [200, 400, 200, 400, 200, 200, 200]
    assert status == 200 and fin == {"type": "length", "length": 300}


# ------------------------------------------------------------------ flush, weight sessions, versions


async def test_flush_cache_refused_while_a_request_runs(pair: Pair, http: aiohttp.ClientSession) -> None:
    async def scenario(url: str) -> Any:
        status, frames, acted = await stream(http, url, {"input_ids": PROMPT, "sampling_params": greedy(300)},
                                             lambda: call(http, url, "/flush_cache", {}))
        idle = await call(http, url, "/flush_cache", {})
        return acted[0], status, finish_shape(finish(frames[-2])), idle[0]

    assert await both(pair, scenario) == (400, 200, {"type": "length", "length": 300}, 200)


def own_tensor(url: str, pair: Pair, model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """One tensor of each engine's own model, as it is (loading it changes nothing but the version)."""
    if url == pair.cpu:
        name, tensor = list(build_model(0).state_dict().items())[-1]
        return [(name, tensor)]
    from safetensors.torch import load_file

    return [("model.norm.weight", load_file(str(model_dir / "model.safetensors"))["model.norm.weight"])]


async def test_weight_update_session_rules(pair: Pair, http: aiohttp.ClientSession, real_sglang_model: Path) -> None:
    """Loads only inside begin/end; a second begin and an end without begin are refused; a load with a
    version is reported in meta_info.weight_version, the weight_versions spans and /model_info."""
    async def scenario(url: str) -> Any:
        payload = [tensor_payload.serialize_named_tensors(own_tensor(url, pair, real_sglang_model))]
        load = wire.update_weights_from_tensor_body(payload, flush_cache=True, weight_version="v-session")
        steps = [error_shape(*await call(http, url, "/update_weights_from_tensor", load)),
                 error_shape(*await call(http, url, "/end_weight_update", {})),
                 error_shape(*await call(http, url, "/begin_weight_update", {})),
                 error_shape(*await call(http, url, "/begin_weight_update", {})),
                 error_shape(*await call(http, url, "/update_weights_from_tensor", load)),
                 error_shape(*await call(http, url, "/end_weight_update", {}))]
        _, out = await call(http, url, "/generate", {"input_ids": PROMPT, "sampling_params": greedy(2)})
        _, info = await call(http, url, "/model_info")
        meta = out["meta_info"]
        return steps, meta["weight_version"], meta.get("weight_versions"), info["weight_version"]

    steps, version, spans, info_version = await both(pair, scenario)
    assert steps == [(400, "success", False), (400, "success", False), (200, "success", True),
                     (400, "success", False), (200, "success", True), (200, "success", True)]
    assert version == info_version == "v-session" and spans == [{"version": "v-session", "start": 0, "end": 2}]


async def test_update_weight_version_without_aborting(pair: Pair, http: aiohttp.ClientSession) -> None:
    async def scenario(url: str) -> Any:
        async def bump() -> Any:
            body = {"new_version": "v-bump", "abort_all_requests": False}
            return await call(http, url, "/update_weight_version", body)

        status, frames, acted = await stream(http, url, {"input_ids": PROMPT, "sampling_params": greedy(200)}, bump)
        _, info = await call(http, url, "/model_info")
        return acted, status, finish_shape(finish(frames[-2])), frames[-2]["meta_info"]["weight_version"], \
            info["weight_version"]

    acted, status, fin, version, info_version = await both(pair, scenario)
    assert acted == (200, {"success": True, "message": "Weight version updated to v-bump", "new_version": "v-bump"})
    assert status == 200 and fin == {"type": "length", "length": 200} and version == info_version == "v-bump"


async def test_a_load_waits_for_running_requests(pair: Pair, http: aiohttp.ClientSession,
                                                 real_sglang_model: Path) -> None:
    """SGLang 0.5.23 (not paused) takes a weight update only when no /generate is in flight (its
    model_update_lock): the load waits for the running request, then succeeds and flushes. The CPU
    engine refused it at once with "the cache was not flushed" instead."""
    async def scenario(url: str) -> Any:
        assert (await call(http, url, "/begin_weight_update", {}))[0] == 200
        try:
            payload = [tensor_payload.serialize_named_tensors(own_tensor(url, pair, real_sglang_model))]
            load = wire.update_weights_from_tensor_body(payload, flush_cache=True, weight_version="v-waited")
            body = {"input_ids": PROMPT, "sampling_params": greedy(300)}
            task = asyncio.ensure_future(call(http, url, "/generate", body))
            await when_running(http, url, task)
            loaded = await call(http, url, "/update_weights_from_tensor", load)
            done_first = task.done()
            status, out = await task
        finally:
            await call(http, url, "/end_weight_update", {})
        return error_shape(*loaded), done_first, status, finish_shape(finish(out)), out["meta_info"]["weight_version"]

    loaded, done_first, status, fin, version = await both(pair, scenario)
    assert loaded == (200, "success", True) and done_first and status == 200
    assert fin == {"type": "length", "length": 300} and version != "v-waited"  # made by the old weights


# ------------------------------------------------------------------ health and server info


async def test_health_and_the_server_info_the_manager_reads(pair: Pair, http: aiohttp.ClientSession) -> None:
    """What the manager reads from /server_info and /model_info (wire.ServerInfo), less what belongs to the
    model (the CPU engine also reports vocab_size, which SGLang does not) and the running-request cap. The
    CPU engine reported no stream_interval (SGLang: its --stream-interval, 1) and the model's context length
    where SGLang reports its --context-length flag (None unless given)."""
    async def scenario(url: str) -> Any:
        health = (await call(http, url, "/health"))[0], (await call(http, url, "/health_generate"))[0]
        _, raw = await call(http, url, "/server_info")
        _, model = await call(http, url, "/model_info")
        info = wire.ServerInfo.from_json(raw).with_model_info(model)
        fields = (info.version, info.tp_size, info.dp_size, info.base_gpu_id, info.gpu_id_step,
                  info.incremental_streaming_output, info.stream_interval, info.weight_version is not None)
        # --speculative-algorithm is a top-level key, null when the server drafts nothing
        return health, raw.get("context_length", "missing"), fields, raw.get("speculative_algorithm", "missing")

    health, context, fields, speculative = await both(pair, scenario)
    assert health == (200, 200) and context == CONTEXT  # the --context-length flag (None when not given)
    assert fields == ("0.5.23", 1, 1, 0, 1, True, 1, True)
    assert speculative is None
