"""Kernel launches with less host time: the compiled kernel's launcher, cached.

``kernel[grid](*args, **kwargs)`` makes Triton bind the arguments to the signature,
specialize each one, build and hash a cache key (which hashes every ``JITFunction``
passed as a constexpr: flashfold's generated combines are), check the kernel's globals
and only then call the launcher. On the H200 machine (Xeon host, Triton 3.6) that cost
28 us for a 12-argument kernel and ~120 us for a reduction kernel with ~60 arguments and
constexprs, against 8.6 us for the compiled kernel's launcher called directly
(``benchmarks/host_overhead.py``). Eager calls on small inputs (decode steps, N = 1K
attention, 2^20 x 7 reductions) are host-bound by it.

:func:`launch` keys the compiled kernel on what Triton specializes on, computed here in
a few Python operations per argument:

* tensors: dtype and whether the address is 16-byte aligned;
* ints: whether the value is 1, divisible by 16, and fits in 32 bits (the i32/i64
  choice); floats by type; bools and ``None`` by value; tuples element by element;
* TMA tensor descriptors: base dtype and alignment, shape, strides, block shape;
* constexprs (by keyword or position) and options (``num_warps``...): by value,
  ``JITFunction`` by identity.

Measured on the H200 host (run 5): 30-110 us less per eager call; building this key in
Python for ~60 arguments still costs ~40-60 us (a plan cache per call signature would
skip it).

The key is never coarser than Triton's (it may be finer: a finer key only costs one more
slow-path call for that key), so the cached kernel is the one Triton would pick. A miss,
or any argument of another type, goes through ``kernel[grid]`` (which compiles when
needed) and caches what it returns. The interpreter (``TRITON_INTERPRET=1``), launch
hooks (profilers), callable grids and kernels that are not plain ``JITFunction``s
(autotuners, interpreted functions) always take Triton's own path (which also rejects
CPU tensors, so nothing is cached for them).
"""

from __future__ import annotations

import functools
import os

import torch

_CACHE: dict = {}
_MAX = 4096
#: id(kernel) -> (kernel, positions of its constexpr parameters: keyed by value, not type)
_CONSTEXPR_POS: dict = {}

try:
    from triton import knobs as _knobs
    from triton.runtime.driver import driver as _driver
    from triton.runtime.jit import JITFunction as _JIT
except Exception:  # pragma: no cover - Triton absent or too old: always the slow path
    _knobs = _driver = _JIT = None

try:
    from triton.tools.tensor_descriptor import TensorDescriptor as _Desc
except Exception:  # pragma: no cover
    _Desc = None

_I32 = (-(2 ** 31), 2 ** 31)


#: what :func:`_spec` / :func:`_kspec` return for an argument they cannot key
_UNKNOWN = object()


def _spec(a):
    """What Triton's specialization of a runtime argument depends on (``_UNKNOWN``: an
    argument type this module does not key; the launch then takes Triton's path)."""
    t = type(a)
    if t is torch.Tensor or isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if t is int:
        return (int, a == 1, a % 16 == 0, _I32[0] <= a < _I32[1], a >= 2 ** 63)
    if a is None or t is bool:
        return (t, a)
    if t is float:
        return (float,)
    if t is tuple:                                  # Triton specializes each element
        parts = tuple(_spec(e) for e in a)
        return _UNKNOWN if any(p is _UNKNOWN for p in parts) else (tuple, parts)
    if _JIT is not None and isinstance(a, _JIT):      # a function: constexpr in Triton
        return ("jit", id(a))
    if _Desc is not None and t is _Desc:
        b = a.base
        return (_Desc, b.dtype, b.data_ptr() % 16 == 0, tuple(a.shape), tuple(a.strides),
                tuple(a.block_shape), getattr(a, "padding", None))
    return _UNKNOWN


def _kspec(v):
    """Constexprs and options: by value (JITFunctions by identity, tuples element-wise)."""
    if _JIT is not None and isinstance(v, _JIT):
        return ("jit", id(v))
    if type(v) is tuple:
        parts = tuple(_kspec(e) for e in v)
        return _UNKNOWN if any(p is _UNKNOWN for p in parts) else (tuple, parts)
    if isinstance(v, torch.Tensor):
        return _spec(v)
    try:
        hash(v)
    except TypeError:
        return _UNKNOWN
    return (type(v), v)


def _jit_objects(values):
    """Every JITFunction in ``values``, tuples searched too (their ids are in the key)."""
    for v in values:
        if isinstance(v, _JIT):
            yield v
        elif type(v) is tuple:
            yield from _jit_objects(v)


def _slow(kernel, grid, args, kwargs):
    return kernel[grid](*args, **kwargs)


def _hooked() -> bool:
    """Whether a launch hook (a profiler's) is installed: Triton 3.6 keeps a chain of them,
    empty by default; older versions a callable or None."""
    for h in (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook):
        if h is not None and (not hasattr(h, "calls") or h.calls):
            return True
    return False


#: os.environ's own mapping and key encoding: ``os.environ.get`` of an unset variable
#: costs ~1 us (it raises and catches a KeyError inside), a lookup here ~0.05 us
_ENV = os.environ._data
_INTERPRET = os.environ.encodekey("TRITON_INTERPRET")
_FAST_LAUNCH = os.environ.encodekey("FLASHFOLD_FAST_LAUNCH")


def enabled() -> bool:
    """Whether launches may bypass ``kernel[grid]`` (``FLASHFOLD_FAST_LAUNCH=0`` turns it off)."""
    interpret, fast = _ENV.get(_INTERPRET), _ENV.get(_FAST_LAUNCH)
    return (_driver is not None
            and (interpret is None or os.environ.decodevalue(interpret) in ("", "0"))
            and (fast is None or os.environ.decodevalue(fast) != "0"))


def launch(kernel, grid, args=(), kwargs=None):
    """``kernel[grid](*args, **kwargs)``, through the cached compiled kernel when possible.

    ``grid``: a tuple of 1-3 ints (not a callable). Returns nothing."""
    kwargs = kwargs or {}
    if not enabled() or _hooked() or callable(grid) or not isinstance(kernel, _JIT):
        _slow(kernel, grid, args, kwargs)
        return
    info = _CONSTEXPR_POS.get(id(kernel))
    if info is None or info[0] is not kernel:
        info = _CONSTEXPR_POS[id(kernel)] = (kernel, frozenset(
            i for i, p in enumerate(kernel.params) if p.is_constexpr))
    cpos = info[1]
    parts = [id(kernel)]
    for i, a in enumerate(args):
        s = _kspec(a) if i in cpos else _spec(a)
        if s is _UNKNOWN:
            _slow(kernel, grid, args, kwargs)
            return
        parts.append(s)
    for k, v in kwargs.items():
        s = _kspec(v)
        if s is _UNKNOWN:
            _slow(kernel, grid, args, kwargs)
            return
        parts.append((k, s))
    device = _driver.active.get_current_device()
    parts.append(device)
    key = tuple(parts)
    hit = _CACHE.get(key)
    if hit is None:
        compiled = _slow(kernel, grid, args, kwargs)
        if compiled is None or not hasattr(compiled, "packed_metadata"):
            return
        tail = []                            # (kwarg name or None, default) after the positionals
        for p in kernel.params[len(args):]:
            tail.append((p.name, None) if p.name in kwargs else (None, p.default))
        # the entry holds the kernel and every JITFunction of the key: while it lives, the
        # ids in its key cannot be reused by other objects
        refs = (kernel,) + tuple(_jit_objects((*args, *kwargs.values())))
        if len(_CACHE) >= _MAX:
            _CACHE.clear()
        _CACHE[key] = (compiled.run, compiled.function, compiled.packed_metadata, tuple(tail), refs)
        return
    run, function, packed, tail, _ = hit
    full = list(args)
    for name, default in tail:
        full.append(kwargs[name] if name is not None else default)
    g0 = grid[0]
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    run(g0, g1, g2, _driver.active.get_current_stream(device), function, packed, None,
        None, None, *full)


@functools.lru_cache(maxsize=None)
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def _index(device) -> int:
    device = torch.device(device)
    return torch.cuda.current_device() if device.index is None else device.index


def capability(device) -> tuple:
    """``(major, minor)`` compute capability of a CUDA ``device``, read once per device
    (``torch.cuda.get_device_capability`` costs ~10 us of host time per call)."""
    p = _properties(_index(device))
    return (p.major, p.minor)


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA ``device``, read once per device."""
    return _properties(_index(device)).multi_processor_count


def cache_clear() -> None:
    """Forget every cached compiled kernel (tests; a changed generated source is a new
    ``JITFunction`` anyway)."""
    _CACHE.clear()


__all__ = ["launch", "enabled", "cache_clear", "capability", "sm_count"]
