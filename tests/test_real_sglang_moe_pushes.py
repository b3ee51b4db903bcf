"""MoE weight pushes into real SGLang 0.5.23 (CPU) through the manager, proven against a ``transformers`` forward.

The tiny Qwen3-MoE of tests/real_sglang_model.py (8 experts, 2 per token, 2 layers) served by one real SGLang box
started through scripts/launch_sglang.sh, the receiver agent beside it; the trainer side is the product's own
(trainer_plugin.weight_push.WeightPusher: sender agent, ``PUT /update_weight_senders``,
``POST /update_weight_version``), the bytes over Mooncake (TCP over loopback). The trainer's state dict holds the
experts as the trainer names them, one tensor per expert and projection
(``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``) and the router (``mlp.gate.weight``); SGLang's
``Qwen3MoeForCausalLM.load_weights`` maps them into its fused ``experts.w13_weight`` / ``w2_weight``.

Push 1 changes every tensor (full); push 2 changes three experts of one layer only and runs as a delta
(``weight_push_mode=delta``): the agent loads only those 9 tensors and every other expert must keep push 1's
values. After each push the box's greedy tokens, direct and through the manager, must equal those of a float32
``transformers`` ``Qwen3MoeForCausalLM`` loaded from a checkpoint holding the trainer's new weights.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import torch
from real_sglang import PushFleet, make_tiny_moe, push_fleet
from safetensors.torch import load_file, save_file
from test_real_sglang_pushes import NEW_TOKENS, PROMPTS, greedy_body, model_info_version, perturbed, post

from trainer_plugin.client import ManagerClient
from trainer_plugin.weight_push import WeightPusher

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow]

DELTA_EXPERTS = tuple(f"model.layers.1.mlp.experts.{e}." for e in (1, 4, 6))  # what push 2 changes


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PushFleet]:
    model = make_tiny_moe(tmp_path_factory.getbasetemp() / "real_sglang_moe")
    with push_fleet(model, tmp_path_factory.mktemp("moe_pushes"), ["moe"], weight_push_mode="delta") as fleet:
        yield fleet


def transformers_greedy(model_dir: Path, state: dict[str, torch.Tensor], tmp: Path) -> list[list[int]]:
    """Greedy decoding (argmax of a full forward per token, no EOS stop) with transformers' Qwen3MoeForCausalLM
    in float32, loaded from a checkpoint of ``state`` under the per-expert names (transformers fuses them
    itself, as SGLang does)."""
    from transformers import Qwen3MoeForCausalLM

    ckpt = tmp / "reference"
    ckpt.mkdir(exist_ok=True)
    shutil.copy(model_dir / "config.json", ckpt / "config.json")
    save_file({n: t.contiguous() for n, t in state.items()}, str(ckpt / "model.safetensors"))
    model = Qwen3MoeForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = list(prompt)
            for _ in range(NEW_TOKENS):
                ids.append(int(torch.argmax(model(torch.tensor([ids])).logits[0, -1])))
            out.append(ids[len(prompt):])
    return out


async def test_moe_pushes_full_then_a_few_experts_leave_sglang_serving_the_trainers_weights(
        rig: PushFleet, tmp_path: Path) -> None:
    checkpoint = load_file(str(rig.model_dir / "model.safetensors"))
    assert sum(".mlp.experts." in n for n in checkpoint) == 2 * 8 * 3  # per-expert names, as trainers hold them
    before = transformers_greedy(rig.model_dir, checkpoint, tmp_path)
    box = rig.boxes[0]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        # the reference itself agrees with SGLang on the checkpoint
        assert [o["output_ids"] for o in await post(s, box.url + "/generate", greedy_body(PROMPTS))] == before
        pusher = WeightPusher(rig.manager.url, ["127.0.0.1"], rig.sender_port, protocol="tcp", wait_for="all",
                              timeout_s=180)
        async with ManagerClient(rig.manager.url) as client:
            try:
                await pusher.start(client)
                state, previous = checkpoint, before
                for version, only in ((1, ()), (2, DELTA_EXPERTS)):
                    state = perturbed(state, seed=version, only=only)
                    answer = await pusher.push(client, state, version)
                    assert answer["new_weight_version"] == version and not answer["timed_out"], answer

                    want = transformers_greedy(rig.model_dir, state, tmp_path)
                    assert want != previous  # the push changes what a greedy rollout says
                    own = await post(s, box.url + "/generate", greedy_body(PROMPTS))
                    assert [o["output_ids"] for o in own] == want, f"SGLang after push {version}"
                    assert await model_info_version(s, box) == str(version)
                    via = await post(s, rig.manager.url + "/generate", greedy_body(PROMPTS))
                    assert [o["output_ids"] for o in via] == want
                    assert {o["meta_info"]["weight_version"] for o in via} == {str(version)}

                    st = await client.get_instances_status()
                    (push,) = [p for p in st["recent_weight_pushes"] if p["version"] == version]
                    assert (push["mode"], push["reloaded"]) == (("full", len(state)) if version == 1 else ("delta", 9))
                    previous = want
            finally:
                pusher.stop()
