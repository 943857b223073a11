r"""Rescale twists, and the tile step every FlashAttention-style kernel runs, derived.

The specification's twist: the state ``(m, d, o)`` of ATTENTION is the direct product
``(max, +, +)`` over ``(m, D, O)`` seen through ``psi(m, D, O) = (m, D e^{-m}, O e^{-m})``.
Read off the combine, that is a *rescale twist*: one **reference** field combined by
``max``, and **linear** fields that the combine rebases to the new reference by a factor
``g(m, r)`` and adds,

.. math::

    r = \max(a_m, b_m), \qquad f = a_f\, g(a_m, r) + b_f\, g(b_m, r)

(``g(m, r) = e^{m - pivot(r)}`` for ATTENTION and LOGSUMEXP, ``2^{m - pivot(r)}`` for
their base-2 transports, with the finite pivot of an empty state). :func:`rescale_twist`
finds that structure in a monoid's traced combine, or says why it is not there; nothing
is declared by hand.

**The tile step.** A kernel folds a tile of elements ``x_1 .. x_n`` (a row's scores
against a key tile, with their values) into a running state ``S``. Associativity allows
``S ⊕ lift(x_1) ⊕ ... ⊕ lift(x_n)`` in any bracketing, and a rescale twist allows the
cheapest one: rebase everything once to the common reference
``r = max(S_m, max_j lift(x_j)_m)``, where the combine is plain addition:

.. math::

    \alpha = g(S_m, r), \quad w_j = g(\mathrm{lift}(x_j)_m, r), \quad
    f' = \alpha\, S_f + \sum_j w_j\, \mathrm{lift}(x_j)_f, \quad m' = r

(the factor's cocycle property ``g(a, b) g(b, c) = g(a, c)`` for ``a <= b <= c`` is what
makes this equal to the pairwise folds; :func:`tile_step`'s tests check it against the
monoid's own fold on special values). A vector field whose lift is linear in a vector
input, ``lift(x)_o = c(x) v`` (ATTENTION: ``where(s > -inf, v, 0)``), is returned as its
weights ``p_j = w_j c(x_j)``: the kernel forms ``o' = alpha o + P V`` with its matrix
unit. Where the lift's weight is the liveness indicator ``where(x_m > -inf, 1, 0)`` and
``g(-inf, r) = 0`` for every ``r`` (checked numerically when the step is derived), the
indicator is dropped: ``w_j`` is already 0 for a dead element. The one case where the
two differ, a NaN ``r``, makes ``alpha`` NaN and with it every output of the step, so the
step's outputs are the same for every input.

This is exactly the hand-scheduled FlashAttention step (``m' = max(m, rowmax S)``,
``alpha = 2^{m - m'}``, ``P = 2^{S - m'}``, ``l' = alpha l + rowsum P``, ``o' = alpha o +
P V``), derived from the monoid instead of restated: a change to the monoid reaches every
kernel that inlines its step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import ops
from .ir import Graph, Node, Var, const, depends_on, inline, substitute, trace
from .lower import compile_graph
from .monoid import Monoid
from .rewrite import assume_above_minus_inf, hoist_uniform


@dataclass(frozen=True)
class RescaleTwist:
    """The rescale structure of a monoid's combine (module docstring).

    ``ref``: the reference field (combined by ``max``); ``linear``: the other fields, in
    field order, each rebased by ``factor`` and added; ``factor``: the graph
    ``g(m, r)`` shared by every linear field.
    """
    monoid: Monoid
    ref: str
    linear: tuple[str, ...]
    factor: Graph


def _check_flag(name: str, value) -> None:
    """``TypeError`` naming ``name`` unless ``value`` is a bool: a string such as ``"no"``
    is truthy, and a flag here changes the derived graph."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")


def _is_var(n: Node, name: str) -> bool:
    return n.op == "var" and n.attr == name


def _rebased(out: Node, a: Node, b: Node):
    """``(F_a, F_b)`` when ``out = a F_a + b F_b`` (either order of the sum and of each
    product), else ``None``."""
    if out.op != "add":
        return None
    sides = {}
    for term in out.args:
        if term.op != "mul":
            return None
        x, y = term.args
        if x is a or x is b:
            sides[id(x)] = y
        elif y is a or y is b:
            sides[id(y)] = x
        else:
            return None
    if set(sides) != {id(a), id(b)}:
        return None
    return sides[id(a)], sides[id(b)]


def _factor_graph(expr: Node, m_leaf: Node, r_node: Node, name: str) -> Graph | None:
    """``expr`` as a function of ``(m, r)`` (``m_leaf -> m``, ``r_node -> r``), or None when
    it depends on anything else."""
    try:
        return trace(lambda m, r: substitute([expr], {id(m_leaf): m, id(r_node): r}),
                     [Var("m"), Var("r")], name)
    except ValueError:                    # a variable other than m and r
        return None


def rescale_twist(monoid: Monoid) -> RescaleTwist:
    """The rescale twist of ``monoid``'s combine (module docstring); ``ValueError`` saying
    which part of the pattern is missing when the combine is not one."""
    if not isinstance(monoid, Monoid):
        raise TypeError(f"monoid: expected a flashfold Monoid, got {type(monoid).__name__}")
    g = monoid.combine_graph
    names = monoid.field_names
    a = {f: g._vars["a_" + f] for f in names}
    b = {f: g._vars["b_" + f] for f in names}
    outs = dict(zip(names, g.outputs))
    refs = [f for f in names if outs[f].op == "maximum"
            and {id(x) for x in outs[f].args} == {id(a[f]), id(b[f])}]
    if len(refs) != 1:
        raise ValueError(f"monoid {monoid.name!r} is not a rescale twist: no single field is "
                         f"combined as max(a, b) (found {refs or 'none'})")
    ref = refs[0]
    r_node = outs[ref]
    linear, factor = [], None
    for f in names:
        if f == ref:
            continue
        sides = _rebased(outs[f], a[f], b[f])
        if sides is None:
            raise ValueError(f"monoid {monoid.name!r} is not a rescale twist: field {f!r} is "
                             f"not combined as a_{f} g(a_{ref}, r) + b_{f} g(b_{ref}, r)")
        ga = _factor_graph(sides[0], a[ref], r_node, f"{monoid.name}.factor")
        gb = _factor_graph(sides[1], b[ref], r_node, f"{monoid.name}.factor")
        if ga is None or gb is None or ga.key() != gb.key():
            raise ValueError(f"monoid {monoid.name!r} is not a rescale twist: the factors of "
                             f"field {f!r} are not one function g({ref}, r) of each side's "
                             f"{ref} and the combined {ref}")
        if factor is not None and factor.key() != ga.key():
            raise ValueError(f"monoid {monoid.name!r}: its linear fields are rebased by "
                             f"different factors; the tile step needs one")
        factor = ga
        linear.append(f)
    if not linear:
        raise ValueError(f"monoid {monoid.name!r} is not a rescale twist: nothing but the "
                         f"reference field {ref!r}")
    return RescaleTwist(monoid, ref, tuple(linear), factor)


def _linear_in(n: Node, v: Node) -> bool:
    """Whether ``n`` is linear and homogeneous in ``v`` (a sum of ``v`` times factors that
    do not depend on it, with ``where(c, ., 0)`` selections)."""
    if n is v:
        return True
    if not depends_on(n, [v]):
        return n.op == "const" and n.attr == 0
    if n.op == "mul":
        x, y = n.args
        return (_linear_in(x, v) and not depends_on(y, [v])) or \
               (_linear_in(y, v) and not depends_on(x, [v]))
    if n.op == "div":
        return _linear_in(n.args[0], v) and not depends_on(n.args[1], [v])
    if n.op in ("add", "sub"):
        return all(_linear_in(x, v) for x in n.args)
    if n.op == "neg":
        return _linear_in(n.args[0], v)
    if n.op == "where":
        c, x, y = n.args
        return not depends_on(c, [v]) and _linear_in(x, v) and _linear_in(y, v)
    return False


def _vanishes_at_minus_inf(factor: Graph) -> bool:
    """``g(-inf, r) == 0`` for every ``r`` that is not NaN (NumPy, float64)."""
    fn = compile_graph(factor, "numpy")
    r = np.array([-math.inf, -1e300, -3.0, 0.0, 2.5, 1e300, math.inf])
    with np.errstate(all="ignore"):
        (g,) = fn(np.full_like(r, -math.inf), r)
    return bool(np.all(np.asarray(g) == 0.0))


def _exponential(factor: Graph) -> bool:
    """``g(a, b) g(b, c) == g(a, c)`` for finite ``a, b, c`` in every order (NumPy,
    float64, to rounding): the factor is ``b^{a - c}``, whose pivot a constant shift of
    the reference scales by a constant."""
    fn = compile_graph(factor, "numpy")
    pts = np.array([-3.0, -0.5, 0.0, 1.25, 4.0])
    a, b, c = (x.ravel() for x in np.meshgrid(pts, pts, pts, indexing="ij"))
    with np.errstate(all="ignore"):
        (ab,) = fn(a, b)
        (bc,) = fn(b, c)
        (ac,) = fn(a, c)
    ab, bc, ac = (np.broadcast_to(np.asarray(x, dtype=np.float64), a.shape) for x in (ab, bc, ac))
    return bool(np.all(np.isfinite(ac)) and np.allclose(ab * bc, ac, rtol=1e-12, atol=0.0))


def _is_liveness(n: Node, ref_j: Node) -> bool:
    """``n`` is ``where(y > -inf, 1, 0)`` with ``ref_j`` either ``y`` or ``y`` times a positive
    constant (LOGSUMEXP2 tests the score before its ``log2 e``): the indicator of
    ``ref_j > -inf``."""
    if n.op != "where":
        return False
    c, x, y = n.args
    if not (c.op == "gt" and c.args[1].op == "const" and c.args[1].attr == -math.inf
            and x.op == "const" and x.attr == 1.0 and y.op == "const" and y.attr == 0.0):
        return False
    tested = c.args[0]
    if tested is ref_j:
        return True
    return (ref_j.op == "mul" and ref_j.args[0] is tested and ref_j.args[1].op == "const"
            and not isinstance(ref_j.args[1].attr, bool) and 0 < ref_j.args[1].attr < math.inf)


def _lift_tile(monoid: Monoid, tile: dict, scale: str | None, scale_node) -> dict:
    """``monoid``'s lift of one tile element, traced: each field by name, from the scalar
    inputs ``tile`` (the one named ``scale`` times ``scale_node``) and 1 for each vector
    input (the coefficient of ``v``: its lifts are linear in it, checked by the caller)."""
    args = [const(1.0) if i.vector else
            tile[i.name] * scale_node if i.name == scale else tile[i.name]
            for i in monoid.inputs]
    return dict(zip(monoid.field_names, inline(monoid.lift_graph, *args)))


@dataclass(frozen=True)
class TileStep:
    """The derived tile step of a rescale-twisted monoid (module docstring).

    ``graph`` takes ``(*state, *tile, *uniform)`` and returns ``(*state', alpha,
    *weights)``: ``state`` are the reference and the scalar linear fields (field order);
    ``tile`` the monoid's scalar inputs, one value per element of a tile whose last axis
    the reductions run over; ``uniform`` the score scale when asked for. Each vector
    field ``f`` of ``contract`` (pairs ``(field, vector input)``) is updated by the caller
    as ``f' = alpha f + sum_j weight_j v_j``.
    """
    monoid: Monoid
    graph: Graph
    state: tuple[str, ...]
    tile: tuple[str, ...]
    uniform: tuple[str, ...]
    contract: tuple[tuple[str, str], ...]


def tile_step(monoid: Monoid, *, scale: str | None = None, shift: bool = False) -> TileStep:
    """Derive ``monoid``'s tile step (module docstring).

    ``scale``: the name of a scalar input that the kernel passes as ``x * scale``, with
    ``scale > 0`` the same for the whole tile (attention's ``1 / sqrt(d)``, a softcap):
    the step then takes ``x`` as that input and ``scale`` as a uniform argument, and the
    rewrites of :mod:`.rewrite` fold the scale into the lift's constants (``scale log2
    e``) and pull it out of the row max.

    ``shift``: the step takes one more uniform argument ``s`` (after ``scale``) and weighs
    the tile against the reference ``r - s`` instead of ``r``: ``w_j = g(lift(x_j)_m, r -
    s)``, one subtraction per row. For an exponential factor ``g(m, r) = b^{m - r}`` (the
    only kind accepted: ``g(a, b) g(b, c) = g(a, c)`` for all finite arguments, checked
    when the step is derived) every weight and every linear field then carries the
    constant ``b^s``: the returned state ``(m', f)`` is the monoid's state ``(m' - s,
    f)``, the same value re-referenced, and ``m'`` stays the running max the next step
    takes. A kernel uses it to produce weights in the units a product wants (an FP8
    ``P V`` takes ``448 P = 2^{x - m' + log2 448}``) with no multiply per element, and
    finalizes at ``m' - s``.

    ``ValueError`` when the monoid is not a rescale twist, has position inputs, a vector
    field is not linear in one vector input, or ``shift`` meets a factor that is not
    exponential; ``TypeError`` for a ``monoid`` that is not one, a ``scale`` that is not an
    input name, a ``shift`` that is not a bool.
    """
    _check_flag("shift", shift)
    if scale is not None and not isinstance(scale, str):
        raise TypeError(f"scale: expected an input name (a str) or None, got "
                        f"{type(scale).__name__}")
    tw = rescale_twist(monoid)
    if shift and not _exponential(tw.factor):
        raise ValueError(f"tile_step: shift needs an exponential factor g(m, r) = b^(m - r) "
                         f"(g(a, b) g(b, c) = g(a, c)); {monoid.name!r}'s is not")
    fields = {f.name: f for f in monoid.fields}
    if any(i.domain == "position" for i in monoid.inputs):
        raise ValueError(f"monoid {monoid.name!r}: the tile step takes no position inputs")
    scalars = tuple(i.name for i in monoid.inputs if not i.vector)
    vectors = [i for i in monoid.inputs if i.vector]
    if scale is not None and scale not in scalars:
        raise ValueError(f"tile_step: scale names {scale!r}, not a scalar input of "
                         f"{monoid.name!r} {scalars}")
    lift = monoid.lift_graph
    vector_fields = [f for f in tw.linear if fields[f].vector]
    contract = []
    for f in vector_fields:
        out = lift.outputs[monoid.field_names.index(f)]
        used = [i for i in vectors if depends_on(out, [lift._vars[i.name]])]
        if len(used) != 1 or not _linear_in(out, lift._vars[used[0].name]):
            raise ValueError(f"monoid {monoid.name!r}: the lift of vector field {f!r} is not "
                             f"linear in one vector input; the tile step cannot contract it")
        contract.append((f, used[0].name))
    if len(vectors) > 1 and len({i for _, i in contract}) != len(vectors):
        raise ValueError(f"monoid {monoid.name!r}: a vector input no field contracts")
    state = (tw.ref,) + tuple(f for f in tw.linear if not fields[f].vector)
    uniform = (("scale",) if scale is not None else ()) + (("shift",) if shift else ())
    drop_liveness = _vanishes_at_minus_inf(tw.factor)

    def step(*nodes):
        st = dict(zip(state, nodes[:len(state)]))
        tile = dict(zip(scalars, nodes[len(state):len(state) + len(scalars)]))
        extra = dict(zip(uniform, nodes[len(state) + len(scalars):]))
        lifted = _lift_tile(monoid, tile, scale, extra.get("scale"))
        ref_j = lifted[tw.ref]
        r = ops.maximum(st[tw.ref], ops.reduce_max(ref_j))
        (alpha,) = inline(tw.factor, st[tw.ref], r)
        (w,) = inline(tw.factor, ref_j, r - extra["shift"] if shift else r)

        def weighted(value):
            if drop_liveness and _is_liveness(value, ref_j):
                return w
            return value * w

        outs = [r]
        outs += [st[f] * alpha + ops.reduce_sum(weighted(lifted[f])) for f in state[1:]]
        outs.append(alpha)
        outs += [weighted(lifted[f]) for f in vector_fields]
        return outs

    graph = trace(step, [Var(n) for n in state + scalars + uniform], f"{monoid.name}.tile_step")
    if scale is not None:
        graph = hoist_uniform(graph, uniform=("scale",), positive=("scale",))
    return TileStep(monoid, graph, state, scalars, uniform, tuple(contract))


@dataclass(frozen=True)
class TileWeights:
    """Each element's weight against a fixed reference, derived like :class:`TileStep`.

    ``graph`` takes ``(ref, *tile, *uniform)`` and returns one weight per linear field
    (field order): ``w_j = g(lift(x_j)_m, ref)`` times the field's lifted value (its
    coefficient for a vector field; the liveness indicator dropped as in the step).
    ``ref`` is a tile-shaped (broadcastable) value, not reduced over.
    """
    monoid: Monoid
    graph: Graph
    tile: tuple[str, ...]
    uniform: tuple[str, ...]
    fields: tuple[str, ...]


def tile_weights(monoid: Monoid, *, scale: str | None = None,
                 reference_above_minus_inf: bool = False) -> TileWeights:
    """The weights of a tile's elements against a reference ``ref`` fixed in advance: the
    probabilities a backward pass recomputes from a row's saved statistics.

    For an exponential factor ``g(m, r) = b^{m - pivot(r)}`` a finished row's share
    ``g(lift(x)_m, m) / d`` is ``g(lift(x)_m, m + log_b d)``: the kernel passes the row's
    log-normalizer (ATTENTION2: ``lambda = lse log2 e``) as ``ref``, and ``P_j = 2^{x_j
    scale log2 e - lambda}``. ``scale`` as in :func:`tile_step`;
    ``reference_above_minus_inf``: the caller never passes ``ref = -inf`` (the backward's
    ``lambda`` is ``+inf`` for a row without keys), which removes the pivot's select per
    element (:func:`.rewrite.assume_above_minus_inf`). ``ValueError`` and ``TypeError`` as
    :func:`tile_step`."""
    _check_flag("reference_above_minus_inf", reference_above_minus_inf)
    step = tile_step(monoid, scale=scale)         # (the same checks)
    tw = rescale_twist(monoid)
    scalars = step.tile
    uniform = step.uniform
    drop_liveness = _vanishes_at_minus_inf(tw.factor)

    def weights(ref, *nodes):
        tile = dict(zip(scalars, nodes[:len(scalars)]))
        lifted = _lift_tile(monoid, tile, scale, nodes[-1])
        ref_j = lifted[tw.ref]
        (w,) = inline(tw.factor, ref_j, ref)
        return [w if drop_liveness and _is_liveness(lifted[f], ref_j) else lifted[f] * w
                for f in tw.linear]

    graph = trace(weights, [Var(n) for n in ("ref",) + scalars + uniform],
                  f"{monoid.name}.tile_weights")
    if scale is not None:
        graph = hoist_uniform(graph, uniform=("scale",), positive=("scale",))
    if reference_above_minus_inf:
        graph = assume_above_minus_inf(graph, ("ref",))
    return TileWeights(monoid, graph, scalars, uniform, tw.linear)


__all__ = ["RescaleTwist", "rescale_twist", "TileStep", "tile_step", "TileWeights",
           "tile_weights"]
