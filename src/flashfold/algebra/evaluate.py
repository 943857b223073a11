"""Running a monoid's traced graphs on NumPy arrays (float64): the reference semantics.

A *state* here is a tuple of arrays, one per field: a scalar field has the batch shape,
a vector field the batch shape plus a trailing feature axis ``(d,)``. Elements are arrays
whose leading axis enumerates them. Everything is elementwise, so one call combines a
whole batch of states at once; the schedules in :mod:`flashfold.schedules` are loops over
these calls.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import numpy as np

from .lower import NUMPY, Backend, compile_graph
from .monoid import Monoid

_CACHE: "weakref.WeakKeyDictionary[Monoid, NumpyMonoid]" = weakref.WeakKeyDictionary()


def numpy_monoid(monoid: Monoid) -> "NumpyMonoid":
    """The (cached) NumPy executor of ``monoid``."""
    if not isinstance(monoid, Monoid):
        raise TypeError(f"monoid: expected a flashfold Monoid, got {type(monoid).__name__}")
    try:
        return _CACHE[monoid]
    except KeyError:
        ex = _CACHE[monoid] = NumpyMonoid(monoid)
        return ex
    except TypeError:  # unhashable user object: no cache
        return NumpyMonoid(monoid)


class NumpyMonoid:
    """``lift``, ``combine``, ``block_lift`` and ``finalize`` of a monoid over NumPy arrays.

    Scalar-class values are given a trailing axis of 1 while a monoid with vector fields
    is evaluated, so that they broadcast against ``(..., d)`` accumulators; results are
    squeezed back and broadcast to full state shape.
    """

    def __init__(self, monoid: Monoid, backend: Backend = NUMPY):
        self.monoid = monoid
        self.backend = backend
        self._lift = compile_graph(monoid.lift_graph, backend)
        self._combine = compile_graph(monoid.combine_graph, backend)
        self._finalize = compile_graph(monoid.finalize_graph, backend)
        self._block = (compile_graph(monoid.block_lift_graph, backend)
                       if monoid.block_lift_graph is not None else None)
        self._block_scan = (compile_graph(monoid.block_scan_graph, backend)
                            if monoid.block_scan_graph is not None else None)
        self._scan_exact = (compile_graph(monoid.scan_exact_graph, backend)
                            if monoid.scan_exact_graph is not None else None)
        self.expand = monoid.has_vector
        self.dtypes = tuple(np.int64 if f.dtype == "int" else np.float64 for f in monoid.fields)

    # -- helpers ----------------------------------------------------------------
    def _args(self, arrays: Sequence[np.ndarray], vector_flags: Sequence[bool]):
        if not self.expand:
            return list(arrays)
        return [a if vec else np.asarray(a)[..., None] for a, vec in zip(arrays, vector_flags)]

    def _state(self, outs, shape: tuple, width: int | None):
        result = []
        for f, o, dt in zip(self.monoid.fields, outs, self.dtypes):
            o = np.asarray(o)
            if self.expand and not f.vector and o.ndim >= 1:
                o = o[..., 0]
            full = shape + ((width,) if f.vector else ())
            result.append(np.array(np.broadcast_to(o, full), dtype=dt))
        return tuple(result)

    # -- the four functions -------------------------------------------------------
    def identity(self, shape: tuple = (), width: int | None = None):
        return tuple(np.full(shape + ((width,) if f.vector else ()), v, dtype=dt)
                     for f, v, dt in zip(self.monoid.fields, self.monoid.identity, self.dtypes))

    def lift(self, inputs: Sequence[np.ndarray], width: int | None):
        """States of each element; ``inputs`` in ``monoid.inputs`` order, positions included."""
        shape = _scalar_shape(inputs, self.monoid)
        with np.errstate(all="ignore"):
            outs = self._lift(*self._args(inputs, [i.vector for i in self.monoid.inputs]))
        return self._state(outs, shape, width)

    def combine(self, a, b):
        fields = self.monoid.fields
        shape = np.broadcast_shapes(*(x.shape[:x.ndim - f.vector] for x, f in zip(a + b, fields + fields)))
        width = _width(a, fields) or _width(b, fields)
        with np.errstate(all="ignore"):
            outs = self._combine(*self._args(a + b, [f.vector for f in fields] * 2))
        return self._state(outs, shape, width)

    @property
    def has_block_lift(self) -> bool:
        return self._block is not None

    def block_lift(self, inputs: Sequence[np.ndarray], width: int | None):
        """State of a whole block (leading axis) at once, through the monoid's block lift."""
        shape = _scalar_shape(inputs, self.monoid)[1:]
        valid = np.ones(_scalar_shape(inputs, self.monoid), dtype=bool)
        flags = [i.vector for i in self.monoid.inputs] + [False]
        with np.errstate(all="ignore"):
            outs = self._block(*self._args(list(inputs) + [valid], flags))
        return self._state(outs, shape, width)

    @property
    def has_block_scan(self) -> bool:
        return self._block_scan is not None

    def block_scan(self, inputs: Sequence[np.ndarray], valid: np.ndarray | None = None):
        """Prefix states of a block (leading axis) through the monoid's block scan, one per
        element, each broadcast to full state shape; ``valid`` masks trailing elements."""
        shape = _scalar_shape(inputs, self.monoid)
        if valid is None:
            valid = np.ones(shape, dtype=bool)
        if self.expand:
            raise ValueError(f"monoid {self.monoid.name!r}: block scans take scalar fields")
        with np.errstate(all="ignore"):
            outs = self._block_scan(*inputs, valid)
        return self._state(outs, shape, None)

    def scan_exact(self, state) -> np.ndarray:
        """``scan_exact`` of each state (a boolean array)."""
        with np.errstate(all="ignore"):
            (flag,) = self._scan_exact(*state)
        return np.broadcast_to(np.asarray(flag, dtype=bool), np.shape(state[0]))

    def finalize(self, state, **params):
        names = [p for p, _ in self.monoid.params]
        unknown = set(params) - set(names)
        if unknown:
            raise TypeError(f"{self.monoid.name}.finalize got unknown parameters {sorted(unknown)}; "
                            f"it takes {names}")
        values = {**self.monoid.param_defaults, **params}
        fields = self.monoid.fields
        pvals = [np.float64(values[p]) for p in names]
        with np.errstate(all="ignore"):
            outs = self._finalize(*self._args(list(state) + pvals,
                                              [f.vector for f in fields] + [False] * len(pvals)))
        shape = state[0].shape[:state[0].ndim - fields[0].vector]
        width = _width(state, fields)
        results = []
        for o, node in zip(outs, self.monoid.finalize_graph.outputs):
            o = np.asarray(o)
            if self.expand and not node.vector and o.ndim >= 1:
                o = o[..., 0]
            results.append(np.array(np.broadcast_to(o, shape + ((width,) if node.vector else ()))))
        return tuple(results)


def _width(state, fields):
    for x, f in zip(state, fields):
        if f.vector:
            return x.shape[-1]
    return None


def _scalar_shape(inputs, monoid: Monoid) -> tuple:
    shapes = [np.shape(x)[:np.ndim(x) - i.vector] for x, i in zip(inputs, monoid.inputs)]
    return np.broadcast_shapes(*shapes)
