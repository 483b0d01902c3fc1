"""The package's shape, read from its source with ``ast`` (nothing imported): no import cycle,
no import upward across the layers docs/ARCHITECTURE.md names, no function over 80 lines, and
no GPU script or benchmark importing a name its neighbour module does not define."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "purlinc"

# Lowest first; a module may import its own layer and those below it.  The longest prefix
# decides a module's layer (``purlinc`` itself is the public front, forwarding to the runtime).
LAYERS = (
    ("base", ("purlinc.errors", "purlinc.registry", "purlinc.settings", "purlinc.dtypes", "purlinc.resources",
              "purlinc.version", "purlinc.log", "purlinc.cachefiles", "purlinc.jsontext")),
    ("frontend", ("purlinc.frontend",)),
    ("snac", ("purlinc.snac",)),
    ("atom", ("purlinc.atom",)),
    ("pipeline", ("purlinc.pipeline", "purlinc.concurrent", "purlinc.checkjobs")),
    ("draw", ("purlinc.draw",)),
    ("runtime", ("purlinc.runtime",)),
    ("front", ("purlinc", "purlinc.__main__", "purlinc.cli", "purlinc.torch")),
)
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _owner(name: str, modules) -> str:
    """The module ``name`` is, or is defined in (``purlinc.x.f`` -> ``purlinc.x``)."""
    while name not in modules:
        name = name.rpartition(".")[0]
    return name


def _imported(name: str, path: Path, modules) -> set[str]:
    """Every purlinc module ``name`` imports, at the top or inside a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(_owner(a.name, modules) for a in node.names if a.name.split(".")[0] == "purlinc")
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = (base + "." + node.module if node.module else base) if node.level else node.module
            if module.split(".")[0] != "purlinc":
                continue
            for alias in node.names:  # ``from purlinc.x import y``: y may be a module of its own
                full = f"{module}.{alias.name}"
                found.add(full if full in modules else _owner(module, modules))
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def _layer(name: str) -> int:
    best = (-1, -1)
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best[1]:
                best = (index, len(prefix))
    assert best[0] >= 0, f"{name} belongs to no layer: add it to LAYERS and to docs/ARCHITECTURE.md"
    return best[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
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
                    work.append((child, iter(sorted(graph.get(child, ())))))
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


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_upward_import():
    upward = [f"{a} ({LAYERS[_layer(a)][0]}) imports {b} ({LAYERS[_layer(b)][0]})"
              for a, targets in sorted(_graph().items()) for b in sorted(targets) if _layer(b) > _layer(a)]
    assert upward == []


def test_layers_read_the_way_the_architecture_guide_says():
    assert _layer("purlinc.snac.verify") < _layer("purlinc.atom.codegen") < _layer("purlinc.runtime.loader")
    assert _layer("purlinc.frontend.check") < _layer("purlinc.snac.ir")
    assert _layer("purlinc.cli.dump") == _layer("purlinc.torch.ops") > _layer("purlinc.runtime.collective")
    assert _layer("purlinc.errors") == 0


def _long_functions(tree: ast.AST) -> list[tuple[int, str, int]]:
    """(line, name, length) of every function (nested ones too) longer than the limit; a
    function's length runs from its first decorator to its last line."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = node.end_lineno - start + 1
            if length > MAX_FUNCTION_LINES:
                found.append((node.lineno, node.name, length))
    return found


def test_no_function_over_80_lines():
    long = [f"{path.relative_to(PACKAGE.parent)}:{line} {name} ({length} lines)"
            for path in sorted(PACKAGE.rglob("*.py"))
            for line, name, length in _long_functions(ast.parse(path.read_text(encoding="utf-8")))]
    assert long == []


def test_the_length_check_counts_lines():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert _long_functions(ast.parse(f"def f():\n{body}\n")) == [(1, "f", MAX_FUNCTION_LINES + 1)]
    assert _long_functions(ast.parse("def g():\n    return 1\n")) == []


# Scripts that import from their neighbours by plain module name (tests/gpu puts its own folder
# on sys.path; the benchmarks put theirs and tests/gpu): a GPU-only script is never imported on
# the CPU, so a name a refactor removed from its neighbour would otherwise surface first on a
# GPU machine.
SCRIPT_FOLDERS = ("tests/gpu", "benchmarks", "benchmarks/e2e")


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def _missing_neighbour_names(folder: Path, search: tuple[Path, ...] = ()) -> list[str]:
    """Names the scripts in ``folder`` import from a module of ``folder`` or of ``search``
    (first match, their own folder first) that the module does not define."""
    missing = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module or "." in node.module:
                continue
            neighbour = next((f / f"{node.module}.py" for f in (folder, *search) if (f / f"{node.module}.py").exists()),
                             None)
            if neighbour is None:
                continue
            defined = _top_level_names(neighbour)
            missing += [f"{path.name}:{node.lineno}: {node.module} has no {alias.name}"
                        for alias in node.names if alias.name != "*" and alias.name not in defined]
    return missing


def test_scripts_import_only_what_their_neighbours_define():
    folders = tuple(PACKAGE.parent / f for f in SCRIPT_FOLDERS)
    missing = [m for folder in folders for m in _missing_neighbour_names(folder, folders)]
    assert not missing, "\n".join(missing)


def test_the_neighbour_import_check_finds_a_missing_name(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "helper.py").write_text("A = 1\ndef f():\n    pass\n")
    (tmp_path / "a" / "user.py").write_text("from helper import A, f, gone\n")
    (tmp_path / "b" / "other.py").write_text("from helper import A, missing\nfrom os import nothing_checked\n")
    assert _missing_neighbour_names(tmp_path / "a") == ["user.py:1: helper has no gone"]
    assert _missing_neighbour_names(tmp_path / "b", (tmp_path / "a",)) == ["other.py:1: helper has no missing"]
