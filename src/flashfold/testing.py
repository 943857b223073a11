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

from .algebra.tolerances import TOLERANCES, dtype_name
from .algebra.tolerances import compare as _compare

__all__ = ["TOLERANCES", "dtype_name", "compare", "assert_close"]


def _to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):                     # torch tensor, without importing torch here
        x = x.detach().cpu()
        if str(x.dtype) in ("torch.bfloat16", "torch.float16"):
            x = x.float()
        return x.double().numpy() if x.dtype.is_floating_point else x.numpy()
    return np.asarray(x)


def compare(actual, expected, dtype="float64", scale=1.0, atol=None, rtol=None) -> dict:
    """Compare ``actual`` to a float64 ``expected`` (arrays or tensors of any dtype and
    device; ``scale`` too); returns a report dict with ``ok`` (:func:`flashfold.algebra.tolerances.compare`)."""
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
