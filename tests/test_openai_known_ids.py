"""A session turn's ids as the rollout path needs them (largest id, affinity block hashes), made from the
ledger's branch and the turn's new ids only, equal what passing over every id gives: along a branch, after a
rewritten history (a new branch), after a turn that kept nothing, and with another block size."""

from __future__ import annotations

import random

from rollout_manager.instances.registry import Kind, Registry
from rollout_manager.instances.served_ids import note_served
from rollout_manager.openai_front.ledger import Ledger, PromptPlan, Session
from rollout_manager.openai_front.prompt import known_ids
from rollout_manager.placement.affinity import AffinityKeys, AffinityTable, block_hashes
from rollout_manager.sglang.generate_request import KnownIds, SequenceBody
from rollout_manager.sglang.openai_turn import TurnResult

BLOCK = 8


def _ids(rng: random.Random, n: int, top: int = 1000) -> list[int]:
    return [rng.randrange(top) for _ in range(n)]


def _result(output: list[int]) -> TurnResult:
    return TurnResult(output, [-0.5] * len(output), "stop", None, 0, 1, [], [])


def _fresh(ids: list[int], block: int = BLOCK) -> KnownIds:
    return KnownIds(ids, max(ids, default=-1), block, block_hashes(ids, block))


def _turn(ledger: Ledger, session: Session, plan: PromptPlan, output: list[int], block: int = BLOCK,
          keep: bool = True) -> KnownIds:
    """One turn: its known ids (checked against a fresh pass), then the turn recorded."""
    known = known_ids(plan, session.branch, block)
    assert known == _fresh(plan.ids, block)
    assert AffinityKeys.of(plan.ids, "t", block, known.hashes) == AffinityKeys.of(plan.ids, "t", block)
    ledger.record(session, plan, None, _result(output), None, known=known if keep else None)
    return known


def test_block_hashes_from_a_prefix_equal_from_scratch() -> None:
    rng = random.Random(1)
    for n in (0, 1, 7, 8, 9, 64, 100, 257):
        ids = _ids(rng, n)
        whole = block_hashes(ids, BLOCK)
        assert [h for _, h in AffinityKeys.of(ids, None, BLOCK).blocks] == whole
        for cut in range(0, n + 1, 3):
            assert block_hashes(ids, BLOCK, block_hashes(ids[:cut], BLOCK)) == whole


def test_hashes_that_do_not_fit_the_ids_are_not_used() -> None:
    ids = list(range(40))
    table = AffinityTable()
    block = table.settings.block_tokens
    assert AffinityKeys.of(ids, None, BLOCK, [1, 2]) == AffinityKeys.of(ids, None, BLOCK)
    many = list(range(3 * block + 5))
    assert table.keys(many, "k", block_hashes(many, block)) == table.keys(many, "k")


def test_known_ids_along_a_branch_then_a_rewrite_then_a_turn_that_kept_nothing() -> None:
    rng = random.Random(2)
    ledger = Ledger(4, 10**6, 60.0)
    session = ledger.begin("s")
    ids = _ids(rng, 13)
    _turn(ledger, session, PromptPlan(ids, extends=False), _ids(rng, 5))
    for _ in range(6):  # each turn: the branch's ids, then new ones (a new top id now and then)
        branch = session.branch
        assert branch is not None
        top = 5000 if rng.random() < 0.3 else 1000
        ids = [*branch.ids.tolist(), *_ids(rng, rng.randrange(1, 30), top)]
        _turn(ledger, session, PromptPlan(ids, extends=True), _ids(rng, rng.randrange(0, 12)))
    first = session.branch
    assert first is not None and first.max_id == max(first.ids) and len(first.hashes) > 3
    # the history rewritten: a new branch, its ids passed over afresh, smaller than the old branch's top
    rewritten = [*first.ids.tolist()[:20], *_ids(rng, 30, 50)]
    _turn(ledger, session, PromptPlan(rewritten, extends=False), _ids(rng, 4, 50))
    assert len(session.branches) == 2
    ids = [*session.branch.ids.tolist(), *_ids(rng, 9, 50)]  # type: ignore[union-attr]
    _turn(ledger, session, PromptPlan(ids, extends=True), _ids(rng, 3, 50))
    # a turn recorded without them (nothing kept): the next one passes over the whole prompt, still equal
    ids = [*session.branch.ids.tolist(), *_ids(rng, 17, 50)]  # type: ignore[union-attr]
    _turn(ledger, session, PromptPlan(ids, extends=True), [7000], keep=False)
    assert session.branch.max_id is None  # type: ignore[union-attr]
    ids = [*session.branch.ids.tolist(), *_ids(rng, 5, 50)]  # type: ignore[union-attr]
    _turn(ledger, session, PromptPlan(ids, extends=True), _ids(rng, 2, 50))
    # another block size (the table's settings are not the branch's): hashed afresh
    ids = [*session.branch.ids.tolist(), *_ids(rng, 5, 50)]  # type: ignore[union-attr]
    _turn(ledger, session, PromptPlan(ids, extends=True), [], block=16)
    # affinity off: no hashes, the top id still known
    ids = [*session.branch.ids.tolist(), 1]  # type: ignore[union-attr]
    assert known_ids(PromptPlan(ids, extends=True), session.branch, 0) == KnownIds(ids, max(ids), 0, [])


def test_a_body_gives_its_known_ids_only_for_the_list_they_were_made_for() -> None:
    ids = [1, 2, 3]
    known = _fresh(ids)
    body = SequenceBody(ids, known_ids=known)
    assert body.known() is known
    assert SequenceBody(list(ids), known_ids=known).known() is None  # a continuation's own list


def test_note_served_with_the_prompts_top_id_equals_a_pass_over_it() -> None:
    rng = random.Random(3)
    for _ in range(20):
        prompt, output = _ids(rng, rng.randrange(0, 50), 300), _ids(rng, rng.randrange(0, 5), 300)
        start = rng.randrange(0, 300)
        a, b = Registry(), Registry()
        passed = a.add("127.0.0.1", 30001, Kind.REMOTE)
        told = b.add("127.0.0.1", 30001, Kind.REMOTE)
        passed.ids_served = told.ids_served = start
        note_served(passed, prompt, output)
        note_served(told, prompt, output, max(prompt, default=-1))
        assert told.ids_served == passed.ids_served
