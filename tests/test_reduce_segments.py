"""Segmented (ragged, "varlen") reduction kernels against a fold of each segment.

Under ``TRITON_INTERPRET=1``: empty segments (the finalized identity), segments shorter
and longer than a tile, positions that restart in every segment (ARGMAX), segments
along dim 0 of packed rows ``(total, features)`` and along the last dim, and the
non-commutative user monoids (segments folded left to right).
"""

import pytest
import torch

import flashfold.monoids as M
from flashfold.kernels.reduce import launch as L
from flashfold.kernels.reduce import reference as R
from flashfold.testing import assert_close

import user_monoids as U

ALL = (M.SUM, M.MAX, M.MIN, M.LOGSUMEXP, M.LOGSUMEXP2, M.WELFORD, M.ARGMAX, M.ARGMIN,
       U.MINMAX, U.MATMUL2, U.MAX_PREFIX_SUM)
EXACT = {"max", "min", "argmax", "argmin", "minmax"}
C = L.Config


def sample(monoid, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * (0.1 if monoid is U.MATMUL2 else 1.0)
    return torch.round(x * 2) / 2 if monoid.name in EXACT else x


def check(monoid, outs, x, offsets, dim, name=""):
    ref = R.segment_reduce_reference(monoid, x, offsets, dim)
    scale = R.error_scale(monoid, x, dim)           # whole-dim magnitude bounds each segment
    for i, (o, r) in enumerate(zip(outs, ref)):
        label = f"{name} {monoid.name} output {i}"
        assert tuple(o.shape) == tuple(r.shape), label
        if not r.dtype.is_floating_point:
            assert o.dtype == torch.int64 and torch.equal(o, r), label
        elif monoid.name in EXACT:
            assert torch.equal(o.double(), r.to(x.dtype).double()), label
        else:
            assert_close(o, r, o.dtype, scale=scale, name=label)


OFFSETS = torch.tensor([0, 0, 1, 9, 9, 40, 57])       # empty, length 1, 8, empty, 31, 17


@pytest.mark.parametrize("monoid", ALL, ids=lambda m: m.name)
def test_packed_rows_dim0(monoid):
    """x: (57 tokens, 5 features), segments along dim 0: out (6, 5)."""
    x = sample(monoid, (57, 5))
    check(monoid, L.launch_segment_reduce(monoid, x, OFFSETS, 0), x, OFFSETS, 0, "dim0")


@pytest.mark.parametrize("monoid", ALL, ids=lambda m: m.name)
def test_segments_of_the_last_dim_with_tiles(monoid, force_tiles):
    """x: (2, 57), segments along dim 1 with tiles of 8: loops, tails, empty segments."""
    x = sample(monoid, (2, 57), seed=1)
    check(monoid, L.launch_segment_reduce(monoid, x, OFFSETS, 1), x, OFFSETS, 1, "dim1")


@pytest.fixture
def force_tiles(monkeypatch):
    def cfg(g, elsize, ordered, *a):
        return C(1, 8, 1, 4) if ordered else C(2, 4, 1, 4)
    monkeypatch.setattr(L, "reduce_config", cfg)


def test_int32_offsets_and_partial_cover():
    """int32 offsets that do not start at 0 nor end at N."""
    x = sample(M.LOGSUMEXP2, (3, 40), seed=2)
    off = torch.tensor([3, 10, 10, 33], dtype=torch.int32)
    check(M.LOGSUMEXP2, L.launch_segment_reduce(M.LOGSUMEXP2, x, off, 1), x, off, 1, "int32")


def test_no_segments():
    x = torch.randn(4, 3)
    outs = L.launch_segment_reduce(M.SUM, x, torch.tensor([0]), 0)
    assert outs[0].shape == (0, 3)
