"""flashfold.dask: any monoid as a Dask reduction / prefix scan.

Checked against float64 NumPy references (or flashfold's sequential reference fold where
NumPy has no equivalent), over uneven chunks (including empty ones), on both axes of a
2-D array, on a ``distributed.LocalCluster`` of several worker *processes* (so every task
function and monoid is pickled and rebuilt on a worker) and on Dask's default threaded
scheduler.
"""

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dask
import dask.array as da
from distributed import Client, LocalCluster

import flashfold.dask as fd
from flashfold import Input, Monoid, finalize, fold
from flashfold.monoids import ARGMAX, ARGMIN, ATTENTION, LOGSUMEXP, SUM, WELFORD
from flashfold.schedules import scan as reference_scan
from flashfold.testing import assert_close
from user_monoids import MATMUL2, MAX_PREFIX_SUM, MINMAX

#: the first-order linear recurrence h <- a h + b as a monoid of affine maps, composed in
#: order (earlier map first): associative, NOT commutative, and (unlike MATMUL2, whose
#: lifts commute) the lifts of different elements do not commute, so any reordering of
#: elements or chunk states changes the result.
AFFINE = Monoid(
    "affine", fields=("a", "b"), identity=(1.0, 0.0),
    inputs=(Input("x", domain="finite"),),
    lift=lambda x: (0.75 + 0.25 * x, x),
    combine=lambda p, q: (p.a * q.a, q.a * p.b + q.b),
    finalize=lambda s: s.b,
    commutative=False)

#: awkward, uneven chunkings of a (23, 17) array, with a length-1 and an empty chunk
CHUNKS = ((5, 1, 9, 0, 8), (4, 6, 7))
SHAPE = (23, 17)


@pytest.fixture(scope="module")
def client():
    """Three single-threaded worker processes; not the default scheduler of other tests."""
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster:
        with Client(cluster, set_as_default=False) as c:
            c.wait_for_workers(3)
            yield c


def on(client, *arrays):
    """Compute dask arrays on the cluster."""
    out = client.compute(list(arrays), sync=True)
    return out[0] if len(out) == 1 else out


def chunked(a, chunks=CHUNKS):
    return da.from_array(a, chunks=chunks)


def data(seed=0, shape=SHAPE, loc=0.0, scale=1.0):
    return np.random.default_rng(seed).normal(loc, scale, size=shape)


def lse_ref(a, axis):
    """log sum exp in float64 with a finite pivot (all -inf -> -inf, never NaN)."""
    m = np.max(a, axis=axis, keepdims=True)
    p = np.where(np.isinf(m), 0.0, m)
    with np.errstate(divide="ignore"):
        return np.squeeze(p + np.log(np.sum(np.exp(a - p), axis=axis, keepdims=True)), axis=axis)


def fold_along(monoid, a, axis):
    """flashfold's sequential reference fold of ``a`` along ``axis``, finalized."""
    return finalize(monoid, fold(monoid, np.moveaxis(a, axis, 0), "sequential"))


# --- on a LocalCluster -----------------------------------------------------------------

@pytest.mark.parametrize("axis", [0, 1, None], ids=lambda a: f"axis={a}")
def test_logsumexp_cluster(client, axis):
    a = data(1, loc=2.0, scale=4.0)
    a[:, 3] = -np.inf                      # a fully masked column: -inf, not NaN
    a[7, :] = -np.inf                      # a fully masked row
    a[2, 5] = -np.inf
    got = on(client, fd.reduce(LOGSUMEXP, chunked(a), axis=axis))
    assert got.dtype == np.float64
    assert_close(got, lse_ref(a, axis), name=f"logsumexp axis={axis}")


@pytest.mark.parametrize("correction", [0, 1])
@pytest.mark.parametrize("axis", [0, 1], ids=lambda a: f"axis={a}")
def test_welford_cluster(client, axis, correction):
    a = data(2, loc=1e3, scale=3.0)        # a large mean: the twisted state must not cancel
    mean, var = fd.reduce(WELFORD, chunked(a), axis=axis, correction=correction)
    mean, var = on(client, mean, var)
    assert_close(mean, a.mean(axis=axis), scale=1e3, name="mean")
    assert_close(var, a.var(axis=axis, ddof=correction), name="var")


def test_welford_all_axes_split_every_cluster(client):
    a = data(3, loc=-5.0)
    mean, var = on(client, *fd.reduce(WELFORD, chunked(a), correction=1, split_every=2))
    assert mean.shape == var.shape == ()
    assert_close(mean, a.mean(), scale=5.0, name="mean")
    assert_close(var, a.var(ddof=1), name="var")


def tie_data():
    """Small integers (many ties), ties placed across chunk boundaries, a -inf column."""
    a = np.random.default_rng(4).integers(-3, 3, size=SHAPE).astype(np.float64)
    a[4, 0] = a[5, 0] = a[14, 0] = 9.0     # rows 4 | 5 | 6..14: a tie across three chunks
    a[:, 1] = -np.inf                       # all -inf: value -inf, index 0
    a[3, 9] = a[3, 10] = 7.0                # columns 9 | 10: a tie across the axis-1 boundary
    return a


@pytest.mark.parametrize("axis", [0, 1, None], ids=lambda a: f"axis={a}")
def test_argmax_argmin_cluster(client, axis):
    a = tie_data()
    results = {}
    for monoid, arg, best in ((ARGMAX, np.argmax, np.max), (ARGMIN, np.argmin, np.min)):
        value, index = fd.reduce(monoid, chunked(a), axis=axis, split_every=2)
        assert index.dtype == np.int64
        value, index = results[monoid.name] = on(client, value, index)
        np.testing.assert_array_equal(index, arg(a, axis=axis), err_msg=monoid.name)
        assert_close(value, best(a, axis=axis), name=f"{monoid.name} value")
    index = results["argmax"][1]
    if axis == 0:
        assert index[0] == 4 and index[1] == 0          # lowest global index; all -inf -> 0
    elif axis == 1:
        assert index[3] == 9


def test_user_monoid_minmax_cluster(client):
    a = data(5)
    for axis in (0, 1):
        lo, hi = on(client, *fd.reduce(MINMAX, chunked(a), axis=axis))
        assert_close(lo, a.min(axis=axis), name="lo")
        assert_close(hi, a.max(axis=axis), name="hi")


@pytest.mark.parametrize("axis", [0, 1], ids=lambda a: f"axis={a}")
def test_noncommutative_order_cluster(client, axis):
    """Non-commutative monoids over many uneven chunks, combined in a tree of pairs/triples."""
    a = np.random.default_rng(6).uniform(-0.6, 0.6, size=(41, 29))
    chunks = ((3, 7, 1, 0, 9, 5, 16), (2, 9, 1, 5, 5, 7))
    x = chunked(a, chunks)
    for monoid, split_every in ((AFFINE, 2), (MAX_PREFIX_SUM, 3)):
        ref = fold_along(monoid, a, axis)
        backwards = fold_along(monoid, np.flip(a, axis), axis)
        assert np.abs(ref - backwards).max() > 1e-3          # the order matters here
        got = on(client, fd.reduce(monoid, x, axis=axis, split_every=split_every))
        assert_close(got, ref, scale=np.abs(a).sum(axis=axis), name=monoid.name)
    # MATMUL2's lifts I + xN all commute with each other, so it checks the 4-field state
    # and the plumbing rather than the order
    got = on(client, *fd.reduce(MATMUL2, x, axis=axis, split_every=2))
    for k, (g, r) in enumerate(zip(got, fold_along(MATMUL2, a, axis))):
        assert_close(g, r, scale=np.abs(r).max(), name=f"matmul2 entry {k}")


def test_scan_cluster(client):
    a = data(7)
    got = on(client, fd.scan(LOGSUMEXP, chunked(a), axis=0, method="blelloch"))
    assert_close(got, np.logaddexp.accumulate(a, axis=0), name="logcumsumexp")
    ref = reference_scan(MATMUL2, a[:, :5])
    got = on(client, *fd.scan(MATMUL2, chunked(a[:, :5], (CHUNKS[0], 5)), axis=0))
    for g, r in zip(got, ref):
        assert_close(g, r, scale=np.abs(r).max(), name="matmul2 scan")


def test_tasks_ran_on_worker_processes(client):
    """The monoid reached the workers as its definition and was rebuilt there."""
    on(client, fd.reduce(LOGSUMEXP, chunked(data(8)), axis=0))
    rebuilt = client.run(lambda: sorted({token[0] for token in fd._REBUILT}))   # per worker
    assert len(rebuilt) == 3
    assert any("logsumexp" in names for names in rebuilt.values())


# --- on the default (threaded) scheduler ------------------------------------------------

def test_default_threaded_scheduler():
    a = data(9, loc=3.0)
    lse = fd.reduce(LOGSUMEXP, chunked(a), axis=1)
    assert dask.base.get_scheduler(collections=[lse]) is dask.threaded.get
    assert isinstance(lse, da.Array) and lse.shape == (23,)
    assert_close(lse.compute(), lse_ref(a, 1), name="logsumexp")
    mean, var = dask.compute(*fd.reduce(WELFORD, chunked(a), axis=0, correction=1))
    assert_close(mean, a.mean(0), scale=3.0, name="mean")
    assert_close(var, a.var(0, ddof=1), name="var")
    value, index = dask.compute(*fd.reduce(ARGMAX, chunked(tie_data()), axis=0))
    np.testing.assert_array_equal(index, tie_data().argmax(0))


def test_keepdims_and_several_axes():
    a = np.random.default_rng(10).normal(size=(6, 5, 7))
    a[2, 1, 3] = a[4, 0, 6] = 10.0                       # tie: C order over axes (0, 2)
    x = da.from_array(a, chunks=((2, 4), (3, 2), (3, 1, 3)))
    mean, var = fd.reduce(WELFORD, x, axis=(0, -1), keepdims=True)
    assert mean.shape == (1, 5, 1)
    assert_close(mean.compute(), a.mean(axis=(0, 2), keepdims=True), name="mean")
    assert_close(var.compute(), a.var(axis=(0, 2), keepdims=True), name="var")
    value, index = dask.compute(*fd.reduce(ARGMAX, x, axis=(2, 0)))
    flat = np.moveaxis(a, 1, -1).reshape(6 * 7, 5)       # reduced axes (0, 2) in C order
    np.testing.assert_array_equal(index, flat.argmax(0))
    assert index[1] == 2 * 7 + 3
    assert_close(value, flat.max(0), name="value")
    s = fd.reduce(SUM, x, axis=())                       # no axis: finalize(lift(x))
    assert_close(s.compute(), a, name="sum over no axes")


def test_noncommutative_several_axes():
    a = np.random.default_rng(11).uniform(-0.5, 0.5, size=(9, 4, 3))
    one_chunk_inner = da.from_array(a, chunks=((2, 3, 4), 4, 3))
    got = dask.compute(*fd.reduce(MATMUL2, one_chunk_inner, axis=(0, 1)))
    ref = finalize(MATMUL2, fold(MATMUL2, a.reshape(36, 3), "sequential"))
    for g, r in zip(got, ref):
        assert_close(g, r, scale=np.abs(r).max(), name="matmul2 over (0, 1)")
    with pytest.raises(ValueError, match="axis"):
        fd.reduce(MATMUL2, da.from_array(a, chunks=(3, 2, 3)), axis=(0, 1))


def test_attention_scores_values():
    rng = np.random.default_rng(12)
    s, v = rng.normal(size=(30, 5)), rng.normal(size=(30, 5, 4))
    s[:, 2] = -np.inf                                    # no visible key: out 0, lse -inf
    ds = da.from_array(s, chunks=((7, 13, 10), (2, 3)))
    dv = da.from_array(v, chunks=((7, 13, 10), (2, 3), (1, 3)))   # feature axis chunked
    out, lse = fd.reduce(ATTENTION, (ds, dv), axis=0)
    assert out.shape == (5, 4) and lse.shape == (5,)
    out, lse = dask.compute(out, lse)
    ref_out, ref_lse = finalize(ATTENTION, fold(ATTENTION, (s, v)))
    assert_close(out, ref_out, name="out")
    assert_close(lse, ref_lse, name="lse")
    out2 = fd.scan(ATTENTION, (ds, dv), axis=0)[0].compute()
    assert out2.shape == (30, 5, 4)
    assert_close(out2[-1], ref_out, name="last prefix of the attention scan")


def test_empty_axis_gives_identity():
    a = np.empty((0, 4))
    x = da.from_array(a, chunks=((0,), (3, 1)))
    assert_close(fd.reduce(LOGSUMEXP, x, axis=0).compute(), np.full(4, -np.inf), name="lse")
    mean, var = dask.compute(*fd.reduce(WELFORD, x, axis=0))
    ref_mean, ref_var = finalize(WELFORD, fold(WELFORD, a))
    assert_close(mean, ref_mean, name="mean")
    assert_close(var, ref_var, name="var")                # 0 / 0: NaN, as NumPy
    assert fd.reduce(LOGSUMEXP, x, axis=1).compute().shape == (0,)


# --- scans (threaded) -------------------------------------------------------------------

@pytest.mark.parametrize("method", ["sequential", "blelloch"])
@pytest.mark.parametrize("reverse", [False, True], ids=["prefix", "suffix"])
@pytest.mark.parametrize("axis", [0, 1], ids=lambda a: f"axis={a}")
def test_scan_matches_reference(axis, reverse, method):
    a = np.random.default_rng(13).uniform(-0.6, 0.6, size=SHAPE)
    x = chunked(a)
    got = dask.compute(*fd.scan(MATMUL2, x, axis=axis, reverse=reverse, method=method))
    ref = reference_scan(MATMUL2, np.moveaxis(a, axis, 0), reverse=reverse)
    for g, r in zip(got, ref):
        assert_close(g, np.moveaxis(r, 0, axis), scale=np.abs(r).max(), name="matmul2 scan")
    for monoid in (MAX_PREFIX_SUM, AFFINE):
        got = fd.scan(monoid, x, axis=axis, reverse=reverse, method=method).compute()
        ref = finalize(monoid, reference_scan(monoid, np.moveaxis(a, axis, 0), reverse=reverse))
        assert_close(got, np.moveaxis(ref, 0, axis), scale=np.abs(a).sum(), name=f"{monoid.name} scan")
    lse = fd.scan(LOGSUMEXP, x, axis=axis, reverse=reverse, method=method).compute()
    ref = np.logaddexp.accumulate(np.flip(a, axis) if reverse else a, axis=axis)
    assert_close(lse, np.flip(ref, axis) if reverse else ref, name="logcumsumexp")


def test_scan_argmax_and_welford():
    a = tie_data()
    value, index = dask.compute(*fd.scan(ARGMAX, chunked(a), axis=0))
    running = np.stack([a[:i + 1].argmax(0) for i in range(a.shape[0])])
    np.testing.assert_array_equal(index, running)         # global positions, lowest on ties
    assert_close(value, np.maximum.accumulate(a, axis=0), name="running max")
    b = data(14, loc=50.0)
    mean, var = dask.compute(*fd.scan(WELFORD, chunked(b), axis=1, correction=1))
    n = np.arange(1, b.shape[1] + 1)
    ref_mean = np.cumsum(b, axis=1) / n
    ref_var = np.stack([b[:, :j + 1].var(axis=1, ddof=1) if j else np.full(b.shape[0], np.nan)
                        for j in range(b.shape[1])], axis=1)
    assert_close(mean, ref_mean, scale=50.0, name="running mean")
    assert_close(var, ref_var, name="running var")


@settings(max_examples=25)
@given(sizes=st.lists(st.integers(0, 6), min_size=1, max_size=8), split_every=st.integers(2, 4),
       seed=st.integers(0, 2**16))
def test_any_chunking_noncommutative(sizes, split_every, seed):
    """Every partition of the axis into chunks and every tree width give the sequential fold."""
    a = np.random.default_rng(seed).uniform(-1.0, 1.0, size=(sum(sizes), 2))
    x = da.from_array(a, chunks=(tuple(sizes), 2))
    scale = np.abs(a).sum() + 1.0
    for monoid in (MAX_PREFIX_SUM, AFFINE):
        got = fd.reduce(monoid, x, axis=0, split_every=split_every).compute()
        assert_close(got, fold_along(monoid, a, 0), scale=scale, name=monoid.name)
        got = fd.scan(monoid, x, axis=0, method="blelloch").compute()
        ref = finalize(monoid, reference_scan(monoid, a))
        assert_close(got, ref, scale=scale, name=f"{monoid.name} scan")


# --- errors and imports -----------------------------------------------------------------

def test_invalid_inputs():
    x = chunked(data(15))
    with pytest.raises(TypeError, match="^x: .*dask.array.Array"):
        fd.reduce(LOGSUMEXP, data(15), axis=0)
    with pytest.raises(TypeError, match="^x: .*floating"):
        fd.reduce(LOGSUMEXP, da.ones((4, 3), dtype=np.int64, chunks=2), axis=0)
    with pytest.raises(TypeError, match="^monoid: "):
        fd.reduce(np.sum, x, axis=0)
    for bad in (2, -3, (0, 0), (0, 5)):
        with pytest.raises(ValueError, match="^axis: "):
            fd.reduce(LOGSUMEXP, x, axis=bad)
        with pytest.raises((ValueError, TypeError), match="^axis: "):
            fd.scan(LOGSUMEXP, x, axis=bad)
    with pytest.raises(TypeError, match="^axis: "):
        fd.reduce(LOGSUMEXP, x, axis="0")
    with pytest.raises(TypeError, match="^axis: "):
        fd.scan(LOGSUMEXP, x, axis=None)
    with pytest.raises(ValueError, match="^x: "):
        fd.reduce(ATTENTION, x, axis=0)                 # needs (scores, values)
    with pytest.raises(ValueError, match="^x: "):
        fd.reduce(ATTENTION, (x, da.ones((23, 16, 4), chunks=4)), axis=0)
    with pytest.raises(TypeError, match="^corection: "):
        fd.reduce(WELFORD, x, axis=0, corection=1)
    with pytest.raises(ValueError, match="^split_every: "):
        fd.reduce(LOGSUMEXP, x, axis=0, split_every=1)
    with pytest.raises(ValueError, match="^split_every: .*axis of x"):
        fd.reduce(LOGSUMEXP, x, axis=0, split_every={5: 2})      # x has 2 axes
    unknown_chunks = x[x[:, 0] > -np.inf]              # chunk sizes are NaN until computed
    with pytest.raises(ValueError, match="^x: .*compute_chunk_sizes"):
        fd.reduce(ARGMAX, unknown_chunks, axis=0)
    with pytest.raises(ValueError, match="^method: "):
        fd.scan(LOGSUMEXP, x, axis=0, method="tree")


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("method", ["sequential", "blelloch"])
def test_scan_unknown_chunk_sizes(method, reverse):
    """Chunk sizes along the scanned axis unknown until computed (a boolean selection,
    which here empties two chunks): refused up front, naming ``x``; once computed, the
    scan matches the reference. Unknown sizes along another axis: the Blelloch scan runs,
    the sequential one (whose chain needs them) is refused up front."""
    a = np.arange(1.0, 13.0)
    x = da.from_array(a, chunks=3)
    picked = x[(x < 4) | (x > 9)]                     # chunks (3, 0, 0, 3) once computed
    with pytest.raises(ValueError, match="^x: .*compute_chunk_sizes"):
        fd.scan(SUM, picked, axis=0, method=method, reverse=reverse)
    kept = a[(a < 4) | (a > 9)]
    want = np.cumsum(kept[::-1])[::-1] if reverse else np.cumsum(kept)
    got = fd.scan(SUM, picked.compute_chunk_sizes(), axis=0, method=method,
                  reverse=reverse).compute(scheduler="synchronous")
    assert_close(got, want, "float64", name="scan after compute_chunk_sizes")
    b = data(16, shape=(6, 4))
    y = da.from_array(b, chunks=(2, 2))
    rows = y[y[:, 0] > -np.inf]                        # unknown sizes along axis 0 only
    if method == "sequential":
        with pytest.raises(ValueError, match="^x: .*compute_chunk_sizes"):
            fd.scan(LOGSUMEXP, rows, axis=1, method=method, reverse=reverse)
        rows = rows.compute_chunk_sizes()
    got = fd.scan(LOGSUMEXP, rows, axis=1, method=method, reverse=reverse).compute(
        scheduler="synchronous")
    want = np.logaddexp.accumulate(b[:, ::-1], 1)[:, ::-1] if reverse else \
        np.logaddexp.accumulate(b, 1)
    assert_close(got, want, "float64", name="scan along a known axis")


def test_dask_is_optional():
    """``import flashfold`` (and ``flashfold.dask``) never imports Dask; calling without it
    names the extra. In a subprocess, so that hiding Dask cannot disturb the cluster."""
    code = (
        "import sys, flashfold, flashfold.dask as fd\n"
        "assert 'dask' not in sys.modules, 'dask was imported'\n"
        "sys.modules['dask'] = sys.modules['dask.array'] = None   # as if not installed\n"
        "from flashfold.monoids import LOGSUMEXP\n"
        "try:\n"
        "    fd.reduce(LOGSUMEXP, None, axis=0)\n"
        "except ImportError as e:\n"
        "    assert 'pip install flashfold[dask]' in str(e), str(e)\n"
        "else:\n"
        "    raise AssertionError('no ImportError')\n")
    subprocess.run([sys.executable, "-c", code], check=True)
