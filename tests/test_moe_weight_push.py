"""MoE weight pushes: per-expert tensors as the trainer names them reach the engine exactly, full and delta, in
one flattened bucket per ``/update_weights_from_tensor`` call (rollout_manager/sglang/tensor_payload.py), however
many experts there are.

The bucket format is SGLang 0.5.23's ``load_format: "flattened_bucket"``; that SGLang's own decoder takes what the
agent sends is checked here too where .venv-sglang exists (real_sglang), and end to end on real SGLang by
tests/test_real_sglang_moe_pushes.py.
"""

from __future__ import annotations

import asyncio
import base64
import os
import pickle
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import torch
from real_sglang import SGLANG_ENV, SGLANG_PY, require_sglang_venv
from support import PY, Proc, free_port, wait_http_ok_sync

from rollout_manager.cpu_engine.model import TinyCausalLM, build_model, tensor_checksum
from rollout_manager.cpu_engine.server import DEBUG_CHECKSUM
from rollout_manager.sglang import tensor_payload
from rollout_manager.weights.layout import HostBuffer, build_layout, stage, unpack
from rollout_manager.weights.protocol import CommitRequest, PushRequest
from rollout_manager.weights.receiver import Receiver
from rollout_manager.weights.sender_agent import SenderAgent

EXPERTS, LAYERS = 16, 3
MOE = {"num_hidden_layers": LAYERS, "num_experts": EXPERTS}


# ---------------------------------------------------------------- the bucket


def _views(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """``state`` as the receiver agent holds it: views into one staged host buffer."""
    layout = build_layout(state)
    buf = HostBuffer.for_layout(layout)
    stage(state, layout, buf)
    return unpack(buf, layout)


def _same(got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]]) -> bool:
    return [n for n, _ in got] == [n for n, _ in want] and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                 b.reshape(-1).view(torch.uint8))
        for (_, a), (_, b) in zip(got, want))


def test_a_bucket_holds_every_tensor_bit_for_bit_whatever_its_dtype_shape_or_source() -> None:
    state = {"w.bf16": torch.randn(5, 3).bfloat16(), "w.f32": torch.randn(7), "w.i8": torch.arange(3, dtype=torch.int8),
             "w.empty": torch.empty(0, 4), "w.nan": torch.tensor([float("nan"), -0.0, float("inf")]),
             "w.f64": torch.randn(2, 2, dtype=torch.float64)}
    views = _views(state)
    foreign = [("t.transposed", torch.randn(4, 6).t()), ("t.half", torch.randn(9).half())]
    for named in (views, views[::2], foreign + views[1:3], foreign):
        bucket = tensor_payload.pack_bucket(named)
        assert all(e.start % tensor_payload.BUCKET_ALIGN == 0 for e in bucket.entries)
        assert _same(tensor_payload.deserialize_bucket(tensor_payload.serialize_bucket(bucket)), named)


def test_tensors_back_to_back_in_the_buffer_go_in_one_copy() -> None:
    state = {f"model.layers.0.mlp.experts.{e}.{p}_proj.weight": torch.randn(8, 4) for e in range(4) for p in "gud"}
    views = _views(state)
    bucket = tensor_payload.pack_bucket(views)
    layout = build_layout(state)
    assert bucket.data.numel() == layout.specs[-1].offset + layout.specs[-1].nbytes  # the buffer's own spacing
    assert [e.start for e in bucket.entries] == [s.offset for s in layout.specs]
    picked = views[1:3] + views[7:8]  # a delta's few tensors: packed tight, nothing between them
    assert tensor_payload.pack_bucket(picked).data.numel() <= 3 * 256


def test_a_bucket_that_lies_is_refused() -> None:
    bucket = tensor_payload.pack_bucket([("a", torch.randn(4, 4))])
    good = tensor_payload.serialize_bucket(bucket)
    obj = pickle.loads(base64.b64decode(good))
    obj["metadata"][0].end_idx += 4  # a range that does not hold the shape
    with pytest.raises(ValueError, match="do not hold"):
        tensor_payload.deserialize_bucket(base64.b64encode(pickle.dumps(obj)))
    with pytest.raises(ValueError, match="flattened bucket is"):
        tensor_payload.deserialize_bucket(tensor_payload.serialize_named_tensors([("a", torch.randn(2))]))
    evil = base64.b64encode(pickle.dumps({"flattened_tensor": os.getcwd, "metadata": []}))
    with pytest.raises(ValueError, match="not allowed"):
        tensor_payload.deserialize_bucket(evil)


@pytest.mark.real_sglang
@pytest.mark.slow
def test_sglangs_own_decoder_takes_the_bucket(tmp_path: Path) -> None:
    """SGLang 0.5.23's restricted unpickler and FlattenedTensorBucket rebuild the agent's bucket exactly."""
    require_sglang_venv()
    named = _views({f"model.layers.0.mlp.experts.{e}.up_proj.weight": torch.randn(4, 8).bfloat16() for e in range(5)}
                   | {"model.layers.0.mlp.gate.weight": torch.randn(5, 8)})
    (tmp_path / "payload").write_text(tensor_payload.serialize_bucket(tensor_payload.pack_bucket(named)))
    torch.save({n: t.clone() for n, t in named}, tmp_path / "want.pt")
    script = (
        "import sys, torch\n"
        "from sglang.srt.utils.common import MultiprocessingSerializer, normalize_serialized_named_tensor_payload\n"
        "from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket\n"
        "raw = normalize_serialized_named_tensor_payload(open(sys.argv[1]).read())\n"
        "d = MultiprocessingSerializer.deserialize(raw)\n"
        "bucket = FlattenedTensorBucket(flattened_tensor=d['flattened_tensor'], metadata=d['metadata'])\n"
        "got = bucket.reconstruct_tensors()\n"
        "want = torch.load(sys.argv[2])\n"
        "assert [n for n, _ in got] == list(want), [n for n, _ in got]\n"
        "assert all(t.dtype == want[n].dtype and torch.equal(t, want[n]) for n, t in got)\n"
        "print('ok', len(got))\n")
    proc = subprocess.run([str(SGLANG_PY), "-c", script, str(tmp_path / "payload"), str(tmp_path / "want.pt")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **SGLANG_ENV})
    assert proc.returncode == 0 and proc.stdout.strip() == f"ok {len(named)}", proc.stderr[-3000:]


# ---------------------------------------------------------------- pushes into a MoE CPU engine


@pytest.fixture
async def moe_engine(tmp_path: Path) -> AsyncIterator[str]:
    port = free_port()
    proc = Proc([PY, "-m", "rollout_manager.cpu_engine", "--port", str(port), "--seed", "0", "--num-experts",
                 str(EXPERTS), "--model-config", f'{{"num_hidden_layers": {LAYERS}}}'], tmp_path / "engine.log")
    try:
        wait_http_ok_sync(f"http://127.0.0.1:{port}/health", proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


async def _engine_sums(url: str) -> dict[str, str]:
    async with aiohttp.ClientSession() as s, s.get(url + DEBUG_CHECKSUM) as r:
        return dict((await r.json())["tensors"])


async def _generate(url: str) -> list[int]:
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
    async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
        return list((await r.json())["output_ids"])


async def _push(sender: SenderAgent, rx: Receiver, version: int, delta: bool) -> tuple[str, int, int]:
    """Sender -> receiver over TCP, then commit (verify and load): (mode, tensors reloaded, load calls)."""
    layout = sender.layout
    assert layout is not None
    offer = sender.delta_offer(version - 1, version) if delta else None
    prep = rx.prepare(layout, "tcp", offer.base_version if offer else None, offer.bytes if offer else None)
    assert (prep.delta_addr is not None) == delta
    pushed = await asyncio.to_thread(sender.push, PushRequest(
        version=version, ip="127.0.0.1", num_engines=2, transport="tcp", session_ids=prep.session_ids,
        buffer_addr=prep.buffer_addr, delta_base=offer.base_version if offer else None,
        delta_addr=prep.delta_addr if offer else None))
    answer = await rx.commit(CommitRequest(version=version, fingerprint=pushed.fingerprint, shards=pushed.shards,
                                           checksums=pushed.checksums, delta_base=pushed.delta_base,
                                           delta_bytes=pushed.bytes if offer else None))
    assert answer.ok and len(pushed.shards) == 2  # the transfer is shards of the buffer, not tensors
    return ("delta" if delta else "full"), answer.reloaded, answer.buckets


async def test_per_expert_tensors_reach_a_moe_engine_exactly_full_then_a_few_experts_by_delta(
        moe_engine: str) -> None:
    state = {n: p.detach().clone() for n, p in build_model(7, **MOE).named_parameters()}
    assert sum(".mlp.experts." in n for n in state) == 3 * EXPERTS * LAYERS
    before = await _generate(moe_engine)
    sender = SenderAgent(["127.0.0.1"], 0)
    rx = Receiver("127.0.0.1", moe_engine, bucket_bytes=1 << 20)
    await rx.start()
    try:
        sender.stage(state, 1)
        mode, reloaded, calls = await _push(sender, rx, 1, delta=False)
        total = build_layout(state).total_bytes
        assert (mode, reloaded) == ("full", len(state)) and calls == -(-total // (1 << 20))  # by bytes, not tensors
        assert await _engine_sums(moe_engine) == {n: tensor_checksum(t) for n, t in state.items()}
        full = await _generate(moe_engine)
        assert full != before

        changed = [f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in (2, 9, 15)
                   for p in ("gate", "up", "down")]
        state = dict(state)
        for name in changed:
            state[name] = state[name] + 0.5 * torch.randn(state[name].shape, generator=torch.Generator().manual_seed(3))
        sender.stage(state, 2)
        assert await _push(sender, rx, 2, delta=True) == ("delta", len(changed), 1)
        assert await _engine_sums(moe_engine) == {n: tensor_checksum(t) for n, t in state.items()}
        reference = build_model(7, **MOE)
        reference.load_named_tensors(state.items())
        assert await _generate(moe_engine) == _greedy(reference, [5, 6, 7, 8], 16)
    finally:
        await rx.close()
        sender.stop()


def _greedy(model: TinyCausalLM, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(torch.argmax(model.logits_last(ids))))
    return ids[len(prompt):]
