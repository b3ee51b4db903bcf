"""SGLang's server-sent events, framed and decoded: the manager reads streams with it, the CPU engine
and the manager's own streaming answers write frames with it.

A frame is ``data: {json}\\n\\n``; a stream ends with ``data: [DONE]`` (:data:`.wire.DONE_FRAME`); an
error inside a stream is a frame ``data: {"error": {...}}``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Generic, TypeVar

from rollout_manager import jsonutil
from rollout_manager.sglang.wire import GenerateChunk

_DATA_PREFIX = b"data: "
_DATA_FIELD = b"data:"
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
    scanned once: a frame split over many reads is not searched again from its start.

    ``max_frame`` bounds one frame's bytes (None: no bound): an engine that sends bytes without a frame
    boundary would otherwise grow the buffer for as long as it sends. ``pending`` is the bytes of the
    unfinished frame held now.
    """

    __slots__ = ("_buf", "_scanned", "done", "max_frame")

    def __init__(self, *, max_frame: int | None = None) -> None:
        self._buf = bytearray()
        self._scanned = 0  # bytes of _buf already searched for a frame end
        self.done = False
        self.max_frame = max_frame

    @property
    def pending(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> list[T]:
        limit = self.max_frame
        if not self._buf:  # the usual read: exactly one whole one-line frame
            end = _frame_end(data, 0)
            if end == len(data) - 2 and data.startswith(_DATA_PREFIX) and data.find(b"\n", 0, end) < 0 \
                    and (limit is None or end <= limit):
                obj = self._payload(data[len(_DATA_PREFIX):end])
                return [] if obj is None else [obj]
        buf = self._buf
        buf += data
        out: list[T] = []
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
    """

    __slots__ = ("_ids", "_lps")

    def __init__(self, *, max_frame: int | None = None) -> None:
        super().__init__(max_frame=max_frame)
        self._ids = _SeenPrefix(b'"output_ids":[', b"]")
        self._lps = _SeenPrefix(b'"output_token_logprobs":[', b"]]")

    def _payload(self, payload: bytes) -> GenerateChunk | None:
        if self._is_done(payload):
            return None
        ids, lps = self._ids, self._lps
        if not ids.enabled:  # incremental streams end up here at once
            obj = jsonutil.loads(payload)
            _raise_on_error(obj)
            return GenerateChunk.of(obj)
        cuts = [(seen, c) for seen in (ids, lps) if (c := seen.cut(payload)) is not None]
        skipped: dict[bytes, int] = {}
        if not cuts:
            obj = jsonutil.loads(payload)
        else:
            cuts.sort(key=lambda sc: sc[1][0])
            pieces, pos = [], 0
            for _, (a, b) in cuts:
                pieces.append(payload[pos:a])
                pos = b
            pieces.append(payload[pos:])
            obj = jsonutil.loads(b"".join(pieces))
            skipped = {seen.key: seen.count for seen, _ in cuts}
        _raise_on_error(obj)
        chunk = GenerateChunk.of(obj, skipped.get(ids.key, 0), skipped.get(lps.key, 0))
        if chunk.fault is not None or not chunk.cumulative:
            # Not the cumulative chunk it looked like (or not a chunk): parse it whole, skip no more.
            ids.stop()
            lps.stop()
            return GenerateChunk.of(jsonutil.loads(payload)) if skipped else chunk
        ids.remember(payload, chunk.meta.total)
        lp_list = chunk.meta.logprobs
        if lp_list is not None:
            lps.remember(payload, len(lp_list) + chunk.skipped_logprobs)
        elif chunk.skipped_logprobs:  # cannot happen with a well-formed chunk; never guess
            ids.stop()
            lps.stop()
            return GenerateChunk.of(jsonutil.loads(payload))
        return chunk


def iter_frames(chunks: Iterable[bytes]) -> list[Any]:
    """Decode a whole stream at once (tests, tools)."""
    dec = SSEDecoder()
    out: list[Any] = []
    for c in chunks:
        out.extend(dec.feed(c))
    return out
