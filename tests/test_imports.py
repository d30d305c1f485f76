"""The import graph of ``src/specdecode``, read statically: the command line sits on top, no circles.

Every ``.py`` file under ``src/specdecode`` is parsed with :mod:`ast` (nothing is imported) and
every ``import specdecode...`` / ``from specdecode... import ...`` in it, at any depth (inside
functions too: the lazy imports that keep ``--help`` cheap are imports all the same), becomes an
edge to the module it names: ``from specdecode.bench import prompts`` -> ``specdecode.bench.prompts``
(a submodule), ``from specdecode.proposers import PROPOSERS`` -> ``specdecode.proposers`` (the
package's ``__init__``). Not modelled: that importing ``a.b.c`` first runs the ``__init__`` of ``a``
and ``a.b`` (with those edges every module would reach the engine through ``specdecode/__init__.py``,
and each proposer would reach the registry in ``proposers/__init__.py`` that imports it), and
imports by name at run time (``importlib``: ``commands/main.py`` imports each command's module so,
from ``commands/registry.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "specdecode"
COMMANDS = "specdecode.commands"


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module and package of ``src/specdecode``."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _known(name: str, modules: dict[str, Path]) -> str:
    """The longest prefix of ``name`` that is a module of ours (a name inside a module -> the module)."""
    while name not in modules and "." in name:
        name = name.rpartition(".")[0]
    return name


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``specdecode`` that module ``name`` (at ``path``) imports, anywhere in its code."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(_known(alias.name, modules) for alias in node.names if alias.name.startswith("specdecode"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if base == "specdecode" or base.startswith("specdecode."):
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    found.add(submodule if submodule in modules else _known(base, modules))
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ``specdecode`` it imports."""
    modules = module_files()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def unit(module: str) -> str:
    """The subpackage or top-level module a module belongs to: ``specdecode.bench.runner`` ->
    ``specdecode.bench``, ``specdecode.engine`` -> itself."""
    return ".".join(module.split(".")[:2])


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between subpackages and top-level modules (imports within one left out)."""
    units: dict[str, set[str]] = {unit(m): set() for m in graph}
    for module, targets in graph.items():
        units[unit(module)].update(unit(t) for t in targets if unit(t) != unit(module))
    return units


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected components of two or more nodes
    (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
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


def describe(graph: dict[str, set[str]], component: list[str]) -> str:
    """The edges of one circle, for a failure message."""
    members = set(component)
    return "; ".join(f"{m} -> {t}" for m in component for t in sorted(graph[m] & members))


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = import_graph()
    assert "specdecode.commands.main" in graph and "specdecode.engine" in graph
    assert "specdecode.commands.registry" in graph["specdecode.commands.main"]  # from a module import a name
    assert "specdecode.engine" in graph["specdecode.commands.generate"]  # inside a function
    assert "specdecode.proposers" in graph["specdecode.commands.common"]  # a package's __init__
    assert "specdecode.drafters.heads" in graph["specdecode.drafters"]  # an __init__'s own imports
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_library_module_imports_the_command_line() -> None:
    graph = import_graph()
    offenders = {
        module: sorted(t for t in targets if unit(t) == COMMANDS)
        for module, targets in graph.items()
        if unit(module) != COMMANDS and any(unit(t) == COMMANDS for t in targets)
    }
    assert offenders == {}, "the library must not import specdecode.commands"


def test_no_import_circle_between_modules() -> None:
    """Stronger than "none through the commands": no circle anywhere in the module graph."""
    graph = import_graph()
    assert [describe(graph, c) for c in cycles(graph)] == []


def test_no_import_circle_between_subpackages() -> None:
    """Collapsed to subpackages and top-level modules (``bench``, ``serve``, ``drafters``, ``proposers``,
    ``models``, ``commands``, ``engine``, ``calibrate``, ``token_map``, ...), still no circle: e.g. the
    commands import ``bench``, and nothing in ``bench`` reaches back to the commands."""
    units = unit_graph(import_graph())
    assert COMMANDS in units and not any(COMMANDS in targets for targets in units.values())
    assert [describe(units, c) for c in cycles(units)] == []


def test_importing_the_package_loads_neither_torch_nor_the_engine() -> None:
    """``import specdecode`` (and a light submodule) must not pay for torch: the top-level names
    load on first use; every exported name then resolves to the class it names."""
    import subprocess
    import sys

    code = (
        "import sys, specdecode, specdecode.stop_strings\n"
        "print(sorted(m for m in ('torch', 'transformers', 'specdecode.engine') if m in sys.modules))\n"
        "names = [getattr(specdecode, n).__name__ for n in specdecode.__all__]\n"
        "print(names == specdecode.__all__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]", f"imported eagerly: {out[0]}"
    assert out[1] == "True", "an exported name does not resolve to the class of that name"


MODEL_CODE = ("transformers.modeling_utils", "transformers.cache_utils", "transformers.masking_utils")
"""transformers' model code: ~3 s of a command's start-up on 2 cores, which the llama.cpp backend never runs."""


def test_the_llamacpp_path_imports_no_transformers_model_code() -> None:
    """The command line's parser, the engine, the proposers' registry, the loader, the server, the
    bench and the llama.cpp backend import none of :data:`MODEL_CODE` (the default backend reads only
    a tokenizer from transformers); the torch backend imports it when it loads a model."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from specdecode.commands.main import build_parser\n"
        "build_parser()\n"
        "import specdecode.engine, specdecode.proposers, specdecode.load, specdecode.models.llamacpp.model\n"
        "import specdecode.serve.server, specdecode.bench.methods, specdecode.cost.measure\n"
        f"print(sorted(m for m in {MODEL_CODE!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]", f"imported on the llama.cpp path: {out[0]}"
