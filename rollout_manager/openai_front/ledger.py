"""The session ledger (token-in/token-out): per session, the exact ids each turn sent and sampled.

A session is a list of branches; a branch is one growing token sequence, the first turn's prompt followed
by every later token with a mask (1: sampled by the model, 0: written by the template or a tool) and the
sampled tokens' log-probs. A turn whose prompt extends the branch adds to it; a turn that rewrote the
history starts a new branch (an agent that edits its past gets a second trajectory, never a corrupted
one). Bounded in sessions, tokens per session and idle time (``openai_*`` in config.toml).

A branch keeps its tokens in compact arrays, not Python lists (an int in a list costs 8 bytes of pointer
and usually 28 of object): an id is 4 bytes (``array('i')``), a mask entry 1, a log-prob 4 (float32, the
precision verl trains with), so a session's tokens cost 9 bytes each (:meth:`Branch.nbytes`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_manager.openai_front.errors import OpenAIError
from rollout_manager.sglang.generate_request import KnownIds
from rollout_manager.sglang.openai_turn import TurnResult


@dataclass(frozen=True)
class Divergence:
    """Where a turn's freshly rendered prompt parted from the ledger. ``kind``: ``retokenized`` (the
    messages were the ledger's but their rendering and tokenizing did not give back its ids: the ledger's
    were used), ``rewritten`` (the caller changed a message the ledger holds: a new branch)."""

    turn: int  # the session's turn (0-based) whose prompt diverged
    position: int  # first token (retokenized) or message (rewritten) that differs
    tokens: int  # tokens of the ledger's history that the fresh rendering would have changed
    kind: str

    def to_json(self) -> dict[str, Any]:
        return {"turn": self.turn, "position": self.position, "tokens": self.tokens, "kind": self.kind}


@dataclass
class Turn:
    """One turn of a branch: its prompt is ``ids[:prompt_len]``, its answer the ``made`` ids after it;
    ``number``: the session's turn (0-based, over every branch)."""

    number: int
    prompt_len: int
    made: int
    finish_reason: str | None
    matched_stop: int | str | None
    weight_version: Any
    weight_versions: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {"prompt_len": self.prompt_len, "response_len": self.made, "finish_reason": self.finish_reason,
                "weight_version": self.weight_version, "weight_versions": self.weight_versions}


def _ids(values: Any = ()) -> array[int]:
    return array("i", values)


def _mask(values: Any = ()) -> array[int]:
    return array("b", values)


def _logprobs(values: Any = ()) -> array[float]:
    return array("f", values)


@dataclass
class Branch:
    prompt_len: int
    ids: array[int] = field(default_factory=_ids)
    mask: array[int] = field(default_factory=_mask)  # for ids[prompt_len:]
    logprobs: array[float] = field(default_factory=_logprobs)  # for ids[prompt_len:]; 0.0 where mask is 0
    messages: list[dict[str, Any]] = field(default_factory=list)  # the conversation the ids hold
    tools: list[dict[str, Any]] | None = None  # the tools its last turn was rendered with
    turns: list[Turn] = field(default_factory=list)
    # R3: the routed experts of positions [0, expert_rows) as SGLang's rows (int32, layers x top_k each),
    # from the turns that asked for them; a turn asks from ``expert_rows`` on, so the rows stay contiguous
    experts: bytearray = field(default_factory=bytearray)
    expert_rows: int = 0
    # where a fresh rendering of the conversation would part from ``ids`` (prompt.retokenized), as of when
    # ``ids`` had ``checked`` tokens (-1: never checked)
    retokenized: Divergence | None = None
    checked: int = -1
    # What the last turn's prompt gave of the ids (a prefix of ``ids``), so the next turn, which extends them,
    # works out only its new ids' part (``front.known_ids``): the largest id in ``ids`` (None: not known) and
    # the affinity hash of each whole ``block`` of the prompt (placement.affinity.block_hashes).
    max_id: int | None = None
    block: int = 0
    hashes: array[int] = field(default_factory=lambda: array("q"))

    @property
    def nbytes(self) -> int:
        """The bytes its token arrays hold (ids, mask, log-probs); messages and turns are not counted."""
        return sum(len(a) * a.itemsize for a in (self.ids, self.mask, self.logprobs))

    def holds(self, ids: list[int]) -> bool:
        """Whether ``ids`` start with this branch's ids."""
        n = len(self.ids)
        return len(ids) >= n and _ids(ids[:n]) == self.ids

    def add_experts(self, rows: bytes, start: int) -> None:
        """A turn's routed-expert rows, asked for from ``start`` (the rows held then), up to the last id but
        one (the last token has none yet); rows that do not fit whole are left out, not misaligned."""
        positions = len(self.ids) - 1 - min(start, len(self.ids) - 1)
        if start != self.expert_rows or positions <= 0 or len(rows) % positions:
            return
        width = len(rows) // positions
        if self.expert_rows and len(self.experts) // self.expert_rows != width:
            return
        self.experts += rows
        self.expert_rows += positions

    def to_json(self) -> dict[str, Any]:
        ids = self.ids.tolist()
        out = {"prompt_ids": ids[:self.prompt_len], "response_ids": ids[self.prompt_len:],
               "response_mask": self.mask.tolist(), "response_logprobs": self.logprobs.tolist(),
               "turns": [t.to_json() for t in self.turns]}
        if self.expert_rows:  # R3: SGLang's base64 rows for positions [0, routed_experts_rows)
            out["routed_experts"] = base64.b64encode(self.experts).decode()
            out["routed_experts_rows"] = self.expert_rows
        return out


def owner_digest(key: str | None) -> bytes | None:
    """What the ledger keeps of an owner key: its SHA-256, never the key."""
    return None if key is None else hashlib.sha256(key.encode()).digest()


@dataclass
class Session:
    id: str
    last_used: float
    branches: list[Branch] = field(default_factory=list)
    divergences: list[Divergence] = field(default_factory=list)
    busy: bool = False
    owner: bytes | None = None  # the digest of the owner key its first turn gave; None: anyone's

    def check_owner(self, key: str | None) -> None:
        """A 403 naming ``session_id`` unless ``key`` is the owner key the session was opened with (a
        session opened without one answers to every caller). Nothing about the session changes."""
        given = owner_digest(key)
        if self.owner is not None and (given is None or not hmac.compare_digest(self.owner, given)):
            raise OpenAIError(403, f"session {self.id!r} belongs to another caller (its X-Session-Owner differs): "
                              "choose another session id", "session_id", "session_owned")

    @property
    def branch(self) -> Branch | None:
        return self.branches[-1] if self.branches else None

    @property
    def tokens(self) -> int:
        return sum(len(b.ids) for b in self.branches)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.branches)

    @property
    def turn_count(self) -> int:
        return sum(len(b.turns) for b in self.branches)

    def to_json(self) -> dict[str, Any]:
        """The trajectory: the current branch's ids at the top, every branch and divergence beside it
        (``rewritten`` ones as the turns made them, then each branch's ``retokenized`` one, if checked)."""
        current = self.branch
        found = [*self.divergences, *(b.retokenized for b in self.branches if b.retokenized is not None)]
        out: dict[str, Any] = {"session_id": self.id, "turn_count": self.turn_count,
                               "divergences": [d.to_json() for d in found],
                               "branch": len(self.branches) - 1, "branches": [b.to_json() for b in self.branches]}
        if current is not None:
            out.update(current.to_json())
        return out


@dataclass(frozen=True)
class PromptPlan:
    """A turn's prompt ids and how they relate to the session's branch: ``extends`` (its first
    ``len(branch.ids)`` ids are the branch's) or a new branch; and a divergence to count, if any."""

    ids: list[int]
    extends: bool
    divergence: Divergence | None = None
    tools: list[dict[str, Any]] | None = None  # what the template was given (chat turns)


class Ledger:
    """The sessions, least recently used first; expiry is swept on every access (no timer task)."""

    def __init__(self, max_sessions: int, max_tokens: int, idle_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self.idle_s = idle_s
        self.clock = clock
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self.expired = 0
        self.evicted = 0
        self.divergences = 0

    def _sweep(self) -> None:
        now = self.clock()
        while self.sessions:
            oldest = next(iter(self.sessions.values()))
            if oldest.busy or now - oldest.last_used < self.idle_s:
                break
            del self.sessions[oldest.id]
            self.expired += 1

    def get(self, session_id: str) -> Session | None:
        self._sweep()
        return self.sessions.get(session_id)

    def begin(self, session_id: str, owner: str | None = None) -> Session:
        """The session for a turn about to run (made if new, owned by ``owner``'s digest when given), marked
        busy: one turn at a time per session (a second one while it runs gets 409: the ledger could not say
        which came first). Another caller's session gets 403 and is left as it was."""
        self._sweep()
        session = self.sessions.get(session_id)
        if session is not None:
            session.check_owner(owner)
        if session is None:
            if len(self.sessions) >= self.max_sessions:
                idle = next((s for s in self.sessions.values() if not s.busy), None)
                if idle is None:
                    raise OpenAIError(429, f"{self.max_sessions} sessions are running a turn "
                                      "(openai_max_sessions)", "session_id", "too_many_sessions")
                del self.sessions[idle.id]
                self.evicted += 1
            session = self.sessions[session_id] = Session(session_id, self.clock(), owner=owner_digest(owner))
        elif session.busy:
            raise OpenAIError(409, f"session {session_id!r} is already running a turn", "session_id",
                              "session_busy")
        self.sessions.move_to_end(session_id)
        session.busy = True
        return session

    def end(self, session: Session) -> None:
        session.busy = False
        session.last_used = self.clock()

    def check_room(self, session: Session, plan: PromptPlan) -> None:
        """Refuse a turn whose prompt would take the session past ``openai_session_max_tokens``."""
        branch = session.branch
        held = session.tokens - (len(branch.ids) if branch is not None and plan.extends else 0)
        if held + len(plan.ids) > self.max_tokens:
            raise invalid_session(f"session {session.id!r} would hold {held + len(plan.ids)} tokens, past "
                                  f"openai_session_max_tokens {self.max_tokens}; read and free it first")

    def record(self, session: Session, plan: PromptPlan, messages: list[dict[str, Any]] | None,
               result: TurnResult, answer: dict[str, Any] | None, experts_from: int = 0,
               known: KnownIds | None = None) -> None:
        """A finished turn into the session: its template tokens (mask 0), its sampled ids (mask 1);
        ``answer`` is the assistant message the caller was given (content and tool calls), which the next
        turn's history must repeat; ``known``: what the turn's prompt ids gave (kept for the next turn)."""
        branch = session.branch
        if plan.divergence is not None:
            session.divergences.append(plan.divergence)
            self.divergences += 1
        if branch is None or not plan.extends:
            branch = Branch(len(plan.ids), _ids(plan.ids))
            session.branches.append(branch)
        else:
            added = plan.ids[len(branch.ids):]
            branch.ids.extend(added)
            branch.mask.extend(_mask(bytes(len(added))))
            branch.logprobs.extend(_logprobs(bytes(4 * len(added))))  # zero bytes: 0.0
        if known is not None and known.ids is plan.ids:
            branch.max_id = max(known.max_id, max(result.output_ids, default=-1))
            branch.block, branch.hashes = known.block, array("q", known.hashes)
        else:  # nothing known of the new ids: the next turn passes over them all
            branch.max_id, branch.block, branch.hashes = None, 0, array("q")
        branch.ids.extend(result.output_ids)
        branch.mask.extend(_mask(b"\x01" * len(result.output_ids)))
        branch.logprobs.extend(_logprobs(0.0 if lp is None else lp for lp in result.logprobs))
        if result.routed_experts is not None:
            branch.add_experts(result.routed_experts, experts_from)
        if messages is not None:
            branch.messages = [*messages, answer or {"role": "assistant", "content": ""}]
            branch.tools = plan.tools
        branch.turns.append(Turn(session.turn_count, len(plan.ids), len(result.output_ids), result.finish_reason,
                                 result.matched_stop, result.weight_version, result.weight_versions))

    def checked(self, branch: Branch, divergence: Divergence | None) -> None:
        """A branch's re-tokenization check (prompt.retokenized) as of its current ids; counted in the
        ledger's figures the first time a check of the branch finds one."""
        if divergence is not None and branch.retokenized is None:
            self.divergences += 1
        branch.retokenized, branch.checked = divergence, len(branch.ids)

    def release(self, session_id: str) -> Session | None:
        session = self.sessions.get(session_id)
        if session is None or session.busy:
            return None
        return self.sessions.pop(session_id)

    def status(self) -> dict[str, Any]:
        self._sweep()
        return {"sessions": len(self.sessions), "tokens": sum(s.tokens for s in self.sessions.values()),
                "token_bytes": sum(s.nbytes for s in self.sessions.values()),
                "divergences": self.divergences, "expired": self.expired, "evicted": self.evicted,
                "max_sessions": self.max_sessions, "max_session_tokens": self.max_tokens,
                "session_idle_s": self.idle_s}


def invalid_session(message: str) -> OpenAIError:
    return OpenAIError(400, message, "session_id", "session_full")
