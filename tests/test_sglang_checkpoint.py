"""The served model's names and shapes, read from its checkpoint's safetensors headers (rollout_manager/sglang/
checkpoint.py): what the receiver agent refuses before SGLang would skip a tensor silently or die on its shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from real_sglang_model import make
from safetensors.torch import load_file, save_file

from rollout_manager.sglang.checkpoint import served_model


def test_names_and_shapes_come_from_the_headers(tmp_path: Path) -> None:
    save_file({"model.embed_tokens.weight": torch.zeros(10, 4), "model.norm.weight": torch.zeros(4)},
              str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(8, 4, dtype=torch.bfloat16)},
              str(tmp_path / "model-00002-of-00002.safetensors"))
    model = served_model(str(tmp_path))
    assert model is not None and model.path == str(tmp_path)
    assert model.tensors["model.layers.0.mlp.up_proj.weight"].shape == (8, 4)
    assert model.tensors["model.layers.0.mlp.up_proj.weight"].dtype == "bfloat16"
    assert model.problems([("model.norm.weight", (4,)), ("lm_head.weight", (10, 4))]) == []  # a tied head passes
    assert model.problems([("model.layers.9.x", (1,)), ("model.norm.weight", (5,)), ("lm_head.weight", (11, 4))]) == [
        "'model.layers.9.x' is not a tensor of the served model",
        "'model.norm.weight' has shape [5], the served model's is [4]",
        "'lm_head.weight' has shape [11, 4], the served model's is [10, 4]",
    ]


def test_a_model_path_not_on_this_box_is_not_judged(tmp_path: Path) -> None:
    assert served_model(str(tmp_path / "absent")) is None
    assert served_model(str(tmp_path)) is None  # a directory without safetensors
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 16)
    assert served_model(str(tmp_path)) is None


def test_the_read_back_compares_in_the_dtype_sglang_serves() -> None:
    from rollout_manager.sglang.weight_loader import _served_dtype

    assert _served_dtype("auto", "bfloat16", torch.float32) is torch.bfloat16  # --dtype auto: the checkpoint's
    assert _served_dtype("float32", "bfloat16", torch.bfloat16) is torch.float32  # an explicit --dtype wins
    assert _served_dtype(None, None, torch.float16) is torch.float16  # nothing known: as sent


@pytest.mark.slow  # transformers builds and saves the model: seconds
def test_a_save_pretrained_checkpoint_names_every_tensor_in_its_headers(tmp_path: Path) -> None:
    """The tiny Llama the real-SGLang tests serve (tests/real_sglang_model.py), as transformers'
    ``save_pretrained`` writes it: the headers name every tensor the file holds, with its shape."""
    make(tmp_path, "llama")
    model = served_model(str(tmp_path))
    assert model is not None
    held = load_file(str(tmp_path / "model.safetensors"))
    assert {n: t.shape for n, t in model.tensors.items()} == {n: tuple(t.shape) for n, t in held.items()}
    assert model.problems([("model.layers.1.mlp.down_proj.weight", (64, 128))]) == []
