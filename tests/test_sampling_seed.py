"""Every sequence is sampled with a seed of its own, kept across instances (docs/sglang-contract.md, item 3).

Under ``--enable-deterministic-inference`` SGLang samples a request that has no ``sampling_seed`` with seed 42,
so the samples of one prompt come out identical; its seeded sampler keys each draw on (seed, position), so a
continuation sent with the same seed draws what the uninterrupted request would have. Fake engines record
what the manager sends them.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec
from fakes import HealthRecorder, reference, register_active, start_fakes
from support import as_json

from rollout_manager.instances.registry import Registry
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.least_in_flight import LeastInFlight
from rollout_manager.placement.local_budget import LocalBudget
from rollout_manager.rollout.generation import GenerationSettings, Generator
from rollout_manager.rollout.request import decode
from rollout_manager.rollout.sequence import sampling_seed
from rollout_manager.sglang.client import SGLangClient
from rollout_manager.sglang.generate_request import SequenceBody, continuation, encode

PROMPT = [5, 17, 42]
SETTINGS = GenerationSettings(max_attempts=3, wait_timeout_s=0.2, connect_timeout_s=2.0, stall_timeout_s=0.3,
                              engine_stream_interval=1)


def body(n: int, **params: Any) -> dict[str, Any]:
    return {"input_ids": list(PROMPT), "sampling_params": {"temperature": 1.0, "max_new_tokens": n, **params}}


async def test_each_sequence_gets_its_own_seed_and_keeps_it_when_continued_elsewhere() -> None:
    fakes = await start_fakes(2)
    dying, healthy = fakes
    dying.die_after_tokens = 4
    try:
        async with aiohttp.ClientSession() as session:
            registry = Registry()
            generator = Generator(Dispatcher(registry, LeastInFlight()), SGLangClient(session), SETTINGS,
                                  LocalBudget(0.0, 0.0, 1.0), on_instance_failure=HealthRecorder().failure,
                                  on_instance_success=HealthRecorder().success)
            register_active(registry, fakes)
            out = as_json(await generator.generate(decode(body(10, rid="seq"))))
            assert isinstance(out, dict) and out["output_ids"] == reference(PROMPT, 10)
            (first,), (cont,) = dying.requests, healthy.requests
            seed = first["sampling_params"]["sampling_seed"]
            assert isinstance(seed, int) and cont["sampling_params"]["sampling_seed"] == seed  # the same draws
            assert cont["input_ids"] == PROMPT + reference(PROMPT, 4)
            assert out["meta_info"]["sampling_seed"] == seed

            dying.die_after_tokens = None
            batch = await generator.generate(decode({"input_ids": [list(PROMPT)] * 8,
                                                     "sampling_params": {"temperature": 1.0, "max_new_tokens": 2}}))
            batch = as_json(batch)
            assert isinstance(batch, list)
            seeds = [o["meta_info"]["sampling_seed"] for o in batch]
            assert len(set(seeds)) == 8  # a GRPO group: no two samples share a seed
    finally:
        for fake in fakes:
            await fake.close()


def test_a_callers_seed_is_kept() -> None:
    given = SequenceBody.of(body(4, sampling_seed=1234))
    assert sampling_seed(given) == 1234
    plain = SequenceBody.of(body(4))
    seed = sampling_seed(plain)
    assert isinstance(seed, int) and seed >= 0
    assert plain.sampling.sampling_seed is None  # the caller's body is not changed
    sent = continuation(plain, [], rid="r", seed=seed)
    assert sent.sampling.sampling_seed == seed
    unseeded = continuation(plain, [], rid="r")
    assert encode(sent) == encode(msgspec.structs.replace(unseeded, sampling=msgspec.structs.replace(
        unseeded.sampling, sampling_seed=seed)))  # nothing else changed
    assert continuation(given, [7], rid="r~1", seed=sampling_seed(given)).sampling.sampling_seed == 1234
