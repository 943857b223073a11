"""Tolerances per dtype and the elementwise comparison that applies them (NumPy only).

One table, :data:`TOLERANCES`, keyed by dtype name: a result in that dtype passes when
``|actual - expected| <= atol * scale + rtol * |expected|`` elementwise, where
``expected`` is a float64 reference and ``scale`` the magnitude of the terms that were
summed (``sum |x|`` for a sum with cancellation; 1 by default). NaN and infinities must
sit at the same places (infinities with the same sign). A failure reports the max abs
error, the relative RMS error, the first bad index and the NaN/inf parity.

The algebra's numeric checks (transport, homomorphisms) compare with it;
:mod:`flashfold.testing` adds tensors (any dtype, any device) and ``assert_close`` on top.
"""

from __future__ import annotations

import numpy as np

__all__ = ["TOLERANCES", "dtype_name", "tolerance", "compare"]

#: dtype name -> (atol, rtol). Stats are fp32 in every kernel, so fp16/bf16 rows bound the
#: rounding of the *inputs and outputs*, not of the accumulation.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-12, 1e-12),
    "float32": (2e-5, 2e-5),
    "float16": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1.6e-2),
}


def dtype_name(dtype) -> str:
    """The key of :data:`TOLERANCES` for a dtype: a name, a NumPy dtype or scalar type
    (``np.float32``), or a torch dtype."""
    if isinstance(dtype, type) and issubclass(dtype, np.generic):
        return np.dtype(dtype).name
    name = str(dtype)
    return name.replace("torch.", "")


def _check_bound(name, x):
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__}")
    if not (np.isfinite(x) and x >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {x}")
    return float(x)


def tolerance(dtype, atol=None, rtol=None) -> tuple[float, float]:
    """``(atol, rtol)``: the row of :data:`TOLERANCES` for ``dtype``, with ``atol`` /
    ``rtol`` (finite, ``>= 0``) in place of its entries where given. ``ValueError`` for a
    dtype without a row (naming the rows) or a NaN / negative bound: either would make every
    comparison pass or fail whatever the values."""
    name = dtype_name(dtype)
    if name not in TOLERANCES:
        raise ValueError(f"dtype: no tolerance for {dtype!r}; expected one of "
                         f"{list(TOLERANCES)} (a name, a NumPy or a torch dtype)")
    t_atol, t_rtol = TOLERANCES[name]
    return (t_atol if atol is None else _check_bound("atol", atol),
            t_rtol if rtol is None else _check_bound("rtol", rtol))


def check_scale(has_nan, has_negative=False) -> None:
    """``ValueError`` for a ``scale`` that is NaN or negative where a finite element is
    compared: a NaN bound would pass it whatever its error, and a negative ``scale`` (a
    magnitude, ``sum |x|``) lowers the bound below 0, failing even an exact match."""
    if has_nan:
        raise ValueError("scale must not be NaN where the compared values are finite (a NaN "
                         "bound passes any error; zero the non-finite terms when summing "
                         "their magnitude)")
    if has_negative:
        raise ValueError("scale must be >= 0 where the compared values are finite (it is the "
                         "magnitude of the summed terms, e.g. sum |x|; a negative scale fails "
                         "even an exact match)")


def check_scale_shape(scale_shape, shape) -> None:
    """``ValueError`` for a ``scale`` whose shape does not broadcast to the compared
    ``shape`` (the bound ``atol * scale + rtol * |expected|`` has the values' shape)."""
    try:
        ok = np.broadcast_shapes(tuple(scale_shape), tuple(shape)) == tuple(shape)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"scale must broadcast to the compared shape {tuple(shape)}, got "
                         f"shape {tuple(scale_shape)}")


def check_real(name, kind_is_complex) -> None:
    """``TypeError`` for complex values (comparing their real parts would hide the rest)."""
    if kind_is_complex:
        raise TypeError(f"{name} is complex; compare its real and imaginary parts separately")


def rms(x) -> float:
    """Root mean square of the finite array ``x`` (0 when empty), computed as
    ``max|x| sqrt(mean((x / max|x|)^2))``: the squares of values above 1e154 would overflow
    (an RMS of inf, a relative RMS of inf / inf = NaN); ``inf`` where ``x`` holds one."""
    big = float(np.max(np.abs(x), initial=0.0))
    if big == 0.0 or not np.isfinite(big):
        return big
    return big * float(np.sqrt(np.mean((x / big) ** 2)))


def compare(actual, expected, dtype="float64", scale=1.0, atol=None, rtol=None) -> dict:
    """Compare array-likes ``actual`` and ``expected`` (the float64 reference) elementwise
    with the tolerance of ``dtype`` (or ``atol`` / ``rtol``); returns a report dict with
    ``ok``, ``max_abs``, ``rel_rms``, ``first_bad``, ``nan_inf_parity``, ``n_bad`` (or
    ``ok`` and ``why`` when the shapes differ)."""
    atol, rtol = tolerance(dtype, atol, rtol)
    a, e = np.asarray(actual), np.asarray(expected)
    check_real("actual", a.dtype.kind == "c")
    check_real("expected", e.dtype.kind == "c")
    a, e = a.astype(np.float64), e.astype(np.float64)
    sc = np.asarray(scale, dtype=np.float64)
    if a.shape != e.shape:
        return {"ok": False, "why": f"shape {a.shape} != expected {e.shape}"}
    check_scale_shape(sc.shape, a.shape)
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    inf_a, inf_e = np.isinf(a), np.isinf(e)
    parity = bool(np.array_equal(nan_a, nan_e) and np.array_equal(inf_a, inf_e)
                  and np.array_equal(np.sign(a[inf_a]), np.sign(e[inf_e])))
    finite = ~(nan_e | inf_e) & ~(nan_a | inf_a)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.where(finite, np.abs(a - e), 0.0)
    bound = atol * sc + rtol * np.abs(e)
    check_scale(bool((np.isnan(bound) & finite).any()), bool((finite & (sc < 0)).any()))
    bad = (diff > bound) | (nan_a != nan_e) | (inf_a != inf_e) | (inf_a & inf_e & (np.sign(a) != np.sign(e)))
    denom = rms(e[finite])
    rel_rms = rms(diff[finite]) / denom if denom > 0 else float(diff.max(initial=0.0))
    first = tuple(int(i) for i in np.argwhere(bad)[0]) if bad.any() else None
    return {"ok": bool(not bad.any() and parity), "max_abs": float(diff.max(initial=0.0)),
            "rel_rms": rel_rms, "first_bad": first, "nan_inf_parity": parity,
            "n_bad": int(bad.sum()), "atol": atol, "rtol": rtol,
            "at_first": None if first is None else (float(a[first]), float(e[first]))}
