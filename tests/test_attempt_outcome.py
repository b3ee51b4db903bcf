"""An attempt's outcome and how a refusal is settled (rollout/outcome.py): every path, without an engine."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_manager.rollout.outcome import (
    CallerError,
    Cancelled,
    Disputed,
    EngineFault,
    Finished,
    Migrated,
    Outcome,
    Preempted,
    outcome_of,
    settle,
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
    (None, "connection reset", True, Migrated()),  # the manager's abort cut it
    (None, None, False, EngineFault("stream finished without saying how it ended")),
    (None, None, True, Migrated()),
    (INSTANCE_ABORT, None, False, EngineFault("aborted by the instance: scheduler restarted")),
    (ABORT_500, None, False, EngineFault("aborted by the instance: oops")),
    (INSTANCE_ABORT, "cut", False, EngineFault("cut")),
    (INSTANCE_ABORT, None, True, Migrated()),
    (CALLER_ABORT, None, False,
     CallerError(EngineError(400, "input too long", "BadRequestError"))),
    (CALLER_ABORT, "cut after it", False,
     CallerError(EngineError(400, "input too long", "BadRequestError"))),
    (CALLER_ABORT, None, True, Migrated()),
])
def test_what_an_engine_call_comes_to(finish: Any, error: str | None, migrating: bool, want: Outcome) -> None:
    assert outcome_of(finish, error, migrating=migrating) == want


BAD = EngineError(400, "bad")


@pytest.mark.parametrize("outcome, used, others, want", [
    (Finished(STOP), False, True, Finished(STOP)),
    (EngineFault("x"), False, True, EngineFault("x")),
    (Preempted(), False, True, Preempted()),
    (Migrated(), True, True, Migrated()),
    (CallerError(BAD), False, True, Disputed(BAD)),  # one second opinion
    (CallerError(BAD), True, True, CallerError(BAD)),  # used already: the caller's error after all
    (CallerError(BAD), False, False, CallerError(BAD)),  # nobody else could say
    (Cancelled(), False, True, Cancelled()),
])
def test_a_refusal_is_settled_once_and_every_other_outcome_stands(outcome: Outcome, used: bool, others: bool,
                                                                  want: Outcome) -> None:
    assert settle(outcome, second_opinion_used=used, others=others) == want
