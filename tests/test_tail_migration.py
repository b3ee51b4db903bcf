"""Tail migration: the pure policy's decisions, and the generator moving sequences between fake engines."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from fakes import FakeSGLang, next_token, reference, register_active
from support import as_json

from rollout_manager.cpu_engine.encode import output_chunk
from rollout_manager.instances.registry import Instance, Registry, State
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.instance_load import InstanceLoad
from rollout_manager.placement.least_in_flight import LeastInFlight
from rollout_manager.placement.local_budget import LocalBudget
from rollout_manager.placement.rate_meter import TokenRateMeter, lone_rate_weight, per_sequence_rate
from rollout_manager.placement.tail_migration import Rest, RunningSequence, TailMigration
from rollout_manager.rollout.batch import run_batch
from rollout_manager.rollout.generation import GenerationSettings, Generator
from rollout_manager.rollout.request import decode
from rollout_manager.sglang import wire
from rollout_manager.sglang.client import SGLangClient
from rollout_manager.sglang.sse import sse_frame

# ---------------------------------------------------------------------------- the policy


def inst(iid: str, in_flight: int, lone: float | None) -> InstanceLoad:
    return InstanceLoad(iid, "remote", in_flight, 0, None, lone)


def seq(sid: str, where: str, made: int = 1000, budget_left: int | None = 4000, **kw: Any) -> RunningSequence:
    return RunningSequence(sid, where, made, 100, budget_left, **kw)


def test_a_long_sequence_on_a_slow_instance_moves_to_an_idle_fast_one() -> None:
    tm = TailMigration(batch_half=64)
    moves = tm.plan([inst("slow", 1, 10.0), inst("fast", 0, 40.0)], [seq("s", "slow")], 0, 100.0)
    assert [(m.seq_id, m.source, m.target) for m in moves] == [("s", "slow", "fast")]
    # 1000 tokens guessed left: 100 s where it is, 25 s + a re-prefill of 1,100 tokens at 8,000/s there
    assert moves[0].gain_s == pytest.approx(100 - 25 - 1100 / 8000 - tm.move_overhead_s)


def test_no_move_between_equal_instances_nor_while_requests_wait() -> None:
    tm = TailMigration()
    loads = [inst("a", 1, 40.0), inst("b", 0, 40.0)]
    assert tm.plan(loads, [seq("s", "a")], 0, 0.0) == []
    fast = [inst("slow", 1, 10.0), inst("fast", 0, 40.0)]
    assert tm.plan(fast, [seq("s", "slow")], waiting=3, now=0.0) == []  # idle capacity goes to waiting work


def test_the_move_must_pay_for_its_re_prefill() -> None:
    loads = [inst("slow", 1, 10.0), inst("fast", 0, 40.0)]
    # a young sequence with a long prompt: 64 tokens guessed left save 4.8 s, re-prefilling 50k costs 6 s
    young = RunningSequence("y", "slow", 0, 50_000, 4000)
    assert TailMigration(prefill_factor=200).plan(loads, [young], 0, 0.0) == []
    assert TailMigration(prefill_factor=2000).plan(loads, [young], 0, 0.0) != []


def test_the_remaining_guess_never_exceeds_the_budget() -> None:
    loads = [inst("slow", 1, 10.0), inst("fast", 0, 40.0)]
    tm = TailMigration(min_gain_s=1.0)
    assert tm.plan(loads, [seq("s", "slow", made=3000, budget_left=10)], 0, 0.0) == []  # 10 tokens: < 1 s saved
    assert tm.plan(loads, [seq("s", "slow", made=3000, budget_left=0)], 0, 0.0) == []
    assert tm.plan(loads, [seq("s", "slow", made=3000, budget_left=None)], 0, 0.0) != []  # no limit


def test_never_back_to_an_instance_it_ran_on_and_moves_are_capped_and_spaced() -> None:
    loads = [inst("slow", 1, 10.0), inst("fast", 0, 40.0)]
    tm = TailMigration(max_moves=2, cooldown_s=5.0)
    assert tm.plan(loads, [seq("s", "slow", visited=frozenset({"slow", "fast"}))], 0, 0.0) == []
    assert tm.plan(loads, [seq("s", "slow", moves=2)], 0, 0.0) == []
    assert tm.plan(loads, [seq("s", "slow", moves=1, last_moved_at=97.0)], 0, 100.0) == []
    assert tm.plan(loads, [seq("s", "slow", moves=1, last_moved_at=94.0)], 0, 100.0) != []


def test_moves_fill_a_target_only_while_it_stays_faster() -> None:
    # 20 long sequences on a slow instance, one idle instance 4x as fast (batch_half 4): the target
    # takes sequences while one more there still runs >= 1.25x what each gets where it is.
    tm = TailMigration(batch_half=4.0, min_speedup=1.25)
    running = [seq(f"s{k}", "slow") for k in range(20)]
    moves = tm.plan([inst("slow", 20, 10.0), inst("fast", 0, 40.0)], running, 0, 0.0)
    n_fast, n_slow = len(moves), 20 - len(moves)
    assert 0 < n_fast < 20
    last_gain = per_sequence_rate(40.0, n_fast, 4.0) / per_sequence_rate(10.0, n_slow + 1, 4.0)
    assert last_gain >= 1.25
    assert per_sequence_rate(40.0, n_fast + 1, 4.0) < 1.25 * per_sequence_rate(10.0, n_slow, 4.0)
    assert len({m.seq_id for m in moves}) == len(moves)


def test_longest_expected_first_and_unmeasured_instances_left_alone() -> None:
    tm = TailMigration(batch_half=1.0)  # one slot's worth: a single move fills the target
    loads = [inst("slow", 2, 20.0), inst("fast", 0, 40.0), inst("new", 0, None)]
    moves = tm.plan(loads, [seq("short", "slow", made=200), seq("long", "slow", made=2000)], 0, 0.0)
    assert [m.seq_id for m in moves] == ["long"]
    assert tm.plan([inst("x", 1, None), inst("fast", 0, 40.0)], [seq("s", "x")], 0, 0.0) == []


def test_a_draining_instance_hands_its_sequences_to_any_target() -> None:
    tm = TailMigration()
    loads = [inst("slower", 0, 5.0)]  # the draining instance is not a target itself
    moves = tm.plan(loads, [seq("s", "leaving")], 0, 0.0, draining={"leaving"})
    assert [(m.source, m.target) for m in moves] == [("leaving", "slower")]


def test_repeated_plans_never_ping_pong() -> None:
    """Apply every plan as the generator would, with speeds changing at random: no sequence ever
    returns to an instance it ran on, and none moves more than max_moves times."""
    rng = random.Random(7)
    ids = [f"i{k}" for k in range(5)]
    where = {f"s{k}": rng.choice(ids) for k in range(40)}
    history = {s: [i] for s, i in where.items()}
    moved_at: dict[str, float] = {}
    tm = TailMigration(batch_half=8.0, min_speedup=1.1, min_gain_s=0.0, cooldown_s=0.0, max_moves=3)
    for step in range(200):
        lone = {i: rng.uniform(5, 100) for i in ids}
        counts = {i: sum(1 for w in where.values() if w == i) for i in ids}
        running = [RunningSequence(s, w, 500 + step, 50, 4000, len(history[s]) - 1, moved_at.get(s),
                                   frozenset(history[s])) for s, w in where.items()]
        for m in tm.plan([inst(i, counts[i], lone[i]) for i in ids], running, 0, float(step)):
            assert m.target not in history[m.seq_id]
            history[m.seq_id].append(m.target)
            where[m.seq_id] = m.target
            moved_at[m.seq_id] = float(step)
    assert max(len(h) for h in history.values()) <= 4
    assert any(len(h) > 1 for h in history.values())


def test_the_lone_rate_meter_recovers_a_lone_sequences_speed_at_any_batch() -> None:
    lone, half = 50.0, 16.0
    meter = TokenRateMeter(tau_s=5.0, min_busy_s=0.0)
    t = 0.0
    for n in (64, 32, 8, 1):
        meter.set_in_flight(n, t)
        for _ in range(20):  # 2 s at each batch size
            t += 0.1
            made = per_sequence_rate(lone, n, half) * n * 0.1
            meter.observe(made * lone_rate_weight(n, half), t)
    assert meter.rate(t) == pytest.approx(lone, rel=1e-6)


@pytest.mark.parametrize("kw", [{"batch_half": 0}, {"min_speedup": 0.9}, {"min_gain_s": -1},
                                {"max_moves": -1}, {"max_target_in_flight": 0}])
def test_bad_parameters_are_refused(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        TailMigration(**kw)


# ---------------------------------------------------------------------------- the generator

PROMPT = [5, 17, 42]


@dataclass
class PacedFake(FakeSGLang):
    """A fake engine that holds each sequence after ``hold_after`` tokens until released, and ends a
    stream at once with an abort finish when told ``/abort_request`` for it (as SGLang does)."""

    hold_after: int | None = None
    ignore_abort: bool = False  # answer the abort but keep generating (the sequence ends normally)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    abort_events: dict[str, asyncio.Event] = field(default_factory=dict)

    def _event(self, rid: str) -> asyncio.Event:
        return self.abort_events.setdefault(rid, asyncio.Event())

    async def _abort(self, request: web.Request) -> web.Response:
        rid = str((await request.json()).get("rid", ""))
        self.aborted.append(rid)
        if not self.ignore_abort:
            self._event(rid).set()
        return web.json_response({})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        prompt, budget = list(body["input_ids"]), int(body["sampling_params"]["max_new_tokens"])
        rid = str(body["rid"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        made: list[int] = []

        async def send(finish: dict[str, Any] | None) -> None:
            await resp.write(sse_frame(output_chunk(
                rid=rid, output_ids=list(made), prompt_tokens=len(prompt), completion_tokens=len(made),
                finish=finish, weight_version=self.weight_version, text="x" * len(made))))

        aborted = self._event(rid)
        while len(made) < budget:
            if aborted.is_set():
                await send(wire.finish_reason("abort", message="Abort in waiting queue"))
                break
            if self.hold_after is not None and len(made) >= self.hold_after and not self.release.is_set():
                waits = [asyncio.ensure_future(e.wait()) for e in (self.release, aborted)]
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for w in waits:
                    w.cancel()
                continue
            made.append(next_token(prompt + made))
            await send(wire.finish_reason(wire.LENGTH, length=len(made)) if len(made) == budget else None)
        await resp.write(wire.DONE_FRAME)
        await resp.write_eof()
        return resp


SETTINGS = GenerationSettings(max_attempts=3, wait_timeout_s=2.0, connect_timeout_s=2.0, stall_timeout_s=5.0,
                              engine_stream_interval=0,
                              migration=TailMigration(batch_half=1.0, min_gain_s=0.0, cooldown_s=0.0),
                              migration_interval_s=3600.0)  # tests call migrate_now() themselves


@dataclass
class Rig:
    registry: Registry
    dispatcher: Dispatcher
    generator: Generator
    failures: list[str]
    fakes: list[PacedFake]
    lone: dict[str, float]
    a: Instance
    b: Instance


async def make_rig(session: aiohttp.ClientSession, fakes: list[PacedFake],
                   settings: GenerationSettings = SETTINGS) -> Rig:
    registry = Registry()
    dispatcher = Dispatcher(registry, LeastInFlight())
    failures: list[str] = []

    def failed(i: Instance, reason: str) -> None:
        failures.append(f"{i.id}: {reason}")

    generator = Generator(dispatcher, SGLangClient(session), settings, LocalBudget(0.0, 0.0, 1.0),
                          on_instance_failure=failed, on_instance_success=lambda i: None)
    a, b = register_active(registry, fakes)
    lone = {a.id: 10.0, b.id: 40.0}  # measured rates stand in: b is 4x as fast

    def measured(inst: Instance, now: float) -> float | None:
        return lone.get(inst.id)

    dispatcher.fleet.lone_rate = measured  # type: ignore[method-assign]
    return Rig(registry, dispatcher, generator, failures, fakes, lone, a, b)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    fakes = [PacedFake(), PacedFake()]
    for f in fakes:
        await f.start()
    try:
        async with aiohttp.ClientSession() as session:
            yield await make_rig(session, fakes)
    finally:
        for f in fakes:
            await f.close()


def body(n: int, rid: str) -> dict[str, Any]:
    return {"input_ids": list(PROMPT), "sampling_params": {"temperature": 0, "max_new_tokens": n}, "rid": rid}


async def wait_for(predicate: Any, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


async def test_a_migrated_sequence_is_exact_within_budget_and_not_a_failure(rig: Rig) -> None:
    slow, fast = rig.fakes
    slow.hold_after = 40  # a goes first (least in flight, ties by id) and stops at 40 tokens
    task = asyncio.ensure_future(rig.generator.generate(decode(body(100, "m"))))
    await wait_for(lambda: rig.dispatcher.fleet.streamed_tokens >= 40)
    assert rig.generator.migrate_now() == 1
    assert rig.b.load.in_flight == 1  # reserved for it at once
    out = as_json(await task)
    assert isinstance(out, dict)
    assert out["output_ids"] == reference(PROMPT, 100)  # nothing lost, nothing made twice
    (cont,) = fast.requests
    assert cont["input_ids"] == PROMPT + reference(PROMPT, 40)
    assert cont["sampling_params"]["max_new_tokens"] == 60  # the budget shrinks by what was made
    segs = [(s["instance"], s["start"], s["end"], s["outcome"]) for s in out["meta_info"]["segments"]]
    assert segs == [(rig.a.id, 0, 40, f"migrated to {rig.b.endpoint}"), (rig.b.id, 40, 100, "finished")]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 100}
    assert slow.aborted == [slow.requests[0]["rid"]] and rig.failures == []  # the engine's id for it, not the caller's
    st = rig.generator.stats
    assert (st["migrated"], st["continuations"], st["failed"]) == (1, 1, 0)
    a, b = rig.a.load, rig.b.load
    assert (a.in_flight, a.in_flight_tokens, b.in_flight, b.in_flight_tokens) == (0, 0, 0, 0)


async def test_a_migrated_sequence_never_moves_back(rig: Rig) -> None:
    slow, fast = rig.fakes
    slow.hold_after = fast.hold_after = 10
    task = asyncio.ensure_future(rig.generator.generate(decode(body(50, "p"))))
    await wait_for(lambda: rig.dispatcher.fleet.streamed_tokens >= 10)
    assert rig.generator.migrate_now() == 1
    await wait_for(lambda: rig.dispatcher.fleet.streamed_tokens >= 20)  # now held on b
    rig.lone[rig.a.id], rig.lone[rig.b.id] = 400.0, 10.0  # a became much faster than b
    assert rig.generator.migrate_now() == 0
    fast.release.set()
    out = as_json(await task)
    assert isinstance(out, dict) and out["output_ids"] == reference(PROMPT, 50)
    assert [s["instance"] for s in out["meta_info"]["segments"]] == [rig.a.id, rig.b.id]


async def test_a_sequence_that_finishes_before_the_abort_lands_frees_its_reserved_target(rig: Rig) -> None:
    slow, fast = rig.fakes
    slow.hold_after, slow.ignore_abort = 30, True
    task = asyncio.ensure_future(rig.generator.generate(decode(body(60, "r"))))
    await wait_for(lambda: rig.dispatcher.fleet.streamed_tokens >= 30)
    assert rig.generator.migrate_now() == 1 and rig.b.load.in_flight == 1
    await wait_for(lambda: slow.aborted == [slow.requests[0]["rid"]])
    slow.release.set()  # it ends where it was, normally
    out = as_json(await task)
    assert isinstance(out, dict) and out["output_ids"] == reference(PROMPT, 60)
    assert [s["outcome"] for s in out["meta_info"]["segments"]] == ["finished"]
    assert fast.requests == [] and rig.generator.stats["migrated"] == 0
    assert (rig.b.load.in_flight, rig.b.load.in_flight_tokens, rig.a.load.in_flight) == (0, 0, 0)


async def test_a_reserved_target_that_dies_meanwhile_falls_back_to_the_dispatcher(rig: Rig) -> None:
    slow, fast = rig.fakes
    slow.hold_after = 20
    task = asyncio.ensure_future(rig.generator.generate(decode(body(40, "d"))))
    await wait_for(lambda: rig.dispatcher.fleet.streamed_tokens >= 20)
    slow.ignore_abort = True  # hold the move until the target is gone
    assert rig.generator.migrate_now() == 1
    rig.registry.transition(rig.b, State.DEAD, "test: gone")
    slow.ignore_abort = False
    slow.abort_events[slow.requests[0]["rid"]].set()
    slow.hold_after = None
    out = as_json(await task)
    assert isinstance(out, dict) and out["output_ids"] == reference(PROMPT, 40)
    assert [s["instance"] for s in out["meta_info"]["segments"]] == [rig.a.id, rig.a.id]
    assert rig.failures == [] and rig.a.load.in_flight == 0


async def test_every_id_answered_once_with_the_timer_moving_sequences() -> None:
    fakes = [PacedFake(hold_after=8), PacedFake()]
    for f in fakes:
        await f.start()
    settings = GenerationSettings(**{**SETTINGS.__dict__, "migration_interval_s": 0.01})
    try:
        async with aiohttp.ClientSession() as session:
            rig = await make_rig(session, fakes, settings)
            rig.dispatcher.policy = LeastInFlight(max_in_flight=4)  # half of them start on the slow a
            items = [(k, decode(body(30 + k, f"q{k}"))) for k in range(8)]
            lines = [as_json(line) async for batch in run_batch(rig.generator, items) for line in batch]
            assert sorted(line["id"] for line in lines) == list(range(8))
            for line in lines:
                assert line["success"], line
                assert line["data"]["output_ids"] == reference(PROMPT, 30 + line["id"])
            assert rig.generator.stats["migrated"] >= 1 and rig.failures == []
            assert all(i.load.in_flight == 0 and i.load.in_flight_tokens == 0 for i in rig.registry)
            await wait_for(lambda: not rig.generator.migrator.running)
    finally:
        for f in fakes:
            await f.close()


async def test_no_move_while_the_managers_own_event_loop_lags() -> None:
    """A blocked loop makes every measured rate the manager's own: moving then would feed the overload."""
    fakes = [PacedFake(), PacedFake()]
    for f in fakes:
        await f.start()
    try:
        async with aiohttp.ClientSession() as session:
            settings = GenerationSettings(**{**SETTINGS.__dict__, "migration_interval_s": 1.0})
            rig = await make_rig(session, fakes, settings)
            fakes[0].hold_after = 40
            task = asyncio.ensure_future(rig.generator.generate(decode(body(100, "lag"))))
            await wait_for(lambda: rig.dispatcher.fleet.streamed_tokens >= 40)
            watch = rig.generator.client.limits.loop
            watch.ensure_started()
            time.sleep(0.5)  # the manager's loop is blocked (this is what is being tested, not a wait)
            assert rig.generator.migrate_now() == 0 and rig.b.load.in_flight == 0
            fakes[0].release.set()
            out = as_json(await task)
            assert isinstance(out, dict) and out["output_ids"] == reference(PROMPT, 100)
            assert rig.generator.stats["migrated"] == 0
    finally:
        for f in fakes:
            await f.close()


async def test_a_sequence_under_an_output_penalty_is_not_migrated(rig: Rig) -> None:
    """SGLang counts frequency, presence and repetition penalties over output tokens only: moved, the sequence
    would sample differently, so tail migration leaves it where it runs."""
    slow, fast = rig.fakes
    slow.hold_after = 20
    penalised = body(40, "p")
    penalised["sampling_params"]["repetition_penalty"] = 1.1
    task = asyncio.ensure_future(rig.generator.generate(decode(penalised)))
    await wait_for(lambda: rig.dispatcher.fleet.streamed_tokens >= 20)
    assert rig.generator.migrate_now() == 0 and slow.aborted == []
    slow.release.set()
    out = as_json(await task)
    assert isinstance(out, dict) and [s["instance"] for s in out["meta_info"]["segments"]] == [rig.a.id]


def test_a_sequence_predicted_to_end_before_the_step_does_stays_where_it_is() -> None:
    """Where lengths are predicted, only the step's tail moves: a sequence that ends where it runs before the
    step's predicted end (the latest box drain) would only load the boxes that run the tail."""
    from rollout_manager.placement.box_speed import StepModel
    fast, slow = StepModel(0.006, 0.00008), StepModel(0.017, 0.00023)
    loads = [InstanceLoad("slow", "remote", 2, 0, None, 10.0, slow, 1000.0, 900.0),
             InstanceLoad("fast", "remote", 1, 0, None, 40.0, fast, 3000.0, 3000.0)]  # the tail runs on fast
    running = [seq("short", "slow", made=1000), seq("long", "slow", made=1000)]
    rest = {"short": 100.0, "long": 2500.0}  # 1.7 s and 42 s where they are; the step ends in 18.2 s
    tm = TailMigration(batch_half=64, tail_share=1.0)
    moved = tm.plan(loads, running, 0, 100.0, predict=lambda s: Rest(rest[s.seq_id]))
    assert [m.seq_id for m in moved] == ["long"]
    # by age alone (no prediction) both move: 1,000 tokens guessed left each
    assert len(TailMigration(batch_half=64, tail_share=1.0).plan(loads, running, 0, 100.0)) == 2


def test_a_tail_sequence_alone_on_a_slow_box_moves_to_an_idle_faster_one() -> None:
    """The defect of issue 46: a long sequence alone on a 0.5-speed box, the other boxes idle. Its box's predicted
    drain (``BoxWork``: it was placed counting the upper quantile) is above what the length model now says it
    still makes, and that drain is the step's predicted end: compared with it, the sequence was "not the tail" and
    ran to its end there. Its finish there (1,400 tokens at 20.6 ms) is set against a 2-speed box's (5.15 ms)."""
    from rollout_manager.placement.box_speed import StepModel
    slow, mid, fast = StepModel(0.020, 0.0006), StepModel(0.010, 0.0003), StepModel(0.005, 0.00015)
    loads = [InstanceLoad("slow", "remote", 1, 0, None, 48.0, slow, 2200.0, 2200.0),
             InstanceLoad("mid", "remote", 0, 0, None, 97.0, mid),
             InstanceLoad("fast", "remote", 0, 0, None, 194.0, fast)]
    long = seq("long", "slow", made=1200, budget_left=2896)
    tm = TailMigration(batch_half=64, tail_share=1.0, tail_slowdown=1.3)
    moves = tm.plan(loads, [long], 0, 100.0, predict=lambda s: Rest(1400.0, True))
    assert [(m.seq_id, m.target) for m in moves] == [("long", "fast")]
    # its finish where it is (1,400 x 20.6 ms) less the move (overhead, re-prefill, 1,400 x 5.15 ms)
    assert moves[0].gain_s == pytest.approx(1400 * 0.0206 - (0.5 + 1300 * 0.00515 / 200 + 1400 * 0.00515))


def test_a_crowded_or_visited_fastest_box_does_not_end_the_search() -> None:
    """The fastest box is full (past ``tail_slowdown`` for the predicted tail) or was run on: the next faster box
    takes the sequence."""
    from rollout_manager.placement.box_speed import StepModel
    curve = StepModel(0.006, 0.00008)
    loads = [InstanceLoad("slow", "remote", 1, 0, None, 40.0, StepModel(0.024, 0.00032)),
             InstanceLoad("fastest", "remote", 40, 0, None, 300.0, StepModel(0.003, 0.00004)),
             InstanceLoad("fast", "remote", 2, 0, None, 160.0, curve)]
    tm = TailMigration(batch_half=64, tail_slowdown=1.3)
    informed = tm.plan(loads, [seq("s", "slow")], 0, 0.0, predict=lambda s: Rest(2000.0, True))
    assert [m.target for m in informed] == ["fast"]
    visited = tm.plan(loads, [seq("s", "slow", visited=frozenset({"slow", "fastest"}))], 0, 0.0)
    assert [m.target for m in visited] == ["fast"]


def test_rates_come_from_the_learned_curve_not_the_configured_batch_model() -> None:
    """The target's learned curve (10 + 0.3 n ms) says 30 beside the sequence make its step 19.3 ms, 1.9x a lone
    one, where the configured batch model (half speed at 64) would say 15.1 ms: against the 23 ms it gets where
    it is, that is less than ``min_speedup`` gained, so it stays; without curves the batch model moves it."""
    from rollout_manager.placement.box_speed import StepModel
    loads = [InstanceLoad("a", "remote", 1, 0, None, 40.0, StepModel(0.0225, 0.0005)),
             InstanceLoad("b", "remote", 30, 0, None, 97.0, StepModel(0.010, 0.0003))]
    assert TailMigration(batch_half=64).plan(loads, [seq("s", "a")], 0, 0.0) == []
    no_curves = [InstanceLoad("a", "remote", 1, 0, None, 40.0), InstanceLoad("b", "remote", 30, 0, None, 97.0)]
    assert [m.target for m in TailMigration(batch_half=64).plan(no_curves, [seq("s", "a")], 0, 0.0)] == ["b"]


def test_the_predicted_tail_moves_only_where_few_run_beside_it() -> None:
    """A sequence whose prediction evidence informs is the predicted tail: it moves to a faster box only while
    its step there, with it added, stays within ``tail_slowdown`` of a lone sequence's (6 + 0.08 n ms: 1.3x
    allows 23 beside it); a sequence predicted from the fleet's figure alone moves as before."""
    from rollout_manager.placement.box_speed import StepModel
    fast, slow = StepModel(0.006, 0.00008), StepModel(0.017, 0.00023)

    def plan(fast_running: int, informed: bool) -> list[str]:
        loads = [InstanceLoad("slow", "remote", 2, 0, None, 10.0, slow, 4000.0, 2000.0),
                 InstanceLoad("fast", "remote", fast_running, 0, None, 160.0, fast, 1000.0, 100.0)]
        tm = TailMigration(batch_half=64, tail_share=1.0, tail_slowdown=1.3)
        return [m.seq_id for m in tm.plan(loads, [seq("long", "slow", made=1000)], 0, 100.0,
                                          predict=lambda s: Rest(3000.0, informed))]

    assert plan(10, informed=True) == ["long"]
    assert plan(30, informed=True) == []  # 8.4 ms a step there with it: past 1.3 x 6.08 ms
    assert plan(30, informed=False) == ["long"]
    with pytest.raises(ValueError):
        TailMigration(tail_slowdown=0.5)


def test_while_requests_wait_an_old_sequence_on_a_slow_full_box_takes_a_fast_boxs_next_slot() -> None:
    """Issue 46's first epoch: every box full, requests waiting, and before this nothing moved until the queue was
    empty, so a long sequence that began on a slow box spent the step's start there. With ``swap_queue`` a sequence
    expected to run longer than the waiting request (by age: 600 made against 300 predicted) takes the faster
    box's next free slot (past its bound, one at most) and the waiting request the slot it leaves; a young one
    (100 made) stays, as does everything with swaps off."""
    from rollout_manager.placement.box_speed import StepModel
    slow, fast = StepModel(0.020, 0.0006), StepModel(0.005, 0.00015)

    def loads(fast_in_flight: int = 32) -> list[InstanceLoad]:
        return [InstanceLoad("slow", "remote", 32, 0, None, 48.0, slow, max_in_flight=32),
                InstanceLoad("fast", "remote", fast_in_flight, 0, None, 194.0, fast, max_in_flight=32)]

    running = [seq("old", "slow", made=600), seq("young", "slow", made=100), seq("there", "fast", made=700)]
    tm = TailMigration(batch_half=64, tail_share=1.0, tail_slowdown=1.3, swap_queue=1)
    moves = tm.plan(loads(), running, 10, 100.0, predict=lambda s: Rest(50.0), waiting_left=300.0)
    assert [(m.seq_id, m.target, m.swap) for m in moves] == [("old", "fast", True)]
    # finish there 600 x 39.2 ms, against the later of the move (overhead, re-prefill, 600 x 9.8 ms on the full
    # fast box) and the waiting request's 300 x 39.2 ms on the slow slot
    gain = 600 * 0.0392 - max(0.5 + 700 * 0.00515 / 200 + 600 * 0.0098, 300 * 0.0392)
    assert moves[0].gain_s == pytest.approx(gain)
    assert tm.plan(loads(33), running, 10, 100.0, waiting_left=300.0) == []  # its next slot is taken already
    assert tm.plan(loads(), running, 10, 100.0, waiting_left=700.0) == []  # the waiting one is as long
    off = TailMigration(batch_half=64, tail_share=1.0, tail_slowdown=1.3)
    assert off.plan(loads(), running, 10, 100.0, waiting_left=300.0) == []
    with pytest.raises(ValueError):
        TailMigration(swap_queue=-1)


async def test_a_swap_moves_a_slow_boxs_sequence_past_a_full_fast_box_and_the_waiting_request_takes_its_slot(
) -> None:
    """Through the generator and the dispatcher, each box bounded to one sequence: the slow box runs an old
    sequence, the fast box another, a third request waits. The plan moves the old one into the fast box past its
    bound (one over, reserved at once), the waiting request is placed on the slow box when the abort lands, and
    every answer is exact."""
    fakes = [PacedFake(hold_after=200), PacedFake(hold_after=0)]
    for f in fakes:
        await f.start()
    try:
        async with aiohttp.ClientSession() as session:
            settings = replace(SETTINGS, migration=TailMigration(batch_half=1.0, min_gain_s=0.0, cooldown_s=0.0,
                                                                 swap_queue=1))
            rig = await make_rig(session, fakes, settings)
            rig.dispatcher.capacity.max_in_flight_per_instance = 1
            for i in (rig.a, rig.b):
                i.load.max_in_flight = rig.dispatcher.capacity.bound_of(i)
            slow, fast = fakes
            old = asyncio.ensure_future(rig.generator.generate(decode(body(300, "old"))))
            await wait_for(lambda: rig.dispatcher.fleet.streamed_tokens >= 200)
            there = asyncio.ensure_future(rig.generator.generate(decode(body(50, "there"))))
            await wait_for(lambda: rig.b.load.in_flight == 1)
            waiting = asyncio.ensure_future(rig.generator.generate(decode(body(100, "w"))))
            await wait_for(lambda: rig.dispatcher.capacity.waiting == 1)
            assert rig.generator.migrate_now() == 1
            assert rig.b.load.in_flight == 2  # reserved at once, one past its bound
            out = as_json(await waiting)  # placed on the slow box's slot once the old one left it
            assert isinstance(out, dict) and out["output_ids"] == reference(PROMPT, 100)
            assert [s["instance"] for s in out["meta_info"]["segments"]] == [rig.a.id]
            fast.release.set()
            moved = as_json(await old)
            assert isinstance(moved, dict) and moved["output_ids"] == reference(PROMPT, 300)
            segs = [(s["instance"], s["start"], s["end"]) for s in moved["meta_info"]["segments"]]
            assert segs == [(rig.a.id, 0, 200), (rig.b.id, 200, 300)]
            assert as_json(await there)["output_ids"] == reference(PROMPT, 50)  # type: ignore[index]
            assert rig.failures == []
    finally:
        for f in fakes:
            await f.close()
