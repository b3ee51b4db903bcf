"""Rollout-box helper for ``scripts/launch_sglang.sh``: the fiddly parts, kept testable and out of bash.

``python -m rollout_manager.launch.box <command> ...``; standard library only, so it runs in SGLang's
environment before anything heavy is imported. Every failure is ONE line on stderr,
``launch_sglang: error: ...``, and a non-zero exit status; results go to stdout.

Commands:

- ``normalize-addr ADDR``: ``1.2.3.4:5000`` -> ``http://1.2.3.4:5000`` (no trailing slash).
- ``detect-host --manager ADDR``: this box's address on the route to the manager (a UDP ``connect``
  sends nothing; the kernel picks the source address of the route).
- ``preflight --manager ADDR --bind H --port P --agent-port A [--wait-for-manager S]``: both ports
  distinct and free, the manager answers ``GET /health`` (waiting up to S seconds for it: boxes and
  trainer often start together); all before anything heavy starts.
- ``exec --parent-pid PID -- CMD ...``: run CMD in its own process group (a terminal's Ctrl-C reaches
  only the launcher, which drains first) that gets SIGTERM if the launcher dies (Linux
  ``PR_SET_PDEATHSIG``), so a killed launcher leaves nothing behind.
- ``wait-ready --url U ... [--auth-url U ...] --pid P ... --timeout S``: until every URL answers 200
  (``--auth-url`` ones asked with the shared token: the receiver agent requires it when one is set);
  fails at once when a watched process exits, or at the deadline.
- ``register --manager ADDR --host H --port P --agent-url URL``: reads the receiver agent's
  ``/info`` (``handshake_port``: Mooncake's RPC port, chosen by Mooncake), registers, prints the
  endpoint the manager files the instance under. A stale registration of the same endpoint (a box
  restarted on the same address) is removed first.
- ``deregister --manager ADDR --endpoint E --timeout S [--state-file F]``: ``POST /shutdown_instances``
  (the manager drains it: no new work, in-flight requests finish), with the box token from F.
- ``watch --manager ADDR --state-file F --interval S``: runs beside the children while the box serves.
  Every S seconds it reads the manager's ``GET /health``; when its ``run_id`` differs from the one
  ``register --state-file F`` saw (the manager restarted and lost its registry) it registers again
  with the same body. Only a new run id does that: an instance an admin removed with
  ``/shutdown_instances`` (same run id, endpoint gone from ``/get_instances_status``) is left out,
  with one log line. While the manager is unreachable the box keeps serving; one line when it goes
  away, one when it is back.

``ROLLOUT_MANAGER_AUTH_TOKEN``, when set, is sent as ``Authorization: Bearer <token>`` on every call
to the manager but one: deregistration uses the box token the registration answer carried (kept in
the state file, renewed by ``watch`` when it registers again), which removes this instance and no
other. From a manager that issues none (or no longer knows it: 401), the shared token is used.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import sys
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any, NoReturn

from rollout_manager.launch.model_config import model_vocab_size
from rollout_manager.manager_client import (
    HTTPAnswer,
    ManagerAPI,
    ManagerAPIError,
    ManagerHealth,
    Registration,
    env_token,
    error_message,
    http_call,
)
from rollout_manager.osutil import die_with_parent, format_endpoint, host_port, source_address_toward
from rollout_manager.retry import Backoff, retry
from rollout_manager.sglang import wire  # standard library only at import time
from rollout_manager.sglang.auth import SGLangAuth  # standard library only

PREFIX = "launch_sglang: error: "


class BoxError(Exception):
    """A failure the user must act on; its message is the one line they see."""


class Unreachable(BoxError):
    def __init__(self, message: str, timed_out: bool):
        super().__init__(message)
        self.timed_out = timed_out


class NotHealthy(BoxError):
    """The manager answers, but not (yet) healthy."""


def fail(message: str, code: int = 1) -> NoReturn:
    print(PREFIX + " ".join(message.split()), file=sys.stderr, flush=True)
    raise SystemExit(code)


# ---------------------------------------------------------------- addresses


def normalize_addr(addr: str) -> str:
    """``host:port`` or ``http(s)://host:port[/]`` -> ``http(s)://host:port``."""
    addr = addr.strip()
    if not addr:
        raise BoxError("no manager address: set ROLLOUT_MANAGER_ADDR=http://<ip>:<port> or pass --manager-addr")
    if "://" not in addr:
        addr = "http://" + addr
    try:
        parsed = urllib.parse.urlsplit(addr)
    except ValueError:  # an unclosed "[" around an IPv6 address
        raise BoxError(f"manager address {addr!r} is not http://<ip>:<port>") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise BoxError(f"manager address {addr!r} is not http://<ip>:<port>")
    try:
        _ = parsed.port  # parsed lazily: a bad one raises here
    except ValueError:
        raise BoxError(f"manager address {addr!r} has a bad port") from None
    return addr.rstrip("/")


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


def url_of(host: str, port: int) -> str:
    return f"http://{format_endpoint(host, port)}"


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


# ---------------------------------------------------------------- HTTP


def request(method: str, url: str, body: Any = None, *, timeout: float = 10.0, auth: bool = True) -> HTTPAnswer:
    """A call to one of this box's own servers (the agent, SGLang), with the shared token when ``auth``;
    raises :class:`ManagerAPIError` when nothing answers over HTTP."""
    return http_call(method, url, body, timeout_s=timeout, token=env_token() if auth else None)


def manager_call(manager: str, method: str, path: str, body: Any = None, *,
                 timeout: float = 10.0, token: str | None = None) -> HTTPAnswer:
    """One call to the manager's API (``token``: a box token instead of the shared one)."""
    api = ManagerAPI(normalize_addr(manager), env_token(), timeout)
    try:
        answer = api.call(method, path, body, token=token)
    except ManagerAPIError as exc:
        raise Unreachable(f"rollout manager at {api.url} is unreachable ({method} {path}: {exc.reason}); "
                          f"check ROLLOUT_MANAGER_ADDR / --manager-addr", exc.timed_out) from None
    if answer.status in (401, 403) and token is None:  # a box token's refusal is the caller's to read
        hint = "set ROLLOUT_MANAGER_AUTH_TOKEN to the manager's token" if not api.token \
            else "ROLLOUT_MANAGER_AUTH_TOKEN does not match the manager's token"
        raise BoxError(f"rollout manager at {api.url} refused {method} {path} (HTTP {answer.status}): {hint}")
    return answer


def manager_health(manager: str, timeout: float = 5.0) -> ManagerHealth:
    answer = manager_call(manager, "GET", "/health", timeout=timeout)
    health = ManagerHealth.from_json(answer.body)
    if answer.status != 200 or not health.healthy:
        raise NotHealthy(f"rollout manager at {normalize_addr(manager)} is not healthy (GET /health: "
                         f"HTTP {answer.status} {error_message(answer.body)}); check ROLLOUT_MANAGER_ADDR / "
                         f"--manager-addr")
    return health


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


def agent_info(agent_url: str, timeout: float = 10.0) -> dict[str, Any]:
    try:
        # the agent requires the shared token, as the manager does, when one is set
        status, info = request("GET", agent_url.rstrip("/") + "/info", timeout=timeout).status_body
    except ManagerAPIError as exc:
        raise BoxError(f"receiver agent at {agent_url} does not answer /info: {exc.reason}") from None
    if status != 200 or not isinstance(info, dict) or not isinstance(info.get("handshake_port"), int):
        raise BoxError(f"receiver agent at {agent_url} gave no handshake_port in /info: HTTP {status} {info}")
    return info


def check_parallelism(sglang_url: str, endpoint: str, timeout: float = 10.0) -> None:
    """Refuse a data-parallel SGLang before registering it: it could never take a weight push. An
    unreadable ``/server_info`` is left to the manager (it checks again when the instance is ready)."""
    try:
        key = SGLangAuth.from_env().api_key  # SGLang's --api-key, when it runs with one (launch_sglang.sh)
        status, answer = http_call("GET", sglang_url.rstrip("/") + wire.SERVER_INFO, None, timeout_s=timeout,
                                   token=key or None).status_body
    except ManagerAPIError:
        return
    info = wire.ServerInfo.from_json(answer if status == 200 else None)
    if info.dp_size > 1:
        raise BoxError(wire.dp_refusal(endpoint, info.dp_size))


def register_with_retry(manager: str, body: dict[str, Any], timeout: float) -> tuple[int, Any]:
    """``POST /register_rollout_instance``, retried for up to ``timeout`` seconds while the manager is
    unreachable or answers 5xx (it may be restarting while the model loaded)."""
    deadline = time.monotonic() + timeout

    def register() -> tuple[int, Any]:
        left = max(deadline - time.monotonic(), 0.0)
        return manager_call(manager, "POST", "/register_rollout_instance", body,
                            timeout=max(min(left, 30.0), 1.0)).status_body

    return retry(register, Backoff(0.5, 5.0, deadline_s=timeout), retry_on=(Unreachable,),
                 again=lambda answer: answer[0] >= 500)


def manager_run_id(manager: str, timeout: float = 5.0) -> str | None:
    """The manager's ``run_id`` (new on each start; None from a manager too old to report one)."""
    return manager_health(manager, timeout).run_id


def cmd_register(args: argparse.Namespace) -> None:
    info = agent_info(args.agent_url)
    body = {"host": args.host, "port": args.port, "mooncake_handshake_port": info["handshake_port"],
            "weight_receiver_port": args.agent_port}
    vocab = args.vocab_size or (model_vocab_size(args.model_path) if args.model_path else None)
    if vocab:
        body["vocab_size"] = vocab
    elif args.model_path:
        print(f"launch_sglang: no vocab_size in {args.model_path}'s config.json (or no config.json here); the "
              "manager cannot refuse out-of-vocabulary input ids for this box (--vocab-size sets it)",
              file=sys.stderr, flush=True)
    endpoint = format_endpoint(args.host, args.port)
    check_parallelism(str(info.get("sglang_url") or url_of(args.host, args.port)), endpoint)
    run_id = None
    if args.state_file:  # read before registering: a restart in between shows up as a new run id later
        try:
            run_id = manager_run_id(args.manager)
        except BoxError:
            pass  # register_with_retry below waits for the manager and reports
    status, answer = register_with_retry(args.manager, body, args.timeout)
    if status == 409:
        # Same host:port still on file: an earlier run of this box (preempted, killed) that the manager
        # has not declared dead yet. Our port was free, so that registration cannot be alive.
        print(f"launch_sglang: {endpoint} is still registered from an earlier run; replacing it",
              file=sys.stderr, flush=True)
        manager_call(args.manager, "POST", "/shutdown_instances",
                     {"endpoints": [endpoint], "check_weight_update": False}, timeout=args.timeout)
        status, answer = register_with_retry(args.manager, body, args.timeout)
    if status != 200 or not isinstance(answer, dict):
        raise BoxError(f"rollout manager refused the registration of {endpoint}: HTTP {status} "
                       f"{error_message(answer)}")
    reg = Registration.from_json(answer, endpoint)
    if args.endpoint_file:
        with open(args.endpoint_file, "w") as f:
            f.write(reg.endpoint)
    if args.state_file:
        with open(args.state_file, "w") as f:
            json.dump({"body": body, "endpoint": reg.endpoint, "run_id": run_id, "box_token": reg.box_token}, f)
    print(json.dumps({"endpoint": reg.endpoint, "id": reg.id, "state": reg.state,
                      "weight_version": reg.weight_version, "mooncake_handshake_port": info["handshake_port"],
                      "weight_transfer": reg.weight_transfer}, separators=(",", ":")))


def read_box_token(state_file: str | None) -> str | None:
    """The box token in a state file written by ``register`` (or renewed by ``watch``); None without one."""
    if not state_file:
        return None
    try:
        with open(state_file) as f:
            token = json.load(f).get("box_token")
    except (OSError, ValueError, AttributeError):
        return None
    return token if isinstance(token, str) and token else None


def save_state(state_file: str, state: dict[str, Any]) -> None:
    """Write the registration state back in place, in one write: the launcher reads the box token from
    it when deregistering. Padded to the old length, so a write cut short by a signal never leaves a
    shorter document with the old one's tail (JSON ignores the trailing blanks)."""
    data = json.dumps({k: state.get(k) for k in ("body", "endpoint", "run_id", "box_token")}).encode()
    fd = os.open(state_file, os.O_WRONLY)
    try:
        os.pwrite(fd, data.ljust(os.fstat(fd).st_size), 0)
    finally:
        os.close(fd)


def cmd_deregister(args: argparse.Namespace) -> None:
    body = {"endpoints": [args.endpoint], "check_weight_update": False}
    box_token = read_box_token(args.state_file)
    try:
        status, answer = manager_call(args.manager, "POST", "/shutdown_instances", body,
                                      timeout=args.timeout, token=box_token).status_body
        if status == 401 and box_token is not None:  # a manager that does not know it: the shared token
            status, answer = manager_call(args.manager, "POST", "/shutdown_instances", body,
                                          timeout=args.timeout).status_body
    except Unreachable as exc:
        if not exc.timed_out:
            raise
        raise BoxError(f"{args.endpoint} still draining after {args.timeout:g}s (--drain-timeout-s); stopping "
                       f"anyway: the manager removes it and continues its unfinished requests elsewhere") from None
    if status != 200 or not isinstance(answer, dict):
        raise BoxError(f"rollout manager refused to remove {args.endpoint}: HTTP {status} {error_message(answer)}")
    print(json.dumps(answer, separators=(",", ":")))


def say(message: str) -> None:
    print("launch_sglang: " + message, file=sys.stderr, flush=True)


def endpoint_known(manager: str, endpoint: str, timeout: float) -> bool:
    status, answer = manager_call(manager, "GET", "/get_instances_status", timeout=timeout).status_body
    if status != 200 or not isinstance(answer, dict):
        return True  # no verdict: assume nothing changed
    return any(isinstance(i, dict) and i.get("endpoint") == endpoint for i in answer.get("instances", []))


def watch_once(manager: str, state: dict[str, Any], timeout: float) -> None:
    """One check; updates ``state`` (``run_id``, ``away``, ``last_error``, ``removed_noted``) and logs
    only on a change. Never raises BoxError: the box keeps serving whatever the manager does."""
    addr = normalize_addr(manager)
    endpoint = state["endpoint"]
    try:
        run_id = manager_run_id(manager, timeout)
    except BoxError as exc:
        if not state.get("away"):
            state["away"] = True
            say(f"manager at {addr} went away ({exc}); still serving, checking again every "
                f"{state['interval']:g}s")
        return
    if state.get("away"):
        state["away"] = False
        say(f"manager at {addr} is back")
    try:
        if run_id is not None and run_id != state.get("run_id"):
            status, answer = manager_call(manager, "POST", "/register_rollout_instance", state["body"],
                                          timeout=max(timeout, 10.0)).status_body
            if status == 409:  # already on file in this run (our registration raced its restart)
                answer = {"endpoint": endpoint}
            elif status != 200 or not isinstance(answer, dict):
                raise BoxError(f"the manager refused registering {endpoint} again: HTTP {status} "
                               f"{error_message(answer)}; retrying in {state['interval']:g}s")
            old = state.get("run_id")
            state.update(run_id=run_id, removed_noted=False, last_error=None)
            if status == 200 and answer.get("box_token"):
                state["box_token"] = answer["box_token"]
                state["changed"] = True
            say(f"manager restarted (run id {old} -> {run_id}): registered again as "
                f"{answer.get('endpoint', endpoint)}")
        elif run_id is not None and not state.get("removed_noted") and not endpoint_known(manager, endpoint, timeout):
            state["removed_noted"] = True
            say(f"{endpoint} is no longer registered with {addr}, which has not restarted (removed with "
                f"/shutdown_instances?); not registering again: restart this launcher to rejoin")
        state["last_error"] = None
    except BoxError as exc:  # unreachable mid-way, auth refused, registration refused: say it once
        if str(exc) != state.get("last_error"):
            state["last_error"] = str(exc)
            say(f"warning: {' '.join(str(exc).split())}")


def cmd_watch(args: argparse.Namespace) -> None:
    with open(args.state_file) as f:
        state = json.load(f)
    state["interval"] = interval = max(args.interval, 0.1)
    timeout = min(max(interval, 1.0), 5.0)
    while True:
        time.sleep(interval)
        watch_once(args.manager, state, timeout)
        if state.pop("changed", False):
            try:
                save_state(args.state_file, state)
            except OSError as exc:
                say(f"warning: cannot update {args.state_file} with the new box token ({exc.strerror}); "
                    f"deregistration will use the shared token")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rollout_manager.launch.box", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("normalize-addr")
    s.add_argument("addr")
    s.set_defaults(func=lambda a: print(normalize_addr(a.addr)))

    s = sub.add_parser("detect-host")
    s.add_argument("--manager", required=True)
    s.set_defaults(func=lambda a: print(detect_host(a.manager)))

    s = sub.add_parser("preflight")
    s.add_argument("--manager", required=True)
    s.add_argument("--bind", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--agent-port", type=int, required=True)
    s.add_argument("--timeout", type=float, default=5.0)
    s.add_argument("--modules", default="", help="comma-separated modules the children need")
    s.add_argument("--wait-for-manager", type=float, default=0.0,
                   help="seconds to wait for the manager to answer healthy (0: fail at once)")
    s.set_defaults(func=cmd_preflight)

    s = sub.add_parser("exec")
    s.add_argument("--parent-pid", type=int, default=0)
    s.add_argument("command", nargs=argparse.REMAINDER)
    s.set_defaults(func=cmd_exec)

    s = sub.add_parser("wait-ready")
    s.add_argument("--url", action="append", default=[])
    s.add_argument("--auth-url", action="append", help="a URL asked with the shared token (the receiver agent)")
    s.add_argument("--pid", type=int, action="append")
    s.add_argument("--pid-name", action="append", help="names of the --pid processes, in order")
    s.add_argument("--timeout", type=float, required=True)
    s.add_argument("--interval", type=float, default=0.2)
    s.set_defaults(func=cmd_wait_ready)

    s = sub.add_parser("register")
    s.add_argument("--manager", required=True)
    s.add_argument("--host", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--agent-url", required=True)
    s.add_argument("--agent-port", type=int, required=True)
    s.add_argument("--model-path", help="the served model, whose config.json gives the vocabulary size")
    s.add_argument("--vocab-size", type=int, help="the vocabulary size to register (default: from --model-path)")
    s.add_argument("--timeout", type=float, default=60.0, help="keep retrying an unreachable manager this long")
    s.add_argument("--endpoint-file", help="also write the registered endpoint here")
    s.add_argument("--state-file", help="also write the body, endpoint and manager run id here (for watch)")
    s.set_defaults(func=cmd_register)

    s = sub.add_parser("watch")
    s.add_argument("--manager", required=True)
    s.add_argument("--state-file", required=True, help="written by register --state-file")
    s.add_argument("--interval", type=float, default=5.0, help="seconds between checks of the manager")
    s.set_defaults(func=cmd_watch)

    s = sub.add_parser("deregister")
    s.add_argument("--manager", required=True)
    s.add_argument("--endpoint", required=True)
    s.add_argument("--timeout", type=float, default=60.0)
    s.add_argument("--state-file", help="written by register --state-file: its box token authorises the call")
    s.set_defaults(func=cmd_deregister)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except BoxError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
