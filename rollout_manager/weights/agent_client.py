"""The manager's calls to the weight agents: the sender's ``/layout`` and ``/push``, the receiver's
``/prepare``, ``/commit`` and ``/activate``, and a peer receiver's ``/layout`` and ``/serve`` (peer bootstrap).
Errors are sorted by whose fault they are: a sender that is down or restaged is
:class:`SenderUnavailable` (the instance waits), anything else :class:`PushFailed`.

Runs in: manager.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from pydantic import BaseModel

from rollout_manager.weights.protocol import (
    ActivateAnswer,
    ActivateRequest,
    BadBody,
    Body,
    CommitAnswer,
    CommitRequest,
    LayoutAnswer,
    PrepareAnswer,
    PrepareRequest,
    PushAnswer,
    PushRequest,
    ServeRequest,
    parse_body,
)


class PushFailed(Exception):
    """The push to one instance failed; counts towards that instance's attempts."""

    def __init__(self, message: str, status: int | None = None, bad_shards: list[int] | None = None):
        super().__init__(message)
        self.status = status
        self.bad_shards = bad_shards  # a commit refused for these shards' checksums (a repair can fix them)


class SenderUnavailable(PushFailed):
    """The trainer-side sender is down or has not staged the version: not the instance's fault, so
    the instance waits out of service (not removed) until the sender is back."""


class AgentClient:
    def __init__(self, session: aiohttp.ClientSession, token: str | None, timeout_s: float) -> None:
        self.session = session
        self.headers = {"Authorization": f"Bearer {token}"} if token else None  # the manager's own token
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def layout(self, sender_url: str, sender: int, delta_base: int | None = None) -> LayoutAnswer:
        """The staged layout; with ``delta_base``, also the sender's delta offer from that version."""
        query = "" if delta_base is None else f"?delta_base={delta_base}"
        try:
            return await self._call("GET", sender_url + "/layout" + query, None, LayoutAnswer)
        except (PushFailed, aiohttp.ClientConnectionError) as exc:
            raise SenderUnavailable(f"sender {sender} at {sender_url}: {exc}") from None

    async def prepare(self, receiver_url: str, req: PrepareRequest) -> PrepareAnswer:
        return await self._call("POST", receiver_url + "/prepare", req, PrepareAnswer)

    async def push(self, sender_url: str, sender: int, req: PushRequest) -> PushAnswer:
        try:
            return await self._call("POST", sender_url + "/push", req, PushAnswer)
        except aiohttp.ClientConnectionError as exc:
            raise SenderUnavailable(f"sender {sender} at {sender_url}: {exc}") from None
        except PushFailed as exc:
            if exc.status == 409:  # restaged since: try again with what is there now
                raise SenderUnavailable(str(exc)) from None
            raise

    async def commit(self, receiver_url: str, req: CommitRequest) -> CommitAnswer:
        return await self._call("POST", receiver_url + "/commit", req, CommitAnswer)

    async def activate(self, receiver_url: str, req: ActivateRequest) -> ActivateAnswer:
        """Load the staged version inside a short pause of generation (weights/activation.py)."""
        return await self._call("POST", receiver_url + "/activate", req, ActivateAnswer)

    async def peer_layout(self, receiver_url: str) -> LayoutAnswer:
        """The verified version a peer's receiver holds, and its layout."""
        return await self._call("GET", receiver_url + "/layout", None, LayoutAnswer)

    async def serve(self, receiver_url: str, req: ServeRequest) -> PushAnswer:
        """Have a peer's receiver write its verified buffer into another receiver's prepared one."""
        return await self._call("POST", receiver_url + "/serve", req, PushAnswer)

    async def _call(self, method: str, url: str, req: BaseModel | None, answer: type[Body]) -> Body:
        """One call; a refusal (non-200) or an answer that does not fit ``answer`` is :class:`PushFailed`."""
        body = None if req is None else req.model_dump(exclude_none=True)  # unused delta fields stay out
        async with self.session.request(method, url, json=body, timeout=self.timeout, headers=self.headers) as resp:
            text = await resp.text()
            if resp.status != 200:
                try:
                    data: Any = json.loads(text)
                except ValueError:
                    data = {"error": text[:300]}
                error = data.get("error", data) if isinstance(data, dict) else data
                bad = data.get("bad_shards") if isinstance(data, dict) else None
                bad_shards = [int(i) for i in bad] if isinstance(bad, list) and all(
                    isinstance(i, int) for i in bad) else None
                raise PushFailed(f"{method} {url} -> HTTP {resp.status}: {error}", resp.status, bad_shards)
            try:
                return parse_body(text, answer)
            except BadBody as exc:
                raise PushFailed(f"{method} {url} -> unexpected answer: {exc}", resp.status) from None
