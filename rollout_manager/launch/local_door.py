"""A loopback port that leads to another process whose address may change (docs/relays.md, "Under Ray").

Under Ray a relay reaches its control process (and relay 0's OpenAI front) through such a door: the relay's
``control_url`` stays ``http://127.0.0.1:<door>`` for its whole life, while the door looks the target's current
``host:port`` up (``resolve``, e.g. a named Ray actor's answer) when it has none or when connecting to the last
one fails. So a control process that Ray started again, on another port or node, is found again before the
relay's next connection, and the relay's own code (control link, forwarders) needs no idea of Ray.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from rollout_manager.config import parse_bind

log = logging.getLogger("rollout_manager.launch.local_door")

CONNECT_TIMEOUT_S = 3.0
CHUNK = 1 << 16


class LocalDoor:
    """Pipes each connection made to its loopback port to ``resolve()``'s ``host:port``; ``resolve`` blocks
    (it runs in a worker thread) and raises when the target cannot be found now."""

    def __init__(self, resolve: Callable[[], str], what: str) -> None:
        self.resolve = resolve
        self.what = what
        self.target: str | None = None
        self.lookups = 0
        self._server: asyncio.Server | None = None

    async def open(self) -> str:
        """Start listening; returns ``127.0.0.1:PORT``."""
        self._server = await asyncio.start_server(self._pipe, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"127.0.0.1:{port}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        for fresh in (self.target is None, True):  # the address known, then a fresh look-up
            if fresh:
                try:
                    target = await asyncio.to_thread(self.resolve)
                except Exception as exc:  # any failure to find it: the caller retries
                    log.warning("cannot find the %s now: %s", self.what, exc)
                    return None
                self.lookups += 1
                if target != self.target:
                    log.info("the %s is at %s", self.what, target)
                self.target = target
            assert self.target is not None
            host, port = parse_bind(self.target)
            try:
                return await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), port), CONNECT_TIMEOUT_S)
            except (OSError, asyncio.TimeoutError):
                continue
        return None

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream = await self._connect()
        if upstream is None:  # the caller sees a refused request and tries again later
            writer.close()
            return
        up_reader, up_writer = upstream
        await asyncio.gather(_copy(reader, up_writer), _copy(up_reader, writer))


async def _copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """One direction; when it ends (EOF or an error) the other side is closed too, so neither end waits on
    a connection whose other half is gone."""
    try:
        while data := await src.read(CHUNK):
            dst.write(data)
            await dst.drain()
    except (OSError, ConnectionError):
        pass
    finally:
        dst.close()
