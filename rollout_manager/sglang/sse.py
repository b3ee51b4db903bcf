"""SGLang's server-sent events, framed and decoded: the manager reads streams with it, the CPU engine
and the manager's own streaming answers write frames with it.

A frame is ``data: {json}\\n\\n``; a stream ends with ``data: [DONE]`` (:data:`.wire.DONE_FRAME`); an
error inside a stream is a frame ``data: {"error": {...}}``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Generic, TypeVar

from rollout_manager import jsonutil
from rollout_manager.sglang import routed_experts as routed
from rollout_manager.sglang.wire import GenerateChunk

_DATA_PREFIX = b"data: "
_DATA_FIELD = b"data:"
_IDS_KEY = b'"output_ids":['  # cannot occur inside a JSON string (its quotes are escaped)
_LPS_KEY = b'"output_token_logprobs":['
T = TypeVar("T")


def sse_frame(obj: Any) -> bytes:
    """One server-sent-event frame carrying a JSON object."""
    return _DATA_PREFIX + jsonutil.dumps(obj) + b"\n\n"


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


def _joined(spans: list[routed.Span]) -> bytes:
    """The bytes of ``spans`` ((read, start, stop) each), joined: one copy."""
    return b"".join([buf if start == 0 and stop == len(buf) else memoryview(buf)[start:stop]
                     for buf, start, stop in spans])


class _SeenPrefix:
    """The raw bytes of one JSON array's content as the last cumulative chunk had it.

    SGLang serializes with orjson, so the next cumulative chunk's array starts with exactly these
    bytes; cutting them out before parsing makes a chunk cost what it adds, not the sequence's length.
    """

    __slots__ = ("key", "closer", "raw", "count", "enabled")

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
            self.stop()
            return
        raw = payload[where[0]:where[1]]
        if b'"' in raw:  # strings inside (text in log-probs): a bracket may hide in them, so stop here
            self.stop()
            return
        self.raw, self.count = raw, count

    def stop(self) -> None:
        """Skip no more (and hold no bytes for it)."""
        self.enabled, self.raw = False, b""


class _Frames(Generic[T]):
    """Incremental reader of an event stream: feed bytes, get one item per ``data:`` field.

    ``done`` turns true at ``data: [DONE]``; a stream that ends before it is a broken stream. Bytes are
    scanned once: a frame split over many reads is not searched again from its start, and its reads are
    held as they came and joined once, at its end (a routed-experts frame runs to megabytes: growing one
    buffer read by read costs a copy of all of it so far at every growth).

    ``max_frame`` bounds one frame's bytes (None: no bound): an engine that sends bytes without a frame
    boundary would otherwise hold more for as long as it sends. ``pending`` is the bytes of the
    unfinished frame held now.
    """

    __slots__ = ("_parts", "_pending", "done", "max_frame")

    def __init__(self, *, max_frame: int | None = None) -> None:
        self._parts: list[bytes] = []  # the unfinished frame's reads, in order
        self._pending = 0  # their bytes
        self.done = False
        self.max_frame = max_frame

    @property
    def pending(self) -> int:
        return self._pending

    def feed(self, data: bytes) -> list[T]:
        limit = self.max_frame
        parts = self._parts
        out: list[T] = []
        pos = 0
        if not parts:  # the usual read: exactly one whole one-line frame
            end = _frame_end(data, 0)
            if end == len(data) - 2 and data.startswith(_DATA_PREFIX) and data.find(b"\n", 0, end) < 0 \
                    and (limit is None or end <= limit):
                obj = self._payload(data[len(_DATA_PREFIX):end])
                return [] if obj is None else [obj]
        else:  # the end of the frame held, if this read brings it
            if parts[-1].endswith(b"\n") and data.startswith(b"\n"):  # its boundary is split over the reads
                end, pos = -1, 1
            else:
                end = _frame_end(data, 0)
                if end < 0:
                    parts.append(data)
                    self._pending += len(data)
                    self._check_pending()
                    return out
                pos = end + 2
            if limit is not None and self._pending + end > limit:
                raise FrameTooLarge(f"a stream frame of {self._pending + end} bytes, over the bound of {limit} "
                                    f"(engine_max_frame_mb)")
            self._parts, self._pending = [], 0
            self._held_frame(parts, data, end, out)
        while True:
            cut = _frame_end(data, pos)
            if cut < 0:
                break
            if limit is not None and cut - pos > limit:
                raise FrameTooLarge(f"a stream frame of {cut - pos} bytes, over the bound of {limit} "
                                    f"(engine_max_frame_mb)")
            start, pos = pos, cut + 2
            if data.startswith(_DATA_PREFIX, start) and data.find(b"\n", start, cut) < 0:  # one data line
                self._emit(data[start + len(_DATA_PREFIX):cut], out)
            else:
                self._lines(data[start:cut], out)
        if pos < len(data):
            rest = data[pos:] if pos else data
            self._parts.append(rest)
            self._pending = len(rest)
            self._check_pending()
        return out

    def _held_frame(self, parts: list[bytes], data: bytes, end: int, out: list[T]) -> None:
        """Decode the frame made of the reads held (``parts``) and ``data[:end]`` (``end`` -1: the last read
        held ends with the first newline of the boundary), joining the reads once."""
        spans = [(p, 0, len(p)) for p in parts]  # (read, start, stop): the frame's bytes, read by read
        if end < 0:
            spans[-1] = (parts[-1], 0, len(parts[-1]) - 1)
        elif end:
            spans.append((data, 0, end))
        first, _, stop = spans[0]
        if stop >= len(_DATA_PREFIX) and first.startswith(_DATA_PREFIX):
            spans[0] = (first, len(_DATA_PREFIX), stop)
            self._held_payload(spans, out)
        else:
            self._lines(_joined(spans), out)

    def _held_payload(self, spans: list[routed.Span], out: list[T]) -> None:
        """Decode a held frame's bytes after ``data: `` (``spans``, read by read): one data line, or several."""
        payload = _joined(spans)
        if payload.find(b"\n") < 0:  # one data line: the payload as is (a memchr pass, no copy)
            self._emit(payload, out)
        else:
            self._lines(_DATA_PREFIX + payload, out)

    def _lines(self, frame: bytes, out: list[T]) -> None:
        """Decode a frame of several lines (or of a field other than ``data:``): each ``data:`` line."""
        for line in frame.split(b"\n"):
            line = line.strip()
            if line.startswith(_DATA_FIELD):
                self._emit(line[len(_DATA_FIELD):], out)

    def _emit(self, payload: bytes, out: list[T]) -> None:
        obj = self._payload(payload)
        if obj is not None:
            out.append(obj)

    def _check_pending(self) -> None:
        limit = self.max_frame
        if limit is not None and self._pending > limit:
            raise FrameTooLarge(f"{self._pending} bytes without a frame boundary, over the bound of {limit} for "
                                f"one frame (engine_max_frame_mb)")

    def _is_done(self, payload: bytes) -> bool:
        if payload[:2] != b"{\"" and payload.strip() == b"[DONE]":
            self.done = True
            return True
        return False

    def _payload(self, payload: bytes) -> T | None:
        """One ``data:`` field's item; None for ``[DONE]``; raises :class:`StreamError` on an error frame."""
        raise NotImplementedError


def _raise_on_error(obj: Any) -> None:
    if isinstance(obj, dict) and "error" in obj and "meta_info" not in obj:
        raise StreamError(obj["error"])


class SSEDecoder(_Frames[Any]):
    """Any stream's frames as JSON values (for tools, tests and any stream of several sequences)."""

    __slots__ = ()

    def _payload(self, payload: bytes) -> Any:
        if self._is_done(payload):
            return None
        obj = jsonutil.loads(payload)
        _raise_on_error(obj)
        return obj


class ChunkDecoder(_Frames[GenerateChunk]):
    """One sequence's ``/generate`` stream (as the manager sends them) as :class:`.wire.GenerateChunk` s.

    Cumulative chunks are parsed without the ids and log-probs already seen: SGLang serializes with
    orjson, so each repeats the previous chunk's arrays byte for byte (:class:`_SeenPrefix`), and a
    chunk then costs what it adds, not the sequence's length. The chunk says how many it left out
    (``skipped_ids``, ``skipped_logprobs``). A chunk that does not fit (an incremental stream, a format
    surprise) is parsed whole, and skipping stops for that stream.

    A long chunk's routed experts (R3: megabytes of base64 on the final chunk) are cut out of its bytes
    before it is parsed and checked in place (:func:`.routed_experts.locate_in_reads`); the chunk carries them as
    :class:`.routed_experts.Base64Rows`. A value that is not base64 as SGLang writes it is left in, and the
    chunk is parsed with it (whose ``fault`` then says why, as for a short chunk).
    """

    __slots__ = ("_ids", "_lps", "_rows")

    def __init__(self, *, max_frame: int | None = None) -> None:
        super().__init__(max_frame=max_frame)
        self._ids = _SeenPrefix(_IDS_KEY, b"]")
        self._lps = _SeenPrefix(_LPS_KEY, b"]]")
        self._rows: routed.Base64Rows | None = None  # cut out of the held frame being decoded

    def _held_payload(self, spans: list[routed.Span], out: list[GenerateChunk]) -> None:
        """A frame held over several reads: its routed experts are joined from the reads on their own (the
        rest once, without them), so their megabytes are copied once; else as any frame."""
        parts = routed.locate_in_reads(spans)
        if parts is not None:
            before, value, after = parts
            try:
                rows = routed.Base64Rows.of_json(_joined(value))
            except ValueError:  # parsed with the chunk: its fault says why
                pass
            else:
                payload = _joined(before + after)  # the value's quotes kept: the parser reads an empty string
                if payload.find(b"\n") < 0:
                    self._rows = rows
                    try:
                        self._emit(payload, out)
                    finally:
                        self._rows = None
                    return
        super()._held_payload(spans, out)

    def _payload(self, payload: bytes) -> GenerateChunk | None:
        if self._is_done(payload):
            return None
        ids, lps, rows = self._ids, self._lps, self._rows
        if not ids.enabled:  # incremental streams end up here at once
            return _chunk(payload, (), rows)
        cuts = sorted(((c, seen) for seen in (ids, lps) if (c := seen.cut(payload)) is not None),
                      key=lambda cut: cut[0])
        chunk = _chunk(payload, cuts, rows)
        if chunk.fault is not None or not chunk.cumulative:
            # Not the cumulative chunk it looked like (or not a chunk): parse it whole, skip no more.
            ids.stop()
            lps.stop()
            return _chunk(payload, (), rows) if cuts else chunk
        ids.remember(payload, chunk.meta.total)
        lp_list = chunk.meta.logprobs
        if lp_list is not None:
            lps.remember(payload, len(lp_list) + chunk.skipped_logprobs)
        elif chunk.skipped_logprobs:  # cannot happen with a well-formed chunk; never guess
            ids.stop()
            lps.stop()
            return _chunk(payload, (), rows)
        return chunk


# A chunk at least this long is looked at for routed experts to cut out (the search costs a memchr-speed pass
# over what is parsed anyway; a shorter chunk's experts are parsed with it, which costs as little).
EXPERTS_CUT_FROM = 4096


def _chunk(payload: bytes, cuts: Iterable[tuple[tuple[int, int], _SeenPrefix]],
           rows: routed.Base64Rows | None = None) -> GenerateChunk:
    """The chunk of ``payload`` less the byte ranges ``cuts`` (sorted; seen prefixes whose counts the chunk
    says it skipped) and less its routed experts' text when it is long (:class:`ChunkDecoder`); ``rows``: the
    experts already cut out of the payload (an empty string stands in their place)."""
    spans: list[routed.Span] = []
    pos = 0
    skipped: dict[bytes, int] = {}
    for (a, b), seen in cuts:
        spans.append((payload, pos, a))
        pos = b
        skipped[seen.key] = seen.count
    spans.append((payload, pos, len(payload)))
    if rows is None and len(payload) >= EXPERTS_CUT_FROM and (found := routed.locate_in_reads(spans)) is not None:
        before, value, after = found
        try:
            rows = routed.Base64Rows.of_json(_joined(value))
        except ValueError:  # parsed with the chunk: its fault says why
            pass
        else:
            spans = before + after
    obj = jsonutil.loads(payload if len(spans) == 1 and spans[0][1:] == (0, len(payload)) else _joined(spans))
    _raise_on_error(obj)
    chunk = GenerateChunk.of(obj, skipped.get(_IDS_KEY, 0), skipped.get(_LPS_KEY, 0))
    experts = chunk.meta.experts
    if rows is not None and experts is not None and experts.quoted == routed.EMPTY.quoted:
        chunk.meta.experts = rows  # the final chunk's (the value cut out is the one the chunk read as empty)
    return chunk


def iter_frames(chunks: Iterable[bytes]) -> list[Any]:
    """Decode a whole stream at once (tests, tools)."""
    dec = SSEDecoder()
    out: list[Any] = []
    for c in chunks:
        out.extend(dec.feed(c))
    return out
