"""The packages are layers in the order data flows (docs/layout.md): a module imports
only from its own package or the layers before it, so reading who imports whom goes checkpoint ->
module -> graph -> engine -> loop -> server; and no modules or packages import each other in a
circle. Imports inside functions, and those only type checkers read, count as much as top-level ones."""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]

LAYERS = ["common", "plugins", "modeling", "export", "runtime.backends", "runtime.decoding",
          "runtime.serving", "distill"]
# what users run or embed: CLIs, the modules Triton and Ray load, README's Python API
ENTRY = len(LAYERS)


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    if module.endswith("__main__"):
        return ENTRY
    for i, layer in reversed(list(enumerate(LAYERS))):
        if module == layer or module.startswith(layer + "."):
            return i
    entry = ("runtime", "bench")   # the CLIs, and the benchmarks that run them
    return ENTRY if any(module == e or module.startswith(e + ".") for e in entry) else -1


def _imports(path: Path, module: str, names: bool = False) -> set[str]:
    """The project's modules and packages that ``module`` imports; with ``names``, also
    ``package.name`` for each ``from package import name`` (a name that may be a module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found.add(base)
            if names:
                found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if _layer(name) >= 0}


SOURCES = [path for layer in ("common", "plugins", "modeling", "export", "runtime", "distill", "bench")
           for path in (ROOT / layer).rglob("*.py")]


def test_no_module_imports_from_a_layer_after_its_own():
    assert len(SOURCES) > 100
    upward = []
    for path in SOURCES:
        module = _module(path)
        for name in _imports(path, module):
            if _layer(name) > _layer(module):
                upward.append(f"{module} imports {name}")
    assert not upward, "\n".join(sorted(upward))


def _import_graph() -> nx.DiGraph:
    """Module -> the project's modules it imports (a name resolves to the longest module it names)."""
    modules = {_module(path): path for path in SOURCES}

    def resolved(name: str) -> str | None:
        parts = name.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        return ".".join(parts) or None

    graph = nx.DiGraph()
    for module, path in modules.items():
        for name in _imports(path, module, names=True):
            if (target := resolved(name)) not in (None, module):
                graph.add_edge(module, target)
    return graph


def _folder(module: str) -> str:
    """The package a module's file sits in (a package's ``__init__`` is its own)."""
    path = ROOT.joinpath(*module.split("."))
    return module if path.is_dir() else module.rpartition(".")[0]


def test_no_modules_import_each_other_in_a_circle():
    assert list(nx.simple_cycles(_import_graph())) == []


def test_no_packages_import_each_other_in_a_circle():
    """Between folders: a package and the packages inside it are one place, not a circle."""
    packages = nx.DiGraph()
    for a, b in _import_graph().edges:
        here, there = _folder(a), _folder(b)
        if not (here == there or here.startswith(there + ".") or there.startswith(here + ".")):
            packages.add_edge(here, there)
    assert len(packages) > 10
    assert list(nx.simple_cycles(packages)) == []


def test_the_layers_are_told_apart():
    """The rule above is only as good as the layer each name gets."""
    assert [_layer(m) for m in ("common.manifest", "plugins.moe.torch_op", "modeling.fixtures.tiny",
                                "export.build", "runtime.backends", "runtime.decoding.scheduler",
                                "runtime.serving.request_loop", "distill.loop")] == list(range(ENTRY))
    assert {_layer(m) for m in ("runtime", "runtime.serve", "runtime.generate", "export.__main__",
                                "distill.__main__", "bench", "bench.decoding")} == {ENTRY}
    assert _layer("torch") == _layer("onnxruntime") == -1
