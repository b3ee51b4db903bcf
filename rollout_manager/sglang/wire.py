"""SGLang's HTTP contract, and nothing else: paths, typed messages, body builders.

This is the one module that knows how SGLang (0.5.x) spells its endpoints, request bodies and
``meta_info`` (like SGLang's own ``io_struct.py``). How a stream is framed and decoded lives in
:mod:`.sse`; a chunk is decoded here (:class:`GenerateChunk`), once, and ``rollout.progress`` checks it
against the sequence it belongs to; the manager's answer is :mod:`.answer`; the CPU engine's encoders in
``cpu_engine.encode``.

Streaming replies are server-sent events: ``data: {json}\\n\\n`` frames ending with ``data: [DONE]``.
By default each chunk is cumulative (``output_ids`` and ``text`` are the whole output so far); with
``--incremental-streaming-output`` chunks carry deltas (ids, text and the log-probs in ``meta_info``).
A batch request's chunks carry ``index``. An error inside the stream is a frame
``data: {"error": {...}}``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgspec

from rollout_manager.sglang import finish as _finish
from rollout_manager.sglang import routed_experts as _routed

# Paths (SGLang's http_server.py).
GENERATE = "/generate"
HEALTH = "/health"
HEALTH_GENERATE = "/health_generate"
SERVER_INFO = "/server_info"
GET_SERVER_INFO = "/get_server_info"  # deprecated alias of SERVER_INFO
MODEL_INFO = "/model_info"  # the live weight_version (SERVER_INFO's is the start-up value)
GET_MODEL_INFO = "/get_model_info"  # deprecated alias of MODEL_INFO
ABORT_REQUEST = "/abort_request"
PAUSE_GENERATION = "/pause_generation"
CONTINUE_GENERATION = "/continue_generation"
FLUSH_CACHE = "/flush_cache"
UPDATE_WEIGHT_VERSION = "/update_weight_version"
UPDATE_WEIGHTS_FROM_TENSOR = "/update_weights_from_tensor"
BEGIN_WEIGHT_UPDATE = "/begin_weight_update"  # SGLang >= 0.5.21 (see weight_update_sessions)
END_WEIGHT_UPDATE = "/end_weight_update"
SHUTDOWN = "/shutdown"
METRICS = "/metrics"  # Prometheus text, only with --enable-metrics

# Prometheus gauges of SGLang's /metrics that the manager may read as a supplement.
METRIC_NUM_RUNNING_REQS = "sglang:num_running_reqs"
METRIC_NUM_QUEUE_REQS = "sglang:num_queue_reqs"
METRIC_GEN_THROUGHPUT = "sglang:gen_throughput"

DONE_FRAME = b"data: [DONE]\n\n"

# finish_reason types (the typed finish_reason is :class:`.finish.FinishReason`).
STOP, LENGTH, ABORT = _finish.STOP, _finish.LENGTH, _finish.ABORT


# ---------------------------------------------------------------- finish reasons and errors


def finish_reason(kind: str | None, **extra: Any) -> dict[str, Any] | None:
    """The finish_reason JSON an engine sends (the CPU engine's and the tests' doubles): ``{"type": "stop"|
    "length"|"abort", ...}``, or null while running (see :meth:`.finish.FinishReason.of`)."""
    return None if kind is None else _finish.FinishReason.of(kind, **extra).to_json()


def error_object(message: str, status_code: int = 400, err_type: str = "BadRequest") -> dict[str, Any]:
    """SGLang's error body, also sent inside a stream as ``data: {"error": ...}``."""
    return {"error": {"message": message, "type": err_type, "code": status_code}}


def error_message(error: Any) -> str:
    """The message of an SGLang error body (``{"error": {"message": ...}}`` or ``{"error": "..."}``).

    Anything else (an inner error object without a message, a bare string) is returned as text.
    """
    if isinstance(error, dict):
        inner = error.get("error", error)
        if isinstance(inner, dict):
            return str(inner.get("message") or inner)
        return str(inner)
    return str(error)


# The meta_info lists with one entry per output token besides ``output_token_logprobs``: with
# ``--incremental-streaming-output`` SGLang sends each chunk's own entries (tokenizer_manager.py,
# _INCREMENTAL_STREAMING_META_INFO_KEYS), so they are gathered chunk by chunk like the tokens.
PER_TOKEN_META_KEYS = ("output_top_logprobs", "output_token_ids_logprobs", "output_token_sampling_mask",
                       "output_token_sampling_logprobs")
_PER_TOKEN = frozenset(PER_TOKEN_META_KEYS)


class ChunkMeta(msgspec.Struct, gc=False):
    """The ``meta_info`` of one chunk: the fields the manager reads, each under its own name; the rest
    opaque (``final``: what a finished sequence keeps of it, passed through to the caller)."""

    rid: Any  # id: the request's
    total: int  # completion_tokens: tokens of the request so far, in either streaming mode
    version: Any  # weight_version as reported (any JSON value; None: not reported)
    logprobs: list[Any] | None  # output_token_logprobs entries the chunk carries (None: not sent)
    per_token: dict[str, list[Any]] | None  # PER_TOKEN_META_KEYS' lists the chunk carries (None: none)
    final: _finish.FinalMeta  # the shared NO_META until the chunk that finished the request
    experts: _routed.Base64Rows | None = None  # the final chunk's routed experts (R3), checked (None: not sent)


class GenerateChunk(msgspec.Struct):
    """One ``/generate`` output object (a stream chunk, or a whole answer), decoded once (:meth:`of`).

    ``ids`` and ``text`` are the JSON values as sent (the ids are checked against a vocabulary where they
    are kept, ``rollout.progress``). ``skipped_ids`` and ``skipped_logprobs`` say how many leading ids and
    log-prob entries of a cumulative chunk the decoder left unparsed because the previous chunk had them
    already (:class:`.sse.ChunkDecoder`): those lists start after that many. A chunk that breaks SGLang's
    shape (no ``meta_info`` object, a count that is not one, a finish_reason the manager cannot read) says
    why in ``fault``, and nothing else of it holds: it is refused where it would be folded in, in order.
    """

    ids: list[Any]
    text: Any  # a string or null, as sent
    finish: _finish.FinishReason | None  # None while the request runs
    meta: ChunkMeta
    index: Any = None  # a batch answer's item number
    skipped_ids: int = 0
    skipped_logprobs: int = 0
    fault: str | None = None

    @property
    def cumulative(self) -> bool:
        """Whether the chunk repeats the whole output so far (SGLang's default) rather than a delta: the
        one place the two modes are told apart (a first chunk is both; it reads as cumulative)."""
        return len(self.ids) + self.skipped_ids == self.meta.total

    @classmethod
    def of(cls, obj: Any, skipped_ids: int = 0, skipped_logprobs: int = 0) -> GenerateChunk:
        """The chunk of a decoded JSON value (see ``fault`` for one that is not a chunk)."""
        if type(obj) is not dict:
            return _faulty(f"a chunk without the meta_info object or the output_ids list: {str(obj)[:200]}")
        meta, ids = obj.get("meta_info"), obj.get("output_ids")
        if ids is None:
            ids = []
        if type(meta) is not dict or type(ids) is not list:
            return _faulty(f"a chunk without the meta_info object or the output_ids list: {str(obj)[:200]}")
        get = meta.get
        total = get("completion_tokens")
        if type(total) is not int:
            return _faulty(f"completion_tokens is {total!r}, not a count")
        lps = get("output_token_logprobs")
        if lps is not None and type(lps) is not list:
            return _faulty(f"output_token_logprobs is {type(lps).__name__}, not a list")
        finish = get("finish_reason")
        final = _finish.NO_META
        experts = None
        if finish is not None:  # decoded once, from the final chunk
            try:
                finish = _finish.FinishReason.from_json(finish)
            except ValueError as exc:
                return _faulty(str(exc))
            final = _finish.FinalMeta.from_json(meta)
            if "routed_experts" in meta:
                try:
                    experts = _routed.checked(meta["routed_experts"])
                except ValueError as exc:
                    return _faulty(str(exc))
        per_token = None
        if not _PER_TOKEN.isdisjoint(meta):  # one C pass over the keys: most chunks carry none of them
            for key in PER_TOKEN_META_KEYS:
                entries = get(key)
                if isinstance(entries, list):
                    if per_token is None:
                        per_token = {}
                    per_token[key] = entries
        meta_of = ChunkMeta(get("id"), total, get("weight_version"), lps, per_token, final, experts)
        return cls(ids, obj.get("text"), finish, meta_of, obj.get("index"), skipped_ids, skipped_logprobs)


_NO_CHUNK_META = ChunkMeta(None, 0, None, None, None, _finish.NO_META)


def _faulty(why: str) -> GenerateChunk:
    return GenerateChunk([], None, None, _NO_CHUNK_META, fault=why)


# ---------------------------------------------------------------- request bodies

# The manager holds a /generate body typed (``generate_request``); these read a body as JSON, the way an
# engine does (the CPU engine and the benchmarks' fake engines).

# The fields of a batched ``/generate`` body that may hold one value per item (a list as long as
# ``input_ids``) instead of one value for all. The manager types and validates these.
PER_ITEM_KEYS: tuple[str, ...] = ("sampling_params", "return_logprob", "rid")
# SGLang 0.5.23's other per-item fields the manager passes through (``GenerateReqInput.__getitem__``): given
# as a list, each item takes its own value (``token_ids_logprob``: a list of lists, one item's value being a
# list itself); given once, the value applies to every item. ``return_routed_experts`` and
# ``routed_experts_start_len`` are not among them: SGLang takes one value for the whole batch.
PER_ITEM_LIST_KEYS: tuple[str, ...] = ("logprob_start_len", "top_logprobs_num", "token_ids_logprob", "lora_path")


def per_item(key: str, value: Any) -> bool:
    """Whether ``value`` of the pass-through field ``key`` of a batch is one value per item."""
    if type(value) is not list:
        return False
    if key == "token_ids_logprob":
        return bool(value) and all(v is None or type(v) is list for v in value)
    return True

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default, when the key is absent


def token_budget(body: dict[str, Any]) -> int | None:
    """The token budget of a single-sequence body: ``sampling_params.max_new_tokens``,
    :data:`DEFAULT_MAX_NEW_TOKENS` when the key is absent, None (no limit: SGLang stops at the
    context length) when it is null."""
    params = body.get("sampling_params") or {}
    if "max_new_tokens" not in params:
        return DEFAULT_MAX_NEW_TOKENS
    value = params["max_new_tokens"]
    return None if value is None else int(value)


def is_batched(body: dict[str, Any]) -> bool:
    """A ``/generate`` body is a batch when ``input_ids`` is a list of lists."""
    ids = body.get("input_ids")
    return isinstance(ids, list) and len(ids) > 0 and isinstance(ids[0], list)


def split_batch(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Split a batched ``/generate`` body into one body per sequence (per-item params honoured).

    A single string ``rid`` for a batch names item ``i`` ``f"{rid}_{i}"``, as SGLang does.
    """
    if not is_batched(body):
        return [dict(body)]
    return [_batch_item(body, i) for i in range(len(body["input_ids"]))]


def _batch_item(body: dict[str, Any], i: int) -> dict[str, Any]:
    sub = {}
    for key, value in body.items():
        if key == "rid" and isinstance(value, str):
            sub[key] = f"{value}_{i}"
        elif key in ("input_ids", "rid") or (key in PER_ITEM_KEYS and isinstance(value, list)):
            sub[key] = value[i] if isinstance(value, list) else value
        elif key in PER_ITEM_LIST_KEYS and per_item(key, value):
            sub[key] = value[i]
        else:
            sub[key] = value
    return sub


def update_weight_version_body(version: str | int) -> dict[str, Any]:
    """``/update_weight_version`` body; never let SGLang abort in-flight requests (its default)."""
    return {"new_version": str(version), "abort_all_requests": False}


def update_weights_from_tensor_body(
    serialized_per_rank: list[str], *, flush_cache: bool, weight_version: str | None
) -> dict[str, Any]:
    """``/update_weights_from_tensor`` body: one base64 string per TP rank."""
    body: dict[str, Any] = {
        "serialized_named_tensors": serialized_per_rank,
        "load_format": None,
        "flush_cache": flush_cache,
    }
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    return body


# ---------------------------------------------------------------- weight-update sessions and /server_info

# From 0.5.21 on, SGLang loads tensors only inside a weight-update session: ``POST /begin_weight_update {}``,
# then ``/update_weights_from_tensor`` any number of times, then ``POST /end_weight_update {}``. Older
# servers (0.5.12, which verl's ``sglang`` extra pins) have neither endpoint (FastAPI answers 404).
WEIGHT_UPDATE_SESSIONS_SINCE = (0, 5, 21)
# SGLang 0.5.23's refusals (scheduler_components/weight_updater.py), each with HTTP 400 and success false.
# SGLang >= 0.5.21 loads the weights, records the new version, then flushes the prefix cache; with
# requests still running or queued the flush is refused and the update call answers 400 with this
# (scheduler_components/weight_updater.py). ``/flush_cache?timeout=S`` then waits up to S seconds for
# the engine to be idle and flushes (scheduler_components/flush_wrapper.py).
CACHE_NOT_FLUSHED_MESSAGE = (
    "Weights were updated, but the cache was not flushed because requests are still running or "
    "queued. Retract or finish them, then call /flush_cache."
)


def flush_cache_path(timeout_s: float) -> str:
    """``/flush_cache`` waiting up to ``timeout_s`` for the engine to go idle (0: try once)."""
    return f"{FLUSH_CACHE}?timeout={timeout_s:g}"


SESSION_REQUIRED_MESSAGE = (
    "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()")
SESSION_ALREADY_OPEN_MESSAGE = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION_OPEN_MESSAGE = "no weight-update session is open; call begin_weight_update() first"
# What SGLang's tokenizer manager asserts when dp_size > 1 (the request fails with HTTP 500).
DP_UNSUPPORTED_MESSAGE = "data-parallel replicas are not supported for update weights from tensor"


def begin_weight_update_body() -> dict[str, Any]:
    """``/begin_weight_update`` body: every runner (``selector`` defaults to ``"all"``)."""
    return {}


def end_weight_update_body() -> dict[str, Any]:
    return {}


def parse_version(version: Any) -> tuple[int, int, int] | None:
    """``"0.5.23"``, ``"0.5.21.post1"``, ``"0.5.22rc0"`` -> ``(0, 5, 2x)``; None when not a release number."""
    import re

    m = re.match(r"\s*v?(\d+)\.(\d+)\.(\d+)", str(version or ""))
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def weight_update_sessions(version: Any) -> bool | None:
    """Whether a server of ``version`` (``/server_info``'s ``version``) needs weight-update sessions;
    None when the version cannot be read (then ask the server: a 404 on begin means no sessions)."""
    parsed = parse_version(version)
    return None if parsed is None else parsed >= WEIGHT_UPDATE_SESSIONS_SINCE


@dataclass(frozen=True)
class ServerInfo:
    """The parts of ``GET /server_info`` the manager and the receiver read (0.5.12 and 0.5.23 alike:
    the server arguments flattened into the top level, plus ``version``)."""

    version: str | None
    tp_size: int
    dp_size: int
    base_gpu_id: int
    gpu_id_step: int
    # ``--incremental-streaming-output`` (None: the server did not say) and ``--stream-interval``: what
    # a streamed /generate costs the manager per token (cumulative chunks repeat the whole output).
    incremental_streaming_output: bool | None = None
    stream_interval: int | None = None
    # From ``/model_info`` (see :meth:`with_model_info`): the weight version the engine reports now, and
    # its vocabulary size where the server says (SGLang 0.5.23 does not; the CPU engine does).
    weight_version: str | None = None
    vocab_size: int | None = None
    # Requests the server runs at once (None: not reported): 0.5.23's scheduler reports the value it
    # settled on as internal_states[0].effective_max_running_requests_per_dp; the top-level
    # max_running_requests is the launch flag (None unless given).
    max_running_requests: int | None = None
    # ``--enable-return-routed-experts``: whether /generate answers ``return_routed_experts`` (without it SGLang
    # answers such a request without them, and says nothing; None: the server did not say).
    routed_experts: bool | None = None
    # ``--dtype`` as launched ("auto": the checkpoint's) and ``--quantization`` (None: none, or not said): how
    # far two boxes' log-probs may differ for the same weights (instances/trust.py).
    dtype: str | None = None
    quantization: str | None = None
    # ``--speculative-algorithm`` ("EAGLE", "NGRAM", ...; None: none, or not said): a box that drafts and verifies
    # makes several tokens a step at small batches, which is where a step's tail runs.
    speculative_algorithm: str | None = None

    def with_model_info(self, model: Any) -> ServerInfo:
        """This, plus what ``GET /model_info`` adds (``weight_version``; ``vocab_size`` where present)."""
        model = model if isinstance(model, dict) else {}
        version, vocab = model.get("weight_version"), model.get("vocab_size")
        return dataclasses.replace(
            self, weight_version=str(version) if isinstance(version, (str, int)) else self.weight_version,
            vocab_size=vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0
            else self.vocab_size)

    @classmethod
    def from_json(cls, info: Any) -> ServerInfo:
        info = info if isinstance(info, dict) else {}

        def number(key: str, default: int) -> int:
            value = info.get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) else default

        version = info.get("version")
        incremental = info.get("incremental_streaming_output")
        interval = number("stream_interval", 0)
        states = info.get("internal_states")
        state = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
        running = state.get("effective_max_running_requests_per_dp")
        experts = info.get("enable_return_routed_experts")
        dtype, quantization = info.get("dtype"), info.get("quantization")
        speculative = info.get("speculative_algorithm")
        if not (isinstance(running, int) and not isinstance(running, bool) and running > 0):
            running = number("max_running_requests", 0)
        return cls(version=str(version) if version is not None else None, tp_size=max(number("tp_size", 1), 1),
                   dp_size=max(number("dp_size", 1), 1), base_gpu_id=number("base_gpu_id", 0),
                   gpu_id_step=max(number("gpu_id_step", 1), 1),
                   incremental_streaming_output=incremental if isinstance(incremental, bool) else None,
                   stream_interval=interval if interval > 0 else None,
                   max_running_requests=running if running > 0 else None,
                   routed_experts=experts if isinstance(experts, bool) else None,
                   dtype=dtype if isinstance(dtype, str) else None,
                   quantization=quantization if isinstance(quantization, str) and quantization else None,
                   speculative_algorithm=speculative if isinstance(speculative, str) and speculative else None)

    def gpu_of_rank(self, tp_rank: int) -> int:
        """The GPU (in SGLang's own numbering) that TP rank ``tp_rank`` runs on."""
        return self.base_gpu_id + tp_rank * self.gpu_id_step


def dp_refusal(endpoint: str, dp_size: int) -> str:
    """Why an SGLang server with ``dp_size > 1`` cannot be a rollout instance, and what to run instead."""
    return (f"{endpoint} runs SGLang with dp_size={dp_size}: SGLang refuses /update_weights_from_tensor on a "
            f"data-parallel server ({DP_UNSUPPORTED_MESSAGE!r}), so it could never take a weight push; run one "
            f"SGLang server per replica instead (--dp-size 1, each on its own port or box with its own "
            f"launch_sglang.sh) and register each")


def abort_body(rid: str | None = None, *, abort_all: bool = False) -> dict[str, Any]:
    return {"rid": rid or "", "abort_all": abort_all}


