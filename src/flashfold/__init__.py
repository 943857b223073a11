"""flashfold: write a monoid once; run it sequentially, in blocks, as a tree, as a scan,
as a Triton kernel or across devices, with the same result.

The layers (each imports only the ones above it):

1. :mod:`flashfold.algebra` (pure Python + NumPy): :class:`Monoid`, :mod:`flashfold.ops`,
   the traced IR, :func:`check_laws`; built-ins in :mod:`flashfold.monoids`, user-style
   examples (recurrences, covariance, top-2, ...) in :mod:`flashfold.examples`.
2. :mod:`flashfold.schedules`: reference executors on NumPy (:func:`fold`, :func:`scan`).
3. :mod:`flashfold.kernels`: Triton code generated from monoids, attention kernels.
4. :mod:`flashfold.api` (public tensor entry points: reductions, attention, decode) and
   :mod:`flashfold.distributed` (ring attention), :mod:`flashfold.dask` (Dask reductions).
5. :mod:`flashfold.cli`: the ``flashfold`` command.

Torch-based entry points are imported on first use, so ``import flashfold`` stays light.
"""

import sys as _sys

from . import monoids
from . import ops
from .algebra import Field, Input, LawReport, Monoid, check_laws
from .schedules import finalize, fold

__version__ = "0.1.0"

#: public name -> module (relative to this package) that defines it, imported on first use
_LAZY = {
    # tensor reductions and scans from generated Triton kernels (CPU: reference schedules)
    **dict.fromkeys(["reduce", "segment_reduce", "logsumexp", "softmax", "var_mean", "argmax",
                     "argmin", "cumsum", "logcumsumexp"], ".api.reductions"),
    # exact attention
    **dict.fromkeys(["attention", "attention_policy", "merge_states", "BlockMask",
                     "create_block_mask"], ".api.attention"),
    **dict.fromkeys(["quantize_fp8", "random_rotation"], ".api.fp8"),
    **dict.fromkeys(["decode", "append_kv", "PagedKVCache"], ".api.decode"),
    # the algebra in depth
    "prove": ".algebra.proofs", "Proof": ".algebra.proofs",
    "transport": ".algebra.transport", "check_transport": ".algebra.transport",
    "derive_combine": ".algebra.homomorphism", "check_folds": ".algebra.homomorphism",
    "numerics": ".error_analysis",
}


def scan(monoid, xs, *args, **kwargs):
    """Inclusive prefix scan of ``xs`` with ``monoid``.

    * a ``torch.Tensor`` (a subclass included), or a tuple or list of them (a monoid of
      several inputs): the tensor scan,
      :func:`flashfold.api.reductions.scan` (``dim=-1``; returns the finalized prefix
      results, computed by a generated kernel on CUDA);
    * anything else (NumPy arrays, lists, array-likes): the reference scan,
      :func:`flashfold.schedules.scan` (elements along axis 0; returns the prefix *states*).

    The test is ``isinstance(xs, torch.Tensor)`` against the torch already loaded: a tensor
    cannot exist before torch is imported, so NumPy input never imports torch.
    """
    torch = _sys.modules.get("torch")
    if torch is not None and (isinstance(xs, torch.Tensor) or (
            isinstance(xs, (tuple, list)) and xs
            and all(isinstance(t, torch.Tensor) for t in xs))):
        from .api.reductions import scan as tensor_scan
        return tensor_scan(monoid, xs, *args, **kwargs)
    from .schedules import scan as reference_scan
    return reference_scan(monoid, xs, *args, **kwargs)


#: submodules reachable as attributes (``flashfold.mods``) without an explicit import
_SUBMODULES = ("examples", "mods", "api", "dask", "distributed", "integrations", "kernels",
               "schedules", "testing", "cli")


def __getattr__(name):
    """Resolve a lazy attribute once: it is then stored in the module, so later lookups
    (``flashfold.argmax`` in a hot loop) do not import again (that cost ~5 us per call)."""
    import importlib
    if name in _SUBMODULES:
        value = importlib.import_module("." + name, __name__)
    else:
        target = _LAZY.get(name)
        if target is None:
            raise AttributeError(f"module 'flashfold' has no attribute {name!r}")
        value = getattr(importlib.import_module(target, __name__), name)
    globals()[name] = value
    return value


__all__ = ["Monoid", "Field", "Input", "ops", "monoids", "check_laws", "LawReport", "fold",
           "scan", "finalize", *_LAZY]
