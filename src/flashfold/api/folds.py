"""The computation behind :mod:`flashfold.api.reductions`: one function for every call
(:func:`run`), the outputs of meta and fake tensors (:func:`empty_outs`), and the names
under which ``torch.compile`` passes monoids and row maps to the custom op of
:mod:`flashfold.api.monoid_op` (:func:`name`).

``run`` takes a validated, prepared call: the generated kernels
(:mod:`flashfold.kernels.reduce.launch`) or the float64 reference
(:mod:`flashfold.kernels.reduce.reference`), chosen by the caller (``kernels``).
"""

from __future__ import annotations

import gc

import torch

from ..algebra.monoid import Monoid
from ..kernels.reduce import reference as _ref

_LAUNCH: list = []


def _launchers():
    """:mod:`flashfold.kernels.reduce.launch`, imported on first use (it imports Triton);
    an import statement in the calling function cost ~1.3 us on every call (2-core dev
    machine), this ~0.1. The module, not its functions, so that patches of them apply."""
    if not _LAUNCH:
        from ..kernels.reduce import launch
        _LAUNCH.append(launch)
    return _LAUNCH[0]


def data_inputs(monoid) -> list:
    """The inputs the caller passes (a position input receives the element's index)."""
    return [i for i in monoid.inputs if i.domain != "position"]


def cast(outs, device, dtype):
    """The reference's outputs on ``device``: float64 ones in ``dtype``, bool ones as
    they are, the others int64; contiguous, as the kernels' outputs and the custom op's
    fake ones are (the reference lays an output out as its moved axes, and
    ``torch.compile`` checks an op's outputs against the fake's strides)."""
    res = []
    for o in outs:
        if o.dtype == torch.float64:
            o = o.to(dtype)
        elif o.dtype != torch.bool:
            o = o.to(torch.int64)
        res.append(o.to(device).contiguous())
    return tuple(res)


def check_offsets(offsets, n: int, d: int):
    """``ValueError`` unless ``offsets`` are non-decreasing indices in ``[0, n]`` (reads
    them: a device sync on CUDA)."""
    o = offsets.to("cpu", torch.int64)
    if bool((o[1:] < o[:-1]).any()) or int(o.min()) < 0 or int(o.max()) > n:
        raise ValueError(f"offsets: must be non-decreasing indices in [0, {n}] (the size of "
                         f"dim {d}), got {o.tolist()[:8]}{'...' if o.numel() > 8 else ''}")


def run(kind: str, obj, xs, d: int, params: dict, out_dtype, *, kernels: bool, asked=None,
        reverse=False, offsets=None, check=False) -> tuple:
    """The outputs of a validated call: the generated kernels (``kernels``) or the
    float64 reference. ``kind``: ``"reduce"``, ``"segment"`` (with ``offsets``, checked
    first with ``check``), ``"scan"`` (``reverse``) of the monoid ``obj``, or
    ``"normalize"`` by the row map ``obj``; ``xs``: the input tensor, or the tuple of a
    monoid's inputs, as prepared (views); ``out_dtype``: the float outputs' dtype;
    ``asked``: the dtype the caller asked a scan or a row map for (None: the input's),
    which their kernels take as given."""
    x = xs if isinstance(xs, torch.Tensor) else xs[0]
    if check:
        check_offsets(offsets, x.shape[d], d)
    if kernels:
        launch = _launchers()
        if kind == "reduce":
            return launch.launch_reduce(obj, xs, d, params)
        if kind == "segment":
            return launch.launch_segment_reduce(obj, xs, offsets.contiguous(), d, params)
        if kind == "scan":
            return launch.launch_scan(obj, xs, d, reverse, params, asked)
        return (launch.launch_normalize(obj, x, d, out_dtype=asked),)
    if kind == "reduce":
        outs = _ref.reduce_reference(obj, xs, d, **params)
    elif kind == "segment":
        outs = _ref.segment_reduce_reference(obj, xs, offsets, d, **params)
    elif kind == "scan":
        outs = _ref.scan_reference(obj, xs, d, reverse, **params)
    else:
        return (_ref.normalize_reference(obj, x, d).to(out_dtype),)
    return cast(outs, x.device, out_dtype)


#: id -> (monoid, dtype kinds of its outputs), for meta and fake tensors (empty_outs)
_KINDS: dict = {}
_KINDS_SIZE = 1024


def empty_outs(monoid: Monoid, shape, x: torch.Tensor, params, dtype, width=None) -> tuple:
    """Outputs of ``monoid`` for a meta (or fake) tensor ``x``: empty tensors like ``x``
    of ``shape``, float outputs in ``dtype``, the others int64 / bool as on the other
    paths.

    The rule for meta tensors: a function that can compute its outputs' shapes and dtypes
    returns meta outputs and computes nothing. The dtypes are read once per monoid off
    the reference's outputs for one element (and, with vector inputs, a feature axis of
    1: an output with that axis gets ``width``), on real CPU tensors also when called
    from a fake implementation under ``torch.compile``."""
    hit = _KINDS.get(id(monoid))
    if hit is None or hit[0] is not monoid:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        data = data_inputs(monoid)
        with unset_fake_temporarily():
            probe_in = tuple(torch.zeros(1, 1) if i.vector else torch.zeros(1) for i in data)
            probe = _ref.reduce_reference(monoid, probe_in[0] if len(data) == 1 and
                                          not data[0].vector else probe_in, 0, **params)
            hit = (monoid, tuple((o.dtype, o.dim() > 0) for o in probe))
        if len(_KINDS) >= _KINDS_SIZE:
            _KINDS.clear()
        _KINDS[id(monoid)] = hit
    return tuple(x.new_empty(tuple(shape) + ((width,) if vec else ()),
                             dtype=dtype if k == torch.float64 else
                             (torch.bool if k == torch.bool else torch.int64))
                 for k, vec in hit[1])


#: registry key -> a monoid or row map that compiled code names (kept: the key names it
#: for the process's lifetime, and its id is not reused)
_NAMED: dict = {}


def register(obj) -> str:
    """The registry key of ``obj`` (:func:`named` gives it back)."""
    key = f"{type(obj).__name__}:{id(obj)}"
    _NAMED.setdefault(key, obj)
    return key


@torch.compiler.assume_constant_result
def name(obj_id: int) -> str:
    """The registry key of the monoid or row map whose ``id`` is ``obj_id``, for compiled
    code: the caller computes ``id(obj)``, so that ``torch.compile`` guards on it, and
    this runs once, at trace time, when the object is alive (Dynamo read it off the
    traced frame). It takes the id, not the object: torch 2.11's Dynamo hands a
    constant-result function constants only (2.12 and later also objects). The object
    is found among the garbage collector's (a scan, once per compilation)."""
    for key, obj in _NAMED.items():
        if id(obj) == obj_id:
            return key
    obj = next((o for o in gc.get_objects() if id(o) == obj_id), None)
    if obj is None:
        raise RuntimeError(f"flashfold: no live object with id {obj_id} to compile a "
                           f"reduction with")
    return register(obj)


def named(key: str):
    """The monoid or row map registered under ``key`` (:func:`register`)."""
    return _NAMED[key]


__all__ = ["run", "cast", "check_offsets", "data_inputs", "empty_outs", "register", "name",
           "named"]
