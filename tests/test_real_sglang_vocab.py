"""Real SGLang 0.5.23 does not refuse an input id past its model's vocabulary: its scheduler crashes on it.
The manager refuses such a request at the door (400) and the box stays up and keeps serving. SGLang
0.5.23 does not report its vocabulary size, so the bound here is the configured engine_vocab_size."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from real_sglang import start_box, start_manager

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow]


def post(url: str, body: Any) -> tuple[int, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def test_an_id_past_the_vocabulary_is_refused_and_the_box_keeps_serving(
        real_sglang_model: Path, tmp_path: Path) -> None:
    vocab = json.loads((real_sglang_model / "config.json").read_text())["vocab_size"]
    manager = start_manager(tmp_path, engine_vocab_size=vocab)
    try:
        box = start_box(real_sglang_model, manager.url, tmp_path)
        try:
            params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
            for body in ({"input_ids": [5, vocab + 1000]}, {"input_ids": [[5], [vocab]], "stream": True}):
                status, out = post(manager.url + "/generate", {**body, "sampling_params": params})
                assert status == 400 and f"below {vocab}" in out["error"], out
            status, out = post(manager.url + "/generate", {"input_ids": [5, vocab - 1], "sampling_params": params})
            assert status == 200 and len(out["output_ids"]) == 4, out
            (inst,) = get(manager.url + "/get_instances_status")["instances"]
            assert inst["state"] == "active" and inst["consecutive_failures"] == 0, inst
            assert box.launcher.popen.poll() is None  # SGLang (and its launcher) still run
        finally:
            box.stop()
    finally:
        manager.stop()
