"""The rollout box's own steps before and beside serving: where it is, whether it can start, when it is up.

``detect-host``, ``preflight`` (modules, ports, a healthy manager), ``exec`` and ``wait-ready`` of
``python -m rollout_manager.launch.box``: checks and process handling on the box itself, kept apart from
the registration lifecycle (``box_registration``) so each reads on its own. Standard library only.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

from rollout_manager.launch.box_common import (
    BoxError,
    NotHealthy,
    Unreachable,
    fail,
    manager_health,
    normalize_addr,
    request,
    say,
)
from rollout_manager.manager_client import ManagerAPIError, ManagerHealth
from rollout_manager.osutil import die_with_parent, host_port, source_address_toward
from rollout_manager.retry import Backoff, retry

# ---------------------------------------------------------------- addresses


def detect_host(manager: str) -> str:
    """The local address the kernel would use to reach the manager (nothing is sent)."""
    addr = normalize_addr(manager)
    host, port = host_port(addr)
    try:
        return source_address_toward(addr)
    except socket.gaierror as exc:
        raise BoxError(f"cannot resolve the manager's host {host!r}: {exc.strerror}; pass --host") from None
    except OSError as exc:
        raise BoxError(f"no route from this box to the manager at {host}:{port} ({exc}); pass --host") from None


# ---------------------------------------------------------------- ports


def port_in_use(bind: str, port: int) -> str | None:
    """None when ``bind:port`` can be listened on (as SGLang and aiohttp do, with SO_REUSEADDR, so a
    socket in TIME_WAIT does not count), else the reason."""
    try:
        infos = socket.getaddrinfo(bind or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve {bind!r}: {exc.strerror}"
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(sockaddr)
            s.listen(1)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "already in use"
            if exc.errno == errno.EADDRNOTAVAIL:
                return f"{bind} is not an address of this box"
            return exc.strerror or str(exc)
    return None


def check_ports(bind: str, ports: Sequence[tuple[str, int]]) -> None:
    seen: dict[int, str] = {}
    for what, port in ports:
        if not 1 <= port <= 65535:
            raise BoxError(f"{what} {port} is out of range 1-65535")
        if port in seen:
            raise BoxError(f"{what} and {seen[port]} are both {port}; they must differ")
        seen[port] = what
    for what, port in ports:
        reason = port_in_use(bind, port)
        if reason:
            raise BoxError(f"port {port} on {bind} ({what}) is {reason}; each instance on a box needs its own "
                           f"ports: pick another --port / --transfer-agent-handshake-port")


# ---------------------------------------------------------------- commands


def check_modules(modules: Sequence[str]) -> None:
    """Find (without importing: torch alone takes seconds) what the children will import."""
    import importlib.util

    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    if missing:
        hint = {"sglang": "pip install 'sglang>=0.5.23'", "mooncake": "pip install mooncake-transfer-engine "
                "(mooncake-transfer-engine-non-cuda on CPU boxes)"}
        how = "; ".join(hint.get(m, f"pip install {m}") for m in missing)
        raise BoxError(f"{sys.executable} cannot import {', '.join(missing)} ({how}; or pick the right "
                       f"interpreter with --python / PYTHON)")


def wait_for_manager(manager: str, timeout: float, wait_s: float) -> ManagerHealth:
    """``GET /health`` until it answers healthy, for up to ``wait_s`` seconds (0: one try). A refused
    token is final at once: waiting cannot fix it."""
    def waiting(attempt: int, sleep_s: float, outcome: object) -> None:
        if attempt == 1:
            die_with_parent()  # a launcher killed meanwhile (no trap runs yet) must not leave us waiting
            say(f"waiting up to {wait_s:g}s for the rollout manager at {normalize_addr(manager)} "
                f"(--wait-for-manager)")

    try:
        return retry(lambda: manager_health(manager, timeout), Backoff(0.5, 0.5, deadline_s=wait_s),
                     retry_on=(Unreachable, NotHealthy), on_retry=waiting)
    except (Unreachable, NotHealthy) as exc:
        if wait_s > 0:
            raise BoxError(f"{exc} (waited {wait_s:g}s: --wait-for-manager)") from None
        raise


def cmd_preflight(args: argparse.Namespace) -> None:
    check_modules([m for m in args.modules.split(",") if m])
    check_ports(args.bind, [("--port (SGLang)", args.port),
                            ("--transfer-agent-handshake-port (receiver agent)", args.agent_port)])
    health = wait_for_manager(args.manager, args.timeout, args.wait_for_manager)
    print(json.dumps({"manager": normalize_addr(args.manager), "version": health.version,
                      "weight_version": health.weight_version}))


def cmd_exec(args: argparse.Namespace) -> NoReturn:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        fail("exec: no command given", 2)
    os.setpgid(0, 0)
    if not die_with_parent(args.parent_pid or None):  # the launcher is gone already
        fail(f"exec: parent {args.parent_pid} is gone; not starting {command[0]}")
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        fail(f"cannot run {command[0]!r}: {exc.strerror}", 127)


def _alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)  # only works for our own children
        return done == 0
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (dead, not yet reaped by its parent) counts as gone
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def cmd_wait_ready(args: argparse.Namespace) -> None:
    names = dict(zip(args.pid, args.pid_name or [])) if args.pid else {}
    deadline = time.monotonic() + args.timeout
    with_token = set(args.auth_url or [])
    pending = list(args.url) + list(args.auth_url or [])
    while pending:
        for pid in args.pid or []:
            if not _alive(pid):
                fail(f"{names.get(pid, f'process {pid}')} exited before it was ready (see its log above)")
        still = []
        for url in pending:
            try:
                status = request("GET", url, timeout=min(5.0, args.interval * 10), auth=url in with_token).status
            except ManagerAPIError:
                status = 0
            if status != 200:
                still.append(url)
        pending = still
        if not pending:
            break
        if time.monotonic() >= deadline:
            fail(f"not ready after {args.timeout:g}s: {', '.join(pending)} did not answer 200 "
                 f"(raise --ready-timeout-s if the model loads slowly)")
        time.sleep(args.interval)
