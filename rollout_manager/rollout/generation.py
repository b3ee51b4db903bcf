"""Generation with token-level continuation.

Every sequence is streamed from SGLang whatever the caller asked (unless what is left fits in one
chunk interval and the caller does not stream: then one answer is asked for), and the tokens (and
log-probs) seen so far are kept. When the instance fails mid-sequence, the sequence continues on another instance
with ``input_ids`` extended by those tokens and ``max_new_tokens`` reduced by them, so no token is
lost and none is generated twice; the result lists the segments it was made of (instance, weight
version, token range) so a sample mixing weight versions is visible. A long sequence may be generated in
pieces (:mod:`.pieces`): each attempt asks for at most one, and the next is placed again from the tokens
made, preferring the instance the sequence is on, the same way but with nothing failed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from rollout_manager.errors import Unavailable
from rollout_manager.instances.registry import Instance, Kind, State
from rollout_manager.placement import affinity as aff
from rollout_manager.placement.ask import Ask
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.lengths import LengthModel, Prediction, Track
from rollout_manager.placement.local_budget import LocalBudget
from rollout_manager.placement.tail_migration import Rest
from rollout_manager.rollout import checkpoints
from rollout_manager.rollout.answers import final_answer, partial_answer
from rollout_manager.rollout.attempt import Attempts
from rollout_manager.rollout.counters import new_generation_stats
from rollout_manager.rollout.generation_settings import GenerationSettings as GenerationSettings  # re-exported
from rollout_manager.rollout.migration import Migrator
from rollout_manager.rollout.outcome import GenerationFailed as GenerationFailed  # re-exported
from rollout_manager.rollout.request import Request, SequenceRequest
from rollout_manager.rollout.sequence import (
    SequenceState,
    version_floor,
    with_failures,
    with_floor,
    within_version,
)
from rollout_manager.rollout.vocab import VocabBound
from rollout_manager.rollout.window import StartWindow
from rollout_manager.sglang import wire
from rollout_manager.sglang.answer import ErrorChunk, GenerateAnswer
from rollout_manager.sglang.client import SGLangClient
from rollout_manager.sglang.coalesce import Coalescer
from rollout_manager.sglang.finish import FinalMeta, FinishReason

log = logging.getLogger("rollout_manager.rollout.generation")


class Generator:
    """Runs sequences on the pool; the HTTP layer only hands it validated bodies."""

    def __init__(self, dispatcher: Dispatcher, client: SGLangClient, settings: GenerationSettings,
                 budget: LocalBudget,
                 on_instance_failure: Callable[[Instance, str], None],
                 on_instance_success: Callable[[Instance], None]):
        self.dispatcher = dispatcher
        self.budget = budget
        self.client = client
        self.settings = settings
        self.on_instance_failure = on_instance_failure
        self.on_instance_success = on_instance_success
        self.local = dispatcher.local
        self.coalescer = Coalescer(settings.batch_max)
        # The manager's own request ids: unique per run (random prefix) and cheap (no urandom per request).
        self._rid_prefix = f"{uuid.uuid4().hex[:8]}-"
        self._rid_counter = itertools.count()
        self.stats = new_generation_stats()  # the keys are metrics' (rollout.counters)
        self.checkpoints: checkpoints.Checkpoints | None = None  # a relay's sequences saved outside it (None: not)
        self.affinity_fallbacks = dict.fromkeys(aff.FALLBACK_REASONS, 0)  # by reason
        self.vocab = VocabBound(dispatcher.registry, settings.vocab_size)  # input ids are checked against it
        # Each sequence's group, told at its start and end only (never per token): lengths predicted early.
        self.lengths = LengthModel() if settings.length_prediction else None
        self.migrator = Migrator(dispatcher, client, settings.migration, settings.migration_interval_s,
                                 bound=lambda seq: self._allowed(seq, restart=False), stats=self.stats,
                                 predict=None if self.lengths is None else _predict_left(self.lengths))
        self.attempts = Attempts(dispatcher, client, settings, self.coalescer, self.migrator, self.stats,
                                 lambda seq: self._allowed(seq, restart=False), on_instance_failure,
                                 on_instance_success)
        self.stopping = asyncio.Event()  # the shutdown grace is over: what still runs is failed (503)
        self._requests: set[asyncio.Task[Any]] = set()
        # Told once per sequence that ended for its caller: (latency_s, completion tokens, ok). Metrics.
        self.finished_listeners: list[Callable[[float, int, bool], None]] = []

    # ------------------------------------------------------------ public
    def begin_rollout(self) -> None:
        """A request arrived: open the local window if a step just began and local instances serve."""
        if self.local.armed and self.dispatcher.registry.count(State.ACTIVE, Kind.LOCAL):
            self.local.open(self.budget.budget_s)

    def _enter(self) -> asyncio.Task[Any]:
        """Register the caller's task: the end of the shutdown grace cancels it, which runs every
        ``finally`` below it (aborting its sequences on their instances). No extra task per request."""
        me = asyncio.current_task()
        assert me is not None
        self._requests.add(me)
        return me

    def _stopped(self, me: asyncio.Task[Any]) -> None:
        """A request was cancelled: when by the end of the shutdown grace, it fails with 503."""
        if not self.stopping.is_set():
            return
        if hasattr(me, "uncancel"):
            me.uncancel()
        raise GenerationFailed(503, "rollout manager is shutting down; the request was aborted") from None

    def stop(self) -> None:
        """The shutdown grace is over: fail what still runs."""
        self.stopping.set()
        for task in list(self._requests):
            task.cancel()

    def generate(self, request: Request, answer: Callable[[GenerateAnswer], None] | None = None
                 ) -> Coroutine[Any, Any, GenerateAnswer | list[GenerateAnswer] | None]:
        """A decoded ``/generate`` -> SGLang's final answer (a list for batched input), to await. The
        sequence's own coroutine, not a wrapper's: a sequence in flight holds every frame it awaits in. The
        awaiting task is registered for the shutdown grace (:meth:`stop`) inside it. ``answer``: one
        sequence's answer is handed to it in the step that builds it, and None returned (see ``batch.py``)."""
        self.begin_rollout()
        if not request.batched:  # the common case, straight to its one sequence
            return self.run_sequence(request.sequences[0], guarded=True, answer=answer)
        return self._generate_batch(request.sequences)

    async def _generate_batch(self, items: list[SequenceRequest]) -> list[GenerateAnswer]:
        me = self._enter()
        try:
            return await self._run_batch(items)
        except asyncio.CancelledError:
            self._stopped(me)
            raise
        finally:
            self._requests.discard(me)

    async def _run_batch(self, items: list[SequenceRequest]) -> list[GenerateAnswer]:
        results: list[GenerateAnswer | None] = [None] * len(items)

        async def one(i: int) -> None:
            results[i] = await self.run_sequence(items[i], index=i)

        window = StartWindow(self.dispatcher, len(items), one)
        try:
            window.fill()
            while window.done < len(items) and window.error is None:
                window.wake.clear()
                await window.wake.wait()
            if window.error is not None:
                raise window.error
            return [r for r in results if r is not None]  # every one is set: the window ran them all
        finally:
            await window.close()

    async def generate_stream(self, request: Request) -> AsyncGenerator[list[GenerateAnswer | ErrorChunk], None]:
        """Like :meth:`generate`, as SGLang's cumulative stream chunks (``index`` set for a batch).

        Yields lists: everything ready at once goes out in one write. Chunks are cumulative, so a
        sequence that advanced several times since the last write gets one chunk with all of it.
        A sequence that fails yields one :class:`.answer.ErrorChunk`, as SGLang does inside a stream.
        """
        self.begin_rollout()
        batched, items = request.batched, request.sequences
        queue: asyncio.Queue[tuple[int, SequenceState | GenerateAnswer | GenerationFailed]] = asyncio.Queue()

        async def one(i: int) -> None:
            try:
                await self.run_sequence(items[i], i if batched else None, on_tokens=lambda s: queue.put_nowait((i, s)),
                                        answer=lambda out: queue.put_nowait((i, out)))
            except GenerationFailed as exc:
                queue.put_nowait((i, exc))

        window = StartWindow(self.dispatcher, len(items), one)
        stop = asyncio.ensure_future(self._fail_on_stop(queue))
        finished = 0
        try:
            window.fill()
            while finished < len(items):
                ready = [await queue.get()]
                while not queue.empty():
                    ready.append(queue.get_nowait())
                out: list[GenerateAnswer | ErrorChunk] = []
                partial: dict[int, SequenceState] = {}
                for i, item in ready:
                    if isinstance(item, GenerationFailed):
                        yield out + [ErrorChunk(str(item), item.status)]
                        return
                    if isinstance(item, SequenceState):
                        partial[i] = item
                    else:  # the final answer supersedes any progress of the same sequence
                        partial.pop(i, None)
                        out.append(item)
                        finished += 1
                out.extend(partial_answer(seq, i if batched else None) for i, seq in partial.items())
                yield out
        finally:
            stop.cancel()
            await window.close()
            await asyncio.gather(stop, return_exceptions=True)

    async def _fail_on_stop(self, queue: asyncio.Queue[Any]) -> None:
        await self.stopping.wait()
        queue.put_nowait((-1, GenerationFailed(503, "rollout manager is shutting down; the request was aborted")))

    async def run_sequence(self, item: SequenceRequest, index: int | None = None,
                           on_tokens: Callable[[SequenceState], None] | None = None,
                           guarded: bool = False, answer: Callable[[GenerateAnswer], None] | None = None
                           ) -> GenerateAnswer | None:
        """Run one sequence to its end and tell ``finished_listeners`` (a cancelled one is not told).

        One coroutine for the sequence's whole life, and one per attempt (:meth:`.attempt.Attempts.run`): a
        sequence in flight holds every frame of its call chain, so the chain is kept short (the steps below
        that do not wait are plain calls). ``guarded``: the task is a caller's request, failed with 503 when
        the shutdown grace ends (:meth:`stop`).
        """
        started = time.monotonic()
        me = self._enter() if guarded else None
        seq, keys = self._start(item)
        track = seq.track
        key = item.resume_key
        saving = self.checkpoints if key is not None else None  # a relay saves it outside (rollout.checkpoints)
        if saving is not None and key is not None:
            if item.resumed is not None:
                checkpoints.resume(seq, item.resumed)
            saving.track(key, seq)
        cancelled = False
        try:
            self._before_first_attempt(seq)
            tries = _RunState(divided=self.settings.pieces.applies(seq.budget) and item.body.divisible)
            while seq.finish is None and self._may_try(seq, tries):
                # The last attempt made its piece: the next one is placed again, preferably where it ran.
                here = tries.tried[-1] if seq.at_boundary and tries.tried else None
                expected = self._next_piece(seq, tries.divided)
                allow = self._allow_next(seq, here)
                reserved = seq.reserve  # what placing it reserves on the instance
                inst = self.migrator.take_handoff(seq, allow)
                if inst is None:
                    ask = self._ask(seq, tries, self._prefer(seq, here, keys), allow, expected)
                    try:
                        inst = await self.dispatcher.acquire(ask, self.settings.wait_timeout_s)
                    except Unavailable as exc:
                        raise self._unplaced(seq, exc) from None
                    if keys is not None and _first_placement(seq):
                        self._placed_by_affinity(keys, ask.prefer, inst)
                if inst.quarantined is not None or self._cut_distrusted(seq):  # caught while it waited for inst
                    self.dispatcher.release(inst, reserved)
                    continue
                self._begin_attempt(seq, inst, here, tries)
                failures = len(seq.failures)
                # the attempt's index names its engine request: one more per piece, even on the same segment
                await self.attempts.run(seq, inst, _attempts_before(seq), on_tokens)
                tries.after_attempt(seq, failures, self.dispatcher.clock)
            self._finished(seq, keys)
        except GenerationFailed:
            for listener in self.finished_listeners:
                listener(time.monotonic() - started, 0, False)
            raise
        except asyncio.CancelledError:
            cancelled = True
            if me is not None:
                self._stopped(me)
            raise
        finally:
            if saving is not None and key is not None:
                saving.end(key, finished=not cancelled)
            if track is not None and self.lengths is not None:
                self.lengths.drop(track)  # failed or cancelled (a finished one is closed already)
            if me is not None:
                self._requests.discard(me)
        return self._deliver(seq, index, started, answer)

    # ------------------------------------------------------------ one sequence's steps (run_sequence)
    def _start(self, item: SequenceRequest) -> tuple[SequenceState, aff.AffinityKeys | None]:
        """The sequence's state, its place in the length model, and its affinity keys (None: affinity is off)."""
        body = item.body
        table = self.dispatcher.affinity
        known = body.known()  # a chat session's block hashes, made for its new ids only
        hashes = known.hashes if known is not None and table is not None and \
            known.block == table.settings.block_tokens else None
        keys = table.keys(body.input_ids, item.trajectory_key, hashes) if table is not None else None
        own = f"rm-{self._rid_prefix}{next(self._rid_counter)}"
        seq = SequenceState(body=body, rid=body.rid or own, engine_rid=own, min_version=item.min_version)
        self.stats["sequences"] += 1
        # A sequence short enough for one chunk interval cannot set a step's tail: the length model (and the
        # makespan policy's gathering, which needs its figure) would cost it more than placement gains.
        lengths = None if _short(seq.budget, self.settings.engine_stream_interval) else self.lengths
        seq.track = None if lengths is None else \
            lengths.start(item.group_key, body.input_ids, seq.rid, lambda: len(seq.output_ids), seq.budget)
        return seq, keys

    def _before_first_attempt(self, seq: SequenceState) -> None:
        """Refuse routed experts no instance returns; answer a sequence with nothing to make here: SGLang would
        run a prefill and report a log-prob for a token it never returns, and no instance is needed."""
        if seq.experts is not None:
            self.check_routed_experts()
        if seq.budget == 0:
            seq.finish = FinishReason.of(wire.LENGTH, length=0)
            seq.texts.append("")
            seq.meta = FinalMeta(weight_version=self._current_version())

    def _may_try(self, seq: SequenceState, tries: _RunState) -> bool:
        """Whether ``seq`` gets another attempt: not once its budget is used up (it ends there, as it would have
        had the instance not died just then); past ``max_attempts`` failures it fails with 502."""
        self._cut_distrusted(seq)  # its box was caught while it was between two attempts
        if seq.remaining == 0:
            seq.finish = FinishReason.of(wire.LENGTH, length=seq.budget)
            return False
        if len(seq.failures) >= self.settings.max_attempts:
            self.stats["failed"] += 1
            raise GenerationFailed(
                502,
                f"sequence {seq.rid} failed on {len(seq.failures)} attempt(s) "
                f"(limit {self.settings.max_attempts}); "
                f"instances tried: {', '.join(i.endpoint for i in tries.tried)}; "
                f"last error: {seq.failures[-1] if seq.failures else 'none'}",
            )
        return True

    def _next_piece(self, seq: SequenceState, divided: bool) -> Prediction | None:
        """The length model's figure for ``seq`` as it stands (None: not predicted), and for a divided rollout the
        size of its next piece from it."""
        expected = None if seq.track is None else self._expected(seq.track, seq)
        if divided:
            assert seq.remaining is not None  # a divided sequence has a budget
            seq.divided().next(self.settings.pieces.size(len(seq.output_ids), seq.remaining,
                                                         None if expected is None else expected.median))
        return expected

    def _allow_next(self, seq: SequenceState, here: Instance | None) -> Callable[[Instance], bool] | None:
        """Which instances may take ``seq``'s next attempt (None: any). At a piece boundary (``here``: where the last
        piece ran) never a staleness restart: it would make tokens again. After a refusal, a second opinion:
        anywhere but the instance that refused."""
        if here is not None:
            allow = _or_here(here, self._allowed(seq, restart=False), max(seq.versions, default=0))
        else:
            allow = self._allowed(seq)
        if seq.refused is not None:
            allow = _excluding(seq.refused.instance, allow)
        return allow

    def _prefer(self, seq: SequenceState, here: Instance | None, keys: aff.AffinityKeys | None) -> str | None:
        """The instance whose prefix cache holds ``seq``: where its last piece ran, else (its first placement) the
        one affinity remembers for its keys."""
        if here is not None:
            return here.id
        table = self.dispatcher.affinity
        return table.lookup(keys) if table is not None and keys is not None and _first_placement(seq) else None

    def _ask(self, seq: SequenceState, tries: _RunState, prefer: str | None, allow: Callable[[Instance], bool] | None,
             expected: Prediction | None) -> Ask:
        """What ``seq`` asks of the dispatcher now: the one place its state becomes an :class:`Ask`."""
        predicted = high = None
        track, lengths = seq.track, self.lengths
        if expected is not None and track is not None and lengths is not None:
            made = len(seq.output_ids)
            predicted = _still_expected(expected.median, made, seq.remaining)
            high = lengths.high(track, made)
            if high is not None and seq.remaining is not None:
                high = min(high, float(seq.remaining))
        return Ask(seq.reserve, frozenset(i.id for i in tries.tried), prefer, allow, tries.failing_since, predicted,
                   len(seq.body.input_ids) + len(seq.output_ids), high)

    def _unplaced(self, seq: SequenceState, exc: Unavailable) -> GenerationFailed:
        """What the caller gets when no instance could take ``seq``: a refusal nobody could check stands as is."""
        self.stats["failed"] += 1
        if seq.refused is not None:
            refused = seq.refused.error
            return GenerationFailed(refused.status, refused.message)
        return GenerationFailed(503, with_failures(with_floor(str(exc), seq), seq))

    def _placed_by_affinity(self, keys: aff.AffinityKeys, prefer: str | None, inst: Instance) -> None:
        table = self.dispatcher.affinity
        if table is not None:
            self._count_affinity(prefer, inst)
            table.placed(keys, inst.id)

    def _begin_attempt(self, seq: SequenceState, inst: Instance, here: Instance | None, tries: _RunState) -> None:
        """``seq``'s next attempt runs on ``inst``: a new instance tried, a piece where the last ran, or a
        continuation."""
        if inst is not here:
            tries.tried.append(inst)
        seq.versions.append(inst.weight_version)
        if here is not None:
            log.debug("piece %d of %s on %s from token %d", seq.divided().crossed + 1, seq.rid, inst.endpoint,
                      len(seq.output_ids))
        elif seq.segments:
            self.stats["continuations"] += 1
            log.info("continuing %s on %s from token %d (%s left)", seq.rid, inst.endpoint,
                     len(seq.output_ids), "no limit" if seq.remaining is None else seq.remaining)
        if seq.pieces is not None:
            seq.pieces.left_boundary()

    def _finished(self, seq: SequenceState, keys: aff.AffinityKeys | None) -> None:
        """``seq`` ended: its length to the length model, its context to affinity."""
        self.stats["tokens"] += len(seq.output_ids)
        if self.lengths is not None and seq.track is not None:
            self.lengths.finish(seq.track, len(seq.output_ids))
        table = self.dispatcher.affinity
        if table is not None and keys is not None and seq.segments:
            table.finished(keys, seq.output_ids, seq.segments[-1].instance)

    def _deliver(self, seq: SequenceState, index: int | None, started: float,
                 answer: Callable[[GenerateAnswer], None] | None) -> GenerateAnswer | None:
        """``seq``'s answer, handed to ``answer`` in the step that builds it (then None; see :meth:`generate`)."""
        latency = round(time.monotonic() - started, 6)
        out = final_answer(seq, index, latency)
        for listener in self.finished_listeners:
            listener(latency, len(seq.output_ids), True)
        if answer is not None:
            answer(out)
            return None
        return out

    def _cut_distrusted(self, seq: SequenceState) -> bool:
        """Cut ``seq`` back to before its first token that a box made unvouched before it was quarantined (a
        sequence between two attempts then was not streaming, so the quarantine could not cut it back; see
        ``rollout.provisional``): it continues from there like the others. Whether it was cut."""
        cut = self.migrator.provisional.cut_at(seq)
        if cut is None:
            return False
        at, why = cut
        made = len(seq.output_ids)
        seq.cut_back(at, why)
        self.stats["cut_back_tokens"] += made - len(seq.output_ids)
        log.info("sequence %s cut back from token %d to %d before its next attempt: %s", seq.rid, made, at, why)
        return True

    def _expected(self, track: Track, seq: SequenceState) -> Prediction | None:
        """The length model's figure for ``seq`` given what it made (None: the model is off)."""
        lengths = self.lengths
        return None if lengths is None else lengths.predict(track, len(seq.output_ids))

    def _current_version(self) -> str:
        """The newest weight version an active instance serves (what a request made now would get)."""
        versions = [i.weight_version for i in self.dispatcher.registry.in_state(State.ACTIVE)]
        return str(max(versions, default=0))

    def evict(self, inst: Instance, reason: str, cut: bool = False) -> int:
        """Move the sequences streaming from ``inst`` to other instances now (see :meth:`Migrator.evict`)."""
        return self.migrator.evict(inst, reason, cut)

    def migrate_now(self) -> int:
        """Run one tail-migration plan now (see :meth:`Migrator.migrate_now`); the number of moves started."""
        return self.migrator.migrate_now()

    # ------------------------------------------------------------ affinity and staleness
    def _count_affinity(self, prefer: str | None, inst: Instance) -> None:
        if prefer is None:
            self.stats["affinity_misses"] += 1
        elif prefer == inst.id:
            self.stats["affinity_hits"] += 1
        else:
            self.stats["affinity_fallbacks"] += 1
            reason = aff.fallback_reason(self.dispatcher.registry.get(prefer), inst)
            self.affinity_fallbacks[reason] = self.affinity_fallbacks.get(reason, 0) + 1

    def check_routed_experts(self) -> None:
        """Refuse a request for routed experts (R3) that no active instance can answer, rather than let it
        wait for one: SGLang started without ``--enable-return-routed-experts`` answers without them. Also
        asked when a /generate is admitted, so a streamed one is refused with its status, not in a stream."""
        active = self.dispatcher.registry.in_state(State.ACTIVE)
        if active and not any(i.engine.routed_experts for i in active):
            raise GenerationFailed(400, f"return_routed_experts: none of the {len(active)} active instance(s) "
                                        "returns routed experts (start SGLang with --enable-return-routed-experts)")

    def _allowed(self, seq: SequenceState, restart: bool = True) -> Callable[[Instance], bool] | None:
        """Which instances may take ``seq`` next (None: any): within the staleness bound
        (:meth:`_staleness_bound`), at :func:`version_floor` or newer, and for a sequence that asked for its
        routed experts, one that returns them."""
        bound = self._staleness_bound(seq, restart)
        if seq.experts is not None:
            bound = _routing_experts(bound)
        floor = version_floor(seq)
        if floor <= 0:
            return bound
        # What the box serves, not what it is named at: from an activation's pause until its load is done
        # the registry already names the new version, and a request placed then would run on the old one.
        return lambda i: i.versions.serving(i.weight_version) >= floor and (bound is None or bound(i))

    def _staleness_bound(self, seq: SequenceState, restart: bool = True) -> Callable[[Instance], bool] | None:
        """Which instances may continue ``seq`` without its segments spanning more than
        ``max_staleness`` versions (None: any). With ``restart``, a sequence that cannot continue within
        the bound as ``staleness_action`` says is restarted from its prompt here (its tokens dropped)."""
        bound = self.settings.max_staleness
        if bound is None or not seq.versions:
            return None
        lo, hi = min(seq.versions), max(seq.versions)

        def within(inst: Instance) -> bool:
            return within_version(lo, hi, inst.weight_version, bound)

        if not restart:
            return within
        active = self.dispatcher.registry.in_state(State.ACTIVE)
        if self.settings.staleness_action == "restart":  # the fleet's newest version, or start over
            stale = not within_version(lo, hi, max((i.weight_version for i in active), default=hi), bound)
        else:
            stale = not any(within(i) and i.health.consecutive_failures == 0 for i in active)  # a clean one, that is
        if not stale:
            return within
        log.info("restarting %s from its prompt: %d token(s) on weight version(s) %d..%d would span more than "
                 "max_staleness=%d", seq.rid, len(seq.output_ids), lo, hi, bound)
        seq.restart()
        self.stats["stale_restarts"] += 1
        return None


@dataclass(slots=True)
class _RunState:
    """One sequence's attempts so far (``run_sequence``): the instances tried, and since when it fails without
    progress (None: it is not failing; its retries share one wait for an instance, so one that fails everywhere
    it may go ends within that wait). ``divided``: it is generated in pieces."""

    divided: bool
    tried: list[Instance] = field(default_factory=list)
    failing_since: float | None = None

    def after_attempt(self, seq: SequenceState, failures_before: int, clock: Callable[[], float]) -> None:
        if seq.segments and seq.segments[-1].end > seq.segments[-1].start:
            self.failing_since = None  # it made progress: a failure from here starts a new wait
        if len(seq.failures) > failures_before and self.failing_since is None:
            self.failing_since = clock()


def _first_placement(seq: SequenceState) -> bool:
    """Whether ``seq`` is being placed for the first time (affinity looks it up and remembers where it went)."""
    return not seq.versions and not seq.discarded


def _still_expected(median: float, made: int, remaining: int | None) -> float:
    """Tokens a sequence with ``made`` is expected to make still (the conditional median's rest, at least one, as
    the simulator in benchmarks/sim_pool.py predicts), within what is left of its budget."""
    left = max(median - made, 1.0)
    return left if remaining is None else min(left, float(remaining))


def _short(budget: int | None, interval: int) -> bool:
    """Whether a sequence of ``budget`` tokens fits one chunk interval (``engine_stream_interval``; 0: none
    does): it is sent as one call and ends too soon to matter to a step's makespan."""
    return budget is not None and 0 < budget <= interval


def _attempts_before(seq: SequenceState) -> int:
    """The attempts ``seq`` had before this one: its segments, kept or thrown away, and the pieces it ended."""
    return len(seq.segments) + len(seq.discarded) + (0 if seq.pieces is None else seq.pieces.crossed)


def _predict_left(lengths: LengthModel) -> Callable[[SequenceState], Rest | None]:
    """What tail migration asks of a running sequence: the tokens the length model expects it still makes, and
    whether evidence informs that."""
    def left(seq: SequenceState) -> Rest | None:
        track = seq.track
        if track is None or not track.open:
            return None
        made = len(seq.output_ids)
        return Rest(lengths.left(track, made), lengths.informed(track))
    return left


def _or_here(here: Instance, allow: Callable[[Instance], bool] | None,
             newest: int) -> Callable[[Instance], bool] | None:
    """``allow``, and the instance the sequence's last piece ran on while it serves no version older than
    ``newest`` (the newest the sequence has tokens of): staying there is what an undivided run does, its
    weights moved on under it or not; a box rolled back is no longer the sequence's."""
    if allow is None:
        return None
    return lambda i: (i is here and i.versions.serving(i.weight_version) >= newest) or allow(i)


def _excluding(inst: Instance, allow: Callable[[Instance], bool] | None) -> Callable[[Instance], bool]:
    return lambda i: i is not inst and (allow is None or allow(i))


def _routing_experts(bound: Callable[[Instance], bool] | None) -> Callable[[Instance], bool]:
    """``bound``, narrowed to instances that return routed experts."""
    def allowed(inst: Instance) -> bool:
        return inst.engine.routed_experts is True and (bound is None or bound(inst))
    return allowed
