"""The import graph points down: every package imports only itself and lower floors, and no module
imports another that imports it back (not even under TYPE_CHECKING).

The floors are the data flow of docs/ARCHITECTURE.md; this file is their one definition.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

FLOORS: dict[str, int] = {
    "version": 0,
    "core": 0,
    "kernels": 1,
    "memory": 1,
    "distributed": 1,
    "structured": 1,
    "sizing": 2,
    "layers": 2,
    "attention": 2,
    "models": 3,
    "speculative": 3,  # proposers and verification: above the sampler, below the runner
    "runner": 4,
    "engine": 5,
    "scheduler": 6,
    "driver": 7,
    "memory_share": 7,
    "server": 8,
    "llm": 8,
    "bench": 9,
    "commands": 10,
    "cli": 11,
    "__main__": 12,
    "__init__": 12,  # the top-level package re-exports the public API
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def _imports() -> dict[str, set[str]]:
    """Every snugkv import of every module, wherever it sits (functions, TYPE_CHECKING blocks)."""
    edges: dict[str, set[str]] = {}
    for path in sorted((SRC / "snugkv").rglob("*.py")):
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "snugkv":
                targets.add(node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names if alias.name.split(".")[0] == "snugkv")
        edges[_module_name(path)] = targets
    return edges


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _resolve(target: str, modules: set[str]) -> str:
    """An import of a name inside a module (`snugkv.core.forward.ForwardBatch`) names the module."""
    while target not in modules and "." in target:
        target = target.rsplit(".", 1)[0]
    return target


def test_every_package_has_a_floor() -> None:
    missing = {_package(module) for module in _imports()} - set(FLOORS)
    assert not missing, f"give these packages a floor in FLOORS: {sorted(missing)}"


def test_imports_point_down() -> None:
    upward = []
    for module, targets in _imports().items():
        floor = FLOORS[_package(module)]
        for target in targets:
            same_package = _package(target) == _package(module)
            if not same_package and FLOORS[_package(target)] >= floor:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that do not point down:\n" + "\n".join(sorted(upward))


def test_no_import_cycles() -> None:
    edges = _imports()
    modules = set(edges)
    graph = {module: {_resolve(t, modules) for t in targets} - {module} for module, targets in edges.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


@pytest.mark.parametrize("package", ["core", "kernels"])
def test_the_ground_floor_imports_nothing_of_the_project_above_it(package: str) -> None:
    for module, targets in _imports().items():
        if _package(module) == package:
            assert all(_package(target) == package for target in targets), (module, sorted(targets))
