"""What the trainer's manager client raises, and what it counts while it survives manager outages.

Apart from :mod:`trainer_plugin.client` so that the batch stream (:mod:`trainer_plugin.batch_stream`),
which raises and counts them too, needs nothing of the client's module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollout_manager.manager_client import ManagerAPIError


class ManagerClientError(ManagerAPIError, RuntimeError):
    """Base class of everything this client raises (the manager API's one error type,
    :class:`rollout_manager.manager_client.ManagerAPIError`)."""


class ManagerUnavailable(ManagerClientError):
    """The manager could not be reached (after the retries), or the connection broke mid-call."""


class ManagerRestarted(ManagerUnavailable):
    """The manager that ran a stream is gone: another run of it answers at the same URL."""

    def __init__(self, message: str, old_run_id: str | None, new_run_id: str | None):
        super().__init__(message)
        self.old_run_id = old_run_id
        self.new_run_id = new_run_id


class ManagerLost(ManagerUnavailable):
    """The manager did not come back in time: ``unfinished`` are the ids of the batch never answered."""

    def __init__(self, message: str, unfinished: list[Any], delivered: int):
        super().__init__(message)
        self.unfinished = unfinished
        self.delivered = delivered


class ManagerHTTPError(ManagerClientError):
    """The manager answered with an error status; ``message`` is its ``{"error": ...}`` text."""

    status: int

    def __init__(self, method: str, path: str, status: int, message: str, body: Any = None):
        super().__init__(f"{method} {path} -> HTTP {status}: {message}", status=status, message=message, body=body)
        self.method = method
        self.path = path


@dataclass
class ClientStats:
    """What the client did to survive manager outages (cumulative over its batches)."""

    interruptions: int = 0  # batch streams lost: broken, ended early, restarted or shut-down manager
    resubmitted: int = 0  # requests sent again after an interruption
    stalls: int = 0  # silent streams during which /health did not answer either
    restarts_seen: int = 0  # a different run_id answered than the one that ran the stream
    duplicates_dropped: int = 0  # lines for ids already delivered
    outage_s: float = 0.0  # time spent waiting for the manager to come back
