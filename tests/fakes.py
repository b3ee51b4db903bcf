"""In-process fakes for testing the manager's state machines without processes or real time.

- :class:`FakeClock`: monotonic time that moves only when a test advances it; its ``sleep`` parks the
  caller until then, so a start-up grace period of minutes passes in microseconds and deterministically.
- :class:`FakeSGLang`: an aiohttp app on 127.0.0.1 that speaks just enough of SGLang's ``/generate``
  (encoded with :mod:`rollout_manager.sglang.wire`, so it is held to the manager's wire contract),
  ``/health_generate`` and ``/abort_request``, and can die, stall or refuse on demand.
- :class:`FakeProbe`: a scripted health probe for :class:`HealthMonitor`.
- :class:`FakeAgents`: an :class:`AgentClient` for :class:`WeightSync` that records calls and fails on demand.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from rollout_manager.cpu_engine.encode import output_chunk
from rollout_manager.instances.registry import Instance, Kind, Registry, State
from rollout_manager.sglang import wire
from rollout_manager.sglang.client import Probe
from rollout_manager.sglang.finish import FinishReason
from rollout_manager.sglang.logprob_probe import is_probe
from rollout_manager.sglang.sse import sse_frame
from rollout_manager.weights.agent_client import AgentClient, PushFailed, SenderUnavailable
from rollout_manager.weights.protocol import (
    ActivateAnswer,
    ActivateRequest,
    CommitAnswer,
    CommitRequest,
    LayoutAnswer,
    LayoutBody,
    PrepareAnswer,
    PrepareRequest,
    PushAnswer,
    PushRequest,
)


class FakeClock:
    """Monotonic time under the test's control; pass ``clock`` where a clock is taken and
    ``clock.sleep`` where a sleep is taken."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._parked = asyncio.Event()

    def __call__(self) -> float:
        return self.now

    @property
    def sleepers(self) -> int:
        """How many callers are parked in :meth:`sleep`."""
        return len(self._sleepers)

    async def sleep(self, seconds: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (self.now + max(seconds, 0.0), next(self._order), fut)
        heapq.heappush(self._sleepers, entry)
        self._parked.set()
        try:
            await fut
        finally:
            if entry in self._sleepers:  # cancelled while parked
                self._sleepers.remove(entry)
                heapq.heapify(self._sleepers)

    def advance(self, seconds: float) -> None:
        """Move time on and wake every sleeper whose deadline has come (they run at the next yield)."""
        self.now += seconds
        while self._sleepers and self._sleepers[0][0] <= self.now:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)

    async def parked(self, count: int = 1, timeout_s: float = 2.0) -> None:
        """Return once ``count`` callers are parked in :meth:`sleep`: the code under test has done all
        it can do at this instant. Real-time bounded so a broken test fails instead of hanging."""
        async def enough() -> None:
            while len(self._sleepers) < count:
                self._parked.clear()
                await self._parked.wait()

        try:
            await asyncio.wait_for(enough(), timeout_s)
        except asyncio.TimeoutError:
            raise AssertionError(f"{len(self._sleepers)} caller(s) parked after {timeout_s:g}s, "
                                 f"expected {count}") from None

    async def step(self, seconds: float, parked: int = 1) -> None:
        """Advance, then wait until ``parked`` callers are parked again."""
        self.advance(seconds)
        await self.parked(parked)


# ---------------------------------------------------------------- SGLang


def next_token(context: list[int]) -> int:
    """The fake model: the next token depends only on the context, as with greedy decoding, so a
    sequence continued elsewhere from its tokens so far gets the very tokens it would have got."""
    return (sum(context) * 31 + len(context) * 7 + 3) % 251


def reference(prompt: list[int], n: int) -> list[int]:
    """What an uninterrupted greedy run of the fake model makes from ``prompt``."""
    context, out = list(prompt), []
    for _ in range(n):
        token = next_token(context)
        context.append(token)
        out.append(token)
    return out


@dataclass
class FakeSGLang:
    """One fake SGLang server. Set the public fields to change how it behaves from the next request."""

    weight_version: str = "0"
    health_status: int = 200
    die_after_tokens: int | None = None  # stream that many tokens, then drop the connection
    stall_after_tokens: int | None = None  # stream that many tokens, then go silent until unstall()
    reject_status: int | None = None  # answer every /generate with this status and an SGLang error body
    abort_finish: dict[str, Any] | None = None  # end every /generate at once with this finish_reason
    context_len: int = 300  # where a request with max_new_tokens null stops
    # Misbehaviour while staying up: ``rewrite(chunk, k)`` replaces the k-th chunk (or answer) before it is
    # sent (None: drop it); ``error_frame`` answers 200 and this error frame; ``babble`` sends these bytes
    # every that many seconds after the headers, forever, never a frame boundary; ``silent`` sends
    # nothing at all, not even the status line, until unstall().
    rewrite: Callable[[dict[str, Any], int], dict[str, Any] | None] | None = None
    error_frame: dict[str, Any] | None = None
    babble: tuple[bytes, float] | None = None
    silent: bool = False
    model_info: dict[str, Any] | None = None  # when set: /server_info answers {} and /model_info this
    requests: list[dict[str, Any]] = field(default_factory=list)  # /generate bodies, in order
    aborted: list[str] = field(default_factory=list)  # rids told to /abort_request
    health_probes: int = 0
    server: TestServer | None = None
    _unstall: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def port(self) -> int:
        assert self.server is not None and self.server.port is not None
        return self.server.port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post(wire.GENERATE, self._generate)
        app.router.add_get(wire.HEALTH_GENERATE, self._health)
        app.router.add_get(wire.HEALTH, self._health)
        app.router.add_post(wire.ABORT_REQUEST, self._abort)
        if self.model_info is not None:
            app.router.add_get(wire.SERVER_INFO, self._server_info)
            app.router.add_get(wire.MODEL_INFO, self._model_info)
        return app

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response(self.model_info)

    async def start(self) -> FakeSGLang:
        self.server = TestServer(self.app(), host="127.0.0.1")
        await self.server.start_server()
        return self

    def unstall(self) -> None:
        self._unstall.set()

    async def close(self) -> None:
        self._unstall.set()  # a stalled handler must not hold the shutdown
        if self.server is not None:
            await self.server.close()

    async def _health(self, request: web.Request) -> web.Response:
        self.health_probes += 1
        return web.json_response({}, status=self.health_status)

    async def _abort(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.aborted.append(str(body.get("rid", "")))
        return web.json_response({})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if is_probe(body):  # the manager's trust probe: no model here to answer it, and no request of a test's
            return web.json_response(wire.error_object("the fake engine has no model to probe", 404), status=404)
        self.requests.append(body)
        if self.silent:
            await self._unstall.wait()
        if self.reject_status is not None:
            error = wire.error_object(f"fake engine refuses with {self.reject_status}", self.reject_status)
            return web.json_response(error, status=self.reject_status)
        prompt = list(body["input_ids"])
        limit = (body.get("sampling_params") or {}).get("max_new_tokens", wire.DEFAULT_MAX_NEW_TOKENS)
        budget = self.context_len - len(prompt) if limit is None else int(limit)
        rid = str(body.get("rid") or "fake")
        if self.babble is not None:  # streaming or not
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            while not self._unstall.is_set():
                await resp.write(self.babble[0])
                await asyncio.sleep(self.babble[1])
            return resp
        if body.get("stream") is not True:
            return await self._answer_once(request, prompt, budget, rid)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.error_frame is not None:
            await resp.write(sse_frame({"error": self.error_frame}) + wire.DONE_FRAME)
            await resp.write_eof()
            return resp
        made: list[int] = []
        sent = 0

        async def send(chunk: dict[str, Any]) -> None:
            nonlocal sent
            out = chunk if self.rewrite is None else self.rewrite(chunk, sent)
            sent += 1
            if out is not None:
                await resp.write(sse_frame(out))

        if self.abort_finish is not None:  # as SGLang's scheduler refusing the request
            await send(output_chunk(
                rid=rid, output_ids=[], prompt_tokens=len(prompt), completion_tokens=0,
                finish=self.abort_finish, weight_version=self.weight_version, text=""))
            budget = 0
        for _ in range(budget):
            if self.die_after_tokens is not None and len(made) >= self.die_after_tokens:
                assert request.transport is not None
                request.transport.close()  # as a crashed engine: no [DONE], no clean end of the body
                return resp
            if self.stall_after_tokens is not None and len(made) >= self.stall_after_tokens:
                await self._unstall.wait()
            made.append(next_token(prompt + made))
            finish = wire.finish_reason(wire.LENGTH, length=len(made)) if len(made) == budget else None
            await send(output_chunk(
                rid=rid, output_ids=list(made), prompt_tokens=len(prompt), completion_tokens=len(made),
                finish=finish, weight_version=self.weight_version, text="x" * len(made),  # cumulative, as SGLang
            ))
        await resp.write(wire.DONE_FRAME)
        await resp.write_eof()
        return resp

    async def _answer_once(self, request: web.Request, prompt: list[int], budget: int,
                           rid: str) -> web.StreamResponse:
        """A non-streaming ``/generate``, as SGLang answers it: one object at the end. A scheduler abort
        with a status comes back as that HTTP status (400: ``{"error": ...}``), one without as a 200."""
        finish = self.abort_finish
        status = finish.get("status_code") if finish is not None else None
        if isinstance(status, int) and status >= 400:
            message = FinishReason.from_json(finish).abort_message
            if status == 400:
                return web.json_response(wire.error_object(message), status=400)
            return web.json_response({"detail": message}, status=status)
        made: list[int] = []
        for _ in range(0 if finish is not None else budget):
            if self.die_after_tokens is not None and len(made) >= self.die_after_tokens:
                assert request.transport is not None
                request.transport.close()  # as a crashed engine: no answer at all
                return web.Response()
            if self.stall_after_tokens is not None and len(made) >= self.stall_after_tokens:
                await self._unstall.wait()
            made.append(next_token(prompt + made))
        answer = output_chunk(
            rid=rid, output_ids=made, prompt_tokens=len(prompt), completion_tokens=len(made),
            finish=finish or wire.finish_reason(wire.LENGTH, length=len(made)),
            weight_version=self.weight_version, text="x" * len(made))
        return web.json_response(answer if self.rewrite is None else self.rewrite(answer, 0))


async def start_fakes(n: int) -> list[FakeSGLang]:
    return [await FakeSGLang().start() for _ in range(n)]


def register_active(registry: Registry, fakes: Iterable[FakeSGLang], kind: Kind = Kind.REMOTE) -> list[Instance]:
    """Register the fakes and mark them active at once (as if their first probe had passed)."""
    out = []
    for fake in fakes:
        inst = registry.add("127.0.0.1", fake.port, kind)
        assert registry.transition(inst, State.ACTIVE, "test: healthy")
        out.append(inst)
    return out


# ---------------------------------------------------------------- health probes


@dataclass
class HealthRecorder:
    """Stands in for the health monitor's failure/success hooks: records what the Generator reports.
    With ``marks`` off, a failure is recorded without counting against the instance."""

    failures: list[tuple[str, str]] = field(default_factory=list)
    successes: list[str] = field(default_factory=list)
    marks: bool = True

    def failure(self, inst: Instance, reason: str) -> None:
        if self.marks:
            inst.health.consecutive_failures += 1
        self.failures.append((inst.id, reason))

    def success(self, inst: Instance) -> None:
        inst.health.consecutive_failures = 0
        self.successes.append(inst.id)


class FakeProbe:
    """A :data:`ProbeFn` whose answer the test sets (``status``: an HTTP status, or None for no answer).

    With ``hold`` set, probes wait on it, so a test can act while a probe is in flight.
    """

    def __init__(self, status: int | None = 200) -> None:
        self.status = status
        self.local = False  # the manager itself cannot connect (out of descriptors)
        self.calls: list[tuple[str, str]] = []
        self.hold: asyncio.Event | None = None

    async def __call__(self, base_url: str, path: str, timeout_s: float) -> Probe:
        self.calls.append((base_url, path))
        if self.hold is not None:
            await self.hold.wait()
        if self.local:
            return Probe(None, f"{path}: the manager could not connect: [Errno 24] Too many open files", local=True)
        if self.status is None:
            return Probe(None, f"{path}: connection refused (fake)")
        return Probe(self.status)


# ---------------------------------------------------------------- weight agents


class FakeAgents(AgentClient):
    """The weight agents, in memory: the sender has ``staged`` staged; every call is recorded with its
    body as a plain dict.

    ``sender_down``: the sender cannot be reached (SenderUnavailable); ``fail_pushes``: that many
    pushes fail (PushFailed), then they succeed; ``hold``: pushes wait on it.
    """

    LAYOUT = LayoutBody(alignment=64, total_bytes=0, tensors=[])

    def __init__(self, staged: int | None = 0) -> None:  # no session: nothing here goes over the network
        self.staged = staged
        self.sender_down = False
        self.fail_pushes = 0
        self.hold: asyncio.Event | None = None
        self.activate_hold: asyncio.Event | None = None
        self.fail_activations = 0
        self.calls: list[tuple[str, str, dict[str, Any] | None]] = []

    def count(self, name: str) -> int:
        return sum(1 for call in self.calls if call[0] == name)

    def pushed_to(self) -> list[str]:
        """Receiver URLs that committed a version, in order."""
        return [url for name, url, _ in self.calls if name == "commit"]

    async def layout(self, sender_url: str, sender: int, delta_base: int | None = None) -> LayoutAnswer:
        self.calls.append(("layout", sender_url, None))
        if self.sender_down:
            raise SenderUnavailable(f"sender {sender} at {sender_url}: connection refused (fake)")
        return LayoutAnswer(version=self.staged, layout=self.LAYOUT, fingerprint="fake")

    async def prepare(self, receiver_url: str, req: PrepareRequest) -> PrepareAnswer:
        self.calls.append(("prepare", receiver_url, req.model_dump(exclude_none=True)))
        return PrepareAnswer(session_ids=["fake-session"], buffer_addr=0, buffer_bytes=0, fingerprint="fake")

    async def push(self, sender_url: str, sender: int, req: PushRequest) -> PushAnswer:
        self.calls.append(("push", sender_url, req.model_dump(exclude_none=True)))
        if self.hold is not None:
            await self.hold.wait()
        if self.fail_pushes > 0:
            self.fail_pushes -= 1
            raise PushFailed(f"POST {sender_url}/push -> HTTP 500: transfer failed (fake)", 500)
        return PushAnswer(version=req.version, bytes=1 << 20, seconds=0.001, gbps=1.0, shards=[], checksums=[],
                          fingerprint="fake")

    async def commit(self, receiver_url: str, req: CommitRequest) -> CommitAnswer:
        self.calls.append(("commit", receiver_url, req.model_dump(exclude_none=True)))
        return CommitAnswer(ok=True, version=req.version, verify_s=0.0, load_s=0.0, buckets=0,
                            staged=True if req.stage else None)

    async def activate(self, receiver_url: str, req: ActivateRequest) -> ActivateAnswer:
        """``activate_hold``: activations wait on it; ``fail_activations``: that many fail after the pause
        (503, SGLang left paused), then they succeed."""
        self.calls.append(("activate", receiver_url, req.model_dump(exclude_none=True)))
        if self.activate_hold is not None:
            await self.activate_hold.wait()
        if self.fail_activations > 0:
            self.fail_activations -= 1
            raise PushFailed(f"POST {receiver_url}/activate -> HTTP 503: load failed after the pause (fake)", 503)
        return ActivateAnswer(version=req.version, mode=req.mode, paused_s=0.25, load_s=0.2, buckets=1, reloaded=3,
                              readback=0)


async def yield_until(predicate: Callable[[], bool], max_yields: int = 1000) -> None:
    """Let other tasks run until ``predicate`` holds: for in-process work that needs no real time
    (a fake probe started, a fake push began). Fails instead of hanging."""
    for _ in range(max_yields):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"condition not reached after {max_yields} event-loop turns")


async def run_pending(turns: int = 10) -> None:
    """Let other tasks run for a few event-loop turns (no time passes): they reach their next wait."""
    for _ in range(turns):
        await asyncio.sleep(0)
