"""Loading verified tensors into one SGLang server, as SGLang 0.5.23's contract demands (the receiver
agent's SGLang side; docs/sglang-contract.md says why each step is there).

One load:

1. ``/server_info`` (tp_size, dp_size, version, model_path, dtype); a data-parallel server is refused.
2. ``/update_weights_from_tensor`` in buckets of ``bucket_bytes``, each one flat tensor (``load_format``
   ``flattened_bucket``: a MoE model's thousands of small expert tensors cost one tensor per bucket, not one
   each), with ``flush_cache`` false and no ``weight_version``, inside
   a weight-update session (``/begin_weight_update`` ... ``/end_weight_update``) from 0.5.21 on. Flushing
   inside the update call fails the call when requests run (0.5.22+: HTTP 400, and the version is then
   not recorded; 0.5.12-0.5.21: an assert that kills the server).
3. ``/flush_cache?timeout=S``: SGLang flushes once it is idle, waiting up to S seconds. No flush, no
   commit: a prefix cache the old weights made would mix versions inside one sequence. Paused (an
   activation, and the receiver agent's full loads), once without a timeout, after retracting
   whatever an ``in_place`` pause left running (:meth:`SGLangWeights.flush_paused`).
4. Only where asked (``readback_tensors`` > 0, the drain path's ``/commit`` alone; never inside an
   activation's pause): ``/get_weights_by_name`` for a sample of tensors, compared with what was sent (where
   SGLang offers it: Llama-family models, TP 1); a mismatch refuses the commit (the load was silently
   partial). SGLang converts the whole parameter to Python floats for it, so it is off by default: the
   manager's trust probe checks what every box serves instead (``instances/probe.py``).
5. ``/update_weight_version`` with ``abort_all_requests`` false, then ``/model_info`` must report it:
   success is never declared on SGLang's silence.

Every call carries SGLang's admin key where one is set (:class:`~rollout_manager.sglang.auth.SGLangAuth`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import torch

from rollout_manager.sglang import tensor_payload, wire
from rollout_manager.sglang.auth import SGLangAuth
from rollout_manager.sglang.checkpoint import ServedModel, served_model

log = logging.getLogger("rollout_manager.receiver")

GET_WEIGHTS_BY_NAME = "/get_weights_by_name"
NamedTensors = list[tuple[str, torch.Tensor]]
FlushWhen = Literal["when_idle", "now", "in_place"] | None


class LoadRefused(Exception):
    """SGLang did not take the load (``status``: what the agent answers the manager)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class LoadSettings:
    bucket_bytes: int = 256 << 20
    load_timeout_s: float = 600.0
    flush_wait_s: float = 30.0  # how long SGLang may take to go idle for the cache flush
    readback_tensors: int = 0  # tensors read back after a /commit load (0: none; activations never read back)
    readback_rows: int = 4  # leading rows of each (SGLang's truncate_size)


@dataclass(frozen=True)
class ServerFacts:
    """What one ``/server_info`` says that a load needs."""

    info: wire.ServerInfo
    model_path: str | None
    dtype: str | None  # the served dtype as launched ("auto": the checkpoint's)

    @classmethod
    def from_json(cls, raw: Any) -> ServerFacts:
        raw = raw if isinstance(raw, dict) else {}
        path, dtype = raw.get("model_path"), raw.get("dtype")
        return cls(wire.ServerInfo.from_json(raw), path if isinstance(path, str) else None,
                   dtype if isinstance(dtype, str) else None)


@dataclass(frozen=True)
class LoadReport:
    buckets: int
    readback: int  # tensors read back and found equal (0: SGLang offers no read-back here)


class SGLangWeights:
    """One SGLang server's weight endpoints, through one aiohttp session."""

    def __init__(self, session: aiohttp.ClientSession, url: str, auth: SGLangAuth | None = None,
                 settings: LoadSettings | None = None):
        self.session = session
        self.url = url.rstrip("/")
        self.auth = auth or SGLangAuth()
        self.settings = settings or LoadSettings()

    # ------------------------------------------------------------ reading
    async def _get(self, path: str, what: str) -> Any:
        try:
            async with self.session.get(self.url + path, headers=self.auth.headers(),
                                        timeout=aiohttp.ClientTimeout(total=30)) as r:
                if r.status != 200:
                    raise LoadRefused(502, f"SGLang's {path} answered HTTP {r.status}{_key_hint(r.status)}")
                return await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise LoadRefused(502, f"cannot read SGLang's {what}: {type(exc).__name__}: {exc}") from None

    async def server_facts(self) -> ServerFacts:
        return ServerFacts.from_json(await self._get(wire.SERVER_INFO, wire.SERVER_INFO))

    async def reported_version(self) -> str | None:
        """The weight version SGLang reports now (``/model_info``; what its outputs carry)."""
        model = await self._get(wire.MODEL_INFO, wire.MODEL_INFO)
        version = model.get("weight_version") if isinstance(model, dict) else None
        return None if version is None else str(version)

    async def served_model(self, facts: ServerFacts | None = None) -> ServedModel | None:
        """The served checkpoint's names and shapes, when its files are on this box (see checkpoint.py)."""
        facts = facts or await self.server_facts()
        if not facts.model_path:
            return None
        return await asyncio.to_thread(served_model, facts.model_path)

    # ------------------------------------------------------------ loading
    async def load(self, named: NamedTensors, version: int | str, *, sample: NamedTensors | None = None,
                   served: ServedModel | None = None, flush: FlushWhen = "when_idle") -> LoadReport:
        """Steps 1-5 of the module's docstring; ``sample``: the tensors to read back (name, what SGLang
        must now hold); ``served``: the checkpoint, whose dtypes SGLang keeps under ``--dtype auto``;
        ``flush``: "when_idle" (step 3), "now" (paused in 'retract' mode: once, without waiting, which is the
        only flush SGLang takes while the retracted requests wait), "in_place" (paused in 'in_place' mode:
        :meth:`flush_paused`), None (skipped).
        Raises :class:`LoadRefused`; the weight-update session is closed whatever happens."""
        facts = await self.server_facts()
        info = facts.info
        if info.dp_size > 1:
            raise LoadRefused(409, wire.dp_refusal(self.url, info.dp_size))
        buckets = self._buckets(named)
        opened = await self._begin_session(wire.weight_update_sessions(info.version))
        try:
            for i, bucket in enumerate(buckets):
                payloads, keep_alive = await asyncio.to_thread(_payloads, bucket, info, torch.cuda.is_available())
                body = {**wire.update_weights_from_tensor_body(payloads, flush_cache=False, weight_version=None),
                        "load_format": tensor_payload.FLATTENED_BUCKET}
                await self._call(wire.UPDATE_WEIGHTS_FROM_TENSOR, body, f"bucket {i}")
                del keep_alive  # SGLang has copied the tensors its IPC handles point at
        except BaseException:
            if opened:  # close the session whatever happened, or SGLang refuses the next begin
                try:
                    await self._call(wire.END_WEIGHT_UPDATE, wire.end_weight_update_body(), "end_weight_update")
                except (LoadRefused, aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    log.warning("could not close the weight-update session after a failed load: %s", exc)
            raise
        if opened:
            await self._call(wire.END_WEIGHT_UPDATE, wire.end_weight_update_body(), "end_weight_update")
        if flush == "in_place":
            await self.flush_paused()
        elif flush is not None:
            await self.flush_when_idle(now=flush == "now")
        readback = await self.read_back(sample, facts, served) if sample else 0
        await self.set_version(version)
        return LoadReport(len(buckets), readback)

    def _buckets(self, named: NamedTensors) -> list[NamedTensors]:
        buckets: list[NamedTensors] = [[]]
        size = 0
        for name, tensor in named:
            if buckets[-1] and size + tensor.nbytes > self.settings.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append((name, tensor))
            size += tensor.nbytes
        return buckets

    async def set_version(self, version: int | str) -> None:
        """``/update_weight_version`` (in-flight requests kept), then ``/model_info`` must say it."""
        await self._call(wire.UPDATE_WEIGHT_VERSION, wire.update_weight_version_body(version), "update_weight_version")
        reported = await self.reported_version()
        if reported != str(version):
            raise LoadRefused(502, f"SGLang took version {version} but reports weight_version {reported!r}")

    async def pause(self, mode: str) -> None:
        """``/pause_generation`` in ``mode`` ("retract" or "in_place"): SGLang keeps its requests and stops
        decoding; weight-update calls then run at once instead of waiting for every request to finish."""
        await self._post_ok(wire.PAUSE_GENERATION, {"mode": mode}, f"pause_generation ({mode})")

    async def resume(self) -> None:
        """``/continue_generation``: the paused requests go on (a retracted one re-prefills first)."""
        await self._post_ok(wire.CONTINUE_GENERATION, {}, "continue_generation")

    async def _post_ok(self, path: str, body: dict[str, Any], what: str) -> None:
        status, text = await self._admin_post(path, body, what)
        text = text[:300]
        if status != 200:
            raise LoadRefused(502, f"SGLang refused {what}: HTTP {status} {text.strip()}{_key_hint(status)}")

    async def flush_paused(self) -> None:
        """Paused in place, after the load: flush the prefix cache before any request can read it. SGLang
        refuses the flush while the requests paused in place run, and offers no way to let them finish while
        holding new ones back (those wait only while paused; its writer lock is taken only unpaused, and by
        then the requests released by ``/continue_generation`` hold it shared): so they are retracted first
        (their KV, the old weights', is freed; they re-prefill under the new weights), then flushed."""
        status, _ = await self._flush(0.0)
        if status == 200:
            return
        log.info("SGLang at %s runs requests paused in place: retracting them so the old weights' cache can "
                 "be flushed before anything reads it", self.url)
        await self.pause("retract")
        await self.flush_when_idle(now=True)

    async def _flush(self, wait: float) -> tuple[int, str]:
        try:
            async with self.session.post(self.url + wire.flush_cache_path(wait), headers=self.auth.admin_headers(),
                                         timeout=aiohttp.ClientTimeout(total=wait + 30)) as r:
                return r.status, (await r.text())[:200]
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise LoadRefused(502, f"the weights are loaded but /flush_cache failed: {exc}") from None

    async def flush_when_idle(self, now: bool = False) -> None:
        """Flush SGLang's prefix cache once nothing runs there, waiting up to ``flush_wait_s``; ``now``: once,
        at once. Paused, SGLang ignores its waiting queue for a flush without a timeout only: one with a
        timeout waits for the queue to empty too (``SchedulerFlushWrapper``), which never happens paused."""
        wait = 0.0 if now else self.settings.flush_wait_s
        status, text = await self._flush(wait)
        if status != 200:
            raise LoadRefused(503, f"the weights are loaded but SGLang's prefix cache could not be flushed "
                                   f"within {wait:g}s (requests still running or queued there): HTTP {status} "
                                   f"{text.strip()}{_key_hint(status)}")

    async def read_back(self, sample: NamedTensors, facts: ServerFacts, served: ServedModel | None = None) -> int:
        """Compare the leading rows SGLang serves for each sampled tensor with what it must hold. Returns
        how many were compared (0 where SGLang offers no read-back: a model without
        ``get_weights_by_name``, such as Qwen2, or TP > 1, where rank 0 holds a slice)."""
        if facts.info.tp_size > 1:
            return 0
        rows = max(self.settings.readback_rows, 1)
        checked = 0
        for name, tensor in sample:
            status, text = await self._admin_post(GET_WEIGHTS_BY_NAME, {"name": name, "truncate_size": rows},
                                                  f"read-back of {name!r}", timeout_s=60.0)
            answer = _parse_json(text) if status == 200 else None
            if answer is None:
                if status in (401, 403):
                    raise LoadRefused(502, f"SGLang refused {GET_WEIGHTS_BY_NAME}: HTTP {status}{_key_hint(status)}")
                if checked == 0:
                    log.info("SGLang at %s offers no read-back of %s (HTTP %d): loads are not read back",
                             self.url, name, status)
                    return 0
                raise LoadRefused(502, f"SGLang could not read back {name!r} after the load: HTTP {status}")
            known = served.tensors.get(name) if served is not None else None
            dtype = _served_dtype(facts.dtype, known.dtype if known is not None else None, tensor.dtype)
            expected = tensor[:rows].to(dtype).to(torch.float32)
            try:
                got = torch.tensor(answer, dtype=torch.float32)
            except (TypeError, ValueError):
                raise LoadRefused(502, f"SGLang read back {name!r} as something not a tensor") from None
            if got.shape != expected.shape or not torch.equal(got, expected):
                raise LoadRefused(502, f"SGLang serves other values for {name!r} than were loaded (a silent partial "
                                       f"load: stale weights); the version is not set")
            checked += 1
        return checked

    # ------------------------------------------------------------ calls
    async def _admin_post(self, path: str, body: dict[str, Any], what: str,
                          timeout_s: float | None = None) -> tuple[int, str]:
        """(status, text) of a POST to an admin endpoint. No answer within ``timeout_s`` (default: the
        load timeout) is a :class:`LoadRefused` (504) that names the call and the bound; a lost
        connection is one too (502): never a bare exception the agent would answer without a word."""
        limit = self.settings.load_timeout_s if timeout_s is None else timeout_s
        try:
            async with self.session.post(self.url + path, json=body, headers=self.auth.admin_headers(),
                                         timeout=aiohttp.ClientTimeout(total=limit)) as r:
                return r.status, await r.text()
        except asyncio.TimeoutError:
            bound = "the receiver's load timeout (--load-timeout-s)" if timeout_s is None else "its bound"
            raise LoadRefused(504, f"SGLang's {what} did not answer within {bound}: {limit:g} s") from None
        except aiohttp.ClientError as exc:
            raise LoadRefused(502, f"SGLang's {what} failed: {type(exc).__name__}: {exc}") from None

    async def _call(self, path: str, body: dict[str, Any], what: str) -> dict[str, Any]:
        """POST to an admin endpoint; anything but 200 with ``success`` true is a :class:`LoadRefused`."""
        status, text = await self._admin_post(path, body, what)
        answer = _answer(text)
        if status != 200 or not answer.get("success", False):
            raise LoadRefused(502, f"SGLang refused {what}: HTTP {status} {answer}{_key_hint(status)}")
        return answer

    async def _begin_session(self, sessions: bool | None) -> bool:
        """Open a weight-update session where the server has them (``sessions``: from its version; None
        when unknown: a 404 then means an older server without them). Returns whether one was opened."""
        if sessions is False:
            return False
        for attempt in range(2):
            status, text = await self._admin_post(wire.BEGIN_WEIGHT_UPDATE, wire.begin_weight_update_body(),
                                                  "begin_weight_update")
            answer = _answer(text)
            if status == 200 and answer.get("success", False):
                return True
            if status == 404 and sessions is None:
                return False
            if attempt == 0 and answer.get("message") == wire.SESSION_ALREADY_OPEN_MESSAGE:
                # Left open by a load that died half-way (this agent is the only one loading): close it.
                log.warning("SGLang had a weight-update session open from an earlier load; closing it")
                await self._call(wire.END_WEIGHT_UPDATE, wire.end_weight_update_body(), "end_weight_update")
                continue
            raise LoadRefused(502, f"SGLang refused begin_weight_update: HTTP {status} {answer}{_key_hint(status)}")
        raise AssertionError("unreachable")


def _payloads(bucket: NamedTensors, info: wire.ServerInfo, cuda: bool) -> tuple[list[str], list[torch.Tensor]]:
    """One ``serialized_named_tensors`` entry per TP rank, each for that rank, as SGLang's own
    ``weight_sync`` helper builds them: the bucket packed into one flat tensor (``load_format``
    flattened_bucket: one copy of its bytes, one tensor to pickle however many it holds); on a GPU box rank r
    gets an IPC handle to a copy on its own GPU (SGLang's rank r opens entry r only, and must not map another
    rank's device); on CPU every rank gets the bytes by value. Also returns the tensors the handles point at,
    to keep alive.

    Device indices are pickled as numbers, which SGLang's patched reductions accept as they are:
    the agent must see the GPUs as SGLang does (launch_sglang.sh starts both with one environment).
    """
    packed = tensor_payload.pack_bucket(bucket)  # views share the whole buffer's storage: never pickle them
    if not cuda:
        return [tensor_payload.serialize_bucket(packed)] * info.tp_size, []
    payloads: list[str] = []
    keep: list[torch.Tensor] = []
    for rank in range(info.tp_size):
        gpu = info.gpu_of_rank(rank)
        if gpu >= torch.cuda.device_count():
            raise LoadRefused(500, f"SGLang's TP rank {rank} runs on GPU {gpu}, which this agent does not see "
                                   f"({torch.cuda.device_count()} visible); start it with SGLang's "
                                   f"CUDA_VISIBLE_DEVICES")
        on_gpu = packed.data.to(f"cuda:{gpu}")
        torch.cuda.synchronize(gpu)
        payloads.append(tensor_payload.serialize_bucket(packed, on_gpu, share_memory=True))
        keep.append(on_gpu)
    return payloads, keep


def _served_dtype(launched: str | None, checkpoint: str | None, sent: torch.dtype) -> torch.dtype:
    """The dtype SGLang holds a tensor in: its ``--dtype``; under "auto" the checkpoint's (where known),
    else the dtype it was sent in."""
    for name in (launched if launched != "auto" else None, checkpoint):
        value = getattr(torch, name or "", None)
        if isinstance(value, torch.dtype):
            return value
    return sent


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _answer(text: str) -> dict[str, Any]:
    answer = _parse_json(text)
    if answer is None:
        return {"raw": text[:300]}
    return answer if isinstance(answer, dict) else {"raw": answer}


def _key_hint(status: int) -> str:
    if status in (401, 403):
        return (" (SGLang runs with --api-key/--admin-api-key: give the agent the same keys, in "
                "ROLLOUT_SGLANG_API_KEY / ROLLOUT_SGLANG_ADMIN_API_KEY; launch_sglang.sh does)")
    return ""
