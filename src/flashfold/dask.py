"""Any flashfold monoid as a Dask reduction or prefix scan.

A monoid :math:`(S, \\oplus, e)` with ``lift`` and ``finalize`` reduces the elements
:math:`x_1, \\dots, x_n` of a chunked axis to

.. math::

    \\mathrm{finalize}\\big(\\underbrace{(\\mathrm{lift}(x_1) \\oplus \\dots
    \\oplus \\mathrm{lift}(x_{c_1}))}_{\\text{chunk } 1} \\oplus \\dots \\oplus
    \\underbrace{(\\dots \\oplus \\mathrm{lift}(x_n))}_{\\text{chunk } K}\\big),

and associativity says any bracketing gives the same value (up to rounding), so the
three phases of :func:`dask.array.reduction` are exactly

* ``chunk``: lift and fold one chunk along the reduced axes (the monoid's block lift when
  it has one, else an order-preserving pairwise tree of ``combine``), giving one state per
  output position;
* ``combine``: fold the partial states of neighbouring chunks, **in chunk order**
  (``dask.array.reduction`` concatenates partials along the axis in block order and
  groups consecutive blocks, so non-commutative monoids such as a matrix product are
  reduced correctly);
* ``aggregate``: fold the last partials, then ``finalize`` (with its parameters, e.g.
  WELFORD's ``correction``).

A state is a tuple of fields; between Dask tasks it travels as one NumPy *structured*
array (field ``f{k}`` = the monoid's ``k``-th field, ``float64``, or ``int64`` for
``Field(dtype="int")`` such as ARGMAX's index, with a ``(d,)`` sub-array for vector
fields), so integer fields stay exact. Inputs of multi-input monoids (ATTENTION's
scores and values) and the element positions of monoids with a ``"position"`` input
(ARGMAX, ARGMIN) are packed the same way, before the reduction.

Positions are **global**: the C-order flat index of an element within the reduced axes
of the whole array (for one axis, its index along that axis), built from ``x.chunks``,
so ties in ARGMAX resolve to the lowest global index across chunk boundaries.

A non-commutative monoid reduced over several axes at once needs every reduced axis but
the first to be one chunk: only then is chunk order the C order of the elements.

:func:`scan` uses :func:`dask.array.reductions.cumreduction` over the lifted states (the
lift is an elementwise map): each chunk is scanned locally (Hillis-Steele,
order-preserving), then the carried state :math:`c` of all earlier chunks is combined
*on the left* of every local prefix, :math:`c \\oplus p_i` (``method="sequential"``: a
chain over the chunks; ``"blelloch"``: an up-/down-sweep tree). Empty chunks along the
scanned axis are dropped for the scan (``cumreduction`` carries the last prefix of the
previous chunk, which an empty chunk lacks) and restored in the result's chunks.
Suffix scans are prefix scans of the flipped axis under :math:`a \\oplus' b = b \\oplus a`.

Dask is an optional extra (``pip install flashfold[dask]``); it is imported when a
function here is called, never by ``import flashfold``. Every task runs the NumPy
executor of :mod:`flashfold.algebra.evaluate` in float64; on a distributed cluster the
monoid travels as its definition (the Python functions, pickled by cloudpickle) and is
re-traced once per worker process.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from .algebra.evaluate import numpy_monoid
from .algebra.monoid import Monoid
from .schedules import combine_states

__all__ = ["reduce", "scan"]

_INSTALL_HINT = "flashfold.dask needs Dask: install the extra with `pip install flashfold[dask]`"


def _dask_array():
    """``dask.array``, or an ImportError naming the extra to install."""
    try:
        import dask.array as da
    except ImportError as e:  # pragma: no cover - exercised only without dask
        raise ImportError(f"{_INSTALL_HINT} ({e})") from e
    return da


# --- the per-task work, picklable for distributed workers ------------------------------

#: monoids rebuilt from their definition in this process (worker side), by token
_REBUILT: dict = {}


def _monoid_token(monoid: Monoid) -> tuple:
    graphs = (monoid.lift_graph, monoid.combine_graph, monoid.finalize_graph,
              monoid.block_lift_graph)
    return (monoid.name,) + tuple(None if g is None else g.key() for g in graphs) + (
        monoid.field_names, tuple(f.dtype for f in monoid.fields), monoid.identity,
        monoid.params)


def _rebuild(token: tuple, definition: dict) -> Monoid:
    m = _REBUILT.get(token)
    if m is None:
        m = _REBUILT[token] = Monoid(**definition)
    return m


def _take(state, idx):
    return tuple(s[idx] for s in state)


class _Kernel:
    """The functions Dask calls on blocks, for one monoid and one call's layout.

    ``ndim``: number of scalar axes of the (packed) input; ``axes``: the reduced (or
    scanned) axes, sorted; ``packed``: whether blocks are structured arrays of inputs
    (``i{k}`` per monoid input) instead of one plain float array; ``width``: feature width
    of vector fields (or None); ``params``: finalize's parameters; ``reverse``: scans
    combine with ``a ⊕' b = b ⊕ a`` (a suffix scan is a prefix scan of the flipped axis).
    """

    def __init__(self, monoid: Monoid, ndim: int, axes: tuple, packed: bool,
                 width: int | None, params: dict, reverse: bool = False):
        self.monoid = monoid
        self.token = _monoid_token(monoid)
        self.ndim, self.axes, self.packed = ndim, tuple(axes), packed
        self.width, self.params, self.reverse = width, dict(params), reverse
        self._setup()

    def _setup(self):
        self.ex = numpy_monoid(self.monoid)
        w = self.width
        self.state_dtype = np.dtype([
            (f"f{k}", dt) if not f.vector else (f"f{k}", dt, (w,))
            for k, (f, dt) in enumerate(zip(self.monoid.fields, self.ex.dtypes))])
        probe = self.ex.finalize(self.ex.identity((1,), w), **self.params)
        self.output_dtype = np.dtype([
            (f"o{k}", o.dtype) if o.ndim == 1 else (f"o{k}", o.dtype, o.shape[1:])
            for k, o in enumerate(probe)])
        self.input_dtype = np.dtype([
            (f"i{k}", np.int64) if i.domain == "position" else
            ((f"i{k}", np.float64, (w,)) if i.vector else (f"i{k}", np.float64))
            for k, i in enumerate(self.monoid.inputs)])
        self.ident = np.array(tuple(self.ex.identity((), w)), dtype=self.state_dtype)[()]

    # pickling: the monoid travels as its definition and is re-traced on the worker
    def __getstate__(self):
        definition = {f.name: getattr(self.monoid, f.name) for f in dataclasses.fields(Monoid)}
        return {"token": self.token, "definition": definition, "ndim": self.ndim,
                "axes": self.axes, "packed": self.packed, "width": self.width,
                "params": self.params, "reverse": self.reverse}

    def __setstate__(self, st):
        self.monoid = _rebuild(st["token"], st["definition"])
        self.token = st["token"]
        for k in ("ndim", "axes", "packed", "width", "params", "reverse"):
            setattr(self, k, st[k])
        self._setup()

    def __dask_tokenize__(self):
        return ("flashfold.dask._Kernel", self.token, self.ndim, self.axes, self.packed,
                self.width, sorted(self.params.items()), self.reverse)

    # -- packing ------------------------------------------------------------------------
    def pack_inputs(self, *blocks):
        """Blocks of each monoid input (positions included) -> one structured block."""
        shape = blocks[0].shape[:self.ndim]
        out = np.empty(shape, self.input_dtype)
        for k, b in enumerate(blocks):
            out[f"i{k}"] = b
        return out

    def _inputs(self, block):
        if self.packed:
            return [block[f"i{k}"] for k in range(len(self.monoid.inputs))]
        return [np.asarray(block, dtype=np.float64)]

    def _front(self, arrays, axes):
        """Move ``axes`` to the front of each array and flatten them (C order) into one."""
        ref = arrays[0]
        n = math.prod(ref.shape[a] for a in axes)
        batch = tuple(ref.shape[a] for a in range(self.ndim) if a not in axes)
        dest = tuple(range(len(axes)))
        flat = [np.moveaxis(a, axes, dest).reshape((n,) + batch + a.shape[self.ndim:])
                for a in arrays]
        return flat, n, batch

    def _combine(self, a, b):
        return self.ex.combine(b, a) if self.reverse else self.ex.combine(a, b)

    def _fold(self, states, n, batch):
        """Order-preserving pairwise fold of a stack of states (leading axis) with ``⊕``."""
        if n == 0:
            return self.ex.identity(batch, self.width)
        return combine_states(self.ex, states, "tree", None)

    def _keep(self, axes, keepdims, shape):
        return tuple(1 if a in axes else s for a, s in enumerate(shape)) if keepdims else \
            tuple(s for a, s in enumerate(shape) if a not in axes)

    def _to_record(self, arrays, dtype, prefix, shape):
        out = np.empty(shape, dtype)
        for k, a in enumerate(arrays):
            out[f"{prefix}{k}"] = a.reshape(shape + dtype[k].shape)
        return out

    def _states_of(self, block, axes):
        fields = [block[f"f{k}"] for k in range(len(self.monoid.fields))]
        return self._front(fields, axes)

    # -- reduction: chunk, combine, aggregate -------------------------------------------
    def _chunk_state(self, block, axes):
        inputs, n, batch = self._front(self._inputs(block), axes)
        if n == 0:
            return self.ex.identity(batch, self.width)
        if self.ex.has_block_lift:
            return self.ex.block_lift(inputs, self.width)
        return self._fold(self.ex.lift(inputs, self.width), n, batch)

    def chunk(self, block, axis, keepdims=True, computing_meta=False):
        """Lift and fold one input block along ``axis``: structured state, reduced axes kept.

        (Dask probes the chunk function for its output type with ``computing_meta=True``
        and casts that to the reduction's final dtype, the structured *outputs*; the probe
        therefore gets an empty array of that dtype.)
        """
        if computing_meta:
            return np.empty((0,) * self.ndim, self.output_dtype)
        state = self._chunk_state(block, tuple(axis))
        return self._to_record(state, self.state_dtype, "f",
                               self._keep(axis, True, block.shape[:self.ndim]))

    def combine(self, block, axis, keepdims=True):
        """Fold the concatenated partial states of neighbouring chunks, in order."""
        states, n, batch = self._states_of(block, tuple(axis))
        state = self._fold(states, n, batch)
        return self._to_record(state, self.state_dtype, "f", self._keep(axis, keepdims, block.shape))

    def aggregate(self, block, axis, keepdims=False):
        """Fold the last partial states, then finalize: structured outputs ``o{k}``."""
        states, n, batch = self._states_of(block, tuple(axis))
        state = self._fold(states, n, batch)
        outs = self.ex.finalize(state, **self.params)
        return self._to_record(outs, self.output_dtype, "o", self._keep(axis, keepdims, block.shape))

    # -- scan (over states: the lift is a separate elementwise map) ------------------------
    def lift_block(self, block):
        """Elementwise lift of one input block: structured states of the same shape."""
        shape = block.shape[:self.ndim]
        inputs = [a.reshape((-1,) + a.shape[self.ndim:]) for a in self._inputs(block)]
        if math.prod(shape) == 0:
            return np.empty(shape, self.state_dtype)
        return self._to_record(self.ex.lift(inputs, self.width), self.state_dtype, "f", shape)

    def scan_block(self, block, axis, dtype=None):
        """Inclusive local scan of a block of states along ``axis`` (Hillis-Steele, in order)."""
        s, n, _ = self._states_of(block, (axis,))
        off = 1
        while off < n:
            tail = self._combine(_take(s, slice(0, n - off)), _take(s, slice(off, n)))
            s = tuple(np.concatenate([x[:off], t]) for x, t in zip(s, tail))
            off *= 2
        s = tuple(np.moveaxis(x, 0, axis) for x in s)
        return self._to_record(s, self.state_dtype, "f", block.shape)

    def scan_reduce(self, block, axis, keepdims=True):
        """Fold of a block of states along ``axis`` (the up-sweep input of Blelloch's scan)."""
        s, n, batch = self._states_of(block, (axis,))
        if self.reverse:       # under a ⊕' b = b ⊕ a: the ⊕-fold of the stack read backwards
            s = _take(s, slice(None, None, -1))
        state = self._fold(s, n, batch)
        return self._to_record(state, self.state_dtype, "f", self._keep((axis,), True, block.shape))

    def scan_binop(self, carry, block):
        """``carry ⊕ p`` for every state ``p`` of ``block`` (``carry`` broadcasts)."""
        k = len(self.monoid.fields)
        a = tuple(carry[f"f{i}"] for i in range(k))
        b = tuple(block[f"f{i}"] for i in range(k))
        shape = np.broadcast_shapes(carry.shape, block.shape)
        if 0 in shape:
            return np.empty(shape, self.state_dtype)
        return self._to_record(self._combine(a, b), self.state_dtype, "f", shape)

    def finalize_block(self, block):
        """Structured prefix states -> structured finalized outputs, elementwise."""
        state = tuple(block[f"f{i}"].copy() for i in range(len(self.monoid.fields)))
        if block.size == 0:
            return np.empty(block.shape, self.output_dtype)
        outs = self.ex.finalize(state, **self.params)
        return self._to_record(outs, self.output_dtype, "o", block.shape)


def _field(block, name):
    return block[name].copy()     # a contiguous array of its own (not a view of the record)


# --- validation ------------------------------------------------------------------------

def _check_monoid(monoid):
    if not isinstance(monoid, Monoid):
        raise TypeError(f"monoid: expected a flashfold Monoid, got {type(monoid).__name__}")


def _check_inputs(da, monoid: Monoid, x):
    """The data inputs as dask arrays (float64), their scalar ndim and the feature width."""
    data = [i for i in monoid.inputs if i.domain != "position"]
    if len(data) == 1 and not isinstance(x, (tuple, list)):
        x = (x,)
    if not isinstance(x, (tuple, list)) or len(x) != len(data):
        raise ValueError(f"x: monoid {monoid.name!r} takes {len(data)} inputs "
                         f"{tuple(i.name for i in data)}; pass them as a tuple of dask arrays")
    arrays = []
    for inp, a in zip(data, x):
        if not isinstance(a, da.Array):
            raise TypeError(f"x: input {inp.name!r} must be a dask.array.Array, got "
                            f"{type(a).__name__} (wrap NumPy arrays with "
                            f"dask.array.from_array(a, chunks=...))")
        if a.dtype.kind != "f":
            raise TypeError(f"x: input {inp.name!r} must be a floating-point array, got dtype {a.dtype}")
        if a.ndim < 1 + inp.vector:
            raise ValueError(f"x: input {inp.name!r} needs at least {1 + inp.vector} "
                             f"dimension(s), got shape {a.shape}")
        arrays.append(a)
    ndim = arrays[0].ndim - data[0].vector
    shape = arrays[0].shape[:ndim]
    width = None
    for inp, a in zip(data, arrays):
        if a.ndim - inp.vector != ndim or a.shape[:ndim] != shape:
            raise ValueError(f"x: input {inp.name!r} has shape {a.shape}, which does not match "
                             f"{data[0].name!r} {arrays[0].shape} outside the feature axis")
        if inp.vector:
            if width is not None and a.shape[-1] != width:
                raise ValueError("x: vector inputs disagree on their feature width")
            width = a.shape[-1]
    if width is not None and (isinstance(width, float) and math.isnan(width)):
        raise ValueError("x: the feature axis of a vector input has an unknown size")
    if width is None and any(f.vector for f in monoid.fields):
        raise ValueError(f"x: monoid {monoid.name!r} has vector fields but no vector input")
    return arrays, ndim, width


def _check_axis(axis, ndim: int, *, allow_many: bool) -> tuple:
    if axis is None and allow_many:
        return tuple(range(ndim))
    many = isinstance(axis, (tuple, list))
    if many and not allow_many:
        raise TypeError(f"axis: expected one int, got {axis!r}")
    items = tuple(axis) if many else (axis,)
    out = []
    for a in items:
        if isinstance(a, bool) or not isinstance(a, numbers.Integral):
            raise TypeError(f"axis: expected {'None, an int or a tuple of ints' if allow_many else 'an int'}, "
                            f"got {axis!r}")
        if not -ndim <= a < ndim:
            raise ValueError(f"axis: {a} is out of range for an input with {ndim} "
                             f"dimension(s) (outside the feature axis)")
        out.append(int(a) % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"axis: repeated axis in {axis!r}")
    return tuple(sorted(out))


def _check_params(monoid: Monoid, params: dict):
    names = [p for p, _ in monoid.params]
    unknown = sorted(set(params) - set(names))
    if unknown:
        raise TypeError(f"{unknown[0]}: monoid {monoid.name!r} takes no parameter {unknown[0]!r}; "
                        f"its finalize parameters are {names}")
    for k, v in params.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{k}: expected a real number, got {v!r}")


def _positions(da, shape, chunks, axes):
    """Global C-order flat index of each element within ``axes``, chunked like the input."""
    for a in axes:
        if any(isinstance(c, float) and math.isnan(c) for c in chunks[a]):
            raise ValueError("x: positions need known chunk sizes along the reduced axes; "
                             "call x.compute_chunk_sizes() first")
    ndim = len(shape)
    if not axes:                           # no reduced axis: each element is position 0
        return da.zeros(shape, chunks=chunks, dtype=np.int64)
    pos, stride = None, 1
    for a in reversed(axes):
        idx = da.arange(shape[a], chunks=(chunks[a],), dtype=np.int64) * stride
        idx = idx[tuple(slice(None) if b == a else None for b in range(ndim))]
        pos = idx if pos is None else pos + idx
        stride *= shape[a]
    return da.broadcast_to(pos, shape, chunks=chunks)


def _prepare(da, monoid, x, axes_of, params):
    """Validate; return (packed or plain input, kernel arguments)."""
    _check_monoid(monoid)
    arrays, ndim, width = _check_inputs(da, monoid, x)
    axes = axes_of(ndim)
    _check_params(monoid, params)
    has_pos = any(i.domain == "position" for i in monoid.inputs)
    packed = len(monoid.inputs) > 1
    if not packed:
        return arrays[0], ndim, axes, packed, width
    if any(isinstance(c, float) and math.isnan(c) for cs in arrays[0].chunks for c in cs):
        raise ValueError(f"x: monoid {monoid.name!r} takes several inputs (element positions "
                         f"included), and packing them needs known chunk sizes; call "
                         f"x.compute_chunk_sizes() first")
    ind = tuple(range(ndim))
    pairs, it = [], iter(arrays)
    pos = _positions(da, arrays[0].shape[:ndim], arrays[0].chunks[:ndim], axes) if has_pos else None
    for inp in monoid.inputs:
        if inp.domain == "position":
            pairs += [pos, ind]
        else:
            a = next(it)
            pairs += [a, ind + ((ndim,) if inp.vector else ())]
    return pairs, ndim, axes, packed, width


def _pack(da, kernel, pairs, ndim):
    return da.blockwise(kernel.pack_inputs, tuple(range(ndim)), *pairs, concatenate=True,
                        dtype=kernel.input_dtype, meta=np.empty((0,) * ndim, kernel.input_dtype),
                        name=f"flashfold-pack-{kernel.monoid.name}-" + _token(kernel, pairs))


def _token(*args):
    from dask.base import tokenize
    return tokenize(*args)


def _unpack_outputs(kernel, result):
    """Structured outputs -> one dask array per output (a vector output gets a ``(d,)`` axis)."""
    outs = []
    for k in range(len(kernel.output_dtype.names)):
        dt = kernel.output_dtype[k]
        if dt.shape:
            outs.append(result.map_blocks(_field, f"o{k}", dtype=dt.base,
                                          chunks=result.chunks + tuple((s,) for s in dt.shape),
                                          new_axis=list(range(result.ndim, result.ndim + len(dt.shape))),
                                          meta=np.empty((0,) * (result.ndim + len(dt.shape)), dt.base)))
        else:
            outs.append(result.map_blocks(_field, f"o{k}", dtype=dt,
                                          meta=np.empty((0,) * result.ndim, dt)))
    return outs[0] if len(outs) == 1 else tuple(outs)


# --- public functions ------------------------------------------------------------------

def reduce(monoid: Monoid, x, axis=None, *, keepdims: bool = False, split_every=None,
           **params):
    """Reduce a chunked Dask array with ``monoid``: lazily, on any Dask scheduler.

    .. math::

        y[b] = \\mathrm{finalize}\\Big(\\bigoplus_{i \\in \\text{axis}}
        \\mathrm{lift}(x[i, b])\\Big)

    with the elements taken in C order of the reduced axes (which matters only for a
    non-commutative monoid). Chunks are folded in parallel (``chunk``), their states
    combined in a tree of at most ``split_every`` neighbours (``combine``, in chunk order),
    and the last combine is finalized (``aggregate``); see the module docstring.

    Parameters
    ----------
    monoid: any :class:`~flashfold.Monoid` (built-in or user-defined).
    x: a ``dask.array.Array`` of floating dtype (computed in float64) of shape
        ``(*S,)``; for a monoid with several data inputs, a tuple of them in the order of
        ``monoid.inputs`` (e.g. ATTENTION: ``(scores (*S,), values (*S, d))``; chunks of the
        shared axes are unified by Dask, which may rechunk). ``"position"`` inputs are not
        passed: they are the global flat indices of the elements within the reduced axes.
    axis: ``None`` (all axes), an int or a tuple of ints of ``S`` (negative allowed).
        A non-commutative monoid over several axes needs every reduced axis but the
        first to be a single chunk (otherwise chunk order is not element order).
    keepdims: keep the reduced axes with length 1.
    split_every: as in :func:`dask.array.reduction` (an int >= 2 or a dict axis -> int):
        the largest number of neighbouring partial states one ``combine`` task folds.
    **params: ``finalize``'s parameters (e.g. ``correction=1`` for WELFORD).

    Returns
    -------
    One dask array of shape ``S`` without the reduced axes (plus ``(d,)`` for a vector
    output) when ``finalize`` has one output, else a tuple of them in ``monoid.outputs``
    order (WELFORD: ``(mean, var)``; ARGMAX: ``(value, index)``, index ``int64``; a monoid
    without ``finalize``: its state fields). Float outputs are ``float64``. An empty
    reduced axis gives ``finalize(identity)`` (LOGSUMEXP: ``-inf``; ARGMAX: ``(-inf,
    INDEX_IDENTITY)``; WELFORD: ``(0, nan)``).

    Raises ``TypeError`` for a non-Monoid ``monoid``, a ``x`` that is not a floating dask
    array, an unknown finalize parameter; ``ValueError`` for a bad ``axis`` or
    ``split_every`` and for inputs that do not fit the monoid.
    """
    da = _dask_array()
    many = isinstance(axis, (tuple, list)) or axis is None
    src, ndim, axes, packed, width = _prepare(
        da, monoid, x, lambda nd: _check_axis(axis, nd, allow_many=True), params)
    if split_every is not None:
        ok = (isinstance(split_every, numbers.Integral) and not isinstance(split_every, bool)
              and split_every >= 2) or (isinstance(split_every, dict) and all(
                  isinstance(v, numbers.Integral) and v >= 2 for v in split_every.values()))
        if ok and isinstance(split_every, dict):
            # keys name axes of x (negative ones from the end), as dask reads them
            ok = all(isinstance(a, numbers.Integral) and not isinstance(a, bool)
                     and -ndim <= a < ndim for a in split_every)
        if not ok:
            raise ValueError(f"split_every: expected None, an int >= 2 or a dict axis of x -> "
                             f"int >= 2, got {split_every!r}")
    kernel = _Kernel(monoid, ndim, axes, packed, width, params)
    arr = _pack(da, kernel, src, ndim) if packed else src
    if not monoid.commutative and many:
        split = [a for a in axes[1:] if arr.numblocks[a] > 1]
        if split:
            raise ValueError(f"axis: monoid {monoid.name!r} is not commutative, so reducing axes "
                             f"{axes} at once needs axes {split} to be one chunk each (chunk order "
                             f"must be element order); rechunk them or reduce one axis at a time")
    out_ndim = ndim if keepdims else ndim - len(axes)
    result = da.reduction(
        arr, kernel.chunk, kernel.aggregate, axis=axes, keepdims=keepdims,
        dtype=kernel.output_dtype, split_every=split_every, combine=kernel.combine,
        name=f"flashfold-{monoid.name}", concatenate=True,
        meta=np.empty((0,) * out_ndim, kernel.output_dtype))
    return _unpack_outputs(kernel, result)


def scan(monoid: Monoid, x, axis: int, *, reverse: bool = False, method: str = "sequential",
         **params):
    """Inclusive prefix scan of a chunked Dask array with ``monoid``, finalized.

    .. math::

        y[i] = \\mathrm{finalize}\\big(\\mathrm{lift}(x_0) \\oplus \\dots \\oplus
        \\mathrm{lift}(x_i)\\big) \\quad\\text{or, with } ``reverse``,\\quad
        y[i] = \\mathrm{finalize}\\big(\\mathrm{lift}(x_i) \\oplus \\dots \\oplus
        \\mathrm{lift}(x_{n-1})\\big)

    along ``axis`` (operand order preserved, so non-commutative monoids are fine). Built on
    :func:`dask.array.reductions.cumreduction`: each chunk is scanned locally, then the
    state of all earlier chunks is combined on the left of each local prefix.

    Parameters
    ----------
    monoid, x, **params: as in :func:`reduce` (``"position"`` inputs are the global
        indices along ``axis``).
    axis: the scanned axis (an int; negative allowed).
    reverse: suffix scan instead of prefix scan.
    method: ``"sequential"`` (a chain of carries over the chunks, the fewest tasks) or
        ``"blelloch"`` (a work-efficient up-/down-sweep tree, depth ``2 log2`` chunks).

    Returns
    -------
    One dask array shaped like ``x`` (plus ``(d,)`` for a vector output), or a tuple of
    them, as :func:`reduce`. Exclusive scans are not offered: ``cumreduction`` carries the
    *last* local prefix of each chunk, which an exclusive local scan does not contain.
    """
    da = _dask_array()
    from dask.array.reductions import cumreduction
    if method not in ("sequential", "blelloch"):
        raise ValueError(f"method: expected 'sequential' or 'blelloch', got {method!r}")
    if not isinstance(reverse, bool):
        raise TypeError(f"reverse: expected True or False, got {reverse!r}")
    src, ndim, axes, packed, width = _prepare(
        da, monoid, x, lambda nd: _check_axis(axis, nd, allow_many=False), params)
    ax = axes[0]
    # (packed inputs have known chunk sizes already: _prepare checks them). Unknown sizes
    # along the scanned axis hide empty chunks, which break the carry between chunks;
    # along the other axes cumreduction's "sequential" chain cannot shape its identity.
    unknown = [a for a in range(ndim) if (a == ax or method == "sequential") and not packed
               and any(isinstance(c, float) and math.isnan(c) for c in src.chunks[a])]
    if unknown:
        raise ValueError(f"x: a {method} scan along axis {ax} needs known chunk sizes along "
                         f"axes {unknown}; call x.compute_chunk_sizes() first")
    kernel = _Kernel(monoid, ndim, axes, packed, width, params, reverse=reverse)
    arr = _pack(da, kernel, src, ndim) if packed else src
    states = arr.map_blocks(kernel.lift_block, dtype=kernel.state_dtype,
                            meta=np.empty((0,) * ndim, kernel.state_dtype))
    # cumreduction carries "the last prefix of the previous chunk", which an empty chunk
    # lacks: scan without empty chunks (every block stays whole; only empty ones go)
    chunks = states.chunks[ax]
    nonempty = tuple(c for c in chunks if c != 0) or (0,)
    if nonempty != chunks:
        states = states.rechunk({ax: nonempty})
    flip = (slice(None),) * ax + (slice(None, None, -1),)
    if reverse:
        states = states[flip]
    states = cumreduction(kernel.scan_block, kernel.scan_binop, kernel.ident, states, axis=ax,
                          dtype=kernel.state_dtype, method=method, preop=kernel.scan_reduce)
    if reverse:
        states = states[flip]
    if nonempty != chunks:
        states = states.rechunk({ax: chunks})
    result = states.map_blocks(kernel.finalize_block, dtype=kernel.output_dtype,
                               meta=np.empty((0,) * ndim, kernel.output_dtype))
    return _unpack_outputs(kernel, result)
