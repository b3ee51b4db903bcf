"""docs/configuration.md is generated from the config model and config.toml's comments: it must be current."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_committed_configuration_reference_is_up_to_date():
    gen = _generator()
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == gen.render(), "docs/configuration.md is out of date: run python scripts/gen_config_docs.py"


def test_every_key_is_in_the_reference_with_its_default_and_bounds():
    from rollout_manager.config import Config

    text = (ROOT / "docs" / "configuration.md").read_text()
    for key in Config.model_fields:
        assert f"| `{key}` |" in text, key
    assert "| `num_mooncake_engines_per_group` | integer > 0 | `4` |" in text
    assert '| `weight_push_mode` | one of `"auto"`, `"full"`, `"delta"` | `"auto"` |' in text


def test_keys_sharing_a_comment_are_grouped_and_an_unreadable_line_is_refused():
    gen = _generator()
    sections = gen.parse_config_toml("# ---- S ----\n# Bounds.\nlo = 1\nhi = 2\n\n# Other.\nx = 3\n")
    assert [(g.description, g.keys) for g in sections[0].groups] == [("Bounds.", ["lo", "hi"]), ("Other.", ["x"])]
    with pytest.raises(ValueError, match="cannot read line"):
        gen.parse_config_toml("[table]\n")
