"""SGLang's own API keys (``--api-key``, ``--admin-api-key``), as the product sends them.

SGLang 0.5.23 (``sglang/srt/utils/auth.py``) sorts its endpoints in three levels:

- ``/health*``, ``/metrics``: always open.
- normal (``/generate``, ``/server_info``, ``/model_info``, ...): need ``--api-key`` when one is set.
- admin-optional (``/abort_request``, ``/pause_generation``, ``/flush_cache``, ``/update_weights_from_tensor``,
  ``/begin_weight_update``, ``/update_weight_version``, ``/get_weights_by_name``, ...): need
  ``--admin-api-key`` when one is set, else ``--api-key`` when that is set, else nothing.

A wrong or missing key gets 401 (``{"error": "Unauthorized"}``). The keys travel to the receiver agent in
its environment (never on a command line it controls): :data:`API_KEY_ENV` and :data:`ADMIN_API_KEY_ENV`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

API_KEY_ENV = "ROLLOUT_SGLANG_API_KEY"
ADMIN_API_KEY_ENV = "ROLLOUT_SGLANG_ADMIN_API_KEY"


@dataclass(frozen=True)
class SGLangAuth:
    """The keys one SGLang server was started with ("" for none)."""

    api_key: str = ""
    admin_api_key: str = ""

    def __repr__(self) -> str:  # never print a key
        return f"SGLangAuth(api_key={'set' if self.api_key else 'none'}, " \
               f"admin_api_key={'set' if self.admin_api_key else 'none'})"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SGLangAuth:
        env = os.environ if environ is None else environ
        return cls(env.get(API_KEY_ENV, ""), env.get(ADMIN_API_KEY_ENV, ""))

    @property
    def admin_key(self) -> str:
        """The key an admin-optional endpoint takes: the admin key, else the API key, else none."""
        return self.admin_api_key or self.api_key

    def headers(self) -> dict[str, str]:
        """For normal endpoints (``/generate``, ``/server_info``, ``/model_info``)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def admin_headers(self) -> dict[str, str]:
        """For admin-optional endpoints (abort, pause, flush, every weight endpoint)."""
        key = self.admin_key
        return {"Authorization": f"Bearer {key}"} if key else {}
