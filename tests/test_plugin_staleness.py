"""The plugin bounds staleness through the manager: ``max_staleness`` -> ``min_weight_version`` on every
request, from the version the trainer published (verl's ``global_steps``)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from trainer_plugin.proxy import build_generate_body, weight_floor
from trainer_plugin.settings import SettingsError, from_rollout_config


def test_the_floor_is_the_published_version_less_max_staleness() -> None:
    assert weight_floor(None, 1) is None  # nothing published yet
    assert weight_floor(5, -1) is None  # no bound
    assert weight_floor(5, 0) == 5 and weight_floor(5, 2) == 3 and weight_floor(1, 4) == 0
    body = build_generate_body([1, 2], {}, "r", prompt_length=8, response_length=4, min_weight_version=3)
    assert body["min_weight_version"] == 3
    assert "min_weight_version" not in build_generate_body([1, 2], {}, "r", prompt_length=8, response_length=4)


def test_the_setting() -> None:
    def settings(**manager: Any) -> Any:
        return from_rollout_config({"custom": {"rollout_manager": manager}})

    assert settings().manager.max_staleness == -1
    assert settings(max_staleness="2").manager.max_staleness == 2
    with pytest.raises(SettingsError, match="max_staleness"):
        settings(max_staleness=-2)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl 0.9.1 is not installed")
async def test_the_proxy_asks_for_the_floor(start_manager: Any, start_engines: Any) -> None:
    from trainer_plugin.client import ManagerHTTPError
    from trainer_plugin.proxy import ManagerProxyServer

    m = await start_manager(no_instance_wait_timeout_s=1)
    (engine,) = await start_engines([])
    await m.register(engine)  # serves version 0
    params = {"temperature": 0.0}
    lenient = ManagerProxyServer(m.url, prompt_length=8, response_length=3, batch_window_s=0, max_staleness=1)
    strict = ManagerProxyServer(m.url, prompt_length=8, response_length=3, batch_window_s=0, max_staleness=0)
    try:
        for server in (lenient, strict):
            await server.set_global_steps(1)  # the trainer published version 1; the instance has not got it
        out = await lenient.generate([5, 6, 7], params, "a")  # version 0 is one behind: allowed
        assert len(out.token_ids) == 3
        with pytest.raises(ManagerHTTPError, match="min_weight_version=1"):
            await strict.generate([5, 6, 7], params, "b")
    finally:
        await lenient.close()
        await strict.close()
