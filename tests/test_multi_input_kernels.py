"""Monoids of several scalar inputs on the generated reduce / scan / segment kernels.

The inputs are a tuple of tensors broadcast to one shape (views: each input is read
through its own strides, stride 0 where it repeats), in one geometry. On CPU machines the
kernels run under ``TRITON_INTERPRET=1`` (``tests/conftest.py``): through the public API
with the dispatch patched (``path`` fixture, as ``tests/test_reduce_api.py``), and through
the launchers with the heuristics patched to force every branch. Everything is checked
against the float64 reference schedules (:mod:`flashfold.kernels.reduce.reference`)
with the tolerance table of :mod:`flashfold.testing`; the interpreter folds
``tl.reduce`` / ``tl.associative_scan`` left to right, so the order checks here are the
kernels' own (lanes, tiles, chunks, look-back), and the GPU section repeats the
examples at real sizes.
"""

import pytest
import torch

import flashfold as ff
from flashfold import examples as ex
from flashfold.api import reductions as api
from flashfold.kernels.reduce import launch as L
from plan_forcing import force, lookback_aggregates_only  # noqa: F401  (force: a fixture)
from flashfold.monoids import ATTENTION, ATTENTION2
from flashfold.kernels.reduce import reference as R
from flashfold.testing import assert_close

ON_CUDA = torch.cuda.is_available()
interpreter = pytest.mark.skipif(ON_CUDA, reason="interpreter tests run on CPU machines")
C = L.Config

SCALAR_EXAMPLES = (ex.LINEAR_RECURRENCE, ex.WEIGHTED_MEAN, ex.COVARIANCE, ex.CORRELATION)


@pytest.fixture
def kernels(monkeypatch):
    """Route the public functions' CPU tensors to the kernels (interpreter)."""
    monkeypatch.setattr(api, "_use_kernels", lambda x: True)


def _inputs(monoid, shape, seed=0, dtype=torch.float32):
    """Inputs of ``monoid`` of one shape: the recurrence's ``a`` in [0.5, 1) (a decay: the
    state stays bounded), a weight in (0.1, 1], ``y`` correlated with ``x``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if monoid is ex.LINEAR_RECURRENCE:
        xs = (0.5 + 0.5 * torch.rand(*shape, generator=g), x)
    elif monoid is ex.WEIGHTED_MEAN:
        xs = (0.1 + 0.9 * torch.rand(*shape, generator=g), x)
    else:
        xs = (x, 0.5 * x + 0.3 * torch.randn(*shape, generator=g))
    return tuple(t.to(dtype) for t in xs)


def _scale(monoid, xs, dim, reduced=True, reverse=False):
    """The magnitude of what each output accumulates along ``dim`` (``flashfold.testing``
    scales): 1 + the recurrence over ``|a|, |b|`` (its conditioning), ``sum |w x| / sum w``
    for the weighted mean, the product of the inputs' spreads for the covariance, 1 for a
    correlation."""
    if monoid is ex.LINEAR_RECURRENCE:
        ab = tuple(t.abs() for t in xs)
        if reduced:
            return 1.0 + R.reduce_reference(monoid, ab, dim)[0]
        return 1.0 + R.scan_reference(monoid, ab, dim, reverse)[0]
    xs = [t.double() for t in torch.broadcast_tensors(*xs)]
    assert reduced
    if monoid is ex.WEIGHTED_MEAN:
        w, x = xs
        return 1.0 + (w * x).abs().sum(dim) / w.sum(dim).clamp_min(1e-30)
    if monoid is ex.COVARIANCE:
        return 1.0 + xs[0].std(dim).nan_to_num() * xs[1].std(dim).nan_to_num()
    return 2.0


def _check(outs, ref, dtype, scale, name):
    outs = outs if isinstance(outs, tuple) else (outs,)
    assert len(outs) == len(ref), name
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert tuple(o.shape) == tuple(r.shape), (name, i, o.shape, r.shape)
        if not r.dtype.is_floating_point:
            assert torch.equal(o, r), (name, i)
        else:
            assert o.dtype == dtype, (name, i, o.dtype)
            assert_close(o, r, dtype, scale=scale, name=f"{name} output {i}")


# --- the public API on the kernels path -------------------------------------------------------

@interpreter
@pytest.mark.parametrize("n", (1, 7, 63, 1000, 4097))
@pytest.mark.parametrize("monoid", SCALAR_EXAMPLES, ids=lambda m: m.name)
def test_reduce_rows_awkward_sizes(kernels, monoid, n):
    xs = _inputs(monoid, (3, n), seed=n)
    ref = R.reduce_reference(monoid, xs, 1)
    _check(ff.reduce(monoid, xs, dim=-1), ref, torch.float32, _scale(monoid, xs, 1),
           f"{monoid.name} n={n}")


@interpreter
@pytest.mark.parametrize("n", (1, 7, 63, 1000))
@pytest.mark.parametrize("monoid", SCALAR_EXAMPLES, ids=lambda m: m.name)
def test_reduce_dim0(kernels, monoid, n):
    """The reduced dim strided, the rows of the tile contiguous columns."""
    xs = _inputs(monoid, (n, 5), seed=n + 1)
    ref = R.reduce_reference(monoid, xs, 0)
    _check(ff.reduce(monoid, xs, dim=0), ref, torch.float32, _scale(monoid, xs, 0),
           f"{monoid.name} dim 0 n={n}")


@interpreter
@pytest.mark.parametrize("reverse", (False, True), ids=("forward", "reverse"))
@pytest.mark.parametrize("n", (1, 7, 63, 1000, 4097))
def test_recurrence_scan_awkward_sizes(kernels, n, reverse):
    xs = _inputs(ex.LINEAR_RECURRENCE, (2, n), seed=n + 2)
    ref = R.scan_reference(ex.LINEAR_RECURRENCE, xs, 1, reverse)
    scale = _scale(ex.LINEAR_RECURRENCE, xs, 1, reduced=False, reverse=reverse)
    _check(ff.scan(ex.LINEAR_RECURRENCE, xs, dim=1, reverse=reverse), ref, torch.float32,
           scale, f"recurrence n={n} reverse={reverse}")
    # dim 0 of the transposes (views: the scan reads the columns through their strides)
    xt = tuple(t.T for t in xs)
    got = ff.scan(ex.LINEAR_RECURRENCE, xt, dim=0, reverse=reverse)
    _check(got, tuple(r.T for r in ref), torch.float32, scale.T, "dim 0")


@interpreter
@pytest.mark.parametrize("reverse", (False, True), ids=("forward", "reverse"))
@pytest.mark.parametrize("monoid", (ex.EMA, ex.AFFINE_HALF), ids=lambda m: m.name)
def test_one_input_recurrences_through_the_api(kernels, monoid, reverse):
    x = torch.randn(3, 333, generator=torch.Generator().manual_seed(3))
    ref = R.scan_reference(monoid, x, 1, reverse)
    _check(ff.scan(monoid, x, dim=-1, reverse=reverse), ref, torch.float32,
           1.0 + 2 * float(x.abs().max()), monoid.name)
    _check(ff.reduce(monoid, x, dim=1), R.reduce_reference(monoid, x, 1), torch.float32,
           1.0 + 2 * float(x.abs().max()), monoid.name)


@interpreter
def test_top2_through_the_api(kernels):
    """A data input and a position input, four fields of which two are int, four outputs."""
    g = torch.Generator().manual_seed(4)
    x = torch.round(torch.randn(4, 300, generator=g) * 2) / 2           # ties
    x[1, 17] = float("nan")
    got = ff.reduce(ex.TOP2, x, dim=1)
    ref = R.reduce_reference(ex.TOP2, x, 1)
    for o, r in zip(got, ref):
        assert torch.equal(o.double().nan_to_num(-7.0), r.double().nan_to_num(-7.0))
    assert got.index1[1] == 17


@interpreter
def test_broadcast_inputs_are_views_never_copies(kernels, monkeypatch):
    """A 0-d decay against a full ``b``; a row vector of weights against a matrix; a
    column of weights: results against the reference of the materialized inputs, and the
    plan reads the broadcast views themselves (stride 0), nothing copied."""
    g = torch.Generator().manual_seed(5)
    b = torch.randn(4, 130, generator=g)
    a = torch.tensor(0.9)
    full = (a.expand_as(b).clone(), b)
    want = R.scan_reference(ex.LINEAR_RECURRENCE, full, 1)
    scale = _scale(ex.LINEAR_RECURRENCE, full, 1, reduced=False)
    _check(ff.scan(ex.LINEAR_RECURRENCE, (a, b), dim=1), want, torch.float32, scale, "0-d a")
    _check(ff.reduce(ex.LINEAR_RECURRENCE, (a, b), dim=1),
           R.reduce_reference(ex.LINEAR_RECURRENCE, full, 1), torch.float32,
           _scale(ex.LINEAR_RECURRENCE, full, 1), "0-d a reduce")
    x = torch.randn(6, 130, generator=g)
    for w, name in ((torch.rand(130, generator=g) + 0.1, "row"),
                    (torch.rand(6, 1, generator=g) + 0.1, "column")):
        wf = w.expand_as(x).clone()
        for dim in (1, 0):
            want = R.reduce_reference(ex.WEIGHTED_MEAN, (wf, x), dim)
            _check(ff.reduce(ex.WEIGHTED_MEAN, (w, x), dim=dim), want, torch.float32,
                   _scale(ex.WEIGHTED_MEAN, (wf, x), dim), f"{name} weights dim {dim}")
        wb, xb = torch.broadcast_tensors(w, x)
        plan, _ = L.plan_reduce(ex.WEIGHTED_MEAN, (wb, xb), 1)
        assert plan[0].args[0][0] is wb and plan[0].args[0][1] is xb
        assert 0 in wb.stride()


@interpreter
def test_strided_and_mixed_layouts(kernels):
    """Transposed, sliced and permuted views, one input in another layout than the other,
    reduced over a middle dim and several dims at once."""
    g = torch.Generator().manual_seed(6)
    base = torch.randn(6, 9, 4, 14, generator=g)
    w = (torch.rand(14, 4, 9, 6, generator=g) + 0.1).permute(3, 2, 1, 0)  # other strides
    x = base[:, :, :, ::1]
    for dim in (1, 3, 0):
        want = R.reduce_reference(ex.WEIGHTED_MEAN, (w, x), dim)
        _check(ff.reduce(ex.WEIGHTED_MEAN, (w, x), dim=dim), want, torch.float32,
               _scale(ex.WEIGHTED_MEAN, (w, x), dim), f"mixed layouts dim {dim}")
    xs = (base[:, ::2, :, 1:12], base.flip(0)[:, ::2, :, 1:12] * 0.5 + 0.1)
    for dim in (3, 1):
        want = R.reduce_reference(ex.COVARIANCE, xs, dim)
        _check(ff.reduce(ex.COVARIANCE, xs, dim=dim), want, torch.float32,
               _scale(ex.COVARIANCE, xs, dim), f"sliced dim {dim}")
    got = ff.reduce(ex.WEIGHTED_MEAN, (w, x), dim=(1, 3))
    wb, xb = (t.permute(0, 2, 1, 3).reshape(6, 4, -1) for t in (w, x))
    _check(got, R.reduce_reference(ex.WEIGHTED_MEAN, (wb, xb), 2), torch.float32,
           _scale(ex.WEIGHTED_MEAN, (wb, xb), 2), "dims (1, 3)")
    a, b = _inputs(ex.LINEAR_RECURRENCE, (20, 3, 7), seed=7)
    at = a.permute(2, 0, 1)                                     # the scanned dim in the middle
    for reverse in (False, True):
        want = R.scan_reference(ex.LINEAR_RECURRENCE, (at, b.permute(2, 0, 1)), 1, reverse)
        got = ff.scan(ex.LINEAR_RECURRENCE, (at, b.permute(2, 0, 1)), dim=1, reverse=reverse)
        _check(got, want, torch.float32, 1.0 + 2 * float(b.abs().sum(0).max()), "middle dim")


@interpreter
def test_promoted_dtypes(kernels):
    """Each input loads in its own dtype; states are float32; the outputs take the
    promoted dtype (bf16 weights and fp32 values give fp32, both bf16 give bf16)."""
    w, x = _inputs(ex.WEIGHTED_MEAN, (3, 200), seed=8)
    wh = w.bfloat16()
    want = R.reduce_reference(ex.WEIGHTED_MEAN, (wh, x), 1)
    _check(ff.reduce(ex.WEIGHTED_MEAN, (wh, x), dim=1), want, torch.float32,
           _scale(ex.WEIGHTED_MEAN, (wh.float(), x), 1), "bf16 w, fp32 x")
    xh = x.bfloat16()
    want = R.reduce_reference(ex.WEIGHTED_MEAN, (wh, xh), 1)
    _check(ff.reduce(ex.WEIGHTED_MEAN, (wh, xh), dim=1), want, torch.bfloat16,
           _scale(ex.WEIGHTED_MEAN, (wh.float(), xh.float()), 1), "bf16")
    a, b = _inputs(ex.LINEAR_RECURRENCE, (2, 100), seed=9)
    got = ff.scan(ex.LINEAR_RECURRENCE, (a.half(), b), dim=1)
    want = R.scan_reference(ex.LINEAR_RECURRENCE, (a.half(), b), 1)
    _check(got, want, torch.float32, _scale(ex.LINEAR_RECURRENCE, (a.half(), b), 1,
                                            reduced=False), "fp16 a")


@interpreter
def test_segments_with_empty_ones(kernels):
    g = torch.Generator().manual_seed(10)
    offsets = torch.tensor([0, 0, 5, 5, 70, 71, 200])
    w, x = _inputs(ex.WEIGHTED_MEAN, (200, 3), seed=10)
    want = R.segment_reduce_reference(ex.WEIGHTED_MEAN, (w, x), offsets, 0)
    got = ff.segment_reduce(ex.WEIGHTED_MEAN, (w, x), offsets, dim=0)
    assert got.shape == (6, 3) and torch.isnan(got[0]).all() and torch.isnan(got[2]).all()
    _check(got, want, torch.float32, 1.0 + 3 * float(x.abs().max()), "weighted mean")
    a, b = _inputs(ex.LINEAR_RECURRENCE, (3, 200), seed=11)
    want = R.segment_reduce_reference(ex.LINEAR_RECURRENCE, (a, b), offsets, 1)
    got = ff.segment_reduce(ex.LINEAR_RECURRENCE, (a, b), offsets, dim=1)
    assert torch.equal(got[:, 0], torch.zeros(3))                     # empty: h = 0
    _check(got, want, torch.float32, 1.0 + 2 * float(b.abs().sum(1).max()), "recurrence")
    xs = (x, torch.randn(200, 3, generator=g))
    want = R.segment_reduce_reference(ex.CORRELATION, xs, offsets, 0)
    _check(ff.segment_reduce(ex.CORRELATION, xs, offsets, dim=0), want, torch.float32, 2.0,
           "correlation")


@interpreter
def test_nonfinite_inputs_follow_the_reference(kernels):
    """No NaN on valid input; an infinite or NaN input where the monoid's rule says."""
    w, x = _inputs(ex.WEIGHTED_MEAN, (3, 40), seed=12)
    x[1, 5] = float("inf")
    w[2] = 0.0                                                  # weights sum to 0: NaN
    got = ff.reduce(ex.WEIGHTED_MEAN, (w, x), dim=1)
    want = R.reduce_reference(ex.WEIGHTED_MEAN, (w, x), 1)
    assert torch.isfinite(got[0]) and got[1] == float("inf") and torch.isnan(got[2])
    _check(got, want, torch.float32, 4.0, "non-finite")


# --- every dispatch branch, forced ------------------------------------------------------------

def _bcast(monoid, shape, seed):
    """The monoid's inputs, the first one broadcast along dim 0 (a stride-0 view)."""
    xs = _inputs(monoid, shape, seed=seed)
    return (xs[0][:1].expand(shape),) + xs[1:]


def _reduce_check(monoid, xs, dim, name):
    ref = R.reduce_reference(monoid, xs, dim)
    _check(L.launch_reduce(monoid, xs, dim), ref, torch.float32, _scale(monoid, xs, dim), name)


def _scan_check(monoid, xs, dim, reverse, name):
    ref = R.scan_reference(monoid, xs, dim, reverse)
    _check(L.launch_scan(monoid, xs, dim, reverse), ref, torch.float32,
           1.0 + 2 * float(xs[1].abs().sum(dim).max()), name)


ORDERED_AND_NOT = (ex.LINEAR_RECURRENCE, ex.WEIGHTED_MEAN, ex.COVARIANCE)


@interpreter
@pytest.mark.parametrize("monoid", ORDERED_AND_NOT, ids=lambda m: m.name)
def test_reduce_branches(monoid, force, monkeypatch):
    ordered = not monoid.commutative
    xs = _bcast(monoid, (3, 7), 20)
    assert L.plan_reduce(monoid, xs, 1)[0][0].kwargs["SMALL"]
    _reduce_check(monoid, xs, 1, "small")
    xs = _bcast(monoid, (3, 37), 21)
    _reduce_check(monoid, xs, 1, "short rows")
    _reduce_check(monoid, _bcast(monoid, (33, 6), 22), 0, "columns")
    # (each force below stays until the test ends; each step forces what it needs)
    force(reduce=C(1, 8, 1, 4) if ordered else C(2, 8, 1, 4))
    xs = _bcast(monoid, (2, 130), 23)
    plan, _ = L.plan_reduce(monoid, xs, 1)
    assert plan[0].kwargs["ALIGN"] == 0 and plan[0].kwargs["LANES"] == 8
    _reduce_check(monoid, xs, 1, "lane tiles")
    with monkeypatch.context() as m:
        m.setattr(L, "_n64", lambda g, *e: True)
        assert L.plan_reduce(monoid, xs, 1)[0][0].kwargs["N64"]
        _reduce_check(monoid, xs, 1, "n64")
    force(reduce=C(1, 8, 1, 4) if ordered else C(2, 4, 1, 4), split=(5, 24),
          states=C(1, 4, 1, 4) if ordered else C(2, 1, 2, 4))
    xs = _bcast(monoid, (3, 107), 24)
    plan, _ = L.plan_reduce(monoid, xs, 1)
    assert len(plan) == 2 and plan[1].kwargs["FROM_STATES"]
    _reduce_check(monoid, xs, 1, "split-K")
    if ordered:                      # lanes folding a vector of consecutive elements
        force(reduce=C(4, 8, 1, 4, vfold=True), split=(5, 24), states=C(1, 4, 1, 4))
        plan, _ = L.plan_reduce(monoid, xs, 1)
        assert plan[0].kwargs["VFOLD"] and plan[0].kwargs["TILE_STATE"].__name__ == "tile_fold"
        _reduce_check(monoid, xs, 1, "vfold split-K")


@interpreter
def test_more_than_three_unmergeable_batch_dims_copy_every_input():
    """The documented fallback: contiguous copies of the broadcast shape."""
    g = torch.Generator().manual_seed(25)
    x = torch.randn(3, 2, 4, 2, 5, 3, generator=g).permute(5, 3, 1, 4, 2, 0)[:, :, :, ::2]
    w = torch.rand(1, 2, 1, 3, 4, 1, generator=g).expand(x.shape)
    plan, _ = L.plan_reduce(ex.WEIGHTED_MEAN, (w, x), 1)
    srcs = plan[0].args[0]
    assert all(s.is_contiguous() for s in srcs) and srcs[0] is not w
    _reduce_check(ex.WEIGHTED_MEAN, (w, x), 1, "copy")


@interpreter
@pytest.mark.parametrize("reverse", (False, True), ids=("forward", "reverse"))
def test_scan_branches(reverse, force, monkeypatch):
    m = ex.LINEAR_RECURRENCE
    xs = _bcast(m, (5, 13), 30)
    assert L.plan_scan(m, xs, 1, reverse)[0][-1].kwargs["SMALL"]
    _scan_check(m, xs, 1, reverse, "small")
    _scan_check(m, _bcast(m, (5, 37), 31), 1, reverse, "short rows")
    _scan_check(m, _bcast(m, (40, 6), 32), 0, reverse, "columns")
    force(scan=C(16, 1, 1, 4), split=(1, 70))
    _scan_check(m, _bcast(m, (2, 70), 33), 1, reverse, "tiles")
    monkeypatch.setattr(L, "LOOKBACK", False)
    force(scan=C(8, 1, 1, 4), split=(5, 24), reduce=C(1, 8, 1, 4))
    xs = _bcast(m, (2, 101), 34)
    plan, _ = L.plan_scan(m, xs, 1, reverse)
    assert len(plan) == 2 and plan[0].kwargs["STATE_OUT"] and plan[1].kwargs["SPLIT"]
    _scan_check(m, xs, 1, reverse, "multi-block")


@interpreter
@pytest.mark.parametrize("prefetch", (False, True), ids=("chunked", "prefetch"))
def test_chunked_scans(prefetch, force):
    m = ex.LINEAR_RECURRENCE
    force(scan=C(64, 1, 1, 4, vec=4, prefetch=prefetch), split=(1, 150))
    xs = _bcast(m, (2, 150), 35)
    plan, _ = L.plan_scan(m, xs, 1)
    assert plan[-1].kwargs["CHUNKED"] and plan[-1].kwargs["PREFETCH"] == prefetch
    _scan_check(m, xs, 1, False, "chunked")


@interpreter
@pytest.mark.parametrize("monoid", (ex.LINEAR_RECURRENCE, ex.COVARIANCE), ids=lambda m: m.name)
def test_look_back_scan(monoid, force, monkeypatch):
    """One pass, chunks of 2 tiles of 32 in ticket order; then only chunk 0 publishing an
    inclusive prefix, so the look-back folds windows of 4 aggregates back to it."""
    ordered = not monoid.commutative
    force(scan=C(32, 1, 1, 4, vec=2), split=(3, 64),
          reduce=C(4, 4, 1, 4, vfold=True) if ordered else C(2, 4, 1, 4))
    monkeypatch.setattr(L, "LOOKBACK_TILES", 2)
    xs = _bcast(monoid, (2, 333), 36)
    plan, _ = L.plan_scan(monoid, xs, 1)
    assert [p.kernel.__name__ for p in plan] == ["lookback_scan_kernel"]
    ref = R.scan_reference(monoid, xs, 1)
    scale = 1.0 + 2 * float(xs[1].abs().sum(1).max()) if ordered else 4.0
    _check(L.launch_scan(monoid, xs, 1), ref, torch.float32, scale, "look-back")
    lookback_aggregates_only(monkeypatch)
    xs = _bcast(monoid, (1, 200), 37)                                    # 13 chunks
    _check(L.launch_scan(monoid, xs, 1), R.scan_reference(monoid, xs, 1), torch.float32,
           1.0 + 2 * float(xs[1].abs().sum(1).max()) if ordered else 4.0, "windows")


@interpreter
def test_segments_forced_narrow_rows(monkeypatch):
    """Segments with the row blocks narrowed (few segments): the segmented template."""
    monkeypatch.setattr(L, "num_sms", lambda device: 64)
    w, x = _bcast(ex.WEIGHTED_MEAN, (300, 40), 38)
    offsets = torch.tensor([0, 120, 120, 300])
    plan, _ = L.plan_segment_reduce(ex.WEIGHTED_MEAN, (w, x), offsets, 0)
    assert plan[0].kwargs["SEGMENTED"] and plan[0].kwargs["ROWS"] == 32
    want = R.segment_reduce_reference(ex.WEIGHTED_MEAN, (w, x), offsets, 0)
    _check(L.launch_segment_reduce(ex.WEIGHTED_MEAN, (w, x), offsets, 0), want,
           torch.float32, 1.0 + 3 * float(x.abs().max()), "segments")


@interpreter
@pytest.mark.parametrize("n", (20, 7), ids=("short", "small"))
def test_ordered_segments_of_many_rows_keep_order(n):
    """Segments of a non-commutative monoid along contiguous rows, few segments over many
    rows (the planner narrows the row blocks to fill the SMs; segments of at most 16
    elements on average take one-lane tiles): each lane still folds consecutive elements
    in order."""
    m = ex.LINEAR_RECURRENCE
    a, b = _inputs(m, (200, 3 * n), seed=39)
    offsets = torch.arange(0, 3 * n + 1, n)
    want = R.segment_reduce_reference(m, (a, b), offsets, 1)
    got = L.launch_segment_reduce(m, (a, b), offsets, 1)
    _check(got, want, torch.float32, 1.0 + 2 * float(b.abs().sum(1).max()), "ordered segments")
    plan, _ = L.plan_segment_reduce(m, (a, b), offsets, 1)
    assert plan[0].kwargs["K"] > 1 and plan[0].kwargs.get("VFOLD"), plan[0].kwargs["K"]


@interpreter
def test_cached_plans_read_the_new_inputs():
    """A replayed plan (same signature) reads the call's own tensors, every one of them."""
    L.plan_cache_clear()
    m = ex.LINEAR_RECURRENCE
    for seed in (40, 41, 42):
        xs = _inputs(m, (3, 50), seed=seed)
        _check(L.launch_scan(m, xs, 1), R.scan_reference(m, xs, 1), torch.float32,
               1.0 + 2 * float(xs[1].abs().sum(1).max()), f"replay {seed}")
    assert L.plan_cache_info()["hits"] >= 2


# --- vector inputs and fields ---------------------------------------------------------------------

from flashfold import Field, Input, Monoid  # noqa: E402

#: a weighted mean of vectors: a scalar weight, a vector value; a vector output and a scalar
VEC_WMEAN = Monoid("vec_wmean", fields=("sw", Field("swx", vector=True)), identity=(0.0, 0.0),
                   inputs=(Input("w"), Input("x", vector=True)),
                   lift=lambda w, x: (w, w * x),
                   combine=lambda a, b: (a.sw + b.sw, a.swx + b.swx),
                   finalize=lambda s: (s.swx / s.sw, s.sw), outputs=("mean", "weight"),
                   commutative=True)


def _vec_check(got, ref, scale, name):
    for i, (o, r) in enumerate(zip(got, ref)):
        assert tuple(o.shape) == tuple(r.shape), (name, i, o.shape, r.shape)
        assert o.is_contiguous(), (name, i)
        assert_close(o, r, torch.float32, scale=scale, name=f"{name} output {i}")


@interpreter
@pytest.mark.parametrize("monoid,width", [(ATTENTION, 8), (ATTENTION2, 5), (ATTENTION2, 1)],
                         ids=["attention-8", "attention2-5", "attention2-1"])
def test_attention_monoid_on_the_kernels(kernels, monoid, width):
    """``(softmax(s) v, logsumexp s)`` over the keys, every causal prefix (forward and
    reverse), segments (one empty), several dims: the per-feature monoid on the kernels
    (the feature axis a batch dim, the scores broadcast along it with stride 0) against
    the float64 reference; ``v`` broadcast over the batch."""
    g = torch.Generator().manual_seed(50 + width)
    s = torch.randn(3, 4, 70, generator=g) * 3
    v = torch.randn(1, 4, 70, width, generator=g)
    scale = 1.0 + float(v.abs().max()) + float(s.abs().max())
    calls = {
        "reduce": lambda: ff.reduce(monoid, (s, v), dim=2),
        "reduce dim 0": lambda: ff.reduce(monoid, (s, v), dim=0),
        "reduce dims (1, 2)": lambda: ff.reduce(monoid, (s, v), dim=(1, 2)),
        "scan": lambda: ff.scan(monoid, (s, v), dim=2),
        "reverse scan": lambda: ff.scan(monoid, (s, v), dim=2, reverse=True),
        "segments": lambda: ff.segment_reduce(monoid, (s, v), torch.tensor([0, 0, 9, 70]),
                                              dim=2),
    }
    for name, call in calls.items():
        got = call()
        with pytest.MonkeyPatch.context() as m:
            m.setattr(api, "_use_kernels", lambda x: False)
            ref = call()                                     # the float64 reference, cast
        _vec_check(got, tuple(r.double() for r in ref), scale, f"{monoid.name} {name}")
        if name == "reduce":
            o, lse = got
            p = torch.softmax(s.double(), -1)
            assert_close(o, (p[..., None] * v.double()).sum(2), torch.float32, scale=scale)
            assert_close(lse, torch.logsumexp(s.double(), -1), torch.float32, scale=scale)


@interpreter
def test_vector_outputs_and_scalar_outputs_of_a_user_monoid(kernels):
    """A vector output (the mean) and a scalar one (the weight, computed once per feature,
    feature 0 returned as a contiguous tensor), rows and columns, a feature axis of 0."""
    g = torch.Generator().manual_seed(60)
    w = torch.rand(5, 40, generator=g) + 0.1
    x = torch.randn(5, 40, 3, generator=g)
    for dim in (1, 0):
        mean, weight = ff.reduce(VEC_WMEAN, (w, x), dim=dim)
        wd, xd = w.double(), x.double()
        assert_close(mean, (wd[..., None] * xd).sum(dim) / wd.sum(dim)[..., None],
                     torch.float32, scale=4.0)
        assert_close(weight, wd.sum(dim), torch.float32, scale=wd.sum(dim))
        assert weight.is_contiguous() and weight.shape == wd.sum(dim).shape
    mean, weight = ff.scan(VEC_WMEAN, (w, x), dim=1)
    assert_close(weight, w.double().cumsum(1), torch.float32, scale=w.double().cumsum(1))
    assert mean.shape == (5, 40, 3)
    mean, weight = ff.reduce(VEC_WMEAN, (w, x[..., :0]), dim=1)
    assert mean.shape == (5, 0) and weight.shape == (5,)
    assert_close(weight, w.double().sum(1), torch.float32, scale=w.double().sum(1))


@interpreter
def test_vector_monoid_plans_read_views(force):
    """The per-feature plan reads the inputs themselves (scores broadcast along the
    feature axis with stride 0: no copy); a forced split-K (two passes) agrees too."""
    g = torch.Generator().manual_seed(61)
    s, v = torch.randn(2, 300, generator=g), torch.randn(2, 300, 16, generator=g)
    per = L._per_feature(ATTENTION2)
    views, d, _ = L._feature_views(ATTENTION2, (s, v), 1)
    assert views[1] is v and views[0].stride() == (300, 1, 0)
    plan, _ = L.plan_reduce(per, views, d)
    assert plan[0].args[0][1] is v and plan[0].args[0][0].stride()[-1] == 0
    force(reduce=C(8, 1, 16, 4), split=(4, 80), states=C(4, 1, 16, 4))
    plan, _ = L.plan_reduce(per, views, d)
    assert len(plan) == 2
    got = L.launch_reduce(ATTENTION2, (s, v), 1)
    ref = R.reduce_reference(ATTENTION2, (s, v), 1)
    _vec_check(got, ref, 1.0 + float(v.abs().max()) + float(s.abs().max()), "split-K")


# --- bad input ------------------------------------------------------------------------------------

def test_bad_input_names_the_argument(kernels):
    w, x = torch.rand(3, 5), torch.randn(3, 5)
    with pytest.raises(ValueError, match=r"x: 'weighted_mean' takes 2 inputs"):
        ff.reduce(ex.WEIGHTED_MEAN, (w, x, x), dim=1)
    with pytest.raises(TypeError, match=r"x: 'linear_recurrence' takes 2 inputs"):
        ff.scan(ex.LINEAR_RECURRENCE, w, dim=1)
    with pytest.raises(ValueError, match=r"x\[1\] \(x\) is on meta"):
        ff.segment_reduce(ex.WEIGHTED_MEAN, (w, x.to("meta")), torch.tensor([0, 3]))
    with pytest.raises(TypeError, match=r"x\[0\] \(w\)"):
        ff.reduce(ex.WEIGHTED_MEAN, (torch.ones(3, 5, dtype=torch.int32), x), dim=1)
    # the launchers take inputs of one shape (the API broadcasts them first)
    with pytest.raises(ValueError, match=r"x\[1\]: shape \(1, 5\)"):
        L.launch_reduce(ex.WEIGHTED_MEAN, (w, x[:1]), 1)
    with pytest.raises(ValueError, match=r"x: 'weighted_mean' takes 2 data inputs, got 1"):
        L.launch_scan(ex.WEIGHTED_MEAN, x, 1)
    # a vector monoid's launchers: the feature axis last, one shape otherwise
    with pytest.raises(ValueError, match=r"x\[0\]: shape \(3, 5\), expected \(3, 4\)"):
        L.launch_reduce(ATTENTION, (x, torch.randn(3, 4, 5)), 1)
    with pytest.raises(ValueError, match=r"x: 'attention' takes 2 data inputs, got 3"):
        L.launch_scan(ATTENTION, (x, x, x), 1)


# --- GPU: the examples at real sizes (the H200) -----------------------------------------------------

gpu = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")


def _affine_f64(a, b, reverse=False):
    """float64 ``B`` of the prefix (``reverse``: suffix) compositions of the maps
    ``h -> a_t h + b_t`` along the last dim of 2-D ``a``, ``b``: ``h_t = a_t h_{t-1} + b_t``
    forward; ``B_t = A_{t+1} b_t + B_{t+1}``, ``A_t = a_t A_{t+1}`` backward."""
    a, b = a.double(), b.double()
    out = torch.empty_like(a)
    B = torch.zeros(a.shape[0], dtype=torch.float64, device=a.device)
    if not reverse:
        for t in range(a.shape[1]):
            B = a[:, t] * B + b[:, t]
            out[:, t] = B
        return out
    A = torch.ones_like(B)
    for t in reversed(range(a.shape[1])):
        B = A * b[:, t] + B
        A = a[:, t] * A
        out[:, t] = B
    return out


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("reverse", (False, True), ids=("forward", "reverse"))
def test_gpu_linear_recurrence_8x1536x16384(reverse):
    """The Mamba-like shape: (8, 1536) rows of 16384 steps, fp32, against a float64 loop
    over the steps, 4096 rows at a time (~2.5 GiB of float64)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (8, 1536, 16384)
    a = 0.9 + 0.1 * torch.rand(shape, device="cuda", generator=g)
    b = torch.randn(shape, device="cuda", generator=g)
    h = ff.scan(ex.LINEAR_RECURRENCE, (a, b), dim=-1, reverse=reverse)
    assert h.shape == shape and h.dtype == torch.float32
    last = ff.reduce(ex.LINEAR_RECURRENCE, (a, b), dim=-1).reshape(-1)
    a2, b2, h2 = (t.reshape(-1, shape[-1]) for t in (a, b, h))
    for r in range(0, a2.shape[0], 4096):
        rows = slice(r, r + 4096)
        want = _affine_f64(a2[rows], b2[rows], reverse)
        scale = 1.0 + _affine_f64(a2[rows], b2[rows].abs(), reverse)
        assert_close(h2[rows], want, "float32", scale=scale, name=f"rows {r}:")
        total = want[:, 0] if reverse else want[:, -1]           # the fold of every step
        assert_close(last[rows], total, "float32", scale=scale[:, 0 if reverse else -1],
                     name=f"reduce rows {r}:")


@pytest.mark.gpu
@gpu
def test_gpu_weighted_mean_16k_x_16k():
    """sum(w x) / sum(w) over rows and over columns of 16K x 16K fp32, and with a row of
    weights broadcast over the rows (a stride-0 view), against float64 sums taken 1024
    rows or columns at a time."""
    g = torch.Generator(device="cuda").manual_seed(1)
    n = 16384
    w = torch.rand(n, n, device="cuda", generator=g) + 0.1
    x = torch.randn(n, n, device="cuda", generator=g)
    row = w[0]
    for name, ws, dim in (("rows", w, 1), ("columns", w, 0), ("broadcast row", row, 1)):
        got = ff.reduce(ex.WEIGHTED_MEAN, (ws, x), dim=dim)
        wb = ws.expand(n, n)
        sw, swx, sa = (torch.empty(n, dtype=torch.float64, device="cuda") for _ in range(3))
        for r in range(0, n, 1024):
            part = (slice(r, r + 1024), slice(None)) if dim == 1 else (slice(None), slice(r, r + 1024))
            wd, xd = wb[part].double(), x[part].double()
            sw[r:r + 1024] = wd.sum(dim)
            swx[r:r + 1024] = (wd * xd).sum(dim)
            sa[r:r + 1024] = (wd * xd).abs().sum(dim)
        assert_close(got, swx / sw, "float32", scale=1.0 + sa / sw, name=name)


@pytest.mark.gpu
@gpu
def test_gpu_attention_monoid_reduce_and_scan():
    """ATTENTION2 over (scores, values) of 4 x 8 heads, 4096 keys, 64 features: the
    reduce is ``(softmax(s) v, logsumexp s)``, the scan every causal prefix of 1024 keys,
    against float64 torch."""
    g = torch.Generator(device="cuda").manual_seed(2)
    s = torch.randn(4, 8, 4096, device="cuda", generator=g) * 3
    v = torch.randn(4, 8, 4096, 64, device="cuda", generator=g)
    o, lse = ff.reduce(ATTENTION2, (s, v), dim=-1)
    p = torch.softmax(s.double(), -1)
    scale = 1.0 + float(v.abs().max())
    assert_close(o, (p[..., None] * v.double()).sum(2), "float32", scale=scale, name="o")
    assert_close(lse, torch.logsumexp(s.double(), -1), "float32", scale=10.0, name="lse")
    s, v = s[..., :1024], v[..., :1024, :]
    o, lse = ff.scan(ATTENTION2, (s, v), dim=-1)
    sd = s.double()
    causal = torch.ones(1024, 1024, dtype=torch.bool, device="cuda").tril()
    p = torch.softmax(sd[..., None, :].expand(*s.shape, 1024).masked_fill(~causal, -float("inf")), -1)
    assert_close(o, p @ v.double(), "float32", scale=scale, name="prefix o")
    assert_close(lse, torch.logcumsumexp(sd, -1), "float32", scale=10.0, name="prefix lse")
