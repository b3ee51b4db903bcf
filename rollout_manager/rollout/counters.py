"""The generator's counters, defined once: ``Generator.stats`` has exactly these keys, ``/metrics``
exports each as ``rollout_manager_<name>_total`` and the status page shows them under ``generation``."""

from __future__ import annotations

# generator.stats key -> (counter name without _total, help)
GENERATION_COUNTERS = {
    "sequences": ("sequences", "Sequences started (each sub-request of a batched input counts once)."),
    "tokens": ("generated_tokens", "Completion tokens of finished sequences; tokens/s is rate() of this."),
    "continuations": ("continuations", "Times a sequence continued on another instance from the tokens made so far."),
    "pieces": ("pieces", "Piece boundaries of divided rollouts: a piece made its tokens and the next one was placed "
               "again (not a failure, a continuation or a migration)."),
    "failed": ("failed_sequences",
               "Sequences that failed for the caller (attempts exhausted or no instance: 502/503)."),
    "preempted": ("preempted_sequences", "Sequences moved off a local instance when the local window closed."),
    "migrated": ("migrated_sequences", "Segments tail migration moved to an instance where they finish sooner."),
    "evicted": ("evicted_sequences", "Segments moved off an instance that had to be idle for a weight push "
                "(still running after drain_timeout_s)."),
    "cut_back_tokens": ("cut_back_tokens", "Tokens thrown away from running sequences because the instance that "
                        "made them was quarantined after its last passing trust probe (remade elsewhere)."),
    "affinity_hits": ("affinity_hits", "Sequences placed on the instance that holds their trajectory's or prompt's "
                      "prefix."),
    "affinity_misses": ("affinity_misses", "Sequences with no remembered instance (a new trajectory or prompt)."),
    "affinity_fallbacks": ("affinity_fallbacks", "Sequences whose remembered instance could not take them "
                           "(by reason: rollout_manager_affinity_fallbacks_by_reason_total)."),
    "stale_restarts": ("stale_restarts", "Sequences restarted from their prompt because continuing them would "
                       "exceed max_staleness."),
}


def new_generation_stats() -> dict[str, int]:
    """Every counter at zero (``Generator.stats``)."""
    return dict.fromkeys(GENERATION_COUNTERS, 0)
