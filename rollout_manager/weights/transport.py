"""What the agents and the pusher need from a transport; :class:`MooncakeEngine` and :class:`TcpEngine`
both provide it, structurally, so a new transport is one more class of this shape and no union to widen.

Runs in: box, trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Transport(Protocol):
    """Moves raw memory ranges between registered buffers on two hosts."""

    @property
    def session_id(self) -> str:
        """What a peer passes as ``target`` to write here (``"host:port"``); needs :meth:`start`."""
        ...

    def start(self) -> Transport:
        """Bring the engine up (idempotent); returns the engine."""
        ...

    def close(self) -> None:
        """Stop it and forget every registered range (idempotent)."""
        ...

    def register(self, addr: int, length: int) -> None:
        """Expose ``[addr, addr + length)`` to peers (as a write target and as a write source)."""
        ...

    def unregister(self, addr: int) -> None:
        ...

    def write_many(self, target: str, items: Sequence[tuple[int, int, int]], *, mode: str = ...,
                   timeout_s: float | None = None) -> None:
        """Write every ``(local_addr, remote_addr, length)`` to ``target``, all in flight together;
        returns once every byte landed, raises ``TransferError`` otherwise."""
        ...
