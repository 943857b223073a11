"""``flashfold.ops``: the math a combine, lift, finalize, score_mod or mask_mod is written in.

Every function takes traced values (or Python numbers) and returns a traced value; the
same definition is then lowered to NumPy, Triton, SymPy or torch. Data-dependent choices
go through :func:`where`::

    from flashfold import ops

    def combine(a, b):
        m = ops.maximum(a.m, b.m)
        pivot = ops.where(m == -ops.inf, 0.0, m)      # keep the pivot finite: no -inf - -inf
        return m, a.d * ops.exp(a.m - pivot) + b.d * ops.exp(b.m - pivot)

Reductions (:func:`reduce_sum`, :func:`reduce_max`, :func:`reduce_min`) act over the
elements of a block and are only valid inside a monoid's ``block_lift`` or
``block_scan``; :func:`scan_sum` (the inclusive prefix sum along the block) only inside a
``block_scan``.
"""

from __future__ import annotations

import math

from .ir import Buffer, apply, reduce_node

inf = math.inf
pi = math.pi
e = math.e
LOG2E = 1.0 / math.log(2.0)   # log2(e): multiply a natural-log score by it for exp2
LN2 = math.log(2.0)


def exp(x): return apply("exp", x)
def exp2(x): return apply("exp2", x)
def log(x): return apply("log", x)
def log2(x): return apply("log2", x)
def log1p(x): return apply("log1p", x)
def expm1(x): return apply("expm1", x)
def sqrt(x): return apply("sqrt", x)
def abs(x): return apply("abs", x)  # noqa: A001 - mirrors numpy/torch naming
def tanh(x): return apply("tanh", x)
def sigmoid(x): return apply("sigmoid", x)
def floor(x): return apply("floor", x)
def isnan(x): return apply("isnan", x)
def isinf(x): return apply("isinf", x)
def to_float(x): return apply("to_float", x)
def to_int(x): return apply("to_int", x)
def maximum(a, b): return apply("maximum", a, b)
def minimum(a, b): return apply("minimum", a, b)
def where(cond, a, b): return apply("where", cond, a, b)
def logical_and(a, b): return apply("and", a, b)
def logical_or(a, b): return apply("or", a, b)
def logical_not(a): return apply("not", a)
def pow(a, b): return apply("pow", a, b)  # noqa: A001


def clamp(x, lo, hi):
    """``min(max(x, lo), hi)``."""
    return minimum(maximum(x, lo), hi)


def softcap(x, cap):
    """``cap * tanh(x / cap)``: Gemma-style logit capping."""
    return cap * tanh(x / cap)


def reduce_sum(x): return reduce_node("rsum", x)
def reduce_max(x): return reduce_node("rmax", x)
def reduce_min(x): return reduce_node("rmin", x)
def scan_sum(x): return reduce_node("csum", x)


__all__ = ["Buffer", "inf", "pi", "e", "LOG2E", "LN2", "exp", "exp2", "log", "log2", "log1p", "expm1",
           "sqrt", "abs", "tanh", "sigmoid", "floor", "isnan", "isinf", "to_float", "to_int",
           "maximum", "minimum", "where", "logical_and", "logical_or", "logical_not", "pow",
           "clamp", "softcap", "reduce_sum", "reduce_max", "reduce_min", "scan_sum"]
