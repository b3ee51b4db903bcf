"""SGLang's prefix (radix) cache as far as weight updates go: which weights computed each cached token's KV.

The engine recomputes every token from scratch, so a stale cache changes none of its outputs; what it keeps
instead is what SGLang 0.5.23 would read. A sequence's prefill matches the longest cached prefix of its tokens
(less the last, which SGLang always computes) and reads that KV; every token it then computes is cached under
the weights loaded at that moment, and stays so until a flush. A weight load does not touch the cache (SGLang's
``update_weights_from_tensor`` flushes only when asked and idle), so KV the old weights made survives it unless
the load is followed by a successful flush. ``stale_reads`` counts the client prefills that read such KV: a
load is clean when it stays 0 for every request that came after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A node: token -> (the weights epoch that computed its KV, its children).
Children = dict[int, tuple[int, "Children"]]


@dataclass
class Cursor:
    """Where one running sequence's cached tokens end, so each decoded token is cached in O(1)."""

    children: Children
    length: int
    generation: int  # the cache's generation it points into (a flush starts a new one)


@dataclass
class PrefixCache:
    max_nodes: int = 1 << 20  # beyond this the cache is emptied (SGLang evicts; no test comes near it)
    epoch: int = 0  # bumped by every weight load
    generation: int = 0  # bumped by every flush
    stale_reads: int = 0  # client prefills that read KV computed by weights loaded before the current ones
    stale_tokens: int = 0  # the tokens of those reads that were stale
    root: Children = field(default_factory=dict)
    nodes: int = 0

    def weights_loaded(self) -> None:
        self.epoch += 1

    def flush(self) -> None:
        self.root, self.nodes, self.generation = {}, 0, self.generation + 1

    def prefill(self, tokens: list[int], *, count: bool = True) -> Cursor:
        """A sequence (re)enters the running batch: read the cached prefix of ``tokens[:-1]`` (a stale read is
        counted when ``count``), then cache the rest under the current weights."""
        children, stale, length = self.root, 0, 0
        for token in tokens[:-1]:
            entry = children.get(token)
            if entry is None:
                break
            stale += entry[0] != self.epoch
            children, length = entry[1], length + 1
        if stale and count:
            self.stale_reads += 1
            self.stale_tokens += stale
        cursor = Cursor(children, length, self.generation)
        self.extend(cursor, tokens)
        return cursor

    def extend(self, cursor: Cursor, tokens: list[int]) -> None:
        """Cache ``tokens[:-1]`` past what ``cursor`` holds (the last token's KV is computed next round)."""
        if cursor.generation != self.generation:  # flushed under it (SGLang refuses that while it runs)
            cursor.children, cursor.length, cursor.generation = self.root, 0, self.generation
        if self.nodes + len(tokens) > self.max_nodes:
            self.flush()
            cursor.children, cursor.length, cursor.generation = self.root, 0, self.generation
        children = cursor.children
        for token in tokens[cursor.length:-1]:
            entry = children.get(token)
            if entry is None:
                entry = children[token] = (self.epoch, {})
                self.nodes += 1
            children = entry[1]
        cursor.children, cursor.length = children, max(len(tokens) - 1, cursor.length)
