"""flashfold.testing: the device-side comparison gives the NumPy rule's report exactly."""

import math

import numpy as np
import pytest
import torch

from flashfold import testing as T
from flashfold.algebra.tolerances import compare as np_compare


def _cases():
    g = torch.Generator().manual_seed(0)
    e = torch.randn(64, 33, generator=g, dtype=torch.float64)
    a = e + 1e-7 * torch.randn(64, 33, generator=g, dtype=torch.float64)
    yield "close", a.float(), e, 1.0
    bad = a.clone()
    bad[3, 4] += 1.0
    bad[10, 0] = math.nan
    yield "bad + nan", bad, e, 1.0
    e2, a2 = e.clone(), a.clone()
    e2[5, 5], a2[5, 5] = math.inf, math.inf
    e2[6, 6], a2[6, 6] = -math.inf, math.inf            # sign mismatch
    e2[7, 7] = math.nan                                   # parity mismatch
    yield "inf signs", a2, e2, e.abs() + 1.0              # tensor scale
    yield "all nan", torch.full((4,), math.nan), torch.full((4,), math.nan), 1.0
    yield "empty", torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.float64), 1.0
    yield "shape", torch.zeros(3), torch.zeros(4, dtype=torch.float64), 1.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_rule_matches_numpy_rule(dtype):
    for name, a, e, sc in _cases():
        want = np_compare(a.double().numpy(), e.numpy(), dtype,
                          sc.numpy() if hasattr(sc, "numpy") else sc)
        got = T._compare_torch(a, e, dtype, sc)
        assert got.keys() == want.keys(), name
        for key in want:
            w, g_ = want[key], got[key]
            if isinstance(w, float) and math.isnan(w):
                assert math.isnan(g_), (name, key)
            elif isinstance(w, float):
                assert g_ == pytest.approx(w, rel=1e-12, abs=1e-300), (name, key, g_, w)
            else:
                assert g_ == w, (name, key, g_, w)


def test_cpu_tensors_take_the_numpy_path(monkeypatch):
    """Only tensors on one accelerator are compared in torch; CPU tensors, NumPy arrays and
    mixed devices go through NumPy (the rule's one definition)."""
    monkeypatch.setattr(T, "_compare_torch", lambda *a, **k: pytest.fail("torch path taken"))
    assert T.compare(torch.ones(3), torch.ones(3, dtype=torch.float64))["ok"]
    assert not T.compare(torch.ones(3), torch.zeros(3, dtype=torch.float64))["ok"]


@pytest.mark.parametrize("device_rule", [False, True], ids=["numpy", "torch"])
def test_bad_arguments_are_refused_not_passed(device_rule):
    """A dtype without a tolerance row, a NaN / negative atol or rtol, a NaN scale at a
    finite element and complex values raise (naming the argument) on both paths, instead of
    a KeyError or a comparison that passes whatever the error."""
    a, e = torch.tensor([5.0, 1.0]), torch.tensor([1.0, 1.0], dtype=torch.float64)
    run = (lambda *args, **kw: T._compare_torch(*args, **kw)) if device_rule else T.compare
    for dtype in ("int32", torch.int64, "float8_e4m3fn"):
        with pytest.raises(ValueError, match="^dtype: no tolerance"):
            run(a, e, dtype, 1.0)
    for kw in ({"atol": math.nan}, {"rtol": math.nan}, {"atol": -1.0}):
        with pytest.raises(ValueError, match=f"^{next(iter(kw))} must be"):
            run(a, e, "float32", 1.0, **kw)
    with pytest.raises(ValueError, match="^scale must not be NaN"):
        run(a, e, "float32", torch.tensor([math.nan, 1.0], dtype=torch.float64))
    with pytest.raises(TypeError, match="^actual is complex"):
        run(a.to(torch.complex64), e, "float32", 1.0)
    # a NaN scale where the expected value is itself NaN compares nothing: allowed
    e2 = torch.tensor([math.nan, 1.0], dtype=torch.float64)
    a2 = torch.tensor([math.nan, 1.0])
    assert run(a2, e2, "float32", torch.tensor([math.nan, 1.0], dtype=torch.float64))["ok"]


def test_numpy_scalar_types_name_their_row():
    assert T.compare(np.float32(1.0), np.float64(1.0), np.float32)["atol"] == \
        T.TOLERANCES["float32"][0]


@pytest.mark.parametrize("device_rule", [False, True], ids=["numpy", "torch"])
def test_a_negative_scale_is_refused(device_rule):
    """``scale`` is a magnitude: a negative one makes the bound negative, which fails an
    exact match; it raises, naming the argument, on both paths."""
    a, e = torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0], dtype=torch.float64)
    run = (lambda *args, **kw: T._compare_torch(*args, **kw)) if device_rule else T.compare
    for sc in (-1.0, torch.tensor([1.0, -2.0], dtype=torch.float64)):
        with pytest.raises(ValueError, match="^scale must be >= 0"):
            run(a, e, "float32", sc)
    # a negative scale where the expected value is not finite compares nothing: allowed
    e2 = torch.tensor([math.inf, 1.0], dtype=torch.float64)
    a2 = torch.tensor([math.inf, 1.0])
    assert run(a2, e2, "float32", torch.tensor([-1.0, 1.0], dtype=torch.float64))["ok"]


@pytest.mark.parametrize("device_rule", [False, True], ids=["numpy", "torch"])
def test_a_scale_that_does_not_broadcast_to_the_values_is_refused(device_rule):
    """``scale`` broadcasts to the compared shape; one of another shape (too few entries,
    or more dimensions than the values) raises, naming it, instead of a broadcasting error
    or an IndexError while the failure is reported."""
    a, e = torch.tensor([1.0, 1.0, 2.0]), torch.ones(3, dtype=torch.float64)
    run = (lambda *args, **kw: T._compare_torch(*args, **kw)) if device_rule else T.compare
    for shape in ((2,), (2, 3)):
        with pytest.raises(ValueError, match="^scale must broadcast to the compared shape"):
            run(a, e, "float32", torch.ones(shape, dtype=torch.float64))
    assert not run(a, e, "float32", torch.ones(1, 3, dtype=torch.float64)[0])["ok"]


@pytest.mark.parametrize("device_rule", [False, True], ids=["numpy", "torch"])
def test_the_report_of_large_values_has_a_finite_rms_error(device_rule):
    """The relative RMS error is scale-free: squaring values above 1e154 overflowed, and
    the report said NaN (inf / inf) with an overflow warning."""
    import warnings
    a = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    e = torch.tensor([1.1, 2.0, 3.0], dtype=torch.float64)
    run = (lambda *args, **kw: T._compare_torch(*args, **kw)) if device_rule else T.compare
    small = run(a, e, "float64", 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        big = run(a * 1e200, e * 1e200, "float64", 1.0)
    assert not big["ok"] and big["rel_rms"] == pytest.approx(small["rel_rms"], rel=1e-12)
    assert big["max_abs"] == pytest.approx(small["max_abs"] * 1e200, rel=1e-12)
