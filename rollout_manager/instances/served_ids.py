"""Which token ids a box is known to take, so that the manager's own requests (the trust probe) never send
it one it might not.

SGLang 0.5.23 reports no vocabulary size and dies on an input id past its embedding table, so a guessed
bound takes boxes down. An id is safe on a box when the box itself said so, or a source that cannot be
wrong did: its vocabulary size reported by the server or read from the model's config.json by its launcher
(``EngineFacts.vocab_checked``), or an id it has been seen to take (the embedding is one dense table, so
every id below the largest it took is in it). A vocabulary size somebody declared at registration is not
enough: it bounds what callers may send, never what the manager sends on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Annotated, Any

import msgspec

from rollout_manager.instances.instance import Instance
from rollout_manager.sglang.logprob_probe import ID_RUNGS

_ENOUGH = ID_RUNGS[-1]  # past the probe's top rung, more ids seen change nothing


@lru_cache(maxsize=64)
def _ids_below(limit: int) -> Any:
    return list[Annotated[int, msgspec.Meta(lt=limit)]]


def below(ids: list[int], limit: int) -> bool:
    """Whether every id of ``ids`` is below ``limit``: ``max(ids) < limit``, checked by msgspec in C (a
    third less than ``max`` on a long prompt, whose Python comparisons are most of its cost)."""
    try:
        msgspec.convert(ids, _ids_below(limit))
    except msgspec.ValidationError:  # an id at or past it (or not an int: max decides)
        return not ids or max(ids) < limit
    return True


def safe_id_limit(inst: Instance) -> int:
    """Every id below this is known to be safe on ``inst`` (0: none is yet)."""
    engine = inst.engine
    checked = engine.vocab_size if engine.vocab_checked and engine.vocab_size else 0
    return max(checked, inst.ids_served)


def note_served(inst: Instance, prompt: Sequence[int], output: Sequence[int], prompt_max: int | None = None) -> None:
    """``inst`` made tokens for ``prompt`` + ``output`` (it prefilled the prompt and sampled or prefilled the
    output): each of those ids is one it takes. Costs one pass over the ids until the box's limit is past
    what the probe needs, nothing after; ``prompt_max``: ``max(prompt)`` when the caller knows it (a chat
    session's ledger keeps it turn to turn), so the prompt is not passed over."""
    if safe_id_limit(inst) >= _ENOUGH:
        return
    served = inst.ids_served
    if prompt_max is not None:
        served = max(served, prompt_max + 1)
        prompt = ()
    for ids in (prompt, output):  # most calls change nothing: checked against what it took, in C
        if ids and not below(list(ids) if type(ids) is not list else ids, served):
            served = max(served, max(ids) + 1)
    inst.ids_served = served
