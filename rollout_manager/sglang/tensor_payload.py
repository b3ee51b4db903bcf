"""The tensors inside SGLang's ``/update_weights_from_tensor`` body: ``serialized_named_tensors`` entries.

Two forms, both SGLang's own: a pickled ``[(name, tensor), ...]`` (``load_format`` null), and a *flattened
bucket* (``load_format: "flattened_bucket"``): one uint8 tensor holding every tensor's bytes plus, per tensor,
its name, dtype, shape and byte range, which SGLang turns back into views and hands to the model's
``load_weights`` as the same list. The receiver agent sends buckets: a MoE model has 3 tensors per expert
per layer (18,432 for 128 experts and 48 layers), and pickling each tensor (a ``torch.save`` of its storage,
or on a GPU box one CUDA IPC handle that SGLang opens) costs per tensor what one bucket costs per bucket
(``benchmarks/bench_moe_push.py``).

Kept apart from :mod:`rollout_manager.sglang.wire` (SGLang's HTTP contract, which the manager imports)
because this half needs torch: only the receiver agent (which encodes) and the CPU engine (which
decodes) import it, and both come with extras that bring torch (docs/install.md).
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

FLATTENED_BUCKET = "flattened_bucket"  # SGLang's load_format for a bucket
BUCKET_ALIGN = 64  # each tensor starts at a multiple of this in a bucket: a typed view is always legal
RUN_GAP = 256  # tensors at most this far apart in one storage (the staged buffer's alignment) share one copy

# Module prefixes a serialized tensor list may reference when unpickled (SGLang restricts its
# unpickler the same way): tensors rebuilt by value, or through torch's shared-memory reductions.
_TENSOR_PICKLE_MODULES = ("collections", "copyreg", "torch", "multiprocessing.resource_sharer")
_TENSOR_PICKLE_BUILTINS = frozenset(
    {"list", "tuple", "dict", "set", "frozenset", "int", "float", "complex", "bool", "str", "bytes",
     "bytearray", "slice", "range", "object"}
)
# Exact globals outside those prefixes (SGLang 0.5.23's SafeUnpickler admits them too): a bucket's metadata.
_TENSOR_PICKLE_GLOBALS = frozenset({("types", "SimpleNamespace")})


def serialize_named_tensors(named_tensors: list[tuple[str, torch.Tensor]], *, share_memory: bool = False) -> str:
    """One TP rank's ``serialized_named_tensors`` entry: base64 of a pickled ``[(name, tensor), ...]``.

    ``share_memory=True`` pickles with ``multiprocessing.reduction.ForkingPickler`` exactly as SGLang's
    ``MultiprocessingSerializer.serialize(obj, output_str=True)`` does: CUDA tensors become IPC
    handles and CPU tensors shared-memory handles, so the payload is only valid on the same box while
    the sender keeps the tensors alive (for CPU tensors between unrelated processes, also call
    ``torch.multiprocessing.set_sharing_strategy("file_system")`` first). The default pickles CPU
    tensors by value, which any receiver can load, SGLang included (its unpickler admits ``torch.*``).
    """
    return _pickle_b64([(str(name), tensor) for name, tensor in named_tensors], share_memory)


class _Unpickler(pickle.Unpickler):
    """Admits only what a tensor list needs, as SGLang's own unpickler does."""

    def find_class(self, module: str, name: str) -> Any:
        if (module == "builtins" and name in _TENSOR_PICKLE_BUILTINS) or (module, name) in _TENSOR_PICKLE_GLOBALS:
            return super().find_class(module, name)
        if not any(module == m or module.startswith(m + ".") for m in _TENSOR_PICKLE_MODULES):
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a tensor payload")
        return super().find_class(module, name)


def deserialize_named_tensors(payload: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`serialize_named_tensors` (and of SGLang's serializer), for one rank's entry.

    Raises ValueError when the payload is not base64, not an allowed pickle, or not name/tensor pairs.
    """
    obj = _unpickle_b64(payload)
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


# ---------------------------------------------------------------- flattened buckets


@dataclass(frozen=True)
class BucketEntry:
    """One tensor's place in a bucket: bytes ``[start, end)`` of the flat uint8 tensor."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class FlatBucket:
    """Many tensors packed into one flat uint8 tensor, one copy of their bytes (``load_format`` flattened_bucket)."""

    data: torch.Tensor
    entries: tuple[BucketEntry, ...]

    def __len__(self) -> int:
        return len(self.entries)


def _align(value: int) -> int:
    return (value + BUCKET_ALIGN - 1) // BUCKET_ALIGN * BUCKET_ALIGN


def pack_bucket(named: Sequence[tuple[str, torch.Tensor]]) -> FlatBucket:
    """Copy ``named`` (CPU tensors, any dtype, contiguous or not) into one new uint8 tensor, each at a
    :data:`BUCKET_ALIGN` boundary; the bits are copied, never converted. Tensors that lie back to back in one
    storage (views of the receiver's buffer, in layout order) keep their spacing and go in one copy per run."""
    entries: list[BucketEntry] = []
    runs: list[tuple[torch.Tensor, int, int]] = []  # (source bytes, bucket start, length): one copy each
    end = 0
    run: tuple[int, int, int] | None = None  # (storage address, source start, bucket start) of the open run
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        src = _storage_bytes(tensor)
        if src is not None and run is not None and src[0] == run[0] and 0 <= src[1] - (run[1] + end - run[2]) \
                <= RUN_GAP and (src[1] - run[1]) % BUCKET_ALIGN == 0:
            start = run[2] + src[1] - run[1]  # continues the open run: same spacing as in the source
            last = runs[-1]
            runs[-1] = (last[0], last[1], start + nbytes - last[1])
        else:
            start = _align(end)
            run = (src[0], src[1], start) if src is not None else None
            runs.append((tensor, start, nbytes))
        end = start + nbytes
        entries.append(BucketEntry(str(name), tensor.dtype, tuple(tensor.shape), start, end))
    data = torch.empty(max(end, 1), dtype=torch.uint8)[:end]
    for tensor, start, length in runs:
        if length:
            data[start: start + length].copy_(_source_bytes(tensor, length))
    return FlatBucket(data, tuple(entries))


def _storage_bytes(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(storage address, byte offset in it) of a contiguous CPU tensor; None for any other."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    return tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()) * tensor.element_size()


def _source_bytes(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """``length`` bytes from the start of ``tensor`` as uint8 (past its end for a run: the same storage)."""
    spot = _storage_bytes(tensor)
    if spot is None:
        return tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    raw = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    return raw[spot[1]: spot[1] + length]


def serialize_bucket(bucket: FlatBucket, data: torch.Tensor | None = None, *, share_memory: bool = False) -> str:
    """One TP rank's entry for ``load_format: "flattened_bucket"``: SGLang's ``{"flattened_tensor", "metadata"}``
    dict, the metadata as plain namespaces with the fields SGLang reads (``FlattenedTensorMetadata``'s).
    ``data``: the bucket's bytes where they were copied to (a GPU, for IPC with ``share_memory``)."""
    flat = bucket.data if data is None else data
    metadata = [SimpleNamespace(name=e.name, shape=torch.Size(e.shape), dtype=e.dtype, start_idx=e.start,
                                end_idx=e.end, numel=e.end - e.start) for e in bucket.entries]
    return _pickle_b64({"flattened_tensor": flat, "metadata": metadata}, share_memory)


def deserialize_bucket(payload: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`serialize_bucket`: the ``(name, tensor)`` views SGLang hands its ``load_weights``.
    Raises ValueError on anything but a well-formed bucket (a range outside the data, a misaligned view)."""
    obj = _unpickle_b64(payload)
    flat = obj.get("flattened_tensor") if isinstance(obj, dict) else None
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1 or not isinstance(
            metadata, (list, tuple)):
        raise ValueError("a flattened bucket is {'flattened_tensor': flat uint8 tensor, 'metadata': [...]}")
    out: list[tuple[str, torch.Tensor]] = []
    for meta in metadata:
        try:
            name, dtype, shape = meta.name, meta.dtype, torch.Size(meta.shape)
            start, end = int(meta.start_idx), int(meta.end_idx)
        except (AttributeError, TypeError, ValueError):
            raise ValueError("bucket metadata lacks name, dtype, shape, start_idx or end_idx") from None
        if not isinstance(name, str) or not isinstance(dtype, torch.dtype):
            raise ValueError("bucket metadata: name must be a str and dtype a torch.dtype")
        if not 0 <= start <= end <= flat.numel() or end - start != shape.numel() * dtype.itemsize:
            raise ValueError(f"{name}: bytes [{start}, {end}) do not hold {dtype}{tuple(shape)} in a bucket of "
                             f"{flat.numel()}")
        try:
            out.append((name, flat[start:end].view(dtype).reshape(shape)))
        except RuntimeError as exc:
            raise ValueError(f"{name}: {exc}") from None
    return out


def _pickle_b64(obj: Any, share_memory: bool) -> str:
    buf = io.BytesIO()
    if share_memory:
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

        ForkingPickler(buf).dump(obj)
    else:
        pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _unpickle_b64(payload: str | bytes) -> Any:
    import torch.multiprocessing  # noqa: F401  (shared-memory payloads rebuild through its reductions)

    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise ValueError(f"serialized_named_tensors entry is not base64: {exc}") from None
    try:
        return _Unpickler(io.BytesIO(raw)).load()
    except Exception as exc:
        raise ValueError(f"cannot unpickle serialized_named_tensors entry: {exc}") from None
