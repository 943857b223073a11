"""Per-monoid Triton helpers for the reduce / scan templates, generated as source text.

:func:`flashfold.kernels.codegen.triton_monoid` lowers a monoid's traced graphs to
``lift``, ``combine``, ``finalize``, ``block_lift``, ``reduce_tile`` and ``scan_tile``.
The kernel templates of this package are written once for every monoid, so they cannot
name a monoid's fields; everything that depends on the *number* of fields is generated
here, next to the codegen functions, in one module per monoid (cached on disk by the
content hash of its source, like every generated module):

==================  =====================================================================
``tile_state``      ``(*xs, pos, valid) -> state`` of a tile reduced over axis 0: the
                    block lift when the monoid has one, else ``lift`` + identity on
                    invalid lanes + ``reduce_tile`` (only used where reordering is
                    allowed, or on an axis of length 1)
``tile_fold``       ``(*xs, pos, valid) -> state`` of a [K, LANES, ROWS] tile folded *in
                    order* over axis 0 (its K consecutive elements per lane, in one
                    thread): ``lift``, identity on invalid lanes, an inclusive scan along
                    axis 0 and its last element (the ordered reduce's ``VFOLD`` tiles)
``lift_xp``         ``(*xs, pos) -> state``: ``lift`` with a uniform signature
``combine_rev``     ``(a, b) -> b ⊕ a``, the combine with its operands swapped
``scan_tile_rev``   inclusive scan with ``combine_rev``: over a tile loaded in *reversed*
                    element order it gives suffix states ``x_i ⊕ x_{i+1} ⊕ ...`` without
                    ``tl.associative_scan(reverse=True)`` (which has an open wrong-result
                    report)
``identity``        ``(ref) -> state`` full of the identity, shaped like ``ref``
``select``          ``(mask, a, b) -> where(mask, a, b)`` fieldwise
``take``            ``(sel, AXIS, a) -> a[sel]`` along ``AXIS``, where ``sel`` is true at
                    exactly one index: ``sum(where(sel, a, 0))``, exact for every value
``bcast0``          ``(ref, a) -> a[None]`` broadcast to ``ref``'s shape
``bcast``           ``(ref, a) -> a`` broadcast to ``ref``'s shape
``shift1``          ``(idx, a) -> a[idx - 1]`` along the only axis (identity at ``idx = 0``):
                    an exclusive scan from an inclusive one, through ``tl.gather``
``load_state``      ``(ptrs, offs, mask) -> state`` from one buffer per field (identity
                    where masked)
``store_state``     ``(ptrs, offs, mask, a)``
``finalize_fast``   ``finalize`` with hardware logarithms (:data:`FAST`), for scans that
                    finalize every element
==================  =====================================================================

``block_scan`` and ``scan_exact`` (None unless the monoid declares them) are the
monoid's own generated functions.

``xs`` are the tiles of the monoid's data inputs in its input order (``x`` for a monoid
of one, ``x0, x1, ...`` for several: the templates load them as a tuple and pass
``*xs``), already float32; the position input, if any, is ``pos``. The input count is a
property of this module: the templates are the same for every count.

States travel through the templates as tuples (``COMBINE(*acc, *s)``), which Triton 3.6
unpacks at compile time. Float fields are float32, int fields int32 (positions are int32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...algebra.evaluate import numpy_monoid
from ...algebra.ir import Graph, Var, trace
from ...algebra.lower import Backend
from ...algebra.monoid import Monoid
from .. import launcher
from ..codegen import (TRITON, TritonMonoid, _safe, jit_source, load_source, log1p_template,
                       triton_monoid)

__all__ = ["ReduceFunctions", "reduce_functions", "RowMap", "row_map", "output_kinds",
           "n_inputs"]


def _const(v, is_float: bool) -> str:
    if not is_float:
        return repr(int(v))
    v = float(v)
    if math.isinf(v):
        return 'float("inf")' if v > 0 else 'float("-inf")'
    return repr(v)


#: The Triton lowering with hardware logarithms: ``tl.log``/``tl.log2`` compile to
#: libdevice's accurate polynomials (~25 instructions), which would dominate a scan that
#: finalizes every element (logcumsumexp); ``lg2.approx`` is one SFU instruction with a
#: relative error below 2^-22. Used for the per-element finalize of scans and maps.
FAST = Backend("triton_fast", {**TRITON.templates, "log2": "_fast_log2(_float({0}))",
                               "log": "(_fast_log2(_float({0})) * 0.6931471805599453)",
                               "log1p": log1p_template("(_fast_log2({}) * 0.6931471805599453)")},
               TRITON.const, reduce_axis=0, buffer_numel=True, truth=TRITON.truth)


def _fast_log2_source() -> str:
    """``_fast_log2``: ``lg2.approx`` when compiling; ``tl.log2`` under the interpreter,
    which has no libdevice (the generated source differs, so its cache key does too)."""
    if launcher.interpreting():
        return "@triton.jit\ndef _fast_log2(x):\n    return tl.log2(x)\n"
    return ("from triton.language.extra import libdevice as _libdevice\n\n\n"
            "@triton.jit\ndef _fast_log2(x):\n    return _libdevice.fast_log2f(x)\n")


def fast_jit_source(graph: Graph, fn_name: str, arg_names: list[str], float_outputs=None) -> str:
    """:func:`flashfold.kernels.codegen.jit_source` with the :data:`FAST` lowering (graphs
    without captured buffers: the reduce/scan templates pass none)."""
    if graph.buffers:
        raise ValueError(f"{graph.name}: captured buffers are not supported here")
    return jit_source(graph, fn_name, arg_names, float_outputs=float_outputs, backend=FAST)


def _helpers(monoid: Monoid) -> str:
    fields = monoid.fields
    k = len(fields)
    fl = [f.dtype == "float" for f in fields]
    xs = [f"x{i}" for i in range(k)]
    a = [f"a{i}" for i in range(k)]
    b = [f"b{i}" for i in range(k)]
    J = ", ".join
    data = [i for i in monoid.inputs if i.domain != "position"]
    if any(i.vector for i in data) or any(f.vector for f in fields):
        raise ValueError(f"monoid: the reduce/scan kernels take monoids of scalar inputs and "
                         f"scalar fields; {monoid.name!r} has inputs {monoid.input_names} and "
                         f"fields {monoid.field_names} (a monoid with vector ones runs per "
                         f"feature: launch._per_feature)")
    names = _input_names(monoid)
    it = iter(names)
    call_args = ["pos" if i.domain == "position" else next(it) for i in monoid.inputs]
    lift_args = J(call_args)
    x_args = J(names)
    ref = names[0]
    dt = ["tl.float32" if f else "tl.int32" for f in fl]
    ident = J(f"tl.full(ref.shape, {_const(v, f)}, {d})" for v, f, d in zip(monoid.identity, fl, dt))
    out = []
    out.append(f"@triton.jit\ndef lift_xp({x_args}, pos):\n    return lift({lift_args})\n")
    out.append(f"@triton.jit\ndef identity(ref):\n    return {ident},\n")
    out.append(f"@triton.jit\ndef select(mask, {J(a)}, {J(b)}):\n"
               f"    return {J(f'tl.where(mask, {p}, {q})' for p, q in zip(a, b))},\n")
    out.append(f"@triton.jit\ndef combine_rev({J(a)}, {J(b)}):\n    return combine({J(b)}, {J(a)})\n")
    out.append(f"@triton.jit\ndef scan_tile_rev({J(xs)}, AXIS: tl.constexpr):\n"
               f"    return tl.associative_scan(({J(xs)},), AXIS, combine_rev)\n")
    out.append(f"@triton.jit\ndef take(sel, AXIS: tl.constexpr, {J(xs)}):\n"
               f"    return {J(f'tl.sum(tl.where(sel, {x}, 0), AXIS)' for x in xs)},\n")
    out.append(f"@triton.jit\ndef bcast0(ref, {J(xs)}):\n"
               f"    return {J(f'tl.broadcast_to(tl.expand_dims({x}, 0), ref.shape)' for x in xs)},\n")
    out.append(f"@triton.jit\ndef bcast(ref, {J(xs)}):\n"
               f"    return {J(f'tl.broadcast_to({x}, ref.shape)' for x in xs)},\n")
    shifted = J(f"tl.where(idx == 0, {_const(v, f)}, tl.gather({x}, prev, 0))"
                for x, v, f in zip(xs, monoid.identity, fl))
    out.append(f"@triton.jit\ndef shift1(idx, {J(xs)}):\n"
               f"    prev = tl.maximum(idx - 1, 0)\n"
               f"    return {shifted},\n")
    loads = J(f"tl.load(ptrs[{i}] + offs, mask=mask, other={_const(v, f)})"
              for i, (v, f) in enumerate(zip(monoid.identity, fl)))
    out.append(f"@triton.jit\ndef load_state(ptrs, offs, mask):\n    return {loads},\n")
    stores = "\n".join(f"    tl.store(ptrs[{i}] + offs, {x}, mask=mask)" for i, x in enumerate(xs))
    out.append(f"@triton.jit\ndef store_state(ptrs, offs, mask, {J(xs)}):\n{stores}\n")
    if monoid.block_lift is not None:
        bl_args = J(call_args + ["valid"])
        body = f"    return block_lift({bl_args})\n"
    else:
        body = (f"    s = lift({lift_args})\n"
                f"    s = select(valid, *s, *identity({ref}))\n"
                f"    return reduce_tile(*s, 0)\n")
    out.append(f"@triton.jit\ndef tile_state({x_args}, pos, valid):\n{body}")
    out.append(f"@triton.jit\ndef tile_fold({x_args}, pos, valid):\n"
               f"    s = lift({lift_args})\n"
               f"    s = select(valid, *s, *identity({ref}))\n"
               f"    last = tl.arange(0, {ref}.shape[0])[:, None, None] == {ref}.shape[0] - 1\n"
               f"    return take(last, 0, *scan_tile(*s, 0, False))\n")
    out.append(_fast_log2_source())
    out.append(fast_jit_source(monoid.finalize_graph, "finalize_fast",
                               [f.name for f in fields] + [p for p, _ in monoid.params]))
    return "\n\n".join(out)


def _input_names(monoid: Monoid) -> list[str]:
    """The generated functions' names of the data inputs: ``x``, or ``x0, x1, ...``."""
    n = sum(i.domain != "position" for i in monoid.inputs)
    return ["x"] if n == 1 else [f"x{j}" for j in range(n)]


def n_inputs(monoid: Monoid) -> int:
    """The data inputs of ``monoid`` (those a caller passes: not the position)."""
    return sum(i.domain != "position" for i in monoid.inputs)


@dataclass(frozen=True)
class ReduceFunctions:
    """The generated functions the reduce/scan templates take as ``tl.constexpr``."""
    monoid: Monoid
    base: TritonMonoid
    lift_xp: object
    combine: object
    combine_rev: object
    finalize: object
    finalize_fast: object
    tile_state: object
    tile_fold: object
    block_scan: object | None
    scan_exact: object | None
    reduce_tile: object
    scan_tile: object
    scan_tile_rev: object
    identity: object
    select: object
    take: object
    bcast0: object
    bcast: object
    shift1: object
    load_state: object
    store_state: object
    has_position: bool
    path: str
    #: data inputs (the tiles the templates load and pass as ``*xs``)
    n_inputs: int = 1


#: (generated source, commutative) -> ReduceFunctions: monoid objects that generate the
#: same functions share them (the source holds the identity and the field dtypes that
#: the helpers bake in, so a monoid defined again under its name with another identity
#: gets its own; ``commutative`` picks the kernels' ORDERED paths)
_CACHE: dict = {}
#: id(monoid) -> (monoid, value): a per-object fast path (hashing a Monoid hashes its graphs)
_BY_ID: dict = {}
_KINDS_BY_ID: dict = {}


def reduce_functions(monoid: Monoid) -> ReduceFunctions:
    """Generate (or fetch) the template helpers of ``monoid`` (see the module docstring).

    Raises ``ValueError`` for monoids with vector inputs or fields (the launchers run
    those per feature, as scalar monoids: ``launch._per_feature``).
    """
    hit = _BY_ID.get(id(monoid))
    if hit is not None and hit[0] is monoid:
        return hit[1]
    if not isinstance(monoid, Monoid):
        raise TypeError(f"monoid: expected a flashfold Monoid, got {type(monoid).__name__}")
    fns = _reduce_functions(monoid)
    _BY_ID[id(monoid)] = (monoid, fns)
    return fns


def _reduce_functions(monoid: Monoid) -> ReduceFunctions:
    base = triton_monoid(monoid)
    source = base.source + "\n\n" + _helpers(monoid)
    key = (source, monoid.commutative)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    mod = load_source(source, "reduce_" + _safe(monoid.name))
    fns = ReduceFunctions(
        monoid, base, mod.lift_xp, mod.combine, mod.combine_rev, mod.finalize, mod.finalize_fast,
        mod.tile_state, mod.tile_fold, getattr(mod, "block_scan", None), getattr(mod, "scan_exact", None),
        mod.reduce_tile, mod.scan_tile, mod.scan_tile_rev, mod.identity, mod.select, mod.take,
        mod.bcast0, mod.bcast, mod.shift1, mod.load_state, mod.store_state,
        any(i.domain == "position" for i in monoid.inputs), mod.__file__, n_inputs(monoid))
    _CACHE[key] = fns
    return fns


def output_kinds(monoid: Monoid) -> tuple[str, ...]:
    """NumPy dtype kind (``'f'``, ``'i'``, ``'b'``) of each finalize output, read off by
    finalizing a reachable state in float64."""
    hit = _KINDS_BY_ID.get(id(monoid))
    if hit is not None and hit[0] is monoid:
        return hit[1]
    kinds = _output_kinds(monoid)
    _KINDS_BY_ID[id(monoid)] = (monoid, kinds)
    return kinds


def _output_kinds(monoid: Monoid) -> tuple[str, ...]:
    ex = numpy_monoid(monoid)
    inputs = []
    for inp in monoid.inputs:
        inputs.append(np.zeros((1,), np.int64) if inp.domain == "position" else np.ones((1,)))
    state = ex.lift(inputs, None)
    outs = ex.finalize(state)
    kinds = []
    for o in outs:
        kind = np.asarray(o).dtype.kind
        kinds.append("f" if kind == "f" else ("b" if kind == "b" else "i"))
    return tuple(kinds)


@dataclass(frozen=True)
class RowMap:
    """An elementwise map that reads its row's reduced state: ``y = map(x, *prep(state))``.

    ``prep`` runs once per row (e.g. softmax's ``(m, 1/d)``), ``map`` once per element;
    both are traced graphs, lowered to Triton (``prep_fn``, ``map_fn``) and to NumPy
    (``prep_graph``, ``map_graph``) for the reference.
    """
    name: str
    monoid: Monoid
    prep_graph: object
    map_graph: object
    prep_fn: object
    map_fn: object


_MAPS: dict = {}


def row_map(name: str, monoid: Monoid, prep, fmap, n_consts: int) -> RowMap:
    """Trace ``prep(state) -> consts`` and ``fmap(x, *consts) -> y`` and generate them."""
    key = (name, monoid.name, monoid.combine_graph.key())
    hit = _MAPS.get(key)
    if hit is not None:
        return hit
    S = monoid.State
    k = len(monoid.fields)
    prep_g = trace(prep, [Var(f.name) for f in monoid.fields], f"{name}.prep",
                   call=lambda fn, nodes: fn(S(*nodes[:k])), n_outputs=n_consts)
    consts = [f"c{i}" for i in range(n_consts)]
    map_g = trace(fmap, [Var("x")] + [Var(c) for c in consts], f"{name}.map", n_outputs=1)
    src = (_fast_log2_source() + "\n\n" + jit_source(prep_g, "prep", list(monoid.field_names))
           + "\n\n" + fast_jit_source(map_g, "fmap", ["x"] + consts))
    mod = load_source(src, "rowmap_" + _safe(name))
    rm = RowMap(name, monoid, prep_g, map_g, mod.prep, mod.fmap)
    _MAPS[key] = rm
    return rm
