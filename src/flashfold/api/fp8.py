r"""FP8 (E4M3) attention inputs: quantization helpers and the checks of
:func:`flashfold.attention`'s FP8 call.

An FP8 call passes ``q, k, v`` as ``torch.float8_e4m3fn`` with float32 **descale**
factors ``q_descale, k_descale, v_descale`` of shape ``(B, Hk)`` (``(S, Hk)`` with
``cu_seqlens``: one row per packed sequence), FlashAttention-3's interface: the tensor
stands for ``x8 * descale``, a query head taking its KV head's column. The output is
``out_dtype`` (bf16 by default), the LSE float32; the statistics stay in fp32 and ``P`` is
quantized to FP8 with its own scale for ``P V``
(:func:`flashfold.kernels.attention.reference.fp8_attention_reference` states the
semantics). Forward only.

:func:`quantize_fp8` makes such inputs from a higher-precision tensor (per (batch, KV
head) absolute-max scaling); :func:`random_rotation` is the "incoherent processing" of
FlashAttention-3: ``q R`` and ``k R`` with one random orthogonal ``R`` leave ``q k^T``
unchanged and spread a few large channels over all of them before quantization (the
caller's choice: flashfold does not rotate; ``flashfold numerics`` measures both).
"""

from __future__ import annotations

import numbers

import torch

from ..kernels.attention.reference import FP8, FP8_MAX
from .validate import FLOAT32_MAX, check_cu_seqlens, check_qkv, check_tensor

#: the smallest positive float32 (a subnormal, 2^-149)
FLOAT32_TINIEST = 2.0 ** -149

#: the FP8 formats torch has; E4M3 (``float8_e4m3fn``) is the one attention takes
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2",
                                                "float8_e4m3fnuz", "float8_e5m2fnuz")
                   if hasattr(torch, n))
#: output dtypes of an FP8 call
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def is_fp8(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES


def quantize_fp8(x: torch.Tensor, heads_k: int | None = None, *,
                 cu_seqlens: torch.Tensor | None = None):
    """``(x8, descale)``: ``x (B, H, N, D)`` (floating point) as E4M3 with one float32
    factor per (batch, KV head), ``descale (B, Hk)`` (``(S, Hk)`` with ``cu_seqlens``),
    ``x8 * descale ~= x``. ``heads_k``: the KV heads (default ``H``; for ``q`` pass ``k``'s
    head count: the query heads of a group share their KV head's factor). The factor maps
    the group's largest magnitude to 448 (E4M3's largest value); an all-zero group gets 1,
    a group below ``448 x 2^-149`` the smallest float32. Finite entries past float32's
    range saturate to +-448; infinities and NaN become NaN.
    ``cu_seqlens``: int32 offsets of packed sequences in ``x (1, H, total, D)``, checked as
    :func:`flashfold.attention` checks them."""
    check_tensor("x", x)
    if x.dim() != 4 or not x.is_floating_point() or x.dtype in FP8_DTYPES:
        raise ValueError(f"x must be a 4-D floating point tensor (B, H, N, D) of a wider "
                         f"format than FP8, got {x.dtype} of shape {tuple(x.shape)}")
    B, H, N, _ = x.shape
    if heads_k is not None and (isinstance(heads_k, bool)
                                or not isinstance(heads_k, numbers.Integral)):
        raise TypeError(f"heads_k must be an int, got {type(heads_k).__name__}")
    hk = H if heads_k is None else int(heads_k)
    if hk <= 0 or H % hk:
        raise ValueError(f"heads_k must divide the {H} heads of x, got {heads_k}")
    # the factors from the finite magnitudes: a NaN or inf entry becomes NaN (below) and
    # does not move its group's factor; a finite one past float32's range counts as the
    # largest float32 (it saturates to +-448 below); clamped in float32, whose largest
    # value a 16-bit tensor cannot hold
    finite = torch.isfinite(x.detach())
    a = x.detach().to(torch.float32).abs().clamp(max=FLOAT32_MAX)
    a = torch.where(finite, a, 0.0)
    if cu_seqlens is None:
        amax = _group_amax(a, hk)
    else:
        if B != 1:
            raise ValueError(f"with cu_seqlens, x must have batch 1 (packed), got {B}")
        lens = check_cu_seqlens("cu_seqlens", cu_seqlens, N, x.device, owner="x")
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        amax = torch.stack([_group_amax(a[:, :, cu[i]:cu[i + 1]], hk)[0]
                            for i in range(len(cu) - 1)])
    # (a group whose largest magnitude is below 448 x 2^-149 takes the smallest float32,
    # 2^-149, not amax / 448 rounded to 0)
    descale = torch.where(amax > 0, (amax / FP8_MAX).clamp(min=FLOAT32_TINIEST), 1.0)
    f = descale.repeat_interleave(H // hk, dim=1)
    x8 = x.detach().to(torch.float32)
    if cu_seqlens is None:
        x8 = x8 / f[:, :, None, None]
    else:
        x8 = x8.clone()
        for i in range(len(cu) - 1):
            x8[:, :, cu[i]:cu[i + 1]] /= f[i][None, :, None, None]
    # rounding may carry the largest entry a hair past 448, and an entry past float32's
    # range is inf here: saturate the finite ones; an inf or NaN entry becomes NaN (E4M3
    # has no inf, and torch's cast would saturate it to 448)
    x8 = torch.where(finite, x8.clamp(-FP8_MAX, FP8_MAX), float("nan"))
    return x8.to(FP8), descale


def _group_amax(a, hk):
    """The largest entry of each (batch, KV head) group of ``a (B, H, N, D)``, ``(B,
    hk)``; 0 for an empty group (no rows, or head dim 0: all-zero, factor 1)."""
    B, H, N, D = a.shape
    group = a.reshape(B, hk, (H // hk) * N * D)
    return group.amax(-1) if group.shape[-1] else a.new_zeros(B, hk)


def random_rotation(head_dim: int, *, seed: int = 0, dtype=torch.float32, device=None):
    """A random orthogonal ``(head_dim, head_dim)`` matrix (the QR factor of a Gaussian
    matrix, signs fixed so that the draw is uniform; computed in float64). ``head_dim``:
    an int ``>= 1``; ``seed``: an int torch's generator takes (``-2^63 .. 2^64 - 1``);
    ``dtype``: a floating point format wider than FP8 (an orthogonal matrix rounded to
    integers or to 3 mantissa bits is not one)."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, numbers.Integral):
        raise TypeError(f"head_dim must be an int, got {type(head_dim).__name__}")
    head_dim = int(head_dim)
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not -2 ** 63 <= int(seed) < 2 ** 64:
        raise ValueError(f"seed must be in -2^63 .. 2^64 - 1, got {seed}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype in FP8_DTYPES:
        raise TypeError(f"dtype must be a floating point dtype wider than FP8, got {dtype}")
    g = torch.Generator().manual_seed(int(seed))
    a = torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64)
    qm, r = torch.linalg.qr(a)
    qm = qm * torch.sign(torch.diagonal(r))[None, :]
    return qm.to(dtype=dtype, device=device)


def check_fp8_call(q, k, v, q_descale, k_descale, v_descale, out_dtype, *, score_mod,
                   mask_mod, n_seqs):
    """The checks of an FP8 call (module docstring): ``TypeError`` / ``ValueError`` naming
    the argument. Returns the output dtype."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        if t.dtype in FP8_DTYPES and t.dtype != FP8:
            raise TypeError(f"{name} is {t.dtype}: FP8 attention takes float8_e4m3fn "
                            f"(E4M3) only")
        if t.dtype != FP8:
            raise TypeError(f"{name} is {t.dtype} but another input is FP8: q, k and v "
                            f"must all be float8_e4m3fn")
    check_qkv(q, k, v, dtypes=(FP8,))
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.requires_grad:
            raise ValueError(f"{name} requires grad: FP8 attention is forward-only (no "
                             f"backward through float8 inputs); detach it, or use bf16")
    if score_mod is not None or mask_mod is not None:
        raise ValueError("score_mod / mask_mod are not supported with FP8 inputs")
    want = (n_seqs, k.shape[1])
    for name, d in (("q_descale", q_descale), ("k_descale", k_descale),
                    ("v_descale", v_descale)):
        if d is None:
            raise ValueError(f"{name} is required with float8 inputs: float32 of shape "
                             f"{want} (see flashfold.api.fp8.quantize_fp8)")
        check_tensor(name, d)
        if d.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {d.dtype}")
        if tuple(d.shape) != want:
            raise ValueError(f"{name} must have shape {want} (batch or packed sequences, "
                             f"KV heads), got {tuple(d.shape)}")
        if d.device != q.device:
            raise ValueError(f"{name} is on {d.device} but q is on {q.device}")
        if d.requires_grad:
            raise ValueError(f"{name} requires grad: FP8 attention is forward-only (no "
                             f"gradient for the descale factors); detach it")
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {[str(d) for d in OUT_DTYPES]}, got "
                        f"{out_dtype}")
    return out_dtype


__all__ = ["quantize_fp8", "random_rotation", "check_fp8_call", "is_fp8", "FP8_DTYPES",
           "OUT_DTYPES"]
