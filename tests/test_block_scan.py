"""Block scans: a monoid's prefix states of a whole tile at once (the twist once per tile).

LOGSUMEXP's block scan refers every prefix of a block to the block's max,
``(M, sum_{j<=i} exp(x_j - M))``: one exponential and one addition per element instead of
a rescaling combine. The law it must obey is the scan's: combined with any carry, its
states finalize to the sequential scan's values wherever ``scan_exact`` holds, and
``scan_exact`` must fail where the shared reference lost digits (a prefix far below the
block's max). The kernels use it inside a tile and rescan inexact tiles with the combine;
those tests run under ``TRITON_INTERPRET=1`` against the float64 reference.
"""

import numpy as np
import pytest
import torch

import flashfold as ff
import flashfold.monoids as M
from flashfold import ops
from flashfold.algebra.evaluate import numpy_monoid
from flashfold.algebra.monoid import Monoid
from flashfold.api import reductions as api
from flashfold.kernels.reduce import launch as L
from flashfold.kernels.reduce import reference as R
from flashfold.testing import assert_close

LSE = (M.LOGSUMEXP, M.LOGSUMEXP2, api.LOGSUMEXP2_SCAN)
C = L.Config


def _sequential(monoid, carry, xs):
    """Finalized ``carry ⊕ x_0 ⊕ ... ⊕ x_i`` for every i, folded one element at a time."""
    ex = numpy_monoid(monoid)
    s, out = carry, []
    for x in xs:
        s = ex.combine(s, ex.lift([np.asarray([x])], None))
        out.append(ex.finalize(s)[0][0])
    return np.array(out)


def _block(monoid, carry, xs, valid=None):
    """Finalized ``carry ⊕ block_scan(xs)_i`` and the ``scan_exact`` flags."""
    ex = numpy_monoid(monoid)
    states = ex.block_scan([np.asarray(xs, dtype=np.float64)], valid)
    n = len(xs)
    c = tuple(np.broadcast_to(f, (n,)) for f in carry)
    combined = ex.combine(c, states)
    return ex.finalize(combined)[0], ex.scan_exact(combined)


@pytest.mark.parametrize("monoid", LSE, ids=lambda m: m.name)
@pytest.mark.parametrize("carry_kind", ("identity", "below", "above", "far_above"))
def test_block_scan_matches_the_sequential_scan(monoid, carry_kind):
    rng = np.random.default_rng(0)
    xs = rng.normal(size=40) * 3
    carries = {"identity": numpy_monoid(monoid).identity((1,)),
               "below": numpy_monoid(monoid).lift([np.array([-5.0])], None),
               "above": numpy_monoid(monoid).lift([np.array([12.0])], None),
               "far_above": numpy_monoid(monoid).lift([np.array([400.0])], None)}
    carry = carries[carry_kind]
    got, exact = _block(monoid, carry, xs)
    assert exact.all()                        # ordinary data takes the fast path
    want = _sequential(monoid, carry, xs)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("monoid", LSE, ids=lambda m: m.name)
def test_scan_exact_flags_prefixes_that_underflow(monoid):
    """An ascending block: its first prefixes are e^-300 of the block's max, below what a
    shared reference can hold, so they are flagged (and a carry that dominates them makes
    them exact again)."""
    xs = np.linspace(0.0, 300.0, 31)
    got, exact = _block(monoid, numpy_monoid(monoid).identity((1,)), xs)
    assert not exact[0] and exact[-1]
    want = _sequential(monoid, numpy_monoid(monoid).identity((1,)), xs)
    np.testing.assert_allclose(got[exact], want[exact], rtol=1e-13)
    carry = numpy_monoid(monoid).lift([np.array([299.0])], None)
    got, exact = _block(monoid, carry, xs)
    assert exact.all()
    np.testing.assert_allclose(got, _sequential(monoid, carry, xs), rtol=1e-13)


@pytest.mark.parametrize("monoid", LSE, ids=lambda m: m.name)
def test_scan_exact_on_infinities_and_masks(monoid):
    ex = numpy_monoid(monoid)
    ident = ex.identity((1,))
    ninf = -np.inf
    got, exact = _block(monoid, ident, [ninf, ninf, ninf])
    assert exact.all() and np.all(got == ninf)          # empty prefixes: -inf, no NaN
    _, exact = _block(monoid, ident, [0.0, np.inf, 1.0])
    assert not exact.any()                               # +inf max: rescanned by the combine
    _, exact = _block(monoid, ident, [0.0, np.nan, 1.0])
    assert not exact[1:].any()
    valid = np.array([True, True, False, False])
    got, exact = _block(monoid, ident, [1.0, 2.0, 50.0, np.inf], valid)
    assert exact[:2].all()
    np.testing.assert_allclose(got[:2], _sequential(monoid, ident, [1.0, 2.0]), rtol=1e-13)


def test_block_scan_needs_scan_exact():
    kw = dict(fields=("s",), identity=(0.0,), lift=lambda x: (x,),
              combine=lambda a, b: (a.s + b.s,))
    with pytest.raises(ValueError, match="scan_exact"):
        Monoid("bad", block_scan=lambda x, valid: (ops.scan_sum(ops.where(valid, x, 0.0)),), **kw)
    good = Monoid("prefix_sum", block_scan=lambda x, valid: (ops.scan_sum(ops.where(valid, x, 0.0)),),
                  scan_exact=lambda s: s.s == s.s, **kw)
    got, exact = _block(good, numpy_monoid(good).identity((1,)), [1.0, 2.0, 3.0])
    assert exact.all() and np.array_equal(got, [1.0, 3.0, 6.0])


def test_transport_carries_the_block_scan():
    """LOGSUMEXP2's block scan is the transported one rewritten with exp2; its scan_exact
    is LOGSUMEXP's through psi^-1."""
    assert M.LOGSUMEXP2.block_scan_graph is not None
    assert M.LOGSUMEXP2.scan_exact_graph is not None
    xs = np.random.default_rng(1).normal(size=25)
    a, _ = _block(M.LOGSUMEXP, numpy_monoid(M.LOGSUMEXP).identity((1,)), xs)
    b, _ = _block(M.LOGSUMEXP2, numpy_monoid(M.LOGSUMEXP2).identity((1,)), xs)
    np.testing.assert_allclose(a, b, rtol=1e-13)


def test_scan_sum_derivative():
    """``csum`` is linear: its tangent is the prefix sum of the tangents."""
    from flashfold.algebra.autodiff import derivative
    from flashfold.algebra.ir import Var, trace
    from flashfold.algebra.lower import compile_graph
    g = trace(lambda x: ops.scan_sum(x * x), [Var("x")], "sq_prefix")
    d = compile_graph(derivative(g, "x"), "numpy")
    x = np.array([1.0, -2.0, 3.0])
    value, dx = d(x)
    assert np.allclose(value, np.cumsum(x * x)) and np.allclose(dx, np.cumsum(2 * x))


# --- the kernels (TRITON_INTERPRET=1) --------------------------------------------------------

def _rows(kind, n, dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, n, generator=g)
    if kind == "ascending":                    # a tile of 64 spans 126 nats: rescanned
        x = torch.arange(n, dtype=torch.float32).expand(4, n) * 2.0
        x = x + torch.randn(4, n, generator=g) * 0.1
    elif kind == "descending":                 # the reverse scan's ascending case
        x = torch.arange(n, 0, -1, dtype=torch.float32).expand(4, n) * 2.0
    elif kind == "specials":
        x[0] = -float("inf")
        x[1, : n // 3] = -float("inf")
        x[2, n // 2] = float("inf")
        x[3, n // 4] = float("nan")
    elif kind == "huge":
        x = x * 1e4
    return x.to(dtype)


def _check(x, reverse, name):
    monoid = api.LOGSUMEXP2_SCAN
    out = L.launch_scan(monoid, x, 1, reverse)[0]
    ref = R.scan_reference(monoid, x, 1, reverse)[0]
    assert_close(out, ref, x.dtype, scale=R.error_scale(monoid, x, 1), name=name)


@pytest.mark.parametrize("kind", ("random", "ascending", "descending", "specials", "huge"))
@pytest.mark.parametrize("reverse", (False, True), ids=("forward", "reverse"))
def test_kernel_block_scan(kind, reverse, force_scan):
    """Tiles of 64 over rows of 300 (four full tiles, the carry, a masked tail), with data
    that keeps the fast path, forces rescans (ascending forward, descending reverse), and
    special values."""
    force_scan(C(64, 1, 1, 4), split=(1, 300))
    x = _rows(kind, 300, torch.float32)
    plan, _ = L.plan_scan(api.LOGSUMEXP2_SCAN, x, 1, reverse)
    assert plan[-1].kwargs["BLOCK_SCAN"] is not None
    _check(x, reverse, f"{kind} reverse={reverse}")


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_kernel_block_scan_half(dtype):
    """The default plan of a row long enough for the block path, 16-bit inputs."""
    x = _rows("random", 700, dtype)
    _check(x, False, str(dtype))


def test_default_plan_uses_the_block_scan():
    """logcumsumexp's long rows take the block scan (no chunked lanes); a monoid without
    one (SUM), or a reverse scan of a non-commutative one, keeps the combine's scan."""
    x = torch.empty(64, 16384)
    kw = L.plan_scan(api.LOGSUMEXP2_SCAN, x, 1)[0][-1].kwargs
    assert kw["BLOCK_SCAN"] is not None and not kw["CHUNKED"]
    assert "BLOCK_SCAN" not in L.plan_scan(M.SUM, x, 1)[0][-1].kwargs
    # "the last element so far" (a flag marks the identity): not commutative, and its
    # block scan is the elements themselves
    last = Monoid("last", fields=("v", "seen"), identity=(0.0, 0.0),
                  lift=lambda v: (v, 1.0),
                  combine=lambda p, q: (ops.where(q.seen > 0, q.v, p.v), ops.maximum(p.seen, q.seen)),
                  block_scan=lambda v, valid: (v, ops.where(valid, 1.0, 0.0)),
                  scan_exact=lambda s: s.seen >= 0.0)
    assert L.plan_scan(last, x, 1)[0][-1].kwargs["BLOCK_SCAN"] is not None
    assert "BLOCK_SCAN" not in L.plan_scan(last, x, 1, True)[0][-1].kwargs


def test_public_logcumsumexp_rescans_ascending_rows():
    """Through the public function (its default plan on a CPU tensor routed to the kernels):
    an ascending row of 3000 (tiles of 2048) against torch in float64."""
    x = torch.arange(3000, dtype=torch.float32)[None] * 0.5
    with_kernels = api._use_kernels
    api._use_kernels = lambda t: True
    try:
        out = ff.logcumsumexp(x, 1)
    finally:
        api._use_kernels = with_kernels
    want = torch.logcumsumexp(x.double(), 1)
    assert_close(out, want, torch.float32, scale=1.0 + x.abs().max().item(), name="ascending")


@pytest.fixture
def force_scan(monkeypatch):
    def apply(scan, split):
        monkeypatch.setattr(L, "scan_config", lambda g, e, *a: scan)
        monkeypatch.setattr(L, "split_plan", lambda g, tile, n, sms, min_tiles=2: split)
    return apply
