"""Reference semantics of the reduce / segment-reduce / scan / row-map kernels.

Pure NumPy (float64) through the reference schedules of :mod:`flashfold.schedules`, on
torch tensors in and out; imports neither Triton nor a GPU. The kernels of this package
must agree with these functions (within the tolerance of the input dtype), and the
public functions of :mod:`flashfold.api.reductions` run them for CPU tensors.

All functions return float64 (float outputs), int64 or bool tensors on the CPU; the
caller casts. ``params`` are the monoid's finalize parameters by name.

``x`` is a tensor, or for a monoid of several data inputs a tuple of tensors of one shape
(one per input, in the monoid's order).

* ``reduce_reference(m, x, dim)``: ``finalize(lift(x_0) ⊕ ... ⊕ lift(x_{N-1}))`` along
  ``dim``, as a pairwise tree (adjacent pairs, so order is kept for monoids that are not
  commutative); an empty dim gives ``finalize(e)``.
* ``segment_reduce_reference(m, x, offsets, dim)``: the same over
  ``x[offsets[j]:offsets[j+1]]`` for each segment ``j``; positions restart at 0.
* ``scan_reference(m, x, dim, reverse)``: ``finalize`` of the inclusive prefix states
  (suffix states ``x_i ⊕ ... ⊕ x_{N-1}`` when ``reverse``).
* ``normalize_reference(rowmap, x, dim)``: ``map(x, *prep(state(row)))``.
"""

from __future__ import annotations

import numpy as np
import torch

from ...algebra.lower import compile_graph
from ...algebra.monoid import Monoid
from ...schedules import finalize, fold, scan

__all__ = ["reduce_reference", "segment_reduce_reference", "scan_reference",
           "normalize_reference", "to_numpy64", "error_scale"]


def to_numpy64(x: torch.Tensor) -> np.ndarray:
    """float64 NumPy copy of a tensor of any float dtype and device."""
    return x.detach().to("cpu", torch.float64).numpy()


def _outs(values) -> tuple:
    values = values if isinstance(values, tuple) else (values,)
    # np.array, not np.ascontiguousarray, which turns a 0-d result into shape (1,)
    return tuple(torch.from_numpy(np.array(v)) for v in values)


def _elements_first(monoid: Monoid, x, dim: int):
    """``x`` (a tensor, or a tuple of tensors of one shape: one per data input) as float64
    arrays with ``dim`` first, in the form the schedules take."""
    if isinstance(x, tuple):
        return tuple(np.moveaxis(to_numpy64(t), dim, 0) for t in x)
    return np.moveaxis(to_numpy64(x), dim, 0)


def _take(xs, sl):
    return tuple(a[sl] for a in xs) if isinstance(xs, tuple) else xs[sl]


def reduce_reference(monoid: Monoid, x: torch.Tensor, dim: int, **params) -> tuple:
    """Outputs of ``monoid`` reduced over ``dim`` (batch shape; float64/int64/bool)."""
    xs = _elements_first(monoid, x, dim)
    return _outs(finalize(monoid, fold(monoid, xs, "tree"), **params))


def segment_reduce_reference(monoid: Monoid, x: torch.Tensor, offsets, dim: int, **params) -> tuple:
    """Outputs per segment; shape of ``x`` with ``dim`` replaced by ``len(offsets) - 1``."""
    xs = _elements_first(monoid, x, dim)
    off = [int(v) for v in torch.as_tensor(offsets).tolist()]
    per_seg = []
    for lo, hi in zip(off[:-1], off[1:]):
        out = finalize(monoid, fold(monoid, _take(xs, slice(lo, hi)), "tree"), **params)
        per_seg.append(out if isinstance(out, tuple) else (out,))
    n_out = len(monoid.finalize_graph.outputs)
    if not per_seg:
        empty = finalize(monoid, fold(monoid, _take(xs, slice(0, 0)), "tree"), **params)
        empty = empty if isinstance(empty, tuple) else (empty,)
        return tuple(torch.from_numpy(np.moveaxis(np.asarray(e)[None][:0], 0, dim).copy())
                     for e in empty)
    res = []
    for k in range(n_out):
        stacked = np.stack([np.asarray(p[k]) for p in per_seg])       # (S, *batch)
        res.append(np.moveaxis(stacked, 0, dim))
    return _outs(tuple(res))


def scan_reference(monoid: Monoid, x: torch.Tensor, dim: int, reverse: bool = False,
                   **params) -> tuple:
    """Finalized inclusive prefix (``reverse``: suffix) states along ``dim``."""
    xs = _elements_first(monoid, x, dim)
    states = scan(monoid, xs, reverse=reverse)
    outs = finalize(monoid, states, **params)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return _outs(tuple(np.moveaxis(np.asarray(o), 0, dim) for o in outs))


def normalize_reference(rowmap, x: torch.Tensor, dim: int) -> torch.Tensor:
    """``map(x, *prep(state))`` along ``dim``, float64."""
    monoid = rowmap.monoid
    xs = _elements_first(monoid, x, dim)
    state = fold(monoid, xs, "tree")
    prep = compile_graph(rowmap.prep_graph, "numpy")
    fmap = compile_graph(rowmap.map_graph, "numpy")
    with np.errstate(all="ignore"):
        consts = prep(*state)
        y = fmap(xs, *[np.asarray(c)[None] for c in consts])[0]
    y = np.broadcast_to(np.asarray(y, dtype=np.float64), xs.shape)
    # a copy, always: a broadcast map (one constant per row, e.g. rows of length 1) is a
    # read-only view whose elements share memory, and the caller owns the result
    return torch.from_numpy(np.array(np.moveaxis(y, 0, dim), order="C", copy=True))


def error_scale(monoid: Monoid, x: torch.Tensor, dim: int) -> np.ndarray:
    """Magnitude of the terms each output of ``monoid`` accumulates along ``dim``, per row
    (keepdims): the ``scale`` of :func:`flashfold.testing.assert_close` (an fp32 kernel's
    error is a few ulps of this, whatever the order of its combines).

    ``sum |x|`` for additive states (SUM, MAX_PREFIX_SUM-like), ``max |x|^2·n`` for
    WELFORD, ``prod (1 + |x|)^2`` for products of lifted 2x2 matrices (MATMUL2 of the
    tests: each factor's entries are at most ``1 + |x| + x^2``), ``1 + max |x|``
    otherwise (LOGSUMEXP, ...).
    """
    a = np.abs(np.moveaxis(to_numpy64(x), dim, -1))
    a = np.where(np.isfinite(a), a, 0.0)
    n = a.shape[-1]
    big = a.max(axis=-1, keepdims=True, initial=0.0)
    name = monoid.name
    if name in ("sum", "max_prefix_sum"):
        s = a.sum(axis=-1, keepdims=True)
    elif name == "welford":
        s = big * big * max(n, 1) + big
    elif name == "matmul2":
        s = np.prod((1.0 + a) ** 2, axis=-1, keepdims=True)
    else:
        s = 1.0 + big
    return np.maximum(np.moveaxis(s, -1, dim), 1.0)
