"""The shape of the house: no import cycle in qlora_fsdp (every import counted, lazy and TYPE_CHECKING ones too), no
module over 600 lines, at most ten modules beside the subpackages, each module's docstring, the test run's file order
naming files that exist, and tests/unit's folders naming the package's subpackages."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import LONG_FILES, REPO_ROOT, TESTS

PACKAGE = REPO_ROOT / "qlora_fsdp"


def _module_name(path: Path, base: Path) -> str:
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports anywhere in its source (a `from pkg import name` of a
    submodule counts as that submodule; of anything else, as the package)."""
    files = {_module_name(f, root.parent): f for f in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
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


def test_no_import_cycle() -> None:
    assert cycles(import_graph(PACKAGE)) == []


def test_the_cycle_finder_finds_a_cycle_through_a_lazy_import(tmp_path: Path) -> None:
    """Control: a cycle closed only by an import inside a function is found."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import f\n")
    (package / "b.py").write_text("def f():\n    from pkg import a\n")
    (package / "c.py").write_text("from . import a\n")
    assert cycles(import_graph(package)) == [["pkg.a", "pkg.b"]]
    (package / "b.py").write_text("def f():\n    pass\n")
    assert cycles(import_graph(package)) == []


def test_no_module_over_600_lines() -> None:
    long = {
        str(f.relative_to(REPO_ROOT)): n for f in PACKAGE.rglob("*.py") if (n := len(f.read_text().splitlines())) > 600
    }
    assert not long, long


def test_long_files_name_test_files_that_exist() -> None:
    present = {f.relative_to(TESTS).as_posix() for f in TESTS.rglob("test_*.py")}
    assert set(LONG_FILES) <= present, set(LONG_FILES) - present


def test_unit_test_folders_mirror_the_package() -> None:
    """A module's unit tests are found from its name: tests/unit/<subpackage>/ for qlora_fsdp/<subpackage>/, the top
    modules' in tests/unit itself. Each folder is a package (two folders may hold files of the same name)."""
    unit = TESTS / "unit"
    folders = [d for d in unit.rglob("*") if d.is_dir() and d.name != "__pycache__"]
    strays = [str(d.relative_to(unit)) for d in folders if not (PACKAGE / d.relative_to(unit) / "__init__.py").exists()]
    assert not strays, f"tests/unit folders that name no qlora_fsdp subpackage: {strays}"
    unpackaged = [str(d.relative_to(unit)) for d in [unit, *folders] if not (d / "__init__.py").exists()]
    assert not unpackaged, f"tests/unit folders without __init__.py: {unpackaged}"


def test_the_top_holds_at_most_ten_modules_and_every_module_says_its_concern() -> None:
    """The tree is the architecture: stages are subpackages, and at most ten modules sit beside them; each module
    opens with a docstring saying what it is for."""
    top = sorted(f.name for f in PACKAGE.glob("*.py") if f.name != "__init__.py")
    assert len(top) <= 10, top
    modules = PACKAGE.rglob("*.py")
    silent = [str(f.relative_to(REPO_ROOT)) for f in modules if ast.get_docstring(ast.parse(f.read_text())) is None]
    assert not silent, silent
