"""Layering: root daemons do not import the command line's package, and no two parts import each other.

The graph is read from the sources (ast), with every import counted, those inside functions too (a
lazy import is a dependency all the same); only imports under `if TYPE_CHECKING:` are left out.
"""

from __future__ import annotations

import ast
import tomllib
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "singularity_slurm"
ROOT_DAEMONS = ("node", "prolog", "epilog", "proxy", "checkpoint", "coordinator")


@cache
def modules() -> dict[str, Path]:
    """Module name -> source file, through pyproject's package-dir mapping."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found: dict[str, Path] = {}
    for package, folder in sorted(mapping.items(), key=lambda item: len(item[0])):
        for source in sorted((ROOT / folder).rglob("*.py")):
            parts = list(source.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = source  # a longer package's own mapping wins
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return skipped


def imported_names(name: str, source: Path) -> set[str]:
    tree = ast.parse(source.read_text(), str(source))
    skipped = _type_checking_only(tree)
    package = name.split(".") if source.name == "__init__.py" else name.split(".")[:-1]
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names.update(f"{base}.{alias.name}" for alias in node.names)
            names.add(base)
    return {n for n in names if n.startswith(PACKAGE + ".")}


def resolve(name: str) -> str | None:
    """The project module an imported name is or lives in."""
    known = modules()
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name if name and name != PACKAGE else None


@cache
def graph() -> dict[str, frozenset[str]]:
    out: dict[str, frozenset[str]] = {}
    for name, source in modules().items():
        targets = {resolve(n) for n in imported_names(name, source)} - {None, name}
        # `from pkg import module` also names the package itself: only the module counts
        out[name] = frozenset(t for t in targets if not any(o.startswith(t + ".") for o in targets))
    return out


def part(module: str) -> str:
    """The part of the project a module belongs to: `node`, `proxy`, `rpc`, `slurm_plugin`..."""
    return module.split(".")[1] if module.count(".") else module


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_the_known_dependencies() -> None:
    """A guard against a reader that finds nothing: these edges exist on purpose."""
    g = graph()
    assert f"{PACKAGE}.rpc" in g[f"{PACKAGE}.node.agent"]
    assert f"{PACKAGE}.slurmcli" in g[f"{PACKAGE}.node.engine"]
    assert f"{PACKAGE}.node.engine" in g[f"{PACKAGE}.node.agent"]  # lazy, inside main()
    assert f"{PACKAGE}.node.agent" in g[f"{PACKAGE}.slurm_plugin.launcher"] or \
        f"{PACKAGE}.rpc" in g[f"{PACKAGE}.slurm_plugin.launcher"]


def test_root_daemons_do_not_import_the_command_lines_package() -> None:
    offending = sorted(f"{module} imports {target}" for module, targets in graph().items()
                       if part(module) in ROOT_DAEMONS
                       for target in targets if part(target) == "slurm_plugin")
    assert offending == []


def test_no_two_parts_of_the_project_import_each_other() -> None:
    edges: dict[str, set[str]] = {}
    for module, targets in graph().items():
        for target in targets:
            if part(module) != part(target):
                edges.setdefault(part(module), set()).add(part(target))
    assert cycles(edges) == []


def test_no_modules_import_each_other() -> None:
    edges = {module: set(targets) for module, targets in graph().items()}
    assert cycles(edges) == []


def test_the_rpc_layer_and_the_slurm_client_sit_below_every_daemon_and_the_command_line() -> None:
    above = {*ROOT_DAEMONS, "slurm_plugin", "devcluster"}
    g = graph()
    assert {part(t) for t in g[f"{PACKAGE}.rpc"]} & above == set()
    assert {part(t) for t in g[f"{PACKAGE}.slurmcli"]} & above == set()
    assert {t for t in g[f"{PACKAGE}.rpc"] if part(t) == "interpose"} <= {
        f"{PACKAGE}.interpose.pyhook._singularity_worker.wire"}


def test_cycles_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
