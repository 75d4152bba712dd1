"""The package's shape: modules, lines, import arrows, modules over 500 lines, import circles.

    python scripts/layout_stats.py [ROOT]      (ROOT: a checkout, default the current one)

An arrow is an `import` or `from ... import` of another funcshard module anywhere in a module,
inside functions too (`from funcshard.comm import _mesh` is an arrow to the submodule); a
circle is a strongly connected set of two or more modules. tests/project/test_layout.py
keeps the limits.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

LINE_LIMIT = 500


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package under `root`."""
    files = {}
    for path in sorted((root / "funcshard").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path
    return files


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `name` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(package, node.module, node.level)
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
                break
    return found


def _absolute(package: str, module: str | None, level: int) -> str:
    if not level:
        return module or ""
    parts = package.split(".")[: len(package.split(".")) - level + 1]
    return ".".join(parts + ([module] if module else []))


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of two or more modules (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
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


def stats(root: Path) -> dict:
    files = module_files(root)
    graph = {name: imports_of(name, path, set(files)) for name, path in files.items()}
    lines = {name: len(path.read_text().splitlines()) for name, path in files.items()}
    return {
        "modules": len(files),
        "lines": sum(lines.values()),
        "arrows": sum(len(targets) for targets in graph.values()),
        "over_limit": sorted((n, name) for name, n in lines.items() if n > LINE_LIMIT),
        "circles": circles(graph),
    }


def main() -> None:
    found = stats(Path(sys.argv[1] if len(sys.argv) > 1 else "."))
    print(f"modules: {found['modules']}  lines: {found['lines']}  arrows: {found['arrows']}")
    print(f"modules over {LINE_LIMIT} lines: {len(found['over_limit'])}")
    for n, name in found["over_limit"]:
        print(f"  {name}: {n}")
    print(f"import circles: {len(found['circles'])}")
    for circle in found["circles"]:
        print("  " + " <-> ".join(circle))


if __name__ == "__main__":
    main()
