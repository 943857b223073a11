"""Tensor reductions and scans of any monoid, and the torch-like functions built on them.

With :math:`\\oplus` a monoid's combine, :math:`e` its identity and
:math:`s_i = \\mathrm{lift}(x_i)` (``lift(x_i, i)`` for monoids that read positions):

* ``reduce(m, x, dim)``: :math:`\\mathrm{finalize}(s_0 \\oplus s_1 \\oplus \\dots \\oplus s_{N-1})`
  along ``dim`` (the identity's finalize for an empty dim);
* ``segment_reduce(m, x, offsets, dim)``: the same over each segment
  :math:`[o_j, o_{j+1})` of ``dim`` (ragged, "varlen"); positions restart at 0;
* ``scan(m, x, dim, reverse)``: :math:`y_i = \\mathrm{finalize}(s_0 \\oplus \\dots \\oplus s_i)`,
  or :math:`\\mathrm{finalize}(s_i \\oplus \\dots \\oplus s_{N-1})` with ``reverse=True``.

On CUDA tensors these run the generated Triton kernels of
:mod:`flashfold.kernels.reduce` (state in float32, inputs float16/bfloat16/float32 read
through their strides, no copies); on CPU tensors the float64 reference schedules of
:mod:`flashfold.schedules`, cast back, with the same semantics. Float outputs have the
input's dtype (the inputs' promoted dtype), integer outputs (positions) int64. Monoids
that are not commutative keep the order of their operands on every schedule.

A monoid of several data inputs takes a tuple of tensors in its input order, broadcast
to one shape (views: a broadcast input is read with stride 0, never copied). What runs
where:

========================================  ==================  ==========================
monoid                                    CPU tensors         CUDA tensors
========================================  ==================  ==========================
scalar inputs (one or several), position  float64 reference   generated kernels
inputs, int fields, several outputs
vector inputs / fields (ATTENTION)        float64 reference   generated kernels, per
                                                              feature (see below)
========================================  ==================  ==========================

A vector input carries a trailing feature axis ``W`` (one width for all); vector outputs
keep it last. On CUDA such a monoid runs per feature: its graphs never mix features, so
the kernels run it with vector values taken as scalars and the feature axis as one more
batch dim (scalar inputs read with stride 0 along it); its scalar fields are computed
once per feature (ATTENTION's exponentials ``W`` times), and a scalar output is taken
from feature 0 (a copy of a ``W``-th of the vector outputs' size).

The conveniences follow torch's signatures and edge cases (shapes ``(..., N, ...)``):

==================  ===========================  ===========================================
function            monoid                        empty dim
==================  ===========================  ===========================================
``logsumexp``       LOGSUMEXP2 (base-2 twist)     ``-inf``
``softmax``         LOGSUMEXP2, then a row map    empty result
``var_mean``        WELFORD (``correction``)      ``(nan, nan)``
``argmax/argmin``   ARGMAX / ARGMIN               ``IndexError`` (as torch)
``cumsum``          SUM scan                      empty result
``logcumsumexp``    LOGSUMEXP2_SCAN scan          empty result
==================  ===========================  ===========================================

A row that is all ``-inf`` gives ``logsumexp = -inf``, ``softmax = nan`` (``0/0``, as
torch), ``argmax = 0``. LOGSUMEXP2's state holds ``x · log2 e``: on the kernels (CUDA
tensors, or the interpreter) a finite float32 entry of magnitude above
``FLOAT32_MAX / log2 e`` (about 2.36e38) overflows it, so ``logsumexp`` and
``logcumsumexp`` of such a row give ``±inf`` and ``softmax`` NaN (torch: finite); the CPU
path is exact there. ``var_mean`` matches torch on finite input; an infinite input
(outside WELFORD's domain) gives a NaN variance, as torch, and an infinite or NaN mean.

A meta tensor (``device="meta"``) gives meta outputs of the shapes and dtypes above and
computes nothing (``segment_reduce`` reads no offsets then); arguments are validated as
for any other tensor. Under ``torch.compile`` each call is one custom op,
``flashfold::monoid`` (:mod:`flashfold.api.monoid_op`; the offsets check runs inside
it), so ``fullgraph=True`` traces it; the computation itself is
:func:`flashfold.api.folds.run` either way. Make the monoid outside the compiled region
(its construction traces its combine, which Dynamo cannot follow).

Gradients: ``logsumexp``, ``softmax``, ``var_mean``, ``cumsum`` and ``logcumsumexp`` are
differentiable (each backward is torch arithmetic on the saved tensors, in float32,
returned in the input's dtype). ``reduce``, ``segment_reduce`` and ``scan`` of a general
monoid have no backward: with grad enabled, an input that requires grad is refused
(``ValueError``) rather than given a result detached from the graph; positions (argmax)
are not differentiable, as torch's.

Several dims (``dim`` a tuple, or ``None`` for all) are reduced as one: the reduced dims
are moved last and flattened, which is a view for a contiguous tensor and reduced dims
that are adjacent, and a copy otherwise (torch's ``flatten`` rule).
"""

from __future__ import annotations

import dataclasses
import keyword
import numbers
from collections import namedtuple

import torch

from ..algebra.monoid import Monoid
from ..kernels.reduce.functions import LOGSUMEXP2_SCAN, softmax_map
from ..monoids import ARGMAX, ARGMIN, LOGSUMEXP2, SUM, WELFORD
from . import folds
from .folds import data_inputs as _data_inputs
from .validate import check_bool as _check_bool

__all__ = ["reduce", "segment_reduce", "scan", "logsumexp", "softmax", "var_mean", "argmax",
           "argmin", "cumsum", "logcumsumexp", "LOGSUMEXP2_SCAN"]
# LOGSUMEXP2_SCAN and SOFTMAX_MAP (softmax's traced prep/map, for the kernels and their
# tests) are defined beside the kernels (kernels.reduce.functions); SOFTMAX_MAP is built on
# first access through the module's __getattr__: tracing it generates source.

_FLOAT = (torch.float32, torch.float16, torch.bfloat16)


#: ARGMAX / ARGMIN finalized to the index alone: ``argmax`` stores no values (torch's
#: argmax writes only its int64 indices; 2^20 x 7 fp32 moves 37 MB instead of 41)
ARGMAX_INDEX, ARGMIN_INDEX = (
    dataclasses.replace(m, name=f"{m.name}_index", finalize=lambda s: s.i, outputs=("index",),
                        doc=f"{m.name.upper()} finalized to the position alone.")
    for m in (ARGMAX, ARGMIN))


# --- validation -------------------------------------------------------------------------

#: id -> a monoid that passed :func:`_check_monoid` (kept alive, so that its id is not
#: another object's). A Monoid is frozen, so it passes for good; at most _CHECKED_SIZE
#: entries, dropped wholesale when full
_CHECKED: dict = {}
_CHECKED_SIZE = 1024


def _check_monoid(monoid):
    """A monoid that reduce/scan can run: checked once per monoid (the check cost ~1.2 us
    per call on the 2-core dev machine, the lookup ~0.15)."""
    if monoid is not None and _CHECKED.get(id(monoid)) is monoid:   # (get's default: None)
        return
    if not isinstance(monoid, Monoid):
        raise TypeError(f"monoid: expected a flashfold Monoid, got {type(monoid).__name__}")
    data = _data_inputs(monoid)
    if not data:
        raise ValueError(f"monoid: {monoid.name!r} has no data input (inputs "
                         f"{monoid.input_names}); reduce/scan need one")
    if any(f.vector for f in monoid.fields) and not any(i.vector for i in data):
        raise ValueError(f"monoid: {monoid.name!r} has vector fields but no vector input")
    if len(_CHECKED) >= _CHECKED_SIZE:
        _CHECKED.clear()
    _CHECKED[id(monoid)] = monoid


def _is_vector(monoid) -> bool:
    """Whether ``monoid`` has a vector input (a trailing feature axis on its tensor)."""
    return any(i.vector for i in _data_inputs(monoid))


def _inputs(monoid, x):
    """``x`` checked for ``monoid``: the tensor of a one-input monoid (or a tuple of that
    one tensor, as for several), or for a monoid of ``n > 1`` data inputs a tuple of
    ``n`` tensors (in the monoid's input order) on one device. A vector input carries a
    trailing feature axis of one width ``W`` for all; the other dims of every input
    broadcast to one shape ``S`` (views: nothing is copied). Returns ``(xs, first,
    dtype)``: ``xs`` the tensor or the tuple of views, ``first`` a tensor (or view) of
    shape ``S`` (dims, device), ``dtype`` the float outputs' dtype (the inputs' promoted
    dtype)."""
    data = _data_inputs(monoid)
    names = [i.name for i in data]
    if len(data) == 1 and not data[0].vector:
        if isinstance(x, (tuple, list)):
            if len(x) == 1:
                x = x[0]
            elif x and all(isinstance(t, torch.Tensor) for t in x):
                raise ValueError(f"x: {monoid.name!r} takes 1 input {names}, got a tuple of "
                                 f"{len(x)}")
        _check_x(x)
        return x, x, x.dtype
    if len(data) == 1 and isinstance(x, torch.Tensor):
        x = (x,)
    if not isinstance(x, (tuple, list)):
        raise TypeError(f"x: {monoid.name!r} takes {len(data)} inputs {names}; pass a tuple of "
                        f"{len(data)} tensors, got {type(x).__name__}")
    if len(x) != len(data):
        raise ValueError(f"x: {monoid.name!r} takes {len(data)} inputs {names}, got a tuple of "
                         f"{len(x)}")
    for j, t in enumerate(x):
        _check_x(t, f"x[{j}] ({names[j]})")
    for j, t in enumerate(x[1:], 1):
        if t.device != x[0].device:
            raise ValueError(f"x[{j}] ({names[j]}) is on {t.device}, x[0] on {x[0].device}")
    widths = {t.shape[-1] for i, t in zip(data, x) if i.vector and t.dim() > 0}
    for j, (i, t) in enumerate(zip(data, x)):
        if i.vector and t.dim() == 0:
            raise ValueError(f"x[{j}] ({names[j]}) is a vector input: it needs a trailing "
                             f"feature axis, got a 0-d tensor")
    if len(widths) > 1:
        raise ValueError(f"x: the vector inputs' feature axes differ: {sorted(widths)}")
    try:
        shape = torch.broadcast_shapes(*[t.shape[:-1] if i.vector else t.shape
                                         for i, t in zip(data, x)])
    except RuntimeError:
        raise ValueError(f"x: the inputs' shapes {[tuple(t.shape) for t in x]} do not "
                         f"broadcast to one shape (outside the feature axis of vector "
                         f"inputs)") from None
    ts = tuple(t.expand(*shape, t.shape[-1]) if i.vector else t.expand(shape)
               for i, t in zip(data, x))
    first = next((t for i, t in zip(data, ts) if not i.vector), None)
    if first is None:
        first = ts[0][..., 0]
    dtype = x[0].dtype
    for t in x[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return ts, first, dtype


def _view_as(monoid, xs, first, dim):
    """Each of ``xs`` viewed as :func:`_reduced_view` views ``first`` (several dims as
    one), a vector input's feature axis kept last."""
    if dim is not None and not isinstance(dim, (tuple, list)):
        return xs
    data = _data_inputs(monoid)
    nd = first.dim()
    dims = _dims_of(dim, nd)
    if len(dims) <= 1:
        return xs
    kept = [i for i in range(nd) if i not in dims]
    out = []
    for inp, t in zip(data, xs):
        perm = kept + dims + ([nd] if inp.vector else [])
        out.append(t.permute(perm).flatten(len(kept), len(kept) + len(dims) - 1))
    return tuple(out)


def _at_least_1d(monoid, xs):
    """``xs`` (the tensor or the tuple of :func:`_inputs`) with a 0-d shape ``S`` made
    ``(1,)``, a vector input's feature axis kept last."""
    if not isinstance(xs, tuple):
        return xs.reshape(1) if xs.dim() == 0 else xs
    return tuple(t.reshape(1, t.shape[-1]) if i.vector and t.dim() == 1 else
                 (t.reshape(1) if t.dim() == 0 else t)
                 for i, t in zip(_data_inputs(monoid), xs))


def _check_x(x, name: str = "x"):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT:
        raise TypeError(f"{name}: expected a float32, float16 or bfloat16 tensor (states are "
                        f"float32), got {x.dtype}")


def _norm_dim(dim, ndim: int, name: str = "dim") -> int:
    if type(dim) is int and -ndim <= dim < ndim:   # the common case (a bool fails below)
        return dim % ndim
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(dim).__name__}")
    dim = int(dim)                                 # (a NumPy integer too, as torch takes)
    lo, hi = (-1, 0) if ndim == 0 else (-ndim, ndim - 1)
    if not lo <= dim <= hi:
        raise IndexError(f"{name}: {dim} is out of range for a tensor with {ndim} dims "
                         f"(expected {lo}..{hi})")
    return dim % max(ndim, 1)


def _dims_of(dim, ndim: int) -> list:
    """The dims that ``dim`` (None or a tuple / list of ints) names, checked and sorted;
    None and an empty tuple name them all."""
    if dim is None:
        return list(range(ndim))
    dims = [_norm_dim(d, ndim) for d in dim]
    if len(set(dims)) != len(dims):
        raise ValueError(f"dim: {tuple(dim)} names a dim twice")
    return sorted(dims) or list(range(ndim))


def _reduced_view(x: torch.Tensor, dim):
    """``(x2, d, kept_shape, keep_shape)``: ``x2`` reduces the dims ``dim`` as its one dim
    ``d``; outputs have ``kept_shape`` (``keep_shape`` with ``keepdim=True``). One dim
    (an int) is sliced out of the shape: 3.1 -> ~1 us per call on the 2-core dev machine
    against the general path (which reads ``x.dim()`` and ``x.shape`` per dim)."""
    ndim = x.dim()
    if ndim == 0:
        if isinstance(dim, (tuple, list)):
            _dims_of(dim, 0)
        elif dim is not None:
            _norm_dim(dim, 0)
        return x.reshape(1), 0, (), ()
    shape = tuple(x.shape)
    if dim is not None and not isinstance(dim, (tuple, list)):
        d = _norm_dim(dim, ndim)
        return x, d, shape[:d] + shape[d + 1:], shape[:d] + (1,) + shape[d + 1:]
    dims = _dims_of(dim, ndim)
    kept = [i for i in range(ndim) if i not in dims]
    kept_shape = tuple(shape[i] for i in kept)
    keep_shape = tuple(1 if i in dims else shape[i] for i in range(ndim))
    if len(dims) == 1:
        return x, dims[0], kept_shape, keep_shape
    x2 = x.permute(kept + dims).flatten(len(kept))       # a view when possible
    return x2, len(kept), kept_shape, keep_shape


def _shaped(outs, shape, base=None) -> tuple:
    """``outs`` reshaped to ``shape``; an output that has it already is returned as it is
    (``reshape`` to its own shape still makes a view: ~1.5 us per output on the 2-core
    dev machine, against ~0.2 for the comparison). With ``base`` (the outputs' batch
    shape), an output's dims past ``base`` (a vector output's feature axis) are kept."""
    if base is None:
        return tuple([o if o.shape == shape else o.reshape(shape) for o in outs])
    res = []
    for o in outs:
        want = tuple(shape) + tuple(o.shape[len(base):])
        res.append(o if o.shape == want else o.reshape(want))
    return tuple(res)


def _result_type(monoid: Monoid):
    """The named tuple of ``monoid``'s outputs: an output whose name cannot be a field of
    one (not an identifier, a keyword, a leading underscore) is ``out{i}``."""
    names = tuple(n if n.isidentifier() and not keyword.iskeyword(n) and not n.startswith("_")
                  else f"out{i}" for i, n in enumerate(monoid.output_names))
    return namedtuple(f"{monoid.type_prefix}Result", names)


_RESULT_TYPES: dict = {}


def _pack(monoid: Monoid, outs):
    if len(outs) == 1:
        return outs[0]
    key = (monoid.name, monoid.output_names)
    t = _RESULT_TYPES.get(key)
    if t is None:
        t = _RESULT_TYPES[key] = _result_type(monoid)
    return t(*outs)


def _wants_grad(x) -> bool:
    """Whether autograd would record a call on ``x`` (a tensor or a tuple of them)."""
    if not torch.is_grad_enabled():
        return False
    xs = x if isinstance(x, (tuple, list)) else (x,)
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in xs)


def _no_backward(fn: str, monoid, x, outs):
    """The general entry points have no backward: an input that requires grad (with grad
    enabled) is refused rather than silently detached, where ``outs`` hold a float
    output (positions are not differentiable, as ``torch.argmax``'s)."""
    if not _wants_grad(x) or not any(o.is_floating_point() for o in outs):
        return
    raise ValueError(f"x: requires grad, but {fn}() of a general monoid ({monoid.name}) has "
                     f"no backward; logsumexp, softmax, var_mean, cumsum and logcumsumexp "
                     f"do. Call it under torch.no_grad() or on x.detach().")


def _use_kernels(x: torch.Tensor) -> bool:
    """Whether ``x`` goes to the generated kernels (CUDA) or the reference (CPU). Tests
    patch this to drive the kernels on CPU tensors under ``TRITON_INTERPRET=1``."""
    return x.is_cuda


def _check_params(monoid: Monoid, params: dict):
    """Finalize parameters: names the monoid declares, values real numbers (not bools)."""
    names = [p for p, _ in monoid.params]
    unknown = set(params) - set(names)
    if unknown:
        raise TypeError(f"{monoid.name}.finalize got unknown parameters {sorted(unknown)}; "
                        f"it takes {names}")
    for k, v in params.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{k}: expected a number, got {type(v).__name__}")


def _compute(kind: str, obj, xs, d: int, params: dict, out_dtype, shape, width=None,
             asked=None, reverse=False, offsets=None, check=False, key=None):
    """:func:`.folds.run` (the kernels where :func:`_use_kernels`), or under
    ``torch.compile`` the op ``flashfold::monoid`` (:mod:`.monoid_op`; outputs of
    ``shape``, vector outputs with the feature axis ``width``, as
    :func:`.folds.empty_outs`; ``obj`` named by ``key`` where given)."""
    x = xs if isinstance(xs, torch.Tensor) else xs[0]
    kernels = _use_kernels(x)
    if not torch.compiler.is_compiling():
        return folds.run(kind, obj, xs, d, params, out_dtype, kernels=kernels, asked=asked,
                         reverse=reverse, offsets=offsets, check=check)
    from .monoid_op import monoid_op
    tupled = not isinstance(xs, torch.Tensor)
    names = sorted(params)
    key = key or folds.name(id(obj))
    return tuple(monoid_op(list(xs) if tupled else [xs], offsets, key,
                           kind, tupled, d, reverse, check, ",".join(names),
                           [float(params[n]) for n in names], out_dtype, asked, list(shape),
                           width, kernels))


# --- generic entry points ---------------------------------------------------------------

def _width(monoid, xs):
    """The feature width of the vector inputs among ``xs`` (None without any)."""
    if not isinstance(xs, tuple):
        return None
    return next((t.shape[-1] for i, t in zip(_data_inputs(monoid), xs) if i.vector), None)


def _reduce_outs(monoid, x, dim, params):
    """``(outs, kept, keep, base)``: outputs of shape ``kept`` (vector outputs: ``kept +
    (W,)``), the shape with ``keepdim``, and ``kept`` again where outputs may carry a
    feature axis (else None)."""
    _check_monoid(monoid)
    xs, first, dtype = _inputs(monoid, x)
    if params:
        _check_params(monoid, params)
    x2, d, kept, keep = _reduced_view(first, dim)
    if xs is first:
        xs = x2
    elif first.dim() == 0:
        xs = _at_least_1d(monoid, xs)
    else:
        xs = _view_as(monoid, xs, first, dim)
    width = _width(monoid, xs)
    if x2.is_meta:
        outs = folds.empty_outs(monoid, kept, x2, params, dtype, width)
    else:
        outs = _compute("reduce", monoid, xs, d, params, dtype, kept, width)
    return outs, kept, keep, (kept if width is not None else None)


def reduce(monoid: Monoid, x: torch.Tensor, dim=-1, *, keepdim: bool = False, **params):
    """Reduce ``x`` along ``dim`` with ``monoid``: ``finalize(lift(x_0) ⊕ ... ⊕ lift(x_{N-1}))``.

    Parameters
    ----------
    monoid: a :class:`~flashfold.Monoid` (optionally with a position input, which
        receives the element's index along ``dim``).
    x: float32 / float16 / bfloat16 tensor of any shape and strides; for a monoid of ``n``
        data inputs a tuple of ``n`` such tensors in the monoid's input order, broadcast
        to one shape ``S`` (e.g. ``(w, x)`` for a weighted mean); a vector input has a
        trailing feature axis, ``S + (W,)`` (e.g. ATTENTION's ``(s, v)``: ``s (B, N)``,
        ``v (B, N, W)``, ``dim=1`` gives ``softmax(s) v`` and the LSE). On CUDA every
        input is read through its own strides (stride 0 where it is broadcast), never
        copied; vector inputs run per feature (module notes).
    dim: an int, a tuple of ints (reduced as one), or ``None`` (all dims).
    keepdim: keep the reduced dims with size 1.
    params: the monoid's finalize parameters (e.g. ``correction=`` for WELFORD).

    Returns a tensor (one output) or a named tuple (e.g. WELFORD's ``(mean, var)``) with
    ``x``'s shape minus ``dim`` (a vector output: plus the feature axis); float outputs in ``x.dtype`` (the inputs' promoted dtype),
    positions int64. An empty
    ``dim`` gives the finalized identity (e.g. ``-inf`` for MAX).
    """
    _check_bool("keepdim", keepdim)
    outs, kept, keep, base = _reduce_outs(monoid, x, dim, params)
    _no_backward("reduce", monoid, x, outs)
    shape = keep if keepdim else kept
    return _pack(monoid, _shaped(outs, shape, base))


def segment_reduce(monoid: Monoid, x: torch.Tensor, offsets: torch.Tensor, dim: int = 0, *,
                   unsafe: bool = False, **params):
    """Reduce each segment ``x[..., offsets[j]:offsets[j+1], ...]`` of ``dim`` (ragged rows).

    Parameters
    ----------
    x: float tensor ``(..., N, ...)``, e.g. packed sequences ``(total_tokens, features)``
        (a tuple of them for a monoid of several inputs, as :func:`reduce`).
    offsets: 1-D int32/int64 tensor of ``S + 1`` non-decreasing indices in ``[0, N]`` on
        ``x``'s device (``cu_seqlens``); segments may be empty (they give the finalized
        identity) and need not cover the whole dim.
    dim: the segmented dim (default 0, as ``torch.segment_reduce``).
    unsafe: skip the check of ``offsets`` (which reads them, a device sync on CUDA).

    Returns outputs shaped like ``x`` with ``dim`` of size ``S``. Positions (ARGMAX) are
    indices within the segment.
    """
    _check_monoid(monoid)
    _check_bool("unsafe", unsafe)
    xs, x, dtype = _inputs(monoid, x)
    if x.dim() == 0:
        raise ValueError("x: segment_reduce needs at least one dim")
    d = _norm_dim(dim, x.dim())
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"offsets: expected a torch.Tensor, got {type(offsets).__name__}")
    if offsets.dtype not in (torch.int32, torch.int64) or offsets.dim() != 1:
        raise TypeError(f"offsets: expected a 1-D int32/int64 tensor, got {offsets.dtype} "
                        f"of shape {tuple(offsets.shape)}")
    if offsets.numel() < 1:
        raise ValueError("offsets: needs at least one entry (S + 1 offsets for S segments)")
    if offsets.device != x.device:
        raise ValueError(f"offsets: on {offsets.device}, but x is on {x.device}")
    if params:
        _check_params(monoid, params)
    shape = x.shape[:d] + (offsets.numel() - 1,) + x.shape[d + 1:]
    if x.is_meta:                                  # shapes only: no offsets to read
        outs = folds.empty_outs(monoid, shape, x, params, dtype, _width(monoid, xs))
    else:
        outs = _compute("segment", monoid, xs, d, params, dtype, shape, _width(monoid, xs),
                        offsets=offsets, check=not unsafe)
    _no_backward("segment_reduce", monoid, xs, outs)
    return _pack(monoid, outs)


def scan(monoid: Monoid, x: torch.Tensor, dim: int = -1, reverse: bool = False, **params):
    """Inclusive scan of ``x`` along ``dim``: ``y_i = finalize(lift(x_0) ⊕ ... ⊕ lift(x_i))``.

    With ``reverse=True``, ``y_i = finalize(lift(x_i) ⊕ ... ⊕ lift(x_{N-1}))`` (operand
    order kept, so non-commutative monoids are right). Outputs are shaped like ``x``.
    ``x``: a tensor, or a tuple of tensors for a monoid of several inputs (as
    :func:`reduce`; e.g. ``(a, b)`` of the recurrence ``h_t = a_t h_{t-1} + b_t``).
    Long rows with few of them run as a multi-block scan (chunk states, then each chunk
    scanned from the fold of the chunks before it).
    """
    out = _scan(monoid, x, dim, reverse, None, params)
    _no_backward("scan", monoid, x, out if isinstance(out, tuple) else (out,))
    return out


def _scan(monoid, x, dim, reverse, dtype, params):
    _check_monoid(monoid)
    xs, x, in_dtype = _inputs(monoid, x)
    if not isinstance(reverse, bool):
        raise TypeError(f"reverse: expected a bool, got {type(reverse).__name__}")
    if params:
        _check_params(monoid, params)
    xs = _at_least_1d(monoid, xs)
    x1 = x.reshape(1) if x.dim() == 0 else x
    d = _norm_dim(dim, x.dim())
    width = _width(monoid, xs)
    if x1.is_meta:
        outs = folds.empty_outs(monoid, x1.shape, x1, params, dtype or in_dtype, width)
    else:
        outs = _compute("scan", monoid, xs, d, params, dtype or in_dtype, x1.shape, width,
                        asked=dtype, reverse=reverse)
    return _pack(monoid, _shaped(outs, x.shape, x1.shape if width is not None else None))


# --- row maps (softmax) -----------------------------------------------------------------

def __getattr__(name):
    if name == "SOFTMAX_MAP":
        return softmax_map()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _normalize(x, dim, dtype):
    """softmax's row map (:func:`~flashfold.kernels.reduce.functions.softmax_map`) along
    ``dim``."""
    if x.dim() == 0:
        _norm_dim(dim, 0)                        # (-1 or 0, as torch)
        return _normalize(x.reshape(1), 0, dtype).reshape(())
    d = _norm_dim(dim, x.dim())
    if x.is_meta:
        return torch.empty(x.shape, dtype=dtype or x.dtype, device="meta")
    if torch.compiler.is_compiling():       # (the row map's first build is not traced)
        return _compute("normalize", None, x, d, {}, dtype or x.dtype, x.shape, asked=dtype,
                        key=_softmax_key())[0]
    return _compute("normalize", softmax_map(), x, d, {}, dtype or x.dtype, x.shape,
                    asked=dtype)[0]


@torch.compiler.assume_constant_result
def _softmax_key() -> str:
    """The registry key of softmax's row map (:func:`.folds.register`), built eagerly."""
    return folds.register(softmax_map())


# --- torch-like conveniences --------------------------------------------------------------

def logsumexp(x: torch.Tensor, dim, keepdim: bool = False) -> torch.Tensor:
    """``log(sum(exp(x)))`` along ``dim`` (as ``torch.logsumexp``), via the base-2 online
    softmax state ``(m, d)`` (LOGSUMEXP2): ``(m + log2 d) · ln 2``. Empty dim: ``-inf``.
    ``x``: float32 / float16 / bfloat16 of any shape; ``dim`` an int, a tuple of ints or
    ``None`` (all); returns ``x``'s shape without ``dim`` (size 1 with ``keepdim``), in
    ``x.dtype``.
    Differentiable: ``dx = g e^(x - y)``, 0 in a row whose result is ``-inf`` (no mass,
    as attention's fully masked rows; torch gives NaN there)."""
    if _wants_grad(x):
        return _LogSumExp.apply(x, dim, keepdim)
    return reduce(LOGSUMEXP2, x, dim, keepdim=keepdim)


def softmax(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``exp(x - max) / sum(exp(x - max))`` along ``dim`` (as ``torch.softmax``).

    ``x``: float32 / float16 / bfloat16 of any shape; returns ``x``'s shape, in ``dtype``
    (float32 / float16 / bfloat16; default ``x.dtype``).

    One read of ``x`` for the row state ``(m, d)`` of LOGSUMEXP2 and one read + write for
    ``y = 2^(x·log2 e - m) / d``; a row that fits a tile (up to 16K fp32 / 32K 16-bit
    elements) is read once and kept in registers. ``dtype`` sets the output dtype (the
    computation is float32 on CUDA, float64 on the CPU, regardless). An all ``-inf`` row
    gives NaN, as torch. A row
    holding ``+inf`` gives 0 at its other entries (the limit of ``exp(x - max)``) and NaN
    at its ``+inf`` ones (``inf / inf``), where torch gives the whole row NaN; a NaN makes
    its row NaN, as torch.
    """
    _check_x(x)
    if dtype is not None and dtype not in _FLOAT:
        raise TypeError(f"dtype: expected float32, float16 or bfloat16, got {dtype}")
    if _wants_grad(x):
        return _Softmax.apply(x, dim, dtype)
    return _normalize(x, dim, dtype)


def var_mean(x: torch.Tensor, dim=None, *, correction=1, keepdim: bool = False):
    """``(var, mean)`` along ``dim`` (as ``torch.var_mean``) from one pass of Welford's
    state ``(n, mean, M2)``: ``var = M2 / max(n - correction, 0)`` (when ``n <=
    correction``: inf, or NaN where ``M2 = 0``, as torch). An infinite or NaN element makes ``var`` NaN and
    ``mean`` infinite or NaN, as torch. An empty dim gives ``(nan, nan)``. Differentiable:
    ``dx = g_mean / n + g_var 2 (x - mean) / (n - correction)``, torch's rule.
    ``correction=None`` is 1, as torch takes it. ``x``: float32 / float16 / bfloat16 of any
    shape; ``dim`` an int, a tuple of ints or ``None`` (all); ``var`` and ``mean`` have
    ``x``'s shape without ``dim`` (size 1 with ``keepdim``), in ``x.dtype``."""
    if correction is None:
        correction = 1
    if isinstance(correction, bool) or not isinstance(correction, numbers.Real):
        raise TypeError(f"correction: expected a number, got {type(correction).__name__}")
    _check_bool("keepdim", keepdim)
    if _wants_grad(x):
        return _VarMean.apply(x, dim, float(correction), keepdim)
    return _var_mean(x, dim, float(correction), keepdim)


def _var_mean(x, dim, correction: float, keepdim: bool):
    outs, kept, keep, _ = _reduce_outs(WELFORD, x, dim, {"correction": correction})
    mean, var = outs
    n = x.numel() // max(1, _numel(kept))
    if n == 0 or x.numel() == 0:
        mean = torch.full_like(mean, float("nan"))
        var = torch.full_like(var, float("nan"))
    return _shaped((var, mean), keep if keepdim else kept)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _arg(monoid, x, dim, keepdim, name):
    """torch's rules: ``dim=None`` reduces the flattened tensor (``keepdim`` keeps every
    dim with size 1); an empty reduced dim (or an empty tensor with ``dim=None``) is an
    IndexError; an empty tensor whose reduced dim is not empty gives an empty result."""
    _check_x(x)
    if not isinstance(keepdim, bool):
        raise TypeError(f"keepdim: expected a bool, got {type(keepdim).__name__}")
    if dim is None:
        if x.numel() == 0:
            raise IndexError(f"x: {name}() of an empty tensor with dim=None (the flattened "
                             f"tensor has size 0)")
        out = reduce(monoid, x.reshape(-1), 0)
        return out.reshape((1,) * x.dim()) if keepdim else out
    ndim = x.dim()
    if ndim > 0:
        d = _norm_dim(dim, ndim)
        if x.shape[d] == 0:
            raise IndexError(f"x: {name}() over dim {d}, which has size 0")
        if x.numel() == 0:                        # an empty batch: an empty result
            shape = x.shape[:d] + ((1,) if keepdim else ()) + x.shape[d + 1:]
            return torch.empty(shape, dtype=torch.int64, device=x.device)
    return reduce(monoid, x, dim, keepdim=keepdim)


def argmax(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """Index of the largest value along ``dim`` (``None``: of the flattened tensor), int64;
    ties give the lowest index and NaN counts as the largest, as ``torch.argmax``.
    ``keepdim`` with ``dim=None`` keeps every dim with size 1. An empty ``dim`` raises
    IndexError; an empty tensor reduced over a non-empty dim gives an empty result.
    ``x``: float32 / float16 / bfloat16 of any shape; returns ``x``'s shape without ``dim``
    (size 1 with ``keepdim``; ``()`` for ``dim=None``)."""
    return _arg(ARGMAX_INDEX, x, dim, keepdim, "argmax")


def argmin(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """Index of the smallest value along ``dim``, int64; as ``torch.argmin`` (shapes and
    rules as :func:`argmax`)."""
    return _arg(ARGMIN_INDEX, x, dim, keepdim, "argmin")


def cumsum(x: torch.Tensor, dim: int, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Inclusive prefix sums along ``dim`` (as ``torch.cumsum``), float32 accumulation on
    CUDA (float64 on the CPU); ``dtype`` casts the result. ``x``: float32 / float16 /
    bfloat16 of any shape; returns ``x``'s shape."""
    if dtype is not None and dtype not in _FLOAT:
        raise TypeError(f"dtype: expected float32, float16 or bfloat16, got {dtype}")
    if _wants_grad(x):
        return _CumSum.apply(x, dim, dtype)
    return _scan(SUM, x, dim, False, dtype, {})


def logcumsumexp(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``log(cumsum(exp(x)))`` along ``dim`` (as ``torch.logcumsumexp``), by a scan of the
    base-2 online-softmax state (LOGSUMEXP2_SCAN: LOGSUMEXP2 with a one-exp2 combine).
    Differentiable: ``dx_j = sum_{i >= j} g_i e^(x_j - y_i)``, summed in log space; 0 at a
    ``-inf`` element (no mass; torch gives NaN in a ``-inf`` prefix). ``x``: float32 /
    float16 / bfloat16 of any shape; returns ``x``'s shape, in ``x.dtype``."""
    if _wants_grad(x):
        return _LogCumSumExp.apply(x, dim)
    return _scan(LOGSUMEXP2_SCAN, x, dim, False, None, {})


# --- gradients of the torch-like functions ------------------------------------------------
# Each forward runs the function above with grad off; each backward is torch arithmetic
# on the saved tensors in float32, returned in x's dtype (itself differentiable).

def _expand_reduced(t, x, dim, keepdim):
    """``t`` (a reduction of ``x`` over ``dim``) with the reduced dims back as size 1."""
    if keepdim or x.dim() == 0:
        return t
    for d in sorted(_dims_of(dim, x.dim()) if dim is None or isinstance(dim, (tuple, list))
                    else [_norm_dim(dim, x.dim())]):
        t = t.unsqueeze(d)
    return t


class _LogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, keepdim):
        y = reduce(LOGSUMEXP2, x, dim, keepdim=keepdim)
        ctx.save_for_backward(x, y)
        ctx.args = (dim, keepdim)
        return y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        y = _expand_reduced(y.float(), x, *ctx.args)
        w = torch.exp(x.float() - torch.where(y == -torch.inf, torch.inf, y))
        return (_expand_reduced(g.float(), x, *ctx.args) * w).to(x.dtype), None, None


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, dtype):
        y = _normalize(x, dim, dtype)
        ctx.save_for_backward(y)
        ctx.dim, ctx.dtype = dim, x.dtype
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        if y.dim() == 0:
            return torch.zeros_like(g, dtype=ctx.dtype), None, None
        y, g = y.float(), g.float()
        d = _norm_dim(ctx.dim, y.dim())
        return (y * (g - (g * y).sum(d, keepdim=True))).to(ctx.dtype), None, None


class _VarMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, correction, keepdim):
        var, mean = _var_mean(x, dim, correction, keepdim)
        ctx.save_for_backward(x, mean)
        ctx.args = (dim, keepdim)
        ctx.correction = correction
        return var, mean

    @staticmethod
    def backward(ctx, g_var, g_mean):
        x, mean = ctx.saved_tensors
        n = x.numel() // max(1, mean.numel())
        dof = n - ctx.correction
        factor = 2.0 / dof if dof != 0 else torch.inf
        xf = x.float()
        mean = _expand_reduced(mean.float(), x, *ctx.args)
        gx = (_expand_reduced(g_mean.float(), x, *ctx.args) / n
              + _expand_reduced(g_var.float(), x, *ctx.args) * factor * (xf - mean))
        return gx.to(x.dtype), None, None, None


class _CumSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, dtype):
        ctx.dim, ctx.dtype = dim, x.dtype
        return _scan(SUM, x, dim, False, dtype, {})

    @staticmethod
    def backward(ctx, g):
        if g.dim() == 0:
            return g.to(ctx.dtype), None, None
        d = _norm_dim(ctx.dim, g.dim())
        return g.float().flip(d).cumsum(d).flip(d).to(ctx.dtype), None, None


class _LogCumSumExp(torch.autograd.Function):
    """``dx_j = sum_{i >= j} g_i e^(x_j - y_i)``, each term at most ``|g_i|`` (``y_i >= x_j``):
    the positive and the negative parts of ``g`` summed apart in log space (reverse
    logcumsumexps), so nothing overflows; a ``-inf`` element gets 0 (no mass)."""

    @staticmethod
    def forward(ctx, x, dim):
        y = _scan(LOGSUMEXP2_SCAN, x, dim, False, None, {})
        ctx.save_for_backward(x, y)
        ctx.dim = dim
        return y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        shape, d = x.shape, _norm_dim(ctx.dim, x.dim())
        xf, yf, gf = (t.float().reshape(t.shape or (1,)) for t in (x, y, g))

        def tail(part):            # log sum_{i >= j} part_i e^(-y_i)
            t = torch.where(part > 0, part.log(), -torch.inf) - yf
            return t.flip(d).logcumsumexp(d).flip(d)
        gx = torch.exp(xf + tail(gf)) - torch.exp(xf + tail(-gf))
        gx = torch.where(xf == -torch.inf, 0.0, gx)
        return gx.reshape(shape).to(x.dtype), None
