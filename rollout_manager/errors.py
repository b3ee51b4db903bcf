"""Errors the core raises; the HTTP layer maps each to a status code and a JSON ``{"error": ...}``."""

from __future__ import annotations


class ManagerError(Exception):
    """Base: a request the manager refuses, with a message for the caller."""

    status = 400


class BadRequest(ManagerError):
    status = 400


class Forbidden(ManagerError):
    status = 403


class Unauthorized(ManagerError):
    status = 401


class TooLarge(ManagerError):
    status = 413


class NotFound(ManagerError):
    status = 404


class Conflict(ManagerError):
    status = 409


class Unavailable(ManagerError):
    status = 503
