"""A pure-torch stand-in for ``sgl_kernel`` so that real SGLang 0.5.23 runs on a CPU-only box (tests only).

No package registry has a CPU build of ``sgl_kernel`` (PyPI's ``sglang-kernel`` is CUDA-only), yet SGLang
imports eight of its names at import time when it runs on CPU (``SGLANG_USE_CPU_ENGINE=1``):

- two that the KV-cache code calls on every request, implemented here in plain torch and registered with
  ``torch.library`` under the ``sgl_kernel`` namespace, as the real package does:
  ``copy_all_layer_kv_cache_cpu`` (``sglang/kernels/ops/kvcache/cache_move.py``) and
  ``assign_req_to_token_pool_cpu`` (``sglang/srt/mem_cache/allocation.py``);
- six that only speculative decoding calls (``sglang/kernels/ops/speculative/``): importable, raising if
  ever called.

``convert_weight_packed`` is deliberately NOT defined: SGLang turns its CPU (AMX) kernels on only when
``torch.ops.sgl_kernel.convert_weight_packed`` exists (``sglang/srt/utils/common.py``), so without it every
layer of a dense model runs SGLang's own torch code and no other ``sgl_kernel`` op is ever reached. Any
other name fails loudly on import, so that a later SGLang that needs more shows at once.
"""

from __future__ import annotations

import ctypes
from typing import Any, NoReturn

import torch

__version__ = "0.0.0+cpu-standin"

def _byte_rows(ptr: int, row_bytes: int, rows: int) -> torch.Tensor:
    """A uint8 [rows, row_bytes] view of memory that SGLang owns (a KV buffer, addressed by its data_ptr)."""
    buf = (ctypes.c_uint8 * (rows * row_bytes)).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8).view(rows, row_bytes)


@torch.library.custom_op("sgl_kernel::copy_all_layer_kv_cache_cpu", mutates_args=())
def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """Copy the KV rows ``src_loc`` to ``tgt_loc`` in every layer buffer (buffer i: ``data_ptrs[i]``, rows of
    ``strides[i]`` bytes). The buffers are reached by address, as the real kernel does."""
    if tgt_loc.numel() == 0:
        return
    src = src_loc.to(torch.int64)
    tgt = tgt_loc.to(torch.int64)
    rows = int(torch.maximum(src.max(), tgt.max()).item()) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        view = _byte_rows(int(ptr), int(stride), rows)
        view[tgt] = view[src].clone()  # clone: a location may be both a source and a target


@torch.library.custom_op("sgl_kernel::assign_req_to_token_pool_cpu", mutates_args=("req_to_token",))
def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """Write each request's slice of ``out_cache_loc`` (concatenated in request order) into
    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]``."""
    pos = 0
    for idx, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = int(end) - int(start)
        if n <= 0:
            continue
        if int(end) > pool_len:
            raise ValueError(f"assign_req_to_token_pool_cpu: end offset {end} beyond the pool row length {pool_len}")
        req_to_token[int(idx), int(start):int(end)] = out_cache_loc[pos:pos + n].to(req_to_token.dtype)
        pos += n


def _speculative_only(name: str) -> Any:
    def op(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name}: speculative decoding is not supported by this CPU stand-in "
            "(scripts/sglang_cpu/sgl_kernel); run SGLang without --speculative-algorithm")
    op.__name__ = name
    return op


_SPECULATIVE = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
)
for _name in _SPECULATIVE:
    globals()[_name] = _speculative_only(_name)


def __getattr__(name: str) -> NoReturn:
    """Every other name fails loudly: an ImportError with this message (an AttributeError would be replaced
    by a bare "cannot import name" in ``from sgl_kernel import X``)."""
    if name.startswith("__"):
        raise AttributeError(name)
    raise ImportError(
        f"sgl_kernel.{name} is not provided by the CPU stand-in (scripts/sglang_cpu/sgl_kernel): it implements "
        "only the KV-cache ops real SGLang needs on CPU for a dense model; add a pure-torch version if SGLang "
        "now needs this one")
