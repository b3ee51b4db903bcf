"""The shared-token check, one place for the manager and the weight agents."""

from __future__ import annotations

import hmac

TOKEN_ENV = "ROLLOUT_MANAGER_AUTH_TOKEN"


def bearer_matches(authorization: str, token: str) -> bool:
    """True when an ``Authorization`` header carries ``Bearer <token>`` (compared in constant time)."""
    scheme, _, value = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())
