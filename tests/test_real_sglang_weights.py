"""The receiver agent against real SGLang 0.5.23 on CPU, where SGLang's contract differs from the CPU engine's
(docs/sglang-contract.md): a load while requests run, names and shapes the model does not have, a load that
leaves stale tensors, SGLang restarting under the agent, and SGLang's API keys.

One SGLang server for the module, started directly (not through the launcher: one test restarts it under a
running agent), with ``--api-key`` and ``--admin-api-key``; the agent runs in this process, its buffer staged
directly (the transfer itself is tested elsewhere), and calls SGLang over real HTTP.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from real_sglang import CPU_FLAGS, SGLANG_ENV, SGLANG_PY, START_TIMEOUT_S, make_tiny_model, require_sglang_venv
from safetensors.torch import load_file
from support import Proc, async_wait_until, quiet_port, wait_until

from rollout_manager.sglang import tensor_payload, wire
from rollout_manager.sglang.auth import SGLangAuth
from rollout_manager.weights.layout import HostBuffer, build_layout, stage
from rollout_manager.weights.protocol import CommitRequest
from rollout_manager.weights.receiver import Receiver
from rollout_manager.weights.refused import CommitRefused
from rollout_manager.weights.shards import shard_checksums, split_shards

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow]

KEYS = SGLangAuth(api_key="test-api-key", admin_api_key="test-admin-key")
PROBE = "model.layers.1.mlp.down_proj.weight"  # a tensor the deltas below never change


@dataclass
class Server:
    model_dir: Path
    log_dir: Path
    port: int
    proc: Proc | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        require_sglang_venv()
        self.starts += 1
        args = [str(SGLANG_PY), "-m", "sglang.launch_server", "--model-path", str(self.model_dir),
                "--host", "127.0.0.1", "--port", str(self.port), "--weight-version", "0",
                "--incremental-streaming-output", *CPU_FLAGS,
                "--api-key", KEYS.api_key, "--admin-api-key", KEYS.admin_api_key]
        self.proc = Proc(args, self.log_dir / f"sglang-{self.port}-{self.starts}.log", env=SGLANG_ENV)
        wait_until(self._ready, START_TIMEOUT_S, interval_s=0.5, message=lambda: f"SGLang on {self.url}")

    def _ready(self) -> bool:
        import urllib.request

        assert self.proc is not None
        if self.proc.popen.poll() is not None:
            raise AssertionError(f"SGLang exited with {self.proc.popen.returncode}:\n{self.proc.log()[-4000:]}")
        try:  # /health_generate: open without a key, 200 once a generation went through
            with urllib.request.urlopen(self.url + wire.HEALTH_GENERATE, timeout=10) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()  # SIGKILL to its process group: the scheduler and detokenizer too
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture(scope="module")
def sglang(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = make_tiny_model(tmp_path_factory.getbasetemp() / "real_sglang_model")
    # SGLang binds its port late (after loading the model): one out of the kernel's ephemeral range
    server = Server(model, tmp_path_factory.mktemp("sglang_weights"), quiet_port())
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def checkpoint(sglang: Server) -> dict[str, torch.Tensor]:
    return load_file(str(sglang.model_dir / "model.safetensors"))


def new_weights(sglang: Server, seed: int) -> dict[str, torch.Tensor]:
    """The checkpoint's names and shapes, other values."""
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=gen, dtype=t.dtype) * 0.05 for n, t in checkpoint(sglang).items()}


async def agent_for(sglang: Server, state: dict[str, torch.Tensor], **kw: Any) -> Receiver:
    """An agent whose buffer holds ``state`` verified-to-be (as if the sender had written it)."""
    agent = Receiver("127.0.0.1", sglang.url, auth=kw.pop("auth", KEYS), **kw)
    agent.loader.session = aiohttp.ClientSession()
    restage(agent, state)
    return agent


def restage(agent: Receiver, state: dict[str, torch.Tensor]) -> None:
    layout = build_layout(state)
    if agent.layout is None or agent.layout.fingerprint() != layout.fingerprint():
        agent.layout, agent.buffer = layout, HostBuffer.for_layout(layout)
    assert agent.buffer is not None
    stage(state, layout, agent.buffer.array)


def commit_body(agent: Receiver, version: int) -> CommitRequest:
    assert agent.layout is not None and agent.buffer is not None
    shards = split_shards(agent.layout.total_bytes, 4)
    return CommitRequest(version=version, fingerprint=agent.layout.fingerprint(), shards=shards,
                         checksums=shard_checksums(agent.buffer.array, shards))


async def close(agent: Receiver) -> None:
    assert agent.loader.session is not None
    await agent.loader.session.close()


async def served(http: aiohttp.ClientSession, sglang: Server, name: str, rows: int = 1000) -> torch.Tensor:
    async with http.post(sglang.url + "/get_weights_by_name", json={"name": name, "truncate_size": rows},
                         headers=KEYS.admin_headers()) as r:
        assert r.status == 200, await r.text()
        return torch.tensor(await r.json(content_type=None), dtype=torch.float32)


async def reported_version(http: aiohttp.ClientSession, sglang: Server) -> str:
    async with http.get(sglang.url + wire.MODEL_INFO, headers=KEYS.headers()) as r:
        assert r.status == 200, await r.text()
        return str((await r.json(content_type=None))["weight_version"])


async def generate(http: aiohttp.ClientSession, sglang: Server, tokens: int) -> dict[str, Any]:
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": tokens, "temperature": 0,
                                                         "ignore_eos": True}}
    async with http.post(sglang.url + wire.GENERATE, json=body, headers=KEYS.headers()) as r:
        assert r.status == 200, await r.text()
        return dict(await r.json(content_type=None))


# ---------------------------------------------------------------- 1. the flush, and the version set explicitly


async def test_a_load_while_a_request_runs_sets_the_version_sglang_then_reports(sglang: Server,
                                                                                http: aiohttp.ClientSession) -> None:
    """A request held in SGLang's scheduler (paused in place, as verl pauses around a load) makes a flush inside
    the update call fail; SGLang then does not record the version. The agent used to flush later and declare
    success: every later output carried the old weight_version and the manager refused the box's chunks."""
    agent = await agent_for(sglang, new_weights(sglang, 1))
    body = {"input_ids": [5, 6, 7, 8], "stream": True,
            "sampling_params": {"max_new_tokens": 900, "temperature": 0, "ignore_eos": True, "stream_interval": 1}}
    try:
        async with http.post(sglang.url + wire.GENERATE, json=body, headers=KEYS.headers()) as r:
            assert r.status == 200
            await r.content.readuntil(b"\n\n")  # it runs now
            await admin(http, sglang, wire.PAUSE_GENERATION, {"mode": "in_place"})
            commit = asyncio.ensure_future(agent.commit(commit_body(agent, 11)))
            new = agent_state(agent, PROBE)

            async def loaded() -> bool:
                assert not commit.done() or commit.exception() is None, commit.exception()
                return torch.equal(await served(http, sglang, PROBE), new)

            await async_wait_until(loaded, 60, interval_s=0.2, message="the load to reach SGLang")
            await admin(http, sglang, wire.CONTINUE_GENERATION, {})
            tail = await r.read()  # the request runs to its end: nothing aborted it
            assert b'"type":"length"' in tail
        answer = await commit
        assert answer.ok and answer.version == 11
        assert await reported_version(http, sglang) == "11"
        assert (await generate(http, sglang, 4))["meta_info"]["weight_version"] == "11"
    finally:
        await close(agent)


async def admin(http: aiohttp.ClientSession, sglang: Server, path: str, body: dict[str, Any]) -> None:
    async with http.post(sglang.url + path, json=body, headers=KEYS.admin_headers()) as r:
        assert r.status == 200, f"{path}: HTTP {r.status} {await r.text()}"


def agent_state(agent: Receiver, name: str) -> torch.Tensor:
    from rollout_manager.weights.layout import unpack

    assert agent.buffer is not None and agent.layout is not None
    return dict(unpack(agent.buffer, agent.layout, copy=True))[name].to(torch.float32)


# ---------------------------------------------------------------- 2. names, shapes, read-back


async def test_a_name_the_model_does_not_know_is_refused_before_anything_loads(
        sglang: Server, http: aiohttp.ClientSession) -> None:
    """Real SGLang skips such a tensor with a warning and answers success: the box keeps stale weights."""
    state = new_weights(sglang, 2)
    state["model.layers.7.mlp.up_proj.weight"] = torch.zeros(128, 64)  # the model has 2 layers
    before = await served(http, sglang, PROBE)
    agent = await agent_for(sglang, state)
    try:
        with pytest.raises(CommitRefused, match="'model.layers.7.mlp.up_proj.weight' is not a tensor") as caught:
            await agent.commit(commit_body(agent, 12))
        assert caught.value.status == 409
    finally:
        await close(agent)
    assert torch.equal(await served(http, sglang, PROBE), before)  # nothing was loaded


async def test_a_shape_the_model_does_not_have_is_refused_and_sglang_lives(sglang: Server,
                                                                           http: aiohttp.ClientSession) -> None:
    """Real SGLang's scheduler dies (SIGQUIT) on a tensor of another shape."""
    state = new_weights(sglang, 3)
    state[PROBE] = torch.zeros(64, 64)  # the model's is [64, 128]
    agent = await agent_for(sglang, state)
    try:
        with pytest.raises(CommitRefused, match=r"has shape \[64, 64\], the served model's is \[64, 128\]"):
            await agent.commit(commit_body(agent, 13))
    finally:
        await close(agent)
    assert len((await generate(http, sglang, 2))["output_ids"]) == 2  # still serving


async def test_a_load_that_leaves_stale_tensors_is_caught_by_the_read_back(sglang: Server,
                                                                           http: aiohttp.ClientSession) -> None:
    """SGLang holds other values than the agent believes (here: written behind its back, as a silently skipped
    tensor would leave them); a partial load then succeeds on SGLang's side, and only reading back shows it."""
    state = new_weights(sglang, 4)
    agent = await agent_for(sglang, state, readback_tensors=1000)
    try:
        await agent.commit(commit_body(agent, 14))
        assert agent.loader.readback == len(state)  # every tensor equal after a full load
        stale = {PROBE: torch.full_like(state[PROBE], 0.5)}
        status, text = await post_tensors(http, sglang, stale)
        assert status == 200, text
        state["model.norm.weight"] = state["model.norm.weight"] + 1  # the delta changes one other tensor
        restage(agent, state)
        agent.loader.dirty = {"model.norm.weight"}
        with pytest.raises(CommitRefused, match=f"other values for '{PROBE}'") as caught:
            await agent.commit(commit_body(agent, 15))
        assert caught.value.status == 502
        assert await reported_version(http, sglang) == "14"  # the version was not moved on
        await agent.commit(commit_body(agent, 16))  # after a refusal the next load sends every tensor
        assert agent.loader.reloaded == len(state) and await reported_version(http, sglang) == "16"
        assert torch.equal(await served(http, sglang, PROBE), state[PROBE])
    finally:
        await close(agent)


async def post_tensors(http: aiohttp.ClientSession, sglang: Server, named: dict[str, torch.Tensor]) -> tuple[int, str]:
    payload = tensor_payload.serialize_named_tensors(list(named.items()))
    load = wire.update_weights_from_tensor_body([payload], flush_cache=False, weight_version=None)
    for path, body in ((wire.BEGIN_WEIGHT_UPDATE, {}), (wire.UPDATE_WEIGHTS_FROM_TENSOR, load),
                       (wire.END_WEIGHT_UPDATE, {})):
        async with http.post(sglang.url + path, json=body, headers=KEYS.admin_headers()) as r:
            status, text = r.status, await r.text()
        if status != 200:
            return status, text
    return status, text


# ---------------------------------------------------------------- 5. SGLang's keys


async def test_the_agent_sends_sglangs_admin_key(sglang: Server, http: aiohttp.ClientSession) -> None:
    state = new_weights(sglang, 5)
    keyless = await agent_for(sglang, state, auth=SGLangAuth())
    try:
        with pytest.raises(CommitRefused, match="HTTP 401"):
            await keyless.commit(commit_body(keyless, 17))
    finally:
        await close(keyless)
    agent = await agent_for(sglang, state)
    try:
        assert (await agent.commit(commit_body(agent, 18))).ok
        assert await reported_version(http, sglang) == "18"
    finally:
        await close(agent)


# ---------------------------------------------------------------- 6. SGLang restarted under the agent


async def test_a_delta_after_sglang_restarted_loads_every_tensor(sglang: Server, http: aiohttp.ClientSession) -> None:
    """A restarted SGLang serves the checkpoint again; a delta onto it would leave every unchanged tensor at the
    checkpoint's values while reporting the new version."""
    state = new_weights(sglang, 6)
    agent = await agent_for(sglang, state, readback_tensors=0)  # the version check alone must catch it
    try:
        await agent.commit(commit_body(agent, 21))
        assert torch.equal(await served(http, sglang, PROBE), state[PROBE])
        await asyncio.to_thread(sglang.restart)
        assert torch.equal(await served(http, sglang, PROBE), checkpoint(sglang)[PROBE])
        state["model.norm.weight"] = state["model.norm.weight"] * 2
        restage(agent, state)
        agent.loader.dirty = {"model.norm.weight"}  # what a delta that changed only this tensor leaves
        answer = await agent.commit(commit_body(agent, 22))
        assert answer.reloaded == len(state)
        assert torch.equal(await served(http, sglang, PROBE), state[PROBE])
        assert await reported_version(http, sglang) == "22"
        # With SGLang where the agent left it, the next delta is partial again.
        state["model.norm.weight"] = state["model.norm.weight"] + 1
        restage(agent, state)
        agent.loader.dirty = {"model.norm.weight"}
        assert (await agent.commit(commit_body(agent, 23))).reloaded == 1
    finally:
        await close(agent)
