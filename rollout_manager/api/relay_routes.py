"""The HTTP side of relay processes (docs/relays.md).

On the control process: ``/relay/hello``, ``/relay/report`` and the fleet stream ``/relay/fleet`` its relays
use. On a relay: the rollout routes served here, the OpenAI front on relay 0 (its sessions live in one
ledger), and every other route handed to the process that owns it, with the caller's address, its token
and its body, the answer streamed back as it comes: a caller sees one manager on one port.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import TypeVar

import aiohttp
import msgspec
from aiohttp import web

from rollout_manager.api.http import json_response
from rollout_manager.bearer import same_secret
from rollout_manager.errors import BadRequest, Forbidden, Unavailable
from rollout_manager.instances.relay_hub import RelayHub
from rollout_manager.instances.relay_messages import Claim, Marked, RelayHello, RelayReport
from rollout_manager.manager import RELAY_SECRET_HEADER, Manager

log = logging.getLogger("rollout_manager.api.relay_routes")

# The caller's address, as the relay that handed a request on saw it (trusted only from a relay: from loopback
# where the control process listens on 127.0.0.1, or with ``relay_secret`` where relays reach it over the network).
FORWARDED_FOR = "X-Rollout-Manager-Forwarded-For"
# Headers a handed-on request keeps, and those its answer keeps.
REQUEST_HEADERS = ("Authorization", "Content-Type", "Accept", "X-Session-Owner", "X-Trajectory-Id")
ANSWER_HEADERS = ("Content-Type", "X-Rollout-Manager-Run-Id", "Retry-After", "Cache-Control")
HUB: web.AppKey[RelayHub] = web.AppKey("relay_hub", RelayHub)
SECRET: web.AppKey[str] = web.AppKey("relay_secret", str)


# ------------------------------------------------------------ on the control process
async def hello(request: web.Request) -> web.Response:
    _only_relays(request)
    return json_response(request.app[HUB].hello(_decode(await request.read(), RelayHello)))


async def report(request: web.Request) -> web.Response:
    _only_relays(request)
    return json_response(request.app[HUB].report(_decode(await request.read(), RelayReport)))


async def claim(request: web.Request) -> web.Response:
    _only_relays(request)
    saved = request.app[HUB].claim(_decode(await request.read(), Claim))
    return web.Response(body=msgspec.json.encode(saved), content_type="application/json")


async def marked(request: web.Request) -> web.Response:
    _only_relays(request)
    return json_response(request.app[HUB].marked(_decode(await request.read(), Marked)))


async def fleet(request: web.Request) -> web.StreamResponse:
    _only_relays(request)
    try:
        relay = int(request.query.get("relay", ""))
    except ValueError:
        raise BadRequest("relay: the relay's index is required (an integer)") from None
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    async for line in request.app[HUB].stream(relay):
        await resp.write(line)
    return resp


def _only_relays(request: web.Request) -> None:
    """With ``relay_secret`` the control process is reachable over the network: only its relays may say hello
    (instances in a hello are adopted without registration's checks), report and follow the fleet."""
    if request.app[SECRET] and not from_relay(request, request.app[SECRET]):
        raise Forbidden(f"{RELAY_SECRET_HEADER}: {request.path} is for this manager's relays only")


S = TypeVar("S", bound=msgspec.Struct)


def _decode(body: bytes, kind: type[S]) -> S:
    try:
        return msgspec.json.decode(body, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadRequest(f"body: {exc}") from None


def add_control_routes(app: web.Application, hub: RelayHub, secret: str = "") -> None:
    app[HUB] = hub
    app[SECRET] = secret
    app.router.add_post("/relay/hello", hello)
    app.router.add_post("/relay/report", report)
    app.router.add_post("/relay/claim", claim)
    app.router.add_post("/relay/marked", marked)
    app.router.add_get("/relay/fleet", fleet)


def caller(request: web.Request, manager: Manager) -> str | None:
    """The address a request came from: the relay's word for it when a relay handed it on."""
    forwarded = request.headers.get(FORWARDED_FOR)
    if forwarded and manager.hub is not None and from_relay(request, manager.config.relay_secret):
        return forwarded
    return request.remote


def from_relay(request: web.Request, secret: str) -> bool:
    """Whether one of this manager's relays sent ``request``: it carries ``secret`` when one is set (relays
    on other nodes), else it came from loopback (the local supervisor's control process listens there only)."""
    if secret:
        given = request.headers.get(RELAY_SECRET_HEADER, "")
        return same_secret(given, secret)
    return bool(request.remote) and _loopback(request.remote or "")


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


# ------------------------------------------------------------ on a relay
class Forwarder:
    """Hands a request to another process of the manager and streams its answer back."""

    def __init__(self, session: aiohttp.ClientSession, url: str, what: str, secret: str = "") -> None:
        self.session = session
        self.url = url.rstrip("/")
        self.what = what
        self.secret = secret  # sent along: the process handed to trusts the caller's address only with it

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        headers = {k: request.headers[k] for k in REQUEST_HEADERS if k in request.headers}
        if request.remote:
            headers[FORWARDED_FOR] = request.remote
        if self.secret:
            headers[RELAY_SECRET_HEADER] = self.secret
        body = await request.read()
        try:
            async with self.session.request(request.method, self.url + request.path_qs, data=body,
                                            headers=headers, allow_redirects=False,
                                            timeout=aiohttp.ClientTimeout(total=None, connect=5)) as answer:
                resp = web.StreamResponse(status=answer.status, headers={
                    k: answer.headers[k] for k in ANSWER_HEADERS if k in answer.headers})
                await resp.prepare(request)
                async for chunk in answer.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except (aiohttp.ClientConnectionError, OSError) as exc:
            raise Unavailable(f"{request.path} is answered by the {self.what}, which is not reachable now "
                              f"({exc.__class__.__name__}); rollouts go on, try this again shortly") from None
