"""What one attempt of a sequence on one instance came to, as a value.

An attempt (:mod:`.attempt`) streams from an instance and ends in one :data:`Outcome`; two pure functions
turn what the engine call left into it (:func:`outcome_of`) and settle a refusal (:func:`settle`). The
attempt then matches on the outcome, one case per type, so every path an attempt can take is listed here
and tested without an engine (tests/test_attempt_outcome.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout_manager.errors import ManagerError
from rollout_manager.sglang.errors import EngineError
from rollout_manager.sglang.finish import FinishReason


class GenerationFailed(ManagerError):
    """A sequence could not be completed; ``status`` says whose fault (4xx caller, 5xx/503 ours)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.reason = "engine_refused" if 400 <= status < 500 else "generation_failed"


@dataclass(frozen=True, slots=True)
class Finished:
    """The engine finished the sequence (``finish``: its finish_reason). ``cut``: the stream broke after
    the final chunk (only ``[DONE]`` was lost): the sequence is complete, the instance still at fault."""

    finish: FinishReason
    cut: str | None = None


@dataclass(frozen=True, slots=True)
class EngineFault:
    """The instance failed the sequence (broken stream, bad chunk, its own abort): its tokens so far stay;
    it is counted against the instance and goes on elsewhere from its tokens."""

    error: str


@dataclass(frozen=True, slots=True)
class CallerError:
    """The instance refused the request as the caller's error (HTTP 4xx, or an abort with a 4xx status):
    the caller gets it."""

    error: EngineError


@dataclass(frozen=True, slots=True)
class Disputed:
    """A refusal one other instance is asked about first (:func:`settle`): a broken engine's, perhaps."""

    error: EngineError


@dataclass(frozen=True, slots=True)
class Preempted:
    """The local window closed (the trainer wants its GPUs back): the sequence goes on elsewhere from its
    tokens, nobody's fault; the engine still runs it until aborted."""


@dataclass(frozen=True, slots=True)
class Migrated:
    """Tail migration or an eviction took the sequence off the instance on purpose: it goes on elsewhere
    from its tokens, nobody's fault."""


@dataclass(frozen=True, slots=True)
class Cancelled:
    """The caller went away (or the shutdown grace ended) while the attempt ran: nobody waits, the
    request is aborted on the instance."""


Outcome = Finished | EngineFault | CallerError | Disputed | Preempted | Migrated | Cancelled


def outcome_of(finish: FinishReason | None, error: str | None, *, migrating: bool) -> Outcome:
    """What an engine call that ended came to: ``finish`` is the last finish_reason it reported (None:
    none), ``error`` why the call failed (None: it did not), ``migrating`` whether the manager was
    taking the sequence off that instance (then an abort or a cut stream is the manager's doing)."""
    instance_abort = finish is not None and finish.is_abort and finish.caller_status is None
    if error is not None and (finish is None or instance_abort):
        return Migrated() if migrating else EngineFault(error)
    if migrating and (finish is None or finish.is_abort):
        return Migrated()  # the stream ended because the manager aborted it to move it
    if finish is None:
        return EngineFault("stream finished without saying how it ended")
    status = finish.caller_status
    if status is not None:
        # SGLang refused the request itself (e.g. too long for its context): every instance would.
        return CallerError(EngineError(status, finish.abort_message, finish.error_type))
    if instance_abort:
        return EngineFault(f"aborted by the instance: {finish.abort_message}")
    return Finished(finish, cut=error)


def settle(outcome: Outcome, *, second_opinion_used: bool, others: bool) -> Outcome:
    """A refusal is checked once with another instance (``others``: one could take the sequence) unless
    the sequence already used its one second opinion: then it is :class:`Disputed`, and the caller gets it
    only if the other instance refuses too. Any other outcome stands."""
    if isinstance(outcome, CallerError) and others and not second_opinion_used:
        return Disputed(outcome.error)
    return outcome
