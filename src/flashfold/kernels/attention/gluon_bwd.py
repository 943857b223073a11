r"""Exact attention, backward, for Hopper (sm_90): a warp-specialized Gluon dK/dV kernel
that also adds dQ.

Same math as :mod:`.bwd` (whose preprocess computes ``D_i = rowsum(dO_i O_i) - dlse_i``
and ``lambda_i = lse_i log2 e``, ``+inf`` for a row without keys, and zeroes the fp32 dQ
accumulator; and whose ``_dq_convert`` writes ``dQ = scale * acc``). One program per key
tile of ``BLOCK_N = 128`` keys of a ``(batch, KV head)`` (causal programs ordered so the
heaviest tiles of a wave's heads start first: :func:`wave_heads`; head_dim-64 dense calls
instead run one persistent program per SM, which takes key tiles in turn:
:func:`persistent_default`); the tile's ``K`` and
``V`` stay in shared memory while the query tiles (``BLOCK_M = 64`` rows) of every query
head of the GQA group stream past. Three partitions (``gl.warp_specialize``):

* **a producer warp** (24 registers) loads ``K``, ``V`` once, then each step's ``Q`` and
  ``dO`` tiles and the rows' ``lambda`` and ``D`` into a ``STAGES``-deep ring (TMA;
  ``ready`` / ``empty`` mbarriers, the latter counting both consumers);
* **two consumer warpgroups** (240 registers each), warpgroup ``w`` owning keys ``64 w ..
  64 w + 63`` of the tile. Per step, transposed tiles (keys x queries, so that ``P^T`` and
  ``dS^T`` are register operands):

  .. code-block:: text

      S^T  = K_w Q^T,  dP^T = V_w dO^T             (two async wgmma)
      P^T  = 2^(S^T scale log2e - lambda)            (0 where causal hides the pair)
      dV_w += P^T dO                                 (async; registers A)
      dS^T = P^T (dP^T - D)
      dS^T -> shared memory (this warpgroup's half of 128 keys x 64 queries), then
      dQ_{j-1}[:, 64 w ..] = dS_{j-1} K[:, 64 w : 64 w + 64]   (async; shared A and B)
      dK_w += dS^T Q                                 (async; registers A), while
      dQ_acc[rows_{j-1}, 64 w ..] += dQ_{j-1}[...]   (TMA reduce-add from shared memory)

  The dQ product is split across the warpgroups by head-dim columns, so each query
  tile's dQ is summed over the 128 keys on chip and added to global memory once per
  step (32 KB per 64 x 128 tile pair, FlashAttention-3's scheme). It needs both
  warpgroups' dS halves, so step ``j`` computes the dQ of step ``j - 1``, whose halves
  were stored a step ago (``ds_ready``, count 2; two buffers, each rewritten only after
  both warpgroups have read it: ``ds_empty``). Computing step ``j``'s own dQ made the
  warpgroups meet at every step, with the tensor cores idle while both stored dS and
  then dQ (H200, whole call: +2-7% at 4K and 16K a step late; ``docs/notes/attention_bwd.md``,
  "dQ one step late"). Step 0 adds the product of a zeroed buffer (zero) to its own rows; the
  last step's dQ is computed while ``dK`` and ``dV`` are written. The add is one
  ``cp.reduce.async.bulk.tensor`` per warpgroup and step: per-thread fp32 atomics
  (``red.global.add``, paired) took 45% of the kernel's time (H200, head_dim 128, 4K
  dense: 363 TFLOP/s with them, 641 without; the note's "dQ accumulation: per-thread
  atomics vs TMA reduce-add"). Storing dQ and adding it still costs ~22% of a step (without
  them: +27% at 4K dense; "What the dQ path costs").
  Head_dim-128 causal programs also make the warpgroups take turns issuing each step's
  first products (:func:`pingpong_default`).

Finally ``dK = scale * sum dS^T Q`` and ``dV`` are written (input dtype): by TMA stores
from the warpgroup's slot of the (then idle) ``Q`` / ``dO`` ring, or, for long dense
programs, from registers (:func:`store_tma`). Causal is
bottom-right aligned (key ``c`` visible to row ``r`` iff ``c <= r + Nk - Nq``): a key
tile starts at the first query tile that sees it and masks the tiles that cross the
diagonal. Dense programs start their walk over the query tiles at different tiles
(:func:`_query_tile`). Rows past ``Nq`` read as zeros (``Q``, ``dO``, and ``lambda``, ``D``
by the TMA's fill): ``S = 0``, ``P = 1``, ``dP = dS = 0``, so they add nothing to
``dK``, ``dV``, and the reduce-add clips their dQ rows. Keys past ``Nk`` read as zeros
and get ``P = 0`` (``2^{-lambda}`` could overflow); their ``dK``, ``dV`` rows are not
written (clipped by the TMA stores, masked otherwise).

Constexpr flags of the one template: ``MASK_LEFT`` / ``MASK_RIGHT``, the window's sides
(causal is a right side of 0; key ``c`` is visible to row ``r`` iff ``r + off - left <=
c <= r + off + right``, ``off = Nk - Nq``): a key tile walks only the query tiles whose
rows see one of its keys (:func:`_program`) and every step selects ``P`` to 0 at hidden
pairs, branch-free, from two per-key row bounds; ``SOFTCAP``: scores ``s = c tanh(x
scale / c)`` recomputed as in the forward (``tanh = 1 - 2 rc``, ``rc = 1 / (2^(x
qk_scale) + 1)``) and ``ds/dx = scale 4 rc (1 - rc)`` folded into ``P`` once ``P^T dO``
is issued; ``BLOCK_D`` (64 or 128, :func:`block_d`) against ``HEAD_DIM``: head dims
below a tile width run padded (TMA reads the columns past ``D`` as zeros and clips them
on the way out; the register stores mask them); head dims 65-96 compute over two column
chunks of their 128-wide tiles, 64 + 16 (up to 80) or 64 + 32: S^T and dP^T reduce over
both, dK and dV are an accumulator of each.

``WIDE`` (head dims past 128, and ``Dv != D``: Gemma's 256, DeepSeek's MLA 192 / 128,
:func:`wide`): two 64 x 256 fp32 accumulators per warpgroup do not fit its 240 registers,
so the warpgroups split the work by output instead of by keys. A program owns
:data:`WIDE_BLOCK_N` = 64 keys; per step of 64 query rows each warpgroup computes the
``S^T`` and ``dP^T`` columns of its 32 rows (64 keys x 32 queries) and stores its halves of
``P^T`` and ``dS^T`` to shared memory; once both halves are there (``ds_ready``,
``DS_RING`` buffers of each, ``ds_empty``), warpgroup 0 adds ``dS^T Q`` into all of ``dK``
and warpgroup 1 ``P^T dO`` into all of ``dV``, and each computes dQ columns ``dS K[:,
cols]`` in pieces of ``DQ_COLS`` (warpgroup 0 up to ``DQ_SPLIT``, warpgroup 1 the rest:
:func:`wide_plan` balances the two), each issued before the one before it is added by a
TMA reduce-add as above. dK and dV leave from registers. The Q / dO ring has two stages;
at 256 / 256 they fit with 32-column dQ pieces and one P / dS buffer of each kind
(shared memory: :func:`wide_plan`). A 192-wide head dim runs in 256-wide tiles whose
products stop at column 192.

Scope (:func:`supported`): fp16/bf16, the forward's head dims (``D = Dv`` up to 256, ``D``
in 129-256 with ``Dv`` in 65-128); up to 128 with ``Dv = D`` the tiles above (the same
template: at tile width 64 the warpgroups own 32 dQ columns each, with no spills, a ring
one stage deeper (:data:`STAGES`) and 133 KB of shared memory, 149 KB in persistent
programs; H200, eager backward at 0.94-1.01x cuDNN's: ``docs/notes/attention_bwd.md``,
"Head_dim 64 on the Gluon kernel"), past that ``WIDE``; dense, causal, windowed (rows
that all see a key: a right bound ``r`` needs ``Nq <= Nk + r``) and soft-capped, GQA, unit
last stride and TMA-compatible strides. By default the order of the dQ adds varies between
runs (last-bit differences), as with the Triton kernels' atomic dQ.

``DETERMINISTIC`` (``deterministic=True``): the same kernel adds dQ in a fixed order, so
that two runs are bitwise equal. Each query tile's column block has a counter
(:func:`dq_counters`); the key tiles that see the tile add into it in the order of their
index, each once the one before has completed its add (:func:`_dq_order`). The consumers
hand each dQ piece to a writer warp of their own (:func:`_dq_hand`, :func:`_dq_writer`:
two more 24-register warps), which waits for the turn, issues the TMA reduce-add and
releases the counter once the add is written; the consumers never wait on global memory.
Programs start in the order they wait in (tile-major), so a program only waits for
programs that started before it (deadlock-free however few fit). Walks are not staggered,
take the query tiles outside and the group's query heads inside in GQA calls without a
left bound (``TILES_OUTSIDE``, :func:`_tiles_outside`), and right-bounded walks go down
from their last query tile, so no program of a KV head reaches a (query head, query
tile) pair before the one before it: each runs one add's latency behind the one before.
Persistent programs where the default mode runs them (the writers walk the program's
key tiles too), launched cooperatively, since a program may wait for a later program's
tile (:func:`_dq_order`); else one program per key tile. H200, eager backward against the default
mode, bf16: head_dim 128 0.92-0.95 (GQA 32:8 causal 0.92, 1K x16 causal 0.86), GQA 32:8
causal window 4096 0.92, head_dim 64 causal 0.96, dense 0.83 (the default's persistent
programs), GQA 16:8 256 causal 0.99, MLA 0.75 (``docs/notes/attention_bwd.md``, "Deterministic backward: dQ adds in turn"); the Triton
deterministic kernels it replaces ran at 0.65-0.78x the default.

Mods (:func:`fits_mods`): ``SCORE_MOD`` (every variant, packed sequences too)
recomputes a traced score_mod's scores with its derivative (:func:`.mods.score_grad_fn`,
lowered to Gluon) in :func:`_probs` and folds the derivative into ``dS``, selected to 0
where ``P`` is; ``MASK_FN`` walks a block mask by key tile: each query head of the group
takes the PARTIAL then the FULL query blocks that the key block's column lists
(:func:`.mods.column_lists`; 128-row blocks, two query tiles each: :func:`_column_walk`),
EMPTY blocks never loaded, and evaluates the mask_mod in the PARTIAL ones only (the
head_dim <= 128 tiles, no packed sequences). Calls with a block mask are scheduled as
windowed ones (uneven programs). H200, backward alone, the workload grid's mod rows (16
heads, 4 x 4096) against the Triton kernels: ALiBi d128 2.47x, prefix-LM d128 2.12x,
causal documents d128 1.76x, at d64 1.86x, 1.53x and 1.21x (``docs/notes/attention_bwd.md``,
"Mods in the Gluon backward").

The dispatch table (:mod:`.dispatch`) sends everything else to the Triton kernels; the
policy's ``gluon`` (``FLASHFOLD_GLUON=0`` by default) turns this path off with the
forward's. GPU only (no interpreter
mode): the CPU suite compiles every variant for sm_90; numerics run on the H200.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...monoids import ATTENTION2
from .. import launcher, plans
from ..codegen import tile_step_functions
from ..compat import HAS_TMA_REDUCE
from ..tma import addressable
from . import gluon_fwd
from .gluon_fwd import CONSUMER_REGS, LOG2E, MAXNREG, PRODUCER_REGS, _desc, gluon
from .mods import column_lists, score_grad_fn, score_grad_gluon_ok

if gluon is not None:
    from ..compat import (fence_async_shared, gl, mbarrier, tma, warp_specialize,
                          warpgroup_mma, warpgroup_mma_wait)
    from ..compat import tma_reduce_add as _tma_reduce_add
    from .gluon_fwd import (_pass_turn, _take_turn, _wgmma_layout, seq_lookup_finish,
                            seq_lookup_issue)

#: query rows per step (one wgmma N of the transposed tiles)
BLOCK_M = 64
#: keys per program (two consumer warpgroups of 64)
BLOCK_N = 128
#: depth of the Q / dO ring by head_dim. A third stage fits both (d128: 226 of 227 KB of
#: shared memory) but helps only d64, whose steps are half as long (H200, kernel alone, 3 /
#: 2 stages: d64 1.00-1.04, d128 0.96-1.03, where ptxas spills 136 bytes against 112;
#: ``docs/notes/attention_bwd.md``, "Q/dO ring depth per head dim")
STAGES = {64: 3, 128: 2}     # by block_d
#: keys per program of the WIDE variant (:func:`wide`)
WIDE_BLOCK_N = 64
#: shared memory a program may use (sm_90: 227 KB), less what the barriers take
SHARED_BYTES = 227 * 1024 - 256
#: dense calls store dK, dV by TMA while a program has at most this many steps
#: (see :func:`store_tma`)
STORE_TMA_MAX_STEPS = 32

__all__ = ["supported", "eligible", "gluon_attention_bwd", "store_tma", "wave_heads", "wide",
           "wide_plan", "pingpong_default", "persistent_default", "late_stats_default", "BLOCK_M", "BLOCK_N"]


if gluon is not None:

    @gluon.jit
    def _query_range(n, q_len, kv_len, left, right, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
                     DETERMINISTIC: gl.constexpr):
        """Key tile ``n``'s query tiles ``[m_lo, m_hi)`` whose rows see a key of it (key
        ``c`` is visible to row ``r`` iff ``r + off - left <= c <= r + off + right``, ``off =
        Nk - Nq``, each side only when bounded) and where its walk over them starts
        (``m_0``, see :func:`_query_tile`; ``DETERMINISTIC`` walks start at their first
        tile)."""
        n_m = gl.cdiv(q_len, BLOCK_M)
        m_lo = 0
        m_hi = n_m
        m_0 = 0
        if MASK_RIGHT:
            m_lo = gl.maximum(n * BLOCK_N - (kv_len - q_len) - right, 0) // BLOCK_M
        if MASK_LEFT:
            last = gl.minimum(n * BLOCK_N + BLOCK_N, kv_len) - 1 - (kv_len - q_len) + left
            # (Triton's // truncates toward zero: a key tile that no row sees, last < 0,
            # gets no step)
            m_hi = gl.maximum(gl.minimum((gl.maximum(last, -BLOCK_M) + BLOCK_M) // BLOCK_M,
                                         n_m), m_lo)
        if not MASK_LEFT and not MASK_RIGHT and not DETERMINISTIC:
            m_0 = (n * (BLOCK_N // BLOCK_M)) % n_m
        return m_lo, m_hi, m_0

    @gluon.jit
    def _program(pid, shape, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
                 DETERMINISTIC: gl.constexpr = False):
        """This program's key tile ``n`` of ``(b, hk)``, the query tiles ``[m_lo, m_hi)``
        whose rows see a key of it and where its walk over them starts (``m_0``):
        :func:`_query_range`. Programs run in groups of ``wave_heads`` heads (the last
        group may have fewer), tile-major inside a group: tile 0 of each of its heads,
        then tile 1, ... (:func:`wave_heads`)."""
        q_len, kv_len, heads_k, group, n_n, wave_heads, n_bh, left, right = shape
        first = (pid // (wave_heads * n_n)) * wave_heads
        heads = gl.minimum(wave_heads, n_bh - first)
        r = pid - first * n_n
        n = r // heads
        bh = first + r % heads
        m_lo, m_hi, m_0 = _query_range(n, q_len, kv_len, left, right, BLOCK_M, BLOCK_N,
                                       MASK_LEFT, MASK_RIGHT, DETERMINISTIC)
        return bh // heads_k, bh % heads_k, n, m_lo, m_hi, m_0

    @gluon.jit
    def _varlen_program(pid, shape, seqs, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
                        WARPS: gl.constexpr):
        """``VARLEN``: program ``pid``'s key tile of packed sequences, ``(valid, hk, n,
        m_lo, m_hi, m_0, s, qs, ks, q_len, kv_len)``: slot ``u = pid % n_n`` of KV head ``hk
        = pid // n_n`` (slots as the forward's, over the keys: ``cu_k[s] // BLOCK_N + s +
        n``, :func:`.gluon_fwd.varlen_slots`; consecutive programs take consecutive key
        tiles of a sequence, which read the same query tiles), its sequence's rows ``qs
        ..`` and keys ``ks ..`` and lengths, and its query range (:func:`_query_range`);
        ``valid`` is false for a slot past its sequence's key tiles. Every partition looks
        the slot up (one program, one tile); ``s`` is the sequence."""
        n_n = shape[4]
        left = shape[7]
        right = shape[8]
        CU_Q, CU_K, n_seqs, levels, top = seqs
        hk = pid // n_n
        s, ks, kv_len, qs, q_len, n = seq_lookup_finish(
            seq_lookup_issue(pid % n_n, CU_K, CU_Q, n_seqs, levels, top, BLOCK_N, WARPS),
            n_seqs, BLOCK_N, WARPS)
        m_lo, m_hi, m_0 = _query_range(n, q_len, kv_len, left, right, BLOCK_M, BLOCK_N,
                                       MASK_LEFT, MASK_RIGHT, False)
        return n < gl.cdiv(kv_len, BLOCK_N), hk, n, m_lo, m_hi, m_0, s, qs, ks, q_len, kv_len

    @gluon.jit
    def _stats_start(s, qs):
        """``VARLEN``: where sequence ``s`` (rows from ``qs``) starts in the row
        statistics (:func:`stats_rows`): a multiple of 4, as TMA needs the start of a
        box's innermost dim 16-byte aligned."""
        return 4 * ((qs + 3) // 4 + s)

    @gluon.jit
    def _query_tile(i, m_lo, m_0, m_hi, DOWN: gl.constexpr = False):
        """Query tile of step ``i`` (``m_lo <= i < m_hi``): the tiles ``m_lo .. m_hi - 1``
        rotated to start at ``m_lo + m_0``. Dense programs of one head would otherwise all
        start at tile 0 and walk in lockstep, adding into the same dQ rows at the same
        time; bounded ones start at their first tile (``m_0 = 0``), already spread (H200:
        dense rows +1-3% at N = 1K-16K; ``docs/notes/attention_bwd.md``, "Staggered walks
        over the query tiles")
        With ``0 <= m_0 < m_hi - m_lo`` (:func:`_program`) one subtraction wraps it: a
        ``%`` by the traced ``m_hi - m_lo`` cost an integer division per step, and in the
        causal kernel (``m_0 = 0``: the identity) its registers spilled 148 -> 64 bytes.
        ``DOWN`` (deterministic calls with a right bound): the tiles from ``m_hi - 1``
        down to ``m_lo``, so that no program of a head reaches a query tile before the
        one before it (see :func:`_dq_order`)."""
        if DOWN:
            return m_lo + m_hi - 1 - i
        x = i + m_0
        return gl.where(x < m_hi, x, x - (m_hi - m_lo))

    @gluon.jit
    def _walk_outer(group, m_lo, m_hi, TILES_OUTSIDE: gl.constexpr):
        """The outer loop's range of a key tile's walk over its (query head ``g`` of the
        group, step ``i`` in ``[m_lo, m_hi)``) pairs: the heads ``[0, group)``, or with
        ``TILES_OUTSIDE`` (:func:`_tiles_outside`: deterministic calls whose groups have
        more than one query head, without a left bound; see :func:`_dq_order`) the steps. The inner loop takes the other
        (:func:`_walk_inner`), :func:`_walk_pair` names the pair. Every partition that
        walks the pairs (producer, consumers, dQ writers) walks them through these three
        with the kernel's ``TILES_OUTSIDE``, so that they agree on the order."""
        if TILES_OUTSIDE:
            lo = m_lo
            hi = m_hi
        else:
            lo = 0
            hi = group
        return lo, hi

    @gluon.jit
    def _walk_inner(group, m_lo, m_hi, TILES_OUTSIDE: gl.constexpr):
        """The inner loop's range of a key tile's walk (see :func:`_walk_outer`): the
        steps ``[m_lo, m_hi)`` (with ``MASK_FN``, of the outer loop's head), or with
        ``TILES_OUTSIDE`` the heads ``[0, group)``."""
        if TILES_OUTSIDE:
            lo = 0
            hi = group
        else:
            lo = m_lo
            hi = m_hi
        return lo, hi

    @gluon.jit
    def _walk_pair(o, u, TILES_OUTSIDE: gl.constexpr):
        """``(g, i)``, query head and step, at outer index ``o`` and inner index ``u`` of
        a key tile's walk (see :func:`_walk_outer`)."""
        if TILES_OUTSIDE:
            g = u
            i = o
        else:
            g = o
            i = u
        return g, i

    @gluon.jit
    def _per_step(m):
        """``m`` through a ``mov`` that the compiler may not move (an asm statement with a
        side effect): the query tile of a ``TILES_OUTSIDE`` walk, the same at each head of
        the inner loop, recomputed at each step with what depends on it (its rows, their
        masks, ...) instead of hoisted out of the heads' loop and kept live across it.
        sm_90 compile, the deterministic GQA variants of the compile tests, spill stores
        without -> with it: causal 468 -> 300 (the consumers' step loops 23 / 27 local
        loads and 2 / 3 stores -> 8 / 14 and none), dense 272 -> 224, ALiBi 748 -> 276, d64
        window 24 -> 0, WIDE 256 causal 224 -> 196."""
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [m], dtype=gl.int32,
                                         is_pure=False, pack=1)

    @gluon.jit
    def _column_walk(bm, b, hq, n):
        """``MASK_FN``: key tile ``n``'s walk for query head ``hq`` of batch ``b`` over the
        query tiles its block mask lists (``bm``, the per-key-block lists of
        :func:`.mods.column_lists` with their strides, :func:`_block_mask_args`): the PARTIAL
        then the FULL query blocks of its key block, each block of 128 rows two query
        tiles. Returns ``(m_lo, m_hi, m_0, walk)`` as :func:`_query_range` does, over the
        walk's steps ``[0, 2 (partial + full))`` (rotated by ``m_0`` as dense walks are,
        :func:`_query_tile`), and ``walk = (partial, full, base)``, the counts and the
        key block's offset in the index lists (:func:`_walk_tile`)."""
        PN, PI, FN, FI, cs_b, cs_h, is_b, is_h, n_mb, tiles_per_block = bm
        kb = n // tiles_per_block
        col = b * cs_b + hq * cs_h + kb
        partial = gl.load(PN + col)
        full = gl.load(FN + col)
        steps = 2 * (partial + full)
        return 0, steps, (2 * n) % gl.maximum(steps, 1), (partial, full,
                                                          b * is_b + hq * is_h + kb * n_mb)

    @gluon.jit
    def _walk_tile(bm, walk, e):
        """Step ``e`` of a :func:`_column_walk`: ``(m, kind)``, query tile ``m`` (half ``e %
        2`` of the ``e // 2``-th listed block) and its kind, PARTIAL (1) or FULL (0)."""
        PN, PI, FN, FI, cs_b, cs_h, is_b, is_h, n_mb, tiles_per_block = bm
        partial, full, base = walk
        blk = e // 2
        in_partial = blk < partial
        idx = gl.where(in_partial, gl.load(PI + base + blk, mask=in_partial, other=0),
                       gl.load(FI + base + blk - partial, mask=blk >= partial, other=0))
        return idx * 2 + e % 2, gl.where(in_partial, 1, 0)

    @gluon.jit
    def _producer_tile(t, j, descs, bufs, bars, shape, seqs, mods, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASK_LEFT: gl.constexpr,
                       MASK_RIGHT: gl.constexpr, DETERMINISTIC: gl.constexpr,
                       VARLEN: gl.constexpr, MASK_FN: gl.constexpr = None,
                       TILES_OUTSIDE: gl.constexpr = False):
        """Key tile ``t``'s loads: ``K`` and ``V`` once, then ``Q``, ``dO``, ``lambda`` and
        ``D`` of every step (query head ``g`` of the group, query tile ``m``, in the
        order of :func:`_walk_outer`) into the ring, whose position ``j`` counts on
        across tiles; returns it. ``VARLEN``: the
        tile of a packed sequence (:func:`_varlen_program`), rows and keys from its
        offsets; none for a slot past its sequence."""
        if VARLEN:
            valid, hk, n, m_lo, m_hi, m_0, s, qs, ks, q_len, kv_len = _varlen_program(
                t, shape, seqs, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, 1)
            j = gl.to_tensor(j)
            if valid:
                j = _producer_steps(0, hk, n, m_lo, m_hi, m_0, qs, ks, _stats_start(s, qs), j,
                                    descs, bufs, bars, shape, mods, BLOCK_M, BLOCK_N, STAGES,
                                    MASK_RIGHT, DETERMINISTIC)
        else:
            b, hk, n, m_lo, m_hi, m_0 = _program(t, shape, BLOCK_M, BLOCK_N, MASK_LEFT,
                                                 MASK_RIGHT, DETERMINISTIC)
            j = _producer_steps(b, hk, n, m_lo, m_hi, m_0, 0, 0, 0, j, descs, bufs, bars,
                                shape, mods, BLOCK_M, BLOCK_N, STAGES, MASK_RIGHT,
                                DETERMINISTIC, MASK_FN, TILES_OUTSIDE)
        return j

    @gluon.jit
    def _producer_steps(b, hk, n, m_lo, m_hi, m_0, qs, ks, ls, j, descs, bufs, bars, shape,
                        mods, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        STAGES: gl.constexpr, MASK_RIGHT: gl.constexpr,
                        DETERMINISTIC: gl.constexpr, MASK_FN: gl.constexpr = None,
                        TILES_OUTSIDE: gl.constexpr = False):
        """:func:`_producer_tile`'s loads of key tile ``n`` of ``(b, hk)`` (rows from ``qs``,
        keys from ``ks``, row statistics from ``ls``: :func:`_stats_start`); returns the
        ring position. ``MASK_FN``: each query head walks the query tiles its block mask
        lists (:func:`_column_walk`)."""
        q_desc, k_desc, v_desc, do_desc, dq_desc, lam_desc, dd_desc = descs
        k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, lam_bufs, dd_bufs = bufs
        kv_ready, kv_empty, q_ready, q_empty, ds_ready, ds_empty, turn, dq_sync = bars
        group = shape[3]
        nbytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes
                                + lam_desc.block_type.nbytes + dd_desc.block_type.nbytes)
        mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, ks + n * BLOCK_N, 0], kv_ready,
                                        k_smem)
        tma.async_copy_global_to_shared(v_desc, [b, hk, ks + n * BLOCK_N, 0], kv_ready,
                                        v_smem)
        j = gl.to_tensor(j)      # (a one-tile program passes the literal 0)
        o_lo, o_hi = _walk_outer(group, m_lo, m_hi, TILES_OUTSIDE)
        for o in range(o_lo, o_hi):
            if not TILES_OUTSIDE:
                hq = hk * group + o
            walk = (0, 0, 0)
            if MASK_FN is not None:
                m_lo, m_hi, m_0, walk = _column_walk(mods[2], b, hq, n)
            u_lo, u_hi = _walk_inner(group, m_lo, m_hi, TILES_OUTSIDE)
            for u in range(u_lo, u_hi):
                g, i = _walk_pair(o, u, TILES_OUTSIDE)
                if TILES_OUTSIDE:
                    hq = hk * group + g
                m = _query_tile(i, m_lo, m_0, m_hi, DETERMINISTIC and MASK_RIGHT)
                if MASK_FN is not None:
                    m = _walk_tile(mods[2], walk, m)[0]
                slot = j % STAGES
                mbarrier.wait(q_empty.index(slot), ((j // STAGES) & 1) ^ 1)
                mbarrier.expect(q_ready.index(slot), nbytes)
                row = qs + m * BLOCK_M
                tma.async_copy_global_to_shared(q_desc, [b, hq, row, 0],
                                                q_ready.index(slot), q_bufs.index(slot))
                tma.async_copy_global_to_shared(do_desc, [b, hq, row, 0],
                                                q_ready.index(slot), do_bufs.index(slot))
                tma.async_copy_global_to_shared(lam_desc, [b, hq, 0, ls + m * BLOCK_M],
                                                q_ready.index(slot), lam_bufs.index(slot))
                tma.async_copy_global_to_shared(dd_desc, [b, hq, 0, ls + m * BLOCK_M],
                                                q_ready.index(slot), dd_bufs.index(slot))
                j += 1
        return j

    @gluon.jit
    def _bwd_producer(descs, bufs, bars, shape, seqs, mods, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASK_LEFT: gl.constexpr,
                      MASK_RIGHT: gl.constexpr, PERSISTENT: gl.constexpr,
                      DETERMINISTIC: gl.constexpr, VARLEN: gl.constexpr,
                      MASK_FN: gl.constexpr = None, TILES_OUTSIDE: gl.constexpr = False):
        """TMA loads of the program's key tile, or (``PERSISTENT``) of key tiles ``pid,
        pid + grid, ...``, each tile's ``K``, ``V`` once both consumers have released the
        previous one (``kv_empty``)."""
        if PERSISTENT:
            q_len, kv_len, heads_k, group, n_n, wave_heads, n_bh, left, right = shape
            kv_empty = bars[1]
            j = 0
            r = 0
            for t in range(gl.program_id(0), n_n * n_bh, gl.num_programs(0)):
                mbarrier.wait(kv_empty, (r & 1) ^ 1)
                j = _producer_tile(t, j, descs, bufs, bars, shape, seqs, mods, BLOCK_M,
                                   BLOCK_N, STAGES, MASK_LEFT, MASK_RIGHT, DETERMINISTIC,
                                   False, MASK_FN, TILES_OUTSIDE)
                r += 1
        else:
            _producer_tile(gl.program_id(0), 0, descs, bufs, bars, shape, seqs, mods, BLOCK_M,
                           BLOCK_N, STAGES, MASK_LEFT, MASK_RIGHT, DETERMINISTIC, VARLEN,
                           MASK_FN, TILES_OUTSIDE)

    @gluon.jit
    def _dq_product(ds_bufs, ds_ready, k_cols, dq_zero, j, buf):
        """Issue the dQ columns of step ``j - 1``: ``dS_{j-1} K[:, cols]`` (async wgmma)
        from dS buffer ``(j - 1) % 2`` once both warpgroups have stored their halves
        (at ``j = 0``: the zeroed buffer 1, whose barrier phase 1 passes at once), or from
        dS buffer ``buf`` (persistent programs' first step of a tile: the zeroed buffer 2;
        the wait then passes at once too, the previous tile's last dS being ready)."""
        pb = (j + 1) % 2
        # phase ((j - 1) // 2) & 1, written for j >= 0: Triton's // truncates toward zero
        mbarrier.wait(ds_ready.index(pb), ((j + 1) // 2 + 1) & 1)
        return warpgroup_mma(ds_bufs.index(buf).permute((1, 0)), k_cols, dq_zero,
                             use_acc=False, is_async=True)

    @gluon.jit
    def _dq_add(dq_desc, dq_bufs, dq, b, hq, row, col, BLOCK_M: gl.constexpr,
                DQ_COLS: gl.constexpr, WG: gl.constexpr):
        """``dQ_acc[b, hq, row .., col ..] += dq`` by a TMA reduce-add from the
        warpgroup's staging buffer (rows past Nq and columns past D clipped), once the
        previous add has read the buffer."""
        dq_smem = dq_bufs.index(WG)
        tma.store_wait(0)
        dq_smem.reshape([BLOCK_M, DQ_COLS]).store(dq)
        fence_async_shared()
        _tma_reduce_add(dq_desc, [b, hq, row, col], dq_smem)

    @gluon.jit
    def _dq_order(b, hq, n, m, shape, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  MASK_LEFT: gl.constexpr, WG: gl.constexpr):
        """``DETERMINISTIC``: the index of the counter of the adds into dQ tile ``(b, hq,
        m)``'s columns of warpgroup ``WG`` (in ``SEM``, int32 ``(B, Hq, n_m, 2)``, zeroed:
        :func:`dq_counters`) and this program's turn, ``n - n_lo(m)``: the key tiles that
        see the tile's rows, ``n_lo(m) .. n_hi(m)`` (contiguous: the walks' bounds rise
        with ``n``), add in the order of ``n``, each once the one before has completed
        its add (:func:`_dq_release`). The sum's order is then fixed: bitwise
        reproducible.

        No deadlock however few programs fit on the GPU: programs start in the order of
        ``n`` (one key tile per program, heads in ``wave_heads`` groups, tile-major), and
        the counters of ``(b, hq, m)`` order only programs of one ``(b, hk)``, so a
        program waits only for programs with a lower ``n``, which started before it
        (resident or finished). By induction over ``n`` each program completes all its
        adds: a wait of ``n`` needs only adds of lower programs, whatever order their
        walks and its own take the pairs in. The order decides how long they wait.
        Persistent programs (``PERSISTENT``: key tiles ``pid, pid + grid, ...`` in the
        same order) wait for lower tiles too, but a lower tile may be a later program's
        (``pid + 1``'s first tile comes before ``pid``'s second): the induction then
        needs every program resident, which the host asks of the launch (a cooperative
        one, at most one program per SM: :func:`gluon_attention_bwd`).

        In GQA calls without a left bound every partition walks the (query head ``g``,
        query tile ``m``) pairs with the tiles outside and the heads inside
        (``TILES_OUTSIDE``: :func:`_walk_outer`; with one query head per KV head both
        orders are the same walk and the heads' loop stays outside: inside, its one-trip
        loop cost each step instructions and spills, sm_90 compile, head_dim 128 causal 8
        -> 28 bytes; with a left bound the heads stay outside, as measured:
        :func:`_tiles_outside`), dense and left-bounded
        walks up from their first tile, ``m_lo = 0``, right-bounded ones down from their
        last, ``m_hi - 1`` (:func:`_query_tile`): program ``n`` reaches ``(g, m)`` at step
        ``m group + g`` going up, ``(m_hi - 1 - m) group + g`` going down, and ``m_hi``
        does not fall as ``n`` grows, so ``n + 1`` reaches a pair at the same step as
        ``n`` or later: after the first wave's ramp it runs an add's latency behind
        ``n`` and waits no more. With the heads outside, head ``g``'s steps would start
        at step ``g (m_hi - m_lo)``, and a causal key tile ``n + 1`` has two query tiles
        fewer than ``n``: it would reach each head's pairs ``2 g`` steps before ``n``
        and wait for ``n`` there, at every head of the group."""
        q_len, kv_len, heads_k, group, n_n, wave_heads, n_bh, left, right = shape
        n_lo = 0
        if MASK_LEFT:
            n_lo = gl.maximum((m * BLOCK_M + kv_len - q_len - left) // BLOCK_N, 0)
        slot = ((b * heads_k * group + hq) * gl.cdiv(q_len, BLOCK_M) + m) * 2 + WG
        return slot, n - n_lo

    @gluon.jit
    def _dq_wait(ptr, turn):
        """Spin until the counter at ``ptr`` reaches ``turn`` (``ld.acquire.gpu``)."""
        return gl.inline_asm_elementwise(
            "{\n.reg .pred p;\n$$spin${:uid}:\nld.acquire.gpu.global.b32 $0, [$1];\n"
            "setp.ne.s32 p, $0, $2;\n@p bra $$spin${:uid};\n}",
            "=r,l,r", [ptr, turn], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _dq_release(ptr):
        """Once this warp's TMA adds have completed (written, not only read from shared
        memory: ``cp.async.bulk.wait_group 0`` in the lane that issued them), add 1 to
        the counter at ``ptr``: lane 0, release at GPU scope, after the warp's lanes have
        met (``bar.warp.sync``)."""
        gl.inline_asm_elementwise(
            "{\n.reg .pred p;\n.reg .b32 t;\ncp.async.bulk.wait_group 0;\n"
            "bar.warp.sync -1;\nfence.proxy.async.global;\nmov.u32 t, %laneid;\n"
            "setp.eq.u32 p, t, 0;\n@p red.release.gpu.global.add.s32 [$1], 1;\n"
            "mov.u32 $0, 0;\n}",
            "=r,l", [ptr], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _dq_hand(dq_bufs, dq_sync, dq, k, BLOCK_M: gl.constexpr, DQ_COLS: gl.constexpr,
                 WG: gl.constexpr):
        """``DETERMINISTIC``: hand this warpgroup's ``k``-th dQ piece to its writer warp
        (:func:`_dq_writer`) through the warpgroup's staging buffer, once the writer's
        add has read the previous one (``dq_sync``: ``WG`` full, ``2 + WG`` empty)."""
        mbarrier.wait(dq_sync.index(2 + WG), (k & 1) ^ 1)
        dq_bufs.index(WG).reshape([BLOCK_M, DQ_COLS]).store(dq)
        fence_async_shared()
        mbarrier.arrive(dq_sync.index(WG), count=1)

    @gluon.jit
    def _dq_writer(descs, bufs, bars, shape, SEM, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
                   COL_LO: gl.constexpr, COL_HI: gl.constexpr, DQ_COLS: gl.constexpr,
                   ZERO_FIRST: gl.constexpr, WG: gl.constexpr,
                   TILES_OUTSIDE: gl.constexpr, PERSISTENT: gl.constexpr = False):
        """``DETERMINISTIC``: the warp that adds warpgroup ``WG``'s dQ pieces (columns
        ``COL_LO .. COL_HI`` of each query tile of the program's walk, ``DQ_COLS`` at a
        time) into ``dQ_acc``, for the program's key tile or (``PERSISTENT``) key tiles
        ``pid, pid + grid, ...`` (:func:`_dq_writer_tile`), the hand-overs counting on
        across tiles. The consumers never wait on global memory; a program's lag behind
        the one before is an add's latency."""
        if PERSISTENT:
            n_n = shape[4]
            n_bh = shape[6]
            k = 0
            for t in range(gl.program_id(0), n_n * n_bh, gl.num_programs(0)):
                k = _dq_writer_tile(t, k, descs, bufs, bars, shape, SEM, BLOCK_M, BLOCK_N,
                                    MASK_LEFT, MASK_RIGHT, COL_LO, COL_HI, DQ_COLS,
                                    ZERO_FIRST, WG, TILES_OUTSIDE)
        else:
            _dq_writer_tile(gl.program_id(0), 0, descs, bufs, bars, shape, SEM, BLOCK_M,
                            BLOCK_N, MASK_LEFT, MASK_RIGHT, COL_LO, COL_HI, DQ_COLS,
                            ZERO_FIRST, WG, TILES_OUTSIDE)

    @gluon.jit
    def _dq_writer_tile(t, k, descs, bufs, bars, shape, SEM, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr,
                        MASK_RIGHT: gl.constexpr, COL_LO: gl.constexpr, COL_HI: gl.constexpr,
                        DQ_COLS: gl.constexpr, ZERO_FIRST: gl.constexpr, WG: gl.constexpr,
                        TILES_OUTSIDE: gl.constexpr):
        """:func:`_dq_writer`'s adds for key tile ``t`` (hand-over ``k`` at its start,
        returned at its end): per query tile of the walk, it waits for its turn
        (:func:`_dq_order`), adds each piece by a TMA reduce-add as the warpgroup hands it
        over (:func:`_dq_hand`), frees the buffer once read, and releases the counter once
        the adds have completed. ``ZERO_FIRST``: the tile's first piece is its step 0's
        zeros (see :func:`_consumer_tile`), taken and not added. ``TILES_OUTSIDE``: the
        walk's order, the consumers' and the producer's (:func:`_walk_outer`)."""
        dq_desc = descs[4]
        dq_bufs = bufs[5]
        dq_sync = bars[7]
        q_len, kv_len, heads_k, group, n_n, wave_heads, n_bh, left, right = shape
        b, hk, n, m_lo, m_hi, m_0 = _program(t, shape, BLOCK_M, BLOCK_N, MASK_LEFT,
                                             MASK_RIGHT, True)
        k = gl.to_tensor(k)      # (a one-tile program passes the literal 0)
        if ZERO_FIRST:
            mbarrier.wait(dq_sync.index(WG), k & 1)
            mbarrier.arrive(dq_sync.index(2 + WG), count=1)
            k += 1
        o_lo, o_hi = _walk_outer(group, m_lo, m_hi, TILES_OUTSIDE)
        for o in range(o_lo, o_hi):
            if not TILES_OUTSIDE:
                hq = hk * group + o
            u_lo, u_hi = _walk_inner(group, m_lo, m_hi, TILES_OUTSIDE)
            for u in range(u_lo, u_hi):
                g, i = _walk_pair(o, u, TILES_OUTSIDE)
                if TILES_OUTSIDE:
                    hq = hk * group + g
                m = _query_tile(i, m_lo, m_0, m_hi, MASK_RIGHT)
                if TILES_OUTSIDE:
                    m = _per_step(m)
                ctr, turn = _dq_order(b, hq, n, m, shape, BLOCK_M, BLOCK_N, MASK_LEFT, WG)
                _dq_wait(SEM + ctr, turn)
                for col in gl.static_range(COL_LO, COL_HI, DQ_COLS):
                    mbarrier.wait(dq_sync.index(WG), k & 1)
                    _tma_reduce_add(dq_desc, [b, hq, m * BLOCK_M, col], dq_bufs.index(WG))
                    tma.store_wait(0)
                    mbarrier.arrive(dq_sync.index(2 + WG), count=1)
                    k += 1
                _dq_release(SEM + ctr)
        return k

    @gluon.jit
    def _probs(st, lam, row0, qcols, first_row, last_row, key_ok, qk_scale, step_scale,
               q_len, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
               SOFTCAP: gl.constexpr, MASK_TAIL_KEYS: gl.constexpr, WEIGHTS: gl.constexpr,
               VARLEN: gl.constexpr = False, mod=None, kind=0, SCORE_MOD: gl.constexpr = None,
               MASK_FN: gl.constexpr = None, BOUNDS: gl.constexpr = False):
        """``(P^T, rc)`` of a step's scores ``st`` (keys x queries ``row0 + qcols``)
        against the rows' ``lambda``: ATTENTION2's weights (generated: ``2^(x c log2 e -
        lambda)``, ``c = step_scale``); ``x = qk``, ``c = scale``, or with ``SOFTCAP`` ``x =
        tanh(scale qk / cap) = 1 - 2 rc``, ``rc = 1 / (2^(qk qk_scale) + 1)`` (the
        forward's form), ``c = cap``, and ``ds/dx = scale (1 - tanh^2) = scale 4 rc (1 -
        rc)`` (exact where tanh rounds to +-1), which the caller folds into ``P`` once ``P``
        has gone to its product (``rc`` is ``st`` without softcap). ``P = 0`` at hidden
        pairs, branch-free (a branch here doubled the live registers): keys before a
        row's window or after its right bound (keys past Nk included: see
        ``first_row``), or, unbounded, keys past Nk (``MASK_TAIL_KEYS``: ``P`` could
        overflow there, the lse far below 0); ``VARLEN``: also rows past ``q_len``, the
        next sequence's (a dense call's rows past Nq read as zeros and add nothing).

        ``SCORE_MOD`` (the Gluon lowering of a traced score_mod's value and derivative,
        :func:`.mods.score_grad_fn`): ``s = SCORE_MOD(x c', b, h, q_idx, kv_idx, BUFS)``
        on the scores in natural-log units (``c' = mod_scale``: the scale or the cap;
        the caller passes ``step_scale = 1``) with ``mod = (b, hq, keys, MOD_BUFS,
        mod_scale, MASK_BUFS)``; the second result is then ``ds/dx / scale`` (the mod's
        derivative, times ``4 rc (1 - rc)`` with ``SOFTCAP``), and rows past ``q_len``
        get ``P = 0`` (a mod's score of a zero row could overflow ``P``). ``MASK_FN`` (a
        block mask's mask_mod): ``P = 0`` where it hides the pair in a PARTIAL tile
        (``kind`` 1; FULL tiles, 0, evaluate nothing). ``BOUNDS``: the mask is each key's
        interval of queries, which the caller has intersected with ``[first_row,
        last_row]`` (``last_row = -1`` for a key past Nk): every tile keeps ``first_row <=
        r <= last_row`` (FULL tiles alike: the interval holds their rows), and nothing
        else is evaluated (two compares and one select per pair; the forward's single
        unsigned compare, ``r - first_row < count``, compiled to more instructions here)."""
        rc = st
        if SOFTCAP:
            rc = gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r",
                                           [gl.exp2(st * qk_scale) + 1.0],
                                           dtype=gl.float32, is_pure=True, pack=1)
            x = 1.0 - 2.0 * rc
        else:
            x = st
        rows = row0 + qcols[None, :]
        if SCORE_MOD is not None or MASK_FN is not None:
            b, hq, keys, mod_bufs, mod_scale, mask_bufs = mod
        if SCORE_MOD is not None:
            s, dmod = SCORE_MOD(x * mod_scale, b, hq, rows, keys[:, None], mod_bufs)
            p = WEIGHTS(lam[None, :], s.to(gl.float32), step_scale)[0]
            if SOFTCAP:
                rc = dmod.to(gl.float32) * (4.0 * rc * (1.0 - rc))
            else:
                rc = dmod.to(gl.float32)
            p = gl.where(rows < q_len, p, 0.0)
        else:
            p = WEIGHTS(lam[None, :], x, step_scale)[0]
        if BOUNDS:
            p = gl.where((first_row[:, None] <= rows) & (rows <= last_row[:, None]), p, 0.0)
        else:
            if MASK_FN is not None:
                vis = MASK_FN(b, hq, rows, keys[:, None], mask_bufs) != 0
                p = gl.where((kind == 0) | vis, p, 0.0)
            if MASK_RIGHT:
                p = gl.where(first_row[:, None] <= rows, p, 0.0)
            elif MASK_TAIL_KEYS:
                p = gl.where(key_ok[:, None], p, 0.0)
            if MASK_LEFT:
                p = gl.where(rows <= last_row[:, None], p, 0.0)
        if VARLEN:
            p = gl.where(rows < q_len, p, 0.0)
        return p, rc

    @gluon.jit
    def _consumer_tile(t, j, r, descs, bufs, bars, shape, ptrs, seqs, mods,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
                       HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, MASK_LEFT: gl.constexpr,
                       MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
                       STORE_TMA: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr,
                       PERSISTENT: gl.constexpr, LATE_STATS: gl.constexpr,
                       MASK_TAIL_KEYS: gl.constexpr, WEIGHTS: gl.constexpr,
                       DETERMINISTIC: gl.constexpr, VARLEN: gl.constexpr,
                       SCORE_MOD: gl.constexpr = None, MASK_FN: gl.constexpr = None,
                       COLUMN_BOUNDS: gl.constexpr = False,
                       TILES_OUTSIDE: gl.constexpr = False):
        """Keys ``64 WG .. 64 WG + 63`` of key tile ``t`` (the program's ``r``-th; ring
        position ``j`` at its start, returned at its end): accumulate their ``dK``, ``dV``
        over every step and add the previous step's dQ columns ``64 WG ..`` (see the
        module docstring), then write ``dK``, ``dV`` and add the last step's dQ.
        ``DETERMINISTIC`` (one tile per program): the dQ pieces go to the writer warp
        (:func:`_dq_hand`), which adds them in turn. ``VARLEN``: the tile of a packed
        sequence (:func:`_varlen_program`; nothing for a slot past its sequence), its
        dK, dV stored from registers."""
        if VARLEN:
            valid, hk, n, m_lo, m_hi, m_0, s, qs, ks, q_len, kv_len = _varlen_program(
                t, shape, seqs, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, 4)
            j = gl.to_tensor(j)
            if valid:
                j = _consumer_steps(0, hk, n, m_lo, m_hi, m_0, qs, ks, q_len, kv_len, j, r,
                                    descs, bufs, bars, shape, ptrs, mods, BLOCK_M, BLOCK_N,
                                    BLOCK_D, HEAD_DIM, STAGES, MASK_LEFT, MASK_RIGHT,
                                    SOFTCAP, STORE_TMA, WG, PINGPONG, PERSISTENT, LATE_STATS,
                                    MASK_TAIL_KEYS, WEIGHTS, DETERMINISTIC, True, SCORE_MOD,
                                    None, s)
        else:
            b, hk, n, m_lo, m_hi, m_0 = _program(t, shape, BLOCK_M, BLOCK_N, MASK_LEFT,
                                                 MASK_RIGHT, DETERMINISTIC)
            j = _consumer_steps(b, hk, n, m_lo, m_hi, m_0, 0, 0, shape[0], shape[1], j, r,
                                descs, bufs, bars, shape, ptrs, mods, BLOCK_M, BLOCK_N,
                                BLOCK_D, HEAD_DIM, STAGES, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                                STORE_TMA, WG, PINGPONG, PERSISTENT, LATE_STATS,
                                MASK_TAIL_KEYS, WEIGHTS, DETERMINISTIC, False, SCORE_MOD,
                                MASK_FN, None, COLUMN_BOUNDS, TILES_OUTSIDE)
        return j

    @gluon.jit
    def _consumer_steps(b, hk, n, m_lo, m_hi, m_0, qs, ks, q_len, kv_len, j, r, descs, bufs,
                        bars, shape, ptrs, mods, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        BLOCK_D: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                        MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
                        SOFTCAP: gl.constexpr, STORE_TMA: gl.constexpr, WG: gl.constexpr,
                        PINGPONG: gl.constexpr, PERSISTENT: gl.constexpr,
                        LATE_STATS: gl.constexpr, MASK_TAIL_KEYS: gl.constexpr,
                        WEIGHTS: gl.constexpr, DETERMINISTIC: gl.constexpr,
                        VARLEN: gl.constexpr, SCORE_MOD: gl.constexpr = None,
                        MASK_FN: gl.constexpr = None, seq=None,
                        COLUMN_BOUNDS: gl.constexpr = False,
                        TILES_OUTSIDE: gl.constexpr = False):
        """:func:`_consumer_tile`'s work on its key tile ``n`` of ``(b, hk)`` (rows from
        ``qs`` and keys from ``ks`` of a sequence of ``q_len`` rows and ``kv_len`` keys,
        with ``VARLEN`` the sequence ``seq``, the mods' ``b``; query tiles ``m_lo .. m_hi``
        from ``m_0``, or with ``MASK_FN`` those its block mask lists per query head:
        :func:`_column_walk`); returns the ring position.
        ``mods = (MOD_BUFS, mod_scale, BM, MASK_BUFS)``: the score_mod's tables and scale,
        the block mask's per-key-block lists and its mask_mod's tables (:func:`_probs`)."""
        q_desc, k_desc, v_desc, do_desc, dq_desc, lam_desc, dd_desc = descs
        k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, lam_bufs, dd_bufs = bufs
        kv_ready, kv_empty, q_ready, q_empty, ds_ready, ds_empty, turn, dq_sync = bars
        _, _, heads_k, group, n_n, wave_heads, n_bh, left, right = shape
        DK, DV, qk_scale, scale, step_scale, SEM = ptrs
        HALF: gl.constexpr = BLOCK_N // 2
        DQ_COLS: gl.constexpr = BLOCK_D // 2     # columns of this warpgroup's dQ add
        DOWN: gl.constexpr = DETERMINISTIC and MASK_RIGHT
        dtype: gl.constexpr = q_desc.dtype
        s_layout: gl.constexpr = _wgmma_layout(BLOCK_M)
        dq_layout: gl.constexpr = _wgmma_layout(DQ_COLS)
        # a head dim in 65-96 runs its products over two column chunks, 64 + D_B (a power
        # of two, at least one wgmma K step), instead of the whole 128-wide tile: S^T and
        # dP^T reduce over them (:func:`_chunked_t`), dK and dV are an accumulator of each
        if BLOCK_D == 128 and HEAD_DIM <= 80:
            D_B: gl.constexpr = 16
        elif BLOCK_D == 128 and HEAD_DIM <= 96:
            D_B: gl.constexpr = 32
        else:
            D_B: gl.constexpr = 0
        NCH: gl.constexpr = 2 if D_B > 0 else 1     # wgmma groups of one such product
        D_A: gl.constexpr = 64 if D_B > 0 else BLOCK_D
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0,
                                                     parent=_wgmma_layout(D_A), k_width=2)
        k_w = k_smem.reshape([BLOCK_N, BLOCK_D]).slice(WG * HALF, HALF, dim=0)
        v_w = v_smem.reshape([BLOCK_N, BLOCK_D]).slice(WG * HALF, HALF, dim=0)
        k_cols = k_smem.reshape([BLOCK_N, BLOCK_D]).slice(WG * DQ_COLS, DQ_COLS, dim=1)
        keys = n * BLOCK_N + WG * HALF + gl.arange(0, HALF,
                                                   layout=gl.SliceLayout(1, s_layout))
        key_ok = keys < kv_len
        # the rows that see key c: first_row(c) <= r <= last_row(c) (see _program); a
        # key past Nk has no first row
        first_row = gl.where(key_ok, keys - (kv_len - q_len) - right, q_len + BLOCK_M)
        last_row = keys - (kv_len - q_len) + left
        qcols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([HALF, BLOCK_M], gl.float32, s_layout)
        dq_zero = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout)
        dk = gl.zeros([HALF, D_A], gl.float32, _wgmma_layout(D_A))
        dv = gl.zeros([HALF, D_A], gl.float32, _wgmma_layout(D_A))
        if D_B > 0:
            dk2 = gl.zeros([HALF, D_B], gl.float32, _wgmma_layout(D_B))
            dv2 = gl.zeros([HALF, D_B], gl.float32, _wgmma_layout(D_B))
        mbarrier.wait(kv_ready, r & 1)
        # dQ runs a step late (see the module docstring): a tile's first step adds the
        # product of a zeroed dS buffer ("step -1", see _bwd_consumer) to its own rows,
        # which adds nothing
        if MASK_FN is not None:     # (a walk of no tiles, or adds of zeros: any tile)
            m_prev = n * 0
        else:
            m_prev = _query_tile(m_lo, m_lo, m_0, m_hi, DOWN)
        hq_prev = hk * group
        mod_bufs, mod_scale, bm, mask_bufs = mods
        mb = b
        if VARLEN:
            mb = seq
        if not PERSISTENT:
            ds_bufs.index(1).store(gl.zeros([BLOCK_N, BLOCK_M], dtype, s_layout))
            fence_async_shared()
        j = gl.to_tensor(j)      # (a one-tile program passes the literal 0)
        j0 = j
        # the (query head, query tile) pairs in the producer's order: a loop over the
        # group's heads around the steps (one loop over the pairs gained nothing:
        # docs/notes/attention_bwd.md, "Flat GQA walk"), or (TILES_OUTSIDE) the steps
        # around the heads, so that no program waits for the one before at every head
        # (see _dq_order)
        o_lo, o_hi = _walk_outer(group, m_lo, m_hi, TILES_OUTSIDE)
        for o in range(o_lo, o_hi):
            if not TILES_OUTSIDE:
                hq = hk * group + o
            walk = (0, 0, 0)
            if MASK_FN is not None:
                m_lo, m_hi, m_0, walk = _column_walk(bm, b, hq, n)
            rows_lo = first_row
            rows_hi = last_row
            if COLUMN_BOUNDS:
                # the mask's interval of queries per key (MASK_FN gives its bounds, for
                # this query head), within the rows above; none for a key past Nk
                lo, hi = MASK_FN(mb, hq, 0, keys, mask_bufs)
                if MASK_RIGHT:
                    rows_lo = gl.maximum(rows_lo, lo)
                else:
                    rows_lo = lo
                if MASK_LEFT:
                    hi = gl.minimum(rows_hi, hi)
                rows_hi = gl.where(key_ok, hi, -1)
            u_lo, u_hi = _walk_inner(group, m_lo, m_hi, TILES_OUTSIDE)
            for u in range(u_lo, u_hi):
                g, i = _walk_pair(o, u, TILES_OUTSIDE)
                if TILES_OUTSIDE:
                    hq = hk * group + g
                m = _query_tile(i, m_lo, m_0, m_hi, DOWN)
                if TILES_OUTSIDE:
                    m = _per_step(m)
                kind = 0
                if MASK_FN is not None:
                    m, kind = _walk_tile(bm, walk, m)
                slot = j % STAGES
                mbarrier.wait(q_ready.index(slot), (j // STAGES) & 1)
                q_s = q_bufs.index(slot).reshape([BLOCK_M, BLOCK_D])
                do_s = do_bufs.index(slot).reshape([BLOCK_M, BLOCK_D])
                _take_turn(turn, j, WG, PINGPONG)     # (see pingpong_default)
                st = _chunked_t(k_w, q_s, s_zero, D_A, D_B)
                dpt = _chunked_t(v_w, do_s, s_zero, D_A, D_B)
                _pass_turn(turn, WG, PINGPONG)
                # lambda and D of the tile's rows: loaded with Q (global loads here were
                # on the critical path: +4-10% per row, and spills 376 -> 156 bytes), read
                # from shared memory before the waits of S^T and dP^T, or after them
                # (LATE_STATS: see gluon_attention_bwd)
                if not LATE_STATS:
                    lam = lam_bufs.index(slot).reshape([BLOCK_M]).load(
                        gl.SliceLayout(0, s_layout))
                st = warpgroup_mma_wait(NCH, deps=[st])
                if LATE_STATS:
                    lam = lam_bufs.index(slot).reshape([BLOCK_M]).load(
                        gl.SliceLayout(0, s_layout))
                p, rc = _probs(st, lam, m * BLOCK_M, qcols, rows_lo, rows_hi, key_ok,
                               qk_scale, step_scale, q_len, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                               MASK_TAIL_KEYS, WEIGHTS, VARLEN,
                               (mb, hq, keys, mod_bufs, mod_scale, mask_bufs), kind,
                               SCORE_MOD, MASK_FN, COLUMN_BOUNDS)
                pa = gl.convert_layout(p.to(dtype), a_layout)
                dv = warpgroup_mma(pa, do_s.slice(0, D_A, dim=1), dv, is_async=True)
                if D_B > 0:
                    dv2 = warpgroup_mma(pa, do_s.slice(D_A, D_B, dim=1), dv2, is_async=True)
                if SCORE_MOD is not None:   # ds/dx / scale, 0 wherever P is (see below)
                    p = gl.where(p == 0.0, 0.0, p * rc)
                elif SOFTCAP:   # P's only other use is dS: fold ds/dx in now, rc dies
                    p = p * (4.0 * rc * (1.0 - rc))
                if not LATE_STATS:
                    dd = dd_bufs.index(slot).reshape([BLOCK_M]).load(
                        gl.SliceLayout(0, s_layout))
                dpt = warpgroup_mma_wait(NCH, deps=[dpt])
                if LATE_STATS:
                    dd = dd_bufs.index(slot).reshape([BLOCK_M]).load(
                        gl.SliceLayout(0, s_layout))
                ds = p * (dpt - dd[None, :])
                if SCORE_MOD is not None:
                    # a pair the score_mod hides (P = 0) adds 0 whatever dP (as the
                    # Triton kernels' dS)
                    ds = gl.where(p == 0.0, 0.0, ds)
                dsa = gl.convert_layout(ds.to(dtype), a_layout)
                # this warpgroup's dS^T half into buffer j % 2 once both warpgroups' dQ
                # of step j - 2 has read it (buffer 1 is read once more: by step -1)
                dsb = j % 2
                mbarrier.wait(ds_empty.index(dsb), (((j + dsb) // 2) & 1) ^ 1)
                ds_bufs.index(dsb).slice(WG * HALF, HALF, dim=0).store(ds.to(dtype))
                fence_async_shared()
                mbarrier.arrive(ds_ready.index(dsb), count=1)
                buf = (j + 1) % 2
                if PERSISTENT:      # a tile's first step: the zeroed buffer 2
                    buf = gl.where(j == j0, 2, buf)
                dq = _dq_product(ds_bufs, ds_ready, k_cols, dq_zero, j, buf)
                # dK after dQ: it runs while dQ goes to shared memory (issued before dQ,
                # it held up the step's last wait; H200: 0 to +3%, and the causal variant's
                # spill stores 952 -> 488 bytes: docs/notes/attention_bwd.md, "dK issued
                # after dQ")
                dk = warpgroup_mma(dsa, q_s.slice(0, D_A, dim=1), dk, is_async=True)
                if D_B > 0:
                    dk2 = warpgroup_mma(dsa, q_s.slice(D_A, D_B, dim=1), dk2, is_async=True)
                    dq, dv, dv2 = warpgroup_mma_wait(2, deps=[dq, dv, dv2])
                else:
                    dq, dv = warpgroup_mma_wait(1, deps=[dq, dv])
                mbarrier.arrive(ds_empty.index((j + 1) % 2), count=1)
                if DETERMINISTIC:   # (a tile's step 0 hands over zeros: the writer drops
                    # them; hand-over j + r: each earlier tile handed one more than its steps)
                    _dq_hand(dq_bufs, dq_sync, dq, j + r, BLOCK_M, DQ_COLS, WG)
                else:
                    _dq_add(dq_desc, dq_bufs, dq, b, hq_prev, qs + m_prev * BLOCK_M,
                            WG * DQ_COLS, BLOCK_M, DQ_COLS, WG)
                dk = warpgroup_mma_wait(0, deps=[dk])
                if D_B > 0:
                    dk2 = warpgroup_mma_wait(0, deps=[dk2])
                mbarrier.arrive(q_empty.index(slot), count=1)
                m_prev = m
                hq_prev = hq
                j += 1
        # the last step's dQ, issued now and added once dK and dV are on their way
        dq = _dq_product(ds_bufs, ds_ready, k_cols, dq_zero, j, (j + 1) % 2)
        if PERSISTENT:
            # K and V read for the last time: the producer loads the next tile's while
            # dK, dV are written. (The next tile's first step makes the ds_empty arrival
            # for this read: its product reads the zeroed buffer instead.)
            dq = warpgroup_mma_wait(0, deps=[dq])
            mbarrier.arrive(kv_empty, count=1)

        # dK = scale * sum dS^T Q, dV = sum P^T dO (see STORE_TMA in _attn_bwd_ws)
        row0 = n * BLOCK_N + WG * HALF
        if STORE_TMA:
            # staged in this warpgroup's slot of the Q and dO ring (free once both
            # warpgroups have released every slot's last use); the stores clip rows past Nk
            for s in gl.static_range(STAGES):
                uses = (j + STAGES - 1 - s) // STAGES
                mbarrier.wait(q_empty.index(s), (uses - 1) & 1)    # unused: parity 1 passes
            dk_smem = q_bufs.index(WG)
            dv_smem = do_bufs.index(WG)
            dk_smem.reshape([HALF, BLOCK_D]).slice(0, D_A, dim=1).store((dk * scale).to(dtype))
            dv_smem.reshape([HALF, BLOCK_D]).slice(0, D_A, dim=1).store(dv.to(dtype))
            if D_B > 0:     # (the columns past 64 + D_B are clipped by the stores)
                dk_smem.reshape([HALF, BLOCK_D]).slice(D_A, D_B, dim=1).store(
                    (dk2 * scale).to(dtype))
                dv_smem.reshape([HALF, BLOCK_D]).slice(D_A, D_B, dim=1).store(
                    dv2.to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(DK, [b, hk, row0, 0], dk_smem)
            tma.async_copy_shared_to_global(DV, [b, hk, row0, 0], dv_smem)
        else:
            if VARLEN:
                kv_base = hk.to(gl.int64) * shape[1] + ks
            else:
                kv_base = (b * heads_k + hk).to(gl.int64) * kv_len
            _store_rows(DK, dk * scale, kv_base, row0, 0, kv_len, HEAD_DIM, HALF, D_A,
                        _wgmma_layout(D_A))
            _store_rows(DV, dv, kv_base, row0, 0, kv_len, HEAD_DIM, HALF, D_A,
                        _wgmma_layout(D_A))
            if D_B > 0:
                _store_rows(DK, dk2 * scale, kv_base, row0, D_A, kv_len, HEAD_DIM, HALF, D_B,
                            _wgmma_layout(D_B))
                _store_rows(DV, dv2, kv_base, row0, D_A, kv_len, HEAD_DIM, HALF, D_B,
                            _wgmma_layout(D_B))
        if not PERSISTENT:
            dq = warpgroup_mma_wait(0, deps=[dq])
            mbarrier.arrive(ds_empty.index((j + 1) % 2), count=1)
        if DETERMINISTIC:
            _dq_hand(dq_bufs, dq_sync, dq, j + r, BLOCK_M, DQ_COLS, WG)
        else:
            _dq_add(dq_desc, dq_bufs, dq, b, hq_prev, qs + m_prev * BLOCK_M, WG * DQ_COLS,
                    BLOCK_M, DQ_COLS, WG)
        return j

    @gluon.jit
    def _bwd_consumer(descs, bufs, bars, shape, ptrs, seqs, mods, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, HEAD_DIM: gl.constexpr,
                      STAGES: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
                      SOFTCAP: gl.constexpr, STORE_TMA: gl.constexpr, WG: gl.constexpr,
                      PINGPONG: gl.constexpr, PERSISTENT: gl.constexpr,
                      LATE_STATS: gl.constexpr, MASK_TAIL_KEYS: gl.constexpr,
                      WEIGHTS: gl.constexpr, DETERMINISTIC: gl.constexpr,
                      VARLEN: gl.constexpr, SCORE_MOD: gl.constexpr = None,
                      MASK_FN: gl.constexpr = None, COLUMN_BOUNDS: gl.constexpr = False,
                      TILES_OUTSIDE: gl.constexpr = False):
        """Keys ``64 WG .. 64 WG + 63`` of the program's key tile, or (``PERSISTENT``) of
        key tiles ``pid, pid + grid, ...``, with the ring and the dS buffers' phases
        counting on across tiles. The first step of a tile adds the product of a zeroed
        dS buffer: buffer 1 of a one-tile program (a dS(1) store into it waits, through
        ds_empty, until both warpgroups have read it at step 0), or the extra buffer 2 of
        a persistent one, read at every tile's first step and never written again. Each
        warpgroup zeroes the whole buffer, so neither waits for the other's zeros."""
        if PERSISTENT:
            q_len, kv_len, heads_k, group, n_n, wave_heads, n_bh, left, right = shape
            bufs[4].index(2).store(gl.zeros([BLOCK_N, BLOCK_M], descs[0].dtype,
                                            _wgmma_layout(BLOCK_M)))
            fence_async_shared()
            j = 0
            r = 0
            for t in range(gl.program_id(0), n_n * n_bh, gl.num_programs(0)):
                j = _consumer_tile(t, j, r, descs, bufs, bars, shape, ptrs, seqs, mods,
                                   BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, STAGES, MASK_LEFT,
                                   MASK_RIGHT, SOFTCAP, STORE_TMA, WG, PINGPONG, PERSISTENT,
                                   LATE_STATS, MASK_TAIL_KEYS, WEIGHTS, DETERMINISTIC, False,
                                   SCORE_MOD, MASK_FN, COLUMN_BOUNDS, TILES_OUTSIDE)
                r += 1
        else:
            _consumer_tile(gl.program_id(0), 0, 0, descs, bufs, bars, shape, ptrs, seqs, mods,
                           BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, STAGES, MASK_LEFT, MASK_RIGHT,
                           SOFTCAP, STORE_TMA, WG, PINGPONG, PERSISTENT, LATE_STATS,
                           MASK_TAIL_KEYS, WEIGHTS, DETERMINISTIC, VARLEN, SCORE_MOD,
                           MASK_FN, COLUMN_BOUNDS, TILES_OUTSIDE)
        tma.store_wait(0)

    @gluon.jit
    def _wide_consumer(descs, bufs, bars, shape, ptrs, mods, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr,
                       HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
                       DQ_SPLIT: gl.constexpr, DQ_COLS: gl.constexpr, DS_RING: gl.constexpr,
                       STAGES: gl.constexpr, MASK_LEFT: gl.constexpr,
                       MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, WG: gl.constexpr,
                       MASK_TAIL_KEYS: gl.constexpr, WEIGHTS: gl.constexpr,
                       DETERMINISTIC: gl.constexpr, SCORE_MOD: gl.constexpr = None,
                       TILES_OUTSIDE: gl.constexpr = False):
        """The ``WIDE`` variant's warpgroup ``WG`` (see the module docstring): of each
        step's 64 x 64 ``S^T`` and ``dP^T`` it computes the query columns ``32 WG ..``
        and stores their ``P^T`` and ``dS^T`` into the step's shared buffers; once both
        halves are there, warpgroup 0 adds ``dS^T Q`` into ``dK`` and warpgroup 1 ``P^T
        dO`` into ``dV`` (whole rows: each accumulator lives in one warpgroup), and each
        adds its dQ columns (0 .. DQ_SPLIT, DQ_SPLIT .. BLOCK_D), ``dS K[:, cols]``, in
        pieces of ``DQ_COLS``; ``DS_RING``: the P^T / dS^T buffers of each kind (with
        one, a step's stores wait for the last step's products to read them). Finally
        warpgroup 0 writes ``dK``, warpgroup 1 ``dV``.
        ``DETERMINISTIC``: the pieces go to the writer warps (:func:`_dq_hand`).
        ``SCORE_MOD``: as in :func:`_consumer_steps` (``mods`` its tables and scale)."""
        q_desc, k_desc, v_desc, do_desc, dq_desc, lam_desc, dd_desc = descs
        k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, lam_bufs, dd_bufs = bufs
        kv_ready, kv_empty, q_ready, q_empty, ds_ready, ds_empty, turn, dq_sync = bars
        q_len, kv_len, heads_k, group, n_n, wave_heads, n_bh, left, right = shape
        DK, DV, qk_scale, scale, step_scale, SEM = ptrs
        HALF: gl.constexpr = BLOCK_M // 2       # query columns of this warpgroup's S^T
        if WG == 0:
            OUT_COLS: gl.constexpr = BLOCK_D
            OUT_DIM: gl.constexpr = HEAD_DIM
            DQ_LO: gl.constexpr = 0
            DQ_HI: gl.constexpr = DQ_SPLIT
        else:
            OUT_COLS: gl.constexpr = BLOCK_DV
            OUT_DIM: gl.constexpr = HEAD_DIM_V
            DQ_LO: gl.constexpr = DQ_SPLIT
            DQ_HI: gl.constexpr = (HEAD_DIM + DQ_COLS - 1) // DQ_COLS * DQ_COLS
        # a 192-wide head dim in a 256-wide tile: the products stop at column 192 (S^T
        # and dP^T as 128 + 64 columns of the reduction, dK / dV as accumulators of 128
        # and 64 columns) instead of multiplying 64 columns of zeros
        S_A: gl.constexpr = 128 if (HEAD_DIM + 63) // 64 == 3 else BLOCK_D
        P_A: gl.constexpr = 128 if (HEAD_DIM_V + 63) // 64 == 3 else BLOCK_DV
        OUT_A: gl.constexpr = 128 if (OUT_DIM + 63) // 64 == 3 else OUT_COLS
        dtype: gl.constexpr = q_desc.dtype
        s_layout: gl.constexpr = _wgmma_layout(HALF)
        acc_layout: gl.constexpr = _wgmma_layout(OUT_A)
        acc2_layout: gl.constexpr = _wgmma_layout(64)
        dq_layout: gl.constexpr = _wgmma_layout(DQ_COLS)
        b, hk, n, m_lo, m_hi, m_0 = _program(gl.program_id(0), shape, BLOCK_M, BLOCK_N,
                                             MASK_LEFT, MASK_RIGHT, DETERMINISTIC)
        k = 0               # DETERMINISTIC: dQ pieces handed over
        k_t = k_smem.reshape([BLOCK_N, BLOCK_D])
        v_t = v_smem.reshape([BLOCK_N, BLOCK_DV])
        keys = n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        key_ok = keys < kv_len
        first_row = gl.where(key_ok, keys - (kv_len - q_len) - right, q_len + BLOCK_M)
        last_row = keys - (kv_len - q_len) + left
        qcols = WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([BLOCK_N, HALF], gl.float32, s_layout)
        dq_zero = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout)
        acc = gl.zeros([BLOCK_N, OUT_A], gl.float32, acc_layout)
        if OUT_A < OUT_COLS:
            acc2 = gl.zeros([BLOCK_N, 64], gl.float32, acc2_layout)
        mbarrier.wait(kv_ready, 0)
        j = 0
        o_lo, o_hi = _walk_outer(group, m_lo, m_hi, TILES_OUTSIDE)
        for o in range(o_lo, o_hi):
            if not TILES_OUTSIDE:
                hq = hk * group + o
            u_lo, u_hi = _walk_inner(group, m_lo, m_hi, TILES_OUTSIDE)
            for u in range(u_lo, u_hi):
                g, i = _walk_pair(o, u, TILES_OUTSIDE)
                if TILES_OUTSIDE:
                    hq = hk * group + g
                m = _query_tile(i, m_lo, m_0, m_hi, DETERMINISTIC and MASK_RIGHT)
                if TILES_OUTSIDE:
                    m = _per_step(m)
                slot = j % STAGES
                mbarrier.wait(q_ready.index(slot), (j // STAGES) & 1)
                q_s = q_bufs.index(slot).reshape([BLOCK_M, BLOCK_D])
                do_s = do_bufs.index(slot).reshape([BLOCK_M, BLOCK_DV])
                st, dpt = _wide_scores(k_t, v_t, q_bufs.index(slot), do_bufs.index(slot),
                                       s_zero, BLOCK_M, BLOCK_D, BLOCK_DV, S_A, P_A, HALF, WG)
                st = warpgroup_mma_wait(1, deps=[st])
                lam = lam_bufs.index(slot).reshape([BLOCK_M]).slice(WG * HALF, HALF).load(
                    gl.SliceLayout(0, s_layout))
                p, rc = _probs(st, lam, m * BLOCK_M, qcols, first_row, last_row, key_ok,
                               qk_scale, step_scale, q_len, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                               MASK_TAIL_KEYS, WEIGHTS, False,
                               (b, hq, keys, mods[0], mods[1], mods[3]), 0, SCORE_MOD)
                pb = p.to(dtype)
                if SCORE_MOD is not None:   # (as in _consumer_steps)
                    p = gl.where(p == 0.0, 0.0, p * rc)
                elif SOFTCAP:
                    p = p * (4.0 * rc * (1.0 - rc))
                dpt = warpgroup_mma_wait(0, deps=[dpt])
                dd = dd_bufs.index(slot).reshape([BLOCK_M]).slice(WG * HALF, HALF).load(
                    gl.SliceLayout(0, s_layout))
                ds = p * (dpt - dd[None, :])
                if SCORE_MOD is not None:
                    ds = gl.where(p == 0.0, 0.0, ds)
                # this warpgroup's halves of P^T (buffer DS_RING + buf) and dS^T (buf),
                # once both warpgroups' products of step j - DS_RING have read them
                buf = j % DS_RING
                mbarrier.wait(ds_empty.index(buf), ((j // DS_RING) & 1) ^ 1)
                ds_bufs.index(DS_RING + buf).slice(WG * HALF, HALF, dim=1).store(pb)
                ds_bufs.index(buf).slice(WG * HALF, HALF, dim=1).store(ds.to(dtype))
                fence_async_shared()
                mbarrier.arrive(ds_ready.index(buf), count=1)
                mbarrier.wait(ds_ready.index(buf), (j // DS_RING) & 1)
                ds_t = ds_bufs.index(buf)
                # the first dQ piece, then dK (or dV) behind it; each further piece is
                # issued before the one before it is added, so that the adds run under
                # the products
                dq = warpgroup_mma(ds_t.permute((1, 0)), k_t.slice(DQ_LO, DQ_COLS, dim=1),
                                   dq_zero, use_acc=False, is_async=True)
                if WG == 0:
                    a_s = ds_t
                    b_s = q_s
                else:
                    a_s = ds_bufs.index(DS_RING + buf)
                    b_s = do_s
                acc = warpgroup_mma(a_s, b_s.slice(0, OUT_A, dim=1), acc, is_async=True)
                if OUT_A < OUT_COLS:
                    acc2 = warpgroup_mma(a_s, b_s.slice(OUT_A, 64, dim=1), acc2,
                                         is_async=True)
                    dq = warpgroup_mma_wait(2, deps=[dq])
                else:
                    dq = warpgroup_mma_wait(1, deps=[dq])
                for c in gl.static_range(DQ_LO, DQ_HI, DQ_COLS):   # (< HEAD_DIM)
                    if c + DQ_COLS < DQ_HI:
                        nxt = warpgroup_mma(ds_t.permute((1, 0)),
                                            k_t.slice(c + DQ_COLS, DQ_COLS, dim=1), dq_zero,
                                            use_acc=False, is_async=True)
                    if DETERMINISTIC:
                        _dq_hand(dq_bufs, dq_sync, dq, k, BLOCK_M, DQ_COLS, WG)
                        k += 1
                    else:
                        _dq_add(dq_desc, dq_bufs, dq, b, hq, m * BLOCK_M, c, BLOCK_M,
                                DQ_COLS, WG)
                    if c + DQ_COLS < DQ_HI:
                        dq = warpgroup_mma_wait(0, deps=[nxt])
                acc = warpgroup_mma_wait(0, deps=[acc])
                if OUT_A < OUT_COLS:
                    acc2 = warpgroup_mma_wait(0, deps=[acc2])
                mbarrier.arrive(ds_empty.index(buf), count=1)
                mbarrier.arrive(q_empty.index(slot), count=1)
                j += 1

        # dK = scale * sum dS^T Q (warpgroup 0), dV = sum P^T dO (warpgroup 1)
        kv_base = (b * heads_k + hk).to(gl.int64) * kv_len
        if WG == 0:
            out = DK
            acc = acc * scale
            if OUT_A < OUT_COLS:
                acc2 = acc2 * scale
        else:
            out = DV
        _store_rows(out, acc, kv_base, n * BLOCK_N, 0, kv_len, OUT_DIM, BLOCK_N, OUT_A,
                    acc_layout)
        if OUT_A < OUT_COLS:
            _store_rows(out, acc2, kv_base, n * BLOCK_N, OUT_A, kv_len, OUT_DIM, BLOCK_N, 64,
                        acc2_layout)
        tma.store_wait(0)

    @gluon.jit
    def _wide_scores(k_t, v_t, q_buf, do_buf, s_zero, BLOCK_M: gl.constexpr,
                     BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr, S_A: gl.constexpr,
                     P_A: gl.constexpr, HALF: gl.constexpr, WG: gl.constexpr):
        """Issue ``S^T = K Q_h^T`` and ``dP^T = V dO_h^T`` (async) for this warpgroup's
        query rows ``h`` of the ring slot ``q_buf`` / ``do_buf``, the reduction over the
        head dim stopping at ``S_A + 64`` / ``P_A + 64`` where that is short of the tile."""
        q_h = q_buf.reshape([BLOCK_M, BLOCK_D]).slice(WG * HALF, HALF, dim=0)
        do_h = do_buf.reshape([BLOCK_M, BLOCK_DV]).slice(WG * HALF, HALF, dim=0)
        st = _chunked_t(k_t, q_h, s_zero, S_A, 64 if S_A < BLOCK_D else 0)
        dpt = _chunked_t(v_t, do_h, s_zero, P_A, 64 if P_A < BLOCK_DV else 0)
        return st, dpt

    @gluon.jit
    def _chunked_t(a_t, b_s, zero, D_A: gl.constexpr, D_B: gl.constexpr):
        """Issue ``a_t b_s^T`` (async) over the head dim's columns ``0 .. D_A`` and,
        with ``D_B > 0``, ``D_A .. D_A + D_B`` as a second wgmma into the same
        accumulator (the columns past them are the tiles' zeros)."""
        acc = warpgroup_mma(a_t.slice(0, D_A, dim=1), b_s.slice(0, D_A, dim=1).permute((1, 0)),
                            zero, use_acc=False, is_async=True)
        if D_B > 0:
            acc = warpgroup_mma(a_t.slice(D_A, D_B, dim=1),
                                b_s.slice(D_A, D_B, dim=1).permute((1, 0)), acc,
                                is_async=True)
        return acc

    @gluon.jit
    def _store_rows(out, acc, kv_base, row0, col0, kv_len, DIM: gl.constexpr,
                    ROWS: gl.constexpr, COLS: gl.constexpr, layout: gl.constexpr):
        """``out[kv_base + row0 .., col0 ..] = acc`` (input dtype) for ``out`` of row
        length ``DIM``, rows past ``kv_len`` and columns past ``DIM`` masked."""
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
        offs = (kv_base + rows)[:, None] * DIM + cols[None, :]
        ok = (rows < kv_len)[:, None] & (cols < DIM)[None, :]
        gl.store(out + offs, acc.to(out.dtype.element_ty), mask=ok)

    @gluon.jit
    def _attn_bwd_ws(q_desc, k_desc, v_desc, do_desc, dq_desc, lam_desc, dd_desc, DK, DV,
                     q_len, kv_len, heads_k, group, n_n, wave_heads, n_bh, left, right,
                     qk_scale, scale, step_scale, SEM, CU_Q, CU_K, n_seqs, search_levels,
                     search_top, MOD_BUFS, mod_scale, BM, MASK_BUFS,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
                     HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, MASK_LEFT: gl.constexpr,
                     MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, STORE_TMA: gl.constexpr,
                     PINGPONG: gl.constexpr, PERSISTENT: gl.constexpr,
                     LATE_STATS: gl.constexpr, MASK_TAIL_KEYS: gl.constexpr,
                     WEIGHTS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                     PRODUCER_REGS: gl.constexpr, DETERMINISTIC: gl.constexpr = False,
                     WIDE: gl.constexpr = False,
                     BLOCK_DV: gl.constexpr = 0, HEAD_DIM_V: gl.constexpr = 0,
                     DQ_SPLIT: gl.constexpr = 0, DS_RING: gl.constexpr = 2,
                     VARLEN: gl.constexpr = False, SCORE_MOD: gl.constexpr = None,
                     MASK_FN: gl.constexpr = None, COLUMN_BOUNDS: gl.constexpr = False,
                     TILES_OUTSIDE: gl.constexpr = False):
        """One program per key tile ``n`` of ``(b, hk)`` (grid ``n_n * B * Hk``):
        ``num_warps=4`` (the first consumer warpgroup), the second consumer and the
        producer warp. ``DK``, ``DV``: TMA descriptors with ``STORE_TMA`` (dK, dV staged
        in the idle ring and stored by TMA), else pointers (stored from registers; see
        :func:`store_tma`). ``SEM``: the dQ tiles' add counters of ``DETERMINISTIC`` calls
        (:func:`_dq_order`), else unused. ``MOD_BUFS``, ``mod_scale``: a score_mod's
        tables and the scale its scores take (``SCORE_MOD``); ``BM``, ``MASK_BUFS``: a
        block mask's per-key-block lists and its mask_mod's tables (``MASK_FN``;
        :func:`_block_mask_args`); ``()`` / unused without them. ``WIDE``: ``DS_RING``
        P^T / dS^T buffers of each kind, dQ pieces as wide as ``dq_desc``'s box
        (:func:`wide_plan`). ``TILES_OUTSIDE`` (:func:`_tiles_outside`: ``DETERMINISTIC``
        calls with more than one query head per KV head and no left bound): every partition walks a key tile's query tiles outside
        the group's query heads (:func:`_walk_outer`, :func:`_dq_order`)."""
        dtype: gl.constexpr = q_desc.dtype
        k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
        q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape,
                                           q_desc.layout)
        do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape,
                                            do_desc.layout)
        if WIDE:    # dS^T and P^T, DS_RING each, stored by halves of 32 query columns
            ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64,
                                                           element_bitwidth=16, rank=2)
            DS_BUFS: gl.constexpr = 2 * DS_RING
        else:
            ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
                [BLOCK_N, BLOCK_M], dtype)
            DS_BUFS: gl.constexpr = 3 if PERSISTENT else 2      # (see _bwd_consumer)
        ds_bufs = gl.allocate_shared_memory(dtype, [DS_BUFS, BLOCK_N, BLOCK_M], ds_layout)
        dq_bufs = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape,
                                            dq_desc.layout)
        lam_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + lam_desc.block_type.shape,
                                             lam_desc.layout)
        dd_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + dd_desc.block_type.shape,
                                            dd_desc.layout)
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        # DETERMINISTIC: the dQ staging buffers' hand-overs, full (WG) and empty (2 + WG);
        # unused otherwise (a placeholder, no shared memory)
        if DETERMINISTIC:
            dq_sync = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(4):
                mbarrier.init(dq_sync.index(i), count=1)
        else:
            dq_sync = turn
        mbarrier.init(kv_ready, count=1)
        if PERSISTENT:
            mbarrier.init(kv_empty, count=2)
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(ds_ready.index(i), count=2)
            mbarrier.init(ds_empty.index(i), count=2)
        if PINGPONG:
            for i in gl.static_range(2):
                mbarrier.init(turn.index(i), count=1)
            mbarrier.arrive(turn.index(0), count=1)   # warpgroup 0 issues first

        descs = (q_desc, k_desc, v_desc, do_desc, dq_desc, lam_desc, dd_desc)
        bufs = (k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, lam_bufs, dd_bufs)
        bars = (kv_ready, kv_empty, q_ready, q_empty, ds_ready, ds_empty, turn, dq_sync)
        shape = (q_len, kv_len, heads_k, group, n_n, wave_heads, n_bh, left, right)
        ptrs = (DK, DV, qk_scale, scale, step_scale, SEM)
        seqs = (CU_Q, CU_K, n_seqs, search_levels, search_top)
        mods = (MOD_BUFS, mod_scale, BM, MASK_BUFS)
        # the writers' dQ columns (DETERMINISTIC): warpgroup 0 adds 0 .. SPLIT, 1 SPLIT .. END
        if WIDE:
            DQ_COLS: gl.constexpr = dq_desc.block_type.shape[3]
            SPLIT: gl.constexpr = DQ_SPLIT
            END: gl.constexpr = (HEAD_DIM + DQ_COLS - 1) // DQ_COLS * DQ_COLS
        else:
            DQ_COLS: gl.constexpr = BLOCK_D // 2
            SPLIT: gl.constexpr = BLOCK_D // 2
            END: gl.constexpr = BLOCK_D
        # (the partitions' arguments are written out: in a tuple variable a function
        # (WEIGHTS) is no value, and constexprs become runtime values that the partitions
        # then receive through shared memory)
        if WIDE:
            if DETERMINISTIC:   # and one writer warp per consumer warpgroup (_dq_writer)
                warp_specialize([
                    (_wide_consumer, (descs, bufs, bars, shape, ptrs, mods, BLOCK_M,
                                      BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V,
                                      DQ_SPLIT, DQ_COLS, DS_RING, STAGES, MASK_LEFT,
                                      MASK_RIGHT, SOFTCAP, 0,
                                      MASK_TAIL_KEYS, WEIGHTS, True, SCORE_MOD, TILES_OUTSIDE)),
                    (_wide_consumer, (descs, bufs, bars, shape, ptrs, mods, BLOCK_M,
                                      BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V,
                                      DQ_SPLIT, DQ_COLS, DS_RING, STAGES, MASK_LEFT,
                                      MASK_RIGHT, SOFTCAP, 1,
                                      MASK_TAIL_KEYS, WEIGHTS, True, SCORE_MOD, TILES_OUTSIDE)),
                    (_bwd_producer, (descs, bufs, bars, shape, seqs, mods, BLOCK_M, BLOCK_N,
                                     STAGES, MASK_LEFT, MASK_RIGHT, False, DETERMINISTIC,
                                     False, None, TILES_OUTSIDE)),
                    (_dq_writer, (descs, bufs, bars, shape, SEM, BLOCK_M, BLOCK_N, MASK_LEFT,
                                  MASK_RIGHT, 0, SPLIT, DQ_COLS, not WIDE, 0, TILES_OUTSIDE)),
                    (_dq_writer, (descs, bufs, bars, shape, SEM, BLOCK_M, BLOCK_N, MASK_LEFT,
                                  MASK_RIGHT, SPLIT, END, DQ_COLS, not WIDE, 1,
                                  TILES_OUTSIDE)),
                ], [4, 1, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS, PRODUCER_REGS])
            else:
                warp_specialize([
                    (_wide_consumer, (descs, bufs, bars, shape, ptrs, mods, BLOCK_M,
                                      BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V,
                                      DQ_SPLIT, DQ_COLS, DS_RING, STAGES, MASK_LEFT,
                                      MASK_RIGHT, SOFTCAP, 0,
                                      MASK_TAIL_KEYS, WEIGHTS, False, SCORE_MOD)),
                    (_wide_consumer, (descs, bufs, bars, shape, ptrs, mods, BLOCK_M,
                                      BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V,
                                      DQ_SPLIT, DQ_COLS, DS_RING, STAGES, MASK_LEFT,
                                      MASK_RIGHT, SOFTCAP, 1,
                                      MASK_TAIL_KEYS, WEIGHTS, False, SCORE_MOD)),
                    (_bwd_producer, (descs, bufs, bars, shape, seqs, mods, BLOCK_M, BLOCK_N,
                                     STAGES, MASK_LEFT, MASK_RIGHT, False, DETERMINISTIC,
                                     False)),
                ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            if DETERMINISTIC:
                warp_specialize([
                    (_bwd_consumer, (descs, bufs, bars, shape, ptrs, seqs, mods, BLOCK_M,
                                     BLOCK_N, BLOCK_D, HEAD_DIM, STAGES, MASK_LEFT,
                                     MASK_RIGHT, SOFTCAP, STORE_TMA, 0, PINGPONG, PERSISTENT,
                                     LATE_STATS, MASK_TAIL_KEYS, WEIGHTS, True, VARLEN,
                                     SCORE_MOD, MASK_FN, COLUMN_BOUNDS, TILES_OUTSIDE)),
                    (_bwd_consumer, (descs, bufs, bars, shape, ptrs, seqs, mods, BLOCK_M,
                                     BLOCK_N, BLOCK_D, HEAD_DIM, STAGES, MASK_LEFT,
                                     MASK_RIGHT, SOFTCAP, STORE_TMA, 1, PINGPONG, PERSISTENT,
                                     LATE_STATS, MASK_TAIL_KEYS, WEIGHTS, True, VARLEN,
                                     SCORE_MOD, MASK_FN, COLUMN_BOUNDS, TILES_OUTSIDE)),
                    (_bwd_producer, (descs, bufs, bars, shape, seqs, mods, BLOCK_M, BLOCK_N,
                                     STAGES, MASK_LEFT, MASK_RIGHT, PERSISTENT,
                                     DETERMINISTIC, VARLEN, MASK_FN, TILES_OUTSIDE)),
                    (_dq_writer, (descs, bufs, bars, shape, SEM, BLOCK_M, BLOCK_N, MASK_LEFT,
                                  MASK_RIGHT, 0, SPLIT, DQ_COLS, not WIDE, 0, TILES_OUTSIDE,
                                  PERSISTENT)),
                    (_dq_writer, (descs, bufs, bars, shape, SEM, BLOCK_M, BLOCK_N, MASK_LEFT,
                                  MASK_RIGHT, SPLIT, END, DQ_COLS, not WIDE, 1,
                                  TILES_OUTSIDE, PERSISTENT)),
                ], [4, 1, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS, PRODUCER_REGS])
            else:
                warp_specialize([
                    (_bwd_consumer, (descs, bufs, bars, shape, ptrs, seqs, mods, BLOCK_M,
                                     BLOCK_N, BLOCK_D, HEAD_DIM, STAGES, MASK_LEFT,
                                     MASK_RIGHT, SOFTCAP, STORE_TMA, 0, PINGPONG, PERSISTENT,
                                     LATE_STATS, MASK_TAIL_KEYS, WEIGHTS, False, VARLEN,
                                     SCORE_MOD, MASK_FN, COLUMN_BOUNDS)),
                    (_bwd_consumer, (descs, bufs, bars, shape, ptrs, seqs, mods, BLOCK_M,
                                     BLOCK_N, BLOCK_D, HEAD_DIM, STAGES, MASK_LEFT,
                                     MASK_RIGHT, SOFTCAP, STORE_TMA, 1, PINGPONG, PERSISTENT,
                                     LATE_STATS, MASK_TAIL_KEYS, WEIGHTS, False, VARLEN,
                                     SCORE_MOD, MASK_FN, COLUMN_BOUNDS)),
                    (_bwd_producer, (descs, bufs, bars, shape, seqs, mods, BLOCK_M, BLOCK_N,
                                     STAGES, MASK_LEFT, MASK_RIGHT, PERSISTENT,
                                     DETERMINISTIC, VARLEN, MASK_FN)),
                ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        mbarrier.invalidate(kv_ready)
        if PERSISTENT:
            mbarrier.invalidate(kv_empty)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(q_ready.index(i))
            mbarrier.invalidate(q_empty.index(i))
        for i in gl.static_range(2):
            mbarrier.invalidate(ds_ready.index(i))
            mbarrier.invalidate(ds_empty.index(i))
        if PINGPONG:
            for i in gl.static_range(2):
                mbarrier.invalidate(turn.index(i))
        if DETERMINISTIC:
            for i in gl.static_range(4):
                mbarrier.invalidate(dq_sync.index(i))


def block_d(head_dim: int) -> int:
    """The kernel's tile width for ``head_dim``: 64 up to 64, else 128 (TMA reads the
    columns past the head dim as zeros and does not write them; 80 and 96 load as 128 and
    compute over 64 + 16 and 64 + 32 columns)."""
    return 64 if head_dim <= 64 else 128


def wide(head_dim: int, head_dim_v: int) -> bool:
    """Whether a call runs the ``WIDE`` variant: head dims past 128, or ``Dv != D``."""
    return not (head_dim == head_dim_v and head_dim <= 128)


class WidePlan(NamedTuple):
    """The tiles of a ``WIDE`` call (:func:`wide_plan`)."""
    block_d: int    # q / k tile width (a power of two)
    block_dv: int   # v / dO tile width
    dq_split: int   # the dQ column where warpgroup 1's pieces start
    stages: int     # depth of the Q / dO ring
    dq_cols: int    # columns of one dQ piece (its staging buffer: BLOCK_M x dq_cols fp32)
    ds_ring: int    # P^T / dS^T buffers of each kind (2: a step stores while the last reads)


def wide_plan(head_dim: int, head_dim_v: int) -> WidePlan:
    """The ``WIDE`` variant's tiles: the forward's tile widths (:func:`.gluon_fwd.block_dims`,
    powers of two: TMA reads the columns past the head dims as zeros), the dQ column where
    warpgroup 1's pieces start (a multiple of 64 near ``BLOCK_DV / 2``, so that ``BLOCK_D +
    DQ_SPLIT`` and ``BLOCK_DV + D - DQ_SPLIT`` output columns, the two warpgroups' products,
    are about equal), and how shared memory is spent: a two-stage Q / dO ring (a single
    stage leaves each step's Q / dO load exposed) with 64-column dQ pieces and two P / dS
    buffers where that fits, else two stages with 32-column pieces and one P / dS buffer
    (256 / 256: K, V 64 KB, P / dS 16 KB, dQ staging 16 KB, two stages of Q and dO 129 KB),
    else one stage."""
    bd, bdv = gluon_fwd.block_dims(head_dim, max(head_dim_v, 64))
    split = min(max(64, (bdv // 2) // 64 * 64), bd - 64)

    def smem(stages, dq_cols, ds_ring):
        kv = 2 * WIDE_BLOCK_N * (bd + bdv)
        ds = 2 * ds_ring * WIDE_BLOCK_N * BLOCK_M * 2
        return (kv + ds + 2 * BLOCK_M * dq_cols * 4
                + stages * (2 * BLOCK_M * (bd + bdv) + 2 * 4 * BLOCK_M))
    for stages, dq_cols, ds_ring in ((2, 64, 2), (2, 32, 1), (1, 64, 2)):
        if smem(stages, dq_cols, ds_ring) <= SHARED_BYTES:
            break
    return WidePlan(bd, bdv, split, stages, dq_cols, ds_ring)


def supported(q, k, v, do, *, causal: bool = False, left: int | None = None,
              right: int | None = None, softcap: float | None = None) -> bool:
    """Whether the kernel's scope covers these tensors, whatever their device: the
    forward's (:func:`.gluon_fwd.supported`: ``D = Dv`` up to 256, or ``D`` in 129-256
    with ``Dv`` in 65-128) narrowed to calls where every row sees a key (a right bound
    ``r``, causal's 0 included: ``Nq <= Nk + r``), with ``dO`` of ``v``'s shape in ``q``'s
    dtype, TMA-compatible; 16-bit (FP8 has no backward)."""
    left, right = gluon_fwd._bounds(causal, left, right)
    return (q.dtype != torch.float8_e4m3fn and q.dim() == 4 and k.dim() == 4 and v.dim() == 4
            and do.shape == (*q.shape[:-1], v.shape[-1])
            and not (right is not None and q.shape[2] > k.shape[2] + right)
            and do.dtype == q.dtype and addressable(do)
            and gluon_fwd.supported(q, k, v, left=left, right=right, softcap=softcap))


def eligible(q, k, v, do, *, causal: bool = False, left: int | None = None,
             right: int | None = None, softcap: float | None = None) -> bool:
    """:func:`supported`, :func:`.gluon_fwd.on_hopper`, and the TMA reduce op present in
    this Triton (3.6 has it; the caller rules out mods, and checks
    :func:`supported_varlen` for packed sequences)."""
    return HAS_TMA_REDUCE and gluon_fwd.on_hopper(q) and supported(
        q, k, v, do, causal=causal, left=left, right=right, softcap=softcap)


def supported_varlen(q, k, v, do, cu_seqlens_q, cu_seqlens_k, *, deterministic: bool,
                     left: int | None = None, right: int | None = None,
                     softcap: float | None = None) -> bool:
    """Whether packed sequences run this kernel (``VARLEN``): :func:`supported` of the
    packed tensors (a batch of one), head dims up to 128 with ``Dv = D`` (not ``WIDE``),
    not deterministic, and every row seeing a key under a right bound, which the same
    offsets for queries and keys guarantee (``cu_seqlens_q is cu_seqlens_k``; other
    offsets with a right bound take the Triton kernels, whose rule needs no lengths)."""
    return (q.shape[0] == 1 and not deterministic and not wide(q.shape[-1], v.shape[-1])
            and (right is None or cu_seqlens_q is cu_seqlens_k)
            and supported(q, k, v, do, left=left, right=right, softcap=softcap))


def fits_mods(q, v, *, score_mod=None, mask_mod=None, mask_block=None,
              left: int | None = None, right: int | None = None, deterministic: bool = False,
              varlen: bool = False) -> bool:
    """Whether the kernel takes these mods (none always): a ``score_mod`` whose value and
    derivative Gluon lowers (:func:`.mods.score_grad_gluon_ok`; packed sequences too,
    ``b`` their index), and a block mask of ``mask_mod`` in blocks of ``mask_block =
    (rows, keys)`` on the head_dim <= 128 tiles (``Dv = D``, not :func:`wide`) without
    packed sequences, on calls without a window or causal bound (its tables carry them),
    not deterministic (its walks are not the contiguous ranges the dQ turns assume), the
    mask_mod lowered by Gluon, its blocks 128 query rows (two query tiles) and a multiple
    of :data:`BLOCK_N` keys (:func:`_column_walk`)."""
    if score_mod is not None and not score_grad_gluon_ok(score_mod):
        return False
    if mask_mod is not None:
        sm, sn = mask_block
        return (not varlen and not wide(q.shape[-1], v.shape[-1]) and left is None
                and right is None and not deterministic and mask_mod.gluon_ok
                and sm == 2 * BLOCK_M and sn % BLOCK_N == 0)
    return True


def _block_mask_args(block_mask, device) -> tuple:
    """The kernel's ``BM`` (:func:`_column_walk`): the block mask's per-key-block lists
    (:func:`.mods.column_lists`), the strides of a ``(b, h)`` row of counts and of index
    lists (0 along a dim the mask broadcasts), the query blocks per index list and the
    key tiles per key block; and ``MASK_BUFS``, its mask_mod's tables. ``()`` twice
    without one."""
    if block_mask is None:
        return (), ()
    Bm, Hm, nM, nN = block_mask.state.shape
    pn, pi, fn, fi = column_lists(block_mask)
    bm = (pn, pi, fn, fi, Hm * nN if Bm > 1 else 0, nN if Hm > 1 else 0,
          Hm * nN * nM if Bm > 1 else 0, nN * nM if Hm > 1 else 0, nM,
          block_mask.BLOCK_SIZE[1] // BLOCK_N)
    return bm, block_mask.column_mod.buffer_args(device)


def _mask_fn(block_mask) -> dict:
    """``MASK_FN`` and ``COLUMN_BOUNDS`` of a call (:meth:`.mods.BlockMask.gluon_mask`): a
    block mask whose columns are each one interval of queries gives the intervals'
    bounds, which each key tile reads once per query head; another, its column mask,
    evaluated per pair in the PARTIAL tiles; none, None."""
    fn, columns = (None, False) if block_mask is None else block_mask.gluon_mask("queries")
    return dict(MASK_FN=fn, COLUMN_BOUNDS=columns)


def store_tma(bounded: bool, steps: int) -> bool:
    """Whether the programs write ``dK``, ``dV`` by TMA stores (staged in the idle Q / dO
    ring) rather than from registers, for programs of ``steps`` query tiles (``bounded``:
    causal or windowed, whose programs are short or uneven: always).

    The register epilogue's 64 scattered 4-byte stores per thread take ~2.9 us of a
    program (a step takes ~2.5 us), so the TMA stores gain where programs are short; but
    the dense variant's step loop compiles slower with them, so dense calls keep the
    register stores once a program has more than :data:`STORE_TMA_MAX_STEPS` steps. One
    rule serves head_dim 64 and 128 (level at 64). Measured (H200, whole call against the
    register stores): 1K dense +2-7%, 1K causal +7-10%, 4K and 16K dense -2 to -6%;
    ``docs/notes/attention_bwd.md``, "TMA stores for causal and short dense programs"."""
    return bounded or steps <= STORE_TMA_MAX_STEPS


def wave_heads(bounded: bool, n_n: int, n_bh: int, num_sms: int) -> int:
    """Heads per group of programs (see ``_program``): 1 for dense calls (every program
    has the same work), else (causal or windowed) the fewest heads, dividing ``n_bh``, whose key tiles together
    fill the GPU (``wave_heads * n_n >= num_sms``).

    Why: a causal key tile ``n`` of ``N`` keys has ``N / 64 - 2 n`` steps, so heavy tiles
    are the first of each head. Head-major order (one group per head) leaves the last
    heads' heaviest tiles to start last: a greedy list schedule of the targets' causal
    rows (16,384 tokens, 16 heads, one program per SM, ~2.4 us a step, 5 us a program's
    fixed cost) ends 6.4% (1K), 6.7% (4K) and 0.4% (16K) after the ideal, which matches the
    H200's stamps at 1K causal (447 us simulated, 447-448 measured). Tile-major groups of
    at least a wave end within 1-1.5% of the ideal in the same model, and keep the heads a
    wave reads few (``Q``, ``dO`` and the dQ rows of ``wave_heads`` heads stay in L2),
    which a global heaviest-first order would not.

    Measured (H200, kernel alone against head-major order): 1K causal 0.99-1.02, 4K
    0.90-1.05, 16K 0.88-1.01 (one outlier each); groups of 64 heads lost 5% (L2), other
    group sizes were no better; ``docs/notes/attention_bwd.md``, "Program order for causal
    calls: waves of heads"."""
    if not bounded:
        return 1
    for g in range(1, n_bh + 1):
        if n_bh % g == 0 and g * n_n >= num_sms:
            return g
    return n_bh


def pingpong_default(causal: bool, head_dim: int) -> bool:
    """Whether the consumer warpgroups take turns issuing each step's first products
    (``S^T``, ``dP^T``) in calls whose rows have a right bound (``causal``: causal or a
    window's right side) at the tile width ``head_dim`` (:func:`block_d`): each waits until the other has issued its own for the step before
    (two mbarriers, the forward's ``_take_turn``), so that they stay half a step apart
    rather than computing their exponentials at the same time.

    Head_dim-128 causal calls take turns. Measured (H200, kernel alone against no turns):
    head_dim 128 causal 4K 1.019-1.046, 16K 0.995-1.040; dense and head_dim 64 around 1.0,
    mostly below; ``docs/notes/attention_bwd.md``, "Turns between the consumer
    warpgroups"."""
    return causal and head_dim == 128


def persistent_default(bounded: bool, head_dim: int) -> bool:
    """Whether the programs are persistent: one per SM (at most one per key tile), taking
    key tiles ``pid, pid + grid, ...`` (dense calls only: causal tiles differ in work and
    keep :func:`wave_heads`' order). A tile's ``K``, ``V`` then load while the previous
    tile's ``dK``, ``dV`` are written, and no program starts or ends between tiles.

    Measured (H200, kernel alone against one program per key tile): head_dim 64 dense
    1.05-1.15; head_dim 128 dense 0.76-0.84, where the tile loop around the step loop makes
    ptxas spill 400 bytes (112 without); ``docs/notes/attention_bwd.md``, "Persistent
    programs at head_dim 64". ``deterministic`` calls too (launched cooperatively), measured
    (H100, eager backward against one program per key tile): d64 dense 4K x4 1.03, 16K
    1.00, GQA 32:8 4K x4 1.00, BERT's 32 x 12 x 512 1.79 (the note's "Persistent programs
    in the deterministic mode")."""
    return not bounded and head_dim == 64


def late_stats_default(head_dim: int) -> bool:
    """Whether each step reads ``lambda`` and ``D`` from shared memory after the waits of
    ``S^T`` and ``dP^T`` (``late_stats``): where the loads before the waits make ptxas
    spill, at head_dim 128 (at 64 nothing spills either way, sm_90 compile).

    Measured (H200, kernel alone against the loads before the waits, medians): head_dim
    128 1.00-1.03, GQA 1.08; head_dim 64 causal 0.97-0.98 (the loads only wait longer);
    ``docs/notes/attention_bwd.md``, "Late stats: where the head_dim-128 step spilled"."""
    return head_dim == 128


def dq_counters(q):
    """A deterministic call's dQ add counters (``_dq_order``): int32 ``(B, Hq, ceil(Nq /
    64), 2)``, one per query tile and warpgroup, zeroed, on ``q``'s device (a plan
    buffer: replays allocate it zeroed again)."""
    B, Hq, Nq = q.shape[:3]
    return plans.new((B, Hq, -(-Nq // BLOCK_M), 2), dtype=torch.int32, device=q.device,
                     zero=True)


#: the sequence arguments of a call without packed sequences (unused)
_NO_SEQS = (None, None, 0, 0, 0)


def stats_length(T: int, n_seqs: int) -> int:
    """The length of :func:`stats_rows`' rows for ``T`` packed rows of ``n_seqs``
    sequences: room for every sequence from its aligned start, and a multiple of 4 (TMA:
    the row stride 16-byte aligned)."""
    return 4 * (-(-T // 4) + n_seqs + 1)


@triton.jit
def _stats_apart(LAM, DD, LAM_OUT, DD_OUT, CU, T, L, n_seqs, n_halvings,
                 stride_h, stride_h_out, BLOCK: tl.constexpr):
    """One program per ``BLOCK`` places of one head's rows of :func:`stats_rows`: place
    ``p`` takes row ``cu[s] + p - start(s)`` of the sequence ``s`` whose start
    ``start(s) = 4 (ceil(cu[s] / 4) + s)`` is the last at or before ``p`` (found by
    ``n_halvings`` halvings of ``[0, n_seqs - 1]``), 0 past that sequence's end (past
    ``T`` for the last sequence)."""
    h = tl.program_id(1)
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = lo + (n_seqs - 1)
    for _ in range(n_halvings):
        mid = (lo + hi + 1) // 2
        c = tl.load(CU + mid)
        before = 4 * ((c + 3) // 4 + mid) <= p
        lo = tl.where(before, mid, lo)
        hi = tl.where(before, hi, mid - 1)
    c = tl.load(CU + lo)
    row = c + p - 4 * ((c + 3) // 4 + lo)
    end = tl.load(CU + lo + 1, mask=lo < n_seqs - 1, other=T)
    inside = (row < end) & (row < T)
    a = tl.load(LAM + h * stride_h + row, mask=inside, other=0.0)
    b = tl.load(DD + h * stride_h + row, mask=inside, other=0.0)
    keep = p < L
    tl.store(LAM_OUT + h * stride_h_out + p, a, mask=keep)
    tl.store(DD_OUT + h * stride_h_out + p, b, mask=keep)


def stats_rows_launch(lam, dd, cu_seqlens):
    """The packed sequences' row statistics ``lam``, ``dd (1, H, T)`` (fp32, unit last
    stride, one head stride) laid out for the kernel: returns ``(lam_out, dd_out, launch)``,
    ``(1, H, stats_length(T, S))`` each (plan buffers) and the launch of
    ``_stats_apart`` that fills them. Sequence ``s`` (rows ``cu[s] ..``) starts at ``4
    (ceil(cu[s] / 4) + s)`` (:func:`_stats_start`), zeros between: a packed tile's first
    row is any row, but TMA needs the start of a box's innermost dim (here the rows)
    16-byte aligned. Rows past ``cu[S]`` follow the last sequence's. The places depend on
    the offsets' values, so the copy is a launch (a plan replays it), with no host sync."""
    H, T = lam.shape[1], lam.shape[-1]
    n = cu_seqlens.shape[0] - 1
    if n < 1:
        raise ValueError("cu_seqlens: needs at least one sequence (shape (S + 1,), S >= 1)")
    if lam.stride() != dd.stride() or lam.stride(-1) != 1:
        raise ValueError("lam, dd: one layout with unit last stride expected")
    L = stats_length(T, n)
    outs = [plans.new((1, H, L), dtype=torch.float32, device=lam.device) for _ in range(2)]
    block = 1024
    grid = (-(-L // block), H)
    launch = (_stats_apart, grid,
              [lam, dd, *outs, cu_seqlens, T, L, n, (n - 1).bit_length(), lam.stride(1), L],
              dict(BLOCK=block, num_warps=4))
    return outs[0], outs[1], launch


def stats_rows(lam, dd, cu_seqlens):
    """:func:`stats_rows_launch`, launched: the laid-out ``(lam_out, dd_out)``."""
    lam_out, dd_out, (kernel, grid, args, kwargs) = stats_rows_launch(lam, dd, cu_seqlens)
    launcher.launch(kernel, grid, args, kwargs)
    return lam_out, dd_out


def _tiles_outside(counters, Hq: int, Hk: int, left) -> bool:
    """``TILES_OUTSIDE`` of a call: deterministic, more than one query head per KV head,
    and no left bound. Measured (H200, bf16, ``benchmarks/deterministic_bwd.py``,
    deterministic against the default): Llama-3 GQA 32:8 causal 4K x4 0.84 -> 0.92,
    Gemma GQA 16:8 causal d256 8K x2 0.77 -> 0.99; with a left bound (Mistral's causal
    window 4096, 16K) 0.92 -> 0.77, so windows keep the heads outside."""
    return counters is not None and Hq > Hk and left is None


def gluon_attention_bwd(q, k, v, do, lam, dd, dq_acc, dk, dv, *, causal: bool, scale: float,
                        left: int | None = None, right: int | None = None,
                        softcap: float | None = None, launch: bool = True, tma_store: bool | None = None,
                        heads_per_wave: int | None = None, pingpong: bool | None = None,
                        persistent: bool | int | None = None, late_stats: bool | None = None,
                        mask_tail_keys: bool | None = None, deterministic: bool = False,
                        cu_seqlens_q=None, cu_seqlens_k=None, score_mod=None,
                        block_mask=None):
    """Add ``dS K`` into ``dq_acc (B, Hq, Nq, D)`` (fp32, contiguous, zeroed; dQ is then
    ``scale * dq_acc``) and write
    ``dk``, ``dv (B, Hk, Nk, D)`` (contiguous, input dtype) for ``q (B, Hq, Nq, D)``,
    ``k, v (B, Hk, Nk, D)``, ``do`` like ``q``, from the preprocess's ``lam`` and ``dd
    (B, Hq, Nq)`` (fp32, unit last stride, 16-byte aligned head strides: TMA tiles).
    ``left`` / ``right``: the forward's bottom-right aligned window (``causal`` folds in
    ``right = 0``); ``softcap``: the forward's ``c tanh(s / c)`` scores. The caller checks
    :func:`eligible`. ``tma_store``: how ``dK``, ``dV`` are written (default
    :func:`store_tma`); ``heads_per_wave``: the program order (default :func:`wave_heads`);
    ``pingpong``: whether the consumers take turns (default :func:`pingpong_default`);
    ``persistent``: whether the programs are persistent (default
    :func:`persistent_default`; an int: that many programs, at most one per key tile);
    ``late_stats``: read each step's ``lambda`` and ``D`` from shared memory after the waits
    of ``S^T`` and ``dP^T`` instead of before them (16 registers each per thread that are
    then not live while the four wgmma accumulators are: at head_dim 128, 16 heads,
    N = 4096, sm_90 compile, spill stores 96 -> 20 bytes (dense), 64 -> 0 (causal) and
    384 -> 152 (dense, persistent programs, whose step loops then spill nothing; see
    ``benchmarks/gluon_bwd_sass.py``); the load latency moves onto the step's path.
    Default :func:`late_stats_default`); ``mask_tail_keys``: whether dense programs zero
    ``P`` of keys past ``Nk`` (default: only when ``Nk`` is not a multiple of ``BLOCK_N``,
    the only case that has such keys; the select was 32 of a head_dim-64 step's 403
    instructions).
    ``deterministic``: the dQ adds into each query tile in a fixed order (the programs of
    its key tiles in turn, ``_dq_order``, counted in :func:`dq_counters`), so that
    ``dq_acc`` is bitwise reproducible; walks not staggered, in GQA calls without a left
    bound the query tiles outside the group's heads (:func:`_tiles_outside`); one program
    per key tile or persistent ones as the default mode's (:func:`persistent_default`),
    persistent programs launched cooperatively, at most one per SM, since a program may
    wait for another's tile.
    ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32 ``(S + 1,)``, tensors of a batch of one):
    packed sequences (``VARLEN``; head dims up to 128, not deterministic, one program
    per key-tile slot, :func:`_varlen_program`; dK, dV from registers; ``lam`` and ``dd``
    given laid out apart per sequence for TMA, ``(1, Hq, stats_length(Nq, S))``:
    :func:`stats_rows`; tiles also read rows past a sequence's end: ``P`` is zeroed
    there). The caller checks :func:`supported_varlen`.
    ``score_mod`` (a traced score_mod, :class:`~.mods.TracedMod`): the forward's modified
    scores, recomputed with their derivative (:func:`_probs`); ``block_mask``
    (:class:`~.mods.BlockMask`): each key tile walks the query tiles its block mask
    lists, evaluating the mask_mod in the PARTIAL ones (:func:`_column_walk`); calls with
    either are scheduled as windowed ones (uneven programs: not persistent, waves of
    heads, TMA stores). The caller checks :func:`fits_mods`.
    ``launch=False`` returns the kernel, its grid, positional and keyword arguments."""
    B, Hq, Nq, D = q.shape
    Hk, Nk, DV = k.shape[1], k.shape[2], v.shape[-1]
    left, right = gluon_fwd._bounds(causal, left, right)
    varlen = cu_seqlens_q is not None
    if not fits_mods(q, v, score_mod=score_mod,
                     mask_mod=block_mask.column_mod if block_mask is not None else None,
                     mask_block=block_mask.BLOCK_SIZE if block_mask is not None else None,
                     left=left, right=right, deterministic=deterministic, varlen=varlen):
        raise ValueError("score_mod / block_mask: outside the kernel's scope (fits_mods)")
    # uneven programs: a window's, or a block mask's walks
    bounded = left is not None or right is not None or block_mask is not None
    weights = tile_step_functions(ATTENTION2, scale="score", gluon=True).tile_weights
    if softcap is not None:
        # tanh(x) = 1 - 2 / (2^(2 log2(e) x) + 1), x = scale qk / c (the forward's form);
        # the generated weights multiply tanh by c
        qk_scale, step_scale = 2 * LOG2E * float(scale) / softcap, float(softcap)
    else:
        qk_scale, step_scale = 0.0, float(scale)
    # a score_mod takes the scores in natural-log units (times the scale or the cap), and
    # the weights then take its output as it comes
    mod_bufs, mod_scale = (), 0.0
    if score_mod is not None:
        mod_bufs, mod_scale, step_scale = score_mod.buffer_args(q.device), step_scale, 1.0
    bm, mask_bufs = _block_mask_args(block_mask, q.device)
    counters = dq_counters(q) if deterministic else None
    if varlen and (wide(D, DV) or deterministic or persistent or tma_store):
        raise ValueError("cu_seqlens: packed sequences run the head_dim <= 128 tiles, one "
                         "program per key tile, dK and dV from registers, not deterministic")
    if wide(D, DV):
        knobs = dict(tma_store=tma_store, pingpong=pingpong, persistent=persistent,
                     late_stats=late_stats, mask_tail_keys=mask_tail_keys)
        asked = sorted(name for name, value in knobs.items() if value is not None)
        if asked:
            raise ValueError(f"{', '.join(asked)}: options of the head_dim <= 128 tiles; the "
                             f"WIDE variant (D={D}, Dv={DV}) has none")
        return _wide_launch(q, k, v, do, lam, dd, dq_acc, dk, dv, left, right, softcap,
                            scale, qk_scale, step_scale, weights, heads_per_wave, counters,
                            launch, score_mod, mod_bufs, mod_scale)
    BD = block_d(D)
    n_n = -(-Nk // BLOCK_N)
    seqs = _NO_SEQS
    if varlen:
        n_seqs = cu_seqlens_q.shape[0] - 1
        laid_out = (B, Hq, stats_length(Nq, n_seqs))
        if lam.shape != laid_out or dd.shape != laid_out:
            raise ValueError(f"lam, dd: packed sequences' statistics laid out by stats_rows "
                             f"{laid_out} expected (got {tuple(lam.shape)}, "
                             f"{tuple(dd.shape)})")
        n_n = gluon_fwd.varlen_slots(Nk, n_seqs)       # key-tile slots per KV head
        levels = max(gluon_fwd.search_levels(n_seqs), 1)
        seqs = (cu_seqlens_q, cu_seqlens_k, n_seqs, levels, 32 ** (levels - 1))
        persistent = tma_store = False
        # keys past a sequence's end are the next sequence's: always masked
        mask_tail_keys = True if mask_tail_keys is None else mask_tail_keys
        if not mask_tail_keys:
            raise ValueError("mask_tail_keys: packed sequences mask the keys past each end")
    if persistent is None:
        persistent = persistent_default(bounded, BD)
    if tma_store is None:   # persistent programs reuse the ring at once: register stores
        tma_store = not persistent and store_tma(bounded, (Hq // Hk) * -(-Nq // BLOCK_M))
    if heads_per_wave is None:
        heads_per_wave = wave_heads(bounded, n_n, B * Hk, gluon_fwd.num_sms(q))
    if pingpong is None:
        pingpong = pingpong_default(right is not None, BD)
    if late_stats is None:
        late_stats = late_stats_default(BD)
    if mask_tail_keys is None:
        mask_tail_keys = Nk % BLOCK_N != 0
    if not mask_tail_keys and Nk % BLOCK_N:
        raise ValueError(f"mask_tail_keys=False needs Nk a multiple of {BLOCK_N} (got {Nk})")
    if persistent and (bounded or tma_store):
        raise ValueError("persistent programs are unbounded and store dK, dV from registers "
                         f"(got left={left}, right={right}, tma_store={tma_store})")
    out = ((_desc(dk, BLOCK_N // 2, BD), _desc(dv, BLOCK_N // 2, BD)) if tma_store
           else (dk, dv))
    args = (_desc(q, BLOCK_M, BD), _desc(k, BLOCK_N, BD), _desc(v, BLOCK_N, BD),
            _desc(do, BLOCK_M, BD), _desc(dq_acc, BLOCK_M, BD // 2),
            _desc(lam.unsqueeze(2), 1, BLOCK_M), _desc(dd.unsqueeze(2), 1, BLOCK_M), *out,
            Nq, Nk, Hk, Hq // Hk, n_n, heads_per_wave, B * Hk,
            0 if left is None else int(left), 0 if right is None else int(right),
            qk_scale, float(scale), step_scale, counters, *seqs, mod_bufs, mod_scale, bm,
            mask_bufs)
    kwargs = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BD, HEAD_DIM=D, STAGES=STAGES[BD],
                  MASK_LEFT=left is not None, MASK_RIGHT=right is not None,
                  SOFTCAP=softcap is not None, STORE_TMA=bool(tma_store),
                  PINGPONG=bool(pingpong), PERSISTENT=bool(persistent),
                  LATE_STATS=bool(late_stats), MASK_TAIL_KEYS=bool(mask_tail_keys),
                  WEIGHTS=weights, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
                  DETERMINISTIC=counters is not None, VARLEN=varlen,
                  TILES_OUTSIDE=_tiles_outside(counters, Hq, Hk, left),
                  SCORE_MOD=score_grad_fn(score_mod, gluon=True) if score_mod is not None
                  else None,
                  **_mask_fn(block_mask), num_warps=4, maxnreg=MAXNREG)
    programs = n_n * B * Hk
    if persistent:
        n_sms = gluon_fwd.num_sms(q)
        if persistent is not True and counters is not None and int(persistent) > n_sms:
            raise ValueError(f"persistent: a deterministic call's persistent programs must "
                             f"all be resident, at most one per SM ({n_sms}; got "
                             f"{int(persistent)})")
        programs = min(programs, n_sms if persistent is True else int(persistent))
        if counters is not None:
            # programs wait for lower key tiles, which may be any program's: a cooperative
            # launch starts them all at once, or fails instead of waiting forever
            kwargs["launch_cooperative_grid"] = True
    grid = (programs,)
    if not launch:
        return _attn_bwd_ws, grid, args, kwargs
    launcher.launch(_attn_bwd_ws, grid, args, kwargs)
    return dq_acc, dk, dv


def _wide_launch(q, k, v, do, lam, dd, dq_acc, dk, dv, left, right, softcap, scale, qk_scale,
                 step_scale, weights, heads_per_wave, counters, launch, score_mod, mod_bufs,
                 mod_scale):
    """:func:`gluon_attention_bwd` for the ``WIDE`` variant (:func:`wide_plan`): programs
    of :data:`WIDE_BLOCK_N` keys, dK and dV stored from registers."""
    B, Hq, Nq, D = q.shape
    Hk, Nk, DV = k.shape[1], k.shape[2], v.shape[-1]
    bounded = left is not None or right is not None
    plan = wide_plan(D, DV)
    BD, BDV = plan.block_d, plan.block_dv
    n_n = -(-Nk // WIDE_BLOCK_N)
    if heads_per_wave is None:
        heads_per_wave = wave_heads(bounded, n_n, B * Hk, gluon_fwd.num_sms(q))
    args = (_desc(q, BLOCK_M, BD), _desc(k, WIDE_BLOCK_N, BD), _desc(v, WIDE_BLOCK_N, BDV),
            _desc(do, BLOCK_M, BDV), _desc(dq_acc, BLOCK_M, plan.dq_cols),
            _desc(lam.unsqueeze(2), 1, BLOCK_M), _desc(dd.unsqueeze(2), 1, BLOCK_M), dk, dv,
            Nq, Nk, Hk, Hq // Hk, n_n, heads_per_wave, B * Hk,
            0 if left is None else int(left), 0 if right is None else int(right),
            qk_scale, float(scale), step_scale, counters, *_NO_SEQS, mod_bufs, mod_scale, (),
            ())
    kwargs = dict(BLOCK_M=BLOCK_M, BLOCK_N=WIDE_BLOCK_N, BLOCK_D=BD, HEAD_DIM=D,
                  STAGES=plan.stages, MASK_LEFT=left is not None, MASK_RIGHT=right is not None,
                  SOFTCAP=softcap is not None, STORE_TMA=False, PINGPONG=False,
                  PERSISTENT=False, LATE_STATS=True,
                  MASK_TAIL_KEYS=Nk % WIDE_BLOCK_N != 0, WEIGHTS=weights,
                  CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
                  DETERMINISTIC=counters is not None, WIDE=True,
                  TILES_OUTSIDE=_tiles_outside(counters, Hq, Hk, left),
                  BLOCK_DV=BDV, HEAD_DIM_V=DV, DQ_SPLIT=plan.dq_split, DS_RING=plan.ds_ring,
                  SCORE_MOD=score_grad_fn(score_mod, gluon=True) if score_mod is not None
                  else None, num_warps=4, maxnreg=MAXNREG)
    grid = (n_n * B * Hk,)
    if not launch:
        return _attn_bwd_ws, grid, args, kwargs
    launcher.launch(_attn_bwd_ws, grid, args, kwargs)
    return dq_acc, dk, dv
