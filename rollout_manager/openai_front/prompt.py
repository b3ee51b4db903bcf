"""A chat turn's prompt ids: the ledger's ids for the history it holds, the template rendered for the rest.

Re-rendering and re-tokenizing a conversation does not give back the ids a model sampled (templates drop
reasoning, tokenizers merge across message boundaries), so a session's history is never re-tokenized
into the prompt: the new ids are the ledger's, then the template's closing of the last answer and the new
messages, rendered after a stand-in answer (:meth:`.Renderer.after_answer`) and tokenized alone, so a
template that rewrites earlier turns (drops their reasoning) cannot change the history, and a turn costs
its new messages, not the history. Where a fresh rendering of the whole conversation would have departed
from the ledger's ids is found once, when the trajectory is read (:func:`retokenized`), not every turn.
"""

from __future__ import annotations

import json
from typing import Any

from rollout_manager.openai_front.ledger import Branch, Divergence, PromptPlan
from rollout_manager.openai_front.render import Renderer
from rollout_manager.placement.affinity import block_hashes
from rollout_manager.sglang.generate_request import KnownIds


def _content(m: dict[str, Any]) -> Any:
    c = m.get("content")
    if isinstance(c, list):  # text parts (schemas.check_messages refused the rest)
        return "".join(str(p.get("text", "")) for p in c)
    return c or ""


def _arguments(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def _calls(m: dict[str, Any]) -> list[tuple[Any, Any, Any]]:
    """A message's tool calls by id, name and arguments (as objects: an agent may send back the text the
    front returned, or the object it parsed from it)."""
    out = []
    for call in m.get("tool_calls") or ():
        fn = call.get("function") or {}
        out.append((call.get("id"), fn.get("name"), _arguments(fn.get("arguments"))))
    return out


def same_message(sent: dict[str, Any], held: dict[str, Any]) -> bool:
    """Whether a message the caller sent is the one the ledger holds (role, text, tool ids and calls)."""
    return (sent.get("role") == held.get("role") and _content(sent) == _content(held)
            and sent.get("tool_call_id") == held.get("tool_call_id") and _calls(sent) == _calls(held))


def plan_chat(renderer: Renderer, branch: Branch | None, turn: int, messages: list[dict[str, Any]],
              tools: list[dict[str, Any]] | None) -> PromptPlan:
    """The prompt for ``messages`` given the session's current branch (None: a fresh session). Only a new
    session or branch renders and tokenizes the whole conversation."""
    if branch is None or not branch.messages:
        return PromptPlan(renderer.encode(renderer.chat_text(messages, tools, True)), extends=False)
    held = branch.messages
    first_change = next((i for i, (a, b) in enumerate(zip(messages, held)) if not same_message(a, b)), None)
    if first_change is None and len(messages) > len(held):
        tail = renderer.after_answer(messages[len(held):], tools)
        if tail is not None:
            last = branch.turns[-1]
            if isinstance(last.matched_stop, int):  # the model sampled the end token the template writes
                written = renderer.token_text(last.matched_stop)
                if tail.startswith(written):
                    tail = tail[len(written):]
            ids = branch.ids.tolist()
            ids += renderer.encode(tail)  # in place: the history is copied once, not twice
            return PromptPlan(ids, extends=True, tools=tools)
        first_change = len(held)  # the template hides the answer's text: no place to join at
    at = len(held) if first_change is None else first_change
    return PromptPlan(renderer.encode(renderer.chat_text(messages, tools, True)), extends=False,
                      divergence=Divergence(turn, at, len(branch.ids), "rewritten"), tools=tools)


def retokenized(renderer: Renderer, branch: Branch) -> Divergence | None:
    """Where rendering and tokenizing the branch's whole conversation afresh would first part from the ids
    the ledger holds (the ids each turn was sent and sampled), and how many of the ledger's would have
    changed; None where it gives them back. ``turn``: the session's turn whose prompt or answer holds that
    position. One rendering of the history: called when the trajectory is read, not per turn."""
    if not branch.messages or not branch.turns:
        return None
    fresh = renderer.encode(renderer.chat_text(branch.messages, branch.tools, False))
    held, n = branch.ids, len(branch.ids)
    at = next((i for i, (a, b) in enumerate(zip(fresh, held)) if a != b), min(len(fresh), n))
    if at >= n:
        return None
    turn = next((t for t in branch.turns if at < t.prompt_len + t.made), branch.turns[-1])
    return Divergence(turn.number, at, n - at, "retokenized")


def plan_ids(branch: Branch | None, turn: int, ids: list[int]) -> PromptPlan:
    """A completion's given prompt ids: extends the branch if it starts with the branch's ids."""
    if branch is None:
        return PromptPlan(ids, extends=False)
    n = len(branch.ids)
    if len(ids) > n and branch.holds(ids):
        return PromptPlan(ids, extends=True)
    at = next((i for i, (a, b) in enumerate(zip(ids, branch.ids)) if a != b), min(len(ids), n))
    return PromptPlan(ids, extends=False, divergence=Divergence(turn, at, n - at, "rewritten"))


def known_ids(plan: PromptPlan, branch: Branch | None, block: int) -> KnownIds:
    """What the rollout path would work out of the plan's ids by passing over them all (their largest id, the
    affinity hashes of their blocks of ``block`` ids; 0: affinity is off), from what the branch kept of its
    last turn and the turn's new ids only, when the plan extends the branch (its ids start with the
    branch's); from all of them otherwise. Equal to what the whole ids give (tests/test_openai_known_ids.py)."""
    ids = plan.ids
    base = branch if branch is not None and plan.extends else None
    if base is not None and base.max_id is not None:
        top = max(base.max_id, max(ids[len(base.ids):], default=-1))
    else:  # no branch to extend, or its last turn kept nothing: the history is passed over once
        top = max(ids, default=-1)
    done = base.hashes if base is not None and base.block == block else ()
    return KnownIds(ids, top, block, block_hashes(ids, block, done) if block else [])
