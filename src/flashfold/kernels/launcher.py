"""Kernel launches with less host time: the compiled kernel's launcher, cached.

``kernel[grid](*args, **kwargs)`` makes Triton bind the arguments to the signature,
specialize each one, build and hash a cache key (which hashes every ``JITFunction``
passed as a constexpr: flashfold's generated combines are), check the kernel's globals
and only then call the launcher. On the H200 machine (Xeon host, Triton 3.6) that cost
28 us for a 12-argument kernel and ~120 us for a reduction kernel with ~60 arguments and
constexprs, against 8.6 us for the compiled kernel's launcher called directly
(``benchmarks/host_overhead.py``). Eager calls on small inputs (decode steps, N = 1K
attention, 2^20 x 7 reductions) are host-bound by it.

:func:`launch` keys the compiled kernel on what Triton specializes on:

* tensors: dtype and whether the address is 16-byte aligned;
* ints: whether the value is 1, divisible by 16, and fits in 32 bits (the i32/i64
  choice) or needs u64; floats by type; bools and ``None`` by value; tuples element by
  element;
* TMA tensor descriptors: base dtype and alignment, shape, strides, block shape (and, for
  Gluon's, the shared-memory layout);
* constexprs (by keyword or position) and options (``num_warps``...): by type and value,
  ``JITFunction`` by identity;
* the kernel, the number of positionals, the keyword names in order, and the type of
  every value.

Measured on the H200 host: 30-110 us less per eager call than ``kernel[grid]``, but
building that key with one or two Python calls per argument still cost ~40-60 us for ~60
arguments (``docs/notes/host_time.md``, "The launcher"). So the key is built from a plan
cached per call signature (kernel,
positional count, keyword names, the type of every value: :class:`_Plan`), which sorts
the values once into groups that go into the key through C-level itemgetters (ints,
constexprs, ``id`` of JITFunctions) or one comprehension (tensors); only tuples and
descriptors take a Python call each. Ints go into the key by value first
(``_BY_VALUE``); their properties (:func:`_exact`, ~0.2 us per int on the machine below)
are computed only when that lookup misses, for the exact cache (``_CACHE``).

Host time per call on the 2-core CPU dev machine, measured with
``PYTHONPATH=src python benchmarks/launcher_keys.py --against OLD_LAUNCHER.py`` (fake
driver and compiled kernel; best of 7 interleaved repeats, us; before: commit d176a9a,
its key loop timed as a function)::

    arguments                              key before -> after   cache hit before -> after
    synthetic: 49 positionals, 24 kwargs         29.7 -> 10.7          39.0 -> 14.3
    argmax 2^20 x 7 plan: 18 + 24                16.5 -> 6.5           23.4 -> 9.1
    attention forward: 64 + 22                   30.5 -> 7.9           40.4 -> 11.1

(under load from other processes every number grew up to ~2x; the ratios held). Not
yet measured on the GPU host, where a hit also queries the driver's device and stream
and calls the compiled kernel's own launcher (8.6 us).

A caller that launches the same arguments but for their tensors again and again (the
replays of one cached plan, :mod:`flashfold.kernels.plans`: the reductions, decode) passes
a *memo*, a one-item list that keeps the launch resolved for them: the next calls check
only the switches, launch hooks, kernel, current device and :func:`cache_clear`, and call
the compiled kernel's launcher without building a key.

The key is never coarser than Triton's (it may be finer: a finer key only costs one more
slow-path call for that key), so the cached kernel is the one Triton would pick. A miss,
or any argument of another type, goes through ``kernel[grid]`` (which compiles when
needed) and caches what it returns. The interpreter (``TRITON_INTERPRET=1``), launch
hooks (profilers), callable grids and kernels that are not plain ``JITFunction``s
(autotuners, interpreted functions) always take Triton's own path (which also rejects
CPU tensors, so nothing is cached for them).
"""

from __future__ import annotations

import contextlib
import functools
import os
from operator import itemgetter

import torch

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

try:  # Gluon's host descriptors also carry the shared-memory layout Triton specializes on
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDesc
except Exception:  # pragma: no cover
    _GluonDesc = None

_MAX = 4096
#: (id(kernel), number of positionals, keyword names, type of every value) -> _Plan
_PLANS: dict = {}
#: exact key (ints by what Triton specializes on) -> cached launch
_CACHE: dict = {}
#: key with the ints by value -> cached launch (the entries of _CACHE, found without
#: computing the ints' properties when the same ints come again)
_BY_VALUE: dict = {}

#: the memos' epoch (see :func:`launch`): a memo kept before the last
#: :func:`cache_clear` is stale
_EPOCH = [object()]

_I32_LO, _I32_HI, _U64 = -(2 ** 31), 2 ** 31, 2 ** 63


class _Unkeyed(Exception):
    """An argument of a type this module does not key: the call takes Triton's path."""


# What a value of each type is keyed on, within its type (the key holds the types too).

def _int_spec(a):
    """What Triton specializes an int on: equal to 1, divisible by 16, i32 / i64 / u64."""
    return (a == 1, a % 16 == 0, _I32_LO <= a < _I32_HI, a >= _U64)


def _tensor_spec(a):
    return (a.dtype, a.data_ptr() % 16 == 0)


def _desc_spec(a):
    b = a.base
    return (b.dtype, b.data_ptr() % 16 == 0, tuple(a.shape), tuple(a.strides),
            tuple(a.block_shape), getattr(a, "padding", None))


def _gluon_desc_spec(a):
    """A Gluon descriptor: as a Triton one, and its shared-memory layout (a frozen
    dataclass, hashable)."""
    return (*_desc_spec(a), a.layout)


def _value(a):
    return a


def _nothing(a):
    """Runtime floats and None: the type is all Triton specializes them on."""


def _unkeyed(a):
    raise _Unkeyed(type(a))


def _tuple_spec(a):
    """A runtime tuple: Triton specializes each element."""
    return tuple([(type(e), _RUNTIME[type(e)](e)) for e in a])


def _constexpr_tuple_spec(a):
    return tuple([(type(e), _CONSTEXPR[type(e)](e)) for e in a])


class _ByType(dict):
    """type -> the function keying its values. Types not listed are resolved on first
    sight: subclasses of ``torch.Tensor`` and ``JITFunction`` (by identity: ``id``) like
    them, any other by ``other(type)``."""

    def __init__(self, table, other):
        super().__init__(table)
        self.other = other

    def __missing__(self, t):
        if issubclass(t, torch.Tensor):
            f = _tensor_spec
        elif _JIT is not None and issubclass(t, _JIT):
            f = id
        else:
            f = self.other(t)
        self[t] = f
        return f


#: runtime arguments: what Triton specializes them on (bools and None by value)
_RUNTIME = _ByType({int: _int_spec, float: _nothing, type(None): _nothing, bool: _value,
                    tuple: _tuple_spec}, lambda t: _unkeyed)
if _Desc is not None:
    _RUNTIME[_Desc] = _desc_spec
if _GluonDesc is not None:
    _RUNTIME[_GluonDesc] = _gluon_desc_spec
#: constexprs and options: by value (tensors as runtime arguments)
_CONSTEXPR = _ByType({tuple: _constexpr_tuple_spec},
                     lambda t: _unkeyed if t.__hash__ is None else _value)


def _getter(positions):
    """``itemgetter(*positions)`` that always returns a tuple (of one item, or empty)."""
    if len(positions) > 1:
        return itemgetter(*positions)
    if positions:
        i = positions[0]
        return lambda values: (values[i],)
    return lambda values: ()


class _Plan:
    """How to key the calls of one kernel with one signature: the number of positionals,
    the keyword names and the type of every value (positionals, then keyword values).

    The types decide, once per signature, what each value is keyed on (:data:`_RUNTIME`,
    :data:`_CONSTEXPR`), and the plan groups the positions by that: ``ints`` (runtime,
    by value; :func:`_exact` replaces them with their properties), ``plain`` (constexprs,
    options and runtime bools, by value), ``jits`` (by id), ``tensors``, and ``others``
    (tuples, descriptors) keyed by ``specs``; runtime floats and ``None`` are not picked
    at all (their type is all Triton specializes them on). ``unkeyed``: some value has a
    type not keyed here, or there are more positionals than parameters (such calls take
    Triton's path). ``call`` picks every parameter of the kernel in order, for the
    compiled kernel's launcher, from the values and ``defaults`` appended to them.
    """

    __slots__ = ("kernel", "unkeyed", "ints", "plain", "jits", "tensors", "others", "specs",
                 "call", "defaults")

    def __init__(self, kernel, nargs, names, types):
        self.kernel = kernel                    # alive while the plan is: its id is in _PLANS
        params = kernel.params
        self.unkeyed = nargs > len(params)
        const = [p.is_constexpr for p in params[:nargs]] + [True] * len(names)
        ints, plain, jits, tensors, others, specs = [], [], [], [], [], []
        for i, (t, c) in enumerate(zip(types, const)):
            f = (_CONSTEXPR if c else _RUNTIME)[t]
            if f is _int_spec:
                ints.append(i)
            elif f is _value:
                plain.append(i)
            elif f is id:
                jits.append(i)
            elif f is _tensor_spec:
                tensors.append(i)
            elif f is _unkeyed:
                self.unkeyed = True
            elif f is not _nothing:
                others.append(i)
                specs.append(f)
        self.ints, self.plain, self.jits = _getter(ints), _getter(plain), _getter(jits)
        self.tensors, self.others, self.specs = _getter(tensors), _getter(others), tuple(specs)
        defaults, picks = [], list(range(nargs))
        for p in params[nargs:]:
            if p.name in names:
                picks.append(nargs + names.index(p.name))
            else:
                picks.append(len(types) + len(defaults))
                defaults.append(p.default)
        self.defaults = tuple(defaults)
        # parameters passed in their order, then options (num_warps...): one slice of the
        # values, ~0.2 us per launch against ~0.5 for picking 40 of them one by one (the
        # reduce kernel's; 2-core dev machine)
        in_order = picks == list(range(len(picks)))
        self.call = itemgetter(slice(0, len(picks))) if in_order else _getter(picks)


def _key(kernel, args, kwargs):
    """``(plan, values, key)`` of a call: its plan, its positionals and keyword values in
    one tuple, and its cache key with the ints by value. Raises :class:`_Unkeyed` for a
    call that only Triton's path can launch."""
    values = (*args, *kwargs.values())
    sig = (id(kernel), len(args), tuple(kwargs), tuple(map(type, values)))
    plan = _PLANS.get(sig)
    if plan is None:
        if len(_PLANS) >= _MAX:
            _PLANS.clear()
        plan = _PLANS[sig] = _Plan(kernel, len(args), sig[2], sig[3])
    if plan.unkeyed:
        raise _Unkeyed(sig)
    tensors = plan.tensors(values)
    key = (plan, _driver.active.get_current_device(), plan.ints(values), plan.plain(values),
           tuple(map(id, plan.jits(values))), tuple([t.dtype for t in tensors]),
           tuple([t.data_ptr() % 16 == 0 for t in tensors]),
           tuple([f(v) for f, v in zip(plan.specs, plan.others(values))]))
    return plan, values, key


def _exact(key):
    """``key`` with each int replaced by what Triton specializes it on (the key of
    ``_CACHE``: two calls whose ints differ only in value share it)."""
    plan, device, ints, *rest = key
    return (plan, device, tuple([_int_spec(a) for a in ints]), *rest)


def _jit_objects(values):
    """Every JITFunction in ``values``, tuples searched too (their ids are in the key)."""
    for v in values:
        if isinstance(v, _JIT):
            yield v
        elif type(v) is tuple:
            yield from _jit_objects(v)


def _store(cache, key, entry):
    if len(cache) >= _MAX:
        cache.clear()
    cache[key] = entry


def _slow(kernel, grid, args, kwargs):
    return kernel[grid](*args, **kwargs)


def _hooked() -> bool:
    """Whether a launch hook (a profiler's) is installed: Triton 3.6 keeps a chain of them,
    empty by default; older versions a callable or None."""
    for h in (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook):
        if h is not None and (not hasattr(h, "calls") or h.calls):
            return True
    return False


#: os.environ's own mapping, and its encoded keys by name: ``os.environ.get`` of an unset
#: variable costs ~1 us (it raises and catches a KeyError inside), :func:`env` ~0.1 us
_ENV = os.environ._data
_ENV_KEYS: dict = {}


def env(name: str) -> str | None:
    """``os.environ.get(name)`` for switches read on every call (here and in the reduction
    plan cache); it follows changes made at run time, as ``os.environ`` does."""
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.environ.encodekey(name)
    value = _ENV.get(key)
    return None if value is None else os.environ.decodevalue(value)


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET`` set, not ``0``),
    as the environment is now."""
    return env("TRITON_INTERPRET") not in (None, "", "0")


def capturing(device) -> bool:
    """Whether a CUDA graph is being captured on the current stream, for tensors on
    ``device`` (always False off CUDA): host reads of device values (a sync) fail then,
    and what the host decides from values is replayed with whatever values the graph's
    inputs hold later."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def enabled() -> bool:
    """Whether launches may bypass ``kernel[grid]`` (``FLASHFOLD_FAST_LAUNCH=0`` turns it off)."""
    return (_driver is not None and not interpreting()
            and env("FLASHFOLD_FAST_LAUNCH") != "0")


def launch(kernel, grid, args=(), kwargs=None, memo=None):
    """``kernel[grid](*args, **kwargs)``, through the cached compiled kernel when possible.

    ``grid``: a tuple of 1-3 ints (not a callable). ``memo``: a one-item list (``[None]``
    to start) that the caller passes only with arguments that key alike on every call
    (the replays of one cached plan, :mod:`flashfold.kernels.plans`: same kernel, the
    same types, ints, constexprs and options, tensors of the same dtypes and alignment):
    the launch resolved for them is kept there, and later calls on the same current
    device skip the key (still checked on every call: the switches, launch hooks, the
    kernel, the device, and :func:`cache_clear` since). Returns nothing."""
    kwargs = kwargs or {}
    if not enabled() or _hooked() or callable(grid) or not isinstance(kernel, _JIT):
        _slow(kernel, grid, args, kwargs)
        return
    kept = memo[0] if memo is not None else None
    if kept is not None:
        epoch, device, plan, hit = kept
        if (epoch is _EPOCH[0] and plan.kernel is kernel
                and device == _driver.active.get_current_device()):
            _call(hit, plan, grid, device, (*args, *kwargs.values()))
            return
    try:
        plan, values, key = _key(kernel, args, kwargs)
        hit = _BY_VALUE.get(key)
    except (_Unkeyed, TypeError):                 # TypeError: an unhashable constexpr
        _slow(kernel, grid, args, kwargs)
        return
    if hit is None:
        exact = _exact(key)
        hit = _CACHE.get(exact)
        if hit is None:
            compiled = _slow(kernel, grid, args, kwargs)
            if compiled is None or not hasattr(compiled, "packed_metadata"):
                return
            # the entry holds every JITFunction of the key: while it lives, their ids in
            # the key cannot be reused by other objects (the plan holds the kernel)
            hit = (compiled.run, compiled.function, compiled.packed_metadata,
                   tuple(_jit_objects(values)))
            _store(_CACHE, exact, hit)
            _store(_BY_VALUE, key, hit)
            if memo is not None:
                memo[0] = (_EPOCH[0], key[1], plan, hit)
            return
        _store(_BY_VALUE, key, hit)
    if memo is not None:
        memo[0] = (_EPOCH[0], key[1], plan, hit)
    _call(hit, plan, grid, key[1], values)


def _call(hit, plan, grid, device, values):
    """Run the compiled kernel of ``hit`` with the values in its parameters' order."""
    run, function, packed, _ = hit
    g0 = grid[0]
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    run(g0, g1, g2, _driver.active.get_current_stream(device), function, packed, None,
        None, None, *plan.call(values + plan.defaults))


_SAME_DEVICE = contextlib.nullcontext()


def on_device(device):
    """A context in which CUDA ``device`` is the current device. Triton launches on the
    current device, not on its arguments', so every kernel family enters this with its
    inputs' device: without it, tensors on ``cuda:1`` while ``cuda:0`` is current (layers
    spread over GPUs, as ``device_map="auto"`` does) would be read by a kernel on the
    wrong GPU. A no-op (a shared ``nullcontext``) for CPU tensors and when the device is
    already current, which costs one ``torch.cuda.current_device()``."""
    if device.type != "cuda" or device.index is None \
            or device.index == torch.cuda.current_device():
        return _SAME_DEVICE
    return torch.cuda.device(device)


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
    """Forget every cached compiled kernel and plan, and every memo's launch (tests; a
    changed generated source is a new ``JITFunction`` anyway)."""
    _CACHE.clear()
    _BY_VALUE.clear()
    _PLANS.clear()
    _EPOCH[0] = object()


__all__ = ["launch", "enabled", "cache_clear", "capability", "sm_count"]
