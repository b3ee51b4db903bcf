"""The manager as Ray actors, from the plugin's settings (``custom.rollout_manager.ray_relays`` > 0).

Where verl launches the replicas (its TaskRunner), :func:`ensure` starts the control actor and the relay actors
(``rollout_manager.launch.ray_relays``; a second replica gets the same actors by name) with the manager's
configuration (``config_path``, ``overrides``), and stops them when that process exits. Every other process
finds the relays through Ray by the actors' names (:func:`find`), as the manager's own relays find the control
actor: nothing is published that a restarted actor would make stale.
"""

from __future__ import annotations

import atexit
import logging
from typing import Any

from rollout_manager.config import load_config, parse_set_option

from .settings import PluginSettings

log = logging.getLogger("trainer_plugin.relay_actors")

_STARTED: list[Any] = []


def ensure(settings: PluginSettings) -> list[str]:
    """Start (or find) the manager's actors; returns the relays' URLs."""
    from rollout_manager.launch import ray_relays

    m = settings.manager
    config = load_config(m.config_path, overrides=dict(parse_set_option(item) for item in m.overrides))
    started = ray_relays.start(config, m.ray_relays)
    if not _STARTED:
        atexit.register(stop_all)
    _STARTED.append(started)
    urls = started.urls()
    log.info("rollout manager as Ray actors: a control actor and %d relay(s) at %s", m.ray_relays, ", ".join(urls))
    return urls


def find() -> list[str]:
    """The URLs of the relays that answer now (a blocking Ray call)."""
    from rollout_manager.launch import ray_relays

    return ray_relays.relay_urls()


def stop_all() -> None:
    """Stop the actors this process started (they are detached: they would outlive it)."""
    while _STARTED:
        try:
            _STARTED.pop().stop()
        except Exception as exc:  # the cluster may be going away already
            log.warning("stopping the manager's actors: %s", exc)
