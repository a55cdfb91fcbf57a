"""No import cycles among agora's modules, and the node never imports the benchmarks.

Every import statement counts: at a module's top, inside a function, under TYPE_CHECKING. An
import moved into a function only to dodge a cycle still ties the two modules together (neither
can be read, tested or moved without the other), and the cycle comes back the day someone moves
it to the top. The graph is read from the source with `ast`, so it sees imports that never run and
costs no import. An edge goes to the module an import names (`from a.b import c`: a.b.c where c is
a module, else a.b), not to the packages Python runs on the way. The benchmarks import the roles
to start swarms (bench/); the node must never import them back.
"""

from __future__ import annotations

import ast
import configparser
from collections import deque
from pathlib import Path
from typing import Mapping

ROOT = Path(__file__).resolve().parents[2]


def package_folders(root: Path) -> dict[str, Path]:
    """Each installed package and its folder, from setup.cfg's package_dir (agora.node = node, ...)."""
    setup = configparser.ConfigParser()
    setup.read(root / "setup.cfg")
    lines = setup["options"]["package_dir"].strip().splitlines()
    return {name.strip(): root / folder.strip() for name, _, folder in (line.partition("=") for line in lines)}


def import_graph(packages: Mapping[str, Path]) -> dict[str, set[str]]:
    """Module name -> the modules of `packages` it imports anywhere in its source."""
    modules: dict[str, Path] = {}
    for package, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path

    def known(name: str) -> str | None:  # the module itself, or the nearest package of ours holding it
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: `from . import x` in a.b.c is a.b.x
                    anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.add(submodule if submodule in modules else known(base))
        graph[module] = {target for target in targets if target is not None and target != module}
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """One cycle per group of modules that import one another, as a path: [a, b, ..., a]."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = {stack.pop()}
            while module not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(_shortest_cycle(min(group), group, graph) for group in groups)


def _shortest_cycle(start: str, group: set[str], graph: Mapping[str, set[str]]) -> list[str]:
    came_from: dict[str, str] = {}
    frontier = deque([start])
    while frontier:
        module = frontier.popleft()
        for target in sorted(graph[module] & group):
            if target == start:
                path = [module]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return path[::-1] + [start]
            if target not in came_from:
                came_from[target] = module
                frontier.append(target)
    raise AssertionError(f"{start} is in a cyclic group but on no cycle")  # not for a strongly connected group


def imports_between(graph: Mapping[str, set[str]], importers: str, imported: str) -> list[tuple[str, str]]:
    """(module, target) for every import from package `importers` (or below) into `imported` (or below)."""
    def within(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    return sorted((module, target) for module, targets in graph.items() if within(module, importers)
                  for target in targets if within(target, imported))


def _described(found: list[list[str]]) -> str:
    return "; ".join(" -> ".join(cycle) for cycle in found)


def test_no_module_takes_part_in_an_import_cycle():
    graph = import_graph(package_folders(ROOT))
    assert "agora.node.cli" in graph["agora.node.__main__"]  # an import inside a function is seen
    found = cycles(graph)
    assert not found, f"import cycles: {_described(found)}"


def test_the_node_never_imports_the_benchmarks():
    graph = import_graph(package_folders(ROOT))
    assert imports_between(graph, "agora.bench", "agora.node")  # the other way round is how bench works
    assert imports_between(graph, "agora.node", "agora.bench") == []


def test_a_cycle_hidden_in_a_function_and_under_type_checking_is_found_and_named(tmp_path):
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "__init__.py").write_text("")
    (tmp_path / "fake" / "first.py").write_text("def later():\n    from agora.fake.second import thing\n")
    (tmp_path / "fake" / "second.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                                 "    from . import first\n\nthing = 1\n")
    (tmp_path / "fake" / "alone.py").write_text("import agora.fake.second\n")
    graph = import_graph({"agora.fake": tmp_path / "fake"})
    assert graph["agora.fake.second"] == {"agora.fake.first"}  # the relative import, resolved
    assert cycles(graph) == [["agora.fake.first", "agora.fake.second", "agora.fake.first"]]
    assert _described(cycles(graph)) == "agora.fake.first -> agora.fake.second -> agora.fake.first"


def test_a_node_module_importing_the_benchmarks_is_named(tmp_path):
    for folder in ("node", "bench"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "node" / "roles.py").write_text("def run():\n    from agora.bench.suite import main\n")
    (tmp_path / "bench" / "suite.py").write_text("def main():\n    pass\n")
    graph = import_graph({"agora.node": tmp_path / "node", "agora.bench": tmp_path / "bench"})
    assert imports_between(graph, "agora.node", "agora.bench") == [("agora.node.roles", "agora.bench.suite")]
