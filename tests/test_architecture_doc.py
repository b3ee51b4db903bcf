"""docs/architecture.md's code layout checked against the tree, so the doc cannot drift from the code.

The module table must name every module of ``rollout_manager/`` and ``trainer_plugin/`` (an empty
``__init__.py`` excepted) and nothing that is not there; the floors must place every module, and what
the doc claims of imports (no cycle, nothing imports a floor above its own) must hold. Imports are read
with ``ast`` (nothing is imported), every ``import`` in a module counting, in a function body or under
``if TYPE_CHECKING:`` too: a module that names another's type for its annotations depends on it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("rollout_manager", "trainer_plugin")

_ROW = re.compile(r"^\| `([^`]+)` \|")
_FLOOR = re.compile(r"^\d+\. (.+)$")


def _section(text: str, heading: str) -> list[str]:
    """The lines under a ``### heading``, up to the next heading."""
    lines = text.splitlines()
    start = lines.index(f"### {heading}") + 1
    out: list[str] = []
    for line in lines[start:]:
        if line.startswith("#"):
            break
        out.append(line)
    return out


def _doc() -> str:
    return DOC.read_text(encoding="utf-8")


def _table_paths() -> list[str]:
    return [m.group(1) for line in _section(_doc(), "Modules") if (m := _ROW.match(line))]


def _floors() -> list[list[str]]:
    """Top floor first; each floor a list of paths (a file, or a folder ending in ``/``)."""
    floors = []
    for line in _section(_doc(), "Floors"):
        if m := _FLOOR.match(line):
            floors.append(re.findall(r"`([^`]+)`", m.group(1)))
    return floors


def _tree() -> dict[str, Path]:
    """Dotted module name -> file, for every module with content."""
    mods: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "__init__.py" and not path.read_text(encoding="utf-8").strip():
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _packages() -> set[str]:
    return {".".join(p.relative_to(ROOT).parent.parts) for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")}


def _imports(name: str, path: Path, mods: dict[str, Path], packages: set[str]) -> set[str]:
    """The project modules ``name`` imports (a name imported from a package counts as that package)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if name in packages else name.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join([*here, base] if base else here)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in mods else base)
    found = set()
    for target in targets:
        while target and target not in mods:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    mods, packages = _tree(), _packages()
    return {name: _imports(name, path, mods, packages) for name, path in mods.items()}


def _rel(name: str) -> str:
    path = _tree()[name].relative_to(ROOT)
    return path.as_posix()


def test_every_module_is_in_the_table() -> None:
    listed = set(_table_paths())
    missing = sorted(_rel(name) for name in _tree() if _rel(name) not in listed)
    assert not missing, f"docs/architecture.md's module table leaves out: {missing}"


def test_every_module_in_the_table_exists() -> None:
    paths = _table_paths()
    assert len(paths) == len(set(paths)), "a module is listed twice"
    gone = [p for p in paths if not (ROOT / p).is_file()]
    assert not gone, f"docs/architecture.md's module table names modules that are not there: {gone}"


def _floor_of() -> dict[str, int]:
    floors = _floors()
    assert floors, "docs/architecture.md has no floors"
    out: dict[str, int] = {}
    for name in _tree():
        rel = _rel(name)
        best: tuple[int, int] | None = None  # (length of the match, floor)
        for level, entries in enumerate(floors):
            for entry in entries:
                if rel == entry or (entry.endswith("/") and rel.startswith(entry)):
                    if best is None or len(entry) > best[0]:
                        best = (len(entry), level)
        assert best is not None, f"{rel} is on no floor of docs/architecture.md"
        out[name] = best[1]
    return out


def test_every_module_is_on_a_floor() -> None:
    assert len(_floor_of()) == len(_tree())


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_imports_form_no_cycle() -> None:
    """Whatever the doc says: a cycle fails this even where the doc stopped claiming there is none."""
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles: {cycles}"


def test_no_module_imports_a_floor_above_its_own() -> None:
    floor = _floor_of()
    up = sorted(
        f"{_rel(name)} -> {_rel(target)}"
        for name, targets in _graph().items()
        for target in targets
        if floor[target] < floor[name]
    )
    assert not up, f"imports that run up a floor: {up}"


def test_class_names_are_unique_across_the_packages() -> None:
    """One name, one class: a reader who finds ``Trust`` or ``Group`` knows which one is meant."""
    where: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                if isinstance(node, ast.ClassDef):
                    where.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, f"classes defined more than once: {twice}"
