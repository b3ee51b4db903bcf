"""The daemon's configuration: one validated object built from defaults, file, environment, command line.

Precedence is command line > environment (``ROLLOUT_MANAGER_<KEY>``) > file > defaults. Each layer is
validated on its own so an error names the key, the value and where it came from; everything is
refused before the daemon binds a port.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]

ENV_PREFIX = "ROLLOUT_MANAGER_"
# Variables with our prefix that belong to the rollout-box side (launch_sglang.sh), not to the daemon.
ENV_NOT_CONFIG = frozenset({"ROLLOUT_MANAGER_ADDR", "ROLLOUT_MANAGER_ADDRESS", "ROLLOUT_MANAGER_ENGINE",
                            "ROLLOUT_MANAGER_VERL_ARGV_ALIASES"})
SECRET_KEYS = frozenset({"auth_token", "sglang_api_key", "sglang_admin_api_key", "relay_secret"})  # never logged
DEFAULT_PORT = 5000

Port = Field(ge=1, le=65535)


class ConfigError(ValueError):
    """A configuration the daemon refuses to start with; the message is one line for the user."""


def parse_networks(value: str | list[str]) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """``"10.0.0.0/8, 192.168.1.7"`` -> networks; an exact IP is a /32 (or /128)."""
    items = value.split(",") if isinstance(value, str) else list(value)
    nets = []
    for item in items:
        item = item.strip()
        if not item:
            continue
        try:
            nets.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(f"{item!r} is not an IP address or CIDR network") from None
    if not nets:
        raise ValueError("needs at least one IP address or CIDR network")
    return nets


def parse_bind(value: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> (host, port); IPv6 hosts in brackets. Port 0: the OS picks a free one (scripts
    and tests read the port actually bound from the daemon's log line)."""
    host, sep, port_s = value.rpartition(":")
    if not sep or not host:
        raise ValueError("must be HOST:PORT, e.g. 0.0.0.0:5000")
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"port {port_s!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is out of range 0-65535 (0: any free port)")
    return host.strip("[]"), port


class Config(BaseModel):
    """Every key the daemon reads. ``config.toml`` documents each one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bind: str = f"0.0.0.0:{DEFAULT_PORT}"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"
    gc_young_threshold: int = Field(default=10000, ge=0)  # see osutil.tune_gc; 0: Python's own collector settings
    relays: int = Field(default=0, ge=0, le=64)  # 0: one process; N: a control process and N relays (docs/relays.md)
    relay_report_s: float = Field(default=0.5, gt=0, le=10)  # how often a relay reports to its control process
    relay_checkpoint_tokens: int = Field(default=256, ge=0)  # a relay's crash re-makes at most this many a sequence
    # shared by a control process and its relays when they talk over the network (under Ray, launch.ray_relays):
    # set, the control process takes /relay/* and a forwarded caller address only with it; empty: only from loopback
    relay_secret: str = ""

    # Weight transfer (names as users of the seed project already write them).
    mooncake_transfer_device_name: str = ""
    mooncake_transfer_protocol: Literal["tcp", "rdma"] = "tcp"
    allowed_sender_ips: str = "0.0.0.0/0"
    num_mooncake_groups_per_sender: int = Field(default=1, gt=0)
    num_mooncake_engines_per_group: int = Field(default=4, gt=0)
    weight_sender_base_port: int = Field(default=17000, ge=1, le=65535)
    weight_transport: Literal["mooncake", "tcp"] = "mooncake"
    weight_push_max_attempts: int = Field(default=3, gt=0)
    weight_push_timeout_s: float = Field(default=600.0, gt=0)
    weight_push_retry_s: float = Field(default=2.0, gt=0)
    weight_push_mode: Literal["auto", "full", "delta"] = "auto"
    weight_delta_below_gbps: float = Field(default=0.4, gt=0)
    peer_bootstrap: bool = True
    peer_bootstrap_timeout_s: float = Field(default=120.0, gt=0)  # each peer's part; the sender's has the above
    # "staged": boxes keep serving while a version is pushed and verified, then pause briefly to load it;
    # "drain": a box stops taking work, drains, then receives and loads (strictly on-policy rollouts).
    weight_activation: Literal["staged", "drain"] = "staged"
    weight_activation_pause_mode: Literal["retract", "in_place"] = "retract"  # SGLang's pause mode to load in

    # Instance health.
    startup_grace_period_s: float = Field(default=1800.0, gt=0)
    pending_poll_interval_s: float = Field(default=2.0, gt=0)
    health_check_interval_s: float = Field(default=10.0, gt=0)
    health_check_timeout_s: float = Field(default=30.0, gt=0)
    health_failure_threshold: int = Field(default=3, gt=0)
    health_check_path: Literal["/health_generate", "/health"] = "/health_generate"
    trust_probe_interval_s: float = Field(default=60.0, ge=0)  # 0: probe only after each activation
    trust_probe_timeout_s: float = Field(default=30.0, gt=0)
    trust_probe_tolerance: float = Field(default=0.0, ge=0)  # 0: by each box's dtype, quantization and TP size
    drain_timeout_s: float = Field(default=120.0, gt=0)
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    # Evacuation of a box with a preemption notice (rollout.evacuation).
    evacuation_stay_share: float = Field(default=0.5, ge=0, le=1)
    evacuation_margin_s: float = Field(default=3.0, ge=0)
    evacuation_tick_s: float = Field(default=0.5, gt=0, le=10)
    # Sequences predicted at least this long go to non-preemptible boxes when one has room (placement.preemptible).
    preemptible_long_tokens: int = Field(default=1024, ge=0)

    # Generation.
    scheduler_policy: Literal["throughput_aware", "least_in_flight", "round_robin", "makespan"] = "makespan"
    placement_gather_s: float = Field(default=0.0, ge=0, le=5)
    max_attempts_per_request: int = Field(default=8, gt=0)
    no_instance_wait_timeout_s: float = Field(default=600.0, gt=0)
    max_in_flight_per_instance: int = Field(default=0, ge=0)  # 0: each instance's max_running_requests (else 1024)
    max_in_flight_total: int = Field(default=0, ge=0)  # 0: what the open-file limit leaves (placement.capacity)
    stream_stall_timeout_s: float = Field(default=300.0, gt=0)
    engine_first_byte_timeout_s: float = Field(default=60.0, gt=0)  # first chunk, unless the instance serves others
    engine_max_frame_mb: float = Field(default=16.0, gt=0)  # one SSE frame (or non-streaming answer) from an engine
    engine_max_instance_buffer_mb: float = Field(default=128.0, gt=0)  # unfinished frames of one instance's calls
    engine_vocab_size: int = Field(default=0, ge=0)  # token ids must be below it (0: as the instance says, else 2**31)
    connect_timeout_s: float = Field(default=10.0, gt=0)
    engine_stream_interval: int = Field(default=64, ge=0)  # 0: send none, the server's --stream-interval holds
    engine_batch_max: int = Field(default=64, ge=1)  # short calls joined into one engine batch at most (1: never)
    # Tail migration (placement.tail_migration; config.toml says what each one means).
    tail_migration: bool = True
    length_prediction: bool = False  # placement.lengths: observe and predict output lengths per group
    # What the scheduler learned, kept across restarts (placement.scheduler_state): the file ("": not kept), written
    # this often.
    scheduler_state_file: str = ""
    scheduler_state_save_s: float = Field(default=60.0, gt=0)
    # The scaling signal (placement.fleet_signal): boxes of each kind the rest of the step needs to end this soon.
    scale_target_step_s: float = Field(default=300.0, gt=0)
    # Divided rollouts (rollout.pieces): the smallest piece (0: off), the smallest budget divided, the largest piece.
    piece_tokens: int = Field(default=0, ge=0)
    piece_min_budget: int = Field(default=1024, ge=1)
    piece_max_tokens: int = Field(default=4096, ge=1)
    tail_migration_interval_s: float = Field(default=1.0, gt=0)
    tail_migration_min_speedup: float = Field(default=1.25, ge=1)
    tail_migration_min_gain_s: float = Field(default=1.0, ge=0)
    tail_migration_max_moves: int = Field(default=3, gt=0)
    tail_migration_cooldown_s: float = Field(default=5.0, ge=0)
    tail_migration_batch_half: float = Field(default=64.0, gt=0)
    tail_migration_prefill_factor: float = Field(default=200.0, gt=0)
    tail_migration_tail_share: float = Field(default=1.0, ge=0)
    tail_migration_tail_slowdown: float = Field(default=1.3, ge=0)  # 0: off, else at least 1
    tail_migration_swap_queue: int = Field(default=1, ge=0)
    # Affinity (placement.affinity) and bounded staleness (rollout.generation); config.toml explains them.
    affinity: bool = True
    affinity_max_slowdown: float = Field(default=2.0, ge=1)
    affinity_block_tokens: int = Field(default=64, gt=0)
    affinity_capacity: int = Field(default=65536, gt=0)
    max_staleness: int = Field(default=-1, ge=-1)  # -1: no bound
    staleness_action: Literal["finish_on_old", "restart"] = "finish_on_old"

    # Local (trainer-side) instances.
    local_budget_initial_s: float = Field(default=60.0, ge=0)
    local_budget_min_s: float = Field(default=0.0, ge=0)
    local_budget_max_s: float = Field(default=600.0, gt=0)
    local_budget_gain: float = Field(default=0.5, gt=0, le=1)

    # Trust: the trainer's log-prob mismatch per box (instances.mismatch; config.toml explains them).
    mismatch_ewma_alpha: float = Field(default=0.3, gt=0, le=1)
    mismatch_outlier_multiple: float = Field(default=3.0, gt=1)
    mismatch_floor: float = Field(default=0.05, ge=0)
    # Quarantine: acting on the probe's and the mismatch's verdicts (instances.quarantine; config.toml explains).
    quarantine: bool = True
    quarantine_min_active: int = Field(default=1, ge=0)
    quarantine_recheck_s: float = Field(default=5.0, ge=0)

    # HTTP API and security.
    max_request_body_mb: float = Field(default=64.0, gt=0)
    max_admin_body_kb: float = Field(default=256.0, gt=0)
    auth_token: str = ""
    registration_allowed_networks: str = "0.0.0.0/0,::/0"
    allow_registration_host_mismatch: bool = False
    metrics_require_token: bool = False  # /metrics lists every instance endpoint; true: it needs the token too
    sglang_api_key: str = ""  # SGLang's --api-key, sent on /generate and /server_info (rollout_manager/sglang/auth.py)
    sglang_admin_api_key: str = ""  # SGLang's --admin-api-key, sent on /abort_request
    # Callers' connections (api.connections): idle, header and body timeouts, and caps.
    http_keepalive_timeout_s: float = Field(default=20.0, gt=0)
    http_header_timeout_s: float = Field(default=10.0, gt=0)
    http_body_timeout_s: float = Field(default=60.0, gt=0)
    max_client_connections: int = Field(default=0, ge=0)  # 0: half the open-file limit
    max_idle_connections_per_client: int = Field(default=256, gt=0)
    http_fast_generate: bool = True  # plain non-streaming POST /generate skips aiohttp's web layer (api.fast_lane)
    # Callers that stop reading a streamed answer: closed after this long; a batch starts no new requests
    # while this much of its output waits to be sent.
    response_write_timeout_s: float = Field(default=60.0, gt=0)
    max_unsent_output_kb: float = Field(default=1024.0, gt=0)
    # The OpenAI-compatible front (openai_front; docs/agents.md): the tokenizer whose chat template renders
    # /v1/chat/completions ("" : token-id completions only), the model name it answers to, the session ledger's bounds.
    openai_tokenizer_path: str = ""
    openai_model_name: str = Field(default="default", min_length=1)
    openai_max_sessions: int = Field(default=4096, gt=0)
    openai_session_max_tokens: int = Field(default=1_048_576, gt=0)
    openai_session_idle_s: float = Field(default=3600.0, gt=0)

    @field_validator("allowed_sender_ips", "registration_allowed_networks", mode="before")
    @classmethod
    def _check_networks(cls, value: Any) -> Any:
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = ",".join(value)
        if isinstance(value, str):
            parse_networks(value)
        return value

    @field_validator("scheduler_state_file")
    @classmethod
    def _state_file(cls, v: str) -> str:
        if v:
            p = Path(v).expanduser()
            if p.is_dir():
                raise ValueError(f"{v!r} is a directory; name a file in it")
            if not p.parent.is_dir():
                raise ValueError(f"the directory of {v!r} does not exist")
            return str(p)
        return v

    @field_validator("tail_migration_tail_slowdown")
    @classmethod
    def _slowdown(cls, v: float) -> float:
        if 0 < v < 1:
            raise ValueError("must be 0 (off) or at least 1 (a factor of a lone sequence's step)")
        return v

    @field_validator("bind")
    @classmethod
    def _check_bind(cls, value: str) -> str:
        parse_bind(value)
        return value

    @model_validator(mode="after")
    def _check_relays(self) -> Config:
        if self.relays and self.weight_activation == "drain":
            raise ValueError("relays: weight_activation = \"drain\" waits for each box to be idle, and with relays the "
                             "control process that pushes does not run the box's sequences; use \"staged\" "
                             "(the default) with relays, or relays = 0")
        return self

    @property
    def bind_host(self) -> str:
        return parse_bind(self.bind)[0]

    @property
    def bind_port(self) -> int:
        return parse_bind(self.bind)[1]

    @property
    def allowed_networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        return parse_networks(self.allowed_sender_ips)

    @property
    def registration_networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        return parse_networks(self.registration_allowed_networks)


KEYS = tuple(Config.model_fields)


@dataclass(frozen=True)
class Layer:
    """Values from one source, with the name used in error messages."""

    source: str
    values: Mapping[str, Any]
    strict: bool  # file values keep their TOML types; env and CLI values are strings to coerce


def _unknown_key_message(key: str, source: str) -> str:
    close = difflib.get_close_matches(key, KEYS, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown config key {key!r} in {source}{hint}"


def _check_layer(layer: Layer) -> None:
    for key in layer.values:
        if key not in Config.model_fields:
            raise ConfigError(_unknown_key_message(key, layer.source))
    try:
        Config.model_validate(dict(layer.values), strict=layer.strict)
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        if not err["loc"]:  # a rule between keys (Config._check_relays)
            raise ConfigError(f"config from {layer.source}: {msg}") from None
        key = ".".join(str(p) for p in err["loc"])
        value = layer.values.get(str(err["loc"][0]), None)
        raise ConfigError(f"config key {key!r} = {value!r} from {layer.source}: {msg}") from None


def file_layer(path: str | os.PathLike[str]) -> Layer:
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {str(p)!r} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {exc}") from None
    for key, value in data.items():
        if isinstance(value, dict):
            raise ConfigError(f"config file {str(p)!r}: table [{key}] is not supported; keys are top-level")
    return Layer(f"file {str(p)!r}", data, strict=True)


def env_layer(environ: Mapping[str, str]) -> Layer:
    values = {}
    for name, value in environ.items():
        if name.startswith(ENV_PREFIX) and name not in ENV_NOT_CONFIG:
            values[name[len(ENV_PREFIX) :].lower()] = value
    return Layer("environment (" + ENV_PREFIX + "*)", values, strict=False)


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the effective configuration; raises ConfigError with a one-line reason."""
    layers: list[Layer] = []
    if path is not None:
        layers.append(file_layer(path))
    layers.append(env_layer(os.environ if environ is None else environ))
    if overrides:
        layers.append(Layer("command line", dict(overrides), strict=False))
    merged: dict[str, Any] = {}
    for layer in layers:
        _check_layer(layer)
        merged.update(layer.values)
    try:
        return Config.model_validate(merged)
    except ValidationError as exc:  # a rule between keys set in different places
        msg = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise ConfigError(f"config (file, environment and command line together): {msg}") from None


def parse_set_option(text: str) -> tuple[str, str]:
    """``--set key=value`` -> (key, value)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def describe(config: Config) -> str:
    """The effective configuration on one line, for the start-up log."""
    return " ".join(f"{k}={'<set>' if k in SECRET_KEYS and v else repr(v)}" for k, v in config.model_dump().items())
