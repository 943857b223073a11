"""The specification's 1,000-key order experiment (seed 000), and `flashfold demo`."""

import pytest

from flashfold.cli import main, order_experiment


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_orders_agree_with_direct_softmax(seed):
    rows, sizes, masked = order_experiment(seed=seed)
    assert 1 in sizes and 0 in sizes and sizes[masked] >= 5
    for order, out_dev, l_dev, lse_dev in rows:
        assert out_dev <= 1e-14, order
        assert l_dev <= 1e-14, order
        assert lse_dev <= 1e-12, order


def test_demo_runs(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    for order in ("sequential", "reversed", "shuffled", "tree"):
        assert order in out
    assert "all orders agree" in out and "MiB" in out
