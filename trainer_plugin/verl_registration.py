"""Registers ``sglang-disaggregated`` with verl; loaded by ``import verl`` through the entry point.

pyproject.toml::

    [project.entry-points."verl.plugins"]
    rollout_manager = "trainer_plugin.verl_registration"

verl 0.9.1 loads every ``verl.plugins`` entry point at the end of ``verl/__init__.py`` (in the
driver and in every Ray worker that imports verl) and logs a failure only at debug level, so
:data:`REGISTERED` and :func:`check_registered` exist to make a broken install loud.

Two registrations make a rollout name usable in verl 0.9.1 (``verl/workers/rollout/replica.py`` and
``verl/workers/rollout/base.py``):

- ``RolloutReplicaRegistry.register(name, loader)``: server side, resolved by ``LLMServerManager``;
  the loader imports :mod:`trainer_plugin.verl_rollout` only when the backend is used;
- ``_ROLLOUT_REGISTRY[(name, "async")] = "trainer_plugin.verl_rollout.ManagerServerAdapter"``:
  training-worker side (``engine_workers.py``, ``CheckpointEngineWorker``); verl imports it by
  dotted name. It is a plain dict with no register function, so the plugin writes into it.

Loading the plugin also maps the literal command-line keys to ``rollout.custom`` (see
:mod:`trainer_plugin.settings`), and arranges for the V1 trainer mode ``rollout_manager_sync``
(:mod:`trainer_plugin.verl_trainer`) to be registered the moment verl imports its V1 trainers:
importing them here would add seconds (TransferQueue and all) to every ``import verl``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable
from typing import Any

from .settings import ROLLOUT_NAME, apply_argv_aliases

log = logging.getLogger("trainer_plugin.verl")
V1_PACKAGE = "verl.trainer.ppo.v1"

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


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback`` right after module ``name`` has been executed (a one-shot post-import hook)."""

    def __init__(self, name: str, callback: Callable[[], Any]):
        self.name = name
        self.callback = callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        # (a find_spec without an import, as importlib.util.find_spec does, must leave the hook in place)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module
        callback = self.callback

        def exec_module(module: Any) -> None:
            run_module(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            try:
                callback()
            except Exception as exc:
                log.warning("rollout-manager plugin: could not register its V1 trainer mode: %s", exc)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


TRAINER_MODULE = "trainer_plugin.verl_trainer"


def _register_trainer() -> None:
    module = sys.modules.get(TRAINER_MODULE)
    if module is not None and not hasattr(module, "register"):
        return  # verl's V1 package is being loaded by that module's own import: it registers at its end
    from .verl_trainer import register as register_trainer

    register_trainer()


def register_trainer_when_loaded() -> None:
    """Register ``rollout_manager_sync`` now if verl's V1 trainers are loaded, else when they are."""
    if V1_PACKAGE in sys.modules:
        _register_trainer()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(V1_PACKAGE, _register_trainer))


register()
apply_argv_aliases()
register_trainer_when_loaded()
