"""Async HTTP client for the rollout manager's API, as the trainer uses it.

- Every call has a timeout: ``connect_timeout_s`` to open the connection and ``timeout_s`` for a
  whole control call; generation calls have no total limit (a long sequence may take minutes) but
  an optional ``read_timeout_s`` of silence.
- Only *connection* failures are retried (the manager is not up yet, or restarting): an answer with
  a 4xx or 5xx status is the manager's verdict and is raised at once as :class:`ManagerHTTPError`.
  Once a request may have reached the manager (the connection broke mid-answer) it is not resent,
  except for ``GET`` calls, which change nothing.
- ``/batch_generate_requests`` is streamed: :meth:`ManagerClient.batch_generate` yields one dict per
  NDJSON line as the manager finishes each request. Leaving the loop early closes the connection,
  which makes the manager abort what is still running.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncGenerator, Iterable, Sequence
from typing import Any

import aiohttp

log = logging.getLogger("trainer_plugin.client")

# Connection problems that mean "the request never reached the manager": always safe to retry.
_CONNECT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientConnectorError,)
# Problems after the request may have been sent: retried only for GET.
_TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
    aiohttp.ClientPayloadError,
)


class ManagerClientError(RuntimeError):
    """Base class of everything this client raises."""


class ManagerUnavailable(ManagerClientError):
    """The manager could not be reached (after the retries), or the connection broke mid-call."""


class ManagerHTTPError(ManagerClientError):
    """The manager answered with an error status; ``message`` is its ``{"error": ...}`` text."""

    def __init__(self, method: str, path: str, status: int, message: str, body: Any = None):
        super().__init__(f"{method} {path} -> HTTP {status}: {message}")
        self.method = method
        self.path = path
        self.status = status
        self.message = message
        self.body = body


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
    ):
        """``auth_token``: sent as ``Authorization: Bearer``; default ``$ROLLOUT_MANAGER_AUTH_TOKEN``."""
        self.auth_token = auth_token if auth_token is not None else os.environ.get("ROLLOUT_MANAGER_AUTH_TOKEN", "")
        if not base_url.startswith(("http://", "https://")):
            base_url = "http://" + base_url
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------ session
    async def __aenter__(self) -> ManagerClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # no total timeout on the session: each call passes its own
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s),
                headers={"Authorization": f"Bearer {self.auth_token}"} if self.auth_token else None,
            )
        return self._session

    def _timeout(self, total: float | None) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total, connect=None, sock_connect=self.connect_timeout_s,
                                     sock_read=self.read_timeout_s if total is None else None)

    # ------------------------------------------------------------ core
    async def _open(self, method: str, path: str, body: Any, total: float | None) -> aiohttp.ClientResponse:
        """Send a request, retrying connection failures; return the response with a 2xx status."""
        url = self.base_url + path
        retryable = _CONNECT_ERRORS + (_TRANSPORT_ERRORS if method == "GET" else ())
        attempt = 0
        while True:
            attempt += 1
            try:
                kwargs: dict[str, Any] = {"timeout": self._timeout(total)}
                if body is not None:
                    kwargs["json"] = body
                resp = await self.session.request(method, url, **kwargs)
            except retryable as exc:
                if attempt > self.retries:
                    raise ManagerUnavailable(
                        f"{method} {url}: rollout manager not reachable after {attempt} attempt(s): {exc}"
                    ) from exc
                delay = self.retry_backoff_s * (2 ** (attempt - 1))
                log.warning("%s %s: %s; retrying in %.2fs (%d/%d)", method, url, exc, delay, attempt, self.retries)
                await asyncio.sleep(delay)
                continue
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
        resp = await self._open(method, path, body, total)
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
        resp = await self._open("GET", path, None, total)
        try:
            return await resp.json(content_type=None)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            raise ManagerUnavailable(f"GET {path}: answer broke off twice ({first}; {exc})") from exc
        finally:
            resp.release()

    # ------------------------------------------------------------ endpoints
    async def health(self) -> dict[str, Any]:
        """``GET /health``: ``{"status", "version", "weight_version", "instances": {state: n}}``."""
        return await self._call("GET", "/health")

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
        """``POST /generate`` (non-streaming): SGLang's final answer, with the manager's ``segments``."""
        return await self._call("POST", "/generate", {**body, "stream": False}, total=None)

    async def batch_generate(self, items: Iterable[tuple[Any, dict[str, Any]]]) -> AsyncGenerator[dict[str, Any], None]:
        """``POST /batch_generate_requests``: yield each NDJSON line (one per request, completion order).

        Each line is ``{"id", "success": true, "data": <SGLang answer>}`` or
        ``{"id", "success": false, "status_code", "error"}``. A connection that breaks before every id
        was answered raises :class:`ManagerUnavailable` (the request is not resent: the manager may
        have run part of it).
        """
        body = [[rid, req] for rid, req in items]
        resp = await self._open("POST", "/batch_generate_requests", body, None)
        received = 0
        try:
            while True:
                try:
                    raw = await resp.content.readline()
                except (aiohttp.ClientError, OSError) as exc:
                    raise ManagerUnavailable(
                        f"/batch_generate_requests: connection broke after {received} of {len(body)} results: {exc}"
                    ) from exc
                except asyncio.TimeoutError as exc:
                    raise ManagerUnavailable(
                        f"/batch_generate_requests: no data for {self.read_timeout_s}s "
                        f"after {received} of {len(body)} results"
                    ) from exc
                if not raw:
                    break
                raw = raw.strip()
                if not raw:
                    continue
                try:
                    line = json.loads(raw)
                except json.JSONDecodeError as exc:
                    raise ManagerClientError(f"/batch_generate_requests: bad NDJSON line {raw[:200]!r}: {exc}") from exc
                received += 1
                yield line
        finally:
            resp.close()  # early exit: drop the connection so the manager aborts the rest
        if received < len(body):
            raise ManagerUnavailable(
                f"/batch_generate_requests: stream ended after {received} of {len(body)} results"
            )

    async def abort_local_requests(self) -> dict[str, Any]:
        return await self._call("POST", "/abort_local_requests", {})

    async def update_weight_version(self, new_version: int | None = None, *, wait_for: int | str | None = None,
                                    timeout_s: float = 600.0) -> dict[str, Any]:
        """Publish a staged weight version; with ``wait_for`` ("all" or a count) wait until served."""
        body: dict[str, Any] = {"timeout_s": float(timeout_s)}
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


def _http_error(method: str, path: str, status: int, raw: bytes) -> ManagerHTTPError:
    body: Any = None
    message = raw.decode(errors="replace").strip()[:2000] or "(empty answer)"
    try:
        body = json.loads(raw)
        if isinstance(body, dict) and "error" in body:
            message = str(body["error"])
    except (json.JSONDecodeError, UnicodeDecodeError):
        pass
    return ManagerHTTPError(method, path, status, message, body)
