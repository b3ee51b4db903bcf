"""The verl plugin: launcher, client, streaming micro-batches, metrics, and verl 0.9.1 registration.

Real manager and CPU engine processes on 127.0.0.1 (the fixtures in conftest.py); the verl tests
are skipped with the reason when verl is not installed (``tests/verl_constraints.txt`` installs it).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import socket
import subprocess
import textwrap
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch
from aiohttp import web
from support import PY, ROOT, Proc, async_wait_until, free_port, wait_until

from rollout_manager.cpu_engine.model import build_model, reference_generate
from trainer_plugin.client import ManagerClient, ManagerHTTPError, ManagerUnavailable
from trainer_plugin.launcher import ManagerProcess, ManagerStartError, PortInUseError, probe_health
from trainer_plugin.metrics import StepTimer, as_log_metrics, post_step_metrics
from trainer_plugin.settings import SettingsError, from_rollout_config, rewrite_argv
from trainer_plugin.streaming import RolloutFailed, RolloutStream, build_micro_batch, iterate_rollouts_sync

HAVE_VERL = importlib.util.find_spec("verl") is not None
needs_verl = pytest.mark.skipif(not HAVE_VERL, reason="verl 0.9.1 is not installed (pip install -c "
                                "tests/verl_constraints.txt verl==0.9.1 after torch==2.13.0)")
V1_MISSING = [m for m in ("verl", "transfer_queue", "cachetools", "fastapi", "uvicorn")
              if importlib.util.find_spec(m) is None]
needs_verl_v1 = pytest.mark.skipif(bool(V1_MISSING), reason=f"verl 0.9.1's V1 trainers need {', '.join(V1_MISSING)} "
                                   "(scripts/install.sh installs them)")
GREEDY = {"temperature": 0.0}
pytestmark = [pytest.mark.filterwarnings("ignore:Ray state API is no longer experimental:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:.* engine is not available:UserWarning")]


@pytest.fixture(scope="module")
def model():
    return build_model(0)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False



# ---------------------------------------------------------------------------------------- launcher
@pytest.mark.slow
def test_launcher_starts_healthy_and_stops(tmp_path):
    port = free_port()
    with ManagerProcess("127.0.0.1", port, log_path=tmp_path / "m.log") as proc:
        assert not proc.attached and proc.running()
        kind, health = probe_health("127.0.0.1", port)
        assert kind == "manager" and health["status"] == "healthy"
        pid = proc.pid
    assert not pid_alive(pid)
    assert probe_health("127.0.0.1", port)[0] == "closed"
    assert "listening on" in (tmp_path / "m.log").read_text()


PARENT = textwrap.dedent("""
    import os, signal, sys, time
    from trainer_plugin.launcher import ManagerProcess
    mode, port, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if mode == "sigterm_chained":
        def mine(signum, frame):
            open(log + ".chained", "w").write("called")
            sys.exit(3)
        signal.signal(signal.SIGTERM, mine)
    proc = ManagerProcess("127.0.0.1", port, log_path=log).start()
    print("READY", proc.pid, flush=True)
    if mode == "exception":
        raise RuntimeError("trainer crashed")
    if mode.startswith("sig"):
        time.sleep(120)
""")


@pytest.mark.slow
def test_manager_never_outlives_the_trainer(tmp_path):
    """Normal exit, uncaught exception, SIGTERM (default and chained handler), SIGKILL of the parent."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    modes = ["normal", "exception", "sigterm", "sigterm_chained", "sigkill"]
    parents = {}
    for mode in modes:
        port = free_port()
        log = tmp_path / f"manager-{mode}.log"
        parents[mode] = (Proc([PY, str(script), mode, str(port), str(log)], tmp_path / f"parent-{mode}.log"), port, log)

    def ready_pid(mode):
        proc = parents[mode][0]
        for line in proc.log().splitlines():
            if line.startswith("READY "):
                return int(line.split()[1])
        if proc.popen.poll() is not None and mode.startswith("sig"):
            raise AssertionError(f"{mode} parent exited early:\n{proc.log()}")
        return None

    try:
        pids = {}

        def all_ready():
            for mode in modes:
                if mode not in pids and (pid := ready_pid(mode)):
                    pids[mode] = pid
            return len(pids) == len(modes)

        wait_until(all_ready, 60, message=lambda: f"READY lines; missing: "
                   f"{ {m: parents[m][0].log() for m in modes if m not in pids} }")
        parents["sigterm"][0].signal(signal.SIGTERM)
        parents["sigterm_chained"][0].signal(signal.SIGTERM)
        parents["sigkill"][0].signal(signal.SIGKILL)
        codes = {mode: parents[mode][0].wait(30) for mode in modes}
        assert codes["normal"] == 0
        assert codes["exception"] == 1 and "trainer crashed" in parents["exception"][0].log()
        assert codes["sigterm"] == -signal.SIGTERM  # the default action still happens after cleanup
        assert codes["sigterm_chained"] == 3  # the trainer's own handler still runs
        assert Path(str(parents["sigterm_chained"][2]) + ".chained").read_text() == "called"
        assert codes["sigkill"] == -signal.SIGKILL
        wait_until(lambda: not any(pid_alive(p) for p in pids.values()), 15,
                   message=lambda: f"the managers to exit; alive: { {m: pid_alive(p) for m, p in pids.items()} }")
        assert {m: pid_alive(p) for m, p in pids.items()} == {m: False for m in modes}
        for mode in modes:
            assert probe_health("127.0.0.1", parents[mode][1])[0] == "closed", mode
    finally:
        for proc, _, _ in parents.values():
            proc.stop()
        for pid in locals().get("pids", {}).values():
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_busy_port_is_refused_clearly(tmp_path):
    with socket.socket() as s:  # something that accepts TCP but is no rollout manager
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PortInUseError, match=rf"127.0.0.1:{port}: the port is already in use by something "
                                                  r"that is not a rollout manager"):
            ManagerProcess("127.0.0.1", port, log_path=tmp_path / "m.log", probe_timeout_s=0.3).start()


@pytest.mark.slow
async def test_attaches_to_a_running_manager_and_leaves_it_running(start_manager, tmp_path):
    m = await start_manager()
    port = int(m.url.rsplit(":", 1)[1])
    proc = await asyncio.to_thread(ManagerProcess("127.0.0.1", port, log_path=tmp_path / "x.log").start)
    assert proc.attached and proc.pid is None and proc.health["status"] == "healthy"
    proc.stop()
    assert (await m.get("/health"))[0] == 200  # not ours: still running
    with pytest.raises(PortInUseError, match="already listening .* attaching to it is disabled"):
        ManagerProcess("127.0.0.1", port, attach_existing=False).start()


@pytest.mark.slow
def test_start_failure_raises_with_the_log_tail(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("no_such_key = 1\n")
    with pytest.raises(ManagerStartError, match=r"exited with code 2(.|\n)*unknown config key 'no_such_key'"):
        ManagerProcess("127.0.0.1", free_port(), bad, log_path=tmp_path / "m.log").start()


# ---------------------------------------------------------------------------------------- client
async def test_client_retries_connection_errors_only():
    hits = []

    async def fail(request):
        hits.append(request.path)
        return web.json_response({"error": "boom"}, status=500)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fail)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with ManagerClient(f"127.0.0.1:{port}", retries=3, retry_backoff_s=0.01) as c:
            with pytest.raises(ManagerHTTPError) as err:
                await c.update_metrics(step_time_s=1, trainer_bubble_time_s=0, step_throughput=1)
            assert err.value.status == 500 and err.value.message == "boom"
            with pytest.raises(ManagerHTTPError):
                await c.health()
        assert hits == ["/update_metrics", "/health"]  # answered errors are never retried
    finally:
        await runner.cleanup()
    closed = free_port()
    async with ManagerClient(f"http://127.0.0.1:{closed}", retries=2, retry_backoff_s=0.01) as c:
        t0 = time.monotonic()
        with pytest.raises(ManagerUnavailable, match="not reachable after 3 attempt"):
            await c.health()
        assert time.monotonic() - t0 < 5


@pytest.mark.slow
async def test_client_reports_validation_errors_and_metrics(start_manager):
    m = await start_manager()
    async with ManagerClient(m.url) as c:
        assert (await c.health())["status"] == "healthy"
        with pytest.raises(ManagerHTTPError) as err:
            await c.generate({"input_ids": []})
        assert err.value.status == 400 and "input_ids" in err.value.message
        timer = StepTimer()
        timer.start_step()
        with timer.waiting():
            await asyncio.sleep(0.02)
        figures = timer.end_step(samples=16)
        assert 0.02 <= figures["trainer_bubble_time_s"] <= figures["step_time_s"]
        answer = await post_step_metrics(c, **figures)
        assert answer["step_time_s"] == pytest.approx(figures["step_time_s"])
        assert "local_budget_s" in answer and "generation" in answer
        flat = as_log_metrics(answer)
        assert "rollout_manager/local_budget_s" in flat and "rollout_manager/generation/sequences" in flat


# ---------------------------------------------------------------------------------------- streaming
class RecordingClient(ManagerClient):
    """Notes the order in which the manager's results arrived."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.arrivals: list[str] = []

    async def batch_generate(self, items):
        async for line in super().batch_generate(items):
            self.arrivals.append(line["id"])
            yield line


def check_stream(batches, client, stream, prompts, n, min_size, model, max_new):
    groups_seen = []
    for k, mb in enumerate(batches):
        size = len(mb)
        if k < len(batches) - 1:
            assert size >= min_size, (k, size)
        pidx = mb.non_tensors["prompt_index"].tolist()
        ridx = mb.non_tensors["rollout_n"].tolist()
        groups = list(dict.fromkeys(pidx))
        for g in groups:  # whole groups, samples in index order
            rows = [i for i, p in enumerate(pidx) if p == g]
            assert len(rows) == n and [ridx[i] for i in rows] == list(range(n))
            assert rows == list(range(rows[0], rows[0] + n))
            assert len(set(mb.non_tensors["uid"][rows].tolist())) == 1
        groups_seen += groups
        for row, g in enumerate(pidx):
            ref = reference_generate(model, prompts[g], max_new)[0]
            length = int(mb.non_tensors["response_len"][row])
            assert mb.tensors["responses"][row, :length].tolist() == ref
    assert sorted(groups_seen) == list(range(len(prompts)))
    # completion order: a group is released when its last sample arrives
    last_arrival = {}
    for pos, rid in enumerate(client.arrivals):
        g = int(rid.split("-")[-2])
        last_arrival[g] = pos
    assert groups_seen == sorted(groups_seen, key=lambda g: last_arrival[g])
    assert stream.stats.samples_yielded == len(prompts) * n and stream.failures == []


@pytest.mark.slow
async def test_stream_micro_batches_keep_groups_whole_in_completion_order(start_manager, start_engines, model):
    m = await start_manager()
    engines = await start_engines(["--token-delay-s", "0.002"], ["--token-delay-s", "0.004"])
    await m.register(*engines)
    prompts = [[(7 * i + j) % 256 for j in range(1 + i % 5)] for i in range(10)]
    async with RecordingClient(m.url) as client:
        for n, min_size, max_new in ((1, 3, 6), (4, 6, 5), (8, 8, 4)):
            client.arrivals = []
            # different budgets per prompt make completion order differ from submission order
            stream = RolloutStream(client, prompts, n=n, min_stream_batch_size=min_size,
                                   sampling_params={**GREEDY, "max_new_tokens": max_new}, output="micro_batch")
            batches = [mb async for mb in stream]
            check_stream(batches, client, stream, prompts, n, min_size, model, max_new)
            assert len(batches) >= 2


@pytest.mark.slow
@needs_verl
async def test_stream_yields_dataprotos_with_verl_fields(start_manager, start_engines, model):
    from verl import DataProto

    m = await start_manager()
    (engine,) = await start_engines([])
    await m.register(engine)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]
    P, R, n = 8, 12, 2
    async with ManagerClient(m.url) as client:
        stream = RolloutStream(client, prompts, n=n, min_stream_batch_size=4, sampling_params=GREEDY,
                               return_logprob=True, prompt_length=P, response_length=R, pad_token_id=0,
                               uids=["a", "b", "c", "d"],
                               non_tensor_batch={"raw_prompt": ["p0", "p1", "p2", "p3"],
                                                 "data_source": ["x"] * 4})
        batches = [b async for b in stream]
    assert all(isinstance(b, DataProto) for b in batches) and len(batches) == 2
    data = DataProto.concat(batches)
    B = len(prompts) * n
    t = data.batch
    for key, dtype, shape in [("prompts", torch.int64, (B, P)), ("responses", torch.int64, (B, R)),
                              ("response_mask", torch.int64, (B, R)), ("input_ids", torch.int64, (B, P + R)),
                              ("attention_mask", torch.int64, (B, P + R)), ("position_ids", torch.int64, (B, P + R)),
                              ("rollout_log_probs", torch.float32, (B, R))]:
        assert t[key].dtype == dtype and tuple(t[key].shape) == shape, key
    for row in range(B):
        g = int(data.non_tensor_batch["prompt_index"][row])
        prompt = prompts[g]
        ref_ids, ref_lps = reference_generate(model, prompt, R)
        assert t["prompts"][row].tolist() == [0] * (P - len(prompt)) + prompt  # left-padded
        assert t["responses"][row].tolist() == ref_ids  # greedy: R tokens, no padding needed
        assert t["attention_mask"][row].tolist() == [0] * (P - len(prompt)) + [1] * (len(prompt) + R)
        assert t["position_ids"][row].tolist() == [0] * (P - len(prompt)) + list(range(len(prompt) + R))
        assert torch.equal(t["input_ids"][row], torch.cat([t["prompts"][row], t["responses"][row]]))
        assert t["rollout_log_probs"][row].tolist() == pytest.approx(ref_lps, abs=1e-4)
        assert data.non_tensor_batch["uid"][row] == "abcd"[g]
        assert data.non_tensor_batch["raw_prompt"][row] == f"p{g}"
        assert data.non_tensor_batch["weight_version"][row] == "0"
        assert data.non_tensor_batch["weight_versions"][row] == ["0"]
        assert data.non_tensor_batch["min_global_steps"][row] == 0 == data.non_tensor_batch["max_global_steps"][row]
    assert data.non_tensor_batch["__num_turns__"].dtype == np.int32
    # right padding and zeroed log-probs when responses are shorter than response_length
    short = build_micro_batch(stream_samples(), uids=["u"], prompt_length=4, response_length=6, with_logprobs=True)
    assert short.tensors["responses"][0].tolist() == [9, 8, 0, 0, 0, 0]
    assert short.tensors["response_mask"][0].tolist() == [1, 1, 0, 0, 0, 0]
    assert short.tensors["rollout_log_probs"][0].tolist() == pytest.approx([-0.5, -0.25, 0, 0, 0, 0])
    assert short.tensors["position_ids"][0].tolist() == [0, 0, 0, 1, 2, 3, 3, 3, 3, 3]


def stream_samples():
    from trainer_plugin.streaming import Sample

    return [Sample(group=0, index=0, request_id="r", prompt_ids=[3, 4], output_ids=[9, 8], logprobs=[-0.5, -0.25],
                   finish_reason="stop", weight_version="7", weight_versions=["6", "7"])]


@pytest.mark.slow
async def test_failed_requests_fail_the_step_or_drop_their_group(start_manager, start_engines):
    # One engine call per sequence (engine_batch_max=1): the engine's injected failures are per call, and a
    # shared call would fail or pass its sequences together.
    m = await start_manager(max_attempts_per_request=1, engine_batch_max=1)
    # a 400 from the engine is final (not the instance's fault, never retried)
    (engine,) = await start_engines(["--fail-rate", "0.3", "--fail-status", "400", "--fault-seed", "3"])
    await m.register(engine)
    prompts = [[i + 1, i + 2] for i in range(12)]
    async with ManagerClient(m.url) as client:
        stream = RolloutStream(client, prompts, n=2, min_stream_batch_size=2,
                               sampling_params={**GREEDY, "max_new_tokens": 3}, output="micro_batch")
        with pytest.raises(RolloutFailed, match=r"rollout request rs-\w+-\d+-\d+ \(prompt \d+, sample \d\) "
                                                r"failed with status 400"):
            async for _ in stream:
                pass
        assert len(stream.failures) == 1
        stream = RolloutStream(client, prompts, n=2, min_stream_batch_size=2, on_failure="drop_group",
                               sampling_params={**GREEDY, "max_new_tokens": 3}, output="micro_batch")
        batches = [b async for b in stream]
    kept = [int(g) for b in batches for g in dict.fromkeys(b.non_tensors["prompt_index"].tolist())]
    assert stream.dropped_groups and set(kept).isdisjoint(stream.dropped_groups)
    assert sorted(kept + stream.dropped_groups) == list(range(len(prompts)))
    assert [b.non_tensors["micro_batch_index"][0] for b in batches] == list(range(len(batches)))
    assert {f["group"] for f in stream.failures} == set(stream.dropped_groups)
    # every group failing fails the step even when groups may be dropped
    async with aiohttp.ClientSession() as s:
        async with s.post(engine.url + "/debug/faults", json={"fail_rate": 1.0}) as r:
            assert r.status == 200, await r.text()
    async with ManagerClient(m.url) as client:
        stream = RolloutStream(client, [[1], [2]], n=2, on_failure="drop_group", output="micro_batch",
                               sampling_params={**GREEDY, "max_new_tokens": 2})
        with pytest.raises(RolloutFailed, match="every one of the 2 groups was dropped"):
            async for _ in stream:
                pass


@pytest.mark.slow
async def test_sync_wrapper_and_early_close(start_manager, start_engines, model):
    m = await start_manager()
    (engine,) = await start_engines(["--token-delay-s", "0.01"])
    await m.register(engine)
    prompts = [[i + 3] for i in range(6)]

    def consume(limit=None):
        out = []
        for mb in iterate_rollouts_sync(m.url, prompts, n=2, min_stream_batch_size=4, output="micro_batch",
                                        sampling_params={**GREEDY, "max_new_tokens": 4}):
            out.append(mb)
            if limit and len(out) >= limit:
                break
        return out

    batches = await asyncio.to_thread(consume)
    assert sum(len(b) for b in batches) == 12
    for b in batches:
        for row, g in enumerate(b.non_tensors["prompt_index"].tolist()):
            assert b.tensors["responses"][row].tolist() == reference_generate(model, prompts[g], 4)[0]
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        await asyncio.to_thread(lambda: list(iterate_rollouts_sync(m.url, [[]], output="micro_batch")))
    # leaving early closes the connection; the manager aborts the rest and stays healthy
    prompts = [[i + 3] for i in range(6)]
    first = await asyncio.to_thread(lambda: consume(limit=1))
    assert len(first) == 1
    await async_wait_until(lambda: _in_flight_zero(m), message="aborted requests to leave the instance")


async def _in_flight_zero(m):
    status = await m.status()
    return all(i["in_flight"] == 0 for i in status["instances"])


# ---------------------------------------------------------------------------------------- settings
def test_settings_and_argv_mapping(tmp_path):
    argv, notes = rewrite_argv(["main_ppo", "actor_rollout_ref.rollout.rollout_manager.port=6001",
                                "+actor_rollout_ref.rollout.rollout_manager.config_path=/x.toml",
                                "actor_rollout_ref.rollout.min_stream_batch_size=16", "trainer.n_gpus_per_node=8"])
    assert argv == ["main_ppo", "++actor_rollout_ref.rollout.custom.rollout_manager.port=6001",
                    "++actor_rollout_ref.rollout.custom.rollout_manager.config_path=/x.toml",
                    "++actor_rollout_ref.rollout.custom.min_stream_batch_size=16", "trainer.n_gpus_per_node=8"]
    assert len(notes) == 3
    toml = tmp_path / "m.toml"
    toml.write_text("")
    s = from_rollout_config({"custom": {"rollout_manager": {"port": "6001", "config_path": str(toml),
                                                            "launch": "false"}, "min_stream_batch_size": 16}})
    assert (s.manager.port, s.manager.launch, s.min_stream_batch_size) == (6001, False, 16)
    assert from_rollout_config({"custom": None}).manager.port == 5000
    with pytest.raises(SettingsError, match=r"actor_rollout_ref.rollout.rollout_manager is not a verl 0.9.1 "
                                            r"rollout key; write it as "
                                            r"actor_rollout_ref.rollout.custom.rollout_manager"):
        from_rollout_config({"rollout_manager": {"port": 1}})
    with pytest.raises(SettingsError, match=r"unknown key actor_rollout_ref.rollout.custom.rollout_manager.prot"):
        from_rollout_config({"custom": {"rollout_manager": {"prot": 1}}})
    with pytest.raises(SettingsError, match="config_path=/nope.toml: no such file"):
        from_rollout_config({"custom": {"rollout_manager": {"config_path": "/nope.toml"}}})
    assert from_rollout_config({}).manager.weight_push_wait_until == "staged"  # update_weights returns once staged
    with pytest.raises(SettingsError, match="weight_push_wait_until must be 'staged' or 'serving', got 'loaded'"):
        from_rollout_config({"custom": {"rollout_manager": {"weight_push_wait_until": "loaded"}}})


# ---------------------------------------------------------------------------------------- verl
@pytest.mark.slow
@needs_verl
def test_importing_verl_loads_the_plugin_through_its_entry_point(tmp_path):
    """verl logs entry-point load errors at debug level only, so check the effect in a fresh process.

    The entry point is declared in a throwaway dist-info (the line pyproject.toml carries), so the
    test holds whether or not the installed metadata has it yet.
    """
    dist = tmp_path / "rollout_manager_verl_plugin_probe-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rollout-manager-verl-plugin-probe\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text('[verl.plugins]\nrollout_manager = trainer_plugin.verl_registration\n')
    code = textwrap.dedent("""
        import sys
        import verl
        assert "trainer_plugin.verl_registration" in sys.modules, "plugin not loaded by import verl"
        from verl.workers.rollout.replica import get_rollout_replica_class
        from verl.workers.rollout.base import get_rollout_class
        print(get_rollout_replica_class("sglang-disaggregated").__name__,
              get_rollout_class("sglang-disaggregated", "async").__name__)
        print(sys.argv[1:])
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    out = subprocess.run([PY, "-c", code, "actor_rollout_ref.rollout.rollout_manager.port=7001"], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "DisaggregatedReplica ManagerServerAdapter"
    assert lines[1] == "['++actor_rollout_ref.rollout.custom.rollout_manager.port=7001']"
    assert "mapped actor_rollout_ref.rollout.rollout_manager.port" in out.stderr


@pytest.mark.slow  # runs for seconds
@needs_verl
def test_shipped_config_and_verl_config_classes(tmp_path):
    from hydra import compose, initialize_config_dir, initialize_config_module
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    import trainer_plugin

    cfg_dir = str(Path(trainer_plugin.__file__).parent / "config")
    with initialize_config_dir(config_dir=cfg_dir, version_base=None):
        cfg = compose("sglang_disaggregated_trainer", overrides=[
            "actor_rollout_ref.rollout.custom.rollout_manager.port=6001",
            *rewrite_argv(["actor_rollout_ref.rollout.min_stream_batch_size=8"])[0]])
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)  # as verl's workers build it
    assert isinstance(rollout, RolloutConfig) and rollout.name == "sglang-disaggregated"
    s = from_rollout_config(rollout)
    assert (s.manager.port, s.min_stream_batch_size, s.manager.host) == (6001, 8, "0.0.0.0")
    assert s.manager.weight_push == "trainer_plugin.weight_push:push_to_rollout_manager"
    assert cfg.trainer.use_v1 and cfg.trainer.v1.trainer_mode == "rollout_manager_sync"
    with initialize_config_module("verl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=["actor_rollout_ref.rollout.name=sglang-disaggregated",
                                                "+actor_rollout_ref.rollout.custom.rollout_manager.port=6002"])
        assert from_rollout_config(omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)).manager.port == 6002
        with pytest.raises(Exception, match="Could not override 'actor_rollout_ref.rollout.rollout_manager.port'"):
            compose("ppo_trainer", overrides=["actor_rollout_ref.rollout.rollout_manager.port=5"])


@pytest.mark.slow
@needs_verl
async def test_proxy_server_turns_verl_generate_into_manager_calls(start_manager, start_engines, model):
    from verl.workers.rollout.replica import TokenOutput

    from trainer_plugin.proxy import ManagerProxyServer, build_generate_body

    m = await start_manager()
    (engine,) = await start_engines([])
    await m.register(engine)
    server = ManagerProxyServer(m.url, prompt_length=8, response_length=6)
    try:
        out = await server.generate([5, 6, 7], {"temperature": 0.0, "top_p": 1.0, "top_k": -1,
                                                "repetition_penalty": 1.0, "logprobs": True}, "req-1")
        ref_ids, ref_lps = reference_generate(model, [5, 6, 7], 6)
        assert isinstance(out, TokenOutput) and out.token_ids == ref_ids and out.stop_reason == "length"
        assert out.log_probs == pytest.approx(ref_lps, abs=1e-4)
        assert out.extra_fields["global_steps"] == 0 and out.extra_fields["weight_versions"] == ["0"]
        assert out.extra_fields["min_global_steps"] == 0 == out.extra_fields["max_global_steps"]
        for control in ("wake_up", "sleep", "clear_kv_cache", "release_kv_cache", "resume_kv_cache",
                        "resume_generation"):
            await getattr(server, control)()
        await server.abort_all_requests(reject_request=True)
        assert server.get_server_address() == ("127.0.0.1", int(m.url.rsplit(":", 1)[1]))
        with pytest.raises(NotImplementedError, match="text-only"):
            await server.generate([1], {}, "r", image_data=["x"])
    finally:
        await server.close()
    # verl's budget rule: min(response_length, prompt_length + response_length - len(prompt)), context-capped
    assert build_generate_body([1] * 10, {}, None, prompt_length=8, response_length=6)["sampling_params"] == \
        {"max_new_tokens": 4}
    body = build_generate_body([1, 2], {"max_tokens": 50, "temperature": 0.7}, "r", prompt_length=8,
                               response_length=6, max_model_len=20)
    assert body == {"input_ids": [1, 2], "sampling_params": {"temperature": 0.7, "max_new_tokens": 17}, "rid": "r",
                    "trajectory_key": "r"}


@pytest.mark.slow
@needs_verl
async def test_replica_starts_one_manager_and_adapter_hands_weights_to_the_push_hook(tmp_path):
    from verl.workers.config import RolloutConfig

    from trainer_plugin.verl_rollout import DisaggregatedReplica, ManagerServerAdapter, ensure_manager

    port = free_port()
    config = RolloutConfig(name="sglang-disaggregated", tensor_model_parallel_size=1, custom={
        "rollout_manager": {"host": "127.0.0.1", "port": port, "log_path": str(tmp_path / "m.log")},
        "min_stream_batch_size": 4})
    replica = DisaggregatedReplica(replica_rank=0, config=config, model_config=None, gpus_per_node=1)
    assert replica.settings.manager_url == f"http://127.0.0.1:{port}" and not replica.rollout_worker_use_gpu()
    manager = await asyncio.to_thread(ensure_manager, replica.settings)
    try:
        assert manager.running() and await asyncio.to_thread(ensure_manager, replica.settings) is manager
    finally:
        manager.stop()
    assert not pid_alive(manager.pid)

    config = RolloutConfig(name="sglang-disaggregated", custom={"rollout_manager": {
        "port": 6010, "weight_push": "trainer_plugin.weight_push:discard_weights"}})
    adapter = ManagerServerAdapter(config, None, None)
    await adapter.resume(["weights"])
    await adapter.release()
    consumed = []

    def weights():
        for i in range(3):
            consumed.append(i)
            yield f"layer{i}.weight", torch.zeros(4, dtype=torch.float32)

    result = await adapter.update_weights(weights(), global_steps=5)
    assert consumed == [0, 1, 2]  # every rank must drain the generator (FSDP gathers are collective)
    assert result == {"tensors": 3, "bytes": 48, "pushed": False}


@pytest.mark.slow
@needs_verl_v1
def test_importing_verl_registers_the_trainer_mode_only_when_v1_loads():
    code = textwrap.dedent("""
        import sys, verl
        assert "verl.trainer.ppo.v1" not in sys.modules  # import verl stays as fast as it was
        from verl.trainer.ppo.v1 import get_trainer_cls
        from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
        cls = get_trainer_cls("rollout_manager_sync")
        assert issubclass(cls, PPOTrainerSync), cls.__mro__
        print("OK", cls.__name__)
    """)
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "OK PPOTrainerSyncWithManager" in out.stdout, out.stderr[-3000:]


@pytest.mark.slow
@needs_verl_v1
async def test_trainer_mode_posts_step_metrics_and_logs_the_answer(start_manager, caplog):
    from omegaconf import OmegaConf

    from trainer_plugin.verl_trainer import PPOTrainerSyncWithManager

    m = await start_manager()
    calls: list[str] = []

    class Checkpoints:  # what PPOTrainerSync's hooks call: the weight sync and the replicas' sleep
        def update_weights(self, step):
            calls.append(f"update_weights {step}")

        def sleep_replicas(self):
            calls.append("sleep_replicas")

    def trainer(port):
        t = object.__new__(PPOTrainerSyncWithManager)  # the hooks only; verl's __init__ needs a cluster
        t.config = OmegaConf.create({"data": {"train_batch_size": 4}, "actor_rollout_ref": {"rollout": {
            "n": 8, "custom": {"rollout_manager": {"host": "127.0.0.1", "port": port}}}}})
        t.checkpoint_manager, t.timing_raw, t.curr_step_profile, t.global_steps = Checkpoints(), {}, False, 3
        return t

    def one_step(t):
        t.on_step_begin()
        t.on_sample_begin()
        time.sleep(0.02)  # the wait for rollouts being measured (not synchronisation)
        t.on_sample_end()
        t.on_step_end()
        return t._consume_sync_metrics()

    port = int(m.url.rsplit(":", 1)[1])
    logged = await asyncio.to_thread(one_step, trainer(port))
    assert calls == ["sleep_replicas", "update_weights 3"]  # verl's sync behaviour is kept
    assert 0.02 <= logged["rollout_manager/trainer_bubble_time_s"] <= logged["rollout_manager/step_time_s"]
    assert logged["rollout_manager/step_throughput"] == pytest.approx(32 / logged["rollout_manager/step_time_s"])
    assert "rollout_manager/local_budget_s" in logged and "rollout_manager/generation/sequences" in logged
    # a manager that is gone costs a warning, not the step
    with caplog.at_level("WARNING", logger="trainer_plugin.trainer"):
        logged = await asyncio.to_thread(one_step, trainer(free_port()))
    assert "rollout_manager/step_time_s" in logged and "local_budget_s" not in str(logged)
    assert "metrics not posted" in caplog.text


@pytest.mark.slow  # imports verl: seconds
@needs_verl_v1
def test_trainer_mode_is_verls_sync_trainer_in_every_other_respect(monkeypatch):
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    from trainer_plugin.verl_trainer import PPOTrainerSyncWithManager

    seen = []
    monkeypatch.setattr(PPOTrainer, "__init__", lambda self, config: seen.append(config.trainer.v1.trainer_mode))
    config = OmegaConf.create({"trainer": {"v1": {"trainer_mode": "rollout_manager_sync"}}})
    OmegaConf.set_struct(config, True)
    PPOTrainerSyncWithManager(config)
    assert seen == ["sync"]  # verl's `trainer_mode == "sync"` checks (replay buffer, refills) hold

    # verl's replay buffer polls TransferQueue every 2 s; the mode polls as often as configured
    import types

    monkeypatch.setattr(PPOTrainer, "_build_replay_buffer", lambda self: types.SimpleNamespace(poll_interval=2.0))
    trainer = object.__new__(PPOTrainerSyncWithManager)
    for custom, expected in (({}, 0.2), ({"replay_poll_interval_s": 0.05}, 0.05)):
        trainer.config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"custom": custom}}})
        assert trainer._build_replay_buffer().poll_interval == expected


@needs_verl_v1
def test_stream_granularity_note_maps_min_stream_batch_size_to_parameter_sync_step():
    from omegaconf import OmegaConf

    from trainer_plugin.verl_trainer import stream_granularity_note

    config = OmegaConf.create({"data": {"train_batch_size": 32}, "actor_rollout_ref": {"rollout": {
        "n": 4, "custom": {"min_stream_batch_size": 20}}}})
    note = stream_granularity_note(config, 1)
    assert "32 whole prompt groups (128 samples)" in note
    assert "parameter_sync_step=4 would match" in note  # 8 groups x 4 = 32 >= 20; at 8: 4 x 4 = 16 < 20


@needs_verl
async def test_proxy_never_hands_verl_an_unknown_version_and_standalone_pools_are_refused():
    from verl.workers.config import RolloutConfig

    from trainer_plugin.proxy import ManagerProxyServer
    from trainer_plugin.verl_rollout import DisaggregatedReplica

    versions = iter(["7", "not-a-number"])

    async def generate(request):  # a manager whose second answer carries a version verl cannot use
        return web.json_response({"output_ids": [4, 2], "meta_info": {
            "finish_reason": {"type": "length"}, "weight_version": next(versions)}})

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    server = ManagerProxyServer(f"http://127.0.0.1:{port}", prompt_length=4, response_length=2, batch_window_s=0)
    try:
        first = await server.generate([1], {}, "a")
        second = await server.generate([1], {}, "b")
        assert first.extra_fields["global_steps"] == 7
        # verl's _compute_metrics builds int arrays from these: the newest known version stands in
        assert [second.extra_fields[k] for k in ("global_steps", "min_global_steps", "max_global_steps")] == [7] * 3
        assert second.extra_fields["weight_version"] == "not-a-number"  # the manager's word is kept as is
    finally:
        await server.close()
        await runner.cleanup()

    replica = DisaggregatedReplica(replica_rank=0, config=RolloutConfig(name="sglang-disaggregated"),
                                   model_config=None, gpus_per_node=1)
    with pytest.raises(NotImplementedError, match="hybrid_engine=true"):
        await replica.init_standalone()


def test_replay_poll_interval_must_be_positive():
    assert from_rollout_config({"custom": {"replay_poll_interval_s": "0.5"}}).replay_poll_interval_s == 0.5
    with pytest.raises(SettingsError, match="replay_poll_interval_s must be > 0"):
        from_rollout_config({"custom": {"replay_poll_interval_s": 0}})
