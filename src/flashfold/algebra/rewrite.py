r"""Rewrites of traced graphs that every lowering benefits from.

A traced graph computes exactly what its Python source says; a kernel wants a cheaper
form of the same function. The rewrites here are generic (they know ops, not monoids),
each exact in real arithmetic, and apply to any graph:

* **uniform factors** (:func:`hoist_uniform`): in a product, the factors that do not vary
  over a tile (constants and the inputs named ``uniform``, e.g. a kernel's score scale)
  are multiplied together first, ``(x u_1) u_2 -> x (u_1 u_2)``, so that a tile pays one
  multiply per element (which the backend contracts with a following subtraction into an
  FMA) and ``u_1 u_2`` is computed once;
* **monotone reductions** (same function): ``max_j (x_j u) = (max_j x_j) u`` and likewise
  for ``min``, when ``u`` is uniform and positive (an input named in ``positive``, a
  positive constant, or a product of them): a row max costs one multiply per row instead
  of one per element. In floating point this is exact (rounding is monotone, so the
  largest product is the product of the largest factor) and NaN propagates alike.

* **range facts** (:func:`assume_above_minus_inf`): a test ``x == -inf`` of an input
  known never to be ``-inf`` (finite, ``+inf`` or NaN: NaN compares unequal too) is
  ``False``, and ``where(False, a, b)`` is ``b``; a factor's finite pivot of an empty
  state, ``where(r == -inf, 0, r)``, is then ``r`` itself (the attention backward's
  ``lambda``, ``+inf`` for a row without keys, never ``-inf``).

The reassociation changes rounding (by an ulp of the product), as any kernel that folds
a scale into ``log2 e`` does; the references compute in float64 and the kernels' results
are held to the tolerance of their dtype.
"""

from __future__ import annotations

import math
from typing import Iterable

from .ir import REDUCTIONS, Graph, Node, apply, const, reduce_node, substitute, trace


def _flatten_mul(n: Node, out: list) -> list:
    if n.op == "mul":
        for a in n.args:
            _flatten_mul(a, out)
    else:
        out.append(n)
    return out


def _product(nodes: list[Node]) -> Node:
    acc = nodes[0]
    for x in nodes[1:]:
        acc = apply("mul", acc, x)
    return acc


class _Facts:
    """Which nodes are uniform (one value for a whole tile) and which are positive."""

    def __init__(self, uniform: Iterable[str], positive: Iterable[str]):
        self.uniform_vars = set(uniform)
        self.positive_vars = set(positive)
        self._u: dict[int, bool] = {}
        self._p: dict[int, bool] = {}

    def uniform(self, n: Node) -> bool:
        hit = self._u.get(id(n))
        if hit is None:
            if n.op == "const":
                hit = True
            elif n.op == "var":
                hit = n.attr in self.uniform_vars
            elif n.op in REDUCTIONS or n.op == "load":
                hit = False
            else:
                hit = all(self.uniform(a) for a in n.args)
            self._u[id(n)] = hit
        return hit

    def positive(self, n: Node) -> bool:
        hit = self._p.get(id(n))
        if hit is None:
            if n.op == "const":
                hit = (not isinstance(n.attr, bool) and isinstance(n.attr, (int, float))
                       and 0 < n.attr < math.inf)
            elif n.op == "var":
                hit = n.attr in self.positive_vars
            elif n.op == "mul":
                hit = all(self.positive(a) for a in n.args)
            else:
                hit = False
            self._p[id(n)] = hit
        return hit


def _names(value, name: str) -> set:
    """``value`` (a sequence of input names) as a set; ``TypeError`` naming ``name`` for a
    string (its characters would be read as names, and match none) or an item that is
    not a string."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name}: expected a sequence of input names, got "
                        f"{type(value).__name__} {value!r} (pass ({value!r},) for one)")
    try:
        items = list(value)
    except TypeError:
        raise TypeError(f"{name}: expected a sequence of input names, got "
                        f"{type(value).__name__}") from None
    bad = [v for v in items if not isinstance(v, str)]
    if bad:
        raise TypeError(f"{name}: expected a sequence of input names, got {bad[0]!r} in it")
    return set(items)


def _check_graph(graph) -> None:
    if not isinstance(graph, Graph):
        raise TypeError(f"graph: expected a traced flashfold Graph, got {type(graph).__name__}")


def _rewrite(graph: Graph, rule) -> Graph:
    """``graph`` rebuilt bottom-up, each node by ``rule(n, go)`` (``go`` rewrites a child;
    ``None``: rebuild the node from its rewritten children). Same inputs and outputs."""
    memo: dict[int, Node] = {}

    def go(n: Node) -> Node:
        hit = memo.get(id(n))
        if hit is not None:
            return hit
        if n.op in ("var", "const"):
            return n
        out = rule(n, go)
        if out is None:
            if n.op in REDUCTIONS or n.op == "csum":
                out = reduce_node(n.op, go(n.args[0]))
            elif n.op == "load":
                out = substitute([n], {id(a): go(a) for a in n.args})[0]
            else:
                out = apply(n.op, *(go(a) for a in n.args))
        memo[id(n)] = out
        return out

    def rebuild(*nodes):
        mapping = {id(graph._vars[v.name]): x for v, x in zip(graph.inputs, nodes)}
        # re-trace: first bind the inputs, then rewrite the rebuilt expressions
        return [go(o) for o in substitute(graph.outputs, mapping)]

    return trace(rebuild, graph.inputs, graph.name)


def hoist_uniform(graph: Graph, uniform: Iterable[str] = (), positive: Iterable[str] = ()) -> Graph:
    """``graph`` with the two rewrites of the module docstring applied everywhere.

    ``uniform``: input names whose value is the same for every element of a tile;
    ``positive``: the uniform inputs known to be ``> 0`` (finite). Nothing else changes:
    the result has the same inputs and outputs, in order. ``TypeError`` for a ``graph``
    that is not one, or names that are not a sequence of strings.
    """
    _check_graph(graph)
    positive = _names(positive, "positive")
    uniform = _names(uniform, "uniform") | positive
    facts = _Facts(uniform, positive)

    def rule(n: Node, go):
        if n.op == "mul":
            factors = [go(a) for a in _flatten_mul(n, [])]
            fixed = [f for f in factors if facts.uniform(f)]
            moving = [f for f in factors if not facts.uniform(f)]
            if moving and len(fixed) >= 2:
                return apply("mul", _product(moving), _product(fixed))
            if moving and fixed:
                return apply("mul", _product(moving), fixed[0])
            return _product(factors)
        if n.op in ("rmax", "rmin"):
            x = go(n.args[0])
            if x.op == "mul" and facts.uniform(x.args[1]) and facts.positive(x.args[1]) \
                    and not facts.uniform(x.args[0]):
                return apply("mul", reduce_node(n.op, x.args[0]), x.args[1])
            return reduce_node(n.op, x)
        return None

    return _rewrite(graph, rule)


def assume_above_minus_inf(graph: Graph, names: Iterable[str]) -> Graph:
    """``graph`` with the inputs ``names`` known never to be ``-inf`` (module docstring):
    exact for every value they may take, NaN included. Same inputs and outputs.
    ``TypeError`` as :func:`hoist_uniform`."""
    _check_graph(graph)
    names = _names(names, "names")

    def rule(n: Node, go):
        if n.op == "eq" and any(a.op == "var" and a.attr in names for a in n.args) \
                and any(a.op == "const" and a.attr == -math.inf for a in n.args):
            return const(False)
        if n.op == "where":
            c, x, y = (go(a) for a in n.args)
            if c.op == "const" and isinstance(c.attr, bool):
                return x if c.attr else y
            return apply("where", c, x, y)
        return None

    return _rewrite(graph, rule)


__all__ = ["hoist_uniform", "assume_above_minus_inf"]
