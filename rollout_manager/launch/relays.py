"""``rollout-manager serve`` with ``relays = N``: one control process and N relays on this machine, each
started again when it dies (docs/relays.md).

The control process listens on 127.0.0.1 only; the relays share the configured ``bind`` (SO_REUSEPORT, so
callers see one address) and each also listens on a private 127.0.0.1 port (relay 0's holds the OpenAI
front for the others). All of them get the same run id, so a process started again is the same manager to
the boxes and to the trainer: nobody registers again or resubmits because one process was replaced.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from rollout_manager.config import Config
from rollout_manager.osutil import die_with_parent_preexec, format_endpoint, free_port, url_host

log = logging.getLogger("rollout_manager.launch.relays")

RESTART_DELAY_S = (0.2, 5.0)  # a process that keeps dying is started again at most this often, doubling
STOP_GRACE_EXTRA_S = 15.0  # beyond shutdown_grace_s, before a child that does not stop is killed
POLL_S = 0.2


@dataclass
class Supervised:
    """One process the supervisor keeps running."""

    name: str
    args: list[str]
    popen: subprocess.Popen[bytes] | None = None
    starts: int = 0
    delay_s: float = RESTART_DELAY_S[0]
    next_start: float = 0.0
    started_at: float = 0.0

    def start(self) -> None:
        self.popen = subprocess.Popen(self.args, preexec_fn=die_with_parent_preexec())
        self.starts += 1
        self.started_at = time.monotonic()
        if self.starts > 1:
            log.warning("%s started again (start %d, pid %d)", self.name, self.starts, self.popen.pid)

    def exited(self) -> int | None:
        return None if self.popen is None else self.popen.poll()


def children(config: Config, serve_args: Sequence[str]) -> list[Supervised]:
    """The control process and the relays, with their addresses and the run id they share."""
    run_id = uuid.uuid4().hex
    host, port = config.bind_host, config.bind_port or free_port(url_host(config.bind_host).strip("[]"))
    control = f"127.0.0.1:{free_port()}"
    private = [f"127.0.0.1:{free_port()}" for _ in range(config.relays)]
    base = [sys.executable, "-m", "rollout_manager", "serve", *serve_args, "--run-id", run_id]
    out = [Supervised("control process", [*base, "--role", "control", "--bind", control])]
    for i in range(config.relays):
        out.append(Supervised(f"relay {i}", [
            *base, "--role", "relay", "--bind", format_endpoint(host, port), "--relay-index", str(i),
            "--relay-private", private[i], "--control-url", f"http://{control}",
            *(["--front-url", f"http://{private[0]}"] if i else [])]))
    return out


def supervise(config: Config, serve_args: Sequence[str]) -> int:
    """Run the control process and the relays until SIGINT/SIGTERM/SIGHUP; then stop the relays (they finish
    what they run, up to ``shutdown_grace_s``) and the control process. Returns the exit status."""
    procs = children(config, serve_args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    log.info("starting a control process and %d relay(s)", config.relays)
    for child in procs:
        child.start()
    while not stop.wait(POLL_S):
        now = time.monotonic()
        for child in procs:
            code = child.exited()
            if code is None:
                continue
            if child.next_start <= child.started_at:  # an exit not seen before: start it again after a pause
                lived = now - child.started_at
                child.delay_s = RESTART_DELAY_S[0] if lived > 30 else min(child.delay_s * 2, RESTART_DELAY_S[1])
                child.next_start = now + child.delay_s
                log.warning("%s exited with %s after %.1fs; starting it again in %.1fs", child.name, code, lived,
                            child.delay_s)
            elif now >= child.next_start:
                child.start()
    _stop([c for c in procs[1:]], config.shutdown_grace_s + STOP_GRACE_EXTRA_S)
    _stop(procs[:1], STOP_GRACE_EXTRA_S)
    return 0


def _stop(procs: Sequence[Supervised], grace_s: float) -> None:
    running = [c for c in procs if c.popen is not None and c.popen.poll() is None]
    for child in running:
        assert child.popen is not None
        child.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in running:
        assert child.popen is not None
        try:
            child.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %gs: killed", child.name, grace_s)
            os.kill(child.popen.pid, signal.SIGKILL)
            child.popen.wait()
