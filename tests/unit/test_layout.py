"""The code's layout holds its rules: no import cycles, no function-local imports of the project's own
modules, and lower layers never import higher ones (models know nothing of ranks, files or options;
scheduling moves no tensors between processes)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pipeline", "comm", "tasks", "serve", "terminal", "python_api")
TOP_MODULES = ("dist_inference_runner", "split_queries")
PROJECT = PACKAGES + TOP_MODULES

# package prefix -> prefixes it must never import (checked on every import, at any depth)
FORBIDDEN = {
    "pipeline.models": ("pipeline.config", "pipeline.scheduling", "pipeline.runtime", "pipeline.loading",
                        "pipeline.sampling", "pipeline.output", "pipeline.cache.prefix", "comm", "tasks", "serve",
                        "torch.distributed"),
    "pipeline.cache": ("pipeline.config", "pipeline.scheduling", "pipeline.runtime", "pipeline.loading",
                       "pipeline.output", "serve", "tasks"),
    "pipeline.scheduling": ("torch.distributed", "comm", "serve", "pipeline.models", "pipeline.loading",
                            "pipeline.runtime"),
    "pipeline.sampling": ("pipeline.output", "pipeline.runtime", "pipeline.scheduling", "serve", "tasks"),
    "pipeline.output": ("pipeline.runtime", "pipeline.scheduling", "serve"),
    "pipeline.loading": ("pipeline.runtime", "pipeline.scheduling", "serve"),
    "pipeline.config": ("pipeline.runtime", "pipeline.scheduling", "serve"),
    "tasks": ("pipeline", "serve", "terminal", "python_api"),
    "comm": ("pipeline", "serve", "tasks", "terminal", "python_api"),
    # the faces: clients of the engine, imported by nothing but the entry point (and never by one another)
    "pipeline": ("serve", "terminal", "python_api"),
    "serve": ("terminal", "python_api"),
    "terminal": ("serve", "python_api"),
    "python_api": ("serve", "terminal"),
}


# the wire messages are data every side builds and reads: the one runtime module scheduling and output import
SHARED = ("pipeline.runtime.messages",)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_files() -> dict[str, Path]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    files += [ROOT / f"{m}.py" for m in TOP_MODULES]
    return {module_name(p): p for p in files}


MODULES = project_files()


def imported(node: ast.AST) -> list[str]:
    """Dotted names an import statement brings in (``from a import b`` gives ``a.b`` when that is a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module for a in node.names]
    return []


def is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def module_imports(tree: ast.Module) -> set[str]:
    """Names imported when the module is executed (not inside functions, not under TYPE_CHECKING)."""
    out: set[str] = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or is_type_checking(node):
                continue
            out.update(imported(node))
            visit(ast.iter_child_nodes(node))

    visit(tree.body)
    return out


LAZY = "# lazy:"  # a function-local import that keeps a heavy module out of the modes that do not use it


def function_local_imports(tree: ast.Module, lines: list[str]) -> list[tuple[str, int]]:
    """Project imports inside functions, but those marked ``# lazy: <why>`` on their line."""
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if hasattr(node, "lineno") and LAZY in lines[node.lineno - 1]:
                    continue
                found += [(name, node.lineno) for name in imported(node) if name.split(".")[0] in PROJECT]
    return found


TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def test_no_function_local_imports_of_project_modules():
    found = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {name}"
             for m, tree in TREES.items()
             for name, line in function_local_imports(tree, MODULES[m].read_text().splitlines())]
    assert not found, "import these at the top of the module:\n" + "\n".join(found)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a list of modules, first == last), or None: depth-first search with colours."""
    colour: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        colour[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if colour.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in colour and (cycle := visit(w)):
                return cycle
        colour[v] = 2
        stack.pop()
        return None

    for v in sorted(graph):
        if v not in colour and (cycle := visit(v)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles():
    graph = {m: {t for t in module_imports(tree) if t in MODULES and t != m} for m, tree in TREES.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_lower_layers_never_import_higher_ones(layer):
    bad = []
    for m, tree in TREES.items():
        if m != layer and not m.startswith(layer + "."):
            continue
        for node in ast.walk(tree):
            for name in imported(node):
                if name not in SHARED and any(name == f or name.startswith(f + ".") for f in FORBIDDEN[layer]):
                    bad.append(f"{m} imports {name}")
    assert not bad, "\n".join(bad)


def test_every_package_says_what_it_holds():
    for m, path in MODULES.items():
        if path.name == "__init__.py" and m.count(".") <= 2:
            doc = ast.get_docstring(TREES[m]) or ""
            assert len(doc) > 40, f"{path.relative_to(ROOT)}: say what the package holds and what it may import"


def test_unit_tests_start_no_processes(request):
    """tests/unit is the fast tier's home: a test that starts processes belongs in tests/integration."""
    offenders = getattr(request.config, "unit_tests_starting_processes", [])
    assert not offenders, "move to tests/integration:\n" + "\n".join(offenders)


def test_every_package_readme_lists_its_modules():
    """Each package's README.md (what it holds, what it may import, a line per module) names every
    module in it, so a newcomer finds each file from its folder's page."""
    for init in [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")]:
        readme = init.with_name("README.md")
        assert readme.is_file(), f"{readme.relative_to(ROOT)} is missing"
        text = readme.read_text()
        missing = [p.name for p in init.parent.glob("*.py") if p.name != "__init__.py" and f"`{p.name}`" not in text]
        assert not missing, f"{readme.relative_to(ROOT)} does not list {', '.join(missing)}"
