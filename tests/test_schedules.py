"""Every schedule and every partition gives the same result; scans equal prefix folds.

Property tests (hypothesis) over every built-in and the user monoids of the tests.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flashfold as ff
from flashfold.algebra.laws import sample_inputs
from flashfold.monoids import ATTENTION, BUILTINS, INDEX_IDENTITY, LOGSUMEXP, MAX, SUM
from flashfold.schedules import SCHEDULES
from flashfold.testing import assert_close

import user_monoids as U

ALL = BUILTINS + (U.MINMAX, U.MATMUL2, U.MAX_PREFIX_SUM)
EXACT = {"max", "min", "argmax", "argmin", "minmax"}


def make_inputs(monoid, rng, n, batch=(), width=3):
    xs = []
    for inp in monoid.inputs:
        if inp.domain == "position":
            continue
        shape = (n, *batch, width) if inp.vector else (n, *batch)
        if monoid is U.MATMUL2:      # keep products of many matrices in range
            xs.append(rng.normal(0.0, 0.5, size=shape))
        else:
            xs.append(sample_inputs(inp.domain, rng, shape))
    return xs[0] if len(xs) == 1 else tuple(xs)


def scale_of(monoid, xs, n):
    """Magnitude of the terms each output accumulates (for the float64 tolerance)."""
    x = np.asarray(xs[0] if isinstance(xs, tuple) else xs)
    big = float(np.max(np.abs(x[np.isfinite(x)]), initial=1.0))
    if monoid.name in ("welford",):
        return max(1.0, n * big * big)
    if monoid.name == "matmul2":
        return float(np.prod(1.0 + np.abs(x).max(initial=0.0)) ** 2) * max(n, 1) * 10
    if monoid.name == "attention":
        return max(1.0, n * float(np.max(np.abs(xs[1]), initial=1.0)))
    return max(1.0, n * big)


def results(monoid, state):
    out = ff.finalize(monoid, state)
    return out if isinstance(out, tuple) else (out,)


def check_same(monoid, got, want, scale, name):
    for g, w in zip(results(monoid, got), results(monoid, want)):
        if monoid.name in EXACT:
            np.testing.assert_array_equal(g, w, err_msg=name)
        else:
            assert_close(g, w, "float64", scale=scale, name=name)


@st.composite
def partitions(draw, n):
    sizes, left = [], n
    while left > 0:
        s = draw(st.integers(0, left))
        sizes.append(s)
        left -= s
        if draw(st.booleans()):
            sizes.append(0)            # empty blocks are allowed anywhere
    return sizes


@pytest.mark.parametrize("monoid", ALL, ids=lambda m: m.name)
@given(data=st.data())
def test_every_schedule_and_partition_agrees(monoid, data):
    n = data.draw(st.integers(0, 40), label="n")
    batch = data.draw(st.sampled_from([(), (3,), (2, 2)]), label="batch")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    xs = make_inputs(monoid, rng, n, batch)
    ref = ff.fold(monoid, xs, "sequential")
    scale = scale_of(monoid, xs, n)
    blocks = data.draw(partitions(n), label="blocks")
    for schedule in SCHEDULES:
        if schedule == "shuffled" and not monoid.commutative:
            continue
        for b in (None, blocks):
            got = ff.fold(monoid, xs, schedule, blocks=b, seed=data.draw(st.integers(0, 9)))
            check_same(monoid, got, ref, scale, f"{monoid.name}/{schedule}/blocks={b}")


@pytest.mark.parametrize("monoid", ALL, ids=lambda m: m.name)
@given(data=st.data())
def test_scan_equals_prefix_folds(monoid, data):
    n = data.draw(st.integers(0, 33), label="n")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    xs = make_inputs(monoid, rng, n, (2,))
    scale = scale_of(monoid, xs, n)
    inclusive = data.draw(st.booleans(), label="inclusive")
    reverse = data.draw(st.booleans(), label="reverse")
    states = ff.scan(monoid, xs, inclusive=inclusive, reverse=reverse)
    assert states[0].shape[0] == n
    sl = (lambda a, i, j: tuple(x[i:j] for x in a)) if isinstance(xs, tuple) else (lambda a, i, j: a[i:j])
    for i in range(n):
        if reverse:
            lo, hi = (i, n) if inclusive else (i + 1, n)
        else:
            lo, hi = (0, i + 1) if inclusive else (0, i)
        want = ff.fold(monoid, sl(xs, lo, hi))
        if "i" in monoid.field_names and lo:   # positions of a slice start at 0, not lo
            want = want._replace(i=np.where(want.i == INDEX_IDENTITY, want.i, want.i + lo))
        got = monoid.State(*(x[i] for x in states))
        check_same(monoid, got, want, scale, f"{monoid.name} prefix {i}")


@pytest.mark.parametrize("monoid", [m for m in ALL if m.inputs[0].domain == "extended"],
                         ids=lambda m: m.name)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_all_masked_rows_give_no_nan(monoid, schedule):
    n = 7
    xs = make_inputs(monoid, np.random.default_rng(0), n, (2,))
    if isinstance(xs, tuple):
        xs = (np.full_like(xs[0], -np.inf),) + xs[1:]
    else:
        xs = np.full_like(xs, -np.inf)
    for b in (None, [3, 0, 1, 3]):
        state = ff.fold(monoid, xs, schedule, blocks=b)
        for f in state:
            assert not np.isnan(f).any()
        for r in results(monoid, state):
            assert not np.isnan(np.asarray(r, dtype=float)).any()


def test_fully_masked_attention_row_is_zero_with_lse_minus_inf():
    out, lse = ff.finalize(ATTENTION, ff.fold(ATTENTION, (np.full(5, -np.inf), np.ones((5, 4)))))
    assert np.array_equal(out, np.zeros(4)) and lse == -np.inf


def test_empty_input_is_the_identity():
    for monoid in (SUM, MAX, LOGSUMEXP):
        st0 = ff.fold(monoid, np.zeros((0, 2)))
        for f, e in zip(st0, monoid.identity):
            assert np.array_equal(f, np.full(2, e))
    assert ff.finalize(LOGSUMEXP, ff.fold(LOGSUMEXP, np.zeros(0))) == -np.inf


def test_identity_laws_hold_exactly_for_every_builtin():
    from flashfold.algebra import numpy_monoid
    from flashfold.algebra.laws import random_states
    for monoid in BUILTINS:
        ex = numpy_monoid(monoid)
        s, _, _ = random_states(monoid, np.random.default_rng(5), 500)
        e = ex.identity((500,), 3)
        for got in (ex.combine(e, s), ex.combine(s, e)):
            for g, w in zip(got, s):
                assert np.array_equal(g, w), monoid.name


def test_non_commutative_monoids_keep_order():
    rng = np.random.default_rng(0)
    x = rng.normal(size=16)
    want = np.eye(2)
    for v in x:
        want = want @ np.array([[1.0 + v * v, v], [v, 1.0]])
    backwards = np.eye(2)
    for v in x[::-1]:
        backwards = backwards @ np.array([[1.0 + v * v, v], [v, 1.0]])
    assert np.abs(backwards - want).max() > 1e-3 * np.abs(want).max()   # order matters
    for schedule in ("sequential", "reversed", "tree", "blocks"):
        st_ = ff.fold(U.MATMUL2, x, schedule, blocks=[5, 0, 1, 10])
        got = np.array([[st_.a, st_.b], [st_.c, st_.d]])
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="schedule.*commutative"):
        ff.fold(U.MATMUL2, x, "shuffled")


def test_argmax_ties_resolve_to_lowest_index_in_every_schedule():
    from flashfold.monoids import ARGMAX, ARGMIN
    x = np.array([1.0, 3.0, -np.inf, 3.0, 0.0, 3.0])
    for schedule in SCHEDULES:
        for b in (None, [1, 2, 0, 3]):
            v, i = ff.finalize(ARGMAX, ff.fold(ARGMAX, x, schedule, blocks=b, seed=4))
            assert (v, i) == (3.0, 1)
            v, i = ff.finalize(ARGMIN, ff.fold(ARGMIN, x, schedule, blocks=b, seed=4))
            assert (v, i) == (-np.inf, 2)
    v, i = ff.finalize(ARGMAX, ff.fold(ARGMAX, np.full(4, -np.inf), "tree"))
    assert i == 0


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_fold_returns_arrays_for_every_length(schedule):
    """fold documents arrays of shape ``batch``; one element used to come back as a
    NumPy scalar (``np.float64``) from the sequential and tree schedules."""
    for n in (0, 1, 2, 5):
        state = ff.fold(LOGSUMEXP, np.arange(float(n)), schedule)
        assert all(isinstance(x, np.ndarray) and x.shape == () for x in state), (n, state)
