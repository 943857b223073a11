"""Reference schedules: any monoid, any bracketing, on NumPy arrays in float64.

These executors are the semantics every kernel is tested against. All of them compute
``lift(x_0) ⊕ lift(x_1) ⊕ ... ⊕ lift(x_{n-1})``; they differ only in bracketing and
(for commutative monoids) order, which associativity says cannot change the result
beyond rounding.

``fold(monoid, xs, schedule, blocks=...)``:

* ``blocks`` (optional) partitions the elements into consecutive blocks of the given
  sizes (uneven, length-1 and empty blocks allowed); each block's state is computed at
  once by the monoid's ``block_lift`` when it has one, else by a sequential fold. Without
  ``blocks`` every element is its own block.
* ``schedule`` orders the combination of the block states::

      sequential  ((s0 ⊕ s1) ⊕ s2) ⊕ ...              left fold
      reversed    ... ⊕ (s_{n-3} ⊕ (s_{n-2} ⊕ s_{n-1}))  right fold, last element first
      shuffled    a seeded random permutation, folded   (commutative monoids only)
      tree        pairwise, log2(n) levels              (the GPU's in-block tree)
      blocks      same as sequential (kept as a name for "blocks, then left fold")

``scan(monoid, xs)`` is the inclusive (or exclusive) prefix scan, computed in
``ceil(log2 n)`` Hillis-Steele steps, each combining ``s[i - 2^k] ⊕ s[i]`` in order, so it
is valid for non-commutative monoids too; ``reverse=True`` gives suffix scans.

Inputs: for a one-input monoid ``xs`` is an array whose leading axis enumerates the
elements (any further axes are independent batch rows); for a multi-input monoid (e.g.
``ATTENTION``: scores ``(n, ...)`` and values ``(n, ..., d)``) a tuple of arrays.
"""

from __future__ import annotations

import numbers
from typing import Sequence

import numpy as np

from ..algebra.evaluate import NumpyMonoid, numpy_monoid
from ..algebra.monoid import Monoid

SCHEDULES = ("sequential", "reversed", "shuffled", "tree", "blocks")

__all__ = ["fold", "scan", "finalize", "reduce_array", "SCHEDULES", "prepare_inputs",
           "combine_states"]


def prepare_inputs(monoid: Monoid, xs, name: str = "xs") -> tuple[list[np.ndarray], int, int | None]:
    """Validate ``xs`` for ``monoid`` and return (float64 inputs incl. positions, n, width)."""
    if not isinstance(monoid, Monoid):
        raise TypeError(f"monoid: expected a flashfold Monoid, got {type(monoid).__name__}")
    data_inputs = [i for i in monoid.inputs if i.domain != "position"]
    if not data_inputs:
        raise ValueError(f"monoid: {monoid.name!r} has no data input (positions are not "
                         f"data): there is nothing to fold over")
    if len(data_inputs) == 1 and not isinstance(xs, tuple):
        xs = (xs,)
    if not isinstance(xs, (tuple, list)) or len(xs) != len(data_inputs):
        raise ValueError(f"{name}: monoid {monoid.name!r} takes {len(data_inputs)} inputs "
                         f"{tuple(i.name for i in data_inputs)}; pass them as a tuple of arrays")
    arrays = []
    for inp, x in zip(data_inputs, xs):
        try:
            arr = np.asarray(x)
        except (TypeError, ValueError) as e:     # ragged lists; torch dtypes NumPy lacks
            kind = TypeError if isinstance(e, TypeError) else ValueError
            raise kind(f"{name}: input {inp.name!r} is not an array of numbers ({e})") from None
        if arr.dtype.kind not in "f":
            raise TypeError(f"{name}: input {inp.name!r} must be a floating-point array, "
                            f"got dtype {arr.dtype}")
        if arr.ndim < 1 + inp.vector:
            raise ValueError(f"{name}: input {inp.name!r} needs at least {1 + inp.vector} "
                             f"dimension(s) (elements{', features' if inp.vector else ''}), "
                             f"got shape {arr.shape}")
        arrays.append(arr.astype(np.float64, copy=False))
    n = arrays[0].shape[0]
    batch = arrays[0].shape[1:arrays[0].ndim - data_inputs[0].vector]
    width = None
    for inp, arr in zip(data_inputs, arrays):
        b = arr.shape[1:arr.ndim - inp.vector]
        if arr.shape[0] != n or b != batch:
            raise ValueError(f"{name}: input {inp.name!r} has shape {arr.shape}, which does not "
                             f"match {data_inputs[0].name!r} {arrays[0].shape} in elements/batch")
        if inp.vector:
            if width is not None and arr.shape[-1] != width:
                raise ValueError(f"{name}: vector inputs disagree on their feature width")
            width = arr.shape[-1]
    out, it = [], iter(arrays)
    for inp in monoid.inputs:
        if inp.domain == "position":
            out.append(np.broadcast_to(np.arange(n, dtype=np.int64).reshape((n,) + (1,) * len(batch)),
                                       (n,) + batch))
        else:
            out.append(next(it))
    if width is None and any(f.vector for f in monoid.fields):
        raise ValueError(f"{name}: monoid {monoid.name!r} has vector fields but no vector input")
    return out, n, width


def _take(state, idx):
    return tuple(x[idx] for x in state)


def combine_states(ex: NumpyMonoid, states, schedule: str, seed: int | None):
    """Combine a stack of states (leading axis) in the order ``schedule`` names."""
    k = states[0].shape[0]
    if schedule in ("sequential", "blocks"):
        acc = _take(states, 0) if k else None
        for i in range(1, k):
            acc = ex.combine(acc, _take(states, i))
        return acc
    if schedule == "reversed":
        acc = _take(states, k - 1) if k else None
        for i in range(k - 2, -1, -1):
            acc = ex.combine(_take(states, i), acc)
        return acc
    if schedule == "shuffled":
        if not ex.monoid.commutative:
            raise ValueError(f"schedule: 'shuffled' reorders elements, which monoid "
                             f"{ex.monoid.name!r} (not commutative) does not allow")
        perm = np.random.default_rng(seed).permutation(k)
        return combine_states(ex, _take(states, perm), "sequential", seed)
    if schedule == "tree":
        while states[0].shape[0] > 1:
            k = states[0].shape[0]
            even = k - k % 2
            paired = ex.combine(_take(states, slice(0, even, 2)), _take(states, slice(1, even, 2)))
            if k % 2:
                paired = tuple(np.concatenate([p, x[k - 1:k]]) for p, x in zip(paired, states))
            states = paired
        return _take(states, 0) if states[0].shape[0] else None
    raise ValueError(f"schedule: unknown schedule {schedule!r}; expected one of {SCHEDULES}")


def fold(monoid: Monoid, xs, schedule: str = "sequential", *, blocks: Sequence[int] | None = None,
         seed: int | None = 0):
    """Reduce the elements of ``xs`` with ``monoid`` in the bracketing ``schedule`` names.

    Parameters
    ----------
    monoid: a :class:`~flashfold.Monoid`.
    xs: ``(n, *batch)`` array (``(n, *batch, d)`` for vector inputs), or a tuple of them
        for multi-input monoids. Elements are along axis 0; ``n = 0`` gives the identity.
    schedule: one of ``"sequential"``, ``"reversed"``, ``"shuffled"``, ``"tree"``,
        ``"blocks"``.
    blocks: optional block sizes (non-negative ints summing to ``n``).
    seed: seed of the ``"shuffled"`` permutation.

    Returns the final state as ``monoid.State`` (a namedtuple of float64/int64 arrays of
    shape ``batch`` or ``batch + (d,)``).
    """
    if not isinstance(monoid, Monoid):
        raise TypeError(f"monoid: expected a flashfold Monoid, got {type(monoid).__name__}")
    if not isinstance(schedule, str) or schedule not in SCHEDULES:
        raise ValueError(f"schedule: unknown schedule {schedule!r}; expected one of {SCHEDULES}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        raise TypeError(f"seed: expected a non-negative int or None, got {type(seed).__name__}")
    if seed is not None and seed < 0:
        raise ValueError(f"seed: expected a non-negative int or None, got {seed!r}")
    if schedule == "shuffled" and not monoid.commutative:
        raise ValueError(f"schedule: 'shuffled' reorders elements, which monoid "
                         f"{monoid.name!r} (not commutative) does not allow")
    inputs, n, width = prepare_inputs(monoid, xs)
    ex = numpy_monoid(monoid)
    batch = inputs[0].shape[1:inputs[0].ndim - monoid.inputs[0].vector]
    if blocks is None:
        states = ex.lift(inputs, width)
    else:
        sizes = _check_blocks(blocks, n)
        states = _block_states(ex, inputs, sizes, batch, width)
    result = combine_states(ex, states, schedule, seed)
    if result is None:
        result = ex.identity(batch, width)
    return monoid.State(*(np.asarray(x) for x in result))   # arrays, also for n = 1


def _check_blocks(blocks, n: int) -> list[int]:
    if isinstance(blocks, (str, bytes)):
        raise TypeError(f"blocks: expected a sequence of ints, got {type(blocks).__name__}")
    try:
        given = list(blocks)             # once: an iterator would be exhausted by a 2nd pass
    except TypeError:
        raise TypeError(f"blocks: expected a sequence of ints, got {type(blocks).__name__}") from None
    if any(isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 0 for b in given):
        raise ValueError(f"blocks: block sizes must be non-negative integers, got {given}")
    sizes = [int(b) for b in given]
    if sum(sizes) != n:
        raise ValueError(f"blocks: block sizes sum to {sum(sizes)}, but there are {n} elements")
    return sizes


def _block_states(ex: NumpyMonoid, inputs, sizes, batch, width):
    """The state of each block: its block lift if any, else a sequential fold."""
    out = []
    start = 0
    for size in sizes:
        part = [x[start:start + size] for x in inputs]
        start += size
        if size == 0:
            out.append(ex.identity(batch, width))
        elif ex.has_block_lift:
            out.append(ex.block_lift(part, width))
        else:
            out.append(combine_states(ex, ex.lift(part, width), "sequential", None))
    if not out:
        return tuple(np.empty((0,) + x.shape, x.dtype) for x in ex.identity(batch, width))
    return tuple(np.stack(f) for f in zip(*out))


def scan(monoid: Monoid, xs, *, inclusive: bool = True, reverse: bool = False):
    """Prefix states of ``xs`` (suffix states with ``reverse=True``).

    Inclusive: ``out[i] = lift(x_0) ⊕ ... ⊕ lift(x_i)``; exclusive: ``out[0] = e`` and
    ``out[i] = lift(x_0) ⊕ ... ⊕ lift(x_{i-1})``. With ``reverse=True``:
    ``out[i] = lift(x_i) ⊕ ... ⊕ lift(x_{n-1})`` (order of operands preserved).

    Computed in ``ceil(log2 n)`` Hillis-Steele steps. Returns ``monoid.State`` of arrays
    with a leading axis of length ``n``.
    """
    for arg, v in (("inclusive", inclusive), ("reverse", reverse)):
        if not isinstance(v, (bool, np.bool_)):
            raise TypeError(f"{arg}: expected a bool, got {type(v).__name__}")
    inputs, n, width = prepare_inputs(monoid, xs)
    ex = numpy_monoid(monoid)
    s = ex.lift(inputs, width)
    if reverse:
        s = tuple(x[::-1] for x in s)
    combine = (lambda a, b: ex.combine(b, a)) if reverse else ex.combine
    off = 1
    while off < n:
        head = _take(s, slice(0, off))
        tail = combine(_take(s, slice(0, n - off)), _take(s, slice(off, n)))
        s = tuple(np.concatenate([h, t]) for h, t in zip(head, tail))
        off *= 2
    if not inclusive and n > 0:
        batch = s[0].shape[1:s[0].ndim - monoid.fields[0].vector]
        e = ex.identity(batch, width)
        s = tuple(np.concatenate([ei[None], x[:n - 1]]) for ei, x in zip(e, s))
    if reverse:
        s = tuple(np.ascontiguousarray(x[::-1]) for x in s)
    return monoid.State(*s)


def finalize(monoid: Monoid, state, **params):
    """``monoid.finalize`` of a state from :func:`fold`/:func:`scan` (NumPy arrays).

    Returns one array, or a tuple when the monoid has several outputs (e.g. WELFORD's
    ``(mean, var)``; ``correction=`` is its parameter). ``state``: one value (array or
    number) per field, in field order; ``params``: numbers, by the names the monoid declares.
    """
    if not isinstance(monoid, Monoid):
        raise TypeError(f"monoid: expected a flashfold Monoid, got {type(monoid).__name__}")
    if not isinstance(state, (tuple, list)) or len(state) != len(monoid.fields):
        got = f"{len(state)} values" if isinstance(state, (tuple, list)) else type(state).__name__
        raise ValueError(f"state: expected one value per field {monoid.field_names}, got {got}")
    for k, v in params.items():                  # (unknown names: the finalize says so)
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{k}: expected a number, got {type(v).__name__}")
    for f, v in zip(monoid.fields, state):       # NumPy would truncate 2.7 and wrap NaN
        if f.dtype == "int" and _numeric(v, np.float64) and np.asarray(v).dtype.kind == "f":
            x = np.asarray(v)
            if not (np.all(np.trunc(x) == x) and np.all(np.abs(x) < 2.0 ** 63)):
                raise ValueError(f"state: field {f.name!r} holds whole numbers (positions), "
                                 f"got {x!r}")
    try:
        state = tuple(np.asarray(v, dtype=np.int64 if f.dtype == "int" else np.float64)
                      for f, v in zip(monoid.fields, state))
    except (TypeError, ValueError):
        bad = next(f.name for f, v in zip(monoid.fields, state)
                   if not _numeric(v, np.int64 if f.dtype == "int" else np.float64))
        raise TypeError(f"state: field {bad!r} must be a number or a numeric array") from None
    state = _broadcast_state(monoid, state)
    outs = numpy_monoid(monoid).finalize(state, **params)
    return outs[0] if len(outs) == 1 else outs


def _broadcast_state(monoid: Monoid, state: tuple) -> tuple:
    """The fields of a state broadcast to one batch shape ``B``: a scalar field to ``B``, a
    vector field to ``B + (d,)`` (its trailing feature axis ``d`` kept), as a fold's state
    is laid out. ``ValueError`` naming the state when a vector field has no feature axis,
    the vector fields' widths differ, or the batch shapes do not broadcast."""
    fields = monoid.fields
    for f, x in zip(fields, state):
        if f.vector and x.ndim == 0:
            raise ValueError(f"state: field {f.name!r} is a vector field: it needs a trailing "
                             f"feature axis, got a number")
    widths = {x.shape[-1] for f, x in zip(fields, state) if f.vector}
    if len(widths) > 1:
        raise ValueError(f"state: the vector fields' feature axes differ: {sorted(widths)}")
    try:
        batch = np.broadcast_shapes(*(x.shape[:x.ndim - f.vector]
                                      for f, x in zip(fields, state)))
    except ValueError:
        raise ValueError(f"state: the fields' shapes {[x.shape for x in state]} do not "
                         f"broadcast to one batch shape (outside the feature axis of vector "
                         f"fields)") from None
    return tuple(np.broadcast_to(x, batch + x.shape[x.ndim - f.vector:])
                 for f, x in zip(fields, state))


def _numeric(v, dtype) -> bool:
    try:
        np.asarray(v, dtype=dtype)
    except (TypeError, ValueError):
        return False
    return True


def reduce_array(monoid: Monoid, xs, schedule: str = "tree", **params):
    """``finalize(fold(monoid, xs, schedule))``: the reduction's result in one call."""
    return finalize(monoid, fold(monoid, xs, schedule), **params)
