"""An OpenAI-compatible front (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``) over the
manager's own rollout path, with a token ledger per session (docs/agents.md)."""
