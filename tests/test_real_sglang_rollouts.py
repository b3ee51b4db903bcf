"""Rollouts through the manager on real SGLang 0.5.23 on CPU, where SGLang's contract differs from the CPU
engine's (docs/sglang-contract.md): SGLang's API keys, per-token log-prob lists in incremental streams, and
per-sequence sampling seeds. One manager and one box (launch_sglang.sh with --api-key/--admin-api-key) per module.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from real_sglang import SGLANG_ENV, SGLANG_PY, RealBox, start_box, start_manager
from support import ROOT

from rollout_manager.sglang import wire
from rollout_manager.sglang.auth import SGLangAuth

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow]

KEYS = SGLangAuth(api_key="rollout-api-key", admin_api_key="rollout-admin-key")


class Env:
    def __init__(self, manager_url: str, box: RealBox):
        self.manager_url, self.box = manager_url, box


@pytest.fixture(scope="module")
def env(real_sglang_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    log_dir = tmp_path_factory.mktemp("real_sglang_rollouts")
    manager = start_manager(log_dir, sglang_api_key=KEYS.api_key, sglang_admin_api_key=KEYS.admin_api_key)
    try:
        box = start_box(real_sglang_model, manager.url, log_dir,
                        launcher_flags=("--api-key", KEYS.api_key, "--admin-api-key", KEYS.admin_api_key))
        try:
            yield Env(manager.url, box)
        finally:
            box.stop()
    finally:
        manager.stop()


def post(url: str, body: Any, headers: dict[str, str] | None = None, timeout: float = 120) -> tuple[int, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


GREEDY = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}


# ---------------------------------------------------------------- 5. SGLang's keys, end to end


def test_sglang_runs_with_keys_and_the_manager_sends_them(env: Env) -> None:
    assert post(env.box.url + wire.GENERATE, GREEDY)[0] == 401  # the launcher gave SGLang its keys
    status, direct = post(env.box.url + wire.GENERATE, GREEDY, KEYS.headers())
    assert status == 200, direct
    status, via = post(env.manager_url + wire.GENERATE, GREEDY)
    assert status == 200, via
    assert via["output_ids"] == direct["output_ids"]
    agent_env = environ_of(env.box, b"rollout_manager.weights.receiver_agent")  # the agent got the keys
    assert agent_env.get("ROLLOUT_SGLANG_ADMIN_API_KEY") == KEYS.admin_api_key
    assert agent_env.get("ROLLOUT_SGLANG_API_KEY") == KEYS.api_key


def environ_of(box: RealBox, marker: bytes) -> dict[str, str]:
    """The environment of the launcher's child whose command line holds ``marker``."""
    from pathlib import Path

    from real_sglang import descendants

    for pid in descendants(box.launcher.pid):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                raw = Path(f"/proc/{pid}/environ").read_bytes()
                return dict(item.decode().split("=", 1) for item in raw.split(b"\0") if b"=" in item)
        except OSError:
            continue
    raise AssertionError(f"no process {marker!r} under the launcher")


def test_an_abort_from_the_manager_reaches_sglang_with_the_admin_key(env: Env) -> None:
    """The manager aborts a sequence on SGLang when its caller goes away (and to move it); without the admin key
    SGLang answers 401 and the sequence runs on, holding the box."""
    import asyncio

    import aiohttp

    from rollout_manager.sglang.client import SGLangClient

    body = {"input_ids": [5, 6, 7, 8], "rid": "abort-me", "stream": True,
            "sampling_params": {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream_interval": 1}}
    started, chunks = threading.Event(), []

    def stream() -> None:
        req = urllib.request.Request(env.box.url + wire.GENERATE, json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **KEYS.headers()})
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    chunks.append(json.loads(line[len(b"data: "):]))
                    started.set()
        started.set()

    runner = threading.Thread(target=stream)
    runner.start()

    async def abort() -> list[bool]:
        async with aiohttp.ClientSession() as session:
            keyless, keyed = SGLangClient(session), SGLangClient(session, auth=KEYS)
            return [await keyless.abort(env.box.url, "abort-me"), await keyed.abort(env.box.url, "abort-me")]

    assert started.wait(60) and chunks, "the request never ran"
    assert asyncio.run(abort()) == [False, True]
    runner.join(60)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort", chunks[-1]
    assert chunks[-1]["meta_info"]["completion_tokens"] < 1000


# ---------------------------------------------------------------- 4. top log-probs in incremental streams


def test_top_logprobs_cover_every_token_through_the_manager(env: Env) -> None:
    """The launcher runs SGLang with --incremental-streaming-output: each chunk carries its own tokens' top
    log-probs; the manager used to answer the last chunk's only."""
    body = {"input_ids": [5, 6, 7, 8], "return_logprob": True, "top_logprobs_num": 3, "token_ids_logprob": [5, 9],
            "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
    status, direct = post(env.box.url + wire.GENERATE, body, KEYS.headers())
    assert status == 200, direct
    status, via = post(env.manager_url + wire.GENERATE, body)
    assert status == 200, via
    assert via["output_ids"] == direct["output_ids"]
    for key in ("output_top_logprobs", "output_token_ids_logprobs"):
        got, want = via["meta_info"][key], direct["meta_info"][key]
        assert len(got) == len(want) == 200, key
        assert [[e[1] for e in tops] for tops in got] == [[e[1] for e in tops] for tops in want], key
        for tops, ref in zip(got, want):
            assert all(abs(a[0] - b[0]) < 1e-4 for a, b in zip(tops, ref)), key


# ---------------------------------------------------------------- 3. a seed per sequence


def test_every_sample_of_a_prompt_gets_its_own_seed_and_they_differ(env: Env) -> None:
    """With SGLang's --enable-deterministic-inference a request without a seed is sampled with seed 42, so a GRPO
    group's samples come out identical. SGLang 0.5.23 refuses that flag on CPU (no deterministic attention
    backend here), so this shows what the manager sends and records; test_sglangs_seeded_sampler_is_position_keyed
    shows what SGLang does with it."""
    body = {"input_ids": [[5, 6, 7, 8]] * 6, "sampling_params": {"max_new_tokens": 24, "temperature": 1.0,
                                                                "ignore_eos": True}}
    status, outs = post(env.manager_url + wire.GENERATE, body)
    assert status == 200, outs
    seeds = [o["meta_info"]["sampling_seed"] for o in outs]
    assert all(isinstance(s, int) for s in seeds) and len(set(seeds)) == 6
    assert len({tuple(o["output_ids"]) for o in outs}) > 1
    given = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 4, "temperature": 1.0,
                                                            "sampling_seed": 77}}
    status, out = post(env.manager_url + wire.GENERATE, given)
    assert status == 200 and out["meta_info"]["sampling_seed"] == 77


SAMPLER_CHECK = """
import json, torch
import sglang.srt.layers.sampler as sampler
calls = []
def stand_in(seed, positions, col_indices):  # any hash of (seed, position, column) will do
    calls.append((seed.shape, positions.shape, col_indices.shape))
    m = 0xFFFFFFFF
    h = ((seed.to(torch.int64).view(-1, 1) & m) * 0x9E3779B1) & m
    h = ((h ^ positions.to(torch.int64).view(-1, 1)) * 0x85EBCA6B) & m
    h = ((h ^ col_indices.to(torch.int64).view(1, -1)) * 0xC2B2AE35) & m
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & m
    return h ^ (h >> 13)
sampler.murmur_hash32 = stand_in
torch.manual_seed(0)
rows = torch.randn(6, 64, dtype=torch.float64).log_softmax(-1)
seeds = torch.tensor([7, 7, 7, 9, 9, 9])
positions = torch.tensor([10, 11, 12, 10, 11, 12])
f = sampler.multinomial_with_seed
batch = f(rows, seeds, positions).view(-1).tolist()
alone = [f(rows[i:i + 1], seeds[i:i + 1], positions[i:i + 1]).view(-1).item() for i in range(6)]
order = [5, 2, 0, 4, 1, 3]
shuffled = f(rows[order], seeds[order], positions[order]).view(-1).tolist()
moved = [f(rows[i:i + 1], seeds[i:i + 1], positions[i:i + 1] + 1).view(-1).item() for i in range(6)]
print(json.dumps({"batch": batch, "alone": alone, "shuffled": [shuffled[order.index(i)] for i in range(6)],
                  "moved": moved, "calls": len(calls)}))
"""


def test_sglangs_seeded_sampler_is_position_keyed() -> None:
    """SGLang's seeded draw (layers/sampler.py, multinomial_with_seed: Gumbel noise from a hash of seed, absolute
    position and column) depends on nothing else: not on the batch it is in, nor on how the sequence got to that
    position. So a continuation that sends input_ids = prompt + tokens so far and the same seed draws, at each
    position, what the uninterrupted request drew, given the same distribution (which deterministic inference
    guarantees). The hash itself is SGLang's sgl_kernel op murmur_hash32_cpu, which the CPU stand-in does not
    have: a stand-in of the same inputs replaces it here; the rest is SGLang's own code."""
    out = subprocess.run([str(SGLANG_PY), "-c", SAMPLER_CHECK], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env={**os.environ, **SGLANG_ENV, "TORCHDYNAMO_DISABLE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    draws = json.loads(out.stdout.strip().splitlines()[-1])
    assert draws["batch"] == draws["alone"] == draws["shuffled"]
    assert draws["moved"] != draws["alone"]  # the position is part of the key
