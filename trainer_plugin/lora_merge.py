"""Unmerged LoRA (verl's default ``lora.merge: False``) pushed as merged weights.

verl 0.9.1's naive sync (``workers/engine_workers.py:update_weights``) with an unmerged adapter calls
the rollout's ``update_weights`` with ``peft_config`` set, and:

- once, on the first sync when ``rollout.load_format`` contains ``dummy`` (verl's default), with the
  **base** weights and ``base_sync_done=False``: ``collect_lora_params`` (``utils/fsdp_utils.py``)
  takes ``peft_model.base_model.model``'s state dict without ``lora_`` entries and ``.base_layer``,
  then ``replace_lora_wrapper`` puts ``.base_layer`` back before ``.weight``/``.bias`` of every
  targeted module (and of every ``q/k/v/o/gate/up/down_proj``): ``model.layers.0.self_attn.q_proj.base_layer.weight``;
- then, under the same ``global_steps`` and again at every later step, with the **adapter** and
  ``base_sync_done=True``: PEFT's ``get_peft_model_state_dict``, named
  ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` / ``...lora_B.weight``.

The base is frozen under LoRA, so verl sends it once. :class:`LoraMerge` keeps it (on the CPU, in
the dtype it came in) and, for each adapter, yields ``W + scale * B @ A`` for every targeted module
(computed in float32, cast back to W's dtype; ``scale = lora_alpha / r``, ``/ sqrt(r)`` with
``use_rslora``) and every other base tensor as it is, under HF names (``.base_layer`` dropped):
one full payload that the weight push publishes as that step's version. Each step merges onto the
kept base, never onto an earlier merge. Adapters this cannot express as a merge (DoRA, per-module
rank/alpha patterns, embedding adapters, ``modules_to_save``, a name with no base tensor) are refused.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

_ADAPTER_NAME = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>A|B)(?:\.[^.]+)?\.weight$")
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraSpec:
    """What of a PEFT ``LoraConfig`` the merge needs."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    fan_in_fan_out: bool = False

    @property
    def scale(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def from_peft_config(cls, config: Any) -> LoraSpec:
        """From verl's ``peft_config`` (a PEFT ``LoraConfig``, or a mapping with its fields)."""
        def get(key: str, default: Any = None) -> Any:
            if isinstance(config, dict):
                return config.get(key, default)
            return getattr(config, key, default)

        if get("use_dora"):
            raise NotImplementedError("peft_config.use_dora: a DoRA adapter is not a plain W + B @ A merge")
        for key in ("rank_pattern", "alpha_pattern"):
            if get(key):
                raise NotImplementedError(f"peft_config.{key} ({get(key)!r}): per-module ranks or alphas are not "
                                          "merged; use one r and lora_alpha for every target module")
        r = int(get("r", 0) or 0)
        if r <= 0:
            raise ValueError(f"peft_config.r must be a positive rank, not {get('r')!r}")
        return cls(r=r, lora_alpha=float(get("lora_alpha", r)), use_rslora=bool(get("use_rslora", False)),
                   fan_in_fan_out=bool(get("fan_in_fan_out", False)))


def hf_base_name(name: str) -> str:
    """verl's base-sync name of a tensor -> the model's own (HF) name: ``.base_layer`` dropped."""
    for tail in (".weight", ".bias"):
        if name.endswith(".base_layer" + tail):
            return name[: -len(".base_layer" + tail)] + tail
    return name


class LoraMerge:
    """One training rank's kept base weights, and the merge of each step's adapter onto them."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}

    @property
    def has_base(self) -> bool:
        return bool(self.base)

    def keep_base(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Drain verl's base-sync iterator into CPU copies under HF names; the previous base is replaced."""
        base: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            base[hf_base_name(name)] = tensor.detach().to("cpu", copy=True)
        self.base = base
        return len(base)

    def merged(self, adapter: Iterable[tuple[str, torch.Tensor]], spec: LoraSpec) -> Iterator[tuple[str, torch.Tensor]]:
        """The base with ``adapter`` merged in, one tensor at a time (the adapter is read first, whole).

        Raises here, before anything is merged or pushed, if an adapter tensor names no base tensor or
        has no partner."""
        return self._merge(self._pairs(adapter), spec.scale, spec.fan_in_fan_out)

    def _merge(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float,
               fan_in_fan_out: bool) -> Iterator[tuple[str, torch.Tensor]]:
        for name, w in self.base.items():
            pair = pairs.get(name)
            if pair is None:
                yield name, w
                continue
            a, b = pair
            delta = b.to(torch.float32) @ a.to(torch.float32)
            if fan_in_fan_out:
                delta = delta.T
            if delta.shape != w.shape:
                raise ValueError(f"LoRA update for {name}: B @ A is {tuple(delta.shape)}, the base tensor is "
                                 f"{tuple(w.shape)}")
            yield name, (w.to(torch.float32) + scale * delta).to(w.dtype)

    def _pairs(self, adapter: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{base weight name: (A, B)}`` from PEFT adapter names; refuses names that map to no base tensor."""
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in adapter:
            m = _ADAPTER_NAME.match(name)
            if m is None:
                raise NotImplementedError(
                    f"LoRA adapter tensor {name!r} is not a lora_A/lora_B weight (embedding adapters, DoRA "
                    "magnitudes and modules_to_save are not merged)")
            module = m["module"]
            if module.startswith(_PEFT_PREFIX):
                module = module[len(_PEFT_PREFIX):]
            target = f"{module}.weight"
            if target not in self.base:
                raise NotImplementedError(f"LoRA adapter tensor {name!r} targets {target!r}, which is not among "
                                          f"the {len(self.base)} base tensors verl synced")
            halves.setdefault(target, {})[m["ab"]] = tensor.detach().to("cpu")
        pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for target, ab in halves.items():
            if set(ab) != {"A", "B"}:
                raise ValueError(f"LoRA adapter for {target!r} has lora_{''.join(ab)} without its partner")
            pairs[target] = (ab["A"], ab["B"])
        return pairs
