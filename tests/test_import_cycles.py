"""No import cycles among kiln's packages: each module's imports (top-level or inside a function, outside
`if TYPE_CHECKING:`) form a graph without a loop, so any module can be imported, read and tested from the
bottom up. Found statically with ast: nothing is imported to look."""

import ast
from pathlib import Path

from kiln.paths import PACKAGES, REPO_ROOT


def module_files(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the packages (a package is its __init__)."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _under_type_checking(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for n in ast.walk(node)}
    return skipped


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The modules of `modules` that `name` imports, each with the line of its first import."""
    tree = ast.parse(path.read_text())
    skipped = _under_type_checking(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parents = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parents, *([node.module] if node.module else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            if target in modules and target != name:
                found.setdefault(target, node.lineno)
    return found


def import_cycles(root: Path, packages=PACKAGES) -> list[list[str]]:
    """Each strongly connected set of two or more modules (Tarjan), as 'a:line -> b' edges."""
    modules = module_files(root, packages)
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(f"{a}:{line} -> {b}" for a in group for b, line in graph[a].items() if b in group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles_among_kilns_packages():
    assert import_cycles(REPO_ROOT) == []


def test_a_cycle_through_a_lazy_import_is_found_with_its_lines(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text(
        "import typing\nif typing.TYPE_CHECKING:\n    from pkg import b\n\n\ndef g():\n    import pkg.a\n"
    )
    assert import_cycles(tmp_path, ("pkg",)) == [["pkg.a:1 -> pkg.b", "pkg.b:2 -> pkg.c", "pkg.c:7 -> pkg.a"]]


def test_imports_under_type_checking_are_not_edges(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n")
    assert import_cycles(tmp_path, ("pkg",)) == []
