"""Activating a staged version on one box: pause generation, load, record the version, continue.

Runs in: box.

The receiver agent holds a pushed version *staged* (verified against the trainer's checksums, in its host
buffer) while SGLang keeps serving the previous one. ``POST /activate {version, mode}`` then:

1. ``/pause_generation`` in ``mode``, which SGLang 0.5.23 (``PauseGenerationReqInput``) keeps the requests
   in: ``retract`` (the default) puts every running request back in the waiting queue and frees its KV, so
   the prefix cache can be flushed and each request re-prefills under the new weights when generation
   continues; ``in_place`` leaves them where they are with their KV, and SGLang then refuses a flush while
   any of them runs: if any does after the load, they are retracted then, so the flush can run before
   anything reads the old weights' cache (SGLang 0.5.23 has no way to let them finish while holding new
   requests back: see ``SGLangWeights.flush_paused``); an idle box is flushed in place.
   Either way SGLang stops decoding, new requests wait at its tokenizer, and weight-update calls run at
   once: unpaused, ``/begin_weight_update`` and every ``/update_weights_from_tensor`` take the
   ``model_update_lock`` writer lock, which waits for every ``/generate`` in flight to finish.
2. The load (:mod:`rollout_manager.sglang.weight_loader`): the changed tensors in buckets inside
   ``/begin_weight_update`` ... ``/end_weight_update`` where the server has sessions, the flush
   (once, without a timeout: with one SGLang waits for its waiting queue, holding the retracted
   requests, to empty, which cannot happen while paused), ``/update_weight_version`` confirmed by
   ``/model_info``. No tensor is read back here: SGLang's ``/get_weights_by_name`` converts a whole parameter
   to Python floats while nothing generates (tens of seconds for a large embedding), exists for few model
   families and at TP 1 only. What the box serves is checked after the pause by the manager's trust probe
   (``instances/probe.py``), and its tokens at the new version are provisional until that passes.
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
from dataclasses import dataclass

from rollout_manager.sglang.weight_loader import LoadRefused
from rollout_manager.weights.layout import HostBuffer, WeightLayout, unpack
from rollout_manager.weights.protocol import ActivateAnswer, ActivateRequest
from rollout_manager.weights.receiver_loader import Loader
from rollout_manager.weights.refused import CommitRefused

log = logging.getLogger("rollout_manager.receiver")


@dataclass(frozen=True)
class Staged:
    """What the agent's buffer holds for ``/activate``: ``version`` (None: nothing staged) and, where the
    buffer holds that version verified, its layout and bytes (else None)."""

    version: int | None
    layout: WeightLayout | None = None
    buffer: HostBuffer | None = None


async def activate(loader: Loader, staged: Staged, req: ActivateRequest) -> ActivateAnswer:
    """Steps 1-3 of the module's docstring; the caller holds the agent's ``busy`` lock and drops what it
    staged once this returns. Raises :class:`CommitRefused`: 409 when ``req.version`` is not staged (nothing
    paused), 502 when SGLang cannot be paused (nothing changed), 503 when the load failed after the pause (now
    or in an earlier activation)."""
    if loader.failed is not None:
        raise CommitRefused(503, f"an earlier activation failed after pausing SGLang ({loader.failed}); only a full "
                                 f"load through /commit serves again")
    if staged.version != req.version or staged.layout is None or staged.buffer is None:
        raise CommitRefused(409, f"version {req.version} is not staged here (staged: {staged.version}, SGLang serves "
                                 f"{loader.version})")
    await loader.check_layout(staged.layout)  # before the pause: a refusal here changes nothing
    weights = loader.weights()
    named = unpack(staged.buffer, staged.layout)
    loading = await loader.selection(weights, named, loader.changed())
    t0 = time.monotonic()
    try:
        await weights.pause(req.mode)
    except LoadRefused as exc:
        raise CommitRefused(502, f"{exc}; nothing loaded, SGLang serves version {loader.version}") from None
    paused_at = time.monotonic()
    loader.reloaded = len(loading)
    try:
        report = await weights.load(loading, req.version, served=loader.served,
                                    flush="now" if req.mode == "retract" else "in_place")
        load_s = time.monotonic() - paused_at
        await weights.resume()
    except BaseException as exc:  # LoadRefused, a lost connection, a cancelled activation: stay paused
        loader.fail_activation(f"activation of version {req.version} ({req.mode}): {exc}")
        log.error("%s; SGLang at %s stays paused (no token from a partly loaded model) until a full load",
                  loader.failed, loader.sglang_url)
        if isinstance(exc, Exception):
            raise CommitRefused(503, f"{loader.failed}; SGLang was paused and stays paused, out of service, "
                                     f"until a full load through /commit succeeds") from None
        raise
    paused_s = time.monotonic() - t0
    loader.loaded(req.version, report)
    return ActivateAnswer(version=req.version, mode=req.mode, paused_s=round(paused_s, 6), load_s=round(load_s, 6),
                          buckets=report.buckets, reloaded=len(loading), readback=0)
