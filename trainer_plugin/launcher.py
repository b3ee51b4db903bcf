"""Start the rollout manager next to the trainer (rank zero) and make sure it never outlives it.

``ManagerProcess(host, port, config_path).start()`` runs ``rollout-manager serve --bind HOST:PORT
[--config PATH]`` as a child process (as ``python -m rollout_manager serve``, the same command, so it
works whether or not the venv's ``bin/`` is on ``PATH``), waits until ``/health`` answers, and raises
:class:`ManagerStartError` with the tail of the manager's log when it exits early or misses the
deadline.

The child is stopped when the trainer exits, whatever the reason:

- normal exit and uncaught exceptions: an ``atexit`` hook;
- ``SIGTERM`` (and ``SIGHUP``) to the trainer: a handler that stops the manager, then hands the
  signal to the handler that was there before (or, if that was the default, re-raises it so the
  trainer still dies of it);
- ``SIGKILL`` of the trainer, or anything else that skips Python's shutdown: on Linux the child asks
  the kernel for ``PR_SET_PDEATHSIG = SIGTERM`` before it runs, so the kernel terminates it when its
  parent dies. The kernel ties that signal to the *thread* that forked the child, so every child is
  forked from one long-lived daemon thread of this module, never from a short-lived worker thread.

The child runs in its own process group (``start_new_session``): a Ctrl-C in the trainer's terminal
does not hit it directly, and stopping it stops anything it started.

Port already taken: if whatever listens there answers ``/health`` as a rollout manager, we *attach*
to it (``attached=True``): it is used but never stopped by us, and a warning says that its
configuration is its own (``config_path`` is not applied). ``attach_existing=False`` refuses
instead. Anything else on the port is refused with :class:`PortInUseError` naming what answered.
"""

from __future__ import annotations

import atexit
import errno
import http.client
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rollout_manager.osutil import die_with_parent_preexec, format_endpoint, port_is_bindable, url_host

log = logging.getLogger("trainer_plugin.launcher")


class ManagerStartError(RuntimeError):
    """The manager could not be started; the message carries the tail of its log."""


class PortInUseError(ManagerStartError):
    """Something that is not a rollout manager (or one we may not attach to) holds the port."""


# ---------------------------------------------------------------------------- probing
def probe_health(host: str, port: int, timeout_s: float = 2.0) -> tuple[str, Any]:
    """What answers on ``host:port``: ``("manager", health_json)``, ``("other", description)``, or
    ``("closed", None)`` when nothing accepts connections."""
    url = f"http://{url_host(host)}:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            raw = r.read(65536)
            status = r.status
    except urllib.error.HTTPError as exc:
        return "other", f"HTTP {exc.code} on GET /health"
    except http.client.HTTPException as exc:
        return "other", f"no valid HTTP answer on GET /health ({exc!r})"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, ConnectionRefusedError) or getattr(reason, "errno", None) == errno.ECONNREFUSED:
            return "closed", None
        return "other", f"no HTTP answer on GET /health ({reason})"
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "other", f"HTTP {status} with a non-JSON body on GET /health"
    if is_manager_health(body):
        return "manager", body
    return "other", f"HTTP {status} on GET /health with {str(body)[:200]}"


def is_manager_health(body: Any) -> bool:
    """A rollout manager's ``/health``: ``{"status": "healthy", "service": "rollout-manager", ...}``."""
    return isinstance(body, dict) and body.get("status") == "healthy" and body.get("service") == "rollout-manager"


# ---------------------------------------------------------------------------- spawning
class _Spawner:
    """Forks every child from one daemon thread that lives as long as the process.

    ``PR_SET_PDEATHSIG`` fires when the forking *thread* exits; forking from, say, a thread pool
    worker would kill the manager as soon as that worker is retired.
    """

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], queue.Queue[tuple[bool, Any]]]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], Any]) -> Any:
        if threading.current_thread() is threading.main_thread():
            return fn()  # the main thread lives as long as the process
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="rollout-manager-spawner", daemon=True)
                self._thread.start()
        reply: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=1)
        self._jobs.put((fn, reply))
        ok, value = reply.get()
        if not ok:
            raise value
        return value

    def _loop(self) -> None:
        while True:
            fn, reply = self._jobs.get()
            try:
                reply.put((True, fn()))
            except BaseException as exc:
                reply.put((False, exc))


_SPAWNER = _Spawner()


# ---------------------------------------------------------------------------- the process
class ManagerProcess:
    """A rollout manager started (or found) by the trainer.

    ``start()`` returns ``self``; ``url`` is where to reach it; ``stop()`` is idempotent. Also a
    context manager. ``python`` and ``extra_args`` exist for tests and unusual installs.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 5000,
        config_path: str | os.PathLike[str] | None = None,
        *,
        extra_args: Sequence[str] = (),
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout_s: float = 60.0,
        stop_timeout_s: float = 15.0,
        probe_timeout_s: float = 2.0,
        attach_existing: bool = True,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
    ):
        self.host = host
        self.port = int(port)
        self.config_path = os.fspath(config_path) if config_path else None
        self.extra_args = list(extra_args)
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self.attach_existing = attach_existing
        self.python = python
        self.env = env
        self.popen: subprocess.Popen[bytes] | None = None
        self.attached = False
        self.health: dict[str, Any] | None = None
        self._log_file: Any = None
        self._stopped = False

    # ------------------------------------------------------------ info
    @property
    def url(self) -> str:
        return f"http://{url_host(self.host)}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    @property
    def command(self) -> list[str]:
        cmd = [self.python, "-m", "rollout_manager", "serve", "--bind", format_endpoint(self.host, self.port)]
        if self.config_path:
            cmd += ["--config", self.config_path]
        return cmd + self.extra_args

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:]) or "(log is empty)"

    # ------------------------------------------------------------ start
    def __enter__(self) -> ManagerProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> ManagerProcess:
        if self.popen is not None or self.attached:
            return self
        kind, what = probe_health(self.host, self.port, timeout_s=self.probe_timeout_s)
        if kind == "manager":
            if not self.attach_existing:
                raise PortInUseError(
                    f"a rollout manager (version {what.get('version')}) is already listening on "
                    f"{self.host}:{self.port} and attaching to it is disabled; stop it or pick another port"
                )
            self.attached, self.health = True, what
            log.warning(
                "a rollout manager is already listening on %s (version %s, instances %s): attaching to it. "
                "It was not started by this trainer, keeps its own configuration%s and will not be stopped "
                "when the trainer exits.", self.url, what.get("version"), what.get("instances"),
                f" ({self.config_path} is NOT applied)" if self.config_path else "")
            return self
        if kind == "other" or not port_is_bindable(self.host, self.port):
            why = what if kind == "other" else "it does not accept HTTP connections"
            raise PortInUseError(
                f"cannot start the rollout manager on {self.host}:{self.port}: the port is already in use "
                f"by something that is not a rollout manager ({why}); free the port or set "
                f"actor_rollout_ref.rollout.custom.rollout_manager.port to another one"
            )
        popen = self._spawn()
        _register(self)
        try:
            self._wait_healthy(popen)
        except BaseException:
            self.stop()
            raise
        log.info("rollout manager started: pid %d, %s, log %s", popen.pid, self.url, self.log_path)
        return self

    def _spawn(self) -> subprocess.Popen[bytes]:
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"rollout-manager-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")
        env = {**os.environ, **(self.env or {})}
        preexec = die_with_parent_preexec()
        cmd = self.command

        def spawn() -> subprocess.Popen[bytes]:
            return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log_file,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                    preexec_fn=preexec, close_fds=True)

        try:
            popen: subprocess.Popen[bytes] = _SPAWNER.run(spawn)
        except OSError as exc:
            raise ManagerStartError(f"cannot run {' '.join(cmd)}: {exc}") from exc
        self.popen = popen
        return popen

    def _wait_healthy(self, popen: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        last = "no answer yet"
        while True:
            code = popen.poll()
            if code is not None:
                raise ManagerStartError(
                    f"the rollout manager exited with code {code} during start-up "
                    f"({' '.join(self.command)}); last lines of {self.log_path}:\n{self.log_tail()}"
                )
            kind, what = probe_health(self.host, self.port, timeout_s=1.0)
            if kind == "manager":
                self.health = what
                return
            if kind == "other":
                last = what
            if time.monotonic() >= deadline:
                raise ManagerStartError(
                    f"the rollout manager did not answer GET /health on {self.url} within "
                    f"{self.startup_timeout_s:g}s (last: {last}); last lines of {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.1)

    # ------------------------------------------------------------ stop
    def stop(self) -> int | None:
        """Stop a manager we started (SIGTERM to its group, SIGKILL after ``stop_timeout_s``)."""
        if self._stopped:
            return self.popen.returncode if self.popen else None
        self._stopped = True
        _unregister(self)
        if self.popen is None:  # attached, or never started: not ours to stop
            return None
        if self.popen.poll() is None:
            _signal_group(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("rollout manager pid %d ignored SIGTERM for %gs; killing it",
                            self.popen.pid, self.stop_timeout_s)
        # whatever is left in its group (it may have started helpers)
        _signal_group(self.popen.pid, signal.SIGKILL)
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass
        if self._log_file is not None:
            self._log_file.close()
        return self.popen.returncode


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def start_manager(host: str = "127.0.0.1", port: int = 5000, config_path: str | None = None,
                  **kwargs: Any) -> ManagerProcess:
    """Shortcut: ``ManagerProcess(...).start()``."""
    return ManagerProcess(host, port, config_path, **kwargs).start()


# ---------------------------------------------------------------------------- exit hooks
_LIVE: weakref.WeakSet[ManagerProcess] = weakref.WeakSet()
_LIVE_STRONG: list[ManagerProcess] = []  # keep started managers alive until stopped
_HOOKS_LOCK = threading.Lock()
_HOOKS_INSTALLED = False
_PREVIOUS: dict[int, Any] = {}
_EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _register(proc: ManagerProcess) -> None:
    _install_exit_hooks()
    with _HOOKS_LOCK:
        _LIVE.add(proc)
        _LIVE_STRONG.append(proc)


def _unregister(proc: ManagerProcess) -> None:
    with _HOOKS_LOCK:
        _LIVE.discard(proc)
        if proc in _LIVE_STRONG:
            _LIVE_STRONG.remove(proc)


def stop_all() -> None:
    """Stop every manager this process started (the exit hooks call this)."""
    with _HOOKS_LOCK:
        procs = list(_LIVE_STRONG)
    for proc in procs:
        try:
            proc.stop()
        except Exception:
            log.exception("could not stop the rollout manager on %s", proc.url)


def _install_exit_hooks() -> None:
    global _HOOKS_INSTALLED
    with _HOOKS_LOCK:
        if _HOOKS_INSTALLED:
            return
        _HOOKS_INSTALLED = True
    atexit.register(stop_all)
    if threading.current_thread() is not threading.main_thread():
        # signal handlers can only be set from the main thread; PDEATHSIG still covers signals
        log.debug("not in the main thread: relying on atexit and PR_SET_PDEATHSIG only")
        return
    for sig in _EXIT_SIGNALS:
        previous = signal.getsignal(sig)
        if previous is signal.SIG_IGN:
            continue  # the trainer chose to survive this signal; so does its manager
        _PREVIOUS[sig] = previous
        signal.signal(sig, _on_exit_signal)


def _on_exit_signal(signum: int, frame: Any) -> None:
    stop_all()
    previous = _PREVIOUS.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
        return
    # default action: die of the same signal, as if we had never been here
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
