"""Transport of structure: a monoid carried through a bijection is again a monoid.

Let ``(C, ·, e)`` be a monoid and ``ψ : C -> C'`` a bijection. Then

.. math::

    x \\oplus y = \\psi\\big(\\psi^{-1}(x) \\cdot \\psi^{-1}(y)\\big), \\qquad e' = \\psi(e)

makes ``C'`` a monoid and ``ψ`` an isomorphism (Holm 2015; the specification's
"twisted monoid"): every law is an equation that ``ψ^{-1}`` turns into the same equation
in ``C``. :func:`transport` builds that monoid from ``base``, ``psi`` and ``psi_inv``
written over :mod:`flashfold.ops`; the result is an ordinary :class:`Monoid` that runs on
every schedule and lowers to every backend. :func:`check_transport` verifies, for a
monoid given *any* way (e.g. a hand-written, numerically stable built-in), that

.. math::

    \\psi(x \\cdot y) = \\psi(x) \\oplus \\psi(y), \\qquad \\psi(e) = e',
    \\qquad \\psi^{-1}(\\psi(x)) = x,

symbolically (SymPy, with the case splits of :mod:`~flashfold.algebra.proofs`) and
numerically (random reachable states): then the built-in *is* the transported monoid and
inherits its laws.

The specification's twists, as bases and maps in this module:

====================  =====================================  =========================================
twisted monoid        base (a direct product)                ψ
====================  =====================================  =========================================
LOGSUMEXP (m, d)      :data:`MAX_PLUS` (max, +) over (m, D)   :func:`exp_rescale`: (m, D e^-m)
ATTENTION (m, d, o)   :data:`MAX_PLUS_PLUS` (max, +, +)       :func:`exp_rescale`: (m, D e^-m, O e^-m)
WELFORD (n, μ, M2)    :data:`POWER_SUMS` (Σ1, Σx, Σx²)         :func:`welford_map`: (n, T/n, W - T²/n)
LOGSUMEXP2 (m, d)     LOGSUMEXP                               :func:`base2_rescale`: (m log2 e, d)
====================  =====================================  =========================================

The adjoined identity. ``ψ`` may be undefined at the base identity: ``D e^{-m}`` at
``m = -inf`` is ``0 · inf``, and ``T/n`` at ``n = 0`` is ``0/0``. As in the
specification's footnote, the identity is then *adjoined* formally: pass the twisted
identity explicitly (``identity=(-inf, 0)``), declare ``ψ(e) = e'``, and the transported
combine, lift and finalize treat ``e'`` by its definition (``e' ⊕ x = x``) through
``ops.where`` guards.

Stability is not transported. The literal combine ``ψ(ψ^{-1}(x) · ψ^{-1}(y))``
computes ``D = d e^m`` and overflows once ``m > 709`` (float64) or ``88`` (float32); the
literal Welford map cancels catastrophically. Associativity is free, stability is not:
the built-ins are the *rewritten* combines (rescale to the larger max; the deviation
form of Welford), and :func:`check_transport` proves each equal to its literal
transport. :func:`transport` accepts such rewritings (``combine=``, ``block_lift=``,
``finalize=``), which is how ``LOGSUMEXP2`` is derived from ``LOGSUMEXP``: its lift and
identity come from ``ψ``, its combine is the ``exp2`` rewriting (the hardware
instruction), proven equal by :func:`check_transport`.

This module imports no SymPy; :func:`check_transport` imports it when called.
"""

from __future__ import annotations

import math
import numbers
import weakref
from collections import namedtuple
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from . import ops
from .ir import Var, trace
from .lower import compile_graph
from .monoid import Field, Input, Monoid, _as_field
from .tolerances import TOLERANCES, compare

# =====================================================================================
# The maps of the specification
# =====================================================================================


def exp_rescale(s):
    """ψ(m, D, ...) = (m, D e^{-m}, ...): absolute sums to sums relative to the max.

    The first field is the max ``m``; every other field is multiplied by ``e^{-m}``
    (``d = D e^{-m}``, ``o = O e^{-m}``). Undefined at ``m = -inf`` (``0 · inf``): the
    identity is adjoined.
    """
    m = s[0]
    scale = ops.exp(-m)
    return (m,) + tuple(x * scale for x in s[1:])


def exp_rescale_inverse(t):
    """ψ^{-1}(m, d, ...) = (m, d e^{m}, ...): back to absolute sums ``D = Σ e^{s_j}``."""
    m = t[0]
    scale = ops.exp(m)
    return (m,) + tuple(x * scale for x in t[1:])


def welford_map(s):
    """ψ(n, T, W) = (n, T/n, W - T²/n) = (n, μ, M2): power sums to Welford's triple.

    A bijection on ``n >= 1`` (inverse :func:`welford_map_inverse`); undefined at
    ``n = 0`` (``0/0``): the identity ``(0, 0, 0)`` is adjoined.
    """
    mean = s.T / s.n
    return s.n, mean, s.W - s.T * mean


def welford_map_inverse(t):
    """ψ^{-1}(n, μ, M2) = (n, nμ, M2 + nμ²)."""
    total = t.n * t.mean
    return t.n, total, t.m2 + total * t.mean


def base2_rescale(s):
    """ψ(m, d, ...) = (m log2 e, d, ...): a natural-log online-softmax state (LOGSUMEXP's
    ``(m, d)``, ATTENTION's ``(m, d, o)``) in base 2; the fields after ``m`` are unchanged.

    ``σ = s log2 e`` is an affine bijection of the scores with ``2^{σ - m'} = e^{s - m}``
    for ``m' = m log2 e``, so ``d`` (and ``o``, a ``d``-weighted sum) is unchanged; defined
    at the identity (``-inf · log2 e = -inf``).
    """
    return (s.m * ops.LOG2E, *tuple(s)[1:])


def base2_rescale_inverse(t):
    """ψ^{-1}(m', d, ...) = (m' ln 2, d, ...)."""
    return (t.m * ops.LN2, *tuple(t)[1:])


# =====================================================================================
# The bases: direct products of plain monoids
# =====================================================================================

MAX_PLUS = Monoid(
    "max_plus", fields=("m", "D"), identity=(-ops.inf, 0.0),
    lift=lambda x: (x, ops.exp(x)),
    combine=lambda a, b: (ops.maximum(a.m, b.m), a.D + b.D),
    finalize=lambda s: ops.log(s.D),
    commutative=True, outputs=("lse",),
    doc="(R ∪ {-inf}, max) × (R≥0, +): the max m and the absolute weight sum D = Σ e^x, "
        "side by side. Overflows past x ≈ 709 (float64): the base of a twist, not a "
        "reduction to run.")

MAX_PLUS_PLUS = Monoid(
    "max_plus_plus", fields=("m", "D", Field("O", vector=True)), identity=(-ops.inf, 0.0, 0.0),
    inputs=(Input("score"), Input("value", vector=True, domain="finite")),
    lift=lambda s, v: (s, ops.exp(s), ops.exp(s) * v),
    combine=lambda a, b: (ops.maximum(a.m, b.m), a.D + b.D, a.O + b.O),
    finalize=lambda s: (s.O / s.D, ops.log(s.D)),
    commutative=True, outputs=("out", "lse"),
    doc="(max, +, +) over (m, D, O) = (max s, Σ e^s, Σ e^s v): attention before the twist; "
        "O / D is the attention output. Overflows past s ≈ 709.")

POWER_SUMS = Monoid(
    "power_sums", fields=("n", "T", "W"), identity=(0.0, 0.0, 0.0),
    inputs=(Input("x", domain="finite"),),
    lift=lambda x: (1.0, x, x * x),
    combine=lambda a, b: (a.n + b.n, a.T + b.T, a.W + b.W),
    finalize=lambda s, correction: (s.T / s.n, (s.W - s.T * s.T / s.n) / ops.maximum(s.n - correction, 0.0)),
    params={"correction": 0.0},
    commutative=True, outputs=("mean", "var"),
    doc="(Σ1, Σx, Σx²): three sum monoids side by side. Its variance W/n - (T/n)² is the "
        "naive formula that cancels catastrophically; Welford is its twist.")


# =====================================================================================
# transport()
# =====================================================================================

#: twisted monoid -> (base, psi, psi_inv, adjoined): what transport() built it from
_PROVENANCE: "weakref.WeakKeyDictionary[Monoid, tuple]" = weakref.WeakKeyDictionary()


def _tupled(fn: Callable) -> Callable:
    """``fn(state)`` with its result as a tuple: a single value (the one field of a
    one-field carrier, ``lambda s: s.m * 2``) as a 1-tuple. Every use of ``psi`` and
    ``psi_inv`` reads them through it, so they agree on what a map returns."""
    def tupled(state):
        out = fn(state)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)
    return tupled


def _map_graph(fn: Callable, fields: Sequence[Field], name: str, n_out: int | None = None):
    """Trace ``fn(state) -> tuple`` over a state with ``fields`` into a Graph."""
    S = namedtuple("S", [f.name for f in fields])
    return trace(_tupled(fn), [Var(f.name, f.vector) for f in fields], name,
                 lambda f, nodes: f(S(*nodes)), n_outputs=n_out)


def _evaluate_at(graph, values, fields):
    """A traced map evaluated with NumPy at one state (vector fields of width 1)."""
    fn = compile_graph(graph, "numpy")
    args = [np.full((1, 1) if f.vector else (1,), float(v)) for f, v in zip(fields, values)]
    with np.errstate(all="ignore"):
        out = fn(*args)
    return tuple(float(np.asarray(o, dtype=np.float64).reshape(-1)[0]) for o in out)


def _is_state(state, values, fields):
    """Traced condition: ``state`` is the constant state ``values``.

    Tested on the scalar fields (a vector field, e.g. attention's ``o``, is determined by
    them on reachable states, and testing it would make the condition a vector).
    """
    scalar = [i for i, f in enumerate(fields) if not f.vector] or list(range(len(fields)))
    cond = None
    for i in scalar:
        c = state[i] == values[i]
        cond = c if cond is None else (cond & c)
    return cond


def _guard(cond, then_values, otherwise):
    return tuple(ops.where(cond, t, o) for t, o in zip(then_values, otherwise))


def transport(base: Monoid, psi: Callable, psi_inv: Callable, *, name: str,
              fields: Sequence | None = None, identity: Sequence | None = None,
              lift: Callable | None = None, combine: Callable | None = None,
              finalize: Callable | None = None, block_lift: Callable | None = None,
              block_scan: Callable | None = None, outputs: Sequence[str] | None = None, commutative: bool | None = None,
              doc: str = "") -> Monoid:
    """The monoid ``base`` carried through the bijection ``psi`` (transport of structure).

    Parameters
    ----------
    base: the monoid ``(C, ·, e)``.
    psi: ``psi(state) -> tuple``: a base state (fields as attributes, in ``base``'s order)
        to the twisted state, written over :mod:`flashfold.ops`.
    psi_inv: ``psi_inv(state) -> tuple``: its inverse, from a twisted state (attributes
        named by ``fields``).
    name: the new monoid's name.
    fields: names (or :class:`Field` objects) of the twisted carrier; default the base's.
        Names inherit ``vector``/``dtype`` from the base field in the same position.
    identity: the twisted identity. Default ``psi(e)``. When ``psi`` is undefined at
        ``e`` (NaN), it must be given: it is then *adjoined* (``ψ(e) := e'``), and the
        derived functions treat it by definition through ``ops.where`` guards.
    lift, combine, finalize, block_lift, block_scan: rewritings that replace the derived
        functions (which are ``psi ∘ base.lift``, ``psi(base.combine(psi_inv(a),
        psi_inv(b)))``, ``base.finalize ∘ psi_inv``, ``psi ∘ base.block_lift`` and
        ``psi ∘ base.block_scan``; ``scan_exact`` is always ``base.scan_exact ∘ psi_inv``); use
        :func:`check_transport` to prove a rewritten combine equal to the derived one.
    outputs, commutative, doc: as for :class:`Monoid` (default: the base's outputs when
        finalize is derived; commutativity is transported).

    Returns a :class:`Monoid` whose laws are the base's, through ``psi``. The derived
    combine is the *definition*, and may be numerically unstable (``e^m`` overflow for
    :data:`MAX_PLUS`): see the module docstring.

    Raises ``TypeError``/``ValueError`` naming the argument: ``base`` not a Monoid,
    ``psi``/``psi_inv`` not callable or returning the wrong number of fields,
    ``fields`` of the wrong length, ``identity`` missing where ``psi(e)`` is undefined
    or different from ``psi(e)`` where it is defined.
    """
    if not isinstance(base, Monoid):
        raise TypeError(f"base: expected a flashfold Monoid, got {type(base).__name__}")
    for arg, fn in (("psi", psi), ("psi_inv", psi_inv)):
        if not callable(fn):
            raise TypeError(f"{arg}: expected a function of a state, got {type(fn).__name__}")
    if not isinstance(name, str) or not name:
        raise TypeError("name: expected a non-empty string")
    if fields is None:
        tw_fields = tuple(base.fields)
    else:
        fields = (fields,) if isinstance(fields, str) else tuple(fields)
        if len(fields) != len(base.fields):
            raise ValueError(f"fields: the twisted carrier needs {len(base.fields)} fields "
                             f"(a bijection of {base.field_names}), got {len(fields)}")
        tw_fields = tuple(f if isinstance(f, Field) else Field(_as_field(f).name, b.vector, b.dtype)
                          for f, b in zip(fields, base.fields))
    k = len(tw_fields)
    psi_graph = _map_graph(psi, base.fields, f"{name}.psi")
    if len(psi_graph.outputs) != k:
        raise ValueError(f"psi: returns {len(psi_graph.outputs)} values for the {k} fields "
                         f"{tuple(f.name for f in tw_fields)}")
    inv_graph = _map_graph(psi_inv, tw_fields, f"{name}.psi_inv")
    if len(inv_graph.outputs) != len(base.fields):
        raise ValueError(f"psi_inv: returns {len(inv_graph.outputs)} values for the base's "
                         f"{len(base.fields)} fields {base.field_names}")

    if identity is not None:
        if isinstance(identity, (str, bytes)) or not isinstance(identity, (tuple, list)):
            raise TypeError(f"identity: expected a tuple of {k} numbers, got "
                            f"{type(identity).__name__}")
        if len(identity) != k:
            raise ValueError(f"identity: expected {k} values, got {len(identity)}")
        for v in identity:
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"identity: expected numbers, got {v!r} "
                                f"({type(v).__name__})")
    at_e = _evaluate_at(psi_graph, base.identity, base.fields)
    adjoined = any(math.isnan(v) for v in at_e)
    if adjoined:
        if identity is None:
            raise ValueError(
                f"identity: psi is undefined at the base identity {base.identity} "
                f"(psi(e) = {at_e}); adjoin the identity explicitly, e.g. identity="
                f"{tuple(base.identity)} if that is the twisted identity")
        identity = tuple(identity)
    else:
        for v, f in zip(at_e, tw_fields):
            if f.dtype == "int" and math.isinf(v):
                raise ValueError(f"psi maps the base identity {base.identity} to {v} in the "
                                 f"int field {f.name!r}, which holds finite values only "
                                 f"(declare it a float field)")
        derived = tuple(int(v) if f.dtype == "int" else v for v, f in zip(at_e, tw_fields))
        if identity is not None and not all(_same_number(x, y) for x, y in zip(identity, derived)):
            raise ValueError(f"identity: psi maps the base identity {base.identity} to {derived}, "
                             f"not to the given {tuple(identity)}")
        identity = tuple(identity) if identity is not None else derived
    if len(identity) != k:
        raise ValueError(f"identity: expected {k} values, got {len(identity)}")

    BaseS = base.State
    provenance = (psi, psi_inv)
    psi, psi_inv = _tupled(psi), _tupled(psi_inv)

    def to_base(t):
        return BaseS(*psi_inv(t))

    def derived_combine(a, b):
        out = tuple(psi(BaseS(*base.combine(to_base(a), to_base(b)))))
        if adjoined:                       # e' ⊕ x = x, x ⊕ e' = x by definition
            out = _guard(_is_state(a, identity, tw_fields), tuple(b),
                         _guard(_is_state(b, identity, tw_fields), tuple(a), out))
        return out

    def through_psi(fn):                    # psi ∘ fn, for lift and the block lift / scan
        def derived(*xs):
            s = BaseS(*fn(*xs))
            out = tuple(psi(s))
            if adjoined:
                out = _guard(_is_state(s, base.identity, base.fields), identity, out)
            return out
        return derived

    def derived_scan_exact(t):
        return base.scan_exact(to_base(t))

    def derived_finalize(t, **params):
        s = tuple(psi_inv(t))
        if adjoined:
            s = _guard(_is_state(t, identity, tw_fields), base.identity, s)
        if base.finalize is None:
            return s
        return base.finalize(BaseS(*s), **params)

    twisted = Monoid(
        name, fields=tw_fields, identity=identity,
        lift=lift if lift is not None else through_psi(base.lift),
        combine=combine if combine is not None else derived_combine,
        inputs=base.inputs,
        finalize=finalize if finalize is not None else derived_finalize,
        params=base.params,
        outputs=tuple(outputs) if outputs is not None else (
            base.outputs if finalize is None else None),
        block_lift=block_lift if block_lift is not None else (
            through_psi(base.block_lift) if base.block_lift is not None else None),
        block_scan=block_scan if block_scan is not None else (
            through_psi(base.block_scan) if base.block_scan is not None else None),
        scan_exact=derived_scan_exact if base.scan_exact is not None else None,
        commutative=base.commutative if commutative is None else commutative,
        doc=doc or f"{base.name} transported through {getattr(psi, '__name__', 'psi')}")
    _PROVENANCE[twisted] = (base, *provenance, adjoined)
    return twisted


def transported_from(monoid: Monoid):
    """``(base, psi, psi_inv, adjoined)`` if ``monoid`` was built by :func:`transport`, else None."""
    try:
        return _PROVENANCE.get(monoid)
    except TypeError:  # pragma: no cover
        return None


def _same_number(x, y) -> bool:
    x, y = float(x), float(y)
    return x == y or (math.isnan(x) and math.isnan(y))


# =====================================================================================
# check_transport()
# =====================================================================================

@dataclass(frozen=True)
class TransportReport:
    """Result of :func:`check_transport`; ``bool(report)`` when every check holds.

    ``homomorphism``: ψ(x · y) = ψ(x) ⊕ ψ(y) (a :class:`~flashfold.algebra.proofs.LawProof`
    with its cases); ``identity``: ψ(e) = e' or, adjoined, e' a two-sided identity on the
    image; ``inverse``: ψ^{-1}(ψ(x)) = x and ψ(ψ^{-1}(t)) = t (None without ``psi_inv``);
    ``numeric_*``: the same homomorphism on random reachable float64 states. Without
    ``inverse``, ``ok`` says that ``psi`` is a homomorphism, not that it is a bijection.
    """
    twisted: str
    base: str
    homomorphism: object
    identity: object
    inverse: object
    adjoined: bool
    trials: int
    numeric_ok: bool
    numeric_max_rel_error: float
    numeric_report: dict

    @property
    def symbolic_ok(self) -> bool:
        return (self.homomorphism.proved and self.identity.proved
                and (self.inverse is None or self.inverse.proved))

    @property
    def ok(self) -> bool:
        return self.symbolic_ok and self.numeric_ok

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return (f"TransportReport({self.twisted!r} from {self.base!r}: symbolic "
                f"{'ok' if self.symbolic_ok else 'FAILED'}"
                f"{'' if self.inverse is not None else ' (bijection not checked)'}, numeric "
                f"{'ok' if self.numeric_ok else 'FAILED'} (max rel. error "
                f"{self.numeric_max_rel_error:.2g} over {self.trials} pairs))")

    def text(self, steps: bool = True) -> str:
        if self.inverse is None:     # a homomorphism; psi may still merge states
            lines = [f"psi is a monoid homomorphism from {self.base!r} to {self.twisted!r} "
                     f"(bijection not checked: pass psi_inv): "
                     f"{'PROVED' if self.ok else 'FAILED'}"]
        else:
            lines = [f"{self.twisted!r} is {self.base!r} transported through psi: "
                     f"{'PROVED' if self.ok else 'FAILED'}"]
        lines.append(self.homomorphism.text("  ", steps))
        lines.append(self.identity.text("  ", steps))
        if self.inverse is not None:
            lines.append(self.inverse.text("  ", steps))
        lines.append(f"  numerically, {self.trials} random reachable pairs (float64): "
                     f"max rel. error {self.numeric_max_rel_error:.3g} "
                     f"({'ok' if self.numeric_ok else 'FAILED: ' + str(self.numeric_report)})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


def _sample_base_states(base: Monoid, rng, trials: int, width: int, scale: float):
    """Reachable base states, each the fold of 1 to 4 lifted inputs of moderate size."""
    from .evaluate import numpy_monoid
    ex = numpy_monoid(base)
    counts = rng.integers(1, 5, size=trials)
    state = ex.identity((trials,), width)
    pos = np.zeros(trials, dtype=np.int64)
    for k in range(4):
        ins = []
        for inp in base.inputs:
            shape = (trials, width) if inp.vector else (trials,)
            if inp.domain == "position":
                ins.append(pos.copy())
            elif inp.domain == "positive":
                ins.append(np.exp(rng.normal(0.0, 1.0, size=shape)))
            elif inp.domain == "small_int":
                ins.append(rng.integers(-3, 4, size=shape).astype(np.float64))
            else:
                x = rng.normal(0.0, scale, size=shape)
                ins.append(x)
        stepped = ex.combine(state, ex.lift(ins, width))
        use = k < counts
        state = tuple(np.where(use.reshape((-1,) + (1,) * (s.ndim - 1)), n, s)
                      for s, n in zip(state, stepped))
        pos = pos + use
    return state


def check_transport(twisted: Monoid, base: Monoid, psi: Callable, psi_inv: Callable | None = None,
                    *, trials: int = 300, seed: int = 0, width: int = 3, scale: float = 3.0):
    """Verify that ``psi`` is an isomorphism from ``base`` onto ``twisted`` (with
    ``psi_inv``), or only a homomorphism (without it: ``psi`` may then merge states, and
    the report says the bijection was not checked).

    Checks, for symbolic reachable base states ``x, y`` (SymPy, with case splits on
    ``max``/``where``; a vector field is one symbol):

    * homomorphism: ``psi(base.combine(x, y)) == twisted.combine(psi(x), psi(y))``;
    * identity: ``psi(e) == e'`` where ``psi`` is defined at ``e`` (otherwise ``e'`` is
      adjoined), and in both cases ``e'`` a two-sided identity on the image:
      ``psi(x) ⊕ e' = e' ⊕ psi(x) = psi(x)`` and ``e' ⊕ e' = e'``;
    * inverse (when ``psi_inv`` is given): ``psi_inv(psi(x)) == x`` and
      ``psi(psi_inv(t)) == t`` for reachable twisted ``t``: a bijection on the states;

    and numerically the homomorphism on ``trials`` random pairs of reachable base states
    (folds of 1-4 lifted inputs ~ N(0, scale²); moderate so that the base's ``e^x``
    stays finite), compared with ``flashfold.algebra.tolerances.TOLERANCES["float64"]``.

    When ``psi`` is a bijection, ``twisted.combine(a, b) = psi(base.combine(psi_inv(a),
    psi_inv(b)))``: a hand-written stable combine proven here *is* the transported one,
    and inherits associativity and the identity from ``base``.

    Returns a :class:`TransportReport`.
    """
    from .evaluate import numpy_monoid
    from .proofs import (Case, LawProof, StateSymbols, check_equal_on_paths, equal, explore,
                         reachable_domains, sympy_function, _fmt, _sp_value)

    for arg, m in (("twisted", twisted), ("base", base)):
        if not isinstance(m, Monoid):
            raise TypeError(f"{arg}: expected a flashfold Monoid, got {type(m).__name__}")
    if not callable(psi):
        raise TypeError(f"psi: expected a function of a base state, got {type(psi).__name__}")
    if psi_inv is not None and not callable(psi_inv):
        raise TypeError(f"psi_inv: expected a function of a twisted state or None, got "
                        f"{type(psi_inv).__name__}")
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        raise ValueError(f"trials: expected a positive int, got {trials!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"seed: expected an int >= 0, got {seed!r}")
    if not isinstance(width, int) or isinstance(width, bool) or width < 1:
        raise ValueError(f"width: expected a positive int (the vector fields' width), got "
                         f"{width!r}")
    if (isinstance(scale, bool) or not isinstance(scale, (int, float))
            or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"scale: expected a finite number > 0, got {scale!r}")
    if len(twisted.fields) != len(base.fields):
        raise ValueError(f"twisted: has {len(twisted.fields)} fields, base {base.name!r} has "
                         f"{len(base.fields)}: psi cannot be a bijection of the carriers")
    psi_graph = _map_graph(psi, base.fields, "psi", n_out=len(twisted.fields))
    psi_s = sympy_function(psi_graph)
    tw = sympy_function(twisted.combine_graph)
    bc = sympy_function(base.combine_graph)
    names = twisted.field_names

    # -- symbolic: homomorphism ------------------------------------------------------
    domains, _ = reachable_domains(base)
    X, Y = StateSymbols(base, domains, "x"), StateSymbols(base, domains, "y")

    def hom(p):
        x, y = X.instantiate(p), Y.instantiate(p)
        p.values = {"x": x, "y": y}
        return list(psi_s(*bc(*x, *y))), list(tw(*psi_s(*x), *psi_s(*y)))

    homomorphism = check_equal_on_paths("homomorphism", "psi(x · y) = psi(x) ⊕ psi(y)", names,
                                        hom, X.rows() + Y.rows(), states=[("x", X), ("y", Y)])

    # -- symbolic: identity ----------------------------------------------------------
    e_base = [_sp_value(v) for v in base.identity]
    e_tw = [_sp_value(v) for v in twisted.identity]
    import sympy as sp
    at_e = list(explore(lambda p: list(psi_s(*e_base))))[0][1]
    adjoined = any(sp.sympify(v).has(sp.nan, sp.zoo) for v in at_e)
    # psi(e) = e' alone does not make e' an identity of the twisted combine: the
    # homomorphism is shown on reachable (non-identity) states only, so e' must also be
    # a two-sided identity on the image, whether psi defines it or it is adjoined
    head = ()
    statement = "psi(e) := e' (adjoined): psi(x) ⊕ e' = e' ⊕ psi(x) = psi(x), e' ⊕ e' = e'"
    if not adjoined:
        sides = tuple((n, _fmt(x), _fmt(y), equal(x, y)) for n, x, y in zip(names, at_e, e_tw))
        head = (Case("identity", ("psi(e)",), sides),)
        statement = "psi(e) = e', psi(x) ⊕ e' = e' ⊕ psi(x) = psi(x), e' ⊕ e' = e'"

    def ident(p):
        x = X.instantiate(p)
        p.values = {"x": x}
        t = list(psi_s(*x))
        return list(tw(*t, *e_tw)) + list(tw(*e_tw, *t)), t + t
    lp = check_equal_on_paths(
        "identity", statement,
        [f"{n} (psi(x) ⊕ e')" for n in names] + [f"{n} (e' ⊕ psi(x))" for n in names],
        ident, X.rows(), states=[("x", X)])
    ee = list(explore(lambda p: list(tw(*e_tw, *e_tw))))[0][1]
    c = Case("identity", ("e' ⊕ e'",), tuple((n, _fmt(x), _fmt(y), equal(x, y))
                                              for n, x, y in zip(names, ee, e_tw)))
    identity = LawProof(lp.name, lp.statement,
                        all(h.holds for h in head) and lp.proved and c.holds,
                        head + lp.cases + (c,), lp.counterexample, lp.note)

    # -- symbolic: inverse -------------------------------------------------------------
    inverse = None
    if psi_inv is not None:
        inv_s = sympy_function(_map_graph(psi_inv, twisted.fields, "psi_inv",
                                          n_out=len(base.fields)))
        tw_domains, _ = reachable_domains(twisted)
        T = StateSymbols(twisted, tw_domains, "t")

        def inv(p):
            x, t = X.instantiate(p), T.instantiate(p)
            p.values = {"x": x, "t": t}
            return list(inv_s(*psi_s(*x))) + list(psi_s(*inv_s(*t))), list(x) + list(t)
        inverse = check_equal_on_paths(
            "inverse", "psi_inv(psi(x)) = x and psi(psi_inv(t)) = t",
            [f"{n} of psi_inv(psi(x))" for n in base.field_names]
            + [f"{n} of psi(psi_inv(t))" for n in names], inv, X.rows() + T.rows(),
            states=[("x", X), ("t", T)])

    # -- numeric -------------------------------------------------------------------------
    rng = np.random.default_rng(seed)
    xs = _sample_base_states(base, rng, trials, width, scale)
    ys = _sample_base_states(base, rng, trials, width, scale)
    ex_b, ex_t = numpy_monoid(base), numpy_monoid(twisted)
    psi_np = compile_graph(psi_graph, "numpy")
    expand = base.has_vector or twisted.has_vector

    def apply_psi(state):
        args = [x if (f.vector or not expand) else x[..., None] for x, f in zip(state, base.fields)]
        with np.errstate(all="ignore"):
            out = psi_np(*args)
        res = []
        for o, f in zip(out, twisted.fields):
            o = np.asarray(o, dtype=np.float64)
            if expand and not f.vector and o.ndim >= 1:
                o = o[..., 0]
            res.append(np.array(np.broadcast_to(o, (trials, width) if f.vector else (trials,))))
        return tuple(res)

    lhs = apply_psi(ex_b.combine(xs, ys))
    rhs = ex_t.combine(apply_psi(xs), apply_psi(ys))
    atol, rtol = TOLERANCES["float64"]
    worst, numeric_ok, report = 0.0, True, {}
    for n, l, r in zip(names, lhs, rhs):
        l = np.asarray(l, dtype=np.float64)
        r = np.asarray(r, dtype=np.float64)
        scale_ = 1.0 + np.abs(l)
        res = compare(r, l, "float64", scale=scale_)
        with np.errstate(all="ignore"):
            rel = np.where(np.isfinite(l), np.abs(r - l) / scale_, 0.0)
        worst = max(worst, float(np.nanmax(rel, initial=0.0)))
        if not res["ok"]:
            numeric_ok = False
            report[n] = {k: res[k] for k in ("max_abs", "rel_rms", "first_bad", "nan_inf_parity")}
    return TransportReport(twisted.name, base.name, homomorphism, identity, inverse, adjoined,
                           trials, numeric_ok, worst, report)


__all__ = ["transport", "check_transport", "TransportReport", "transported_from",
           "MAX_PLUS", "MAX_PLUS_PLUS", "POWER_SUMS", "exp_rescale", "exp_rescale_inverse",
           "welford_map", "welford_map_inverse", "base2_rescale", "base2_rescale_inverse"]
