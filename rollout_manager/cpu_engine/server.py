"""HTTP face of the CPU engine: SGLang's endpoints (paths and encoders from sglang_wire) plus /debug/*.

Handlers only parse, validate and call into :class:`engine.Engine`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import signal
import sys
import uuid
from typing import Any

from aiohttp import web

from rollout_manager.cpu_engine import routed_experts
from rollout_manager.cpu_engine.contract import generate_contract_error
from rollout_manager.cpu_engine.encode import metrics_text
from rollout_manager.cpu_engine.engine import CallGroup, Engine, EngineConfig
from rollout_manager.cpu_engine.http_common import ENGINE_KEY, WEIGHT_SESSION_KEY, WeightSession
from rollout_manager.cpu_engine.http_common import engine_of as _engine
from rollout_manager.cpu_engine.http_common import error_response as _error
from rollout_manager.cpu_engine.http_common import json_body as _json_body
from rollout_manager.cpu_engine.model import EngineSampling
from rollout_manager.cpu_engine.request import EngineRequest, RequestRefused, SequenceSpec
from rollout_manager.cpu_engine.weight_routes import (
    begin_weight_update,
    end_weight_update,
    flush_cache,
    update_weight_version,
    update_weights_from_tensor,
)
from rollout_manager.sglang import wire
from rollout_manager.sglang.finish import FinishReason
from rollout_manager.sglang.logprob_probe import is_probe
from rollout_manager.sglang.sse import sse_frame

log = logging.getLogger("rollout_manager.cpu_engine")

STOP_KEY = web.AppKey("stop", asyncio.Event)

DEBUG_FAULTS = "/debug/faults"
DEBUG_CHECKSUM = "/debug/state_dict_checksum"
DEBUG_PREFIX_CACHE = "/debug/prefix_cache"

VERSION = "cpu-engine-0.1"


# ------------------------------------------------------------------ /generate


async def generate(request: web.Request) -> web.StreamResponse:
    """SGLang's order: FastAPI's model of the body (here only its R3 fields), the schema contract
    (``400 {"error": "..."}``), then the tokenizer's checks
    (for a stream an error frame inside a 200 stream, else ``400 {"error": {"message": ...}}``),
    then the scheduler's (an abort finish that carries a ``status_code``)."""
    engine = _engine(request)
    try:
        body = await _json_body(request)
    except RequestRefused as exc:
        return _error(str(exc))
    unreadable = routed_experts.field_error(body)
    if unreadable is not None:
        return web.json_response(unreadable, status=400)
    violation = generate_contract_error(body)
    if violation is not None:
        return web.json_response({"error": violation}, status=400)
    stream = body.get("stream") is True
    try:
        req = engine.parse(body)
    except RequestRefused as exc:
        return await _refuse(request, str(exc), stream=stream)
    # The manager's trust probe is the engine's own business, as /health_generate is: no fault or count bites it.
    probe = is_probe(body)
    if not probe and engine.faults.should_fail_request():
        status = engine.faults.fail_status
        return _error(f"injected failure (fail_rate={engine.faults.fail_rate})", status, "ServiceUnavailable")
    # SGLang's model_update_lock, held shared for the request's life: a weight update waits for it.
    async with request.app[WEIGHT_SESSION_KEY].lock.shared():
        return await _run(request, engine, req, internal=probe)


async def _run(request: web.Request, engine: Engine, req: EngineRequest, *,
               internal: bool = False) -> web.StreamResponse:
    try:
        group = engine.submit(req, internal=internal)
    except RequestRefused as exc:
        return await _refuse(request, str(exc), stream=req.stream)
    if req.stream:
        return await _stream(request, engine, group)
    try:
        while not group.finished:
            group.changed.clear()
            await group.changed.wait()
    finally:
        if not group.finished:
            engine.cancel_group(group)
    for s in group.sequences:  # a scheduler refusal fails the whole non-streamed request
        if s.finish is None:
            continue
        refused = s.finish.caller_status or _server_abort_status(s.finish)
        if refused == 400:
            return web.json_response({"error": {"message": s.finish.abort_message}}, status=400)
        if refused is not None:
            return web.json_response({"detail": s.finish.abort_message}, status=refused)
    outs = [engine.chunk(s, len(s.output_ids), final=True) for s in group.sequences]
    return web.json_response(outs if req.batched else outs[0])


def _server_abort_status(finish: FinishReason) -> int | None:
    """A 5xx ``status_code`` of an abort finish (SGLang answers it as an HTTP error too)."""
    status = finish.status_code if finish.is_abort else None
    return status if isinstance(status, int) and 500 <= status < 600 else None


async def _refuse(request: web.Request, message: str, *, stream: bool) -> web.StreamResponse:
    """A request the tokenizer stage refuses: SGLang has already started a stream by then."""
    if not stream:
        return _error(message)
    resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    error = {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}
    await resp.write(sse_frame({"error": error}))
    await resp.write(wire.DONE_FRAME)
    await resp.write_eof()
    return resp


async def _stream(request: web.Request, engine: Engine, group: CallGroup) -> web.StreamResponse:
    resp = web.StreamResponse(
        status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    incremental = engine.config.incremental_streaming_output
    stepped = [0] * len(group.sequences)  # tokens looked at (one decoding step each)
    sent = [0] * len(group.sequences)  # tokens sent to the client
    closed = [False] * len(group.sequences)
    try:
        await resp.prepare(request)
        while True:
            group.changed.clear()
            for i, s in enumerate(group.sequences):
                if closed[i]:
                    continue
                finished = s.finish is not None
                n = len(s.output_ids)
                interval = s.spec.stream_interval or engine.config.stream_interval
                while stepped[i] < n:  # SGLang's output streamer, step by step
                    k = stepped[i] = stepped[i] + 1
                    final = finished and k == n
                    unsent = k - sent[i]
                    if not (final or interval == 1 or unsent >= interval or (sent[i] == 0 and unsent > 0)):
                        continue
                    chunk = engine.chunk(s, k, since=sent[i] if incremental else 0, final=final)
                    await resp.write(sse_frame(chunk))
                    engine.faults.note_emitted(unsent)
                    sent[i] = k
                    closed[i] = final
                if finished and not closed[i]:  # finished without a new token (abort, max_new_tokens=0)
                    chunk = engine.chunk(s, n, since=sent[i] if incremental else 0, final=True)
                    await resp.write(sse_frame(chunk))
                    closed[i] = True
            if all(closed):
                break
            await group.changed.wait()
        await resp.write(wire.DONE_FRAME)
        await resp.write_eof()
    except (ConnectionResetError, ConnectionError) as exc:
        log.debug("stream client went away: %s", exc)
    finally:
        if not group.finished:  # the client went away (or we are shutting down)
            engine.cancel_group(group)
    return resp


# ------------------------------------------------------------------ health and info


async def health(request: web.Request) -> web.Response:
    if _engine(request).faults.health_fail or _engine(request).faults.loading:
        return web.Response(status=503, text="unhealthy (injected)")
    return web.Response(status=200)


async def health_generate(request: web.Request) -> web.Response:
    engine = _engine(request)
    if engine.faults.health_fail or engine.faults.loading:
        return web.Response(status=503, text="unhealthy (injected)")
    if engine.paused:
        return web.Response(status=503, text="generation is paused")
    spec = SequenceSpec(
        rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
        input_ids=[0],
        params=EngineSampling(max_new_tokens=1, temperature=0.0),
        return_logprob=False,
        index=None,
    )
    group = engine.submit(EngineRequest([spec], stream=False, batched=False), internal=True)
    try:
        await asyncio.wait_for(_wait_finished(group), engine.config.health_generate_timeout_s)
    except asyncio.TimeoutError:
        return web.Response(status=503, text="health generation timed out")
    finally:
        if not group.finished:
            engine.cancel_group(group)
    if group.sequences[0].output_ids:
        return web.Response(status=200)
    return web.Response(status=503, text="health generation was aborted")


async def _wait_finished(group: CallGroup) -> None:
    while not group.finished:
        group.changed.clear()
        await group.changed.wait()


def server_info_dict(engine: Engine) -> dict[str, Any]:
    cfg = engine.model.config
    running, queued = engine.counts()
    name = engine.config.served_model_name or f"cpu-engine-{engine.config.model_size}"
    return {
        "version": engine.config.sglang_version,
        "tp_size": engine.config.tp_size,
        "dp_size": engine.config.dp_size,
        "base_gpu_id": 0,
        "gpu_id_step": 1,
        "model_path": f"cpu-engine/{engine.config.model_size}",
        "dtype": "float32",  # what the weights are computed in (SGLang reports its --dtype flag here)
        "quantization": None,
        "served_model_name": name,
        "skip_tokenizer_init": True,
        "context_length": engine.config.context_length,  # SGLang reports its flag here (None unless given)
        "stream_interval": engine.config.stream_interval,
        "weight_version": engine.weight_version,
        "incremental_streaming_output": engine.config.incremental_streaming_output,
        "max_running_requests": engine.config.max_running_requests,
        "random_seed": engine.config.seed,
        "enable_return_routed_experts": engine.config.enable_return_routed_experts,
        "speculative_algorithm": None,  # it drafts nothing
        "model_config": cfg.to_dict(),
        "internal_states": [{"last_gen_throughput": float(engine.last_gen_throughput)}],
        # Engine-specific (SGLang 0.5.23 has no such counts in server_info): for debugging only.
        "cpu_engine": {
            "engine_version": VERSION,
            "running": running,
            "queued": queued,
            "paused": engine.paused,
            "total_generated_tokens": engine.total_generated,
            "faults": engine.faults.snapshot(),
        },
    }


async def server_info(request: web.Request) -> web.Response:
    return web.json_response(server_info_dict(_engine(request)))


def model_info_dict(engine: Engine) -> dict[str, Any]:
    """SGLang 0.5.23's ``/model_info`` (the parts that apply), with the live ``weight_version``."""
    return {
        "model_path": f"cpu-engine/{engine.config.model_size}",
        "served_model_name": engine.config.served_model_name or f"cpu-engine-{engine.config.model_size}",
        "tokenizer_path": None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.weight_version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        # Not SGLang's (its /model_info has no vocabulary size): lets the manager check token ids exactly.
        "vocab_size": engine.model.config.vocab_size,
    }


async def model_info(request: web.Request) -> web.Response:
    return web.json_response(model_info_dict(_engine(request)))


async def metrics(request: web.Request) -> web.Response:
    engine = _engine(request)
    running, queued = engine.counts()
    name = engine.config.served_model_name or f"cpu-engine-{engine.config.model_size}"
    text = metrics_text(
        {
            wire.METRIC_NUM_RUNNING_REQS: running,
            wire.METRIC_NUM_QUEUE_REQS: queued,
            wire.METRIC_GEN_THROUGHPUT: engine.last_gen_throughput,
        },
        model_name=name,
    )
    return web.Response(text=text, content_type="text/plain")


# ------------------------------------------------------------------ control


async def abort_request(request: web.Request) -> web.Response:
    engine = _engine(request)
    try:
        body = await _json_body(request, required=False)
        if not isinstance(body, dict):
            raise RequestRefused("the body must be a JSON object")
        rid = body.get("rid") or None
        abort_all = body.get("abort_all", False)
        if rid is not None and not isinstance(rid, str):
            raise RequestRefused("rid must be a string")
        if not isinstance(abort_all, bool):
            raise RequestRefused("abort_all must be a boolean")
    except RequestRefused as exc:
        return _error(str(exc))
    engine.abort(rid, abort_all=abort_all)
    return web.Response(status=200)


async def pause_generation(request: web.Request) -> web.Response:
    engine = _engine(request)
    try:
        body = await _json_body(request, required=False)
        mode = body.get("mode", "abort") if isinstance(body, dict) else "abort"
        await engine.pause(mode)
    except RequestRefused as exc:
        return _error(str(exc))
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    _engine(request).resume()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def not_found(request: web.Request) -> web.Response:
    """What FastAPI answers for a route the emulated (older) SGLang does not have."""
    return web.json_response({"detail": "Not Found"}, status=404)


async def shutdown(request: web.Request) -> web.Response:
    request.app[STOP_KEY].set()
    return web.json_response({"success": True, "message": "shutting down"})


# ------------------------------------------------------------------ debug (engine-specific)


async def prefix_cache(request: web.Request) -> web.Response:
    """What the prefix cache model saw: ``stale_reads`` (client prefills that read KV older weights made)."""
    cache = _engine(request).prefix_cache
    return web.json_response({"stale_reads": cache.stale_reads, "stale_tokens": cache.stale_tokens,
                              "cached_tokens": cache.nodes, "flushes": cache.generation})


async def get_faults(request: web.Request) -> web.Response:
    return web.json_response(_engine(request).faults.snapshot())


async def set_faults(request: web.Request) -> web.Response:
    engine = _engine(request)
    try:
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise RequestRefused("the body must be a JSON object")
        engine.faults.update(body)
    except (RequestRefused, ValueError) as exc:
        return _error(str(exc))
    engine.kick()  # a lifted stall resumes at once
    return web.json_response(engine.faults.snapshot())


async def state_dict_checksum(request: web.Request) -> web.Response:
    engine = _engine(request)
    sums = await engine.checksums()
    total = hashlib.sha256("".join(f"{k}={v};" for k, v in sorted(sums.items())).encode()).hexdigest()
    return web.json_response({"weight_version": engine.weight_version, "total": total, "tensors": sums})


# ------------------------------------------------------------------ app and process


def create_app(engine_config: EngineConfig | None = None) -> web.Application:
    config = engine_config or EngineConfig()
    app = web.Application(client_max_size=1 << 30)
    app[STOP_KEY] = asyncio.Event()
    app[WEIGHT_SESSION_KEY] = WeightSession()

    async def on_startup(app: web.Application) -> None:
        engine = Engine(config)
        app[ENGINE_KEY] = engine
        engine.start()

    async def on_shutdown(app: web.Application) -> None:
        # End open streams (finish_reason abort) before the server waits for its handlers.
        if ENGINE_KEY in app:
            app[ENGINE_KEY].abort(abort_all=True, message="Server shutting down")

    async def on_cleanup(app: web.Application) -> None:
        if ENGINE_KEY in app:
            await app[ENGINE_KEY].close()

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    r = app.router
    r.add_post(wire.GENERATE, generate)
    r.add_get(wire.HEALTH, health)
    r.add_get(wire.HEALTH_GENERATE, health_generate)
    r.add_get(wire.SERVER_INFO, server_info)
    r.add_get(wire.GET_SERVER_INFO, server_info)
    r.add_get(wire.MODEL_INFO, model_info)
    r.add_get(wire.GET_MODEL_INFO, model_info)
    r.add_get(wire.METRICS, metrics)
    r.add_post(wire.ABORT_REQUEST, abort_request)
    r.add_post(wire.PAUSE_GENERATION, pause_generation)
    r.add_post(wire.CONTINUE_GENERATION, continue_generation)
    r.add_post(wire.FLUSH_CACHE, flush_cache)
    r.add_get(wire.FLUSH_CACHE, flush_cache)
    r.add_post(wire.UPDATE_WEIGHT_VERSION, update_weight_version)
    r.add_post(wire.UPDATE_WEIGHTS_FROM_TENSOR, update_weights_from_tensor)
    sessions = wire.weight_update_sessions(config.sglang_version) is not False
    r.add_post(wire.BEGIN_WEIGHT_UPDATE, begin_weight_update if sessions else not_found)
    r.add_post(wire.END_WEIGHT_UPDATE, end_weight_update if sessions else not_found)
    r.add_post(wire.SHUTDOWN, shutdown)
    r.add_get(DEBUG_FAULTS, get_faults)
    r.add_post(DEBUG_FAULTS, set_faults)
    r.add_get(DEBUG_CHECKSUM, state_dict_checksum)
    r.add_get(DEBUG_PREFIX_CACHE, prefix_cache)
    return app


async def serve(host: str, port: int, engine_config: EngineConfig | None = None) -> None:
    """Serve until SIGTERM/SIGINT or POST /shutdown; print one ready line with the bound port."""
    config = engine_config or EngineConfig()
    app = create_app(config)
    stop = app[STOP_KEY]
    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
            pass
    engine = app[ENGINE_KEY]
    print(
        f"cpu-engine ready on http://{host}:{bound} (model={config.model_size} seed={config.seed} "
        f"weight_version={engine.weight_version} incremental={config.incremental_streaming_output})",
        flush=True,
    )
    try:
        await stop.wait()
        log.info("cpu-engine shutting down")
    finally:
        await runner.cleanup()


def run(host: str = "127.0.0.1", port: int = 30000, engine_config: EngineConfig | None = None) -> int:
    """Blocking entry point; returns the process exit status."""
    try:
        asyncio.run(serve(host, port, engine_config))
    except OSError as exc:
        print(f"cpu-engine: cannot serve on {host}:{port}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0
