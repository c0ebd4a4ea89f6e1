"""Imports among the project's own modules run one way: no cycle, counting imports inside
functions and relative imports, and nothing below the job (launch/, train.py) imports it.

A cycle works only while each side imports the other late enough (inside a function, at the
bottom of a module); the next edit that moves one breaks it, and a reader cannot follow the
arrows one way. The project's modules are what pyproject.toml installs (its packages and
py-modules). One pair is not counted: a package's __init__ importing its own submodules, which
import the package back for its shared names (model/__init__.py holds the contract that the
families import, then names the families).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_INSTALLED = {"tests", "bench", "docs"}  # run from the checkout, never imported by the project


def project_modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for every module pyproject.toml installs."""
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    modules = {name: root / f"{name}.py" for name in setup.get("py-modules", [])}
    for package in setup.get("packages", []):
        for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported_names(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """Dotted names an import statement may load: the module, and each imported name as a
    submodule (`from model import llama` loads `model.llama`)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: `from . import x` in a package or beside a module
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}".strip(".")
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def _enclosing(name: str, modules: dict[str, Path]) -> str:
    """The deepest project module `name` is in ('' if none): a name imported from a module is
    that module."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def import_graph(root: Path) -> dict[str, dict[str, str]]:
    """module -> {module it imports: where ("path:line")}, anywhere in the file."""
    modules = project_modules(root)
    graph: dict[str, dict[str, str]] = {name: {} for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):  # every statement, also inside functions and classes
            for imported in _imported_names(node, name, path.name == "__init__.py"):
                # Importing a.b.c also runs the packages a and a.b.
                target = _enclosing(imported, modules)
                while target:
                    # Not itself, nor a package it lives in (being imported already).
                    if target != name and not name.startswith(target + "."):
                        graph[name].setdefault(target, f"{path.relative_to(root)}:{node.lineno}")
                    target = _enclosing(target.rpartition(".")[0], modules)
    return graph


def import_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

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
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                cycles.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def describe(cycles: list[list[str]], graph: dict[str, dict[str, str]]) -> str:
    lines = []
    for cycle in cycles:
        lines.append(" <-> ".join(cycle))
        for a in cycle:
            lines += [f"    {a} -> {b}  ({graph[a][b]})" for b in cycle if b in graph[a]]
    return "\n".join(lines)


def test_no_import_cycle_among_project_modules() -> None:
    graph = import_graph(ROOT)
    assert len(graph) > 30 and "train" in graph and "model.llama_hf" in graph
    cycles = import_cycles(graph)
    assert not cycles, "import cycles (make the arrows run one way):\n" + describe(cycles, graph)


# The job (launch/, train.py) assembles the rooms below it and imports them, never the reverse:
# a room that imports the job's tree (even inside a function) depends on every other room.
JOB = ("launch", "train")


def test_no_room_below_the_job_imports_it() -> None:
    graph = import_graph(ROOT)
    up = [f"{a} -> {b}  ({where})" for a, imported in graph.items()
          if a.partition(".")[0] not in JOB
          for b, where in imported.items() if b.partition(".")[0] in JOB]  # fmt: skip
    assert not up, "imports of the job from below it (pass the sections instead):\n" + "\n".join(up)


def test_pyproject_installs_every_project_module() -> None:
    """The cycle test covers what pyproject.toml installs: that must be every top-level package
    and module outside tests/, bench/ and docs/."""
    installed = {name.partition(".")[0] for name in project_modules(ROOT)}
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    present = packages | {p.stem for p in ROOT.glob("*.py")}
    assert present - NOT_INSTALLED == installed


def test_a_cycle_is_found_however_it_is_imported(tmp_path: Path) -> None:
    """top -> pkg.a at module level, pkg.a -> pkg.b by a relative import inside a function,
    pkg.b -> top inside a method: one cycle. pkg's __init__ importing pkg.a, which imports
    pkg back, is not one on its own; nor is `leaf`, which imports none of them."""
    files = {
        "pyproject.toml": '[tool.setuptools]\npy-modules = ["top", "leaf"]\npackages = ["pkg"]\n',
        "top.py": "import pkg.a\nimport leaf\n",
        "leaf.py": "import json\n",
        "pkg/__init__.py": "SHARED = 1\nfrom pkg import a  # noqa\n",
        "pkg/a.py": "from pkg import SHARED\n\ndef f():\n    from . import b\n",
        "pkg/b.py": "import leaf\n\nclass C:\n    def m(self):\n        from top import x\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path)
    assert graph["pkg.a"] == {"pkg.b": "pkg/a.py:4"}
    # pkg is in it too: importing pkg.a (top) runs pkg, which imports pkg.a.
    assert import_cycles(graph) == [["pkg", "pkg.a", "pkg.b", "top"]]
    (tmp_path / "pkg/b.py").write_text("import leaf\n")  # the cycle broken
    assert import_cycles(import_graph(tmp_path)) == []
