"""The served model's tensor names and shapes, read from the checkpoint SGLang loaded.

Why: SGLang 0.5.23's ``/update_weights_from_tensor`` skips a name its model does not know (a warning,
then success: the old weights stay) and dies on a shape mismatch (the scheduler asserts, SIGQUIT).
SGLang exposes no list of loadable names, but ``/server_info`` says ``model_path``, and on the box
that runs it that is a directory of ``*.safetensors`` (or a Hugging Face hub id whose files are in the
local cache): their headers name every tensor the model was loaded from, with its shape and dtype.
Only the headers are read (8 bytes of length, then JSON), never the tensors.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# safetensors' dtype names -> torch's (the ones a checkpoint of a language model holds).
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                      "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                      "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound
TIED_HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


@dataclass(frozen=True)
class CheckpointTensor:
    shape: tuple[int, ...]
    dtype: str  # torch's name, e.g. "bfloat16"


@dataclass(frozen=True)
class ServedModel:
    """The checkpoint's tensors by name, and where they were read from."""

    path: str
    tensors: dict[str, CheckpointTensor]

    def problems(self, specs: Iterable[tuple[str, tuple[int, ...]]]) -> list[str]:
        """Why each (name, shape) would not load as sent: a name the checkpoint lacks (SGLang would skip
        it silently), a shape other than the checkpoint's (SGLang's scheduler would die). A tied model's
        ``lm_head.weight`` is accepted when it has the embedding's shape: SGLang skips it by design."""
        out: list[str] = []
        for name, shape in specs:
            known = self.tensors.get(name)
            if known is None and name == TIED_HEAD and EMBEDDING in self.tensors:
                known = self.tensors[EMBEDDING]
            if known is None:
                out.append(f"{name!r} is not a tensor of the served model")
            elif tuple(shape) != known.shape:
                out.append(f"{name!r} has shape {list(shape)}, the served model's is {list(known.shape)}")
        return out


def read_header(path: Path) -> dict[str, CheckpointTensor]:
    """One ``.safetensors`` file's tensors (header only). Raises ValueError when it is not one."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: too short for a safetensors header")
        (size,) = struct.unpack("<Q", head)
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: a header of {size} bytes")
        header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    out: dict[str, CheckpointTensor] = {}
    for name, entry in header.items():
        if name == "__metadata__" or not isinstance(entry, dict):
            continue
        shape, dtype = entry.get("shape"), entry.get("dtype")
        if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
            raise ValueError(f"{path}: tensor {name!r} has no shape")
        out[name] = CheckpointTensor(tuple(shape), SAFETENSORS_DTYPES.get(str(dtype), str(dtype).lower()))
    return out


def local_model_dir(model_path: str) -> Path | None:
    """``model_path`` as a local directory: itself, or a hub id's snapshot in the local cache; None when
    neither is on this box (nothing is downloaded)."""
    path = Path(model_path).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return Path(snapshot_download(model_path, local_files_only=True, allow_patterns=["*.safetensors", "*.json"]))
    except Exception:  # not in the cache, not a hub id: huggingface_hub raises several kinds
        return None


def served_model(model_path: str) -> ServedModel | None:
    """The checkpoint at ``model_path`` (see :func:`local_model_dir`); None when it cannot be read here
    (no such directory, no ``*.safetensors`` in it)."""
    root = local_model_dir(model_path)
    if root is None:
        return None
    files = sorted(root.glob("*.safetensors"))
    if not files:
        return None
    tensors: dict[str, CheckpointTensor] = {}
    for file in files:
        try:
            tensors.update(read_header(file))
        except (OSError, ValueError):
            return None
    return ServedModel(str(root), tensors)
