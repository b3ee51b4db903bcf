"""The trust probe's reference log-probs, computed with the trainer's own model (``POST /update_probe_reference``).

The manager judges the boxes at a weight version by comparing their answers to one fixed prompt; a fault every
box shares (a weight sync gone wrong for all, a dtype) is invisible to that comparison, and a box alone at its
version has nothing to be compared with. The trainer holds the weights the boxes should serve: the log-probs
of the probe prompt under its model are the reference. :func:`reference_logprobs` computes them from any
callable that maps a prompt's ids to its logits (an HF causal LM through :func:`hf_logits`, or a module that
returns ``[n, vocab]`` logits), in float32, one forward of 32 tokens; :func:`post_reference` fetches the prompt
(``GET /probe_prompt``), computes and posts them with the version. It is optional and called by whoever holds
the module: in verl's V1 trainer the actor lives in Ray workers, not in the driver where the plugin's hooks
run, so the plugin does not call it by itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .metrics import call_sync

LogitsOf = Callable[[list[int]], Any]  # prompt ids -> logits, [n, vocab] or [1, n, vocab]


def hf_logits(module: Any) -> LogitsOf:
    """A Hugging Face causal LM (``module(input_ids).logits``) as a :data:`LogitsOf`, on the module's device."""
    import torch

    def logits_of(ids: list[int]) -> Any:
        device = next(module.parameters()).device
        return module(torch.tensor([ids], device=device)).logits

    return logits_of


def reference_logprobs(logits_of: LogitsOf, ids: Sequence[int]) -> list[float]:
    """The log-prob of each token of ``ids`` after the first, given the ones before it (what the probe reads
    from SGLang's ``input_token_logprobs``), computed in float32 without gradients."""
    import torch

    with torch.no_grad():
        logits = logits_of(list(ids))
        if logits.dim() == 3:
            logits = logits[0]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(list(ids)[1:], device=logprobs.device)
        picked = logprobs[:-1].gather(1, target[:, None])[:, 0]
    return [float(v) for v in picked.cpu().tolist()]


def post_reference(manager_url: str, weight_version: int, logits_of: LogitsOf,
                   vocab_size: int | None = None) -> dict[str, Any]:
    """Fetch the probe prompt, compute its log-probs with ``logits_of`` and post them for ``weight_version``;
    the manager's answer (its boxes at that version are probed again and judged by them)."""
    prompt = call_sync(manager_url, lambda client: client.probe_prompt(vocab_size))
    ids = [int(t) for t in prompt["input_ids"]]
    values = reference_logprobs(logits_of, ids)
    return call_sync(manager_url, lambda client: client.update_probe_reference(weight_version, ids, values))
