"""Activating a staged version on one box: pause generation, load, record the version, continue.

The receiver agent holds a pushed version *staged* (verified against the trainer's checksums, in its host
buffer) while SGLang keeps serving the previous one. ``POST /activate {version, mode}`` then:

1. ``/pause_generation`` in ``mode``, which SGLang 0.5.23 (``PauseGenerationReqInput``) keeps the requests
   in: ``retract`` (the default) puts every running request back in the waiting queue and frees its KV, so
   the prefix cache can be flushed and each request re-prefills under the new weights when generation
   continues; ``in_place`` leaves them where they are with their KV, and SGLang then refuses a flush while
   any of them runs, so the load skips the flush (use it only where the old weights' cache may be kept).
   Either way SGLang stops decoding, new requests wait at its tokenizer, and weight-update calls run at
   once: unpaused, ``/begin_weight_update`` and every ``/update_weights_from_tensor`` take the
   ``model_update_lock`` writer lock, which waits for every ``/generate`` in flight to finish.
2. The load (:mod:`rollout_manager.sglang.weight_loader`): the changed tensors in buckets inside
   ``/begin_weight_update`` ... ``/end_weight_update`` where the server has sessions, the flush
   (``retract``; once, without a timeout: with one SGLang waits for its waiting queue, holding the retracted
   requests, to empty, which cannot happen while paused), the read-back of a sample,
   ``/update_weight_version`` confirmed by ``/model_info``.
3. ``/continue_generation``: the requests go on; their chunks from here carry the new ``weight_version``.

The guarantee that a failed load never serves a half-loaded model: ``/continue_generation`` is called only
after step 2 succeeded completely. If anything in it fails (or the agent is cancelled), SGLang is left
paused, so it decodes nothing and takes no new request; the agent records why (``/info``
``activation_failed``), answers 503, forgets which tensors SGLang holds (the next load sends every
tensor) and refuses further activations; only a full load through ``/commit`` continues generation. The
manager takes such a box out of service and moves its sequences elsewhere. An agent that dies mid-load
leaves SGLang paused too: its health check then fails and the manager removes it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from rollout_manager.sglang.weight_loader import LoadRefused, NamedTensors
from rollout_manager.weights.protocol import ActivateAnswer, ActivateRequest
from rollout_manager.weights.refused import CommitRefused

if TYPE_CHECKING:
    from rollout_manager.weights.receiver_agent import ReceiverAgent

log = logging.getLogger("rollout_manager.receiver")


async def activate(agent: ReceiverAgent, req: ActivateRequest) -> ActivateAnswer:
    """Steps 1-3 of the module's docstring; the caller holds ``agent.busy``. Raises
    :class:`CommitRefused`: 409 when ``req.version`` is not staged (nothing paused), 502 when SGLang cannot be
    paused (nothing changed), 503 when the load failed after the pause (now or in an earlier activation)."""
    layout, buffer = agent.layout, agent.buffer
    if agent.failed is not None:
        raise CommitRefused(503, f"an earlier activation failed after pausing SGLang ({agent.failed}); only a full "
                                 f"load through /commit serves again")
    if (agent.staged != req.version or layout is None or buffer is None
            or agent.held != (req.version, layout.fingerprint())):
        raise CommitRefused(409, f"version {req.version} is not staged here (staged: {agent.staged}, SGLang serves "
                                 f"{agent.version})")
    await agent.check_layout(layout)  # before the pause: a refusal here changes nothing
    weights = agent._weights()
    names = None if agent.dirty is None or agent.version is None else set(agent.dirty)
    named, loading = await agent.selection(weights, names)
    t0 = time.monotonic()
    try:
        await weights.pause(req.mode)
    except LoadRefused as exc:
        raise CommitRefused(502, f"{exc}; nothing loaded, SGLang serves version {agent.version}") from None
    paused_at = time.monotonic()
    agent.reloaded = len(loading)
    sample = readback_sample(named, agent.readback_tensors, req.version)
    try:
        report = await weights.load(loading, req.version, sample=sample, served=agent._served,
                                    flush="now" if req.mode == "retract" else None)
        load_s = time.monotonic() - paused_at
        await weights.resume()
    except BaseException as exc:  # LoadRefused, a lost connection, a cancelled activation: stay paused
        agent.dirty = None  # what SGLang holds now is not known
        agent.failed = f"activation of version {req.version} ({req.mode}): {exc}"
        log.error("%s; SGLang at %s stays paused (no token from a partly loaded model) until a full load",
                  agent.failed, agent.sglang_url)
        if isinstance(exc, Exception):
            raise CommitRefused(503, f"{agent.failed}; SGLang was paused and stays paused, out of service, "
                                     f"until a full load through /commit succeeds") from None
        raise
    paused_s = time.monotonic() - t0
    agent.version, agent.dirty, agent.staged = req.version, set(), None
    agent.readback = report.readback
    return ActivateAnswer(version=req.version, mode=req.mode, paused_s=round(paused_s, 6), load_s=round(load_s, 6),
                          buckets=report.buckets, reloaded=len(loading), readback=report.readback)


def readback_sample(named: NamedTensors, count: int, version: int) -> NamedTensors:
    """``count`` tensors spread over all of them (every tensor must equal what SGLang holds after a load,
    not only those just sent), starting at a point that moves with the version."""
    if count <= 0 or not named:
        return []
    if count >= len(named):
        return list(named)
    step = len(named) / count
    return [named[(version + int(i * step)) % len(named)] for i in range(count)]
