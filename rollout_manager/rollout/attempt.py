"""One attempt of a sequence on one instance: the engine call, each chunk folded in, and the outcome carried
out (beside :mod:`.outcome`, which says what an attempt came to).

Generation (:mod:`.generation`) picks the instance and runs attempts until the sequence ends; an attempt
streams the sequence's remaining tokens from one instance and leaves it resumable when that instance
fails, so the next attempt continues from the tokens made.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from rollout_manager.instances.registry import Instance, Kind, State
from rollout_manager.instances.served_ids import note_served
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.rollout.attempt_segments import AttemptSegments
from rollout_manager.rollout.call_bounds import CallBoundsCache
from rollout_manager.rollout.generation_settings import GenerationSettings
from rollout_manager.rollout.migration import Migrator
from rollout_manager.rollout.outcome import (
    CallerError,
    Cancelled,
    Disputed,
    EngineFault,
    Finished,
    GenerationFailed,
    Migrated,
    Outcome,
    Preempted,
    outcome_of,
    settle,
)
from rollout_manager.rollout.progress import TOKEN_ID_BOUND, BadChunk, SequenceProgress
from rollout_manager.rollout.sequence import PIECE_END, Refusal, Segment, SequenceState, version_check
from rollout_manager.sglang.client import CallBounds, EngineFailed, EngineRejected, SGLangClient, open_stream
from rollout_manager.sglang.coalesce import Coalescer
from rollout_manager.sglang.finish import LENGTH
from rollout_manager.sglang.generate_request import SequenceBody, continuation
from rollout_manager.sglang.routed_experts import MAX_ROW_TEXT
from rollout_manager.sglang.wire import GenerateChunk

log = logging.getLogger("rollout_manager.rollout.generation")

Bound = Callable[[Instance], bool]


class Attempts:
    """Runs attempts for the generator (:meth:`run`); what it needs of the generator is handed in.

    ``bound(seq)``: which instances may take ``seq`` next (None: any), to tell whether another instance
    could settle a refusal.
    """

    def __init__(self, dispatcher: Dispatcher, client: SGLangClient, settings: GenerationSettings,
                 coalescer: Coalescer, migrator: Migrator, stats: dict[str, int],
                 bound: Callable[[SequenceState], Bound | None],
                 on_instance_failure: Callable[[Instance, str], None],
                 on_instance_success: Callable[[Instance], None]):
        self.dispatcher = dispatcher
        self.client = client
        self.settings = settings
        self.coalescer = coalescer
        self.migrator = migrator
        self.stats = stats
        self.bound = bound
        self.on_instance_failure = on_instance_failure
        self.on_instance_success = on_instance_success
        self.local = dispatcher.local
        self._loop = coalescer.loop
        self._call_bounds = CallBoundsCache(client)  # one CallBounds per instance, not per attempt

    async def run(self, seq: SequenceState, inst: Instance, attempt: int,
                  on_tokens: Callable[[SequenceState], None] | None = None) -> None:
        """Stream the sequence's remaining tokens from ``inst``; on failure leave it resumable.

        The engine call runs in this coroutine (a remote instance) or in one task that races the local
        window (a local one); each chunk is folded in by :meth:`_take`. No closures: a sequence holds
        this frame for as long as it streams.
        """
        rid = seq.engine_rid if attempt == 0 else f"{seq.engine_rid}~{attempt}"
        once = self._once(seq, inst, on_tokens)
        body = self._body(seq, rid, once, on_tokens)
        progress = self._progress(seq, inst)
        # one per weight version the engine reports, each of the era of inst's quarantines it was made in
        segments = AttemptSegments(seq, inst, self.migrator.provisional.era(inst.id))
        reserved = seq.reserve
        # Only a local instance's stream races the local window (in a task of its own).
        stream = asyncio.ensure_future(self._consume(seq, inst, body, progress, segments, on_tokens)) \
            if inst.kind == Kind.LOCAL else None
        live = id(segments)
        outcome: Outcome = Cancelled()  # until the call comes to something: the caller went away
        try:
            self.migrator.enter(live, seq, inst, rid)
            error: str | None = None
            try:
                if stream is not None:
                    del body  # the task has it
                    closed = asyncio.ensure_future(self.local.closed.wait())
                    await asyncio.wait((stream, closed), return_when=asyncio.FIRST_COMPLETED)
                    closed.cancel()
                    if not stream.done():  # the trainer wants its GPUs back: move the sequence on
                        outcome = Preempted()
                    else:
                        await stream
                elif once:  # one answer, awaited directly: no stream machinery for the commonest short call
                    self._take(seq, inst, progress, segments, on_tokens, await self.coalescer.generate_once(
                        self.client.session, inst.url, body, self._bounds(inst, seq)))
                else:
                    chunks = await open_stream(self.client.session, inst.url, body, self._bounds(inst, seq))
                    del body  # sent: a continuation's prompt plus tokens (a list of ints) is not kept
                    try:
                        # The stream's future is awaited in this frame: no coroutine per stream while it waits.
                        while (ready := chunks.poll()) != []:
                            if ready is None:
                                await chunks.readable()
                            else:
                                self._take_all(seq, inst, progress, segments, on_tokens, ready)
                    finally:
                        chunks.close()
            except EngineRejected as exc:
                outcome = CallerError(exc.error)
            except EngineFailed as exc:
                error = str(exc)
            if not isinstance(outcome, (Preempted, CallerError)):
                outcome = outcome_of(progress.finish, error, migrating=seq.migration.leaving)
            self._settle(outcome, seq, inst, segments, progress, on_tokens)
        finally:
            await self._leave(seq, inst, rid, stream, outcome, segments, reserved, live)

    def _once(self, seq: SequenceState, inst: Instance, on_tokens: Callable[[SequenceState], None] | None) -> bool:
        """Whether to ask for one answer rather than a stream: what is left (or one piece of it,
        ``rollout.pieces``) fits in one chunk interval and nobody watches it stream. A failure then loses no
        more than a stream at that interval would (<= interval tokens). Not on a local instance: the local
        window takes those back every step, routinely."""
        interval, limit = self.settings.engine_stream_interval, seq.limit
        return (on_tokens is None and interval > 0 and limit is not None and limit <= interval
                and inst.kind == Kind.REMOTE)

    def _body(self, seq: SequenceState, rid: str, once: bool,
              on_tokens: Callable[[SequenceState], None] | None) -> SequenceBody:
        """The engine request that continues the sequence from the tokens it has."""
        interval = self.settings.engine_stream_interval
        return continuation(seq.body, seq.output_ids, rid=rid, stream_interval=interval or None,
                            keep_caller_interval=on_tokens is not None, stream=not once, seed=seq.seed,
                            experts_from=None if seq.experts is None else seq.experts.end,
                            piece=None if seq.pieces is None else seq.pieces.size)

    def _progress(self, seq: SequenceState, inst: Instance) -> SequenceProgress:
        """The checker of this attempt's chunks. The engine's tokens are appended to the sequence's own lists
        as they come (no copy per chunk), each chunk checked first, so the lists hold only tokens it vouches
        for."""
        return SequenceProgress(
            seq.output_ids, seq.logprobs, limit=seq.limit, per_token=seq.per_token,
            vocab_size=inst.engine.vocab_size or self.settings.vocab_size or TOKEN_ID_BOUND,
            version_ok=version_check(inst, seq.versions[-1] if seq.versions else inst.weight_version),
            experts=seq.experts, prompt=len(seq.body.input_ids))

    def _settle(self, outcome: Outcome, seq: SequenceState, inst: Instance, segments: AttemptSegments,
                progress: SequenceProgress, on_tokens: Callable[[SequenceState], None] | None) -> None:
        """What the call came to, carried out on the sequence and the instance (:meth:`_carry_out`)."""
        self._carry_out(outcome, seq, inst, segments, progress)
        if segments.made:  # it prefilled the prompt and what came before: ids it takes (the probe's)
            known = seq.body.known()
            note_served(inst, seq.body.input_ids, seq.output_ids, None if known is None else known.max_id)
        if seq.at_boundary and on_tokens is not None:
            on_tokens(seq)  # the piece's last chunk (a final one) was not streamed yet

    async def _leave(self, seq: SequenceState, inst: Instance, rid: str, stream: asyncio.Future[None] | None,
                     outcome: Outcome, segments: AttemptSegments, reserved: int, live: int) -> None:
        """The attempt's end, however it ended: the local task stopped, the instance's reservation and the
        migrator's record released, and the engine told to abort a request it still runs."""
        if stream is not None and not stream.done():
            stream.cancel()
            await asyncio.gather(stream, return_exceptions=True)
        self.dispatcher.release(inst, max(reserved - segments.made, 0))
        self.migrator.leave(live, seq, segments.current)
        if isinstance(outcome, (Cancelled, Preempted)):  # the engine still runs it
            if isinstance(outcome, Cancelled):
                segments.current.outcome = "cancelled"
            await asyncio.shield(self.client.abort(inst.url, rid))

    async def _consume(self, seq: SequenceState, inst: Instance, body: SequenceBody, progress: SequenceProgress,
                       segments: AttemptSegments, on_tokens: Callable[[SequenceState], None] | None) -> None:
        """A local instance's stream, run as a task that races the local window."""
        chunks = await open_stream(self.client.session, inst.url, body, self._bounds(inst, seq))
        del body  # sent
        try:
            while ready := await chunks.next():
                self._take_all(seq, inst, progress, segments, on_tokens, ready)
        finally:
            chunks.close()

    def _bounds(self, inst: Instance, seq: SequenceState) -> CallBounds:
        """``inst``'s call bounds; for a sequence that asked for its routed experts, with room in the final
        frame for their rows (they can outweigh the tokens a thousandfold: never the instance's fault)."""
        bounds = self._call_bounds.of(inst, self.settings, len(self.dispatcher.registry))
        if seq.experts is None or bounds.max_frame_bytes is None:
            return bounds
        positions = len(seq.body.input_ids) + len(seq.output_ids) + seq.reserve
        return dataclasses.replace(bounds, max_frame_bytes=bounds.max_frame_bytes + positions * MAX_ROW_TEXT)

    def _take_all(self, seq: SequenceState, inst: Instance, progress: SequenceProgress, segments: AttemptSegments,
                  on_tokens: Callable[[SequenceState], None] | None, chunks: list[GenerateChunk]) -> None:
        """Fold in the chunks of one read, in order; ``chunks`` is emptied, so the sequence keeps only its
        tokens while the next read waits."""
        chunks.reverse()
        made = progress.made
        try:
            while chunks:
                self._take(seq, inst, progress, segments, on_tokens, chunks.pop())
        finally:
            self._timed(inst, progress, progress.made - made)

    def _timed(self, inst: Instance, progress: SequenceProgress, tokens: int) -> None:
        """This sequence's tokens of one read, timed from its previous read that brought tokens: a box's step
        time (``FleetModel.step_gap``). The first read of an attempt only starts the clock (it waited for a
        prefill)."""
        if tokens <= 0:
            return
        now = self._loop.time()
        if progress.tokens_at is not None:
            self.dispatcher.fleet.step_gap(inst, tokens, now - progress.tokens_at)
        progress.tokens_at = now

    def _take(self, seq: SequenceState, inst: Instance, progress: SequenceProgress, segments: AttemptSegments,
              on_tokens: Callable[[SequenceState], None] | None, chunk: GenerateChunk) -> None:
        """Fold one chunk into the sequence; raises :class:`EngineFailed` for a chunk it cannot vouch for."""
        try:
            new = progress.apply(chunk)
        except BadChunk as exc:  # nothing of it was kept: the sequence goes on from before it
            raise EngineFailed(f"bad chunk after {progress.made} good token(s), dropped: {exc}") from None
        self.dispatcher.progress(inst, new, self._loop.time(), timed=True)
        if new and seq.refused is not None:
            self._refusal_overruled(seq, inst)
        segments.advance(progress.weight_version, new)
        if progress.final.has_spans:
            segments.exact(progress.final.spans())  # SGLang's exact spans, on the final chunk
        seq.live_text = progress.text  # joined only when a streaming caller is sent a chunk
        if new and on_tokens is not None and progress.finish is None:
            on_tokens(seq)

    def _carry_out(self, outcome: Outcome, seq: SequenceState, inst: Instance, segments: AttemptSegments,
                   progress: SequenceProgress) -> None:
        """Record ``outcome`` on the sequence and the instance; raises :class:`GenerationFailed` when the
        caller gets a refusal."""
        used = seq.refused is not None or seq.second_opinion
        others = isinstance(outcome, CallerError) and not used and self._others_may_take(seq, inst)
        segment = segments.current
        match settle(outcome, second_opinion_used=used, others=others):
            case Finished(finish, cut):
                seq.texts.append(progress.text)
                pieces = seq.pieces
                if pieces is not None and pieces.size is not None and finish.type == LENGTH \
                        and progress.made == pieces.size:
                    self._piece_ended(seq, segment, segments, progress)
                else:
                    seq.finish, seq.meta = finish.rebased(segments.start), progress.final
                    if pieces is not None:  # a divided rollout: its counts over every piece
                        seq.meta = pieces.whole(seq.meta, len(seq.body.input_ids), segments.start,
                                                len(seq.output_ids), seq.per_token, seq.logprobs)
                    segment.outcome = "finished"
                if cut is None:
                    self.on_instance_success(inst)
                else:
                    self.on_instance_failure(inst, f"stream cut after the final chunk: {cut}")
            case Disputed(error):
                seq.live_text = None
                seq.refused, seq.second_opinion = Refusal(inst, error), True
                log.info("sequence %s: %s refused it (HTTP %d: %s); asking another instance whether the request "
                         "is at fault", seq.rid, inst.endpoint, error.status, error.message[:200])
                segment.outcome = f"rejected: HTTP {error.status}: {error.message[:200]}; asking another instance"
                seq.texts.append("" if progress.made == 0 else None)
            case CallerError(error):
                seq.live_text = None
                seq.refused = None  # a second refusal: the caller's error after all
                segment.outcome = "rejected"
                raise GenerationFailed(error.status, error.message)
            case Preempted():
                segment.outcome = "preempted: local window closed"
                seq.texts.append(None)
                seq.live_text = None
                self.stats["preempted"] += 1
            case Migrated():
                self.migrator.moved(seq, segment)
                seq.texts.append(None)
                seq.live_text = None
            case EngineFault(error):
                segment.outcome = f"failed: {error}"
                seq.failures += (f"{inst.endpoint}: {error}",)
                seq.texts.append(None)
                seq.live_text = None
                log.warning("sequence %s failed on %s after %d token(s): %s", seq.rid, inst.endpoint,
                            segments.made, error)
                self.on_instance_failure(inst, error)
            case Cancelled():
                pass  # nobody waits for it: the attempt's end aborts it on the instance

    def _piece_ended(self, seq: SequenceState, segment: Segment, segments: AttemptSegments,
                     progress: SequenceProgress) -> None:
        """The attempt made its piece (rollout.pieces): not the sequence's end, nobody's fault; the generator
        places the next piece, which continues from here."""
        segment.outcome = PIECE_END
        seq.live_text = ""  # the next piece's text so far
        seq.divided().ended(progress.final, len(seq.body.input_ids), segments.start)
        self.stats["pieces"] += 1

    # ------------------------------------------------------------ refusals
    def _others_may_take(self, seq: SequenceState, inst: Instance) -> bool:
        """Whether another instance could take ``seq`` and settle a refusal by ``inst``.

        SGLang refuses with 400 what its contract forbids, and the manager checked the body against that
        contract already; so a refusal may be a broken engine's, which would otherwise swallow requests
        without ever being counted against. One other instance settles it: if it accepts, ``inst`` is at
        fault (:meth:`_refusal_overruled`); if it refuses too, the caller gets the refusal. Never more
        than one extra try per sequence (:func:`.outcome.settle`).
        """
        bound = self.bound(seq)
        return any(i is not inst and (i.kind == Kind.REMOTE or self.local.is_open) and (bound is None or bound(i))
                   for i in self.dispatcher.registry.in_state(State.ACTIVE))

    def _refusal_overruled(self, seq: SequenceState, accepted_by: Instance) -> None:
        """Another instance made tokens for a request the refuser called malformed: the refuser is at fault."""
        assert seq.refused is not None
        refuser, error = seq.refused.instance, seq.refused.error
        seq.refused = None
        reason = (f"refused a request (HTTP {error.status}: {error.message[:200]}) that "
                  f"{accepted_by.endpoint} accepted")
        log.warning("instance %s %s %s", refuser.id, refuser.endpoint, reason)
        self.on_instance_failure(refuser, reason)
