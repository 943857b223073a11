"""Built-in monoids, each written once over :mod:`flashfold.ops`.

Every built-in handles its identity and fully masked inputs (scores of ``-inf``) without
NaN: where a rescale would compute ``exp(-inf - (-inf))`` the pivot is kept finite
(``pivot = where(isinf(m), 0, m)``), exactly as the specification's merge guards the
"both blocks fully masked" case.

===========  ==========================  ===================  ===============================
name         state (fields)              identity             finalize
===========  ==========================  ===================  ===============================
SUM          s                           0                    s
MAX / MIN    m                           -inf / +inf          m
LOGSUMEXP    (m, d): max, sum e^(x-m)    (-inf, 0)            m + log d
LOGSUMEXP2   (m, d) base 2 (see below)   (-inf, 0)            (m + log2 d) · ln 2
ATTENTION    (m, d, o[d]) over (s, v)    (-inf, 0, 0)         (o / d, m + log d)
ATTENTION2   (m, d, o[d]) base 2         (-inf, 0, 0)         (o / d, (m + log2 d) · ln 2)
WELFORD      (n, mean, M2)               (0, 0, 0)            (mean, M2 / max(n - corr, 0))
ARGMAX/MIN   (value, index)              (-inf, BIG)          (value, index)
===========  ==========================  ===================  ===============================

LOGSUMEXP2 is the base-2 twist of the specification: scores are rescaled by log2(e) on
lift (an affine bijection, so the reduction stays associative) and every exponential is
``exp2``; finalize converts back to natural-log units. Kernels use it because ``exp2`` is
the hardware instruction. It is derived from LOGSUMEXP by transport of structure through
psi(m, d) = (m log2 e, d) (:func:`flashfold.transport`): lift and identity come from psi,
the combine and block lift are the exp2 rewritings that ``check_transport`` proves equal.
ATTENTION2 is ATTENTION's base-2 twist by the same psi, extended by the identity on ``o``.
"""

from __future__ import annotations

from .algebra import ops
from .algebra.monoid import Field, Input, Monoid
from .algebra.transport import base2_rescale, base2_rescale_inverse, transport

#: index carried by the ARGMAX/ARGMIN identity: larger than any real position, and
#: representable in int32 so kernels can keep indices in 32-bit registers.
INDEX_IDENTITY = 2**31 - 1


def _pivot(m):
    """A finite reference point for rescaling: ``m`` itself unless it is infinite."""
    return ops.where(ops.isinf(m), 0.0, m)


# --- plain monoids ------------------------------------------------------------------

SUM = Monoid(
    "sum", fields=("s",), identity=(0.0,),
    lift=lambda x: (x,),
    combine=lambda a, b: (a.s + b.s,),
    finalize=lambda s: s.s,
    block_lift=lambda x, valid: (ops.reduce_sum(ops.where(valid, x, 0.0)),),
    commutative=True, outputs=("sum",),
    doc="Sum of the elements; identity 0.")

MAX = Monoid(
    "max", fields=("m",), identity=(-ops.inf,),
    lift=lambda x: (x,),
    combine=lambda a, b: (ops.maximum(a.m, b.m),),
    finalize=lambda s: s.m,
    block_lift=lambda x, valid: (ops.reduce_max(ops.where(valid, x, -ops.inf)),),
    commutative=True, outputs=("max",),
    doc="Maximum of the elements; identity -inf.")

MIN = Monoid(
    "min", fields=("m",), identity=(ops.inf,),
    lift=lambda x: (x,),
    combine=lambda a, b: (ops.minimum(a.m, b.m),),
    finalize=lambda s: s.m,
    block_lift=lambda x, valid: (ops.reduce_min(ops.where(valid, x, ops.inf)),),
    commutative=True, outputs=("min",),
    doc="Minimum of the elements; identity +inf.")


# --- online softmax: (m, d) -----------------------------------------------------------

def _lse_lift(x):
    return x, ops.where(x > -ops.inf, 1.0, 0.0)


def _lse_combine(a, b, exp=ops.exp):
    m = ops.maximum(a.m, b.m)
    p = _pivot(m)
    return m, a.d * exp(a.m - p) + b.d * exp(b.m - p)


def _lse_block(x, valid, exp=ops.exp):
    xm = ops.where(valid, x, -ops.inf)
    m = ops.reduce_max(xm)
    return m, ops.reduce_sum(exp(xm - _pivot(m)))


def _lse_block_scan(x, valid, exp=ops.exp):
    """Prefix states of a block, all referred to the block's max ``M`` (the twist once
    per block): ``(M, sum_{j <= i} exp(x_j - M))``, one exponential and one addition per
    element instead of a rescaling combine."""
    xm = ops.where(valid, x, -ops.inf)
    m = ops.reduce_max(xm)
    return m, ops.scan_sum(exp(xm - _pivot(m)))


#: below this ``d`` a block-scan state may have lost digits: ``d`` sums terms referred to
#: a max far above the prefix's own, and terms (or a carry) under 2^-126 underflow. With
#: d >= 2^-60 what underflowed is < (block + carry count) 2^-126 <= 2^32 2^-126, i.e. a
#: relative 2^-34 of d, below float32 rounding.
LSE_SCAN_MIN_D = 2.0 ** -60


def _lse_scan_exact(s):
    """A block-scan state is exact when empty (``m = -inf``, ``d = 0`` exactly), or when
    ``m`` is finite and ``d`` is not small enough to have lost digits to underflow.
    ``+inf`` and NaN maxima (``inf - inf`` in the rescale) rescan the block with the
    combine, which handles them."""
    return (s.m == -ops.inf) | ((s.m < ops.inf) & (s.d >= LSE_SCAN_MIN_D))


LOGSUMEXP = Monoid(
    "logsumexp", fields=("m", "d"), identity=(-ops.inf, 0.0),
    lift=_lse_lift,
    combine=_lse_combine,
    finalize=lambda s: s.m + ops.log(s.d),
    block_lift=_lse_block, block_scan=_lse_block_scan, scan_exact=_lse_scan_exact,
    commutative=True, outputs=("lse",),
    doc="Online softmax state: m = max x, d = sum exp(x - m); finalize to log-sum-exp. "
        "(m, d) is the direct product (max, +) twisted by e^-m.")

# derived by transport of structure: psi(m, d) = (m log2 e, d) carries LOGSUMEXP onto the
# base-2 state; lift and identity are psi's, the combine and block lift are its exp2
# rewritings (proven equal to the transported ones by check_transport, tests/test_transport.py)
LOGSUMEXP2 = transport(
    LOGSUMEXP, base2_rescale, base2_rescale_inverse, name="logsumexp2",
    combine=lambda a, b: _lse_combine(a, b, exp=ops.exp2),
    finalize=lambda s: (s.m + ops.log2(s.d)) * ops.LN2,
    block_lift=lambda x, valid: _lse_block(x * ops.LOG2E, valid, exp=ops.exp2),
    block_scan=lambda x, valid: _lse_block_scan(x * ops.LOG2E, valid, exp=ops.exp2),
    outputs=("lse",),
    doc="Base-2 online softmax: sigma = x log2(e), m = max sigma, d = sum 2^(sigma - m); "
        "finalize to the natural-log log-sum-exp.")


# --- attention: (m, d, o) over (score, value) pairs -----------------------------------
#
# The non-finite rule (stated for users in :mod:`flashfold.api.attention`): a NaN or +inf
# score makes the state NaN (m = NaN, or d = NaN from the +inf - +inf of the rescale), a
# -inf score is weight 0, and finalize reads "empty" from m = -inf alone, so a NaN never
# finalizes to the empty row (0, -inf). Values enter only through d-weighted sums, and
# never where the score is -inf (lift and block lift select them away): an invisible
# value contributes nothing, whatever it holds.

def _attn_pivot(m):
    """The rescale reference point: ``m`` itself, 0 for an empty state. Unlike
    :func:`_pivot`, ``+inf`` stays ``+inf``: ``exp(+inf - +inf)`` is NaN, so a ``+inf``
    score makes the state NaN instead of an infinite ``d``."""
    return ops.where(m == -ops.inf, 0.0, m)


def _attn_lift(s, v):
    live = s > -ops.inf
    return s, ops.where(live, 1.0, 0.0), ops.where(live, v, 0.0)


def _attn_combine(a, b, exp=ops.exp):
    m = ops.maximum(a.m, b.m)
    p = _attn_pivot(m)
    sa, sb = exp(a.m - p), exp(b.m - p)             # exp(-inf) = 0 for an empty side
    return m, a.d * sa + b.d * sb, a.o * sa + b.o * sb


def _attn_finalize(s, log=ops.log, to_natural=1.0):
    """``(o / d, lse)`` with ``lse = (m + log d) * to_natural``: ``(0, -inf)`` when empty,
    ``(NaN, NaN)`` when ``m = +inf``. That state is only ever a lone ``+inf`` score's lift
    ``(+inf, 1, v)`` (a row of one key, a scan's first prefix): every combine and the
    block lift make it NaN, so ``d`` is read as NaN (``m - m``) there too."""
    empty = s.m == -ops.inf
    d = ops.where(s.m == ops.inf, s.m - s.m, s.d)
    return (ops.where(empty, 0.0, s.o / ops.where(empty, 1.0, d)),
            (s.m + log(d)) * to_natural)


def _attn_block(s, v, valid, exp=ops.exp):
    sm = ops.where(valid, s, -ops.inf)
    m = ops.reduce_max(sm)
    p = exp(sm - _attn_pivot(m))
    d = ops.reduce_sum(p)
    # a NaN score is a NaN d even where the max ignores NaN (tl.max on the GPU): carry it
    # into m, which finalize reads
    return (ops.where(ops.isnan(d), d, m), d,
            ops.reduce_sum(ops.where(sm > -ops.inf, p * v, 0.0)))


ATTENTION = Monoid(
    "attention", fields=("m", "d", Field("o", vector=True)), identity=(-ops.inf, 0.0, 0.0),
    inputs=(Input("score"), Input("value", vector=True, domain="finite")),
    lift=_attn_lift,
    combine=_attn_combine,
    finalize=_attn_finalize,
    block_lift=_attn_block,
    commutative=True, outputs=("out", "lse"),
    doc="FlashAttention's state over (score, value) pairs: m = max s, d = sum e^(s-m), "
        "o = sum e^(s-m) v; finalize to (o / d, m + log d). A row with no visible key "
        "(m = -inf) finalizes to (0, -inf); a NaN or +inf score to (NaN, NaN); a value "
        "with score -inf contributes nothing, whatever it holds.")


# derived by transport of structure, as LOGSUMEXP2: psi(m, d, o) = (m log2 e, d, o). The
# scores stay in natural units at the inputs; the lift and the block lift multiply them by
# log2 e (which a kernel folds into its score scale), and every exponential is exp2. The
# rewritten combine, block lift and finalize are proven equal to the transported ones by
# check_transport (tests/test_transport.py)
ATTENTION2 = transport(
    ATTENTION, base2_rescale, base2_rescale_inverse, name="attention2",
    lift=lambda s, v: _attn_lift(s * ops.LOG2E, v),
    combine=lambda a, b: _attn_combine(a, b, exp=ops.exp2),
    finalize=lambda s: _attn_finalize(s, log=ops.log2, to_natural=ops.LN2),
    block_lift=lambda s, v, valid: _attn_block(s * ops.LOG2E, v, valid, exp=ops.exp2),
    outputs=("out", "lse"),
    doc="Base-2 attention state: sigma = s log2(e), m = max sigma, d = sum 2^(sigma - m), "
        "o = sum 2^(sigma - m) v; finalize to (o / d, (m + log2 d) ln 2), the natural-log "
        "LSE. The same non-finite rule as ATTENTION (empty iff m = -inf).")

# --- Welford: (n, mean, M2) ----------------------------------------------------------

def _welford_combine(a, b):
    n = a.n + b.n
    w = ops.where(n > 0.0, b.n / ops.where(n > 0.0, n, 1.0), 0.0)   # n_b / n, 0 if empty
    delta = b.mean - a.mean
    # finite means further apart than the largest float (3e38 and -3e38 in float32): delta
    # is infinite, a.mean + delta w would be too; the weighted mean of the two never
    # overflows (M2 is then infinite, as the variance is)
    mean = ops.where(ops.isinf(delta), a.mean * (1.0 - w) + b.mean * w, a.mean + delta * w)
    return n, mean, a.m2 + b.m2 + delta * (delta * (a.n * w))


def _welford_block(x, valid):
    n = ops.reduce_sum(ops.where(valid, 1.0, 0.0))
    # the mean as a sum of x / n: its partial sums stay within the elements' range, where
    # the sum of the elements overflows for finite ones near the largest float
    inv = 1.0 / ops.maximum(n, 1.0)
    mean = ops.reduce_sum(ops.where(valid, x * inv, 0.0))
    dev = ops.where(valid, x - mean, 0.0)
    return n, mean, ops.reduce_sum(dev * dev)


WELFORD = Monoid(
    "welford", fields=("n", "mean", "m2"), identity=(0.0, 0.0, 0.0),
    inputs=(Input("x", domain="finite"),),
    lift=lambda x: (1.0, x, 0.0),
    combine=_welford_combine,
    # a non-finite mean (an infinite or NaN input) makes the variance NaN, as torch:
    # M2 alone can be inf there ([1, inf, 3]); mean - mean is NaN exactly then
    finalize=lambda s, correction: (
        s.mean, ops.where(ops.isinf(s.mean) | ops.isnan(s.mean), s.mean - s.mean,
                          s.m2 / ops.maximum(s.n - correction, 0.0))),
    params={"correction": 0.0},
    block_lift=_welford_block,
    commutative=True, outputs=("mean", "var"),
    doc="Welford / Chan-Golub-LeVeque: n, mean, M2 = sum (x - mean)^2; finalize to mean "
        "and M2 / max(n - correction, 0) (when n <= correction: inf, or NaN where M2 = 0, "
        "as in torch and NumPy; NaN when an input is infinite or NaN, as in torch). "
        "(n, mean, M2) is (sum 1, sum x, sum x^2) twisted by (n, T/n, W - T^2/n).")


# --- argmax / argmin: (value, index), ties to the lowest index ------------------------

def _arg_combine(better):
    def combine(a, b):
        a_nan, b_nan = ops.isnan(a.v), ops.isnan(b.v)
        first = b.i < a.i
        # NaN beats every number (as torch.argmax/argmin); among equals the lowest index
        b_wins = ops.where(a_nan, b_nan & first,
                           b_nan | better(b.v, a.v) | ((b.v == a.v) & first))
        return ops.where(b_wins, b.v, a.v), ops.where(b_wins, b.i, a.i)
    return combine


ARGMAX = Monoid(
    "argmax", fields=("v", Field("i", dtype="int")), identity=(-ops.inf, INDEX_IDENTITY),
    inputs=(Input("x"), Input("pos", domain="position")),
    lift=lambda x, pos: (x, pos),
    combine=_arg_combine(lambda b, a: b > a),
    finalize=lambda s: (s.v, s.i),
    commutative=True, outputs=("value", "index"),
    doc="Largest value and its position; ties resolve to the lowest index (so the "
        "combine is a lexicographic max: associative and commutative); NaN counts as "
        "the largest value, as in torch.argmax.")

ARGMIN = Monoid(
    "argmin", fields=("v", Field("i", dtype="int")), identity=(ops.inf, INDEX_IDENTITY),
    inputs=(Input("x"), Input("pos", domain="position")),
    lift=lambda x, pos: (x, pos),
    combine=_arg_combine(lambda b, a: b < a),
    finalize=lambda s: (s.v, s.i),
    commutative=True, outputs=("value", "index"),
    doc="Smallest value and its position; ties resolve to the lowest index; NaN wins, "
        "as in torch.argmin.")


BUILTINS = (SUM, MAX, MIN, LOGSUMEXP, LOGSUMEXP2, ATTENTION, ATTENTION2, WELFORD, ARGMAX,
            ARGMIN)

__all__ = ["SUM", "MAX", "MIN", "LOGSUMEXP", "LOGSUMEXP2", "ATTENTION", "ATTENTION2", "WELFORD",
           "ARGMAX", "ARGMIN", "BUILTINS", "INDEX_IDENTITY"]
