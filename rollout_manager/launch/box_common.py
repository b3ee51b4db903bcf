"""What the rollout box's helper commands share: the one-line error, addresses, and calls to the manager.

Both halves of ``python -m rollout_manager.launch.box`` (the box-local steps in ``box_local`` and the
registration lifecycle in ``box_registration``) report failures the same way (:class:`BoxError`, one
``launch_sglang: error: ...`` line) and reach the manager and the box's own servers the same way; this is
that common ground, and it imports neither half. Standard library only, like the helper itself.
"""

from __future__ import annotations

import sys
import urllib.parse
from typing import Any, NoReturn

from rollout_manager.manager_client import (
    HTTPAnswer,
    ManagerAPI,
    ManagerAPIError,
    ManagerHealth,
    env_token,
    error_message,
    http_call,
)
from rollout_manager.osutil import format_endpoint

PREFIX = "launch_sglang: error: "


class BoxError(Exception):
    """A failure the user must act on; its message is the one line they see."""


class Unreachable(BoxError):
    """The manager did not answer over HTTP (``timed_out``: it did not answer in time)."""

    def __init__(self, message: str, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class NotHealthy(BoxError):
    """The manager answers, but not (yet) healthy."""


def fail(message: str, code: int = 1) -> NoReturn:
    print(PREFIX + " ".join(message.split()), file=sys.stderr, flush=True)
    raise SystemExit(code)


def say(message: str) -> None:
    print("launch_sglang: " + message, file=sys.stderr, flush=True)


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


def url_of(host: str, port: int) -> str:
    return f"http://{format_endpoint(host, port)}"


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
