"""Routed-expert replay (R3) as SGLang 0.5.23 answers it, and one sequence's experts assembled across engines.

With ``return_routed_experts`` SGLang's final output carries ``meta_info.routed_experts``: base64 of
little-endian int32, one row of ``layers x top_k`` expert ids per position, covering positions
``[min(start, seqlen - 1), seqlen - 1)`` where ``start`` is ``routed_experts_start_len`` and ``seqlen`` the
prompt plus the tokens made (the last token never went through the model, so it has no row). Only the final
output carries them (never a stream's earlier chunks), an abort's included.

A sequence continued on another engine keeps the rows it holds and asks the next engine only for the rows
it lacks (:attr:`RoutedExperts.end` as that request's ``routed_experts_start_len``): the tokens made on the
first engine keep the experts chosen when they were made, and the next engine adds the positions from
there (its prefill computes the routing of a token the first engine made but never fed back). An engine
that died before its final output leaves no rows; the next engine's prefill then computes them.

The rows are held as the base64 text SGLang sent, checked (:func:`checked`) but never decoded, as the JSON
string it came in (:class:`Base64Rows`: its bytes, quotes included), and a sequence's answer splices those
bytes in as they are (an ``orjson.Fragment``): decoding and encoding again, or even making a ``str`` of the text
and encoding that, cost many times what relaying the token itself costs at Qwen3-30B-A3B's 48 layers x top-8
(2 KB of base64 a token; docs/benchmarks.md, "Routed-expert replay"). A long final chunk's value is cut out of
its bytes before they are parsed (:func:`locate_in_reads`; ``sse.ChunkDecoder``), so the JSON
parser never sees it. Rows of several engines are joined as bytes where base64 allows it (every part but the
last a multiple of 3 bytes), else decoded and encoded once. No Python object per token either way.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field

import orjson

ROW_ITEM = 4  # bytes of one expert id (int32)
# The most base64 text one position's row may take in an engine's frame: 96 layers x top-16 ids (8 KiB), past
# every MoE model served today (Qwen3: 48 x 8, DeepSeek-V3 and Kimi K2: 58-61 x 8). A request for routed experts
# gets this much room per position on top of engine_max_frame_mb, which bounds the tokens' part.
MAX_ROW_TEXT = 96 * 16 * ROW_ITEM * 4 // 3
_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
# The field as SGLang (orjson) writes it: no space, and the quote that opens a string value. It cannot occur
# inside a JSON string (a quote there is escaped), nor inside a number list.
KEY = b'"routed_experts":"'
_NOT_QUANTA = "routed_experts is not base64: not ASCII, or not a multiple of 4 characters"
_NOT_ALPHABET = "routed_experts is not base64: a character outside its alphabet"
_PADDED = (b'""', b'"="', b'"=="')  # what is left of a quoted base64 value once its alphabet is taken out
_CHECK_WINDOW = 64 * 1024  # bytes checked at a time: under glibc's smallest mmap threshold, no system call


class Base64Rows:
    """Routed-expert rows as SGLang's base64, checked, kept as the JSON string they came in: ``quoted`` is its
    bytes, quotes included (no escapes: base64 has none), so an answer splices them in as they are
    (:meth:`to_json`). Not a dataclass: orjson would encode one as an object of its fields."""

    __slots__ = ("quoted",)

    def __init__(self, quoted: bytes) -> None:
        self.quoted = quoted

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Base64Rows) and other.quoted == self.quoted

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Base64Rows({self.quoted[:40]!r}{'...' if len(self.quoted) > 40 else ''})"

    @classmethod
    def of_json(cls, quoted: bytes) -> Base64Rows:
        """The rows of a JSON string's bytes (quotes included), once the text is SGLang's base64 (standard
        alphabet, padded, no newlines, no escapes); raises ValueError otherwise. One pass, no decode."""
        n = len(quoted)
        if n < 2 or quoted[:1] != b'"' or (n - 2) % 4:
            raise ValueError(_NOT_QUANTA)
        # A C loop; what is left is the quotes and the padding. By windows: translate allocates its input's length
        # for its answer, and megabytes at a time would grow and trim the heap on every final chunk.
        if n <= _CHECK_WINDOW:
            rest = quoted.translate(None, _ALPHABET)
        else:
            rest = b"".join([quoted[at:at + _CHECK_WINDOW].translate(None, _ALPHABET)
                             for at in range(0, n, _CHECK_WINDOW)])
        if rest not in _PADDED or not quoted.endswith(rest[1:]):
            raise ValueError(_NOT_ALPHABET)
        return cls(quoted)

    @property
    def size(self) -> int:
        """Bytes of the rows (counted, not decoded)."""
        q = self.quoted
        return (len(q) - 2) // 4 * 3 - q[-3:-1].count(b"=")

    @property
    def text(self) -> memoryview:
        """The base64 text, without its quotes (a view: no copy)."""
        return memoryview(self.quoted)[1:-1]

    def to_json(self) -> orjson.Fragment:
        """The JSON string itself, for ``jsonutil.dumps`` to copy into an answer as it is (no scan, no str)."""
        return orjson.Fragment(self.quoted)


EMPTY = Base64Rows(b'""')


def checked(value: object) -> Base64Rows:
    """``meta_info.routed_experts`` as parsed JSON, once it is SGLang's base64 (:meth:`Base64Rows.of_json`);
    raises ValueError otherwise. For a value the decoder did not cut out of its chunk's bytes
    (:func:`locate_in_reads`)."""
    if type(value) is not str:
        raise ValueError(f"routed_experts is {type(value).__name__}, not a base64 string")
    if not value.isascii() or len(value) % 4:  # isascii reads a flag: no pass
        raise ValueError(_NOT_QUANTA)
    return Base64Rows.of_json(b'"' + value.encode("ascii") + b'"')


Span = tuple[bytes, int, int]  # bytes[start:stop] of one read
Place = tuple[int, int]  # (read, position in it)


class _Split(Exception):
    """The key may be split over two reads."""


def locate_in_reads(spans: list[Span]) -> tuple[list[Span], list[Span], list[Span]] | None:
    """Where the ``routed_experts`` string value is in a chunk's bytes as its reads hold them (``spans``, in
    order; or the ranges of one payload the decoder parses, a range it cut out holding numbers only), so the
    value is joined on its own and nothing else is copied with it: the bytes split in three, up to and with the
    value's opening quote, the value with its quotes, and from its closing quote on. None when the field is not
    there as SGLang writes it, is there more than once, or may have its key split over two spans (rare: the
    caller joins the reads and looks again, or parses the chunk whole). The value is not checked here
    (:meth:`Base64Rows.of_json`)."""
    try:
        found = _find(spans, (0, spans[0][1]), KEY)
        if found is None:
            return None
        opening = (found[0], found[1] + len(KEY) - 1)
        closing = _find(spans, (opening[0], opening[1] + 1), b'"')  # base64 holds no quote, nor any escape
        if closing is None or _find(spans, (closing[0], closing[1] + 1), KEY) is not None:
            return None
    except _Split:
        return None
    after = (closing[0], closing[1] + 1)
    return (_between(spans, (0, spans[0][1]), (opening[0], opening[1] + 1)), _between(spans, opening, after),
            _between(spans, closing, (len(spans) - 1, spans[-1][2])))


def _find(spans: list[Span], place: Place, sub: bytes) -> Place | None:
    """The first ``sub`` in ``spans`` from ``place`` on; raises :class:`_Split` where ``sub`` may be split over
    two reads before it."""
    i, pos = place
    while i < len(spans):
        buf, start, stop = spans[i]
        at = buf.find(sub, max(pos, start), stop)
        if at >= 0:
            return i, at
        if len(sub) > 1 and i + 1 < len(spans):
            nxt, nstart, _ = spans[i + 1]
            if sub in buf[max(start, pos, stop - len(sub) + 1):stop] + nxt[nstart:nstart + len(sub) - 1]:
                raise _Split()
        i, pos = i + 1, 0
    return None


def _between(spans: list[Span], begin: Place, end: Place) -> list[Span]:
    """The spans' bytes from ``begin`` up to ``end`` (not included)."""
    (i, a), (j, b) = begin, end
    if i == j:
        return [(spans[i][0], a, b)] if a < b else []
    return [(spans[i][0], a, spans[i][2]), *spans[i + 1:j], (spans[j][0], spans[j][1], b)]


def encode(rows: bytes | bytearray) -> Base64Rows:
    """Raw rows as ``meta_info.routed_experts`` (base64, no newlines)."""
    return Base64Rows(b'"' + binascii.b2a_base64(rows, newline=False) + b'"')


def size(rows: bytes | Base64Rows) -> int:
    """Bytes of ``rows``: raw rows, or base64 that was checked (counted, not decoded)."""
    return rows.size if isinstance(rows, Base64Rows) else len(rows)


@dataclass(slots=True)
class RoutedExperts:
    """One sequence's routed experts so far: the rows of positions ``[start, end)``, one part per engine
    that sent some, each the base64 it sent (raw rows handed in are encoded once).

    ``start`` is the caller's ``routed_experts_start_len``; ``row_bytes`` (``layers x top_k x 4``) is learned
    from the first engine that sends rows, and every later engine must agree with it. Rows are handed in
    as raw bytes or as checked base64 (:class:`Base64Rows`: what the wire gives).
    """

    start: int
    end: int = -1  # first position without a row (set to start)
    parts: list[Base64Rows] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # each part's bytes (decoded)
    row_bytes: int = 0  # 0: not known yet

    def __post_init__(self) -> None:
        if self.end < 0:
            self.end = self.start

    @property
    def rows(self) -> bytes:
        """The rows held, decoded (for inspection: answers carry :meth:`to_json`)."""
        return b"".join(base64.b64decode(p.text) for p in self.parts)

    def check(self, blob: bytes | Base64Rows, seqlen: int) -> str | None:
        """Why ``blob`` (an engine's rows for a request that started at :attr:`end` and ended with ``seqlen``
        positions) is not what that engine owes, or None."""
        want = max(seqlen - 1 - self.end, 0)
        got = size(blob)
        if want == 0:
            return None if not got else f"{got} bytes of routed experts for no position"
        if got % (want * ROW_ITEM):
            return f"{got} bytes of routed experts do not make {want} rows of int32"
        if self.row_bytes and got != want * self.row_bytes:
            return (f"{got // want} bytes a row of routed experts where earlier engines sent "
                    f"{self.row_bytes}")
        return None

    def add(self, blob: bytes | Base64Rows, seqlen: int) -> None:
        """Keep ``blob`` (checked by :meth:`check`) as the rows up to position ``seqlen - 1``."""
        want = max(seqlen - 1 - self.end, 0)
        if want:
            got = size(blob)
            self.row_bytes = got // want
            self.parts.append(blob if isinstance(blob, Base64Rows) else encode(blob))
            self.sizes.append(got)
            self.end = seqlen - 1

    def reset(self) -> None:
        """Forget every row (the sequence starts again from its prompt)."""
        self.parts = []
        self.sizes = []
        self.end = self.start

    def cut(self, end: int) -> None:
        """Keep the rows of the positions before ``end`` only (never before :attr:`start`): the part a cut falls
        inside is decoded, cut at a row and encoded again (a cut-back is rare; the rest stay as sent)."""
        end = max(self.start, min(end, self.end))
        if end == self.end:
            return
        keep = (end - self.start) * self.row_bytes
        parts, sizes, held = [], [], 0
        for part, size in zip(self.parts, self.sizes):
            if held + size <= keep:
                parts.append(part)
                sizes.append(size)
                held += size
                continue
            if held < keep:
                parts.append(encode(base64.b64decode(part.text)[:keep - held]))
                sizes.append(keep - held)
                held = keep
            break
        self.parts, self.sizes, self.end = parts, sizes, end

    def to_json(self) -> Base64Rows:
        """The rows as ``meta_info.routed_experts``: one engine's base64 as it sent it; several engines' joined
        as bytes, once, when each part but the last is a whole number of base64 quanta (3 bytes), else
        re-encoded."""
        parts = self.parts
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return EMPTY
        if all(n % 3 == 0 for n in self.sizes[:-1]):
            return Base64Rows(b"".join([b'"', *(p.text for p in parts), b'"']))
        return encode(self.rows)
