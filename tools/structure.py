"""The structural check of `make lint`: file sizes and import circles between files.

Two rules of docs/architecture.md that import-linter's package-level contracts do not cover:

* a product file (fleetrl/ broker/ hub/ rollout/ trainer/ regions/) or a bench file holds at most
  MAX_LINES lines: past that it holds more than one idea, and the seam is there to find;
* no import circle between files: no file imports (at module level or inside a function) a file that,
  directly or through others, imports it back.

The layering (who may import whom, DESIGN.md §2) is import-linter's job (`lint-imports`, contracts in
pyproject.toml). This script reads the sources with `ast` only: it imports nothing of FleetRL, so it
runs before the install and cannot be fooled by an import-time side effect.

An import is an edge to the file that defines the imported module: `from fleetrl.hub import codec`
goes to hub/codec.py when that file exists, else to hub/__init__.py; `import fleetrl.hub.codec` goes
to hub/codec.py. The package `__init__.py` that Python runs on the way is not an edge (every file of a
package would otherwise sit in a circle with an `__init__.py` that re-exports it). Imports under
`if TYPE_CHECKING:` are edges too: a circle that only type checking closes still says that two files
hold one idea between them (and mypy resolves it by import order). bench/ files import each other as
`bench.<name>` or by bare `<name>` (the script's own folder is on sys.path when a bench runs).

Usage: python tools/structure.py [ROOT]   exit 0 when clean, 1 with one line per finding.
"""

from __future__ import annotations

import ast
import pathlib
import sys
from collections.abc import Iterator

MAX_LINES = 500
# Folder -> the import name it installs under (pyproject.toml's [tool.setuptools.package-dir]).
PACKAGES = {
    "fleetrl": "fleetrl",
    "broker": "fleetrl.broker",
    "hub": "fleetrl.hub",
    "rollout": "fleetrl.rollout",
    "trainer": "fleetrl.trainer",
    "regions": "fleetrl.regions",
}
BENCH = "bench"


def module_files(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Every checked file by its dotted module name (a package's `__init__.py` by the package's)."""
    modules: dict[str, pathlib.Path] = {}
    for folder, name in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((name, *parts))] = path
    for path in sorted((root / BENCH).glob("*.py")):
        modules[f"{BENCH}.{path.stem}"] = path
    return modules


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of a file: module level, in functions, under `if TYPE_CHECKING:`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative imports resolved against `module`)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    drop = node.level - 1 if is_package else node.level
    base = base[: len(base) - drop] if drop else base
    return ".".join([*base, node.module] if node.module else base)


def _resolve(name: str, modules: dict[str, pathlib.Path], bench: bool) -> str | None:
    """The checked module `name` refers to, or None when it is outside the checked tree."""
    if name in modules:
        return name
    if bench and f"{BENCH}.{name}" in modules:
        return f"{BENCH}.{name}"
    return None


def imports_of(module: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The checked modules that `module` imports at run time."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bench = module.startswith(f"{BENCH}.")
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = _absolute(module, is_package, node)
            # `from pkg import name`: the submodule pkg.name when it is a file, else pkg itself.
            targets = [f"{base}.{alias.name}" if _resolve(f"{base}.{alias.name}", modules, bench) else base
                       for alias in node.names]
        for target in targets:
            resolved = _resolve(target, modules, bench)
            if resolved is not None and resolved != module:
                found.add(resolved)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def findings(root: pathlib.Path) -> list[str]:
    """One line per file over MAX_LINES and per import circle; empty when the tree is in order."""
    modules = module_files(root)
    lines: list[str] = []
    for path in modules.values():
        count = len(path.read_text().splitlines())
        if count > MAX_LINES:
            lines.append(f"{path.relative_to(root)}: {count} lines (at most {MAX_LINES}): split it at its seam")
    graph = {module: imports_of(module, path, modules) for module, path in modules.items()}
    for component in circles(graph):
        files = " <-> ".join(str(modules[m].relative_to(root)) for m in component)
        lines.append(f"import circle: {files}")
    return lines


def main(argv: list[str]) -> int:
    root = pathlib.Path(argv[1] if len(argv) > 1 else ".").resolve()
    problems = findings(root)
    for line in problems:
        print(line)
    if problems:
        print(f"structure: {len(problems)} finding(s) (tools/structure.py; docs/architecture.md)")
        return 1
    print(f"structure: {len(module_files(root))} files, none over {MAX_LINES} lines, no import circle")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
