"""Relay processes (docs/relays.md): a control process and N relays that share the manager's port.

In process: a relay's registry follows the control process's through the views that changed, and the relays'
parts of each box's bound add up to the bound; one report carries a bounded number of saved tokens, and a relay
with more reports again at once (to a real HTTP endpoint) until the control process holds them all. With real
processes on 127.0.0.1 (`serve` with relays = 2, CPU engines): a step through both relays gives the greedy
reference's tokens; the control process SIGKILLed mid-step loses nothing and comes back with the same boxes; a
relay SIGKILLed mid-step loses nothing the trainer's client sent (it sends the unanswered ids again, through the
other relay).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from support import async_wait_until, descendants

from rollout_manager.config import ConfigError, load_config
from rollout_manager.cpu_engine.model import build_model, reference_generate
from rollout_manager.instances.control_link import ControlLink
from rollout_manager.instances.health import adopt_engine
from rollout_manager.instances.instance import EngineFacts
from rollout_manager.instances.mirror import ViewTracker, follow, view_of
from rollout_manager.instances.registry import Kind, Registry, State
from rollout_manager.instances.relay_hub import RelayHub
from rollout_manager.instances.relay_messages import RelayLoad, RelayReport, SavedSegment, SavedTokens
from rollout_manager.instances.saved_tokens import SavedStore
from rollout_manager.instances.version import WeightVersion
from rollout_manager.ops import render_status
from rollout_manager.placement.capacity import Capacity
from rollout_manager.placement.lengths import LengthModel
from rollout_manager.rollout.checkpoints import Checkpoints, resume
from rollout_manager.rollout.progress import token_array
from rollout_manager.rollout.request import decode
from rollout_manager.rollout.sequence import SequenceState
from trainer_plugin.client import ManagerClient

MAX_NEW = 24
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW}
ENGINE_FLAGS = ["--token-delay-s", "0.01", "--max-running-requests", "4"]
FAST_CLIENT = {"stall_timeout_s": 0.5, "probe_timeout_s": 0.5, "restart_timeout_s": 30.0}


# ------------------------------------------------------------------------------------------ in process
def _views(registry: Registry) -> dict[str, Any]:
    return {i.id: view_of(i) for i in registry}


def test_a_relay_registry_follows_the_control_registry_through_changed_views():
    control, version = Registry(), WeightVersion()
    relay, relay_version = Registry(), WeightVersion()
    heard: list[tuple[str, State]] = []
    relay.listeners.append(lambda inst, event: heard.append((inst.id, event.new)))
    a, b = control.add_many([("10.0.0.1", 30000, Kind.REMOTE, None), ("10.0.0.2", 30000, Kind.REMOTE, None)])
    tracker = ViewTracker()

    def sync() -> Any:
        delta = tracker.delta("run", control, version)
        if delta is not None:
            follow(relay, relay_version, delta)
        return delta

    first = sync()
    assert first.full and len(first.changed) == 2 and _views(relay) == _views(control)
    assert sync() is None  # nothing changed: nothing sent

    adopt_engine(a, EngineFacts(vocab_size=1024, max_running_requests=8))
    control.transition(a, State.ACTIVE, "healthy")
    version.current = 3
    control.set_weight_version(b, 3)
    delta = sync()
    assert {v.id for v in delta.changed} == {a.id, b.id} and delta.weight_version == 3
    assert _views(relay) == _views(control) and relay_version.current == 3
    assert relay.get(a.id).engine.max_running_requests == 8 and relay.get(a.id).state == State.ACTIVE

    control.quarantine(a, "probe disagrees")
    delta = sync()
    assert [v.id for v in delta.changed] == [a.id]  # only the instance that changed
    assert relay.get(a.id).state == State.SYNCING and relay.get(a.id).quarantined == "probe disagrees"

    control.transition(b, State.DEAD, "3 consecutive failures")
    assert sync().removed == [b.id] and relay.get(b.id) is None
    assert (a.id, State.ACTIVE) in heard and (b.id, State.DEAD) in heard  # the relay's parts hear each move

    stale = Registry()  # a relay that knew an instance the control process has forgotten
    stale.add("10.0.0.9", 30000, Kind.REMOTE)
    follow(stale, WeightVersion(), ViewTracker().delta("run", control, version))
    assert _views(stale) == _views(control)
    ids = [i.id for i in control.add_many([("10.0.0.3", 30000, Kind.REMOTE, None)])]
    assert ids == ["inst-3"]  # ids go on after the followed ones


@pytest.mark.parametrize("relays", [1, 2, 3, 4])
def test_the_relays_parts_of_each_bound_add_up_to_the_bound(relays):
    registry = Registry()
    boxes = registry.add_many([(f"10.0.0.{n}", 30000, Kind.REMOTE, None) for n in range(1, 12)])
    for n, inst in enumerate(boxes):
        adopt_engine(inst, EngineFacts(max_running_requests=n + 1))
    parts = [Capacity(registry, share=(i, relays)) for i in range(relays)]
    for inst in boxes:
        whole = Capacity(registry).bound_of(inst)
        shares = [c.bound_of(inst) for c in parts]
        assert sum(shares) == whole and max(shares) - min(shares) <= 1, (whole, shares)
    # boxes of one kind (one odd bound): no relay gets the larger part of every box
    for inst in boxes:
        adopt_engine(inst, EngineFacts(max_running_requests=2 * relays + 1))
    totals = [sum(c.bound_of(i) for i in boxes) for c in parts]
    assert max(totals) - min(totals) <= 1, totals


def test_saved_tokens_grow_cut_back_drop_and_ask_to_be_sent_whole_after_a_restart():
    now = [0.0]
    store = SavedStore(ttl_s=10, max_tokens=1000, clock=lambda: now[0])
    seg = [SavedSegment("inst-1", "10.0.0.1:30000", "0", 0, 3)]
    assert store.apply(0, [SavedTokens("a", 0, _b([1, 2, 3]), [], seg, [0])], []) == []
    assert store.apply(0, [SavedTokens("a", 3, _b([4, 5]), [], seg, [0])], []) == []
    assert _ids(store.claim(1, ["a", "b"])["a"]) == [1, 2, 3, 4, 5]  # "b" was never saved
    assert store.apply(1, [SavedTokens("a", 2, _b([9]), [], seg, [0])], []) == []  # cut back at 2, then on
    assert _ids(store.claim(1, ["a"])["a"]) == [1, 2, 9]
    # a piece that does not start where the held tokens end (this process started again): sent whole next time
    assert store.apply(0, [SavedTokens("c", 40, _b([7]), [], seg, [0])], []) == ["c"]
    assert store.apply(1, [], ["a"]) == [] and store.claim(1, ["a"]) == {}  # finished: dropped
    store.apply(0, [SavedTokens("d", 0, _b([1] * 600), [], seg, [0])], [])
    store.apply(0, [SavedTokens("e", 0, _b([1] * 600), [], seg, [0])], [])
    assert store.claim(0, ["d"]) == {} and store.tokens == 600  # over max_tokens: the oldest went
    now[0] = 11.0
    store.apply(0, [], [])
    assert store.tokens == 0 and store.status()["dropped"] == 2  # nobody reported on "e" for ttl_s


def test_checkpoints_save_every_k_tokens_and_only_move_on_once_a_report_arrived():
    saving = Checkpoints(every=4)
    seq = SequenceState(body=_body([5, 6]), rid="r")
    saving.track("k", seq)
    seq.output_ids.extend([1, 2, 3])
    assert saving.collect().saved == []  # fewer than K made
    seq.output_ids.extend([4, 5])
    out = saving.collect()
    assert [(p.start, _ids(p)) for p in out.saved] == [(0, [1, 2, 3, 4, 5])]
    out.lost()  # the report did not arrive: the same piece goes again
    out = saving.collect()
    assert [(p.start, _ids(p)) for p in out.saved] == [(0, [1, 2, 3, 4, 5])]
    out.arrived([])
    assert saving.collect().saved == []
    del seq.output_ids[3:]  # cut back below what was saved: the control process is told where
    out = saving.collect()
    assert [(p.start, _ids(p)) for p in out.saved] == [(3, [])]
    out.arrived(["k"])  # the control process started again: everything goes again, once K are unsaved
    seq.output_ids.append(8)
    assert [(p.start, _ids(p)) for p in saving.collect().saved] == [(0, [1, 2, 3, 8])]
    saving.end("k", finished=True)
    assert saving.collect().done == ["k"]
    resumed = SequenceState(body=_body([5, 6]), rid="r")
    resume(resumed, SavedTokens("k", 0, _b([1, 2, 3]), [], [SavedSegment("inst-1", "h:1", "0", 0, 3)], [0]))
    assert list(resumed.output_ids) == [1, 2, 3] and resumed.remaining == 7
    assert [(s.instance, s.start, s.end) for s in resumed.segments] == [("inst-1", 0, 3)]


def test_one_report_carries_at_most_per_report_tokens_taking_the_sequences_in_turn():
    saving = Checkpoints(every=4, per_report=10)
    seqs = {k: SequenceState(body=_body([5, 6]), rid=k) for k in "abc"}
    for k, seq in seqs.items():
        saving.track(k, seq)
        seq.output_ids.extend(range(8))
    out = saving.collect()  # 8 of a and 2 of b; more waits
    assert [(p.key, p.start, p.count) for p in out.saved] == [("a", 0, 8), ("b", 0, 2)] and out.more
    out.arrived([])
    out = saving.collect()  # c first (a and b went to the back of the turn), then b's rest
    assert [(p.key, p.start, p.count) for p in out.saved] == [("c", 0, 8), ("b", 2, 2)] and out.more
    out.lost()  # not arrived: the same tokens go again
    out = saving.collect()
    assert [(p.key, p.start, p.count) for p in out.saved] == [("c", 0, 8), ("b", 2, 2)]
    out.arrived([])
    out = saving.collect()  # b's last 4, and nothing left
    assert [(p.key, p.start, _ids(p)) for p in out.saved] == [("b", 4, [4, 5, 6, 7])] and not out.more
    out.arrived([])
    assert saving.collect().saved == []


async def test_a_relay_reports_again_at_once_while_saved_tokens_wait_and_the_control_process_holds_all():
    store, sizes = SavedStore(), []

    async def report(request: web.Request) -> web.Response:
        body = await request.read()
        got = msgspec.json.decode(body, type=RelayReport)
        sizes.append(sum(p.count for p in got.saved))
        return web.json_response({"missing": store.apply(got.relay, got.saved, got.done)})

    app = web.Application(client_max_size=1 << 20)
    app.router.add_post("/relay/report", report)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    saving = Checkpoints(every=4, per_report=1000)
    seqs = [SequenceState(body=_body([5, 6]), rid=str(i)) for i in range(5)]
    for i, seq in enumerate(seqs):
        saving.track(str(i), seq)
        seq.output_ids.extend(range(i, i + 700))
    try:
        async with aiohttp.ClientSession() as session:
            link = ControlLink(f"http://127.0.0.1:{port}", 0, "", Registry(), WeightVersion(), session, RelayLoad,
                               report_s=3600)
            link.collect = saving.collect
            await link.report()  # one call: four reports of at most 1,000 tokens, one after the other
    finally:
        await runner.cleanup()
    assert sizes == [1000, 1000, 1000, 500]
    saved = store.claim(1, [str(i) for i in range(5)])
    assert {k: _ids(v) for k, v in saved.items()} == {str(i): list(range(i, i + 700)) for i in range(5)}


def _b(ids: list[int]) -> bytes:
    return token_array(ids).tobytes()


def _ids(saved: SavedTokens) -> list[int]:
    out = token_array()
    out.frombytes(saved.ids)
    return out.tolist()


def _body(ids: list[int]) -> Any:
    [item] = decode({"input_ids": ids, "sampling_params": {"max_new_tokens": 10}}).sequences
    return item.body


def test_each_relay_learns_the_lengths_the_other_relays_finished():
    hub = RelayHub("run", Registry(), WeightVersion(), health=None)  # type: ignore[arg-type]  # no failures here
    assert hub.report(RelayReport(0, 100, lengths=[(11, 300), (12, 40)]))["lengths"] == []
    assert hub.report(RelayReport(1, 200, lengths=[(13, 7)]))["lengths"] == [(11, 300), (12, 40)]
    assert hub.report(RelayReport(0, 100))["lengths"] == [(13, 7)]  # not its own, and each once
    assert hub.report(RelayReport(0, 100))["lengths"] == []
    assert hub.report(RelayReport(1, 201))["lengths"] == [(11, 300), (12, 40)]  # started again: all it missed
    model = LengthModel()
    model.finished_elsewhere([(11, 300), (11, 200), (13, 7)])
    assert model.history[11] == [300, 200] and model.finished == 3


def test_drain_activation_is_refused_with_relays_wherever_each_is_set():
    with pytest.raises(ConfigError, match="drain"):
        load_config(None, environ={}, overrides={"relays": "2", "weight_activation": "drain"})
    with pytest.raises(ConfigError, match="together"):
        load_config(None, environ={"ROLLOUT_MANAGER_WEIGHT_ACTIVATION": "drain"}, overrides={"relays": "1"})
    assert load_config(None, environ={}, overrides={"relays": "2"}).weight_activation == "staged"


def test_the_status_command_lists_the_relays():
    relays = [{"relay": 0, "pid": 11, "connected": True, "in_flight": 3, "waiting": 0, "finished": 40, "cpu_s": 1.25,
               "restarts": 0, "report_age_s": 0.1},
              {"relay": 1, "pid": 12, "connected": False, "in_flight": 0, "waiting": 0, "finished": 2, "cpu_s": 0.5,
               "restarts": 1, "report_age_s": 9.0}]
    lines = render_status({"instances": [], "relays": relays}, "http://m:5000").splitlines()
    assert lines[-3].split() == ["RELAY", "PID", "CONNECTED", "IN", "FLIGHT", "WAITING", "FINISHED", "CPU", "S",
                                 "RESTARTS", "REPORT", "AGE", "S"]
    assert lines[-2].split() == ["0", "11", "yes", "3", "0", "40", "1.2", "0", "0.10"]
    assert lines[-1].split() == ["1", "12", "no", "0", "0", "2", "0.5", "1", "9.00"]
    assert "RELAY" not in render_status({"instances": [], "relays": None}, "http://m:5000")


# ------------------------------------------------------------------------------------------ processes
@pytest.fixture(scope="module")
def model():
    return build_model(0)


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + j) % 200 + 1 for j in range(1 + i % 5)] for i in range(n)]


def _pids(root: int, role: str) -> list[int]:
    out = []
    for pid in descendants(root):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--role" in args and args[args.index(b"--role") + 1] == role.encode():
            out.append(pid)
    return out


async def with_relays(start_manager, start_engines, **settings: Any):
    m = await start_manager(relays=2, relay_report_s=0.1, **settings)
    engines = await start_engines(ENGINE_FLAGS, ENGINE_FLAGS)
    await m.register(*engines)  # through a relay, handed on to the control process with the caller's address
    await async_wait_until(lambda: _relays_connected(m, 2), message="both relays report")
    return m, engines


async def _relays_connected(m, n: int) -> bool:
    relays = (await m.status())["relays"] or []
    return len(relays) == n and all(r["connected"] and r["report_age_s"] is not None for r in relays)


async def _generate_each_on_its_own_connection(url: str, batch: list[list[int]]) -> list[list[int]]:
    async def one(ids: list[int]) -> list[int]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
                s.post(url + "/generate", json={"input_ids": ids, "sampling_params": GREEDY}) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["output_ids"]

    return list(await asyncio.gather(*(one(p) for p in batch)))


async def test_two_relays_serve_one_port_with_the_reference_tokens(start_manager, start_engines, model):
    m, engines = await with_relays(start_manager, start_engines)
    batch = prompts(24)
    outs = await _generate_each_on_its_own_connection(m.url, batch)
    assert outs == [reference_generate(model, p, MAX_NEW)[0] for p in batch]
    async with ManagerClient(m.url, **FAST_CLIENT) as client:
        lines = [line async for line in client.batch_generate(
            [(i, {"input_ids": p, "sampling_params": GREEDY}) for i, p in enumerate(batch)])]
    assert sorted((line["id"], line["data"]["output_ids"]) for line in lines) == \
        [(i, reference_generate(model, p, MAX_NEW)[0]) for i, p in enumerate(batch)]

    await async_wait_until(lambda: _finished_by_each(m), message="each relay's report counts what it finished")
    status = await m.status()
    assert sum(r["finished"] for r in status["relays"]) == 48
    assert all(r["finished"] > 0 and r["cpu_s"] > 0 for r in status["relays"])  # the kernel spread the callers
    assert [i["state"] for i in status["instances"]] == ["active", "active"]
    _, health = await m.get("/health")
    assert health["instances"]["active"] == 2 and health["run_id"] == (await m.get("/health"))[1]["run_id"]
    async with m.session.get(m.url + "/metrics") as r:  # the control process's, with each relay's figures
        text = await r.text()
    finished = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("rollout_manager_relay_sequences_finished{")}
    assert finished.keys() == {"0", "1"} and sum(finished.values()) == 48


async def _finished_by_each(m) -> bool:
    relays = (await m.status())["relays"]
    return sum(r["finished"] for r in relays) == 48


async def test_control_process_sigkilled_mid_step_loses_nothing(start_manager, start_engines, model):
    # health checks that make no tokens, so the engines' count is the step's alone
    m, engines = await with_relays(start_manager, start_engines, health_check_path="/health", trust_probe_interval_s=0)
    before = await m.status()
    made_before = await _generated(engines)
    run_id = (await m.get("/health"))[1]["run_id"]
    [control] = _pids(m.proc.pid, "control")
    batch = prompts(40)
    got: dict[int, list[int]] = {}
    async with ManagerClient(m.url, **FAST_CLIENT) as client:
        async for line in client.batch_generate(
                [(i, {"input_ids": p, "sampling_params": GREEDY}) for i, p in enumerate(batch)]):
            assert line["success"], line
            got[line["id"]] = line["data"]["output_ids"]
            if len(got) == 4:
                os.kill(control, signal.SIGKILL)  # relays keep serving on the fleet they last saw
        assert client.stats.resubmitted == 0 and client.stats.interruptions == 0
    assert got == {i: reference_generate(model, p, MAX_NEW)[0] for i, p in enumerate(batch)}
    # not one token made again: beyond the step's, only the new control process's trust probe of each box it
    # adopted (a one-token prefill)
    assert 0 <= await _generated(engines) - made_before - len(batch) * MAX_NEW <= len(engines)
    # a new control process took the fleet back from the relays: same ids, still active, same run
    await async_wait_until(lambda: _relays_connected(m, 2), message="relays follow the new control process")
    after = await m.status()
    assert [(i["id"], i["endpoint"], i["state"]) for i in after["instances"]] == \
        [(i["id"], i["endpoint"], "active") for i in before["instances"]]
    assert (await m.get("/health"))[1]["run_id"] == run_id
    assert _pids(m.proc.pid, "control") != [control]


async def test_relay_sigkilled_mid_step_answers_every_id_through_the_other(start_manager, start_engines, model):
    m, engines = await with_relays(start_manager, start_engines)
    batch = prompts(40)
    got: dict[int, list[int]] = {}
    killed: list[int] = []
    async with ManagerClient(m.url, **FAST_CLIENT) as client:
        async for line in client.batch_generate(
                [(i, {"input_ids": p, "sampling_params": GREEDY}) for i, p in enumerate(batch)]):
            assert line["success"], line
            assert line["id"] not in got
            got[line["id"]] = line["data"]["output_ids"]
            if len(got) == 4 and not killed:
                status = await m.status()
                relays = status["relays"]
                busy = [r["pid"] for r in relays if r["in_flight"] or r["waiting"]]
                # the status shows each box's sequences as the relays last reported them
                assert sum(i["in_flight"] for i in status["instances"]) == sum(r["in_flight"] for r in relays) > 0
                os.kill(busy[0], signal.SIGKILL)
                killed.append(busy[0])
        stats = dataclasses.asdict(client.stats)
    assert got == {i: reference_generate(model, p, MAX_NEW)[0] for i, p in enumerate(batch)}
    # only unanswered ids are sent again (a second interruption: a pooled connection to the dead relay, reset)
    assert 1 <= stats["interruptions"] <= 2 and 0 < stats["resubmitted"] <= 36 * stats["interruptions"], stats
    assert stats["duplicates_dropped"] == 0, stats
    await async_wait_until(lambda: _relays_connected(m, 2), message="the supervisor started the relay again")
    assert killed[0] not in _pids(m.proc.pid, "relay")
    assert any(r["restarts"] == 1 for r in (await m.status())["relays"])


async def _generated(engines) -> int:
    """Tokens the engines made, all requests together (the CPU engine's own count)."""
    async with aiohttp.ClientSession() as s:
        total = 0
        for e in engines:
            async with s.get(e.url + "/server_info") as r:
                total += (await r.json())["cpu_engine"]["total_generated_tokens"]
        return total


async def test_relay_sigkilled_mid_sequence_costs_each_sequence_at_most_k_tokens(start_manager, start_engines, model):
    """With relay_checkpoint_tokens = K the sequences of a relay killed mid-step go on from their saved tokens."""
    k, interval, long_new, n = 8, 8, 200, 12
    # the relay knows a sequence's tokens as its chunks bring them: every engine_stream_interval tokens
    m, engines = await with_relays(start_manager, start_engines, relay_checkpoint_tokens=k,
                                   engine_stream_interval=interval, health_check_path="/health",
                                   trust_probe_interval_s=0)
    params = {"temperature": 0.0, "max_new_tokens": long_new}
    batch = prompts(n)
    before = await _generated(engines)
    killed: list[int] = []

    async def kill_mid_sequence() -> None:  # half-way through the second wave of sequences (4 run at once)
        await async_wait_until(lambda: _made_at_least(engines, before + 6 * long_new), timeout_s=60,
                               message="the step is under way")
        busy = [r["pid"] for r in (await m.status())["relays"] if r["in_flight"]]
        os.kill(busy[0], signal.SIGKILL)
        killed.append(busy[0])

    killer = asyncio.create_task(kill_mid_sequence())
    got: dict[int, dict[str, Any]] = {}
    async with ManagerClient(m.url, **FAST_CLIENT) as client:
        async for line in client.batch_generate([(i, {"input_ids": p, "sampling_params": params})
                                                 for i, p in enumerate(batch)]):
            assert line["success"] and line["id"] not in got, line
            got[line["id"]] = line["data"]
    await killer
    assert {i: d["output_ids"] for i, d in got.items()} == \
        {i: reference_generate(model, p, long_new)[0] for i, p in enumerate(batch)}
    resumed = [d for d in got.values()
               if any("saved by its relay" in s["outcome"] for s in d["meta_info"].get("segments", []))]
    assert resumed, "no sequence went on from saved tokens"
    remade = await _generated(engines) - before - n * long_new
    # each of the (at most 4) sequences running there loses what it made since its last save: under K, plus a
    # chunk's worth the relay had not seen, plus what one report interval (0.1 s) makes at 100 tokens/s, plus what
    # the engine makes before it notices the relay is gone (until its next chunk). Without saving: ~100 each.
    assert 0 <= remade <= 4 * (k + 2 * interval + 10), remade
    print(f"\nFIGURES relay SIGKILL with relay_checkpoint_tokens={k}: {len(resumed)} sequence(s) continued from "
          f"saved tokens, {remade} token(s) made again in all (sequences of {long_new})")


async def _made_at_least(engines, total: int) -> bool:
    return await _generated(engines) >= total


async def test_a_box_quarantined_by_the_control_process_is_cut_back_in_the_relays(start_manager, start_engines,
                                                                                  model):
    """The control process probes and quarantines; the relays vouch for what probes passed, cut their running
    sequences back to it and list what they delivered unvouched, so every answer is the reference's."""
    long_new = 200
    m = await start_manager(relays=2, relay_report_s=0.1, trust_probe_interval_s=0.3, trust_probe_tolerance=0.001)
    engines = await start_engines(ENGINE_FLAGS, ENGINE_FLAGS, ENGINE_FLAGS)
    await m.register(*engines)
    await async_wait_until(lambda: _relays_connected(m, 2), message="both relays report")
    bad = engines[0]
    before = await _generated(engines)
    params = {"temperature": 0.0, "max_new_tokens": long_new}
    batch = prompts(12)

    async def perturb_mid_step() -> None:
        await async_wait_until(lambda: _made_at_least(engines, before + 8 * 80), timeout_s=60,
                               message="the step is under way")
        fault = {"perturb_tensor": "model.layers.0.self_attn.q_proj.weight", "perturb_after_requests": 0,
                 "perturb_scale": 0.5}  # its weights go wrong on its next request
        async with aiohttp.ClientSession() as s:
            async with s.post(bad.url + "/debug/faults", json=fault) as r:
                assert r.status == 200
            async with s.post(bad.url + "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}):
                pass

    fault = asyncio.create_task(perturb_mid_step())
    got: dict[int, dict[str, Any]] = {}
    async with ManagerClient(m.url, **FAST_CLIENT) as client:
        async for line in client.batch_generate([(i, {"input_ids": p, "sampling_params": params})
                                                 for i, p in enumerate(batch)]):
            assert line["success"], line
            got[line["id"]] = line["data"]
    await fault
    assert {i: d["output_ids"] for i, d in got.items()} == \
        {i: reference_generate(model, p, long_new)[0] for i, p in enumerate(batch)}
    status = await m.status()
    [quarantined] = [i for i in status["instances"] if i["quarantined"]]
    assert quarantined["endpoint"] == bad.endpoint
    metas = [d["meta_info"] for d in got.values()]
    cut = [s for meta in metas for s in meta.get("segments", [])
           if s["endpoint"] == bad.endpoint and "cut back at token" in s["outcome"]]
    assert cut and any(s["end"] > s["start"] for s in cut), "nothing a passing probe vouched for was kept"
    assert any(s["outcome"].startswith("distrusted: quarantined")
               for meta in metas for s in meta.get("discarded_segments", []))


async def test_shutdown_of_a_box_waits_for_the_relays_sequences_on_it(start_manager, start_engines, model):
    """``/shutdown_instances`` at the control process drains the box in every relay: it answers once the relays
    report nothing running there, so the box may be stopped then and no sequence has to move (and prefill again)."""
    m, engines = await with_relays(start_manager, start_engines)
    batch = prompts(16)
    got: dict[int, dict[str, Any]] = {}
    async with ManagerClient(m.url, **FAST_CLIENT) as client:
        async def step() -> None:
            async for line in client.batch_generate(
                    [(i, {"input_ids": p, "sampling_params": GREEDY}) for i, p in enumerate(batch)]):
                assert line["success"], line
                got[line["id"]] = line["data"]

        task = asyncio.ensure_future(step())

        async def both_busy() -> bool:
            return all(i["in_flight"] > 0 for i in (await m.status())["instances"])

        await async_wait_until(both_busy, 20, message="sequences running on both boxes, as the relays report")
        endpoint = f"127.0.0.1:{engines[0].port}"
        status, answer = await m.post("/shutdown_instances", {"endpoints": [endpoint]})
        assert status == 200 and answer["removed"] == [endpoint], answer
        os.kill(engines[0].proc.pid, signal.SIGKILL)  # as its operator would, once the call returned
        assert len(got) < len(batch)  # removed mid-step, once its own sequences were done
        await task
    assert {i: d["output_ids"] for i, d in got.items()} == \
        {i: reference_generate(model, p, MAX_NEW)[0] for i, p in enumerate(batch)}
    ran_on = [{s["endpoint"] for s in d["meta_info"]["segments"]} for d in got.values()]
    assert sum(endpoint in on for on in ran_on) > 0 and all(len(on) == 1 for on in ran_on)  # none moved
