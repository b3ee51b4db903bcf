"""SGLang's HTTP wire format, and nothing else.

This is the one module that knows how SGLang (0.5.x) spells its endpoints, request bodies, streaming
frames and ``meta_info``. The manager's client decodes with it; the CPU engine encodes with it, so the
stand-in and the real server are held to the same contract.

Streaming replies are server-sent events: ``data: {json}\\n\\n`` frames ending with ``data: [DONE]``.
By default each chunk is cumulative (``output_ids`` and ``text`` are the whole output so far); with
``--incremental-streaming-output`` chunks carry deltas (ids, text and the log-probs in ``meta_info``).
A batch request's chunks carry ``index``. An error inside the stream is a frame
``data: {"error": {...}}``.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_manager import jsonutil

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
UPDATE_WEIGHTS_FROM_DISK = "/update_weights_from_disk"
BEGIN_WEIGHT_UPDATE = "/begin_weight_update"  # SGLang >= 0.5.21 (see weight_update_sessions)
END_WEIGHT_UPDATE = "/end_weight_update"
SHUTDOWN = "/shutdown"
METRICS = "/metrics"  # Prometheus text, only with --enable-metrics

# Prometheus gauges of SGLang's /metrics that the manager may read as a supplement.
METRIC_NUM_RUNNING_REQS = "sglang:num_running_reqs"
METRIC_NUM_QUEUE_REQS = "sglang:num_queue_reqs"
METRIC_GEN_THROUGHPUT = "sglang:gen_throughput"

DONE_FRAME = b"data: [DONE]\n\n"
_DATA_PREFIX = b"data: "
_DATA_FIELD = b"data:"

# finish_reason types.
STOP = "stop"
LENGTH = "length"
ABORT = "abort"


# ---------------------------------------------------------------- encoding (the engine, and the manager's answers)


def sse_frame(obj: Any) -> bytes:
    """One server-sent-event frame carrying a JSON object."""
    return _DATA_PREFIX + jsonutil.dumps(obj) + b"\n\n"


def finish_reason(kind: str | None, **extra: Any) -> dict[str, Any] | None:
    """SGLang's finish_reason object: ``{"type": "stop"|"length"|"abort", ...}`` or null while running."""
    if kind is None:
        return None
    reason: dict[str, Any] = {"type": kind}
    if kind == LENGTH:
        reason.setdefault("length", extra.pop("length", None))
    if kind == ABORT:
        reason.setdefault("message", extra.pop("message", "Abort"))
    reason.update(extra)
    return reason


def logprob_entry(logprob: float, token_id: int) -> list[Any]:
    """One ``output_token_logprobs`` entry: ``[logprob, token_id, text_or_null]``."""
    return [float(logprob), int(token_id), None]


def output_chunk(
    *,
    rid: str,
    output_ids: list[int],
    prompt_tokens: int,
    completion_tokens: int,
    finish: dict[str, Any] | None,
    weight_version: str,
    logprobs: list[list[Any]] | None = None,
    text: str | None = None,
    index: int | None = None,
    e2e_latency: float | None = None,
) -> dict[str, Any]:
    """One ``/generate`` output object (a stream chunk, or the whole non-streaming answer)."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": prompt_tokens,
        "weight_version": weight_version,
        "completion_tokens": completion_tokens,
        "cached_tokens": 0,
    }
    if logprobs is not None:
        meta["output_token_logprobs"] = logprobs
    if e2e_latency is not None:
        meta["e2e_latency"] = e2e_latency
    out: dict[str, Any] = {"text": text, "output_ids": output_ids, "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out


def error_object(message: str, status_code: int = 400, err_type: str = "BadRequest") -> dict[str, Any]:
    """SGLang's error body, also sent inside a stream as ``data: {"error": ...}``."""
    return {"error": {"message": message, "type": err_type, "code": status_code}}


def partial_output(
    body: dict[str, Any],
    *,
    rid: str,
    output_ids: Sequence[int],
    logprobs: list[list[Any]],
    weight_version: str,
    index: int | None,
    text: str | None = None,
) -> dict[str, Any]:
    """A cumulative, unfinished stream chunk of a sequence run from the single-sequence ``body``.

    Log-probs appear only when ``body`` asked for them, as SGLang does; ``text`` is the text so far
    (SGLang fills it in every cumulative chunk), null when it is not known.
    """
    return output_chunk(
        rid=rid, output_ids=as_list(output_ids), prompt_tokens=len(body["input_ids"]),
        completion_tokens=len(output_ids), finish=None, weight_version=weight_version,
        logprobs=list(logprobs) if wants_logprobs(body) else None, index=index, text=text,
    )


def final_output(
    body: dict[str, Any],
    *,
    rid: str,
    output_ids: Sequence[int],
    logprobs: list[list[Any]],
    finish: dict[str, Any] | None,
    engine_meta: dict[str, Any],
    segments: list[dict[str, Any]],
    text: str | None,
    e2e_latency: float,
    index: int | None,
    per_token: dict[str, list[Any]] | None = None,
) -> dict[str, Any]:
    """The manager's final ``/generate`` answer for one sequence that may span several engines.

    Starts from the ``meta_info`` of the engine that finished the sequence, so fields the manager does
    not interpret pass through, then overwrites what is a property of the whole sequence rather than
    of its last request. ``meta_info.segments`` (``instance``, ``endpoint``, ``weight_version``,
    ``start``, ``end``, ``outcome`` per engine) is the manager's addition to SGLang's format; the
    top-level ``weight_version`` is the last segment's.
    """
    meta = dict(engine_meta)
    meta.update({
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": len(body.get("input_ids") or []),
        "completion_tokens": len(output_ids),
        "weight_version": segments[-1]["weight_version"] if segments else meta.get("weight_version"),
        "e2e_latency": round(e2e_latency, 6),
        "segments": segments,
    })
    if wants_logprobs(body):
        meta["output_token_logprobs"] = logprobs
    else:
        meta.pop("output_token_logprobs", None)
    meta.update(per_token or {})  # gathered over every chunk and segment, not the last chunk's
    seed = (body.get("sampling_params") or {}).get("sampling_seed")
    if seed is not None:
        meta["sampling_seed"] = seed  # what the sequence was sampled with (the manager's when the caller gave none)
    out: dict[str, Any] = {"text": text, "output_ids": as_list(output_ids), "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out


# ---------------------------------------------------------------- decoding (the manager side)


def is_abort(finish: Any) -> bool:
    """Whether a finish_reason says the engine aborted the request (it did not end on its own)."""
    return isinstance(finish, dict) and finish.get("type") == ABORT


def abort_message(finish: dict[str, Any]) -> str:
    """Why the engine aborted, for logs and errors (the whole finish_reason when it gives no message)."""
    return str(finish.get("message") or finish)


def abort_caller_status(finish: Any) -> int | None:
    """The 4xx status of an abort that refused the request itself, None for any other finish.

    SGLang's scheduler refuses some requests (an input longer than it can hold, a bad
    ``logprob_start_len``, ...) by finishing them at once with ``{"type": "abort", "status_code": 400,
    "err_type": "BadRequestError", "message": ...}`` instead of an HTTP error. That is the caller's
    error and every instance would say the same; an abort with no status or a 5xx is the instance's.
    """
    if not is_abort(finish):
        return None
    status = finish.get("status_code")
    if isinstance(status, int) and not isinstance(status, bool) and 400 <= status < 500:
        return status
    return None


def rebase_finish_reason(finish: dict[str, Any] | None, start: int) -> dict[str, Any] | None:
    """A continued request's finish_reason as seen from the whole sequence.

    The request that continues a sequence ``start`` tokens in counts ``length`` from its own first
    token; the caller counts from the sequence's first token, so ``length`` moves up by ``start``.
    """
    if isinstance(finish, dict) and finish.get("type") == LENGTH and isinstance(finish.get("length"), int):
        return {**finish, "length": finish["length"] + start}
    return finish


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


@dataclass(frozen=True)
class GenerateOutput:
    """One ``/generate`` output object (of SGLang or of the manager), read field by field.

    Values are the JSON ones, unconverted; absent lists read as empty and absent scalars as None.
    """

    output_ids: list[Any]
    text: str | None
    index: int | None
    meta_info: dict[str, Any]

    @property
    def rid(self) -> Any:
        return self.meta_info.get("id")

    @property
    def finish_reason(self) -> Any:
        return self.meta_info.get("finish_reason")

    @property
    def finish_type(self) -> Any:
        """``"stop"``, ``"length"``, ``"abort"``, None while running; a non-object reason as it is."""
        finish = self.finish_reason
        return finish.get("type") if isinstance(finish, dict) else finish

    @property
    def weight_version(self) -> Any:
        """The version that made the output (the manager's: that of the last segment)."""
        return self.meta_info.get("weight_version")

    @property
    def prompt_tokens(self) -> int | None:
        return self.meta_info.get("prompt_tokens")

    @property
    def completion_tokens(self) -> int | None:
        return self.meta_info.get("completion_tokens")

    @property
    def e2e_latency(self) -> float | None:
        return self.meta_info.get("e2e_latency")

    @property
    def logprob_entries(self) -> list[list[Any]]:
        """``output_token_logprobs``: ``[logprob, token_id, text_or_null]`` per output token."""
        return self.meta_info.get("output_token_logprobs") or []

    @property
    def token_logprobs(self) -> list[Any]:
        """The log-prob of each output token (an entry's first element; null where the engine gave none)."""
        return [entry[0] for entry in self.logprob_entries]

    @property
    def segments(self) -> list[dict[str, Any]]:
        """The manager's segments (one per engine the sequence ran on); empty in SGLang's own output."""
        return self.meta_info.get("segments") or []

    @property
    def weight_versions(self) -> list[Any]:
        """Every segment's weight version, in order; just ``[weight_version]`` without segments."""
        return [s.get("weight_version") for s in self.segments] or [self.weight_version]


def read_output(obj: dict[str, Any]) -> GenerateOutput:
    """Read one ``/generate`` output object (a batch answer's item, or an NDJSON line's ``data``)."""
    return GenerateOutput(
        output_ids=obj.get("output_ids") or [],
        text=obj.get("text"),
        index=obj.get("index"),
        meta_info=obj.get("meta_info") or {},
    )


class FrameTooLarge(ValueError):
    """One stream frame (or the bytes without a frame boundary so far) is over the decoder's bound."""


class StreamError(Exception):
    """The engine reported an error inside the stream (a ``data: {"error": ...}`` frame)."""

    def __init__(self, error: Any):
        self.error = error
        message = error.get("message") if isinstance(error, dict) else None
        super().__init__(message or str(error))


def _frame_end(buf: bytes | bytearray, start: int) -> int:
    """Where the next ``\\n\\n`` begins, or -1. A one-byte find is a memchr, several times faster than
    a two-byte one, and JSON payloads hold no raw newline, so this rarely loops."""
    at = buf.find(b"\n", start)
    while at >= 0 and buf[at + 1:at + 2] != b"\n":
        at = buf.find(b"\n", at + 1)
    return at


# The meta_info lists with one entry per output token besides ``output_token_logprobs``: with
# ``--incremental-streaming-output`` SGLang sends each chunk's own entries (tokenizer_manager.py,
# _INCREMENTAL_STREAMING_META_INFO_KEYS), so they are gathered chunk by chunk like the tokens.
PER_TOKEN_META_KEYS = ("output_top_logprobs", "output_token_ids_logprobs", "output_token_sampling_mask",
                       "output_token_sampling_logprobs")

# Set by SSEDecoder(skip_seen=True) on a cumulative chunk whose already-seen ids it left unparsed:
# that chunk's ``output_ids`` (and ``output_token_logprobs``) start after that many tokens.
SKIPPED_IDS = "rm_skipped_ids"
SKIPPED_LOGPROBS = "rm_skipped_logprobs"


class _SeenPrefix:
    """The raw bytes of one JSON array's content as the last cumulative chunk had it.

    SGLang serializes with orjson, so the next cumulative chunk's array starts with exactly these
    bytes; cutting them out before parsing makes a chunk cost what it adds, not the sequence's length.
    """

    def __init__(self, key: bytes, closer: bytes):
        self.key = key  # '"output_ids":[' ; cannot occur inside a JSON string (its quotes are escaped)
        self.closer = closer  # where the content ends: b"]" for ints, b"]]" for lists of number lists
        self.raw = b""
        self.count = 0
        self.enabled = True

    def locate(self, payload: bytes) -> tuple[int, int] | None:
        """(start, end) of the array's content in ``payload``, or None."""
        at = payload.find(self.key)
        if at < 0:
            return None
        start = at + len(self.key)
        if payload.startswith(b"]", start):
            return start, start
        end = payload.find(self.closer, start)
        if end < 0:
            return None
        return start, end + len(self.closer) - 1

    def cut(self, payload: bytes) -> tuple[int, int] | None:
        """The byte range to drop from ``payload`` (the seen prefix and its comma), or None."""
        if not (self.enabled and self.count):
            return None
        where = self.locate(payload)
        if where is None:
            return None
        start = where[0]
        stop = start + len(self.raw)
        if not payload.startswith(self.raw, start) or payload[stop:stop + 1] not in (b",", b"]"):
            return None
        return start, stop + (payload[stop:stop + 1] == b",")

    def remember(self, payload: bytes, count: int) -> None:
        where = self.locate(payload)
        if where is None:
            self.enabled = False
            return
        raw = payload[where[0]:where[1]]
        if b'"' in raw:  # strings inside (text in log-probs): a bracket may hide in them, so stop here
            self.enabled = False
            return
        self.raw, self.count = raw, count


class SSEDecoder:
    """Incremental decoder of SGLang's event stream: feed bytes, get JSON objects.

    ``done`` turns true at ``data: [DONE]``; a stream that ends before it is a broken stream. Bytes are
    scanned once: a frame split over many reads is not searched again from its start.

    With ``skip_seen=True`` (one sequence per stream, as the manager sends), cumulative chunks are
    parsed without the ids and log-probs already seen; :class:`SequenceProgress` reads the
    ``SKIPPED_*`` counts it leaves. A chunk that does not fit (an incremental stream, a format
    surprise) is parsed whole, and skipping stops for that stream.

    ``max_frame`` bounds one frame's bytes (None: no bound): an engine that sends bytes without a frame
    boundary would otherwise grow the buffer for as long as it sends. ``pending`` is the bytes of the
    unfinished frame held now.
    """

    def __init__(self, *, skip_seen: bool = False, max_frame: int | None = None) -> None:
        self._buf = bytearray()
        self._scanned = 0  # bytes of _buf already searched for a frame end
        self.done = False
        self.max_frame = max_frame
        self._seen: tuple[_SeenPrefix, _SeenPrefix] | None = (
            (_SeenPrefix(b'"output_ids":[', b"]"), _SeenPrefix(b'"output_token_logprobs":[', b"]]"))
            if skip_seen else None)

    @property
    def pending(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        limit = self.max_frame
        if not self._buf:  # the usual read: exactly one whole one-line frame
            end = _frame_end(data, 0)
            if end == len(data) - 2 and data.startswith(_DATA_PREFIX) and data.find(b"\n", 0, end) < 0 \
                    and (limit is None or end <= limit):
                obj = self._payload(data[len(_DATA_PREFIX):end])
                return [] if obj is None else [obj]
        buf = self._buf
        buf += data
        out: list[dict[str, Any]] = []
        begin = 0
        while True:
            cut = _frame_end(buf, max(begin, self._scanned - 1))
            if cut < 0:
                break
            if limit is not None and cut - begin > limit:
                raise FrameTooLarge(f"a stream frame of {cut - begin} bytes, over the bound of {limit} "
                                    f"(engine_max_frame_mb)")
            start, begin = begin, cut + 2
            if buf.startswith(_DATA_PREFIX, start) and buf.find(b"\n", start, cut) < 0:  # one data line
                payloads = [bytes(buf[start + len(_DATA_PREFIX):cut])]
            else:
                lines = (line.strip() for line in bytes(buf[start:cut]).split(b"\n"))
                payloads = [line[len(_DATA_FIELD):] for line in lines if line.startswith(_DATA_FIELD)]
            for payload in payloads:
                obj = self._payload(payload)
                if obj is not None:
                    out.append(obj)
        if begin:
            del buf[:begin]
        self._scanned = len(buf)
        if limit is not None and len(buf) > limit:
            raise FrameTooLarge(f"{len(buf)} bytes without a frame boundary, over the bound of {limit} for "
                                f"one frame (engine_max_frame_mb)")
        return out

    def _payload(self, payload: bytes) -> Any:
        """One ``data:`` field's JSON; None for ``[DONE]``; raises on an error frame."""
        if payload[:2] != b"{\"" and payload.strip() == b"[DONE]":
            self.done = True
            return None
        obj = self._decode(payload)
        if isinstance(obj, dict) and "error" in obj and "meta_info" not in obj:
            raise StreamError(obj["error"])
        return obj

    def _decode(self, payload: bytes) -> Any:
        if self._seen is None or not self._seen[0].enabled:  # incremental streams end up here at once
            return jsonutil.loads(payload)
        ids, lps = self._seen
        cuts = [(seen, c) for seen in (ids, lps) if (c := seen.cut(payload)) is not None]
        if not cuts:
            obj = jsonutil.loads(payload)
            skipped = {}
        else:
            cuts.sort(key=lambda sc: sc[1][0])
            pieces, pos = [], 0
            for _, (a, b) in cuts:
                pieces.append(payload[pos:a])
                pos = b
            pieces.append(payload[pos:])
            obj = jsonutil.loads(b"".join(pieces))
            skipped = {seen.key: seen.count for seen, _ in cuts}
        if not isinstance(obj, dict):
            return obj
        meta = obj.get("meta_info")
        total = meta.get("completion_tokens") if isinstance(meta, dict) else None
        n_ids = len(obj.get("output_ids") or []) + skipped.get(ids.key, 0)
        if not isinstance(total, int) or n_ids != total:
            if skipped:  # it was not the cumulative chunk it looked like: parse it whole, skip no more
                obj = jsonutil.loads(payload)
            ids.enabled = lps.enabled = False
            return obj
        if skipped.get(ids.key):
            obj[SKIPPED_IDS] = skipped[ids.key]
        ids.remember(payload, n_ids)
        lp_list = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
        if isinstance(lp_list, list):
            n_lps = len(lp_list) + skipped.get(lps.key, 0)
            if skipped.get(lps.key):
                obj[SKIPPED_LOGPROBS] = skipped[lps.key]
            lps.remember(payload, n_lps)
        elif lps.key in skipped:  # cannot happen with a well-formed chunk; never guess
            obj = jsonutil.loads(payload)
            ids.enabled = lps.enabled = False
        return obj


# Token ids at or above this are no model's (every vocabulary fits 32 bits): the bound when an instance's
# vocabulary size is not known.
TOKEN_ID_BOUND = 2**32
_UINT = "I" if array("I").itemsize == 4 else "L"  # a C array type holding exactly [0, TOKEN_ID_BOUND)


class BadChunk(ValueError):
    """A chunk the manager cannot vouch for: the engine broke its contract (not the caller's error)."""


def token_array(ids: Iterable[int] = ()) -> array[int]:
    """A sequence's token ids as the manager keeps them: 4 bytes each (a list of ints costs about 40)."""
    return array(_UINT, ids)


def as_list(ids: Sequence[int]) -> list[int]:
    """Token ids as the JSON list callers get (a C conversion for the manager's own arrays)."""
    return ids.tolist() if isinstance(ids, array) else list(ids)


def checked_token_ids(ids: list[Any], vocab_size: int) -> array[int] | str:
    """``ids`` as a :func:`token_array` when they are token ids of a ``vocab_size`` vocabulary (ints,
    not bools); otherwise why they are not.

    Built for the relay: the common case costs the C conversion to the unsigned 32-bit array the
    sequence keeps anyway (it refuses floats, strings, nulls, negatives and ids past 32 bits), a scan
    for bools and, when the vocabulary is known, a ``max``; the offending id is looked for only when
    something is wrong.
    """
    try:
        out = array(_UINT, ids)
    except (TypeError, OverflowError, ValueError):
        pass
    else:
        if bool not in map(type, ids) and (vocab_size >= TOKEN_ID_BOUND or not ids or max(out) < vocab_size):
            return out
    return bad_token_ids(ids, vocab_size) or f"token ids {str(ids)[:200]} are not a vocabulary's"


def bad_token_ids(ids: list[Any], vocab_size: int) -> str | None:
    """Why ``ids`` are not token ids of a ``vocab_size`` vocabulary (ints, not bools), or None."""
    for t in ids:
        if type(t) is not int:
            return f"token id {t!r} is not an integer"
        if not 0 <= t < vocab_size:
            return f"token id {t} is outside the vocabulary [0, {vocab_size})"
    return None


@dataclass(slots=True)
class SequenceProgress:
    """What one sequence has produced so far on one engine, whatever the chunk mode, checked.

    Chunks are classified by ``meta_info.completion_tokens`` (always cumulative): if ``output_ids``
    is as long as that count the chunk is cumulative, otherwise it is a delta.

    ``output_ids`` (a :func:`token_array`: 4 bytes a token, however long the sequence runs; a list handed
    in is copied into one) and ``logprobs`` may be handed in already holding what earlier segments made
    (the sequence's own): the engine's tokens are appended to them in place, so folding a chunk costs
    what the chunk brings, never the length of the sequence. ``made`` is this engine's share.

    Every chunk is checked before anything of it is kept, so the lists only ever hold tokens the manager
    can vouch for; :meth:`apply` raises :class:`BadChunk` (and changes nothing) for a chunk whose
    ``completion_tokens`` is missing, goes back or does not match its ids, whose cumulative ids rewrite
    what was sent, whose new ids are not in ``[0, vocab_size)``, that goes past ``limit`` tokens (the
    request's ``max_new_tokens``; None: no limit), that brings tokens after the final chunk, or whose
    ``weight_version`` ``version_ok`` refuses (None: any).
    """

    output_ids: array[int] = field(default_factory=token_array)
    logprobs: list[list[Any]] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    meta_info: dict[str, Any] = field(default_factory=dict)
    text: str | None = None
    weight_version: str | None = None  # the latest a chunk reported (chunks may leave it out)
    limit: int | None = None
    vocab_size: int = TOKEN_ID_BOUND
    version_ok: Callable[[Any], str | None] | None = None  # why a reported version is wrong, or None
    per_token: dict[str, list[Any]] = field(default_factory=dict)  # PER_TOKEN_META_KEYS' lists, gathered
    chunks: int = 0  # chunks folded in
    _ids_start: int = field(init=False, repr=False)
    _lps_start: int = field(init=False, repr=False)
    _per_token_start: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.output_ids, array) or self.output_ids.typecode != _UINT:
            self.output_ids = token_array(self.output_ids)
        self._ids_start, self._lps_start = len(self.output_ids), len(self.logprobs)
        self._per_token_start = {k: len(v) for k, v in self.per_token.items()}

    @property
    def made(self) -> int:
        """Tokens this engine produced (not counting what the lists held at the start)."""
        return len(self.output_ids) - self._ids_start

    def apply(self, chunk: dict[str, Any]) -> int:
        """Fold one chunk in; return how many new tokens it brought. Raises :class:`BadChunk`."""
        meta = chunk.get("meta_info")
        ids = chunk.get("output_ids")
        if ids is None:
            ids = []
        if not isinstance(meta, dict) or not isinstance(ids, list):
            raise BadChunk(f"a chunk without the meta_info object or the output_ids list: {str(chunk)[:200]}")
        skipped = chunk.pop(SKIPPED_IDS, 0)  # ids the decoder left unparsed: they were seen already
        skipped_lps = chunk.pop(SKIPPED_LOGPROBS, 0)
        total = meta.get("completion_tokens")
        before = self.made
        if type(total) is not int:
            raise BadChunk(f"completion_tokens is {total!r}, not a count (after {before} token(s))")
        if total < before:
            raise BadChunk(f"completion_tokens went back from {before} to {total}")
        if skipped > before or skipped_lps > len(self.logprobs) - self._lps_start:
            raise BadChunk("a chunk skipped tokens this sequence never saw")
        cumulative = len(ids) + skipped == total
        if cumulative:  # it repeats what was seen: only its tail is new, and the rest must be what was seen
            seen = before - skipped
            start = self._ids_start + skipped
            if seen and ids[:seen] != self.output_ids[start:start + seen].tolist():
                raise BadChunk(f"a cumulative chunk of {total} token(s) changed some of the {before} already sent")
            new = ids[seen:] if seen else ids
        elif before + len(ids) == total:
            new = ids
        else:
            raise BadChunk(f"completion_tokens {total} fits neither a cumulative nor a delta chunk of "
                           f"{len(ids)} id(s) after {before} token(s)")
        checked: array[int] | str | None = None
        if new:
            if self.finish_reason is not None:
                raise BadChunk(f"{len(new)} token(s) after the final chunk")
            if self.limit is not None and total > self.limit:
                raise BadChunk(f"{total} tokens for a request of max_new_tokens={self.limit}")
            checked = checked_token_ids(new, self.vocab_size)
            if isinstance(checked, str):
                raise BadChunk(checked)
        version = meta.get("weight_version")
        if version is not None and version != self.weight_version and self.version_ok is not None:
            why = self.version_ok(version)  # asked when it changes: chunks repeat the version they run on
            if why is not None:
                raise BadChunk(why)
        lps = meta.get("output_token_logprobs")
        if lps is not None and not isinstance(lps, list):
            raise BadChunk(f"output_token_logprobs is {type(lps).__name__}, not a list")
        if isinstance(checked, array):
            self.output_ids.extend(checked)
        if lps is not None:
            seen_lps = len(self.logprobs) - self._lps_start - skipped_lps
            self.logprobs.extend(lps[seen_lps:] if cumulative else lps)
        for key in PER_TOKEN_META_KEYS:
            entries = meta.get(key)
            if isinstance(entries, list):
                gathered = self.per_token.setdefault(key, [])
                seen = len(gathered) - self._per_token_start.setdefault(key, 0)
                gathered.extend(entries[seen:] if cumulative else entries)
        if chunk.get("text") is not None:
            self.text = chunk["text"] if cumulative else (self.text or "") + chunk["text"]
        self.meta_info = meta
        self.finish_reason = meta.get("finish_reason")
        if version is not None:
            self.weight_version = version
        self.chunks += 1
        return len(new)


# ---------------------------------------------------------------- request bodies

# The fields of a batched ``/generate`` body that may hold one value per item (a list as long as
# ``input_ids``) instead of one value for all. The manager splits and validates these; SGLang 0.5.23
# has more (``logprob_start_len``, ``top_logprobs_num``, ``lora_path``, ...), which the manager
# hands to every item unchanged.
PER_ITEM_KEYS: tuple[str, ...] = ("sampling_params", "return_logprob", "rid")

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


def wants_logprobs(body: dict[str, Any]) -> bool:
    """Whether a single-sequence body asked for ``output_token_logprobs``."""
    return bool(body.get("return_logprob"))


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
    return [batch_item(body, i) for i in range(len(body["input_ids"]))]


def batch_item(body: dict[str, Any], i: int) -> dict[str, Any]:
    """Item ``i`` of a batched ``/generate`` body, as :func:`split_batch` gives it (built on demand, so a
    large batch need not hold every item's body at once)."""
    sub = {}
    for key, value in body.items():
        if key == "rid" and isinstance(value, str):
            sub[key] = f"{value}_{i}"
        elif key in ("input_ids", "rid") or (key in PER_ITEM_KEYS and isinstance(value, list)):
            sub[key] = value[i] if isinstance(value, list) else value
        else:
            sub[key] = value
    return sub


# The keys in which single-sequence bodies may differ and still go to an engine as one batch: SGLang
# takes each as a list with one value per item.
JOIN_ITEM_KEYS = frozenset({"input_ids", "sampling_params", "rid"})


def joinable(body: dict[str, Any]) -> bool:
    """Whether a single-sequence, non-streaming body may join a batch (:func:`join_batch`): SGLang
    expands ``n`` > 1 (parallel sampling) per batch, not per item, so such a body goes alone."""
    params = body.get("sampling_params") or {}
    return body.get("stream") is False and params.get("n", 1) == 1 and isinstance(body.get("rid"), str)


def join_key(body: dict[str, Any]) -> dict[str, Any]:
    """What bodies must share to join one batch: everything but :data:`JOIN_ITEM_KEYS`."""
    return {k: v for k, v in body.items() if k not in JOIN_ITEM_KEYS}


def join_batch(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """One batched ``/generate`` body for single-sequence bodies with the same :func:`join_key`:
    ``input_ids``, ``sampling_params`` and ``rid`` become per-item lists (the inverse of :func:`split_batch`)."""
    out = join_key(bodies[0])
    out["input_ids"] = [b["input_ids"] for b in bodies]
    out["sampling_params"] = [b.get("sampling_params") or {} for b in bodies]
    out["rid"] = [b["rid"] for b in bodies]
    return out


def continuation_body(
    body: dict[str, Any], made: Sequence[int], *, rid: str, stream_interval: int | None = None,
    keep_caller_interval: bool = False, stream: bool = True,
) -> dict[str, Any]:
    """The body that continues a single sequence elsewhere from the tokens already made.

    ``input_ids`` grows by ``made`` and ``max_new_tokens`` shrinks by ``len(made)``, never past the
    original budget, so the context never overflows and no token is produced twice. A null
    ``max_new_tokens`` (no limit) stays null: SGLang then stops where the context ends, which is
    the same place for the continued request as for the original one.

    ``stream_interval`` (when given) becomes ``sampling_params.stream_interval``, which SGLang 0.5.23
    uses before its server-wide ``--stream-interval``: the engine then sends a chunk every that many
    tokens, so the manager parses that many times fewer frames. ``keep_caller_interval`` leaves a
    caller's own value in place (a streaming caller chose how often it wants chunks). With
    ``stream=False`` the engine answers once, at the end (no interval is set).
    """
    new = dict(body)
    new["input_ids"] = list(body["input_ids"]) + as_list(made)
    params = dict(body.get("sampling_params") or {})
    budget = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if budget is not None:
        params["max_new_tokens"] = max(int(budget) - len(made), 0)
    if "min_new_tokens" in params:
        params["min_new_tokens"] = max(int(params["min_new_tokens"] or 0) - len(made), 0)
    if stream and stream_interval is not None and not (
            keep_caller_interval and params.get("stream_interval") is not None):
        params["stream_interval"] = int(stream_interval)
    new["sampling_params"] = params
    new["stream"] = stream
    new["rid"] = rid
    return new


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


def cache_not_flushed(message: str) -> bool:
    """Whether a refused weight update did load the weights and only failed to flush the cache."""
    return "the cache was not flushed" in message


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
        if not (isinstance(running, int) and not isinstance(running, bool) and running > 0):
            running = number("max_running_requests", 0)
        return cls(version=str(version) if version is not None else None, tp_size=max(number("tp_size", 1), 1),
                   dp_size=max(number("dp_size", 1), 1), base_gpu_id=number("base_gpu_id", 0),
                   gpu_id_step=max(number("gpu_id_step", 1), 1),
                   incremental_streaming_output=incremental if isinstance(incremental, bool) else None,
                   stream_interval=interval if interval > 0 else None,
                   max_running_requests=running if running > 0 else None)

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


def iter_frames(chunks: Iterable[bytes]) -> list[dict[str, Any]]:
    """Decode a whole stream at once (tests, tools)."""
    dec = SSEDecoder()
    out: list[dict[str, Any]] = []
    for c in chunks:
        out.extend(dec.feed(c))
    return out


# ---------------------------------------------------------------- /metrics


def metrics_text(values: dict[str, float], *, model_name: str) -> str:
    """Prometheus text exposition of gauges named like SGLang's (``sglang:...``)."""
    label = model_name.replace("\\", "\\\\").replace('"', '\\"')
    lines = []
    for name, value in values.items():
        lines.append(f"# TYPE {name} gauge")
        lines.append(f'{name}{{model_name="{label}"}} {float(value)}')
    return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """Sum each metric's samples over its labels (``sglang:num_running_reqs`` -> 3.0, ...)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name_part, _, rest = line.partition(" ")
        if "{" in line:
            name_part = line[: line.index("{")]
            rest = line[line.rindex("}") + 1 :]
        fields_ = rest.split()
        if not fields_:
            continue
        try:
            value = float(fields_[0])
        except ValueError:
            continue
        out[name_part] = out.get(name_part, 0.0) + value
    return out
