r"""Exact attention, backward: Triton kernels (FlashAttention-2 schedule) and their launcher.

Math (per (batch, query head), rows ``i``, keys ``j``; the forward is :mod:`.fwd`). The
forward stored only ``o`` and the row's log-sum-exp ``lse_i`` (natural log), which
summarizes the whole row: with the final scores ``s_ij`` (scaled, soft-capped,
score-modified; ``-inf`` where hidden), :math:`P_{ij} = e^{s_{ij} - \mathrm{lse}_i}`
is recomputed tile by tile, never stored. Given :math:`dO` (and :math:`d\mathrm{lse}`
when the LSE output was used):

.. math::

    D_i = \sum_d dO_{id}\, O_{id} - d\mathrm{lse}_i \qquad \text{(preprocess, once per row)}

    dV_j = \sum_i P_{ij}\, dO_i, \qquad dP_{ij} = dO_i \cdot v_j, \qquad
    dS_{ij} = P_{ij} (dP_{ij} - D_i)

(``dlse`` enters because :math:`\partial \mathrm{lse}_i / \partial s_{ij} = P_{ij}`).
:math:`dS` is the gradient with respect to the *final* score; the chain rule back to the
raw product :math:`x_{ij} = q_i \cdot k_j` goes through the score pipeline:

.. math::

    \frac{\partial s}{\partial x} = \mathrm{scale} \cdot (1 - t^2) \cdot
    \mathrm{score\_mod}'(s_c), \qquad t = \tanh(\mathrm{scale}\, x / c),\; s_c = c\, t

(the softcap factor only with ``softcap=c``; ``score_mod'`` is the derivative graph
:func:`flashfold.algebra.autodiff.derivative` builds from the traced score_mod, lowered
to one Triton function returning the value and the derivative). With
:math:`\widetilde{dS} = dS \cdot \partial s / \partial x / \mathrm{scale}`,

.. math::

    dQ_i = \mathrm{scale} \sum_j \widetilde{dS}_{ij} k_j, \qquad
    dK_j = \mathrm{scale} \sum_i \widetilde{dS}_{ij} q_i,

summed over the query heads of a GQA group for ``dK``/``dV``. In base 2 (as the
forward): :math:`P = 2^{\sigma - \lambda}` with :math:`\sigma = s \log_2 e` (plain
scores: :math:`\sigma = x \cdot \mathrm{scale} \log_2 e`, one FMA) and
:math:`\lambda = \mathrm{lse} \log_2 e`. The preprocess stores :math:`\lambda = +\infty`
for a row with no visible key (``lse = -inf``) and loads it as :math:`+\infty` past the end
of a sequence, so :math:`P = 2^{\sigma - \infty} = 0` for every element of such rows,
hidden (:math:`\sigma = -\infty`) or not: no :math:`-\infty - (-\infty)`, gradients 0,
never NaN. :math:`P` is not written here: it is ATTENTION2's weights against
:math:`\lambda`, generated from the monoid (:func:`flashfold.kernels.codegen.tile_step_functions`,
``tile_weights``) as the forward's tile step is, and inlined by every backward kernel
(these and :mod:`.gluon_bwd`).

Kernels (one template each; constexpr flags as in :mod:`.fwd`):

* ``_bwd_preprocess``: ``D = rowsum(dO * O) - dlse`` and :math:`\lambda`, one program per
  ``BLOCK_M`` rows of a (batch, head); optionally zeroes the fp32 ``dQ`` accumulator.
* ``_attn_bwd_dkdv``: one program per (key tile, batch * KV head). ``K``, ``V`` stay on
  chip; the program loops over the query heads of the GQA group and, for each, over the
  query tiles that can see the key tile (:func:`_q_tile_ranges`: ``[masked | unmasked |
  masked]`` runs from the causal / window bounds; with a mask_mod, the PARTIAL then FULL
  query blocks of the key block's column of the block mask; EMPTY blocks are skipped),
  accumulating ``dK``, ``dV`` in fp32 registers without atomics. Tiles are computed
  transposed (``[BLOCK_N, BLOCK_M]``: :math:`S^T = K Q^T`) so that :math:`P^T` and
  :math:`dS^T` are the register (A) operands of :math:`dV \mathrel{+}= P^T dO` and
  :math:`dK \mathrel{+}= dS^T Q`. With ``DQ_ATOMIC`` the same program also adds
  :math:`dS\, K` into an fp32 ``dQ`` accumulator (TMA reduce-add
  ``cp.reduce.async.bulk`` on sm_90, pointer ``atomic_add`` otherwise).
* ``_attn_bwd_dq``: one program per (query tile, batch * query head), looping over key
  tiles like the forward (:func:`.fwd._tile_ranges`, block-mask rows): recomputes ``P``
  and accumulates ``dQ`` in registers, written once.
* ``_dq_convert`` (atomic mode): ``dQ = scale * acc`` in the input dtype.

The dK/dV and dQ kernels take their arguments as the forward's (:func:`.fwd._attn_fwd`):
each tensor's (batch, head, row, dim) strides as one tuple next to it (``SQ``, ``SK``,
``SV``, ``SDO``, ``SDK``, ``SDV``, ``SDQ``; ``SL`` the statistics' (batch, head)), the
block mask's four tables as one (``TABLES``, columns for dK/dV, rows for dQ), the
per-call sizes as separate scalars (not specialized).

On sm_90, calls with the Gluon forward's head dims (up to 256; MLA's 192/128), dense,
causal, windowed or soft-capped, packed sequences in its varlen scope, a score_mod or a
block mask it lowers (:func:`.dispatch.backward_gluon`), without an explicit ``config``, run the
warp-specialized Gluon kernel of :mod:`.gluon_bwd` between the preprocess and the
conversion instead: dK, dV and a dQ added by TMA reduce-adds in one pass (H200, head_dim
128: 0.93-1.04x cuDNN, 1.25-1.42x these kernels; head_dim 256 and MLA, its WIDE variant:
1.7-2.2x FlexAttention on Gemma's rows, 0.67-0.77x cuDNN; the workload grid's mod rows
1.2-2.5x these kernels; ``benchmarks/RESULTS.md``, ``docs/notes/attention_bwd.md``).

Modes: ``deterministic=True`` gives bitwise equal runs: in the Gluon kernel's scope its
``DETERMINISTIC`` variant (dQ added in a fixed order, 0.75-0.96x the default mode's speed
on the H200); elsewhere preprocess, dK/dV (no atomics) and the dQ kernel, where every sum has
a fixed order. The Triton kernels' default mode adds ``dQ`` with fp32
atomics from the dK/dV kernel (5 matmuls per tile pair instead of 7), whose order varies
from run to run (last-bit differences), where the configuration picks it (sm_90 with TMA,
causal / right-bounded rows, head dim <= 128, no softcap / score_mod / mask_mod:
:data:`HOPPER_BWD_CONFIGS`; measured faster there, while the dQ kernel was as fast or faster
on full rows, and the other variants would spill registers) and the policy's
``atomic_dq`` is on (:mod:`.dispatch`); elsewhere the default runs the deterministic kernels too.

In the dK/dV kernel without softcap / score_mod, ``-D`` and ``-lambda / (scale log2 e)``
are the initial accumulators of the ``dP^T`` and ``S^T`` matmuls, so no per-column vector is
held across the tile (it keeps the kernel within 255 registers).

Non-finite inputs (rule 4 of :mod:`flashfold.api.attention`): ``dq_i``, ``dk_j``, ``dv_j``
are non-finite only through a visible pair; hidden pairs add exactly 0. On masked tiles the
kernels *select* ``P`` and ``dS`` to 0 at hidden pairs (a NaN score, ``lambda``, ``D`` or
``dP`` there gives 0), which leaves one leak: the products ``P^T dO``, ``dS^T Q``, ``dS K``
multiply a hidden pair's 0 by the input tile, NaN there or not. Calls that can hide keys
inside a loaded tile (causal, window, mask, varlen; varlen TMA loads also read the next
sequence's rows past a sequence's end) raise a flag (one int32, zeroed by the preprocess)
where an output is not finite, in the kernels' epilogues (Triton) or in the conversion of
the dQ accumulator (Gluon: see :func:`prepare_backward`); two more launches, guarded by the
flag (they return at once when it is clear), then recompute dq, dk, dv with *strict*
products on the masked tiles: an input tile with a non-finite entry is replaced by 0 there,
and ``(row, channel)`` outputs that see a non-finite entry through a visible pair are set
to NaN (a product of the 0/1 visibility and the 0/1 non-finite indicator). Unmasked tiles
and valid input cost the checks and the two early-exit launches only.

Layouts: ``q (B, Hq, Nq, D)``, ``k (B, Hk, Nk, D)``, ``v (B, Hk, Nk, Dv)``, ``o``/``dO (B,
Hq, Nq, Dv)``, any strides (TMA where :func:`.fwd.tma_ok`; ``dO`` is copied once to a
contiguous tensor when it cannot feed TMA while q/k/v can, e.g. the expanded gradient of
``.sum()``); ``lse (B, Hq, Nq)`` float32 natural log. Outputs ``dq``, ``dk``, ``dv``
contiguous in the input dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ...monoids import ATTENTION2
from .. import launcher, plans
from ..codegen import tile_step_functions
from . import dispatch, gluon_bwd, gluon_fwd
from .fwd import (TensorDescriptor, _desc, _interpreting, _load_tile, _tanh, _tile_ranges,
                  _varlen_slot, _visible_2d, block_dims, tma_ok)
from .mods import BlockMask, TracedMod, column_lists, plan_tables, score_grad_fn


# --- jit helpers ----------------------------------------------------------------------------

@triton.jit
def _scores_bwd(qk, qk_scale, softcap, b, h, qi, kj, grad_fn,
                SBUF,
                HAS_SOFTCAP: tl.constexpr, HAS_SCORE_MOD: tl.constexpr):
    """Raw ``q.k`` -> ``(s, dfac)``: the final scores and ``ds / dx / scale``.

    Without softcap / score_mod, ``s`` is the raw ``qk`` (the caller's weights apply
    ``qk_scale = scale``) and ``dfac`` is 1 (unused). ``qi`` /
    ``kj``: broadcastable int32 index tiles of the rows and keys.
    """
    if HAS_SOFTCAP or HAS_SCORE_MOD:
        if HAS_SOFTCAP:
            t = _tanh(qk * qk_scale)
            s = softcap * t
            dfac = 1.0 - t * t
        else:
            s = qk * qk_scale
            dfac = tl.full(qk.shape, 1.0, tl.float32)
        if HAS_SCORE_MOD:
            s, dmod = grad_fn(s, b, h, qi, kj, SBUF)
            dfac = dfac * dmod.to(tl.float32)
            s = s.to(tl.float32)
        return s, dfac
    else:
        return qk, qk


@triton.jit
def _probs(qk, lam, qk_scale, softcap, b, h, qi, kj, vis,
           grad_fn, WEIGHTS: tl.constexpr, SBUF,
           MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SCORE_MOD: tl.constexpr):
    """``(P, dfac)`` of a tile: ``P`` = ATTENTION2's weights against ``lambda``
    (``WEIGHTS``, generated: ``2^(s c log2 e - lambda)``, ``c = qk_scale`` on raw scores,
    1 on final ones; ``lam`` broadcasts against ``qk``: ``+inf`` for empty or out-of-range
    rows gives 0), *selected* to 0 where ``vis`` (masked tiles) hides the pair: a NaN
    score or lambda of a hidden pair gives 0, not NaN."""
    s, dfac = _scores_bwd(qk, qk_scale, softcap, b, h, qi, kj, grad_fn,
                          SBUF, HAS_SOFTCAP, HAS_SCORE_MOD)
    if HAS_SOFTCAP or HAS_SCORE_MOD:
        p = WEIGHTS(lam, s, 1.0)[0]
    else:
        p = WEIGHTS(lam, s, qk_scale)[0]                # one FMA per score
    if MASKED:
        p = tl.where(vis, p, 0.0)
    return p, dfac


@triton.jit
def _strict_dot(a, vis, x, acc):
    """``acc + a @ x`` in which the pairs hidden by ``vis`` add exactly 0 (the strict
    recompute's masked tiles).

    ``a [M, K]`` is 0 where ``vis`` (bool, broadcastable to ``[M, K]``) hides the pair;
    ``x [K, N]`` an input tile. The product uses ``x`` with its non-finite entries replaced
    by 0, and ``(m, n)`` is NaN where a *visible* ``k`` has a non-finite ``x[k, n]``
    (counted by a second product, of the 0/1 visibility and the 0/1 non-finite indicator:
    what IEEE arithmetic gives there, ``0 * inf`` included). ``acc`` may be None."""
    ok = tl.abs(x.to(tl.float32)) < float("inf")
    seen = tl.dot(tl.broadcast_to(vis, a.shape).to(tl.float16),
                  tl.where(ok, 0.0, 1.0).to(tl.float16), out_dtype=tl.float16)
    # the mark after the product, not in its accumulator: a count feeding a dot's
    # accumulator makes Triton lay it out as a chained dot, replicated over the warpgroups
    # (twice the registers and a layout conversion: the strict dK/dV kernel at head_dim
    # 128 spilled 88-104 bytes on sm_90, none this way)
    return tl.where(seen > 0.0, float("nan"), tl.dot(a, tl.where(ok, x, 0.0).to(x.dtype), acc))


@triton.jit
def _dscores(p, dp, dd, dfac, HAS_SOFTCAP: tl.constexpr, HAS_SCORE_MOD: tl.constexpr):
    """``dS~ = P (dP - D) dfac`` (``dd`` broadcasts against ``p``); 0 wherever ``P = 0`` even
    if a score_mod's derivative is not finite at a hidden score."""
    ds = p * (dp - dd)
    if HAS_SCORE_MOD:
        ds = tl.where(p == 0.0, 0.0, ds * dfac)
    elif HAS_SOFTCAP:
        ds = ds * dfac
    return ds


@triton.jit
def _q_tile_ranges(start_n, q_len, k_len, delta, win_left, win_right,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, Q_TAIL: tl.constexpr):
    """Query tiles that can see key tile ``start_n``, as ``[t_lo, t_a)`` masked,
    ``[t_a, t_c)`` unmasked, ``[t_c, t_hi)`` masked (tile indices).

    Key ``j`` is visible to rows ``j - delta - R <= i <= j - delta + L`` (the transpose of
    :func:`.fwd._tile_ranges`). A tile needs no mask when every (real row, key) pair of
    it is inside both bounds and the key tile is inside ``k_len`` (a ragged key tile masks
    every query tile). Rows past ``q_len`` need no mask when they read as zeros: their
    ``lambda = +inf`` zeroes P; with ``Q_TAIL`` (varlen TMA loads, which read the next
    sequence's rows there, NaN or not) a ragged last query tile of the unmasked run moves
    to the last masked run.
    """
    n_last = tl.minimum(start_n + BLOCK_N, k_len) - 1
    lo = 0
    full_lo = 0
    hi = q_len
    if MASK_RIGHT:
        lo = tl.maximum(start_n - delta - win_right, 0)
        full_lo = tl.maximum(n_last - delta - win_right, 0)
    if MASK_LEFT:
        hi = tl.minimum(n_last - delta + win_left + 1, q_len)
    hi = tl.maximum(hi, 0)
    t_lo = lo // BLOCK_M
    t_hi = tl.maximum((hi + BLOCK_M - 1) // BLOCK_M, t_lo)
    t_a = tl.minimum(tl.maximum((full_lo + BLOCK_M - 1) // BLOCK_M, t_lo), t_hi)
    t_c = t_hi
    if MASK_LEFT:
        full_hi = start_n - delta + win_left + 1            # rows < full_hi see every key
        t_c = tl.where(full_hi >= q_len, t_hi, tl.maximum(full_hi, 0) // BLOCK_M)
        t_c = tl.minimum(tl.maximum(t_c, t_a), t_hi)
    ragged = start_n + BLOCK_N > k_len
    t_a = tl.where(ragged, t_hi, t_a)
    t_c = tl.where(ragged, t_hi, t_c)
    if Q_TAIL:
        t_c = tl.where((t_hi * BLOCK_M > q_len) & (t_c == t_hi) & (t_c > t_a), t_hi - 1, t_c)
    return t_lo, t_a, t_c, t_hi


@triton.jit
def _dkdv_step(dk, dv, k, v, STRICT: tl.constexpr, i, lo, idx_ptr,
               desc_q, desc_do, desc_dq, q_base, do_base, dq_base, lam_base, dd_base,
               tma_b, h, q_row, q_len, sqm, sqd, sdom, sdod, sdqm, sdqd,
               offs_n, k_len, delta, win_left, win_right, b, qk_scale, softcap,
               grad_fn, WEIGHTS, SBUF,
               mask_fn, MBUF,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               SPARSE: tl.constexpr, SPARSE_M: tl.constexpr, MASKED: tl.constexpr,
               APPLY_MASK_MOD: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HAS_SCORE_MOD: tl.constexpr, USE_TMA: tl.constexpr,
               DQ_ATOMIC: tl.constexpr, DQ_TMA: tl.constexpr):
    """Fold query tile ``i`` of a run into ``(dK, dV)`` (transposed tiles ``[BLOCK_N,
    BLOCK_M]``); with ``DQ_ATOMIC`` also add its ``dS K`` into the fp32 dQ accumulator.

    Dense runs: the tile starts at ``lo + i BLOCK_M``; sparse ones: sub-tile ``i % R`` of
    query block ``idx_ptr[i // R]`` (``R = SPARSE_M / BLOCK_M``).
    """
    if SPARSE:
        blk = tl.load(idx_ptr + i // (SPARSE_M // BLOCK_M))
        start_m = blk * SPARSE_M + (i % (SPARSE_M // BLOCK_M)) * BLOCK_M
    else:
        start_m = lo + i * BLOCK_M
    start_m = tl.multiple_of(start_m, BLOCK_M)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    # rows past q_len read as 0 (pointers) or as another sequence's rows (TMA, varlen):
    # finite either way, and lambda = +inf zeroes their P
    q = _load_tile(desc_q, q_base, tma_b, h, q_row, start_m, q_len, sqm, sqd,
                   BLOCK_M, BLOCK_D, HEAD_DIM, True, USE_TMA)
    row_ok = offs_m < q_len
    lam = tl.load(lam_base + offs_m, mask=row_ok, other=float("inf"))
    dd = tl.load(dd_base + offs_m, mask=row_ok, other=0.0)
    # dP^T - D = V dO^T - D: -D rides in the accumulator   [BLOCK_N, BLOCK_M]
    do = _load_tile(desc_do, do_base, tma_b, h, q_row, start_m, q_len, sdom, sdod,
                    BLOCK_M, BLOCK_DV, HEAD_DIM_V, True, USE_TMA)
    dpT = tl.dot(v, tl.trans(do), tl.broadcast_to(-dd[None, :], [BLOCK_N, BLOCK_M]))
    if MASKED:
        # hidden pairs (causal, window, mask_mod, keys past k_len, and rows past q_len,
        # which TMA reads from the next sequence in varlen calls) add exactly 0
        vis = _visible_2d(offs_m[None, :], offs_n[:, None], k_len, delta, win_left, win_right,
                          b, h, mask_fn, MBUF,
                          MASK_LEFT, MASK_RIGHT, APPLY_MASK_MOD) & row_ok[None, :]
    else:
        vis = 0
    # -- P^T: [BLOCK_N, BLOCK_M] fp32
    if HAS_SOFTCAP or HAS_SCORE_MOD:
        qkT = tl.dot(k, tl.trans(q))
        pT, dfac = _probs(qkT, lam[None, :], qk_scale, softcap, b, h, offs_m[None, :],
                          offs_n[:, None], vis, grad_fn, WEIGHTS, SBUF,
                          MASKED, HAS_SOFTCAP, HAS_SCORE_MOD)
    else:
        # -lambda / (qk_scale log2 e) rides in the accumulator: P = 2^(qk_scale log2 e (q.k
        # - lambda / (qk_scale log2 e))) (no per-column lambda held across the tile; +inf
        # rows give -inf, P = 0)
        qkT = tl.dot(k, tl.trans(q), tl.broadcast_to(
            (-lam * 0.6931471805599453 / qk_scale)[None, :], [BLOCK_N, BLOCK_M]))
        pT, dfac = _probs(qkT, 0.0, qk_scale, softcap, b, h, offs_m[None, :],
                          offs_n[:, None], vis, grad_fn, WEIGHTS, SBUF,
                          MASKED, HAS_SOFTCAP, HAS_SCORE_MOD)
    dsT = _dscores(pT, dpT, 0.0, dfac, HAS_SOFTCAP, HAS_SCORE_MOD)
    if MASKED and STRICT:
        # dV += P^T dO, strict (the recompute)
        dv = _strict_dot(pT.to(do.dtype), vis, do, dv)
    else:
        dv = tl.dot(pT.to(do.dtype), do, dv)                # dV += P^T dO   [BLOCK_N, BLOCK_DV]
    if MASKED:
        dsT = tl.where(vis, dsT, 0.0)       # (dP^T of a hidden pair may be NaN)
    dsT = dsT.to(q.dtype)
    if DQ_ATOMIC:
        dq = tl.dot(tl.trans(dsT), k)                       # dS K           [BLOCK_M, BLOCK_D]
        if DQ_TMA:
            desc_dq.atomic_add([tma_b, h, q_row + start_m, 0], dq.reshape([1, 1, BLOCK_M, BLOCK_D]))
        else:
            offs_d = tl.arange(0, BLOCK_D)
            ptrs = (dq_base + start_m.to(tl.int64) * sdqm
                    + (tl.arange(0, BLOCK_M)[:, None] * sdqm + offs_d[None, :] * sdqd))
            tl.atomic_add(ptrs, dq, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
                          sem="relaxed")
    if MASKED and STRICT:
        dk = _strict_dot(dsT, vis, q, dk)
    else:
        dk = tl.dot(dsT, q, dk)                             # dK += dS^T Q   [BLOCK_N, BLOCK_D]
    return dk, dv


@triton.jit
def _dkdv_loop(dk, dv, k, v, STRICT: tl.constexpr, lo, count, idx_ptr,
               desc_q, desc_do, desc_dq, q_base, do_base, dq_base, lam_base, dd_base,
               tma_b, h, q_row, q_len, sqm, sqd, sdom, sdod, sdqm, sdqd,
               offs_n, k_len, delta, win_left, win_right, b, qk_scale, softcap,
               grad_fn, WEIGHTS, SBUF,
               mask_fn, MBUF,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               SPARSE: tl.constexpr, SPARSE_M: tl.constexpr, MASKED: tl.constexpr,
               APPLY_MASK_MOD: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HAS_SCORE_MOD: tl.constexpr, USE_TMA: tl.constexpr,
               DQ_ATOMIC: tl.constexpr, DQ_TMA: tl.constexpr, INTERPRET: tl.constexpr):
    """Fold ``count`` query tiles (:func:`_dkdv_step`); ``tl.range`` compiled (software
    pipelined), a ``while`` loop under the interpreter (as :func:`.fwd._kv_loop`)."""
    if INTERPRET:
        i = 0
        while i < count:
            dk, dv = _dkdv_step(
                dk, dv, k, v, STRICT, i, lo, idx_ptr, desc_q, desc_do, desc_dq, q_base, do_base, dq_base,
                lam_base, dd_base, tma_b, h, q_row, q_len, sqm, sqd, sdom, sdod, sdqm, sdqd,
                offs_n, k_len, delta, win_left, win_right, b, qk_scale, softcap,
                grad_fn, WEIGHTS, SBUF,
                mask_fn, MBUF,
                BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, SPARSE, SPARSE_M,
                MASKED, APPLY_MASK_MOD, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_SCORE_MOD,
                USE_TMA, DQ_ATOMIC, DQ_TMA)
            i += 1
    else:
        for i in tl.range(0, count):
            dk, dv = _dkdv_step(
                dk, dv, k, v, STRICT, i, lo, idx_ptr, desc_q, desc_do, desc_dq, q_base, do_base, dq_base,
                lam_base, dd_base, tma_b, h, q_row, q_len, sqm, sqd, sdom, sdod, sdqm, sdqd,
                offs_n, k_len, delta, win_left, win_right, b, qk_scale, softcap,
                grad_fn, WEIGHTS, SBUF,
                mask_fn, MBUF,
                BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, SPARSE, SPARSE_M,
                MASKED, APPLY_MASK_MOD, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_SCORE_MOD,
                USE_TMA, DQ_ATOMIC, DQ_TMA)
    return dk, dv


@triton.jit
def _dq_step(dq, q, do, lam, dd, STRICT: tl.constexpr, i, lo, idx_ptr,
             desc_k, desc_v, k_base, v_base, tma_b, hk, k_row, k_len, skn, skd, svn, svd,
             offs_m, delta, win_left, win_right, b, h, qk_scale, softcap,
             grad_fn, WEIGHTS, SBUF,
             mask_fn, MBUF,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
             SPARSE: tl.constexpr, SPARSE_N: tl.constexpr, MASKED: tl.constexpr,
             APPLY_MASK_MOD: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
             HAS_SOFTCAP: tl.constexpr, HAS_SCORE_MOD: tl.constexpr, USE_TMA: tl.constexpr):
    """Fold key tile ``i`` of a run into ``dQ`` (tiles ``[BLOCK_M, BLOCK_N]``; addressing
    as :func:`.fwd._kv_step`)."""
    if SPARSE:
        blk = tl.load(idx_ptr + i // (SPARSE_N // BLOCK_N))
        start_n = blk * SPARSE_N + (i % (SPARSE_N // BLOCK_N)) * BLOCK_N
    else:
        start_n = lo + i * BLOCK_N
    start_n = tl.multiple_of(start_n, BLOCK_N)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load_tile(desc_k, k_base, tma_b, hk, k_row, start_n, k_len, skn, skd,
                   BLOCK_N, BLOCK_D, HEAD_DIM, MASKED, USE_TMA)
    qk = tl.dot(q, tl.trans(k))                             # [BLOCK_M, BLOCK_N]
    if MASKED:
        vis = _visible_2d(offs_m[:, None], offs_n[None, :], k_len, delta, win_left, win_right,
                          b, h, mask_fn, MBUF,
                          MASK_LEFT, MASK_RIGHT, APPLY_MASK_MOD)
    else:
        vis = 0
    p, dfac = _probs(qk, lam[:, None], qk_scale, softcap, b, h, offs_m[:, None], offs_n[None, :],
                     vis, grad_fn, WEIGHTS, SBUF,
                     MASKED, HAS_SOFTCAP, HAS_SCORE_MOD)
    v = _load_tile(desc_v, v_base, tma_b, hk, k_row, start_n, k_len, svn, svd,
                   BLOCK_N, BLOCK_DV, HEAD_DIM_V, MASKED, USE_TMA)
    dp = tl.dot(do, tl.trans(v))                            # [BLOCK_M, BLOCK_N]
    ds = _dscores(p, dp, dd[:, None], dfac, HAS_SOFTCAP, HAS_SCORE_MOD)
    if MASKED:
        ds = tl.where(vis, ds, 0.0)         # (dP of a hidden pair may be NaN)
    if MASKED and STRICT:
        # dS K strict where K holds a non-finite entry (keys hidden inside the tile, or
        # past k_len)
        dq = _strict_dot(ds.to(k.dtype), vis, k, dq)
    else:
        dq = tl.dot(ds.to(k.dtype), k, dq)                  # dQ += dS K  [BLOCK_M, BLOCK_D]
    return dq


@triton.jit
def _dq_loop(dq, q, do, lam, dd, STRICT: tl.constexpr, lo, count, idx_ptr,
             desc_k, desc_v, k_base, v_base, tma_b, hk, k_row, k_len, skn, skd, svn, svd,
             offs_m, delta, win_left, win_right, b, h, qk_scale, softcap,
             grad_fn, WEIGHTS, SBUF,
             mask_fn, MBUF,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
             SPARSE: tl.constexpr, SPARSE_N: tl.constexpr, MASKED: tl.constexpr,
             APPLY_MASK_MOD: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
             HAS_SOFTCAP: tl.constexpr, HAS_SCORE_MOD: tl.constexpr, USE_TMA: tl.constexpr,
             INTERPRET: tl.constexpr):
    """Fold ``count`` key tiles (:func:`_dq_step`) into ``dQ``."""
    if INTERPRET:
        i = 0
        while i < count:
            dq = _dq_step(dq, q, do, lam, dd, STRICT, i, lo, idx_ptr, desc_k, desc_v, k_base, v_base,
                          tma_b, hk, k_row, k_len, skn, skd, svn, svd, offs_m, delta, win_left,
                          win_right, b, h, qk_scale, softcap,
                          grad_fn, WEIGHTS, SBUF,
                          mask_fn, MBUF,
                          BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, SPARSE,
                          SPARSE_N, MASKED, APPLY_MASK_MOD, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP,
                          HAS_SCORE_MOD, USE_TMA)
            i += 1
    else:
        for i in tl.range(0, count):
            dq = _dq_step(dq, q, do, lam, dd, STRICT, i, lo, idx_ptr, desc_k, desc_v, k_base, v_base,
                          tma_b, hk, k_row, k_len, skn, skd, svn, svd, offs_m, delta, win_left,
                          win_right, b, h, qk_scale, softcap,
                          grad_fn, WEIGHTS, SBUF,
                          mask_fn, MBUF,
                          BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, SPARSE,
                          SPARSE_N, MASKED, APPLY_MASK_MOD, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP,
                          HAS_SCORE_MOD, USE_TMA)
    return dq


# --- kernels -----------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["N_ROWS", "ROW_STRIDE", "NUM_M"])
def _bwd_preprocess(O, DO, LSE, DLSE, DD, LAM, DQ_ACC,
                    sob, soh, som, sod, sdob, sdoh, sdom, sdod, slb, slh, sdlb, sdlh, sdlm,
                    sqab, sqah, sqam, sqad, N_ROWS, ROW_STRIDE, H, NUM_M, FLAG,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr,
                    ZERO_DQ: tl.constexpr, HAS_FLAG: tl.constexpr = False):
    """Per row: ``D = sum_d dO O - dlse`` and ``lambda = lse log2 e`` (``+inf`` where
    ``lse = -inf``), stored ``(B, H, N)`` fp32 with unit last stride and ``ROW_STRIDE``
    between heads (``N`` rounded up to 16 bytes, so that the Gluon kernel can load their
    tiles by TMA); with ``ZERO_DQ``, zero the rows of the fp32 dQ accumulator. Row-wise,
    so packed (varlen) rows need no sequence logic. With ``HAS_FLAG``, program 0 clears
    the non-finite flag that the Gluon path's kernels raise."""
    pid = tl.program_id(0)
    if HAS_FLAG:
        if pid == 0:
            tl.store(FLAG, 0)
    bh = pid // NUM_M
    b = bh // H
    h = bh % H
    offs_m = (pid % NUM_M) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < N_ROWS
    mask = row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    rows = offs_m.to(tl.int64)
    o = tl.load(O + b.to(tl.int64) * sob + h.to(tl.int64) * soh
                + rows[:, None] * som + offs_dv[None, :] * sod, mask=mask, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh
                 + rows[:, None] * sdom + offs_dv[None, :] * sdod, mask=mask, other=0.0)
    dd = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        # any strides: the gradient of lse.sum() is an expanded (stride 0) tensor
        dl = tl.load(DLSE + b.to(tl.int64) * sdlb + h.to(tl.int64) * sdlh + rows * sdlm,
                     mask=row_ok, other=0.0)
        dd = dd - dl.to(tl.float32)
    lse = tl.load(LSE + b.to(tl.int64) * slb + h.to(tl.int64) * slh + rows, mask=row_ok, other=0.0)
    lam = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    out = bh.to(tl.int64) * ROW_STRIDE + rows
    tl.store(DD + out, dd, mask=row_ok)
    tl.store(LAM + out, lam, mask=row_ok)
    if ZERO_DQ:
        offs_d = tl.arange(0, BLOCK_D)
        ptrs = (DQ_ACC + b.to(tl.int64) * sqab + h.to(tl.int64) * sqah
                + rows[:, None] * sqam + offs_d[None, :] * sqad)
        tl.store(ptrs, tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
                 mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit(do_not_specialize=["NUM_N", "HK", "GROUP", "SEQ_Q", "SEQ_K", "N_SEQ", "win_left",
                               "win_right", "bn_b", "bn_h", "bi_b", "bi_h", "bi_n"])
def _attn_bwd_dkdv(
    Q, K, V, DO, DK, DV, DQ_ACC, LAM, DD,
    desc_q, desc_k, desc_v, desc_do, desc_dq, SQ, SK, SV, SDO, SDK, SDV, SDQ, SL,
    NUM_N, HK, GROUP, SEQ_Q, SEQ_K, CU_Q, CU_K, N_SEQ,
    qk_scale, softcap, scale, win_left, win_right,
    TABLES, bn_b, bn_h, bi_b, bi_h, bi_n,
    grad_fn: tl.constexpr, WEIGHTS: tl.constexpr, SBUF,
    mask_fn: tl.constexpr, MBUF, FLAG,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPARSE_M: tl.constexpr, SPARSE_N: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SCORE_MOD: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr, FULL_NEEDS_MASK: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_TMA: tl.constexpr, DQ_ATOMIC: tl.constexpr,
    DQ_TMA: tl.constexpr, INTERPRET: tl.constexpr, Q_TAIL: tl.constexpr = False,
    CHECK: tl.constexpr = False, STRICT: tl.constexpr = False,
):
    # program -> (key tile, batch, kv head); key tiles of one head are adjacent (they read
    # the same Q / dO, which stay in L2); causal: the first key tiles are the heaviest.
    # Packed sequences: (slot, kv head), NUM_N slots per head (_varlen_slot)
    if STRICT:      # the strict recompute: only when the first pass raised the flag
        if tl.load(FLAG) == 0:
            return
    sqb, sqh, sqm, sqd = SQ[0], SQ[1], SQ[2], SQ[3]
    skb, skh, skn, skd = SK[0], SK[1], SK[2], SK[3]
    svb, svh, svn, svd = SV[0], SV[1], SV[2], SV[3]
    sdob, sdoh, sdom, sdod = SDO[0], SDO[1], SDO[2], SDO[3]
    sdkb, sdkh, sdkn, sdkd = SDK[0], SDK[1], SDK[2], SDK[3]
    sdvb, sdvh, sdvn, sdvd = SDV[0], SDV[1], SDV[2], SDV[3]
    sdqb, sdqh, sdqm, sdqd = SDQ[0], SDQ[1], SDQ[2], SDQ[3]
    slb, slh = SL[0], SL[1]
    PART_NUM, PART_IDX, FULL_NUM, FULL_IDX = TABLES[0], TABLES[1], TABLES[2], TABLES[3]
    pid = tl.program_id(0)
    bh = pid // NUM_N
    start_n = (pid % NUM_N) * BLOCK_N
    b = bh // HK
    hk = bh % HK
    if IS_VARLEN:
        hk = bh
        b, n_tile = _varlen_slot(CU_K, pid % NUM_N, N_SEQ, BLOCK_N)
        start_n = n_tile * BLOCK_N
    k_base = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    dk_base = DK + b.to(tl.int64) * sdkb + hk.to(tl.int64) * sdkh
    dv_base = DV + b.to(tl.int64) * sdvb + hk.to(tl.int64) * sdvh
    if IS_VARLEN:
        q_row = tl.load(CU_Q + b)
        q_len = tl.load(CU_Q + b + 1) - q_row
        k_row = tl.load(CU_K + b)
        k_len = tl.load(CU_K + b + 1) - k_row
        if start_n >= k_len:
            return
        k_base += k_row.to(tl.int64) * skn
        v_base += k_row.to(tl.int64) * svn
        dk_base += k_row.to(tl.int64) * sdkn
        dv_base += k_row.to(tl.int64) * sdvn
        tma_b = 0
    else:
        q_row = 0
        q_len = SEQ_Q
        k_row = 0
        k_len = SEQ_K
        tma_b = b
    delta = k_len - q_len
    offs_n = start_n + tl.arange(0, BLOCK_N)

    # -- K, V stay on chip; dK, dV accumulate in fp32 over the group's heads and query tiles
    k = _load_tile(desc_k, k_base, tma_b, hk, k_row, start_n, k_len, skn, skd,
                   BLOCK_N, BLOCK_D, HEAD_DIM, True, USE_TMA)
    v = _load_tile(desc_v, v_base, tma_b, hk, k_row, start_n, k_len, svn, svd,
                   BLOCK_N, BLOCK_DV, HEAD_DIM_V, True, USE_TMA)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    if not HAS_BLOCK_MASK:
        t_lo, t_a, t_c, t_hi = _q_tile_ranges(start_n, q_len, k_len, delta, win_left, win_right,
                                              BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, Q_TAIL)
    g = 0
    while g < GROUP:
        h = hk * GROUP + g
        q_base = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + q_row.to(tl.int64) * sqm
        do_base = DO + b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh + q_row.to(tl.int64) * sdom
        dq_base = DQ_ACC + b.to(tl.int64) * sdqb + h.to(tl.int64) * sdqh + q_row.to(tl.int64) * sdqm
        lam_base = LAM + b.to(tl.int64) * slb + h.to(tl.int64) * slh + q_row
        dd_base = DD + b.to(tl.int64) * slb + h.to(tl.int64) * slh + q_row
        if HAS_BLOCK_MASK:
            # the key block's column of the block mask: PARTIAL query blocks (mask_mod
            # evaluated), then FULL ones (no mask_mod)
            col = start_n // SPARSE_N
            n_off = b.to(tl.int64) * bn_b + h.to(tl.int64) * bn_h + col
            i_off = b.to(tl.int64) * bi_b + h.to(tl.int64) * bi_h + col.to(tl.int64) * bi_n
            R: tl.constexpr = SPARSE_M // BLOCK_M
            n_part = tl.load(PART_NUM + n_off)
            dk, dv = _dkdv_loop(
                dk, dv, k, v, STRICT, 0, n_part * R, PART_IDX + i_off,
                desc_q, desc_do, desc_dq, q_base, do_base, dq_base, lam_base, dd_base,
                tma_b, h, q_row, q_len, sqm, sqd, sdom, sdod, sdqm, sdqd,
                offs_n, k_len, delta, win_left, win_right, b, qk_scale, softcap,
                grad_fn, WEIGHTS, SBUF,
                mask_fn, MBUF,
                BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, True, SPARSE_M,
                True, True, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_SCORE_MOD, USE_TMA,
                DQ_ATOMIC, DQ_TMA, INTERPRET)
            n_full = tl.load(FULL_NUM + n_off)
            n_main = n_full
            if Q_TAIL:
                # a FULL block holding rows past q_len (the sorted list's last) reads the
                # next sequence's rows there: masked, below
                last = tl.load(FULL_IDX + i_off + tl.maximum(n_full - 1, 0))
                n_main = tl.where((n_full > 0) & ((last + 1) * SPARSE_M > q_len), n_full - 1, n_full)
            dk, dv = _dkdv_loop(
                dk, dv, k, v, STRICT, 0, n_main * R, FULL_IDX + i_off,
                desc_q, desc_do, desc_dq, q_base, do_base, dq_base, lam_base, dd_base,
                tma_b, h, q_row, q_len, sqm, sqd, sdom, sdod, sdqm, sdqd,
                offs_n, k_len, delta, win_left, win_right, b, qk_scale, softcap,
                grad_fn, WEIGHTS, SBUF,
                mask_fn, MBUF,
                BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, True, SPARSE_M,
                FULL_NEEDS_MASK, False, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_SCORE_MOD,
                USE_TMA, DQ_ATOMIC, DQ_TMA, INTERPRET)
            if Q_TAIL:
                dk, dv = _dkdv_loop(
                    dk, dv, k, v, STRICT, 0, (n_full - n_main) * R, FULL_IDX + i_off + n_main,
                    desc_q, desc_do, desc_dq, q_base, do_base, dq_base, lam_base, dd_base,
                    tma_b, h, q_row, q_len, sqm, sqd, sdom, sdod, sdqm, sdqd,
                    offs_n, k_len, delta, win_left, win_right, b, qk_scale, softcap,
                    grad_fn, WEIGHTS, SBUF,
                    mask_fn, MBUF,
                    BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, True, SPARSE_M,
                    True, False, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_SCORE_MOD,
                    USE_TMA, DQ_ATOMIC, DQ_TMA, INTERPRET)
        else:
            # unmasked interior first, then the masked edges (a fixed order: deterministic)
            dk, dv = _dkdv_loop(
                dk, dv, k, v, STRICT, t_a * BLOCK_M, t_c - t_a, PART_IDX,
                desc_q, desc_do, desc_dq, q_base, do_base, dq_base, lam_base, dd_base,
                tma_b, h, q_row, q_len, sqm, sqd, sdom, sdod, sdqm, sdqd,
                offs_n, k_len, delta, win_left, win_right, b, qk_scale, softcap,
                grad_fn, WEIGHTS, SBUF,
                mask_fn, MBUF,
                BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, False, SPARSE_M,
                False, False, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_SCORE_MOD, USE_TMA,
                DQ_ATOMIC, DQ_TMA, INTERPRET)
            dk, dv = _dkdv_loop(
                dk, dv, k, v, STRICT, t_lo * BLOCK_M, t_a - t_lo, PART_IDX,
                desc_q, desc_do, desc_dq, q_base, do_base, dq_base, lam_base, dd_base,
                tma_b, h, q_row, q_len, sqm, sqd, sdom, sdod, sdqm, sdqd,
                offs_n, k_len, delta, win_left, win_right, b, qk_scale, softcap,
                grad_fn, WEIGHTS, SBUF,
                mask_fn, MBUF,
                BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, False, SPARSE_M,
                True, False, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_SCORE_MOD, USE_TMA,
                DQ_ATOMIC, DQ_TMA, INTERPRET)
            if MASK_LEFT or Q_TAIL:
                dk, dv = _dkdv_loop(
                    dk, dv, k, v, STRICT, t_c * BLOCK_M, t_hi - t_c, PART_IDX,
                    desc_q, desc_do, desc_dq, q_base, do_base, dq_base, lam_base, dd_base,
                    tma_b, h, q_row, q_len, sqm, sqd, sdom, sdod, sdqm, sdqd,
                    offs_n, k_len, delta, win_left, win_right, b, qk_scale, softcap,
                    grad_fn, WEIGHTS, SBUF,
                    mask_fn, MBUF,
                    BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, False, SPARSE_M,
                    True, False, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_SCORE_MOD, USE_TMA,
                    DQ_ATOMIC, DQ_TMA, INTERPRET)
        g += 1

    # -- dK = scale * sum dS~^T Q, dV = sum P^T dO (rows past k_len are not written)
    offs_r = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask = offs_n[:, None] < k_len
    if BLOCK_D != HEAD_DIM:
        mask = mask & (offs_d[None, :] < HEAD_DIM)
    tl.store(dk_base + start_n.to(tl.int64) * sdkn + (offs_r[:, None] * sdkn + offs_d[None, :] * sdkd),
             (dk * scale).to(DK.dtype.element_ty), mask=mask)
    if CHECK:       # a non-finite dK raises the flag: the strict recompute follows
        tl.store(FLAG + tl.zeros([BLOCK_N, BLOCK_D], tl.int32), 1,
                 mask=mask & ~(tl.abs(dk) < float("inf")))
    offs_dv = tl.arange(0, BLOCK_DV)
    mask = offs_n[:, None] < k_len
    if BLOCK_DV != HEAD_DIM_V:
        mask = mask & (offs_dv[None, :] < HEAD_DIM_V)
    tl.store(dv_base + start_n.to(tl.int64) * sdvn + (offs_r[:, None] * sdvn + offs_dv[None, :] * sdvd),
             dv.to(DV.dtype.element_ty), mask=mask)
    if CHECK:
        tl.store(FLAG + tl.zeros([BLOCK_N, BLOCK_DV], tl.int32), 1,
                 mask=mask & ~(tl.abs(dv) < float("inf")))


@triton.jit(do_not_specialize=["NUM_M", "HQ", "GROUP", "SEQ_Q", "SEQ_K", "N_SEQ", "win_left",
                               "win_right", "bn_b", "bn_h", "bi_b", "bi_h", "bi_m"])
def _attn_bwd_dq(
    Q, K, V, DO, DQ, LAM, DD,
    desc_q, desc_k, desc_v, desc_do, SQ, SK, SV, SDO, SDQ, SL,
    NUM_M, HQ, GROUP, SEQ_Q, SEQ_K, CU_Q, CU_K, N_SEQ,
    qk_scale, softcap, scale, win_left, win_right,
    TABLES, bn_b, bn_h, bi_b, bi_h, bi_m,
    grad_fn: tl.constexpr, WEIGHTS: tl.constexpr, SBUF,
    mask_fn: tl.constexpr, MBUF, FLAG,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPARSE_M: tl.constexpr, SPARSE_N: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SCORE_MOD: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr, FULL_NEEDS_MASK: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_TMA: tl.constexpr, REVERSE_M: tl.constexpr,
    INTERPRET: tl.constexpr, CHECK: tl.constexpr = False, STRICT: tl.constexpr = False,
):
    # program -> (query tile, batch, head), as the forward (causal: heaviest tiles first);
    # packed sequences: (slot, head), NUM_M slots per head (_varlen_slot)
    if STRICT:      # the strict recompute: only when the first pass raised the flag
        if tl.load(FLAG) == 0:
            return
    sqb, sqh, sqm, sqd = SQ[0], SQ[1], SQ[2], SQ[3]
    skb, skh, skn, skd = SK[0], SK[1], SK[2], SK[3]
    svb, svh, svn, svd = SV[0], SV[1], SV[2], SV[3]
    sdob, sdoh, sdom, sdod = SDO[0], SDO[1], SDO[2], SDO[3]
    sdqb, sdqh, sdqm, sdqd = SDQ[0], SDQ[1], SDQ[2], SDQ[3]
    slb, slh = SL[0], SL[1]
    PART_NUM, PART_IDX, FULL_NUM, FULL_IDX = TABLES[0], TABLES[1], TABLES[2], TABLES[3]
    pid = tl.program_id(0)
    bh = pid // NUM_M
    mt = pid % NUM_M
    if REVERSE_M:
        mt = NUM_M - 1 - mt
    b = bh // HQ
    h = bh % HQ
    if IS_VARLEN:
        h = bh
        b, mt = _varlen_slot(CU_Q, mt, N_SEQ, BLOCK_M)
    hk = h // GROUP
    start_m = mt * BLOCK_M
    q_base = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    do_base = DO + b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh
    k_base = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    dq_base = DQ + b.to(tl.int64) * sdqb + h.to(tl.int64) * sdqh
    if IS_VARLEN:
        q_row = tl.load(CU_Q + b)
        q_len = tl.load(CU_Q + b + 1) - q_row
        k_row = tl.load(CU_K + b)
        k_len = tl.load(CU_K + b + 1) - k_row
        if start_m >= q_len:
            return
        q_base += q_row.to(tl.int64) * sqm
        do_base += q_row.to(tl.int64) * sdom
        k_base += k_row.to(tl.int64) * skn
        v_base += k_row.to(tl.int64) * svn
        dq_base += q_row.to(tl.int64) * sdqm
        tma_b = 0
    else:
        q_row = 0
        q_len = SEQ_Q
        k_row = 0
        k_len = SEQ_K
        tma_b = b
    delta = k_len - q_len
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_ok = offs_m < q_len
    lam = tl.load(LAM + b.to(tl.int64) * slb + h.to(tl.int64) * slh + q_row + offs_m,
                  mask=row_ok, other=float("inf"))
    dd = tl.load(DD + b.to(tl.int64) * slb + h.to(tl.int64) * slh + q_row + offs_m,
                 mask=row_ok, other=0.0)
    q = _load_tile(desc_q, q_base, tma_b, h, q_row, start_m, q_len, sqm, sqd,
                   BLOCK_M, BLOCK_D, HEAD_DIM, True, USE_TMA)
    do = _load_tile(desc_do, do_base, tma_b, h, q_row, start_m, q_len, sdom, sdod,
                    BLOCK_M, BLOCK_DV, HEAD_DIM_V, True, USE_TMA)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    if HAS_BLOCK_MASK:
        R: tl.constexpr = SPARSE_N // BLOCK_N
        row = start_m // SPARSE_M
        n_off = b.to(tl.int64) * bn_b + h.to(tl.int64) * bn_h + row
        i_off = b.to(tl.int64) * bi_b + h.to(tl.int64) * bi_h + row.to(tl.int64) * bi_m
        n_part = tl.load(PART_NUM + n_off)
        dq = _dq_loop(dq, q, do, lam, dd, STRICT, 0, n_part * R, PART_IDX + i_off,
                      desc_k, desc_v, k_base, v_base, tma_b, hk, k_row, k_len, skn, skd, svn, svd,
                      offs_m, delta, win_left, win_right, b, h, qk_scale, softcap,
                      grad_fn, WEIGHTS, SBUF,
                      mask_fn, MBUF,
                      BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, True, SPARSE_N,
                      True, True, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_SCORE_MOD, USE_TMA,
                      INTERPRET)
        n_full = tl.load(FULL_NUM + n_off)
        dq = _dq_loop(dq, q, do, lam, dd, STRICT, 0, n_full * R, FULL_IDX + i_off,
                      desc_k, desc_v, k_base, v_base, tma_b, hk, k_row, k_len, skn, skd, svn, svd,
                      offs_m, delta, win_left, win_right, b, h, qk_scale, softcap,
                      grad_fn, WEIGHTS, SBUF,
                      mask_fn, MBUF,
                      BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, True, SPARSE_N,
                      FULL_NEEDS_MASK, False, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_SCORE_MOD,
                      USE_TMA, INTERPRET)
    else:
        t_lo, t_a, t_c, t_hi = _tile_ranges(start_m, q_len, k_len, delta, win_left, win_right,
                                            BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
        dq = _dq_loop(dq, q, do, lam, dd, STRICT, t_a * BLOCK_N, t_c - t_a, PART_IDX,
                      desc_k, desc_v, k_base, v_base, tma_b, hk, k_row, k_len, skn, skd, svn, svd,
                      offs_m, delta, win_left, win_right, b, h, qk_scale, softcap,
                      grad_fn, WEIGHTS, SBUF,
                      mask_fn, MBUF,
                      BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, False, SPARSE_N,
                      False, False, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_SCORE_MOD, USE_TMA,
                      INTERPRET)
        if MASK_LEFT:
            dq = _dq_loop(dq, q, do, lam, dd, STRICT, t_lo * BLOCK_N, t_a - t_lo, PART_IDX,
                          desc_k, desc_v, k_base, v_base, tma_b, hk, k_row, k_len, skn, skd, svn,
                          svd, offs_m, delta, win_left, win_right, b, h, qk_scale, softcap,
                          grad_fn, WEIGHTS, SBUF,
                          mask_fn, MBUF,
                          BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, False,
                          SPARSE_N, True, False, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP,
                          HAS_SCORE_MOD, USE_TMA, INTERPRET)
        dq = _dq_loop(dq, q, do, lam, dd, STRICT, t_c * BLOCK_N, t_hi - t_c, PART_IDX,
                      desc_k, desc_v, k_base, v_base, tma_b, hk, k_row, k_len, skn, skd, svn, svd,
                      offs_m, delta, win_left, win_right, b, h, qk_scale, softcap,
                      grad_fn, WEIGHTS, SBUF,
                      mask_fn, MBUF,
                      BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, False, SPARSE_N,
                      True, False, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_SCORE_MOD, USE_TMA,
                      INTERPRET)

    offs_d = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None]
    if BLOCK_D != HEAD_DIM:
        mask = mask & (offs_d[None, :] < HEAD_DIM)
    tl.store(dq_base + start_m.to(tl.int64) * sdqm
             + (tl.arange(0, BLOCK_M)[:, None] * sdqm + offs_d[None, :] * sdqd),
             (dq * scale).to(DQ.dtype.element_ty), mask=mask)
    if CHECK:       # a non-finite dQ raises the flag: the strict recompute follows
        tl.store(FLAG + tl.zeros([BLOCK_M, BLOCK_D], tl.int32), 1,
                 mask=mask & ~(tl.abs(dq) < float("inf")))


@triton.jit
def _dq_convert(ACC, DQ, scale, n_elements, FLAG, LAM, N_ROWS, ROW_STRIDE,
                BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr = 1, HAS_FLAG: tl.constexpr = False,
                EMPTY_ROWS: tl.constexpr = False):
    """``dq = scale * acc`` in dq's dtype (both contiguous, same shape); with ``HAS_FLAG``,
    ``FLAG[0] = 1`` where ``acc`` is not finite, and with ``EMPTY_ROWS`` also where the
    row's ``lambda`` (``LAM``: the preprocess's, ``N_ROWS`` rows of ``ROW_STRIDE`` per
    head) is ``+inf``: a row without a visible weight (plain stores: no reduction)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_elements
    acc = tl.load(ACC + offs, mask=m, other=0.0)
    tl.store(DQ + offs, (acc * scale).to(DQ.dtype.element_ty), mask=m)
    if HAS_FLAG:
        bad = ~(tl.abs(acc) < float("inf"))
        if EMPTY_ROWS:
            row = offs // HEAD_DIM
            lam = tl.load(LAM + (row // N_ROWS) * ROW_STRIDE + row % N_ROWS, mask=m, other=0.0)
            bad = bad | (lam == float("inf"))
        tl.store(FLAG + offs * 0, 1, mask=m & bad)


# --- launcher ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class BwdConfig:
    """Tiles and launch options of the backward kernels.

    ``block_m`` x ``block_n``, ``num_warps``, ``num_stages``: the dK/dV kernel (query tiles
    of ``block_m`` rows stream past a resident key tile of ``block_n``); ``dq_*``: the dQ
    kernel (key tiles of ``dq_block_n`` stream past a resident query tile of
    ``dq_block_m``). ``use_tma``: TMA descriptors for Q/K/V/dO loads and the dQ reduce-add.
    ``atomic_dq``: whether the default (non-deterministic) mode adds dQ with atomics from
    the dK/dV kernel (else it runs the dQ kernel, as ``deterministic=True`` always does).
    """
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    dq_block_m: int = 64
    dq_block_n: int = 64
    dq_warps: int = 4
    dq_stages: int = 2
    use_tma: bool = False
    atomic_dq: bool = True

    def __str__(self):
        return (f"dkdv BM{self.block_m}-BN{self.block_n}-w{self.num_warps}-s{self.num_stages} "
                f"dq BM{self.dq_block_m}-BN{self.dq_block_n}-w{self.dq_warps}-s{self.dq_stages}"
                f"{' tma' if self.use_tma else ''}{' atomic-dq' if self.atomic_dq else ''}")


#: Hopper configurations per (padded head dim, features, right-bounded), ``features`` =
#: softcap, score_mod or mask_mod (their extra per-element state costs registers),
#: right-bounded = causal or a window's right edge:
#: (dK/dV block_m, block_n, warps, stages, dQ block_m, block_n, warps, stages, atomic dQ).
#: Tiles chosen with the real compiler for sm_90 (``tests/test_attention_backward_compile.py``):
#: the dK/dV kernel holds two ``[block_n, D]`` fp32 accumulators, so it sits at the
#: 255-register limit; every deterministic variant is spill-free, the atomic-dQ variant of
#: head dim 128 spills 32-40 bytes, those with features or head dim 256 would spill more, so
#: they use the dQ kernel. Atomic dQ only on right-bounded rows: in the H200 run of
#: 2026-11-29 (``benchmarks/logs/2026-11-29_h200_attention_bwd_run1.log``, bf16, H=16,
#: 16K tokens) the dQ kernel was as fast or faster on every full row (d128 N16K 382 vs
#: 355 TFLOP/s, N4K 370 vs 346) and the atomic dQ faster on causal rows (d128 N16K 388 vs
#: 373, N1K 170 vs 147; d64 N1K 88 vs 69; d64 N4K/16K within 3%).
#: ``benchmarks/attention.py --tune-bwd`` times the alternatives.
HOPPER_BWD_CONFIGS = {
    (32, False, False): (64, 128, 8, 2, 128, 64, 8, 2, False),
    (32, False, True): (64, 128, 8, 2, 128, 64, 8, 2, True),
    (64, False, False): (64, 128, 8, 2, 128, 64, 8, 2, False),
    (64, False, True): (64, 128, 8, 2, 128, 64, 8, 2, True),
    (128, False, False): (64, 128, 8, 2, 128, 64, 8, 2, False),
    (128, False, True): (64, 128, 8, 2, 128, 64, 8, 2, True),
    (256, False, False): (32, 64, 8, 2, 64, 32, 8, 2, False),
    (256, False, True): (32, 64, 8, 2, 64, 32, 8, 2, False),
    (32, True, False): (64, 128, 8, 2, 128, 64, 8, 2, False),
    (32, True, True): (64, 128, 8, 2, 128, 64, 8, 2, False),
    (64, True, False): (64, 128, 8, 2, 128, 64, 8, 2, False),
    (64, True, True): (64, 128, 8, 2, 128, 64, 8, 2, False),
    (128, True, False): (64, 64, 8, 2, 128, 64, 8, 2, False),
    (128, True, True): (64, 64, 8, 2, 128, 64, 8, 2, False),
    (256, True, False): (16, 64, 8, 2, 64, 32, 8, 2, False),
    (256, True, True): (16, 64, 8, 2, 64, 32, 8, 2, False),
}
#: the fallback when TMA is asked for but the strides do not allow it (e.g. rows not
#: 16-byte aligned): pointer loads keep their addresses in registers, so smaller tiles and
#: the dQ kernel, spill-free on sm_90 with every feature (head dim 256: mma.sync-sized
#: tiles); keyed like :data:`HOPPER_BWD_CONFIGS`, without the atomic flag
POINTER_BWD_CONFIGS = {
    (32, False): (32, 64, 8, 2, 64, 64, 8, 2), (32, True): (32, 64, 8, 2, 64, 64, 8, 2),
    (64, False): (32, 64, 8, 2, 64, 64, 8, 2), (64, True): (32, 64, 8, 2, 64, 64, 8, 2),
    (128, False): (32, 64, 8, 2, 128, 32, 8, 2), (128, True): (16, 64, 8, 2, 128, 16, 8, 2),
    (256, False): (16, 32, 8, 2, 32, 16, 8, 2), (256, True): (16, 32, 8, 2, 32, 16, 8, 2),
}


def default_config(q, head_dim: int, head_dim_v: int, features: bool = False,
                   causal: bool = False) -> BwdConfig:
    """The backward launch configuration for these inputs (heuristic; no autotuning).

    ``features``: softcap, score_mod or mask_mod present; ``causal``: rows have a right
    bound (causal or a window's right edge). On sm_90+ :data:`HOPPER_BWD_CONFIGS`, or
    :data:`POINTER_BWD_CONFIGS` while the policy's ``tma`` is off (:mod:`.dispatch`).
    """
    if q.device.type != "cuda" or _interpreting():
        return BwdConfig(16, 16, 4, 1, 16, 16, 4, 1, use_tma=False, atomic_dq=True)
    bd = min(max(max(block_dims(head_dim, head_dim_v)), 32), 256)
    bm, bn, w, s, qm, qn, qw, qs, atomic = HOPPER_BWD_CONFIGS[(bd, bool(features), bool(causal))]
    major = launcher.capability(q.device)[0]
    if major < 9:                          # Ampere and older: no TMA, pointer atomics
        return BwdConfig(min(bm, 64), min(bn, 64), w, 2, min(qm, 64), min(qn, 64), qw, 2,
                         use_tma=False, atomic_dq=False)
    if not dispatch.current().tma or TensorDescriptor is None:
        # the policy's pointer loads: the pointer configuration (as where strides refuse TMA)
        return BwdConfig(*POINTER_BWD_CONFIGS[(bd, bool(features))], use_tma=False,
                         atomic_dq=False)
    return BwdConfig(bm, bn, w, s, qm, qn, qw, qs, use_tma=True, atomic_dq=atomic)


#: allocator of the outputs (:func:`flashfold.kernels.plans.new`: ``torch.empty``, noted
#: while a plan is recorded); the GPU check in ``benchmarks/attention.py`` swaps in a
#: NaN-filling one so that any element the kernels fail to write is caught (the plan cache
#: is bypassed while it is swapped)
_alloc = plans.new


def strict_config(cfg: BwdConfig) -> BwdConfig:
    """The configuration of the strict recompute (:func:`prepare_backward`), deterministic:
    the strict products of the masked tiles hold a count accumulator and the sanitized
    operand next to dK, dV, so smaller tiles than ``cfg``'s: dK/dV 16 x 64 (64 key rows:
    the least that keeps wgmma), one stage; dQ 64 x 16, two stages (one stage spilled
    24-208 bytes at head_dim 256 with features); 8 warps each. sm_90 compile (Triton 3.6):
    spill-free at head_dim 128 with TMA and with pointers on causal rows; the dK/dV kernel
    still spills at head_dim 256 with features (336 bytes) and at head_dim 128 with
    pointers and features (48 bytes), where the first pass's own state (block mask,
    window, softcap, score_mod) already fills the 255 registers at these tiles; 64 x 64
    dK/dV tiles spilled 64-432 bytes."""
    return replace(cfg, block_m=min(cfg.block_m, 16), block_n=min(cfg.block_n, 64),
                   num_warps=STRICT_WARPS[0], num_stages=1, dq_block_m=min(cfg.dq_block_m, 64),
                   dq_block_n=min(cfg.dq_block_n, 16), dq_warps=STRICT_WARPS[1], dq_stages=2,
                   atomic_dq=False)


#: warps of the strict recompute's dK/dV and dQ kernels (:func:`strict_config`)
STRICT_WARPS = (8, 8)


def attention_backward(do, q, k, v, o, lse, *, scale: float, dlse=None,
                       softcap: float | None = None, left: int | None = None,
                       right: int | None = None, score_mod: TracedMod | None = None,
                       block_mask: BlockMask | None = None, cu_seqlens_q=None, cu_seqlens_k=None,
                       max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                       full_needs_mask: bool = True, deterministic: bool = False,
                       atomic_dq: bool | None = None, config: BwdConfig | None = None):
    """Launch the backward kernels; returns ``(dq, dk, dv)``.

    Arguments as :func:`.fwd.attention_forward`, plus ``do`` (the gradient of ``o``,
    any strides), ``o`` and ``lse`` (the forward's outputs) and ``dlse`` (the gradient of
    ``lse`` or None). ``deterministic=True`` never uses atomics (bitwise reproducible);
    otherwise ``atomic_dq`` picks the atomic dQ path (default: the configuration's choice,
    while the policy's ``atomic_dq`` is on, :mod:`.dispatch`).
    ``block_mask`` must have block sizes that the tiles divide (the launcher shrinks the
    tiles to fit).

    A call replays the launches planned for the same signature (:data:`_CACHE`, see
    :mod:`flashfold.kernels.plans`; a score_mod or block mask by identity, its tables as
    inputs of the plan, as in the forward): its host code
    (checks, dispatch, configuration, allocation, TMA descriptors) cost more than the
    kernels at N = 1K causal (H200: ~0.5-0.85 ms of host time per eager backward against
    0.54 ms on the GPU; ``docs/notes/host_time.md``, "Attention").
    """
    options = dict(scale=scale, dlse=dlse, softcap=softcap, left=left, right=right,
                   cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                   full_needs_mask=full_needs_mask, deterministic=deterministic,
                   atomic_dq=atomic_dq, config=config)
    inputs = (do, q, k, v, o, lse, dlse, cu_seqlens_q, cu_seqlens_k)
    # the mods' tables (and the block mask's per-key-block lists) are inputs of the plan
    # too; the mods themselves are held by identity
    tables = plan_tables(score_mod, block_mask, q.device)
    if block_mask is not None:
        tables += column_lists(block_mask)
    policy = dispatch.current()
    # what _plan reads: the tensors' signatures, the options, the mods, the policy
    key = (plans.signatures(inputs + tables), scale, softcap, left,
           right, max_seqlen_q, max_seqlen_k, full_needs_mask, deterministic, atomic_dq,
           config, id(score_mod), id(block_mask), policy)
    dq, dk, dv, launches, memos = _CACHE.planned(key, (score_mod, block_mask), inputs + tables,
                                                 _plan, *inputs[:6], score_mod=score_mod,
                                                 block_mask=block_mask, policy=policy,
                                                 **options)
    for (kernel, grid, args, kwargs), memo in zip(launches, memos):
        launcher.launch(kernel, grid, args, kwargs, memo)
    return dq, dk, dv


def _plan(do, q, k, v, o, lse, **options):
    """:func:`prepare_backward`, and a launcher memo per launch (shared by the replays of
    the plan: :func:`flashfold.kernels.launcher.launch`)."""
    dq, dk, dv, launches = prepare_backward(do, q, k, v, o, lse, **options)
    return dq, dk, dv, launches, tuple([None] for _ in launches)


def mask_tiles(q, k, v, do, *, softcap=None, left=None, right=None, score_mod=None,
               mask_mod=None, cu_seqlens_q=None, cu_seqlens_k=None,
               deterministic=False) -> tuple[int, int]:
    """The tiles ``(block_m, block_n)`` of the block table that the backward builds for a
    callable ``mask_mod``: 128 x 128 where the Gluon kernel will walk it
    (:func:`.dispatch.backward_gluon`), else tiles that the Triton kernels' configuration
    divides (the larger of its dK/dV and dQ tiles)."""
    square = (2 * gluon_bwd.BLOCK_M, gluon_bwd.BLOCK_N)
    if dispatch.backward_gluon(q, k, v, do, softcap=softcap, left=left, right=right,
                               score_mod=score_mod, mask_mod=mask_mod, mask_block=square,
                               cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                               deterministic=deterministic):
        return square
    features = softcap is not None or score_mod is not None or mask_mod is not None
    cfg = default_config(q, q.shape[3], v.shape[3], features=features, causal=right is not None)
    return max(cfg.block_m, cfg.dq_block_m), max(cfg.block_n, cfg.dq_block_n)


def _convert_launch(dq_acc, dq, scale, flag=None, lam=None, stat_stride=0):
    """The launch of ``_dq_convert``: ``dq = scale * dq_acc`` (the atomic modes' last step;
    ``flag``: raised where ``dq_acc`` is not finite, or with ``lam`` where a row has
    ``lambda = +inf``)."""
    n = dq.numel()
    B, H, NQ, D = dq.shape
    kw = dict(BLOCK=1024, HEAD_DIM=D, HAS_FLAG=flag is not None, EMPTY_ROWS=lam is not None,
              num_warps=4)
    return (_dq_convert, (triton.cdiv(n, 1024),),
            [dq_acc, dq, float(scale), n, flag, lam, NQ, stat_stride], kw)


def prepare_backward(do, q, k, v, o, lse, *, scale, dlse=None, softcap=None, left=None,
                     right=None, score_mod=None, block_mask=None, cu_seqlens_q=None,
                     cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                     full_needs_mask=True, deterministic=False, atomic_dq=None, config=None,
                     interpret=None, policy=None):
    """Allocate the gradients and build the launches: ``(dq, dk, dv, [(kernel, grid, args,
    kwargs), ...])`` in launch order (tools compile them ahead of time). ``policy``: the
    switches in force (default :func:`.dispatch.current`)."""
    policy = policy or dispatch.current()
    B, HQ, NQ, D = q.shape
    HK, NK, DV = k.shape[1], k.shape[2], v.shape[3]
    dev = q.device
    varlen = cu_seqlens_q is not None
    n_seq = cu_seqlens_q.shape[0] - 1 if varlen else B
    # (packed rows of unknown lengths, None: the packed lengths bound every sequence's)
    seq_q = max_seqlen_q if varlen and max_seqlen_q is not None else NQ
    seq_k = max_seqlen_k if varlen and max_seqlen_k is not None else NK
    interp = _interpreting() if interpret is None else interpret
    dk = _alloc((B, HK, NK, D), dtype=q.dtype, device=dev)
    dv = _alloc((B, HK, NK, DV), dtype=q.dtype, device=dev)
    if B == 0 or HQ == 0 or NQ == 0 or NK == 0 or n_seq == 0:
        dq = torch.zeros((B, HQ, NQ, D), dtype=q.dtype, device=dev)
        return dq, dk.zero_(), dv.zero_(), []
    BD, BDV = block_dims(D, DV)
    features = softcap is not None or score_mod is not None or block_mask is not None
    cfg = config or default_config(q, D, DV, features=features, causal=right is not None)
    use_tma = cfg.use_tma and tma_ok(q, k, v)
    if cfg.use_tma and not use_tma:
        # TMA asked for but the strides do not allow it: the pointer configuration
        bm, bn, w, st, qm, qn, qw, qs = POINTER_BWD_CONFIGS[(min(max(BD, BDV, 32), 256), features)]
        cfg = BwdConfig(bm, bn, w, st, qm, qn, qw, qs, use_tma=False, atomic_dq=False)
    if block_mask is not None:
        sm, sn = block_mask.BLOCK_SIZE
        cfg = replace(cfg, block_m=min(cfg.block_m, sm), block_n=min(cfg.block_n, sn),
                      dq_block_m=min(cfg.dq_block_m, sm), dq_block_n=min(cfg.dq_block_n, sn))
    asked_atomic = atomic_dq                   # (None: the configuration's choice, below)
    if atomic_dq is None:
        atomic_dq = policy.atomic_dq and cfg.atomic_dq
    atomic = bool(atomic_dq) and not deterministic
    if use_tma and not tma_ok(do):
        do = do.contiguous()        # documented: e.g. the expanded (stride 0) gradient of .sum()
    use_gluon = dispatch.backward_gluon(
        q, k, v, do, softcap=softcap, left=left, right=right, score_mod=score_mod,
        mask_mod=block_mask.column_mod if block_mask is not None else None,
        mask_block=block_mask.BLOCK_SIZE if block_mask is not None else None,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, deterministic=deterministic,
        config=config, atomic_dq=asked_atomic, interpret=interp, policy=policy)
    atomic = atomic or use_gluon
    # calls that can hide keys inside the tiles they load (causal, window, mask, varlen:
    # rule 4 of the attention API's docstring) raise a flag when an output is not finite
    # (a product of a hidden pair's zero and a non-finite input, or a true non-finite
    # gradient); the strict kernels, guarded by the flag, then recompute dq, dk, dv. The
    # Triton kernels select P and dS to 0 at hidden pairs and check dq, dk, dv in their
    # epilogues. The Gluon kernel is unchanged (its step loop and registers are tuned):
    # in its scope (every row sees a key) a non-finite q, dO, dlse, lse or o of a row
    # makes that row's dq non-finite, and a non-finite k or v of a key makes dq
    # non-finite in every row of the tiles that load it (visible: through dS; hidden:
    # the pair's zero times k, or P = 0 times a NaN dP), except a row whose visible
    # scores are all -inf (lse = -inf). Every leak (a hidden pair's zero times a
    # non-finite input) so comes with a non-finite dq row, and the conversion of the dQ
    # accumulator flags a non-finite dq or a row with lse = -inf.
    # (a score_mod's hidden keys too in the Gluon kernel, whose dQ meets their k)
    hides = policy.strict_nonfinite and (
        left is not None or right is not None or block_mask is not None or varlen
        or (use_gluon and score_mod is not None))
    flag = plans.new((1,), dtype=torch.int32, device=dev) if hides else None
    dq = _alloc((B, HQ, NQ, D), dtype=q.dtype, device=dev)
    dq_acc = plans.new((B, HQ, NQ, D), dtype=torch.float32, device=dev) if atomic else dq
    # rows of D and lambda 16-byte aligned (TMA tiles in gluon_bwd), read through views
    stat_stride = -(-NQ // 4) * 4
    dd = plans.new((B, HQ, stat_stride), dtype=torch.float32, device=dev)[..., :NQ]
    lam = plans.new((B, HQ, stat_stride), dtype=torch.float32, device=dev)[..., :NQ]
    dq_tma = atomic and use_tma and not interp

    # scale folding as in the forward
    has_softcap = softcap is not None
    has_mod = score_mod is not None
    qk_scale = scale / softcap if has_softcap else scale
    weights = tile_step_functions(ATTENTION2, scale="score").tile_weights
    sargs = score_mod.buffer_args(dev) if has_mod else ()
    grad_fn = score_grad_fn(score_mod) if has_mod else None
    if block_mask is not None:
        bmk = block_mask
        Bm, Hm = bmk.state.shape[0], bmk.state.shape[1]
        nM, nN = bmk.state.shape[2], bmk.state.shape[3]
        rows = [bmk.partial_num, bmk.partial_idx, bmk.full_num, bmk.full_idx]
        row_strides = [Hm * nM if Bm > 1 else 0, nM if Hm > 1 else 0,
                       Hm * nM * nN if Bm > 1 else 0, nM * nN if Hm > 1 else 0, nN]
        cols = list(column_lists(bmk))
        col_strides = [Hm * nN if Bm > 1 else 0, nN if Hm > 1 else 0,
                       Hm * nN * nM if Bm > 1 else 0, nN * nM if Hm > 1 else 0, nM]
        sparse = bmk.BLOCK_SIZE
        # the mask as the walks read it: dK/dV walk a key tile's queries, dQ a query
        # tile's keys (BlockMask.column_mod / row_mod)
        by_cols = (bmk.column_mod.triton_fn(), bmk.column_mod.buffer_args(dev))
        by_rows = (bmk.row_mod.triton_fn(), bmk.row_mod.buffer_args(dev))
    else:
        rows = cols = [None, None, None, None]
        row_strides = col_strides = [0, 0, 0, 0, 0]
        sparse = None
        full_needs_mask = False
        by_cols = by_rows = (None, ())
    def rows_of(t):    # (batch, head, row, dim) strides; packed sequences: batch stride 0
        return (0 if varlen else t.stride(0), *t.stride()[1:])
    common_kw = dict(
        HEAD_DIM=D, HEAD_DIM_V=DV, BLOCK_D=BD, BLOCK_DV=BDV,
        MASK_LEFT=left is not None, MASK_RIGHT=right is not None, HAS_SOFTCAP=has_softcap,
        HAS_SCORE_MOD=has_mod, HAS_BLOCK_MASK=block_mask is not None,
        FULL_NEEDS_MASK=full_needs_mask, IS_VARLEN=varlen, USE_TMA=use_tma, INTERPRET=interp)
    win = [int(left) if left is not None else 0, int(right) if right is not None else 0]
    strides_in = [rows_of(q), rows_of(k), rows_of(v), rows_of(do)]
    launches = []

    # 1. preprocess: D, lambda (and zero the dQ accumulator)
    pm = 64
    num_pm = -(-NQ // pm)
    launches.append((_bwd_preprocess, (num_pm * B * HQ,), [
        o, do, lse, dlse, dd, lam, dq_acc,
        *o.stride(), *do.stride(), lse.stride(0), lse.stride(1),
        *(dlse.stride() if dlse is not None else (0, 0, 0)),
        *dq_acc.stride(), NQ, stat_stride, HQ, num_pm, flag,
    ], dict(HEAD_DIM=D, HEAD_DIM_V=DV, BLOCK_D=BD, BLOCK_DV=BDV, BLOCK_M=pm,
            HAS_DLSE=dlse is not None, ZERO_DQ=atomic, HAS_FLAG=flag is not None,
            num_warps=4)))
    lam_strides = (0 if varlen else lam.stride(0), lam.stride(1))

    def triton_pass(cfg, atomic, dq_tma, check, strict):
        """The Triton kernels' launches: dK/dV (with the atomic dQ, or then the dQ kernel);
        ``check``: raise ``flag`` where an output is not finite; ``strict``: the guarded
        strict recompute."""
        launches = []
        acc = dq_acc if atomic else dq
        bm, bn = cfg.block_m, cfg.block_n
        if use_tma:
            dq_desc = _desc(acc, bm, BD) if dq_tma else acc
            descs = [_desc(q, bm, BD), _desc(k, bn, BD), _desc(v, bn, BDV), _desc(do, bm, BDV), dq_desc]
        else:
            descs = [q, k, v, do, acc]
        # packed sequences: slots per head (_varlen_slot), no grid padded to the longest
        num_n = NK // bn + n_seq if varlen else -(-seq_k // bn)
        # the strict recompute holds its count products in nearly all of its registers:
        # the column form's per-key entries, live across its walk, spill there (sm_90,
        # Triton 3.6: 88 / 392 bytes where the row form's loads per step spill 16 / 256,
        # tests/test_attention_backward_compile.py), so it reads the row form
        by_walk = by_rows if strict else by_cols
        launches.append((_attn_bwd_dkdv, (num_n * (1 if varlen else n_seq) * HK,), [
            q, k, v, do, dk, dv, acc, lam, dd, *descs, *strides_in,
            rows_of(dk), rows_of(dv), rows_of(acc), lam_strides,
            num_n, HK, HQ // HK, seq_q, seq_k, cu_seqlens_q, cu_seqlens_k, n_seq,
            qk_scale, float(softcap) if has_softcap else 1.0, float(scale), *win,
            tuple(cols), *col_strides,
            grad_fn, weights, sargs, *by_walk, flag,
        ], dict(common_kw, BLOCK_M=bm, BLOCK_N=bn,
                SPARSE_M=sparse[0] if sparse else bm, SPARSE_N=sparse[1] if sparse else bn,
                DQ_ATOMIC=atomic, DQ_TMA=dq_tma, Q_TAIL=varlen and use_tma,
                CHECK=check, STRICT=strict, num_warps=cfg.num_warps, num_stages=cfg.num_stages)))

        # 3. dQ: the deterministic kernel, or the conversion of the atomic accumulator
        if atomic:
            launches.append(_convert_launch(acc, dq, scale, flag if check else None))
        else:
            qm, qn = cfg.dq_block_m, cfg.dq_block_n
            if use_tma:
                descs = [_desc(q, qm, BD), _desc(k, qn, BD), _desc(v, qn, BDV), _desc(do, qm, BDV)]
            else:
                descs = [q, k, v, do]
            num_m = NQ // qm + n_seq if varlen else -(-seq_q // qm)
            launches.append((_attn_bwd_dq, (num_m * (1 if varlen else n_seq) * HQ,), [
                q, k, v, do, dq, lam, dd, *descs, *strides_in, rows_of(dq), lam_strides,
                num_m, HQ, HQ // HK, seq_q, seq_k, cu_seqlens_q, cu_seqlens_k, n_seq,
                qk_scale, float(softcap) if has_softcap else 1.0, float(scale), *win,
                tuple(rows), *row_strides,
                grad_fn, weights, sargs, *by_rows, flag,
            ], dict(common_kw, BLOCK_M=qm, BLOCK_N=qn,
                    SPARSE_M=sparse[0] if sparse else qm, SPARSE_N=sparse[1] if sparse else qn,
                    REVERSE_M=right is not None, CHECK=check, STRICT=strict,
                    num_warps=cfg.dq_warps, num_stages=cfg.dq_stages)))
        return launches

    # 2. dK, dV (and the atomic dQ)
    if use_gluon:
        lam_g, dd_g = lam, dd
        if varlen:      # the statistics apart per sequence (TMA alignment), copied on the GPU
            lam_g, dd_g, copy = gluon_bwd.stats_rows_launch(lam, dd, cu_seqlens_q)
            launches.append(copy)
        launches.append(gluon_bwd.gluon_attention_bwd(q, k, v, do, lam_g, dd_g, dq_acc, dk, dv,
                                                      causal=False, left=left, right=right,
                                                      softcap=softcap, scale=scale,
                                                      deterministic=deterministic,
                                                      cu_seqlens_q=cu_seqlens_q,
                                                      cu_seqlens_k=cu_seqlens_k,
                                                      score_mod=score_mod,
                                                      block_mask=block_mask, launch=False))
        # (the Gluon kernel itself is unchanged: see the flag's rule above)
        launches.append(_convert_launch(dq_acc, dq, scale, flag,
                                        lam if flag is not None else None, stat_stride))
    else:
        launches += triton_pass(cfg, atomic, dq_tma, check=flag is not None, strict=False)
    if flag is not None:
        # the strict recompute, guarded by the flag: the deterministic kernels (dQ written,
        # not added) on tiles small enough for the strict products' registers
        launches += triton_pass(strict_config(cfg), False, False,
                                check=False, strict=True)
    return dq, dk, dv, launches


__all__ = ["attention_backward", "prepare_backward", "BwdConfig", "default_config",
           "HOPPER_BWD_CONFIGS", "POINTER_BWD_CONFIGS", "score_grad_fn", "column_lists"]


# --- plan cache -------------------------------------------------------------------------

#: entries the plan cache holds; when full it is dropped wholesale
PLAN_CACHE_SIZE = 256
#: :func:`attention_backward`'s plans, bypassed while any global that :func:`_plan` reads
#: here, in the Gluon modules or in the dispatch table (heuristics, the allocator, the
#: Gluon scopes, which tests monkeypatch) differs from what it was at import; the
#: policy is part of each plan's key
_CACHE = plans.PlanCache("attention backward", globals(), (_plan,),
                         modules=(gluon_bwd, gluon_fwd, dispatch))


def plan_cache_info() -> dict:
    """Hits and misses of the backward's plan cache since it was last cleared, and its
    entries."""
    return _CACHE.info()


def plan_cache_clear():
    """Drop every cached backward plan and zero the counters."""
    _CACHE.clear()
