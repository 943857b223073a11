"""The Third Homomorphism Theorem: combines read off a batch function and its weak inverse."""

import math

import numpy as np
import pytest

import flashfold as ff
from flashfold import ops
from flashfold.algebra.evaluate import numpy_monoid
from flashfold.algebra.homomorphism import (check_weak_inverse, max_prefix_sum_batch,
                                            max_prefix_sum_left, max_prefix_sum_right,
                                            max_prefix_sum_weak_inverse, online_softmax_batch,
                                            online_softmax_left, online_softmax_right,
                                            online_softmax_weak_inverse)
from flashfold.algebra.proofs import prove
from flashfold.monoids import LOGSUMEXP
from flashfold.testing import assert_close

import user_monoids as U

SOFTMAX_COMBINE = ff.derive_combine(online_softmax_batch, online_softmax_weak_inverse)
MPS_COMBINE = ff.derive_combine(max_prefix_sum_batch, max_prefix_sum_weak_inverse)


def scores(rng, n, masked=0.1):
    x = rng.normal(0.0, 3.0, size=n)
    x = np.where(rng.random(n) < 0.2, rng.integers(-2, 3, size=n).astype(float), x)   # ties
    x[rng.random(n) < masked] = -np.inf
    return x


def partition(rng, n):
    sizes, left = [], n
    while left > 0:
        s = int(min(left, rng.integers(0, 40)))
        sizes.append(s)
        left -= s
    return sizes


def split(x, sizes):
    out, start = [], 0
    for s in sizes:
        out.append(list(x[start:start + s]))
        start += s
    return out


def tree(combine, states):
    while len(states) > 1:
        nxt = [combine(states[i], states[i + 1]) for i in range(0, len(states) - 1, 2)]
        if len(states) % 2:
            nxt.append(states[-1])
        states = nxt
    return states[0]


def seq(combine, states):
    acc = states[0]
    for s in states[1:]:
        acc = combine(acc, s)
    return acc


def test_online_softmax_is_a_left_and_a_right_fold():
    report = ff.check_folds(online_softmax_batch, online_softmax_left, online_softmax_right,
                            trials=300)
    assert report.ok, str(report)
    assert check_weak_inverse(online_softmax_batch, online_softmax_weak_inverse, max_len=40).ok


def test_a_wrong_right_step_is_caught():
    wrong = lambda s, st: (max(st[0], s), st[1] + 1.0)   # noqa: E731 - forgets to rescale
    report = ff.check_folds(online_softmax_batch, online_softmax_left, wrong)
    assert not report.ok
    assert dict(report.checks)["left fold: h(xs + [x]) == left_step(h(xs), x)"]
    assert report.counterexample["equation"].startswith("h([x] + xs)")


def test_a_too_short_weak_inverse_is_caught():
    """Two scores carry d <= 2 at most: [m, m + log(d - 1)] is no inverse once d > 2."""
    def two(state):
        m, d = state
        return [] if m == -math.inf else ([m] if d <= 1 else [m, m + math.log(d - 1)])
    report = check_weak_inverse(online_softmax_batch, two)
    assert not report.ok and report.counterexample["h(xs)"][1] > 2


def test_derived_combine_reproduces_the_online_softmax_combine():
    """a ⊙ b = h(g(a) ++ g(b)) is the spec's (max, d_a e^(m_a-m) + d_b e^(m_b-m))."""
    rng = np.random.default_rng(0)
    ex = numpy_monoid(LOGSUMEXP)
    for _ in range(200):
        xs, ys = scores(rng, int(rng.integers(0, 30)), 0.2), scores(rng, int(rng.integers(0, 30)), 0.2)
        a, b = online_softmax_batch(xs), online_softmax_batch(ys)
        got = SOFTMAX_COMBINE(a, b)
        want = ex.combine((np.array(a[0]), np.array(a[1])), (np.array(b[0]), np.array(b[1])))
        assert got[0] == want[0]
        assert_close(got[1], want[1], "float64", scale=1.0 + want[1])
        whole = online_softmax_batch(list(xs) + list(ys))    # the homomorphism property
        assert got[0] == whole[0]
        assert_close(got[1], whole[1], "float64", scale=1.0 + whole[1])


@pytest.mark.parametrize("seed", range(4))
def test_derived_softmax_combine_agrees_with_the_builtin_on_random_partitions(seed):
    rng = np.random.default_rng(seed)
    x = scores(rng, 500)
    sizes = partition(rng, x.size)
    states = [online_softmax_batch(b) for b in split(x, sizes)]
    for name, fold in (("sequential", seq), ("tree", tree)):
        got = fold(SOFTMAX_COMBINE, states)
        want = ff.fold(LOGSUMEXP, x, name, blocks=sizes)
        assert got[0] == float(want.m), name
        assert_close(got[1], want.d, "float64", scale=1.0 + float(want.d), name=name)
        assert_close(got[1], online_softmax_batch(x)[1], "float64", scale=1.0 + float(want.d))


def test_derived_combine_of_an_all_masked_row_is_the_identity():
    e = online_softmax_batch([-np.inf, -np.inf])
    assert e == (-math.inf, 0.0)
    a = online_softmax_batch([1.0, 2.0])
    assert SOFTMAX_COMBINE(e, e) == e
    assert SOFTMAX_COMBINE(e, a) == a and SOFTMAX_COMBINE(a, e) == a


def test_max_prefix_sum_homomorphism():
    """Not a built-in: (sum, best prefix) from its folds and the inverse g(s, b) = [b, s - b]."""
    assert ff.check_folds(max_prefix_sum_batch, max_prefix_sum_left, max_prefix_sum_right).ok
    assert check_weak_inverse(max_prefix_sum_batch, max_prefix_sum_weak_inverse).ok
    rng = np.random.default_rng(5)
    ex = numpy_monoid(U.MAX_PREFIX_SUM)
    x = rng.normal(0.0, 2.0, size=300)
    sizes = partition(rng, x.size)
    blocks = [b for b in split(x, sizes)]
    states = [max_prefix_sum_batch(b) for b in blocks]
    for fold in (seq, tree):                              # order-preserving: not commutative
        got = fold(MPS_COMBINE, states)
        want = fold(lambda a, b: tuple(float(v) for v in ex.combine(
            tuple(np.array(v) for v in a), tuple(np.array(v) for v in b))), states)
        whole = ff.fold(U.MAX_PREFIX_SUM, x, "sequential")
        assert_close(np.array(got), np.array(want), "float64", scale=100.0)
        assert_close(got[1], whole.best, "float64", scale=100.0)


def _mps_h(xs):
    """The batch function over flashfold.ops: traceable for a list of fixed length."""
    s, best = 0.0, -ops.inf
    for x in xs:
        s = s + x
        best = ops.maximum(best, s)
    return s, best


def _mps_g(state):
    return [state.best, state.s - state.best]


def _adjoin_identity(combine, identity_best=-ops.inf):
    """The derived combine with the identity (0, -inf) adjoined: e ⊙ x = x ⊙ e = x."""
    def guarded(a, b):
        out = combine(a, b)
        a_e, b_e = a.best == identity_best, b.best == identity_best
        return tuple(ops.where(a_e, y, ops.where(b_e, x, o)) for x, y, o in zip(a, b, out))
    return guarded


def test_traced_derivation_is_proven_equal_to_the_hand_written_combine():
    """With h and a fixed-length g over flashfold.ops the derived combine traces into a
    Monoid: prove() shows it is one, and check_transport through the identity map shows it
    *is* MAX_PREFIX_SUM's combine (on reachable states, where best >= s)."""
    derived = ff.Monoid("mps_derived", fields=("s", "best"), identity=(0.0, -ops.inf),
                        inputs=U.MAX_PREFIX_SUM.inputs, lift=lambda x: (x, x),
                        combine=_adjoin_identity(ff.derive_combine(_mps_h, _mps_g)),
                        finalize=lambda st: st.best)
    proof = prove(derived)
    assert proof.ok, proof.text()
    same = ff.check_transport(derived, U.MAX_PREFIX_SUM, lambda st: (st.s, st.best))
    assert same.ok, same.text()
    x = np.random.default_rng(7).normal(size=100)
    assert ff.fold(derived, x, "tree").best == pytest.approx(ff.fold(U.MAX_PREFIX_SUM, x).best)


# --- polynomial evaluation: another non-built-in, with a variable-length inverse ----------

X0 = 1.5


def poly_h(cs):
    """(Horner value at X0, X0^len): h([c_0, ..., c_{n-1}]) = (Σ c_i X0^(n-1-i), X0^n)."""
    p = 0.0
    for c in cs:
        p = p * X0 + c
    return p, X0 ** len(cs)


def poly_left(state, c):
    p, q = state
    return p * X0 + c, q * X0


def poly_right(c, state):
    p, q = state
    return c * q + p, q * X0


def poly_g(state):
    p, q = state
    n = round(math.log(q) / math.log(X0))
    return [] if n == 0 else [0.0] * (n - 1) + [p]


def test_polynomial_evaluation_homomorphism():
    assert ff.check_folds(poly_h, poly_left, poly_right).ok
    assert check_weak_inverse(poly_h, poly_g, max_len=20).ok
    combine = ff.derive_combine(poly_h, poly_g)
    rng = np.random.default_rng(11)
    for _ in range(100):
        a = poly_h(list(rng.normal(size=int(rng.integers(0, 10)))))
        b = poly_h(list(rng.normal(size=int(rng.integers(0, 10)))))
        c = poly_h(list(rng.normal(size=int(rng.integers(0, 10)))))
        got = combine(a, b)
        assert_close(np.array(got), np.array((a[0] * b[1] + b[0], a[1] * b[1])), "float64",
                     scale=1.0 + abs(got[0]) + got[1])
        lhs, rhs = combine(combine(a, b), c), combine(a, combine(b, c))
        assert_close(np.array(lhs), np.array(rhs), "float64", scale=1.0 + abs(lhs[0]) + lhs[1])


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="h"):
        ff.derive_combine(1, online_softmax_weak_inverse)
    with pytest.raises(TypeError, match="weak_inverse"):
        ff.derive_combine(online_softmax_batch, None)
    with pytest.raises(TypeError, match="right_step"):
        ff.check_folds(online_softmax_batch, online_softmax_left, 3)
    with pytest.raises(ValueError, match="trials"):
        ff.check_folds(online_softmax_batch, online_softmax_left, online_softmax_right, trials=0)
    with pytest.raises(TypeError, match="elements"):
        ff.check_folds(online_softmax_batch, online_softmax_left, online_softmax_right, elements=5)
    with pytest.raises(ValueError, match="state"):
        online_softmax_weak_inverse((0.0, 0.5))


def test_a_nan_score_is_never_the_empty_state():
    """``h([nan]) = (nan, nan)`` (an all-NaN list is not "no score above -inf"), the folds
    keep a NaN (Python's ``max`` would drop it), and the derived combine carries it."""
    nan = float("nan")
    assert all(math.isnan(v) for v in online_softmax_batch([nan]))
    assert all(math.isnan(v) for v in online_softmax_batch([1.0, nan, 2.0]))
    assert all(math.isnan(v) for v in online_softmax_left((1.0, 1.0), nan))
    assert all(math.isnan(v) for v in online_softmax_right(nan, (1.0, 1.0)))
    merged = SOFTMAX_COMBINE(online_softmax_batch([nan]), online_softmax_batch([3.0]))
    assert all(math.isnan(v) for v in merged)
    assert online_softmax_batch([]) == online_softmax_batch([-math.inf]) == (-math.inf, 0.0)


def test_nan_on_both_sides_counts_as_agreement_in_check_folds():
    """A correct fold of NaN elements gives NaN on both sides; the comparison treats
    matching NaN as agreeing (only NaN against a number, or inf against -inf, is a
    mismatch), so a true statement is not reported FAILED."""
    def total(xs):
        return (math.fsum(xs) if xs else 0.0,)
    nan_elems = lambda rng, n: [float("nan")] * n                    # noqa: E731
    report = ff.check_folds(total, lambda s, x: (s[0] + x,), lambda x, s: (x + s[0],),
                            elements=nan_elems)
    assert report.ok, str(report)
    wrong = ff.check_folds(total, lambda s, x: (s[0] + x,), lambda x, s: (0.0,),
                           elements=nan_elems)
    assert not wrong.ok


def test_check_folds_names_bad_seed_elements_and_states():
    args = (online_softmax_batch, online_softmax_left, online_softmax_right)
    with pytest.raises(TypeError, match="seed"):
        ff.check_folds(*args, seed="x")
    with pytest.raises(ValueError, match="seed"):
        check_weak_inverse(online_softmax_batch, online_softmax_weak_inverse, seed=-1)
    with pytest.raises(ValueError, match=r"elements: asked for \d+ elements, returned 0"):
        ff.check_folds(*args, elements=lambda rng, n: [])
    with pytest.raises(TypeError, match="state"):
        ff.check_folds(lambda xs: "a", lambda s, x: "a", lambda x, s: "b")
