"""Symbolic proofs of the monoid laws: the IR lowered to SymPy, with case splits.

:func:`prove` decides, for a :class:`~flashfold.algebra.monoid.Monoid` ``(S, ⊕, e)``,

.. math::

    (a \\oplus b) \\oplus c = a \\oplus (b \\oplus c), \\qquad
    a \\oplus e = e \\oplus a = a, \\qquad e \\oplus e = e,

(and ``a ⊕ b = b ⊕ a`` when the monoid declares itself commutative) for *symbolic*
states ``a = (a_m, a_d, ...)``, and returns a :class:`Proof` whose steps can be printed,
or the failing law with a concrete counterexample.

How
---
1. **Lowering.** The combine graph is lowered to SymPy through a :class:`Backend` table
   (``exp -> sp.exp``, ``exp2 -> 2**x``, ``log -> sp.log``, ...), like every other
   lowering. Branching ops (``maximum``, ``minimum``, ``abs``, ``where``) do not become
   ``Max``/``Piecewise``: they ask a *decision oracle* which branch holds.
2. **Case splits.** The oracle decides a comparison from the facts already assumed on
   the current path (linear arithmetic over the rationals, decided exactly by
   Fourier-Motzkin elimination, plus SymPy's sign assumptions). When the facts do not
   decide it, the path forks: ``x >= y`` and ``x < y`` (``x = y``, ``x < y``, ``x > y``
   for an equality test), each explored by re-running the lowered code (symbolic
   execution). Every feasible path is one case of the proof, e.g. for the online-softmax
   merge ``a_m >= b_m, a_m >= c_m, b_m >= c_m``; infeasible orderings are pruned.
3. **Equality.** Within a case the branch-free sides are compared by canonical forms:
   ``expand`` + ``powsimp`` (which merges ``e^x e^y = e^(x+y)``, the cancellation of the
   intermediate maximum), ``cancel(together(.))`` for rational functions (Welford),
   ``rewrite(exp)`` for ``2^x``, and ``simplify`` as a last resort.

Reachable states and the adjoined identity
-------------------------------------------
A law only has to hold on states a reduction can produce. :func:`prove` computes an
*invariant* of the reachable states: sign facts per field (``d > 0``, ``n > 0``,
``M2 >= 0``, integer positions ``0 <= i < 2^31 - 1``) that every lifted element has and
that the combine preserves (checked symbolically, as an induction). The symbols of the
proof carry those facts, and are finite reals.

The identity is treated as the specification's *adjoined element*: the ``-inf`` of
``(-inf, 0)`` is not a real number, so ``e`` is kept concrete (``m = -oo``) and the laws
involving it are checked separately: ``a ⊕ e = a``, ``e ⊕ a = a`` for symbolic ``a`` and
``e ⊕ e = e``. Together with associativity on symbolic states this covers every triple
of ``S ∪ {e}`` (a triple containing ``e`` reduces to the identity laws). Guards such as
``where(isinf(m), 0, m)`` then decide themselves: ``isinf`` is false on a finite
symbolic ``m`` and true on the adjoined ``-oo``. When an input domain admits ``-inf``
and lifting it does *not* give the identity (``ARGMAX`` keeps ``(-inf, position)``),
the affected field ranges over ``R ∪ {-oo}`` and each state is split into both cases.

A vector field (attention's ``o``) is represented by one scalar symbol: the combine is
elementwise in it, so one coordinate stands for all.

Failure
-------
When a case does not simplify to zero, :func:`prove` searches small rational values
satisfying that case's conditions at which the two sides differ (evaluated to 30
digits), replays them through the NumPy lowering (the code that actually runs), and
reports them with the symbolic residue ``lhs - rhs``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Sequence

from .lower import Backend, compile_graph, get_backend, register_backend
from .monoid import Monoid

#: positions (``Input(domain="position")``) are below this bound: int32 kernels, and the
#: ARGMAX/ARGMIN identity index 2^31 - 1 is larger than every real position
POSITION_BOUND = 2**31 - 1

#: give up on a law after this many paths (cases)
MAX_PATHS = 20000


class ProofError(RuntimeError):
    """The proof could not be carried out (too many cases, an op SymPy cannot lower)."""


# =====================================================================================
# Conditions: comparisons stay symbolic until a branch needs their truth value
# =====================================================================================

class _Rel:
    """``lhs op rhs`` with op in lt, le, gt, ge, eq, ne."""
    __slots__ = ("op", "lhs", "rhs")

    def __init__(self, op, lhs, rhs):
        self.op, self.lhs, self.rhs = op, lhs, rhs


class _Logic:
    """``and``/``or``/``not`` of conditions (short-circuit when asked for a truth value)."""
    __slots__ = ("op", "args")

    def __init__(self, op, *args):
        self.op, self.args = op, args


class _Atom:
    """A condition no linear fact can decide (``isinf`` of an expression of unknown
    finiteness, a non-linear comparison): branched on as an opaque proposition."""
    __slots__ = ("key", "text", "expr")

    def __init__(self, key, text, expr=None):
        self.key, self.text, self.expr = key, text, expr


_SYM = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "=", "ne": "!="}


# =====================================================================================
# Linear facts, decided exactly (Fourier-Motzkin over the rationals)
# =====================================================================================

def _num(c):
    """A SymPy number as an exact Fraction when rational, else the SymPy number itself."""
    if c.is_Rational:
        return Fraction(int(c.p), int(c.q))
    return c


def _linear(expr):
    """``expr`` as ``(coeffs {symbol: number}, constant)`` when it is affine, else None."""
    import sympy as sp
    if not expr.free_symbols:
        return ({}, _num(expr)) if expr.is_comparable or expr.is_Rational else None
    if not expr.is_Add and not expr.is_Mul and not expr.is_Symbol:
        return None
    if expr.is_Mul and not any(t.is_Symbol for t in expr.args):
        expr = sp.expand(expr)
    coeffs: dict = {}
    const = Fraction(0)
    for term in sp.Add.make_args(expr):
        indep, dep = term.as_independent(*term.free_symbols, as_Add=False)
        if dep == 1:
            if not (indep.is_Rational or indep.is_comparable):
                return None
            const = const + _num(indep)
        elif dep.is_Symbol and (indep.is_Rational or indep.is_comparable):
            coeffs[dep] = coeffs.get(dep, 0) + _num(indep)
        else:
            return None
    return {k: v for k, v in coeffs.items() if v != 0}, const


def _positive(c) -> bool:
    return bool(c > 0)


def _feasible(rows) -> bool:
    """Whether the linear constraints ``sum c_i x_i + k (> or >=) 0`` have a real solution.

    ``rows``: iterable of ``(coeffs, k, strict)``. Fourier-Motzkin elimination, exact for
    rational (and, through SymPy, real algebraic) coefficients.
    """
    rows = [(dict(c), k, s) for c, k, s in rows]
    for _ in range(64):
        live = []
        for co, k, s in rows:
            co = {v: a for v, a in co.items() if a != 0}
            if not co:
                if (k < 0) or (s and k == 0):
                    return False
                continue
            live.append((co, k, s))
        if not live:
            return True
        vars_: dict = {}
        for co, _, _ in live:
            for v, a in co.items():
                p, n = vars_.get(v, (0, 0))
                vars_[v] = (p + 1, n) if _positive(a) else (p, n + 1)
        v = min(vars_, key=lambda x: (vars_[x][0] * vars_[x][1] - sum(vars_[x]), str(x)))
        pos = [r for r in live if v in r[0] and _positive(r[0][v])]
        neg = [r for r in live if v in r[0] and not _positive(r[0][v])]
        rest = [r for r in live if v not in r[0]]
        out, seen = list(rest), set()
        for pc, pk, ps in pos:
            for nc, nk, ns in neg:
                a, b = pc[v], -nc[v]
                co = {}
                for w in set(pc) | set(nc):
                    if w is v:
                        continue
                    co[w] = b * pc.get(w, 0) + a * nc.get(w, 0)
                row = (co, b * pk + a * nk, ps or ns)
                key = _row_key(row)
                if key not in seen:
                    seen.add(key)
                    out.append(row)
        rows = out
    raise ProofError("linear arithmetic did not terminate")  # pragma: no cover


def _row_key(row):
    co, k, s = row
    items = sorted(((str(v), a) for v, a in co.items() if a != 0), key=lambda t: t[0])
    if items:
        scale = abs(items[0][1])
        items = tuple((n, a / scale) for n, a in items)
        k = k / scale
    return (tuple(items), k, s)


def _component(rows, vars_):
    """The rows that share variables (transitively) with ``vars_``: all that can matter."""
    want = set(vars_)
    chosen: list = []
    left = list(rows)
    changed = True
    while changed:
        changed = False
        keep = []
        for r in left:
            if want & set(r[0]):
                chosen.append(r)
                want |= set(r[0])
                changed = True
            else:
                keep.append(r)
        left = keep
    return chosen


def _neg(row):
    co, k, s = row
    return ({v: -a for v, a in co.items()}, -k, not s)


# =====================================================================================
# Symbolic execution: one path = one case of the proof
# =====================================================================================

class _Path:
    """The facts and decisions of one path; forks are queued as forced prefixes."""

    def __init__(self, forced: list, base_rows: list):
        self.forced = forced
        self.trail: list = []
        self.pending: list = []
        self.rows = list(base_rows)
        self.atoms: dict = {}
        self.atom_text: dict = {}
        self.conditions: list = []
        self.nonlinear: list = []          # (expr, op) facts SymPy could not linearize
        self.cache: dict = {}
        self.values: dict = {}             # what the law instantiated each state with

    # -- forks ------------------------------------------------------------------------
    def branch(self, alts):
        """``alts``: list of ``(value, rows, atoms, text)``; returns the chosen value."""
        k = len(self.trail)
        if k < len(self.forced):
            i = self.forced[k]
        else:
            i = 0
            for j in range(1, len(alts)):
                self.pending.append(self.trail + [j])
        self.trail.append(i)
        value, rows, atoms, text, nonlin = alts[i]
        self.rows.extend(rows)
        self.atoms.update(atoms)
        self.nonlinear.extend(nonlin)
        if text:
            self.conditions.append(text)
        return value

    def choose(self, options: Sequence[str]) -> int:
        """A plain case split into ``len(options)`` cases (e.g. a field finite or -oo)."""
        return self.branch([(i, [], {}, t, []) for i, t in enumerate(options)])

    # -- truth of conditions ------------------------------------------------------------
    def truth(self, c) -> bool:
        import sympy as sp
        if isinstance(c, bool):
            return c
        if c is sp.true or c is sp.false:
            return bool(c)
        if isinstance(c, _Logic):
            if c.op == "not":
                return not self.truth(c.args[0])
            if c.op == "and":
                return all(self.truth(a) for a in c.args)
            return any(self.truth(a) for a in c.args)
        if isinstance(c, _Rel):
            return self._rel(c.op, c.lhs, c.rhs)
        if isinstance(c, _Atom):
            return self._atom(c)
        if hasattr(c, "is_zero"):            # a number used as a condition: nonzero is true
            return not self._rel("eq", c, sp.Integer(0))
        raise ProofError(f"cannot take the truth value of {c!r}")

    def _atom(self, a: _Atom) -> bool:
        if a.key in self.atoms:
            return self.atoms[a.key]
        return self.branch([(True, [], {a.key: True}, a.text, []),
                            (False, [], {a.key: False}, f"not {a.text}", [])])

    def _rel(self, op, x, y) -> bool:
        import sympy as sp
        key = (op, x, y)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        result = self._decide(op, sp.sympify(x), sp.sympify(y))
        self.cache[key] = result
        return result

    def _decide(self, op, x, y) -> bool:
        import sympy as sp
        bad = (sp.nan, sp.zoo)
        if x in bad or y in bad or x.has(sp.nan) or y.has(sp.nan):
            return op == "ne"                  # IEEE: every comparison with NaN is false
        if x.is_infinite or y.is_infinite:
            rel = {"lt": sp.Lt, "le": sp.Le, "gt": sp.Gt, "ge": sp.Ge,
                   "eq": sp.Eq, "ne": sp.Ne}[op](x, y)
            if rel in (sp.true, sp.false):
                return bool(rel)
            return self._atom(_Atom(("rel", op, x, y), f"{x} {_SYM[op]} {y}"))
        diff = x - y
        text = lambda o: f"{_fmt(x)} {_SYM[o]} {_fmt(y)}"  # noqa: E731
        lin = _linear(diff)
        if lin is None:
            return self._decide_nonlinear(op, diff, text)
        coeffs, k = lin
        gt, ge = (coeffs, k, True), (coeffs, k, False)
        lt, le = _neg(ge), _neg(gt)
        if op in ("gt", "ge", "lt", "le"):
            h = {"gt": gt, "ge": ge, "lt": lt, "le": le}[op]
            nh = _neg(h)
            inv = {"gt": "le", "ge": "lt", "lt": "ge", "le": "gt"}[op]
            can_true, can_false = self._sat([h]), self._sat([nh])
            if not can_false:
                return True
            if not can_true:
                return False
            return self.branch([(True, [h], {}, text(op), []), (False, [nh], {}, text(inv), [])])
        # equality: three orderings
        eq_rows = [ge, le]
        alts = []
        if self._sat(eq_rows):
            alts.append((op == "eq", eq_rows, {}, text("eq"), []))
        if self._sat([gt]):
            alts.append((op == "ne", [gt], {}, text("gt"), []))
        if self._sat([lt]):
            alts.append((op == "ne", [lt], {}, text("lt"), []))
        if not alts:
            raise ProofError("inconsistent facts on a path")  # pragma: no cover
        if len({a[0] for a in alts}) == 1:
            return alts[0][0]
        return self.branch(alts)

    def _decide_nonlinear(self, op, diff, text) -> bool:
        sign = _sign(diff)
        if sign is not None:
            lo, hi = sign                      # diff in [lo, hi] as signs: -1, 0, 1
            results = {s: _holds(op, s) for s in range(lo, hi + 1)}
            if len(set(results.values())) == 1:
                return next(iter(results.values()))
        key = ("nl", op, diff)
        if key in self.atoms:
            return self.atoms[key]
        inv = {"gt": "le", "ge": "lt", "lt": "ge", "le": "gt", "eq": "ne", "ne": "eq"}[op]
        return self.branch([(True, [], {key: True}, text(op), [(diff, op)]),
                            (False, [], {key: False}, text(inv), [(diff, inv)])])

    def _sat(self, extra) -> bool:
        vars_ = set().union(*(r[0] for r in extra)) if extra else set()
        return _feasible(_component(self.rows, vars_) + list(extra))

    def equalities(self) -> dict:
        """Substitutions ``{symbol: expr}`` for the linear equalities the facts imply.

        A non-strict fact ``L >= 0`` is an equality when ``L > 0`` is infeasible (e.g.
        ``a_m >= b_m`` together with ``b_m >= a_m``); solved by elimination, replacing the
        later-named symbol (``b_m -> a_m``).
        """
        import sympy as sp
        eqs = []
        for co, k, strict in self.rows:
            if strict or not co:
                continue
            if not self._sat([(co, k, True)]):
                eqs.append(sum((sp.Rational(a.numerator, a.denominator) if isinstance(a, Fraction) else a) * v
                               for v, a in co.items())
                           + (sp.Rational(k.numerator, k.denominator) if isinstance(k, Fraction) else k))
        subs: dict = {}
        for e in eqs:
            e = sp.expand(e.subs(subs))
            free = sorted(e.free_symbols, key=str)
            if not free:
                continue
            var = free[-1]
            sol = sp.solve(e, var)
            if not sol:
                continue
            subs = {k: v.subs(var, sol[0]) for k, v in subs.items()}
            subs[var] = sol[0]
        return subs

    def implied(self, op, x, y) -> bool | None:
        """Whether the path's facts imply ``x op y`` (None: not decided), without forking."""
        import sympy as sp
        x, y = sp.sympify(x), sp.sympify(y)
        if x.is_infinite or y.is_infinite:
            rel = {"lt": sp.Lt, "le": sp.Le, "gt": sp.Gt, "ge": sp.Ge}[op](x, y)
            return bool(rel) if rel in (sp.true, sp.false) else None
        lin = _linear(x - y)
        if lin is None:
            s = _sign(x - y)
            if s is None:
                return None
            vals = {_holds(op, v) for v in range(s[0], s[1] + 1)}
            return vals.pop() if len(vals) == 1 else None
        coeffs, k = lin
        h = {"gt": (coeffs, k, True), "ge": (coeffs, k, False)}.get(op)
        if h is None:
            h = _neg({"lt": (coeffs, k, False), "le": (coeffs, k, True)}[op])
        if not self._sat([_neg(h)]):
            return True
        if not self._sat([h]):
            return False
        return None


def _holds(op, s) -> bool:
    return {"gt": s > 0, "ge": s >= 0, "lt": s < 0, "le": s <= 0, "eq": s == 0, "ne": s != 0}[op]


def _sign(e):
    """(lowest, highest) possible sign of ``e`` from SymPy's assumptions, or None."""
    if e.is_zero:
        return (0, 0)
    if e.is_positive:
        return (1, 1)
    if e.is_negative:
        return (-1, -1)
    if e.is_nonnegative:
        return (0, 1)
    if e.is_nonpositive:
        return (-1, 0)
    return None


_ACTIVE: list[_Path] = []


def _path() -> _Path:
    if not _ACTIVE:
        raise ProofError("SymPy-lowered code must run inside a proof (a decision oracle)")
    return _ACTIVE[-1]


def explore(fn: Callable[["_Path"], object], base_rows=(), max_paths: int = MAX_PATHS):
    """Run ``fn(path)`` once per feasible path; yields ``(path, result)``.

    ``fn`` calls SymPy-lowered graphs (:func:`sympy_function`); every branch the facts of
    the path do not decide forks it, and the other alternatives are run later by
    replaying the same decisions up to the fork (depth first).
    """
    stack: list = [[]]
    count = 0
    while stack:
        forced = stack.pop()
        count += 1
        if count > max_paths:
            raise ProofError(f"more than max_paths={max_paths} cases: pass a larger max_paths, "
                             f"or the case split may not terminate in reasonable time")
        p = _Path(forced, list(base_rows))
        _ACTIVE.append(p)
        try:
            result = fn(p)
        finally:
            _ACTIVE.pop()
        stack.extend(reversed(p.pending))
        yield p, result


# =====================================================================================
# The SymPy backend
# =====================================================================================

def _fmt(e) -> str:
    return str(e)


def _known_constants():
    import sympy as sp
    ln2 = sp.log(2)
    return {math.log(2.0): ln2, 1.0 / math.log(2.0): 1 / ln2, math.log2(math.e): 1 / ln2,
            math.pi: sp.pi, math.e: sp.E, math.log(10.0): sp.log(10),
            math.sqrt(2.0): sp.sqrt(2), 1.0 / math.sqrt(2.0): 1 / sp.sqrt(2)}


def _sympy_const(v) -> str:
    if isinstance(v, bool):
        return repr(v)
    if isinstance(v, int):
        return f"_sp.Integer({v})"
    if math.isinf(v):
        return "_sp.oo" if v > 0 else "(-_sp.oo)"
    if float(v).is_integer():
        return f"_sp.Integer({int(v)})"
    return f"_K[{float(v)!r}]" if float(v) in _CONSTS_KEYS else f"_sp.Rational({repr(float(v))!r})"


_CONSTS_KEYS: set = {math.log(2.0), 1.0 / math.log(2.0), math.log2(math.e), math.pi, math.e,
                     math.log(10.0), math.sqrt(2.0), 1.0 / math.sqrt(2.0)}


def _h_max(x, y):
    return x if _path().truth(_Rel("ge", x, y)) else y


def _h_min(x, y):
    return x if _path().truth(_Rel("le", x, y)) else y


def _h_abs(x):
    return x if _path().truth(_Rel("ge", x, 0)) else -x


def _h_where(c, x, y):
    return x if _path().truth(c) else y


def _h_rel(op):
    def f(x, y):
        return _Rel(op, x, y)
    return f


def _h_and(x, y):
    if x is False or y is False:
        return False
    if x is True:
        return y
    if y is True:
        return x
    return _Logic("and", x, y)


def _h_or(x, y):
    if x is True or y is True:
        return True
    if x is False:
        return y
    if y is False:
        return x
    return _Logic("or", x, y)


def _h_not(x):
    if isinstance(x, bool):
        return not x
    return _Logic("not", x)


def _h_isinf(x):
    import sympy as sp
    if isinstance(x, (bool, _Rel, _Logic, _Atom)):
        return False
    if x in (sp.oo, -sp.oo, sp.zoo):
        return True
    if x is sp.nan or x.is_finite:
        return False
    if x.is_infinite is False and x.is_extended_real:
        return False
    return _Atom(("isinf", x), f"isinf({x})", x)


def _h_isnan(x):
    import sympy as sp
    if isinstance(x, (bool, _Rel, _Logic, _Atom)):
        return False
    if x is sp.nan:
        return True
    if x.is_finite or x in (sp.oo, -sp.oo) or x.is_extended_real:
        return False
    return _Atom(("isnan", x), f"isnan({x})", x)


def _h_num(x):
    """to_float / to_int of a condition: 1 or 0."""
    import sympy as sp
    if isinstance(x, (bool, _Rel, _Logic, _Atom)):
        return sp.Integer(1) if _path().truth(x) else sp.Integer(0)
    return x


def _h_to_int(x):
    import sympy as sp
    x = _h_num(x)
    if x.is_integer:
        return x
    return sp.floor(x) if _path().truth(_Rel("ge", x, 0)) else sp.ceiling(x)


def _h_log(x):
    import sympy as sp
    if x == 0:
        return -sp.oo
    return sp.log(x)


def sympy_backend() -> Backend:
    """The SymPy lowering (registered as ``"sympy"`` on first use; imports SymPy)."""
    try:
        return get_backend("sympy")
    except ValueError:
        pass
    import sympy as sp
    ns = {"_sp": sp, "_K": _known_constants(), "_max": _h_max, "_min": _h_min,
          "_abs": _h_abs, "_where": _h_where, "_and": _h_and, "_or": _h_or, "_not": _h_not,
          "_isinf": _h_isinf, "_isnan": _h_isnan, "_num": _h_num, "_to_int": _h_to_int,
          "_log": _h_log}
    t = {
        "neg": "(-{0})", "exp": "_sp.exp({0})", "exp2": "_sp.Pow(2, {0})",
        "log": "_log({0})", "log2": "(_log({0}) / _sp.log(2))", "log1p": "_log(1 + {0})",
        "expm1": "(_sp.exp({0}) - 1)", "sqrt": "_sp.sqrt({0})", "abs": "_abs({0})",
        "tanh": "_sp.tanh({0})", "sigmoid": "(1 / (1 + _sp.exp(-({0}))))",
        "floor": "_sp.floor({0})", "not": "_not({0})", "isnan": "_isnan({0})",
        "isinf": "_isinf({0})", "to_float": "_num({0})", "to_int": "_to_int({0})",
        "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})",
        "div": "({0} / {1})", "floordiv": "_sp.floor({0} / {1})", "mod": "_sp.Mod({0}, {1})",
        "pow": "_sp.Pow({0}, {1})", "maximum": "_max({0}, {1})", "minimum": "_min({0}, {1})",
        "and": "_and({0}, {1})", "or": "_or({0}, {1})", "where": "_where({0}, {1}, {2})",
    }
    for op in ("lt", "le", "gt", "ge", "eq", "ne"):
        ns["_" + op] = _h_rel(op)
        t[op] = "_%s({0}, {1})" % op
    return register_backend(Backend("sympy", t, _sympy_const, ns))


def sympy_function(graph) -> Callable:
    """``graph`` lowered to SymPy: a Python function of SymPy expressions returning a tuple.

    Branching ops consult the decision oracle, so call it inside :func:`explore`. The
    results must be numbers: a truth value (a comparison, ``a.s | b.s``) as a state's
    field raises :class:`ProofError`, since the symbols of a proof range over the reals
    (a field of 0 / 1 is refuted at states such as 2 that no reduction reaches).
    """
    try:
        fn = compile_graph(graph, sympy_backend())
    except NotImplementedError as e:
        raise ProofError(f"{graph.name}: {e} (SymPy proofs cover elementwise combines, not "
                         f"block reductions or buffer loads)") from None

    def numbers(*args):
        outs = fn(*args)
        for i, o in enumerate(outs):
            if isinstance(o, (bool, _Rel, _Logic, _Atom)):
                raise ProofError(f"{graph.name}: result {i} is a truth value (a comparison "
                                 f"or a logical op); symbolic proofs cover fields of numbers "
                                 f"(check_laws checks this monoid numerically)")
        return outs
    return numbers


# =====================================================================================
# Reachable states: symbols, sign invariants, the -inf fiber
# =====================================================================================

_PREDICATES = ("positive", "nonnegative", "integer", "index")


@dataclass(frozen=True)
class FieldDomain:
    """What a reachable (non-identity) state's field can be: finite reals with ``facts``,
    plus the infinities listed in ``infinities`` (e.g. ``(-oo,)`` for ARGMAX's value)."""
    name: str
    facts: tuple = ()
    infinities: tuple = ()

    def describe(self) -> str:
        words = {"positive": f"{self.name} > 0", "nonnegative": f"{self.name} >= 0",
                 "integer": f"{self.name} integer",
                 "index": f"{self.name} < {POSITION_BOUND}"}
        parts = [words[f] if isinstance(f, str) else f"{self.name} >= {f[1]}"
                 for f in self.facts if not (f == "nonnegative" and "positive" in self.facts)]
        if self.infinities:
            parts.append(f"{self.name} may be " + " or ".join(str(i) for i in self.infinities))
        return ", ".join(parts)


def _symbol(name: str, facts) -> object:
    import sympy as sp
    kw = {"real": True, "finite": True}
    if "positive" in facts:
        kw["positive"] = True
    elif "nonnegative" in facts:
        kw["nonnegative"] = True
    if "integer" in facts:
        kw["integer"] = True
    return sp.Symbol(name, **kw)


def _fact_rows(sym, facts) -> list:
    rows = []
    if "positive" in facts:
        rows.append(({sym: Fraction(1)}, Fraction(0), True))
    elif "nonnegative" in facts:
        rows.append(({sym: Fraction(1)}, Fraction(0), False))
    if "index" in facts:
        rows.append(({sym: Fraction(-1)}, Fraction(POSITION_BOUND - 1), False))
    return rows


class StateSymbols:
    """Symbolic states of a monoid: ``prefix_field`` symbols carrying the domain's facts."""

    def __init__(self, monoid: Monoid, domains: Sequence[FieldDomain], prefix: str):
        self.monoid = monoid
        self.domains = domains
        self.prefix = prefix
        self.symbols = [_symbol(f"{prefix}_{d.name}", d.facts) for d in domains]

    def rows(self) -> list:
        out = []
        by_name = {d.name: s for s, d in zip(self.symbols, self.domains)}
        for s, d in zip(self.symbols, self.domains):
            out.extend(_fact_rows(s, d.facts))
            for f in d.facts:
                if isinstance(f, tuple) and f[0] == "ge":      # s >= other field
                    out.append(({s: Fraction(1), by_name[f[1]]: Fraction(-1)}, Fraction(0), False))
        return out

    def instantiate(self, path: _Path) -> list:
        """The state's values on ``path``: each field with infinities is split into cases."""
        vals = []
        for s, d in zip(self.symbols, self.domains):
            if d.infinities:
                k = path.choose([f"{s} finite"] + [f"{s} = {i}" for i in d.infinities])
                vals.append(s if k == 0 else d.infinities[k - 1])
            else:
                vals.append(s)
        return vals


def _input_symbol(inp, name=None):
    import sympy as sp
    name = name or inp.name
    if inp.domain == "positive":
        return sp.Symbol(name, positive=True, finite=True), []
    if inp.domain == "small_int":
        return sp.Symbol(name, integer=True, finite=True), []
    if inp.domain == "position":
        s = sp.Symbol(name, integer=True, nonnegative=True, finite=True)
        return s, _fact_rows(s, ("index",))
    return sp.Symbol(name, real=True, finite=True), []


def _facts_of(path: _Path, expr) -> set:
    import sympy as sp
    out = set()
    if not isinstance(expr, sp.Basic) or not expr.is_finite:
        return out
    if path.implied("gt", expr, 0) or expr.is_positive:
        out.add("positive")
    if "positive" in out or path.implied("ge", expr, 0) or expr.is_nonnegative:
        out.add("nonnegative")
    if expr.is_integer:
        out.add("integer")
    if path.implied("le", expr, POSITION_BOUND - 1):
        out.add("index")
    return out


def reachable_domains(monoid: Monoid) -> tuple[tuple[FieldDomain, ...], list[str]]:
    """An inductive invariant of the reachable non-identity states, field by field.

    Facts are taken from the lift of generic inputs (finite reals, positives, positions)
    and kept only if the combine of two states with the facts has them again, on every
    case of the combine (an induction over the number of elements). Lifting ``-inf``
    (for ``"extended"`` inputs) either gives the identity (nothing to add) or lets the
    fields it makes infinite range over those infinities too. Returns the domains and
    notes for the proof.
    """
    import sympy as sp
    notes: list[str] = []
    lift = sympy_function(monoid.lift_graph)
    combine = sympy_function(monoid.combine_graph)
    names = monoid.field_names
    k = len(names)
    identity = [_sp_value(v) for v in monoid.identity]

    syms, rows = [], []
    for inp in monoid.inputs:
        s, r = _input_symbol(inp)
        syms.append(s)
        rows.extend(r)
    # sign facts per field, and order relations "field_i >= field_j" between fields
    facts = [set(_PREDICATES) | {("ge", names[j]) for j in range(k) if j != i} for i in range(k)]
    infs: list[set] = [set() for _ in range(k)]
    finite_ok = [True] * k

    def absorb(path, outs):
        outs = [sp.sympify(o) for o in outs]
        for i, o in enumerate(outs):
            if o.is_infinite or o is sp.nan:    # NaN (0 * -oo): a value, not "unknown"
                infs[i].add(o)
                facts[i] = {f for f in facts[i] if isinstance(f, str)}
            elif o.is_finite:
                keep = _facts_of(path, o)
                for j, other in enumerate(outs):
                    if j != i and ("ge", names[j]) in facts[i] and other.is_finite \
                            and path.implied("ge", o, other):
                        keep.add(("ge", names[j]))
                facts[i] &= keep
            else:
                finite_ok[i] = False
                facts[i] = set()

    for path, outs in explore(lambda p: lift(*syms), rows):
        absorb(path, outs)
    for j, inp in enumerate(monoid.inputs):
        if inp.domain != "extended":
            continue
        args = list(syms)
        args[j] = -sp.oo
        for path, outs in explore(lambda p: lift(*args), rows):
            if all(_same(o, e) for o, e in zip(outs, identity)):
                continue
            absorb(path, outs)

    def domains():
        out = []
        for i, n in enumerate(names):
            rel = tuple(sorted(f for f in facts[i] if isinstance(f, tuple)
                               if not infs[names.index(f[1])]))
            out.append(FieldDomain(n, tuple(f for f in _PREDICATES if f in facts[i]) + rel,
                                   tuple(sorted(infs[i], key=str))))
        return tuple(out)

    for _ in range(8):                              # induction: keep facts combine preserves
        doms = domains()
        a, b = StateSymbols(monoid, doms, "a"), StateSymbols(monoid, doms, "b")
        before = ([set(f) for f in facts], [set(s) for s in infs])

        def run(p):
            return combine(*a.instantiate(p), *b.instantiate(p))
        for path, outs in explore(run, a.rows() + b.rows()):
            absorb(path, outs)
        if ([set(f) for f in facts], [set(s) for s in infs]) == before:
            break
    else:  # pragma: no cover
        raise ProofError("the reachable-state invariant did not stabilize")
    doms = domains()
    for i, n in enumerate(names):
        if not finite_ok[i]:
            notes.append(f"field {n!r}: finiteness of reachable values could not be shown; "
                         f"assumed finite")
    return doms, notes


def _sp_value(v):
    import sympy as sp
    if isinstance(v, float) and math.isinf(v):
        return sp.oo if v > 0 else -sp.oo
    if isinstance(v, float) and not v.is_integer():
        return sp.Rational(repr(v))
    return sp.Integer(int(v))


def _same(x, y) -> bool:
    import sympy as sp
    x, y = sp.sympify(x), sp.sympify(y)
    return x == y or (x.is_number and y.is_number and not x.has(sp.nan)
                      and not x.is_infinite and not y.is_infinite and (x - y) == 0)


# =====================================================================================
# Equality of the two sides of a law
# =====================================================================================

def equal(x, y) -> str | None:
    """The canonicalization under which ``x == y`` (a method name), or None."""
    import sympy as sp
    x, y = sp.sympify(x), sp.sympify(y)
    # NaN first: SymPy's nan == nan would make a NaN result "identical" on both sides
    if x.has(sp.nan, sp.zoo) or y.has(sp.nan, sp.zoo):
        return None
    # an infinity inside a term of the symbols (-oo * b) is NaN where the term meets a
    # zero: equal only when that cannot happen, which is not decided here
    if any(e.free_symbols and e.has(sp.oo, -sp.oo) for e in (x, y)):
        return None
    if x == y:
        return "identical"
    if x.is_infinite or y.is_infinite:
        return None
    d = x - y
    if d == 0:
        return "identical"
    attempts = (
        ("expand + powsimp", lambda e: sp.expand(sp.powsimp(sp.expand(e)))),
        ("cancel", lambda e: sp.cancel(sp.together(e))),
        ("rewrite(exp) + powsimp", lambda e: sp.expand(sp.powsimp(sp.expand(e.rewrite(sp.exp))))),
        ("simplify", sp.simplify),
    )
    for name, f in attempts:
        try:
            if f(d) == 0:
                return name
        except Exception:  # pragma: no cover - a canonicalizer giving up is not a proof
            continue
    return None


# =====================================================================================
# Proof objects
# =====================================================================================

@dataclass(frozen=True)
class Case:
    """One case of a law: the conditions that select it and both sides per field."""
    law: str
    conditions: tuple
    sides: tuple                   # (field, lhs text, rhs text, method or None)

    @property
    def holds(self) -> bool:
        return all(m is not None for _, _, _, m in self.sides)

    def text(self, indent: str = "    ") -> str:
        cond = ", ".join(self.conditions) if self.conditions else "(no case split)"
        lines = [f"{indent}case {cond}:"]
        for name, lhs, rhs, method in self.sides:
            if method == "identical":
                lines.append(f"{indent}  {name}: {lhs}   (both sides)")
            elif method is None:
                lines.append(f"{indent}  {name}: {lhs}  !=  {rhs}")
            else:
                lines.append(f"{indent}  {name}: {lhs}  =  {rhs}   [{method}]")
        return "\n".join(lines)


@dataclass(frozen=True)
class Counterexample:
    """Concrete states at which a law fails, with the symbolic residue lhs - rhs."""
    law: str
    conditions: tuple
    states: tuple                  # ((label, {field: value}), ...)
    residue: tuple                 # ((field, symbolic lhs - rhs), ...)
    lhs: tuple                     # exact values of the failing fields, ((field, value), ...)
    rhs: tuple
    numpy_lhs: tuple | None = None  # the same law evaluated by the NumPy lowering
    numpy_rhs: tuple | None = None

    @property
    def confirmed(self) -> bool:
        """Whether the NumPy lowering (the code that runs) also gives different sides."""
        if self.numpy_lhs is None:
            return False
        return any(not _num_close(x, y) for x, y in zip(self.numpy_lhs, self.numpy_rhs))

    def text(self, indent: str = "    ") -> str:
        lines = [f"{indent}counterexample ({self.law}):"]
        for label, vals in self.states:
            lines.append(f"{indent}  {label} = (" + ", ".join(f"{k}={v}" for k, v in vals.items()) + ")")
        for (name, l), (_, r) in zip(self.lhs, self.rhs):
            lines.append(f"{indent}  {name}: lhs = {l}, rhs = {r}")
        for name, res in self.residue:
            lines.append(f"{indent}  residue lhs - rhs ({name}) = {res}")
        if self.numpy_lhs is not None:
            lines.append(f"{indent}  NumPy lowering: lhs = {self.numpy_lhs}, rhs = {self.numpy_rhs}"
                         f" ({'confirmed' if self.confirmed else 'NOT reproduced'})")
        return "\n".join(lines)


def _num_close(x, y) -> bool:
    if isinstance(x, float) and isinstance(y, float):
        if math.isnan(x) or math.isnan(y):
            return math.isnan(x) and math.isnan(y)
        if math.isinf(x) or math.isinf(y):
            return x == y
        return abs(x - y) <= 1e-9 * max(1.0, abs(x), abs(y))
    return x == y


@dataclass(frozen=True)
class LawProof:
    """The proof (or refutation) of one law: its cases and, on failure, a counterexample."""
    name: str
    statement: str
    proved: bool
    cases: tuple
    counterexample: Counterexample | None = None
    note: str = ""

    def text(self, indent: str = "  ", steps: bool = True) -> str:
        status = f"proved, {len(self.cases)} case{'s' * (len(self.cases) != 1)}" if self.proved else "FAILED"
        lines = [f"{indent}{self.name}: {self.statement}   [{status}]"]
        if self.note:
            lines.append(f"{indent}  note: {self.note}")
        if steps or not self.proved:
            shown = self.cases if self.proved else [c for c in self.cases if not c.holds][:1]
            for c in shown:
                lines.append(c.text(indent + "  "))
        if self.counterexample is not None:
            lines.append(self.counterexample.text(indent + "  "))
        return "\n".join(lines)


@dataclass(frozen=True)
class Proof:
    """Result of :func:`prove`: one :class:`LawProof` per law; ``bool(proof)`` if all hold.

    ``str(proof)`` prints every case with both sides and the simplification that equates
    them; :attr:`failure` is the first failing law (with its :class:`Counterexample`).
    """
    monoid: str
    fields: tuple
    laws: tuple
    domains: tuple = ()
    notes: tuple = ()

    @property
    def ok(self) -> bool:
        return all(l.proved for l in self.laws)

    def __bool__(self) -> bool:
        return self.ok

    @property
    def failure(self) -> LawProof | None:
        return next((l for l in self.laws if not l.proved), None)

    @property
    def counterexample(self) -> Counterexample | None:
        f = self.failure
        return None if f is None else f.counterexample

    @property
    def steps(self) -> tuple:
        """Every case of every law, in order (each printable with ``.text()``)."""
        return tuple(c for l in self.laws for c in l.cases)

    def law(self, name: str) -> LawProof:
        for l in self.laws:
            if l.name == name:
                return l
        raise KeyError(f"no law {name!r} in this proof; laws: {[l.name for l in self.laws]}")

    def __repr__(self) -> str:
        parts = ", ".join(f"{l.name}: {'proved' if l.proved else 'FAILED'} ({len(l.cases)} cases)"
                          for l in self.laws)
        return f"Proof({self.monoid!r}, {'ok' if self.ok else 'FAILED'}; {parts})"

    def text(self, steps: bool = True) -> str:
        head = f"proof that {self.monoid!r} is a monoid: {'PROVED' if self.ok else 'FAILED'}"
        lines = [head, f"  carrier: ({', '.join(self.fields)})"]
        dom = [d.describe() for d in self.domains if d.describe()]
        lines.append("  reachable states: " + ("; ".join(dom) if dom else "any finite reals")
                     + "; the identity e is a separate (adjoined) element")
        lines.extend(f"  note: {n}" for n in self.notes)
        for l in self.laws:
            lines.append(l.text("  ", steps))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


# =====================================================================================
# prove()
# =====================================================================================

def check_equal_on_paths(law: str, statement: str, field_names: Sequence[str],
                         run: Callable, rows: list, *, states: Sequence = (),
                         replay: Callable | None = None, max_paths: int = MAX_PATHS) -> LawProof:
    """Explore ``run(path) -> (lhs tuple, rhs tuple)`` and compare the sides per case.

    ``states``: ``(label, StateSymbols)`` pairs to print a counterexample with; ``run``
    stores the values it instantiated them with (a symbol, or ``-oo`` in an infinite
    case) in ``path.values``. ``replay(state values) -> (lhs, rhs)`` evaluates the law
    numerically (the NumPy lowering) to confirm a counterexample.
    """
    cases: list[Case] = []
    bad = None
    for path, (lhs, rhs) in explore(run, rows, max_paths):
        sides = []
        subs = None
        for name, l, r in zip(field_names, lhs, rhs):
            method = equal(l, r)
            if method is None:                     # use the equalities the case implies
                if subs is None:
                    subs = path.equalities()
                if subs:
                    m2 = equal(_subs(l, subs), _subs(r, subs))
                    if m2 is not None:
                        eqs = ", ".join(f"{k} = {v}" for k, v in subs.items())
                        method = f"{m2}, using {eqs}"
            sides.append((name, _fmt(l), _fmt(r), method))
        sides = tuple(sides)
        c = Case(law, tuple(path.conditions), sides)
        cases.append(c)
        if not c.holds and bad is None:
            unproved = [i for i, side in enumerate(sides) if side[3] is None]
            bad = (path, [field_names[i] for i in unproved], [lhs[i] for i in unproved],
                   [rhs[i] for i in unproved])
    if bad is None:
        return LawProof(law, statement, True, tuple(cases))
    path, names, lhs, rhs = bad
    cex = _counterexample(law, path, names, lhs, rhs, states, replay)
    note = "" if cex is not None else ("no concrete counterexample found for the failing case; "
                                       "the law may hold but could not be shown symbolically")
    return LawProof(law, statement, False, tuple(cases), cex, note)


def _subs(e, subs):
    import sympy as sp
    return sp.sympify(e).subs(subs)


def _candidates(sym, rng: random.Random):
    import sympy as sp
    half = sp.Rational(1, 2)
    if sym.is_integer and sym.is_nonnegative:
        pool = [0, 1, 2, 3]
    elif sym.is_integer:
        pool = [-2, -1, 0, 1, 2, 3]
    elif sym.is_positive:
        pool = [half, 1, 2, 3]
    elif sym.is_nonnegative:
        pool = [0, half, 1, 2]
    else:
        pool = [-2, -1, -half, 0, half, 1, 2, 3]
    return sp.sympify(rng.choice(pool))


def _to_frac(c) -> Fraction:
    return c if isinstance(c, Fraction) else Fraction(float(c)).limit_denominator(10**12)


def _sample_point(rows, syms, rng: random.Random):
    """A random point satisfying the linear ``rows`` (approximately for irrational
    coefficients), by Fourier-Motzkin elimination and back-substitution: each variable,
    in reverse elimination order, is drawn inside the interval its rows leave open."""
    import sympy as sp
    cur = [({v: _to_frac(a) for v, a in co.items() if a != 0}, _to_frac(k), st) for co, k, st in rows]
    levels = []
    for _ in range(64):
        cur = [r for r in cur if r[0]]
        if not cur:
            break
        vars_ = sorted({v for co, _, _ in cur for v in co}, key=str)
        v = min(vars_, key=lambda x: (sum(1 for co, _, _ in cur if x in co), str(x)))
        levels.append((v, [r for r in cur if v in r[0]]))
        pos = [r for r in cur if v in r[0] and r[0][v] > 0]
        neg = [r for r in cur if v in r[0] and r[0][v] < 0]
        nxt = [r for r in cur if v not in r[0]]
        for pc, pk, ps in pos:
            for nc, nk, ns in neg:
                a, b = pc[v], -nc[v]
                co = {w: b * pc.get(w, 0) + a * nc.get(w, 0) for w in set(pc) | set(nc) if w is not v}
                nxt.append(({w: x for w, x in co.items() if x != 0}, b * pk + a * nk, ps or ns))
        cur = nxt
    values: dict = {}
    for v, vrows in reversed(levels):
        lo = hi = None
        lo_strict = hi_strict = False
        for co, k, strict in vrows:
            rest = k + sum(a * values.get(w, Fraction(0)) for w, a in co.items() if w is not v)
            bound = -rest / co[v]                      # a v + rest (>) 0
            if co[v] > 0 and (lo is None or bound > lo or (bound == lo and strict)):
                lo, lo_strict = bound, strict
            elif co[v] < 0 and (hi is None or bound < hi or (bound == hi and strict)):
                hi, hi_strict = bound, strict
        step = Fraction(rng.choice([1, 1, 2, 3, 5]), rng.choice([1, 2, 4]))
        if lo is not None and hi is not None:
            t = Fraction(rng.choice([1, 1, 2, 3]), 4) if hi > lo else Fraction(0)
            x = lo + (hi - lo) * t
        elif lo is not None:
            x = lo + (step if lo_strict or rng.random() < 0.7 else 0)
        elif hi is not None:
            x = hi - (step if hi_strict or rng.random() < 0.7 else 0)
        else:
            x = Fraction(rng.choice([-2, -1, 0, 1, 2, 3]))
        if v.is_integer and x.denominator != 1:
            x = Fraction(math.ceil(x)) if lo is not None else Fraction(math.floor(x))
        values[v] = x
    out = {}
    for sym in syms:
        out[sym] = (sp.Rational(values[sym].numerator, values[sym].denominator)
                    if sym in values else _candidates(sym, rng))
    return out


def _satisfies(path: _Path, values: dict) -> bool:
    """Whether concrete ``values`` select ``path`` (its linear facts and opaque atoms)."""
    import sympy as sp
    for co, k, strict in path.rows:
        tot = k
        for v, a in co.items():
            if v not in values:
                return False
            x = values[v]
            tot = tot + a * (Fraction(int(x.p), int(x.q)) if x.is_Rational else x)
        if not (tot > 0 if strict else tot >= 0):
            return False
    for key, want in path.atoms.items():
        if key[0] == "nl":
            _, op, diff = key
            val = sp.sympify(diff).subs(values)
            if not val.is_comparable:
                return False
            if _holds(op, int(bool(val > 0)) - int(bool(val < 0))) != want:
                return False
        elif key[0] in ("isinf", "isnan"):
            val = sp.sympify(key[1]).subs(values)
            got = bool(val.is_infinite) if key[0] == "isinf" else val is sp.nan
            if got != want:
                return False
        elif key[0] == "rel":
            _, op, x, y = key
            r = {"lt": sp.Lt, "le": sp.Le, "gt": sp.Gt, "ge": sp.Ge, "eq": sp.Eq, "ne": sp.Ne}[op](
                sp.sympify(x).subs(values), sp.sympify(y).subs(values))
            if r not in (sp.true, sp.false) or bool(r) != want:
                return False
    return True


def _counterexample(law, path, field_names, lhs, rhs, states, replay, tries: int = 4000):
    """Small rational values on ``path`` at which some field's sides differ."""
    import sympy as sp
    syms = set()
    for e in list(lhs) + list(rhs):
        syms |= sp.sympify(e).free_symbols
    for _, st in states:
        syms |= set(st.symbols)
    syms = sorted(syms, key=str)
    rng = random.Random(0)
    for attempt in range(tries):
        if attempt % 2 == 0:                       # inside the case's linear facts
            values = _sample_point(path.rows, syms, rng)
        else:                                      # small values, which make ties likely
            values = {s: _candidates(s, rng) for s in syms}
        if not _satisfies(path, values):
            continue
        bad_fields = []
        for name, l, r in zip(field_names, lhs, rhs):
            lv, rv = sp.sympify(l).subs(values), sp.sympify(r).subs(values)
            if not _values_equal(lv, rv):
                bad_fields.append((name, l, r, lv, rv))
        if not bad_fields:
            continue
        inst = getattr(path, "values", {})
        state_vals, numeric_states = [], []
        for label, st in states:
            given = inst.get(label, st.symbols)
            concrete = [sp.sympify(g).subs(values) for g in given]
            state_vals.append((label, {d.name: _show(v) for d, v in zip(st.domains, concrete)}))
            numeric_states.append(concrete)
        residue = tuple((n, _fmt(sp.simplify(sp.sympify(l) - sp.sympify(r))))
                        for n, l, r, _, _ in bad_fields)
        num_l = num_r = None
        if replay is not None:
            num_l, num_r = replay(numeric_states)
        return Counterexample(law, tuple(path.conditions), tuple(state_vals), residue,
                              tuple((n, _show(lv)) for n, _, _, lv, _ in bad_fields),
                              tuple((n, _show(rv)) for n, _, _, _, rv in bad_fields),
                              num_l, num_r)
    return None


def _values_equal(x, y) -> bool:
    import sympy as sp
    if x == y:
        return True
    if x.has(sp.nan, sp.zoo) or y.has(sp.nan, sp.zoo) or x.is_infinite or y.is_infinite:
        return False
    d = (x - y).evalf(30)
    if not d.is_comparable:
        return False
    scale = max(1, abs(x.evalf(30)), abs(y.evalf(30)))
    return abs(d) <= sp.Float("1e-25") * scale


def _show(v):
    import sympy as sp
    v = sp.sympify(v)
    if v.is_Rational or v.is_infinite:
        return v
    if v.is_number:
        return sp.Float(v.evalf(17), 17)
    return v


def _to_float(v) -> float:
    import sympy as sp
    v = sp.sympify(v)
    if v is sp.oo:
        return math.inf
    if v is -sp.oo:
        return -math.inf
    return float(v)


def numpy_replay(monoid: Monoid, bracket: Callable) -> Callable:
    """``replay(states) -> (lhs, rhs)``: a law evaluated by the NumPy lowering.

    ``states``: concrete states (lists of SymPy numbers, one per field);
    ``bracket(ex, numpy_states) -> (lhs, rhs)`` with ``ex`` the monoid's NumPy executor.
    """
    import numpy as np

    from .evaluate import numpy_monoid
    ex = numpy_monoid(monoid)

    def to_numpy(state):
        out = []
        for f, v in zip(monoid.fields, state):
            x = _to_float(v)
            dt = np.int64 if (f.dtype == "int" and math.isfinite(x)) else np.float64
            out.append(np.full((1, 1) if f.vector else (1,), x, dtype=dt))
        return tuple(out)

    def replay(states):
        lhs, rhs = bracket(ex, [to_numpy(s) for s in states])
        flat = lambda s: tuple(float(np.asarray(x, dtype=np.float64).reshape(-1)[0]) for x in s)  # noqa: E731
        return flat(lhs), flat(rhs)
    return replay


def prove(monoid: Monoid, *, commutativity: bool | None = None, max_paths: int = MAX_PATHS) -> Proof:
    """Prove the monoid laws of ``monoid`` symbolically (SymPy), or refute one.

    Laws: associativity ``(a ⊕ b) ⊕ c = a ⊕ (b ⊕ c)``; identity ``a ⊕ e = a``,
    ``e ⊕ a = a``, ``e ⊕ e = e`` (``e`` the adjoined element, kept concrete, e.g.
    ``m = -oo``); commutativity ``a ⊕ b = b ⊕ a`` when ``monoid.commutative`` (or when
    ``commutativity=True``). ``a, b, c`` are symbolic reachable states (see
    :func:`reachable_domains`); ``max``/``min``/``where``/``abs`` are decided by case
    splits, and each case's sides are shown equal by canonical forms.

    Returns a :class:`Proof` (``bool(proof)``: all laws hold). A failing law carries a
    :class:`Counterexample`: small rational states satisfying the failing case at which
    the sides differ, replayed through the NumPy lowering.

    Raises ``TypeError`` if ``monoid`` is not a :class:`Monoid`, :class:`ProofError` when
    the case split exceeds ``max_paths`` or an op (a block reduction, a buffer load) has
    no SymPy meaning.
    """
    if not isinstance(monoid, Monoid):
        raise TypeError(f"monoid: expected a flashfold Monoid, got {type(monoid).__name__}")
    if isinstance(max_paths, bool) or not isinstance(max_paths, int):
        raise TypeError(f"max_paths: expected an int, got {type(max_paths).__name__}")
    if max_paths < 1:
        raise ValueError(f"max_paths: must be at least 1, got {max_paths}")
    if commutativity is not None and not isinstance(commutativity, bool):
        raise TypeError(f"commutativity: expected True, False or None, got "
                        f"{type(commutativity).__name__}")
    if commutativity is None:
        commutativity = monoid.commutative
    names = monoid.field_names
    domains, notes = reachable_domains(monoid)
    combine = sympy_function(monoid.combine_graph)
    identity = [_sp_value(v) for v in monoid.identity]
    A, B, C = (StateSymbols(monoid, domains, p) for p in ("a", "b", "c"))
    if monoid.has_vector:
        vec = [f.name for f in monoid.fields if f.vector]
        notes = list(notes) + [f"vector field{'s' * (len(vec) > 1)} {', '.join(vec)}: the combine "
                               f"is elementwise, one symbol stands for every coordinate"]

    def op(x, y):
        return list(combine(*x, *y))

    laws = []

    def assoc(p):
        a, b, c = A.instantiate(p), B.instantiate(p), C.instantiate(p)
        p.values = {"a": a, "b": b, "c": c}
        return op(op(a, b), c), op(a, op(b, c))

    def assoc_np(ex, s):
        a, b, c = s
        return ex.combine(ex.combine(a, b), c), ex.combine(a, ex.combine(b, c))

    laws.append(check_equal_on_paths(
        "associativity", "(a ⊕ b) ⊕ c = a ⊕ (b ⊕ c)", names, assoc,
        A.rows() + B.rows() + C.rows(), states=[("a", A), ("b", B), ("c", C)],
        replay=numpy_replay(monoid, assoc_np), max_paths=max_paths))

    def ident(p):
        a = A.instantiate(p)
        p.values = {"a": a}
        return op(a, identity) + op(identity, a), a + a

    def ident_np(ex, s):
        (a,) = s
        e = ex.identity((1,), 1)
        return ex.combine(a, e) + ex.combine(e, a), a + a

    ident_names = [f"{n} (a ⊕ e)" for n in names] + [f"{n} (e ⊕ a)" for n in names]
    lp = check_equal_on_paths(
        "identity", "a ⊕ e = a, e ⊕ a = a, e ⊕ e = e   (e = ("
        + ", ".join(map(str, identity)) + "))", ident_names, ident, A.rows(),
        states=[("a", A)], replay=numpy_replay(monoid, ident_np), max_paths=max_paths)
    ee = list(explore(lambda p: op(identity, identity)))
    ee_sides = tuple((n, _fmt(x), _fmt(y), equal(x, y)) for n, x, y in zip(names, ee[0][1], identity))
    ee_case = Case("identity", ("e ⊕ e",), ee_sides)
    cex = lp.counterexample
    if cex is None and not ee_case.holds:
        bad = [(n, x) for n, x, _, m in ee_sides if m is None]
        cex = Counterexample("identity", ("e ⊕ e",), (("e", dict(zip(names, identity))),),
                             tuple((n, "lhs - rhs undefined or nonzero") for n, _ in bad),
                             tuple(bad), tuple((n, y) for (n, _, _, m), y in zip(ee_sides, identity)
                                               if m is None))
    laws.append(LawProof(lp.name, lp.statement, lp.proved and ee_case.holds,
                         lp.cases + (ee_case,), cex, lp.note))

    if commutativity:
        def comm(p):
            a, b = A.instantiate(p), B.instantiate(p)
            p.values = {"a": a, "b": b}
            return op(a, b), op(b, a)

        def comm_np(ex, s):
            a, b = s
            return ex.combine(a, b), ex.combine(b, a)

        laws.append(check_equal_on_paths(
            "commutativity", "a ⊕ b = b ⊕ a", names, comm, A.rows() + B.rows(),
            states=[("a", A), ("b", B)], replay=numpy_replay(monoid, comm_np),
            max_paths=max_paths))
    return Proof(monoid.name, names, tuple(laws), domains, tuple(notes))


__all__ = ["prove", "Proof", "LawProof", "Case", "Counterexample", "ProofError",
           "FieldDomain", "reachable_domains", "sympy_backend", "sympy_function", "explore",
           "equal", "StateSymbols", "POSITION_BOUND"]
