"""The package's import structure: layers as DESIGN.md draws them, and no cycle.

Every module under ``src/flashfold`` is parsed (nothing is imported or run); each
``import`` and ``from ... import`` is resolved to the module it loads (relative imports
against the importing module's package; ``from P import name`` is ``P.name`` when that is
a module, else ``P``), at module level and inside functions alike, and literal
``importlib.import_module("...")`` calls count too. Importing ``P.Q`` also runs
``P/__init__.py``; that implicit edge is not drawn.

Layers, each importing only itself and the ones below it:

=====  ===============================================================================
0      algebra: ``algebra/``, the built-in monoids ``monoids.py``, the ``ops`` namespace
       and the example monoids ``examples.py``
1      schedules: ``schedules/`` (reference executors on NumPy)
2      kernels: ``kernels/`` (Triton lowering, attention kernels, their references)
3      api: ``api/``, ``distributed/``, ``dask.py``, ``integrations/``, ``mods.py``
4      cli: ``cli.py`` and the command features ``bench.py``, ``error_analysis.py``
5      the face: ``flashfold/__init__.py`` (re-exports every layer, some on first use),
       and ``testing.py`` (tolerances and assertions for tests, the fuzz suite and the
       benchmarks); no module of the package imports either
=====  ===============================================================================

Asserted, with the full list of what is found on failure:

* no upward import, at module level or inside a function;
* no import cycle among module-level imports, nor through function-level ones (a
  function importing a module that imports it back runs, but ties the two together);
* no import made only for its side effect (a name bound and never read, outside an
  ``__init__.py``): nothing registers at import;
* no private name (``_name``) taken from another part of the package (``api/``,
  ``kernels/``, ...): what several parts share is public in a module they all import;
* no module global assigned by another module (``launch.num_sms = ...``): a value a
  function depends on is passed to it.

With them, the face's own rules: ``import flashfold`` (and a NumPy scan or fold) loads no
torch, Triton, SymPy or matplotlib, and ``flashfold.scan`` dispatches on the input's type.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "flashfold"

#: module (or package) -> layer; a module takes the layer of its longest listed prefix
LAYERS = {
    "flashfold.algebra": 0, "flashfold.monoids": 0, "flashfold.ops": 0,
    "flashfold.examples": 0,
    "flashfold.schedules": 1,
    "flashfold.kernels": 2,
    "flashfold.api": 3, "flashfold.distributed": 3, "flashfold.dask": 3,
    "flashfold.integrations": 3, "flashfold.mods": 3,
    "flashfold.cli": 4, "flashfold.bench": 4, "flashfold.error_analysis": 4,
    "flashfold": 5, "flashfold.testing": 5,
}
LAYER_NAMES = {0: "algebra", 1: "schedules", 2: "kernels", 3: "api", 4: "cli", 5: "face"}


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    toplevel: bool          # False: inside a function body
    names: tuple            # names bound by the import (for the side-effect check)
    taken: str = ""         # ``from M import taken``: the name taken from module ``M``


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def layer_of(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def _resolve(module: str, is_pkg: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _internal(name: str) -> str | None:
    """The package module that ``import name`` loads (the longest existing prefix)."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in MODULES:
            return cand
        parts.pop()
    return None


class _Walker(ast.NodeVisitor):
    def __init__(self, module: str, is_pkg: bool):
        self.module, self.is_pkg = module, is_pkg
        self.depth = 0
        self.edges: list[Edge] = []

    def _add(self, name: str, node, bound: tuple, taken: str = ""):
        if not (name == PACKAGE or name.startswith(PACKAGE + ".")):
            return
        dst = _internal(name)
        if dst is not None and dst != self.module:
            self.edges.append(Edge(self.module, dst, node.lineno, self.depth == 0, bound,
                                   taken))

    def _scoped(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _scoped

    def visit_Import(self, node):
        for a in node.names:
            self._add(a.name, node, (a.asname or a.name.split(".")[0],))

    def visit_ImportFrom(self, node):
        base = _resolve(self.module, self.is_pkg, node.level, node.module)
        for a in node.names:
            sub = f"{base}.{a.name}"
            if sub in MODULES:
                self._add(sub, node, (a.asname or a.name,))
            else:
                self._add(base, node, () if a.name == "*" else (a.asname or a.name,),
                          taken=a.name)

    def visit_Call(self, node):
        f = node.func
        fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        if fname == "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            text = node.args[0].value
            level = len(text) - len(text.lstrip("."))
            name = _resolve(self.module, self.is_pkg, level, text[level:] or None) \
                if level else text
            self._add(name, node, ())
        self.generic_visit(node)


def _parse(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text(encoding="utf-8"), str(MODULES[module]))


def import_edges() -> list[Edge]:
    edges = []
    for module, path in MODULES.items():
        w = _Walker(module, path.name == "__init__.py")
        w.visit(_parse(module))
        edges += w.edges
    return edges


EDGES = import_edges()


def _area(module: str) -> str:
    """The part of the package a module belongs to: ``flashfold.kernels`` for every module
    under ``kernels/``, the module itself for a top-level file (``flashfold.cli``)."""
    return ".".join(module.split(".")[:2])


def _merged(edges) -> list[tuple[Edge, tuple]]:
    """One entry per import statement and target: ``(edge, names taken)``."""
    out: dict[tuple, list] = {}
    for e in edges:
        out.setdefault((e.src, e.line, e.dst, e.toplevel), [e, []])[1] += [e.taken] * bool(e.taken)
    return [(e, tuple(names)) for e, names in out.values()]


def _where(e: Edge, names=()) -> str:
    rel = MODULES[e.src].relative_to(SRC)
    what = f" ({', '.join(names)})" if names else ""
    return f"{rel}:{e.line}: {e.src} -> {e.dst}{what}" + ("" if e.toplevel else " [in a function]")


def upward_imports(edges=EDGES) -> list[str]:
    return [f"{_where(e, n)}: {LAYER_NAMES[layer_of(e.src)]} imports "
            f"{LAYER_NAMES[layer_of(e.dst)]}"
            for e, n in _merged(edges) if layer_of(e.dst) > layer_of(e.src)]


def cycles(edges) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set] = {}
    for e in edges:
        graph.setdefault(e.src, set()).add(e.dst)
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _describe_cycle(comp, edges) -> str:
    inside = [(e, n) for e, n in _merged(edges) if e.src in comp and e.dst in comp]
    return "cycle of " + ", ".join(comp) + ":\n" + "\n".join("    " + _where(e, n)
                                                              for e, n in inside)


def side_effect_imports(edges=EDGES) -> list[str]:
    """Imports (outside ``__init__.py``) whose bound names the module never reads."""
    out = []
    for module in MODULES:
        if MODULES[module].name == "__init__.py":
            continue
        tree = _parse(module)
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {"__all__"}
        for n in ast.walk(tree):
            if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__"
                                                 for t in n.targets):
                used |= {c.value for c in ast.walk(n.value) if isinstance(c, ast.Constant)}
        for e, n in _merged(e for e in edges if e.src == module):
            bound = {b for x in edges if (x.src, x.line, x.dst) == (e.src, e.line, e.dst)
                     for b in x.names}
            if bound and not bound & used:
                out.append(f"{_where(e, n)}: binds {', '.join(sorted(bound))}, never read")
    return out


def private_names_across_packages(edges=EDGES) -> list[str]:
    """``from M import _name`` where ``M`` lies in another part of the package (``api/``
    taking a private helper of ``kernels/``, ``distributed/`` one of ``api/``): a helper
    that several parts share is public in a module they all import."""
    return [f"{_where(e, n)}: private to {_area(e.dst)}"
            for e, n in _merged(edges)
            if any(t.startswith("_") and not t.startswith("__") for t in n)
            and _area(e.src) != _area(e.dst)]


def globals_assigned_from_outside() -> list[str]:
    """``M.name = value`` (or ``setattr(M, ...)``) where ``M`` is an imported module of the
    package: a module's global patched by another module; pass the value instead."""
    out = []
    for module in MODULES:
        tree = _parse(module)
        bound = {n: e.dst for e in EDGES if e.src == module and not e.taken for n in e.names}
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            hits = [(t.value.id, t.attr) for tg in targets for t in ast.walk(tg)
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                    and t.value.id in bound]
            if (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr"
                    and node.args and isinstance(node.args[0], ast.Name)
                    and node.args[0].id in bound):
                hits.append((node.args[0].id, "(setattr)"))
            for alias, attr in hits:
                rel = MODULES[module].relative_to(SRC)
                out.append(f"{rel}:{node.lineno}: {module} assigns {bound[alias]}.{attr}")
    return out


def violations() -> dict[str, list[str]]:
    top = [e for e in EDGES if e.toplevel]
    top_cycles = cycles(top)
    fn_cycles = [c for c in cycles(EDGES) if c not in top_cycles]
    return {
        "upward imports": upward_imports(),
        "module-level import cycles": [_describe_cycle(c, top) for c in top_cycles],
        "import cycles through function-level imports": [_describe_cycle(c, EDGES)
                                                         for c in fn_cycles],
        "imports for a side effect": side_effect_imports(),
        "private names taken across packages": private_names_across_packages(),
        "module globals assigned from another module": globals_assigned_from_outside(),
    }


def _report(found: dict[str, list[str]]) -> str:
    lines = []
    for kind, items in found.items():
        lines.append(f"{kind}: {len(items)}")
        lines += ["  " + i for i in items]
    return "\n".join(lines)


def test_the_walker_sees_the_package():
    """Sanity: every module is parsed and the known edges are resolved (a relative
    import, a submodule named in ``from P import name``, one inside a function)."""
    assert {"flashfold", "flashfold.algebra.monoid", "flashfold.cli"} <= set(MODULES)
    pairs = {(e.src, e.dst) for e in EDGES}
    assert ("flashfold.monoids", "flashfold.algebra.transport") in pairs
    assert ("flashfold.schedules", "flashfold.algebra.monoid") in pairs
    assert any(e.src == "flashfold.api.reductions" and not e.toplevel for e in EDGES)
    assert layer_of("flashfold.kernels.attention.fwd") == 2
    assert layer_of("flashfold") == 5 and layer_of("flashfold.testing") == 5


def test_cycles_are_found():
    e = lambda a, b: Edge(a, b, 1, True, ())  # noqa: E731
    assert cycles([e("a", "b"), e("b", "c"), e("c", "a"), e("c", "d")]) == [["a", "b", "c"]]
    assert cycles([e("a", "b"), e("b", "c")]) == []


def test_scan_dispatches_on_the_type_not_the_module_name():
    """``flashfold.scan``: a ``torch.Tensor`` goes to the tensor scan, everything else to the
    reference scan, whatever module its type comes from."""
    import numpy as np
    import torch

    import flashfold as ff

    class ArrayLike:                                  # an array-like from a torch-named module
        __module__ = "torchlike.arrays"

        def __init__(self, a):
            self.a = a

        def __array__(self, dtype=None, copy=None):
            return np.asarray(self.a, dtype=dtype)

    xs = np.array([1.0, -2.0, 4.0])
    ref = ff.scan(ff.monoids.SUM, xs)
    np.testing.assert_array_equal(ff.scan(ff.monoids.SUM, ArrayLike(xs)).s, ref.s)
    t = ff.scan(ff.monoids.SUM, torch.tensor(xs, dtype=torch.float32))
    assert isinstance(t, torch.Tensor)
    np.testing.assert_array_equal(t.numpy(), ref.s)


def test_import_flashfold_loads_no_torch_triton_or_sympy():
    code = ("import sys, numpy as np, flashfold as ff; ff.scan(ff.monoids.SUM, np.ones(3)); "
            "ff.fold(ff.monoids.SUM, np.ones(3)); "
            "bad = [m for m in ('torch', 'triton', 'sympy', 'matplotlib') if m in sys.modules]; "
            "assert not bad, bad; print('ok')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_layers_and_no_cycles():
    """No import from a lower layer to a higher one, no import cycle, no import made only
    for its side effect. On failure the message lists every violation found."""
    found = violations()
    print(_report(found))
    if any(found.values()):
        pytest.fail("import structure violates the layers:\n" + _report(found), pytrace=False)
