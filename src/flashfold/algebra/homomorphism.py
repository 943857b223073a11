"""The Third Homomorphism Theorem: reading an associative combine off a batch function.

A *batch function* ``h`` maps a list of elements to a state. It is a *list homomorphism*
when some operator ``⊙`` satisfies ``h(xs ++ ys) = h(xs) ⊙ h(ys)``; then
``h = reduce(⊙) ∘ map(h ∘ [·])`` folds under any bracketing, i.e. on every schedule.

**Third Homomorphism Theorem** (Gibbons 1996). If ``h`` is both a left fold and a right
fold,

.. math::

    h(xs \\mathbin{+\\!\\!+} [x]) = h(xs) \\triangleleft x, \\qquad
    h([x] \\mathbin{+\\!\\!+} xs) = x \\triangleright h(xs),

then ``h`` is a list homomorphism, and with any *weak right inverse* ``g`` of ``h``
(a function with ``h(g(s)) = s`` for every ``s`` in the image of ``h``)

.. math::

    a \\odot b = h\\big(g(a) \\mathbin{+\\!\\!+} g(b)\\big)

is the combine (associative on the image of ``h``, because it *is* ``h`` of a
concatenation). :func:`check_folds` tests the two fold equations on random lists,
:func:`check_weak_inverse` tests ``h ∘ g ∘ h = h``, and :func:`derive_combine` builds
``⊙``. We never guess the combine; we read it off the folds.

Online softmax (the specification's example), ``h(s) = (m, d) = (max s, Σ e^{s - m})``:

* left step ``(m, d) ◁ s = (m', d e^{m - m'} + e^{s - m'})``, ``m' = max(m, s)``; the
  right step is the same with the terms swapped (:func:`online_softmax_left`,
  :func:`online_softmax_right`);
* weak right inverse (:func:`online_softmax_weak_inverse`): ``d`` of a list of ``k``
  scores is at most ``k`` (the max's term is 1, the others at most 1), so ``g`` needs
  ``k = ceil(d)`` scores: the max itself and ``k - 1`` copies of
  ``m + log((d - 1)/(k - 1)) <= m``, whose weights add up to ``d - 1``:

  .. math::

      g(m, d) = [m] \\mathbin{+\\!\\!+} [\\,m + \\log\\tfrac{d - 1}{k - 1}\\,]^{k - 1},
      \\quad k = \\lceil d \\rceil, \\qquad g(-\\infty, 0) = [\\,];

* then ``h(g(a) ++ g(b)) = (m, d_a e^{m_a - m} + d_b e^{m_b - m})``, ``m = max(m_a, m_b)``:
  the online-softmax combine, reproduced.

Maximum prefix sum, ``h(xs) = (Σ xs, max_k Σ_{i<=k} x_i)`` (not a built-in;
``tests/user_monoids.py``): the left step is ``(s, b) ◁ x = (s + x, max(b, s + x))``,
the right step ``x ▷ (s, b) = (x + s, max(x, x + b))``, and since ``b >= s`` on the image
the two-element list ``g(s, b) = [b, s - b]`` (prefix sums ``b, s``) is a weak right
inverse. The derived ``⊙`` is ``(s_a + s_b, max(b_a, s_a + b_b))``.

The functions here work on concrete values: ``h``, ``g`` and the steps are ordinary
Python (numbers, NumPy). A weak inverse of fixed length may also be written over
:mod:`flashfold.ops` together with ``h``; the derived combine is then traceable, i.e. a
:class:`~flashfold.algebra.monoid.Monoid` combine that :func:`~flashfold.prove` can
prove (the softmax inverse has a data-dependent length ``ceil(d)`` and is not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .tolerances import TOLERANCES


def derive_combine(h: Callable, weak_inverse: Callable) -> Callable:
    """The combine ``a ⊙ b = h(weak_inverse(a) ++ weak_inverse(b))`` of the 3HT.

    Parameters
    ----------
    h: the batch function, ``h(list of elements) -> state`` (a tuple).
    weak_inverse: ``g(state) -> list of elements`` with ``h(g(s)) == s`` on the image of
        ``h`` (check with :func:`check_weak_inverse`).

    Returns ``combine(a, b) -> state``. It is associative on the image of ``h`` whenever
    ``h`` is both a left and a right fold (:func:`check_folds`): then
    ``h(xs ++ ys) = h(xs) ⊙ h(ys)``.
    """
    if not callable(h):
        raise TypeError(f"h: expected a function of a list of elements, got {type(h).__name__}")
    if not callable(weak_inverse):
        raise TypeError(f"weak_inverse: expected a function of a state, got "
                        f"{type(weak_inverse).__name__}")

    def combine(a, b):
        return h(list(weak_inverse(a)) + list(weak_inverse(b)))

    combine.__name__ = f"derived_{getattr(h, '__name__', 'h')}_combine"
    combine.__qualname__ = combine.__name__
    combine.__doc__ = (f"a ⊙ b = {getattr(h, '__name__', 'h')}("
                       f"{getattr(weak_inverse, '__name__', 'g')}(a) ++ "
                       f"{getattr(weak_inverse, '__name__', 'g')}(b))  (Third Homomorphism Theorem)")
    combine.h = h
    combine.weak_inverse = weak_inverse
    return combine


# =====================================================================================
# Checks
# =====================================================================================

@dataclass(frozen=True)
class FoldReport:
    """Result of :func:`check_folds` / :func:`check_weak_inverse`; ``bool()`` when all hold.

    ``checks`` maps each equation to (holds, number of lists tried); ``worst_error`` is
    the largest ``|lhs - rhs| / (1 + |rhs|)`` seen; ``counterexample`` the first failure.
    """
    name: str
    checks: tuple
    trials: int
    worst_error: float
    counterexample: dict | None = None

    @property
    def ok(self) -> bool:
        return all(ok for _, ok in self.checks)

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        lines = [f"{self.name}: {'ok' if self.ok else 'FAILED'} ({self.trials} random lists, "
                 f"worst relative deviation {self.worst_error:.3g})"]
        for eq, ok in self.checks:
            lines.append(f"  {eq}: {'ok' if ok else 'FAILED'}")
        if self.counterexample:
            for k, v in self.counterexample.items():
                lines.append(f"  {k}: {v}")
        return "\n".join(lines)


def _default_elements(rng: np.random.Generator, n: int) -> list:
    """Scores ~ N(0, 3²), a few of them tied small integers."""
    x = rng.normal(0.0, 3.0, size=n)
    ties = rng.random(n) < 0.2
    x = np.where(ties, rng.integers(-2, 3, size=n).astype(np.float64), x)
    return [float(v) for v in x]


def _as_tuple(s) -> tuple:
    if isinstance(s, (tuple, list)):
        return tuple(s)
    return (s,)


def _same_state(x, y) -> tuple[bool, float]:
    """States equal within ``TOLERANCES["float64"]`` (relative to ``1 + |y|``), inf-exact."""
    atol, rtol = TOLERANCES["float64"]
    x, y = _as_tuple(x), _as_tuple(y)
    if len(x) != len(y):
        return False, math.inf
    worst = 0.0
    for a, b in zip(x, y):
        try:
            a = np.asarray(a, dtype=np.float64)
            b = np.asarray(b, dtype=np.float64)
        except (TypeError, ValueError):
            raise TypeError(f"state: expected a number, an array or a tuple of them, got "
                            f"{type(a).__name__} and {type(b).__name__}") from None
        if a.shape != b.shape:
            return False, math.inf
        inf = np.isinf(a) | np.isinf(b) | np.isnan(a) | np.isnan(b)
        # infinities exactly, NaN where the other side has NaN (NaN != NaN otherwise)
        if not np.array_equal(a[inf], b[inf], equal_nan=True):
            return False, math.inf
        fin = ~inf
        err = np.abs(a[fin] - b[fin]) / (1.0 + np.abs(b[fin]))
        worst = max(worst, float(err.max(initial=0.0)))
        if np.any(np.abs(a[fin] - b[fin]) > atol * (1.0 + np.abs(b[fin])) + rtol * np.abs(b[fin])):
            return False, worst
    return True, worst


def _check_args(trials, max_len, elements, seed=0):
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"seed: expected an int >= 0, got {seed!r}")
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        raise ValueError(f"trials: expected a positive int, got {trials!r}")
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
        raise ValueError(f"max_len: expected a positive int, got {max_len!r}")
    if elements is not None and not callable(elements):
        raise TypeError(f"elements: expected a function (rng, n) -> list, got {type(elements).__name__}")


def _drawer(elements):
    """``elements`` (or the default), checked to return ``n`` elements when asked for ``n``."""
    if elements is None:
        return _default_elements

    def draw(rng, n):
        out = list(elements(rng, n))
        if len(out) != n:
            raise ValueError(f"elements: asked for {n} elements, returned {len(out)}")
        return out
    return draw


def check_folds(h: Callable, left_step: Callable, right_step: Callable, *,
                elements: Callable | None = None, trials: int = 200, max_len: int = 12,
                seed: int = 0) -> FoldReport:
    """Check that ``h`` is a left fold with ``left_step`` and a right fold with ``right_step``.

    On ``trials`` random lists ``xs`` (length 0 to ``max_len``) and elements ``x``:

    * ``h(xs + [x]) == left_step(h(xs), x)``   (``h`` is a foldl),
    * ``h([x] + xs) == right_step(x, h(xs))``  (``h`` is a foldr),

    compared with ``TOLERANCES["float64"]`` (:mod:`flashfold.algebra.tolerances`) relative
    to ``1 + |rhs|`` (infinities exactly). Both holding is the hypothesis of the Third Homomorphism
    Theorem: ``h`` is then a list homomorphism and :func:`derive_combine` gives its combine.

    ``elements(rng, n) -> list`` draws list elements (default: scores ~ N(0, 3²) with
    ties). Returns a :class:`FoldReport`.
    """
    for arg, fn in (("h", h), ("left_step", left_step), ("right_step", right_step)):
        if not callable(fn):
            raise TypeError(f"{arg}: expected a function, got {type(fn).__name__}")
    _check_args(trials, max_len, elements, seed)
    draw = _drawer(elements)
    rng = np.random.default_rng(seed)
    ok_l = ok_r = True
    worst, cex = 0.0, None
    with np.errstate(all="ignore"):
        for _ in range(trials):
            n = int(rng.integers(0, max_len + 1))
            xs = list(draw(rng, n))
            x = draw(rng, 1)[0]
            hx = h(xs)
            same, err = _same_state(left_step(hx, x), h(xs + [x]))
            worst = max(worst, err if math.isfinite(err) else worst)
            if not same:
                ok_l = False
                cex = cex or {"equation": "h(xs + [x]) == left_step(h(xs), x)", "xs": xs, "x": x,
                              "h(xs + [x])": h(xs + [x]), "left_step(h(xs), x)": left_step(hx, x)}
            same, err = _same_state(right_step(x, hx), h([x] + xs))
            worst = max(worst, err if math.isfinite(err) else worst)
            if not same:
                ok_r = False
                cex = cex or {"equation": "h([x] + xs) == right_step(x, h(xs))", "xs": xs, "x": x,
                              "h([x] + xs)": h([x] + xs), "right_step(x, h(xs))": right_step(x, hx)}
    return FoldReport(f"folds of {getattr(h, '__name__', 'h')}",
                      (("left fold: h(xs + [x]) == left_step(h(xs), x)", ok_l),
                       ("right fold: h([x] + xs) == right_step(x, h(xs))", ok_r)),
                      trials, worst, cex)


def check_weak_inverse(h: Callable, weak_inverse: Callable, *, elements: Callable | None = None,
                       trials: int = 200, max_len: int = 12, seed: int = 0) -> FoldReport:
    """Check ``h(weak_inverse(h(xs))) == h(xs)`` on random lists (a weak right inverse)."""
    for arg, fn in (("h", h), ("weak_inverse", weak_inverse)):
        if not callable(fn):
            raise TypeError(f"{arg}: expected a function, got {type(fn).__name__}")
    _check_args(trials, max_len, elements, seed)
    draw = _drawer(elements)
    rng = np.random.default_rng(seed)
    ok, worst, cex = True, 0.0, None
    with np.errstate(all="ignore"):
        for _ in range(trials):
            xs = list(draw(rng, int(rng.integers(0, max_len + 1))))
            s = h(xs)
            back = h(list(weak_inverse(s)))
            same, err = _same_state(back, s)
            worst = max(worst, err if math.isfinite(err) else worst)
            if not same:
                ok = False
                cex = cex or {"xs": xs, "h(xs)": s, "g(h(xs))": list(weak_inverse(s)),
                              "h(g(h(xs)))": back}
    return FoldReport(f"weak inverse of {getattr(h, '__name__', 'h')}",
                      (("h(g(h(xs))) == h(xs)", ok),), trials, worst, cex)


# =====================================================================================
# Online softmax: h, its folds, its weak right inverse
# =====================================================================================

def online_softmax_batch(scores: Sequence[float]) -> tuple[float, float]:
    """``h(s) = (m, d) = (max s, Σ e^{s_j - m})``; ``h([]) = (-inf, 0)`` (also all ``-inf``);
    a NaN score gives ``(nan, nan)`` (never the empty state)."""
    s = np.asarray(list(scores), dtype=np.float64)
    if np.isnan(s).any():
        return (math.nan, math.nan)
    if s.size == 0 or not np.any(s > -np.inf):
        return (-math.inf, 0.0)
    m = float(s.max())
    return (m, float(np.sum(np.exp(s - m))))


def _rescale(x: float, m: float) -> float:
    return 0.0 if x == -math.inf else math.exp(x - m)


def online_softmax_left(state, s: float) -> tuple[float, float]:
    """``(m, d) ◁ s = (m', d e^{m - m'} + e^{s - m'})``, ``m' = max(m, s)`` (NaN if either
    is: Python's ``max`` would keep the number)."""
    m, d = state
    if math.isnan(m) or math.isnan(s):
        return (math.nan, math.nan)
    m2 = max(m, s)
    if m2 == -math.inf:
        return (-math.inf, 0.0)
    return (m2, d * _rescale(m, m2) + _rescale(s, m2))


def online_softmax_right(s: float, state) -> tuple[float, float]:
    """``s ▷ (m, d) = (m', e^{s - m'} + d e^{m - m'})``, ``m' = max(m, s)`` (NaN if either
    is)."""
    m, d = state
    if math.isnan(m) or math.isnan(s):
        return (math.nan, math.nan)
    m2 = max(m, s)
    if m2 == -math.inf:
        return (-math.inf, 0.0)
    return (m2, _rescale(s, m2) + d * _rescale(m, m2))


def online_softmax_weak_inverse(state) -> list[float]:
    """``g(m, d) = [m] + [m + log((d - 1)/(k - 1))] * (k - 1)`` with ``k = ceil(d)``.

    On the image of :func:`online_softmax_batch` ``d >= 1`` (the max contributes 1), and
    ``(d - 1)/(k - 1) <= 1`` keeps every extra score at most ``m``; the weights sum to
    ``1 + (k - 1)(d - 1)/(k - 1) = d``. ``g(-inf, 0) = []``; ``g(nan, nan) = [nan]``.
    """
    m, d = (float(v) for v in state)
    if m == -math.inf:
        return []
    if math.isnan(m) or math.isnan(d):
        return [math.nan]
    if not d >= 1.0:
        raise ValueError(f"state: (m, d) = {(m, d)} is not in the image of the online-softmax "
                         f"batch function (needs d >= 1)")
    k = max(1, math.ceil(d))
    if k == 1:
        return [m]
    return [m] + [m + math.log((d - 1.0) / (k - 1))] * (k - 1)


# =====================================================================================
# Maximum prefix sum (not a built-in)
# =====================================================================================

def max_prefix_sum_batch(xs: Sequence[float]) -> tuple[float, float]:
    """``h(xs) = (Σ xs, max_k Σ_{i<=k} x_i)``; ``h([]) = (0, -inf)``."""
    x = np.asarray(list(xs), dtype=np.float64)
    if x.size == 0:
        return (0.0, -math.inf)
    prefix = np.cumsum(x)
    return (float(prefix[-1]), float(prefix.max()))


def max_prefix_sum_left(state, x: float) -> tuple[float, float]:
    """``(s, b) ◁ x = (s + x, max(b, s + x))``."""
    s, b = state
    return (s + x, max(b, s + x))


def max_prefix_sum_right(x: float, state) -> tuple[float, float]:
    """``x ▷ (s, b) = (x + s, max(x, x + b))``."""
    s, b = state
    return (x + s, max(x, x + b))


def max_prefix_sum_weak_inverse(state) -> list[float]:
    """``g(s, b) = [b, s - b]`` (prefix sums ``b`` then ``s``, so ``h = (s, max(b, s)) = (s, b)``
    because ``b >= s`` on the image); ``g(0, -inf) = []``."""
    s, b = (float(v) for v in state)
    if b == -math.inf:
        return []
    return [b, s - b]


__all__ = ["derive_combine", "check_folds", "check_weak_inverse", "FoldReport",
           "online_softmax_batch", "online_softmax_left", "online_softmax_right",
           "online_softmax_weak_inverse", "max_prefix_sum_batch", "max_prefix_sum_left",
           "max_prefix_sum_right", "max_prefix_sum_weak_inverse"]
