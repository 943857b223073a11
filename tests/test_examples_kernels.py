"""The example monoids (:mod:`flashfold.examples`) through the tensor API: the one-input
ones on the generated kernels (under ``TRITON_INTERPRET=1`` on CPU machines) against the
float64 reference, the several-input ones on CPU tensors against float64 closed forms."""

import numpy as np
import pytest
import torch

import flashfold as ff
from flashfold import examples as ex
from flashfold.kernels.reduce import launch as L
from flashfold.kernels.reduce import reference as R
from flashfold.testing import assert_close

ON_CUDA = torch.cuda.is_available()
interpreter = pytest.mark.skipif(ON_CUDA, reason="interpreter tests run on CPU machines")


def _x(shape, seed=0, ties=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    return torch.round(x * 2) / 2 if ties else x


def _check(outs, ref, x, name, exact=False):
    assert len(outs) == len(ref), name
    scale = 1.0 + float(x.abs().max())
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert tuple(o.shape) == tuple(r.shape), (name, i)
        if not r.dtype.is_floating_point:
            assert torch.equal(o, r), (name, i)
        elif exact:
            assert torch.equal(o.double(), r), (name, i)
        else:
            assert_close(o, r, "float32", scale=scale, name=f"{name} output {i}")


@interpreter
@pytest.mark.parametrize("shape,dim", [((5, 37), 1), ((300, 3), 0), ((2, 3, 129), 2)],
                         ids=["rows", "columns", "3d"])
def test_top2_reduce_kernel(shape, dim):
    """Values and positions, ties to the lowest position (a tie-heavy input)."""
    x = _x(shape, seed=1, ties=True)
    _check(L.launch_reduce(ex.TOP2, x, dim, {}), R.reduce_reference(ex.TOP2, x, dim), x,
           "top2", exact=True)


@interpreter
@pytest.mark.parametrize("monoid", [ex.EMA, ex.AFFINE_HALF], ids=lambda m: m.name)
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("shape,dim", [((4, 150), 1), ((70, 3), 0)], ids=["rows", "columns"])
def test_ordered_scans_on_the_kernels(monoid, reverse, shape, dim):
    """Non-commutative one-input recurrences keep their order, forward and reverse."""
    x = _x(shape, seed=2)
    got = L.launch_scan(monoid, x, dim, reverse, {}, None)
    _check(got, R.scan_reference(monoid, x, dim, reverse), x, f"{monoid.name} scan")


@interpreter
@pytest.mark.parametrize("monoid", [ex.EMA, ex.AFFINE_HALF], ids=lambda m: m.name)
def test_ordered_reduce_on_the_kernels(monoid):
    x = _x((6, 200), seed=3)
    _check(L.launch_reduce(monoid, x, 1, {}), R.reduce_reference(monoid, x, 1), x,
           f"{monoid.name} reduce")


def test_ema_scan_is_the_recurrence():
    x = _x((3, 64), seed=4)
    alpha = 0.1
    h = torch.zeros(3, dtype=torch.float64)
    want = []
    for t in range(64):
        h = (1 - alpha) * h + alpha * x[:, t].double()
        want.append(h)
    assert_close(ff.scan(ex.EMA, x, dim=1), torch.stack(want, 1), "float32",
                 scale=1.0 + float(x.abs().max()))


def test_several_inputs_through_the_tensor_api():
    """COVARIANCE / CORRELATION / WEIGHTED_MEAN reduce and LINEAR_RECURRENCE scan of
    tuples of CPU tensors, against torch / NumPy in float64."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 90, generator=g)
    y = 0.5 * x + 0.2 * torch.randn(4, 90, generator=g)
    w = torch.rand(4, 90, generator=g)
    cov = ff.reduce(ex.COVARIANCE, (x, y), dim=1)
    cor = ff.reduce(ex.CORRELATION, (x, y), dim=1)
    for i in range(4):
        xy = np.stack([x[i].double().numpy(), y[i].double().numpy()])
        assert_close(cov[i], torch.tensor(np.cov(xy)[0, 1]), "float32", scale=2.0)
        assert_close(cor[i], torch.tensor(np.corrcoef(xy)[0, 1]), "float32")
    wm = ff.reduce(ex.WEIGHTED_MEAN, (w, x), dim=1)
    assert_close(wm, (w.double() * x.double()).sum(1) / w.double().sum(1), "float32", scale=2.0)
    a = torch.rand(4, 90, generator=g)
    h = torch.zeros(4, dtype=torch.float64)
    habs = torch.zeros(4, dtype=torch.float64)       # the same recurrence over |x|: the scale
    want, scale = [], []
    for t in range(90):
        h = a[:, t].double() * h + x[:, t].double()
        habs = a[:, t].double() * habs + x[:, t].double().abs()
        want.append(h)
        scale.append(1.0 + habs)
    assert_close(ff.scan(ex.LINEAR_RECURRENCE, (a, x), dim=1), torch.stack(want, 1), "float32",
                 scale=torch.stack(scale, 1))
