"""The Triton lowering of the IR: traced graphs become ``@triton.jit`` functions.

A monoid's ``lift``, ``combine``, ``finalize`` and ``block_lift`` (and any score_mod /
mask_mod) are emitted as Triton source text by the shared emitter of
:mod:`flashfold.algebra.lower`, with the table :data:`TRITON` below; the text is written
to a cache folder keyed by the graphs' content hash and imported, so Triton can read the
source (it needs a real file). Kernels take the generated functions as ``tl.constexpr``
arguments (calling them; ``reduce_tile``/``scan_tile`` wrap ``tl.reduce``/
``tl.associative_scan`` with the module's own combine), so one kernel template serves
every monoid.

Conventions of the generated functions:

* ``combine(a_f1, ..., a_fk, b_f1, ..., b_fk) -> (f1, ..., fk)``: flattened fields, the
  exact signature ``tl.reduce`` and ``tl.associative_scan`` expect for tuple operands;
* ``lift(x1, ..., [pos]) -> fields`` (inputs already converted to float32);
* ``finalize(f1, ..., fk, *params) -> outputs``;
* ``block_lift(x1, ..., valid) -> fields`` reducing over axis 0 of the tile (the block
  axis leads, as in the NumPy reference, so a reduced value broadcasts back against the
  tile); with vector inputs, scalar-class tiles carry a trailing axis of 1;
* ``block_scan(x1, ..., valid) -> fields`` the prefix states along axis 0 (a reduced
  field has the tile's shape without axis 0 and broadcasts), and
  ``scan_exact(f1, ..., fk) -> flag``, when the monoid has them;
* captured buffers become trailing ``bufN, bufN_numel`` arguments.

Float fields are float32 in kernels, int fields int32. Constant outputs are broadcast to
the shape of the first argument with ``tl.full``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from ..algebra.ir import Graph
from ..algebra.lower import Backend, emit, register_backend
from ..algebra.monoid import Monoid


def _tl_const(v) -> str:
    if isinstance(v, bool):
        return repr(v)
    if isinstance(v, int):
        return repr(v)
    if math.isinf(v):
        return 'float("inf")' if v > 0 else 'float("-inf")'
    return repr(float(v))


def log1p_template(log: str) -> str:
    """``log1p`` through a natural ``log`` (a template over ``{{0}}``, e.g. ``"tl.log({})"``)
    without losing a small ``x`` to ``1 + x == 1`` (Goldberg's ``log(u) x / (u - 1)``,
    ``u = 1 + x``, where ``u - 1`` is exact): ``x`` itself where ``u == 1``, ``+inf`` at
    ``+inf``."""
    u = "(1.0 + {0})"
    return (f"tl.where({u} == 1.0, {{0}}, tl.where({u} == float(\"inf\"), {u}, "
            f"{log.format(u)} * ({{0}} / ({u} - 1.0))))")


TRITON = register_backend(Backend(
    "triton",
    {
        "neg": "(-{0})", "exp": "tl.exp(_float({0}))", "exp2": "tl.exp2(_float({0}))",
        "log": "tl.log(_float({0}))", "log2": "tl.log2(_float({0}))",
        "log1p": log1p_template("tl.log({})"),
        # expm1 as Kahan's (u - 1) x / log(u), u = e^x: exp(x) - 1 alone is 0 for |x| below
        # 2^-24 and keeps only the leading digits of a small one
        "expm1": ("tl.where(tl.exp(_float({0})) == 1.0, {0}, "
                  "tl.where((tl.exp(_float({0})) - 1.0) == -1.0, -1.0, "
                  "tl.where(tl.exp(_float({0})) == float(\"inf\"), tl.exp(_float({0})), "
                  "(tl.exp(_float({0})) - 1.0) * ({0} / tl.log(tl.exp(_float({0})))))))"),
        "sqrt": "tl.sqrt(_float({0}))", "abs": "tl.abs({0})",
        "tanh": "(2.0 * tl.sigmoid(2.0 * {0}) - 1.0)", "sigmoid": "tl.sigmoid(_float({0}))",
        "floor": "tl.floor(_float({0}))", "not": "({0} == 0)", "isnan": "({0} != {0})",
        "isinf": '(tl.abs({0}) == float("inf"))',
        "to_float": "({0}).to(tl.float32)", "to_int": "({0}).to(tl.int32)",
        "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})",
        # floored, as mod (_floordiv below: Triton's // truncates ints and refuses floats)
        "floordiv": "_floordiv({0}, {1})",
        # the IR's mod is floored (NumPy's, Python's: the divisor's sign); Triton's % is
        # C's remainder (the dividend's sign), moved by one divisor where the signs differ
        "mod": "tl.where((({0} % {1}) != 0) & ((({0} % {1}) < 0) != ({1} < 0)), "
               "({0} % {1}) + {1}, {0} % {1})",
        # C's pow: |a|^b through exp2/log2, negated for a < 0 and an odd integer b, NaN
        # for a finite a < 0 and a finite non-integer b, 1 for a^0, 1^b and (-1)^(+-inf)
        # (exp2(b log2 a) alone is NaN for every a < 0, x ** 2 included, and for 0^0);
        # -0.0 counts as 0.0 (its odd powers are +0 and +inf, not -0 and -inf)
        "pow": ("tl.where(({1} == 0) | ({0} == 1) | (({0} == -1) & (({1} == float(\"inf\")) | "
                "({1} == float(\"-inf\")))), 1.0, "
                "tl.where(({0} < 0) & ({0} != float(\"-inf\")) & (({1} % 1.0) != 0) & "
                "({1} != float(\"inf\")) & ({1} != float(\"-inf\")), float(\"nan\"), "
                "tl.where(({0} < 0) & ((({1} % 2.0) == 1.0) | (({1} % 2.0) == -1.0)), "
                "-1.0, 1.0) * tl.exp2({1} * tl.log2(_float(tl.abs({0}))))))"),
        "maximum": "tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
        "minimum": "tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
        "lt": "({0} < {1})", "le": "({0} <= {1})", "gt": "({0} > {1})", "ge": "({0} >= {1})",
        "eq": "({0} == {1})", "ne": "({0} != {1})", "and": "({0} & {1})", "or": "({0} | {1})",
        "where": "tl.where({0}, {1}, {2})",
        # max / min reductions propagate NaN, as the IR's (NumPy's) do: tl.max keeps the
        # non-NaN operand (PTX max.f32), which would turn a NaN row into a number
        "rsum": "tl.sum({0}, axis={axis})", "rmax": "tl.reduce({0}, {axis}, _max_nan)",
        "rmin": "tl.reduce({0}, {axis}, _min_nan)", "csum": "tl.cumsum({0}, axis={axis})",
        # clamp out-of-range indices into the table, as the NumPy and torch lowerings do
        "load": "tl.load({buf} + tl.minimum(tl.maximum({0}, 0), {buf}_numel - 1))",
    },
    # the IR's and / or / where read a number as true when nonzero (NumPy's logical_and);
    # Triton's & and | are bitwise on ints and refuse floats
    _tl_const, reduce_axis=0, buffer_numel=True, truth="({0} != 0)"))
TRITON.check_complete()


def cache_dir() -> Path:
    """Where generated sources live: ``$FLASHFOLD_CACHE_DIR`` or ``~/.cache/flashfold``."""
    root = os.environ.get("FLASHFOLD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "flashfold")
    path = Path(root) / "triton"
    path.mkdir(parents=True, exist_ok=True)
    return path


def jit_source(graph: Graph, fn_name: str, arg_names: list[str] | None = None,
               extra_params: tuple[str, ...] = (), float_outputs: tuple[bool, ...] | None = None,
               backend: Backend = TRITON, state: bool = False) -> str:
    """Triton source of one ``@triton.jit`` function computing ``graph`` (``@gluon.jit``
    with ``backend=GLUON``, defined below; load it with :data:`_GLUON_HEADER`).

    ``float_outputs[i]`` says whether output ``i`` is a float (else int32) when it is a
    constant that must be broadcast to the first argument's shape. ``state``: the outputs
    are a state's fields, each converted to its field's type (``float_outputs``), as the
    reference stores a state: a truth value in a float field is 1.0 / 0.0, a float in an
    int field is truncated (``tl.reduce`` and ``tl.associative_scan`` refuse a combine
    whose results differ in type from its operands). ``backend`` is a Triton table
    (:data:`TRITON`, or a variant such as one with fast approximate math).
    """
    args = list(arg_names or [v.name for v in graph.inputs])
    lines, outs = emit(graph, backend, args)
    ref = args[0]
    gluon = backend.name == "gluon"
    fixed = []
    for i, (node, expr) in enumerate(zip(graph.outputs, outs)):
        dt = "tl.float32" if (float_outputs is None or float_outputs[i]) else "tl.int32"
        if node.op == "const":
            expr = (f"gl.full({ref}.shape, {expr}, {dt}, {ref}.type.layout)" if gluon
                    else f"tl.full({ref}.shape, {expr}, {dt})")
        elif state:
            expr = f"({expr}).to({dt})"
        fixed.append(expr)
    buf_params = []
    for i, _ in enumerate(graph.buffers):
        buf_params += [f"buf{i}", f"buf{i}_numel"]
    params = args + list(extra_params) + buf_params
    body = lines or []
    ret = "    return " + ", ".join(fixed) + ("," if len(fixed) == 1 else "")
    deco = "@gluon.jit" if gluon else "@triton.jit"
    return "\n".join([deco, f"def {fn_name}({', '.join(params)}):", *body, ret]) + "\n"


def _float_source(deco: str, lang: str) -> str:
    """``_float(x)``: ``x`` as float32 where it is an int (a position, an int field), as
    is, at no cost, where it is a float: the IR's math takes ints as NumPy does, Triton's
    ``exp``, ``log``, ``sqrt``, ``floor``... only floats."""
    return (f"{deco}\ndef _float(x):\n"
            f"    if {lang}.constexpr(x.dtype.is_floating()):\n"
            f"        return x\n"
            f"    return x.to({lang}.float32)\n\n\n")


def _floordiv_source(deco: str, lang: str) -> str:
    """``_floordiv(a, b)``: the IR's floor division (NumPy's, Python's) in Triton (``lang``
    ``tl``) or Gluon (``gl``). Ints: C's truncating ``//``; floats (which ``//`` refuses):
    ``(a - fmod(a, b)) / b`` rounded to the integer it is, as CPython does (``a / 0`` by
    a zero, as NumPy); both moved down by one where the remainder is non-zero and its
    sign differs from ``b``'s."""
    return (f"{deco}\ndef _floordiv(a, b):\n"
            f"    r = a % b\n"
            f"    if {lang}.constexpr(r.dtype.is_floating()):\n"
            f"        q = (a - r) / b\n"
            f"        f = {lang}.floor(q)\n"
            f"        q = {lang}.where(q - f > 0.5, f + 1.0, f)\n"
            f"        q = {lang}.where(b == 0, a / b, q)\n"
            f"    else:\n"
            f"        q = a // b\n"
            f"    return {lang}.where((r != 0) & ((r < 0) != (b < 0)), q - 1, q)\n\n\n")


_HEADER = ('"""Generated by flashfold from traced graphs; do not edit (regenerated on demand)."""\n'
           "import triton\nimport triton.language as tl\n\n\n"
           "@triton.jit\ndef _max_nan(a, b):\n"
           "    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)\n\n\n"
           "@triton.jit\ndef _min_nan(a, b):\n"
           "    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)\n\n\n"
           + _floordiv_source("@triton.jit", "tl") + _float_source("@triton.jit", "tl"))
_LOCK = threading.Lock()
_MODULES: dict[str, object] = {}


def load_source(source: str, stem: str, header: str = _HEADER):
    """Write ``source`` (a module body) to the cache, keyed by its hash, and import it.
    ``header``: the module's imports and helpers (:data:`_HEADER`, or :data:`_GLUON_HEADER`
    for Gluon functions)."""
    text = header + source
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    # the stem (a monoid's name) is cut to a length any file system takes; the hash of the
    # text, which holds the whole name, keeps the module's name unique
    name = f"flashfold_generated_{stem[:64]}_{key}"
    with _LOCK:
        mod = _MODULES.get(name)
        if mod is not None:
            return mod
        path = cache_dir() / f"{name}.py"
        if not path.exists() or path.read_text() != text:
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)                     # atomic: concurrent writers agree
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        _MODULES[name] = mod
        return mod


@dataclass(frozen=True)
class TritonMonoid:
    """The generated ``@triton.jit`` functions of one monoid (see module docstring)."""
    monoid: Monoid
    lift: object
    combine: object
    finalize: object
    block_lift: object | None
    block_scan: object | None
    scan_exact: object | None
    reduce_tile: object
    scan_tile: object
    source: str
    path: str


_BY_MONOID: dict = {}


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def _combinators(fields) -> str:
    """``reduce_tile`` / ``scan_tile``: tl.reduce / tl.associative_scan with this combine.

    The compiler does not accept a combine passed to ``tl.reduce`` as a ``tl.constexpr``
    argument (seen with Triton 3.6 on an H200: "'constexpr' object has no attribute
    'fn'"), while calling a constexpr function works; so each generated module carries
    these two wrappers that name its own ``combine`` directly.
    """
    xs = ", ".join("x_" + f.name for f in fields)
    tup = f"({xs},)"
    return (f"@triton.jit\ndef reduce_tile({xs}, AXIS: tl.constexpr):\n"
            f"    return tl.reduce({tup}, AXIS, combine)\n\n\n"
            f"@triton.jit\ndef scan_tile({xs}, AXIS: tl.constexpr, REVERSE: tl.constexpr):\n"
            f"    return tl.associative_scan({tup}, AXIS, combine, reverse=REVERSE)\n")


def triton_monoid(monoid: Monoid) -> TritonMonoid:
    """Generate (or fetch from the cache) the Triton functions of ``monoid``."""
    optional = (monoid.block_lift_graph, monoid.block_scan_graph, monoid.scan_exact_graph)
    # (the fields' dtypes too: they type the constants of the generated functions)
    key = (monoid.name, tuple(f.dtype for f in monoid.fields), monoid.combine_graph.key(),
           monoid.lift_graph.key(), monoid.finalize_graph.key(),
           *(g.key() if g is not None else None for g in optional))
    hit = _BY_MONOID.get(key)
    if hit is not None:
        return hit
    fields = monoid.fields
    is_float = tuple(f.dtype == "float" for f in fields)
    a = ["a_" + f.name for f in fields]
    b = ["b_" + f.name for f in fields]
    parts = [
        jit_source(monoid.lift_graph, "lift", [i.name for i in monoid.inputs],
                   float_outputs=is_float, state=True),
        jit_source(monoid.combine_graph, "combine", a + b, float_outputs=is_float, state=True),
        jit_source(monoid.finalize_graph, "finalize",
                   [f.name for f in fields] + [p for p, _ in monoid.params]),
    ]
    block_args = [i.name for i in monoid.inputs] + ["valid"]
    if monoid.block_lift_graph is not None:
        parts.append(jit_source(monoid.block_lift_graph, "block_lift", block_args,
                                float_outputs=is_float, state=True))
    if monoid.block_scan_graph is not None:
        parts.append(jit_source(monoid.block_scan_graph, "block_scan", block_args,
                                float_outputs=is_float, state=True))
        parts.append(jit_source(monoid.scan_exact_graph, "scan_exact",
                                [f.name for f in fields], float_outputs=(False,)))
    parts.append(_combinators(fields))
    source = "\n\n".join(parts)
    mod = load_source(source, _safe(monoid.name))
    tm = TritonMonoid(monoid, mod.lift, mod.combine, mod.finalize,
                      getattr(mod, "block_lift", None), getattr(mod, "block_scan", None),
                      getattr(mod, "scan_exact", None), mod.reduce_tile, mod.scan_tile,
                      source, mod.__file__)
    _BY_MONOID[key] = tm
    return tm


# --- the tile step of a rescale-twisted monoid (FlashAttention's inner step) -----------------

#: the Gluon lowering: Triton's table over ``gl`` (the functions Gluon re-exports; a
#: Gluon kernel can only call ``@gluon.jit`` functions); max and min reductions propagate
#: NaN as Triton's do. Gluon has no ``sigmoid``: it is written out as Triton's own
#: ``tl.sigmoid`` is, ``1 / (1 + e^-x)``, and ``tanh`` through it as in :data:`TRITON`, so
#: both lowerings compute the same expression. No ``cumsum`` (a scan across the tile's
#: lanes): a graph using it runs on the Triton kernels.
GLUON = register_backend(Backend(
    "gluon",
    {**{op: tmpl.replace("tl.", "gl.").replace("gl.PropagateNan", "tl.PropagateNan")
        for op, tmpl in TRITON.templates.items()
        if op not in ("tanh", "sigmoid", "csum")},
     # (_float: an int argument, which gl.exp refuses, as Triton's sigmoid takes it)
     "sigmoid": "(1.0 / (1.0 + gl.exp(-_float({0}))))",
     "tanh": "(2.0 / (1.0 + gl.exp(-2.0 * {0})) - 1.0)"},
    _tl_const, reduce_axis=0, buffer_numel=True, truth=TRITON.truth))

_GLUON_HEADER = ('"""Generated by flashfold from traced graphs; do not edit (regenerated on demand)."""\n'
                 "import triton.language as tl\n"
                 "from flashfold.kernels.compat import gl, gluon\n\n\n"
                 "@gluon.jit\ndef _max_nan(a, b):\n"
                 "    return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)\n\n\n"
                 "@gluon.jit\ndef _min_nan(a, b):\n"
                 "    return gl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)\n\n\n"
                 + _floordiv_source("@gluon.jit", "gl") + _float_source("@gluon.jit", "gl"))


@dataclass(frozen=True)
class TileStepFunctions:
    """The generated tile step and row finalize of a rescale-twisted monoid
    (:func:`flashfold.algebra.twist.tile_step`), for kernels that hold one state per row of
    a ``[rows, cols]`` tile:

    * ``tile_step(*state, *tile, scale) -> (*state', alpha, *weights)``: ``state`` values
      ``[rows]``, ``tile`` values ``[rows, cols]`` (reduced over ``cols``), ``scale`` a
      scalar; ``weights [rows, cols]``, to contract with the vector inputs
      (``o' = alpha[:, None] o + weights @ v``);
    * ``finalize_rows(*fields) -> outputs``: the monoid's finalize with scalar fields
      ``[rows]`` and vector fields ``[rows, width]``;
    * ``tile_weights(ref, *tile, scale) -> weights``: each element's weight against a
      fixed reference (:func:`flashfold.algebra.twist.tile_weights`, one per linear
      field): a backward's probabilities from the rows' saved log-normalizers. ``ref``
      comes broadcastable against the tile (``lam[:, None]``, or ``lam[None, :]`` in a
      transposed tile) and is never ``-inf``: a row without elements passes ``+inf``
      (every weight 0).

    ``step`` is the derivation (which fields, which inputs, what is contracted)."""
    step: object
    tile_step: object
    finalize_rows: object
    tile_weights: object
    source: str
    path: str


_STEPS: dict = {}


def tile_step_functions(monoid: Monoid, *, scale: str | None = None, shift: bool = False,
                        gluon: bool = False) -> TileStepFunctions:
    """Generate (or fetch) ``monoid``'s tile step and row finalize as ``@triton.jit``
    functions, or ``@gluon.jit`` ones with ``gluon=True`` (for the Gluon kernels, which
    call only Gluon functions). ``scale``: the scalar input the kernel passes as ``x *
    scale``; ``shift``: the step takes a reference shift ``s`` after the scale, its
    weights and linear fields carry ``b^s``, and the kernel finalizes at ``m - s`` (see
    :func:`~flashfold.algebra.twist.tile_step`)."""
    from ..algebra.twist import tile_step, tile_weights

    key = (monoid.name, monoid.combine_graph.key(), monoid.lift_graph.key(),
           monoid.finalize_graph.key(), scale, shift, gluon)
    hit = _STEPS.get(key)
    if hit is not None:
        return hit
    step = tile_step(monoid, scale=scale, shift=shift)
    backend = GLUON if gluon else TRITON
    deco = "@gluon.jit" if gluon else "@triton.jit"

    def function(graph, name, tile, uniform=()):
        args = [v.name for v in graph.inputs]
        lines, outs = emit(graph, backend, args, tile=tile, uniform=uniform, reduce_axis=1)
        ret = "    return " + ", ".join(outs) + ("," if len(outs) == 1 else "")
        return "\n".join([deco, f"def {name}({', '.join(args)}):", *lines, ret]) + "\n"

    vector_fields = tuple(f.name for f in monoid.fields if f.vector)
    fin = monoid.finalize_graph
    if fin.buffers or monoid.params:
        raise ValueError(f"monoid {monoid.name!r}: a row finalize takes no params or buffers")
    weights = tile_weights(monoid, scale=scale, reference_above_minus_inf=True)
    source = "\n\n".join([
        function(step.graph, "tile_step", tile=step.tile, uniform=step.uniform),
        function(fin, "finalize_rows", tile=vector_fields),
        function(weights.graph, "tile_weights", tile=("ref",) + weights.tile,
                 uniform=weights.uniform),
    ])
    mod = load_source(source, ("gluon_" if gluon else "") + ("shifted_" if shift else "")
                      + "step_" + _safe(monoid.name),
                      header=_GLUON_HEADER if gluon else _HEADER)
    fns = TileStepFunctions(step, mod.tile_step, mod.finalize_rows, mod.tile_weights, source,
                            mod.__file__)
    _STEPS[key] = fns
    return fns


def triton_function(graph: Graph, name: str, arg_names: list[str] | None = None):
    """One generated ``@triton.jit`` function for ``graph`` (a score_mod, a mask_mod, ...)."""
    src = jit_source(graph, _safe(name), arg_names)
    return getattr(load_source(src, _safe(name)), _safe(name))
