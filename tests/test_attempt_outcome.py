"""An attempt's outcome and the step after it (rollout/outcome.py): every path, without an engine."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_manager.rollout.outcome import (
    CallerError,
    Cancelled,
    EngineFault,
    Finished,
    Move,
    Moved,
    Outcome,
    Step,
    next_step,
    outcome_of,
)
from rollout_manager.sglang.errors import EngineError
from rollout_manager.sglang.finish import FinishReason

STOP = FinishReason("stop")
LENGTH = FinishReason("length", length=8)
INSTANCE_ABORT = FinishReason("abort", message="scheduler restarted")
ABORT_500 = FinishReason("abort", message="oops", status_code=500)
CALLER_ABORT = FinishReason("abort", message="input too long", status_code=400, err_type="BadRequestError")


@pytest.mark.parametrize("finish, error, migrating, want", [
    (STOP, None, False, Finished(STOP)),
    (LENGTH, None, True, Finished(LENGTH)),  # it finished before the move took effect: kept
    (STOP, "stream ended without [DONE]", False, Finished(STOP, cut="stream ended without [DONE]")),
    (None, "connection reset", False, EngineFault("connection reset")),
    (None, "connection reset", True, Moved(Move.MIGRATED)),  # the manager's abort cut it
    (None, None, False, EngineFault("stream finished without a finish_reason")),
    (None, None, True, Moved(Move.MIGRATED)),
    (INSTANCE_ABORT, None, False, EngineFault("aborted by the instance: scheduler restarted")),
    (ABORT_500, None, False, EngineFault("aborted by the instance: oops")),
    (INSTANCE_ABORT, "cut", False, EngineFault("cut")),
    (INSTANCE_ABORT, None, True, Moved(Move.MIGRATED)),
    (CALLER_ABORT, None, False,
     CallerError(EngineError(400, "input too long", "BadRequestError"))),
    (CALLER_ABORT, "cut after it", False,
     CallerError(EngineError(400, "input too long", "BadRequestError"))),
    (CALLER_ABORT, None, True, Moved(Move.MIGRATED)),
])
def test_what_an_engine_call_comes_to(finish: Any, error: str | None, migrating: bool, want: Outcome) -> None:
    assert outcome_of(finish, error, migrating=migrating) == want


@pytest.mark.parametrize("outcome, used, others, want", [
    (Finished(STOP), False, False, Step.DONE),
    (Finished(STOP, cut="x"), True, True, Step.DONE),
    (EngineFault("x"), False, True, Step.FAULT),
    (Moved(Move.PREEMPTED), False, False, Step.MOVE),
    (Moved(Move.MIGRATED), True, True, Step.MOVE),
    (CallerError(EngineError(400, "bad")), False, True, Step.ASK_ANOTHER),  # one second opinion
    (CallerError(EngineError(400, "bad")), True, True, Step.FAIL),  # used already: the caller's error after all
    (CallerError(EngineError(400, "bad")), False, False, Step.FAIL),  # nobody else could say
    (Cancelled(), False, True, Step.ABORT),
])
def test_the_step_after_each_outcome(outcome: Outcome, used: bool, others: bool, want: Step) -> None:
    assert next_step(outcome, second_opinion_used=used, others=others) is want
