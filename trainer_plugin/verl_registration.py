"""Registers ``sglang-disaggregated`` with verl; loaded by ``import verl`` through the entry point.

pyproject.toml::

    [project.entry-points."verl.plugins"]
    rollout_manager = "trainer_plugin.verl_registration"

verl 0.9.1 loads every ``verl.plugins`` entry point at the end of ``verl/__init__.py`` (in the
driver and in every Ray worker that imports verl) and logs a failure only at debug level, so
:data:`REGISTERED` and :func:`check_registered` exist to make a broken install loud.

Two registrations make a rollout name usable (DESIGN.md section 9):

- ``RolloutReplicaRegistry.register(name, loader)``: server side, resolved by ``LLMServerManager``;
  the loader imports :mod:`trainer_plugin.verl_rollout` only when the backend is used;
- ``_ROLLOUT_REGISTRY[(name, "async")] = "trainer_plugin.verl_rollout.ManagerServerAdapter"``:
  training-worker side (``engine_workers.py``, ``CheckpointEngineWorker``); verl imports it by
  dotted name. It is a plain dict with no register function, so the plugin writes into it.

Loading the plugin also maps the literal command-line keys to ``rollout.custom`` (see
:mod:`trainer_plugin.settings`).
"""

from __future__ import annotations

from .settings import ROLLOUT_NAME, apply_argv_aliases

ADAPTER = "trainer_plugin.verl_rollout.ManagerServerAdapter"
REGISTERED = False


def _load_replica() -> type:
    from .verl_rollout import DisaggregatedReplica

    return DisaggregatedReplica


def register() -> None:
    """Idempotent; safe to call by hand when verl's plugin loading is disabled
    (``VERL_USE_EXTERNAL_PLUGINS=none``)."""
    global REGISTERED
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)
    _ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = ADAPTER
    REGISTERED = True


def check_registered() -> None:
    """Raise with a useful message if ``import verl`` did not load this plugin."""
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    if ROLLOUT_NAME not in RolloutReplicaRegistry._registry or (ROLLOUT_NAME, "async") not in _ROLLOUT_REGISTRY:
        raise RuntimeError(
            f"rollout backend {ROLLOUT_NAME!r} is not registered with verl: is rollout-manager installed "
            "(its 'verl.plugins' entry point), and is VERL_USE_EXTERNAL_PLUGINS unset or listing "
            "'rollout_manager'? Run with VERL_LOGGING_LEVEL=DEBUG to see verl's plugin load errors.")


register()
apply_argv_aliases()
