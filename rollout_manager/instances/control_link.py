"""A relay's link to its control process: the fleet it follows and the reports it sends.

The relay says hello (the instances it knows, so a control process that started again takes them back),
follows the fleet stream into its own registry (``mirror.follow``), and reports every ``report_s`` the
failures it saw through each box's fault and its own load. When the control process is gone the relay keeps
serving on the last fleet it saw and connects again with backoff; failures seen meanwhile wait for the next
control process (the newest ``MAX_PENDING`` of them).
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec

from rollout_manager.instances.mirror import FleetDelta, InstanceView, TrustView, ViewListener, follow, views_of
from rollout_manager.instances.registry import Instance, Registry
from rollout_manager.instances.relay_messages import (
    Claim,
    DistrustedItem,
    Marked,
    Outgoing,
    RelayHello,
    RelayLoad,
    RelayReport,
    SavedTokens,
)
from rollout_manager.instances.version import WeightVersion

log = logging.getLogger("rollout_manager.instances.control_link")

MAX_PENDING = 10_000  # failures kept while no control process listens
MAX_LINE = 64 * 1024 * 1024  # one fleet line: a thousand instances' views are about 0.5 MB
BACKOFF_S = (0.1, 2.0)
SEND_PIECE = 256 * 1024  # aiohttp reads a BytesIO body this much at a time, waiting for the socket between


class ControlLink:
    def __init__(self, url: str, relay: int, token: str, registry: Registry, version: WeightVersion,
                 session: aiohttp.ClientSession, load: Callable[[], RelayLoad], report_s: float) -> None:
        self.url = url.rstrip("/")
        self.relay = relay
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.registry = registry
        self.version = version
        self.session = session
        self.load = load
        self.report_s = report_s
        # The tokens of the relay's running sequences to save with each report (rollout.checkpoints; the manager
        # sets it when checkpoints are on).
        self.collect: Callable[[], Outgoing] = _nothing_saved
        # Told each instance's view as it is applied, with the one before (the trust follower), and asked for the
        # distrusted samples to report (rollout.trust_follower; the manager sets both).
        self.on_view: ViewListener | None = None
        self.distrusted: Callable[[], tuple[list[DistrustedItem], Callable[[], None]]] = _none_distrusted
        self._seen: dict[str, InstanceView] = {}
        # The lengths this relay's sequences finished, and where the other relays' go (the length model; the manager
        # sets both when lengths are predicted).
        self.take_lengths: Callable[[], list[tuple[int, int]]] = list
        self.learn_lengths: Callable[[list[tuple[int, int]]], None] = _ignore
        self._unsent_lengths: list[tuple[int, int]] = []
        self.run_id: str | None = None  # the control process's run id (the one boxes see in /health)
        self.connected = False
        self.connects = 0
        self._failures: list[tuple[str, str]] = []
        self._successes: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._telling: set[asyncio.Task[None]] = set()
        self._followed = asyncio.Event()  # set once the first whole fleet was applied

    # ------------------------------------------------------------ what the generator reports
    def report_failure(self, inst: Instance, reason: str) -> None:
        """A request failed through ``inst``'s fault: the control process counts it towards removal."""
        self._failures.append((inst.id, reason))
        del self._failures[:-MAX_PENDING]

    def report_success(self, inst: Instance) -> None:
        self._successes.add(inst.id)

    # ------------------------------------------------------------ running
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._follow(), name="control-link:follow"),
                       loop.create_task(self._report(), name="control-link:report")]

    async def followed(self, timeout_s: float) -> bool:
        """Whether the whole fleet arrived within ``timeout_s`` (a relay starts serving after that)."""
        try:
            await asyncio.wait_for(self._followed.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _follow(self) -> None:
        delay = BACKOFF_S[0]
        while True:
            try:
                await self._hello()
                await self._stream()
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, msgspec.DecodeError, ValueError) as exc:
                if self.connected:  # it was followed until now: connect again soon
                    log.warning("control process at %s lost (%s): serving on the last fleet seen", self.url, exc)
                    delay = BACKOFF_S[0]
                elif delay >= BACKOFF_S[1]:  # still not followed after the backoff's growth: say why, each time
                    log.warning("cannot follow the control process at %s (%s): trying again in %.1fs", self.url,
                                exc, delay)
                self.connected = False
            except Exception:  # a fault here must not end the following: the relay would serve a stale fleet
                log.exception("following the control process at %s failed; connecting again", self.url)
                self.connected = False
            else:
                continue
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_S[1])

    async def _hello(self) -> None:
        hello = RelayHello(self.relay, os.getpid(), self.version.current, views_of(self.registry))
        answer = await self._post("/relay/hello", msgspec.json.encode(hello))
        self.run_id = str(answer["run_id"])
        # A control process counts its trust probes from 1 when it starts: what it says next is new, whatever the
        # last one counted. Quarantines and distrust are kept, so one that happened meanwhile is still acted on.
        self._seen = {iid: msgspec.structs.replace(view, trust=TrustView(distrusting=view.trust.distrusting))
                      for iid, view in self._seen.items()}
        if answer.get("adopted"):
            log.info("the control process took back %d instance(s) from this relay", len(answer["adopted"]))

    async def _stream(self) -> None:
        decoder = msgspec.json.Decoder(FleetDelta)
        async with self.session.get(f"{self.url}/relay/fleet", params={"relay": str(self.relay)},
                                    headers=self.headers, timeout=aiohttp.ClientTimeout(total=None, connect=5),
                                    read_bufsize=1 << 20, max_line_size=MAX_LINE) as resp:
            resp.raise_for_status()
            self.connected = True
            self.connects += 1
            log.info("following the fleet of the control process at %s", self.url)
            async for line in resp.content:
                if line.strip():
                    follow(self.registry, self.version, decoder.decode(line), self.on_view, self._seen)
                    self._followed.set()
        raise aiohttp.ClientPayloadError("the fleet stream ended")

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(self.report_s)
            await self.report()

    async def report(self) -> None:
        """Report now, and again at once while saved tokens were left for the next report (one carries a bounded
        number, ``rollout.checkpoints``), for at most one report interval: everything to save goes within it unless
        the control process takes longer than that to read it (then the rest goes after the next interval)."""
        loop = asyncio.get_running_loop()
        until, more = loop.time() + self.report_s, True
        while more and loop.time() < until:
            try:
                more = await self._report_once()
            except Exception:  # a fault here must not end the reports (failures, saved tokens)
                log.exception("a report to the control process at %s failed to be made", self.url)
                more = False

    async def _report_once(self) -> bool:
        """One report; whether saved tokens were left for the next."""
        failures, successes = self._failures, self._successes
        self._failures, self._successes = [], set()
        outgoing = self.collect()
        distrusted, listed = self.distrusted()
        lengths = self._unsent_lengths + self.take_lengths()
        body = msgspec.json.encode(RelayReport(self.relay, os.getpid(), self.load(), failures, sorted(successes),
                                               outgoing.saved, outgoing.done, distrusted, lengths))
        outgoing.saved = []  # the body carries them now: their ids are freed before it is sent
        try:
            answer = await self._post("/relay/report", body)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
            self._failures[:0] = failures  # kept for the next control process, oldest first
            del self._failures[:-MAX_PENDING]
            self._successes |= successes
            outgoing.lost()
            self._unsent_lengths = lengths[-MAX_PENDING:]
            return False
        outgoing.arrived([str(k) for k in answer.get("missing", ())])
        listed()
        self._unsent_lengths = []
        self.learn_lengths([(int(k), int(n)) for k, n in answer.get("lengths", ())])
        return outgoing.more

    def tell_marked(self, instance: str, sent: int) -> None:
        """This relay marked what ``instance`` made for trust probe ``sent``: the probe waits for that."""
        task = asyncio.get_running_loop().create_task(self._tell_marked(instance, sent))
        self._telling.add(task)
        task.add_done_callback(self._telling.discard)

    async def _tell_marked(self, instance: str, sent: int) -> None:
        try:
            await self._post("/relay/marked", msgspec.json.encode(Marked(self.relay, instance, sent)))
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as exc:
            log.info("could not tell the control process probe %d of %s was marked (%s): it goes after its wait",
                     sent, instance, exc)

    async def claim(self, keys: list[str]) -> dict[str, SavedTokens]:
        """The saved tokens of sequences a caller sent again (none when the control process cannot say now: they
        start from their prompts)."""
        try:
            async with self.session.post(f"{self.url}/relay/claim", data=msgspec.json.encode(Claim(self.relay, keys)),
                                         timeout=aiohttp.ClientTimeout(total=30),
                                         headers={**self.headers, "Content-Type": "application/json"}) as resp:
                resp.raise_for_status()
                return msgspec.json.decode(await resp.read(), type=dict[str, SavedTokens])
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, msgspec.DecodeError) as exc:
            log.warning("saved tokens of %d sequence(s) sent again not available (%s): they start from their "
                        "prompts", len(keys), exc)
            return {}

    async def _post(self, path: str, body: bytes) -> dict[str, Any]:
        # A large body (a report's saved tokens) goes a piece at a time (SEND_PIECE): given whole, it is copied with
        # the headers and again into the transport's buffer, three copies of it at once.
        data: bytes | io.BytesIO = io.BytesIO(body) if len(body) > SEND_PIECE else body
        async with self.session.post(f"{self.url}{path}", data=data, timeout=aiohttp.ClientTimeout(total=10),
                                     headers={**self.headers, "Content-Type": "application/json"}) as resp:
            resp.raise_for_status()
            answer = await resp.json()
        if not isinstance(answer, dict):
            raise ValueError(f"{path} answered {answer!r}")
        return answer

    def status(self) -> dict[str, Any]:
        return {"control": self.url, "connected": self.connected, "connects": self.connects,
                "run_id": self.run_id, "pending_failures": len(self._failures)}


def _nothing_saved() -> Outgoing:
    return Outgoing([], [], lambda missing: None, lambda: None)


def _none_distrusted() -> tuple[list[DistrustedItem], Callable[[], None]]:
    return [], lambda: None


def _ignore(lengths: list[tuple[int, int]]) -> None:
    return None
