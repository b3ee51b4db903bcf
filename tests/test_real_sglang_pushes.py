"""Weight pushes into real SGLang 0.5.23 (CPU), proven against a ``transformers`` forward.

The trainer side is the product's own (trainer_plugin.weight_push.WeightPusher: a sender agent in this process,
staging, ``PUT /update_weight_senders``, ``POST /update_weight_version``); the boxes are real SGLang with the
receiver agent beside it, started through scripts/launch_sglang.sh; the bytes go over Mooncake (TCP over
loopback). After each push, each box's own greedy tokens must equal those of a float32 ``transformers``
``LlamaForCausalLM`` holding the trainer's new weights, and SGLang must report the pushed version.

Push 1 changes every tensor (a full push); push 2 changes some tensors only and runs as a delta
(``weight_push_mode=delta``), so the receiver agent loads only those into SGLang and the rest must still be
push 1's values.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from real_sglang import SGLANG_PY, PushFleet, RealBox, push_fleet
from safetensors.torch import load_file
from support import ROOT
from test_demo import processes_with

from trainer_plugin.client import ManagerClient
from trainer_plugin.weight_push import WeightPusher

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow]

SENDER_IPS = ["127.0.0.1", "127.0.0.2"]
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [300, 200, 100, 50, 25]]
NEW_TOKENS = 24
DELTA_TENSORS = ("model.layers.1.", "lm_head.", "model.norm.")  # what push 2 changes


@pytest.fixture(scope="module")
def rig(real_sglang_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PushFleet]:
    with push_fleet(real_sglang_model, tmp_path_factory.mktemp("pushes"), ["a", "b"],
                    weight_push_mode="delta") as fleet:
        yield fleet


def perturbed(state: dict[str, torch.Tensor], seed: int, only: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """A trainer step's result: every tensor (or those whose name starts with one of ``only``) moved by a
    deterministic random step, large enough to change the greedy tokens."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(state):
        t = state[name]
        step = torch.randn(t.shape, generator=gen, dtype=torch.float32) * 0.05
        out[name] = (t + step).contiguous() if not only or name.startswith(only) else t.clone()
    return out


def transformers_greedy(model_dir: Path, state: dict[str, torch.Tensor], prompts: list[list[int]],
                        n: int) -> list[list[int]]:
    """Greedy decoding with transformers' LlamaForCausalLM in float32: argmax of a full forward per token (no
    EOS stop, as SGLang's ``ignore_eos``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(str(model_dir))
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(n):
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(torch.argmax(logits)))
            out.append(ids[len(prompt):])
    return out


def greedy_body(prompts: list[list[int]]) -> dict[str, Any]:
    return {"input_ids": prompts, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                                      "ignore_eos": True}}


async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with s.post(url, json=body) as r:
        text = await r.text()
        assert r.status == 200, f"{url}: HTTP {r.status} {text}"
        return json.loads(text)


async def model_info_version(s: aiohttp.ClientSession, box: RealBox) -> str:
    async with s.get(box.url + "/model_info") as r:
        assert r.status == 200, await r.text()
        return str((await r.json(content_type=None))["weight_version"])


async def test_two_pushes_leave_sglang_serving_exactly_the_trainers_weights(rig: PushFleet) -> None:
    checkpoint = load_file(str(rig.model_dir / "model.safetensors"))
    before = transformers_greedy(rig.model_dir, checkpoint, PROMPTS, NEW_TOKENS)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        for box in rig.boxes:  # the reference itself agrees with SGLang on the checkpoint
            assert [o["output_ids"] for o in await post(s, box.url + "/generate", greedy_body(PROMPTS))] == before

        pusher = WeightPusher(rig.manager.url, SENDER_IPS, rig.sender_port, protocol="tcp", wait_for="all",
                              timeout_s=180, groups_per_sender=2, engines_per_group=2)
        async with ManagerClient(rig.manager.url) as client:
            try:
                await pusher.start(client)
                groups = {(i["sender"], i["group"]) for i in (await client.get_instances_status())["instances"]}
                assert groups == {(0, 0), (0, 1)}  # the two boxes pull from different groups (IPs)
                state, previous = checkpoint, before
                for version, only in ((1, ()), (2, DELTA_TENSORS)):
                    state = perturbed(state, seed=version, only=only)
                    answer = await pusher.push(client, state, version)
                    assert answer["new_weight_version"] == version and not answer["timed_out"], answer
                    assert answer["instances_at_version"] == 2, answer

                    want = transformers_greedy(rig.model_dir, state, PROMPTS, NEW_TOKENS)
                    assert want != previous  # the push changes what a greedy rollout says
                    for box in rig.boxes:
                        own = await post(s, box.url + "/generate", greedy_body(PROMPTS))
                        assert [o["output_ids"] for o in own] == want, f"{box.endpoint} after push {version}"
                        assert {o["meta_info"]["weight_version"] for o in own} == {str(version)}
                        assert await model_info_version(s, box) == str(version)
                    via = await post(s, rig.manager.url + "/generate", greedy_body(PROMPTS))
                    assert [o["output_ids"] for o in via] == want
                    assert {o["meta_info"]["weight_version"] for o in via} == {str(version)}

                    st = await client.get_instances_status()
                    assert {(i["state"], i["weight_version"]) for i in st["instances"]} == {("active", version)}
                    pushes = {p["endpoint"]: p for p in st["recent_weight_pushes"] if p["version"] == version}
                    changed = sum(1 for n in state if not only or n.startswith(only))
                    assert {e: (p["mode"], p["reloaded"]) for e, p in pushes.items()} == {
                        b.endpoint: ("full" if version == 1 else "delta", changed) for b in rig.boxes}
                    previous = want
            finally:
                pusher.stop()


def test_the_demo_runs_on_real_sglang(real_sglang_model: Path, tmp_path: Path) -> None:
    """``rollout-manager demo --engine sglang``: training steps whose rollouts come from real SGLang boxes, a push
    per step, a box killed mid-generation (its sequences continued elsewhere) and a fresh one bootstrapped."""
    run_id = uuid.uuid4().hex
    proc = subprocess.run(
        [sys.executable, "-m", "rollout_manager", "demo", "--engine", "sglang", "--model-path", str(real_sglang_model),
         "--sglang-python", str(SGLANG_PY), "--steps", "2", "--kill-step", "2", "--logdir", str(tmp_path / "logs")],
        cwd=ROOT, capture_output=True, text=True, timeout=540, env={**os.environ, "RM_DEMO_RUN_ID": run_id})
    out = proc.stdout
    assert proc.returncode == 0, f"{out}\n{proc.stderr}"
    steps = re.findall(r"^step +(\d+) +reward [\d.]+ +rollouts (\d+) .* continued +(\d+) +push v(\d+)", out, re.M)
    assert [(int(s), int(r), int(v)) for s, r, _, v in steps] == [(1, 32, 1), (2, 32, 2)], out
    assert int(steps[1][2]) > 0, "the box killed in step 2 had sequences to continue"
    final = re.search(r"every box at v2: (.*)$", out, re.M)
    assert final is not None and len(final.group(1).split()) == 2, out
    assert all(x.endswith(":active@v2") for x in final.group(1).split())
    assert "Loading weights" not in out + proc.stderr  # transformers' progress bar stays out of the display
    assert processes_with("RM_DEMO_RUN_ID", run_id) == []
