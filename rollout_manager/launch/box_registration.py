"""The box's registration lifecycle with the manager: ``register``, ``deregister`` and ``watch``.

What the box tells the manager about itself (the receiver agent's ``/info``, SGLang's parallelism, the
model's vocabulary size), the registration and its state file (the body, endpoint, run id and box
token that ``watch`` renews and ``deregister`` authorises with), and re-registering after a manager
restart. Kept apart from the box-local steps (``box_local``); both rest on ``box_common`` only.
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from rollout_manager.launch.box_common import (
    BoxError,
    Unreachable,
    manager_call,
    manager_health,
    normalize_addr,
    request,
    say,
    url_of,
)
from rollout_manager.launch.model_config import model_vocab_size
from rollout_manager.manager_client import ManagerAPIError, Registration, error_message, http_call
from rollout_manager.osutil import format_endpoint
from rollout_manager.retry import Backoff, retry
from rollout_manager.sglang import wire  # standard library only at import time
from rollout_manager.sglang.auth import SGLangAuth  # standard library only


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
        # Read from the files the box serves: the manager may then use ids below it for its own requests.
        body["vocab_source"] = "declared" if args.vocab_size else "model_config"
    elif args.model_path:
        print(f"launch_sglang: no vocab_size in {args.model_path}'s config.json (or no config.json here); the "
              "manager cannot refuse out-of-vocabulary input ids for this box (--vocab-size sets it)",
              file=sys.stderr, flush=True)
    if getattr(args, "preemptible", False):
        body["preemptible"] = True  # left out when false: the manager's default, and older managers know no such field
    if getattr(args, "price_per_hour", None) is not None:
        body["price_per_hour"] = args.price_per_hour
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
