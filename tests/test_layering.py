"""The package's layering, read from the real imports: every import in `hfjax` (at module level or inside a
function) goes to the same unit (a top-level module or subpackage of `hfjax`) or to a unit of a lower layer, and no
chain of imports between modules comes back to where it started. `LAYERS` is where the order is written; the
architecture doc (docs/architecture.md) describes it. A ceiling beside it: no module over `MAX_MODULE_LINES` lines,
and at most `MAX_LOOSE_MODULES` modules loose at the package's top level."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hfjax"

# Bottom to top: a unit imports only units of the layers below its own (never a sibling of its layer).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("protocol", "typed_config", "user_code", "xla_settings", "lazy_names"),
    ("parallel",),
    ("models",),
    ("rollout", "data"),
    ("envs", "controller", "algos", "rewards", "optim", "records"),
    ("config",),
    ("workers", "predict"),
    ("trainer",),
    ("automap", "serve"),
    ("cli",),
)


MAX_MODULE_LINES = 450  # past this a module has more than one job: split it
MAX_LOOSE_MODULES = 5  # top-level modules outside any subpackage (`__init__` aside)


def modules(package: Path) -> dict[str, Path]:
    """Every module of `package` by dotted name (a package by its own name, from its `__init__.py`)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """The modules of `known` that module `name` imports (anywhere in it), with the line of each import. `from a
    import b` imports module `a.b` where that is a module, else (a name defined in `a`) module `a`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            if target in known and target != name:
                yield target, node.lineno


def unit(module: str) -> str:
    """The top-level module or subpackage of the package that `module` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layering_errors(package: Path, layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """What breaks the layering of `package` under `layers`: units without a layer, imports up or across the
    layers (`file:line: a imports b ...`), and cycles of module imports."""
    known = modules(package)
    level = {name: i for i, layer in enumerate(layers) for name in layer}
    errors = [
        f"{name}: in no layer of LAYERS" for name in sorted({unit(m) for m in known} - {package.name} - set(level))
    ]
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        graph[name] = set()
        for target, line in imports(name, path, known):
            graph[name].add(target)
            source_unit, target_unit = unit(name), unit(target)
            if source_unit in (target_unit, package.name) or target_unit == package.name:
                continue
            if source_unit in level and target_unit in level and level[target_unit] >= level[source_unit]:
                where = "up" if level[target_unit] > level[source_unit] else "across"
                errors.append(
                    f"{path.relative_to(package.parent)}:{line}: {name} imports {target}, {where} the layers "
                    f"({source_unit} is layer {level[source_unit]}, {target_unit} layer {level[target_unit]})"
                )
    errors += [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(graph)]
    return errors


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each back edge of a depth-first search of `graph` (none: the graph is acyclic)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    found = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_every_import_goes_down_the_layers_and_none_closes_a_cycle() -> None:
    errors = layering_errors(PACKAGE, LAYERS)
    assert not errors, "\n".join(errors)


def ceiling_errors(package: Path) -> list[str]:
    """The modules of `package` over `MAX_MODULE_LINES` lines, and its loose top-level modules when there are more
    than `MAX_LOOSE_MODULES`."""
    errors = [
        f"{path.relative_to(package.parent)}: {lines} lines (at most {MAX_MODULE_LINES})"
        for path in sorted(package.rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    loose = sorted(p.stem for p in package.glob("*.py") if p.name != "__init__.py")
    if len(loose) > MAX_LOOSE_MODULES:
        errors.append(f"{len(loose)} loose top-level modules (at most {MAX_LOOSE_MODULES}): {', '.join(loose)}")
    return errors


def test_no_module_is_over_the_ceiling_and_few_are_loose() -> None:
    errors = ceiling_errors(PACKAGE)
    assert not errors, "\n".join(errors)


def test_the_ceiling_catches_a_long_module_and_too_many_loose_ones(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (package / "sub" / "short.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    for i in range(MAX_LOOSE_MODULES):
        (package / f"loose{i}.py").write_text("")
    assert ceiling_errors(package) == [f"pkg/sub/long.py: {MAX_MODULE_LINES + 1} lines (at most {MAX_MODULE_LINES})"]
    (package / "one_more.py").write_text("")
    assert ceiling_errors(package)[1].startswith(f"{MAX_LOOSE_MODULES + 1} loose top-level modules")


def test_a_planted_upward_import_a_sibling_import_and_a_cycle_are_caught(tmp_path: Path) -> None:
    """The check itself: a small package with one import up the layers, one across a layer and a cycle."""
    package = tmp_path / "pkg"
    (package / "low").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "from pkg.low import b\n",
        "low/b.py": "def f():\n    from pkg.high import run  # lazily, still up\n",
        "side.py": "from pkg.low.a import *\nimport pkg.beside\n",
        "beside.py": "from . import low\n",
        "high.py": "run = print\n",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    (package / "low" / "b.py").write_text(files["low/b.py"] + "from .a import *\n")  # b -> a -> b
    errors = layering_errors(package, (("low",), ("side", "beside"), ("high",)))
    assert errors == [
        "pkg/low/b.py:2: pkg.low.b imports pkg.high, up the layers (low is layer 0, high layer 2)",
        "pkg/side.py:2: pkg.side imports pkg.beside, across the layers (side is layer 1, beside layer 1)",
        "import cycle: pkg.low.a -> pkg.low.b -> pkg.low.a",
    ]
    assert layering_errors(package, (("low",), ("side",), ("high",))) == [
        "beside: in no layer of LAYERS",
        *errors[:1],
        errors[2],
    ]
