"""Example monoids a user would write: recurrences, weighted and bivariate statistics, top-2.

None of them is a built-in (:mod:`flashfold.monoids`); each is one :class:`Monoid` over
:mod:`flashfold.ops`, written as a user's own would be, with nothing backend-specific in
it. Nothing here registers itself: import the module and pass a monoid to ``fold``,
``scan``, ``check_laws``, ``prove`` or ``flashfold check flashfold.examples:NAME``.

=================  ========  =============================  =================  ====================
name               inputs    state (fields)                 identity           finalize
=================  ========  =============================  =================  ====================
LINEAR_RECURRENCE  (a, b)    (A, B): the map h -> A h + B   (1, 0)             h = B
EMA, ema(alpha)    x         (A, B) = (1 - alpha, alpha x)  (1, 0)             h = B
AFFINE_HALF        x         (a, b) = (0.5, x)              (1, 0)             (a, b)
WEIGHTED_MEAN      (w, x)    (sw, swx) = (sum w, sum w x)   (0, 0)             swx / sw
COVARIANCE         (x, y)    (n, mean_x, mean_y, c)         zeros              c / max(n - corr, 0)
CORRELATION        (x, y)    (n, means, mxx, myy, cxy)      zeros              cxy / sqrt(mxx myy)
TOP2               (x, pos)  (v1, i1, v2, i2)               (-inf, BIG) twice  (v1, i1, v2, i2)
=================  ========  =============================  =================  ====================

For the affine maps the state column shows the lift of one element. The math of each:

* **LINEAR_RECURRENCE**: ``h_t = a_t h_{t-1} + b_t`` from ``h_{-1} = 0``. An element is
  the affine map ``h -> a h + b``; composing the earlier map ``l`` with the later ``r``
  gives ``h -> r.A (l.A h + l.B) + r.B``, so ``l ⊕ r = (l.A r.A, r.A l.B + r.B)``, the
  identity map is ``(1, 0)``, and the fold of ``x_0..x_t`` applied to ``h_{-1} = 0`` is its
  ``B``: the scan gives every ``h_t``. Composition of maps is associative, not
  commutative.
* **EMA**: the exponential moving average ``h_t = (1 - alpha) h_{t-1} + alpha x_t`` from
  ``h_{-1} = 0``, the linear recurrence with ``a = 1 - alpha``, ``b = alpha x``
  (``h_t = alpha sum_{s <= t} (1 - alpha)^(t - s) x_s``; no bias correction). ``alpha``
  enters the lift, so it is fixed per monoid: ``ema(alpha)`` builds one, ``EMA`` is
  ``ema(0.1)``.
* **AFFINE_HALF**: the one-input affine map ``h -> 0.5 h + x``, composed as above: the
  fold of ``x_0..x_{n-1}`` is ``(0.5^n, sum_t 0.5^(n-1-t) x_t)``. Finalize is the state
  itself: ``b`` is ``h_{n-1}`` of ``h_t = 0.5 h_{t-1} + x_t``.
* **WEIGHTED_MEAN**: ``sum w x / sum w``; both sums are plain additions (commutative).
  Where ``sum w == 0`` (no elements, or weights cancelling) the mean is NaN, as torch's
  mean of nothing.
* **COVARIANCE**: Welford's state for two variables, ``c = sum (x - mean_x)(y - mean_y)``,
  merged by Chan, Golub and LeVeque's pairwise formula: with ``n = n_l + n_r``,
  ``w = n_r / n``, ``dx = mean_x_r - mean_x_l``, ``dy = mean_y_r - mean_y_l``:
  ``mean_x = mean_x_l + w dx``, ``mean_y = mean_y_l + w dy``,
  ``c = c_l + c_r + n_l w dx dy``. Finalize ``c / max(n - correction, 0)``
  (``correction = 1`` as ``torch.cov``): when ``n <= correction`` +-inf, or NaN where
  ``c = 0`` (as ``torch.cov``), and NaN when an input is infinite or NaN (the rule of
  WELFORD).
* **CORRELATION**: the same merge for ``mxx = sum (x - mean_x)^2``,
  ``myy = sum (y - mean_y)^2`` and ``cxy``; finalize Pearson's
  ``r = cxy / (sqrt(mxx) sqrt(myy))``, clipped to ``[-1, 1]`` as ``numpy.corrcoef``; NaN
  when a variable is constant (or fewer than 2 elements), or an input is infinite or NaN.
* **TOP2**: the largest and second-largest values with their positions, in the order of
  ARGMAX: NaN above every number, then larger values, among equal values the lower
  position. That order is total on (value, position) pairs, and the state is the best two
  of the elements seen; the combine takes the best two of the four pairs of its operands
  (each side sorted first, so any two pairs are a state), i.e. top-2 of a union, which is
  associative and commutative. ``BIG`` is :data:`flashfold.monoids.INDEX_IDENTITY`; with
  a single element the second place stays ``(-inf, BIG)``. ``check_laws`` holds it to all
  three laws; ``prove`` proves associativity and commutativity over every state (18672
  and 346 cases, minutes) and refutes the identity law on unsorted states, which no fold
  builds: its invariant of the reachable states (sign facts per field, order relations
  between finite fields) cannot say "``(v1, i1)`` comes first". On sorted states the
  identity law is proved (``tests/test_examples_monoids.py``).
"""

from __future__ import annotations

import numbers

from . import ops
from .algebra.monoid import Field, Input, Monoid
from .monoids import INDEX_IDENTITY

__all__ = ["LINEAR_RECURRENCE", "EMA", "ema", "AFFINE_HALF", "WEIGHTED_MEAN", "COVARIANCE",
           "CORRELATION", "TOP2", "EXAMPLES"]


# --- affine maps: linear recurrences ----------------------------------------------------

LINEAR_RECURRENCE = Monoid(
    "linear_recurrence", fields=("A", "B"), identity=(1.0, 0.0),
    inputs=(Input("a", domain="finite"), Input("b", domain="finite")),
    lift=lambda a, b: (a, b),
    combine=lambda l, r: (l.A * r.A, r.A * l.B + r.B),
    finalize=lambda s: s.B,
    commutative=False, outputs=("h",),
    doc="First-order linear recurrence h_t = a_t h_{t-1} + b_t from h_{-1} = 0, as the "
        "composition of the affine maps h -> a h + b (earlier map first): associative, "
        "not commutative; a scan gives every h_t.")


def ema(alpha: float = 0.1) -> Monoid:
    """The exponential moving average ``h_t = (1 - alpha) h_{t-1} + alpha x_t`` from
    ``h_{-1} = 0`` as a monoid (the linear recurrence with ``a = 1 - alpha``,
    ``b = alpha x``); ``0 < alpha <= 1``. ``alpha`` is a constant of the lift, so each
    value is its own monoid."""
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):     # NumPy scalars too
        raise TypeError(f"alpha: expected a number in (0, 1], got {alpha!r}")
    alpha = float(alpha)
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha: expected a number in (0, 1], got {alpha!r}")
    decay = 1.0 - alpha
    return Monoid(
        "ema", fields=("A", "B"), identity=(1.0, 0.0),
        inputs=(Input("x", domain="finite"),),
        lift=lambda x: (decay, alpha * x),
        combine=lambda l, r: (l.A * r.A, r.A * l.B + r.B),
        finalize=lambda s: s.B,
        commutative=False, outputs=("ema",),
        doc=f"Exponential moving average h_t = (1 - alpha) h_{{t-1}} + alpha x_t from "
            f"h_{{-1}} = 0, alpha = {alpha!r}: the linear recurrence with a = 1 - alpha, "
            f"b = alpha x (no bias correction); not commutative.")


EMA = ema(0.1)

AFFINE_HALF = Monoid(
    "affine_half", fields=("a", "b"), identity=(1.0, 0.0),
    inputs=(Input("x", domain="finite"),),
    lift=lambda x: (0.5, x),
    combine=lambda l, r: (l.a * r.a, r.a * l.b + r.b),
    commutative=False,
    doc="Composition of the affine maps h -> 0.5 h + x (earlier map first): the fold of "
        "x_0..x_{n-1} is (0.5^n, sum_t 0.5^(n-1-t) x_t); associative, not commutative.")


# --- weighted mean ----------------------------------------------------------------------

def _weighted_mean_finalize(s):
    empty = s.sw == 0.0
    # 0 * inf: NaN where the weights sum to zero (no NaN constant can be traced)
    return ops.where(empty, s.sw * ops.inf, s.swx / ops.where(empty, 1.0, s.sw))


WEIGHTED_MEAN = Monoid(
    "weighted_mean", fields=("sw", "swx"), identity=(0.0, 0.0),
    inputs=(Input("w", domain="finite"), Input("x", domain="finite")),
    lift=lambda w, x: (w, w * x),
    combine=lambda l, r: (l.sw + r.sw, l.swx + r.swx),
    finalize=_weighted_mean_finalize,
    commutative=True, outputs=("mean",),
    doc="Weighted mean sum(w x) / sum(w) from the two sums; NaN where sum(w) == 0 (no "
        "elements, or weights that cancel), as torch's mean of nothing.")


# --- covariance and correlation: Chan's pairwise merge ----------------------------------

def _chan_weights(l, r):
    """``(n, w = n_r / n (0 when empty), dx, dy, n_l w)`` of Chan's merge."""
    n = l.n + r.n
    w = ops.where(n > 0.0, r.n / ops.where(n > 0.0, n, 1.0), 0.0)
    return n, w, r.mean_x - l.mean_x, r.mean_y - l.mean_y, l.n * w


def _cov_combine(l, r):
    n, w, dx, dy, lw = _chan_weights(l, r)
    return n, l.mean_x + dx * w, l.mean_y + dy * w, l.c + r.c + dx * (dy * lw)


def _nonfinite(s):
    """NaN exactly where a mean is infinite or NaN (an infinite or NaN input), else 0."""
    return (s.mean_x - s.mean_x) + (s.mean_y - s.mean_y)


def _cov_finalize(s, correction):
    bad = _nonfinite(s)
    return ops.where(ops.isnan(bad), bad, s.c / ops.maximum(s.n - correction, 0.0))


COVARIANCE = Monoid(
    "covariance", fields=("n", "mean_x", "mean_y", "c"), identity=(0.0, 0.0, 0.0, 0.0),
    inputs=(Input("x", domain="finite"), Input("y", domain="finite")),
    lift=lambda x, y: (1.0, x, y, 0.0),
    combine=_cov_combine,
    finalize=_cov_finalize,
    params={"correction": 1.0},
    commutative=True, outputs=("cov",),
    doc="Covariance of (x, y) pairs from n, the means and c = sum (x - mean_x)(y - mean_y), "
        "merged by Chan's pairwise formula; finalize c / (n - correction) (correction 1 as "
        "torch.cov; when n <= correction +-inf, or NaN where c = 0, as torch.cov; NaN when "
        "an input is infinite or NaN).")


def _corr_combine(l, r):
    n, w, dx, dy, lw = _chan_weights(l, r)
    return (n, l.mean_x + dx * w, l.mean_y + dy * w, l.mxx + r.mxx + dx * (dx * lw),
            l.myy + r.myy + dy * (dy * lw), l.cxy + r.cxy + dx * (dy * lw))


def _corr_finalize(s):
    bad = _nonfinite(s)
    r = ops.clamp(s.cxy / (ops.sqrt(s.mxx) * ops.sqrt(s.myy)), -1.0, 1.0)
    return ops.where(ops.isnan(bad), bad, r)


CORRELATION = Monoid(
    "correlation", fields=("n", "mean_x", "mean_y", "mxx", "myy", "cxy"),
    identity=(0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
    inputs=(Input("x", domain="finite"), Input("y", domain="finite")),
    lift=lambda x, y: (1.0, x, y, 0.0, 0.0, 0.0),
    combine=_corr_combine,
    finalize=_corr_finalize,
    commutative=True, outputs=("r",),
    doc="Pearson correlation of (x, y) pairs from n, the means, the sums of squared "
        "deviations mxx, myy and the co-deviation cxy, merged by Chan's pairwise formula; "
        "finalize cxy / sqrt(mxx myy) clipped to [-1, 1] (NaN when a variable is constant, "
        "for fewer than 2 pairs, and when an input is infinite or NaN).")


# --- top-2 with positions -----------------------------------------------------------------

def _beats(pv, pi, qv, qi):
    """Whether ``(pv, pi)`` comes before ``(qv, qi)``: NaN first (the lower position among
    NaNs), then the larger value, among equal values the lower position (ARGMAX's order)."""
    first = pi < qi
    return ops.where(ops.isnan(qv), ops.isnan(pv) & first,
                     ops.isnan(pv) | (pv > qv) | ((pv == qv) & first))


def _sorted(v1, i1, v2, i2):
    """Two pairs, the first of them (by :func:`_beats`) first."""
    s = _beats(v2, i2, v1, i1)
    return ((ops.where(s, v2, v1), ops.where(s, i2, i1)),
            (ops.where(s, v1, v2), ops.where(s, i1, i2)))


def _top2_combine(l, r):
    # each side sorted first (a state built by the fold already is): the combine is then
    # the top 2 of the union of any two pairs of pairs, associative as it stands
    (a1v, a1i), (a2v, a2i) = _sorted(l.v1, l.i1, l.v2, l.i2)
    (b1v, b1i), (b2v, b2i) = _sorted(r.v1, r.i1, r.v2, r.i2)
    p = _beats(a1v, a1i, b1v, b1i)                       # the left side's best is first
    # the runner-up: the loser of the match for first place, or the winner's own second
    ov, oi = ops.where(p, b1v, a1v), ops.where(p, b1i, a1i)
    cv, ci = ops.where(p, a2v, b2v), ops.where(p, a2i, b2i)
    q = _beats(ov, oi, cv, ci)
    return (ops.where(p, a1v, b1v), ops.where(p, a1i, b1i),
            ops.where(q, ov, cv), ops.where(q, oi, ci))


TOP2 = Monoid(
    "top2", fields=("v1", Field("i1", dtype="int"), "v2", Field("i2", dtype="int")),
    identity=(-ops.inf, INDEX_IDENTITY, -ops.inf, INDEX_IDENTITY),
    inputs=(Input("x"), Input("pos", domain="position")),
    lift=lambda x, pos: (x, pos, -ops.inf, INDEX_IDENTITY),
    combine=_top2_combine,
    finalize=lambda s: (s.v1, s.i1, s.v2, s.i2),
    commutative=True, outputs=("value1", "index1", "value2", "index2"),
    doc="The two largest values and their positions; among equal values the lower position "
        "comes first, and NaN counts as larger than every number (as torch.argmax and "
        "torch.topk). With one element the second place is (-inf, INDEX_IDENTITY).")


EXAMPLES = (LINEAR_RECURRENCE, EMA, AFFINE_HALF, WEIGHTED_MEAN, COVARIANCE, CORRELATION, TOP2)
