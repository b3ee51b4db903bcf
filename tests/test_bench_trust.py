"""benchmarks/bench_trust.py and its noisy box: the noise has the spread it is said to have, a box behind the proxy
serves the engine's exact tokens while its probe moves with its composition, the bench counts what a trainer
would train on as it says, and a tiny run through the real manager catches a wrong tensor and reports it."""

from __future__ import annotations

import itertools
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from rollout_manager.osutil import free_port
from rollout_manager.sglang.logprob_probe import PROBE_RID_PREFIX, parse_input_logprobs, probe_body, probe_ids

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_trust import STEPS, Answer, clean_model, judge_delivered, probe_move, wrong_tensor  # noqa: E402
from noisy_box import CompositionNoise, NoisyBox, add_noise, app  # noqa: E402


def test_two_compositions_differ_by_the_spread_and_one_composition_not_at_all() -> None:
    noise = CompositionNoise(0.117, seed=3)
    probes = {c: noise.offsets(c, 31) for c in range(40)}
    assert noise.offsets(5, 31) == probes[5]  # a composition's offsets are fixed: two boxes there agree exactly
    mean_diffs = [statistics.fmean(abs(x - y) for x, y in zip(probes[a], probes[b]))
                  for a, b in itertools.combinations(probes, 2)]
    assert statistics.fmean(mean_diffs) == pytest.approx(0.117, rel=0.05)
    assert CompositionNoise(0.0).offsets(7, 4) == [0.0] * 4


def test_the_noise_moves_each_predicted_token_and_leaves_the_null_first() -> None:
    answer = {"meta_info": {"input_token_logprobs": [[None, 5, None], [-1.0, 6, None], [-2.0, 7, None]]}}
    noise = CompositionNoise(0.5)
    add_noise(answer, noise, 2)
    offsets = noise.offsets(2, 3)
    assert [e[0] for e in answer["meta_info"]["input_token_logprobs"]] == [None, -1.0 + offsets[0],
                                                                           -2.0 + offsets[1]]


def test_a_wrong_matrix_moves_the_probe_far_beyond_the_bf16_spread_and_small_noise_does_not() -> None:
    """The bench's live fault must be one the probe can see, at the logit scale the fleet runs at."""
    model = clean_model()
    tensor = "model.layers.1.self_attn.o_proj.weight"
    original = model.named_tensors()[tensor].detach().clone()
    moved = probe_move(model, tensor, wrong_tensor(original, 1))
    assert moved > 0.6  # the tolerance is at most 4 x 0.117 = 0.47 here
    assert model.named_tensors()[tensor].equal(original)  # put back
    assert wrong_tensor(original, 1).abs().mean().item() == pytest.approx(original.abs().mean().item(), rel=1e-5)


def _answer(rid: str, received: float, bad_box_tokens: int, model: Any, instance: str = "bad") -> Answer:
    prompt = [3, 4, 5]
    output = [9] * 4
    clean = model.input_logprobs(prompt + output, len(prompt))
    logprobs = [v - 1.0 if k < bad_box_tokens else v for k, v in enumerate(clean)]  # the bad box's are off
    segments = [{"instance": instance, "start": 0, "end": bad_box_tokens},
                {"instance": "good", "start": bad_box_tokens, "end": 4}]
    return Answer(rid, received, prompt, output, logprobs, segments)


def test_the_trainers_share_is_counted_from_when_each_answer_arrived() -> None:
    model = clean_model()
    answers = [_answer("early", 9.0, 4, model),  # before the fault: not counted
               _answer("a", 10.0, 4, model),  # 2 s before the catch at 12: trained with p = min(1, 2 / step)
               _answer("b", 11.5, 2, model),  # 0.5 s before: p = 0.5 / step
               _answer("c", 13.0, 4, model)]  # after the catch: the drop decides
    listed = [{"request_id": "a", "instance": "bad", "start": 0, "end": 4, "first": 0},
              {"request_id": "c", "instance": "bad", "start": 0, "end": 4, "first": 0}]
    got = judge_delivered(answers, model, "bad", armed=10.0, caught_at=12.0, interval_s=1.0, distrusted=listed)
    assert got.bad_tokens == 10
    assert got.kept == 2  # b was never listed
    assert got.dropped_answers == 2 and got.dropped_good_tokens == 0
    assert got.trained_before[STEPS[0]] == pytest.approx(4 * 1.0 + 2 * 0.5)  # a step of one interval
    assert got.trained_before[5.0] == pytest.approx(4 * 2 / 5 + 2 * 0.5 / 5)
    never = judge_delivered(answers, model, "bad", armed=10.0, caught_at=None, interval_s=1.0, distrusted=[])
    assert never.kept == never.bad_tokens == 10 and never.trained_before[5.0] == 10  # not caught: all trained


async def test_a_box_behind_the_proxy_serves_exact_tokens_and_a_probe_moved_by_its_composition(
        start_engines: Any) -> None:
    (engine,) = await start_engines([])
    box = NoisyBox(engine.endpoint, CompositionNoise(0.117, seed=1))
    runner = web.AppRunner(app(box))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    proxy = f"http://127.0.0.1:{port}"
    ids = probe_ids(256)
    body: dict[str, Any] = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 6, "temperature": 0.0},
                            "return_logprob": True}
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(proxy + "/server_info") as r:
                assert (await r.json())["dtype"] == "bfloat16"
            answers = []
            for url in (engine.url, proxy):
                async with s.post(url + "/generate", json=body) as r:
                    assert r.status == 200
                    answers.append(await r.json())
            assert answers[0]["output_ids"] == answers[1]["output_ids"]
            assert answers[0]["meta_info"]["output_token_logprobs"] == answers[1]["meta_info"]["output_token_logprobs"]
            probes = []
            for url in (engine.url, proxy):
                async with s.post(url + "/generate", json=probe_body(ids, PROBE_RID_PREFIX + "t")) as r:
                    probes.append(parse_input_logprobs(await r.json(), ids))
            offsets = CompositionNoise(0.117, seed=1).offsets(0, len(ids))  # nothing else ran: composition 0
            assert probes[1] == pytest.approx([v + o for v, o in zip(probes[0], offsets)], abs=1e-9)
            async with s.get(proxy + "/_noisy_box") as r:
                assert (await r.json())["compositions"] == {"0": 1}
    finally:
        await runner.cleanup()


@pytest.mark.slow
def test_a_tiny_run_catches_a_wrong_tensor_and_keeps_none_of_its_tokens_after_the_catch() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_trust.py"), "--runs", "1", "--subtle-runs", "0",
         "--interval-s", "1", "--clean-probes", "30", "--spreads", "0.117", "--readback-rows", "0", "--seed", "1"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    last = out.stdout.splitlines()[-1]
    assert re.match(r"trust: wrong tensor caught in 1 of 1 runs in \d+\.\d\d intervals .*, 0 bad tokens kept after "
                    r"the catch \(worst run\), \d+% \(worst \d+%\) trained before it .*; 0 false quarantines in "
                    r"\d+ probes \(0 at spread 0\.117, 0 in the fault runs\)$", last), last
    assert re.search(r"^clean fleet, bf16 spread 0\.117 .* 0 false 'disagrees', 0 false quarantines$", out.stdout, re.M)
