"""Plan choices made from H200 measurements (2026-11-29, CUDA-graph kernel times).

Each test pins one decision of :mod:`flashfold.kernels.reduce.launch` that a measurement
made (the numbers are in the docstrings there and in docs/notes/reductions.md), on the shapes of
``benchmarks/reductions.py``; only plans are built (no launch), except where a path that
the natural heuristics now take at small sizes is run under the interpreter against a
float64 reference.
"""

import pytest
import torch

import flashfold.monoids as M
from flashfold.algebra.monoid import Monoid
from flashfold.api import reductions as API
from flashfold.kernels.reduce import launch as L

C = L.Config


@pytest.fixture(autouse=True)
def h200(monkeypatch):
    """Split decisions as on an H200 (132 SMs), whatever runs the tests."""
    monkeypatch.setattr(L, "num_sms", lambda device: 132)


def _reduce(monoid, x, dim=1):
    plan, _ = L.plan_reduce(monoid, x, dim)
    return plan[0].kwargs


def _scan(monoid, x, reverse=False):
    plan, _ = L.plan_scan(monoid, x, 1, reverse)
    return plan[-1].kwargs


@pytest.mark.parametrize("monoid", (M.LOGSUMEXP2, M.WELFORD, M.SUM), ids=lambda m: m.name)
def test_misaligned_long_rows_are_realigned(monoid, monkeypatch):
    """4096 x 12345 fp32: K=8 x 1024 lanes, 8 warps, tiles realigned to 4-element vectors
    (kernel time from CUDA graphs: logsumexp 0.067 vs 0.085 ms with scalar loads,
    var_mean 0.084 vs 0.092). Scalar loads still answer to ALIGN_ROWS."""
    x = torch.empty(4096, 12345)
    kw = _reduce(monoid, x)
    assert (kw["K"], kw["LANES"], kw["num_warps"], kw["ALIGN"]) == (8, 1024, 8, 4)
    monkeypatch.setattr(L, "ALIGN_ROWS", False)
    assert _reduce(monoid, x)["ALIGN"] == 0


@pytest.mark.parametrize("monoid,k16", [(M.LOGSUMEXP2, 8), (M.WELFORD, 4), (M.SUM, 4),
                                        (M.MAX, 4), (M.ARGMAX, 4)],
                         ids=lambda v: str(getattr(v, "name", v)))
def test_16bit_wide_tiles_only_for_two_field_costly_states(monoid, k16):
    """16K x 16K bf16: K=8 tiles for logsumexp (3133 -> 3387 GB/s); var_mean measured
    2777 -> 2734 with them (75 -> 105 registers) and keeps K=4; cheap monoids never took
    them. fp32 rows are 8K-element tiles (K=8 x 1024 lanes) for every monoid."""
    kw = _reduce(monoid, torch.empty(16384, 16384, dtype=torch.bfloat16))
    assert (kw["K"], kw["LANES"], kw["num_warps"]) == (k16, 2048, 8)
    kw = _reduce(monoid, torch.empty(16384, 16384))
    assert (kw["K"], kw["LANES"], kw["num_warps"]) == (8, 1024, 8)


def test_cheap_scans_take_the_block_scan_aligned_or_not():
    """cumsum: the block scan (4096, 8 warps) on rows that start on 16-byte boundaries
    (16K x 16K fp32: 2712 -> 4011 GB/s) and on rows that do not (4096 x 12345, or a view
    one element in: 0.149 ms against 0.202 for the chunked scan in kernel time)."""
    for x in (torch.empty(64, 16384), torch.empty(64, 12345), torch.empty(64, 16385)[:, 1:]):
        kw = _scan(M.SUM, x)
        assert (kw["CHUNKED"], kw["BLOCK"], kw["num_warps"]) == (False, 4096, 8)
    kw = _scan(M.SUM, torch.empty(64, 1000))                     # the rule's 512-2047 step
    assert (kw["CHUNKED"], kw["BLOCK"], kw["num_warps"]) == (False, 1024, 4)
    kw = _scan(M.SUM, torch.empty(64, 12345), reverse=True)       # reversed loads: block scan
    assert not kw["CHUNKED"]


@pytest.mark.parametrize("shape", ((64, 16384), (64, 12345)))
def test_costly_scans_with_a_block_scan_take_the_block_path(shape):
    """logcumsumexp (LOGSUMEXP2_SCAN has a block scan): the block path, tiles of 1024 on
    one warp (16K x 16K on the H200: fp32 0.543 ms against 0.639 for the chunked scan;
    bf16 0.351 against 0.505), aligned rows or not."""
    for dtype in (torch.float32, torch.bfloat16):
        kw = _scan(API.LOGSUMEXP2_SCAN, torch.empty(*shape, dtype=dtype))
        assert kw["BLOCK_SCAN"] is not None
        assert (kw["CHUNKED"], kw["BLOCK"], kw["num_warps"]) == (False, 1024, 1)


@pytest.mark.parametrize("shape", ((64, 16384), (64, 12345)))
def test_costly_scans_without_one_take_the_prefetching_1024_chunked_scan_in_fp32(shape):
    """A costly combine and no block scan (LOGSUMEXP2_SCAN's functions minus its block
    scan): fp32 chunked 1024 / 2 warps with the next tile prefetched, on aligned and
    misaligned rows alike (logcumsumexp 16K fp32 kernel time: 0.639-0.641 ms against 0.680
    for the 2048 / 4 warps chunked scan); bf16 2048 / 4 warps (0.505 ms, 0.539 with the
    fp32 plan)."""
    m = API.LOGSUMEXP2_SCAN
    plain = Monoid("logsumexp2_scan_plain", fields=m.fields, identity=m.identity, lift=m.lift,
                   combine=m.combine, finalize=m.finalize, commutative=True)
    kw = _scan(plain, torch.empty(*shape))
    assert (kw["CHUNKED"], kw["BLOCK"], kw["num_warps"], kw["PREFETCH"]) == (True, 1024, 2, True)
    assert "BLOCK_SCAN" not in kw
    kw = _scan(plain, torch.empty(*shape, dtype=torch.bfloat16))
    assert (kw["CHUNKED"], kw["BLOCK"], kw["num_warps"], kw["PREFETCH"]) == (True, 2048, 4, False)


@pytest.mark.parametrize("monoid", (M.SUM, M.ARGMAX, API.LOGSUMEXP2_SCAN), ids=lambda m: m.name)
def test_misaligned_rows_scan_correctly_through_the_natural_plan(monoid):
    """The scans that misaligned rows take, run under the interpreter (4099 elements, each
    row start 4 bytes past a 16-byte boundary): cheap combines the block scan (one full
    4096-element tile, then the carry into a masked tail of 3), LOGSUMEXP2_SCAN its block
    scan (four full 1024-element tiles and the tail)."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(3, 4100, generator=g)
    if monoid is M.ARGMAX:
        base = torch.round(base * 2) / 2                           # ties: lowest index
    x = base[:, 1:]
    kw = _scan(monoid, x)
    costly = monoid is API.LOGSUMEXP2_SCAN
    assert (kw["CHUNKED"], kw["BLOCK"]) == (False, 1024 if costly else 4096)
    from flashfold.kernels.reduce import reference as R
    from flashfold.testing import assert_close
    outs = L.launch_scan(monoid, x, 1)
    ref = R.scan_reference(monoid, x, 1)
    scale = R.error_scale(monoid, x, 1)
    for o, r in zip(outs, ref):
        if not r.dtype.is_floating_point:
            assert o.dtype == torch.int64 and torch.equal(o, r)
        elif monoid is M.ARGMAX:
            assert torch.equal(o.double(), r.to(x.dtype).double())
        else:
            assert_close(o, r, o.dtype, scale=scale, name=monoid.name)
