"""The base install is the daemon and its CLI: no torch, no numpy (docs/install.md).

Three views of one promise: pyproject's base dependencies name neither; no import statement reachable
from the daemon's entry points (function-local ones included) leads to them; and the real daemon and CLI,
started with both made unimportable, serve and answer, while the subcommands that do need them say
which extra to install.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import urllib.request
from collections import deque
from pathlib import Path
from typing import Any

import pytest
from support import PY, ROOT, Proc, free_port, wait_http_ok_sync

from rollout_manager import ops

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

HEAVY = ("torch", "numpy")

# Where the daemon starts: `rollout-manager serve` and the operator's subcommands (cli, ops), the manager
# as other programs embed it (manager, api.server: the trainer plugin's rank 0 runs it), and the launcher's
# helper (standard library only: it runs in SGLang's environment before anything heavy).
ENTRY_POINTS = ("rollout_manager.__main__", "rollout_manager.cli", "rollout_manager.ops", "rollout_manager.manager",
                "rollout_manager.api.server", "rollout_manager.launch.box")
# The CLI's subcommands that need an extra; cli.main checks for it (rollout_manager.extras) before importing.
GATED = {("rollout_manager.cli", "rollout_manager.cpu_engine.__main__"),
         ("rollout_manager.cli", "rollout_manager.launch.demo"),
         ("rollout_manager.cli", "rollout_manager.weights.receiver_agent"),
         # optional: a hub id's cached config.json; without the hub client a local path still works
         # (tests/test_model_config.py runs it without one)
         ("rollout_manager.launch.model_config", "huggingface_hub")}


def _project() -> Any:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


# ------------------------------------------------------------------ pyproject


def test_base_dependencies_name_no_torch_and_no_numpy() -> None:
    base = {_requirement_name(r) for r in _project()["dependencies"]}
    assert not base & {"torch", "numpy"}, base
    assert {"aiohttp", "pydantic", "msgspec", "orjson", "prometheus-client"} <= base


def test_extras_bring_what_moved_out_and_refer_only_to_extras_that_exist() -> None:
    extras: dict[str, list[str]] = _project()["optional-dependencies"]

    def closure(name: str) -> set[str]:
        out: set[str] = set()
        for req in extras[name]:
            if _requirement_name(req) == "rollout-manager":
                for inner in req[req.index("[") + 1: req.index("]")].split(","):
                    assert inner.strip() in extras, f"{name} refers to an extra that does not exist: {req}"
                    out |= closure(inner.strip())
            else:
                out.add(_requirement_name(req))
        return out

    agent = {"torch", "numpy", "xxhash", "zstandard"}
    assert agent <= closure("agent")
    for name in ("cpu", "cuda", "verl", "demo"):  # a Mooncake build always comes with the agents that use it
        assert agent <= closure(name), name
    assert "mooncake-transfer-engine-non-cuda" in closure("cpu") and "mooncake-transfer-engine" in closure("cuda")
    assert {"torch", "mooncake-transfer-engine-non-cuda"} <= closure("demo")
    assert "torch" in closure("cpu-engine")


def test_install_script_default_installs_every_extra_a_cpu_box_can_use() -> None:
    """The README's two commands (scripts/install.sh, then demo or pytest) still get everything."""
    extras = set(_project()["optional-dependencies"])
    line, = re.findall(r"^EXTRAS=\$\{EXTRAS:-([^}]*)\}$", (ROOT / "scripts" / "install.sh").read_text(), re.M)
    # Not on a CPU box: cuda (Mooncake's CUDA build; cpu is the other one), sglang (its GPU stack), bench.
    assert set(line.split(",")) == extras - {"cuda", "sglang", "bench"}


# ------------------------------------------------------------------ the import graph, read from the source


def _module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str) -> set[str]:
    """Every module ``module`` names in an import run at run time: top-level and function-local
    statements, not the ones under ``if TYPE_CHECKING:``."""
    path = _module_file(module)
    assert path is not None, module
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if _module_file(sub) is not None else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found - {"__future__"}


def _with_parents(names: set[str]) -> set[str]:
    """Importing ``a.b.c`` also imports ``a`` and ``a.b``."""
    out = set()
    for name in names:
        parts = name.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return out


def _reachable(entry_points: tuple[str, ...]) -> dict[str, str | None]:
    """Every module reachable from ``entry_points`` (ours and third-party top-level names), each with
    the module that first imported it."""
    ours = ("rollout_manager", "trainer_plugin")
    parent: dict[str, str | None] = dict.fromkeys(entry_points)
    queue = deque(entry_points)
    while queue:
        module = queue.popleft()
        if module.split(".")[0] not in ours or _module_file(module) is None:
            continue
        for dep in sorted(_with_parents({d for d in _imports(module) if (module, d) not in GATED})):
            if dep in parent:
                continue
            if dep.split(".")[0] not in ours:
                dep = dep.split(".")[0]
                if dep in parent:
                    continue
            parent[dep] = module
            queue.append(dep)
    return parent


def _path_to(parent: dict[str, str | None], module: str) -> str:
    chain = [module]
    while (up := parent[chain[-1]]) is not None:
        chain.append(up)
    return " <- ".join(chain)


def test_no_import_path_from_the_daemon_reaches_torch_or_numpy() -> None:
    parent = _reachable(ENTRY_POINTS)
    assert "rollout_manager.api.server" in parent and "rollout_manager.weights.sync" in parent  # the walk works
    assert "rollout_manager.launch.demo" not in parent  # only through the extras check
    for heavy in HEAVY:
        assert heavy not in parent, _path_to(parent, heavy)
    # And nothing else beyond the base install: each third-party module the daemon can import is a base
    # dependency's (or one of the standard library's).
    base = {"aiohttp", "httptools", "pydantic", "pydantic_core", "orjson", "msgspec", "prometheus_client", "rich",
            "uvloop", "tomli", "cachetools"}
    third_party = {m for m in parent if "." not in m and m not in sys.stdlib_module_names
                   and m not in ("rollout_manager", "trainer_plugin")}
    assert third_party <= base, {m: _path_to(parent, m) for m in third_party - base}


def test_the_walk_would_see_a_function_local_import() -> None:
    """The graph follows imports inside functions, so it finds paths that only run on some requests."""
    parent = _reachable(("rollout_manager.cli",))
    assert "rollout_manager.api.server" in parent  # imported inside cli._serve
    assert "rich" in parent  # imported inside ops' watch


# ------------------------------------------------------------------ the real daemon, torch and numpy absent

# Run as `python -c PRELUDE ARGS...`: makes torch and numpy unimportable as on a base install (a finder
# ahead of all others), writes every attempt to import them to stderr, then runs `rollout-manager ARGS`.
PRELUDE = """
import runpy, sys
assert not {"torch", "numpy"} & set(sys.modules), "imported before the prelude"
class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "numpy"):
            print(f"light-install: attempted import of {name}", file=sys.stderr, flush=True)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NotInstalled())
sys.argv[0] = "rollout-manager"
runpy.run_module("rollout_manager", run_name="__main__", alter_sys=True)
"""
ATTEMPT = "light-install: attempted import of"


def _cli(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-c", PRELUDE, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


def _get(url: str) -> tuple[int, dict[str, object]]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, json.loads(r.read())


@pytest.mark.slow
def test_daemon_and_cli_run_without_torch_and_numpy(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Proc([PY, "-c", PRELUDE, "serve", "--bind", f"127.0.0.1:{port}"], tmp_path / "manager.log")
    try:
        wait_http_ok_sync(url + "/health", proc)
        status, health = _get(url + "/health")
        assert status == 200 and health["status"] == "healthy", health
        status, instances = _get(url + "/get_instances_status")
        assert status == 200 and instances["instances"] == [], instances
        for args in (["--help"], ["serve", "--help"], ["status", "--manager", url],
                     ["push-status", "--manager", url], ["watch", "--once", "--manager", url]):
            done = _cli(*args)
            assert done.returncode == 0, (args, done.stderr)
            assert ATTEMPT not in done.stderr, (args, done.stderr)
        assert json.loads(_cli("status", "--json", "--manager", url).stdout)["instances"] == []
        done = _cli("drain", "127.0.0.1:1", "--manager", url)  # an unknown endpoint: the answer, not an import
        assert done.returncode == ops.UNKNOWN_ENDPOINT and ATTEMPT not in done.stderr, done
    finally:
        proc.stop()
    log = proc.log_path.read_text()
    assert "listening on" in log and ATTEMPT not in log, log


@pytest.mark.slow
@pytest.mark.parametrize(("command", "extra"), [("demo", "rollout-manager[demo]"),
                                                 ("cpu-engine", "rollout-manager[cpu-engine]"),
                                                 ("receiver-agent", "rollout-manager[cuda]")])
def test_a_subcommand_that_needs_an_extra_names_it(command: str, extra: str) -> None:
    done = _cli(command, "--help")
    lines = [line for line in done.stderr.splitlines() if not line.startswith(ATTEMPT)]
    assert done.returncode == 1 and len(lines) == 1, done
    assert lines[0].startswith(f"rollout-manager {command}: needs torch") and extra in lines[0], lines
    assert "Traceback" not in done.stderr
