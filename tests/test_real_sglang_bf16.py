"""Float32 weights pushed into a real SGLang 0.5.23 box serving bfloat16 (CPU): verl's FSDP trainer keeps float32
parameters (``model_dtype: fp32``) while SGLang serves bf16, the usual GPU case.

The whole path is real: the trainer side (``WeightPusher``: a sender agent in this process), Mooncake over
loopback, the receiver agent beside a box started through scripts/launch_sglang.sh with ``--dtype bfloat16``,
SGLang's ``/update_weights_from_tensor``. What SGLang then holds is read back through its own
``/get_weights_by_name`` (the served parameter, cast to float32, as a JSON list: exact for bf16) and must equal
the trainer's current float32 tensors cast to bf16, bit for bit, every tensor, after each push.

The deltas are exact on the trainer's float32 bytes, and SGLang casts each tensor it is sent. A step smaller than
bf16's resolution still changes float32 bytes, so that tensor is sent again and cast again; the hazard this
guards against is a delta that drops such steps (as "no change at the served precision") while the trainer's
values drift: several sub-resolution steps add up to a changed bf16 value that SGLang would then never get.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import torch
from real_sglang import PushFleet, RealBox, push_fleet
from safetensors.torch import load_file
from test_real_sglang_pushes import model_info_version, perturbed, post

from trainer_plugin.client import ManagerClient
from trainer_plugin.weight_push import WeightPusher

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow]

MOVED = ("model.layers.1.",)  # push 2 moves these by a large step
CREPT = ("model.norm.weight", "model.layers.0.mlp.down_proj.weight")  # pushes 2 and 3 move these by 0.4 bf16 ulp


@pytest.fixture(scope="module")
def bf16_rig(real_sglang_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PushFleet]:
    with push_fleet(real_sglang_model, tmp_path_factory.mktemp("bf16"), ["bf16"], "--dtype", "bfloat16",
                    weight_push_mode="delta") as fleet:
        yield fleet


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def crept(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``CREPT`` moved up by 0.4 of each value's bf16 spacing: below bf16's resolution (each value's cast moves
    only where it sat within 0.4 ulp of a rounding boundary), yet a new float32 value everywhere."""
    out = dict(state)
    for name in CREPT:
        t = state[name]
        _, exp = torch.frexp(t)  # |t| = m * 2**exp, m in [0.5, 1): bf16's spacing there is 2**(exp - 8)
        out[name] = (t + 0.4 * torch.ldexp(torch.ones_like(t), exp - 8)).contiguous()
    return out


async def served(s: aiohttp.ClientSession, box: RealBox, name: str, rows: int) -> torch.Tensor:
    """SGLang's own read-back: the served parameter cast to float32 (exact for bf16), leading ``rows`` rows."""
    return torch.tensor(await post(s, box.url + "/get_weights_by_name", {"name": name, "truncate_size": rows}),
                        dtype=torch.float32)


async def assert_serves_the_bf16_cast(s: aiohttp.ClientSession, box: RealBox, state: dict[str, torch.Tensor],
                                      version: str) -> None:
    stale = [n for n, t in sorted(state.items()) if not torch.equal(await served(s, box, n, t.shape[0]), bf16(t))]
    assert stale == [], f"SGLang holds other values than the bf16 cast of the trainer's tensors at v{version}"
    assert await model_info_version(s, box) == version
    out = await post(s, box.url + "/generate", {"input_ids": [5, 6, 7, 8], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})
    assert out["meta_info"]["weight_version"] == version


async def test_float32_pushes_leave_bf16_sglang_holding_the_cast_of_the_trainers_tensors(bf16_rig: PushFleet) -> None:
    rig = bf16_rig
    (box,) = rig.boxes
    checkpoint = load_file(str(rig.model_dir / "model.safetensors"))
    assert {t.dtype for t in checkpoint.values()} == {torch.float32}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        async with s.get(box.url + "/server_info") as r:
            assert (await r.json(content_type=None))["dtype"] == "bfloat16"
        await assert_serves_the_bf16_cast(s, box, checkpoint, "0")  # SGLang's own cast of the checkpoint

        pusher = WeightPusher(rig.manager.url, ["127.0.0.1"], rig.sender_port, protocol="tcp", wait_for="all",
                              timeout_s=180)
        v1 = perturbed(checkpoint, seed=1)  # push 1: every tensor (full)
        v2 = crept(perturbed(v1, seed=2, only=MOVED))  # push 2: a large step on MOVED, 0.4 ulp on CREPT (delta)
        v3 = crept(v2)  # push 3: 0.4 ulp more on CREPT only (delta)
        for name in CREPT:  # the trainer's float32 moves every time; the bf16 casts move only by adding up
            assert (v2[name] != v1[name]).all() and (v3[name] != v2[name]).all()
            assert (bf16(v2[name]) != bf16(v1[name])).float().mean() < 0.5
            assert (bf16(v3[name]) != bf16(v1[name])).float().mean() > 0.6
        pushes = [(1, v1, "full", len(v1)), (2, v2, "delta", sum(n.startswith(MOVED + CREPT) for n in v2)),
                  (3, v3, "delta", len(CREPT))]
        async with ManagerClient(rig.manager.url) as client:
            try:
                await pusher.start(client)
                for version, state, mode, reloaded in pushes:
                    answer = await pusher.push(client, state, version)
                    assert answer["new_weight_version"] == version and not answer["timed_out"], answer
                    assert answer["instances_at_version"] == 1, answer
                    await assert_serves_the_bf16_cast(s, box, state, str(version))
                    st = await client.get_instances_status()
                    record = [p for p in st["recent_weight_pushes"] if p["version"] == version]
                    assert [(p["mode"], p["reloaded"]) for p in record] == [(mode, reloaded)]
            finally:
                pusher.stop()
