"""Argument checks shared by the entry points of :mod:`flashfold.api` and
:mod:`flashfold.distributed` (:func:`~flashfold.attention`, :func:`~flashfold.decode`,
:func:`~flashfold.distributed.ring_attention`, ...): one check and one message per kind of
argument, so that the functions accept and reject the same values.

Rules:

* a value of the wrong type raises ``TypeError``, a value out of range ``ValueError``; the
  message starts with the argument's name as the caller spelled it;
* ``window=(left, right)``: each side an int ``>= 0``, or ``None`` / ``-1`` for unbounded. A
  side at least as long as the sequence it bounds hides no key and is unbounded
  (:func:`unbounded_beyond`): ``window=(2**70, 0)`` is causal attention, and no huge side
  reaches a kernel's int32 position arithmetic. A malformed window raises
  :class:`WindowTypeError`, both a ``TypeError`` and a ``ValueError``, so code written
  against either class catches it;
* meta tensors (shape propagation, as torch's own functions do): a function whose output
  shapes follow from its inputs' shapes returns meta outputs of the right shape and dtype
  and computes nothing, skipping the checks that read values; a check the caller asked for
  explicitly that needs values, or an output shape that depends on values, raises
  ``ValueError`` naming the argument (:func:`no_values`: ``"q is a meta tensor: ..."``).
"""

from __future__ import annotations

import math
import numbers

import torch


class WindowTypeError(TypeError, ValueError):
    """A ``window`` that is not a pair of ints / None (both a TypeError and a ValueError)."""


def check_tensor(name: str, t) -> None:
    """``TypeError`` unless ``t`` is a tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_int(name: str, x, minimum: int | None = None) -> int:
    """``x`` as an int: ``TypeError`` unless it is an integer (a NumPy one too) and not a
    bool (``True`` is an int to Python, but a flag passed for a size or a distance is a
    mistake, read as 1), nor a float (``2.5`` would be truncated, ``2.0`` read as an int
    by chance); ``ValueError`` below ``minimum``."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    x = int(x)
    if minimum is not None and x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    return x


def check_bool(name: str, x, none: bool = False) -> None:
    """``TypeError`` unless ``x`` is a bool (or, with ``none``, None)."""
    if not (isinstance(x, bool) or (none and x is None)):
        raise TypeError(f"{name} must be a bool{' or None' if none else ''}, got "
                        f"{type(x).__name__} {x!r}")


def check_cu_seqlens(name: str, cu, total: int | None, device, values: bool = True,
                     owner: str = "q"):
    """Check packed-sequence offsets ``cu`` (int32 ``(S + 1,)`` on ``device``, ``owner``'s,
    from 0, non-decreasing, ending at ``total``) and return the ``S`` lengths; ``values=False``
    (under ``torch.compile``, on meta tensors) checks the dtype and shape alone and returns
    None. The values are read once per tensor and version (a host sync) and remembered."""
    check_tensor(name, cu)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} must be 1-D with (num_seqs + 1) >= 2 entries, got shape "
                         f"{tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but {owner} is on {device}")
    if not values:                              # under torch.compile: no host sync here
        return None
    from ..kernels.attention.autograd import known_lengths, remember_lengths
    lens = known_lengths(cu)
    if lens is not None:
        # validated before at this version (an in-place write bumps it): no host sync, so
        # that the layers of a model sharing one cu_seqlens read it once
        if sum(lens) != total:
            raise ValueError(f"{name} must end at the packed length {total}, got {sum(lens)}")
        return lens
    vals = cu.tolist()                          # one host sync: lengths drive the launch grid
    if vals[0] != 0:
        raise ValueError(f"{name} must start at 0, got {vals[0]}")
    if any(b < a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"{name} must be non-decreasing")
    if vals[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}, got {vals[-1]}")
    lens = [b - a for a, b in zip(vals, vals[1:])]
    remember_lengths(cu, lens)                  # the kernels' host code reads no more
    return lens


#: the largest float32: scales and caps beyond it would be inf in the kernels' float32
FLOAT32_MAX = torch.finfo(torch.float32).max


def check_positive(name: str, x):
    """``None`` or a real in ``(0, FLOAT32_MAX]`` -> ``None`` or a float (a score scale or
    cap, which the kernels hold in float32: a larger one would be ``inf`` there, and
    ``0 * inf`` NaN)."""
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {x}")
    if x > FLOAT32_MAX:
        raise ValueError(f"{name} must be at most {FLOAT32_MAX:.6g} (it is computed in "
                         f"float32), got {x}")
    return x


def check_window(window):
    """``None`` or ``(left, right)`` -> ``(left, right)``, each an int ``>= 0`` or None
    (unbounded; ``-1`` also means unbounded). Any int size is accepted: see
    :func:`unbounded_beyond` for the sides that reach past every key."""
    if window is None:
        return None, None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise WindowTypeError(f"window must be a pair (left, right) of ints >= 0 (None or -1: "
                              f"unbounded), got {window!r}")
    out = []
    for side, w in zip(("left", "right"), window):
        if w is None:
            out.append(None)
            continue
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            raise WindowTypeError(f"window {side} must be an int >= 0, -1 or None, got {w!r}")
        w = int(w)
        if w < -1:
            raise ValueError(f"window {side} must be >= 0 (or -1 / None for unbounded), got {w}")
        out.append(None if w == -1 else w)
    return tuple(out)


def unbounded_beyond(side, n):
    """``None`` (unbounded) for a window side ``>= n``, where ``n`` is a length no query can
    reach past (a side that long hides no key), else ``side``."""
    return None if side is not None and side >= n else side


#: the largest head dim of the GPU kernels of attention and decode (q/k and v independently
#: take any of ``1 .. MAX_HEAD_DIM``: the kernels' tiles are the next power of two, at least
#: 16, the padding masked inside the kernel, never copied on the host); attention's CPU
#: reference takes any head dim >= 1
MAX_HEAD_DIM = 256
#: attention's dtypes on CUDA and elsewhere
CUDA_DTYPES = (torch.float16, torch.bfloat16)
CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_qkv(q, k, v, dtypes=None) -> None:
    """Attention's ``q (B, Hq, S, D)``, ``k (B, Hkv, L, D)``, ``v (B, Hkv, L, Dv)``: tensors
    of 4 dims, one dtype (:data:`CUDA_DTYPES` on CUDA, :data:`CPU_DTYPES` elsewhere) and one
    device (``dtypes``, when given, instead), ``Hq`` a multiple of ``Hkv`` (GQA / MQA), ``D``
    and ``Dv`` >= 1 (the kernels' bound is :func:`check_kernel_head_dims`);
    ``TypeError`` for a type or dtype, ``ValueError`` for a shape or device, naming the
    tensor."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (batch, heads, seq, head_dim), got "
                             f"shape {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} dtype {t.dtype} does not match q dtype {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    allowed = dtypes or (CUDA_DTYPES if q.device.type == "cuda" else CPU_DTYPES)
    if q.dtype not in allowed:
        raise TypeError(f"q dtype {q.dtype} is not supported on {q.device.type}; expected one "
                        f"of {[str(d) for d in allowed]}")
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"v has {v.shape[1]} heads but k has {k.shape[1]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads "
                         f"({k.shape[1]}) for GQA/MQA")
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"v seq length {v.shape[2]} does not match k seq length {k.shape[2]}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k head_dim {k.shape[3]} does not match q head_dim {q.shape[3]}")
    for name, d in (("q/k", q.shape[3]), ("v", v.shape[3])):
        if d < 1:
            raise ValueError(f"{name} head_dim must be >= 1, got {d}")


def check_kernel_head_dims(q, v) -> None:
    """``ValueError`` unless ``q``'s and ``v``'s head dims fit the GPU kernels' tiles
    (``1 ..`` :data:`MAX_HEAD_DIM`); the CPU reference takes any."""
    for name, d in (("q/k", q.shape[3]), ("v", v.shape[3])):
        if d > MAX_HEAD_DIM:
            raise ValueError(f"{name} head_dim must be in 1..{MAX_HEAD_DIM} for the GPU "
                             f"kernels, got {d} (the CPU reference takes any head_dim)")


def is_meta(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "meta"


def no_values(name: str, what: str) -> ValueError:
    """The error for a meta tensor whose values a call needs (raise it)."""
    return ValueError(f"{name} is a meta tensor: {what} needs its values, and a meta tensor "
                      f"has none (meta inputs give meta outputs of the right shape only where "
                      f"the shapes do not depend on values)")


__all__ = ["WindowTypeError", "check_tensor", "check_int", "check_bool", "check_cu_seqlens",
           "check_positive", "check_window",
           "unbounded_beyond", "MAX_HEAD_DIM", "CUDA_DTYPES", "CPU_DTYPES", "check_qkv",
           "check_kernel_head_dims", "is_meta",
           "no_values"]
