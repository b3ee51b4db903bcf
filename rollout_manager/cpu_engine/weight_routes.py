"""The CPU engine's weight and cache endpoints, as SGLang 0.5.23 answers them: weight-update sessions,
tensor loads, the weight version, and the prefix-cache flush.

A weight-update call (begin, load, end) takes SGLang's model_update_lock exclusively unless generation is
paused, so it runs only once every /generate in flight has finished (``sglang/srt/managers/
tokenizer_control_mixin.py``); while paused it runs at once. A flush is refused while requests run, or,
unpaused, wait: a 'retract' pause moves them to the waiting queue, so the cache can be flushed then; an
'in_place' pause keeps them running, so it cannot (a load that asks for the flush is in, the call fails).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

from rollout_manager.cpu_engine.engine import Engine
from rollout_manager.cpu_engine.http_common import WEIGHT_SESSION_KEY, engine_of, error_response, json_body
from rollout_manager.cpu_engine.request import RequestRefused
from rollout_manager.sglang import tensor_payload, wire


@asynccontextmanager
async def update_turn(request: web.Request) -> AsyncIterator[None]:
    """Run a weight update now if generation is paused, else after every /generate in flight."""
    if engine_of(request).paused:
        yield
        return
    async with request.app[WEIGHT_SESSION_KEY].lock.exclusive():
        yield


async def flush_cache(request: web.Request) -> web.Response:
    """As SGLang 0.5.23: refused (400) while anything runs or waits (while paused: while anything runs,
    which a 'retract' pause never leaves); ``?timeout=S`` (S > 0) instead waits up to S seconds for nothing
    to run or wait, paused or not (so, paused with requests held, it times out)."""
    engine = engine_of(request)
    try:
        timeout = float(request.query.get("timeout", "0") or 0)
    except ValueError:
        return web.json_response({"detail": "timeout must be a number"}, status=422)
    if timeout < 0:
        return web.json_response({"detail": "timeout must be >= 0"}, status=422)
    if timeout > 0:  # SGLang's SchedulerFlushWrapper: waits for full idle, the waiting queue included
        deadline = asyncio.get_running_loop().time() + timeout
        while engine.busy() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)  # SGLang's scheduler re-checks each loop iteration too
    if (timeout > 0 and engine.busy()) or not engine.flush_cache():
        return web.Response(status=400, text="Timed out waiting for idle state." if timeout else
                            "Flush cache failed.\n")
    return web.Response(status=200, text="Cache flushed.\n")


async def update_weight_version(request: web.Request) -> web.Response:
    engine = engine_of(request)
    try:
        body = await json_body(request)
        if not isinstance(body, dict):
            raise RequestRefused("the body must be a JSON object")
        version = body.get("new_version")
        if not isinstance(version, (str, int)) or isinstance(version, bool) or str(version) == "":
            raise RequestRefused("new_version must be a non-empty string")
        abort_all = body.get("abort_all_requests", True)  # SGLang's default: abort in-flight requests
        if not isinstance(abort_all, bool):
            raise RequestRefused("abort_all_requests must be a boolean")
    except RequestRefused as exc:
        return error_response(str(exc))
    if abort_all:
        engine.abort(abort_all=True, message="Abort by update_weight_version")
    engine.set_weight_version(str(version))
    return web.json_response(
        {"success": True, "message": f"Weight version updated to {version}", "new_version": str(version)}
    )


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    engine = engine_of(request)

    def fail(message: str) -> web.Response:
        return web.json_response({"success": False, "message": message}, status=400)

    try:
        body = await json_body(request)
    except RequestRefused as exc:
        return fail(str(exc))
    if not isinstance(body, dict):
        return fail("the body must be a JSON object")
    payloads = body.get("serialized_named_tensors")
    if not isinstance(payloads, list) or not payloads or not all(isinstance(p, str) for p in payloads):
        return fail("serialized_named_tensors must be a non-empty list of base64 strings (one per TP rank)")
    load_format = body.get("load_format")
    if load_format not in (None, "direct", tensor_payload.FLATTENED_BUCKET):
        return fail(f"load_format {load_format!r} is not supported by this engine (use null, 'direct' or "
                    f"'{tensor_payload.FLATTENED_BUCKET}')")
    version = body.get("weight_version")
    if version is not None and (not isinstance(version, (str, int)) or isinstance(version, bool)):
        return fail("weight_version must be a string")
    if engine.config.dp_size > 1:  # SGLang's tokenizer manager asserts this; the assertion answers 500
        return web.json_response({"success": False, "message": wire.DP_UNSUPPORTED_MESSAGE}, status=500)
    if body.get("abort_all_requests", False) is True:
        engine.abort(abort_all=True, message="Abort by update_weights_from_tensor")
    async with update_turn(request):
        if _sessions(engine) and not request.app[WEIGHT_SESSION_KEY].open:
            return fail(wire.SESSION_REQUIRED_MESSAGE)
        tp_size = engine.config.tp_size
        if len(payloads) < tp_size:  # TP rank r reads entry r: a missing one fails that rank
            return fail(f"serialized_named_tensors has {len(payloads)} entries for tp_size={tp_size}: "
                        f"TP rank r loads entry r, so there must be one per rank")
        try:
            named = await asyncio.to_thread(_own_rank_payloads, payloads[:tp_size],
                                            load_format == tensor_payload.FLATTENED_BUCKET)
            if engine.faults.load_delay_s:
                engine.faults.loading = True
                try:
                    await asyncio.sleep(engine.faults.load_delay_s)
                finally:
                    engine.faults.loading = False
            if engine.faults.load_fail:
                raise ValueError("injected fault load_fail")
            count = await engine.load_weights(named)
        except ValueError as exc:
            return fail(f"Failed to update weights: {exc}")
        message = f"Succeeded to update model weights ({count} tensors)."
        if version is not None:
            engine.set_weight_version(str(version))
            message += f" Weight version updated to {version}."
        if body.get("flush_cache", True) is not False and not engine.flush_cache() and _sessions(engine):
            # SGLang >= 0.5.21: the weights and the version are in, but the prefix cache could not be
            # flushed while requests run or wait, and the call fails.
            return fail(wire.CACHE_NOT_FLUSHED_MESSAGE)
        return web.json_response({"success": True, "message": message})


def _own_rank_payloads(payloads: list[str], flattened: bool = False) -> list[tuple[str, Any]]:
    """Decode each TP rank's own entry as that rank would (and only its own; ``flattened``: a flattened
    bucket), check that every rank got the same tensors, each on its own device, and return rank 0's.
    Raises ValueError."""
    import torch

    decode = tensor_payload.deserialize_bucket if flattened else tensor_payload.deserialize_named_tensors
    ranks = [decode(p) for p in payloads]
    first = ranks[0]
    for rank, named in enumerate(ranks):
        for _, tensor in named:
            if tensor.is_cuda and tensor.device.index != rank:
                raise ValueError(f"TP rank {rank}'s payload holds a tensor on {tensor.device}, not on its own GPU")
        if rank == 0:
            continue
        if [n for n, _ in named] != [n for n, _ in first]:
            raise ValueError(f"TP rank {rank}'s payload names other tensors than rank 0's")
        for (name, tensor), (_, ref) in zip(named, first):
            if tensor.shape != ref.shape or tensor.dtype != ref.dtype or not torch.equal(tensor.cpu(), ref.cpu()):
                raise ValueError(f"TP rank {rank}'s payload differs from rank 0's in {name}")
    return first


def _sessions(engine: Engine) -> bool:
    """Whether the SGLang this engine stands in for has weight-update sessions (0.5.21 and later)."""
    return wire.weight_update_sessions(engine.config.sglang_version) is not False


async def begin_weight_update(request: web.Request) -> web.Response:
    session = request.app[WEIGHT_SESSION_KEY]
    try:
        body = await json_body(request)
        if not isinstance(body, dict) or body.get("selector", "all") not in ("target", "draft", "all"):
            raise RequestRefused("the body must be a JSON object; selector is one of target, draft, all")
    except RequestRefused as exc:
        return error_response(str(exc))
    async with update_turn(request):
        if session.open:
            return web.json_response({"success": False, "message": wire.SESSION_ALREADY_OPEN_MESSAGE}, status=400)
        session.open = True
    return web.json_response({"success": True, "message": "Success"})


async def end_weight_update(request: web.Request) -> web.Response:
    session = request.app[WEIGHT_SESSION_KEY]
    try:
        body = await json_body(request)
        if not isinstance(body, dict):
            raise RequestRefused("the body must be a JSON object")
    except RequestRefused as exc:
        return error_response(str(exc))
    async with update_turn(request):
        if not session.open:
            return web.json_response({"success": False, "message": wire.NO_SESSION_OPEN_MESSAGE}, status=400)
        session.open = False
    return web.json_response({"success": True, "message": "Success"})

