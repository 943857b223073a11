"""What differs between the Triton releases flashfold supports: 3.6 (pinned by torch 2.11)
through 3.9. Nothing else in flashfold compares Triton versions or probes Triton's API.

The Gluon kernels (:mod:`.attention.gluon_fwd`, :mod:`.attention.gluon_bwd`) take every
Gluon name from here. What moved, and what this module gives under one name:

=========================  ===============================  ==============================
here                       Triton 3.6, 3.7                  Triton 3.8, 3.9
=========================  ===============================  ==============================
``tma.async_load``         ``tma.async_copy_global_to_``    ``tma.async_load`` (3.8 keeps
                           ``shared``                       the old name as an alias, 3.9
                                                            removes it)
``tma.async_store``        ``tma.async_copy_shared_to_``    ``tma.async_store`` (the same)
                           ``global``
``tma_reduce_add``         the builder's                    ``tma.async_atomic_add``
                           ``create_async_tma_reduce``
                           (no Python API yet)
``warp_specialize``        ``gl.warp_specialize(parts,      the same; ``worker_num_regs``
                           warps, regs)``                   optional from 3.7
=========================  ===============================  ==============================

``tma`` is a namespace with both the old and the new names bound to the installed
Triton's functions, so kernel code written with either compiles on every version here.
``tma.store_wait(n)`` waits until the pending stores have *read* shared memory
(``cp.async.bulk.wait_group.read``) on all of them; the kernels rely on nothing more.

:func:`gluon_usable` is the one rule of whether a Gluon kernel may run: Gluon imports,
every name above resolves, ``gl.warp_specialize`` has a known signature, and the Triton
version lies in :data:`TESTED` (Gluon is experimental and its API moves every release, so
an untested version runs the Triton kernels rather than risk a kernel that compiles to
something else). Where it is false, dispatch uses the Triton kernels and
:func:`gluon_usable` warns once per process, naming the version and the reason.

The Triton kernels (``@triton.jit``) need nothing here: they are written to the
intersection of the supported versions.
"""

from __future__ import annotations

import inspect
import os
import re
import types
import warnings

import triton

__all__ = ["TRITON_VERSION", "TESTED", "parse_version", "warp_specialize", "adapt_warp_specialize",
           "gluon_unusable_reason", "gluon_usable", "HAS_TMA_REDUCE", "tma", "tma_reduce_add",
           "nvidia_tool"]

#: the Triton versions whose kernels CI compiles and runs: ``[low, high)``
TESTED = ((3, 6), (3, 10))


def parse_version(text: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a version string: ``"3.9.0"``, ``"3.10.0+git1a2b"``,
    ``"3.6.0rc1"`` -> ``(3, 6, 0)``; a missing patch reads 0."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if m is None:
        raise ValueError(f"version: cannot read a Triton version from {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


#: the installed Triton's ``(major, minor, patch)``
TRITON_VERSION = parse_version(triton.__version__)


def adapt_warp_specialize(ws):
    """A function ``call(partitions, worker_num_warps, worker_num_regs, **builtin_kwargs)``
    that calls ``ws``, a ``gl.warp_specialize`` of the installed Triton, with the partition
    list ``[(default_fn, args), (worker_fn, args), ...]``, one warp count and one register
    count per worker; ``None`` when ``ws`` has a signature not seen in a tested Triton.

    Known: ``(functions_and_args, worker_num_warps, worker_num_regs)`` with the register
    counts required (3.6) or defaulting to ``None`` (3.7 to 3.9). The partitions go in
    first, the counts by name, so that a reordering of the counts still binds."""
    try:
        params = inspect.signature(ws).parameters
    except (TypeError, ValueError):
        return None
    positional = [p for p in params.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not positional or positional[0].name != "functions_and_args" \
            or not {"worker_num_warps", "worker_num_regs"} <= named:
        return None

    def call(partitions, worker_num_warps, worker_num_regs, **builtin_kwargs):
        return ws(partitions, worker_num_warps=worker_num_warps,
                  worker_num_regs=worker_num_regs, **builtin_kwargs)

    return call


def _first(module, *names):
    """The first of ``names`` that ``module`` has (the newest name first: 3.9 keeps stubs
    that raise "has been removed" under the old TMA names)."""
    for name in names:
        fn = getattr(module, name, None)
        if fn is not None:
            return fn
    return None


#: why Gluon cannot be used on this Triton, found at import (``None``: nothing missing)
_MISSING: str | None = None
gluon = gl = mbarrier = fence_async_shared = warpgroup_mma = warpgroup_mma_wait = None
GluonDescriptor = None
tma = None
tma_reduce_add = None
HAS_TMA_REDUCE = False
_ws_call = None

try:  # Triton >= 3.5 ships Gluon
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin as _builtin
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.language.nvidia.hopper import tma as _tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
except ImportError as e:
    gluon = None
    _MISSING = f"Gluon does not import ({e})"

if gluon is not None:
    _load = _first(_tma, "async_load", "async_copy_global_to_shared")
    _store = _first(_tma, "async_store", "async_copy_shared_to_global")
    _ws_call = adapt_warp_specialize(getattr(gl, "warp_specialize", None))
    tma = types.ModuleType(__name__ + ".tma", "Gluon's Hopper TMA functions under the names "
                           "of every supported Triton (see flashfold.kernels.compat).")
    for _name in dir(_tma):
        if not _name.startswith("_"):
            setattr(tma, _name, getattr(_tma, _name))
    tma.async_load = tma.async_copy_global_to_shared = _load
    tma.async_store = tma.async_copy_shared_to_global = _store

    tma_reduce_add = _first(_tma, "async_atomic_add")
    if tma_reduce_add is None:
        try:  # 3.6, 3.7: the builder has the op, Gluon's Python API does not wrap it
            from triton._C.libtriton import gluon_ir as _gluon_ir
            from triton._C.libtriton import ir as _ir
            if hasattr(_gluon_ir.GluonOpBuilder, "create_async_tma_reduce") \
                    and hasattr(_ir, "DESCRIPTOR_REDUCE_KIND"):

                @_builtin
                def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
                    """``global[coord] += src`` for a shared-memory tile through TMA
                    (``cp.reduce.async.bulk.tensor ... .add``; completes like a TMA store:
                    ``tma.store_wait``)."""
                    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
                    _semantic.builder.create_async_tma_reduce(
                        _ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)
        except ImportError:
            pass
    HAS_TMA_REDUCE = tma_reduce_add is not None

    _missing = [n for n, v in (("tma.async_load", _load), ("tma.async_store", _store),
                              ("tma.store_wait", getattr(_tma, "store_wait", None)),
                              ("a TMA reduce (tma.async_atomic_add)", tma_reduce_add))
               if v is None]
    if _ws_call is None:
        _missing.append("gl.warp_specialize(functions_and_args, worker_num_warps, "
                       "worker_num_regs)")
    if _missing:
        _MISSING = "Gluon lacks " + ", ".join(_missing)

    @_builtin
    def warp_specialize(partitions, worker_num_warps, worker_num_regs, _semantic=None,
                        _generator=None):
        """``gl.warp_specialize`` of the installed Triton: ``partitions`` is
        ``[(default_fn, args), (worker_fn, args), ...]`` (the default partition runs in the
        kernel's ``num_warps`` warps), ``worker_num_warps`` and ``worker_num_regs`` one
        warp count and one ``setmaxnreg`` register count per worker."""
        return _ws_call(partitions, worker_num_warps, worker_num_regs, _semantic=_semantic,
                        _generator=_generator)
else:
    def warp_specialize(partitions, worker_num_warps, worker_num_regs):
        """Unavailable: this Triton has no Gluon."""
        raise RuntimeError(f"warp_specialize: {_MISSING}")


_FOUND = object()


def gluon_unusable_reason(version: tuple | None = None, missing=_FOUND) -> str | None:
    """Why a Gluon kernel may not run on this Triton (``None``: it may): what this module
    found missing at import (or ``missing``: a reason, or ``None`` for nothing), else the
    version (``version``: default the installed one) outside :data:`TESTED`."""
    version = TRITON_VERSION if version is None else version
    missing = _MISSING if missing is _FOUND else missing
    low, high = TESTED
    if missing:
        return missing
    if not low <= tuple(version[:2]) < high:
        return (f"the Gluon kernels are tested on Triton {low[0]}.{low[1]} to "
                f"{high[0]}.{high[1] - 1}")
    return None


_warned = False


def gluon_usable() -> bool:
    """Whether a Gluon kernel may run on this Triton (:func:`gluon_unusable_reason`). The
    first call that answers no warns (``RuntimeWarning``, once per process) that the
    attention kernels fall back to Triton, naming the installed version and the reason."""
    global _warned
    reason = gluon_unusable_reason()
    if reason is None:
        return True
    if not _warned:
        _warned = True
        warnings.warn(f"flashfold: Triton {triton.__version__} is installed and {reason}; "
                      "attention on sm_90 runs the Triton kernels instead of the Gluon ones",
                      RuntimeWarning, stacklevel=3)
    return False


def nvidia_tool(name: str, arch: int = 90) -> str:
    """The path of the NVIDIA tool ``name`` (``"ptxas"``, ``"cuobjdump"``, ``"nvdisasm"``)
    that Triton's backend uses for ``sm_<arch>``. ``ptxas`` is the one that assembles for
    that architecture: Triton 3.6 to 3.8 assemble sm_90 with ``bin/ptxas`` (CUDA 12.8),
    3.9 with ``bin/ptxas-blackwell`` (CUDA 13), whose PTX (ISA 9.x) the older one rejects.
    ``TRITON_<NAME>_PATH`` overrides the shipped binaries, as it does for Triton."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        from triton.knobs import nvidia
        return (get_ptxas(arch) if name == "ptxas"
                else getattr(nvidia, name.replace("-", "_")).get()).path
    except (ImportError, AttributeError, RuntimeError):
        return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
