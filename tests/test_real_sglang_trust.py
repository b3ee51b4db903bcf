"""A rogue write caught by the trust probe on real SGLang 0.5.23 (CPU), issue 39 item 5.

Three fleets, one manager each (the probe compares boxes at one version, so two models must not share one): a tiny
Qwen2 (SGLang has no ``/get_weights_by_name`` for it: the old tensor read-back could not look) and a tiny Llama in
float32, and the Qwen2 in bfloat16 (judged with bf16's tolerance, 50 times fp32's), two boxes each, started through
scripts/launch_sglang.sh with the receiver agent. The test writes a changed tensor straight into one box through
SGLang's own ``/update_weights_from_tensor`` (its weight-update session, no version: the receiver agent and the
manager know nothing, and the box still says it serves the version it did), then polls the manager's
``/get_instances_status`` until the probe, every ``trust_probe_interval_s``, has found that box and only it:
"disagrees" there, "checked" on the other.

With two boxes a majority cannot tell which one went wrong; the probe's baseline can: each box's first passing
probe at its version is kept, and the box whose probe moved beyond the tolerance since is the one that changed.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from real_sglang import Daemon, RealBox, make_tiny_model, start_boxes, start_manager
from safetensors.torch import load_file
from support import wait_until

from rollout_manager.instances.trust import tolerance
from rollout_manager.sglang import tensor_payload, wire

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow]

FLEETS = (("qwen2", "float32"), ("llama", "float32"), ("qwen2", "bfloat16"))  # (model, SGLang --dtype)
PROBE_INTERVAL_S = 1.0
CAUGHT_WITHIN_S = 60.0  # a few probe rounds; generous for a 2-core machine shared with other suites
# Replaced by another tensor of its size, 8 times the magnitude (a wrong tensor, not the trainer's). The tiny
# random models' logits are near zero, so small noise barely moves their log-probs: 5% noise on this tensor moves
# the probe's mean by ~0.02, a replacement of its own magnitude by ~0.16 and one of 8 times by ~0.8-1.0
# (transformers, bf16), while two clean boxes agree exactly; the tolerances are 1e-3 (fp32) and 0.3 (bf16, set by
# the spread measured on a GPU).
ROGUE_SCALE = 8.0
ROGUE_TENSOR = "lm_head.weight"


@dataclass
class Fleet:
    manager: Daemon
    boxes: list[RealBox]
    model_dir: Path


def _fleet(arch: str, dtype: str, model_dir: Path, log_dir: Path) -> Fleet:
    manager = start_manager(log_dir, trust_probe_interval_s=str(PROBE_INTERVAL_S))
    try:
        names = [f"{arch}-{dtype}-a", f"{arch}-{dtype}-b"]
        return Fleet(manager, start_boxes(model_dir, manager.url, log_dir, names, "--dtype", dtype), model_dir)
    except BaseException:
        manager.stop()
        raise


@pytest.fixture(scope="module")
def fleets(real_sglang_model: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], Fleet]]:
    base = tmp_path_factory.getbasetemp()
    models = {"llama": real_sglang_model, "qwen2": make_tiny_model(base / "real_sglang_qwen2", "qwen2")}
    log_dir = tmp_path_factory.mktemp("trust")
    with ThreadPoolExecutor(len(FLEETS)) as pool:  # every fleet starts at once
        futures = {(arch, dtype): pool.submit(_fleet, arch, dtype, models[arch], log_dir) for arch, dtype in FLEETS}
        started = {key: f.result() for key, f in futures.items() if f.exception() is None}
    try:
        for future in futures.values():
            if (failed := future.exception()) is not None:
                raise failed
        yield started
    finally:  # every box stopped at once (each may wait for its launcher's drain), then the managers
        with ThreadPoolExecutor(max(1, sum(len(f.boxes) for f in started.values()))) as pool:
            list(pool.map(RealBox.stop, [box for fleet in started.values() for box in fleet.boxes]))
        for fleet in started.values():
            fleet.manager.stop()


def trust_of(fleet: Fleet) -> dict[str, dict[str, Any]]:
    """Each box's trust record and serving version, by endpoint, from the manager's own status."""
    with urllib.request.urlopen(fleet.manager.url + "/get_instances_status", timeout=10) as r:
        status = json.loads(r.read())
    return {i["endpoint"]: {**i["trust"], "weight_version": i.get("weight_version")} for i in status["instances"]}


def states(fleet: Fleet) -> list[str]:
    trust = trust_of(fleet)
    return [trust[box.endpoint]["state"] if box.endpoint in trust else "gone" for box in fleet.boxes]


async def rogue_write(box: RealBox, model_dir: Path) -> None:
    """A changed tensor written into ``box`` through SGLang's own weight-update session, bypassing the receiver
    agent: no version is given, so SGLang goes on reporting the one it had."""
    original = load_file(str(model_dir / "model.safetensors"))[ROGUE_TENSOR]
    noise = torch.randn(original.shape, generator=torch.Generator().manual_seed(7))
    changed = ROGUE_SCALE * original.abs().mean() * noise
    payload = [tensor_payload.serialize_named_tensors([(ROGUE_TENSOR, changed.contiguous())])]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        for path, body in (("/begin_weight_update", {}),
                           ("/update_weights_from_tensor",
                            wire.update_weights_from_tensor_body(payload, flush_cache=True, weight_version=None)),
                           ("/end_weight_update", {})):
            async with s.post(box.url + path, json=body) as r:
                assert r.status == 200, f"{path}: HTTP {r.status} {(await r.text())[:300]}"


def trainer_reference(model_dir: Path, ids: list[int]) -> list[float]:
    """The probe prompt's log-probs by the trainer's model: the checkpoint loaded with transformers, float32."""
    from transformers import AutoModelForCausalLM

    from trainer_plugin.probe_reference import hf_logits, reference_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    return reference_logprobs(hf_logits(model), ids)


def post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return dict(json.loads(r.read()))


@pytest.mark.parametrize(("arch", "dtype"), FLEETS)
def test_the_trainers_own_forward_is_within_the_tolerance_of_every_box(
        fleets: dict[tuple[str, str], Fleet], arch: str, dtype: str) -> None:
    """Item 1's "where the trainer can provide the probe's reference log-probs, use them too", on real SGLang:
    the reference (transformers, float32, on this CPU) judges both boxes checked, with the box's tolerance."""
    fleet = fleets[(arch, dtype)]
    with urllib.request.urlopen(fleet.manager.url + "/probe_prompt", timeout=10) as r:
        ids = json.loads(r.read())["input_ids"]
    version = trust_of(fleet)[fleet.boxes[0].endpoint]["weight_version"]
    reference = trainer_reference(fleet.model_dir, ids)
    answer = post_json(fleet.manager.url + "/update_probe_reference",
                       {"weight_version": version, "input_ids": ids, "logprobs": reference})
    assert answer["probed_again"] == 2

    def judged_by_reference() -> bool:
        trust = trust_of(fleet)
        return all(trust[b.endpoint]["state"] == "checked" and "reference" in (trust[b.endpoint]["detail"] or "")
                   for b in fleet.boxes)

    wait_until(judged_by_reference, CAUGHT_WITHIN_S, interval_s=0.25,
               message=lambda: f"both {arch} {dtype} boxes checked by the reference: {trust_of(fleet)}")
    diffs = [trust_of(fleet)[b.endpoint]["diff"] for b in fleet.boxes]
    print(f"{arch} {dtype}: SGLang's probe against transformers' float32 forward: mean |diff| "
          f"{', '.join(f'{d:.3g}' for d in diffs)} (tolerance {tolerance(dtype, None, 1):g})")


@pytest.mark.parametrize(("arch", "dtype"), FLEETS)
async def test_a_rogue_write_into_one_box_is_caught_by_the_probe_on_that_box_alone(
        fleets: dict[tuple[str, str], Fleet], arch: str, dtype: str) -> None:
    fleet = fleets[(arch, dtype)]
    good, bad = fleet.boxes
    # both boxes checked at the version they serve: each has its baseline
    wait_until(lambda: states(fleet) == ["checked", "checked"], CAUGHT_WITHIN_S, interval_s=0.25,
               message=lambda: f"both {arch} boxes checked: {trust_of(fleet)}")
    before = trust_of(fleet)
    assert before[bad.endpoint]["disagreements"] == 0 and before[good.endpoint]["disagreements"] == 0

    await rogue_write(bad, fleet.model_dir)
    written = time.monotonic()
    wait_until(lambda: states(fleet) == ["checked", "disagrees"], CAUGHT_WITHIN_S, interval_s=0.25,
               message=lambda: f"{bad.endpoint} disagrees and {good.endpoint} checked: {trust_of(fleet)}")
    caught_s = time.monotonic() - written
    # the good box's probe of the same round may be judged after the bad one's: wait for it too
    wait_until(lambda: trust_of(fleet)[good.endpoint]["probes"] > before[good.endpoint]["probes"], CAUGHT_WITHIN_S,
               interval_s=0.25, message=lambda: f"{good.endpoint} probed after the write: {trust_of(fleet)}")

    after = trust_of(fleet)
    flagged, fine = after[bad.endpoint], after[good.endpoint]
    # the write was silent: same version as before, nothing loaded through the manager
    assert flagged["weight_version"] == before[bad.endpoint]["weight_version"]
    assert flagged["disagreements"] == 1 and fine["disagreements"] == 0
    assert flagged["diff"] is not None and flagged["diff"] > tolerance(dtype, None, 1) and "moved" in flagged["detail"]
    assert fine["probes"] > before[good.endpoint]["probes"]  # the good box was probed after the write too
    print(f"{arch} {dtype}: rogue write caught in {caught_s:.1f} s (probe every {PROBE_INTERVAL_S:g} s), "
          f"moved by {flagged['diff']:.3g}")
