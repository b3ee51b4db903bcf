"""The receiver agent's refusals, with the HTTP status that says whose fault they are.

Runs in: box.
"""

from __future__ import annotations


class CommitRefused(Exception):
    """A prepare, commit, serve or activate the receiver agent refuses (``status``: its HTTP answer)."""

    def __init__(self, status: int, message: str, bad_shards: list[int] | None = None):
        super().__init__(message)
        self.status = status
        self.bad_shards = bad_shards
