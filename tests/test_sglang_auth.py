"""SGLang's API keys as the manager and the receiver agent send them (rollout_manager/sglang/auth.py): read
from the environment, the admin key falling back to the API key as SGLang itself does, never shown."""

from __future__ import annotations

from rollout_manager.sglang.auth import SGLangAuth


def test_the_keys_come_from_the_environment_and_stay_out_of_the_repr() -> None:
    auth = SGLangAuth.from_env({"ROLLOUT_SGLANG_API_KEY": "k-1", "ROLLOUT_SGLANG_ADMIN_API_KEY": "k-2"})
    assert auth.headers() == {"Authorization": "Bearer k-1"} and auth.admin_headers() == {"Authorization": "Bearer k-2"}
    assert SGLangAuth(api_key="k-1").admin_headers() == {"Authorization": "Bearer k-1"}  # SGLang's own fallback
    assert "k-1" not in repr(auth) and "k-2" not in repr(auth)
