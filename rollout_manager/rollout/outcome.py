"""What one attempt of a sequence on one instance came to, as a value, and what follows from it.

An attempt (``Generator._attempt``) streams from an instance and ends in one :data:`Outcome`; two pure
functions turn what the engine call left into it (:func:`outcome_of`) and decide the next step
(:func:`next_step`). The generator then only carries the step out, so every path an attempt can take is
listed here and tested without an engine (tests/test_attempt_outcome.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from rollout_manager.sglang.errors import EngineError
from rollout_manager.sglang.finish import FinishReason


@dataclass(frozen=True, slots=True)
class Finished:
    """The engine finished the sequence (``finish``: its finish_reason). ``cut``: the stream broke after
    the final chunk (only ``[DONE]`` was lost): the sequence is complete, the instance still at fault."""

    finish: FinishReason
    cut: str | None = None


@dataclass(frozen=True, slots=True)
class EngineFault:
    """The instance failed the sequence (broken stream, bad chunk, its own abort): its tokens so far stay."""

    error: str


@dataclass(frozen=True, slots=True)
class CallerError:
    """The instance refused the request as the caller's error (HTTP 4xx, or an abort with a 4xx status)."""

    error: EngineError


class Move(enum.Enum):
    PREEMPTED = "preempted"  # the local window closed: the trainer wants its GPUs back
    MIGRATED = "migrated"  # tail migration or an eviction took it off on purpose


@dataclass(frozen=True, slots=True)
class Moved:
    """The manager took the sequence off the instance on purpose: no one's fault, its tokens stay."""

    why: Move


@dataclass(frozen=True, slots=True)
class Cancelled:
    """The caller went away (or the shutdown grace ended) while the attempt ran."""


Outcome = Finished | EngineFault | CallerError | Moved | Cancelled


def outcome_of(finish: FinishReason | None, error: str | None, *, migrating: bool) -> Outcome:
    """What an engine call that ended came to: ``finish`` is the last finish_reason it reported (None:
    none), ``error`` why the call failed (None: it did not), ``migrating`` whether the manager was
    taking the sequence off that instance (then an abort or a cut stream is the manager's doing)."""
    instance_abort = finish is not None and finish.is_abort and finish.caller_status is None
    if error is not None and (finish is None or instance_abort):
        return Moved(Move.MIGRATED) if migrating else EngineFault(error)
    if migrating and (finish is None or finish.is_abort):
        return Moved(Move.MIGRATED)  # the stream ended because the manager aborted it to move it
    if finish is None:
        return EngineFault("stream finished without a finish_reason")
    status = finish.caller_status
    if status is not None:
        # SGLang refused the request itself (e.g. too long for its context): every instance would.
        return CallerError(EngineError(status, finish.abort_message, finish.error_type))
    if instance_abort:
        return EngineFault(f"aborted by the instance: {finish.abort_message}")
    return Finished(finish, cut=error)


class Step(enum.Enum):
    DONE = "done"  # the sequence is complete
    FAULT = "fault"  # count it against the instance; the sequence goes on elsewhere from its tokens
    MOVE = "move"  # the sequence goes on elsewhere from its tokens; nobody's fault
    ASK_ANOTHER = "ask_another"  # a refusal one other instance is asked about (a broken engine's?)
    FAIL = "fail"  # the caller gets the refusal
    ABORT = "abort"  # nobody waits: abort the request on the instance


def next_step(outcome: Outcome, *, second_opinion_used: bool, others: bool) -> Step:
    """The step after ``outcome``. A refusal is checked once with another instance (``others``: one could
    take the sequence) unless the sequence already used its one second opinion; the caller gets it then."""
    if isinstance(outcome, Finished):
        return Step.DONE
    if isinstance(outcome, EngineFault):
        return Step.FAULT
    if isinstance(outcome, Moved):
        return Step.MOVE
    if isinstance(outcome, CallerError):
        return Step.ASK_ANOTHER if others and not second_opinion_used else Step.FAIL
    return Step.ABORT
