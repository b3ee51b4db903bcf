"""The optional extras that the CLI's heavy subcommands need, checked before anything heavy is imported.

The base install is the daemon and its operator CLI (no torch, no numpy). ``demo``, ``receiver-agent`` and
``cpu-engine`` need packages that come with extras (pyproject.toml, docs/install.md); without them the
subcommand says in one line what to install instead of ending in an import traceback.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class Needs:
    """What one subcommand imports beyond the base install, and the install line that brings it."""

    modules: tuple[str, ...]  # top-level import names
    install: str  # the pip argument(s) that bring them


# Mooncake's module is ``mooncake``; its CPU and CUDA builds are the ``cpu`` and ``cuda`` extras.
_AGENT_MODULES = ("torch", "numpy", "zstandard", "mooncake")

SUBCOMMAND_NEEDS: dict[str, Needs] = {
    "demo": Needs(_AGENT_MODULES, "'rollout-manager[demo]'"),
    "receiver-agent": Needs(_AGENT_MODULES, "'rollout-manager[cuda]' (GPU box; 'rollout-manager[cpu]' without CUDA)"),
    "cpu-engine": Needs(("torch",), "'rollout-manager[cpu-engine]'"),
}


def missing_modules(needs: Needs) -> list[str]:
    """The modules of ``needs`` that cannot be imported here (found without importing them)."""
    missing = []
    for name in needs.modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a broken install, or a module replaced in sys.modules
            found = False
        if not found:
            missing.append(name)
    return missing


def missing_extra_message(command: str) -> str | None:
    """One line naming what ``rollout-manager COMMAND`` lacks and how to install it; None if nothing."""
    needs = SUBCOMMAND_NEEDS.get(command)
    if needs is None:
        return None
    missing = missing_modules(needs)
    if not missing:
        return None
    return (f"rollout-manager {command}: needs {', '.join(missing)}, not installed here; "
            f"install it with: pip install {needs.install}")
