"""The example monoids of :mod:`flashfold.examples`: their laws (random and symbolic), and
each one's folds and scans on every CPU schedule against a float64 closed form (NumPy /
torch), with the tolerance table of :mod:`flashfold.algebra.tolerances`."""

import dataclasses
import os

import numpy as np
import pytest
import torch

import flashfold as ff
from flashfold import examples as E
from flashfold.algebra.evaluate import numpy_monoid
from flashfold.algebra.proofs import (StateSymbols, check_equal_on_paths, explore, prove,
                                      reachable_domains, sympy_function)
from flashfold.cli import main
from flashfold.monoids import INDEX_IDENTITY
from flashfold.testing import assert_close

N = 97
BLOCKS = (10, 1, 0, 33, 2, 51)                      # uneven, with a length-1 and an empty block
ORDERED = [("sequential", None), ("reversed", None), ("tree", None), ("sequential", BLOCKS),
           ("tree", BLOCKS)]
ANY_ORDER = ORDERED + [("shuffled", None)]


def schedules(monoid):
    return ANY_ORDER if monoid.commutative else ORDERED


def folds(monoid, xs, **params):
    """``(schedule label, finalized result)`` of the fold on every schedule ``monoid``
    allows, and of the last prefix state of the scan."""
    out = []
    for schedule, blocks in schedules(monoid):
        state = ff.fold(monoid, xs, schedule, blocks=blocks)
        label = schedule + ("/blocks" if blocks else "")
        out.append((label, ff.finalize(monoid, state, **params)))
    prefixes = ff.scan(monoid, xs)
    last = type(prefixes)(*(f[-1] for f in prefixes))
    out.append(("scan[-1]", ff.finalize(monoid, last, **params)))
    return out


# --- laws ----------------------------------------------------------------------------

@pytest.mark.parametrize("monoid", E.EXAMPLES, ids=lambda m: m.name)
def test_laws_hold_on_random_states(monoid):
    report = ff.check_laws(monoid, trials=500)
    assert report.ok, str(report)
    assert report.identity_exact, str(report)
    assert report.commutative is (True if monoid.commutative else None)


SYMBOLIC = [m for m in E.EXAMPLES if m is not E.TOP2]


@pytest.mark.parametrize("monoid", SYMBOLIC, ids=lambda m: m.name)
def test_laws_are_proved(monoid):
    proof = prove(monoid)
    assert proof.ok, proof.text()
    assert [l.name for l in proof.laws] == (["associativity", "identity"]
                                           + ["commutativity"] * monoid.commutative)


# prove(TOP2) is not in the list above, for two reasons found by running it (382 s):
#
# * associativity (18672 cases) and commutativity (346 cases) are proved, over every
#   state, sorted or not: the combine sorts each side first, so it is the top 2 of the
#   union of any two pairs of pairs. 18672 cases take minutes (six symbolic values, each
#   finite or -oo, in every order, ties split by position), too long for this suite:
#   test_top2_full_proof runs it with FLASHFOLD_LONG_PROOFS=1.
# * the identity law is refuted, on a state the fold never builds: prove's invariant of
#   the reachable states is sign facts per field and order relations between finite
#   fields, and TOP2's is that (v1, i1) comes before (v2, i2) in ARGMAX's order, with v2
#   = -inf after the lift (which drops the relation) and positions breaking ties (which
#   no such fact says). On a generic a with (v2, i2) first (or with a position past
#   INDEX_IDENTITY), a ⊕ e sorts a: a ⊕ e != a.
#
# The tests below prove what holds quickly: commutativity over every state, and the
# identity law over the sorted states (every state a fold builds is sorted), by applying
# the law to s = a ⊕ e, the sorted form of a symbolic a; and they show that the law's only
# failures are on unsorted states.

def _top2_symbols():
    import sympy as sp
    domains, _ = reachable_domains(E.TOP2)
    combine = sympy_function(E.TOP2.combine_graph)
    e = [-sp.oo, sp.Integer(INDEX_IDENTITY), -sp.oo, sp.Integer(INDEX_IDENTITY)]
    A, B = (StateSymbols(E.TOP2, domains, p) for p in "ab")
    return (lambda x, y: list(combine(*x, *y))), e, A, B


def test_top2_commutativity_is_proved_on_every_state():
    op, _, A, B = _top2_symbols()

    def comm(p):
        a, b = A.instantiate(p), B.instantiate(p)
        p.values = {"a": a, "b": b}
        return op(a, b), op(b, a)
    law = check_equal_on_paths("commutativity", "a ⊕ b = b ⊕ a", E.TOP2.field_names, comm,
                               A.rows() + B.rows(), states=[("a", A), ("b", B)])
    assert law.proved, law.text()


def test_top2_identity_is_proved_on_sorted_states_only():
    op, e, A, _ = _top2_symbols()
    names = [f"{n} ({side})" for side in ("s ⊕ e", "e ⊕ s") for n in E.TOP2.field_names]

    def on_sorted(p):
        a = A.instantiate(p)
        p.values = {"a": a}
        s = op(a, e)                                 # a sorted: any sorted state is one
        return op(s, e) + op(e, s), s + s
    law = check_equal_on_paths("identity", "s ⊕ e = s = e ⊕ s for s = a ⊕ e", names,
                               on_sorted, A.rows(), states=[("a", A)])
    assert law.proved, law.text()
    assert [list(outs) for _, outs in explore(lambda p: op(e, e))] == [e]    # e ⊕ e = e

    def on_any(p):
        a = A.instantiate(p)
        p.values = {"a": a}
        return op(a, e), a
    law = check_equal_on_paths("identity", "a ⊕ e = a", E.TOP2.field_names, on_any, A.rows(),
                               states=[("a", A)])
    assert not law.proved                            # the counterexample is unsorted
    a = dict(law.counterexample.states[0][1])
    assert (a["v2"], -a["i2"]) > (a["v1"], -a["i1"]), a


@pytest.mark.skipif(not os.environ.get("FLASHFOLD_LONG_PROOFS"),
                    reason="minutes of case splits; set FLASHFOLD_LONG_PROOFS=1")
def test_top2_full_proof():
    proof = prove(E.TOP2)
    assert proof.law("associativity").proved and proof.law("commutativity").proved
    assert proof.failure.name == "identity"
    a = dict(proof.counterexample.states[0][1])
    assert (a["v2"], -a["i2"]) > (a["v1"], -a["i1"]), a


@pytest.mark.parametrize("monoid", [E.LINEAR_RECURRENCE, E.EMA, E.AFFINE_HALF],
                         ids=lambda m: m.name)
def test_the_recurrences_are_not_commutative(monoid):
    ex = numpy_monoid(monoid)
    xs = [np.array([0.5, 2.0]), np.array([3.0, -1.0])][:len(monoid.inputs)]
    s = ex.lift(xs, None)
    l, r = tuple(f[:1] for f in s), tuple(f[1:] for f in s)
    lr, rl = ex.combine(l, r), ex.combine(r, l)
    assert not all(np.array_equal(x, y) for x, y in zip(lr, rl)), (lr, rl)
    # the checks agree: declared commutative, both the random check and the proof refute it
    claimed = dataclasses.replace(monoid, commutative=True)
    assert ff.check_laws(claimed, trials=200).commutative is False
    assert prove(monoid, commutativity=True).failure.name == "commutativity"
    with pytest.raises(ValueError, match="not commutative"):
        ff.fold(monoid, tuple(xs) if len(xs) > 1 else xs[0], "shuffled")


# --- recurrences -------------------------------------------------------------------------

def recurrence(a, b):
    """``h_t = a_t h_{t-1} + b_t`` from ``h_{-1} = 0``, the loop in float64."""
    h, out = np.zeros(b.shape[1:]), np.empty_like(b)
    for t in range(b.shape[0]):
        h = a[t] * h + b[t]
        out[t] = h
    return out


def test_linear_recurrence_scan_is_the_loop():
    rng = np.random.default_rng(1)
    a, b = rng.uniform(-1.0, 1.0, (N, 4)), rng.normal(0.0, 3.0, (N, 4))
    want = recurrence(a, b)
    scale = np.abs(b).sum(axis=0)                   # |h_t| <= sum |b| as |a| <= 1
    scanned = ff.scan(E.LINEAR_RECURRENCE, (a, b))
    assert_close(ff.finalize(E.LINEAR_RECURRENCE, scanned), want, "float64", scale=scale,
                 name="scan h")
    assert_close(scanned.A, np.cumprod(a, axis=0), "float64", name="scan A")
    for name, h in folds(E.LINEAR_RECURRENCE, (a, b)):
        assert_close(h, want[-1], "float64", scale=scale, name=name)


@pytest.mark.parametrize("alpha", [0.1, 0.37, 1.0])
def test_ema_scan_is_the_loop(alpha):
    rng = np.random.default_rng(2)
    x = rng.normal(5.0, 2.0, (N, 3))
    M = E.EMA if alpha == 0.1 else E.ema(alpha)
    want = recurrence(np.full_like(x, 1.0 - alpha), alpha * x)
    scale = np.abs(x).max()                         # h is a sub-convex combination of the x
    assert_close(ff.finalize(M, ff.scan(M, x)), want, "float64", scale=scale, name="scan")
    for name, h in folds(M, x):
        assert_close(h, want[-1], "float64", scale=scale, name=name)
    if alpha == 1.0:
        np.testing.assert_array_equal(ff.finalize(M, ff.scan(M, x)), x)


def test_ema_validates_alpha():
    for bad in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="alpha"):
            E.ema(bad)
    for bad in ("0.1", None, True):
        with pytest.raises(TypeError, match="alpha"):
            E.ema(bad)
    assert E.ema(0.25) != E.EMA
    # a NumPy scalar (e.g. an alpha computed from a half-life in NumPy) is a number
    x = np.random.default_rng(3).normal(size=(9, 2))
    for a in (np.float32(0.25), np.float64(0.25)):
        got = ff.finalize(E.ema(a), ff.scan(E.ema(a), x))
        want = recurrence(np.full_like(x, 0.75), 0.25 * x)
        assert_close(got, want, "float64", scale=np.abs(x).max(), name=f"ema({a!r})")


def test_affine_half_closed_form():
    rng = np.random.default_rng(3)
    x = rng.normal(0.0, 10.0, (N, 2))
    t = np.arange(N)
    # prefix t: a = 0.5^(t+1), b = sum_{s <= t} 0.5^(t - s) x_s
    want_b = np.stack([((0.5 ** (k - t[:k + 1]))[:, None] * x[:k + 1]).sum(axis=0)
                       for k in range(N)])
    want_a = np.broadcast_to((0.5 ** (t + 1.0))[:, None], x.shape)
    scale = 2.0 * np.abs(x).max()
    a, b = ff.scan(E.AFFINE_HALF, x)
    np.testing.assert_array_equal(a, want_a)        # powers of two: exact
    assert_close(b, want_b, "float64", scale=scale, name="scan b")
    for name, (fa, fb) in folds(E.AFFINE_HALF, x):
        np.testing.assert_array_equal(fa, want_a[-1], err_msg=name)
        assert_close(fb, want_b[-1], "float64", scale=scale, name=name)


# --- statistics --------------------------------------------------------------------------

def test_weighted_mean():
    rng = np.random.default_rng(4)
    w, x = rng.uniform(0.0, 2.0, (N, 3)), rng.normal(1.0, 4.0, (N, 3))
    want = (w * x).sum(axis=0) / w.sum(axis=0)
    scale = np.abs(w * x).sum(axis=0) / w.sum(axis=0)
    for name, m in folds(E.WEIGHTED_MEAN, (w, x)):
        assert_close(m, want, "float64", scale=scale, name=name)
    prefix = np.cumsum(w * x, axis=0) / np.cumsum(w, axis=0)
    assert_close(ff.finalize(E.WEIGHTED_MEAN, ff.scan(E.WEIGHTED_MEAN, (w, x))), prefix,
                 "float64", scale=scale, name="scan")


def test_weighted_mean_of_nothing_is_nan():
    empty = ff.fold(E.WEIGHTED_MEAN, (np.zeros(0), np.zeros(0)))
    assert np.isnan(ff.finalize(E.WEIGHTED_MEAN, empty))
    assert np.isnan(torch.tensor([], dtype=torch.float64).mean().item())   # the same rule
    cancel = ff.fold(E.WEIGHTED_MEAN, (np.array([1.0, -1.0]), np.array([3.0, 5.0])))
    assert np.isnan(ff.finalize(E.WEIGHTED_MEAN, cancel))


def bivariate(rng, n=N, batch=4):
    """Correlated (x, y) columns, off-centre so that a one-pass sum of products would
    cancel."""
    x = rng.normal(0.0, 1.0, (n, batch))
    y = 0.6 * x + 0.8 * rng.normal(0.0, 1.0, (n, batch))
    return 100.0 + 3.0 * x, -50.0 + 2.0 * y


@pytest.mark.parametrize("correction", [0, 1, 2])
def test_covariance_is_torch_cov(correction):
    x, y = bivariate(np.random.default_rng(5 + correction))
    cols = range(x.shape[1])
    want = np.array([torch.cov(torch.tensor(np.stack([x[:, j], y[:, j]])),
                               correction=correction)[0, 1].item() for j in cols])
    np.testing.assert_allclose(want, [np.cov(x[:, j], y[:, j], ddof=correction)[0, 1]
                                      for j in cols], rtol=1e-12)
    dx, dy = x - x.mean(axis=0), y - y.mean(axis=0)
    scale = np.abs(dx * dy).sum(axis=0) / (N - correction)
    for name, c in folds(E.COVARIANCE, (x, y), correction=correction):
        assert_close(c, want, "float64", scale=scale, name=name)
    # prefixes: the covariance of every x[:t+1], y[:t+1] (t >= 1)
    prefix = ff.finalize(E.COVARIANCE, ff.scan(E.COVARIANCE, (x, y)), correction=correction)
    for t in range(max(1, correction), N, 8):
        ref = np.array([np.cov(x[:t + 1, j], y[:t + 1, j], ddof=correction)[0, 1] for j in cols])
        assert_close(prefix[t], ref, "float64", scale=scale, name=f"scan[{t}]")


@pytest.mark.filterwarnings("ignore:cov.*degrees of freedom is <= 0")
def test_covariance_edge_cases_follow_torch():
    """n <= correction (NaN, or C / 0 past it), an infinite or NaN input: as torch.cov."""
    cases = (([1.0], [2.0], 1), ([1.0, 2.0], [2.0, 5.0], 2), ([1.0, 2.0], [2.0, 5.0], 3),
             ([1.0, np.inf, 3.0], [1.0, 2.0, 3.0], 1), ([1.0, 2.0, 3.0], [1.0, np.nan, 3.0], 1))
    for x, y, c in cases:
        state = ff.fold(E.COVARIANCE, (np.array(x), np.array(y)), "tree")
        want = torch.cov(torch.tensor([x, y], dtype=torch.float64), correction=c)[0, 1]
        assert_close(ff.finalize(E.COVARIANCE, state, correction=c), want.item(), "float64",
                     name=f"cov({x}, {y}, correction={c})")
    assert np.isnan(ff.finalize(E.COVARIANCE, ff.fold(E.COVARIANCE, (np.zeros(0), np.zeros(0)))))


def test_correlation_is_numpy_corrcoef():
    x, y = bivariate(np.random.default_rng(8))
    cols = range(x.shape[1])
    want = np.array([np.corrcoef(x[:, j], y[:, j])[0, 1] for j in cols])
    for name, r in folds(E.CORRELATION, (x, y)):
        assert_close(r, want, "float64", name=name)
    prefix = ff.finalize(E.CORRELATION, ff.scan(E.CORRELATION, (x, y)))
    for t in range(2, N, 8):
        ref = np.array([np.corrcoef(x[:t + 1, j], y[:t + 1, j])[0, 1] for j in cols])
        assert_close(prefix[t], ref, "float64", name=f"scan[{t}]")
    # exactly (anti)correlated pairs give +-1, a constant variable NaN, as corrcoef
    line = np.linspace(-3.0, 7.0, 13)
    const = np.full_like(line, 4.0)

    def r(x, y):
        return ff.finalize(E.CORRELATION, ff.fold(E.CORRELATION, (x, y), "tree"))
    assert_close(r(line, 2.0 * line + 1.0), 1.0, "float64")
    assert_close(r(line, -0.5 * line), -1.0, "float64")
    with np.errstate(all="ignore"):
        assert_close(r(line, const), np.corrcoef(line, const)[0, 1], "float64")
    assert np.isnan(r(np.array([1.0, np.inf, 2.0]), line[:3]))


# --- top 2 ---------------------------------------------------------------------------------

def top2_reference(x):
    """Values and positions of the two first elements of each column in the order of
    ARGMAX (NaN first, then larger values, ties to the lower position), by a stable sort."""
    vals, idx = [], []
    for col in x.T:
        order = sorted(range(len(col)), key=lambda i: (0, 0.0, i) if np.isnan(col[i])
                       else (1, -col[i], i))[:2]
        vals.append(col[order])
        idx.append(order)
    return np.array(vals).T, np.array(idx).T


def check_top2(x, name=""):
    want_v, want_i = top2_reference(x)
    t = torch.tensor(x)
    srt = torch.sort(t, dim=0, descending=True, stable=True)
    np.testing.assert_array_equal(srt.indices[:2].numpy(), want_i)   # torch's order, ties low
    top = torch.topk(t, 2, dim=0)
    assert_close(top.values.numpy(), want_v, "float64", name="topk values")
    for label, (v1, i1, v2, i2) in folds(E.TOP2, x):
        assert_close(np.stack([v1, v2]), top.values.numpy(), "float64", name=f"{name} {label}")
        np.testing.assert_array_equal(np.stack([i1, i2]), want_i, err_msg=f"{name} {label}")
    return top


def test_top2_is_topk():
    x = np.random.default_rng(9).normal(0.0, 1.0, (N, 5))
    top = check_top2(x, "distinct")
    np.testing.assert_array_equal(top.indices.numpy(), top2_reference(x)[1])


def test_top2_ties_go_to_the_lowest_index():
    rng = np.random.default_rng(10)
    x = rng.integers(-3, 4, (N, 6)).astype(np.float64)          # many ties
    x[:, 0] = 2.0                                                # all equal
    x[:, 1] = -np.inf                                            # all -inf: real positions win
    x[[40, 7], 2] = 9.0                                          # a tie for first place
    x[60, 3], x[[50, 20, 80], 3] = 9.0, 8.0                      # a tie for second place
    check_top2(x, "ties")
    _, i1, _, i2 = ff.finalize(E.TOP2, ff.fold(E.TOP2, x, "tree"))
    assert (i1[:3].tolist(), i2[:3].tolist()) == ([0, 0, 7], [1, 1, 40])
    assert (i1[3], i2[3]) == (60, 20)


def test_top2_nan_is_the_largest():
    rng = np.random.default_rng(11)
    x = rng.normal(0.0, 1.0, (N, 4))
    x[30, 0] = np.nan                                            # one NaN: first place
    x[[70, 12], 1] = np.nan                                      # two: both places, low first
    x[[5, 90, 44], 2] = np.nan
    x[:, 3] = np.nan
    check_top2(x, "nan")
    v1, i1, v2, i2 = ff.finalize(E.TOP2, ff.fold(E.TOP2, x, "shuffled", seed=3))
    assert i1.tolist() == [30, 12, 5, 0] and i2[1:].tolist() == [70, 44, 1]
    assert np.isnan(v1).all() and not np.isnan(v2[0])


def test_top2_of_one_element_keeps_the_identity_second():
    v1, i1, v2, i2 = ff.finalize(E.TOP2, ff.fold(E.TOP2, np.array([-np.inf])))
    assert (v1, i1, v2, i2) == (-np.inf, 0, -np.inf, INDEX_IDENTITY)
    empty = ff.finalize(E.TOP2, ff.fold(E.TOP2, np.zeros(0)))
    assert tuple(empty) == tuple(E.TOP2.identity)


def test_top2_scan_gives_every_prefix():
    x = np.random.default_rng(12).integers(-4, 5, (40, 3)).astype(np.float64)
    x[17, 1] = np.nan
    v1, i1, v2, i2 = ff.finalize(E.TOP2, ff.scan(E.TOP2, x))
    for t in range(1, len(x)):
        want_v, want_i = top2_reference(x[:t + 1])
        assert_close(np.stack([v1[t], v2[t]]), want_v, "float64", name=f"scan[{t}]")
        np.testing.assert_array_equal(np.stack([i1[t], i2[t]]), want_i, err_msg=f"scan[{t}]")


# --- the command line --------------------------------------------------------------------

def test_check_on_the_command_line(capsys):
    assert main(["check", "flashfold.examples:LINEAR_RECURRENCE", "--trials", "200",
                 "--prove"]) == 0
    out = capsys.readouterr().out
    assert "linear_recurrence" in out and "FAILED" not in out
