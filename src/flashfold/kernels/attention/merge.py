r"""Merging partial attention results: a kernel generated from the ATTENTION monoid.

A normalized partial result over a key subset ``K_s`` is ``(o_s, lse_s)`` with
``lse_s = log sum_{j in K_s} e^{s_j}`` and ``o_s = sum_j e^{s_j - lse_s} v_j``. It is
exactly the ATTENTION state of *one* pseudo-key with score ``lse_s`` and value ``o_s``:

.. math::

    \mathrm{lift}(\mathrm{lse}_s, o_s) = (m, d, o) = (\mathrm{lse}_s, 1, o_s)

(an empty part, ``lse_s = -inf``, lifts to the identity ``(-inf, 0, 0)``), so merging
parts is folding them with the monoid's combine and finalizing:

.. math::

    \mathrm{lse} = \log \sum_s e^{\mathrm{lse}_s}, \qquad
    o = \sum_s e^{\mathrm{lse}_s - \mathrm{lse}}\, o_s

(``o = 0``, ``lse = -inf`` when every part is empty, whatever their ``o``). Non-finite
parts follow rule 5 of :mod:`flashfold.api.attention`: ``m = -inf`` is the only empty
state the finalize knows, so a NaN ``lse_s`` (NaN ``m``) makes ``o`` and ``lse`` NaN, and
a non-finite ``o_s[c]`` with a finite ``lse_s`` makes ``o[c]`` non-finite. Because the combine is
associative and commutative, any split of the keys (split-KV decoding, cascade /
shared-prefix attention, sequence parallelism) merged in any order gives the unsplit
attention up to rounding.

The kernel calls the ``lift``, ``combine`` and ``finalize`` that
:func:`flashfold.kernels.codegen.triton_monoid` generates from ``ATTENTION``'s traced
IR (nothing here restates the math): one program per ``BLOCK_R`` rows, each row's state
``m, d: [BLOCK_R, 1]``, ``o: [BLOCK_R, BLOCK_D]`` in fp32, folding the splits in order.
Layouts: parts ``(S, B, H, N, D)`` / ``(S, B, H, N)`` with any strides; output ``o``
``(B, H, N, D)`` in the parts' dtype, ``lse`` float32 ``(B, H, N)``.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from ...monoids import ATTENTION
from .. import launcher


@triton.jit
def _load_part(O, L, s, b, h, n, offs_d, rmask, dmask,
               so_s, so_b, so_h, so_n, so_d, sl_s, sl_b, sl_h, sl_n):
    """Split ``s`` of the rows: ``lse [BLOCK_R, 1]`` (-inf outside), ``o [BLOCK_R, BLOCK_D]``."""
    s64 = tl.full([], 0, tl.int64) + s
    l_off = s64 * sl_s + b * sl_b + h * sl_h + n * sl_n
    lse = tl.load(L + l_off, mask=rmask, other=float("-inf")).to(tl.float32)
    o_off = s64 * so_s + b * so_b + h * so_h + n * so_n
    o = tl.load(O + o_off[:, None] + offs_d[None, :] * so_d,
                mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    return lse[:, None], o


@triton.jit
def _merge_kernel(O, L, O2, L2, OUT, LSE, S, R, H, N, D,
                  so_s, so_b, so_h, so_n, so_d, sl_s, sl_b, sl_h, sl_n,
                  so2_b, so2_h, so2_n, so2_d, sl2_b, sl2_h, sl2_n,
                  oo_b, oo_h, oo_n, oo_d, ol_b, ol_h, ol_n,
                  lift: tl.constexpr, combine: tl.constexpr, finalize: tl.constexpr,
                  PAIR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """``PAIR``: two parts at ``(O, L)`` and ``(O2, L2)``; else ``S`` parts stacked at ``(O, L)``."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    n = rows % N
    h = (rows // N) % H
    b = rows // N // H
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    lse, o = _load_part(O, L, 0, b, h, n, offs_d, rmask, dmask,
                        so_s, so_b, so_h, so_n, so_d, sl_s, sl_b, sl_h, sl_n)
    m, d, acc = lift(lse, o)
    if PAIR:
        lse, o = _load_part(O2, L2, 0, b, h, n, offs_d, rmask, dmask,
                            0, so2_b, so2_h, so2_n, so2_d, 0, sl2_b, sl2_h, sl2_n)
        bm, bd, bo = lift(lse, o)
        m, d, acc = combine(m, d, acc, bm, bd, bo)
    elif INTERPRET:   # the interpreter's range() cannot take a tensor bound with NumPy >= 2.4
        s = 1
        while s < S:
            lse, o = _load_part(O, L, s, b, h, n, offs_d, rmask, dmask,
                                so_s, so_b, so_h, so_n, so_d, sl_s, sl_b, sl_h, sl_n)
            bm, bd, bo = lift(lse, o)
            m, d, acc = combine(m, d, acc, bm, bd, bo)
            s += 1
    else:
        for s in tl.range(1, S):
            lse, o = _load_part(O, L, s, b, h, n, offs_d, rmask, dmask,
                                so_s, so_b, so_h, so_n, so_d, sl_s, sl_b, sl_h, sl_n)
            bm, bd, bo = lift(lse, o)
            m, d, acc = combine(m, d, acc, bm, bd, bo)
    out, lse_out = finalize(m, d, acc)
    tl.store(OUT + (b * oo_b + h * oo_h + n * oo_n)[:, None] + offs_d[None, :] * oo_d,
             out.to(OUT.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])
    tl.store(LSE + b * ol_b + h * ol_h + n * ol_n, tl.reshape(lse_out, [BLOCK_R]), mask=rmask)


def rows_per_program(block_d: int) -> int:
    """Rows per program: 4096 fp32 state elements over 4 warps (32 registers per tile)."""
    return max(1, min(64, 4096 // block_d))


def _launch(o1, l1, o2, l2, S, split_strides):
    from ..codegen import triton_monoid

    B, H, N, D = o1.shape[-4:]
    out = torch.empty((B, H, N, D), dtype=o1.dtype, device=o1.device)
    lse = torch.empty((B, H, N), dtype=torch.float32, device=o1.device)
    R = B * H * N
    if R == 0:
        return out, lse
    fns = triton_monoid(ATTENTION)
    interpret = launcher.interpreting()
    block_d = 1 << max(0, D - 1).bit_length()
    block_r = rows_per_program(block_d) if not interpret else 16
    pair = o2 is not None
    so = list(o1.stride()[-4:])
    sl = list(l1.stride()[-3:])
    so2 = list(o2.stride()) if pair else [0] * 4
    sl2 = list(l2.stride()) if pair else [0] * 3
    grid = (-(-R // block_r),)
    with launcher.on_device(o1.device):
        launcher.launch(_merge_kernel, grid, (
            o1, l1, o2, l2, out, lse, S, R, H, N, D,
            split_strides[0], *so, split_strides[1], *sl, *so2, *sl2,
            *out.stride(), *lse.stride(),
            fns.lift, fns.combine, fns.finalize),
            dict(PAIR=pair, BLOCK_R=block_r, BLOCK_D=block_d, INTERPRET=interpret, num_warps=4))
    return out, lse


def merge_parts(outs, lses):
    """Merge ``outs (S, B, H, N, D)`` / ``lses (S, B, H, N)`` (validated by
    :func:`flashfold.merge_states`); returns ``(o (B, H, N, D), lse (B, H, N))``."""
    return _launch(outs, lses, None, None, outs.shape[0], (outs.stride(0), lses.stride(0)))


def merge_pair(o_a, lse_a, o_b, lse_b):
    """Merge two parts ``o_* (B, H, N, D)``, ``lse_* (B, H, N)`` without stacking them."""
    return _launch(o_a, lse_a, o_b, lse_b, 2, (0, 0))


__all__ = ["merge_parts", "merge_pair"]
