"""``benchmarks/deterministic_bwd.py`` on the CPU: its FLOP count and its refusal to run
without a GPU (the timings themselves run on the H200)."""

import pytest
import torch

from bench_script import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("deterministic_bwd", "deterministic_bwd")


def test_flops_count_the_visible_pairs(bench):
    B, H, N, D, DV = 2, 3, 10, 64, 32
    dense = bench.flops(B, H, N, D, DV, False, None)
    assert dense == 2.5 * 2 * B * H * N * N * (D + DV)
    # causal: row i sees i + 1 keys; a window (3, 0) at most 4
    assert bench.flops(B, H, N, D, DV, True, None) == dense * (N + 1) / 2 / N
    pairs = sum(min(i + 1, 4) for i in range(N))
    assert bench.flops(B, H, N, D, DV, True, (3, 0)) == pytest.approx(dense * pairs / N / N)


def test_rows_name_their_shapes_and_a_cpu_run_refuses(bench, monkeypatch, capsys):
    assert all(len(r) == 9 and r[1] * r[2] * r[4] > 0 and r[2] % r[3] == 0 for r in bench.ROWS)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 2
    assert "needs a GPU" in capsys.readouterr().out


def test_difference_keeps_a_nan_of_any_gradient(bench):
    """A NaN in the default mode's dK (not the first gradient) fails the row: the max
    over the gradients is NaN, not dQ's finite difference."""
    want = [torch.ones(2, 3) for _ in range(3)]
    got = [w.clone() for w in want]
    got[0][0, 0] = 1.001
    assert bench.max_rel_diff(got, want) == pytest.approx(1e-3, rel=1e-3)
    want[1][1, 2] = float("nan")
    assert not bench.max_rel_diff(got, want) < 2e-2
