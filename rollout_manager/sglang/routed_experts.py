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

The rows are held as the base64 text SGLang sent, checked (:func:`checked`) but not decoded, and a
sequence's answer carries that same text when one engine made all its rows: decoding and encoding again
cost about 2 KB of base64 work per token at Qwen3-30B-A3B's 48 layers x top-8, many times what relaying
the token itself costs (docs/benchmarks.md, "Routed-expert replay"). Rows of several engines are joined
as text where base64 allows it (every part but the last a multiple of 3 bytes), else decoded and encoded
once. No Python object per token either way.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field

ROW_ITEM = 4  # bytes of one expert id (int32)
# The most base64 text one position's row may take in an engine's frame: 96 layers x top-16 ids (8 KiB), past
# every MoE model served today (Qwen3: 48 x 8, DeepSeek-V3 and Kimi K2: 58-61 x 8). A request for routed experts
# gets this much room per position on top of engine_max_frame_mb, which bounds the tokens' part.
MAX_ROW_TEXT = 96 * 16 * ROW_ITEM * 4 // 3
_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def checked(value: object) -> str:
    """``meta_info.routed_experts`` as sent, once it is SGLang's base64 (standard alphabet, padded, no
    newlines); raises ValueError otherwise. Costs one pass over the text, not a decode."""
    if type(value) is not str:
        raise ValueError(f"routed_experts is {type(value).__name__}, not a base64 string")
    if not value.isascii() or len(value) % 4:  # isascii reads a flag: no pass
        raise ValueError("routed_experts is not base64: not ASCII, or not a multiple of 4 characters")
    text = value.encode("ascii")
    body = text.rstrip(b"=")
    if len(text) - len(body) > 2 or body.translate(None, _ALPHABET):
        raise ValueError("routed_experts is not base64: a character outside its alphabet")
    return value


def encode(rows: bytes | bytearray) -> str:
    """Rows as ``meta_info.routed_experts`` (base64, no newlines)."""
    return binascii.b2a_base64(rows, newline=False).decode("ascii")


def size(rows: bytes | str) -> int:
    """Bytes of ``rows``: raw rows, or base64 text that :func:`checked` passed (counted, not decoded)."""
    if isinstance(rows, str):
        return len(rows) // 4 * 3 - rows[-2:].count("=")
    return len(rows)


@dataclass(slots=True)
class RoutedExperts:
    """One sequence's routed experts so far: the rows of positions ``[start, end)``, one part per engine
    that sent some, each the base64 text it sent (raw rows handed in are encoded once).

    ``start`` is the caller's ``routed_experts_start_len``; ``row_bytes`` (``layers x top_k x 4``) is learned
    from the first engine that sends rows, and every later engine must agree with it. Rows are handed in
    as raw bytes or as base64 text that :func:`checked` passed (what the wire gives).
    """

    start: int
    end: int = -1  # first position without a row (set to start)
    parts: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # each part's bytes (decoded)
    row_bytes: int = 0  # 0: not known yet

    def __post_init__(self) -> None:
        if self.end < 0:
            self.end = self.start

    @property
    def rows(self) -> bytes:
        """The rows held, decoded (for inspection: answers carry :meth:`to_json`)."""
        return b"".join(base64.b64decode(p) for p in self.parts)

    def check(self, blob: bytes | str, seqlen: int) -> str | None:
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

    def add(self, blob: bytes | str, seqlen: int) -> None:
        """Keep ``blob`` (checked by :meth:`check`) as the rows up to position ``seqlen - 1``."""
        want = max(seqlen - 1 - self.end, 0)
        if want:
            got = size(blob)
            self.row_bytes = got // want
            self.parts.append(blob if isinstance(blob, str) else encode(blob))
            self.sizes.append(got)
            self.end = seqlen - 1

    def reset(self) -> None:
        """Forget every row (the sequence starts again from its prompt)."""
        self.parts = []
        self.sizes = []
        self.end = self.start

    def to_json(self) -> str:
        """The rows as ``meta_info.routed_experts``: one engine's text as it sent it; several engines' joined
        as text when each part but the last is a whole number of base64 quanta (3 bytes), else re-encoded."""
        parts = self.parts
        if len(parts) == 1:
            return parts[0]
        if all(n % 3 == 0 for n in self.sizes[:-1]):
            return "".join(parts)
        return encode(self.rows)
