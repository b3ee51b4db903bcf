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
first output, so each keeps its own key. Bounded (least recently used dropped first); the cost is
one hash step per prompt token, and only up to the longest remembered context.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence


class TrajectoryKeys:
    def __init__(self, capacity: int = 65536, trim: int = 1):
        if capacity < 1 or trim < 0:
            raise ValueError("capacity must be >= 1 and trim >= 0")
        self.capacity = capacity
        self.trim = trim
        self._keys: OrderedDict[tuple[int, int], str] = OrderedDict()  # (length, hash) -> key
        self._lengths: Counter[int] = Counter()
        self.continued = 0  # requests that took over a remembered trajectory's key
        self.started = 0  # requests that started a trajectory

    def __len__(self) -> int:
        return len(self._keys)

    def key_for(self, prompt_ids: Sequence[int], request_id: str) -> str:
        """The key of the trajectory ``prompt_ids`` continues, else ``request_id`` (a new trajectory)."""
        found: tuple[int, int] | None = None
        if self._lengths:
            longest = max(self._lengths)
            h = 0
            for n, token in enumerate(prompt_ids[:longest], start=1):
                h = hash((h, int(token)))
                if n in self._lengths and (n, h) in self._keys:
                    found = (n, h)
        if found is None:
            self.started += 1
            return request_id
        self.continued += 1
        return self._drop(found)

    def finished(self, key: str, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """The turn keyed ``key`` produced ``output_ids``: its next turn will extend this context."""
        context = [*prompt_ids, *output_ids]
        # the whole context, and (past the prompt, which a turn's siblings share) up to `trim` tokens less
        shortest = max(len(context) - self.trim, len(prompt_ids) + 1, 1)
        h = 0
        for n, token in enumerate(context, start=1):
            h = hash((h, int(token)))
            if n >= shortest:
                self._remember((n, h), key)
        while len(self._keys) > self.capacity:
            self._drop(next(iter(self._keys)))

    def _remember(self, entry: tuple[int, int], key: str) -> None:
        if entry in self._keys:
            self._drop(entry)
        self._keys[entry] = key
        self._lengths[entry[0]] += 1

    def _drop(self, entry: tuple[int, int]) -> str:
        key = self._keys.pop(entry)
        self._lengths[entry[0]] -= 1
        if self._lengths[entry[0]] <= 0:
            del self._lengths[entry[0]]
        return key
