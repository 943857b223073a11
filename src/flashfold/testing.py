"""Tolerances and comparison helpers shared by the tests, the fuzz suite and the benchmarks.

The table and the NumPy comparison live in :mod:`flashfold.algebra.tolerances` (the
algebra's numeric checks use them); this module takes tensors too and raises.

One table, :data:`TOLERANCES`, keyed by dtype name: a result in that dtype passes when
``|actual - expected| <= atol * scale + rtol * |expected|`` elementwise, where
``expected`` is a float64 reference and ``scale`` the magnitude of the terms that were
summed (``sum |x|`` for a sum with cancellation; 1 by default). A failure reports the max
abs error, the relative RMS error, the first bad index and the NaN/inf parity.
"""

from __future__ import annotations

import numpy as np

from .algebra.tolerances import (TOLERANCES, check_real, check_scale, check_scale_shape,
                                 dtype_name, tolerance)
from .algebra.tolerances import compare as _compare

__all__ = ["TOLERANCES", "dtype_name", "compare", "assert_close"]


def _to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):                     # torch tensor, without importing torch here
        x = x.detach().cpu()
        if x.is_complex():
            return x.numpy()                     # refused by the comparison, by name
        if str(x.dtype) in ("torch.bfloat16", "torch.float16"):
            x = x.float()
        return x.double().numpy() if x.dtype.is_floating_point else x.numpy()
    return np.asarray(x)


def _on_device(*xs) -> bool:
    """True when every tensor among ``xs`` lives on one accelerator (not the CPU)."""
    devs = {str(x.device) for x in xs if hasattr(x, "device")}
    return hasattr(xs[0], "device") and hasattr(xs[1], "device") and len(devs) == 1 \
        and devs != {"cpu"}


def _rms_torch(x, n: int) -> float:
    """:func:`flashfold.algebra.tolerances.rms` of a tensor holding ``n`` finite values
    (zeros elsewhere): scaled by ``max|x|``, so squares of values above 1e154 cannot
    overflow."""
    big = float(x.abs().max()) if x.numel() else 0.0
    if big == 0.0 or big == float("inf"):
        return big
    return big * float(x.div(big).square().sum().div(max(n, 1)).sqrt())


def _compare_torch(actual, expected, dtype, scale, atol=None, rtol=None) -> dict:
    """:func:`flashfold.algebra.tolerances.compare`'s rule on torch tensors, where they are
    (a GPU check of 2^31 elements stays on the GPU instead of crossing to NumPy); the same
    report, element for element (``tests/test_testing.py`` holds the two to each other)."""
    import torch

    atol, rtol = tolerance(dtype, atol, rtol)
    check_real("actual", actual.is_complex())
    check_real("expected", expected.is_complex())
    a, e = actual.detach().double(), expected.detach().double()
    sc = scale.detach().double() if hasattr(scale, "detach") else float(scale)
    if a.shape != e.shape:
        return {"ok": False, "why": f"shape {tuple(a.shape)} != expected {tuple(e.shape)}"}
    check_scale_shape(sc.shape if hasattr(sc, "shape") else (), a.shape)
    nan_a, nan_e, inf_a, inf_e = a.isnan(), e.isnan(), a.isinf(), e.isinf()
    sign_bad = inf_a & inf_e & (a.sign() != e.sign())
    parity = bool(torch.equal(nan_a, nan_e) and torch.equal(inf_a, inf_e) and not sign_bad.any())
    finite = ~(nan_e | inf_e) & ~(nan_a | inf_a)
    diff = torch.where(finite, (a - e).abs(), 0.0)
    bound = atol * sc + rtol * e.abs()
    check_scale(bool((bound.isnan() & finite).any()), bool((finite & (sc < 0)).any()))
    bad = (diff > bound) | (nan_a != nan_e) | (inf_a != inf_e) | sign_bad
    n_fin = int(finite.sum())
    denom = _rms_torch(torch.where(finite, e, 0.0), n_fin)
    max_abs = float(diff.max()) if diff.numel() else 0.0
    rel_rms = _rms_torch(diff, n_fin) / denom if denom > 0 else max_abs
    n_bad = int(bad.sum())
    first = tuple(int(i) for i in bad.nonzero()[0]) if n_bad else None
    return {"ok": bool(not n_bad and parity), "max_abs": max_abs, "rel_rms": rel_rms,
            "first_bad": first, "nan_inf_parity": parity, "n_bad": n_bad, "atol": atol,
            "rtol": rtol, "at_first": None if first is None else (float(a[first]), float(e[first]))}


def compare(actual, expected, dtype="float64", scale=1.0, atol=None, rtol=None) -> dict:
    """Compare ``actual`` to a float64 ``expected`` (arrays or tensors of any dtype and
    device; ``scale`` too); returns a report dict with ``ok`` (:func:`flashfold.algebra.tolerances.compare`).
    Tensors on one accelerator are compared there (:func:`_compare_torch`, the same rule).

    ``ValueError`` for a ``dtype`` without a row in :data:`TOLERANCES`, a NaN or negative
    ``atol`` / ``rtol``, or a ``scale`` that is NaN or negative where finite values are
    compared (each would pass or fail every element whatever its error); ``TypeError`` for
    complex values."""
    if _on_device(actual, expected, scale):
        return _compare_torch(actual, expected, dtype, scale, atol, rtol)
    return _compare(_to_numpy(actual), _to_numpy(expected), dtype, _to_numpy(scale), atol, rtol)


def assert_close(actual, expected, dtype="float64", scale=1.0, name="result", **kw):
    """Raise ``AssertionError`` with a full report unless ``actual`` matches ``expected``."""
    r = compare(actual, expected, dtype, scale, **kw)
    if not r["ok"]:
        if "why" in r:
            raise AssertionError(f"{name}: {r['why']}")
        raise AssertionError(
            f"{name} ({dtype_name(dtype)}): {r['n_bad']} elements out of tolerance "
            f"(atol={r['atol']:g} x scale, rtol={r['rtol']:g}); max abs err {r['max_abs']:.3g}, "
            f"rel RMS err {r['rel_rms']:.3g}, first bad index {r['first_bad']} "
            f"(actual, expected) = {r['at_first']}, NaN/inf parity {r['nan_inf_parity']}")
    return r
