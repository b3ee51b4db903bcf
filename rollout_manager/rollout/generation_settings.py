"""How the generator runs sequences, read from the manager's config like the other settings classes."""

from __future__ import annotations

from dataclasses import dataclass

from rollout_manager.config import Config
from rollout_manager.placement.tail_migration import TailMigration
from rollout_manager.rollout.pieces import PieceSettings


@dataclass(frozen=True)
class GenerationSettings:
    max_attempts: int
    wait_timeout_s: float  # how long a request waits for an instance that can take it
    connect_timeout_s: float
    stall_timeout_s: float
    # sampling_params.stream_interval sent with every sequence (a streaming caller's own value wins):
    # the engine sends a chunk per that many tokens, so the relay parses that many times fewer frames.
    # 0: none is sent (the server's --stream-interval holds).
    engine_stream_interval: int = 64
    # Tail migration (None: off): the policy, and how often it is asked which sequences to move.
    migration: TailMigration | None = None
    migration_interval_s: float = 1.0
    # Bounded staleness (None: no bound): the most weight versions one sequence's segments may span,
    # and what a continuation that would span more does: "finish_on_old" (only on an instance within
    # the bound; restart if none is active) or "restart" (from the prompt, on the current version).
    max_staleness: int | None = None
    staleness_action: str = "finish_on_old"
    # Engines that misbehave while they stay up (sglang.client): how long the first chunk may take (None:
    # stall_timeout_s), the most bytes one frame may have (None: no bound), and the vocabulary size token
    # ids are checked against where an instance does not report its own (0: only the int32 range).
    first_byte_timeout_s: float | None = None
    max_frame_bytes: int | None = None
    vocab_size: int = 0
    # The most bytes of unfinished frames one instance's calls may hold at once (None: no bound).
    max_instance_buffer_bytes: int | None = None
    # Short non-streaming calls that start together on one instance go as one SGLang batch of at most
    # this many (sglang.coalesce; 1: one call each).
    batch_max: int = 64
    # Output lengths predicted per group (placement.lengths), observation only; off: no work per request.
    length_prediction: bool = False
    # Divided rollouts (rollout.pieces; tokens 0: off): long sequences generated in pieces, each placed again.
    pieces: PieceSettings = PieceSettings()

    @classmethod
    def from_config(cls, cfg: Config) -> GenerationSettings:
        migration = TailMigration(
            batch_half=cfg.tail_migration_batch_half, min_speedup=cfg.tail_migration_min_speedup,
            min_gain_s=cfg.tail_migration_min_gain_s, prefill_factor=cfg.tail_migration_prefill_factor,
            max_moves=cfg.tail_migration_max_moves, cooldown_s=cfg.tail_migration_cooldown_s,
            tail_share=cfg.tail_migration_tail_share, tail_slowdown=cfg.tail_migration_tail_slowdown or None,
            swap_queue=cfg.tail_migration_swap_queue)
        return cls(cfg.max_attempts_per_request, cfg.no_instance_wait_timeout_s, cfg.connect_timeout_s,
                   cfg.stream_stall_timeout_s, cfg.engine_stream_interval, migration if cfg.tail_migration else None,
                   cfg.tail_migration_interval_s, None if cfg.max_staleness < 0 else cfg.max_staleness,
                   cfg.staleness_action, first_byte_timeout_s=cfg.engine_first_byte_timeout_s,
                   pieces=PieceSettings(cfg.piece_tokens, cfg.piece_min_budget, cfg.piece_max_tokens),
                   max_frame_bytes=int(cfg.engine_max_frame_mb * 1e6), vocab_size=cfg.engine_vocab_size,
                   max_instance_buffer_bytes=int(cfg.engine_max_instance_buffer_mb * 1e6),
                   batch_max=cfg.engine_batch_max,
                   length_prediction=cfg.length_prediction or cfg.scheduler_policy == "makespan")
