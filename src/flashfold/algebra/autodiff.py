r"""Symbolic differentiation of traced graphs: :func:`derivative` turns a
:class:`~flashfold.algebra.ir.Graph` into a new graph computing its derivative.

Forward mode over the DAG: every node ``n`` of the graph gets a *tangent* node
:math:`\dot n = \partial n / \partial x` for the chosen input ``x``, built from the
tangents of its arguments by the rule of its op (chain rule). Tangents that are zero by
construction (constants, integer indices, table loads, comparisons) are tracked as a
structural zero and never emitted, so the derivative of ``score + slope[h] * (kv - q)``
with respect to ``score`` is the constant 1, and that of ``c tanh(s / c)`` is
``1 - t^2`` with ``t`` shared with the value. The result is an ordinary graph with the
*same inputs* as the original (and the same captured tables), whose outputs are
``(value, d value / d x)`` (or only the derivative), so every backend lowers it: NumPy,
torch, Triton source (:func:`flashfold.kernels.codegen.triton_function`). The attention
backward kernel uses it for ``d score_mod / d score``.

Rules (``r`` is the node's value, ``a``, ``b`` its arguments, dots their tangents):

=============================  ===========================================================
op                             tangent
=============================  ===========================================================
``neg``, ``add``, ``sub``      linear
``mul``, ``div``               :math:`\dot a b + a \dot b`, :math:`(\dot a - r \dot b) / b`
``exp``, ``exp2``              :math:`r \dot a`, :math:`r \ln 2\, \dot a`
``log``, ``log2``, ``log1p``   :math:`\dot a / a`, :math:`\dot a / (a \ln 2)`, :math:`\dot a / (1 + a)`
``expm1``, ``sqrt``            :math:`(r + 1) \dot a`, :math:`\dot a / (2 r)`
``tanh``, ``sigmoid``          :math:`(1 - r^2) \dot a`, :math:`r (1 - r) \dot a`
``abs``                        :math:`\operatorname{sign}(a) \dot a` (0 at 0, as torch)
``pow``                        :math:`b a^{b-1} \dot a + r \log(a) \dot b`
``maximum``, ``minimum``       the tangent of the selected side; half of each on a tie
                               (as torch)
``where``                      ``where(cond, da, db)``
``mod``                        :math:`\dot a - \lfloor a / b \rfloor \dot b`
``to_float``                   :math:`\dot a`
``rsum``, ``csum``             ``rsum(da)``, ``csum(da)``; ``rmax``/``rmin``: mean
                               tangent of the elements equal to the extremum
``floor``, ``to_int``,         0 (piecewise constant, integer or boolean results)
``floordiv``, comparisons,
``and``/``or``/``not``,
``isnan``/``isinf``, ``load``
=============================  ===========================================================

Captured tables (``ops.Buffer``) are constants: no gradient flows into them. Derivatives
are those of the expression almost everywhere; at a kink (``abs`` at 0, a tie of
``maximum``) the convention above matches ``torch.autograd`` on the torch lowering.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from .ir import (BINARY, BOOLEAN, REDUCTIONS, SCANS, UNARY, Graph, Node, _context, apply, const,
                 reduce_node, trace)

LN2 = math.log(2.0)

#: ops whose derivative is zero everywhere it exists
ZERO_DERIVATIVE = ("floor", "to_int", "floordiv", "isnan", "isinf", "load") + BOOLEAN

#: every op :func:`derivative` differentiates
SUPPORTED = tuple(sorted(set(UNARY) | set(BINARY) | set(REDUCTIONS) | set(SCANS)
                         | {"where", "load", "var", "const"}))


# --- tangent arithmetic: structural zeros (None) and constant folding ------------------

_FOLD = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
         "div": lambda a, b: a / b, "neg": lambda a: -a}


def _num(x):
    """The Python number of a constant (non-boolean) node or number, else None."""
    if isinstance(x, Node):
        return x.attr if x.op == "const" and not isinstance(x.attr, bool) else None
    return None if isinstance(x, bool) else x


def _op(op, *args):
    """``apply(op, *args)``, folding arithmetic on constants (the derivative of ``s / 3``
    is the constant ``1/3``, not ``div(1, 3)``) and multiplications by 0 and 1."""
    nums = [_num(a) for a in args]
    if op in _FOLD and all(n is not None for n in nums):
        try:
            return const(float(_FOLD[op](*nums)))
        except ZeroDivisionError:
            pass
    if op == "mul":
        a, b = args
        if nums[0] == 1:
            return const(b)
        if nums[1] == 1:
            return const(a)
        if nums[0] == -1:
            return _op("neg", b)
        if nums[1] == -1:
            return _op("neg", a)
    if op == "div" and nums[1] == 1:
        return const(args[0])
    return apply(op, *args)


def _add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return _op("add", a, b)


def _sub(a, b):
    if b is None:
        return a
    if a is None:
        return _op("neg", b)
    return _op("sub", a, b)


def _mul(t, factor):
    """``t * factor`` (``t`` a tangent or None)."""
    return None if t is None else _op("mul", t, factor)


def _div(t, den):
    return None if t is None else _op("div", t, den)


def _zero_or(t):
    return const(0.0) if t is None else t


def _rule(op: str, r: Node, args: tuple, dots: tuple):
    """The tangent of ``r = op(*args)`` from the arguments' tangents (None = zero)."""
    if op in ZERO_DERIVATIVE:
        return None
    if all(d is None for d in dots):
        return None
    a = args[0]
    da = dots[0]
    if op == "neg":
        return _op("neg", da)
    if op == "to_float":
        return da
    if op == "exp":
        return _mul(da, r)
    if op == "exp2":
        return _mul(da, _op("mul", r, LN2))
    if op == "log":
        return _div(da, a)
    if op == "log2":
        return _div(da, _op("mul", a, LN2))
    if op == "log1p":
        return _div(da, _op("add", a, 1.0))
    if op == "expm1":
        return _mul(da, _op("add", r, 1.0))
    if op == "sqrt":
        return _div(da, _op("mul", r, 2.0))
    if op == "tanh":
        return _mul(da, _op("sub", 1.0, _op("mul", r, r)))
    if op == "sigmoid":
        return _mul(da, _op("mul", r, _op("sub", 1.0, r)))
    if op == "abs":
        return apply("where", a > 0.0, da, apply("where", a < 0.0, _op("neg", da), 0.0))
    if op == "where":
        cond = args[0]
        dx, dy = dots[1], dots[2]
        if dx is None and dy is None:
            return None
        return apply("where", cond, _zero_or(dx), _zero_or(dy))
    b = args[1]
    db = dots[1]
    if op == "add":
        return _add(da, db)
    if op == "sub":
        return _sub(da, db)
    if op == "mul":
        return _add(_mul(da, b), _mul(db, a))
    if op == "div":
        return _div(_sub(da, _mul(db, r)), b)
    if op == "pow":
        out = _mul(da, _op("mul", b, apply("pow", a, _op("sub", b, 1.0))))
        return _add(out, _mul(db, _op("mul", r, apply("log", a))))
    if op == "mod":
        return _sub(da, _mul(db, apply("floor", _op("div", a, b))))
    if op in ("maximum", "minimum"):
        pick_a = (a > b) if op == "maximum" else (a < b)
        pick_b = (a < b) if op == "maximum" else (a > b)
        za, zb = _zero_or(da), _zero_or(db)
        return apply("where", pick_a, za, apply("where", pick_b, zb, _op("mul", _op("add", za, zb), 0.5)))
    raise NotImplementedError(f"derivative: no rule for IR op {op!r}")


def _reduce_rule(op: str, r: Node, a: Node, da):
    if da is None:
        return None
    if op in ("rsum", "csum"):                   # linear: the sum (prefix sum) of tangents
        return reduce_node(op, da)
    hit = a == r                                 # the elements attaining the extremum
    count = reduce_node("rsum", apply("where", hit, 1.0, 0.0))
    return _op("div", reduce_node("rsum", apply("where", hit, da, 0.0)), count)


# --- the transformation ----------------------------------------------------------------

def derivative(graph: Graph, wrt: str, *, output: int = 0, with_value: bool = True,
               name: str | None = None) -> Graph:
    """The derivative of output ``output`` of ``graph`` with respect to input ``wrt``.

    Returns a new :class:`Graph` with the same inputs (and captured tables) as ``graph``
    and outputs ``(value, d value / d wrt)`` when ``with_value`` (the value shares its
    subexpressions with the derivative: one lowering computes both), else
    ``(d value / d wrt,)``. A derivative that is identically zero or constant is a
    constant output. Raises ``ValueError`` for an unknown input name or output index,
    ``TypeError`` for a ``graph`` that is not one, an ``output`` that is not an int or a
    ``with_value`` that is not a bool, and ``NotImplementedError`` for an op without a
    rule (see the module table).
    """
    if not isinstance(graph, Graph):
        raise TypeError(f"graph: expected a traced flashfold Graph, got {type(graph).__name__}")
    if isinstance(output, bool) or not isinstance(output, numbers.Integral):
        raise TypeError(f"output: expected an int (an output index), got "
                        f"{type(output).__name__}")
    if not isinstance(with_value, (bool, np.bool_)):
        raise TypeError(f"with_value: expected a bool, got {type(with_value).__name__}")
    output = int(output)
    names = [v.name for v in graph.inputs]
    if wrt not in names:
        raise ValueError(f"derivative: {graph.name} has no input {wrt!r}; inputs are {names}")
    if not 0 <= output < len(graph.outputs):
        raise ValueError(f"derivative: {graph.name} has {len(graph.outputs)} outputs, "
                         f"asked for output {output}")
    nodes = graph.nodes()
    for n in nodes:
        if n.op not in SUPPORTED:
            raise NotImplementedError(f"derivative: no rule for IR op {n.op!r}")

    def rebuild(*var_nodes):
        by_name = dict(zip(names, var_nodes))
        val: dict[int, Node] = {}
        dot: dict[int, Node | None] = {}
        for n in nodes:
            if n.op == "var":
                val[id(n)] = by_name[n.attr]
                dot[id(n)] = const(1.0) if n.attr == wrt else None
            elif n.op == "const":
                val[id(n)] = const(n.attr)
                dot[id(n)] = None
            elif n.op == "load":
                idx = val[id(n.args[0])]
                val[id(n)] = _context().make("load", (idx,), n.attr, idx.vector)
                dot[id(n)] = None
            elif n.op in REDUCTIONS or n.op in SCANS:
                a = val[id(n.args[0])]
                r = reduce_node(n.op, a)
                val[id(n)] = r
                dot[id(n)] = _reduce_rule(n.op, r, a, dot[id(n.args[0])])
            else:
                args = tuple(val[id(a)] for a in n.args)
                r = apply(n.op, *args)
                val[id(n)] = r
                dot[id(n)] = _rule(n.op, r, args, tuple(dot[id(a)] for a in n.args))
        out = graph.outputs[output]
        d = _zero_or(dot[id(out)])
        return (val[id(out)], d) if with_value else (d,)

    return trace(rebuild, graph.inputs, name or f"d({graph.name})/d{wrt}",
                 n_outputs=2 if with_value else 1)


__all__ = ["derivative", "SUPPORTED", "ZERO_DERIVATIVE"]
