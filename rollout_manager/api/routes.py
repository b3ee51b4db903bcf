"""The manager's HTTP API: parse, validate, call the core, answer JSON. Nothing else lives here.

The handlers and the route table; the generic plumbing they stand on is in ``http.py``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from rollout_manager import __version__, jsonutil
from rollout_manager.api import openai_routes, relay_routes, status_page
from rollout_manager.api.fast_lane import FastLane, LaneOwner, LaneStats
from rollout_manager.api.http import (
    BOX_TOKEN,
    MAX_ADMIN_BODY,
    MAX_BODY,
    ON_REJECT,
    BodyTimeout,
    Handler,
    accepts,
    bearer_auth,
    decode_json,
    decodes,
    json_errors,
    json_response,
)
from rollout_manager.api.openapi import batch_schema, build_openapi, generate_schema
from rollout_manager.api.schemas import (
    CancelEvacuation,
    Empty,
    EvacuateInstance,
    RegisterLocalRolloutInstances,
    RegisterRolloutInstance,
    ShutdownInstances,
    UpdateMetrics,
    UpdateMismatch,
    UpdateProbeReference,
    UpdateWeightSenders,
    UpdateWeightVersion,
)
from rollout_manager.bearer import bearer_matches
from rollout_manager.errors import INTERNAL_ERROR, BadRequest, ManagerError
from rollout_manager.instances.mismatch import BoxReport
from rollout_manager.manager import Manager, Role
from rollout_manager.metrics import CONTENT_TYPE
from rollout_manager.notify import bounded
from rollout_manager.placement.affinity import KEY_HEADER, KEY_MAX_LEN
from rollout_manager.rollout import checkpoints
from rollout_manager.rollout.batch import run_batch_ndjson
from rollout_manager.rollout.request import Request, decode, decode_items
from rollout_manager.sglang import wire
from rollout_manager.sglang.logprob_probe import ID_RUNGS
from rollout_manager.sglang.sse import sse_frame

if TYPE_CHECKING:  # a Protocol in aiohttp's typedefs, not importable from every supported aiohttp
    from aiohttp.typedefs import Middleware

log = logging.getLogger("rollout_manager.api.routes")
MANAGER: web.AppKey[Manager] = web.AppKey("manager", Manager)
# Open without the token: liveness, scraping, the status page shell and the API description. /metrics
# lists every instance endpoint; metrics_require_token closes it for deployments that must hide them.
OPEN_PATHS = frozenset({("GET", "/health"), ("GET", "/metrics"), ("GET", "/"), ("GET", "/openapi.json")})
# Where a box token (issued at registration) stands in for the shared token: its launcher deregisters, and its
# preemption-notice watcher evacuates it (or cancels that); each for its own endpoint only.
BOX_TOKEN_PATHS = frozenset({("POST", "/shutdown_instances"), ("POST", "/evacuate_instance"),
                             ("POST", "/cancel_evacuation")})


def manager_of(request: web.Request) -> Manager:
    return request.app[MANAGER]


async def health(request: web.Request) -> web.Response:
    """Liveness: always open, even with an auth token."""
    m = manager_of(request)
    counts = m.registry.counts()
    return json_response({
        "status": "healthy", "service": "rollout-manager", "version": __version__, "weight_version": m.weight_version,
        "instances": counts, "run_id": m.run_id, "started_at": m.started_at,
    })


@accepts(RegisterRolloutInstance)
async def register_rollout_instance(request: web.Request, body: RegisterRolloutInstance, _: Any) -> web.Response:
    """Register a rollout box (pending until /health_generate succeeds); 409 if already registered."""
    await manager_of(request).check_registration_source(relay_routes.caller(request, manager_of(request)),
                                                        [body.host])
    result = manager_of(request).register_remote(body.host, body.port, body.mooncake_handshake_port,
                                                 body.weight_receiver_port, body.vocab_size,
                                                 vocab_from_config=body.vocab_source == "model_config",
                                                 preemptible=body.preemptible, price_per_hour=body.price_per_hour)
    return json_response(result)


@accepts(RegisterLocalRolloutInstances)
async def register_local_rollout_instances(request: web.Request, body: RegisterLocalRolloutInstances,
                                           _: Any) -> web.Response:
    """Register trainer-side instances, all or none; the trainer updates their weights itself. Like a
    box, the caller registers only its own instances (its address; see ``instances.admission``)."""
    await manager_of(request).check_registration_source(relay_routes.caller(request, manager_of(request)),
                                                        [host for host, _ in body.root])
    return json_response(manager_of(request).register_local(body.root))


async def get_instances_status(request: web.Request) -> web.Response:
    """Every instance with its state, kind, weight version, group and load, plus recent events."""
    status = manager_of(request).status()
    status["openai_sessions"] = request.app[openai_routes.FRONT].ledger.status()  # the OpenAI front's ledger
    return json_response(status)


async def distrusted_samples(request: web.Request) -> web.Response:
    """Delivered answers with tokens a quarantined box made unvouched, numbered above ``?after=N``: the
    trainer drops those samples before a step."""
    after = request.query.get("after", "0")
    if not after.isascii() or not after.isdigit() or len(after) > 18:
        raise BadRequest(f"after must be a whole number >= 0, not {after[:40]!r}")
    return json_response(manager_of(request).generator.migrator.provisional.since(int(after)))


@accepts(ShutdownInstances)
async def shutdown_instances(request: web.Request, body: ShutdownInstances, _: Any) -> web.Response:
    """Drain and remove instances; answers which were removed, unknown or skipped. With a box token
    (not the shared one) only the instance it was issued for."""
    result = await manager_of(request).shutdown_instances(body.endpoints, body.check_weight_update,
                                                          request.get(BOX_TOKEN))
    return json_response(result)


@accepts(EvacuateInstance)
async def evacuate_instance(request: web.Request, body: EvacuateInstance, _: Any) -> web.Response:
    """A preemption notice: the box takes only new work it is predicted to finish; its sequences finish there or
    move before the deadline, then it is removed. With a box token (not the shared one) only the box it was issued
    for."""
    return json_response(manager_of(request).evacuate_instance(body.endpoint, body.deadline_s, body.source,
                                                               body.detail, request.get(BOX_TOKEN)))


@accepts(CancelEvacuation)
async def cancel_evacuation(request: web.Request, body: CancelEvacuation, _: Any) -> web.Response:
    """The notice was cancelled (or the box outlived it): the box serves again (after the weights it missed)."""
    return json_response(manager_of(request).cancel_evacuation(body.endpoint, request.get(BOX_TOKEN)))


@accepts(UpdateWeightSenders)
async def update_weight_senders(request: web.Request, body: UpdateWeightSenders, _: Any) -> web.Response:
    """The trainer nodes' IPs; groups per allowed interface, instances re-dealt round-robin."""
    result = manager_of(request).update_weight_senders(
        body.weight_sender_ips, body.num_mooncake_groups_per_sender, body.num_mooncake_engines_per_group
    )
    return json_response(result)


def admit(manager: Manager, data: Any, trajectory_header: str | None) -> Request:
    """A ``/generate`` body (decoded JSON) as the request to run, on aiohttp's path and on the fast lane:
    typed in one pass, its ids checked against the vocabulary (an id past the model's vocabulary
    crashes SGLang's scheduler) and a request for routed experts against the active instances; raises
    ManagerError (400) naming the field."""
    request = decode(data, trajectory_header)
    generator = manager.generator
    assert generator is not None
    generator.vocab.check(request.input_ids)
    if any(s.body.routed_experts for s in request.sequences):
        generator.check_routed_experts()
    return request


def _generate_request(request: web.Request, data: Any) -> Request:
    return admit(manager_of(request), data, _trajectory_header(request))


@decodes(generate_schema, _generate_request)
async def generate(request: web.Request, body: Request) -> web.StreamResponse:
    """SGLang's /generate through the pool, continued on another instance if one dies mid-sequence."""
    generator = manager_of(request).generator
    assert generator is not None
    if not body.stream:
        return json_response(await generator.generate(body))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    chunks = generator.generate_stream(body)
    try:
        async for ready in chunks:
            if not await _send(request, resp, b"".join(sse_frame(chunk) for chunk in ready)):
                return resp  # the caller is gone or stopped reading: what still runs is aborted below
    finally:
        await chunks.aclose()
    if await _send(request, resp, wire.DONE_FRAME):
        await _sent(request, resp.write_eof())
    return resp


async def _send(request: web.Request, resp: web.StreamResponse, data: bytes) -> bool:
    """Write to a streamed answer; False if the caller went away or stopped reading (see :func:`_sent`)."""
    return await _sent(request, resp.write(data))


async def _sent(request: web.Request, write: Awaitable[None]) -> bool:
    """Wait for a write to a streamed answer; False if the caller went away or read nothing for
    ``response_write_timeout_s`` (then its connection is closed: a caller that stops reading must not
    keep its results, and the requests behind them, in the manager's memory)."""
    timeout = manager_of(request).config.response_write_timeout_s
    try:
        await bounded(write, timeout)
    except asyncio.TimeoutError:
        manager_of(request).metrics.slow_reader(request.path)
        log.warning("closing the connection of %s: it read nothing of its %s answer for %gs "
                    "(response_write_timeout_s); its unfinished requests are aborted",
                    request.remote, request.path, timeout)
        if request.transport is not None:
            request.transport.abort()  # drop what is buffered for it; no flush to a peer that does not read
        return False
    except ConnectionError:
        return False
    return True


def _trajectory_header(request: web.Request) -> str | None:
    """The ``X-Trajectory-Key`` header (affinity), for callers that cannot add a body key."""
    key = request.headers.get(KEY_HEADER)
    if key is not None and not 1 <= len(key) <= KEY_MAX_LEN:
        raise BadRequest(f"{KEY_HEADER} must be 1 to {KEY_MAX_LEN} characters")
    return key


class GenerateLane:
    """``POST /generate`` on the fast lane (``fast_lane``): the checks of :func:`generate` and the same
    call. What they would refuse, and streaming requests, go to aiohttp's path, which answers them."""

    def __init__(self, manager: Manager, max_body: int) -> None:
        self.manager = manager
        self.max_body = max_body
        self.token = manager.config.auth_token
        self.key_header = KEY_HEADER.lower()
        self.stats = LaneStats()

    def admit(self, headers: dict[str, str]) -> bool:
        """What the head decides, before any body is awaited: without the token (or with a trajectory
        key :func:`generate` refuses) aiohttp's path answers at once, and the caller never holds the
        connection busy while it withholds its body."""
        if self.token and not bearer_matches(headers.get("authorization", ""), self.token):
            return False
        key = headers.get(self.key_header)
        return key is None or 1 <= len(key) <= KEY_MAX_LEN

    def check(self, headers: dict[str, str], body: bytes) -> Request | None:
        """An admitted head's body: what :func:`generate` would run, or None for aiohttp to answer."""
        try:
            data = decode_json(body, self.max_body)
            if type(data) is dict and data.get("stream") is True:
                return None
            return admit(self.manager, data, headers.get(self.key_header))
        except ManagerError:
            return None

    async def run(self, prepared: Request) -> tuple[int, bytes]:
        generator = self.manager.generator
        assert generator is not None
        try:
            return 200, jsonutil.dumps(await generator.generate(prepared))
        except ManagerError as exc:
            if 400 <= exc.status < 500:
                self.manager.metrics.rejected("/generate", exc.reason)
            return exc.status, jsonutil.dumps({"error": str(exc)})
        except Exception:  # as json_errors: the daemon answers 500 and keeps running
            log.exception("unhandled error in POST /generate")
            return 500, jsonutil.dumps({"error": INTERNAL_ERROR})

    def body_timeout(self, timeout_s: float) -> bytes:
        self.manager.metrics.rejected("/generate", "body_timeout")
        return jsonutil.dumps({"error": str(BodyTimeout.after(timeout_s))})

    def lane_factory(self, body_timeout_s: float) -> Callable[[LaneOwner], FastLane]:
        """Per connection, a lane that serves this route."""
        return lambda owner: FastLane(owner, self, self.max_body, body_timeout_s,
                                      lambda: self.body_timeout(body_timeout_s), self.stats)


def _batch_items(_: web.Request, data: Any) -> list[tuple[Any, Request]]:
    return decode_items(data)


@decodes(batch_schema, _batch_items)
async def batch_generate_requests(request: web.Request, items: list[tuple[Any, Request]]) -> web.StreamResponse:
    """Many /generate bodies at once; NDJSON results in completion order, every id exactly once."""
    generator = manager_of(request).generator
    assert generator is not None
    if generator.checkpoints is not None:  # a relay saves them outside itself (rollout.checkpoints)
        link = manager_of(request).link
        again = link is not None and request.headers.get(checkpoints.RESUME_HEADER) is not None
        items = checkpoints.keyed(items, await link.claim(checkpoints.keys_of(items)) if again and link else None)
    # the run id lets a client tell a restarted manager (whose batch is gone) from a quiet stream
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson",
                                       "X-Rollout-Manager-Run-Id": manager_of(request).run_id})
    await resp.prepare(request)
    unsent = int(manager_of(request).config.max_unsent_output_kb * 1024)
    lines = run_batch_ndjson(generator, items, unsent)
    try:
        async for ready in lines:
            if not await _send(request, resp, ready):
                return resp
    finally:
        await lines.aclose()  # on a disconnect (or a caller that stopped reading) this aborts what still runs
    await _sent(request, resp.write_eof())
    return resp


@accepts(Empty, optional=True)
async def abort_local_requests(request: web.Request, _: Empty, __: Any) -> web.Response:
    """Close the local window now: sequences on trainer-side instances continue on remote ones."""
    return json_response(manager_of(request).abort_local_requests())


@accepts(UpdateMetrics)
async def update_metrics(request: web.Request, body: UpdateMetrics, _: Any) -> web.Response:
    """A step ended: adapt the local budget from the trainer's bubble and the remote idle time."""
    result = manager_of(request).update_metrics(body.step_time_s, body.trainer_bubble_time_s,
                                                body.step_throughput)
    return json_response(result)


@accepts(UpdateMismatch)
async def update_mismatch(request: web.Request, body: UpdateMismatch, _: Any) -> web.Response:
    """A step's trainer/rollout log-prob mismatch per instance: each instance's trust figure (outliers are
    quarantined)."""
    result = manager_of(request).update_mismatch(
        body.step, [BoxReport(b.instance, b.tokens, b.mean_abs_diff, b.k3_kl) for b in body.boxes],
        body.unattributed_tokens)
    return json_response(result)


async def probe_prompt(request: web.Request) -> web.Response:
    """The trust probe's prompt for a vocabulary size (``?vocab_size=N``; the served boxes' when left out),
    for the trainer to compute its reference log-probs of."""
    raw = request.query.get("vocab_size")
    if raw is not None and (not raw.isascii() or not raw.isdigit() or len(raw) > 10 or int(raw) < ID_RUNGS[0]):
        raise BadRequest(f"vocab_size must be a whole number >= {ID_RUNGS[0]}, not {raw[:40]!r}")
    return json_response(manager_of(request).probe_prompt(None if raw is None else int(raw)))


@accepts(UpdateProbeReference)
async def update_probe_reference(request: web.Request, body: UpdateProbeReference, _: Any) -> web.Response:
    """The probe prompt's log-probs by the trainer's model at a version: the boxes there are judged by them."""
    return json_response(manager_of(request).update_probe_reference(body.weight_version, body.input_ids,
                                                                    body.logprobs))


@accepts(UpdateWeightVersion, optional=True)
async def update_weight_version(request: web.Request, body: UpdateWeightVersion, _: Any) -> web.Response:
    """New weights are staged: remote instances sync to the new version; optionally wait for them."""
    result = await manager_of(request).update_weight_version(body.new_version, body.wait_for_instances,
                                                              body.timeout_s, staged=body.wait_until == "staged")
    return json_response(result)


async def prometheus_metrics(request: web.Request) -> web.Response:
    """Prometheus metrics (open, like /health, unless metrics_require_token)."""
    body = manager_of(request).metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def status_page_html(request: web.Request) -> web.Response:
    """The live status page (HTML; it reads /get_instances_status every second)."""
    return status_page.response()


async def openapi_json(request: web.Request) -> web.Response:
    """This API described as OpenAPI 3.1, generated from the schemas that validate the bodies."""
    return json_response(build_openapi(ROUTES, __version__))


ROUTES: list[tuple[str, str, Handler]] = [
    ("GET", "/health", health),
    ("POST", "/register_rollout_instance", register_rollout_instance),
    ("POST", "/register_local_rollout_instances", register_local_rollout_instances),
    ("GET", "/get_instances_status", get_instances_status),
    ("GET", "/distrusted_samples", distrusted_samples),
    ("POST", "/shutdown_instances", shutdown_instances),
    ("POST", "/evacuate_instance", evacuate_instance),
    ("POST", "/cancel_evacuation", cancel_evacuation),
    ("PUT", "/update_weight_senders", update_weight_senders),
    ("POST", "/generate", generate),
    ("POST", "/batch_generate_requests", batch_generate_requests),
    ("POST", "/abort_local_requests", abort_local_requests),
    ("POST", "/update_metrics", update_metrics),
    ("POST", "/update_mismatch", update_mismatch),
    ("GET", "/probe_prompt", probe_prompt),
    ("POST", "/update_probe_reference", update_probe_reference),
    ("POST", "/update_weight_version", update_weight_version),
    ("GET", "/metrics", prometheus_metrics),
    ("GET", "/", status_page_html),
    ("GET", "/openapi.json", openapi_json),
]


def max_body_of(manager: Manager) -> int:
    return int(manager.config.max_request_body_mb * 1024 * 1024)


def create_app(manager: Manager) -> web.Application:
    max_body = max_body_of(manager)
    open_paths = OPEN_PATHS - {("GET", "/metrics")} if manager.config.metrics_require_token else OPEN_PATHS
    middlewares: list[Middleware] = [json_errors]
    if manager.config.auth_token:  # without a token everything is open: no check to run per request
        middlewares.append(bearer_auth(manager.config.auth_token, open_paths, box_paths=BOX_TOKEN_PATHS,
                                       is_box_token=manager.is_box_token))
    app = web.Application(middlewares=middlewares, client_max_size=max_body)
    app[MANAGER] = manager
    app[ON_REJECT] = manager.metrics.rejected
    app[MAX_BODY] = max_body
    app[MAX_ADMIN_BODY] = int(manager.config.max_admin_body_kb * 1024)
    if manager.role is Role.RELAY:
        _relay_routes(app, manager)
        return app
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
    openai_routes.register(app, manager)  # /v1/*: the OpenAI-compatible front (docs/agents.md)
    if manager.hub is not None:
        relay_routes.add_control_routes(app, manager.hub, manager.config.relay_secret)
    return app


# What a relay answers itself; the rest is the control process's (docs/relays.md).
RELAY_PATHS = frozenset({"/health", "/generate", "/batch_generate_requests"})


def _relay_routes(app: web.Application, manager: Manager) -> None:
    place = manager.place
    assert place is not None
    for method, path, handler in ROUTES:
        if path in RELAY_PATHS:
            app.router.add_route(method, path, handler)
    if place.front_url is None:
        openai_routes.register(app, manager)
    else:
        app.router.add_route("*", "/v1/{tail:.*}", relay_routes.Forwarder(
            manager.session, place.front_url, "relay that holds the OpenAI front", manager.config.relay_secret))
    app.router.add_route("*", "/{tail:.*}", relay_routes.Forwarder(manager.session, place.control_url,
                                                                    "control process", manager.config.relay_secret))
