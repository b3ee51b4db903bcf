"""Async HTTP client for the rollout manager's API, as the trainer uses it.

- Every call has a timeout: ``connect_timeout_s`` to open the connection and ``timeout_s`` for a
  whole control call; generation calls have no total limit (a long sequence may take minutes) but
  an optional ``read_timeout_s`` of silence.
- Only *connection* failures are retried (the manager is not up yet, or restarting): an answer with
  a 4xx or 5xx status is the manager's verdict and is raised at once as :class:`ManagerHTTPError`.
  Once a request may have reached the manager (the connection broke mid-answer) it is not resent,
  except for ``GET`` calls, which change nothing.
- ``/batch_generate_requests`` is streamed: :meth:`ManagerClient.batch_generate` yields one dict per
  NDJSON line as the manager finishes each request, and resumes a stream lost to a manager outage
  (:mod:`trainer_plugin.batch_stream`). ``POST /generate`` is sent again after such an outage.

A manager restart costs only the tokens in flight (``restart_timeout_s`` > 0, the default): the
client waits, up to ``restart_timeout_s``, for ``/health`` to answer at the same URL, and sends again
what was not answered; ``restart_timeout_s=0`` raises :class:`ManagerUnavailable` at once instead.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, Iterable, Sequence
from typing import Any

import aiohttp

from rollout_manager.manager_client import (
    HEALTH,
    RUN_ID_HEADER,
    ManagerHealth,
    bearer_headers,
    decode,
    env_token,
    error_message,
)
from rollout_manager.manager_client import base_url as base_url_of
from rollout_manager.retry import Backoff, retry_async

from .batch_stream import stream_batch
from .client_errors import (
    ClientStats,
    ManagerClientError,
    ManagerHTTPError,
    ManagerLost,
    ManagerRestarted,
    ManagerUnavailable,
)

log = logging.getLogger("trainer_plugin.client")

__all__ = ["RUN_ID_HEADER", "ClientStats", "ManagerClient", "ManagerClientError", "ManagerHTTPError",
           "ManagerLost", "ManagerRestarted", "ManagerUnavailable"]

# Connection problems that mean "the request never reached the manager": always safe to retry.
_CONNECT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientConnectorError,)
# Problems after the request may have been sent: retried only for GET.
_TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
    aiohttp.ClientPayloadError,
)


class ManagerClient:
    """One manager, one ``aiohttp`` session (created lazily inside the running event loop).

    Use as ``async with ManagerClient("http://127.0.0.1:5000") as client: ...`` or call
    :meth:`close` yourself.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float | None = None,
        retries: int = 3,
        retry_backoff_s: float = 0.5,
        max_connections: int = 256,
        auth_token: str | None = None,
        stall_timeout_s: float | None = 10.0,
        restart_timeout_s: float = 120.0,
        probe_timeout_s: float = 5.0,
        max_resubmits: int = 5,
    ):
        """``auth_token``: sent as ``Authorization: Bearer``; default ``$ROLLOUT_MANAGER_AUTH_TOKEN``.

        ``stall_timeout_s``: silence on a generation stream before ``/health`` is probed (None or 0:
        never); ``restart_timeout_s``: how long a batch waits for a manager that is down or frozen
        (0: no resubmission); ``probe_timeout_s``: a ``/health`` probe slower than this counts as no
        answer; ``max_resubmits``: resubmissions in a row that deliver nothing before giving up.
        """
        if restart_timeout_s < 0 or probe_timeout_s <= 0 or max_resubmits < 0:
            raise ValueError(f"restart_timeout_s and max_resubmits must be >= 0 and probe_timeout_s > 0, got "
                             f"{restart_timeout_s}, {max_resubmits}, {probe_timeout_s}")
        self.auth_token = auth_token if auth_token is not None else env_token()
        self.base_url = base_url_of(base_url)
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self.max_connections = max_connections
        self.stall_timeout_s = stall_timeout_s or None
        self.restart_timeout_s = restart_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self.max_resubmits = max_resubmits
        self.stats = ClientStats()
        self._session: aiohttp.ClientSession | None = None
        self._probe_session: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------ session
    async def __aenter__(self) -> ManagerClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        for session in (self._session, self._probe_session):
            if session is not None and not session.closed:
                await session.close()
        self._session = self._probe_session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # no total timeout on the session: each call passes its own
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s),
                headers=bearer_headers(self.auth_token) or None,
            )
        return self._session

    def _timeout(self, total: float | None) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total, connect=None, sock_connect=self.connect_timeout_s,
                                     sock_read=self.read_timeout_s if total is None else None)

    # ------------------------------------------------------------ core
    async def send(self, method: str, path: str, body: Any, total: float | None,
                   headers: dict[str, str] | None = None) -> aiohttp.ClientResponse:
        """Send a request, retrying connection failures; return the response with a 2xx status."""
        url = self.base_url + path
        retryable = _CONNECT_ERRORS + (_TRANSPORT_ERRORS if method == "GET" else ())
        kwargs: dict[str, Any] = {"timeout": self._timeout(total)}
        if headers:
            kwargs["headers"] = headers
        if body is not None:
            kwargs["json"] = body

        def retrying(attempt: int, delay: float, exc: object) -> None:
            log.warning("%s %s: %s; retrying in %.2fs (%d/%d)", method, url, exc, delay, attempt, self.retries)

        try:
            resp = await retry_async(lambda: self.session.request(method, url, **kwargs),
                                     Backoff(self.retry_backoff_s, float("inf"), attempts=self.retries + 1),
                                     retry_on=retryable, on_retry=retrying)
        except retryable as exc:
            raise ManagerUnavailable(
                f"{method} {url}: rollout manager not reachable after {self.retries + 1} attempt(s): {exc}"
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise ManagerUnavailable(f"{method} {url}: connection failed: {exc}") from exc
        except asyncio.TimeoutError as exc:
            raise ManagerUnavailable(f"{method} {url}: timed out") from exc
        if resp.status >= 400:
            try:
                raw = await resp.read()
            finally:
                resp.release()
            raise _http_error(method, path, resp.status, raw)
        return resp

    async def _call(self, method: str, path: str, body: Any = None, *, total: float | None = -1.0) -> Any:
        """One request, one JSON answer."""
        total = self.timeout_s if total == -1.0 else total
        resp = await self.send(method, path, body, total)
        try:
            return await resp.json(content_type=None)
        except (aiohttp.ClientError, OSError) as exc:
            if method == "GET":  # one more go for a read-only call whose answer broke off
                return await self._retry_get(path, total, exc)
            raise ManagerUnavailable(f"{method} {path}: connection broke while reading the answer: {exc}") from exc
        except asyncio.TimeoutError as exc:
            raise ManagerUnavailable(f"{method} {path}: timed out reading the answer") from exc
        except json.JSONDecodeError as exc:
            raise ManagerClientError(f"{method} {path}: answer is not JSON: {exc}") from exc
        finally:
            resp.release()

    async def _retry_get(self, path: str, total: float | None, first: BaseException) -> Any:
        resp = await self.send("GET", path, None, total)
        try:
            return await resp.json(content_type=None)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            raise ManagerUnavailable(f"GET {path}: answer broke off twice ({first}; {exc})") from exc
        finally:
            resp.release()

    # ------------------------------------------------------------ endpoints
    async def health(self) -> dict[str, Any]:
        """``GET /health``: ``{"status", "version", "weight_version", "instances": {state: n}}``."""
        return await self._call("GET", HEALTH)

    async def get_instances_status(self) -> dict[str, Any]:
        return await self._call("GET", "/get_instances_status")

    async def register_local_rollout_instances(self, endpoints: Sequence[tuple[str, int]]) -> dict[str, Any]:
        return await self._call("POST", "/register_local_rollout_instances", [[h, p] for h, p in endpoints])

    async def update_weight_senders(self, weight_sender_ips: list[list[str]], *,
                                    num_mooncake_groups_per_sender: int | None = None,
                                    num_mooncake_engines_per_group: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"weight_sender_ips": weight_sender_ips}
        if num_mooncake_groups_per_sender is not None:
            body["num_mooncake_groups_per_sender"] = num_mooncake_groups_per_sender
        if num_mooncake_engines_per_group is not None:
            body["num_mooncake_engines_per_group"] = num_mooncake_engines_per_group
        return await self._call("PUT", "/update_weight_senders", body)

    async def generate(self, body: dict[str, Any]) -> Any:
        """``POST /generate`` (non-streaming): SGLang's final answer, with the manager's ``segments``.

        A connection that breaks (the manager died or restarted, which aborts the request there) is
        sent again once the manager answers ``/health``, within ``restart_timeout_s``.
        """
        tries = 0
        while True:
            try:
                return await self._call("POST", "/generate", {**body, "stream": False}, total=None)
            except ManagerLost:
                raise
            except ManagerUnavailable as exc:
                tries += 1
                if self.restart_timeout_s <= 0 or tries > self.max_resubmits:
                    raise
                self.stats.interruptions += 1
                started = time.monotonic()
                log.warning("POST /generate: %s; sending it again when the manager at %s answers (up to %gs)",
                            exc, self.base_url, self.restart_timeout_s)
                health = await self.wait_for_manager(started + self.restart_timeout_s, None)
                self.stats.outage_s += time.monotonic() - started
                if health is None:
                    raise ManagerLost(f"POST /generate: rollout manager at {self.base_url} did not come back "
                                      f"within {self.restart_timeout_s:g}s after: {exc}; the request "
                                      f"(rid {body.get('rid')!r}) is lost", [body.get("rid")], 0) from exc
                self.stats.resubmitted += 1

    def batch_generate(self, items: Iterable[tuple[Any, dict[str, Any]]]) -> AsyncGenerator[dict[str, Any], None]:
        """``POST /batch_generate_requests``: yield each NDJSON line (one per request, completion order).

        Each line is ``{"id", "success": true, "data": <SGLang answer>}`` or
        ``{"id", "success": false, "status_code", "error"}``, each id exactly once. A lost stream is
        resumed with the unanswered ids (:mod:`trainer_plugin.batch_stream`); when the manager does not
        come back in time this raises :class:`ManagerLost` naming them. With ``restart_timeout_s=0`` a
        broken stream raises :class:`ManagerUnavailable` at once, as before.
        """
        return stream_batch(self, items)

    @property
    def probe_session(self) -> aiohttp.ClientSession:
        """A pool of its own: streams holding every connection of the main pool cannot delay a probe."""
        if self._probe_session is None or self._probe_session.closed:
            self._probe_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4))
        return self._probe_session

    async def probe_health(self) -> ManagerHealth | None:
        """``/health``'s answer, or None if it does not answer 200 within ``probe_timeout_s``."""
        try:
            async with self.probe_session.get(self.base_url + HEALTH,
                                              timeout=aiohttp.ClientTimeout(total=self.probe_timeout_s)) as r:
                if r.status != 200:
                    return None
                body = await r.json(content_type=None)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
            return None
        return ManagerHealth.from_json(body) if isinstance(body, dict) else None

    async def wait_for_manager(self, deadline: float, not_run_id: str | None) -> ManagerHealth | None:
        """Poll ``/health`` until it answers (from a run other than ``not_run_id``) or the deadline."""
        def fresh(health: ManagerHealth | None) -> bool:
            return health is not None and (not_run_id is None or health.run_id != not_run_id)

        health = await retry_async(self.probe_health, Backoff(0.05, 1.0, deadline_s=deadline - time.monotonic()),
                                   again=lambda h: not fresh(h))
        return health if fresh(health) else None

    async def abort_local_requests(self) -> dict[str, Any]:
        return await self._call("POST", "/abort_local_requests", {})

    async def update_weight_version(self, new_version: int | None = None, *, wait_for: int | str | None = None,
                                    timeout_s: float = 600.0, wait_until: str = "serving") -> dict[str, Any]:
        """Publish a staged weight version; with ``wait_for`` ("all" or a count) wait until that many instances
        serve it (``wait_until`` "staged": hold it verified, ready to activate)."""
        body: dict[str, Any] = {"timeout_s": float(timeout_s)}
        if wait_until != "serving":
            body["wait_until"] = wait_until
        if new_version is not None:
            body["new_version"] = int(new_version)
        if wait_for is not None:
            body["wait_for_instances"] = wait_for
        return await self._call("POST", "/update_weight_version", body, total=timeout_s + 30)

    async def update_metrics(self, *, step_time_s: float, trainer_bubble_time_s: float,
                             step_throughput: float) -> dict[str, Any]:
        return await self._call("POST", "/update_metrics", {
            "step_time_s": float(step_time_s),
            "trainer_bubble_time_s": float(trainer_bubble_time_s),
            "step_throughput": float(step_throughput),
        })

    async def distrusted_samples(self, after: int = 0) -> dict[str, Any]:
        """``GET /distrusted_samples``: answers a quarantined box made unvouched, numbered above ``after``
        (:mod:`trainer_plugin.distrust`)."""
        return await self._call("GET", f"/distrusted_samples?after={int(after)}")

    async def probe_prompt(self, vocab_size: int | None = None) -> dict[str, Any]:
        """``GET /probe_prompt``: the trust probe's prompt (:mod:`trainer_plugin.probe_reference`)."""
        query = "" if vocab_size is None else f"?vocab_size={int(vocab_size)}"
        return await self._call("GET", "/probe_prompt" + query)

    async def update_probe_reference(self, weight_version: int, input_ids: list[int],
                                     logprobs: list[float]) -> dict[str, Any]:
        """``POST /update_probe_reference``: the probe prompt's log-probs by the trainer's model."""
        return await self._call("POST", "/update_probe_reference", {
            "weight_version": int(weight_version), "input_ids": list(input_ids), "logprobs": list(logprobs)})

    async def update_mismatch(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /update_mismatch``: a step's log-prob mismatch per box (:mod:`trainer_plugin.mismatch`)."""
        return await self._call("POST", "/update_mismatch", body)


def _http_error(method: str, path: str, status: int, raw: bytes) -> ManagerHTTPError:
    body = decode(raw)
    return ManagerHTTPError(method, path, status, error_message(body), None if isinstance(body, str) else body)
