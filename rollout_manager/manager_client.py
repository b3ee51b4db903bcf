"""One client for the manager's own HTTP API, shared by the operator's CLI (``ops``), the rollout box's
launcher helper (``launch.box``) and the trainer plugin's async client (``trainer_plugin.client``).

Standard library only: the launcher runs it in SGLang's environment before anything heavy is imported,
and the daemon's base install has no torch (docs/install.md). It holds what the three must agree on:
the address form, the bearer token (``$ROLLOUT_MANAGER_AUTH_TOKEN``), the one error type
(:class:`ManagerAPIError`), the ``{"error": ...}`` message of a refusal, and the typed answers
(:class:`ManagerHealth`, :class:`ShutdownResult`, :class:`Registration`). :class:`ManagerAPI` makes blocking
calls with a timeout each; the trainer plugin keeps its own aiohttp transport (streams, restarts) and
uses the rest.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from rollout_manager.bearer import TOKEN_ENV

# The manager names its run (new on every start) on each batch answer; /health carries it too.
RUN_ID_HEADER = "X-Rollout-Manager-Run-Id"
HEALTH = "/health"
INSTANCES_STATUS = "/get_instances_status"
SHUTDOWN_INSTANCES = "/shutdown_instances"
EVACUATE_INSTANCE = "/evacuate_instance"
CANCEL_EVACUATION = "/cancel_evacuation"
REGISTER_INSTANCE = "/register_rollout_instance"


class ManagerAPIError(Exception):
    """A call to the manager (or a box's agent) that did not get the answer it wanted.

    ``status``: the HTTP status of an error answer, None when nothing answered over HTTP (refused,
    unreachable, timed out: then ``reason`` says which, ``timed_out`` whether it was the clock);
    ``message``: the answer's ``{"error": ...}`` text, or the start of its body; ``body``: the decoded body.
    """

    def __init__(self, text: str, *, status: int | None = None, message: str = "", body: Any = None,
                 reason: str = "", timed_out: bool = False) -> None:
        super().__init__(text)
        self.status = status
        self.message = message or text
        self.body = body
        self.reason = reason
        self.timed_out = timed_out


def base_url(addr: str) -> str:
    """``host:port`` or ``http(s)://host:port[/]`` -> ``http(s)://host:port`` (no trailing slash)."""
    addr = addr.strip()
    if "://" not in addr:
        addr = "http://" + addr
    return addr.rstrip("/")


def env_token() -> str:
    return os.environ.get(TOKEN_ENV, "")


def bearer_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def decode(raw: bytes) -> Any:
    """Decoded JSON, or the start of the text when the body is not JSON (an empty body is None)."""
    try:
        return json.loads(raw or b"null")
    except ValueError:
        return raw.decode(errors="replace")[:300]


def error_message(body: Any) -> str:
    """The manager's ``{"error": ...}`` message when there is one, else the start of the body."""
    if isinstance(body, dict) and "error" in body:
        return str(body["error"])
    if isinstance(body, str):
        return body.strip()[:300] or "(empty answer)"
    return json.dumps(body)[:300]


def describe_os_error(exc: BaseException) -> str:
    """``connection refused``, ``timed out``, ...: why nothing answered, in a few words."""
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc, urllib.error.HTTPError):
        exc = exc.reason if isinstance(exc.reason, BaseException) else exc
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


@dataclass(frozen=True)
class HTTPAnswer:
    """An HTTP answer: its status and its body, decoded (JSON, else the start of the text)."""

    status: int
    body: Any

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def status_body(self) -> tuple[int, Any]:
        return self.status, self.body


def http_call(method: str, url: str, body: Any = None, *, timeout_s: float | None = 10.0,
              token: str | None = None) -> HTTPAnswer:
    """One blocking call; an answer of any status is returned. Raises :class:`ManagerAPIError` with
    ``status=None`` when nothing answered over HTTP (also when something other than HTTP answers)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Accept": "application/json", **bearer_headers(token)}
    if data is not None:
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as exc:
        try:
            status, raw = exc.code, exc.read()
        except OSError:
            status, raw = exc.code, b""
    except http.client.HTTPException as exc:  # something else listens there
        why = f"not an HTTP answer ({type(exc).__name__})"
        raise ManagerAPIError(f"{method} {url}: {why}", reason=why) from None
    except OSError as exc:  # refused, timed out, no such host (urllib.error.URLError included)
        why = describe_os_error(exc)
        raise ManagerAPIError(f"{method} {url}: {why}", reason=why, timed_out=why == "timed out") from None
    return HTTPAnswer(status, decode(raw))


@dataclass(frozen=True)
class ManagerHealth:
    """``GET /health``: ``status`` is ``healthy`` when the manager serves; ``run_id`` is new on each start
    (None from a manager too old to report one)."""

    status: str
    version: str | None = None
    weight_version: int | None = None
    run_id: str | None = None
    instances: dict[str, int] = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        return self.status == "healthy"

    @classmethod
    def from_json(cls, body: Any) -> ManagerHealth:
        if not isinstance(body, dict):
            return cls(status="unknown")
        run_id, version, weight_version = body.get("run_id"), body.get("version"), body.get("weight_version")
        instances = body.get("instances")
        return cls(status=str(body.get("status", "unknown")), version=None if version is None else str(version),
                   weight_version=weight_version if isinstance(weight_version, int) else None,
                   run_id=str(run_id) if run_id else None,
                   instances=dict(instances) if isinstance(instances, dict) else {})


@dataclass(frozen=True)
class ShutdownResult:
    """``POST /shutdown_instances``: endpoints removed, not registered, and left alone (a push running)."""

    removed: list[str]
    not_found: list[str]
    skipped: list[dict[str, Any]]
    raw: dict[str, Any]  # the whole answer, for ``--json``

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> ShutdownResult:
        return cls(list(body.get("removed") or []), list(body.get("not_found") or []),
                   list(body.get("skipped") or []), body)


@dataclass(frozen=True)
class Registration:
    """``POST /register_rollout_instance``'s answer: where the manager files the instance, and the box
    token that later removes it (and no other)."""

    endpoint: str
    id: Any = None
    state: str | None = None
    weight_version: int | None = None
    box_token: str | None = None
    weight_transfer: Any = None

    @classmethod
    def from_json(cls, body: dict[str, Any], endpoint: str) -> Registration:
        token = body.get("box_token")
        return cls(str(body.get("endpoint", endpoint)), body.get("id"), body.get("state"),
                   body.get("weight_version"), token if isinstance(token, str) and token else None,
                   body.get("weight_transfer"))


_DEFAULT = object()


@dataclass(frozen=True)
class ManagerAPI:
    """One manager: its address, the bearer token, and the timeout of each blocking call (None: none)."""

    url: str
    token: str = ""
    timeout_s: float | None = 10.0

    def call(self, method: str, path: str, body: Any = None, *, timeout_s: float | None | object = _DEFAULT,
             token: str | None = None) -> HTTPAnswer:
        """Any status is returned; nothing answering raises :class:`ManagerAPIError` (``status=None``).
        ``token`` replaces the shared one (a box token)."""
        timeout = self.timeout_s if timeout_s is _DEFAULT else timeout_s
        assert timeout is None or isinstance(timeout, (int, float))
        try:
            return http_call(method, self.url + path, body, timeout_s=timeout,
                             token=self.token if token is None else token)
        except ManagerAPIError as exc:
            raise ManagerAPIError(f"cannot reach the manager at {self.url}: {exc.reason}", reason=exc.reason,
                                  timed_out=exc.timed_out) from None

    def request(self, method: str, path: str, body: Any = None, *,
                timeout_s: float | None | object = _DEFAULT) -> Any:
        """The decoded JSON answer of a 2xx; an error status raises :class:`ManagerAPIError` with it."""
        answer = self.call(method, path, body, timeout_s=timeout_s)
        if not answer.ok:
            message = error_message(answer.body)
            raise ManagerAPIError(f"{method} {path} -> HTTP {answer.status}: {message}", status=answer.status,
                                  message=message, body=answer.body)
        if isinstance(answer.body, str):
            raise ManagerAPIError(f"{method} {path}: the answer is not JSON ({answer.body[:80]!r})",
                                  status=answer.status, body=answer.body)
        return answer.body

    def _object(self, method: str, path: str, body: Any = None, *,
                timeout_s: float | None | object = _DEFAULT) -> dict[str, Any]:
        answer = self.request(method, path, body, timeout_s=timeout_s)
        if not isinstance(answer, dict):
            raise ManagerAPIError(f"{method} {path}: expected an object, got {type(answer).__name__}",
                                  status=200, body=answer)
        return answer

    def health(self, *, timeout_s: float | None | object = _DEFAULT) -> ManagerHealth:
        return ManagerHealth.from_json(self._object("GET", HEALTH, timeout_s=timeout_s))

    def instances_status(self, *, timeout_s: float | None | object = _DEFAULT) -> dict[str, Any]:
        """``GET /get_instances_status``: the status page's document (its shape is docs/http-api.md's)."""
        return self._object("GET", INSTANCES_STATUS, timeout_s=timeout_s)

    def shutdown_instances(self, endpoints: list[str], *, check_weight_update: bool = True,
                           timeout_s: float | None | object = _DEFAULT) -> ShutdownResult:
        body = {"endpoints": list(endpoints), "check_weight_update": check_weight_update}
        return ShutdownResult.from_json(self._object("POST", SHUTDOWN_INSTANCES, body, timeout_s=timeout_s))

    def evacuate_instance(self, endpoint: str, deadline_s: float, *, source: str = "manual", detail: str | None = None,
                          timeout_s: float | None | object = _DEFAULT) -> dict[str, Any]:
        """``POST /evacuate_instance``: a preemption notice (the box's sequences move before ``deadline_s``)."""
        body: dict[str, Any] = {"endpoint": endpoint, "deadline_s": deadline_s, "source": source}
        if detail is not None:
            body["detail"] = detail
        return self._object("POST", EVACUATE_INSTANCE, body, timeout_s=timeout_s)

    def cancel_evacuation(self, endpoint: str, *, timeout_s: float | None | object = _DEFAULT) -> dict[str, Any]:
        """``POST /cancel_evacuation``: the box serves again."""
        return self._object("POST", CANCEL_EVACUATION, {"endpoint": endpoint}, timeout_s=timeout_s)
