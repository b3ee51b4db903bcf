"""The OpenAI front's session ledger and prompt planning without processes: the real transformers tokenizer
(tests/openai_tokenizer.py, a ChatML template) and the ledger's bounds under a controlled clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from openai_tokenizer import DROPS_REASONING, make

from rollout_manager.openai_front.errors import OpenAIError
from rollout_manager.openai_front.ledger import Ledger
from rollout_manager.openai_front.prompt import plan_chat, plan_ids, retokenized
from rollout_manager.openai_front.render import Renderer
from rollout_manager.sglang.openai_turn import TurnResult


@pytest.fixture(scope="module")
def renderer(tmp_path_factory: pytest.TempPathFactory) -> Renderer:
    return Renderer(str(make(Path(tmp_path_factory.mktemp("tok")))))


def result(ids: list[int], matched: int | None = None) -> TurnResult:
    return TurnResult(ids, [-0.5] * len(ids), "stop" if matched is not None else "length", matched, 0, "v1", [], [])


def answer(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def test_a_reply_whose_rendering_does_not_give_back_its_ids_keeps_the_ids_and_counts_the_divergence(
        renderer: Renderer) -> None:
    ledger = Ledger(8, 10_000, 60.0)
    session = ledger.begin("s")
    messages = [{"role": "user", "content": "hello"}]
    first = plan_chat(renderer, None, 0, messages, None)
    assert first.ids == renderer.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    # the model sampled "<|endoftext|>" inside its answer: decoding skips it, so a re-rendering loses it
    sampled = [20, 0, 21]
    text = renderer.decode(sampled)
    ledger.record(session, first, messages, result(sampled), answer(text))
    ledger.end(session)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "again"}]
    second = plan_chat(renderer, session.branch, 1, messages, None)
    assert second.extends and second.ids[:len(first.ids) + 3] == first.ids + sampled
    # the template's closing of the answer (the model did not sample <|im_end|>) and the new message, alone
    assert second.ids[len(first.ids) + 3:] == renderer.encode("<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n"
                                                              "<|im_start|>assistant\n")
    assert second.divergence is None  # not looked for per turn: once, when the trajectory is read
    ledger.record(session, second, messages, result([30]), answer(renderer.decode([30])))
    found = retokenized(renderer, session.branch)  # type: ignore[arg-type]
    assert found is not None and found.kind == "retokenized" and found.turn == 0  # in the first turn's answer
    assert found.position == len(first.ids) + 1 and found.tokens == len(second.ids) + 1 - found.position


def test_an_answer_that_sampled_the_end_token_is_not_closed_twice(renderer: Renderer) -> None:
    ledger = Ledger(8, 10_000, 60.0)
    session = ledger.begin("s")
    messages = [{"role": "user", "content": "hello"}]
    first = plan_chat(renderer, None, 0, messages, None)
    end = renderer.encode("<|im_end|>")[0]
    sampled = [20, 21, end]
    ledger.record(session, first, messages, result(sampled, matched=end), answer(renderer.decode(sampled)))
    messages += [{"role": "assistant", "content": renderer.decode(sampled)}, {"role": "user", "content": "again"}]
    second = plan_chat(renderer, session.branch, 1, messages, None)
    assert second.ids[len(first.ids) + 3:] == renderer.encode("\n<|im_start|>user\nagain<|im_end|>\n"
                                                              "<|im_start|>assistant\n")
    ledger.record(session, second, messages, result([30]), answer(renderer.decode([30])))
    branch = session.branch
    assert branch is not None and retokenized(renderer, branch) is None  # tokenizes back to the ledger's ids
    assert branch is not None and branch.mask.tolist() == [1, 1, 1] + [0] * (len(second.ids) - len(first.ids) - 3) + [1]
    assert branch.logprobs.count(-0.5) == 4 and len(branch.logprobs) == len(branch.mask)


def test_completion_ids_extend_or_branch() -> None:
    ledger = Ledger(8, 10_000, 60.0)
    session = ledger.begin("s")
    ledger.record(session, plan_ids(None, 0, [1, 2]), None, result([3]), None)
    assert plan_ids(session.branch, 1, [1, 2, 3, 4]).extends
    rewritten = plan_ids(session.branch, 1, [1, 9, 3, 4])
    assert not rewritten.extends and rewritten.divergence is not None and rewritten.divergence.position == 1


def test_the_ledgers_bounds() -> None:
    now = [0.0]
    ledger = Ledger(2, 10, 60.0, clock=lambda: now[0])
    a = ledger.begin("a")
    with pytest.raises(OpenAIError) as busy:
        ledger.begin("a")
    assert busy.value.status == 409 and busy.value.param == "session_id"
    ledger.end(a)
    b = ledger.begin("b")
    ledger.end(b)
    ledger.begin("c")  # a third session frees the least recently used idle one
    assert ledger.get("a") is None and ledger.evicted == 1
    with pytest.raises(OpenAIError) as full:
        ledger.check_room(b, plan_ids(None, 0, list(range(11))))
    assert full.value.status == 400 and full.value.param == "session_id"
    now[0] = 61.0  # b idle past the bound; c is running a turn and stays
    assert ledger.get("b") is None and ledger.get("c") is not None and ledger.expired == 1
    assert ledger.status()["sessions"] == 1


def test_a_template_that_drops_earlier_reasoning_cannot_change_the_history(tmp_path: Path) -> None:
    renderer = Renderer(str(make(tmp_path / "tok", DROPS_REASONING)))
    ledger = Ledger(8, 10_000, 60.0)
    session = ledger.begin("s")
    messages = [{"role": "user", "content": "hello"}]
    first = plan_chat(renderer, None, 0, messages, None)
    think, end_think = renderer.encode("<think> </think>")
    sampled = [think, 200, end_think, 201]
    text = renderer.decode(sampled)
    ledger.record(session, first, messages, result(sampled), answer(text))
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "again"}]
    reasoning = renderer.decode([200])
    assert reasoning in text and reasoning not in renderer.chat_text(messages, None, True)  # dropped on rendering
    second = plan_chat(renderer, session.branch, 1, messages, None)
    assert second.extends and second.ids[:len(first.ids) + 4] == first.ids + sampled  # the ledger's ids kept
    assert second.ids[len(first.ids) + 4:] == renderer.encode("<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n"
                                                              "<|im_start|>assistant\n")
    ledger.record(session, second, messages, result([30]), answer(renderer.decode([30])))
    found = retokenized(renderer, session.branch)  # type: ignore[arg-type]
    assert found is not None and found.kind == "retokenized" and found.turn == 0
    assert found.position == len(first.ids) and found.tokens == len(second.ids) + 1 - len(first.ids)
    ledger.checked(session.branch, found)  # type: ignore[arg-type]
    assert session.to_json()["divergences"] == [found.to_json()] and ledger.status()["divergences"] == 1


def test_another_callers_turn_on_an_owned_session_is_refused_and_changes_nothing() -> None:
    now = [0.0]
    ledger = Ledger(8, 10_000, 60.0, clock=lambda: now[0])
    owned = ledger.begin("s", owner="alice")
    ledger.end(owned)
    ledger.end(ledger.begin("t"))  # now the most recently used
    now[0] = 5.0
    for key in ("bob", None):
        with pytest.raises(OpenAIError) as caught:
            ledger.begin("s", owner=key)
        assert caught.value.status == 403 and caught.value.param == "session_id"
    assert not owned.busy and owned.last_used == 0.0 and list(ledger.sessions) == ["s", "t"]
    assert owned.owner is not None and b"alice" not in owned.owner  # a digest, not the key
    assert ledger.begin("s", owner="alice") is owned
    ledger.end(owned)
    ledger.end(ledger.begin("t", owner="carol"))  # opened without a key: anyone's
