"""Real SGLang 0.5.23 on CPU, started through scripts/launch_sglang.sh with its receiver agent, serves greedy
rollouts directly and through the manager, and the two agree token for token."""

from __future__ import annotations

import json
import urllib.request

import pytest

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow]


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status, json.loads(r.read())


def test_box_registers_and_greedy_rollout_through_manager_equals_sglang(real_sglang):
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
    status, direct = post(real_sglang.box.url + "/generate", body)
    assert status == 200 and len(direct["output_ids"]) == 16
    assert direct["meta_info"]["finish_reason"]["type"] == "length"
    status, via = post(real_sglang.manager.url + "/generate", body)
    assert status == 200, via
    assert via["output_ids"] == direct["output_ids"]
