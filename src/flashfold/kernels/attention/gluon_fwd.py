r"""Exact attention, forward, for Hopper (sm_90): a warp-specialized Gluon kernel.

Same math as :mod:`.fwd` (the ATTENTION monoid's state ``(m, l, acc)`` in base 2, finite
rescale pivot, ``o = acc / l``, ``lse = (m + log2 l) ln 2``), with the schedule of
FlashAttention-3 written out explicitly, which Triton 3.6 does not derive from the
``tl.dot`` kernel on sm_90 (see ``docs/notes/attention_fwd.md``, "Why a Gluon kernel: the
Triton template's ceiling"). Three partitions per program (``gl.warp_specialize``):

* **a producer warp** (``_producer``, 24 registers) issues every TMA load: a work item's
  two 64-row query halves, then its key and value tiles into ``STAGES``-deep rings, each
  slot guarded by a ``ready`` mbarrier (TMA bytes arrived) and an ``empty`` one (both
  consumers' ``wgmma`` that read it have completed, count 2);
* **two consumer warpgroups** (``_consumer``: the default partition and a worker, 4 warps
  and 240 registers each, 64 query rows each of a ``BLOCK_M = 128`` tile) never issue a
  global load. They are separate partitions so that each synchronizes only its own 128
  threads: in one 8-warp partition every mbarrier arrive came with a barrier over both
  warpgroups, which held them in lockstep (0.80-0.87x cuDNN at head_dim 128, against
  0.98-1.07x split). Per key tile ``j`` each overlaps its tensor-core work with its
  softmax:

  .. code-block:: text

      S_j   = Q K_j^T                (wgmma, async)
      acc  += P_{j-1} V_{j-1}        (wgmma, async, P from registers)
      wait until S_j is done         (PV still running)
      m, l, P_j from S_j             (exp2 on the SFU while the PV wgmma runs)
      wait until PV is done; acc *= alpha_j

  then writes ``o = acc / l`` through its own shared-memory buffer and a TMA store. On
  causal calls the epilogue also writes one int32 flag per 64 rows, nonzero where ``o``
  holds a non-finite entry: a diagonal tile's ``P V`` meets hidden keys' values (``0 x
  NaN``), and the strict Triton guard that follows recomputes the flagged rows (rule 1 of
  :mod:`flashfold.api.attention`; :func:`.fwd.prepare_guard`). The key loop is unchanged.
  Finalize reads the empty row from ``l = 0`` only: a NaN ``l`` (a NaN or ``+inf``
  visible score) gives NaN ``o`` and ``lse``.

Work items are query tiles ``(bh, m)``. A grid of one program per SM takes them in
rounds (persistent): the producer loads the next item's query tile once both consumers
have computed the last ``S`` of the previous one (``q_empty``), so loads overlap the
epilogue. Causal items differ in cost, and long causal sequences run one program per
item instead (:func:`persistent_default`).

Scope (the dispatcher in :mod:`.fwd` sends everything else to the Triton template):
fp16/bf16, head_dim 64 or 128, dense or causal (bottom-right aligned, ``Nq <= Nk``),
GQA, ``scale > 0``, no window, softcap, mods or varlen; ``q``, ``k``, ``v`` as ``(B, H,
N, D)`` with unit last stride and 16-byte aligned strides (4-D TMA descriptors: rows past
a head's end read as zero and are not written). Returns ``o (B, Hq, Nq, D)`` contiguous
in the input dtype and ``lse (B, Hq, Nq)`` float32. ``FLASHFOLD_GLUON=0`` turns the
path off.

GPU only: Gluon kernels have no interpreter mode. The CPU suite compiles every variant
for sm_90 (``tests/test_attention_gluon.py``: warp specialization, TMA, wgmma, per-
warpgroup barriers, key loops free of local memory); correctness against float64 runs
on the H200 (the same file's ``gpu`` tests, ``benchmarks/attention.py``).
"""

from __future__ import annotations

import functools
import math

import torch

from .. import compat, launcher
from ..compat import (GluonDescriptor, fence_async_shared, gl, gluon, mbarrier, tma,
                      warp_specialize, warpgroup_mma, warpgroup_mma_wait)
from ..tma import addressable, box_strides

LOG2E = 1.4426950408889634

#: query rows per program (two consumer warpgroups of 64 rows)
BLOCK_M = 128
#: key rows per tile
BLOCK_N = 128
#: depth of the key and value rings
STAGES = 2
#: causal calls run persistent while a round of work items spans at least this many
#: heads (see :func:`persistent_default`)
CAUSAL_HEADS_PER_ROUND = 4
#: calls whose work items average at most this many key tiles ping-pong the two consumer
#: warpgroups (see :func:`pingpong_default`)
PINGPONG_MAX_TILES = 24
#: registers of the second consumer warpgroup (a worker partition; the first, the
#: default partition, gets what the cap leaves: (168 * 12 - 240 * 4 - 24 * 4) / 4 = 240)
CONSUMER_REGS = 240
#: registers of the producer warp (the minimum ``setmaxnreg`` allows)
PRODUCER_REGS = 24
#: register cap of the whole kernel: 12 warps (two consumer warpgroups, the producer's
#: warp rounded up to a warpgroup) x 32 threads x 168 <= 65,536
MAXNREG = 168

__all__ = ["supported", "eligible", "on_hopper", "gluon_attention_fwd", "persistent_default",
           "pingpong_default", "num_sms", "BLOCK_M", "BLOCK_N"]


if gluon is not None:

    @gluon.constexpr_function
    def _wgmma_layout(n):
        """The register layout of a wgmma accumulator ``[64, n]`` of one warpgroup."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                         instr_shape=[16, n, 16])

    @gluon.jit
    def _rounds(shape, bh_total):
        """How many work items (``n_m x BH`` in all) this program takes.
        Program ``p`` of ``G`` takes one item per round ``i``: item ``i G + p`` in even
        rounds and ``i G + G - 1 - p`` in odd ones (a snake: with items ordered heaviest
        first, each program's sum of work evens out), while the item exists."""
        count = shape[4] * bh_total
        G = gl.num_programs(0)
        p = gl.program_id(0)
        rounds = gl.cdiv(count, G)
        last = rounds - 1
        slot = gl.where(last % 2 == 0, p, G - 1 - p)
        return gl.where(last * G + slot < count, rounds, last)

    @gluon.jit
    def _tile(i, shape, bh_total, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              CAUSAL: gl.constexpr):
        """This program's item of round ``i`` (see :func:`_rounds`): query tile ``m`` of head
        ``(b, hq)``, its key/value head ``hk``, first row ``q0``, key tiles ``n_kv`` and
        the first tile that needs masking. Items are numbered head-major, ``t = bh * n_m +
        m'``: the query tiles of a head together, so that the programs running at once
        share its keys and values in L2, with ``m' = m`` or, causal, ``n_m - 1 - m``
        (heaviest first)."""
        q_len, kv_len, heads_q, group, n_m = shape
        G = gl.num_programs(0)
        p = gl.program_id(0)
        t = i * G + gl.where(i % 2 == 0, p, G - 1 - p)
        m = t % n_m
        if CAUSAL:
            m = n_m - 1 - m
        bh = t // n_m
        b = bh // heads_q
        hq = bh % heads_q
        q0 = m * BLOCK_M
        causal_off = kv_len - q_len
        if CAUSAL:
            kv_end = gl.minimum(kv_len, q0 + BLOCK_M + causal_off)
            mask_from = gl.minimum((q0 + causal_off + 1) // BLOCK_N, kv_len // BLOCK_N)
        else:
            kv_end = kv_len
            mask_from = kv_len // BLOCK_N
        return b, hq, hq // group, q0, gl.cdiv(kv_end, BLOCK_N), mask_from

    @gluon.jit
    def _producer(descs, bufs, bars, shape, out, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                  RETURN_LSE: gl.constexpr):
        """TMA loads, work item after work item: the two query halves (once both consumer
        warpgroups have released the previous ones: ``q_empty``), then key and value
        tiles into their rings, whose slot and phase count on across items. An ``empty``
        barrier starts out with its phase 1 complete, so the first waits pass at once;
        each slot is released by both consumer warpgroups (count 2)."""
        q_desc, k_desc, v_desc, o_desc = descs
        q_bufs, o_bufs, k_bufs, v_bufs = bufs
        q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn = bars
        rounds = _rounds(shape, out[4])
        it = 0
        for i in range(rounds):
            b, hq, hk, q0, n_kv, mask_from = _tile(i, shape, out[4], BLOCK_M, BLOCK_N, CAUSAL)
            mbarrier.wait(q_empty, (i & 1) ^ 1)
            mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [b, hq, q0, 0], q_ready, q_bufs.index(0))
            tma.async_copy_global_to_shared(q_desc, [b, hq, q0 + BLOCK_M // 2, 0], q_ready,
                                            q_bufs.index(1))
            for j in range(n_kv):
                slot = (it + j) % STAGES
                phase = ((it + j) // STAGES) & 1
                mbarrier.wait(k_empty.index(slot), phase ^ 1)
                mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [b, hk, j * BLOCK_N, 0],
                                                k_ready.index(slot), k_bufs.index(slot))
                mbarrier.wait(v_empty.index(slot), phase ^ 1)
                mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [b, hk, j * BLOCK_N, 0],
                                                v_ready.index(slot), v_bufs.index(slot))
            it += n_kv

    @gluon.jit
    def _masked(s, j, mask_from, last_key, kv_len, BLOCK_N: gl.constexpr,
                CAUSAL: gl.constexpr):
        """``s`` with invisible keys at ``-inf`` on tiles ``j >= mask_from`` (the ragged
        last tile, and the causal diagonal: key ``c`` visible to row ``r`` iff ``c <=
        last_key[r] = r + Nk - Nq``). Causal needs no ``c < Nk`` test: a row ``r < Nq``
        has ``last_key < Nk``, and the rows past ``Nq`` of the last query tile (keys read
        as zeros past ``Nk``) are never written."""
        if j >= mask_from:
            c = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
            if CAUSAL:
                ok = c[None, :] <= last_key[:, None]
            else:
                ok = c[None, :] < kv_len
            s = gl.where(ok, s, -float("inf"))
        return s

    @gluon.jit
    def _take_turn(turn, e, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """Ping-pong: wait until the other warpgroup has issued its wgmma of event ``e - 1``
        (warpgroup 0) or ``e`` (warpgroup 1); ``turn[0]`` starts with one arrival, so
        warpgroup 0 goes first. Events count the issues of both warpgroups in step: an
        item of ``n_kv`` key tiles has ``n_kv + 1`` (``S_0``, ``S_j`` with ``P_{j-1} V``,
        the last ``P V``), so the item of round ``i`` starting at ring position ``it``
        starts at event ``it + i``."""
        if PINGPONG:
            mbarrier.wait(turn.index(WG), e & 1)

    @gluon.jit
    def _pass_turn(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """Ping-pong: this warpgroup's wgmma of the current event are issued."""
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - WG), count=1)

    @gluon.jit
    def _consumer(descs, bufs, bars, shape, out, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                  RETURN_LSE: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """One warpgroup's 64 query rows (half ``WG``) of each work item: fold key tiles
        ``0 .. n_kv`` (``>= 1``) into ``(acc, l, m)`` -- base-2 maxima ``m`` of ``qk *
        qk_scale``, ``l = sum 2^(s - m)``, ``acc = sum 2^(s - m) v`` -- with ``P V`` of
        tile ``j - 1`` running while the softmax of tile ``j`` is computed; then write
        ``o = acc / l`` (staged in this half's output buffer, TMA store) and the LSE."""
        q_desc, k_desc, v_desc, o_desc = descs
        q_bufs, o_bufs, k_bufs, v_bufs = bufs
        q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn = bars
        q_len, kv_len, heads_q, group, n_m = shape
        LSE, stride_lb, stride_lh, qk_scale, bh_total, FLAGS, flag_groups = out
        HALF: gl.constexpr = BLOCK_M // 2
        dtype: gl.constexpr = q_desc.dtype
        s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
        o_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        q = q_bufs.index(WG).reshape([HALF, HEAD_DIM])
        o_smem = o_bufs.index(WG)
        s_zero = gl.zeros([HALF, BLOCK_N], gl.float32, s_layout)

        rounds = _rounds(shape, bh_total)
        it = 0
        for i in range(rounds):
            b, hq, hk, q0, n_kv, mask_from = _tile(i, shape, bh_total, BLOCK_M, BLOCK_N,
                                                   CAUSAL)
            r0 = q0 + WG * HALF
            rows = r0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
            last_key = rows + (kv_len - q_len)
            mbarrier.wait(q_ready, i & 1)

            # key tile 0: S, then its softmax (nothing to overlap with yet)
            slot = it % STAGES
            mbarrier.wait(k_ready.index(slot), (it // STAGES) & 1)
            _take_turn(turn, it + i, WG, PINGPONG)
            s = warpgroup_mma(q, k_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)),
                              s_zero, use_acc=False, is_async=True)
            _pass_turn(turn, WG, PINGPONG)
            s = warpgroup_mma_wait(0, deps=[s])
            mbarrier.arrive(k_empty.index(slot), count=1)
            s = _masked(s, 0, mask_from, last_key, kv_len, BLOCK_N, CAUSAL)
            m = gl.max(s, 1) * qk_scale
            m_use = gl.where(m == -float("inf"), 0.0, m)
            p = gl.exp2(s * qk_scale - m_use[:, None])
            l = gl.sum(p, 1)
            acc = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)

            for j in range(1, n_kv):
                slot = (it + j) % STAGES
                prev = (it + j - 1) % STAGES
                mbarrier.wait(k_ready.index(slot), ((it + j) // STAGES) & 1)
                _take_turn(turn, it + j + i, WG, PINGPONG)
                s = warpgroup_mma(q, k_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)),
                                  s_zero, use_acc=False, is_async=True)
                mbarrier.wait(v_ready.index(prev), ((it + j - 1) // STAGES) & 1)
                pa = gl.convert_layout(p.to(dtype), p_layout)
                acc = warpgroup_mma(pa, v_bufs.index(prev).reshape([BLOCK_N, HEAD_DIM]), acc,
                                    is_async=True)
                _pass_turn(turn, WG, PINGPONG)
                s = warpgroup_mma_wait(1, deps=[s])                   # S_j done, PV running
                mbarrier.arrive(k_empty.index(slot), count=1)
                s = _masked(s, j, mask_from, last_key, kv_len, BLOCK_N, CAUSAL)
                m_new = gl.maximum(m, gl.max(s, 1) * qk_scale)
                m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
                alpha = gl.exp2(m - m_use)
                p = gl.exp2(s * qk_scale - m_use[:, None])
                l = l * alpha + gl.sum(p, 1)
                m = m_new
                acc, pa = warpgroup_mma_wait(0, deps=[acc, pa])
                mbarrier.arrive(v_empty.index(prev), count=1)
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]

            # every S of this item is done: the producer may load the next query tile
            mbarrier.arrive(q_empty, count=1)
            last = (it + n_kv - 1) % STAGES
            mbarrier.wait(v_ready.index(last), ((it + n_kv - 1) // STAGES) & 1)
            pa = gl.convert_layout(p.to(dtype), p_layout)
            _take_turn(turn, it + n_kv + i, WG, PINGPONG)
            acc = warpgroup_mma(pa, v_bufs.index(last).reshape([BLOCK_N, HEAD_DIM]), acc,
                                is_async=True)
            _pass_turn(turn, WG, PINGPONG)
            acc, pa = warpgroup_mma_wait(0, deps=[acc, pa])
            mbarrier.arrive(v_empty.index(last), count=1)
            it += n_kv

            # epilogue: o = acc / l (0 for a row with no visible key), lse in natural log
            l_o = gl.convert_layout(l, gl.SliceLayout(1, o_layout))
            o = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]
            tma.store_wait(0)                  # the previous item's store has read o_smem
            o_smem.reshape([HALF, HEAD_DIM]).store(o.to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(o_desc, [b, hq, r0, 0], o_smem)
            if RETURN_LSE:
                lse = gl.where(l == 0.0, -float("inf"), (m + gl.log2(l)) * 0.6931471805599453)
                gl.store(LSE + b.to(gl.int64) * stride_lb + hq * stride_lh + rows, lse,
                         mask=rows < q_len)
            if CAUSAL:
                # the non-finite flag of these 64 rows (``flag_groups`` per head; 0: off):
                # a diagonal tile's P V meets the values of hidden keys (0 x NaN), so a
                # non-finite o may be a leak, which the strict Triton guard launched
                # after this kernel recomputes (:func:`.fwd.prepare_guard`)
                if flag_groups != 0:
                    if r0 < q_len:
                        rows_o = r0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, o_layout))
                        ok = (gl.abs(o) < float("inf")) | (rows_o >= q_len)[:, None]
                        bad = gl.max(gl.max(gl.where(ok, 0, 1), 1), 0)
                        gl.store(FLAGS + (b * heads_q + hq) * flag_groups + r0 // HALF, bad)
        tma.store_wait(0)

    @gluon.jit
    def _attn_fwd_ws(q_desc, k_desc, v_desc, o_desc, LSE, stride_lb, stride_lh,
                     q_len, kv_len, heads_q, group, bh_total, qk_scale, FLAGS, flag_groups,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                     STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                     RETURN_LSE: gl.constexpr, PINGPONG: gl.constexpr,
                     CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        """Work items (query tile ``m`` of batch x head ``bh``) over a 1-D grid of ``G``
        programs: one item each when ``G`` is the item count, else persistent (``G`` =
        the SM count; rounds in a snake order, :func:`_rounds`), where the producer loads
        the next item while the consumers finish the last one. ``num_warps=4`` (the
        first consumer warpgroup) plus the second consumer and the producer."""
        dtype: gl.constexpr = q_desc.dtype
        q_bufs = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        o_bufs = gl.allocate_shared_memory(dtype, [2] + o_desc.block_type.shape, o_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready, count=1)
        mbarrier.init(q_empty, count=2)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        if PINGPONG:
            mbarrier.arrive(turn.index(0), count=1)   # warpgroup 0 issues first

        descs = (q_desc, k_desc, v_desc, o_desc)
        bufs = (q_bufs, o_bufs, k_bufs, v_bufs)
        bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn)
        shape = (q_len, kv_len, heads_q, group, gl.cdiv(q_len, BLOCK_M))
        out = (LSE, stride_lb, stride_lh, qk_scale, bh_total, FLAGS, flag_groups)
        warp_specialize([
            (_consumer, (descs, bufs, bars, shape, out, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                         CAUSAL, RETURN_LSE, 0, PINGPONG)),
            (_consumer, (descs, bufs, bars, shape, out, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                         CAUSAL, RETURN_LSE, 1, PINGPONG)),
            (_producer, (descs, bufs, bars, shape, out, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                         CAUSAL, RETURN_LSE)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        mbarrier.invalidate(q_ready)
        mbarrier.invalidate(q_empty)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_ready.index(i))
            mbarrier.invalidate(k_empty.index(i))
            mbarrier.invalidate(v_ready.index(i))
            mbarrier.invalidate(v_empty.index(i))
        for i in gl.static_range(2):
            mbarrier.invalidate(turn.index(i))


_GL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


@functools.lru_cache(maxsize=None)
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def supported(q, k, v, *, causal: bool = False, scale: float | None = None) -> bool:
    """Whether the kernel's scope covers these tensors, whatever their device: fp16/bf16,
    ``(B, H, N, D)`` with ``D`` 64 or 128 for q, k and v, ``Hq % Hk == 0``, non-empty,
    ``Nq <= Nk`` when causal (every row sees a key), ``scale > 0``, TMA-compatible strides
    and addresses (unit last stride, the others and the base 16-byte aligned)."""
    if q.dtype not in _GL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[-1] not in (64, 128) \
            or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return False
    if scale is not None and not scale > 0:
        return False
    nq, nk = q.shape[2], k.shape[2]
    if q.shape[0] == 0 or q.shape[1] == 0 or nq == 0 or nk == 0 or (causal and nq > nk):
        return False
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        return False
    return all(addressable(t) for t in (q, k, v))


def on_hopper(q: torch.Tensor) -> bool:
    """Whether Gluon kernels may run on ``q``'s device: Gluon present, an sm_90 GPU, and
    ``FLASHFOLD_GLUON`` not ``0`` (which turns every Gluon path off)."""
    if not q.is_cuda or launcher.env("FLASHFOLD_GLUON") == "0":
        return False
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return _is_sm90(index) and compat.gluon_usable()


def eligible(q, k, v, *, causal: bool = False, scale: float | None = None) -> bool:
    """:func:`supported` and :func:`on_hopper` (the caller rules out windows, softcap,
    mods and varlen)."""
    return on_hopper(q) and supported(q, k, v, causal=causal, scale=scale)


def pingpong_default(causal: bool, nq: int, nk: int) -> bool:
    """Whether the two consumer warpgroups ping-pong: each issues its wgmma only after the
    other has issued its own for the previous event (two mbarriers), so that one
    warpgroup's softmax runs while the other's products hold the tensor cores.

    Each warpgroup already overlaps its softmax with its own ``P V`` product, except on
    an item's first key tile (``S_0`` alone, then its softmax) and last ``P V``; ping-pong
    fills those gaps with the other warpgroup's work, and costs a wait per tile
    everywhere. So items averaging at most ``PINGPONG_MAX_TILES`` key tiles ping-pong.
    Measured (H200, against no ping-pong): 1K dense (8 tiles per item) +2%, 4K causal
    (16.5 on average) +1-5.5%, 4K dense (32) -3.5% at head_dim 128, 16K (64-128) 0 to
    -1.3%; ``docs/notes/attention_fwd.md``, "Warpgroup ping-pong"."""
    mean = (nk - nq + (nq + BLOCK_M) / 2) / BLOCK_N if causal else nk / BLOCK_N
    return mean <= PINGPONG_MAX_TILES


def persistent_default(causal: bool, n_m: int, sms: int) -> bool:
    """Whether a call runs persistent (one program per SM taking work items in snake
    rounds) rather than one program per item (the hardware's block scheduler then
    balances the items as they finish).

    Dense items all cost the same: persistent (H200, head_dim 128: +4-12% at N = 1K-16K
    over one program per item, the next item's loads overlapping the last one's
    epilogue). Causal items cost ``m + 1`` key tiles: a head contributes a sawtooth of
    weights ``n_m .. 1`` and the snake evens out a program's sum only when one round
    (``sms`` items) spans several heads. So causal calls go persistent while ``sms >=
    CAUSAL_HEADS_PER_ROUND * n_m``. Measured (H200, head_dim 128): at 4K (``n_m = 32``, 4
    heads per round) persistent 564-571 TFLOP/s against 493-513 per item; at 16K (``n_m =
    128``, one head per round) 467-472 against 580-618; ``docs/notes/attention_fwd.md``,
    "Persistent programs and the order of work items"."""
    return not causal or sms >= CAUSAL_HEADS_PER_ROUND * n_m


@functools.lru_cache(maxsize=None)
def _layout(block: tuple, dtype: torch.dtype):
    """The shared-memory layout of a TMA block (a frozen, hashable value): computing it
    took ~60% of the host time of a call (~37 us per descriptor under cProfile on the dev
    machine), so it is computed once per block shape and dtype."""
    name = "float32" if dtype == torch.float32 else _GL_DTYPES[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, name))


def num_sms(q: torch.Tensor) -> int:
    """SMs of ``q``'s GPU (132, an H100/H200's, for CPU tensors: compile checks)."""
    return launcher.sm_count(q.device) if q.is_cuda else 132


def _desc(t: torch.Tensor, rows: int, cols: int | None = None):
    """A 4-D TMA descriptor over ``t (B, H, N, D)`` with ``[1, 1, rows, cols]`` blocks
    (``cols``: all of ``D`` by default)."""
    block = (1, 1, rows, cols or t.shape[-1])
    return GluonDescriptor(t, list(t.shape), box_strides(t), list(block),
                           _layout(block, t.dtype))


def gluon_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        causal: bool = False, scale: float | None = None,
                        return_lse: bool = False, out: torch.Tensor | None = None,
                        lse: torch.Tensor | None = None, launch: bool = True,
                        persistent: bool | None = None, pingpong: bool | None = None,
                        flags: torch.Tensor | None = None):
    """``(o, lse)`` for ``q (B, Hq, Nq, D)``, ``k, v (B, Hk, Nk, D)``: ``o (B, Hq, Nq, D)``
    in the input dtype, ``lse (B, Hq, Nq)`` float32 natural log (``None`` without
    ``return_lse``). ``out`` / ``lse``: contiguous buffers to write (else allocated).
    The caller checks :func:`eligible`. ``launch=False`` returns the kernel, its grid,
    positional and keyword arguments instead (compile checks).

    ``flags`` (causal only): int32 ``(B * Hq * ceil(Nq / 64),)``, every entry written:
    nonzero where those 64 rows of ``o`` hold a non-finite entry. A causal diagonal tile
    lets a hidden key's NaN or inf value through its ``P V`` (0 x NaN); the forward's
    dispatch (:func:`.fwd.attention_forward`) follows this kernel with the strict guard
    (:func:`.fwd.prepare_guard`) that recomputes the flagged rows. Without ``flags`` the
    kernel's output is FlashAttention's (a hidden value of a diagonal tile may reach a
    row). Dense calls need none: every key a tile loads is visible or, past ``Nk``, read
    as zero by the 4-D descriptors."""
    B, Hq, Nq, D = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    o = torch.empty((B, Hq, Nq, D), device=q.device, dtype=q.dtype) if out is None else out
    if return_lse and lse is None:
        lse = torch.empty((B, Hq, Nq), device=q.device, dtype=torch.float32)
    if not return_lse:
        lse = None
    lse_arg = lse if return_lse else o
    if pingpong is None:
        pingpong = pingpong_default(causal, Nq, Nk)
    args = (_desc(q, BLOCK_M // 2), _desc(k, BLOCK_N), _desc(v, BLOCK_N),
            _desc(o, BLOCK_M // 2), lse_arg,
            lse.stride(0) if return_lse else 0, lse.stride(1) if return_lse else 0,
            Nq, Nk, Hq, Hq // Hk, B * Hq, float(scale) * LOG2E,
            o if flags is None else flags, 0 if flags is None else -(-Nq // (BLOCK_M // 2)))
    kwargs = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=D, STAGES=STAGES,
                  CAUSAL=bool(causal), RETURN_LSE=bool(return_lse), PINGPONG=bool(pingpong),
                  CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4,
                  maxnreg=MAXNREG)
    n_m = -(-Nq // BLOCK_M)
    sms = num_sms(q)
    if persistent is None:
        persistent = persistent_default(causal, n_m, sms)
    grid = (min(n_m * B * Hq, sms) if persistent else n_m * B * Hq,)
    if not launch:
        return _attn_fwd_ws, grid, args, kwargs
    launcher.launch(_attn_fwd_ws, grid, args, kwargs)
    return o, lse
