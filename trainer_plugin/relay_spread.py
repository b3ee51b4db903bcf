"""The trainer's batches spread over the manager's relays (docs/relays.md, "Under Ray").

With ``custom.rollout_manager.ray_relays`` the manager runs as relay actors with addresses of their own; this
finds their URLs through Ray (``find``) and sends each relay its part of every batch: the requests of one group
(verl's GRPO ``group_key``, else one prompt: the samples the manager groups) go to one relay, chosen by a stable
hash of the group, so siblings and the later turns of a trajectory with a group stay together.

A relay that is lost mid-batch (its stream breaks, or it stops answering) is left out for the rest of the batch;
the ids it had not answered go to the relays found then, marked as sent again (``X-Rollout-Resume``: each
continues from the tokens the lost relay saved in the control process), each id answered exactly once. Each
relay's own client does not wait for that relay to come back (``restart_timeout_s = 0``): a relay Ray starts
again has a new address, found at the next look-up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import aiohttp

from .batch_stream import RESUME_HEADERS, ManagerLink, stream_batch
from .client import ManagerClient
from .client_errors import ManagerLost, ManagerUnavailable

log = logging.getLogger("trainer_plugin.relay_spread")

Item = tuple[Any, dict[str, Any]]
FIND_EVERY_S = 10.0  # the relays are looked up again this often (and whenever one was lost)
MAX_LOSSES = 16  # relay streams lost in one batch before it fails (a relay that answers but keeps breaking)
FIND_RETRY_S = 0.5  # while no relay answers, looked up again this often (up to restart_timeout_s)


@dataclass
class SpreadStats:
    """What the spread did (cumulative)."""

    batches: int = 0
    relays_lost: int = 0  # relay streams that broke mid-batch
    resubmitted: int = 0  # ids sent again to another relay after their relay was lost


def group_of(body: dict[str, Any]) -> str:
    """The key that keeps requests together on one relay: the GRPO group, else the prompt."""
    key = body.get("group_key")
    return f"g:{key}" if key else "p:" + json.dumps(body.get("input_ids", body.get("text")))


def split(items: Iterable[Item], urls: list[str]) -> dict[str, list[Item]]:
    """Each relay's part: a group's requests all go to ``urls[crc32(group) % len(urls)]``."""
    parts: dict[str, list[Item]] = {}
    for item in items:
        url = urls[zlib.crc32(group_of(item[1]).encode()) % len(urls)]
        parts.setdefault(url, []).append(item)
    return parts


class _SentAgain:
    """A relay's client whose batches all say they are sent again (their relay was lost)."""

    def __init__(self, client: ManagerClient) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    async def send(self, method: str, path: str, body: Any, total: float | None,
                   headers: dict[str, str] | None = None) -> aiohttp.ClientResponse:
        return await self._client.send(method, path, body, total, {**RESUME_HEADERS, **(headers or {})})


def _id_key(rid: Any) -> str:
    return json.dumps(rid, sort_keys=True)


class RelaySpread:
    """``batch_generate`` over the relays ``find()`` returns (a blocking call: it runs in a thread)."""

    def __init__(self, find: Callable[[], list[str]], client_options: dict[str, Any] | None = None) -> None:
        """``client_options``: :class:`ManagerClient`'s; its ``restart_timeout_s`` (default 120) is how long a
        batch waits for some relay to answer when none does (Ray is starting them again)."""
        self.find = find
        self.wait_s = float((client_options or {}).get("restart_timeout_s", 120.0))
        self.client_options = {**(client_options or {}), "restart_timeout_s": 0.0}
        self.stats = SpreadStats()
        self._clients: dict[str, ManagerClient] = {}
        self._urls: list[str] = []
        self._found_at = float("-inf")

    async def relays(self, fresh: bool = False) -> list[str]:
        """The relays' URLs, looked up again when ``fresh`` or older than ``FIND_EVERY_S``."""
        if fresh or not self._urls or time.monotonic() - self._found_at > FIND_EVERY_S:
            self._urls = list(await asyncio.to_thread(self.find))
            self._found_at = time.monotonic()
        return self._urls

    def client(self, url: str) -> ManagerClient:
        if url not in self._clients:
            self._clients[url] = ManagerClient(url, **self.client_options)
        return self._clients[url]

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()

    async def batch_generate(self, items: Iterable[Item]) -> AsyncGenerator[dict[str, Any], None]:
        """Each NDJSON line of the batch (``ManagerClient.batch_generate``'s), every id exactly once, from
        whichever relays serve it; raises :class:`ManagerLost` naming the ids when no relay is left."""
        listed = list(items)
        pending = {_id_key(rid): (rid, req) for rid, req in listed}
        self.stats.batches += 1
        lost: set[str] = set()
        lines: asyncio.Queue[tuple[str, list[Item], dict[str, Any] | BaseException | None]] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()

        async def pump(url: str, part: list[Item], again: bool) -> None:
            link = cast(ManagerLink, _SentAgain(self.client(url))) if again else self.client(url)
            try:
                async for line in stream_batch(link, part):
                    await lines.put((url, part, line))
                await lines.put((url, part, None))
            except Exception as exc:  # handed to the consumer, which decides
                await lines.put((url, part, exc))

        async def send(part: list[Item], again: bool = False) -> int:
            deadline, fresh = time.monotonic() + self.wait_s, bool(lost)
            while True:  # the relays not lost in this batch; else any that answers (a lost stream, a live relay)
                found = await self.relays(fresh)
                urls = [u for u in found if u not in lost] or found
                if urls or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(FIND_RETRY_S)
                fresh = True
            if not urls:
                ids = [rid for rid, _ in part]
                raise ManagerLost(f"no relay of the rollout manager answered within {self.wait_s:g}s to send "
                                  f"{len(ids)} request(s) to (lost: {', '.join(sorted(lost))})", ids,
                                  len(listed) - len(pending))
            parts = split(part, urls)
            for url, share in parts.items():
                task = asyncio.get_running_loop().create_task(pump(url, share, again))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            return len(parts)

        losses = 0
        try:
            running = await send(listed) if listed else 0
            while running:
                url, part, got = await lines.get()
                if isinstance(got, dict):
                    key = _id_key(got.get("id"))
                    if pending.pop(key, None) is not None:
                        yield got
                    continue
                running -= 1
                if got is None:
                    continue
                if not isinstance(got, ManagerUnavailable):
                    raise got
                unanswered = [item for item in part if _id_key(item[0]) in pending]
                lost.add(url)
                losses += 1
                self.stats.relays_lost += 1
                if losses > MAX_LOSSES:
                    raise ManagerLost(f"{losses} relay streams of one batch lost (last: {got})",
                                      [rid for rid, _ in pending.values()], len(listed) - len(pending)) from got
                self._found_at = float("-inf")  # look the relays up again for the next batch too
                if unanswered:
                    log.warning("relay %s lost (%s): sending its %d unanswered request(s) to the other relays",
                                url, got, len(unanswered))
                    self.stats.resubmitted += len(unanswered)
                    running += await send(unanswered, again=True)
            if pending:  # every stream ended and these were never answered
                raise ManagerLost(f"the relays' streams ended without {len(pending)} result(s)",
                                  [rid for rid, _ in pending.values()], len(listed) - len(pending))
        finally:
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
