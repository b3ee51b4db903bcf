"""``rollout_manager/weights/`` holds code for three processes: each module says which run it, the architecture
doc's row says the same, and a module imports only modules that run wherever it runs (so the manager never
reaches the agents' byte layer, and the box's receiver never the trainer's sender). Read with ``ast``: nothing is
imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WEIGHTS = ROOT / "rollout_manager" / "weights"
PROCESSES = ("manager", "box", "trainer")
_LINE = re.compile(r"^Runs in: ([a-z, ]+)\.", re.M)


def _processes(path: Path) -> frozenset[str]:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    found = _LINE.findall(doc)
    assert len(found) == 1, f"{path.name}: its docstring needs one 'Runs in: ...' line, has {len(found)}"
    names = [name.strip() for name in found[0].split(",")]
    assert names and set(names) <= set(PROCESSES), f"{path.name}: runs in {names}, not among {PROCESSES}"
    return frozenset(names)


def _modules() -> dict[str, frozenset[str]]:
    return {path.stem: _processes(path) for path in sorted(WEIGHTS.glob("*.py"))}


def _weights_imports(path: Path) -> set[str]:
    """The weights modules ``path`` imports, anywhere in it (a function body counts)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module == "rollout_manager.weights":
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rollout_manager.weights."):
            found.add(node.module.split(".")[2])  # type: ignore[union-attr]
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[2] for a in node.names if a.name.startswith("rollout_manager.weights."))
    return found


def test_every_weights_module_says_which_processes_run_it() -> None:
    modules = _modules()
    assert {"sync", "receiver_agent", "sender_agent"} <= set(modules)
    assert modules["sync"] == {"manager"} and modules["receiver_agent"] == {"box"}
    assert modules["sender_agent"] == {"trainer"}


def test_the_architecture_doc_says_the_same() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    for name, processes in _modules().items():
        row = re.search(rf"^\| `rollout_manager/weights/{name}\.py` \| \[([a-z, ]+)\] ", doc, re.M)
        assert row, f"docs/architecture.md: the row of weights/{name}.py does not start with its processes"
        assert frozenset(p.strip() for p in row.group(1).split(",")) == processes, name


def test_a_module_imports_only_modules_that_run_wherever_it_runs() -> None:
    """The package's ``__init__`` is left out: it loads the byte layer's names on first use only (PEP 562)."""
    modules = _modules()
    wrong = []
    for name, processes in modules.items():
        if name == "__init__":
            continue
        for target in _weights_imports(WEIGHTS / f"{name}.py") & set(modules):
            if not processes <= modules[target]:
                wrong.append(f"{name} ({', '.join(sorted(processes))}) imports {target} "
                             f"({', '.join(sorted(modules[target]))})")
    assert not wrong, wrong
