"""Configuration: precedence, the shipped file, and every kind of refused value."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollout_manager.config import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_shipped_config_toml_equals_builtin_defaults_and_documents_every_key():
    shipped = load_config(ROOT / "config.toml", environ={})
    assert shipped == Config()
    text = (ROOT / "config.toml").read_text()
    for key in Config.model_fields:
        assert f"\n{key} = " in text, f"config.toml does not document {key}"


def test_precedence_cli_over_env_over_file_over_defaults(tmp_path):
    f = write(tmp_path, "num_mooncake_engines_per_group = 2\nnum_mooncake_groups_per_sender = 3\n"
                        "health_failure_threshold = 7\n")
    env = {"ROLLOUT_MANAGER_NUM_MOONCAKE_ENGINES_PER_GROUP": "5",
           "ROLLOUT_MANAGER_NUM_MOONCAKE_GROUPS_PER_SENDER": "6"}
    cfg = load_config(f, environ=env, overrides={"num_mooncake_engines_per_group": "9"})
    assert cfg.num_mooncake_engines_per_group == 9  # command line
    assert cfg.num_mooncake_groups_per_sender == 6  # environment
    assert cfg.health_failure_threshold == 7  # file
    assert cfg.drain_timeout_s == Config().drain_timeout_s  # default


def test_seed_project_keys_are_read_as_written(tmp_path):
    f = write(tmp_path, 'mooncake_transfer_device_name = "mlx5_0"\nmooncake_transfer_protocol = "rdma"\n'
                        'allowed_sender_ips = "10.0.0.0/8, 192.168.1.7"\n'
                        "num_mooncake_groups_per_sender = 2\nnum_mooncake_engines_per_group = 8\n")
    cfg = load_config(f, environ={})
    assert cfg.mooncake_transfer_protocol == "rdma"
    assert [str(n) for n in cfg.allowed_networks] == ["10.0.0.0/8", "192.168.1.7/32"]
    assert (cfg.num_mooncake_groups_per_sender, cfg.num_mooncake_engines_per_group) == (2, 8)


def test_unrelated_env_vars_with_our_prefix_for_rollout_boxes_are_ignored():
    cfg = load_config(environ={"ROLLOUT_MANAGER_ADDR": "http://1.2.3.4:5000"})
    assert cfg == Config()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("num_mooncake_engine_per_group = 4", "did you mean 'num_mooncake_engines_per_group'"),
        ("bogus_key = 1", "unknown config key 'bogus_key'"),
        ('num_mooncake_engines_per_group = "4"', "'num_mooncake_engines_per_group' = '4'"),
        ("num_mooncake_engines_per_group = 0", "greater than 0"),
        ("num_mooncake_groups_per_sender = -1", "'num_mooncake_groups_per_sender' = -1"),
        ('allowed_sender_ips = "10.0.0.0/33"', "'10.0.0.0/33' is not an IP address or CIDR"),
        ('allowed_sender_ips = "10.0.0.1, nope"', "'nope' is not an IP address"),
        ('bind = "0.0.0.0:70000"', "port 70000 is out of range"),
        ('bind = "localhost"', "must be HOST:PORT"),
        ("weight_sender_base_port = 0", "'weight_sender_base_port' = 0"),
        ('mooncake_transfer_protocol = "udp"', "'mooncake_transfer_protocol' = 'udp'"),
        ("health_check_interval_s = 0", "'health_check_interval_s' = 0"),
        ("tail_migration_tail_slowdown = 0.5", "'tail_migration_tail_slowdown' = 0.5"),
        ("[section]\nx = 1", "table [section] is not supported"),
        ("num_mooncake_engines_per_group = ", "not valid TOML"),
    ],
)
def test_refused_file_values_name_key_and_value(tmp_path, text, expected):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), environ={})
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


def test_refused_env_and_cli_values_name_their_source(tmp_path):
    with pytest.raises(ConfigError, match="environment.*greater than 0|greater than 0"):
        load_config(environ={"ROLLOUT_MANAGER_NUM_MOONCAKE_ENGINES_PER_GROUP": "0"})
    with pytest.raises(ConfigError, match="from environment"):
        load_config(environ={"ROLLOUT_MANAGER_HEALTH_FAILURE_THRESHOLD": "many"})
    with pytest.raises(ConfigError, match="from command line"):
        load_config(environ={}, overrides={"bind": "1.2.3.4:70000"})
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml", environ={})


@pytest.mark.slow
def test_cli_refuses_bad_config_before_binding_with_one_line(tmp_path):
    f = write(tmp_path, "num_mooncake_groups_per_sender = 0\n")
    proc = subprocess.run(
        [sys.executable, "-m", "rollout_manager", "serve", "--config", str(f), "--bind", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "num_mooncake_groups_per_sender" in lines[0] and "0" in lines[0]


def test_generation_settings_are_built_from_the_config_like_the_other_settings() -> None:
    from rollout_manager.rollout.generation_settings import GenerationSettings

    off = GenerationSettings.from_config(Config(max_staleness=-1, tail_migration=False, engine_max_frame_mb=2.5))
    assert (off.max_staleness, off.migration, off.max_frame_bytes) == (None, None, 2_500_000)
    on = GenerationSettings.from_config(Config(max_staleness=2, tail_migration=True, tail_migration_max_moves=3,
                                               max_attempts_per_request=7, engine_batch_max=5))
    assert on.max_staleness == 2 and on.migration is not None and on.migration.max_moves == 3
    assert (on.max_attempts, on.batch_max) == (7, 5)
