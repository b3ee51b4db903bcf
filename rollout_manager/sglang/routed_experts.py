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

The rows are held as the bytes SGLang sent (no Python object per token) and sent on base64-encoded once.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field

ROW_ITEM = 4  # bytes of one expert id (int32)


def decode(value: object) -> bytes:
    """``meta_info.routed_experts`` as bytes; raises ValueError for a value that is not SGLang's base64."""
    if type(value) is not str:
        raise ValueError(f"routed_experts is {type(value).__name__}, not a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"routed_experts is not base64: {exc}") from None


def encode(rows: bytes | bytearray) -> str:
    """Rows as ``meta_info.routed_experts`` (base64, no newlines)."""
    return binascii.b2a_base64(rows, newline=False).decode("ascii")


@dataclass(slots=True)
class RoutedExperts:
    """One sequence's routed experts so far: the rows of positions ``[start, end)``, in SGLang's bytes.

    ``start`` is the caller's ``routed_experts_start_len``; ``row_bytes`` (``layers x top_k x 4``) is learned
    from the first engine that sends rows, and every later engine must agree with it.
    """

    start: int
    end: int = -1  # first position without a row (set to start)
    rows: bytearray = field(default_factory=bytearray)
    row_bytes: int = 0  # 0: not known yet

    def __post_init__(self) -> None:
        if self.end < 0:
            self.end = self.start

    def check(self, blob: bytes, seqlen: int) -> str | None:
        """Why ``blob`` (an engine's rows for a request that started at :attr:`end` and ended with ``seqlen``
        positions) is not what that engine owes, or None."""
        want = max(seqlen - 1 - self.end, 0)
        if want == 0:
            return None if not blob else f"{len(blob)} bytes of routed experts for no position"
        if len(blob) % (want * ROW_ITEM):
            return f"{len(blob)} bytes of routed experts do not make {want} rows of int32"
        if self.row_bytes and len(blob) != want * self.row_bytes:
            return (f"{len(blob) // want} bytes a row of routed experts where earlier engines sent "
                    f"{self.row_bytes}")
        return None

    def add(self, blob: bytes, seqlen: int) -> None:
        """Keep ``blob`` (checked by :meth:`check`) as the rows up to position ``seqlen - 1``."""
        want = max(seqlen - 1 - self.end, 0)
        if want:
            self.row_bytes = len(blob) // want
            self.rows += blob
            self.end = seqlen - 1

    def reset(self) -> None:
        """Forget every row (the sequence starts again from its prompt)."""
        self.rows = bytearray()
        self.end = self.start

    def to_json(self) -> str:
        return encode(self.rows)
