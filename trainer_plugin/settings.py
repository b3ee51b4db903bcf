"""The plugin's settings, read from verl's ``actor_rollout_ref.rollout`` config, and the key mapping.

verl 0.9.1's ``RolloutConfig`` is a dataclass and Hydra runs in struct mode, so a new key such as
``actor_rollout_ref.rollout.rollout_manager.port`` is refused (by Hydra on the command line, and by
the dataclass when it is instantiated). The config's own extension point is ``rollout.custom`` (a
free dict), so the plugin's keys live there:

``actor_rollout_ref.rollout.`` + the key as the issue / seed guide writes it -> where it lives on verl 0.9.1:

- ``rollout_manager.port`` -> ``custom.rollout_manager.port``
- ``rollout_manager.config_path`` -> ``custom.rollout_manager.config_path``
- ``rollout_manager.<key>`` -> ``custom.rollout_manager.<key>``
- ``min_stream_batch_size`` -> ``custom.min_stream_batch_size``

On the command line the ``custom`` form needs a leading ``+`` with verl's own ``ppo_trainer`` config
(``custom`` is absent from its YAML) and none with the shipped config
``trainer_plugin/config/sglang_disaggregated_trainer.yaml``, which declares it. The literal
left-hand form is also accepted on the command line: when verl is imported, the plugin rewrites
such arguments of ``sys.argv`` to the right-hand form (``++`` form, which works with both configs) and
says so on stderr (:func:`rewrite_argv`; ``ROLLOUT_MANAGER_VERL_ARGV_ALIASES=0`` turns that off, and
then the literal form fails with Hydra's "Key 'rollout_manager' is not in struct").
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

ROLLOUT_NAME = "sglang-disaggregated"
NODE_IP_HOST = "node_ip"  # rollout_manager.host: the node's Ray address (not a valid host name: no "_")
PREFIX = "actor_rollout_ref.rollout."
_ALIAS = re.compile(r"^(?P<plus>\+{0,2})actor_rollout_ref\.rollout\."
                    r"(?P<key>rollout_manager\.[A-Za-z0-9_.]+|min_stream_batch_size)=(?P<value>.*)$", re.S)


class SettingsError(ValueError):
    """A plugin setting is missing or invalid; the message names the full config key."""


def rewrite_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Map the literal keys to ``rollout.custom`` (see the module doc). Returns (argv, notes)."""
    out, notes = [], []
    for arg in argv:
        m = _ALIAS.match(arg)
        if m is None:
            out.append(arg)
            continue
        new = f"++{PREFIX}custom.{m.group('key')}={m.group('value')}"
        out.append(new)
        notes.append(f"{arg.split('=', 1)[0]} -> {new.split('=', 1)[0]}")
    return out, notes


def apply_argv_aliases() -> None:
    """Rewrite ``sys.argv`` in place (called when verl loads the plugin)."""
    if os.environ.get("ROLLOUT_MANAGER_VERL_ARGV_ALIASES", "1").lower() in ("0", "false", "no", "off"):
        return
    new, notes = rewrite_argv(sys.argv)
    if notes:
        sys.argv[:] = new
        print("rollout-manager plugin: verl 0.9.1 keeps extra rollout keys under rollout.custom; mapped "
              + "; ".join(notes), file=sys.stderr)


@dataclass(frozen=True)
class ManagerSettings:
    """``rollout.custom.rollout_manager``: how the trainer starts or finds the manager."""

    port: int = 5000
    config_path: str | None = None
    # Where the manager listens. 0.0.0.0: rollout boxes on other hosts register with it; "node_ip":
    # only the address Ray knows the launching node by (the address published for the training ranks)
    host: str = "0.0.0.0"
    # The host every trainer process reaches it at; empty: in Ray, the URL the replica launch published
    # (trainer_plugin.manager_address); outside Ray, host (127.0.0.1 for a wildcard host)
    address: str = ""
    # start it where verl launches the replicas, its TaskRunner (or attach to one already listening);
    # false: use one started elsewhere
    launch: bool = True
    attach_existing: bool = True
    startup_timeout_s: float = 60.0
    log_path: str | None = None
    # extra "KEY=VALUE" overrides passed as --set to the manager
    overrides: tuple[str, ...] = ()
    # dotted path "module:function" called with the weights after each update (the weight push hook)
    weight_push: str = "trainer_plugin.weight_push:push_to_rollout_manager"
    # each trainer node's interfaces for weight traffic (then filtered by the manager's
    # allowed_sender_ips): IPs as given, or CIDRs that pick each node's own addresses inside them;
    # empty: the address Ray knows the node by (outside Ray: the node's route to the manager)
    sender_ips: tuple[str, ...] = ()
    # after a push: wait until "all" remote instances serve the new version, a number of them, or "none"
    weight_push_wait: str = "all"
    # what the wait waits for: "staged" (the instances hold the version verified; with the manager's
    # weight_activation = "staged" they then activate it with a short pause, so the trainer does not wait
    # for their generation or loads) or "serving" (they serve it)
    weight_push_wait_until: str = "staged"
    weight_push_timeout_s: float = 600.0
    request_timeout_s: float = 30.0
    # verl's per-sample generate calls arriving within this window go out as one batch request
    # (0: one /generate per call); at most batch_max_requests per batch
    batch_window_ms: float = 5.0
    batch_max_requests: int = 1024
    # a generation stream silent this long makes the client probe the manager's /health: a different
    # run_id means it restarted (resubmit), no answer is reported as a stall (0: never probe)
    stall_timeout_s: float = 10.0
    # how long a step waits for a restarted, unreachable or frozen manager before it fails naming the
    # unfinished requests; 0: fail at once, no resubmission
    restart_timeout_s: float = 120.0
    # samples are made by weights at most this many versions behind the one the trainer published (verl's
    # global_steps): each request asks the manager for min_weight_version = published - max_staleness
    # (-1: no bound, samples may come from any version)
    max_staleness: int = -1
    # run the manager as Ray actors: a control actor and this many relay actors (rollout_manager.launch.ray_relays,
    # placed on the CPU-only nodes when the cluster has any); the plugin finds the relays through Ray and spreads
    # its batches over them (trainer_plugin.relay_spread). 0: one manager process on the launching node
    ray_relays: int = 0

    def client_options(self) -> dict[str, Any]:
        """Keyword arguments of :class:`trainer_plugin.client.ManagerClient` from these settings."""
        return {"timeout_s": self.request_timeout_s, "stall_timeout_s": self.stall_timeout_s,
                "restart_timeout_s": self.restart_timeout_s}


@dataclass(frozen=True)
class PluginSettings:
    manager: ManagerSettings
    min_stream_batch_size: int = 1
    # what a finally failed request does to the step: "raise" (default) or "drop_group"
    on_failure: str = "raise"
    # how often verl V1's replay buffer looks for finished groups (verl's own default: 2 s, which the
    # trainer can spend idle after the last group of a micro-batch is done)
    replay_poll_interval_s: float = 0.2

    @property
    def manager_url(self) -> str:
        host = self.manager.address or _reach_host(self.manager.host)
        return f"http://{host}:{self.manager.port}"


def _reach_host(bind_host: str) -> str:
    if bind_host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1" if bind_host != "::1" else "[::1]"
    if bind_host not in ("0.0.0.0", "::", "", NODE_IP_HOST):
        return bind_host
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:
        pass
    return "127.0.0.1"


def _get(config: Any, key: str, default: Any = None) -> Any:
    if config is None:
        return default
    if isinstance(config, Mapping):
        return config.get(key, default)
    getter = getattr(config, "get", None)
    if callable(getter):  # DictConfig and verl's BaseConfig
        try:
            return getter(key, default)
        except Exception:
            pass
    return getattr(config, key, default)


def _to_plain(value: Any) -> Any:
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:
        pass
    return value


def from_rollout_config(rollout: Any) -> PluginSettings:
    """Read the settings from ``actor_rollout_ref.rollout`` (DictConfig, RolloutConfig or dict).

    Refuses the literal keys that verl cannot hold with a message giving the ``custom`` form.
    """
    for literal in ("rollout_manager", "min_stream_batch_size"):
        if _get(rollout, literal) is not None:
            raise SettingsError(
                f"{PREFIX}{literal} is not a verl 0.9.1 rollout key; write it as {PREFIX}custom.{literal}")
    custom = _to_plain(_get(rollout, "custom")) or {}
    if not isinstance(custom, Mapping):
        raise SettingsError(f"{PREFIX}custom must be a mapping, got {type(custom).__name__}")
    raw = _to_plain(custom.get("rollout_manager")) or {}
    if not isinstance(raw, Mapping):
        raise SettingsError(f"{PREFIX}custom.rollout_manager must be a mapping, got {raw!r}")
    known = {f.name: f for f in fields(ManagerSettings)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            raise SettingsError(f"unknown key {PREFIX}custom.rollout_manager.{key}; known: {', '.join(sorted(known))}")
        default = ManagerSettings.__dataclass_fields__[key].default
        values[key] = _coerce(f"{PREFIX}custom.rollout_manager.{key}", value, default)
    port = values.get("port", 5000)
    if not 1 <= int(port) <= 65535:
        raise SettingsError(f"{PREFIX}custom.rollout_manager.port={port} is out of range 1-65535")
    if values.get("config_path") and not os.path.isfile(values["config_path"]):
        raise SettingsError(f"{PREFIX}custom.rollout_manager.config_path={values['config_path']}: no such file")
    if values.get("batch_window_ms", 0.0) < 0 or values.get("batch_max_requests", 1) < 1:
        raise SettingsError(f"{PREFIX}custom.rollout_manager.batch_window_ms must be >= 0 and batch_max_requests "
                            f">= 1, got {values.get('batch_window_ms')}, {values.get('batch_max_requests')}")
    if not 0 <= values.get("ray_relays", 0) <= 64:
        raise SettingsError(f"{PREFIX}custom.rollout_manager.ray_relays must be in 0-64 (0: one manager process), "
                            f"got {values['ray_relays']}")
    if values.get("max_staleness", -1) < -1:
        raise SettingsError(f"{PREFIX}custom.rollout_manager.max_staleness must be >= -1 (-1: no bound), "
                            f"got {values['max_staleness']}")
    for key in ("stall_timeout_s", "restart_timeout_s"):
        if values.get(key, 0.0) < 0:
            raise SettingsError(f"{PREFIX}custom.rollout_manager.{key} must be >= 0, got {values[key]}")
    msbs = _coerce(f"{PREFIX}custom.min_stream_batch_size", custom.get("min_stream_batch_size", 1), 1)
    if msbs < 1:
        raise SettingsError(f"{PREFIX}custom.min_stream_batch_size must be >= 1, got {msbs}")
    if values.get("weight_push_wait_until", "staged") not in ("staged", "serving"):
        raise SettingsError(f"{PREFIX}custom.rollout_manager.weight_push_wait_until must be 'staged' or 'serving', "
                            f"got {values['weight_push_wait_until']!r}")
    on_failure = custom.get("on_failure", "raise")
    if on_failure not in ("raise", "drop_group"):
        raise SettingsError(f"{PREFIX}custom.on_failure must be 'raise' or 'drop_group', got {on_failure!r}")
    poll = _coerce(f"{PREFIX}custom.replay_poll_interval_s", custom.get("replay_poll_interval_s", 0.2), 0.2)
    if not poll > 0:
        raise SettingsError(f"{PREFIX}custom.replay_poll_interval_s must be > 0, got {poll}")
    return PluginSettings(ManagerSettings(**values), min_stream_batch_size=msbs, on_failure=on_failure,
                          replay_poll_interval_s=poll)


def _coerce(key: str, value: Any, default: Any) -> Any:
    if value is None:
        return None
    try:
        if isinstance(default, bool):
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
        if isinstance(default, tuple):
            return tuple(str(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
        return str(value)
    except (TypeError, ValueError):
        raise SettingsError(f"{key}={value!r} is not a valid {type(default).__name__}") from None
