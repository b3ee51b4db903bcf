"""verl's rollout routing replay (R3) through the manager: ask for the experts, decode them, check the fleet.

With ``actor_rollout_ref.rollout.enable_rollout_routing_replay`` verl's own SGLang server sets
``return_routed_experts`` on ``/generate`` and hands the trainer ``TokenOutput.routed_experts``: SGLang's
``meta_info.routed_experts`` (base64 of little-endian int32) as a numpy array shaped
``(-1, num_hidden_layers, num_experts_per_tok)``, one row per token of ``prompt + response`` but the last
(verl 0.9.1 ``workers/rollout/sglang_rollout/async_sglang_server.py``). The agent loop then pads it to
``prompt + response`` rows of int16 for the trainer's router replay. The proxy does the same with the
manager's answer (:func:`decode_routed_experts`), which has SGLang's format and alignment.

Without experts the trainer would replay nothing and train as if replay were off, so every way they can
go missing fails loudly instead: at start, a manager whose instances all say they cannot return experts
(:func:`require_routed_experts`, from ``/get_instances_status``); on a request, the manager's refusal
(:func:`refusal_error`); and an answer without them or of the wrong length (:func:`decode_routed_experts`).
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger("trainer_plugin.routed_experts")

REPLAY_KEY = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
SERVER_FLAG = "--enable-return-routed-experts"
REQUEST_FIELD = "return_routed_experts"
_FIX = (f"start every rollout box's SGLang with {SERVER_FLAG} (and a MoE model), or set {REPLAY_KEY}=false; "
        "without the experts the trainer's router replay would train as if it were off")


class RoutedExpertsUnavailable(RuntimeError):
    """Routing replay is on but the rollout fleet does not return routed experts."""


@dataclass(frozen=True)
class ExpertsLayout:
    """The model's MoE shape: one row of a token's experts is ``layers x top_k`` expert ids."""

    layers: int
    top_k: int

    @classmethod
    def of_model(cls, model_config: Any) -> ExpertsLayout:
        """From verl's ``HFModelConfig`` (its ``hf_config``), as verl's SGLang server reads it."""
        hf = getattr(model_config, "hf_config", None)
        layers, top_k = getattr(hf, "num_hidden_layers", None), getattr(hf, "num_experts_per_tok", None)
        if not isinstance(layers, int) or not isinstance(top_k, int) or layers < 1 or top_k < 1:
            raise AttributeError(f"{REPLAY_KEY}=true needs a MoE model whose config defines num_hidden_layers and "
                                 f"num_experts_per_tok (got {layers!r} and {top_k!r})")
        return cls(layers, top_k)


def decode_routed_experts(value: str | None, layout: ExpertsLayout, *, rows: int, rid: Any = None) -> np.ndarray:
    """An answer's ``routed_experts`` (:attr:`ReceivedAnswer.routed_experts`, base64 text; None: not sent)
    -> int32 ``[rows, layers, top_k]`` (verl's ``TokenOutput.routed_experts``).

    ``rows``: what SGLang's alignment gives from position 0, ``prompt + completion - 1``; an answer that
    does not carry exactly that many is refused rather than handed to the trainer misaligned."""
    if value is None:
        raise RoutedExpertsUnavailable(
            f"request {rid}: the answer carries no meta_info.routed_experts although it asked for them "
            f"({REQUEST_FIELD}); the manager or the instance that served it does not return experts: {_FIX}")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"request {rid}: meta_info.routed_experts is not base64: {exc}") from exc
    per_row = 4 * layout.layers * layout.top_k
    if len(raw) != rows * per_row:
        raise ValueError(f"request {rid}: meta_info.routed_experts holds {len(raw)} bytes, expected {rows} rows of "
                         f"{layout.layers} layers x {layout.top_k} experts (int32: {rows * per_row} bytes)")
    return np.frombuffer(raw, dtype="<i4").astype(np.int32, copy=False).reshape(rows, layout.layers, layout.top_k)


@dataclass(frozen=True)
class FleetExperts:
    """Which instances say they return routed experts (SGLang's ``/server_info``
    ``enable_return_routed_experts``, each instance's ``routed_experts`` in ``/get_instances_status``);
    unknown: not said yet (still starting, or a manager that does not report it)."""

    capable: tuple[str, ...]
    incapable: tuple[str, ...]
    unknown: tuple[str, ...]

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> FleetExperts:
        groups: dict[bool | None, list[str]] = {True: [], False: [], None: []}
        for inst in status.get("instances") or []:
            if isinstance(inst, Mapping) and inst.get("state") != "dead":
                groups[_says(inst)].append(str(inst.get("endpoint")))
        return cls(tuple(groups[True]), tuple(groups[False]), tuple(groups[None]))


def _says(inst: Mapping[str, Any]) -> bool | None:
    value = inst.get("routed_experts")
    return value if isinstance(value, bool) else None


def require_routed_experts(fleet: FleetExperts, manager_url: str) -> None:
    """Fail when instances answered and none can return experts; warn about the ones that cannot.

    An instance that has not said yet (still starting) is given the benefit of the doubt: the manager
    refuses an R3 request that no instance can serve, and an answer without experts fails the request."""
    if fleet.incapable and not fleet.capable and not fleet.unknown:
        raise RoutedExpertsUnavailable(
            f"{REPLAY_KEY}=true, but no instance of the rollout manager at {manager_url} returns routed experts "
            f"(started without {SERVER_FLAG}: {', '.join(fleet.incapable)}): {_FIX}")
    if fleet.incapable:
        log.warning("routing replay: %d instance(s) started without %s serve no replay requests: %s",
                    len(fleet.incapable), SERVER_FLAG, ", ".join(fleet.incapable))


def refusal_error(status: int, message: str) -> RoutedExpertsUnavailable | None:
    """The manager's refusal of an R3 request for want of an instance that returns experts, in our words."""
    if (400 <= status < 500 or status == 503) and REQUEST_FIELD in message:
        return RoutedExpertsUnavailable(f"{REPLAY_KEY}=true, but the rollout manager refused the request "
                                        f"({status}: {message}): {_FIX}")
    return None
