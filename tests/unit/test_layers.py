"""The house rules of docs/architecture.md, checked on the source: layers and cycles.

Every import in the project's modules counts, at the top of a file or inside a function.
A module may import modules of its own package and of packages in lower layers only, and
the module import graph has no cycle.  (That offline planning never loads torch is checked
in a fresh interpreter by tests/e2e/test_offline_imports.py.)
"""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]
# Source folder -> installed package name (pyproject.toml's package-dir).
SOURCES = {"autopar": "autopar", "passes": "autopar.passes", "cost": "autopar.cost"}
# Package -> layer; imports go from a higher layer to a strictly lower one (docs/architecture.md).
LAYERS = {
    "autopar.errors": 0, "autopar.error_report": 0, "autopar.plan": 0, "autopar.plan_space": 0, "autopar.support": 0, "autopar.compat": 0,
    "autopar.frontend": 1,
    "autopar.cost": 2, "autopar.ops": 2,
    "autopar.passes": 3,
    "autopar.planning": 4, "autopar.views": 4,
    "autopar.runtime": 5,
    "autopar.verification": 6,
    "autopar.cli": 7,
    "autopar": 8,  # the package's __init__: public names, imported lazily
}
# Modules of layer 0 form one group: plan and support may use errors (no cycle is still checked).
BASE = {"autopar.errors", "autopar.error_report", "autopar.plan", "autopar.plan_space", "autopar.support", "autopar.compat"}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def _package(module: str) -> str:
    """The unit a layer is assigned to: ``autopar.<sub>`` for sub-packages, else the module."""
    parts = module.split(".")
    candidate = ".".join(parts[:2])
    return candidate if candidate in LAYERS else "autopar"


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_pkg else base[:-1]
                base = base[:len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
        for name in names:
            # The longest project module the import names (``from autopar.ops import collectives``).
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def _graph() -> nx.DiGraph:
    mods = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(mods)
    for module, path in mods.items():
        for target in _imports(module, path, set(mods)):
            graph.add_edge(module, target)
    return graph


def _cycle_free(graph: nx.DiGraph) -> nx.DiGraph:
    # A package's __init__ re-exporting its own modules is the package, not a cycle through it.
    return nx.DiGraph((a, b) for a, b in graph.edges if not (b == a.rpartition(".")[0] and a.startswith(b + ".")))


def test_no_import_cycles():
    cycles = list(nx.simple_cycles(_cycle_free(_graph())))
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_imports_follow_the_layer_order():
    bad = []
    for a, b in _graph().edges:
        pa, pb = _package(a), _package(b)
        if pa == pb or (pa in BASE and pb in BASE):
            continue
        if LAYERS[pa] <= LAYERS[pb]:
            bad.append(f"{a} (layer {LAYERS[pa]}) imports {b} (layer {LAYERS[pb]})")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_every_module_has_a_layer():
    assert all(_package(m) in LAYERS for m in _modules())


def test_the_checker_sees_imports_inside_functions(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from autopar.runtime import parallelize\n    from .x import y\n")
    assert _imports("autopar.cost.m", src, {"autopar.runtime", "autopar.cost.x"}) == {"autopar.runtime",
                                                                                   "autopar.cost.x"}
