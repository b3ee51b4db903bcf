"""The launcher reads the served model's vocabulary size from its config.json (SGLang does not report it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rollout_manager.launch.model_config import model_vocab_size, vocab_size_of


@pytest.mark.parametrize(("config", "size"), [
    ({"vocab_size": 151936}, 151936),
    ({"text_config": {"vocab_size": 262208}}, 262208),  # multimodal: the text model's embedding
    ({"vocab_size": 32000, "text_config": {"vocab_size": 1}}, 32000),
    ({"vocab_size": 0}, None), ({"vocab_size": True}, None), ({"vocab_size": "32000"}, None), ({}, None), ([], None),
])
def test_vocab_size_of(config: object, size: int | None) -> None:
    assert vocab_size_of(config) == size


def test_model_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 1024}))
    assert model_vocab_size(str(tmp_path)) == 1024


def test_nothing_to_read_is_none_not_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never a download, whatever the cache holds
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert model_vocab_size(str(tmp_path / "missing")) is None
    assert model_vocab_size("some-org/not-cached-model") is None
    (tmp_path / "config.json").write_text("{not json")
    assert model_vocab_size(str(tmp_path)) is None


def test_without_the_hub_client_a_local_directory_still_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's base install has no huggingface_hub: a hub id gives None, a directory its size."""
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails as if not installed
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 32000}))
    assert model_vocab_size(str(tmp_path)) == 32000
    assert model_vocab_size("some-org/some-model") is None
