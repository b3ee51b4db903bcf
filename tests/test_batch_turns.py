"""A big batch starts its requests over several event-loop turns, not all in one: each start's first step
is a placement, and a thousand of them in one turn blocked the loop (every probe, stream and caller) for
seconds. Both ways of starting many at once are paced, together: ``/batch_generate_requests``
(``batch._BatchRun``) and a batched ``/generate`` (``window.StartWindow``)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from test_batch_window import batch, generator

from rollout_manager.instances.registry import Kind, Registry, State
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.least_in_flight import LeastInFlight
from rollout_manager.rollout.batch import BatchLine, run_batch
from rollout_manager.rollout.request import Request, decode
from rollout_manager.rollout.window import START_PER_TURN, pacer

N = 1000  # well above START_PER_TURN, and within the pool's room: only the pacing spreads the starts


class Turns:
    """Counts event-loop turns: a callback that schedules itself runs once in each. ``check`` runs
    in every turn too (an invariant that must hold at every moment)."""

    def __init__(self, check: Callable[[], None] = lambda: None) -> None:
        self.loop = asyncio.get_running_loop()
        self.n = 0
        self.check = check
        self.loop.call_soon(self._tick)

    def _tick(self) -> None:
        self.n += 1
        self.check()
        self.loop.call_soon(self._tick)

    async def until(self, done: Callable[[], bool], most: int = 10_000) -> None:
        for _ in range(most):
            if done():
                return
            await asyncio.sleep(0)
        raise AssertionError("not reached")


def pool() -> Dispatcher:
    """Room for N at once: one active instance (never called; the requests are stubs) bounded at N."""
    registry = Registry()
    inst = registry.add("127.0.0.1", 9, Kind.REMOTE)
    assert registry.transition(inst, State.ACTIVE, "test: healthy")
    return Dispatcher(registry, LeastInFlight(), max_in_flight_per_instance=N)


class Stub:
    """Stands in for the generator's requests: records, for each, the turn its coroutine was made in
    (started) and the turn it took its first step in; each waits for ``release``."""

    def __init__(self, turns: Turns) -> None:
        self.turns = turns
        self.created: list[int] = []
        self.values: list[Any] = []  # what each request answers, in the order they were started
        self.stepped: list[int] = []
        self.release = asyncio.Event()

    async def run(self, value: Any, answer: Callable[[Any], None] | None = None) -> Any:
        self.stepped.append(self.turns.n)
        await self.release.wait()
        if answer is not None:
            answer(value)
            return None
        return value

    def generate(self, request: Request, answer: Callable[[Any], None] | None = None) -> Coroutine[Any, Any, Any]:
        self.created.append(self.turns.n)
        self.values.append(request.sequences[0].body.input_ids[0])
        return self.run(self.values[-1], answer)

    def run_sequence(self, item: Any, index: int | None = None, on_tokens: Any = None, guarded: bool = False,
                     answer: Callable[[Any], None] | None = None) -> Coroutine[Any, Any, Any]:
        self.created.append(self.turns.n)
        return self.run(index, answer)

    def assert_paced(self) -> None:
        per_turn = Counter(self.stepped)
        assert len(self.stepped) == N
        assert max(per_turn.values()) <= START_PER_TURN, per_turn.most_common(3)
        assert len(per_turn) >= N // START_PER_TURN, sorted(per_turn)


async def test_a_big_batch_starts_its_requests_over_several_turns_answering_each_once_in_order() -> None:
    d = pool()
    g = generator(d)
    counted: list[tuple[int, int]] = []
    turns = Turns(lambda: counted.append((d.capacity.held_by_batches, len(stub.created))))
    stub = Stub(turns)
    g.generate = stub.generate  # type: ignore[method-assign]
    items = [(f"r{k}", decode({"input_ids": [k + 1, 2]})) for k in range(N)]
    lines: list[BatchLine] = []

    async def consume() -> None:
        async for ready in run_batch(g, items):
            lines.extend(ready)

    task = asyncio.ensure_future(consume())
    await turns.until(lambda: len(stub.stepped) == N)  # every one started, none ended: only pacing spread them
    stub.assert_paced()
    stub.release.set()
    await asyncio.wait_for(task, 10)

    assert stub.values == [k + 1 for k in range(N)]  # started in the batch's order
    assert sorted(line.id for line in lines) == sorted(rid for rid, _ in items)  # each id once
    assert all(line.success and line.data == int(line.id[1:]) + 1 for line in lines)
    # held_by_batches is exact in every turn: what the batch holds is what it has not started yet
    assert all(held in (0, N - created) for held, created in counted), counted[:5]
    assert d.capacity.held_by_batches == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_big_batched_generate_starts_its_sequences_over_several_turns(stream: bool) -> None:
    d = pool()
    g = generator(d)
    turns = Turns()
    stub = Stub(turns)
    g.run_sequence = stub.run_sequence  # type: ignore[method-assign]

    async def run() -> list[Any]:
        if not stream:
            out = await g.generate(decode(batch(N)))
            assert isinstance(out, list)
            return out
        finals = []
        async for ready in g.generate_stream(decode({**batch(N), "stream": True})):
            finals += ready
        return finals

    task = asyncio.ensure_future(run())
    await turns.until(lambda: len(stub.stepped) == N)
    stub.assert_paced()
    assert d.capacity.held_by_batches == 0 and d.capacity.windowed == N
    stub.release.set()
    out = await asyncio.wait_for(task, 10)
    assert sorted(out) == list(range(N)) and (stream or out == list(range(N)))
    assert d.capacity.held_by_batches == 0 and d.capacity.windowed == 0


async def test_a_batch_whose_caller_goes_between_turns_starts_nothing_after() -> None:
    d = pool()
    g = generator(d)
    turns = Turns()
    stub = Stub(turns)
    g.generate = stub.generate  # type: ignore[method-assign]
    results = run_batch(g, [(f"r{k}", decode({"input_ids": [k + 1, 2]})) for k in range(N)])
    first = asyncio.ensure_future(results.__anext__())
    await turns.until(lambda: len(stub.created) >= 2 * START_PER_TURN)
    first.cancel()  # the caller went away while the batch was held back by the pacer
    await asyncio.gather(first, return_exceptions=True)
    await results.aclose()
    started, at = len(stub.created), turns.n
    assert started < N and d.capacity.held_by_batches == 0
    await turns.until(lambda: turns.n >= at + 20)
    assert len(stub.created) == started and d.capacity.held_by_batches == 0
    assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]


async def test_batches_started_together_share_the_turns_and_take_them_in_turn() -> None:
    """Two batches at once: at most START_PER_TURN starts per turn between them, and the second does not
    wait until all of the first has started."""
    d = pool()
    g = generator(d)
    turns = Turns()
    stub = Stub(turns)
    g.generate = stub.generate  # type: ignore[method-assign]

    async def consume(base: int) -> None:
        async for _ in run_batch(g, [(k, decode({"input_ids": [base + k, 2]})) for k in range(N // 2)]):
            pass

    tasks = [asyncio.ensure_future(consume(base)) for base in (1, 10_001)]
    await turns.until(lambda: len(stub.stepped) == N)
    stub.assert_paced()
    second = [n for n, value in enumerate(stub.values) if value > 10_000]
    first = [n for n, value in enumerate(stub.values) if value <= 10_000]
    assert second[0] < first[-1] - START_PER_TURN and first[0] < second[-1] - START_PER_TURN
    stub.release.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)


def test_a_loop_that_is_gone_leaves_no_pacer_behind() -> None:
    loop = asyncio.new_event_loop()

    async def use() -> None:
        pacer().spent(1)

    loop.run_until_complete(use())
    loop.close()
    ref = weakref.ref(loop)
    del loop
    gc.collect()
    assert ref() is None  # and so its entry in _pacers is gone
