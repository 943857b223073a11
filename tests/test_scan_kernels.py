"""The generated scan kernels against the float64 reference scan (Hillis-Steele).

Under ``TRITON_INTERPRET=1`` at small awkward sizes, for every built-in and the
non-commutative user monoids: single tile, several tiles with the state carried across
them and a masked tail, reverse scans (reversed loads and stores, swapped combine),
short rows (many rows per program), columns, and the multi-block scan (chunk states from
the reduce kernel, then each chunk scanned from the in-order fold of the chunks before
it, or after it when reversed).
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashfold as ff
import flashfold.monoids as M
from flashfold.kernels.reduce import launch as L
from plan_forcing import force, lookback_aggregates_only  # noqa: F401  (force: a fixture)
from flashfold.kernels.reduce import reference as R
from flashfold.testing import assert_close

import user_monoids as U

ALL = (M.SUM, M.MAX, M.MIN, M.LOGSUMEXP, M.LOGSUMEXP2, M.WELFORD, M.ARGMAX, M.ARGMIN,
       U.MINMAX, U.MATMUL2, U.MAX_PREFIX_SUM)
EXACT = {"max", "min", "argmax", "argmin", "minmax"}
C = L.Config


def sample(monoid, shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    sigma = 0.1 if monoid is U.MATMUL2 else 1.0
    x = torch.randn(*shape, generator=g) * sigma
    if monoid.name in EXACT:
        x = torch.round(x * 2) / 2
    return x.to(dtype)


def check(monoid, outs, x, dim, reverse=False, name=""):
    ref = R.scan_reference(monoid, x, dim, reverse)
    scale = R.error_scale(monoid, x, dim)
    assert len(outs) == len(ref)
    for i, (o, r) in enumerate(zip(outs, ref)):
        label = f"{name} {monoid.name} reverse={reverse} output {i}"
        assert tuple(o.shape) == tuple(x.shape), label
        if not r.dtype.is_floating_point:
            assert o.dtype == torch.int64 and torch.equal(o, r), label
        elif monoid.name in EXACT:
            assert torch.equal(o.double(), r.to(x.dtype).double()), label
        else:
            assert_close(o, r, o.dtype, scale=scale, name=label)


@pytest.mark.parametrize("n", (13, 37), ids=("small", "short"))
@pytest.mark.parametrize("reverse", (False, True), ids=("forward", "reverse"))
@pytest.mark.parametrize("monoid", ALL, ids=lambda m: m.name)
def test_short_rows(monoid, reverse, n):
    """(5, 13): one row per thread, folded in registers (SMALL); (5, 37): one [64, ROWS]
    tile per program, scanned along axis 0, tail masked."""
    x = sample(monoid, (5, n))
    plan, _ = L.plan_scan(monoid, x, 1, reverse)
    assert plan[-1].kwargs["SMALL"] == (n <= L.SMALL_N)
    check(monoid, L.launch_scan(monoid, x, 1, reverse), x, 1, reverse, "short rows")


@pytest.mark.parametrize("reverse", (False, True), ids=("forward", "reverse"))
@pytest.mark.parametrize("monoid", ALL, ids=lambda m: m.name)
def test_tiles_carry_the_state(monoid, reverse, force):
    """Tiles of 16 along a row of 70: four full tiles, carry, masked tail."""
    force(scan=C(16, 1, 1, 4), split=(1, 70))
    x = sample(monoid, (2, 70), seed=1)
    check(monoid, L.launch_scan(monoid, x, 1, reverse), x, 1, reverse, "tiles")


@pytest.mark.parametrize("monoid", ALL, ids=lambda m: m.name)
def test_chunked_lanes(monoid, force):
    """Forward chunked scan: 4 lanes x 4 vectors x 4 elements = tiles of 64; a row of 150
    is two full tiles (carry) and a masked tail that ends inside a lane."""
    force(scan=C(64, 1, 1, 4, vec=4), split=(1, 150))
    x = sample(monoid, (2, 150), seed=7)
    plan, _ = L.plan_scan(monoid, x, 1)
    assert plan[-1].kwargs["CHUNKED"]
    check(monoid, L.launch_scan(monoid, x, 1), x, 1, False, "chunked")


@pytest.mark.parametrize("n", (40, 64, 150, 192), ids=("no-full-tile", "one-tile", "tail", "three-tiles"))
@pytest.mark.parametrize("monoid", (M.SUM, M.LOGSUMEXP2, M.ARGMAX, U.MATMUL2), ids=lambda m: m.name)
def test_chunked_prefetch(monoid, n, force):
    """The chunked scan that loads the next full tile before scanning the current one
    (PREFETCH): rows with no full tile of 64 (the first load masked, nothing scanned in
    the loop), exactly one, two and a tail, three (the last prefetch is skipped)."""
    force(scan=C(64, 1, 1, 4, vec=4, prefetch=True), split=(1, n))
    x = sample(monoid, (3, n), seed=11)
    plan, _ = L.plan_scan(monoid, x, 1)
    assert plan[-1].kwargs["CHUNKED"] and plan[-1].kwargs["PREFETCH"]
    check(monoid, L.launch_scan(monoid, x, 1), x, 1, False, "chunked prefetch")


def test_chunked_multi_block(force, monkeypatch):
    """Chunked scan of chunks (multi-block): carries from the folded chunk states."""
    monkeypatch.setattr(L, "LOOKBACK", False)
    force(scan=C(32, 1, 1, 4, vec=2), split=(4, 40), reduce=C(1, 8, 1, 4))
    for monoid in (M.LOGSUMEXP2, U.MAX_PREFIX_SUM):
        x = sample(monoid, (3, 150), seed=8)
        check(monoid, L.launch_scan(monoid, x, 1), x, 1, False, "chunked multi-block")


@pytest.mark.parametrize("reverse", (False, True), ids=("forward", "reverse"))
@pytest.mark.parametrize("monoid", ALL, ids=lambda m: m.name)
def test_multi_block(monoid, reverse, force, monkeypatch):
    """Reduce-then-scan: chunks of 24 of a row of 101 (5 chunks), chunk states, then
    carries in order (forward scans use the look-back unless it is switched off)."""
    monkeypatch.setattr(L, "LOOKBACK", False)
    ordered = not monoid.commutative
    force(scan=C(8, 1, 1, 4), split=(5, 24),
          reduce=C(1, 8, 1, 4) if ordered else C(2, 4, 1, 4))
    x = sample(monoid, (2, 101), seed=2)
    plan, _ = L.plan_scan(monoid, x, 1, reverse)
    assert len(plan) == 2 and plan[0].kwargs["STATE_OUT"] and plan[1].kwargs["SPLIT"]
    check(monoid, L.launch_scan(monoid, x, 1, reverse), x, 1, reverse, "multi-block")


def test_multi_block_carry_spans_several_state_tiles(force, monkeypatch):
    """More chunks than one PBLOCK of states: the carry loop folds several tiles."""
    monkeypatch.setattr(L, "LOOKBACK", False)
    force(scan=C(4, 1, 1, 4), split=(11, 4), reduce=C(1, 4, 1, 4))
    orig = L._p2
    monkeypatch.setattr(L, "_p2", lambda n: min(orig(n), 4))
    x = sample(U.MATMUL2, (1, 41), seed=3)
    for reverse in (False, True):
        check(U.MATMUL2, L.launch_scan(U.MATMUL2, x, 1, reverse), x, 1, reverse, "pblock")


@pytest.mark.parametrize("monoid", (M.SUM, M.LOGSUMEXP2, U.MAX_PREFIX_SUM, M.ARGMAX),
                         ids=lambda m: m.name)
def test_columns_and_strides(monoid):
    """Scanning dim 0 (rows of the tile contiguous), a middle dim, a transposed view."""
    base = sample(monoid, (9, 3, 10), seed=4)
    for name, (x, dim) in {"dim0": (base, 0), "middle": (base, 1),
                           "transposed": (base.transpose(0, 2), 2)}.items():
        for reverse in (False, True):
            check(monoid, L.launch_scan(monoid, x, dim, reverse), x, dim, reverse, name)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_half_inputs(dtype, force):
    force(scan=C(16, 1, 1, 4), split=(1, 50))
    for monoid in (M.SUM, M.LOGSUMEXP2):
        x = sample(monoid, (2, 50), dtype, seed=5)
        check(monoid, L.launch_scan(monoid, x, 1), x, 1, False, str(dtype))


def test_edge_rows():
    ninf = -float("inf")
    x = torch.tensor([[ninf, ninf, ninf], [ninf, 2.0, ninf], [1.0, ninf, 3.0]])
    for monoid in (M.SUM, M.MAX, M.LOGSUMEXP, M.LOGSUMEXP2, M.ARGMAX):
        for reverse in (False, True):
            check(monoid, L.launch_scan(monoid, x, 1, reverse), x, 1, reverse, "-inf")
    one = torch.randn(4, 1)
    check(M.LOGSUMEXP2, L.launch_scan(M.LOGSUMEXP2, one, 1), one, 1, False, "length 1")
    empty = torch.empty(3, 0)
    outs = L.launch_scan(M.SUM, empty, 1)
    assert outs[0].shape == (3, 0)


def test_reverse_scan_keeps_operand_order():
    """A reverse scan of a non-commutative monoid is x_i ⊕ (x_{i+1} ⊕ ...), not the
    reversed product: compare with a sequential left fold of each suffix."""
    x = sample(U.MATMUL2, (1, 9), seed=6) * 5
    out = L.launch_scan(U.MATMUL2, x, 1, True)
    xs = x[0].double().numpy()
    for i in (0, 4, 8):
        want = ff.fold(U.MATMUL2, xs[i:], "sequential")
        scale = float(np.prod(1.0 + np.abs(xs[i:])) ** 2)
        for k, field in enumerate(U.MATMUL2.field_names):
            assert_close(out[k][0, i], getattr(want, field), "float32", scale=scale,
                         name=f"suffix {field} at {i}")


@pytest.mark.parametrize("monoid", (M.SUM, M.LOGSUMEXP2, M.ARGMAX, U.MAX_PREFIX_SUM, U.MATMUL2),
                         ids=lambda m: m.name)
def test_decoupled_look_back(monoid, force, monkeypatch):
    """Few long rows, forward: one pass, chunks of 2 tiles of 32, ticket order, each chunk
    folded, published, prefixed by the look-back, scanned again; the last chunk partial.
    (The interpreter runs programs in ticket order, so it checks the algebra of the
    look-back, not its concurrency; the benchmark checks it on the GPU.)"""
    ordered = not monoid.commutative
    force(scan=C(32, 1, 1, 4, vec=2), split=(3, 64),
          reduce=C(1, 8, 1, 4) if ordered else C(2, 4, 1, 4))
    monkeypatch.setattr(L, "LOOKBACK_TILES", 2)
    x = sample(monoid, (2, 333), seed=9)
    plan, _ = L.plan_scan(monoid, x, 1)
    assert [p.kernel.__name__ for p in plan] == ["lookback_scan_kernel"]
    assert plan[0].grid == (2 * 6,)
    check(monoid, L.launch_scan(monoid, x, 1), x, 1, False, "look-back")


def test_look_back_walks_several_windows(force, monkeypatch):
    """Only chunk 0 publishes an inclusive prefix: every look-back folds aggregates over
    windows of 4 predecessors back to it, in order."""
    force(scan=C(16, 1, 1, 4, vec=2), split=(3, 64), reduce=C(1, 8, 1, 4))
    lookback_aggregates_only(monkeypatch)
    for monoid in (U.MAX_PREFIX_SUM, M.SUM):
        x = sample(monoid, (1, 200), seed=10)                      # 13 chunks
        check(monoid, L.launch_scan(monoid, x, 1), x, 1, False, "windows")


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_random_shapes_dims_and_strides(data):
    """Hypothesis: any rank (1-3), sizes 1-12, any dim, forward or reverse, permuted and
    sliced views."""
    rank = data.draw(st.integers(1, 3), label="rank")
    shape = data.draw(st.lists(st.integers(1, 12), min_size=rank, max_size=rank), label="shape")
    perm = data.draw(st.permutations(range(rank)), label="perm")
    step = data.draw(st.integers(1, 2), label="step")
    monoid = data.draw(st.sampled_from((M.SUM, M.LOGSUMEXP2, M.ARGMIN, U.MATMUL2)), label="monoid")
    reverse = data.draw(st.booleans(), label="reverse")
    base = sample(monoid, [s * step for s in shape], seed=data.draw(st.integers(0, 99)))
    x = base[tuple(slice(None, None, step) for _ in shape)].permute(*perm)
    dim = data.draw(st.integers(-rank, rank - 1), label="dim") % rank
    check(monoid, L.launch_scan(monoid, x, dim, reverse), x, dim, reverse, "hypothesis")
