"""On a GPU box the receiver agent hands SGLang its bucket as a CUDA IPC handle: one flat tensor per TP rank
(rollout_manager/sglang/weight_loader.py ``_payloads``). Another process (SGLang's scheduler, here a spawned
child) must rebuild every tensor bit for bit from it. Also prints what the two payload forms cost at a MoE's
tensor count (18,432 expert tensors), encoded here and opened in the child. Needs CUDA; skipped without it."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest
import torch

from rollout_manager.sglang import tensor_payload, wire
from rollout_manager.sglang.weight_loader import _payloads

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _open(conn: Any) -> None:
    """The child: decode each payload it is sent, answer (seconds, per-tensor sums of the bytes)."""
    torch.cuda.init()
    while (msg := conn.recv()) is not None:
        form, payload = msg
        t0 = time.perf_counter()
        named = (tensor_payload.deserialize_bucket(payload) if form == "bucket"
                 else tensor_payload.deserialize_named_tensors(payload))
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        devices = {str(t.device) for _, t in named}
        sums = [(n, t.reshape(-1).view(torch.uint8).to(torch.int64).sum().item(), tuple(t.shape), str(t.dtype))
                for n, t in named]
        conn.send((seconds, devices, sums))
        del named


def _moe_state(layers: int, experts: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for layer in range(layers):
        out.append((f"model.layers.{layer}.mlp.gate.weight", torch.randn(experts, 64, generator=gen).bfloat16()))
        for e in range(experts):
            for proj, shape in (("gate", (32, 64)), ("up", (32, 64)), ("down", (64, 32))):
                out.append((f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight",
                            torch.randn(shape, generator=gen).bfloat16()))
    return out


def _expected(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, int, tuple[int, ...], str]]:
    return [(n, t.reshape(-1).view(torch.uint8).to(torch.int64).sum().item(), tuple(t.shape), str(t.dtype))
            for n, t in named]


def test_a_bucket_reaches_another_process_over_cuda_ipc_bit_for_bit() -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_open, args=(child,), daemon=True)
    proc.start()
    try:
        info = wire.ServerInfo.from_json({"tp_size": 1})
        small = [("a", torch.randn(3, 5)), ("b", torch.randn(7).half()), ("c", torch.arange(6, dtype=torch.int32))]
        payloads, keep = _payloads(small, info, True)
        parent.send(("bucket", payloads[0]))
        _, devices, sums = parent.recv()
        assert devices == {"cuda:0"} and sums == _expected(small)
        del keep

        named = _moe_state(48, 128)  # 18,432 expert tensors and 48 routers
        t0 = time.perf_counter()
        payloads, keep = _payloads(named, info, True)
        bucket_encode = time.perf_counter() - t0
        parent.send(("bucket", payloads[0]))
        bucket_open, devices, sums = parent.recv()
        assert devices == {"cuda:0"} and sums == _expected(named)
        del keep

        t0 = time.perf_counter()  # the form sent before: a tensor each, each its own IPC handle
        on_gpu = [(n, t.to("cuda:0")) for n, t in named]
        torch.cuda.synchronize()
        listed = tensor_payload.serialize_named_tensors(on_gpu, share_memory=True)
        list_encode = time.perf_counter() - t0
        parent.send(("list", listed))
        list_open, _, sums = parent.recv()
        assert sums == _expected(named)
        print(f"\n{len(named)} tensors over CUDA IPC: one bucket {bucket_encode:.2f}s to build + {bucket_open:.2f}s to "
              f"open, payload {len(payloads[0]) / 1e3:.0f} kB; a tensor each {list_encode:.2f}s + {list_open:.2f}s, "
              f"payload {len(listed) / 1e3:.0f} kB")
    finally:
        parent.send(None)
        proc.join(60)
