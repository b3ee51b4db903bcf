"""rollout-manager: an async disaggregated rollout manager for RL training with SGLang instances."""

__version__ = "0.1.0"
