"""Randomized law checking with tolerances derived from a floating-point error bound.

:func:`check_laws` draws reachable states (each the fold of 1-4 lifted random inputs,
including ``-inf`` scores, ties and magnitudes from 1e-3 to 1e4) and checks

* associativity: ``(a ⊕ b) ⊕ c == a ⊕ (b ⊕ c)``,
* the identity law: ``e ⊕ a == a == a ⊕ e`` and ``e ⊕ e == e`` (also reported
  separately as *exact*),
* commutativity, when the monoid declares it: ``a ⊕ b == b ⊕ a``.

The states never come from the claimed identity: a fold starts from its first lifted
element, so a wrong identity cannot shape the states it is tested on (a max with
``e = 0`` folded from ``e`` only ever sees ``max(0, ...)``, on which 0 is an identity).
``a``, ``b`` and ``c`` are drawn independently, so commutativity is tested on distinct
states (a combine that keeps its left operand fails it).

Equality is judged against a *running error bound*, not a guessed epsilon: the combine
is lowered a second time to an error-propagating backend that carries, next to each
float64 value ``v``, a first-order bound ``e`` on its absolute rounding error
(``e(x + y) = e(x) + e(y) + u|x + y|``, ``e(xy) = |x|e(y) + |y|e(x) + u|xy|``,
``e(exp x) = exp(x) e(x) + u exp(x)``, ... with ``u = 2^-53``, Higham ch. 3). Two
bracketings agree when ``|lhs - rhs| <= K (e_lhs + e_rhs)``. A combine that is not
associative, e.g. the average ``(a + b) / 2``, differs by far more than its rounding
error and is reported with a concrete counterexample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .evaluate import numpy_monoid
from .lower import Backend, compile_graph
from .monoid import Monoid

U64 = 2.0 ** -53          # unit roundoff of float64
SAFETY = 8.0              # slack over the first-order bound (second-order terms, exp/log ulps)


# --- the error-bound lowering ----------------------------------------------------------

class Approx:
    """A float64 value (array) with a bound on its absolute rounding error."""
    __slots__ = ("v", "e")

    def __init__(self, v, e=0.0):
        self.v = np.asarray(v)
        self.e = np.asarray(e, dtype=np.float64)


def _r(v):
    """Bound on the rounding error of producing ``v`` itself (0 for exact/boolean/inf)."""
    v = np.asarray(v)
    if v.dtype.kind != "f":
        return 0.0
    a = np.abs(v)
    return np.where(np.isfinite(a), U64 * a, 0.0)


def _clean(e):
    """Non-finite bounds come from infinite values, which compare exactly: bound 0."""
    e = np.asarray(e, dtype=np.float64)
    return np.where(np.isfinite(e), e, 0.0)


class _EB:
    """Namespace of the error-bound backend's helpers (first-order propagation)."""

    @staticmethod
    def c(x):
        return Approx(x, 0.0)

    @staticmethod
    def add(a, b):
        v = a.v + b.v
        return Approx(v, _clean(a.e + b.e + _r(v)))

    @staticmethod
    def sub(a, b):
        v = a.v - b.v
        return Approx(v, _clean(a.e + b.e + _r(v)))

    @staticmethod
    def mul(a, b):
        v = a.v * b.v
        return Approx(v, _clean(np.abs(a.v) * b.e + np.abs(b.v) * a.e + a.e * b.e + _r(v)))

    @staticmethod
    def div(a, b):
        v = a.v / b.v
        return Approx(v, _clean((a.e + np.abs(v) * b.e) / np.abs(b.v) + _r(v)))

    @staticmethod
    def unary(fn, deriv):
        def f(a):
            v = fn(a.v)
            return Approx(v, _clean(np.abs(deriv(a.v, v)) * a.e + _r(v)))
        return f

    @staticmethod
    def exact(fn):
        def f(*args):
            return Approx(fn(*(a.v for a in args)), 0.0)
        return f

    @staticmethod
    def select(fn):
        """max/min: no new rounding; the larger of the operands' errors."""
        def f(a, b):
            return Approx(fn(a.v, b.v), np.maximum(a.e, b.e))
        return f

    @staticmethod
    def where(c, a, b):
        return Approx(np.where(c.v, a.v, b.v), np.where(c.v, a.e, b.e))


def _error_backend() -> Backend:
    eb = _EB
    ln2 = math.log(2.0)
    ns = {
        "_c": eb.c, "_add": eb.add, "_sub": eb.sub, "_mul": eb.mul, "_div": eb.div,
        "_where": eb.where,
        "_neg": lambda a: Approx(-a.v, a.e), "_abs": lambda a: Approx(np.abs(a.v), a.e),
        "_exp": eb.unary(np.exp, lambda x, v: v),
        "_exp2": eb.unary(np.exp2, lambda x, v: v * ln2),
        "_log": eb.unary(np.log, lambda x, v: 1.0 / x),
        "_log2": eb.unary(np.log2, lambda x, v: 1.0 / (x * ln2)),
        "_log1p": eb.unary(np.log1p, lambda x, v: 1.0 / (1.0 + x)),
        "_expm1": eb.unary(np.expm1, lambda x, v: v + 1.0),
        "_sqrt": eb.unary(np.sqrt, lambda x, v: 0.5 / v),
        "_tanh": eb.unary(np.tanh, lambda x, v: 1.0 - v * v),
        "_sigmoid": eb.unary(lambda x: 0.5 * (np.tanh(0.5 * x) + 1.0), lambda x, v: v * (1.0 - v)),
        "_pow": lambda a, b: Approx(np.power(a.v, b.v),
                                    _clean(np.abs(np.power(a.v, b.v)) * (np.abs(b.v / a.v) * a.e + np.abs(np.log(np.abs(a.v))) * b.e) + _r(np.power(a.v, b.v)))),
        "_max": eb.select(np.maximum), "_min": eb.select(np.minimum),
    }
    exact = {"floor": np.floor, "not": np.logical_not, "isnan": np.isnan, "isinf": np.isinf,
             "to_float": lambda x: np.asarray(x, dtype=np.float64),
             "to_int": lambda x: np.asarray(x).astype(np.int64),
             "floordiv": np.floor_divide, "mod": np.mod, "lt": np.less, "le": np.less_equal,
             "gt": np.greater, "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal,
             "and": np.logical_and, "or": np.logical_or}
    templates = {
        "neg": "_neg({0})", "abs": "_abs({0})", "exp": "_exp({0})", "exp2": "_exp2({0})",
        "log": "_log({0})", "log2": "_log2({0})", "log1p": "_log1p({0})", "expm1": "_expm1({0})",
        "sqrt": "_sqrt({0})", "tanh": "_tanh({0})", "sigmoid": "_sigmoid({0})",
        "add": "_add({0}, {1})", "sub": "_sub({0}, {1})", "mul": "_mul({0}, {1})",
        "div": "_div({0}, {1})", "pow": "_pow({0}, {1})", "maximum": "_max({0}, {1})",
        "minimum": "_min({0}, {1})", "where": "_where({0}, {1}, {2})",
    }
    for op, fn in exact.items():
        ns["_x_" + op] = eb.exact(fn)
        arity = 1 if op in ("floor", "not", "isnan", "isinf", "to_float", "to_int") else 2
        templates[op] = f"_x_{op}(" + ", ".join("{%d}" % i for i in range(arity)) + ")"

    def const(v):
        return f"_c({v!r})" if not (isinstance(v, float) and math.isinf(v)) else f"_c(float({str(v)!r}))"
    return Backend("error_bound", templates, const, ns)


ERROR_BOUND = _error_backend()


# --- sampling reachable states --------------------------------------------------------

def sample_inputs(domain: str, rng: np.random.Generator, shape: tuple) -> np.ndarray:
    """Random inputs from an :class:`~flashfold.algebra.monoid.Input` domain."""
    if domain == "small_int":
        return rng.integers(-3, 4, size=shape).astype(np.float64)
    if domain == "positive":
        return np.exp(rng.normal(0.0, 3.0, size=shape))
    scale = rng.choice([1e-3, 1.0, 30.0, 1e4], size=shape)
    x = rng.normal(0.0, 1.0, size=shape) * scale
    ties = rng.random(shape) < 0.25
    x = np.where(ties, rng.integers(-2, 3, size=shape).astype(np.float64), x)
    if domain == "extended":
        x = np.where(rng.random(shape) < 0.15, -np.inf, x)
    return x


def random_states(monoid: Monoid, rng: np.random.Generator, trials: int, max_elems: int = 4,
                  width: int = 3, start_positions=None):
    """``trials`` reachable states, each the sequential fold of 1..max_elems lifted inputs.

    A state is ``lift(x_1) ⊕ ... ⊕ lift(x_k)``, ``k`` uniform in ``1..max_elems``: the
    fold starts from the first lifted element, never from the claimed identity, so that
    the identity law is tested on states the identity did not shape (folding from a wrong
    identity ``e`` gives states on which ``e`` may act as one: ``max(0, ...)`` for a max
    with ``e = 0``). Returns (states, counts, next_positions): positions (for
    ``position`` inputs) continue from ``start_positions`` so that consecutive states
    cover consecutive elements.
    """
    if max_elems < 1:
        raise ValueError(f"max_elems: expected a positive int, got {max_elems!r}")
    ex = numpy_monoid(monoid)
    counts = rng.integers(1, max_elems + 1, size=trials)
    pos = np.zeros(trials, dtype=np.int64) if start_positions is None else start_positions.copy()
    template = ex.identity((trials,), width)           # shapes only
    state = None
    for k in range(max_elems):
        ins = []
        for inp in monoid.inputs:
            if inp.domain == "position":
                ins.append(pos.copy())
            else:
                shape = (trials, width) if inp.vector else (trials,)
                ins.append(sample_inputs(inp.domain, rng, shape))
        lifted = ex.lift(ins, width)
        if state is None:
            state = tuple(np.where(np.ones(t.shape, dtype=bool), v, t)
                          for v, t in zip(lifted, template))
        else:
            stepped = ex.combine(state, lifted)
            use = k < counts
            state = tuple(np.where(use.reshape((-1,) + (1,) * (s.ndim - 1)), n, s)
                          for s, n in zip(state, stepped))
        pos = pos + (k < counts)
    return state, counts, pos


# --- the report ---------------------------------------------------------------------

@dataclass
class LawReport:
    """Result of :func:`check_laws`: a boolean per law, the worst error, a counterexample."""
    monoid: str
    trials: int
    associative: bool
    identity: bool
    identity_exact: bool
    commutative: bool | None          # None when the monoid does not declare it
    nan_free: bool
    worst_error: float                # max |lhs - rhs| seen (absolute, any field)
    worst_ratio: float                # max |lhs - rhs| / tolerance (<= 1 means within bound)
    counterexample: dict | None = None
    notes: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.associative and self.identity and self.nan_free
                and self.commutative is not False)

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        yes = lambda b: "n/a" if b is None else ("ok" if b else "FAILED")  # noqa: E731
        lines = [f"laws of monoid {self.monoid!r} ({self.trials} random triples)",
                 f"  associativity : {yes(self.associative)}",
                 f"  identity      : {yes(self.identity)}" + (" (exact)" if self.identity_exact else ""),
                 f"  commutativity : {yes(self.commutative)}",
                 f"  no NaN        : {yes(self.nan_free)}",
                 f"  worst |lhs-rhs| = {self.worst_error:.3g}  ({self.worst_ratio:.3g} x the error bound)"]
        if self.counterexample:
            lines.append("  counterexample:")
            for k, v in self.counterexample.items():
                lines.append(f"    {k}: {v}")
        lines.extend("  note: " + n for n in self.notes)
        return "\n".join(lines)


def _fmt(x) -> str:
    x = np.asarray(x)
    if x.ndim == 0:
        return f"{x.item():.17g}" if x.dtype.kind == "f" else str(x.item())
    return "[" + ", ".join(f"{v:.6g}" for v in x.tolist()) + "]"


def _check_count(value, name: str, lo: int):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {value!r}")
    return int(value)


def check_laws(monoid: Monoid, trials: int = 500, seed: int = 0, width: int = 3) -> LawReport:
    """Check associativity, identity and (if declared) commutativity on random states.

    Parameters
    ----------
    monoid: the monoid to check.
    trials: number of random triples (a, b, c) (an int >= 1); each state is a fold of 1
        to 4 lifted random inputs drawn from each input's domain, started from the first
        lifted element (never from the identity), and a, b, c are drawn independently.
    seed: seed of the random generator, an int >= 0 (the check is deterministic given it).
    width: feature width of vector fields, an int >= 1.

    The laws checked are, for every triple, ``(a ⊕ b) ⊕ c = a ⊕ (b ⊕ c)``,
    ``e ⊕ a = a = a ⊕ e``, ``e ⊕ e = e`` and, when declared, ``a ⊕ b = b ⊕ a``.
    Returns a :class:`LawReport`; ``bool(report)`` is True when every law holds.
    """
    if not isinstance(monoid, Monoid):
        raise TypeError(f"monoid: expected a flashfold Monoid, got {type(monoid).__name__}")
    block_ops = sorted({n.op for n in monoid.combine_graph.nodes()
                        if n.op in ("rsum", "rmax", "rmin", "csum", "load")})
    if block_ops:
        raise ValueError(f"monoid: {monoid.name!r} combine uses {', '.join(block_ops)}, which act "
                         f"along the block axis, not on one state: a combine must be "
                         f"elementwise in its two states for its laws to mean anything")
    trials = _check_count(trials, "trials", 1)
    seed = _check_count(seed, "seed", 0)
    width = _check_count(width, "width", 1)
    rng = np.random.default_rng(seed)
    ex = numpy_monoid(monoid)
    a, _, pos = random_states(monoid, rng, trials, width=width)
    b, _, pos = random_states(monoid, rng, trials, width=width, start_positions=pos)
    c, _, _ = random_states(monoid, rng, trials, width=width, start_positions=pos)
    e = ex.identity((trials,), width)

    comb = compile_graph(monoid.combine_graph, ERROR_BOUND)
    expand = monoid.has_vector
    vec = [f.vector for f in monoid.fields]

    def to_approx(state):
        return [Approx(x if (v or not expand) else x[..., None]) for x, v in zip(state, vec)]

    def op(x, y):
        return list(comb(*(x + y)))

    with np.errstate(all="ignore"):
        A, B, C, E = to_approx(a), to_approx(b), to_approx(c), to_approx(e)
        lhs, rhs = op(op(A, B), C), op(A, op(B, C))
        ab, ba = op(A, B), op(B, A)
        ea, ae, ee = op(E, A), op(A, E), op(E, E)

    def compare(x, y):
        """Per trial: (all fields within K x the error bound, worst |diff|, worst ratio)."""
        ok = np.ones(trials, dtype=bool)
        diff_max, ratio_max = np.zeros(trials), np.zeros(trials)
        for xf, yf in zip(x, y):
            xv, yv = (np.asarray(t.v, dtype=np.float64) for t in (xf, yf))
            xv, yv = np.broadcast_arrays(xv, yv)
            tol = SAFETY * (xf.e + yf.e) + 1e-300
            same = xv == yv
            d = np.where(same, 0.0, np.abs(xv - yv))
            d = np.where(np.isnan(d), np.inf, d)
            good, r = d <= tol, d / tol
            axes = tuple(range(1, xv.ndim))
            if axes:
                good, d, r = good.all(axis=axes), d.max(axis=axes), r.max(axis=axes)
            ok &= good
            diff_max, ratio_max = np.maximum(diff_max, d), np.maximum(ratio_max, r)
        return ok, diff_max, ratio_max

    def show(state_apx, i):
        return "(" + ", ".join(f"{f.name}={_fmt(_sq(x.v, v, expand)[i])}"
                               for f, x, v in zip(monoid.fields, state_apx, vec)) + ")"

    with np.errstate(all="ignore"):
        assoc_ok, assoc_d, assoc_r = compare(lhs, rhs)
        # within one combine's rounding; e * e = e on its own (no sample is the identity)
        ident_ok = compare(ea, A)[0] & compare(ae, A)[0]
        ee_ok = compare(ee, E)[0]
        comm_ok = compare(ab, ba)[0]
    identity_exact = all(np.array_equal(np.asarray(x.v), np.asarray(y.v))
                         for x, y in zip(ea + ae + ee, A + A + E))
    nan_free = not any(np.isnan(np.asarray(x.v, dtype=np.float64)).any()
                       for x in lhs + rhs + ea + ae + ee)
    comm = bool(comm_ok.all()) if monoid.commutative else None

    cex = None
    if not assoc_ok.all():
        i = int(np.argmax(np.where(assoc_ok, -1.0, assoc_r)))
        cex = {"law": "associativity", "a": show(A, i), "b": show(B, i), "c": show(C, i),
               "(a*b)*c": show(lhs, i), "a*(b*c)": show(rhs, i)}
    elif not ident_ok.all():
        i = int(np.argmin(ident_ok))
        cex = {"law": "identity", "a": show(A, i), "e": show(E, i),
               "e*a": show(ea, i), "a*e": show(ae, i)}
    elif not ee_ok.all():
        cex = {"law": "identity", "a": show(E, 0), "e": show(E, 0),
               "e*a": show(ee, 0), "a*e": show(ee, 0)}
    elif comm is False:
        i = int(np.argmin(comm_ok))
        cex = {"law": "commutativity", "a": show(A, i), "b": show(B, i),
               "a*b": show(ab, i), "b*a": show(ba, i)}
    notes = [] if monoid.commutative else [
        "commutativity not declared: kernels will preserve element order"]
    return LawReport(monoid.name, trials, bool(assoc_ok.all()),
                     bool(ident_ok.all() and ee_ok.all()), identity_exact, comm, nan_free, float(assoc_d.max()), float(assoc_r.max()),
                     cex, notes)


def _sq(x, vector, expand):
    x = np.asarray(x)
    return x[..., 0] if (expand and not vector and x.ndim >= 1) else x
