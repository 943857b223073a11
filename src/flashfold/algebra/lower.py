"""Lowering the IR: one small table per backend, one shared emitter.

A backend is a :class:`Backend`: a format template per IR op (``"np.exp({0})"``,
``"tl.exp({0})"``, ``"sp.exp({0})"``), a way to print constants, and the namespace the
generated code runs in. :func:`emit` turns a :class:`~flashfold.algebra.ir.Graph` into
straight-line SSA source (one assignment per node, each subexpression once);
:func:`compile_graph` execs it into a Python function. Backends register themselves with
:func:`register_backend`, so adding a lowering (Triton source, SymPy, torch) touches
no other code: the NumPy lowering, which the CPU schedules execute, lives here; the
others live next to their users.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping

from .ir import BINARY, OPS, REDUCTIONS, SCANS, UNARY, Graph, Node, is_bool


@dataclass(frozen=True)
class Backend:
    """Templates and namespace of one lowering target.

    ``templates[op]`` is a ``str.format`` template over the operands' names; reductions
    may also use ``{axis}``, and ``load`` uses ``{buf}`` (the buffer's parameter name). ``const(value)`` prints a constant. ``namespace`` holds the
    names the templates use (``np``, ``tl``, helper functions).

    ``truth`` (optional) is a template turning a number into the IR's truth value,
    ``x != 0``, for a backend whose ``and`` / ``or`` / ``where`` take booleans only
    (Triton's ``&`` and ``|`` are bitwise: ``2 & 1 == 0`` where the IR's ``and`` is true):
    :func:`emit` applies it to each operand of ``and`` / ``or`` and to the condition of
    ``where`` that is not a truth value by :func:`~flashfold.algebra.ir.is_bool`.
    """
    name: str
    templates: Mapping[str, str]
    const: Callable[[object], str]
    namespace: Mapping[str, object] = field(default_factory=dict)
    reduce_axis: object = 0
    buffer_numel: bool = False                       # pass each buffer's size as an argument
    expand: str = "{0}[:, None]"                     # a row value broadcast against a tile
    convert_buffer: Callable = staticmethod(lambda data: data)
    truth: str | None = None                         # a number as a truth value: x != 0

    def check_complete(self, ops=OPS):
        missing = [op for op in ops if op not in ("var", "const") and op not in self.templates]
        if missing:
            raise ValueError(f"backend {self.name!r} has no template for {missing}")


_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    _BACKENDS[backend.name] = backend
    return backend


def get_backend(name: str) -> Backend:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; registered: {sorted(_BACKENDS)}") from None


#: shape classes of :func:`emit`'s tile mode: one value per call, per row, per element
UNIFORM, ROW, TILE = 0, 1, 2


def emit(graph: Graph, backend: Backend, arg_names: list[str] | None = None,
         prefix: str = "t", indent: str = "    ", tile: tuple[str, ...] | None = None,
         uniform: tuple[str, ...] = (), reduce_axis=None) -> tuple[list[str], list[str]]:
    """Straight-line source for ``graph``: (assignment lines, output expressions).

    ``arg_names`` renames the graph inputs (default: the input names).

    Tile mode (``tile`` given: the names of inputs with one value per element of a 2-D
    tile ``[rows, cols]``): the other inputs hold one value per row (``[rows]``) except
    those named in ``uniform`` (one value per call); reductions run over the columns
    (``reduce_axis``, default the backend's) and give one value per row, and a row value
    meeting a tile value is broadcast with the backend's ``expand`` template
    (``x[:, None]``), as a kernel holding ``m [BLOCK_M]`` beside ``s [BLOCK_M, BLOCK_N]``
    writes it.
    """
    names: dict[int, str] = {}
    vars_ = {v.name: i for i, v in enumerate(graph.inputs)}
    buffers = graph.buffers
    lines: list[str] = []
    axis = backend.reduce_axis if reduce_axis is None else reduce_axis
    klass: dict[int, int] = {}
    k = 0
    for n in graph.nodes():
        if n.op == "var":
            names[id(n)] = arg_names[vars_[n.attr]] if arg_names else n.attr
            klass[id(n)] = TILE if tile is None or n.attr in tile else (
                UNIFORM if n.attr in uniform else ROW)
            continue
        if n.op == "const":
            names[id(n)] = backend.const(n.attr)
            klass[id(n)] = UNIFORM
            continue
        tmpl = backend.templates.get(n.op)
        if tmpl is None:
            raise NotImplementedError(f"backend {backend.name!r} cannot lower op {n.op!r}")
        buf = f"buf{[i for i, b in enumerate(buffers) if b is n.attr][0]}" if n.op == "load" else ""
        operands = [names[id(a)] for a in n.args]
        if backend.truth is not None and n.op in _LOGICAL:
            operands = [_truth(backend, a, x) if i in _LOGICAL[n.op] else x
                        for i, (x, a) in enumerate(zip(operands, n.args))]
        if tile is not None:
            if n.op in REDUCTIONS:
                if klass[id(n.args[0])] != TILE:
                    raise ValueError(f"emit: {n.op} of a value that is not a tile in {graph.name}")
                klass[id(n)] = ROW
            else:
                klass[id(n)] = max((klass[id(a)] for a in n.args), default=UNIFORM)
                if klass[id(n)] == TILE:
                    operands = [backend.expand.format(x) if klass[id(a)] == ROW else x
                                for x, a in zip(operands, n.args)]
        else:
            klass[id(n)] = TILE
        expr = tmpl.format(*operands, axis=axis, buf=buf)
        name = f"{prefix}{k}"
        k += 1
        lines.append(f"{indent}{name} = {expr}")
        names[id(n)] = name
    return lines, [names[id(o)] for o in graph.outputs]


#: the operands (by position) that the IR reads as truth values: nonzero is true
_LOGICAL = {"and": (0, 1), "or": (0, 1), "where": (0,)}


def _truth(backend: Backend, node: Node, name: str) -> str:
    """``name`` (the lowering of ``node``) as a truth value of ``backend``: as is where
    ``node`` is one, a constant's truth printed, else ``backend.truth`` of it."""
    if is_bool(node):
        return name
    if node.op == "const":
        return backend.const(bool(node.attr))
    return backend.truth.format(name)


def function_source(graph: Graph, backend: Backend, fn_name: str,
                    arg_names: list[str] | None = None, decorator: str = "",
                    extra_args: tuple[str, ...] = ()) -> str:
    """A complete ``def`` for ``graph`` returning a tuple of its outputs.

    Captured buffers become trailing arguments ``buf0, buf1, ...`` (see :func:`buffer_args`).
    """
    args = list(arg_names or [v.name for v in graph.inputs]) + list(extra_args) + buffer_params(graph, backend)
    lines, outs = emit(graph, backend, arg_names)
    head = (decorator + "\n" if decorator else "") + f"def {fn_name}({', '.join(args)}):"
    ret = "    return " + (", ".join(outs) + ("," if len(outs) == 1 else ""))
    return "\n".join([head, *lines, ret]) + "\n"


def buffer_params(graph: Graph, backend: Backend) -> list[str]:
    """Parameter names the lowered function takes for the graph's captured buffers."""
    names = []
    for i, _ in enumerate(graph.buffers):
        names.append(f"buf{i}")
        if backend.buffer_numel:
            names.append(f"buf{i}_numel")
    return names


def buffer_args(graph: Graph, backend: Backend, convert=lambda data: data) -> list:
    """Run-time values for :func:`buffer_params`: each buffer's data (converted), its size."""
    out = []
    for b in graph.buffers:
        out.append(convert(b.data))
        if backend.buffer_numel:
            out.append(b.numel)
    return out


def compile_graph(graph: Graph, backend: Backend | str, arg_names: list[str] | None = None):
    """Exec the lowered ``graph`` into a Python function returning a tuple.

    Captured buffers are bound (as the backend's ``convert_buffer`` of their data), so the
    returned function takes only the graph's inputs.
    """
    if not isinstance(graph, Graph):
        raise TypeError(f"graph: expected a traced flashfold Graph (e.g. monoid.combine_graph), "
                        f"got {type(graph).__name__}")
    if isinstance(backend, str):
        backend = get_backend(backend)
    if not isinstance(backend, Backend):
        raise TypeError(f"backend: expected a Backend or a registered backend's name "
                        f"{sorted(_BACKENDS)}, got {type(backend).__name__}")
    src = function_source(graph, backend, "_lowered", arg_names)
    ns = dict(backend.namespace)
    exec(compile(src, f"<flashfold:{backend.name}:{graph.name}>", "exec"), ns)
    fn = ns["_lowered"]
    if graph.buffers:
        bound = buffer_args(graph, backend, backend.convert_buffer)
        inner = fn

        def fn(*args):
            return inner(*args, *bound)
    fn.__flashfold_source__ = src
    return fn


# --- the NumPy lowering (reference semantics, float64) ----------------------------

def _np_const(v) -> str:
    if isinstance(v, bool):
        return repr(v)
    if isinstance(v, int):
        return repr(v)
    if math.isinf(v):
        return "np.inf" if v > 0 else "(-np.inf)"
    return repr(float(v))


def _numpy_backend() -> Backend:
    import numpy as np

    def sigmoid(x):
        return 0.5 * (np.tanh(0.5 * x) + 1.0)

    t = {
        "neg": "(-{0})", "exp": "np.exp({0})", "exp2": "np.exp2({0})", "log": "np.log({0})",
        "log2": "np.log2({0})", "log1p": "np.log1p({0})", "expm1": "np.expm1({0})",
        "sqrt": "np.sqrt({0})", "abs": "np.abs({0})", "tanh": "np.tanh({0})",
        "sigmoid": "_sigmoid({0})", "floor": "np.floor({0})", "not": "np.logical_not({0})",
        "isnan": "np.isnan({0})", "isinf": "np.isinf({0})",
        "to_float": "np.asarray({0}, dtype=np.float64)", "to_int": "np.asarray({0}).astype(np.int64)",
        "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})",
        "floordiv": "({0} // {1})", "mod": "({0} % {1})", "pow": "np.power({0}, {1})",
        "maximum": "np.maximum({0}, {1})", "minimum": "np.minimum({0}, {1})",
        "lt": "({0} < {1})", "le": "({0} <= {1})", "gt": "({0} > {1})", "ge": "({0} >= {1})",
        "eq": "({0} == {1})", "ne": "({0} != {1})",
        "and": "np.logical_and({0}, {1})", "or": "np.logical_or({0}, {1})",
        "where": "np.where({0}, {1}, {2})",
        "rsum": "np.sum({0}, axis={axis})", "rmax": "np.max({0}, axis={axis})",
        "rmin": "np.min({0}, axis={axis})", "csum": "np.cumsum({0}, axis={axis})",
        "load": "{buf}[np.clip(np.asarray({0}, dtype=np.int64), 0, {buf}.size - 1)]",
    }
    return Backend("numpy", t, _np_const, {"np": np, "_sigmoid": sigmoid}, reduce_axis=0,
                   convert_buffer=lambda data: _flat_numpy(data))


def _flat_numpy(data):
    import numpy as np
    if hasattr(data, "detach"):                      # a torch tensor
        data = data.detach().cpu().numpy()
    return np.ascontiguousarray(data).reshape(-1)


NUMPY = register_backend(_numpy_backend())
NUMPY.check_complete()

assert set(UNARY) | set(BINARY) | set(REDUCTIONS) | set(SCANS) | {"where"} <= set(NUMPY.templates)


def node_count(graph: Graph) -> int:
    return sum(1 for n in graph.nodes() if n.op not in ("var", "const"))


__all__ = ["Backend", "register_backend", "get_backend", "emit", "function_source",
           "compile_graph", "NUMPY", "node_count", "Node"]
