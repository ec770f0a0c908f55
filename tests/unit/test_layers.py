"""The house rules of docs/architecture.md, checked on the source: layers and cycles.

Every import in the project's modules counts, at the top of a file or inside a function.
A module may import modules of its own package and of packages in lower layers only, and
the module import graph has no cycle.  (That offline planning never loads torch is checked
in a fresh interpreter by tests/e2e/test_offline_imports.py.)
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]
# Source folder -> installed package name (pyproject.toml's package-dir).
SOURCES = {"autopar": "autopar", "passes": "autopar.passes", "cost": "autopar.cost"}
# Package -> layer; imports go from a higher layer to a strictly lower one (docs/architecture.md).
LAYERS = {
    "autopar.errors": 0, "autopar.error_report": 0, "autopar.plan": 0, "autopar.plan_checks": 0,
    "autopar.plan_text": 0, "autopar.plan_space": 0, "autopar.support": 0, "autopar.compat": 0,
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
BASE = {"autopar.errors", "autopar.error_report", "autopar.plan", "autopar.plan_checks", "autopar.plan_text",
        "autopar.plan_space", "autopar.support", "autopar.compat"}


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


# ----------------------------------------------------------------------------- narrow interfaces
MODULE_FILE = ROOT / "autopar" / "runtime" / "module.py"
# Every Python folder of the project: product code, benchmarks, examples and the suite itself.
EVERY_FOLDER = ("autopar", "passes", "cost", "benchmarks", "examples", "tests")


def _private_fields() -> set[str]:
    """ParallelModule's private names: the methods and ``self._x`` attributes its class defines."""
    tree = ast.parse(MODULE_FILE.read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "ParallelModule")
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)
              and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private_reads(path: Path, fields: set[str]) -> list[str]:
    """``pm._x`` anywhere, and ``obj._x`` for a private field of ParallelModule on anything but ``self``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        owner = node.value.id if isinstance(node.value, ast.Name) else None
        if owner == "pm" or (node.attr in fields and owner != "self"):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    return out


def test_nothing_outside_the_module_file_reads_a_parallel_modules_private_fields():
    """ParallelModule is assembled from parts with narrow interfaces (RankParameters, LossSplit,
    StepEnvironment): the weights modules, the executors and everything else take those parts,
    never the module's private state."""
    fields = _private_fields()
    assert {"_norm_weights", "_begin"} <= fields  # the check sees the class it guards
    bad = [hit for folder in EVERY_FOLDER for path in sorted((ROOT / folder).rglob("*.py"))
           if path != MODULE_FILE for hit in _private_reads(path, fields)]
    assert not bad, "private fields of ParallelModule read outside autopar/runtime/module.py:\n" + "\n".join(bad)


def test_the_private_read_check_can_fail(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f(pm, other, self):\n    return pm._aliases, other._begin, self._begin, pm.plan\n")
    rel = Path(src.relative_to(tmp_path))
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert _private_reads(src, {"_begin"}) == [f"{rel}:2: ._aliases", f"{rel}:2: ._begin"]
    finally:
        ROOT = saved


def _test_imports(path: Path) -> list[str]:
    """Imports of the test suite (``tests`` or ``tests.*``), and jobs named by a ``tests.`` module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if re.fullmatch(r"tests(\.\w+)+:\w+", node.value) else []
        out += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n == "tests" or n.startswith("tests.")]
    return out


def test_product_code_and_benchmarks_never_import_the_tests():
    """The engines the benchmarks share with the suite (the scale simulation, the zoo, the small
    models, the local launcher) live in the package or in benchmarks/, never in tests/."""
    bad = [hit for folder in ("autopar", "passes", "cost", "benchmarks")
           for path in sorted((ROOT / folder).rglob("*.py")) for hit in _test_imports(path)]
    assert not bad, "imports of tests/ from product code or benchmarks:\n" + "\n".join(bad)
