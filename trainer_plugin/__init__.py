"""verl side of rollout-manager: start the manager, talk to it, stream rollouts, plug into verl.

Names are imported lazily: ``import trainer_plugin.launcher`` loads neither torch nor aiohttp, and
nothing here imports verl; :mod:`trainer_plugin.verl_registration` (the ``verl.plugins`` entry
point) and :mod:`trainer_plugin.verl_rollout` do.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ManagerClient": "client", "ManagerClientError": "client", "ManagerHTTPError": "client",
    "ManagerUnavailable": "client", "ManagerLost": "client", "ManagerRestarted": "client",
    "ManagerProcess": "launcher", "ManagerStartError": "launcher", "PortInUseError": "launcher",
    "start_manager": "launcher",
    "StepTimer": "metrics", "as_log_metrics": "metrics", "post_step_metrics": "metrics",
    "post_step_metrics_sync": "metrics",
    "ROLLOUT_NAME": "settings", "PluginSettings": "settings", "SettingsError": "settings",
    "from_rollout_config": "settings",
    "MicroBatch": "streaming", "RolloutFailed": "streaming", "RolloutStream": "streaming",
    "iterate_rollouts_sync": "streaming", "stream_rollouts": "streaming",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer_plugin' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
