"""Errors the core raises; the HTTP layer maps each to a status code and a JSON ``{"error": ...}``."""

from __future__ import annotations

INTERNAL_ERROR = "internal error; see the manager's log"  # the 500 answer's message on every path


class ManagerError(Exception):
    """Base: a request the manager refuses, with a message for the caller.

    ``reason`` is a short fixed word for the refusal, the label of its counter in ``/metrics``.
    """

    status = 400
    reason = "bad_request"


class BadRequest(ManagerError):
    status = 400


class InvalidJSON(ManagerError):
    """The body is empty or not JSON."""

    status = 400
    reason = "invalid_json"


class InvalidField(ManagerError):
    """The body is JSON but a field is missing, of the wrong type or out of range."""

    status = 400
    reason = "invalid_field"


class Forbidden(ManagerError):
    status = 403
    reason = "forbidden"


class Unauthorized(ManagerError):
    status = 401
    reason = "unauthorized"


class TooLarge(ManagerError):
    status = 413
    reason = "too_large"


class NotFound(ManagerError):
    status = 404
    reason = "not_found"


class Conflict(ManagerError):
    status = 409
    reason = "conflict"


class Unavailable(ManagerError):
    status = 503
    reason = "unavailable"
