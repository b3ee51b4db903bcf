"""OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}`` with the matching status.

The OpenAI SDK raises its typed exceptions (``BadRequestError``, ``NotFoundError``, ...) from the status and
reads ``param`` and ``code`` from this object, so a caller's agent can tell which field was wrong.
"""

from __future__ import annotations

from typing import Any

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error"}


class OpenAIError(Exception):
    """A refusal or failure to answer in OpenAI's shape; ``param`` names the field at fault (None: none)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def to_json(self) -> dict[str, Any]:
        kind = _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str, code: str | None = "invalid_value") -> OpenAIError:
    """A 400 naming ``param``."""
    return OpenAIError(400, message, param, code)
