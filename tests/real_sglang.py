"""Real SGLang 0.5.23 on CPU as a test engine (tests marked ``real_sglang``; installed by scripts/install.sh).

Stable API (other test modules build on it; change only by adding):

- ``SGLANG_PY``: .venv-sglang's interpreter (scripts/sglang_cpu/install.sh makes it).
- ``CPU_FLAGS``: the SGLang flags that make it serve on CPU (device, torch_native attention, float32,
  a small KV pool, ``--sleep-on-idle``).
- ``make_tiny_model(dest, arch="llama")``: the tiny random model and its locally trained tokenizer
  (tests/real_sglang_model.py), written once per ``dest``.
- ``start_manager(log_dir, **settings) -> Daemon``: a rollout manager on a free loopback port.
- ``start_box(model_dir, manager_url, log_dir, *sglang_flags, deterministic=False, name="box",
  launcher_flags=()) -> RealBox``:
  real SGLang plus the receiver agent, started THROUGH ``scripts/launch_sglang.sh --engine sglang`` on free
  loopback ports (this checkout's scripts/sglang_cpu/ first on the path, as for ``start_sglang``), registered
  with the manager; returns once the manager reports it active.
  ``RealBox.url`` is SGLang's own URL, ``.endpoint`` the manager's name for it, ``.agent_url`` the receiver
  agent; ``.stop()`` tears everything down (SIGTERM to the launcher, then SIGKILL to every process it left,
  torch_shm_manager included); ``.kill_sglang()`` SIGKILLs the SGLang server's process group (a dead box).
- ``start_boxes(model_dir, manager_url, log_dir, names, ...) -> list[RealBox]``: several at once (their
  starts overlap), the same otherwise.
- Fixtures (registered in tests/conftest.py): ``real_sglang_model`` (session: the model dir) and
  ``real_sglang`` (module: ``RealSGLang(manager, box, model_dir)``, one manager and one box per test module).
- ``make_tiny_moe(dest)``: the tiny Qwen3-MoE (``MOE_EXPERTS`` experts, ``MOE_TOP_K`` per token,
  ``MOE_LAYERS`` layers; tests/real_sglang_model.py), written once per ``dest``.
- ``start_sglang(model_dir, log_dir, *sglang_flags, name="sglang") -> SGLangServer``: real SGLang alone (no
  launcher, no agent, no manager) on a free loopback port, returned once ``/health_generate`` answers 200;
  this checkout's scripts/sglang_cpu/ first on its path, so its hook serves ``--enable-return-routed-experts``
  (routed-expert capture) whichever copy the venv holds. ``.stop()`` kills its process group.

Every process that imports SGLang gets ``SGLANG_USE_CPU_ENGINE=1`` (its CPU path) and ``OMP_NUM_THREADS=1``
(with SGLang's ``--sleep-on-idle``: otherwise each idle server spins every core and two servers starve a
2-core machine).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support import PY, ROOT, OnLoopback, Proc, alive, descendants, free_port, quiet_port, wait_http_ok_sync, wait_until

SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
LAUNCHER = ROOT / "scripts" / "launch_sglang.sh"
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
             "--disable-cuda-graph", "--mem-fraction-static", "0.05", "--max-total-tokens", "8192",
             "--dtype", "float32", "--sleep-on-idle", "--log-level", "warning")
SGLANG_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1", "MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2"}
START_TIMEOUT_S = 240.0  # ~17 s alone on 2 cores; far longer while other suites load the machine
HOOK_DIR = ROOT / "scripts" / "sglang_cpu"


def _with_hook(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this checkout's scripts/sglang_cpu/ first on PYTHONPATH: its hook (routed-expert capture
    included) is the one SGLang imports, whichever copy .venv-sglang holds."""
    path = os.pathsep.join(p for p in (str(HOOK_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": path}


def require_sglang_venv() -> None:
    if not SGLANG_PY.exists():
        pytest.fail(f"{SGLANG_PY} is missing: run scripts/install.sh (or scripts/sglang_cpu/install.sh)")


def make_tiny_model(dest: Path, arch: str = "llama") -> Path:
    """The tiny model (Llama by default: SGLang's /get_weights_by_name reads Llama weights, not Qwen2's)."""
    if not (dest / "model.safetensors").exists():
        require_sglang_venv()
        subprocess.run([str(SGLANG_PY), str(ROOT / "tests" / "real_sglang_model.py"), str(dest), arch],
                       check=True, capture_output=True, timeout=300, env={**os.environ, **SGLANG_ENV})
    return dest


@dataclass
class Daemon:
    url: str
    proc: Proc

    def stop(self) -> None:
        self.proc.stop()


def start_manager(log_dir: Path, **settings: Any) -> Daemon:
    port = free_port()
    args = [PY, "-m", "rollout_manager", "serve", "--bind", f"127.0.0.1:{port}"]
    for key, value in {"pending_poll_interval_s": "0.2", "health_check_interval_s": "0.5", **settings}.items():
        args += ["--set", f"{key}={value}"]
    proc = Proc(args, log_dir / f"manager-{port}.log")
    try:
        wait_http_ok_sync(f"http://127.0.0.1:{port}/health", proc)
    except BaseException:
        proc.stop()
        raise
    return Daemon(f"http://127.0.0.1:{port}", proc)


@dataclass
class RealBox(OnLoopback):
    launcher: Proc
    port: int
    agent_port: int
    manager_url: str

    @property
    def agent_url(self) -> str:
        return f"http://127.0.0.1:{self.agent_port}"

    def log(self) -> str:
        return self.launcher.log()

    def sglang_pid(self) -> int:
        """The SGLang server's main process (listening on .port)."""
        for pid in descendants(self.launcher.pid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"sglang.launch_server" in cmd and str(self.port).encode() in cmd:
                return pid
        raise AssertionError(f"no SGLang process under launcher {self.launcher.pid}")

    def kill_sglang(self) -> None:
        """SIGKILL the SGLang server and its scheduler/detokenizer (its own process group): a box that dies."""
        pid = self.sglang_pid()
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the launcher (it deregisters and stops its children), then SIGKILL whatever is left:
        the launcher's descendants, torch_shm_manager among them (it holds inherited stdout open)."""
        left = descendants(self.launcher.pid)
        self.launcher.signal(signal.SIGTERM)
        try:
            self.launcher.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        left |= {p for p in list(left) for p in descendants(p)}
        for pid in left:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.launcher.stop()


def _launch(model_dir: Path, manager_url: str, log_dir: Path, sglang_flags: tuple[str, ...], deterministic: bool,
            name: str, launcher_flags: tuple[str, ...]) -> RealBox:
    # SGLang binds its port only once the model is loaded: out of the kernel's ephemeral range, and never
    # one handed to another box of this run (quiet_port remembers what it gave)
    port, agent_port = quiet_port(), quiet_port()
    args = ["bash", str(LAUNCHER), "--engine", "sglang", "--model-path", str(model_dir), "--manager-addr", manager_url,
            "--host", "127.0.0.1", "--port", str(port), "--transfer-agent-handshake-port", str(agent_port),
            "--python", str(SGLANG_PY), "--ready-timeout-s", str(int(START_TIMEOUT_S)), "--drain-timeout-s", "5",
            "--stop-timeout-s", "10", *(("--deterministic",) if deterministic else ()), *launcher_flags,
            "--", *CPU_FLAGS, *sglang_flags]
    return RealBox(Proc(args, log_dir / f"{name}-{port}.log", env=_with_hook(SGLANG_ENV)), port, agent_port,
                   manager_url)


def start_boxes(model_dir: Path, manager_url: str, log_dir: Path, names: list[str], *sglang_flags: str,
                deterministic: bool = False, launcher_flags: tuple[str, ...] = ()) -> list[RealBox]:
    """Several boxes started at once (their starts overlap); returns once the manager reports all active."""
    require_sglang_venv()
    boxes: list[RealBox] = []
    try:
        for name in names:
            boxes.append(_launch(model_dir, manager_url, log_dir, sglang_flags, deterministic, name, launcher_flags))
        for box in boxes:
            wait_until(lambda box=box: _active(box), START_TIMEOUT_S, interval_s=0.5,
                       message=lambda box=box: f"{box.endpoint} active in the manager; launcher log:\n"
                                               f"{box.log()[-6000:]}")
    except BaseException:
        for box in boxes:
            box.stop()
        raise
    return boxes


def start_box(model_dir: Path, manager_url: str, log_dir: Path, *sglang_flags: str, deterministic: bool = False,
              name: str = "box", launcher_flags: tuple[str, ...] = ()) -> RealBox:
    """Real SGLang with the receiver agent, through scripts/launch_sglang.sh; returns once it serves and the
    manager reports it active."""
    return start_boxes(model_dir, manager_url, log_dir, [name], *sglang_flags, deterministic=deterministic,
                       launcher_flags=launcher_flags)[0]


def _active(box: RealBox) -> bool:
    import json
    import urllib.request

    if box.launcher.popen.poll() is not None:
        raise AssertionError(f"launch_sglang.sh exited with {box.launcher.popen.returncode}:\n{box.log()[-6000:]}")
    try:
        with urllib.request.urlopen(box.manager_url + "/get_instances_status", timeout=5) as r:
            status = json.loads(r.read())
    except OSError:
        return False
    return any(i["endpoint"] == box.endpoint and i["state"] == "active" for i in status["instances"])


@dataclass
class PushFleet:
    """A manager that takes weight pushes over Mooncake from a sender agent the test runs on
    ``sender_port``, and real SGLang boxes registered with it."""

    manager: Daemon
    boxes: list[RealBox]
    model_dir: Path
    sender_port: int


@contextlib.contextmanager
def push_fleet(model_dir: Path, log_dir: Path, names: list[str], *sglang_flags: str,
               **settings: str) -> Iterator[PushFleet]:
    """:class:`PushFleet` with ``settings`` for the manager (on top of Mooncake pushes from 127.0.0.0/8 with
    half-second retries); everything stopped at the end, boxes first."""
    sender_port = free_port()
    manager = start_manager(log_dir, **{"weight_sender_base_port": str(sender_port),
                                        "allowed_sender_ips": "127.0.0.0/8", "weight_transport": "mooncake",
                                        "weight_push_retry_s": "0.5", **settings})
    try:
        boxes = start_boxes(model_dir, manager.url, log_dir, names, *sglang_flags)
        try:
            yield PushFleet(manager, boxes, model_dir, sender_port)
        finally:
            for box in boxes:
                box.stop()
    finally:
        manager.stop()


@dataclass
class RealSGLang:
    manager: Daemon
    box: RealBox
    model_dir: Path
    start_s: float = 0.0  # launcher start to active in the manager


def start_real_sglang(model_dir: Path, log_dir: Path) -> RealSGLang:
    manager = start_manager(log_dir)
    started = time.monotonic()
    try:
        box = start_box(model_dir, manager.url, log_dir)
    except BaseException:
        manager.stop()
        raise
    return RealSGLang(manager, box, model_dir, time.monotonic() - started)


@pytest.fixture(scope="session")
def real_sglang_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.getbasetemp() / "real_sglang_model")


@pytest.fixture(scope="module")
def real_sglang(real_sglang_model: Path, tmp_path_factory: pytest.TempPathFactory):
    env = start_real_sglang(real_sglang_model, tmp_path_factory.mktemp("real_sglang"))
    try:
        yield env
    finally:
        env.box.stop()
        env.manager.stop()


# ------------------------------------------------------------------ MoE and SGLang alone

MOE_EXPERTS, MOE_TOP_K, MOE_LAYERS = 8, 2, 2  # tests/real_sglang_model.py's qwen3_moe


def make_tiny_moe(dest: Path) -> Path:
    return make_tiny_model(dest, "qwen3_moe")


@dataclass
class SGLangServer(OnLoopback):
    port: int
    proc: Proc

    def log(self) -> str:
        return self.proc.log()

    def stop(self) -> None:
        self.proc.stop()  # SIGKILL to its process group: the scheduler and detokenizer too


def start_sglang(model_dir: Path, log_dir: Path, *sglang_flags: str, name: str = "sglang") -> SGLangServer:
    """Real SGLang alone on a quiet loopback port; returns once a generation went through."""
    import urllib.request

    require_sglang_venv()
    port = quiet_port()
    args = [str(SGLANG_PY), "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), *CPU_FLAGS, *sglang_flags]
    server = SGLangServer(port, Proc(args, log_dir / f"{name}-{port}.log", env=_with_hook(SGLANG_ENV)))

    def ready() -> bool:
        if server.proc.popen.poll() is not None:
            raise AssertionError(f"SGLang exited with {server.proc.popen.returncode}:\n{server.log()[-6000:]}")
        try:
            with urllib.request.urlopen(server.url + "/health_generate", timeout=10) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    try:
        wait_until(ready, START_TIMEOUT_S, interval_s=0.5, message=lambda: f"SGLang on {server.url}")
    except BaseException:
        server.stop()
        raise
    return server


def start_cpu_engine(log_dir: Path, *flags: str) -> tuple[str, Proc]:
    """A CPU engine beside a real SGLang box, for the differential tests: the same requests go to both. 2 ms a
    token, so a long request is still running when a test acts on it, as on real SGLang (~1.5 ms)."""
    port = free_port()
    proc = Proc([PY, "-m", "rollout_manager.cpu_engine", "--port", str(port), "--seed", "0", "--token-delay-s",
                 "0.002", *flags], log_dir / f"cpu-engine-{port}.log")
    try:
        wait_http_ok_sync(f"http://127.0.0.1:{port}/health", proc)
    except BaseException:
        proc.stop()
        raise
    return f"http://127.0.0.1:{port}", proc


async def call(s: Any, url: str, path: str, body: Any) -> tuple[int, Any]:
    """POST ``body`` as JSON to ``url + path`` (an aiohttp session ``s``): the status and the decoded answer,
    or its text when it is not JSON (SGLang answers some refusals in plain text)."""
    async with s.post(url + path, json=body) as r:
        text = await r.text()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text
