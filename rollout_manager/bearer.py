"""The shared-token check, one place for the manager and the weight agents."""

from __future__ import annotations

import hmac

TOKEN_ENV = "ROLLOUT_MANAGER_AUTH_TOKEN"


def bearer_value(authorization: str) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None for another scheme."""
    scheme, _, value = authorization.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


def bearer_matches(authorization: str, token: str) -> bool:
    """True when an ``Authorization`` header carries ``Bearer <token>`` (compared in constant time).

    Header bytes that are not UTF-8 (aiohttp keeps them as surrogate escapes) are compared as the
    bytes they were, so such a header is a wrong token, not an encoding error.
    """
    value = bearer_value(authorization)
    return value is not None and same_secret(value, token)


def same_secret(given: str, secret: str) -> bool:
    """``given`` (from a header) is ``secret``, compared in constant time; undecodable bytes are a mismatch."""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), secret.encode("utf-8", "surrogateescape"))
