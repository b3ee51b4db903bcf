"""The tensors inside SGLang's ``/update_weights_from_tensor`` body: ``serialized_named_tensors`` entries.

Kept apart from :mod:`rollout_manager.sglang.wire` (SGLang's HTTP contract, which the manager imports)
because this half needs torch: only the receiver agent (which encodes) and the CPU engine (which
decodes) import it, and both come with extras that bring torch (docs/install.md).
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from typing import Any

import torch

# Module prefixes a serialized tensor list may reference when unpickled (SGLang restricts its
# unpickler the same way): tensors rebuilt by value, or through torch's shared-memory reductions.
_TENSOR_PICKLE_MODULES = ("collections", "copyreg", "torch", "multiprocessing.resource_sharer")
_TENSOR_PICKLE_BUILTINS = frozenset(
    {"list", "tuple", "dict", "set", "frozenset", "int", "float", "complex", "bool", "str", "bytes",
     "bytearray", "slice", "range", "object"}
)


def serialize_named_tensors(named_tensors: list[tuple[str, torch.Tensor]], *, share_memory: bool = False) -> str:
    """One TP rank's ``serialized_named_tensors`` entry: base64 of a pickled ``[(name, tensor), ...]``.

    ``share_memory=True`` pickles with ``multiprocessing.reduction.ForkingPickler`` exactly as SGLang's
    ``MultiprocessingSerializer.serialize(obj, output_str=True)`` does: CUDA tensors become IPC
    handles and CPU tensors shared-memory handles, so the payload is only valid on the same box while
    the sender keeps the tensors alive (for CPU tensors between unrelated processes, also call
    ``torch.multiprocessing.set_sharing_strategy("file_system")`` first). The default pickles CPU
    tensors by value, which any receiver can load, SGLang included (its unpickler admits ``torch.*``).
    """
    pairs = [(str(name), tensor) for name, tensor in named_tensors]
    buf = io.BytesIO()
    if share_memory:
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

        ForkingPickler(buf).dump(pairs)
    else:
        pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(pairs)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class _Unpickler(pickle.Unpickler):
    """Admits only what a tensor list needs, as SGLang's own unpickler does."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _TENSOR_PICKLE_BUILTINS:
            return super().find_class(module, name)
        if not any(module == m or module.startswith(m + ".") for m in _TENSOR_PICKLE_MODULES):
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a tensor payload")
        return super().find_class(module, name)


def deserialize_named_tensors(payload: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`serialize_named_tensors` (and of SGLang's serializer), for one rank's entry.

    Raises ValueError when the payload is not base64, not an allowed pickle, or not name/tensor pairs.
    """
    import torch.multiprocessing  # shared-memory payloads rebuild through its reductions

    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise ValueError(f"serialized_named_tensors entry is not base64: {exc}") from None
    try:
        obj = _Unpickler(io.BytesIO(raw)).load()
    except Exception as exc:
        raise ValueError(f"cannot unpickle serialized_named_tensors entry: {exc}") from None
    if not isinstance(obj, (list, tuple)):
        raise ValueError(f"expected a list of (name, tensor), got {type(obj).__name__}")
    out: list[tuple[str, torch.Tensor]] = []
    for item in obj:
        if (
            not isinstance(item, (list, tuple))
            or len(item) != 2
            or not isinstance(item[0], str)
            or not isinstance(item[1], torch.Tensor)
        ):
            raise ValueError("expected a list of (name, tensor) pairs")
        out.append((item[0], item[1]))
    return out
