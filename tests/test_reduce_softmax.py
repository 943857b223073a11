"""The row-map kernel (softmax) against float64: fused and two-loop schedules.

Softmax is the LOGSUMEXP2 state of the row, then ``y = 2^(x·log2 e - m) / d`` for each
element. Fused: the row is one tile, read once and written once; two-loop: a statistics
loop and a map loop. Rows of all ``-inf`` give NaN (``0/0``), as ``torch.softmax``.
"""

import pytest
import torch

from flashfold.api.reductions import SOFTMAX_MAP
from flashfold.kernels.reduce import launch as L
from flashfold.kernels.reduce import reference as R
from flashfold.testing import assert_close

C = L.Config


def check(y, x, dim, name):
    ref = R.normalize_reference(SOFTMAX_MAP, x, dim)
    torch_ref = torch.softmax(x.double(), dim)
    assert y.shape == x.shape and y.dtype == x.dtype, name
    assert_close(y, ref, y.dtype, name=name + " vs reference")
    assert_close(y, torch_ref, y.dtype, name=name + " vs torch")


@pytest.fixture
def force(monkeypatch):
    def apply(cfg, fused):
        monkeypatch.setattr(L, "normalize_config", lambda g, e, o: (cfg, fused))
    return apply


@pytest.mark.parametrize("n", (7, 37), ids=("small", "short"))
def test_short_rows_fused(n):
    x = torch.randn(6, n) * 3
    plan, _ = L.plan_normalize(SOFTMAX_MAP, x, 1)
    assert plan[0].kwargs["FUSED"] and plan[0].kwargs["SMALL"] == (n <= L.SMALL_N)
    check(L.launch_normalize(SOFTMAX_MAP, x, 1), x, 1, "short rows")


def test_long_row_fused_tile(force):
    force(C(4, 16, 1, 4), True)
    x = torch.randn(3, 50) * 3
    check(L.launch_normalize(SOFTMAX_MAP, x, 1), x, 1, "fused lanes")


def test_two_loops_with_tail(force):
    force(C(2, 8, 1, 4), False)
    x = torch.randn(3, 70) * 3
    check(L.launch_normalize(SOFTMAX_MAP, x, 1), x, 1, "two loops")


def test_columns_and_middle_dims():
    x = torch.randn(21, 4, 6)
    for dim in (0, 1, 2):
        check(L.launch_normalize(SOFTMAX_MAP, x, dim), x, dim, f"dim {dim}")
    xt = x.transpose(0, 2)
    check(L.launch_normalize(SOFTMAX_MAP, xt, 2), xt, 2, "transposed")


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_half_inputs(dtype, force):
    force(C(2, 8, 1, 4), False)
    x = (torch.randn(3, 45) * 3).to(dtype)
    check(L.launch_normalize(SOFTMAX_MAP, x, 1), x, 1, str(dtype))


def test_inf_rows_and_length_one(force):
    ninf = -float("inf")
    x = torch.tensor([[ninf] * 5, [ninf, 1.0, ninf, 2.0, ninf], [0.5] * 5])
    y = L.launch_normalize(SOFTMAX_MAP, x, 1)
    assert torch.isnan(y[0]).all()
    check(y, x, 1, "-inf rows")
    one = torch.randn(4, 1)
    assert torch.equal(L.launch_normalize(SOFTMAX_MAP, one, 1), torch.ones(4, 1))
    force(C(2, 8, 1, 4), False)
    check(L.launch_normalize(SOFTMAX_MAP, x, 1), x, 1, "-inf rows, two loops")


def test_output_dtype():
    x = torch.randn(2, 9)
    y = L.launch_normalize(SOFTMAX_MAP, x, 1, out_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert_close(y, torch.softmax(x.double(), 1), torch.bfloat16, name="bf16 out")


def test_split_rows(monkeypatch):
    """Few long rows: chunk states, then each chunk normalized with the folded row state."""
    monkeypatch.setattr(L, "normalize_config", lambda g, e, o: (C(2, 4, 1, 4), False))
    monkeypatch.setattr(L, "reduce_config", lambda g, e, o, *a: C(2, 4, 1, 4))
    monkeypatch.setattr(L, "split_plan", lambda g, tile, n, sms, min_tiles=2: (5, 16))
    x = torch.randn(2, 75) * 3
    x[1, :40] = -float("inf")
    plan, _ = L.plan_normalize(SOFTMAX_MAP, x, 1)
    assert len(plan) == 2 and plan[1].kwargs["SPLIT"]
    check(L.launch_normalize(SOFTMAX_MAP, x, 1), x, 1, "split rows")
