"""The support code that lets real SGLang run on CPU (scripts/sglang_cpu/), checked in .venv-sglang: the
sgl_kernel stand-in's two KV-cache ops against plain indexing, its refusals, and the torchvision hook."""

from __future__ import annotations

import os
import subprocess

import pytest
from real_sglang import SGLANG_ENV, SGLANG_PY, require_sglang_venv

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow]

CHECK = r'''
import torch, sgl_kernel
from sgl_kernel import assign_req_to_token_pool_cpu, copy_all_layer_kv_cache_cpu

# assign_req_to_token_pool_cpu: request i's slice of out_cache_loc goes to req_to_token[pool[i], start:end]
req_to_token = torch.zeros(4, 10, dtype=torch.int32)
pool, start, end = torch.tensor([2, 0]), torch.tensor([1, 3]), torch.tensor([4, 5])
out_cache_loc = torch.tensor([11, 12, 13, 21, 22], dtype=torch.int64)
torch.ops.sgl_kernel.assign_req_to_token_pool_cpu(pool, req_to_token, start, end, out_cache_loc, 10)
expect = torch.zeros(4, 10, dtype=torch.int32)
expect[2, 1:4] = torch.tensor([11, 12, 13]); expect[0, 3:5] = torch.tensor([21, 22])
assert torch.equal(req_to_token, expect), req_to_token

# copy_all_layer_kv_cache_cpu: rows src_loc -> tgt_loc in every buffer, reached by address
bufs = [torch.randn(16, 2, 4), torch.randn(16, 2, 4, dtype=torch.float64)]
before = [b.clone() for b in bufs]
ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs])
src, tgt = torch.tensor([1, 2, 3]), torch.tensor([3, 9, 1])  # 3 is both a source and a target
copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
for b, ref in zip(bufs, before):
    want = ref.clone(); want[tgt] = ref[src]
    assert torch.equal(b, want)

for name in sgl_kernel._SPECULATIVE:
    try:
        getattr(sgl_kernel, name)()
    except NotImplementedError:
        pass
    else:
        raise AssertionError(name)
try:
    from sgl_kernel import silu_and_mul  # noqa
except ImportError as exc:
    assert "CPU stand-in" in str(exc)
else:
    raise AssertionError("an unknown name imported")
assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")  # SGLang keeps its own torch layers

import torchvision  # the hook declared its operators
print("ok")
'''


def test_sgl_kernel_stand_in_and_torchvision_hook() -> None:
    require_sglang_venv()
    done = subprocess.run([str(SGLANG_PY), "-c", CHECK], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **SGLANG_ENV})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_without_the_cpu_switch_torchvision_is_left_alone() -> None:
    """The hook is active only with SGLANG_USE_CPU_ENGINE=1: other processes of that venv see the plain import."""
    require_sglang_venv()
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    done = subprocess.run([str(SGLANG_PY), "-c", "import torchvision"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode != 0 and "torchvision::nms does not exist" in done.stderr
