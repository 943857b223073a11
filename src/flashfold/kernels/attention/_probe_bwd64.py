"""TEMPORARY compile-only probe (fourteenth session; removed in the next commit): the
Gluon backward as 64-key CTAs of ONE consumer warpgroup and the producer warp, meant to
run two CTAs per SM (see benchmarks/RESULTS.md, backward, Open problems). Not run:
only compiled for sm_90 to read registers, spills and shared memory."""

from __future__ import annotations

from .. import launcher
from ..tma import addressable
from . import gluon_bwd, gluon_fwd
from .gluon_bwd import _program, _query_tile, _bwd_producer
from .gluon_fwd import CONSUMER_REGS, LOG2E, MAXNREG, PRODUCER_REGS, _desc, gluon

#: whether this Triton has what :func:`_tma_reduce_add` uses (3.6 does)
HAS_TMA_REDUCE = False
if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

    from .gluon_fwd import _wgmma_layout

    try:  # private API (see _tma_reduce_add): another Triton may move it; then no Gluon path
        from triton._C.libtriton import gluon_ir as _gluon_ir
        from triton._C.libtriton import ir as _ir
        from triton.experimental.gluon.language._core import builtin as _builtin
        HAS_TMA_REDUCE = hasattr(_gluon_ir.GluonOpBuilder, "create_async_tma_reduce")
    except (ImportError, AttributeError):
        pass

if HAS_TMA_REDUCE:

    @_builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """``global[coord] += src`` for a shared-memory tile through TMA
        (``cp.reduce.async.bulk.tensor ... .add``; completes like a TMA store:
        ``tma.store_wait``). Gluon 3.6's builder has the op (``create_async_tma_reduce``)
        but its Python API does not wrap it yet."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD,
                                                  tensor_desc.handle, coord, src.handle)


BLOCK_M = 64
BLOCK_N = 64
#: registers: two CTAs of 8 warps (the producer's warp rounded up to a warpgroup) share
#: the register file: 128 per thread at launch; the consumer gets (128*8 - 24*4)/4 = 232
MAXNREG64 = 128

if gluon is not None:

    @gluon.jit
    def _consumer64(descs, bufs, bars, shape, ptrs, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                    CAUSAL: gl.constexpr, DQ_SPLIT: gl.constexpr, DQ_BUFS: gl.constexpr,
                    DK_FIRST: gl.constexpr, ADD_DQ: gl.constexpr):
        """All 64 keys of the tile; per step S^T, dP^T, dV, dS^T -> smem, dQ = dS K (all
        HEAD_DIM columns, DQ_SPLIT products of HEAD_DIM / DQ_SPLIT), dK; dQ added by TMA
        reduce-adds in the same step (no second warpgroup to wait for)."""
        q_desc, k_desc, v_desc, do_desc, dq_desc, lam_desc, dd_desc = descs
        k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, lam_bufs, dd_bufs = bufs
        kv_ready, q_ready, q_empty, ds_ready, ds_empty = bars
        q_len, kv_len, heads_k, group, n_n, wave_heads, n_bh = shape
        DK, DV, qk_scale, scale = ptrs
        DQ_COLS: gl.constexpr = HEAD_DIM // DQ_SPLIT
        dtype: gl.constexpr = q_desc.dtype
        s_layout: gl.constexpr = _wgmma_layout(BLOCK_M)
        acc_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
        dq_layout: gl.constexpr = _wgmma_layout(DQ_COLS)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                     k_width=2)
        b, hk, n, m_lo, m_0 = _program(shape, BLOCK_M, BLOCK_N, CAUSAL)
        k_w = k_smem.reshape([BLOCK_N, HEAD_DIM])
        v_w = v_smem.reshape([BLOCK_N, HEAD_DIM])
        keys = n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        first_key = keys - (kv_len - q_len)
        key_ok = keys < kv_len
        qcols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
        dq_zero = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout)
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        n_m = gl.cdiv(q_len, BLOCK_M)
        mbarrier.wait(kv_ready, 0)
        j = 0
        for g in range(group):
            hq = hk * group + g
            for i in range(m_lo, n_m):
                m = _query_tile(i, m_lo, m_0, n_m)
                slot = j % STAGES
                mbarrier.wait(q_ready.index(slot), (j // STAGES) & 1)
                q_s = q_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
                do_s = do_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
                st = warpgroup_mma(k_w, q_s.permute((1, 0)), s_zero, use_acc=False,
                                   is_async=True)
                dpt = warpgroup_mma(v_w, do_s.permute((1, 0)), s_zero, use_acc=False,
                                    is_async=True)
                lam = lam_bufs.index(slot).reshape([BLOCK_M]).load(gl.SliceLayout(0, s_layout))
                st = warpgroup_mma_wait(1, deps=[st])
                p = gl.exp2(st * qk_scale - lam[None, :])
                if CAUSAL:
                    p = gl.where(first_key[:, None] <= m * BLOCK_M + qcols[None, :], p, 0.0)
                else:
                    p = gl.where(key_ok[:, None], p, 0.0)
                pa = gl.convert_layout(p.to(dtype), a_layout)
                dv = warpgroup_mma(pa, do_s, dv, is_async=True)
                dd = dd_bufs.index(slot).reshape([BLOCK_M]).load(gl.SliceLayout(0, s_layout))
                dpt = warpgroup_mma_wait(1, deps=[dpt])
                ds = p * (dpt - dd[None, :])
                dsa = gl.convert_layout(ds.to(dtype), a_layout)
                ds_smem = ds_bufs.index(0)
                ds_smem.store(ds.to(dtype))
                fence_async_shared()
                if DK_FIRST:
                    dk = warpgroup_mma(dsa, q_s, dk, is_async=True)
                for c in gl.static_range(DQ_SPLIT):
                    k_cols = k_w.slice(c * DQ_COLS, DQ_COLS, dim=1)
                    dq = warpgroup_mma(ds_smem.permute((1, 0)), k_cols, dq_zero,
                                       use_acc=False, is_async=True)
                    if DK_FIRST:
                        if c == 0:
                            dq, dv = warpgroup_mma_wait(0, deps=[dq, dv])
                        else:
                            dq = warpgroup_mma_wait(0, deps=[dq])
                    elif c == 0:   # dK after the first dQ part: it runs while dQ is stored
                        dk = warpgroup_mma(dsa, q_s, dk, is_async=True)
                        dq, dv = warpgroup_mma_wait(1, deps=[dq, dv])
                    else:        # in-order completion: this waits for dK too
                        dq = warpgroup_mma_wait(0, deps=[dq])
                    if ADD_DQ:     # (off: timing only, dQ left out)
                        dq_smem = dq_bufs.index(c % DQ_BUFS)
                        tma.store_wait(DQ_BUFS - 1)
                        dq_smem.reshape([BLOCK_M, DQ_COLS]).store(dq)
                        fence_async_shared()
                        _tma_reduce_add(dq_desc, [b, hq, m * BLOCK_M, c * DQ_COLS], dq_smem)
                dk = warpgroup_mma_wait(0, deps=[dk])
                mbarrier.arrive(q_empty.index(slot), count=1)
                j += 1
        row0 = n * BLOCK_N
        out_rows = row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
        dcols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
        kv_base = (b * heads_k + hk).to(gl.int64) * kv_len
        offs = (kv_base + out_rows)[:, None] * HEAD_DIM + dcols[None, :]
        ok = (out_rows < kv_len)[:, None]
        gl.store(DK + offs, (dk * scale).to(dtype), mask=ok)
        gl.store(DV + offs, dv.to(dtype), mask=ok)
        tma.store_wait(0)

    @gluon.jit
    def _attn_bwd64(q_desc, k_desc, v_desc, do_desc, dq_desc, lam_desc, dd_desc, DK, DV,
                    q_len, kv_len, heads_k, group, n_n, wave_heads, n_bh, qk_scale, scale,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                    STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_SPLIT: gl.constexpr,
                    DQ_BUFS: gl.constexpr, DK_FIRST: gl.constexpr, ADD_DQ: gl.constexpr,
                    PRODUCER_REGS: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
        q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape,
                                           q_desc.layout)
        do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape,
                                            do_desc.layout)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M],
                                                                        dtype)
        ds_bufs = gl.allocate_shared_memory(dtype, [1, BLOCK_N, BLOCK_M], ds_layout)
        dq_bufs = gl.allocate_shared_memory(gl.float32, [DQ_BUFS] + dq_desc.block_type.shape,
                                            dq_desc.layout)
        lam_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + lam_desc.block_type.shape,
                                             lam_desc.layout)
        dd_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + dd_desc.block_type.shape,
                                            dd_desc.layout)
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_ready, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=1)
        descs = (q_desc, k_desc, v_desc, do_desc, dq_desc, lam_desc, dd_desc)
        bufs = (k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, lam_bufs, dd_bufs)
        bars = (kv_ready, q_ready, q_empty, ds_ready, ds_empty)
        shape = (q_len, kv_len, heads_k, group, n_n, wave_heads, n_bh)
        ptrs = (DK, DV, qk_scale, scale)
        gl.warp_specialize([
            (_consumer64, (descs, bufs, bars, shape, ptrs, BLOCK_M, BLOCK_N, HEAD_DIM,
                           STAGES, CAUSAL, DQ_SPLIT, DQ_BUFS, DK_FIRST, ADD_DQ)),
            (_bwd_producer, (descs, bufs, bars, shape, BLOCK_M, BLOCK_N, STAGES, CAUSAL)),
        ], [1], [PRODUCER_REGS])
        mbarrier.invalidate(kv_ready)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(q_ready.index(i))
            mbarrier.invalidate(q_empty.index(i))


def bwd64(q, k, v, do, lam, dd, dq_acc, dk, dv, *, causal, scale, stages=1, dq_split=2,
          dq_bufs=2, dk_first=False, add_dq=True, num_sms=132):
    """(kernel, grid, args, kwargs) of the probe kernel (launch=False only)."""
    B, Hq, Nq, D = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    n_n = -(-Nk // BLOCK_N)
    args = (_desc(q, BLOCK_M), _desc(k, BLOCK_N), _desc(v, BLOCK_N), _desc(do, BLOCK_M),
            _desc(dq_acc, BLOCK_M, D // dq_split), _desc(lam.unsqueeze(2), 1, BLOCK_M),
            _desc(dd.unsqueeze(2), 1, BLOCK_M), dk, dv, Nq, Nk, Hk, Hq // Hk, n_n,
            gluon_bwd.wave_heads(causal, n_n, B * Hk, 2 * num_sms), B * Hk,
            float(scale) * LOG2E, float(scale))
    kwargs = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=D, STAGES=stages,
                  CAUSAL=bool(causal), DQ_SPLIT=dq_split, DQ_BUFS=dq_bufs, DK_FIRST=dk_first, ADD_DQ=add_dq,
                  PRODUCER_REGS=PRODUCER_REGS,
                  num_warps=4, maxnreg=MAXNREG64)
    return _attn_bwd64, (n_n * B * Hk,), args, kwargs
