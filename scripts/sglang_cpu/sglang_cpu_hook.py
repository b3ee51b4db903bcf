"""Lets PyPI's torchvision import beside the CPU build of torch, for real SGLang on CPU (tests only).

SGLang imports torchvision at import time. PyPI's torchvision wheels carry a C++ extension built against
CUDA torch; on the CPU torch it does not load, and torchvision's own fake-tensor registrations then fail
with ``operator torchvision::nms does not exist``. Declaring the ``nms`` and ``qnms`` operator schemas
(the two it registers fakes for without checking that its extension loaded) lets it import; nothing on
SGLang's path calls them. Active only when ``SGLANG_USE_CPU_ENGINE=1`` (which every process that imports
SGLang on CPU sets), and only when torchvision is first imported: a ``.pth`` file installs the finder
below at interpreter start, so no other process pays for importing torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

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


def install() -> None:
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" and "torchvision" not in sys.modules:
        sys.meta_path.insert(0, _BeforeTorchvision())
