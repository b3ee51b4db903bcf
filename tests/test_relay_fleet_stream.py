"""The control process's fleet streams (instances/relay_hub.RelayHub.stream), in process: every relay's stream
starts with the whole fleet and then carries each change, and all streams send from one scan of the views, so
a change or a tick reads each instance's view once however many relays follow."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from rollout_manager.instances import relay_hub
from rollout_manager.instances.mirror import FleetDelta, ViewTracker, follow, view_of
from rollout_manager.instances.registry import Kind, Registry, State
from rollout_manager.instances.relay_hub import LINES_KEPT, RelayHub
from rollout_manager.instances.version import WeightVersion

DECODE = msgspec.json.Decoder(FleetDelta)


class Follower:
    """A relay's registry following one stream, read all the time as a relay reads it (``hold`` stops reading)."""

    def __init__(self, stream: AsyncIterator[bytes]) -> None:
        self.registry, self.version = Registry(), WeightVersion()
        self.lines: asyncio.Queue[FleetDelta] = asyncio.Queue()
        self.reading = asyncio.Event()
        self.reading.set()
        self.task = asyncio.create_task(self._read(stream))

    async def _read(self, stream: AsyncIterator[bytes]) -> None:
        async for raw in stream:
            await self.reading.wait()
            self.lines.put_nowait(DECODE.decode(raw))

    async def line(self) -> FleetDelta:
        delta = await asyncio.wait_for(self.lines.get(), 5.0)
        follow(self.registry, self.version, delta)
        return delta


def views(registry: Registry) -> dict[str, Any]:
    return {i.id: view_of(i) for i in registry}


async def test_every_stream_sends_the_whole_fleet_then_each_change_from_one_scan(monkeypatch):
    monkeypatch.setattr(relay_hub, "TICK_S", 3600.0)  # no tick while changes with a registry event are counted
    control, version = Registry(), WeightVersion()
    a, b, c = control.add_many([(f"10.0.0.{n}", 30000, Kind.REMOTE, None) for n in (1, 2, 3)])
    hub = RelayHub("run", control, version, health=None)  # type: ignore[arg-type]  # reports are not streamed
    scans = 0
    delta = ViewTracker.delta

    def counted(self: ViewTracker, *args: Any) -> FleetDelta | None:
        nonlocal scans
        scans += 1
        return delta(self, *args)

    monkeypatch.setattr(ViewTracker, "delta", counted)
    relays = [Follower(hub.stream(r)) for r in range(3)]
    for relay in relays:
        first = await relay.line()
        assert first.full and views(relay.registry) == views(control)

    scans = 0
    control.transition(a, State.ACTIVE, "healthy")  # a registry event
    for relay in relays:
        assert [v.id for v in (await relay.line()).changed] == [a.id]
    assert scans == 1

    scans = 0
    version.current = 4  # no registry event: found on the next tick
    control.set_weight_version(b, 4)
    monkeypatch.setattr(relay_hub, "TICK_S", 0.05)
    control.transition(c, State.SYNCING, "moved")  # wakes the streams, which now wait a short tick
    for relay in relays:
        assert [v.id for v in (await relay.line()).changed] == [b.id, c.id]
    ticked = scans
    version.current = 5
    control.set_weight_version(a, 5)
    for relay in relays:
        line = await relay.line()
        assert [v.id for v in line.changed] == [a.id] and line.weight_version == 5
        assert views(relay.registry) == views(control) and relay.version.current == 5
    assert 1 <= scans - ticked <= 2  # a tick or two while the lines were read, not one a stream
    monkeypatch.setattr(relay_hub, "TICK_S", 3600.0)

    # a stream that sent nothing while more changes than the lines kept were made gets the whole fleet again
    late, others = relays[0], relays[1:]
    late.reading.clear()
    for n in range(LINES_KEPT + 2):
        control.set_weight_version(c, 10 + n)
        control.transition(c, State.ACTIVE if n % 2 == 0 else State.SYNCING, "moved")
        for relay in others:
            await relay.line()
    control.transition(b, State.DEAD, "removed")
    late.reading.set()
    first = await late.line()  # the line it held when it stopped reading, then the whole fleet
    assert not first.full and (await late.line()).full
    assert views(late.registry) == views(control) and late.registry.get(b.id) is None
    for relay in others:
        assert (await relay.line()).removed == [b.id]
        assert views(relay.registry) == views(control)
    for relay in relays:
        relay.task.cancel()
