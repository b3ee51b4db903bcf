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
the dtype it came in: float32 under verl's default ``model_dtype``) on the ranks that merge, each
node's lowest rank (the one that stages weights into the node's sender; the adapter decides, see
:mod:`trainer_plugin.verl_rollout`), and, for each adapter, yields ``W + scale * B @ A`` for every targeted module
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
    """One training rank's view of the base weights, and the merge of each step's adapter onto them.

    Every rank keeps the base's names and shapes, so every rank refuses the same adapters before any
    collective of the push; only a rank that keeps the base (``keep_base(..., keep=True)``) keeps its
    tensors and yields merged weights."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.synced = False  # verl's base sync has happened (whether or not this rank kept the tensors)
        self.kept = False

    @property
    def base_bytes(self) -> int:
        """Host memory the kept base takes on this rank."""
        return sum(t.nbytes for t in self.base.values())

    def keep_base(self, weights: Iterable[tuple[str, torch.Tensor]], keep: bool = True) -> int:
        """Drain verl's base-sync iterator (every rank must) into CPU copies under HF names, replacing the
        previous base; ``keep`` False: keep only names and shapes (a rank that never merges). Returns the
        number of tensors synced."""
        base: dict[str, torch.Tensor] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for name, tensor in weights:
            hf = hf_base_name(name)
            shapes[hf] = tuple(tensor.shape)
            if keep:
                base[hf] = tensor.detach().to("cpu", copy=True)
        self.base, self.shapes, self.synced, self.kept = base, shapes, True, keep
        return len(shapes)

    def merged(self, adapter: Iterable[tuple[str, torch.Tensor]], spec: LoraSpec) -> Iterator[tuple[str, torch.Tensor]]:
        """The base with ``adapter`` merged in, one tensor at a time (the adapter is read first, whole);
        nothing on a rank that did not keep the base tensors.

        Raises here, on every rank alike, before anything is merged or pushed, if an adapter tensor names
        no base tensor, has no partner, or does not fit its base tensor's shape."""
        pairs = self._pairs(adapter, spec.fan_in_fan_out)
        return self._merge(pairs, spec.scale, spec.fan_in_fan_out) if self.kept else iter(())

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
            yield name, (w.to(torch.float32) + scale * delta).to(w.dtype)

    def _pairs(self, adapter: Iterable[tuple[str, torch.Tensor]],
               fan_in_fan_out: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
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
            if target not in self.shapes:
                raise NotImplementedError(f"LoRA adapter tensor {name!r} targets {target!r}, which is not among "
                                          f"the {len(self.shapes)} base tensors verl synced")
            halves.setdefault(target, {})[m["ab"]] = tensor.detach().to("cpu")
        pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for target, ab in halves.items():
            if set(ab) != {"A", "B"}:
                raise ValueError(f"LoRA adapter for {target!r} has lora_{''.join(ab)} without its partner")
            a, b = ab["A"], ab["B"]
            delta = (b.shape[0], a.shape[-1]) if a.dim() == 2 and b.dim() == 2 and a.shape[0] == b.shape[1] else None
            if delta is not None and fan_in_fan_out:
                delta = delta[::-1]
            if delta != self.shapes[target]:
                raise ValueError(f"LoRA update for {target}: B {tuple(b.shape)} @ A {tuple(a.shape)} does not fit "
                                 f"the base tensor's {self.shapes[target]}")
            pairs[target] = (a, b)
        return pairs
