r"""Exact attention, forward: one Triton template (FlashAttention-2 schedule) and its launcher.

Math (per query row ``i`` of one (batch, head); semantics in :mod:`.reference`). The
kernel folds key tiles into the ATTENTION monoid's state ``(m, l, acc)`` in *base 2*
(specification 004, "the base-2 twist"): with :math:`\sigma_{ij} = s_{ij} \log_2 e`,

.. math::

    m \leftarrow \max(m, \max_j \sigma_{ij}), \quad
    \alpha = 2^{m_\text{old} - m}, \quad
    l \leftarrow \alpha\, l + \sum_j 2^{\sigma_{ij} - m}, \quad
    acc \leftarrow \alpha\, acc + \sum_j 2^{\sigma_{ij} - m} v_j

and finalizes ``o = acc / l``, ``lse = (m + log2 l) ln 2`` (natural log). That step and
that finalize are not written here: they are the ATTENTION2 monoid's, generated from its
traced combine, lift and finalize (:func:`flashfold.algebra.twist.tile_step`, lowered by
:func:`flashfold.kernels.codegen.tile_step_functions`) and passed to the kernel as the
constexpr functions ``STEP`` and ``FINALIZE``; the kernel contracts ``P V`` on the tensor
cores (``acc' = alpha acc + P V``). The scores reach the step as ``x c`` with ``c > 0``
uniform (:func:`_scores`): ``(qk, scale)``, ``(tanh(qk scale / cap), cap)`` with softcap,
``(score_mod(s), 1)`` with a score_mod; the derivation folds ``c log2 e`` into one FMA per
score and takes the row max on ``x`` (one multiply per row). Masked scores are ``-inf``;
the rescale pivot is kept finite (``m = -inf -> 0``) so a row with no visible key so far
stays ``(-inf, 0, 0)`` without ``-inf - (-inf) = NaN``, and finalizes to ``o = 0``, ``lse
= -inf``. Statistics and the accumulator are fp32; ``tl.dot`` accumulates fp32 (fp16
products that overflow fp16 are fine).

Non-finite inputs (the rule of :mod:`flashfold.api.attention`). Hidden scores are
*selected* to ``-inf``, so a NaN score of a hidden key never enters. A NaN visible score
makes ``m`` NaN (the generated row max propagates NaN), a ``+inf`` one makes ``l`` NaN
(``2^(inf - inf)``), and finalize reads the empty row from ``m = -inf`` only: ``o`` and
``lse`` are NaN. The one leak is ``P V``: a hidden key's ``p = 0`` times a NaN or inf ``v`` is
NaN, on masked tiles (the causal diagonal, window edges, partial block-mask tiles,
cross-sequence ends, whose TMA loads read the next sequence's keys); unmasked tiles have
no hidden key, and a dense call's ragged end reads zeros past ``N_k``. No kernel adds
work to its key loop for it. A leak can only make an output non-finite, so the forwards
that can leak (the Gluon kernel with a window, causal included; the Triton template
with a window, mask_mod or varlen) write one int32 flag per output tile from their
epilogue (nonzero: the tile's ``o`` holds a non-finite entry), and a second launch,
:func:`_attn_fwd_guard` (:func:`prepare_guard`), reads the flags, returns at once where
they are clear (every program, with finite inputs) and recomputes the flagged tiles
strictly: ``STRICT`` masked tiles take :func:`_pv_strict`, which sums the ``v`` tile to a
scalar and, only when that is not finite, zeroes its non-finite entries and marks NaN the
``(row, channel)`` pairs that see one of a visible key. The policy's ``strict_hidden``
(:mod:`.dispatch`) turns the flags and the guard off (to measure them).

Structure (the backward and split-KV decode kernels reuse these pieces):

* ``_load_rows`` / ``_load_tile``: a ``[rows, BLOCK_D]`` tile, through a TMA tensor
  descriptor (``USE_TMA``; 4-D descriptor over ``(B, H, N, D)``, out-of-range rows and
  columns read as zero) or plain pointers with explicit strides (int64 bases);
* ``_scores``: ``qk`` -> scores in base-2 units (softcap, score_mod), and
  ``_visible``: the elementwise mask (sequence bound, bottom-right causal/window bounds,
  mask_mod) -- shared by every attention kernel;
* ``_softmax_update``: one tile folded into ``(acc, l, m)`` (the generated step, then
  ``P V``), and ``_kv_step``: load K, scores, mask, load V, update;
* ``_kv_loop``: folds a run of key tiles into ``(acc, l, m)``; dense runs
  (``lo + i BLOCK_N``) or sparse ones (block indices read from a block-mask list);
  ``MASKED`` selects whether ``_visible`` is evaluated;
* ``_tile_ranges``: per query tile, the key tiles that can be visible split into
  ``[masked | unmasked | masked]`` runs (causal: the diagonal; window: both edges;
  ragged end: the last tile);
* ``_fwd_tile``: one query tile, GQA by ``h // GROUP``, varlen through ``cu_seqlens``
  (``IS_VARLEN``), block-sparse iteration over PARTIAL then FULL tiles when a mask_mod is
  given (``HAS_BLOCK_MASK``); ``_attn_fwd``: one program per (query tile, batch * head);
  ``_attn_fwd_guard``: the flagged tiles of a forward, recomputed strictly.

Constexpr flags: ``MASK_LEFT``/``MASK_RIGHT`` (window sides; causal is ``right = 0``),
``HAS_SOFTCAP``, ``HAS_SCORE_MOD``, ``HAS_BLOCK_MASK`` (mask_mod), ``FULL_NEEDS_MASK``
(the block table does not already account for bounds / causal / window),
``IS_VARLEN``, ``USE_TMA``, ``RETURN_LSE``, ``REVERSE_M`` (causal: heaviest query tiles
first), ``STRICT`` (masked tiles' ``P V`` leaves hidden keys out: the guard's), ``FLAGGED``
(the epilogue writes the tile's non-finite flag), ``FP8`` (E4M3 q, k, v with float32
descale factors per (batch or sequence, KV head): ``q_descale k_descale`` joins the score
scale, the step's reference shift :data:`SHIFT_FP8` makes ``P`` come out times 448 (E4M3's
largest value) for ``P V``, and the finalize multiplies ``acc`` by ``v_descale`` and takes
the state at ``m - SHIFT_FP8``; statistics fp32 as always;
:func:`.reference.fp8_attention_reference` is its semantics; ``v`` keys-contiguous,
``v.stride(2) == 1``, read by TMA through its transpose, so that its tiles are the
K-major B operand of an 8-bit ``wgmma`` as loaded).

Layouts: ``q (B, Hq, Nq, D)``, ``k (B, Hk, Nk, D)``, ``v (B, Hk, Nk, Dv)``, any strides
(TMA needs a unit last stride and 16-byte aligned strides/base, else the pointer path);
with ``cu_seqlens`` ``B == 1`` and sequences are packed along ``N``. Output ``o (B, Hq,
Nq, Dv)`` contiguous in the input dtype; ``lse (B, Hq, Nq)`` float32 contiguous, natural
log (the backward wants base 2: multiply by ``log2 e``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ...monoids import ATTENTION2
from .. import launcher, plans, tma
from ..codegen import tile_step_functions
from . import dispatch, gluon_fwd
from .mods import BlockMask, TracedMod, plan_tables
from .reference import FP8_MAX

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
#: the tile step's reference shift of an FP8 ``P V``: ``P`` (``<= 1``) comes out times
#: 448, the format's largest value, for its rounding to E4M3 (as the Gluon kernel's
#: ``gluon_fwd.SHIFT_FP8``)
SHIFT_FP8 = tl.constexpr(math.log2(FP8_MAX))

try:  # Triton >= 3.3
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None


# --- jit helpers ----------------------------------------------------------------------

@triton.jit
def _tanh(x):
    # 1 - 2 / (e^{2x} + 1): exact limits +-1 (e^{2x} overflowing to inf is fine)
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _load_rows(base, row0, n_rows, stride_r, stride_d,
               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
               CHECK_ROWS: tl.constexpr):
    """Rows ``row0 .. row0 + BLOCK_R`` of a ``(n_rows, HEAD_DIM)`` matrix at ``base``.

    Rows ``>= n_rows`` (when ``CHECK_ROWS``) and columns ``>= HEAD_DIM`` read as 0.
    """
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    ptrs = (base + row0.to(tl.int64) * stride_r
            + (offs_r[:, None] * stride_r + offs_d[None, :] * stride_d))
    if CHECK_ROWS:
        mask = (row0 + offs_r)[:, None] < n_rows
        if BLOCK_D != HEAD_DIM:
            mask = mask & (offs_d[None, :] < HEAD_DIM)
        return tl.load(ptrs, mask=mask, other=0.0)
    elif BLOCK_D != HEAD_DIM:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _load_tile(desc, base, tma_b, tma_h, tma_row, row0, n_rows, stride_r, stride_d,
               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
               CHECK_ROWS: tl.constexpr, USE_TMA: tl.constexpr):
    """A ``[BLOCK_R, BLOCK_D]`` tile: TMA (``desc`` at ``[tma_b, tma_h, tma_row + row0, 0]``)
    or pointers (``base``, local rows ``row0..``)."""
    if USE_TMA:
        t = desc.load([tma_b, tma_h, tma_row + row0, 0])
        return t.reshape([BLOCK_R, BLOCK_D])
    else:
        return _load_rows(base, row0, n_rows, stride_r, stride_d, BLOCK_R, BLOCK_D, HEAD_DIM,
                          CHECK_ROWS)


@triton.jit
def _scores(qk, qk_scale, softcap, b, h, offs_m, offs_n, score_fn,
            SBUF,
            HAS_SOFTCAP: tl.constexpr, HAS_SCORE_MOD: tl.constexpr):
    """Raw ``q.k`` -> ``(x, c)``: the scores are ``x c`` in natural units, with ``c > 0``
    the same for the whole tile, which the tile step folds into its ``log2 e`` (one FMA
    per score): ``(qk, scale)`` plain; ``(tanh(qk scale / cap), cap)`` with softcap;
    ``(score_mod(s), 1)`` with a score_mod (``s`` the softcapped or scaled score).

    ``qk_scale`` is ``scale / softcap`` with softcap, else ``scale``."""
    if HAS_SCORE_MOD:
        if HAS_SOFTCAP:
            s = softcap * _tanh(qk * qk_scale)
        else:
            s = qk * qk_scale
        s = score_fn(s, b, h, offs_m[:, None], offs_n[None, :],
                     SBUF).to(tl.float32)
        return s, 1.0
    elif HAS_SOFTCAP:
        return _tanh(qk * qk_scale), softcap
    else:
        return qk, qk_scale


@triton.jit
def _visible_2d(qi, kj, k_len, delta, win_left, win_right, b, h, mask_fn,
                MBUF,
                MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, APPLY_MASK_MOD: tl.constexpr):
    """Visibility of the pairs ``(qi, kj)`` (broadcastable 2-D int32 index tiles: query
    rows ``qi``, key columns ``kj``; the backward's transposed tiles pass ``[1, BLOCK_M]``
    and ``[BLOCK_N, 1]``): ``j < N_k``, ``i + delta - L <= j <= i + delta + R`` (``delta =
    N_k - N_q``: bottom-right alignment), and ``mask_mod(b, h, i, j)``."""
    vis = kj < k_len
    if MASK_RIGHT:
        vis = vis & (kj <= qi + (delta + win_right))
    if MASK_LEFT:
        vis = vis & (kj >= qi + (delta - win_left))
    if APPLY_MASK_MOD:
        mm = mask_fn(b, h, qi, kj, MBUF)
        vis = vis & (mm != 0)
    return vis


@triton.jit
def _visible(offs_m, offs_n, k_len, delta, win_left, win_right, b, h, mask_fn,
             MBUF,
             MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, APPLY_MASK_MOD: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]`` visibility of rows ``offs_m`` and keys ``offs_n``
    (:func:`_visible_2d` on ``offs_m[:, None]``, ``offs_n[None, :]``)."""
    return _visible_2d(offs_m[:, None], offs_n[None, :], k_len, delta, win_left, win_right, b, h,
                       mask_fn, MBUF,
                       MASK_LEFT, MASK_RIGHT, APPLY_MASK_MOD)


@triton.jit
def _pv_strict(acc, p, v, vis):
    """``acc + p @ v`` in which a hidden key's ``v`` never meets its ``p = 0`` (rule 1 of
    the non-finite rule; ``vis [BLOCK_M, BLOCK_N]`` the visibility). One reduction of the
    tile to a scalar decides: a finite sum means every entry is finite, and the plain
    product is exact; otherwise (rare: a NaN or inf in the tile, or a sum overflowing)
    the product takes ``v`` with its non-finite entries zeroed, and the ``(row, channel)``
    that see a non-finite entry of a visible key become NaN (a 0/1 product of ``vis`` and
    the indicator of those entries, in fp16: counts <= BLOCK_N are exact). ``p`` is in the
    units of the product: times 448 for E4M3 tiles (:data:`SHIFT_FP8`)."""
    vf = v.to(tl.float32)
    total = tl.sum(tl.sum(vf, 1), 0)
    if tl.abs(total) < float("inf"):
        acc = tl.dot(p.to(v.dtype), v, acc)
    else:
        bad = ~(tl.abs(vf) < float("inf"))
        acc = tl.dot(p.to(v.dtype), tl.where(bad, 0.0, vf).to(v.dtype), acc)
        seen = tl.dot(vis.to(tl.float16), bad.to(tl.float16))
        acc = tl.where(seen > 0.0, float("nan"), acc)
    return acc


@triton.jit
def _softmax_update(acc, l_i, m_i, x, c, v, vis, STRICT: tl.constexpr, STEP: tl.constexpr,
                    FP8: tl.constexpr):
    """Fold one tile into ``(acc, l, m)``: scores ``x c`` (``x [BLOCK_M, BLOCK_N]``, ``-inf``
    where masked) and the value tile ``v [BLOCK_N, BLOCK_DV]``. ``STEP`` is ATTENTION2's
    generated tile step (:func:`flashfold.kernels.codegen.tile_step_functions`): ``m' =
    max(m, rowmax(x c log2 e))``, ``alpha = 2^(m - m')``, ``P = 2^(x c log2 e - m')`` (finite
    pivot for an empty row), ``l' = alpha l + rowsum P``; here ``acc' = alpha acc + P V``
    on the tensor cores. ``STRICT`` (tiles with hidden pairs, ``vis`` their visibility):
    :func:`_pv_strict`. ``FP8`` (E4M3 ``v``): the step weighs the tile against the
    reference ``m' - SHIFT_FP8`` (``STEP``'s reference shift), so ``P`` comes out times 448
    for its rounding to E4M3 (``P <= 1`` would otherwise use only the format's lower
    range) with no multiply per score; ``l`` (the unrounded ``448 P``) and ``acc`` carry
    that factor, and the finalize takes the state at ``m - SHIFT_FP8``."""
    if FP8:
        m_new, l_i, alpha, p = STEP(m_i, l_i, x, c, SHIFT_FP8)
    else:
        m_new, l_i, alpha, p = STEP(m_i, l_i, x, c, 0.0)
    acc = acc * alpha[:, None]
    if STRICT:
        acc = _pv_strict(acc, p, v, vis)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)              # [BLOCK_M, BLOCK_DV], fp32 accumulate
    return acc, l_i, m_new


@triton.jit
def _kv_step(acc, l_i, m_i, q, i, lo, idx_ptr,
             desc_k, desc_v, k_base, v_base, tma_b, hk, k_row, k_len,
             skn, skd, svn, svd,
             offs_m, delta, win_left, win_right, b, h, qk_scale, softcap,
             score_fn, SBUF,
             mask_fn, MBUF,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
             SPARSE: tl.constexpr, SPARSE_N: tl.constexpr, MASKED: tl.constexpr,
             APPLY_MASK_MOD: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
             HAS_SOFTCAP: tl.constexpr, HAS_SCORE_MOD: tl.constexpr, USE_TMA: tl.constexpr,
             STRICT: tl.constexpr, STEP: tl.constexpr, FP8: tl.constexpr):
    """Fold key tile ``i`` of a run into ``(acc, l, m)``.

    Dense (``SPARSE=False``): the tile starts at ``lo + i BLOCK_N``. Sparse: it is
    sub-tile ``i % R`` of key block ``idx_ptr[i // R]`` (``R = SPARSE_N / BLOCK_N``).
    ``MASKED`` evaluates :func:`_visible` (else every pair is known visible and in range,
    and loads skip the row check); with ``STRICT`` a masked tile's ``P V`` leaves hidden
    keys out whatever their values (:func:`_pv_strict`).
    """
    if SPARSE:
        blk = tl.load(idx_ptr + i // (SPARSE_N // BLOCK_N))
        start_n = blk * SPARSE_N + (i % (SPARSE_N // BLOCK_N)) * BLOCK_N
    else:
        start_n = lo + i * BLOCK_N
    start_n = tl.multiple_of(start_n, BLOCK_N)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    # -- scores: [BLOCK_M, BLOCK_N] fp32
    k = _load_tile(desc_k, k_base, tma_b, hk, k_row, start_n, k_len, skn, skd,
                   BLOCK_N, BLOCK_D, HEAD_DIM, MASKED, USE_TMA)
    qk = tl.dot(q, tl.trans(k))
    s, c = _scores(qk, qk_scale, softcap, b, h, offs_m, offs_n, score_fn,
                   SBUF, HAS_SOFTCAP, HAS_SCORE_MOD)
    if MASKED:
        vis = _visible(offs_m, offs_n, k_len, delta, win_left, win_right, b, h, mask_fn,
                       MBUF,
                       MASK_LEFT, MASK_RIGHT, APPLY_MASK_MOD)
        s = tl.where(vis, s, float("-inf"))
    if FP8 and USE_TMA:
        # an E4M3 v is stored keys-contiguous (:func:`prepare_forward`): its TMA tile
        # [BLOCK_DV, BLOCK_N], transposed in place in shared memory, is the K-major B
        # operand that an 8-bit wgmma takes, with no transpose through registers
        v = tl.trans(desc_v.load([tma_b, hk, 0, k_row + start_n]).reshape([BLOCK_DV, BLOCK_N]))
    else:
        v = _load_tile(desc_v, v_base, tma_b, hk, k_row, start_n, k_len, svn, svd,
                       BLOCK_N, BLOCK_DV, HEAD_DIM_V, MASKED, USE_TMA)
    # a score_mod's -inf is weight 0, as a mask is: in the strict recompute its key is
    # left out of P V like a hidden one, also in the tiles that need no mask, whatever the
    # key's value holds
    if STRICT and HAS_SCORE_MOD:
        # (in a masked tile s is -inf where vis hides the pair)
        return _softmax_update(acc, l_i, m_i, s, c, v, s != float("-inf"), True, STEP, FP8)
    elif MASKED:
        return _softmax_update(acc, l_i, m_i, s, c, v, vis, STRICT, STEP, FP8)
    else:
        return _softmax_update(acc, l_i, m_i, s, c, v, s, False, STEP, FP8)


@triton.jit
def _kv_loop(acc, l_i, m_i, q, lo, count, idx_ptr,
             desc_k, desc_v, k_base, v_base, tma_b, hk, k_row, k_len,
             skn, skd, svn, svd,
             offs_m, delta, win_left, win_right, b, h, qk_scale, softcap,
             score_fn, SBUF,
             mask_fn, MBUF,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
             SPARSE: tl.constexpr, SPARSE_N: tl.constexpr, MASKED: tl.constexpr,
             APPLY_MASK_MOD: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
             HAS_SOFTCAP: tl.constexpr, HAS_SCORE_MOD: tl.constexpr, USE_TMA: tl.constexpr,
             INTERPRET: tl.constexpr, STRICT: tl.constexpr, STEP: tl.constexpr,
             FP8: tl.constexpr):
    """Fold ``count`` key tiles (:func:`_kv_step`) into ``(acc, l, m)``.

    Compiled: ``tl.range`` (software-pipelined). Under ``TRITON_INTERPRET`` a ``while``
    loop: the interpreter's ``range`` takes ``int()`` of a one-element array, which
    NumPy >= 2.4 rejects.
    """
    if INTERPRET:
        i = 0
        while i < count:
            acc, l_i, m_i = _kv_step(
                acc, l_i, m_i, q, i, lo, idx_ptr, desc_k, desc_v, k_base, v_base, tma_b, hk,
                k_row, k_len, skn, skd, svn, svd, offs_m, delta, win_left, win_right, b, h,
                qk_scale, softcap, score_fn, SBUF,
                mask_fn, MBUF,
                BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, SPARSE, SPARSE_N,
                MASKED, APPLY_MASK_MOD, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_SCORE_MOD,
                USE_TMA, STRICT, STEP, FP8)
            i += 1
    else:
        for i in tl.range(0, count):
            acc, l_i, m_i = _kv_step(
                acc, l_i, m_i, q, i, lo, idx_ptr, desc_k, desc_v, k_base, v_base, tma_b, hk,
                k_row, k_len, skn, skd, svn, svd, offs_m, delta, win_left, win_right, b, h,
                qk_scale, softcap, score_fn, SBUF,
                mask_fn, MBUF,
                BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, SPARSE, SPARSE_N,
                MASKED, APPLY_MASK_MOD, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_SCORE_MOD,
                USE_TMA, STRICT, STEP, FP8)
    return acc, l_i, m_i


@triton.jit
def _tile_ranges(start_m, q_len, k_len, delta, win_left, win_right,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    """Key tiles of query tile ``start_m`` as three runs ``[t_lo, t_a)`` masked,
    ``[t_a, t_c)`` unmasked, ``[t_c, t_hi)`` masked (tile indices).

    Visible keys of row ``i`` lie in ``[i + delta - L, i + delta + R] & [0, k_len)``; a
    tile needs no mask when it is inside that range for every real row of the query tile
    (first row for the right edge, last row for the left edge) and inside ``k_len``.
    Positions are clamped at 0 before dividing (integer division truncates).
    """
    m_last = tl.minimum(start_m + BLOCK_M, q_len) - 1
    hi = k_len
    full_hi = k_len
    if MASK_RIGHT:
        hi = tl.minimum(hi, m_last + delta + win_right + 1)
        full_hi = tl.minimum(full_hi, start_m + delta + win_right + 1)
    lo = 0
    full_lo = 0
    if MASK_LEFT:
        lo = tl.maximum(start_m + delta - win_left, 0)
        full_lo = tl.maximum(m_last + delta - win_left, 0)
    hi = tl.maximum(hi, 0)
    full_hi = tl.maximum(full_hi, 0)
    t_lo = lo // BLOCK_N
    t_hi = tl.maximum((hi + BLOCK_N - 1) // BLOCK_N, t_lo)
    t_a = tl.minimum(tl.maximum((full_lo + BLOCK_N - 1) // BLOCK_N, t_lo), t_hi)
    t_c = tl.minimum(tl.maximum(full_hi // BLOCK_N, t_a), t_hi)
    return t_lo, t_a, t_c, t_hi


# --- the kernel -------------------------------------------------------------------------

@triton.jit
def _fwd_tile(
    b, h, start_m, flag_idx,
    Q, K, V, O, LSE, desc_q, desc_k, desc_v, SQ, SK, SV, SO, SL,
    NUM_M, HQ, GROUP, SEQ_Q, SEQ_K, CU_Q, CU_K,
    qk_scale, softcap, win_left, win_right,
    TABLES, bn_b, bn_h, bi_b, bi_h, bi_m,
    score_fn: tl.constexpr, SBUF,
    mask_fn: tl.constexpr, MBUF, DESCALES, SD, FLAGS,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPARSE_M: tl.constexpr, SPARSE_N: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SCORE_MOD: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr, FULL_NEEDS_MASK: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_TMA: tl.constexpr, RETURN_LSE: tl.constexpr,
    REVERSE_M: tl.constexpr, INTERPRET: tl.constexpr,
    STRICT: tl.constexpr, FLAGGED: tl.constexpr, STEP: tl.constexpr, FINALIZE: tl.constexpr,
    FP8: tl.constexpr,
):
    """Query tile ``start_m .. start_m + BLOCK_M`` of (sequence or batch ``b``, head
    ``h``): fold its key tiles, write ``o`` (and ``lse``) of its rows and, ``FLAGGED``,
    ``FLAGS[flag_idx]``: 1 if the tile's ``o`` holds a non-finite entry, else 0. The
    arguments as :func:`_attn_fwd`'s. A varlen tile past its sequence's end must not be
    passed (the kernels return before)."""
    sqb, sqh, sqm, sqd = SQ[0], SQ[1], SQ[2], SQ[3]
    skb, skh, skn, skd = SK[0], SK[1], SK[2], SK[3]
    svb, svh, svn, svd = SV[0], SV[1], SV[2], SV[3]
    sob, soh, som, sod = SO[0], SO[1], SO[2], SO[3]
    slb, slh = SL[0], SL[1]
    PART_NUM, PART_IDX, FULL_NUM, FULL_IDX = TABLES[0], TABLES[1], TABLES[2], TABLES[3]
    hk = h // GROUP
    q_base = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    k_base = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    o_base = O + b.to(tl.int64) * sob + h.to(tl.int64) * soh
    if IS_VARLEN:
        # packed sequences (batch dim 1; launcher passes batch strides 0); b = sequence
        q_row = tl.load(CU_Q + b)
        q_len = tl.load(CU_Q + b + 1) - q_row
        k_row = tl.load(CU_K + b)
        k_len = tl.load(CU_K + b + 1) - k_row
        q_base += q_row.to(tl.int64) * sqm
        k_base += k_row.to(tl.int64) * skn
        v_base += k_row.to(tl.int64) * svn
        o_base += q_row.to(tl.int64) * som
        tma_b = 0
    else:
        q_row = 0
        q_len = SEQ_Q
        k_row = 0
        k_len = SEQ_K
        tma_b = b
    delta = k_len - q_len
    offs_m = start_m + tl.arange(0, BLOCK_M)
    if FP8:
        # E4M3 inputs stand for x8 * descale, one factor per (batch or sequence, KV head):
        # q's and k's go into the score scale, v's into the finalize
        d_q = tl.load(DESCALES[0] + b.to(tl.int64) * SD[0] + hk * SD[1])
        d_k = tl.load(DESCALES[1] + b.to(tl.int64) * SD[2] + hk * SD[3])
        qk_scale = qk_scale * (d_q * d_k)

    # -- state (m, l, acc) = identity; q stays on chip
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    q = _load_tile(desc_q, q_base, tma_b, h, q_row, start_m, q_len, sqm, sqd,
                   BLOCK_M, BLOCK_D, HEAD_DIM, True, USE_TMA)

    if HAS_BLOCK_MASK:
        # PARTIAL tiles (mask_mod evaluated), then FULL tiles (no mask_mod)
        R: tl.constexpr = SPARSE_N // BLOCK_N
        row = start_m // SPARSE_M
        n_off = b.to(tl.int64) * bn_b + h.to(tl.int64) * bn_h + row
        i_off = b.to(tl.int64) * bi_b + h.to(tl.int64) * bi_h + row.to(tl.int64) * bi_m
        n_part = tl.load(PART_NUM + n_off)
        acc, l_i, m_i = _kv_loop(
            acc, l_i, m_i, q, 0, n_part * R, PART_IDX + i_off,
            desc_k, desc_v, k_base, v_base, tma_b, hk, k_row, k_len, skn, skd, svn, svd,
            offs_m, delta, win_left, win_right, b, h, qk_scale, softcap,
            score_fn, SBUF,
            mask_fn, MBUF,
            BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, True, SPARSE_N,
            True, True, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_SCORE_MOD, USE_TMA,
            INTERPRET, STRICT, STEP, FP8)
        n_full = tl.load(FULL_NUM + n_off)
        acc, l_i, m_i = _kv_loop(
            acc, l_i, m_i, q, 0, n_full * R, FULL_IDX + i_off,
            desc_k, desc_v, k_base, v_base, tma_b, hk, k_row, k_len, skn, skd, svn, svd,
            offs_m, delta, win_left, win_right, b, h, qk_scale, softcap,
            score_fn, SBUF,
            mask_fn, MBUF,
            BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, True, SPARSE_N,
            FULL_NEEDS_MASK, False, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_SCORE_MOD,
            USE_TMA, INTERPRET, STRICT, STEP, FP8)
    else:
        t_lo, t_a, t_c, t_hi = _tile_ranges(start_m, q_len, k_len, delta, win_left, win_right,
                                            BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
        # unmasked interior first, then the masked edges (order is free: the combine
        # is commutative)
        acc, l_i, m_i = _kv_loop(
            acc, l_i, m_i, q, t_a * BLOCK_N, t_c - t_a, PART_IDX,
            desc_k, desc_v, k_base, v_base, tma_b, hk, k_row, k_len, skn, skd, svn, svd,
            offs_m, delta, win_left, win_right, b, h, qk_scale, softcap,
            score_fn, SBUF,
            mask_fn, MBUF,
            BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, False, SPARSE_N,
            False, False, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_SCORE_MOD, USE_TMA,
            INTERPRET, STRICT, STEP, FP8)
        if MASK_LEFT:
            acc, l_i, m_i = _kv_loop(
                acc, l_i, m_i, q, t_lo * BLOCK_N, t_a - t_lo, PART_IDX,
                desc_k, desc_v, k_base, v_base, tma_b, hk, k_row, k_len, skn, skd, svn, svd,
                offs_m, delta, win_left, win_right, b, h, qk_scale, softcap,
                score_fn, SBUF,
                mask_fn, MBUF,
                BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, False, SPARSE_N,
                True, False, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_SCORE_MOD, USE_TMA,
                INTERPRET, STRICT, STEP, FP8)
        acc, l_i, m_i = _kv_loop(
            acc, l_i, m_i, q, t_c * BLOCK_N, t_hi - t_c, PART_IDX,
            desc_k, desc_v, k_base, v_base, tma_b, hk, k_row, k_len, skn, skd, svn, svd,
            offs_m, delta, win_left, win_right, b, h, qk_scale, softcap,
            score_fn, SBUF,
            mask_fn, MBUF,
            BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, False, SPARSE_N,
            True, False, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_SCORE_MOD, USE_TMA,
            INTERPRET, STRICT, STEP, FP8)

    # -- finalize: ATTENTION2's (o = acc / l, lse = (m + log2 l) ln 2; a row with no visible
    # key, m = -inf, gives 0 and -inf; a NaN m or l, NaN)
    if FP8:
        # o is linear in v: v's factor, once per tile; the state is ATTENTION2's at
        # m - SHIFT_FP8
        d_v = tl.load(DESCALES[2] + b.to(tl.int64) * SD[4] + hk * SD[5])
        acc = acc * d_v
        m_i = m_i - SHIFT_FP8
    o, lse = FINALIZE(m_i, l_i, acc)
    offs_dv = tl.arange(0, BLOCK_DV)
    o_ptrs = (o_base + start_m.to(tl.int64) * som
              + (tl.arange(0, BLOCK_M)[:, None] * som + offs_dv[None, :] * sod))
    o_mask = offs_m[:, None] < q_len
    if BLOCK_DV != HEAD_DIM_V:
        o_mask = o_mask & (offs_dv[None, :] < HEAD_DIM_V)
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=o_mask)
    if RETURN_LSE:
        lse_ptrs = LSE + b.to(tl.int64) * slb + h.to(tl.int64) * slh + q_row + offs_m
        tl.store(lse_ptrs, lse, mask=offs_m < q_len)
    if FLAGGED:
        # this tile's non-finite flag: a masked tile's P V met hidden keys' values
        # (0 x NaN), so a non-finite o may be a leak, which the guard recomputes
        ok = (tl.abs(o) < float("inf")) | ~o_mask
        tl.store(FLAGS + flag_idx, tl.max(tl.max(tl.where(ok, 0, 1), 1), 0))




# lengths and counts vary per call: not specialized (one compiled variant per feature set,
# not per sequence length); strides keep their divisibility specialization (vector loads)
@triton.jit(do_not_specialize=["NUM_M", "HQ", "GROUP", "SEQ_Q", "SEQ_K", "win_left",
                               "win_right", "bn_b", "bn_h", "bi_b", "bi_h", "bi_m"])
def _attn_fwd(
    Q, K, V, O, LSE, desc_q, desc_k, desc_v, SQ, SK, SV, SO, SL,
    NUM_M, HQ, GROUP, SEQ_Q, SEQ_K, CU_Q, CU_K,
    qk_scale, softcap, win_left, win_right,
    TABLES, bn_b, bn_h, bi_b, bi_h, bi_m,
    score_fn: tl.constexpr, SBUF,
    mask_fn: tl.constexpr, MBUF, DESCALES, SD, FLAGS,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPARSE_M: tl.constexpr, SPARSE_N: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SCORE_MOD: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr, FULL_NEEDS_MASK: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_TMA: tl.constexpr, RETURN_LSE: tl.constexpr,
    REVERSE_M: tl.constexpr, INTERPRET: tl.constexpr,
    STRICT: tl.constexpr, FLAGGED: tl.constexpr, STEP: tl.constexpr, FINALIZE: tl.constexpr,
    FP8: tl.constexpr,
):
    """One program per (query tile, batch x head) (:func:`_fwd_tile`). Arguments: the
    tensors and their TMA descriptors; ``SQ``, ``SK``, ``SV``, ``SO``: each one's (batch,
    head, row, dim) strides (batch stride 0 for packed sequences), ``SL``: the LSE's
    (batch, head); the per-call sizes (not specialized); scales and window bounds;
    ``TABLES``: the block mask's (partial counts, partial indices, full counts, full
    indices) and their five strides; each mod's function (constexpr) and tables (``SBUF``,
    ``MBUF``: :func:`.mods.TracedMod.buffer_args`); ``DESCALES``, ``SD``: with ``FP8``,
    the q, k, v descale tensors and their (batch or sequence, KV head) strides, six ints
    (else Nones and zeros); then the constexpr flags. ``STRICT``: masked
    tiles leave hidden keys out of ``P V`` whatever their values (:func:`_pv_strict`).
    ``FLAGGED``: each tile writes its non-finite flag, ``FLAGS[bh NUM_M + m]`` (tile ``m``
    of batch x head ``bh``), for the guard (:func:`_attn_fwd_guard`)."""
    # program -> (query tile, batch, head); query tiles of one head are adjacent (K/V
    # stay in L2); causal runs the heaviest (last) query tiles of each head first
    pid = tl.program_id(0)
    bh = pid // NUM_M
    mt = pid % NUM_M
    if REVERSE_M:
        mt = NUM_M - 1 - mt
    b = bh // HQ
    h = bh % HQ
    start_m = mt * BLOCK_M
    if IS_VARLEN:
        if start_m >= tl.load(CU_Q + b + 1) - tl.load(CU_Q + b):
            return
    _fwd_tile(b, h, start_m, bh * NUM_M + mt, Q, K, V, O, LSE, desc_q, desc_k, desc_v, SQ,
              SK, SV, SO, SL, NUM_M, HQ, GROUP, SEQ_Q, SEQ_K, CU_Q, CU_K, qk_scale, softcap,
              win_left, win_right, TABLES, bn_b, bn_h, bi_b, bi_h, bi_m, score_fn, SBUF,
              mask_fn, MBUF, DESCALES, SD, FLAGS, HEAD_DIM, HEAD_DIM_V, BLOCK_D,
              BLOCK_DV, BLOCK_M, BLOCK_N, SPARSE_M, SPARSE_N, MASK_LEFT, MASK_RIGHT,
              HAS_SOFTCAP, HAS_SCORE_MOD, HAS_BLOCK_MASK, FULL_NEEDS_MASK, IS_VARLEN,
              USE_TMA, RETURN_LSE, REVERSE_M, INTERPRET, STRICT, FLAGGED, STEP, FINALIZE, FP8)


@triton.jit
def _varlen_slot(CU, slot, N_SEQ, BLOCK: tl.constexpr):
    """``(sequence, tile)`` of work slot ``slot`` over packed sequences (offsets ``CU``,
    ``N_SEQ`` of them): sequence ``s`` owns the slots ``CU[s] // BLOCK + s + t`` of its
    tiles ``t < ceil(len_s / BLOCK)`` (:func:`.gluon_fwd.varlen_slots`: they never meet,
    ``total // BLOCK + N_SEQ`` hold all), so the slot's sequence is the last ``s`` with
    ``CU[s] // BLOCK + s <= slot`` (bisection); a tile past its sequence's end is an
    empty slot, which the caller skips."""
    lo = 0
    hi = N_SEQ - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(CU + mid) // BLOCK + mid <= slot:
            lo = mid
        else:
            hi = mid - 1
    return lo, slot - (tl.load(CU + lo) // BLOCK + lo)


#: query rows per flag of the guarded Gluon forward (one consumer warpgroup's half tile)
FLAG_ROWS = 64


@triton.jit(do_not_specialize=["N_FLAGS", "FLAG_TILES", "N_SEQ", "NUM_M", "HQ", "GROUP",
                               "SEQ_Q", "SEQ_K", "win_left", "win_right", "bn_b", "bn_h",
                               "bi_b", "bi_h", "bi_m"])
def _attn_fwd_guard(
    GFLAGS, N_FLAGS, FLAG_TILES, N_SEQ,
    Q, K, V, O, LSE, desc_q, desc_k, desc_v, SQ, SK, SV, SO, SL,
    NUM_M, HQ, GROUP, SEQ_Q, SEQ_K, CU_Q, CU_K,
    qk_scale, softcap, win_left, win_right,
    TABLES, bn_b, bn_h, bi_b, bi_h, bi_m,
    score_fn: tl.constexpr, SBUF,
    mask_fn: tl.constexpr, MBUF, DESCALES, SD, FLAGS,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPARSE_M: tl.constexpr, SPARSE_N: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SCORE_MOD: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr, FULL_NEEDS_MASK: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_TMA: tl.constexpr, RETURN_LSE: tl.constexpr,
    REVERSE_M: tl.constexpr, INTERPRET: tl.constexpr,
    STRICT: tl.constexpr, FLAGGED: tl.constexpr, STEP: tl.constexpr, FINALIZE: tl.constexpr,
    FP8: tl.constexpr, CHUNK: tl.constexpr, FLAG_ROWS: tl.constexpr, SLOTS: tl.constexpr,
):
    """The strict recomputation behind a forward that may have let a hidden key's value
    through (``0 x NaN`` in a masked tile's ``P V``): ``GFLAGS`` holds one int32 per
    ``(batch x head, FLAG_ROWS-row tile)`` (``FLAG_TILES`` per batch x head), nonzero where
    that tile's output has a non-finite entry (written by the forward's epilogue: the
    Gluon kernel's, 64 rows, or the Triton template's, ``BLOCK_M`` rows). ``SLOTS``
    (packed sequences, the Gluon kernel's layout): one per ``(head, slot)``, ``FLAG_TILES``
    slots per head, sequence ``s``'s tile ``t`` at slot ``CU_Q[s] // FLAG_ROWS + s + t``
    (:func:`_varlen_slot`, ``N_SEQ`` sequences): sized by the packed rows, not by the
    longest sequence, which a CUDA-graph capture does not know. Program ``p`` reads
    flags ``p CHUNK .. (p + 1) CHUNK`` (one vector load) and returns when they are all
    clear (every program, unless the inputs hold a NaN or inf); else it recomputes each
    flagged tile with :func:`_fwd_tile` (``STRICT``) and overwrites its ``o`` and ``lse``.
    ``FLAG_ROWS % BLOCK_M == 0``."""
    f0 = tl.program_id(0) * CHUNK
    offs = f0 + tl.arange(0, CHUNK)
    if tl.max(tl.load(GFLAGS + offs, mask=offs < N_FLAGS, other=0), 0) == 0:
        return
    for i in range(CHUNK):
        f = f0 + i
        if tl.load(GFLAGS + f, mask=f < N_FLAGS, other=0) != 0:
            if SLOTS:
                h = f // FLAG_TILES
                b, t = _varlen_slot(CU_Q, f % FLAG_TILES, N_SEQ, FLAG_ROWS)
            else:
                bh = f // FLAG_TILES
                b = bh // HQ
                h = bh % HQ
                t = f % FLAG_TILES
            q_len = SEQ_Q
            if IS_VARLEN:
                q_len = tl.load(CU_Q + b + 1) - tl.load(CU_Q + b)
            for sub in tl.static_range(FLAG_ROWS // BLOCK_M):
                start_m = t * FLAG_ROWS + sub * BLOCK_M
                if start_m < q_len:
                    _fwd_tile(b, h, start_m, 0, Q, K, V, O, LSE, desc_q, desc_k,
                              desc_v, SQ, SK, SV, SO, SL, NUM_M, HQ, GROUP, SEQ_Q,
                              SEQ_K, CU_Q, CU_K, qk_scale, softcap, win_left, win_right,
                              TABLES, bn_b, bn_h, bi_b, bi_h, bi_m, score_fn, SBUF,
                              mask_fn, MBUF, DESCALES, SD,
                              FLAGS, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV,
                              BLOCK_M, BLOCK_N, SPARSE_M, SPARSE_N, MASK_LEFT,
                              MASK_RIGHT, HAS_SOFTCAP, HAS_SCORE_MOD,
                              HAS_BLOCK_MASK, FULL_NEEDS_MASK, IS_VARLEN, USE_TMA,
                              RETURN_LSE, REVERSE_M, INTERPRET, STRICT,
                              False, STEP, FINALIZE, FP8)


# --- launcher ---------------------------------------------------------------------------

@dataclass(frozen=True)
class FwdConfig:
    """Tile sizes and launch options of one forward launch."""
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    use_tma: bool = False

    def __str__(self):
        return (f"BM{self.block_m}-BN{self.block_n}-w{self.num_warps}-s{self.num_stages}"
                f"{'-tma' if self.use_tma else ''}")


_interpreting = launcher.interpreting


#: Hopper heuristic keyed on the padded head dim: (BLOCK_M, BLOCK_N, num_warps, num_stages).
#: Chosen from the FA2 / Triton-tutorial design space and checked (ahead-of-time compile for
#: sm_90) for zero register spills and shared memory under 227 KB; retune with
#: ``benchmarks/attention.py --tune`` on the H200.
#: (block_m, block_n, warps, stages) per (padded head dim, right-bounded i.e. causal);
#: measured on the H200 with ``benchmarks/attention.py --tune`` (bf16, H=16, N=4096, B=4,
#: 2026-11-29): d64 full 441 TFLOP/s (BM128-BN64-w8-s3), d64 causal 383 (BM64-BN64-w4-s3),
#: d128 full 500 (BM128-BN128-w8-s3), d128 causal 449 (BM64-BN64-w4-s3), d256 full 557 /
#: causal 495 (BM128-BN64-w8-s2). Causal rows prefer 64-row tiles: twice the programs and
#: half the work wasted on the diagonal tile.
HOPPER_CONFIGS = {
    (32, False): (128, 64, 4, 3), (32, True): (64, 64, 4, 3),
    (64, False): (128, 64, 8, 3), (64, True): (64, 64, 4, 3),
    (128, False): (128, 128, 8, 3), (128, True): (64, 64, 4, 3),
    (256, False): (128, 64, 8, 2), (256, True): (128, 64, 8, 2),
}


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def block_dims(head_dim: int, head_dim_v: int, least: int = 16) -> tuple[int, int]:
    """Power-of-two tile widths covering the head dims, at least ``least`` (a dot's
    reduction width: 16 for 16-bit operands, 32 for 8-bit ones): 8 -> 16, 80 -> 128, 96 ->
    128, 192 -> 256; the kernels mask the columns past the head dim in their loads and
    stores."""
    return max(least, _pow2(head_dim)), max(least, _pow2(head_dim_v))


def default_config(q, head_dim: int, head_dim_v: int, causal: bool = False) -> FwdConfig:
    """The launch configuration for these inputs (heuristic; no autotuning).

    ``causal``: whether rows have a right bound (causal or a window's right edge). TMA
    descriptors on sm_90+ while the policy's ``tma`` is on (:mod:`.dispatch`; the launch
    falls back to pointers where strides do not allow them).
    """
    if q.device.type != "cuda" or _interpreting():
        return FwdConfig(16, 16, 4, 1, use_tma=False)
    bd = max(block_dims(head_dim, head_dim_v))
    bm, bn, warps, stages = HOPPER_CONFIGS[(min(max(bd, 32), 256), bool(causal))]
    major = launcher.capability(q.device)[0]
    if major < 9:                                 # Ampere and older: smaller stages, no TMA
        return FwdConfig(bm if bd <= 128 else 64, min(bn, 64), warps, 2, use_tma=False)
    return FwdConfig(bm, bn, warps, stages,
                     use_tma=dispatch.current().tma and TensorDescriptor is not None)


def keys_contiguous(v) -> bool:
    """Whether ``v (B, H, Nk, Dv)`` has its keys as its contiguous dim (``v.stride(2) ==
    1``, or one key), the layout the FP8 flag reads V in (the 8-bit ``P V`` takes V
    K-major)."""
    return v.stride(2) == 1 or v.shape[2] <= 1


def tma_ok(*tensors) -> bool:
    """Whether TMA descriptors can address these tensors: unit last stride, 16-byte aligned
    base and strides (of dims longer than 1), no zero strides."""
    return TensorDescriptor is not None and all(tma.addressable(t) for t in tensors)


def _desc(t, block_rows, block_d, keys_inner=False):
    """A 4-D TMA descriptor over ``t (B, H, N, D)`` loading ``[1, 1, block_rows, block_d]``
    boxes (the stride of a size-1 dim is irrelevant; replaced by an aligned value).
    ``keys_inner``: ``t`` is stored with ``N`` innermost (an FP8 ``v``), and the
    descriptor spans ``(B, H, D, N)``: its base is ``t`` itself with the transposed shape
    and strides, not a transposed view (a plan replays descriptors over its inputs, not
    over views of them: :mod:`flashfold.kernels.plans`)."""
    view = t.transpose(2, 3) if keys_inner else t
    return TensorDescriptor(t, list(view.shape), tma.box_strides(view),
                            [1, 1, block_rows, block_d])


#: allocator of the outputs (:func:`flashfold.kernels.plans.new`: ``torch.empty``, noted
#: while a plan is recorded); the GPU check in ``benchmarks/attention.py`` swaps in a
#: NaN-filling one so that any element the kernel fails to write is caught
_alloc = plans.new


def attention_forward(q, k, v, *, scale: float, softcap: float | None = None,
                      left: int | None = None, right: int | None = None,
                      score_mod: TracedMod | None = None, block_mask: BlockMask | None = None,
                      cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int | None = None,
                      max_seqlen_k: int | None = None, return_lse: bool = True,
                      full_needs_mask: bool = True, config: FwdConfig | None = None,
                      descales=None, out_dtype=None):
    """Launch the forward kernel; returns ``(o, lse)`` (``lse`` None unless ``return_lse``).

    Inputs are validated by :func:`flashfold.attention`; this expects: ``q (B, Hq, Nq, D)``,
    ``k (B, Hk, Nk, D)``, ``v (B, Hk, Nk, Dv)`` on one device, ``Hq % Hk == 0``,
    ``left``/``right`` the bottom-right aligned window (causal folded in as ``right=0``;
    None = unbounded), ``scale > 0``, ``softcap > 0`` or None, varlen ``cu_seqlens_*``
    int32 ``(S + 1,)`` with ``max_seqlen_*``. ``block_mask`` carries the traced mask_mod;
    ``full_needs_mask=False`` promises that its FULL tiles need no masking at all (the
    table was computed for these lengths and this window), else the kernel also applies
    bounds and window masks inside FULL tiles. ``config`` overrides the heuristic.
    ``descales``: with ``torch.float8_e4m3fn`` q, k, v, their float32 factors ``(q_descale,
    k_descale, v_descale)``, each ``(B or S, Hk)`` (no mods); ``out_dtype``: ``o``'s
    dtype (default q's, bf16 for FP8).

    A call replays the launch planned for the same signature (:data:`_CACHE`, see
    :mod:`flashfold.kernels.plans`), as the backward does; a score_mod or block mask enters
    the signature by identity and its tables as inputs of the plan
    (:func:`.mods.plan_tables`). The checks, dispatch, allocation and TMA descriptors cost ~135 us of host time
    per call on the dev machine, and an eager forward + backward at N = 1K causal was
    host-bound on the H200 (0.85x cuDNN at head_dim 128, 0.51x at 64, against 1.01x and
    0.96x from CUDA graphs; ``docs/notes/host_time.md``, "Attention").
    """
    if out_dtype is None:
        out_dtype = torch.bfloat16 if descales is not None else q.dtype
    options = dict(scale=scale, softcap=softcap, left=left, right=right,
                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, return_lse=return_lse,
                   full_needs_mask=full_needs_mask, config=config, out_dtype=out_dtype)
    inputs = (q, k, v, cu_seqlens_q, cu_seqlens_k) + (tuple(descales) if descales else (None,) * 3)
    # the mods' tables are inputs of the plan too; the mods themselves are held by identity
    tables = plan_tables(score_mod, block_mask, q.device)
    policy = dispatch.current()
    # what _plan reads: the tensors' signatures, the options, the mods, the policy
    key = (plans.signatures(inputs + tables), scale, softcap, left,
           right, max_seqlen_q, max_seqlen_k, return_lse, full_needs_mask, config, out_dtype,
           id(score_mod), id(block_mask), policy)
    o, lse, launch, memo = _CACHE.planned(key, (score_mod, block_mask), inputs + tables, _plan,
                                          *inputs, score_mod=score_mod, block_mask=block_mask,
                                          policy=policy, **options)
    for one, one_memo in zip(launch, memo):
        launcher.launch(*one, one_memo)
    return o, lse


def mask_tiles(q, k, v, *, scale, softcap=None, left=None, right=None, score_mod=None,
               mask_mod=None, varlen=False) -> tuple[int, int]:
    """The tiles ``(block_m, block_n)`` of the block table that the forward builds for a
    callable ``mask_mod``: the Gluon kernel's query tile and its plan's key tile where the
    call will run it (:func:`.dispatch.forward_gluon`, before the table exists), else the
    Triton template's tiles."""
    if not varlen and dispatch.forward_gluon(q, k, v, scale=scale, softcap=softcap, left=left,
                                             right=right, score_mod=score_mod):
        tiles = gluon_fwd.block_mask_tiles(q, v, mask_mod)
        if tiles is not None:
            return tiles
    cfg = default_config(q, q.shape[3], v.shape[3], causal=right is not None)
    return cfg.block_m, cfg.block_n


def _plan(q, k, v, cu_seqlens_q, cu_seqlens_k, q_descale=None, k_descale=None, v_descale=None,
          *, scale, softcap=None, left=None, right=None, score_mod=None, block_mask=None,
          max_seqlen_q=None, max_seqlen_k=None, return_lse=True, full_needs_mask=True,
          config=None, out_dtype=None, policy=None):
    """The forward's outputs and its launches: ``(o, lse, launches, memos)``, a tuple of
    ``(kernel, grid, args, kwargs)`` (none, one or two) and one launcher memo for each,
    shared by the replays of the plan (:func:`flashfold.kernels.launcher.launch`).

    Dispatch: the Gluon kernel where :func:`.dispatch.forward_gluon` says so (FP8 too:
    its E4M3 descriptors, with the call's descales and ``out_dtype``), everything else
    the Triton template (:func:`prepare_forward`). While the ``policy``'s
    ``strict_hidden`` is on, calls whose masked tiles can hold hidden keys are flagged
    and followed by the strict guard (:func:`prepare_guard`): with a window, causal,
    score_mod, mask_mod or varlen (the tiles on a window's edges; keys a mod hides; a
    packed sequence's tiles read the next one's keys)."""
    policy = policy or dispatch.current()
    strict = policy.strict_hidden
    varlen = cu_seqlens_q is not None
    descales = None if q_descale is None else (q_descale, k_descale, v_descale)
    if dispatch.forward_gluon(q, k, v, scale=scale, softcap=softcap, left=left, right=right,
                              score_mod=score_mod, block_mask=block_mask, varlen=varlen,
                              config=config, policy=policy):
        B, HQ, NQ = q.shape[:3]
        o = _alloc((B, HQ, NQ, v.shape[3]), dtype=out_dtype or q.dtype, device=q.device)
        lse = _alloc((B, HQ, NQ), dtype=torch.float32, device=q.device) if return_lse else None
        # (the guard takes these too: an FP8 call's rows are recomputed by the template's
        # FP8 flag)
        bounds = dict(scale=scale, softcap=softcap, left=left, right=right,
                      score_mod=score_mod, block_mask=block_mask, descales=descales)
        if varlen:
            bounds.update(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        hides = (left is not None or right is not None or score_mod is not None
                 or block_mask is not None)
        if not varlen and (not hides or not strict):
            launches = gluon_fwd.gluon_attention_fwd(q, k, v, return_lse=return_lse, out=o,
                                                     lse=lse, launch=False, **bounds)
            return o, lse, launches, tuple([None] for _ in launches)
        # a window (causal too): its edge tiles hold hidden keys, whose values the Gluon
        # kernel's P V meets (0 x NaN); packed sequences: the next sequence's keys too. Its
        # flags tell the guard which rows to recompute strictly (scratch, not an output:
        # plans.new, not the swappable output allocator; zeroed: the kernel sets the
        # flags of rows that hold a non-finite o and writes no others)
        n_seq = cu_seqlens_q.shape[0] - 1 if varlen else B
        flags = plans.new((flag_count(NQ, HQ, n_seq, varlen),), dtype=torch.int32,
                          device=q.device, zero=True)
        launches = gluon_fwd.gluon_attention_fwd(q, k, v, return_lse=return_lse, out=o,
                                                 lse=lse, launch=False, flags=flags, **bounds)
        if strict:
            launches += (prepare_guard(q, k, v, o, lse, flags, slots=varlen,
                                       full_needs_mask=full_needs_mask, **bounds),)
        return o, lse, launches, tuple([None] for _ in launches)
    options = dict(scale=scale, softcap=softcap, left=left, right=right, score_mod=score_mod,
                   block_mask=block_mask, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                   full_needs_mask=full_needs_mask, out_dtype=out_dtype, descales=descales)
    # masked tiles that can hold hidden keys of the sequence (or the next sequence's, read
    # through a packed TMA descriptor): flagged, then guarded. A dense call's only masked
    # tile is the ragged end, whose keys past Nk read as zeros (4-D TMA box, masked loads)
    guarded = strict and (left is not None or right is not None or block_mask is not None
                                 or cu_seqlens_q is not None or score_mod is not None)
    o, lse, launch = prepare_forward(q, k, v, return_lse=return_lse, config=config,
                                     flagged=guarded, **options)
    if launch is None:
        return o, lse, (), ()
    if not guarded:
        return o, lse, ((_attn_fwd, *launch),), ([None],)
    _, args, kw = launch
    used = FwdConfig(kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"],
                     use_tma=kw["USE_TMA"])
    guard = prepare_guard(q, k, v, o, lse, args[-1], flag_rows=kw["BLOCK_M"], config=used,
                          **options)
    return o, lse, ((_attn_fwd, *launch), guard), ([None], [None])


def prepare_forward(q, k, v, *, scale, softcap=None, left=None, right=None, score_mod=None,
                    block_mask=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                    max_seqlen_k=None, return_lse=True, full_needs_mask=True, config=None,
                    interpret=None, out=None, flagged=False, descales=None, out_dtype=None):
    """Allocate the outputs and build the launch: ``(o, lse, (grid, args, kwargs) | None)``.

    Separate from the launch so that tools can compile the exact specialization ahead of
    time (``benchmarks/attention.py``, ``tests/test_attention_compile.py``). ``out``:
    ``(o, lse)`` to write instead of new buffers (``lse`` None without ``return_lse``).
    ``flagged``: every program writes its tile's non-finite flag into a new int32 buffer
    of one entry per program (the last positional argument), for :func:`prepare_guard`.
    ``descales``, ``out_dtype``: an FP8 call's (:func:`attention_forward`).
    """
    B, HQ, NQ, D = q.shape
    HK, NK, DV = k.shape[1], k.shape[2], v.shape[3]
    varlen = cu_seqlens_q is not None
    n_seq = cu_seqlens_q.shape[0] - 1 if varlen else B
    # (packed rows of unknown lengths, None: the packed lengths bound every sequence's)
    seq_q = max_seqlen_q if varlen and max_seqlen_q is not None else NQ
    seq_k = max_seqlen_k if varlen and max_seqlen_k is not None else NK
    if out is not None:
        o, lse = out
    else:
        o = _alloc((B, HQ, NQ, DV), dtype=out_dtype or q.dtype, device=q.device)
        lse = _alloc((B, HQ, NQ), dtype=torch.float32, device=q.device) if return_lse else None
    if B == 0 or HQ == 0 or NQ == 0 or n_seq == 0:
        return o, lse, None
    fp8 = descales is not None
    BD, BDV = block_dims(D, DV, least=32 if fp8 else 16)
    step = tile_step_functions(ATTENTION2, scale="score", shift=True)
    cfg = config or default_config(q, D, DV, causal=right is not None)
    if fp8 and cfg.block_n < 32:
        cfg = replace(cfg, block_n=32)         # P V's reduction: 32 at least for 8 bits
    if block_mask is not None:
        sm, sn = block_mask.BLOCK_SIZE
        # kernel tiles must divide the block-mask tiles
        cfg = replace(cfg, block_m=min(cfg.block_m, sm), block_n=min(cfg.block_n, sn))
    if fp8 and not keys_contiguous(v):
        raise ValueError("an FP8 v must be stored keys-contiguous (v.stride(2) == 1: the "
                         "transpose of a (B, Hk, Dv, Nk) tensor), as flashfold.attention "
                         "passes it")
    # an FP8 v is addressed through its transpose, (B, Hk, Dv, Nk), keys innermost; packed
    # sequences start at any key, which TMA cannot take as an innermost coordinate (its
    # start must be 16-byte aligned): they load through pointers
    use_tma = (cfg.use_tma and tma_ok(q, k, v.transpose(2, 3) if fp8 else v)
               and not (fp8 and varlen))
    if not use_tma and cfg.num_stages > 2:
        # pointer loads keep their addresses in registers: a third stage, or 4 warps on
        # 64-row tiles, spills at 255 registers with every feature on (sm_90, d128)
        cfg = replace(cfg, num_stages=2, num_warps=max(cfg.num_warps, 8 if cfg.block_m >= 64 else 4))
    if use_tma:
        desc_q = _desc(q, cfg.block_m, BD)
        desc_k = _desc(k, cfg.block_n, BD)
        desc_v = (_desc(v, BDV, cfg.block_n, keys_inner=True) if fp8
                  else _desc(v, cfg.block_n, BDV))
    else:
        desc_q, desc_k, desc_v = q, k, v

    # the scale inside the scores (:func:`_scores`): scale / c with a softcap, else scale
    has_softcap = softcap is not None
    has_mod = score_mod is not None
    qk_scale = scale / softcap if has_softcap else scale
    sargs = score_mod.buffer_args(q.device) if has_mod else ()
    if block_mask is not None:
        bmk = block_mask
        margs = bmk.row_mod.buffer_args(q.device)
        Bm, Hm = bmk.state.shape[0], bmk.state.shape[1]
        nM, nN = bmk.state.shape[2], bmk.state.shape[3]
        tables = [bmk.partial_num, bmk.partial_idx, bmk.full_num, bmk.full_idx]
        strides = [Hm * nM if Bm > 1 else 0, nM if Hm > 1 else 0,
                   Hm * nM * nN if Bm > 1 else 0, nM * nN if Hm > 1 else 0, nN]
        sparse = bmk.BLOCK_SIZE
        mask_fn = bmk.row_mod.triton_fn()
    else:
        margs = ()
        tables = [None, None, None, None]
        strides = [0, 0, 0, 0, 0]
        sparse = (cfg.block_m, cfg.block_n)
        full_needs_mask = False
        mask_fn = None
    num_m = -(-seq_q // cfg.block_m)
    grid = (num_m * n_seq * HQ,)
    def rows(t):       # (batch, head, row, dim) strides; packed sequences: batch stride 0
        return (0 if varlen else t.stride(0), *t.stride()[1:])
    args = [
        q, k, v, o, lse, desc_q, desc_k, desc_v, rows(q), rows(k), rows(v), rows(o),
        ((0 if varlen else lse.stride(0)), lse.stride(1)) if return_lse else (0, 0),
        num_m, HQ, HQ // HK, seq_q, seq_k, cu_seqlens_q, cu_seqlens_k,
        qk_scale, float(softcap) if has_softcap else 1.0,
        int(left) if left is not None else 0, int(right) if right is not None else 0,
        tuple(tables), *strides,
        score_mod.triton_fn() if has_mod else None, sargs,
        mask_fn, margs,
        *gluon_fwd._fp8_args(q, descales, out_dtype)[2:],     # DESCALES, their strides
        # one non-finite flag per program, for the guard; a varlen program past its
        # sequence returns without writing its flag, so those start at zero
        plans.new((grid[0],), dtype=torch.int32, device=q.device, zero=varlen) if flagged else None,
    ]
    kwargs = dict(
        HEAD_DIM=D, HEAD_DIM_V=DV, BLOCK_D=BD, BLOCK_DV=BDV,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPARSE_M=sparse[0], SPARSE_N=sparse[1],
        MASK_LEFT=left is not None, MASK_RIGHT=right is not None, HAS_SOFTCAP=has_softcap,
        HAS_SCORE_MOD=has_mod, HAS_BLOCK_MASK=block_mask is not None,
        FULL_NEEDS_MASK=full_needs_mask, IS_VARLEN=varlen, USE_TMA=use_tma,
        RETURN_LSE=return_lse, REVERSE_M=right is not None,
        INTERPRET=_interpreting() if interpret is None else interpret,
        STRICT=False, FLAGGED=bool(flagged), STEP=step.tile_step,
        FINALIZE=step.finalize_rows, FP8=fp8, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return o, lse, (grid, args, kwargs)


#: most flags one guard program reads (:func:`prepare_guard`)
GUARD_CHUNK = 16


def prepare_guard(q, k, v, o, lse, flags, *, flag_rows=FLAG_ROWS, slots=False, config=None,
                  interpret=None, **options):
    """The strict guard of a forward that may let hidden values through (``0 x NaN`` in a
    masked tile's ``P V``): ``(_attn_fwd_guard, grid, args, kwargs)``, overwriting ``o``
    and ``lse`` (None without the LSE) in the ``flag_rows``-row tiles whose ``flags``
    entry (int32, ``(sequences x Hq x ceil(seq_q / flag_rows),)``, head-major) is nonzero,
    with the Triton template's strict result. ``slots`` (packed sequences): the flags are
    ``(Hq x (Nq // flag_rows + sequences),)`` by slot instead (:func:`flag_count`, the Gluon
    kernel's layout). ``options``: the call's, as :func:`prepare_forward` takes them
    (``scale``, window, mods, varlen...).

    The flags come from the Gluon kernel's epilogue (64 rows) or the Triton template's
    (``prepare_forward(flagged=True)``, ``flag_rows`` its ``BLOCK_M``). Each program reads
    ``chunk`` flags (a power of two <= :data:`GUARD_CHUNK`, about two programs per SM)
    and returns when they are clear: with finite inputs the launch costs its start and
    one load per program."""
    HQ = q.shape[1]
    varlen = options.get("cu_seqlens_q") is not None
    n_seq = options["cu_seqlens_q"].shape[0] - 1 if varlen else q.shape[0]
    if slots:
        assert varlen
        tiles = q.shape[2] // flag_rows + n_seq
        n_flags = HQ * tiles
    else:
        rows = options["max_seqlen_q"] if varlen else None
        tiles = -(-(q.shape[2] if rows is None else rows) // flag_rows)
        n_flags = n_seq * HQ * tiles
    assert flags.numel() == n_flags and flags.dtype == torch.int32
    cfg = config or default_config(q, q.shape[3], v.shape[3],
                                   causal=options.get("right") is not None)
    if flag_rows % cfg.block_m:
        cfg = replace(cfg, block_m=flag_rows)
    _, _, (_, args, kwargs) = prepare_forward(
        q, k, v, return_lse=lse is not None, config=cfg, interpret=interpret, out=(o, lse),
        **options)
    assert flag_rows % kwargs["BLOCK_M"] == 0
    sms = gluon_fwd.num_sms(q)
    chunk = 1 << max(0, min(GUARD_CHUNK, max(1, n_flags // (2 * sms))).bit_length() - 1)
    kwargs = dict(kwargs, STRICT=True, CHUNK=chunk, FLAG_ROWS=flag_rows, SLOTS=slots)
    return _attn_fwd_guard, (-(-n_flags // chunk),), [flags, n_flags, tiles, n_seq, *args], kwargs


def flag_count(q_rows: int, heads: int, sequences: int, varlen: bool) -> int:
    """Entries of the non-finite flags of the Gluon forward (:func:`prepare_guard`): one
    per 64-row group (:data:`FLAG_ROWS`) of each ``(batch, head)``; packed sequences by
    slot, ``heads x (q_rows // 64 + sequences)`` over ``q_rows`` packed rows, whatever
    the lengths (a CUDA-graph capture does not know them)."""
    if varlen:
        return heads * (q_rows // FLAG_ROWS + sequences)
    return sequences * heads * -(-q_rows // FLAG_ROWS)


__all__ = ["attention_forward", "prepare_forward", "prepare_guard", "FwdConfig", "default_config",
           "tma_ok", "keys_contiguous", "HOPPER_CONFIGS", "FLAG_ROWS", "LOG2E",
           "LN2", "plan_cache_info", "plan_cache_clear"]


# --- plan cache -------------------------------------------------------------------------

#: entries the plan cache holds; when full it is dropped wholesale
PLAN_CACHE_SIZE = 256
#: :func:`attention_forward`'s plans, bypassed while any global that :func:`_plan` reads
#: here, in :mod:`.gluon_fwd` or in the dispatch table (heuristics, the allocator, the
#: Gluon scope, which tests monkeypatch) differs from what it was at import; the policy
#: is part of each plan's key
_CACHE = plans.PlanCache("attention forward", globals(), (_plan,),
                         modules=(gluon_fwd, dispatch))


def plan_cache_info() -> dict:
    """Hits and misses of the forward's plan cache since it was last cleared, and its
    entries."""
    return _CACHE.info()


def plan_cache_clear():
    """Drop every cached forward plan and zero the counters."""
    _CACHE.clear()
