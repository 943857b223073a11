"""The expression IR that every monoid, score modification and mask is traced into.

A combine is ordinary Python over :mod:`flashfold.ops`. Called on :class:`Node` values
instead of numbers, it records an expression DAG::

    def combine(a, b):
        m = ops.maximum(a.m, b.m)
        return m, a.d * ops.exp(a.m - m) + b.d * ops.exp(b.m - m)

    graph = trace(combine, ...)   # Graph(inputs=(a_m, a_d, b_m, b_d), outputs=(m, d))

The IR is deliberately tiny so that each backend lowering is a table, not a compiler:

* leaves: ``var`` (a named input) and ``const`` (a Python float/int/bool);
* elementwise ops (:data:`UNARY`, :data:`BINARY`, ``where``);
* reductions over the block axis (:data:`REDUCTIONS`), used only by block lifts, and the
  inclusive prefix sum along it (:data:`SCANS`), used only by block scans;
* ``load``: an element of a captured :class:`Buffer` (a 1-D/2-D table such as per-token
  document ids or per-head ALiBi slopes), so masks and score modifications can read data.

Every node carries a *shape class*: ``vector`` nodes have a trailing feature axis (the
``o`` accumulator of attention, of width ``d``); scalar nodes broadcast against it.
Nodes are hash-consed inside one trace, so common subexpressions are shared and a
lowering emits each once.

Python control flow on a traced value raises ``TypeError``: data-dependent choices go
through ``ops.where``, as in any tracing compiler.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

UNARY = ("neg", "exp", "exp2", "log", "log2", "log1p", "expm1", "sqrt", "abs", "tanh",
         "sigmoid", "floor", "not", "isnan", "isinf", "to_float", "to_int")
BINARY = ("add", "sub", "mul", "div", "floordiv", "mod", "pow", "maximum", "minimum",
          "lt", "le", "gt", "ge", "eq", "ne", "and", "or")
REDUCTIONS = ("rsum", "rmax", "rmin")
#: shape-preserving ops along the block axis: ``csum`` is the inclusive prefix sum
SCANS = ("csum",)
LEAVES = ("var", "const")
OPS = LEAVES + UNARY + BINARY + ("where", "load") + REDUCTIONS + SCANS

#: ops whose result is boolean
BOOLEAN = ("lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not", "isnan", "isinf")


class Node:
    """One value of the IR; also the tracer that user code computes with.

    Arithmetic operators build new nodes (``a + b``, ``-a``, ``a < b``, ``a & b``);
    ``bool(node)`` raises, since a traced value has no concrete truth value.
    """

    __slots__ = ("op", "args", "attr", "vector", "_ctx", "__weakref__")

    def __init__(self, op: str, args: tuple, attr, vector: bool, ctx: "_TraceContext | None"):
        self.op = op
        self.args = args
        self.attr = attr
        self.vector = vector
        self._ctx = ctx

    # identity semantics for containers; ``==`` builds a node (see __eq__)
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        if self.op == "var":
            return f"var({self.attr})"
        if self.op == "const":
            return f"const({self.attr!r})"
        return f"{self.op}({', '.join(map(repr, self.args))})"

    def __bool__(self):
        raise TypeError(
            "a traced flashfold value has no truth value: Python `if`/`and`/`or`/`max` on "
            "it cannot be traced; write data-dependent choices with ops.where(cond, a, b) "
            "and ops.maximum / ops.minimum")

    def __index__(self):
        raise TypeError("a traced flashfold value cannot be used as a Python index")

    def __float__(self):
        raise TypeError("a traced flashfold value cannot be converted to a Python float")

    # arithmetic -------------------------------------------------------------------
    def __add__(self, o): return apply("add", self, o)
    def __radd__(self, o): return apply("add", o, self)
    def __sub__(self, o): return apply("sub", self, o)
    def __rsub__(self, o): return apply("sub", o, self)
    def __mul__(self, o): return apply("mul", self, o)
    def __rmul__(self, o): return apply("mul", o, self)
    def __truediv__(self, o): return apply("div", self, o)
    def __rtruediv__(self, o): return apply("div", o, self)
    def __floordiv__(self, o): return apply("floordiv", self, o)
    def __rfloordiv__(self, o): return apply("floordiv", o, self)
    def __mod__(self, o): return apply("mod", self, o)
    def __rmod__(self, o): return apply("mod", o, self)
    def __pow__(self, o): return apply("pow", self, o)
    def __rpow__(self, o): return apply("pow", o, self)
    def __neg__(self): return apply("neg", self)
    def __pos__(self): return self
    def __abs__(self): return apply("abs", self)
    def __lt__(self, o): return apply("lt", self, o)
    def __le__(self, o): return apply("le", self, o)
    def __gt__(self, o): return apply("gt", self, o)
    def __ge__(self, o): return apply("ge", self, o)
    def __eq__(self, o): return apply("eq", self, o)  # type: ignore[override]
    def __ne__(self, o): return apply("ne", self, o)  # type: ignore[override]
    def __and__(self, o): return apply("and", self, o)
    def __rand__(self, o): return apply("and", o, self)
    def __or__(self, o): return apply("or", self, o)
    def __ror__(self, o): return apply("or", o, self)
    def __invert__(self): return apply("not", self)


class _TraceContext:
    """Hash-conses nodes of one trace so shared subexpressions become one node."""

    def __init__(self):
        self.table: dict = {}

    def make(self, op, args, attr, vector) -> Node:
        key = (op, tuple(id(a) for a in args), attr if op != "const" else (type(attr), attr))
        node = self.table.get(key)
        if node is None:
            node = Node(op, args, attr, vector, self)
            self.table[key] = (node)
            # keep args alive so ids stay unique for the lifetime of the context
        return node


_ACTIVE: list[_TraceContext] = []


def _context() -> _TraceContext:
    if not _ACTIVE:
        raise RuntimeError("flashfold ops can only be applied while tracing (inside a "
                           "monoid's lift/combine/finalize, a score_mod or a mask_mod)")
    return _ACTIVE[-1]


def const(value) -> Node:
    """A constant leaf (float, int or bool)."""
    if isinstance(value, Node):
        return value
    if isinstance(value, bool):
        pass
    elif isinstance(value, int):
        pass
    elif isinstance(value, float):
        if math.isnan(value):
            raise ValueError("NaN constants are not allowed in a traced expression")
    else:
        try:
            import numpy as np
            if isinstance(value, np.generic):
                return const(value.item())
        except ImportError:  # pragma: no cover
            pass
        raise TypeError(f"cannot use {type(value).__name__} {value!r} in a traced "
                        f"expression; use numbers or flashfold.ops values")
    return _context().make("const", (), value, False)


def apply(op: str, *args) -> Node:
    """Build node ``op(*args)``, promoting Python numbers to constants."""
    if op not in OPS:
        raise ValueError(f"unknown IR op {op!r}")
    nodes = tuple(const(a) for a in args)
    folded = _fold_constants(op, nodes)
    if folded is not None:
        return folded
    vector = any(n.vector for n in nodes)
    return _context().make(op, nodes, None, vector)


class Buffer:
    """A captured table that traced code may index: ``docs = Buffer(doc_ids); docs[q_idx]``.

    ``data`` is any array-like with a ``shape`` (NumPy array or torch tensor, kept by
    reference and handed to the lowered code at run time). Indexing with traced integers
    builds a ``load`` node on the flattened (row-major) table; out-of-range indices are
    clamped to the table, so masked-off lanes of a kernel never read out of bounds.
    """

    def __init__(self, data, name: str | None = None):
        shape = tuple(int(s) for s in getattr(data, "shape", ()))
        if len(shape) not in (1, 2):
            raise ValueError(f"Buffer: expected a 1-D or 2-D table, got shape {shape}")
        self.data = data
        self.shape = shape
        self.numel = shape[0] * (shape[1] if len(shape) == 2 else 1)
        self.name = name

    def __repr__(self):
        return f"Buffer(shape={self.shape})"

    def __getitem__(self, index):
        idx = index if isinstance(index, tuple) else (index,)
        if len(idx) != len(self.shape):
            raise IndexError(f"Buffer of shape {self.shape} needs {len(self.shape)} indices")
        flat = idx[0] if len(idx) == 1 else idx[0] * self.shape[1] + idx[1]
        flat = const(flat)
        return _context().make("load", (flat,), self, flat.vector)


def reduce_node(op: str, x) -> Node:
    """A reduction (or, for an op of :data:`SCANS`, a prefix scan) over the block axis
    (only meaningful inside a block lift or block scan)."""
    x = const(x)
    return _context().make(op, (x,), None, x.vector)


def _fold_constants(op, nodes):
    """Cheap algebraic simplifications that keep the IR small and readable."""
    if op in ("add",):
        a, b = nodes
        if _is_const(a, 0) and not is_bool(b):
            return b
        if _is_const(b, 0) and not is_bool(a):
            return a
    if op == "mul":
        a, b = nodes
        if _is_const(a, 1):
            return b
        if _is_const(b, 1):
            return a
    if op == "sub" and _is_const(nodes[1], 0):
        return nodes[0]
    return None


def _is_const(n: Node, value) -> bool:
    return n.op == "const" and not isinstance(n.attr, bool) and n.attr == value


def is_bool(n: Node) -> bool:
    """Whether a node is a truth value by the IR's own rule: a comparison or logical op,
    or a bool constant."""
    return n.op in BOOLEAN or (n.op == "const" and isinstance(n.attr, bool))


@dataclass(frozen=True)
class Var:
    """A named input of a graph; ``vector`` marks a trailing feature axis."""
    name: str
    vector: bool = False


@dataclass(frozen=True, eq=False)
class Graph:
    """A traced function: named inputs -> output expressions (a DAG of :class:`Node`)."""
    name: str
    inputs: tuple[Var, ...]
    outputs: tuple[Node, ...]

    def nodes(self) -> list[Node]:
        """All nodes reachable from the outputs, in topological order (inputs first)."""
        order: list[Node] = []
        seen: set[int] = set()
        for var_node in self._var_nodes:
            if id(var_node) not in seen:
                seen.add(id(var_node))
                order.append(var_node)
        stack = [(n, False) for n in reversed(self.outputs)]
        while stack:
            node, expanded = stack.pop()
            if id(node) in seen:
                continue
            if expanded:
                seen.add(id(node))
                order.append(node)
                continue
            stack.append((node, True))
            for a in reversed(node.args):
                if id(a) not in seen:
                    stack.append((a, False))
        return order

    @property
    def _var_nodes(self) -> list[Node]:
        return [self._vars[v.name] for v in self.inputs]

    @property
    def _vars(self) -> dict:
        return object.__getattribute__(self, "_var_map")

    def text(self) -> str:
        """A readable SSA listing, e.g. for ``flashfold trace`` or error messages."""
        names: dict[int, str] = {}
        lines = [f"{self.name}({', '.join(v.name + ('[d]' if v.vector else '') for v in self.inputs)}):"]
        k = 0
        for n in self.nodes():
            if n.op == "var":
                names[id(n)] = n.attr
                continue
            if n.op == "const":
                names[id(n)] = repr(n.attr)
                continue
            names[id(n)] = f"t{k}"
            args = ", ".join(names[id(a)] for a in n.args)
            if n.op == "load":
                args = f"buf{self.buffers.index(n.attr)}{list(n.attr.shape)}, {args}"
            lines.append(f"  t{k} = {n.op}({args})")
            k += 1
        lines.append("  return " + ", ".join(names[id(o)] for o in self.outputs))
        return "\n".join(lines)

    def key(self) -> str:
        """A stable content hash (used to cache generated source on disk), computed once
        per graph (a graph is immutable; kernel plans key on it on every call)."""
        k = self.__dict__.get("_key")
        if k is None:
            k = hashlib.sha256(self.text().encode()).hexdigest()[:16]
            object.__setattr__(self, "_key", k)
        return k

    def uses_reductions(self) -> bool:
        return any(n.op in REDUCTIONS or n.op in SCANS for n in self.nodes())

    @property
    def buffers(self) -> tuple:
        """Captured :class:`Buffer` objects, in order of first use (found once per graph,
        as :meth:`key`)."""
        out = self.__dict__.get("_buffers")
        if out is None:
            found: list = []
            for n in self.nodes():
                if n.op == "load" and all(b is not n.attr for b in found):
                    found.append(n.attr)
            out = tuple(found)
            object.__setattr__(self, "_buffers", out)
        return out


def trace(fn: Callable, inputs: Sequence[Var], name: str,
          call: Callable[[Callable, list[Node]], object] | None = None,
          n_outputs: int | None = None) -> Graph:
    """Trace ``fn`` on symbolic inputs into a :class:`Graph`.

    ``call(fn, var_nodes)`` adapts how the symbolic inputs are passed (e.g. grouped into
    two state objects for a combine); by default ``fn(*var_nodes)``. ``fn`` may return a
    node, a number, or a tuple/list of them.
    """
    ctx = _TraceContext()
    _ACTIVE.append(ctx)
    try:
        var_map = {v.name: ctx.make("var", (), v.name, v.vector) for v in inputs}
        nodes = [var_map[v.name] for v in inputs]
        result = call(fn, nodes) if call is not None else fn(*nodes)
        outs = _as_outputs(result, name)
        outs = tuple(const(o) for o in outs)
    finally:
        _ACTIVE.pop()
    if n_outputs is not None and len(outs) != n_outputs:
        raise ValueError(f"{name} returned {len(outs)} values, expected {n_outputs}")
    g = Graph(name, tuple(inputs), outs)
    object.__setattr__(g, "_var_map", var_map)
    object.__setattr__(g, "_ctx", ctx)
    return g


def substitute(outputs: Sequence[Node], mapping: dict) -> list[Node]:
    """Rebuild ``outputs`` in the active trace with ``mapping`` (``id(old node) -> new
    value``) put in place of those nodes.

    Every other node is re-applied through :func:`apply` / :func:`reduce_node`, so the
    result is hash-consed into the active trace (shared subexpressions stay shared,
    constants fold) and may be combined with the nodes of that trace. A ``var`` that
    ``mapping`` does not bind raises ``ValueError``.
    """
    memo: dict[int, Node] = {}

    def go(n: Node) -> Node:
        key = id(n)
        if key in mapping:
            return const(mapping[key])
        hit = memo.get(key)
        if hit is not None:
            return hit
        if n.op == "var":
            raise ValueError(f"substitute: variable {n.attr!r} is not bound")
        if n.op == "const":
            out = const(n.attr)
        elif n.op == "load":
            index = go(n.args[0])
            out = _context().make("load", (index,), n.attr, index.vector)
        elif n.op in REDUCTIONS or n.op in SCANS:
            out = reduce_node(n.op, go(n.args[0]))
        else:
            out = apply(n.op, *(go(a) for a in n.args))
        memo[key] = out
        return out

    return [go(o) for o in outputs]


def inline(graph: "Graph", *args) -> list[Node]:
    """``graph``'s outputs applied to ``args`` (one value per input, in order) inside the
    active trace: calling a traced function from another trace."""
    if len(args) != len(graph.inputs):
        raise ValueError(f"inline: {graph.name} takes {len(graph.inputs)} inputs, got {len(args)}")
    mapping = {id(graph._vars[v.name]): a for v, a in zip(graph.inputs, args)}
    return substitute(graph.outputs, mapping)


def depends_on(node: Node, leaves: Iterable[Node]) -> bool:
    """Whether ``node`` reaches any of ``leaves`` (by identity)."""
    targets = {id(x) for x in leaves}
    seen: set[int] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if id(n) in targets:
            return True
        if id(n) in seen:
            continue
        seen.add(id(n))
        stack.extend(n.args)
    return False


def _as_outputs(result, name: str) -> tuple:
    if isinstance(result, dict):
        raise TypeError(f"{name} must return a value or a tuple of values, not a dict")
    if isinstance(result, (tuple, list)):
        return tuple(result)
    return (result,)


def iter_ops(graph: Graph) -> Iterable[str]:
    return (n.op for n in graph.nodes())
