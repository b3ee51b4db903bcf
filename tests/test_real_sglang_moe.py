"""A real MoE on real SGLang 0.5.23 (CPU), and routed-expert replay (R3) as SGLang answers it.

The tiny Qwen3-MoE of tests/real_sglang_model.py served by SGLang alone, once with
``--enable-return-routed-experts`` (incremental streaming, as the launcher runs it) and once without it
(cumulative streaming, SGLang's default), each beside a CPU engine with MoE layers started the same way.
Real-only tests assert what SGLang does (the facts docs/real-sglang.md states); differential tests send the
same requests to both engines and compare the answers' shape and format (not the experts: the models differ).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from real_sglang import (
    MOE_EXPERTS,
    MOE_LAYERS,
    MOE_TOP_K,
    SGLangServer,
    call,
    make_tiny_moe,
    start_cpu_engine,
    start_sglang,
)

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow]

PROMPT = [5, 6, 7, 8, 9]  # ids inside both vocabularies (CPU engine 256, real model 1,024)
ROW_BYTES = MOE_LAYERS * MOE_TOP_K * 4
LONG = 900  # tokens of a request still running when the test aborts it


@dataclass
class Pair:
    """Real SGLang and the CPU engine, started alike (R3 flag and streaming mode)."""

    real: str
    cpu: str


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_moe(tmp_path_factory.getbasetemp() / "real_sglang_moe")


def _pair(model: Path, log_dir: Path, *flags: str) -> Iterator[Pair]:
    cpu_url, cpu = start_cpu_engine(log_dir, "--num-experts", str(MOE_EXPERTS), "--num-experts-per-tok",
                                    str(MOE_TOP_K), *flags)
    real: SGLangServer | None = None
    try:
        real = start_sglang(model, log_dir, *flags, name="moe")
        yield Pair(real.url, cpu_url)
    finally:
        if real is not None:
            real.stop()
        cpu.stop()


@pytest.fixture(scope="module")
def r3(moe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """Both with ``--enable-return-routed-experts`` and incremental streaming."""
    yield from _pair(moe_model, tmp_path_factory.mktemp("moe_r3"), "--enable-return-routed-experts",
                     "--incremental-streaming-output")


@pytest.fixture(scope="module")
def plain(moe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """Both without the flag, streaming cumulative chunks."""
    yield from _pair(moe_model, tmp_path_factory.mktemp("moe_plain"))


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        yield s


# ------------------------------------------------------------------ requests and shapes


def greedy(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def r3_body(n: int = 4, **extra: Any) -> dict[str, Any]:
    return {"input_ids": PROMPT, "sampling_params": greedy(n), "return_routed_experts": True, **extra}


async def stream(s: aiohttp.ClientSession, url: str, body: dict[str, Any],
                 on_first: Callable[[], Awaitable[Any]] | None = None) -> tuple[int, list[Any]]:
    """A streaming /generate: (status, frames, "[DONE]" kept); ``on_first`` runs once the first chunk is in."""
    frames: list[Any] = []
    acted: asyncio.Future[Any] | None = None
    async with s.post(url + "/generate", json={**body, "stream": True}) as r:
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                payload = line[len("data: "):]
                frames.append(payload if payload == "[DONE]" else json.loads(payload))
                if on_first is not None and acted is None:
                    acted = asyncio.ensure_future(on_first())
    if acted is not None:
        await acted
    return r.status, frames


def experts(meta: dict[str, Any]) -> np.ndarray:
    """``meta_info.routed_experts`` decoded: base64 of little-endian int32 ``[rows, layers, top_k]``."""
    raw = base64.b64decode(meta["routed_experts"])
    assert len(raw) % ROW_BYTES == 0, len(raw)
    return np.frombuffer(raw, dtype="<i4").reshape(-1, MOE_LAYERS, MOE_TOP_K)


def rows(out: dict[str, Any]) -> int | None:
    """How many token rows ``routed_experts`` holds, None when absent."""
    meta = out["meta_info"]
    return None if "routed_experts" not in meta else len(experts(meta))


def shape(out: dict[str, Any]) -> dict[str, Any]:
    """An output with what differs by model erased: counts, finish, and the experts' presence and rows."""
    meta = out["meta_info"]
    fin = meta["finish_reason"]
    return {"n": len(out["output_ids"]), "prompt": meta["prompt_tokens"], "completion": meta["completion_tokens"],
            "finish": None if fin is None else (fin["type"], fin.get("status_code")), "rows": rows(out),
            "index": out.get("index")}


def error_shape(status: int, answer: Any) -> Any:
    """A refusal without its text: the status and where the message sits."""
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        return status, "error.message"
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        return status, "error"
    if isinstance(answer, dict) and answer.get("object") == "error":
        return status, "object:error", answer.get("code")
    return status, shape(answer) if isinstance(answer, dict) else [shape(o) for o in answer]


def stream_summary(frames: list[Any]) -> dict[str, Any]:
    """A stream's shape, the number of chunks erased (SGLang coalesces incremental chunks by timing):
    which chunks carry experts, and the final chunk."""
    outs = [f for f in frames if f != "[DONE]"]
    return {"experts_before_final": [rows(o) for o in outs[:-1] if rows(o) is not None],
            "final": {k: v for k, v in shape(outs[-1]).items() if k != "n"}, "done": frames[-1] == "[DONE]"}


async def both(pair: Pair, scenario: Callable[[str], Awaitable[Any]]) -> Any:
    real = await scenario(pair.real)
    cpu = await scenario(pair.cpu)
    assert cpu == real, f"CPU engine differs from real SGLang:\n real: {real}\n cpu:  {cpu}"
    return real


# ------------------------------------------------------------------ real SGLang alone


async def test_the_moe_generates_greedily_and_returns_every_tokens_experts(
        r3: Pair, http: aiohttp.ClientSession) -> None:
    status, with_experts = await call(http, r3.real, "/generate", r3_body(6))
    _, without = await call(http, r3.real, "/generate", {"input_ids": PROMPT, "sampling_params": greedy(6)})
    assert status == 200 and len(with_experts["output_ids"]) == 6
    assert with_experts["output_ids"] == without["output_ids"]  # asking for experts changes no token
    assert "routed_experts" not in without["meta_info"]
    whole = experts(with_experts["meta_info"])
    assert whole.shape == (len(PROMPT) + 6 - 1, MOE_LAYERS, MOE_TOP_K)  # every token but the last one made
    assert ((whole >= 0) & (whole < MOE_EXPERTS)).all()
    assert all(len(set(r)) == MOE_TOP_K for r in whole.reshape(-1, MOE_TOP_K).tolist())
    assert len({r.tobytes() for r in whole}) > 1  # the router does tell tokens apart


async def test_routed_experts_start_len_drops_the_positions_before_it(r3: Pair, http: aiohttp.ClientSession) -> None:
    _, out = await call(http, r3.real, "/generate", r3_body(4))
    whole = experts(out["meta_info"])
    for start in (1, 3, len(PROMPT)):
        _, part = await call(http, r3.real, "/generate", r3_body(4, routed_experts_start_len=start))
        assert (experts(part["meta_info"]) == whole[start:]).all()
    _, prefill = await call(http, r3.real, "/generate", r3_body(0))  # max_new_tokens 0: the prompt is prefilled
    assert prefill["output_ids"] == [] and (experts(prefill["meta_info"]) == whole[:len(PROMPT) - 1]).all()
    _, one = await call(http, r3.real, "/generate", r3_body(1, routed_experts_start_len=len(PROMPT)))
    assert one["meta_info"]["routed_experts"] == ""  # [min(5, 5), 5): nothing, but present
    status, refused = await call(http, r3.real, "/generate", r3_body(4, routed_experts_start_len=len(PROMPT) + 1))
    assert status == 400 and "routed_experts_start_len" in refused["error"]["message"]


async def test_only_the_final_chunk_carries_the_experts_of_the_whole_sequence(
        r3: Pair, http: aiohttp.ClientSession) -> None:
    _, whole = await call(http, r3.real, "/generate", r3_body(4, routed_experts_start_len=2))
    status, frames = await stream(http, r3.real, r3_body(4, routed_experts_start_len=2))
    outs = [f for f in frames if f != "[DONE]"]
    assert status == 200 and len(outs) > 1 and all("routed_experts" not in f["meta_info"] for f in outs[:-1])
    assert outs[-1]["meta_info"]["routed_experts"] == whole["meta_info"]["routed_experts"]  # not a delta


# ------------------------------------------------------------------ differential: real SGLang and the CPU engine


async def test_non_streaming_answers_match(r3: Pair, plain: Pair, http: aiohttp.ClientSession) -> None:
    bodies = [r3_body(4), r3_body(4, routed_experts_start_len=3), r3_body(0), r3_body(3, routed_experts_start_len=5),
              r3_body(2, return_routed_experts=False), {**r3_body(3), "sampling_params": {"max_new_tokens": 3,
                                                                                          "temperature": 0}},
              {**r3_body(3), "input_ids": [PROMPT, PROMPT[:3]], "routed_experts_start_len": 2}]

    async def scenario(url: str) -> Any:
        return [error_shape(*await call(http, url, "/generate", body)) for body in bodies]

    with_flag = await both(r3, scenario)
    assert [s[1]["rows"] for s in with_flag[:5]] == [len(PROMPT) + 3, len(PROMPT), len(PROMPT) - 1, 2, None]
    assert [s["rows"] for s in with_flag[6][1]] == [len(PROMPT) + 3 - 1 - 2, 3 + 3 - 1 - 2]
    without = await both(plain, scenario)
    assert all(s[1]["rows"] is None for s in without[:6]) and all(s["rows"] is None for s in without[6][1])


async def test_refusals_match(r3: Pair, plain: Pair, http: aiohttp.ClientSession) -> None:
    bad = [r3_body(2, routed_experts_start_len=len(PROMPT) + 1), r3_body(2, routed_experts_start_len=-1),
           {**r3_body(2), "input_ids": [PROMPT, PROMPT[:1]], "routed_experts_start_len": 2},
           r3_body(2, return_routed_experts=[True]), r3_body(2, return_routed_experts=None),
           r3_body(2, return_routed_experts=2), r3_body(2, routed_experts_start_len=None),
           r3_body(2, routed_experts_start_len="2")]

    async def scenario(url: str) -> Any:
        answers = [error_shape(*await call(http, url, "/generate", body)) for body in bad]
        _, frames = await stream(http, url, bad[0])  # the scheduler's refusal inside a stream
        last = [f for f in frames if f != "[DONE]"][-1]
        return answers, shape(last)["finish"], frames[-1]

    for pair in (r3, plain):  # the checks hold whether or not the server captures experts
        answers, finish, done = await both(pair, scenario)
        assert answers[:3] == [(400, "error.message")] * 3
        assert answers[3:7] == [(400, "object:error", 400)] * 4 and answers[7] == (400, "error")
        assert finish == ("abort", 400) and done == "[DONE]"


async def test_streams_match(r3: Pair, plain: Pair, http: aiohttp.ClientSession) -> None:
    async def scenario(url: str) -> Any:
        single = stream_summary((await stream(http, url, r3_body(4, routed_experts_start_len=1)))[1])
        _, frames = await stream(http, url, {**r3_body(3), "input_ids": [PROMPT, PROMPT[:3]]})
        items = [stream_summary([f for f in frames if f == "[DONE]" or f.get("index") == i]) for i in (0, 1)]
        return single, items

    single, items = await both(r3, scenario)
    assert single["experts_before_final"] == [] and single["final"]["rows"] == len(PROMPT) + 4 - 1 - 1
    assert [i["final"]["rows"] for i in items] == [len(PROMPT) + 2, 3 + 2]
    single, items = await both(plain, scenario)
    assert single["final"]["rows"] is None and [i["final"]["rows"] for i in items] == [None, None]


async def test_an_aborted_request_still_returns_the_experts_of_what_it_made(
        r3: Pair, http: aiohttp.ClientSession) -> None:
    async def scenario(url: str) -> Any:
        body = {**r3_body(LONG), "rid": "moe-abort"}
        _, frames = await stream(http, url, body, lambda: call(http, url, "/abort_request", {"rid": "moe-abort"}))
        final = shape([f for f in frames if f != "[DONE]"][-1])
        return final["finish"], final["rows"] == final["prompt"] + final["completion"] - 1, final["completion"] < LONG

    assert await both(r3, scenario) == (("abort", None), True, True)


async def test_server_info_says_whether_experts_are_captured(
        r3: Pair, plain: Pair, http: aiohttp.ClientSession) -> None:
    async def scenario(url: str) -> Any:
        async with http.get(url + "/server_info") as r:
            return (await r.json())["enable_return_routed_experts"]

    assert await both(r3, scenario) is True
    assert await both(plain, scenario) is False
