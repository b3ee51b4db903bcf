"""What weight sync is configured with (the ``weight_*`` and ``peer_bootstrap*`` options of :class:`Config`).

Runs in: manager.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rollout_manager.config import Config
from rollout_manager.weights.protocol import PauseMode, PushMode, TransportName


@dataclass(frozen=True)
class SyncSettings:
    transport: TransportName
    drain_timeout_s: float
    push_timeout_s: float
    retry_s: float
    max_attempts: int
    push_mode: PushMode = "full"
    peer_bootstrap: bool = False
    # "auto" sends deltas only to instances whose last full push from their sender ran below this
    # (GB/s): on a faster link encoding and applying a delta costs more than the bytes it saves.
    delta_below_gbps: float = 0.4
    # The most a peer bootstrap waits on the peer (its layout and serve calls together) before the
    # instance falls back to its sender: a peer that hangs must not cost the whole push_timeout_s.
    peer_timeout_s: float = 120.0
    activation: Literal["staged", "drain"] = "drain"  # config.weight_activation
    pause_mode: PauseMode = "retract"  # config.weight_activation_pause_mode

    @classmethod
    def from_config(cls, cfg: Config) -> SyncSettings:
        mode = cfg.weight_push_mode
        if mode == "auto" and cfg.weight_transport == "mooncake" and cfg.mooncake_transfer_protocol == "rdma":
            mode = "full"  # RDMA moves the full bytes faster than a delta is encoded and applied
        return cls(cfg.weight_transport, cfg.drain_timeout_s, cfg.weight_push_timeout_s, cfg.weight_push_retry_s,
                   cfg.weight_push_max_attempts, mode, cfg.peer_bootstrap, cfg.weight_delta_below_gbps,
                   cfg.peer_bootstrap_timeout_s, cfg.weight_activation, cfg.weight_activation_pause_mode)
