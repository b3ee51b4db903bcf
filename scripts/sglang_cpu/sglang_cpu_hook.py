"""Lets real SGLang run on CPU in tests: PyPI's torchvision beside the CPU torch, and routed-expert capture.

SGLang imports torchvision at import time. PyPI's torchvision wheels carry a C++ extension built against
CUDA torch; on the CPU torch it does not load, and torchvision's own fake-tensor registrations then fail
with ``operator torchvision::nms does not exist``. Declaring the ``nms`` and ``qnms`` operator schemas
(the two it registers fakes for without checking that its extension loaded) lets it import; nothing on
SGLang's path calls them. Active only when ``SGLANG_USE_CPU_ENGINE=1`` (which every process that imports
SGLang on CPU sets), and only when torchvision is first imported: a ``.pth`` file installs the finder
below at interpreter start, so no other process pays for importing torch.

``--enable-return-routed-experts`` (routed-expert replay) makes SGLang keep every token's experts in a host
buffer it allocates through ``ALLOC_MEMORY_FUNCS[device]`` with ``pin_memory=True``; on CPU the default
entry registers the buffer with CUDA and the server dies at start. The hook gives the ``cpu`` entry a plain
(unpinned) allocation as soon as SGLang's ``pool_host.common`` module is imported; nothing else on SGLang's
CPU path allocates through it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib.abc import Loader
from importlib.machinery import ModuleSpec
from importlib.util import find_spec
from types import ModuleType
from typing import Any

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_libs: list[object] = []  # a torch.library.Library must stay alive for its definitions to stay


def declare_torchvision_ops() -> None:
    """Declare torchvision::nms and torchvision::qnms unless something (a working extension) already did."""
    import torch

    missing = [name for name in _SCHEMAS if not torch._C._dispatch_has_kernel(f"torchvision::{name}")
               and not _has_schema(torch, name)]
    if not missing:
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for name in missing:
        lib.define(_SCHEMAS[name])
    _libs.append(lib)


def _has_schema(torch: ModuleType, name: str) -> bool:
    try:
        torch._C._get_schema(f"torchvision::{name}", "")
    except RuntimeError:
        return False
    return True


class _BeforeTorchvision:
    """A meta-path finder that only runs declare_torchvision_ops() once, before torchvision's first import."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            declare_torchvision_ops()
        return None


_HOST_ALLOC_MODULE = "sglang.srt.mem_cache.pool_host.common"


def _alloc_unpinned(dims: tuple[int, ...], dtype: Any, device: str, pin_memory: bool, allocator: Any,
                    registration_granularity_bytes: int | None = None) -> Any:
    """``ALLOC_MEMORY_FUNCS``'s signature; ordinary host memory whatever ``pin_memory`` asks."""
    import torch

    return torch.zeros(dims, dtype=dtype, device=device)


def allow_unpinned_host_buffers(module: ModuleType) -> None:
    """Route ``ALLOC_MEMORY_FUNCS["cpu"]`` (a defaultdict whose default pins through CUDA) to plain memory."""
    module.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_unpinned


class _PatchedLoader(Loader):
    """Runs the real loader, then ``patch`` on the fresh module."""

    def __init__(self, inner: Loader, patch: Any):
        self.inner, self.patch = inner, patch

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.patch(module)


class _AfterHostAlloc:
    """A meta-path finder that patches SGLang's host-memory module right after its first import."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != _HOST_ALLOC_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PatchedLoader(spec.loader, allow_unpinned_host_buffers)
        return spec


def install() -> None:
    if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        return
    if "torchvision" not in sys.modules:
        sys.meta_path.insert(0, _BeforeTorchvision())
    if _HOST_ALLOC_MODULE not in sys.modules:
        sys.meta_path.insert(0, _AfterHostAlloc())
