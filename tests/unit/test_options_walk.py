"""Where the run options travel (issue 54): from ``dist_inference_runner.execute``, follow every call that
hands on the options (an argument named ``opts``, or ``<x>.opts``) through the project's functions, and
count the calls that carry them into another module (and so return from it: the walk "climbs back up").
Options are resolved once, near the top (the plan, the rank's start-up), into what each component
takes; components below take their own values, not the options. At the project's commit a49bd03 this
walk made 15 such calls (7 of them from pipeline/runtime/roles.py)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("serve", "terminal", "python_api", "pipeline", "tasks", "comm")


def functions() -> dict[str, tuple[str, ast.FunctionDef]]:
    """name -> (module, def) for the project's functions and methods (the first of a name wins)."""
    out = {}
    files = [ROOT / "dist_inference_runner.py"] + [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    for path in files:
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.parse(path.read_text()).body:
            for fn in [node] if isinstance(node, ast.FunctionDef) else node.body if isinstance(node, ast.ClassDef) else []:
                if isinstance(fn, ast.FunctionDef):
                    out.setdefault(fn.name, (module, fn))
    return out


def passes_options(call: ast.Call) -> bool:
    args = [*call.args, *(k.value for k in call.keywords)]
    return any((isinstance(a, ast.Name) and a.id == "opts") or (isinstance(a, ast.Attribute) and a.attr == "opts")
               for a in args)


def walk(start: str = "execute") -> list[tuple[str, str, str]]:
    """Each call that carries the options into another module: (caller module, callee, callee module)."""
    defs = functions()
    seen, edges, todo = set(), [], [start]
    while todo:
        name = todo.pop()
        if name in seen or name not in defs:
            continue
        seen.add(name)
        module, fn = defs[name]
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and passes_options(node):
                callee = node.func.id if isinstance(node.func, ast.Name) else \
                    node.func.attr if isinstance(node.func, ast.Attribute) else None
                if callee in defs:
                    if defs[callee][0] != module:
                        edges.append((module, callee, defs[callee][0]))
                    todo.append(callee)
    return edges


def test_the_options_go_down_from_execute_and_stop_early():
    edges = walk()
    assert len(edges) <= 8, "\n".join(f"{a} hands the options to {f} ({b})" for a, f, b in edges)
