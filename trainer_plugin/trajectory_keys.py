"""A trajectory key that stays the same across a multi-turn agent's turns, found from the prompt.

The manager sends a request carrying a known ``trajectory_key`` to the instance that served that key
before, whose prefix cache holds the conversation. verl 0.9.1's agent loops cannot give the proxy such
a key: ``LLMServerClient.generate`` (``workers/rollout/llm_server.py``) keeps the trajectory's
``request_id`` for its own load balancer and passes the server a fresh ``uuid4().hex`` on every turn
(``_vllm_request_id``; only ``full_determinism`` passes it through). What is stable is the token
context: a tool agent's next prompt is its previous prompt, the tokens generated for it, and whatever
the tools and the chat template add (``tool_agent_loop.py``, ``ct_merge_assistant_token``).

So :class:`TrajectoryKeys` remembers, for each finished turn, ``prompt + output`` (as a chained hash
and its length) under that turn's key; a new prompt that begins with a remembered context takes over
its key (the longest one wins, and the entry moves on with the trajectory), and a prompt that extends
none starts a trajectory keyed by its own request id. Some of verl's token builders drop the stop
token at the junction (``GLMContinuousTokenBuilder`` in ``utils/tokenizer/continuous_token.py``),
so the context is also remembered without its last ``trim`` output tokens. Siblings of one GRPO prompt diverge in their
first output, so each keeps its own key. Bounded (least recently used dropped first). Contexts are
hashed in blocks of :data:`BLOCK` tokens (a chained hash of each block-aligned prefix) plus the tail
after the last whole block, so a look-up costs one hash per block of the prompt, up to the longest
remembered context.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

BLOCK = 16
Entry = tuple[int, int, tuple[int, ...]]  # (block-aligned length, hash of that prefix, the tokens after it)


def _prefix_hashes(ids: Sequence[int], upto: int) -> list[int]:
    """Hash of ``ids[:b]`` for every block boundary ``b <= upto`` (index ``b // BLOCK``), chained."""
    out = [0]
    for b in range(BLOCK, min(upto, len(ids)) + 1, BLOCK):
        out.append(hash((out[-1], tuple(ids[b - BLOCK:b]))))
    return out


class TrajectoryKeys:
    def __init__(self, capacity: int = 65536, trim: int = 1):
        if capacity < 1 or trim < 0:
            raise ValueError("capacity must be >= 1 and trim >= 0")
        self.capacity = capacity
        self.trim = trim
        self._order: OrderedDict[Entry, str] = OrderedDict()  # entry -> key, least recently used first
        self._index: dict[tuple[int, int], set[tuple[int, ...]]] = {}  # (length, hash) -> tails stored there
        self._longest = 0
        self.continued = 0  # requests that took over a remembered trajectory's key
        self.started = 0  # requests that started a trajectory

    def __len__(self) -> int:
        return len(self._order)

    def key_for(self, prompt_ids: Sequence[int], request_id: str) -> str:
        """The key of the trajectory ``prompt_ids`` continues, else ``request_id`` (a new trajectory)."""
        found: Entry | None = None
        if self._order:
            n = len(prompt_ids)
            for i, h in enumerate(_prefix_hashes(prompt_ids, min(n, self._longest))):
                b = i * BLOCK
                for tail in self._index.get((b, h), ()):
                    end = b + len(tail)
                    if end <= n and (found is None or end > found[0] + len(found[2])) and \
                            tuple(prompt_ids[b:end]) == tail:
                        found = (b, h, tail)
        if found is None:
            self.started += 1
            return request_id
        self.continued += 1
        return self._drop(found)

    def finished(self, key: str, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """The turn keyed ``key`` produced ``output_ids``: its next turn will extend this context."""
        context = [*prompt_ids, *output_ids]
        hashes = _prefix_hashes(context, len(context))
        # the whole context, and (past the prompt, which a turn's siblings share) up to `trim` tokens less
        for n in range(max(len(context) - self.trim, len(prompt_ids) + 1, 1), len(context) + 1):
            b = n // BLOCK * BLOCK
            entry = (b, hashes[b // BLOCK], tuple(context[b:n]))
            if entry in self._order:
                self._drop(entry)
            self._order[entry] = key
            self._index.setdefault(entry[:2], set()).add(entry[2])
            self._longest = max(self._longest, n)
        while len(self._order) > self.capacity:
            self._drop(next(iter(self._order)))

    def _drop(self, entry: Entry) -> str:
        key = self._order.pop(entry)
        tails = self._index[entry[:2]]
        tails.discard(entry[2])
        if not tails:
            del self._index[entry[:2]]
        return key
