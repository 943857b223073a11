"""Public reductions and scans against torch in float64, on both paths.

``path="reference"``: CPU tensors as users run them (the float64 reference schedules);
``path="kernels"``: the same public calls routed to the generated Triton kernels (under
``TRITON_INTERPRET=1``) by patching the dispatch. Every dtype, awkward sizes, rows that
are all ``-inf``, rows of length 1 and empty dims, keepdim, several dims, and input
validation naming the argument.
"""

import math

import pytest
import torch

import flashfold as ff
from flashfold.api import reductions as api
from flashfold import Field, Input, Monoid, ops
from flashfold.monoids import ATTENTION, LOGSUMEXP2, MAX, SUM, WELFORD
from flashfold.testing import assert_close

import user_monoids as U

#: a lawful monoid that reduce cannot run: its only input is the position
NO_DATA = Monoid("positions_only", fields=(Field("i", dtype="int"),), identity=(0,),
                 inputs=(Input("pos", domain="position"),), lift=lambda pos: (pos,),
                 combine=lambda a, b: (ops.maximum(a.i, b.i),), commutative=True)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NINF = -float("inf")


@pytest.fixture(params=("reference", "kernels"))
def path(request, monkeypatch):
    if request.param == "kernels":
        monkeypatch.setattr(api, "_use_kernels", lambda x: True)
    return request.param


def data(shape, dtype, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def with_edges(x):
    """Row 0 all -inf, row 1 one finite value."""
    x = x.clone()
    x[0] = NINF
    x[1] = NINF
    x[1, -1] = 1.5
    return x


def rowsum_abs(x, dim):
    a = x.double().abs()
    return torch.where(torch.isfinite(a), a, 0).sum(dim, keepdim=True).clamp_min(1.0).numpy()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_logsumexp(path, dtype):
    x = with_edges(data((5, 33), dtype))
    got = ff.logsumexp(x, 1)
    assert got.dtype == dtype and got.shape == (5,)
    assert_close(got, torch.logsumexp(x.double(), 1), dtype, name="logsumexp")
    assert_close(ff.logsumexp(x, 0, keepdim=True), torch.logsumexp(x.double(), 0, keepdim=True),
                 dtype, name="logsumexp dim 0")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax(path, dtype):
    x = with_edges(data((4, 29), dtype))
    got = ff.softmax(x, -1)
    want = torch.softmax(x.double(), -1)
    assert torch.isnan(got[0]).all() and torch.isnan(want[0]).all()   # 0/0, as torch
    assert_close(got, want, dtype, name="softmax")
    assert_close(ff.softmax(x[1:], 0), torch.softmax(x[1:].double(), 0), dtype, name="dim 0")


def test_softmax_of_plus_infinite_entries(path):
    """A row holding ``+inf``: its finite and ``-inf`` entries get 0 (their limit,
    ``exp(x - inf)``), its ``+inf`` entries NaN (``inf / inf``: no limit); a NaN makes its
    whole row NaN; rows without either are untouched. (torch gives the whole row NaN.)"""
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[1.0, inf, 2.0, NINF], [inf, inf, 0.0, 0.0], [1.0, nan, inf, 0.0],
                      [0.0, 1.0, 2.0, 3.0]])
    got = ff.softmax(x, -1)
    nan_at = torch.tensor([[0, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]).bool()
    assert torch.equal(got.isnan(), nan_at), got
    assert torch.equal(got[:2][~nan_at[:2]], torch.zeros(5))
    assert torch.allclose(got[3], torch.softmax(x[3], -1))


@pytest.mark.filterwarnings("error")
def test_softmax_of_length_one_rows_owns_its_memory(path):
    """Rows of length 1: softmax is 1 everywhere, and the result is an ordinary writable
    tensor (the reference path once wrapped a read-only NumPy view: torch warns that
    writing to such a tensor is undefined)."""
    x = data((4, 1), torch.float32)
    got = ff.softmax(x, 1)
    assert torch.equal(got, torch.ones(4, 1))
    got[0, 0] = 5.0
    assert torch.equal(got[1:], torch.ones(3, 1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_var_mean(path, dtype):
    x = data((4, 27), dtype, scale=3.0) + 5
    for corr in (0, 1, 2, None):            # (None: torch's default, 1)
        var, mean = ff.var_mean(x, 1, correction=corr)
        wv, wm = torch.var_mean(x.double(), 1, correction=corr)
        assert_close(mean, wm, dtype, scale=x.double().abs().amax(1).numpy(), name="mean")
        assert_close(var, wv, dtype, scale=(x.double() ** 2).amax(1).numpy(), name="var")
    var, mean = ff.var_mean(x, None)
    wv, wm = torch.var_mean(x.double())
    assert var.shape == () and mean.shape == ()
    assert_close(var, wv, dtype, scale=float((x.double() ** 2).max()), name="var, all dims")


def test_var_mean_edges(path):
    one = data((3, 1), torch.float32)
    var, mean = ff.var_mean(one, 1)                  # n - correction = 0: NaN, as torch
    assert torch.isnan(var).all() and torch.equal(mean, one[:, 0])
    var, mean = ff.var_mean(torch.empty(2, 0), 1)
    assert torch.isnan(var).all() and torch.isnan(mean).all()
    x = with_edges(data((3, 6), torch.float32))     # infinities: outside WELFORD's domain
    var, mean = ff.var_mean(x, 1)
    wv, wm = torch.var_mean(x, 1)
    assert torch.equal(torch.isnan(var), torch.isnan(wv))
    assert not torch.isfinite(mean[:2]).any() and torch.isfinite(mean[2])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_var_of_infinite_input_is_nan_as_torch(path, dtype):
    """An infinite or NaN input gives a NaN variance whatever its position (torch's rule);
    an infinite mean stays infinite. Welford's M2 of [1, inf, 3] is inf, not NaN."""
    inf, nan = float("inf"), float("nan")
    rows = [[1.0, inf, 3.0], [inf, 1.0, 3.0], [1.0, 3.0, -inf], [inf, inf, 2.0],
            [1.0, nan, 3.0], [1.0, 2.0, 4.0]]
    x = torch.tensor(rows).to(dtype)
    for corr in (0, 1):
        var, mean = ff.var_mean(x, 1, correction=corr)
        wv, wm = torch.var_mean(x.float(), 1, correction=corr)
        assert torch.equal(torch.isnan(var), torch.isnan(wv)), (corr, var, wv)
        assert torch.isnan(var[:5]).all() and torch.isfinite(var[5])
        res = ff.reduce(WELFORD, x, 1, correction=corr)
        assert torch.isnan(res.var[:5]).all()
    var, mean = ff.var_mean(torch.tensor([inf]).to(dtype), 0, correction=0)
    assert torch.isnan(var) and mean.item() == inf              # torch: (nan, inf)


@pytest.mark.parametrize("n", [3, 64, 3000], ids=lambda n: f"n{n}")
def test_var_mean_of_finite_input_near_the_largest_float_is_not_nan(path, n):
    """Finite float32 input whose sum (or whose blocks' means' difference) passes the
    largest float: the mean is the float64 mean rounded, the variance the float64 one
    (here past float32: inf), as torch; the kernels gave (nan, nan) (an infinite block
    sum, then ``inf - inf``)."""
    big = 3e38
    rows = [[big] * (n - n // 3) + [-big] * (n // 3),          # the sum overflows
            [big] * (n // 2) + [-big] * (n - n // 2),          # blocks' means 6e38 apart
            [-big] * (n - 1) + [big]]
    x = torch.tensor(rows, dtype=torch.float32)
    for corr in (0, 1):
        var, mean = ff.var_mean(x, 1, correction=corr)
        wv, wm = torch.var_mean(x.double(), 1, correction=corr)
        assert not torch.isnan(mean).any() and not torch.isnan(var).any(), (mean, var)
        assert_close(mean, wm, torch.float32, scale=big, name="mean")
        assert torch.equal(var, wv.float()), (var, wv)             # inf in float32
        st = ff.scan(WELFORD, x, 1, correction=corr)
        assert not torch.isnan(st.mean).any()
        assert_close(st.mean[:, -1], wm, torch.float32, scale=big, name="scan mean")


def test_argmax_keepdim_over_all_dims_as_torch(path):
    x = data((3, 4, 5), torch.float32)
    for f, t in ((ff.argmax, torch.argmax), (ff.argmin, torch.argmin)):
        got, want = f(x, None, keepdim=True), t(x, None, keepdim=True)
        assert got.shape == want.shape == (1, 1, 1) and torch.equal(got, want), f.__name__
        assert f(x, keepdim=True).shape == (1, 1, 1)
        assert torch.equal(f(x, None), t(x, None))
        s = torch.tensor(2.5)
        assert f(s, None, keepdim=True).shape == t(s, None, keepdim=True).shape == ()


def test_argmax_of_an_empty_tensor_over_a_nonempty_dim_as_torch(path):
    """torch returns an empty result when the reduced dim is not empty; it raises only
    when the reduced dim (or the flattened tensor) is empty."""
    for f, t in ((ff.argmax, torch.argmax), (ff.argmin, torch.argmin)):
        for shape, dim, keep in (((0, 5), 1, False), ((0, 5), 1, True), ((3, 0, 2), 2, False),
                                 ((3, 0, 2), -1, True)):
            x = torch.zeros(shape)
            got, want = f(x, dim, keepdim=keep), t(x, dim, keepdim=keep)
            assert got.shape == want.shape and got.dtype == torch.int64, (f.__name__, shape)
        for shape, dim in (((0, 5), 0), ((3, 0), 1), ((0, 5), None), ((0,), 0)):
            with pytest.raises(IndexError, match="^x: "):
                f(torch.zeros(shape), dim)
            with pytest.raises(IndexError):
                t(torch.zeros(shape), dim)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_argmax_argmin(path, dtype):
    x = torch.round(data((6, 31), dtype) * 2) / 2   # ties: lowest index, as torch
    x = with_edges(x)
    x[2, 7] = float("nan")                            # NaN wins, as torch
    for f, t in ((ff.argmax, torch.argmax), (ff.argmin, torch.argmin)):
        assert torch.equal(f(x, 1), t(x, 1)), f.__name__
        assert torch.equal(f(x, 0, keepdim=True), t(x, 0, keepdim=True)), f.__name__
        assert torch.equal(f(x), t(x)), f.__name__ + " flattened"
    with pytest.raises(IndexError, match="x.*size 0"):
        ff.argmax(torch.empty(3, 0), 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cumsum_and_logcumsumexp(path, dtype):
    x = with_edges(data((4, 37), dtype))
    finite = x.clone()
    finite[:2] = 1.0
    got = ff.cumsum(finite, 1)
    assert got.dtype == dtype
    assert_close(got, torch.cumsum(finite.double(), 1), dtype, scale=rowsum_abs(finite, 1),
                 name="cumsum")
    assert_close(ff.cumsum(finite, 0), torch.cumsum(finite.double(), 0), dtype,
                 scale=rowsum_abs(finite, 0), name="cumsum dim 0")
    assert ff.cumsum(finite, 1, dtype=torch.float32).dtype == torch.float32
    assert_close(ff.logcumsumexp(x, 1), torch.logcumsumexp(x.double(), 1), dtype,
                 scale=1 + x.double().abs().nan_to_num(posinf=0, neginf=0).amax(1, keepdim=True).numpy(),
                 name="logcumsumexp")


def test_empty_dims_and_scalars(path):
    e = torch.empty(3, 0)
    assert torch.equal(ff.logsumexp(e, 1), torch.full((3,), NINF))
    assert ff.softmax(e, 1).shape == (3, 0)
    assert ff.cumsum(e, 1).shape == (3, 0) and ff.logcumsumexp(e, 1).shape == (3, 0)
    s = torch.tensor(0.7)
    assert_close(ff.logsumexp(s, 0), torch.logsumexp(s.double(), 0), torch.float32, name="0-d")
    assert ff.softmax(s, 0).item() == 1.0


def test_generic_reduce_and_scan(path):
    x = data((3, 4, 11), torch.float32)
    m = ff.reduce(MAX, x, dim=(0, 2))
    assert torch.equal(m, x.amax(dim=(0, 2)))
    m = ff.reduce(MAX, x, dim=(0, 2), keepdim=True)
    assert torch.equal(m, x.amax(dim=(0, 2), keepdim=True))
    res = ff.reduce(WELFORD, x, 2, correction=0)
    assert res._fields == ("mean", "var")
    wv, wm = torch.var_mean(x.double(), 2, correction=0)
    assert_close(res.var, wv, torch.float32, scale=(x.double() ** 2).amax(2).numpy(), name="var")
    assert_close(ff.scan(SUM, x, 1), torch.cumsum(x.double(), 1), torch.float32,
                 scale=rowsum_abs(x, 1), name="flashfold.scan on a tensor")
    # reverse max-prefix-sum (not commutative): best prefix of x_i, x_{i+1}, ... =
    # max_j sum_{k=i..j} x_k
    y = ff.scan(U.MAX_PREFIX_SUM, x, -1, reverse=True)
    suff = torch.stack([torch.cumsum(x.double()[..., i:], -1).amax(-1) for i in range(11)], -1)
    assert_close(y, suff, torch.float32, scale=rowsum_abs(x, -1), name="reverse max prefix sum")


def test_segment_reduce(path):
    x = data((20, 3), torch.float32)
    off = torch.tensor([0, 4, 4, 20])
    got = ff.segment_reduce(LOGSUMEXP2, x, off)
    want = torch.stack([torch.logsumexp(x[a:b].double(), 0) for a, b in ((0, 4), (4, 4), (4, 20))])
    assert_close(got, want, torch.float32, name="segments")
    got = ff.segment_reduce(SUM, x.T, off, dim=1)
    assert got.shape == (3, 3)


def test_one_input_monoid_takes_its_input_in_a_tuple_too(path):
    """The tuple form of several inputs holds for one: ``(x,)`` is ``x``."""
    x = data((3, 40), torch.float32)
    assert torch.equal(ff.reduce(SUM, (x,), 1), ff.reduce(SUM, x, 1))
    assert torch.equal(ff.scan(SUM, [x], 1), ff.scan(SUM, x, 1))
    with pytest.raises(ValueError, match="^x: 'sum' takes 1 input"):
        ff.reduce(SUM, (x, x), 1)


def test_validation():
    x = torch.randn(3, 4)
    with pytest.raises(TypeError, match="^x: expected a torch.Tensor"):
        ff.logsumexp(x.numpy(), 1)
    with pytest.raises(TypeError, match="^x: .*float32.*int64"):
        ff.cumsum(torch.arange(4), 0)
    with pytest.raises(TypeError, match="^x: .*float64"):
        ff.reduce(SUM, x.double())
    with pytest.raises(IndexError, match="^dim: 2 is out of range"):
        ff.softmax(x, 2)
    with pytest.raises(TypeError, match="^dim: expected an int"):
        ff.scan(SUM, x, 1.0)
    with pytest.raises(ValueError, match="^dim: .*twice"):
        ff.logsumexp(x, (1, -1))
    with pytest.raises(TypeError, match="^monoid: expected a flashfold Monoid"):
        ff.reduce("sum", x)
    with pytest.raises(ValueError, match="^monoid: 'positions_only' has no data input"):
        ff.reduce(NO_DATA, x)
    with pytest.raises(TypeError, match="^x: 'attention' takes 2 inputs"):
        ff.reduce(ATTENTION, x)
    with pytest.raises(TypeError, match="^reverse"):
        ff.scan(SUM, x, 1, reverse=1)
    with pytest.raises(TypeError, match="^correction"):
        ff.var_mean(x, 1, correction="1")
    with pytest.raises(TypeError, match="unknown parameters"):
        ff.reduce(WELFORD, x, 1, ddof=1)
    with pytest.raises(TypeError, match="^dtype"):
        ff.softmax(x, 1, dtype=torch.int32)
    with pytest.raises(TypeError, match="^offsets: expected a 1-D int32/int64"):
        ff.segment_reduce(SUM, x, torch.tensor([0.0, 3.0]))
    with pytest.raises(ValueError, match=r"^offsets: must be non-decreasing indices in \[0, 3\]"):
        ff.segment_reduce(SUM, x, torch.tensor([0, 2, 1]))
    with pytest.raises(ValueError, match=r"^offsets: must be non-decreasing"):
        ff.segment_reduce(SUM, x, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="^offsets: needs at least one"):
        ff.segment_reduce(SUM, x, torch.tensor([], dtype=torch.int64))


def test_monoid_checks_are_kept_per_monoid_and_failures_raise_every_time(monkeypatch):
    """``_check_monoid`` remembers a monoid that passed (by identity, keeping it alive so
    that its id cannot become another object's); one that fails raises on every call."""
    import dataclasses
    import gc
    import weakref
    x = torch.randn(3, 4)
    for _ in range(2):
        with pytest.raises(ValueError, match="^monoid: 'positions_only'"):
            ff.reduce(NO_DATA, x)
        with pytest.raises(TypeError, match="^monoid: expected a flashfold Monoid"):
            ff.reduce("sum", x)
    assert id(NO_DATA) not in api._CHECKED
    good = dataclasses.replace(SUM, name="sum_copy")
    ff.reduce(good, x, 1)
    assert api._CHECKED[id(good)] is good
    kept = weakref.ref(good)
    del good
    gc.collect()
    assert kept() is not None
    monkeypatch.setattr(api, "_CHECKED_SIZE", 2)
    for i in range(4):
        ff.reduce(dataclasses.replace(SUM, name=f"sum_{i}"), x, 1)
        assert len(api._CHECKED) <= 2
    with pytest.raises(ValueError, match="^monoid: 'positions_only'"):
        ff.reduce(NO_DATA, x)


def test_results_do_not_depend_on_the_path(monkeypatch):
    """The kernels and the reference agree beyond the tolerance of the output dtype."""
    x = data((3, 50), torch.bfloat16, seed=3)
    ref = (ff.logsumexp(x, 1), ff.cumsum(x, 1), ff.softmax(x, 1))
    monkeypatch.setattr(api, "_use_kernels", lambda t: True)
    ker = (ff.logsumexp(x, 1), ff.cumsum(x, 1), ff.softmax(x, 1))
    for r, k, name in zip(ref, ker, ("logsumexp", "cumsum", "softmax")):
        assert r.dtype == k.dtype == torch.bfloat16
        scale = rowsum_abs(x, 1) if name == "cumsum" else 1.0
        assert_close(k, r.double(), torch.bfloat16, scale=scale, name=name)
    assert math.isfinite(float(ker[0][0]))


def test_one_exp2_scan_monoid_is_lawful():
    """LOGSUMEXP2_SCAN (logcumsumexp's state) is a commutative monoid whose combine
    finalizes like LOGSUMEXP2's, including the infinite maxima its guard handles (with a
    +inf max the states differ, d = 1 against inf, but both finalize to +inf)."""
    import numpy as np
    from flashfold.algebra.evaluate import numpy_monoid
    report = ff.check_laws(api.LOGSUMEXP2_SCAN)
    assert report.ok, report
    a = numpy_monoid(api.LOGSUMEXP2_SCAN)
    b = numpy_monoid(LOGSUMEXP2)
    m = np.array([NINF, NINF, 3.0, 3.0, float("inf"), float("inf"), -2.0])
    d = np.array([0.0, 0.0, 2.0, 1.5, 1.0, 1.0, 4.0])
    s1 = (m, d)
    s2 = (m[::-1].copy(), d[::-1].copy())
    x, = a.finalize(a.combine(s1, s2))
    y, = b.finalize(b.combine(s1, s2))
    assert_close(x, y, "float64", name="one-exp2 combine, finalized")


# --- finalize parameters and meta tensors ----------------------------------------------

@pytest.mark.parametrize("value", ["a", None, True, [1], "1"], ids=repr)
def test_finalize_parameters_are_numbers_named_in_the_error(path, value):
    x = torch.randn(3, 4)
    with pytest.raises(TypeError, match="^correction: expected a number"):
        ff.reduce(WELFORD, x, 1, correction=value)
    with pytest.raises(TypeError, match="^correction: expected a number"):
        ff.scan(WELFORD, x, 1, correction=value)
    with pytest.raises(TypeError, match="^correction: expected a number"):
        ff.segment_reduce(WELFORD, x, torch.tensor([0, 3]), correction=value)
    with pytest.raises(TypeError, match="unknown parameters"):
        ff.scan(WELFORD, x, 1, ddof=1)
    assert ff.reduce(WELFORD, x, 1, correction=1).var.shape == (3,)   # ints are numbers


def _meta(t, shape, dtype):
    assert t.is_meta and tuple(t.shape) == tuple(shape) and t.dtype == dtype, (t, shape, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_meta_tensors_give_meta_outputs_of_the_right_shape_and_dtype(path, dtype):
    """Every reduction and scan can compute its output's shape and dtype, so a meta input
    gives meta outputs (nothing computed, nothing copied), as torch's own functions do."""
    x = torch.empty(3, 4, 5, device="meta", dtype=dtype)
    _meta(ff.logsumexp(x, 1), (3, 5), dtype)
    _meta(ff.logsumexp(x, (0, 2), keepdim=True), (1, 4, 1), dtype)
    _meta(ff.reduce(SUM, x, None), (), dtype)
    res = ff.reduce(WELFORD, x, -1, correction=0)
    assert res._fields == ("mean", "var")
    _meta(res.mean, (3, 4), dtype)
    _meta(res.var, (3, 4), dtype)
    value, index = ff.reduce(ff.monoids.ARGMAX, x, 2, keepdim=True)
    _meta(value, (3, 4, 1), dtype)
    _meta(index, (3, 4, 1), torch.int64)
    _meta(ff.scan(SUM, x, 1), (3, 4, 5), dtype)
    _meta(ff.scan(U.MAX_PREFIX_SUM, x, 0, reverse=True), (3, 4, 5), dtype)
    _meta(ff.cumsum(x, 2, dtype=torch.float32), (3, 4, 5), torch.float32)
    _meta(ff.logcumsumexp(x, 0), (3, 4, 5), dtype)
    _meta(ff.softmax(x, 1), (3, 4, 5), dtype)
    _meta(ff.softmax(x, 1, dtype=torch.float32), (3, 4, 5), torch.float32)
    var, mean = ff.var_mean(x, 1, correction=0, keepdim=True)
    _meta(var, (3, 1, 5), dtype)
    _meta(mean, (3, 1, 5), dtype)
    _meta(ff.argmax(x, 1), (3, 5), torch.int64)
    _meta(ff.argmin(x, None, keepdim=True), (1, 1, 1), torch.int64)
    _meta(ff.logsumexp(torch.empty((), device="meta", dtype=dtype), 0), (), dtype)
    off = torch.tensor([0, 1, 1, 3], device="meta")
    _meta(ff.segment_reduce(LOGSUMEXP2, x, off, dim=0), (3, 4, 5), dtype)
    _meta(ff.segment_reduce(SUM, x, off[:2], dim=1), (3, 1, 5), dtype)


def test_meta_tensors_are_validated_like_real_ones():
    x = torch.empty(3, 4, device="meta")
    with pytest.raises(IndexError, match="^dim"):
        ff.logsumexp(x, 2)
    with pytest.raises(TypeError, match="^x: .*float64"):
        ff.reduce(SUM, x.double())
    with pytest.raises(TypeError, match="^correction"):
        ff.reduce(WELFORD, x, 1, correction="a")
    with pytest.raises(TypeError, match="unknown parameters"):
        ff.reduce(WELFORD, x, 1, ddof=1)
    with pytest.raises(IndexError, match="^x: "):
        ff.argmax(torch.empty(3, 0, device="meta"), 1)
    with pytest.raises(ValueError, match="^offsets: on cpu"):
        ff.segment_reduce(SUM, x, torch.tensor([0, 3]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_torch_rules_on_the_gpu():
    """The rules above on CUDA tensors (the generated kernels compiled for the device)."""
    inf = float("inf")
    x = torch.tensor([[1.0, inf, 3.0], [inf, 1.0, 3.0], [1.0, 2.0, 4.0]], device="cuda")
    var, mean = ff.var_mean(x, 1)
    wv, wm = torch.var_mean(x, 1)
    assert torch.equal(torch.isnan(var), torch.isnan(wv)) and torch.isnan(var[:2]).all()
    y = torch.randn(64, 300, device="cuda")
    long = torch.randn(1, 1 << 20, device="cuda")
    long[0, 12345] = inf
    assert torch.isnan(ff.var_mean(long, 1)[0]).all()            # across tiles too
    assert torch.equal(ff.argmax(y, None, keepdim=True), torch.argmax(y, None, keepdim=True))
    assert ff.argmax(torch.zeros(0, 5, device="cuda"), 1).shape == (0,)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_nan_reaches_max_min_and_logsumexp(path, dtype):
    """A NaN in a row makes its max, min and logsumexp NaN, as torch's, and no other
    row's. The kernels' block lifts reduce with ``rmax`` / ``rmin``, which once lowered to
    ``tl.max`` / ``tl.min``: those keep the non-NaN operand (PTX ``max.f32``, and the
    interpreter alike) and gave the row's largest number instead."""
    x = data((5, 300), dtype)
    x[1, 7] = float("nan")
    x[3, 299] = float("nan")                                  # in the last, ragged tile
    for f, t in ((lambda x, d: ff.reduce(MAX, x, d), torch.amax),
                 (lambda x, d: ff.reduce(ff.monoids.MIN, x, d), torch.amin),
                 (ff.logsumexp, torch.logsumexp)):
        got = f(x, 1)
        got = got[0] if isinstance(got, tuple) else got
        want = t(x.double(), 1)
        assert torch.equal(torch.isnan(got), torch.isnan(want)), (f, got, want)
        assert torch.isnan(got[[1, 3]]).all() and not torch.isnan(got[[0, 2, 4]]).any()


# --- gradients ------------------------------------------------------------------------------

#: (name, flashfold call, torch call): the differentiable conveniences
GRAD_CASES = [
    ("logsumexp", lambda t: ff.logsumexp(t, 1), lambda t: torch.logsumexp(t, 1)),
    ("logsumexp-dims-keepdim", lambda t: ff.logsumexp(t, (0, 2), keepdim=True),
     lambda t: torch.logsumexp(t, (0, 2), keepdim=True)),
    ("softmax", lambda t: ff.softmax(t, -1), lambda t: torch.softmax(t, -1)),
    ("softmax-dim0", lambda t: ff.softmax(t, 0), lambda t: torch.softmax(t, 0)),
    ("var_mean", lambda t: ff.var_mean(t, 1), lambda t: torch.var_mean(t, 1)),
    ("var_mean-all-correction0", lambda t: ff.var_mean(t, None, correction=0, keepdim=True),
     lambda t: torch.var_mean(t, None, correction=0, keepdim=True)),
    ("cumsum", lambda t: ff.cumsum(t, 2), lambda t: torch.cumsum(t, 2)),
    ("logcumsumexp", lambda t: ff.logcumsumexp(t, 1), lambda t: torch.logcumsumexp(t, 1)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name, fn, ref", GRAD_CASES, ids=[c[0] for c in GRAD_CASES])
def test_gradients_match_float64_autograd(path, name, fn, ref, dtype):
    """The torch-like functions are differentiable: the gradient of a random linear
    function of their outputs against float64 torch autograd, in x's dtype."""
    x = data((3, 37, 5), dtype, seed=3)
    leaf = x.clone().requires_grad_()
    outs = fn(leaf)
    outs = outs if isinstance(outs, tuple) else (outs,)
    x64 = x.double().requires_grad_()
    want = ref(x64)
    want = want if isinstance(want, tuple) else (want,)
    g = torch.Generator().manual_seed(4)
    gs = [torch.randn(w.shape, generator=g, dtype=torch.float64) for w in want]
    (got,) = torch.autograd.grad(outs, leaf, [gg.to(o.dtype) for gg, o in zip(gs, outs)])
    (exp,) = torch.autograd.grad(want, x64, gs)
    assert got.dtype == dtype
    assert_close(got, exp, dtype, scale=exp.abs().max().item(), name=f"d{name}")


def test_gradients_mix_with_other_terms_and_of_a_masked_row_are_zero():
    """A term of a larger loss contributes its gradient (no silent detach); a row that is
    all ``-inf`` (logsumexp ``-inf``) gets zero gradients, as attention's masked rows."""
    w = data((3, 4), torch.float32).requires_grad_()
    (ff.logsumexp(w, 1).sum() + ff.softmax(w, 0)[0].sum() + (w ** 2).sum()).backward()
    w64 = w.detach().double().requires_grad_()
    (torch.logsumexp(w64, 1).sum() + torch.softmax(w64, 0)[0].sum() + (w64 ** 2).sum()).backward()
    assert_close(w.grad, w64.grad, torch.float32, name="dw")
    x = torch.tensor([[NINF, NINF], [0.0, 1.0]], requires_grad=True)
    ff.logsumexp(x, 1).sum().backward()
    assert torch.equal(x.grad[0], torch.zeros(2))
    # logcumsumexp: the -inf elements (a prefix without mass) get 0, the others torch's
    y = torch.tensor([[NINF, NINF, 0.0, 1.0, -30.0, 5.0]], requires_grad=True)
    g = torch.tensor([[1.0, -2.0, 3.0, -4.0, 5.0, 0.5]])
    ff.logcumsumexp(y, 1).backward(g)
    y64 = y.detach().double().requires_grad_()
    torch.logcumsumexp(y64, 1).backward(g.double())
    assert torch.equal(y.grad[0, :2], torch.zeros(2))
    assert_close(y.grad[0, 2:], y64.grad[0, 2:], torch.float32, name="dy")
    assert_close(x.grad[1], torch.softmax(torch.tensor([0.0, 1.0]).double(), 0), torch.float32,
                 name="dx")


@pytest.mark.parametrize("call", [
    lambda x: ff.reduce(SUM, x, 1),
    lambda x: ff.reduce(WELFORD, x, 1),
    lambda x: ff.scan(SUM, x, 1),
    lambda x: ff.segment_reduce(MAX, x, torch.tensor([0, 2, 4]), 1),
], ids=["reduce", "reduce-welford", "scan", "segment_reduce"])
def test_general_monoids_refuse_inputs_that_require_grad(call):
    """The general entry points have no backward: they raise rather than return a result
    detached from the graph; under no_grad, or on positions (argmax), they run."""
    x = data((3, 4), torch.float32).requires_grad_()
    with pytest.raises(ValueError, match=r"^x: requires grad, but .* has no backward"):
        call(x)
    with torch.no_grad():
        call(x)
    call(x.detach())
    assert torch.equal(ff.argmax(x, 1), torch.argmax(x, 1))


def test_keepdim_must_be_a_bool():
    x = data((3, 4), torch.float32)
    for call in (lambda: ff.logsumexp(x, 1, keepdim="no"),
                 lambda: ff.var_mean(x, 1, keepdim=1),
                 lambda: ff.reduce(SUM, x, 1, keepdim=None)):
        with pytest.raises(TypeError, match="keepdim must be a bool"):
            call()


def test_segment_reduce_unsafe_must_be_a_bool():
    """``unsafe`` skips the offsets check, so only ``True`` skips it: a truthy string or
    number (``unsafe="no"``) used to skip it too, letting offsets past the dim through."""
    x = data((3, 4), torch.float32)
    for value in ("no", 0, 1, None):
        with pytest.raises(TypeError, match="^unsafe must be a bool"):
            ff.segment_reduce(SUM, x, torch.tensor([0, 2, 3]), unsafe=value)


@pytest.mark.parametrize("name, outputs, fields", [
    ("my-sum", None, ("out0", "out1")),
    ("2 sums", ("total", "count"), ("total", "count")),
    ("sums", ("class", "_n"), ("out0", "out1")),
    ("x" * 300, ("total", "count"), ("total", "count")),
], ids=["hyphen", "digit-space", "keyword-underscore-outputs", "long"])
def test_results_of_any_monoid_name_and_output_names_are_named_tuples(path, name, outputs,
                                                                       fields):
    """A monoid's name is free text and an output name that a named tuple cannot take is
    ``out{i}``: reduce used to raise namedtuple's ValueError for ``"my-sum"`` and for
    outputs named ``class`` or ``_n``, and the kernels an OSError for a long name (a file
    name of the generated module)."""
    m = Monoid(name, fields=("s", "n"), identity=(0.0, 0.0), lift=lambda x: (x, 1.0),
               combine=lambda a, b: (a.s + b.s, a.n + b.n), finalize=lambda st: (st.s, st.n),
               outputs=outputs, commutative=True)
    x = data((3, 5), torch.float32)
    got = ff.reduce(m, x, 1)
    assert got._fields == fields and type(got).__name__.endswith("Result")
    assert_close(got[0], x.double().sum(1), torch.float32, name="sum")
    assert torch.equal(got[1], torch.full((3,), 5.0))
    assert ff.scan(m, x, 1)[1].shape == x.shape


def test_dims_as_numpy_integers_and_a_scalars_dim_are_checked_as_torch_checks_them():
    import numpy as np
    x = data((3, 4), torch.float32)
    assert torch.equal(ff.logsumexp(x, np.int64(1)), ff.logsumexp(x, 1))
    assert torch.equal(ff.softmax(x, np.int32(-1)), ff.softmax(x, -1))
    s = torch.tensor(2.0)
    assert ff.softmax(s, 0).item() == ff.softmax(s, -1).item() == 1.0
    with pytest.raises(IndexError, match="dim: 5 is out of range"):
        ff.softmax(s, 5)
    with pytest.raises(TypeError, match="dim: expected an int, got str"):
        ff.softmax(s, "a")
    # a tuple of dims of a 0-d tensor too (it used to be accepted whatever it held)
    assert ff.reduce(SUM, s, (0,)).item() == ff.reduce(SUM, s, (-1,)).item() == 2.0
    with pytest.raises(IndexError, match="dim: 5 is out of range"):
        ff.reduce(SUM, s, (5,))
    with pytest.raises(TypeError, match="dim: expected an int, got str"):
        ff.reduce(SUM, s, ("a",))
    with pytest.raises(ValueError, match="names a dim twice"):
        ff.reduce(SUM, s, (0, -1))


def test_scan_of_a_list_of_tensors_is_the_tensor_scan():
    """``flashfold.scan`` routes a list of tensors as a tuple (``reduce`` takes both); it
    used to run the reference scan over axis 0, returning prefix states."""
    s, v = data((2, 5), torch.float32), data((2, 5, 3), torch.float32)
    a, b = ff.scan(ATTENTION, (s, v)), ff.scan(ATTENTION, [s, v])
    assert type(a) is type(b) and all(torch.equal(x, y) for x, y in zip(a, b))
