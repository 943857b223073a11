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

  where the softmax of a tile (mask, row max, ``exp2``, row sum, rescale factor) is one
  step, :func:`_softmax_tile`. Then it writes ``o = acc / l`` through its own shared-
  memory buffer (at head_dim 256 and at 192 / 128, its query buffer) and a TMA
  store. With a window (causal too) the epilogue also writes one int32 flag per 64 rows,
  nonzero where ``o`` holds a non-finite entry: an edge tile's ``P V`` meets hidden
  keys' values (``0 x NaN``), and the strict Triton guard that follows recomputes the
  flagged rows (rule 1 of :mod:`flashfold.api.attention`; :func:`.fwd.prepare_guard`).
  The key loop is unchanged. Finalize reads the empty row from ``l = 0`` only: a NaN ``l`` (a NaN or
  ``+inf`` visible score) gives NaN ``o`` and ``lse``; a row that sees no key gives ``o =
  0``, ``lse = -inf``.

Work items are query tiles ``(bh, m)``, each with the run of key tiles its rows can see
(:func:`_tile`, which the producer and both consumers compute alike; tiles outside a
window are never loaded). A grid of one program per SM takes them in rounds
(persistent): the producer loads the next item's query tile once both consumers have
computed the last ``S`` of the previous one (``q_empty``), so loads overlap the
epilogue. Items bounded on one side only (causal) differ in cost, and long such
sequences run one program per item instead (:func:`persistent_default`). A block mask's
items differ in cost arbitrarily: its programs draw them (``DYNAMIC``) from a ticket
counter, one atomic add per item, and the producer hands each to the consumers through
shared memory as a packed sequence's. Query tiles
whose rows see no key (a right bound with ``Nq > Nk``) are no work items: the kernel
runs on the rows after them and :func:`_fill_empty_rows` writes them.

Packed sequences (``VARLEN``, ``cu_seqlens``): the work items are the query tiles of
every sequence, numbered by slots that need no host sync and no padding to the longest
sequence (:func:`varlen_slots`); the producer alone looks a slot's sequence up in
``cu_seqlens`` (:func:`_lookup_issue`, one slot ahead, so that its loads fly while the
previous item loads), skips empty slots and hands each item to the consumers through
shared memory (:func:`_hand_item`), ending with ``m = -1``. The query heads of a KV group
take the same slot in a row: their programs read the same key and value tiles at once
(against a head-major order, 0.85x at 16 x 1K tokens, Llama's 32:8 heads, H200). A
half tile that ends past its sequence is stored from registers (a TMA box would write
the next sequence's rows); tiles read the next sequence's keys past their own (masked),
so the epilogue flags non-finite rows for the strict guard as with a window.

Constexpr flags of the one template: ``MASK_LEFT`` / ``MASK_RIGHT`` (the window's sides,
bottom-right aligned as :func:`.fwd._visible_2d` defines them; causal is ``right = 0``;
each is masked only on the tiles that cross it), ``SOFTCAP`` (``s = c tanh(scale qk /
c)``, before the masks), ``BLOCK_D`` / ``BLOCK_D2`` / ``BLOCK_DV`` (tile widths: q and k
in one or two power-of-two column chunks, :func:`qk_chunks`, ``S`` summed over both; v's
the next power of two of ``Dv``; TMA reads columns past a head dim as zeros and does
not write them), ``BLOCK_N`` and ``O_IN_Q`` (the tile plan: :data:`TILE_PLANS`,
:func:`_plan`), ``RETURN_LSE``, ``PINGPONG``, ``VARLEN``, ``DYNAMIC``; with a block mask,
``MASK_FN`` (its row mask, evaluated per pair in PARTIAL tiles) or, where each row of the
mask is one interval of keys, ``ROW_BOUNDS`` with ``MASK_FN`` the intervals' bounds,
read once per item and intersected with the window's (:func:`_consume_item`).

FP8 (E4M3 ``q``, ``k``, ``v`` with float32 factors, :func:`.reference.fp8_attention_reference`'s
semantics) is the same template on 8-bit descriptors: their dtype is the flag (``FP8``
in the partitions). ``S = Q K^T`` runs on the tiles as stored and ``q_descale
k_descale`` (one load each per item, per batch or sequence and KV head) joins the score
scale, inside the tanh with a softcap; ``P`` enters ``P V`` times 448, rounded to E4M3
(``cvt.rn.satfinite``). With 128-key tiles the step weighs the tile against the
reference ``m' - log2 448`` (ATTENTION2's step with a reference shift), so its ``P``
comes out as ``448 P = 2^(x - m' + log2 448)`` with no multiply per score, ``l`` sums
the unrounded ``448 P`` in fp32, and the epilogue finalizes at ``m - log2 448`` after
multiplying ``acc`` by ``v_descale``; with 64-key tiles (head_dim 256) ``P`` is
multiplied by 448 and ``acc`` by ``v_descale / 448`` (as measured:
:data:`FP8_SHIFT_MIN_BLOCK_N`; :func:`_softmax_tile`, :func:`_pv_issue`,
:func:`_consume_item`). An 8-bit wgmma reduces 32 entries per instruction (accumulator
layouts with ``k = 32``, ``P``'s register operand four entries per register) and takes
its B operand K-major only, so ``v`` is stored keys-contiguous (a ``(B, Hk, Dv, Nk)``
tensor viewed as ``(B, Hk, Nk, Dv)``): its descriptor over ``(B, Hk, Dv, Nk)`` loads
``[BLOCK_DV, BLOCK_N]`` tiles whose shared-memory permute is that operand, nothing
moved. The output (``out_dtype``) has its own staging buffers (``O_IN_Q`` off). A TMA
box's start along the innermost dim must be 16-byte aligned, and V's innermost dim is
then the keys: a packed sequence's key tiles start at its first key rounded down to 16
(:func:`_first_key`), the keys before it hidden by a left bound that every packed FP8
call has.

Scope (:func:`supported`; the dispatcher in :mod:`.fwd` sends mods and block masks to
the Triton template): fp16/bf16, or E4M3 with ``v`` keys-contiguous and its transpose
TMA-addressable (``Nk`` a multiple of 16 keys for a dense ``(B, Hk, Dv, Nk)`` store),
head_dim 17-256 (``Dv = D``, or ``D`` in 129-256 with ``Dv`` in 65-128), GQA, ``scale >
0``, any window, softcap; ``q``, ``k``, ``v`` as ``(B, H, N, D)`` with unit last stride
and 16-byte aligned strides (4-D TMA descriptors: rows past a head's end read as zero
and are not written). Returns ``o (B, Hq, Nq, Dv)`` contiguous in the input dtype
(FP8: ``out_dtype``) and ``lse (B, Hq, Nq)`` float32.
Which calls run it: :mod:`.dispatch` (the policy's ``gluon``, ``FLASHFOLD_GLUON=0`` by
default, turns the path off).

GPU only: Gluon kernels have no interpreter mode. The CPU suite compiles every variant
for sm_90 (``tests/test_attention_gluon.py``: warp specialization, TMA, wgmma, per-
warpgroup barriers, key loops free of local memory); correctness against float64 runs
on the H200 (the same file's ``gpu`` tests, ``benchmarks/attention.py``).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ...monoids import ATTENTION2
from .. import compat, launcher, plans
from ..codegen import tile_step_functions
from ..compat import (GluonDescriptor, fence_async_shared, gl, gluon, mbarrier, tma,
                      warp_specialize, warpgroup_mma, warpgroup_mma_wait)
from ..tma import addressable, box_strides
from .reference import FP8_MAX

LOG2E = 1.4426950408889634
#: the tile step's reference shift of an FP8 call: ``P`` (``<= 1``) comes out times 448,
#: the format's largest value, for its rounding to E4M3 (as the Triton template's
#: ``fwd.SHIFT_FP8``)
SHIFT_FP8 = tl.constexpr(math.log2(FP8_MAX))
#: the FP8 calls whose key tiles are at least this wide take the 448 as the step's
#: reference shift; narrower ones (64-key tiles, head_dim 256) multiply ``P`` by it.
#: Measured (H200, graphs, ``benchmarks/attention_fp8.py``): the shift 1.04x at dense
#: d128, 1.08x at d64, 1.00x Llama-3 causal; at d256 0.93x dense, 0.97x Gemma-2
#: (docs/notes/fp8.md)
FP8_SHIFT_MIN_BLOCK_N = tl.constexpr(128)
FP8_MAX_C = tl.constexpr(FP8_MAX)

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
#: FP8 calls whose q/k tiles are at least this wide ping-pong whatever their items' length
#: (see :func:`pingpong_default`)
FP8_PINGPONG_MIN_D = 128
#: registers of the second consumer warpgroup (a worker partition; the first, the
#: default partition, gets what the cap leaves: (168 * 12 - 240 * 4 - 24 * 4) / 4 = 240)
CONSUMER_REGS = 240
#: registers of the producer warp (the minimum ``setmaxnreg`` allows)
PRODUCER_REGS = 24
#: rows per program of :func:`_fill_empty_rows`
FILL_ROWS = 64
#: register cap of the whole kernel: 12 warps (two consumer warpgroups, the producer's
#: warp rounded up to a warpgroup) x 32 threads x 168 <= 65,536
MAXNREG = 168

__all__ = ["supported", "eligible", "on_hopper", "gluon_attention_fwd", "persistent_default",
           "pingpong_default", "num_sms", "BLOCK_M", "BLOCK_N"]


if gluon is not None:

    @gluon.constexpr_function
    def _wgmma_layout(n, operand=None):
        """The register layout of a wgmma accumulator ``[64, n]`` of one warpgroup with
        operands of dtype ``operand`` (None: 16-bit). An instruction reduces 32 bytes of
        each operand row: 16 entries of 16 bits, 32 of 8 (FP8)."""
        k = 32 if operand is not None and operand.primitive_bitwidth == 8 else 16
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                         instr_shape=[16, n, k])

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
    def _item_index(i):
        """Round ``i``'s work item ``t`` of this program (see :func:`_rounds`)."""
        G = gl.num_programs(0)
        p = gl.program_id(0)
        return i * G + gl.where(i % 2 == 0, p, G - 1 - p)

    @gluon.jit
    def _key_tiles(q0, q_len, kv_len, win_left, win_right, k_first, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr):
        """The key tiles of the query tile at row ``q0`` of a sequence of ``q_len`` rows
        and ``kv_len`` keys: ``(t_lo, n_kv, t_a, t_c)``, the first, their count, and the
        unmasked run ``[t_a, t_c)`` (tiles before ``t_a`` meet the window's left edge,
        tiles from ``t_c`` on its right edge, the causal diagonal or the ragged end), as
        :func:`.fwd._tile_ranges` computes them and :func:`item_range` on the host.
        ``k_first``: the position of the sequence's first key (0, or with ``MASK_LEFT``
        that of :func:`_first_key`), where the left edge is at the earliest."""
        if MASK_LEFT or MASK_RIGHT:
            # visible keys of row r: [r + delta - left, r + delta + right] & [0, Nk); a
            # tile needs no mask when every real row of the item sees all of it (the
            # first row bounds the right edge, the last real row the left one). Positions
            # are clamped at k_first >= 0 before dividing (integer division truncates)
            delta = kv_len - q_len
            r_last = gl.minimum(q0 + BLOCK_M, q_len) - 1
            hi = kv_len
            full_hi = kv_len
            if MASK_RIGHT:
                hi = gl.maximum(gl.minimum(hi, r_last + delta + win_right + 1), 0)
                full_hi = gl.maximum(gl.minimum(full_hi, q0 + delta + win_right + 1), 0)
            t_lo = 0
            t_a = 0
            if MASK_LEFT:
                t_lo = gl.maximum(q0 + delta - win_left, k_first) // BLOCK_N
                full_lo = gl.maximum(r_last + delta - win_left, k_first)
                t_a = gl.maximum((full_lo + BLOCK_N - 1) // BLOCK_N, t_lo)
            t_hi = gl.maximum((hi + BLOCK_N - 1) // BLOCK_N, t_lo)
            t_a = gl.minimum(t_a, t_hi)
            t_c = gl.minimum(gl.maximum(full_hi // BLOCK_N, t_a), t_hi)
            n_kv = t_hi - t_lo
        else:
            t_lo = 0
            t_a = 0
            t_c = kv_len // BLOCK_N
            n_kv = gl.cdiv(kv_len, BLOCK_N)
        return t_lo, n_kv, t_a, t_c

    @gluon.jit
    def _first_key(ks, kv_len, FP8: gl.constexpr):
        """A packed sequence's keys ``ks .. ks + kv_len`` (rows of ``k``) as its key tiles
        walk them: ``(start, length, k_first)``, tiles from row ``start`` over ``length``
        keys of which the first ``k_first`` are not the sequence's. 16-bit: ``(ks,
        kv_len, 0)``. ``FP8``: from ``ks`` rounded down to 16 keys (V's tiles start at key
        ``start + t BLOCK_N`` of its innermost dim, where a TMA box's start must be
        16-byte aligned), ``k_first = ks % 16`` keys of the sequence before it in front,
        hidden by the left bound that every packed FP8 call has (clamped at ``k_first``:
        :func:`_key_tiles`, :func:`_consume_item`). Right bounds stay bottom-right
        aligned: ``length - q_len`` moves with ``k_first`` as the key positions do."""
        k_first = 0
        if FP8:
            k_first = ks % 16
        return ks - k_first, kv_len + k_first, k_first

    @gluon.jit
    def _tile(t, shape, bh_total, bm, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, MASK_FN: gl.constexpr,
              SPLIT: gl.constexpr):
        """Work item ``t = bh n_m + m`` of ``B`` sequences of ``Nq`` rows, numbered
        head-major (the query tiles of a head together, so that the programs running at
        once share its keys and values in L2): ``(b, hq, hk, q0, t_lo, n_kv, t_a, t_c,
        walk)``, query tile ``m`` (first row ``q0``) of head ``(b, hq)``, its key/value
        head ``hk`` and its key tiles (:func:`_key_tiles`). ``m`` runs backwards with a
        right bound (heaviest first). The producer and both consumers call this with the
        same ``t``, so they walk the same tiles. Every item sees a key (the host launches
        the kernel on the query rows from the first tile that does:
        :func:`gluon_attention_fwd`), unless a block mask hides them all.

        With a block mask (``MASK_FN``; ``bm``: its lists, :func:`_block_mask_args`) the
        item walks the PARTIAL then the FULL key blocks of its row of blocks, ``SPLIT``
        tiles each (:func:`_walk`): ``n_kv = SPLIT (partial + full)``, at least one tile
        (a row of blocks without any: one tile, masked whole); ``walk = (partial, full,
        base)``, the counts and the row's offset in the index lists."""
        q_len, kv_len, heads_q, group, n_m, win_left, win_right = shape
        bh = t // n_m
        m = t % n_m
        if MASK_RIGHT:
            m = n_m - 1 - m
        b = bh // heads_q
        hq = bh % heads_q
        q0 = m * BLOCK_M
        t_lo, n_kv, t_a, t_c = _key_tiles(q0, q_len, kv_len, win_left, win_right, 0, BLOCK_M,
                                          BLOCK_N, MASK_LEFT, MASK_RIGHT)
        walk = (0, 0, 0)
        if MASK_FN is not None:
            PN, PI, FN, FI, rs_b, rs_h, is_b, is_h, n_n, row0 = bm
            r = (q0 + row0) // BLOCK_M
            row = b * rs_b + hq * rs_h + r
            partial = gl.load(PN + row)
            full = gl.load(FN + row)
            walk = (partial, full, b * is_b + hq * is_h + r * n_n)
            n_kv = gl.maximum((partial + full) * SPLIT, 1)
        return b, hq, hq // group, q0, t_lo, n_kv, t_a, t_c, walk

    @gluon.jit
    def _walk(bm, walk, t_lo, j, MASK_FN: gl.constexpr, SPLIT: gl.constexpr):
        """Key tile ``j`` of an item: ``(t, kind)``, its index and kind: ``t_lo + j``,
        FULL (0) without a block mask; with one, sub-tile ``j % SPLIT`` of the item's
        ``j // SPLIT``-th listed block (PARTIAL (1) blocks first, then FULL ones), or
        tile 0 hidden whole (2) past the lists (an item without blocks)."""
        t = t_lo + j
        kind = j * 0
        if MASK_FN is not None:
            PN, PI, FN, FI, rs_b, rs_h, is_b, is_h, n_n, row0 = bm
            partial, full, base = walk
            e = j // SPLIT
            in_partial = e < partial
            in_full = (e >= partial) & (e < partial + full)
            idx = gl.where(in_partial, gl.load(PI + base + e, mask=in_partial, other=0),
                           gl.load(FI + base + e - partial, mask=in_full, other=0))
            t = idx * SPLIT + j % SPLIT
            kind = gl.where(in_partial, 1, gl.where(in_full, 0, 2))
        return t, kind

    @gluon.jit
    def seq_lookup_issue(u, CU_A, CU_B, n_seqs, levels, top, BLOCK: gl.constexpr,
                         WARPS: gl.constexpr):
        """The first half of the lookup of slot ``u`` of packed sequences
        (:func:`seq_lookup_finish` completes it), tiled by ``BLOCK`` rows of the offsets
        ``CU_A`` (``CU_B``: the other side's): ``(u, lo, ca, ca1, cb, cb1)``, the 32
        sequences ``lo + lane`` among which the slot's lies and their offsets ``CU_A[j]``,
        ``CU_A[j + 1]``, ``CU_B[j]``, ``CU_B[j + 1]`` (loads that may still be in flight:
        a caller can issue them early and finish later). ``WARPS``: the calling
        partition's warps.

        Sequence ``s`` holds the slots ``u = CU_A[s] // BLOCK + s + m``, ``m <
        ceil(len_s / BLOCK)`` (:func:`varlen_slots`; they never overlap), so the slot's
        sequence is the last whose first slot is at most ``u``: a 32-way search,
        ``levels - 1`` rounds of 32 loads at once from a stride ``top = 32^(levels - 1)``
        narrowing the range 32 times each (none up to 32 sequences, one up to 1024), then
        the last 32 candidates."""
        lanes = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
        lo = u * 0
        step = top
        for _ in range(levels - 1):
            idx = lo + lanes * step
            ok = idx < n_seqs
            first = gl.load(CU_A + idx, mask=ok, other=0) // BLOCK + idx
            lo = lo + (gl.sum((ok & (first <= u)).to(gl.int32), 0) - 1) * step
            step = step // 32
        idx = lo + lanes
        ok = idx < n_seqs
        ca = gl.load(CU_A + idx, mask=ok, other=0)
        ca1 = gl.load(CU_A + idx + 1, mask=ok, other=0)
        cb = gl.load(CU_B + idx, mask=ok, other=0)
        cb1 = gl.load(CU_B + idx + 1, mask=ok, other=0)
        return u, lo, ca, ca1, cb, cb1

    @gluon.jit
    def seq_lookup_finish(pending, n_seqs, BLOCK: gl.constexpr, WARPS: gl.constexpr):
        """The sequence of a slot (:func:`seq_lookup_issue`): ``(s, a0, a_len, b0, b_len,
        m)``, its offsets and lengths on both sides and the slot's tile ``m`` of it (a
        slot past the sequence's tiles has ``m >= ceil(a_len / BLOCK)``)."""
        u, lo, ca, ca1, cb, cb1 = pending
        lanes = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
        idx = lo + lanes
        hit = (idx < n_seqs) & (ca // BLOCK + idx <= u)
        c = gl.sum(hit.to(gl.int32), 0) - 1          # the sequence's lane
        pick = lanes == c
        a0 = gl.sum(gl.where(pick, ca, 0), 0)
        a_len = gl.sum(gl.where(pick, ca1, 0), 0) - a0
        b0 = gl.sum(gl.where(pick, cb, 0), 0)
        b_len = gl.sum(gl.where(pick, cb1, 0), 0) - b0
        s = lo + c
        return s, a0, a_len, b0, b_len, u - (a0 // BLOCK + s)

    @gluon.jit
    def _lookup_issue(i, n_m, group, seqs, BLOCK_M: gl.constexpr):
        """The producer's lookup of round ``i``'s item of packed sequences, issued
        (:func:`_lookup_finish` completes it): ``(hq, pending)``, the query head and the
        pending lookup (:func:`seq_lookup_issue`) of slot ``u``, item ``t = (hk n_m + u)
        group + g``, ``hq = hk group + g``: the query heads of a KV group on the same slot
        run together, reading the same key and value tiles. The producer issues it before
        loading the previous item and reads it after."""
        CU_Q, CU_K, n_seqs, levels, top, info = seqs
        t = _item_index(i)
        g = t % group
        r = t // group
        hq = (r // n_m) * group + g
        return hq, seq_lookup_issue(r % n_m, CU_Q, CU_K, n_seqs, levels, top, BLOCK_M, 1)

    @gluon.jit
    def _lookup_finish(pending, n_seqs, BLOCK_M: gl.constexpr, MASK_RIGHT: gl.constexpr):
        """The item of a lookup (:func:`_lookup_issue`): ``(hq, s, qs, q_len, ks, kv_len,
        m)``, query tile ``m`` of sequence ``s`` (``m < 0``: the slot holds no item), its
        rows ``qs ..`` in ``q`` and keys ``ks ..`` in ``k``; ``m`` runs backwards with a
        right bound (heaviest first)."""
        hq, lookup = pending
        s, qs, q_len, ks, kv_len, m = seq_lookup_finish(lookup, n_seqs, BLOCK_M, 1)
        n_tiles = gl.cdiv(q_len, BLOCK_M)
        if MASK_RIGHT:
            m = n_tiles - 1 - m           # (negative for the slots past the tiles)
        m = gl.where(m < n_tiles, m, -1)
        return hq, s, qs, q_len, ks, kv_len, m

    @gluon.jit
    def _hand_item(info, hq, s, qs, q_len, ks, kv_len, m):
        """The producer writes an item ``(hq, s, qs, q_len, ks, kv_len, m)`` to the
        consumers' shared-memory slot (before its ``q_ready`` arrive, whose release
        makes it visible to their acquiring wait; ``m = -1``: no more items)."""
        j = gl.arange(0, 8, layout=gl.BlockedLayout([8], [32], [1], [0]))
        vals = gl.where(j == 0, hq, gl.where(j == 1, s, gl.where(j == 2, qs, gl.where(
            j == 3, q_len, gl.where(j == 4, ks, gl.where(j == 5, kv_len, m))))))
        info.store(vals)

    @gluon.jit
    def _take_item(info):
        """A consumer's read of the item the producer handed (:func:`_hand_item`)."""
        layout: gl.constexpr = gl.BlockedLayout([8], [32], [4], [0])
        vals = info.load(layout)
        j = gl.arange(0, 8, layout=layout)
        hq = gl.sum(gl.where(j == 0, vals, 0), 0)
        s = gl.sum(gl.where(j == 1, vals, 0), 0)
        qs = gl.sum(gl.where(j == 2, vals, 0), 0)
        q_len = gl.sum(gl.where(j == 3, vals, 0), 0)
        ks = gl.sum(gl.where(j == 4, vals, 0), 0)
        kv_len = gl.sum(gl.where(j == 5, vals, 0), 0)
        m = gl.sum(gl.where(j == 6, vals, 0), 0)
        return hq, s, qs, q_len, ks, kv_len, m

    @gluon.jit
    def _hand_walk(dst, t, kind):
        """The producer's note of a ring slot's key tile ``t`` and ``kind`` (:func:`_walk`)
        for the consumers (:func:`_take_walk`): they need not walk the lists themselves,
        whose pointers and counts would hold registers through their key loops."""
        j = gl.arange(0, 2, layout=gl.BlockedLayout([2], [32], [1], [0]))
        dst.store(gl.where(j == 0, t, kind))

    @gluon.jit
    def _take_walk(src):
        """A consumer's read of a ring slot's ``(t, kind)`` (:func:`_hand_walk`)."""
        layout: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])
        vals = src.load(layout)
        j = gl.arange(0, 2, layout=layout)
        return gl.sum(gl.where(j == 0, vals, 0), 0), gl.sum(gl.where(j == 1, vals, 0), 0)

    @gluon.jit
    def _ring_tile(walk_bufs, slot, t_lo, j, MASK_FN: gl.constexpr):
        """A consumer's key tile ``j`` of an item in ring ``slot``: ``(t, kind)``,
        ``t_lo + j`` and FULL without a block mask, else the producer's note."""
        if MASK_FN is not None:
            t, kind = _take_walk(walk_bufs.index(slot))
        else:
            t = t_lo + j
            kind = 0
        return t, kind

    @gluon.jit
    def _load_item(descs, bufs, bars, coords_q, hk, k0, t_lo, n_kv, it, bm, walk,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
                   BLOCK_D2: gl.constexpr, STAGES: gl.constexpr, MASK_FN: gl.constexpr,
                   SPLIT: gl.constexpr):
        """The TMA loads of one item: its two query halves (``coords_q``: the first's
        ``[b, hq, row]``), then key and value tiles ``t_lo .. t_lo + n_kv`` (or the block
        mask's walk, :func:`_walk`; rows from ``k0``) into their rings from position
        ``it``; with ``BLOCK_D2`` each query half and key tile in two column chunks (its
        first ``BLOCK_D`` columns, then ``BLOCK_D2`` more), on one barrier. The caller has
        waited for ``q_empty``."""
        q_desc, k_desc, v_desc, o_desc, q2_desc, k2_desc = descs
        q_bufs, o_bufs, k_bufs, v_bufs, walk_bufs, q2_bufs, k2_bufs = bufs
        q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn = bars
        b, hq, r = coords_q
        if BLOCK_D2 > 0:
            mbarrier.expect(q_ready, 2 * (q_desc.block_type.nbytes + q2_desc.block_type.nbytes))
            tma.async_copy_global_to_shared(q2_desc, [b, hq, r, BLOCK_D], q_ready,
                                            q2_bufs.index(0))
            tma.async_copy_global_to_shared(q2_desc, [b, hq, r + BLOCK_M // 2, BLOCK_D],
                                            q_ready, q2_bufs.index(1))
        else:
            mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, hq, r, 0], q_ready, q_bufs.index(0))
        tma.async_copy_global_to_shared(q_desc, [b, hq, r + BLOCK_M // 2, 0], q_ready,
                                        q_bufs.index(1))
        for j in range(n_kv):
            slot = (it + j) % STAGES
            phase = ((it + j) // STAGES) & 1
            t, kind = _walk(bm, walk, t_lo, j, MASK_FN, SPLIT)
            n0 = k0 + t * BLOCK_N
            mbarrier.wait(k_empty.index(slot), phase ^ 1)
            if MASK_FN is not None:
                # the tile and its kind for the consumers, visible to them through the
                # release of the k_ready arrive below and their acquiring wait
                _hand_walk(walk_bufs.index(slot), t, kind)
            if BLOCK_D2 > 0:
                mbarrier.expect(k_ready.index(slot),
                                k_desc.block_type.nbytes + k2_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k2_desc, [b, hk, n0, BLOCK_D],
                                                k_ready.index(slot), k2_bufs.index(slot))
            else:
                mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [b, hk, n0, 0],
                                            k_ready.index(slot), k_bufs.index(slot))
            mbarrier.wait(v_empty.index(slot), phase ^ 1)
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            if v_desc.dtype == gl.float8e4nv:
                # keys-contiguous V: a [BLOCK_DV, BLOCK_N] tile of (B, Hk, Dv, Nk), keys
                # innermost (n0 a multiple of 16: _first_key)
                tma.async_copy_global_to_shared(v_desc, [b, hk, 0, n0],
                                                v_ready.index(slot), v_bufs.index(slot))
            else:
                tma.async_copy_global_to_shared(v_desc, [b, hk, n0, 0],
                                                v_ready.index(slot), v_bufs.index(slot))

    @gluon.jit
    def _producer(descs, bufs, bars, shape, seqs, out, bm, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_D2: gl.constexpr,
                  STAGES: gl.constexpr, MASK_LEFT: gl.constexpr,
                  MASK_RIGHT: gl.constexpr, VARLEN: gl.constexpr, MASK_FN: gl.constexpr,
                  SPLIT: gl.constexpr, DYNAMIC: gl.constexpr):
        """TMA loads, work item after work item (:func:`_load_item`): the two query halves
        once both consumer warpgroups have released the previous ones (``q_empty``), then
        the item's key and value tiles into their rings, whose slot and phase count on
        across items. An ``empty`` barrier starts out with its phase 1 complete, so the
        first waits pass at once; each slot is released by both consumer warpgroups
        (count 2).

        ``VARLEN``: the producer alone looks each slot up (:func:`_lookup_issue`, one
        slot ahead: its loads are in flight while the item before loads), skips the
        empty ones, and hands the consumers each item it loads through shared memory
        (:func:`_hand_item`), then ``m = -1`` with a bare ``q_ready`` arrive: the
        consumers' per-item start costs a shared-memory read instead of the lookup's
        dependent global loads.

        ``DYNAMIC``: the producer draws each item from the launch's ticket counter
        (``out[16]``, zeroed; one atomic add per item, drawn an item ahead) and hands it
        to the consumers as varlen items are, ending with ``m = -1``."""
        q_len, kv_len, heads_q, group, n_m, win_left, win_right = shape
        rounds = _rounds(shape, out[4])
        q_ready = bars[0]
        q_empty = bars[1]
        FP8: gl.constexpr = descs[0].dtype == gl.float8e4nv
        it = 0
        if VARLEN:
            info = seqs[5]
            done = 0
            pending = _lookup_issue(0, n_m, group, seqs, BLOCK_M)
            for i in range(rounds):
                hq, s, qs, q_len, ks, kv_len, m = _lookup_finish(pending, seqs[2], BLOCK_M,
                                                                 MASK_RIGHT)
                # the next slot's lookup loads fly while this item's tiles load
                pending = _lookup_issue(i + 1, n_m, group, seqs, BLOCK_M)
                if m >= 0:
                    k_start, k_len, k_first = _first_key(ks, kv_len, FP8)
                    t_lo, n_kv, t_a, t_c = _key_tiles(m * BLOCK_M, q_len, k_len, win_left,
                                                      win_right, k_first, BLOCK_M, BLOCK_N,
                                                      MASK_LEFT, MASK_RIGHT)
                    # rows without a visible key: one key tile, masked whole (t_c <= t_lo)
                    n_kv = gl.maximum(n_kv, 1)
                    mbarrier.wait(q_empty, (done & 1) ^ 1)
                    _hand_item(info, hq, s, qs, q_len, ks, kv_len, m)
                    _load_item(descs, bufs, bars, (0, hq, qs + m * BLOCK_M), hq // group,
                               k_start, t_lo, n_kv, it, bm, (0, 0, 0), BLOCK_M, BLOCK_N,
                               BLOCK_D, BLOCK_D2, STAGES, None, 1)
                    it += n_kv
                    done += 1
            mbarrier.wait(q_empty, (done & 1) ^ 1)
            _hand_item(info, 0, 0, 0, 0, 0, 0, -1)
            mbarrier.arrive(q_ready, count=1)
        elif DYNAMIC:
            info = seqs[5]
            counter = out[16]
            count = n_m * out[4]
            done = 0
            t = gl.atomic_add(counter, 1)
            while t < count:
                # the next ticket is drawn while this item loads
                nxt = gl.atomic_add(counter, 1)
                b, hq, hk, q0, t_lo, n_kv, t_a, t_c, walk = _tile(
                    t, shape, out[4], bm, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, MASK_FN,
                    SPLIT)
                mbarrier.wait(q_empty, (done & 1) ^ 1)
                _hand_item(info, t, n_kv, 0, 0, 0, 0, 0)
                _load_item(descs, bufs, bars, (b, hq, q0), hk, 0, t_lo, n_kv, it, bm, walk,
                           BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_D2, STAGES, MASK_FN, SPLIT)
                it += n_kv
                done += 1
                t = nxt
            mbarrier.wait(q_empty, (done & 1) ^ 1)
            _hand_item(info, 0, 0, 0, 0, 0, 0, -1)
            mbarrier.arrive(q_ready, count=1)
        else:
            for i in range(rounds):
                b, hq, hk, q0, t_lo, n_kv, t_a, t_c, walk = _tile(
                    _item_index(i), shape, out[4], bm, BLOCK_M, BLOCK_N, MASK_LEFT,
                    MASK_RIGHT, MASK_FN, SPLIT)
                mbarrier.wait(q_empty, (i & 1) ^ 1)
                _load_item(descs, bufs, bars, (b, hq, q0), hk, 0, t_lo, n_kv, it, bm, walk,
                           BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_D2, STAGES, MASK_FN, SPLIT)
                it += n_kv

    @gluon.jit
    def _columns(c0, BLOCK_N: gl.constexpr, PARENT: gl.constexpr):
        """``c0 + [0, BLOCK_N)``, a key tile's column indices in the slice of its scores'
        wgmma layout, formed as ``(c0 + lane part) + register part``. A thread holds the
        ``BLOCK_N / 4`` columns ``8 g + 2 (lane % 4) + e``; written ``c0 + arange``, the
        compiler hoists their loop-invariant ``lane part + constant`` out of the key loop,
        where they hold as many registers or spill into it (Triton 3.9's ptxas spilled
        them into the key loops of the packed-sequence variants). The sum ``c0 + lane
        part`` is kept opaque (one ``add``), so that the constants are added inside the
        loop. (Exact whichever bits the lanes own: the two parts split ``arange``'s
        bits.) ``PARENT``: the scores' layout (:func:`_wgmma_layout` of their operands)."""
        LANE_BITS: gl.constexpr = 6        # (the bits of 2 (lane % 4))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, PARENT))
        base = gl.inline_asm_elementwise("add.s32 $0, $1, $2;", "=r,r,r",
                                         [cols & LANE_BITS, c0], dtype=gl.int32,
                                         is_pure=True, pack=1)
        return base + (cols & ~LANE_BITS)

    @gluon.jit
    def _rows(r0, t, HALF: gl.constexpr, BLOCK_N: gl.constexpr, PARENT: gl.constexpr):
        """``r0 + [0, HALF)``, a warpgroup's row positions in the slice of its scores'
        wgmma layout, as values of key tile ``t``: ``(r0 + lane part)`` behind an opaque
        ``add`` that also reads ``t``, plus the register part (bit 3: a thread's two
        rows are 8 apart). What a mod computes from the rows alone (e.g. the addresses of
        a table's entries) is then formed in the key loop instead of hoisted out of it,
        where it held registers through the loop or spilled into it. ``PARENT``: the
        scores' layout."""
        rows = gl.arange(0, HALF, layout=gl.SliceLayout(1, PARENT))
        REGISTER_BIT: gl.constexpr = 8     # (a thread's second row)
        base = gl.inline_asm_elementwise("add.s32 $0, $1, $2;", "=r,r,r,r",
                                         [rows & ~REGISTER_BIT, r0, t], dtype=gl.int32,
                                         is_pure=True, pack=1)
        return base + (rows & REGISTER_BIT)

    @gluon.jit
    def _softmax_tile(s, m, l, t, kind, t_a, t_c, key_lo, key_hi, kv_len, qk_scale,
                      step_scale, mod, BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr,
                      MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, STEP: gl.constexpr,
                      SHIFT: gl.constexpr, SCORE_MOD: gl.constexpr, MASK_FN: gl.constexpr,
                      ROW_BOUNDS: gl.constexpr):
        """Key tile ``t``'s scores ``s = q k^T`` folded into the row state ``(m, l)``:
        ``(p, m', l', alpha)`` from ``STEP``, ATTENTION2's tile step generated as a Gluon
        function (:func:`flashfold.kernels.codegen.tile_step_functions`) with the
        reference shift ``SHIFT`` (0, or :data:`SHIFT_FP8`): in base 2, ``m' = max(m,
        rowmax(x c log2 e))``, ``p = 2^(x c log2 e - m' + SHIFT)``, ``l' = alpha l +
        rowsum(p)``, ``alpha = 2^(m - m')`` with a finite pivot for a row that has seen no
        key (the caller rescales its ``acc`` by ``alpha`` and adds ``p V``; ``l`` and
        ``acc`` carry ``2^SHIFT``, and the row's state is ATTENTION2's ``(m - SHIFT, l,
        acc)``).

        Scores ``x c`` (``c = step_scale``): without ``SOFTCAP`` ``x = qk``, ``c = scale``
        (the step forms ``qk (scale log2 e)`` in one FMA inside the ``exp2`` and takes the
        row max on the raw ``qk``); with it ``x = tanh(scale qk / cap) = 1 - 2 / (2^(qk
        qk_scale) + 1)``, ``qk_scale = 2 log2 e scale / cap``, ``c = cap`` (exact limits
        ``+-1``: the ``exp2`` may overflow to ``inf``, whose reciprocal is 0; the
        reciprocal's error is about one ulp). Masks apply after the softcap, on the tiles
        outside the unmasked run ``[t_a, t_c)`` only (:func:`_tile`): key ``c`` is visible
        to row ``r`` iff ``key_lo[r] <= c`` (``MASK_LEFT``) and ``c <= key_hi[r]``
        (:func:`_consume_item`: ``Nk - 1`` without a right bound, clamped below ``Nk``
        with one); bounded on both sides, one unsigned compare, ``c - key_lo[r] <
        key_hi[r] - key_lo[r] + 1``.

        ``SCORE_MOD`` (a traced score_mod's Gluon function, or None) applies after the
        softcap and before the masks, to the scores in natural-log units ``x c'`` (``c' =
        mod_scale``: the scale or the cap; the caller passes ``step_scale = 1``), with
        ``mod = (b, h, r0, BUFS, mod_scale, MASK_BUFS)``, the rows' positions from ``r0``
        (:func:`_rows`) and the key positions of tile ``t``. ``MASK_FN`` (a block mask's
        mask_mod): tile ``t`` of ``kind`` (:func:`_walk`) FULL is masked as without,
        PARTIAL also where ``MASK_FN(b, h, q_idx, kv_idx, MASK_BUFS)`` is false, and hidden
        whole past the lists. ``ROW_BOUNDS``: the mask is each row's interval of keys, which
        the caller has intersected with ``[key_lo, key_hi]`` (:func:`_consume_item`): every
        masked tile keeps ``key_lo <= c <= key_hi``, and nothing else is evaluated (a row
        without keys has ``key_lo > key_hi``; so has every row of a tile past the lists)."""
        if SOFTCAP:
            # (rcp.approx: one MUFU.RCP; a "/" is div.full, which adds range checks)
            r = gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r",
                                          [gl.exp2(s * qk_scale) + 1.0], dtype=gl.float32,
                                          is_pure=True, pack=1)
            s = 1.0 - 2.0 * r
        b, hq, r0, mod_bufs, mod_scale, mask_bufs = mod
        S_LAYOUT: gl.constexpr = s.type.layout
        q_idx = _rows(r0, t, s.shape[0], BLOCK_N, S_LAYOUT)
        if SCORE_MOD is not None:
            kv_idx = _columns(t * BLOCK_N, BLOCK_N, S_LAYOUT)
            s = SCORE_MOD(s * mod_scale, b, hq, q_idx[:, None], kv_idx[None, :], mod_bufs)
        masked = t >= t_c
        if MASK_LEFT:
            masked = masked | (t < t_a)
        if MASK_FN is not None:
            masked = masked | (kind != 0)
        if masked:
            c = _columns(t * BLOCK_N, BLOCK_N, S_LAYOUT)
            if MASK_LEFT or ROW_BOUNDS:
                # key_lo <= c <= key_hi as one unsigned compare: c - key_lo < their count
                count = gl.maximum(key_hi - key_lo + 1, 0).to(gl.uint32)
                ok = (c[None, :] - key_lo[:, None]).to(gl.uint32) < count[:, None]
            elif MASK_RIGHT:
                ok = c[None, :] <= key_hi[:, None]
            else:
                ok = c[None, :] < kv_len
            if MASK_FN is not None and not ROW_BOUNDS:
                vis = MASK_FN(b, hq, q_idx[:, None], c[None, :], mask_bufs) != 0
                ok = ok & ((kind == 0) | ((kind == 1) & vis))
            s = gl.where(ok, s, -float("inf"))
        m, l, alpha, p = STEP(m, l, s, step_scale, SHIFT)
        return p, m, l, alpha

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
    def _scores(q, k_bufs, k2_bufs, slot, pos, s_zero, WG: gl.constexpr, BLOCK_N: gl.constexpr,
                BLOCK_D: gl.constexpr, BLOCK_D2: gl.constexpr):
        """``S = Q K^T`` of warpgroup ``WG``'s query rows (``q``: the query buffers, both
        column chunks) and ring slot ``slot`` (ring position ``pos``), issued
        (asynchronous): one wgmma group per column chunk, so a ``warpgroup_mma_wait`` that
        leaves only later groups in flight has ``S`` whole. The query buffer is indexed
        by ``WG + (pos >> 31)`` (``pos >= 0``: ``WG``), which the compiler cannot fold:
        the query's wgmma descriptors, one 64-bit value per K step, are then formed in the
        key loop instead of hoisted out of it, where at 128 + 64 columns Triton 3.9's
        ptxas kept one in local memory."""
        HALF: gl.constexpr = s_zero.shape[0]
        wg = WG + (pos >> 31)
        s = warpgroup_mma(q[0].index(wg).reshape([HALF, BLOCK_D]),
                          k_bufs.index(slot).reshape([BLOCK_N, BLOCK_D]).permute((1, 0)),
                          s_zero, use_acc=False, is_async=True)
        if BLOCK_D2 > 0:
            s = warpgroup_mma(q[1].index(wg).reshape([HALF, BLOCK_D2]),
                              k2_bufs.index(slot).reshape([BLOCK_N, BLOCK_D2]).permute((1, 0)),
                              s, is_async=True)
        return s

    @gluon.jit
    def _pv_issue(p, v_tile, acc, p_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                  BLOCK_DV: gl.constexpr, FP8: gl.constexpr, SHIFT: gl.constexpr):
        """``acc += P V`` issued (asynchronous): ``(acc token, the A operand)``. 16-bit: P
        in V's dtype, V's tile ``[BLOCK_N, BLOCK_DV]`` as loaded. ``FP8``: P times 448 (from
        the step's reference shift ``SHIFT``, or with ``SHIFT = 0`` multiplied here)
        rounded to E4M3 (``cvt.rn.satfinite``), V's tile ``[BLOCK_DV, BLOCK_N]`` (keys
        contiguous) permuted to the K-major B operand 8-bit wgmma takes."""
        if FP8:
            # 448 P: from the step's reference shift (SHIFT_FP8), or multiplied here
            if SHIFT == 0.0:
                p = p * FP8_MAX_C
            pa = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
            vb = v_tile.reshape([BLOCK_DV, BLOCK_N]).permute((1, 0))
        else:
            pa = gl.convert_layout(p.to(v_tile.dtype), p_layout)
            vb = v_tile.reshape([BLOCK_N, BLOCK_DV])
        return warpgroup_mma(pa, vb, acc, is_async=True), pa

    @gluon.jit
    def _pv_wait(acc, pa, FP8: gl.constexpr):
        """Wait for the ``P V`` wgmma: ``(acc, pa)``. An 8-bit register operand cannot be a
        dependency of the wait (Triton 3.6-3.9: "Unexpected bitwidth in WGMMAWaitGroupOp:
        8"), so ``FP8`` waits on ``acc`` alone; ``pa`` is not written again before the
        wait (ptxas keeps an asynchronous operand's registers until then, and did not
        serialize the wgmma: the compile tests check its warning)."""
        if FP8:
            acc = warpgroup_mma_wait(0, deps=[acc])
        else:
            acc, pa = warpgroup_mma_wait(0, deps=[acc, pa])
        return acc, pa

    @gluon.jit
    def _fold(q, bufs, bars, it, i, t_lo, n_kv, t_a, t_c, key_lo, key_hi, kv_len, qk_scale,
              step_scale, mod, s_zero, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
              BLOCK_D2: gl.constexpr, BLOCK_DV: gl.constexpr, STAGES: gl.constexpr,
              MASK_LEFT: gl.constexpr,
              MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, O_IN_Q: gl.constexpr,
              WG: gl.constexpr, PINGPONG: gl.constexpr, STEP: gl.constexpr,
              SHIFT: gl.constexpr, SCORE_MOD: gl.constexpr, MASK_FN: gl.constexpr,
              ROW_BOUNDS: gl.constexpr):
        """One warpgroup's rows of one item: key tiles ``t_lo .. t_lo + n_kv`` (``n_kv >=
        1``, ring positions from ``it``) folded into ``(acc, l, m)`` by
        :func:`_softmax_tile`, with ``P V`` of tile ``j - 1`` running while the softmax of
        tile ``j`` is computed. Releases the query tile (``q_empty``) after the last ``S``
        unless the output is staged in it (``O_IN_Q``: the epilogue releases it). ``q``:
        the query buffers ``(columns 0 .. BLOCK_D, the next BLOCK_D2)`` (:func:`_scores`).
        ``SHIFT``: the step's reference shift (:func:`_softmax_tile`, :func:`_pv_issue`)."""
        q_bufs, o_bufs, k_bufs, v_bufs, walk_bufs, q2_bufs, k2_bufs = bufs
        q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn = bars
        dtype: gl.constexpr = q[0].dtype
        FP8: gl.constexpr = dtype == gl.float8e4nv
        HALF: gl.constexpr = s_zero.shape[0]
        o_layout: gl.constexpr = _wgmma_layout(BLOCK_DV, dtype)
        # (an 8-bit A operand in registers: four entries per 32-bit register)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                     k_width=4 if FP8 else 2)

        # key tile 0: S, then its softmax (nothing to overlap with yet)
        slot = it % STAGES
        mbarrier.wait(k_ready.index(slot), (it // STAGES) & 1)
        t, kind = _ring_tile(walk_bufs, slot, t_lo, 0, MASK_FN)
        _take_turn(turn, it + i, WG, PINGPONG)
        s = _scores(q, k_bufs, k2_bufs, slot, it, s_zero, WG, BLOCK_N, BLOCK_D, BLOCK_D2)
        _pass_turn(turn, WG, PINGPONG)
        s = warpgroup_mma_wait(0, deps=[s])
        mbarrier.arrive(k_empty.index(slot), count=1)
        # from the monoid's identity (-inf, 0)
        rows: gl.constexpr = gl.SliceLayout(1, s.type.layout)
        m = gl.full([HALF], -float("inf"), gl.float32, rows)
        l = gl.zeros([HALF], gl.float32, rows)
        p, m, l, alpha = _softmax_tile(s, m, l, t, kind, t_a, t_c, key_lo, key_hi, kv_len,
                                       qk_scale, step_scale, mod, BLOCK_N, MASK_LEFT,
                                       MASK_RIGHT, SOFTCAP, STEP, SHIFT, SCORE_MOD,
                                       MASK_FN, ROW_BOUNDS)
        acc = gl.zeros([HALF, BLOCK_DV], gl.float32, o_layout)

        for j in range(1, n_kv):
            slot = (it + j) % STAGES
            prev = (it + j - 1) % STAGES
            mbarrier.wait(k_ready.index(slot), ((it + j) // STAGES) & 1)
            t, kind = _ring_tile(walk_bufs, slot, t_lo, j, MASK_FN)
            _take_turn(turn, it + j + i, WG, PINGPONG)
            s = _scores(q, k_bufs, k2_bufs, slot, it + j, s_zero, WG, BLOCK_N, BLOCK_D,
                        BLOCK_D2)
            mbarrier.wait(v_ready.index(prev), ((it + j - 1) // STAGES) & 1)
            acc, pa = _pv_issue(p, v_bufs.index(prev), acc, p_layout, BLOCK_N, BLOCK_DV, FP8,
                                SHIFT)
            _pass_turn(turn, WG, PINGPONG)
            s = warpgroup_mma_wait(1, deps=[s])                   # S_j done, PV running
            mbarrier.arrive(k_empty.index(slot), count=1)
            p, m, l, alpha = _softmax_tile(s, m, l, t, kind, t_a, t_c, key_lo, key_hi,
                                           kv_len, qk_scale, step_scale, mod, BLOCK_N,
                                           MASK_LEFT, MASK_RIGHT, SOFTCAP, STEP, SHIFT,
                                           SCORE_MOD, MASK_FN, ROW_BOUNDS)
            acc, pa = _pv_wait(acc, pa, FP8)
            mbarrier.arrive(v_empty.index(prev), count=1)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]

        if not O_IN_Q:
            # every S of this item is done: the producer may load the next query tile
            mbarrier.arrive(q_empty, count=1)
        last = (it + n_kv - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((it + n_kv - 1) // STAGES) & 1)
        _take_turn(turn, it + n_kv + i, WG, PINGPONG)
        acc, pa = _pv_issue(p, v_bufs.index(last), acc, p_layout, BLOCK_N, BLOCK_DV, FP8,
                            SHIFT)
        _pass_turn(turn, WG, PINGPONG)
        acc, pa = _pv_wait(acc, pa, FP8)
        mbarrier.arrive(v_empty.index(last), count=1)
        return acc, l, m

    @gluon.jit
    def _store_o(o, o_smem, o_desc, coords, q_empty, HALF: gl.constexpr,
                 BLOCK_DV: gl.constexpr, O_IN_Q: gl.constexpr):
        """A warpgroup's 64 output rows through its shared-memory buffer and a TMA store
        (with ``O_IN_Q`` the buffer is its query tile's, released once the store has read
        it)."""
        tma.store_wait(0)                  # the previous item's store has read o_smem
        o_smem.reshape([HALF, BLOCK_DV]).store(o)
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, coords, o_smem)
        if O_IN_Q:
            # the output went out through the query buffer: release it once read
            tma.store_wait(0)
            mbarrier.arrive(q_empty, count=1)

    @gluon.jit
    def _consume_item(q, descs, bufs, bars, o_smem, s_zero, out, win, it, k_i, b, hq, qs,
                      q_len, kv_len, k_first, q0, t_lo, n_kv, t_a, t_c, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_D2: gl.constexpr,
                      BLOCK_DV: gl.constexpr,
                      STAGES: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
                      SOFTCAP: gl.constexpr, O_IN_Q: gl.constexpr, RETURN_LSE: gl.constexpr,
                      VARLEN: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr,
                      STEP: gl.constexpr, FINALIZE: gl.constexpr, SCORE_MOD: gl.constexpr,
                      MASK_FN: gl.constexpr, ROW_BOUNDS: gl.constexpr):
        """One warpgroup's rows of one work item (query tile at row ``q0`` of head ``(b,
        hq)``, the ``k_i``-th item this program takes, its key tiles from ring position
        ``it``; ``k_first``: the position of the sequence's first key, :func:`_first_key`):
        wait for its query tile (``VARLEN``: the caller has), fold, then the epilogue.
        ``FP8`` (E4M3 descriptors): the item's descale factors (``descales``, ``sd``: their
        pointers and ``(batch or sequence, KV head)`` strides) scale the scores and the
        output."""
        q_desc, k_desc, v_desc, o_desc, q2_desc, k2_desc = descs
        q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn = bars
        (LSE, stride_lb, stride_lh, qk_scale, bh_total, FLAGS, flag_groups, step_scale,
         O, stride_oh, stride_on, dv, mod_bufs, mod_scale, row0, mask_bufs, _, descales,
         sd) = out
        win_left, win_right, heads_q, group = win
        HALF: gl.constexpr = BLOCK_M // 2
        FP8: gl.constexpr = q_desc.dtype == gl.float8e4nv
        # the tile step's reference shift: FP8's 448 with wide enough key tiles, else 0
        SHIFT: gl.constexpr = (SHIFT_FP8 if FP8 and BLOCK_N >= FP8_SHIFT_MIN_BLOCK_N
                               else 0.0)
        dtype: gl.constexpr = o_desc.dtype          # (o's: FP8 calls' out_dtype)
        s_layout: gl.constexpr = _wgmma_layout(BLOCK_N, q_desc.dtype)
        o_layout: gl.constexpr = _wgmma_layout(BLOCK_DV, q_desc.dtype)
        r0 = q0 + WG * HALF
        rows = r0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
        # this half's visible keys per row: [key_lo, key_hi] (see _softmax_tile)
        key_lo = rows
        key_hi = gl.full_like(rows, kv_len - 1)
        if MASK_RIGHT:
            # (the clamp: a window's right edge may reach past Nk, where keys read as
            # zeros; causal rows r < Nq end at r + Nk - Nq < Nk anyway)
            key_hi = gl.minimum(rows + (kv_len - q_len + win_right), kv_len - 1)
        if MASK_LEFT:
            key_lo = rows + (kv_len - q_len - win_left)
            if FP8:
                # (a packed sequence's tiles may start before its first key: _first_key)
                key_lo = gl.maximum(key_lo, k_first)
        if ROW_BOUNDS:
            # the mask's interval of keys per row (MASK_FN gives its bounds), within these
            first, last = MASK_FN(b, hq, rows + row0, 0, mask_bufs)
            if MASK_LEFT:
                key_lo = gl.maximum(key_lo, first)
            else:
                key_lo = first
            key_hi = gl.minimum(key_hi, last)
        if not VARLEN:
            # (varlen: the caller waited, to read the item the producer handed)
            mbarrier.wait(q_ready, k_i & 1)
        # a score_mod's arguments (query positions: of the call's rows, from row0 on)
        mod = (b, hq, r0 + row0, mod_bufs, mod_scale, mask_bufs)
        if FP8:
            # E4M3 inputs stand for x8 * descale, per (batch or sequence, KV head): q's and
            # k's join the score scale (inside the tanh with a softcap), v's the finalize
            hk = hq // group
            QD, KD, VD = descales
            d_qk = (gl.load(QD + b.to(gl.int64) * sd[0] + hk * sd[1])
                    * gl.load(KD + b.to(gl.int64) * sd[2] + hk * sd[3]))
            if SOFTCAP:
                qk_scale = qk_scale * d_qk
            else:
                step_scale = step_scale * d_qk
        acc, l, m = _fold(q, bufs, bars, it, k_i, t_lo, n_kv, t_a, t_c, key_lo, key_hi,
                          kv_len, qk_scale, step_scale, mod, s_zero, BLOCK_N,
                          BLOCK_D, BLOCK_D2, BLOCK_DV, STAGES, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                          O_IN_Q,
                          WG, PINGPONG, STEP, SHIFT, SCORE_MOD, MASK_FN, ROW_BOUNDS)

        # epilogue: ATTENTION2's finalize, generated (o = acc / l, lse = (m + log2 l) ln 2;
        # a row with no visible key, m = -inf: 0 and -inf; NaN m or l: NaN)
        rows_o = r0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, o_layout))
        if FP8:
            # o is linear in v: v's factor; the state is ATTENTION2's at m - SHIFT_FP8
            # (the step's reference shift), or acc carries the 448 of the multiply
            vd = gl.load(VD + b.to(gl.int64) * sd[4] + hk * sd[5])
            if SHIFT != 0.0:
                acc = acc * vd
                m = m - SHIFT
            else:
                acc = acc * (vd / FP8_MAX_C)
        o, lse = FINALIZE(gl.convert_layout(m, gl.SliceLayout(1, o_layout)),
                          gl.convert_layout(l, gl.SliceLayout(1, o_layout)), acc)
        if VARLEN:
            if r0 + HALF > q_len:
                # the sequence ends inside these rows: masked stores, no TMA box (it would
                # write the next sequence's rows)
                cols = gl.arange(0, BLOCK_DV, layout=gl.SliceLayout(0, o_layout))
                ptrs = (O + hq.to(gl.int64) * stride_oh
                        + (qs + rows_o).to(gl.int64)[:, None] * stride_on + cols[None, :])
                gl.store(ptrs, o.to(dtype), mask=(rows_o < q_len)[:, None] & (cols < dv)[None, :])
                if O_IN_Q:
                    mbarrier.arrive(q_empty, count=1)
            else:
                _store_o(o.to(dtype), o_smem, o_desc, [0, hq, qs + r0, 0], q_empty, HALF,
                         BLOCK_DV, O_IN_Q)
        else:
            _store_o(o.to(dtype), o_smem, o_desc, [b, hq, r0, 0], q_empty, HALF, BLOCK_DV,
                     O_IN_Q)
        if RETURN_LSE:
            gl.store(LSE + b.to(gl.int64) * stride_lb + hq * stride_lh + qs + rows_o, lse,
                     mask=rows_o < q_len)
        if MASK_LEFT or MASK_RIGHT or VARLEN or SCORE_MOD is not None or MASK_FN is not None:
            # the non-finite flag of these 64 rows (``flag_groups`` per head; 0: off): an
            # edge tile's P V meets the values of hidden keys (0 x NaN; packed, the next
            # sequence's too; keys a score_mod hides), so a non-finite o may be a leak,
            # which the strict Triton guard launched after this kernel recomputes
            # (:func:`.fwd.prepare_guard`). The flags are zeroed by the caller; a row
            # whose o holds a NaN or inf (its sum carries it) stores 1, predicated: no
            # reduction across the warpgroup's warps. A finite sum that overflows flags
            # its rows too: the guard recomputes them, exactly.
            if flag_groups != 0:
                bad = (~(gl.abs(gl.sum(o, 1)) < float("inf"))) & (rows_o < q_len)
                if VARLEN:
                    # by slot: sequence b's groups at qs // HALF + b + g, flag_groups =
                    # Nq // HALF + sequences per head (.fwd.flag_count: no flag for rows
                    # past a sequence, whose lengths a capture does not know)
                    flag = FLAGS + hq * flag_groups + qs // HALF + b + r0 // HALF
                else:
                    flag = FLAGS + (b * heads_q + hq) * flag_groups + r0 // HALF
                gl.store(flag + gl.zeros_like(rows_o), gl.full_like(rows_o, 1), mask=bad)

    @gluon.jit
    def _consumer(descs, bufs, bars, shape, seqs, out, bm, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_D2: gl.constexpr,
                  BLOCK_DV: gl.constexpr,
                  STAGES: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
                  SOFTCAP: gl.constexpr, O_IN_Q: gl.constexpr, RETURN_LSE: gl.constexpr,
                  VARLEN: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr,
                  STEP: gl.constexpr, FINALIZE: gl.constexpr, SCORE_MOD: gl.constexpr,
                  MASK_FN: gl.constexpr, ROW_BOUNDS: gl.constexpr, SPLIT: gl.constexpr,
                  DYNAMIC: gl.constexpr):
        """One warpgroup's 64 query rows (half ``WG``) of each work item
        (:func:`_consume_item`): fold its key tiles into ``(acc, l, m)`` (:func:`_fold`)
        -- base-2 maxima ``m`` of the scores, ``l = sum 2^(s - m)``, ``acc = sum 2^(s -
        m) v`` -- then write ``o = acc / l`` (staged in this half's output buffer, or its
        query buffer with ``O_IN_Q``, TMA store) and the LSE; a row that sees no key gets
        ``o = 0``, ``lse = -inf`` (``l = 0``). ``VARLEN``: the items come from the
        producer (:func:`_take_item`) until ``m = -1``; a half that ends past its
        sequence is written by masked stores from registers. ``DYNAMIC``: the items too
        (item ``t`` and its tile count)."""
        q_bufs, o_bufs, k_bufs, v_bufs, walk_bufs, q2_bufs, k2_bufs = bufs
        q_ready = bars[0]
        q_len, kv_len, heads_q, group, n_m, win_left, win_right = shape
        bh_total = out[4]
        HALF: gl.constexpr = BLOCK_M // 2
        FP8: gl.constexpr = descs[0].dtype == gl.float8e4nv
        q = (q_bufs, q2_bufs)
        if O_IN_Q:
            o_smem = q_bufs.index(WG)
        else:
            o_smem = o_bufs.index(WG)
        s_zero = gl.zeros([HALF, BLOCK_N], gl.float32, _wgmma_layout(BLOCK_N, descs[0].dtype))
        win = (win_left, win_right, heads_q, group)
        it = 0
        if VARLEN or DYNAMIC:
            # the items the producer hands (_hand_item), until m = -1: a packed
            # sequence's (hq, s, qs, q_len, ks, kv_len, m), or DYNAMIC's (t, n_kv, ..)
            info = seqs[5]
            done = 0
            mbarrier.wait(q_ready, 0)
            x, y, qs, x_len, ks, y_len, m = _take_item(info)
            while m >= 0:
                if VARLEN:
                    b = y
                    hq = x
                    q_start = qs
                    q_len = x_len
                    _, kv_len, k_first = _first_key(ks, y_len, FP8)
                    q0 = m * BLOCK_M
                    t_lo, n_kv, t_a, t_c = _key_tiles(q0, q_len, kv_len, win_left, win_right,
                                                      k_first, BLOCK_M, BLOCK_N, MASK_LEFT,
                                                      MASK_RIGHT)
                    n_kv = gl.maximum(n_kv, 1)        # (as the producer: rows without keys)
                else:
                    # item x; its tile count y is the producer's, which read the block
                    # mask's lists
                    b, hq, _, q0, t_lo, _, t_a, t_c, _ = _tile(
                        x, shape, bh_total, bm, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, None,
                        SPLIT)
                    n_kv = y
                    q_start = 0
                    k_first = 0
                _consume_item(q, descs, bufs, bars, o_smem, s_zero, out, win, it, done, b, hq,
                              q_start, q_len, kv_len, k_first, q0, t_lo, n_kv, t_a, t_c,
                              BLOCK_M, BLOCK_N,
                              BLOCK_D, BLOCK_D2, BLOCK_DV, STAGES, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                              O_IN_Q, RETURN_LSE, VARLEN, WG, PINGPONG, STEP, FINALIZE,
                              SCORE_MOD, MASK_FN, ROW_BOUNDS)
                it += n_kv
                done += 1
                mbarrier.wait(q_ready, done & 1)
                x, y, qs, x_len, ks, y_len, m = _take_item(info)
        else:
            rounds = _rounds(shape, bh_total)
            for i in range(rounds):
                # (the walk's lists are the producer's: the consumers take each tile from
                # its note, _ring_tile)
                b, hq, hk, q0, t_lo, n_kv, t_a, t_c, _ = _tile(
                    _item_index(i), shape, bh_total, bm, BLOCK_M, BLOCK_N, MASK_LEFT,
                    MASK_RIGHT, MASK_FN, SPLIT)
                _consume_item(q, descs, bufs, bars, o_smem, s_zero, out, win, it, i, b, hq,
                              0, q_len, kv_len, 0, q0, t_lo, n_kv, t_a, t_c, BLOCK_M, BLOCK_N,
                              BLOCK_D, BLOCK_D2, BLOCK_DV, STAGES, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                              O_IN_Q, RETURN_LSE, VARLEN, WG, PINGPONG, STEP, FINALIZE,
                              SCORE_MOD, MASK_FN, ROW_BOUNDS)
                it += n_kv
        tma.store_wait(0)

    @gluon.jit
    def _attn_fwd_ws(q_desc, k_desc, v_desc, o_desc, q2_desc, k2_desc, LSE, stride_lb, stride_lh,
                     q_len, kv_len, heads_q, group, bh_total, qk_scale, step_scale, win_left,
                     win_right, FLAGS, flag_groups, O, stride_oh, stride_on, dv, CU_Q, CU_K,
                     n_seqs, search_levels, search_top, MOD_BUFS, mod_scale, row0, BM,
                     MASK_BUFS, COUNTER, DESCALES, SD, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr,
                     BLOCK_D: gl.constexpr,
                     BLOCK_D2: gl.constexpr, BLOCK_DV: gl.constexpr, STAGES: gl.constexpr,
                     MASK_LEFT: gl.constexpr,
                     MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
                     O_IN_Q: gl.constexpr, RETURN_LSE: gl.constexpr, PINGPONG: gl.constexpr,
                     VARLEN: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                     PRODUCER_REGS: gl.constexpr, STEP: gl.constexpr, FINALIZE: gl.constexpr,
                     SCORE_MOD: gl.constexpr, MASK_FN: gl.constexpr,
                     ROW_BOUNDS: gl.constexpr, SPLIT: gl.constexpr, DYNAMIC: gl.constexpr):
        """Work items (query tile ``m`` of batch x head ``bh``) over a 1-D grid of ``G``
        programs: one item each when ``G`` is the item count, else persistent (``G`` =
        the SM count; rounds in a snake order, :func:`_rounds`, or with ``DYNAMIC`` the
        next item of the ticket counter ``COUNTER``, int32, zeroed), where the producer
        loads the next item while the consumers finish the last one. ``num_warps=4`` (the
        first consumer warpgroup) plus the second consumer and the producer. ``O_IN_Q``:
        the output is staged in the query buffers (no separate output buffers: head_dim
        256, whose query, key/value rings and output buffers would exceed shared memory).
        E4M3 descriptors (FP8): ``DESCALES``, the q, k, v factors, float32 ``(B or S,
        Hk)``, and ``SD``, their six strides; ``v_desc`` spans ``(B, Hk, Dv, Nk)``, keys
        innermost (Nones and zeros for 16-bit calls)."""
        dtype: gl.constexpr = q_desc.dtype
        q_bufs = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        if O_IN_Q:
            o_bufs = q_bufs
        else:
            o_bufs = gl.allocate_shared_memory(o_desc.dtype, [2] + o_desc.block_type.shape,
                                               o_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        if BLOCK_D2 > 0:
            # the queries' and keys' second column chunk (q2_desc, k2_desc)
            q2_bufs = gl.allocate_shared_memory(dtype, [2] + q2_desc.block_type.shape,
                                                q2_desc.layout)
            k2_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k2_desc.block_type.shape,
                                                k2_desc.layout)
        else:
            q2_bufs = q_bufs               # (unused)
            k2_bufs = k_bufs
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

        descs = (q_desc, k_desc, v_desc, o_desc, q2_desc, k2_desc)
        if MASK_FN is not None:
            # each ring slot's key tile and kind (_walk), from the producer
            walk_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, 2], gl.SwizzledSharedLayout(
                1, 1, 1, [0]))
        else:
            walk_bufs = q_ready            # (unused)
        bufs = (q_bufs, o_bufs, k_bufs, v_bufs, walk_bufs, q2_bufs, k2_bufs)
        bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn)
        if VARLEN:
            n_m = q_len // BLOCK_M + n_seqs          # slots (see _tile)
        else:
            n_m = gl.cdiv(q_len, BLOCK_M)
        shape = (q_len, kv_len, heads_q, group, n_m, win_left, win_right)
        if VARLEN or DYNAMIC:
            # the item the producer hands the consumers (_hand_item)
            info = gl.allocate_shared_memory(gl.int32, [8], gl.SwizzledSharedLayout(
                1, 1, 1, [0]))
        else:
            info = q_ready                 # (unused)
        seqs = (CU_Q, CU_K, n_seqs, search_levels, search_top, info)
        out = (LSE, stride_lb, stride_lh, qk_scale, bh_total, FLAGS, flag_groups, step_scale,
               O, stride_oh, stride_on, dv, MOD_BUFS, mod_scale, row0, MASK_BUFS, COUNTER,
               DESCALES, SD)
        warp_specialize([
            (_consumer, (descs, bufs, bars, shape, seqs, out, BM, BLOCK_M, BLOCK_N, BLOCK_D,
                         BLOCK_D2, BLOCK_DV, STAGES, MASK_LEFT, MASK_RIGHT, SOFTCAP, O_IN_Q,
                         RETURN_LSE,
                         VARLEN, 0, PINGPONG, STEP, FINALIZE, SCORE_MOD, MASK_FN,
                         ROW_BOUNDS, SPLIT, DYNAMIC)),
            (_consumer, (descs, bufs, bars, shape, seqs, out, BM, BLOCK_M, BLOCK_N, BLOCK_D,
                         BLOCK_D2, BLOCK_DV, STAGES, MASK_LEFT, MASK_RIGHT, SOFTCAP, O_IN_Q,
                         RETURN_LSE,
                         VARLEN, 1, PINGPONG, STEP, FINALIZE, SCORE_MOD, MASK_FN,
                         ROW_BOUNDS, SPLIT, DYNAMIC)),
            (_producer, (descs, bufs, bars, shape, seqs, out, BM, BLOCK_M, BLOCK_N, BLOCK_D,
                         BLOCK_D2, STAGES,
                         MASK_LEFT, MASK_RIGHT, VARLEN, MASK_FN, SPLIT, DYNAMIC)),
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


@triton.jit
def _fill_empty_rows(O, LSE, n_rows, dv, heads, sob, soh, som, sod, slb, slh,
                     BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr, RETURN_LSE: tl.constexpr):
    """Rows ``0 .. n_rows`` of every (batch, head) ``bh = program_id(0)``, which see no key
    (the first query tiles of a call with a right bound and ``Nq > Nk``): ``o = 0``,
    ``lse = -inf`` (their non-finite flags stay as the caller zeroed them). Program ``(bh,
    i)`` writes rows ``i BLOCK_R .. (i + 1) BLOCK_R`` (the heads on the grid's first axis,
    which may exceed 65,535)."""
    bh = tl.program_id(0)
    b = bh // heads
    h = bh % heads
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_DV)
    ptrs = (O + b.to(tl.int64) * sob + h.to(tl.int64) * soh
            + rows.to(tl.int64)[:, None] * som + cols[None, :] * sod)
    tl.store(ptrs, tl.zeros([BLOCK_R, BLOCK_DV], O.dtype.element_ty),
             mask=(rows < n_rows)[:, None] & (cols < dv)[None, :])
    if RETURN_LSE:
        tl.store(LSE + b.to(tl.int64) * slb + h.to(tl.int64) * slh + rows,
                 tl.full([BLOCK_R], float("-inf"), tl.float32), mask=rows < n_rows)


_GL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16",
              torch.float8_e4m3fn: "float8e4nv"}


@functools.lru_cache(maxsize=None)
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def block_dims(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """The kernel's tile widths ``(BLOCK_D, BLOCK_DV)``: the next powers of two of the head
    dims (80 and 96 -> 128, 192 -> 256); TMA reads the columns past a head dim as zeros
    and does not write them."""
    return 1 << max(0, head_dim - 1).bit_length(), 1 << max(0, head_dim_v - 1).bit_length()


#: ``(BLOCK_N, O_IN_Q)`` per ``(BLOCK_D, BLOCK_DV)``: key rows per tile, and whether the
#: output is staged in the query buffers. 128-key tiles up to head_dim 128 (two 64 x 128
#: fp32 score tiles and accumulators per warpgroup fit 240 registers; shared memory at
#: 128: 32 KB of queries, 2 x 64 KB of keys and values, 32 KB of output); at 256, 64-key
#: tiles (the 64 x 256 fp32 accumulator alone is 128 registers a thread), and with a
#: 256-wide ``V`` the output goes out through the query buffer (64 + 128 + 64 KB would
#: exceed 227 KB). Every plan here is compiled for sm_90 by the CPU suite.
TILE_PLANS = {(32, 32): (128, False), (64, 64): (128, False), (128, 128): (128, False),
              (256, 256): (64, True), (256, 128): (64, False),
              # q/k in two column chunks (:func:`qk_chunks`): the registers of the 128-wide
              # plan; at 192 (DeepSeek's MLA, 128 + 64) shared memory holds 48 KB of
              # queries and 2 x 80 KB of keys and values, so the output goes out through
              # the first query chunk (as wide as v)
              (80, 128): (128, False), (96, 128): (128, False), (192, 128): (128, True)}


def qk_chunks(head_dim: int, head_dim_v: int, least: int = 16) -> tuple[int, int]:
    """``(BLOCK_D, BLOCK_D2)``: the q/k tile's column chunks. A register tensor and a TMA
    box are powers of two wide, so a head dim between two powers runs as a power-of-two
    chunk of ``BLOCK_D`` columns and a second of ``BLOCK_D2`` (a power of two, at least
    16: one wgmma K step; the least that covers the head dim and has a plan of that
    width in :data:`TILE_PLANS`), read at column ``BLOCK_D`` and multiplied into the same
    scores (192 = 128 + 64, 96 = 64 + 32, 80 = 64 + 16; 160 as 128 + 64); else the
    next power of two (``BLOCK_D2 = 0``). Either way TMA reads columns past the head dim
    as zeros. The padding cost ``S = Q K^T`` 33% more work at 192 and 96, 60% at 80."""
    block_d, block_dv = block_dims(head_dim, head_dim_v)
    lo = block_d // 2
    if head_dim > lo >= 16:
        hi = max(least, block_dims(head_dim - lo, 1)[0])
        while hi < lo:
            if (lo + hi, block_dv) in TILE_PLANS:
                return lo, hi
            hi *= 2
    return block_d, 0


def _bounds(causal: bool, left: int | None, right: int | None):
    """``(left, right)`` with ``causal`` folded in (``right = min(right, 0)``)."""
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def supported(q, k, v, *, causal: bool = False, scale: float | None = None,
              left: int | None = None, right: int | None = None,
              softcap: float | None = None) -> bool:
    """Whether the kernel's scope covers these tensors, whatever their device: fp16/bf16
    or E4M3 (FP8; the call passes its descales), ``(B, H, N, D)`` for q and k, ``(B, H,
    N, Dv)`` for v, with tile widths (the next powers of two of ``D``, ``Dv``) of a plan
    in :data:`TILE_PLANS` (``D = Dv`` in 17-256, or ``D`` in 129-256 with ``Dv`` in
    65-128), ``Hq % Hk == 0``, non-empty, ``scale > 0``, ``softcap > 0`` or None, window
    sides ints ``>= 0`` or None, TMA-compatible strides and addresses (unit last stride,
    the others and the base 16-byte aligned); an E4M3 ``v`` keys-contiguous, its
    transposed view ``(B, H, Dv, N)`` TMA-compatible (stored ``(B, H, Dv, Nk)``: ``Nk``
    a multiple of 16), and ``Dv`` a multiple of 8 (the 16-bit or fp32 output's rows, which
    a 16-bit call's ``v`` vouches for)."""
    if q.dtype not in _GL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[-1] != q.shape[-1] \
            or block_dims(q.shape[-1], v.shape[-1]) not in TILE_PLANS:
        return False
    if (scale is not None and not scale > 0) or (softcap is not None and not softcap > 0):
        return False
    if any(w is not None and not w >= 0 for w in (left, right)):
        return False
    nq, nk = q.shape[2], k.shape[2]
    if q.shape[0] == 0 or q.shape[1] == 0 or nq == 0 or nk == 0:
        return False
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        return False
    if q.dtype == torch.float8_e4m3fn:
        if v.shape[3] % 8:
            return False
        v = v.transpose(2, 3)                # (the tensor its descriptor spans: _desc)
    return all(addressable(t) for t in (q, k, v))


def on_hopper(q: torch.Tensor) -> bool:
    """Whether Gluon kernels can run on ``q``'s device: Gluon present and an sm_90 GPU
    (whether they may is the policy's, :mod:`.dispatch`)."""
    if not q.is_cuda:
        return False
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return _is_sm90(index) and compat.gluon_usable()


def eligible(q, k, v, *, causal: bool = False, scale: float | None = None,
             left: int | None = None, right: int | None = None,
             softcap: float | None = None) -> bool:
    """:func:`supported` and :func:`on_hopper` (the caller rules out mods and block
    masks)."""
    return on_hopper(q) and supported(q, k, v, causal=causal, scale=scale, left=left,
                                      right=right, softcap=softcap)


def item_range(q0: int, nq: int, nk: int, left: int | None = None,
               right: int | None = None, block_n: int = BLOCK_N) -> tuple[int, int, int, int]:
    """The key tiles of the work item whose query tile starts at row ``q0``, as the
    kernel's :func:`_tile` computes them: ``(t_lo, n_kv, t_a, t_c)``, the ``n_kv`` tiles
    of ``block_n`` keys from ``t_lo`` that meet the window ``[r + Nk - Nq - left, r + Nk -
    Nq + right]`` of a real row ``r`` (``None``: unbounded; causal is ``right = 0``; ``n_kv
    = 0`` for an item none of whose rows sees a key), and the run ``[t_a, t_c)`` of tiles
    every real row sees whole (the others are masked)."""
    delta = nk - nq
    r_last = min(q0 + BLOCK_M, nq) - 1
    hi = full_hi = nk
    if right is not None:
        hi = max(min(hi, r_last + delta + right + 1), 0)
        full_hi = max(min(full_hi, q0 + delta + right + 1), 0)
    t_lo = t_a = 0
    if left is not None:
        t_lo = max(q0 + delta - left, 0) // block_n
        t_a = max(-(-max(r_last + delta - left, 0) // block_n), t_lo)
    t_hi = max(-(-hi // block_n), t_lo)
    t_a = min(t_a, t_hi)
    return t_lo, t_hi - t_lo, t_a, min(max(full_hi // block_n, t_a), t_hi)


def item_tiles(nq: int, nk: int, left: int | None = None, right: int | None = None,
               block_n: int = BLOCK_N) -> list[int]:
    """The key-tile count of each work item of a head (:func:`item_range`)."""
    return [item_range(q0, nq, nk, left, right, block_n)[1] for q0 in range(0, nq, BLOCK_M)]


def pingpong_default(causal: bool, nq: int, nk: int, left: int | None = None,
                     right: int | None = None, block_n: int = BLOCK_N, *,
                     fp8_width: int = 0) -> bool:
    """Whether the two consumer warpgroups ping-pong: each issues its wgmma only after the
    other has issued its own for the previous event (two mbarriers), so that one
    warpgroup's softmax runs while the other's products hold the tensor cores.

    Each warpgroup already overlaps its softmax with its own ``P V`` product, except on
    an item's first key tile (``S_0`` alone, then its softmax) and last ``P V``; ping-pong
    fills those gaps with the other warpgroup's work, and costs a wait per tile
    everywhere. So items averaging at most ``PINGPONG_MAX_TILES`` key tiles
    (:func:`item_tiles`: causal items average ``(Nk - Nq + (Nq + 128) / 2) / 128``, a
    window's about ``(left + right + 128) / 128``) ping-pong. Measured (H200, against no
    ping-pong): 1K dense (8 tiles per item) +2%, 4K causal (16.5 on average) +1-5.5%, 4K
    dense (32) -3.5% at head_dim 128, 16K (64-128) 0 to -1.3%;
    ``docs/notes/attention_fwd.md``, "Warpgroup ping-pong".

    ``fp8_width``: an FP8 call's q/k tile width (both column chunks; 0: a 16-bit call).
    An E4M3 product takes half a 16-bit one's tensor time and the softmax the same, so
    the softmax is the longer part of a step: from ``FP8_PINGPONG_MIN_D`` columns FP8
    calls ping-pong whatever their length (H100, CUDA graphs, against no ping-pong: dense
    d128 4K +7.6%, Gemma-2's d256 causal softcap 8K +4.1%, dense d256 4K +0.6%; dense d64
    4K -5.1%, so narrower ones keep the rule; ``docs/notes/fp8.md``)."""
    left, right = _bounds(causal, left, right)
    tiles = [n for n in item_tiles(nq, nk, left, right, block_n) if n]   # the work items
    return _pingpong(tiles, fp8_width)


def _pingpong(tiles: list, fp8_width: int) -> bool:
    """:func:`pingpong_default` of the work items' key tile counts ``tiles``."""
    if fp8_width >= FP8_PINGPONG_MIN_D:
        return True
    return sum(tiles) <= PINGPONG_MAX_TILES * len(tiles)


def persistent_default(uneven: bool, n_m: int, sms: int) -> bool:
    """Whether a call runs persistent (one program per SM taking work items in snake
    rounds) rather than one program per item (the hardware's block scheduler then
    balances the items as they finish). ``uneven``: the items of a head differ in cost
    as a sawtooth, which a window bounded on one side only makes (causal: item ``m``
    costs ``m + 1`` key tiles); dense items, and a window's bounded on both sides (but
    for the first few), cost the same.

    Even items: persistent (H200, head_dim 128: +4-12% at N = 1K-16K over one program
    per item, the next item's loads overlapping the last one's epilogue). Uneven items:
    a head contributes a sawtooth of weights ``n_m .. 1`` and the snake evens out a
    program's sum only when one round (``sms`` items) spans several heads. So they go
    persistent while ``sms >= CAUSAL_HEADS_PER_ROUND * n_m``. Measured (H200, causal,
    head_dim 128): at 4K (``n_m = 32``, 4 heads per round) persistent 564-571 TFLOP/s
    against 493-513 per item; at 16K (``n_m = 128``, one head per round) 467-472 against
    580-618; ``docs/notes/attention_fwd.md``, "Persistent programs and the order of work
    items"."""
    return not uneven or sms >= CAUSAL_HEADS_PER_ROUND * n_m


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


def _desc(t: torch.Tensor, rows: int, cols: int | None = None, keys_inner: bool = False):
    """A 4-D TMA descriptor over ``t (B, H, N, D)`` with ``[1, 1, rows, cols]`` blocks
    (``cols``: all of ``D`` by default; wider, the columns past ``D`` read as zeros and
    are not written). ``keys_inner``: ``t`` is stored with ``N`` innermost (an FP8
    ``v``), and the descriptor spans ``(B, H, D, N)``, blocks of ``rows`` of ``D`` by
    ``cols`` keys; its base is ``t`` itself with the transposed shape and strides, not a
    transposed view (a plan replays descriptors over its inputs, not over views of
    them: :mod:`flashfold.kernels.plans`)."""
    view = t.transpose(2, 3) if keys_inner else t
    block = (1, 1, rows, cols or view.shape[-1])
    return GluonDescriptor(t, list(view.shape), box_strides(view), list(block),
                           _layout(block, t.dtype))


def _plan(D: int, Dv: int, fp8: bool = False) -> tuple[int, int, int, int, bool]:
    """``(BLOCK_D, BLOCK_D2, BLOCK_DV, BLOCK_N, O_IN_Q)`` of a call (:func:`qk_chunks`,
    :data:`TILE_PLANS`, keyed by q/k's width over both chunks and v's). ``fp8``: 8-bit
    tiles, whose wgmma reduces 32 columns at least (a second q/k chunk is 32 wide or
    more), and whose query buffers cannot stage a 16-bit output and need not (half the
    bytes: ``O_IN_Q`` off)."""
    bd, bd2 = qk_chunks(D, Dv, least=32 if fp8 else 16)
    bdv = block_dims(D, Dv)[1]
    block_n, o_in_q = TILE_PLANS[(bd + bd2, bdv)]
    return (bd, bd2, bdv, block_n, o_in_q and not fp8)


def _descs(q, k, v, o, plan) -> tuple:
    """The kernel's six TMA descriptors of a plan (:func:`_plan`): ``q``, ``k``, ``v``,
    ``o``, then the queries' and keys' second column chunks (with ``BLOCK_D2 = 0`` the
    first ones again, unread). An E4M3 ``v`` (keys-contiguous) is described keys
    innermost, ``[BLOCK_DV, BLOCK_N]`` tiles (:func:`_desc`)."""
    bd, bd2, bdv, block_n, _ = plan
    qd, kd = _desc(q, BLOCK_M // 2, bd), _desc(k, block_n, bd)
    vd = (_desc(v, bdv, block_n, keys_inner=True) if v.dtype == torch.float8_e4m3fn
          else _desc(v, block_n, bdv))
    return (qd, kd, vd, _desc(o, BLOCK_M // 2, bdv),
            _desc(q, BLOCK_M // 2, bd2) if bd2 else qd, _desc(k, block_n, bd2) if bd2 else kd)


def _scales(scale: float, softcap: float | None, score_mod=None, device=None) -> tuple:
    """The kernel's ``(qk_scale, step_scale)`` (:func:`_softmax_tile`) and its score_mod
    arguments ``(MOD_BUFS, mod_scale)``: with a score_mod the scores reach it in natural-log
    units (times ``mod_scale``) and the step takes them as they come (``step_scale =
    1``)."""
    if softcap is not None:
        # tanh(x) = 1 - 2 / (2^(2 log2(e) x) + 1), x = scale qk / c; the step multiplies by c
        qk_scale, step_scale = 2 * LOG2E * float(scale) / softcap, float(softcap)
    else:
        qk_scale, step_scale = 0.0, float(scale)
    if score_mod is None:
        return qk_scale, step_scale, (), 1.0
    return qk_scale, 1.0, score_mod.buffer_args(device), step_scale


def _constexprs(plan, left, right, softcap, return_lse, pingpong, *, varlen: bool,
                score_mod=None, block_mask=None, dynamic: bool = False) -> dict:
    """The template's flags and launch options of a call (``plan``: :func:`_plan`)."""
    step = tile_step_functions(ATTENTION2, scale="score", shift=True, gluon=True)
    block_d, block_d2, block_dv, block_n, o_in_q = plan
    return dict(BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_D2=block_d2,
                BLOCK_DV=block_dv,
                STAGES=STAGES, MASK_LEFT=left is not None, MASK_RIGHT=right is not None,
                SOFTCAP=softcap is not None, O_IN_Q=o_in_q, RETURN_LSE=bool(return_lse),
                PINGPONG=bool(pingpong), VARLEN=varlen, CONSUMER_REGS=CONSUMER_REGS,
                PRODUCER_REGS=PRODUCER_REGS, STEP=step.tile_step,
                FINALIZE=step.finalize_rows,
                SCORE_MOD=score_mod.gluon_fn() if score_mod is not None else None,
                **_mask_fn(block_mask),
                SPLIT=block_mask.BLOCK_SIZE[1] // block_n if block_mask is not None else 1,
                DYNAMIC=dynamic, num_warps=4, maxnreg=MAXNREG)


def _mask_fn(block_mask) -> dict:
    """``MASK_FN`` and ``ROW_BOUNDS`` of a call (:meth:`.mods.BlockMask.gluon_mask`): a
    block mask whose rows are each one interval of keys gives the intervals' bounds, which
    the kernel intersects with its own row bounds once per item; another, its row mask,
    evaluated per pair; none, None."""
    fn, rows = (None, False) if block_mask is None else block_mask.gluon_mask("keys")
    return dict(MASK_FN=fn, ROW_BOUNDS=rows)


#: the widest q/k tile whose calls walk block masks: the 256-wide plans' key loops spill
#: with a mask_mod on Triton 3.9 (docs/notes/attention_fwd.md, "Block masks")
BLOCK_MASK_MAX_D = 128


def block_mask_tiles(q, v, mask_mod) -> tuple[int, int] | None:
    """The tiles ``(BLOCK_M, block_n)`` whose multiples a block table must have for the
    kernel to walk it (:func:`_walk`): 128 query rows and the key tile of the call's plan
    (:func:`_plan`); None where the kernel walks none: a ``mask_mod`` (traced) that
    Gluon cannot lower, or q/k tiles wider than :data:`BLOCK_MASK_MAX_D`."""
    plan = _plan(q.shape[-1], v.shape[-1])
    if not mask_mod.gluon_ok or plan[0] + plan[1] > BLOCK_MASK_MAX_D:
        return None
    return BLOCK_M, plan[3]


def fits_block_mask(q, v, block_mask) -> bool:
    """Whether the kernel walks ``block_mask``'s lists: blocks of the 128 query rows of
    :func:`block_mask_tiles` and a multiple of its key tile (FlexAttention's and
    :func:`~.mods.create_block_mask`'s default 128 x 128 fits every such call)."""
    tiles = block_mask_tiles(q, v, block_mask.row_mod)
    sm, sn = block_mask.BLOCK_SIZE
    return tiles is not None and sm == tiles[0] and sn % tiles[1] == 0


def _block_mask_args(block_mask, device, row0: int) -> tuple:
    """The kernel's ``BM`` (:func:`_tile`): the block mask's four lists, the strides of
    a ``(b, h)`` row of counts and of index lists (0 along a dim the mask broadcasts),
    the blocks per row of index lists, and the position of the kernel's first row; and
    ``MASK_BUFS``, its mask_mod's tables. ``()`` twice without one."""
    if block_mask is None:
        return (), ()
    Bm, Hm, nM, nN = block_mask.state.shape
    bm = (block_mask.partial_num, block_mask.partial_idx, block_mask.full_num,
          block_mask.full_idx, Hm * nM if Bm > 1 else 0, nM if Hm > 1 else 0,
          Hm * nM * nN if Bm > 1 else 0, nM * nN if Hm > 1 else 0, nN, row0)
    return bm, block_mask.row_mod.buffer_args(device)


def _fp8_args(q, descales, out_dtype) -> tuple:
    """``(fp8, o's dtype, DESCALES, SD)`` of a call: whether it is FP8 (E4M3 ``q``, which
    takes ``descales``, the q, k, v factors, float32 ``(B or S, Hk)``; a 16-bit call
    takes none), its output's dtype (``out_dtype``, by default bf16 for FP8 and the input
    dtype else), and the kernel's ``DESCALES`` and ``SD``, the factors and their six
    strides (Nones and zeros without)."""
    fp8 = q.dtype == torch.float8_e4m3fn
    if fp8 != (descales is not None):
        raise ValueError("descales: E4M3 q, k, v take their factors (q, k, v descales), "
                         "16-bit ones none")
    if not fp8:
        return False, out_dtype or q.dtype, (None, None, None), (0,) * 6
    return (True, out_dtype or torch.bfloat16, tuple(descales),
            tuple(x for d in descales for x in d.stride()))


#: the left bound of a packed FP8 call without one: it hides none of a sequence's keys,
#: only the keys of the sequence before that its first key tile may start with
#: (:func:`_first_key`)
FP8_VARLEN_LEFT = 1 << 30


def varlen_slots(total_q: int, n_seqs: int) -> int:
    """Work-item slots per head of a packed call of ``n_seqs`` sequences, ``total_q``
    query rows in all: sequence ``s`` takes slots ``cu_q[s] // BLOCK_M + s + m`` for its
    query tiles ``m < ceil(len_s / BLOCK_M)``. Its tiles end at most one slot past the
    slot of its last row's tile, where the next sequence starts at the earliest, so the
    slots of different sequences never meet, and ``total_q // BLOCK_M + n_seqs`` slots
    hold all (at most ``n_seqs`` of them empty, against ``n_seqs x ceil(max_len /
    BLOCK_M)`` for a grid padded to the longest sequence)."""
    return total_q // BLOCK_M + n_seqs


def search_levels(n_seqs: int) -> int:
    """Rounds of the kernel's 32-way search for a slot's sequence (:func:`_lookup_issue`):
    the least ``L`` with ``32^L >= n_seqs``."""
    levels = 0
    while 32 ** levels < n_seqs:
        levels += 1
    return levels


def _varlen_launches(q, k, v, *, causal, left, right, softcap, scale, return_lse, out, lse,
                     launch, pingpong, persistent, flags, cu_seqlens_q, cu_seqlens_k,
                     max_seqlen_q, max_seqlen_k, score_mod, descales, out_dtype):
    """:func:`gluon_attention_fwd` of packed sequences (its docstring)."""
    _, Hq, Nq, D = q.shape
    Hk, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    if q.shape[0] != 1 or cu_seqlens_k is None or (max_seqlen_q is None) != (max_seqlen_k is None):
        raise ValueError("varlen: q, k, v of batch 1 with cu_seqlens_q, cu_seqlens_k, "
                         "and max_seqlen_q, max_seqlen_k both given or both None")
    n_seqs = cu_seqlens_q.shape[0] - 1
    # the flags by slot (the epilogue's): Nq // 64 + sequences per head, which hold every
    # sequence's 64-row groups whatever the lengths
    flag_groups = Nq // (BLOCK_M // 2) + n_seqs
    if max_seqlen_q is None:
        # lengths unknown (a CUDA-graph capture): the mean lengths stand for the longest
        # in the rules
        max_seqlen_q, max_seqlen_k = -(-Nq // max(n_seqs, 1)), -(-Nk // max(n_seqs, 1))
    if flags is None or flags.numel() != Hq * flag_groups:
        raise ValueError(f"flags: varlen calls write one flag per 64-row slot of each head "
                         f"(Nq // 64 + sequences), ({Hq * flag_groups},) zeroed int32")
    left, right = _bounds(causal, left, right)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    fp8, o_dtype, *descale_args = _fp8_args(q, descales, out_dtype)
    o = torch.empty((1, Hq, Nq, Dv), device=q.device, dtype=o_dtype) if out is None else out
    if return_lse and lse is None:
        lse = torch.empty((1, Hq, Nq), device=q.device, dtype=torch.float32)
    if not return_lse:
        lse = None
    plan = _plan(D, Dv, fp8)
    block_n = plan[3]
    if pingpong is None:
        # (the items of the longest sequence stand for all)
        pingpong = pingpong_default(False, max_seqlen_q, max_seqlen_k, left, right, block_n,
                                    fp8_width=(plan[0] + plan[1]) * fp8)
    slots, sms = varlen_slots(Nq, n_seqs) * Hq, num_sms(q)
    if persistent is None:
        # the dense rule, the longest sequence's query tiles standing for all
        persistent = persistent_default((left is None) != (right is None),
                                        -(-max_seqlen_q // BLOCK_M), sms)
    if fp8 and left is None:
        left = FP8_VARLEN_LEFT              # (its tiles start before a sequence's keys)
    levels = max(search_levels(n_seqs), 1)
    scales = _scales(scale, softcap, score_mod, q.device)
    args = (*_descs(q, k, v, o, plan), lse if return_lse else o,
            0, lse.stride(1) if return_lse else 0,
            Nq, Nk, Hq, Hq // Hk, Hq, *scales[:2],
            0 if left is None else int(left), 0 if right is None else int(right),
            flags, flag_groups, o, o.stride(1), o.stride(2), Dv,
            cu_seqlens_q, cu_seqlens_k, n_seqs, levels, 32 ** (levels - 1), *scales[2:], 0,
            *_block_mask_args(None, q.device, 0), o,       # (o: no ticket counter)
            *descale_args)
    kwargs = _constexprs(plan, left, right, softcap, return_lse, pingpong, varlen=True,
                         score_mod=score_mod)
    launches = ((_attn_fwd_ws, (min(slots, sms) if persistent else slots,), args, kwargs),)
    if not launch:
        return launches
    launcher.launch(*launches[0])
    return o, lse


def gluon_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        causal: bool = False, left: int | None = None,
                        right: int | None = None, softcap: float | None = None,
                        scale: float | None = None, return_lse: bool = False,
                        out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                        launch: bool = True, persistent: bool | None = None,
                        pingpong: bool | None = None, flags: torch.Tensor | None = None,
                        cu_seqlens_q: torch.Tensor | None = None,
                        cu_seqlens_k: torch.Tensor | None = None,
                        max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                        score_mod=None, block_mask=None, descales=None, out_dtype=None):
    """``(o, lse)`` for ``q (B, Hq, Nq, D)``, ``k (B, Hk, Nk, D)``, ``v (B, Hk, Nk, Dv)``:
    ``o (B, Hq, Nq, Dv)`` in the input dtype (FP8: ``out_dtype``), ``lse (B, Hq, Nq)``
    float32 natural log (``None`` without ``return_lse``). ``left`` / ``right``: the bottom-right aligned
    window (``None``: unbounded; ``causal`` folds in ``right = 0``); ``softcap``: scores
    ``c tanh(s / c)``. ``out`` / ``lse``: contiguous buffers to write (else allocated).
    The caller checks :func:`eligible`. ``launch=False`` returns the launches instead, a
    tuple of ``(kernel, grid, args, kwargs)``: the Gluon kernel's first, then, when the
    first query tiles see no key, :func:`_fill_empty_rows` (compile checks; the forward's
    plan).

    Query tiles whose rows see no key (with a right bound and ``Nq > Nk``, the first
    ``m_first`` ones) are no work item of the Gluon kernel: it runs on the rows from
    ``128 m_first`` on (views of ``q``, ``o``, the LSE and the flags; the bottom-right
    alignment ``Nk - Nq`` moves with ``Nq``, so a row sees the same keys), and
    :func:`_fill_empty_rows` writes the rows before with ``o = 0``, ``lse = -inf``.

    ``flags`` (windowed or causal calls only): int32 ``(B * Hq * ceil(Nq / 64),)``,
    zeroed; set to 1 where those 64 rows of ``o`` hold a non-finite entry. A tile
    on a window's edge (the causal diagonal) lets a hidden key's NaN or inf value through
    its ``P V`` (0 x NaN); the forward's dispatch (:func:`.fwd.attention_forward`)
    follows this kernel with the strict guard (:func:`.fwd.prepare_guard`) that
    recomputes the flagged rows. Without ``flags`` the kernel's output is
    FlashAttention's (a hidden value of an edge tile may reach a row). Calls without a
    window need none: every key a tile loads is visible or, past ``Nk``, read as zero by
    the 4-D descriptors.

    Varlen (``cu_seqlens_q`` / ``cu_seqlens_k``: int32 ``(S + 1,)`` offsets of ``S``
    sequences packed along ``N`` of a batch of one, with the longest lengths
    ``max_seqlen_q`` / ``max_seqlen_k``, or both None where they are not known (a
    CUDA-graph capture)): each sequence attends within itself (windows
    bottom-right aligned per sequence); the work items are its query tiles
    (:func:`varlen_slots`; no host sync, no padding), persistent or one program per slot
    by the dense rule with the longest sequence's tiles (:func:`persistent_default`;
    ``persistent`` overrides it; the mean lengths where the longest are not known). Query
    tiles of one
    sequence read the next one's rows and keys (masked, not written): ``flags``
    (required, zeroed, ``(Hq * (Nq // 64 + S),)``: by slot, sequence ``s``'s group ``g``
    at ``cu_seqlens_q[s] // 64 + s + g`` of its head's, whatever the lengths) mark the
    64-row groups where such a key's non-finite value reached ``o``, for the strict
    guard (:func:`.fwd.prepare_guard` with ``slots``); no rows
    are skipped on the host (rows that see no key take one masked key tile).

    ``score_mod`` (a :class:`~.mods.TracedMod` of kind ``"score"`` with
    :attr:`~.mods.TracedMod.gluon_ok`): applied to every visible score in the kernel
    (:func:`_softmax_tile`); ``flags`` mark its rows too (a score_mod's ``-inf`` hides
    keys as a window does). ``block_mask`` (:class:`~.mods.BlockMask`, dense calls,
    :func:`fits_block_mask`): each item walks its row's PARTIAL and FULL key blocks
    only, evaluating the mask_mod in the PARTIAL ones (``flags`` as with a window).

    ``persistent``: one program per SM taking items in snake rounds (True) or one program
    per item (False); by default :func:`persistent_default`, and with a block mask
    persistent programs that draw the items from a ticket counter (``DYNAMIC``; a
    zeroed int32 buffer of the call, from :func:`flashfold.kernels.plans.new`).

    FP8 (``torch.float8_e4m3fn`` q, k, v; no score_mod or block mask): ``descales``, the
    q, k, v factors ``(q_descale, k_descale, v_descale)``, float32 ``(B, Hk)`` (packed:
    ``(S, Hk)``), each input standing for ``x8 * descale`` with a query head taking its
    KV head's factor: ``o = v_descale / (448 l) P8 V8`` with ``P8`` the E4M3 rounding of
    ``448 P``, ``P`` from the scores ``q_descale k_descale scale q8 k8^T`` (softcapped
    after that scaling), ``l`` the fp32 sum of the unrounded ``P``
    (:func:`.reference.fp8_attention_reference`). ``v`` keys-contiguous (``v.stride(2)
    == 1``, a ``(B, Hk, Dv, Nk)`` tensor transposed), its transposed view TMA-addressable.
    ``out_dtype``: ``o``'s dtype, bf16 by default (fp16, bf16 or float32)."""
    varlen = cu_seqlens_q is not None
    if varlen and block_mask is not None:
        raise ValueError("block_mask: packed sequences take the Triton kernels' block masks")
    if varlen:
        return _varlen_launches(q, k, v, causal=causal, left=left, right=right,
                                softcap=softcap, scale=scale, return_lse=return_lse, out=out,
                                lse=lse, launch=launch, pingpong=pingpong,
                                persistent=persistent, flags=flags,
                                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                score_mod=score_mod, descales=descales, out_dtype=out_dtype)
    B, Hq, Nq, D = q.shape
    Hk, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    left, right = _bounds(causal, left, right)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if (flags is not None and left is None and right is None and score_mod is None
            and block_mask is None):
        raise ValueError("flags: only windowed, causal, score_mod or block-mask calls write "
                         "flags")
    fp8, o_dtype, *descale_args = _fp8_args(q, descales, out_dtype)
    o = torch.empty((B, Hq, Nq, Dv), device=q.device, dtype=o_dtype) if out is None else out
    if return_lse and lse is None:
        lse = torch.empty((B, Hq, Nq), device=q.device, dtype=torch.float32)
    if not return_lse:
        lse = None
    plan = _plan(D, Dv, fp8)
    block_n, BDV = plan[3], plan[2]
    tiles = item_tiles(Nq, Nk, left, right, block_n)
    # the first query tiles whose rows see no key (only with a right bound and Nq > Nk;
    # the last tile always sees one): not work items
    m_first = next(m for m, n in enumerate(tiles) if n)
    tiles = tiles[m_first:]
    skip = m_first * BLOCK_M
    flag_groups = -(-Nq // (BLOCK_M // 2))
    # the rows the kernel computes: from `skip` on (views: a row sees the same keys; the
    # tensors themselves when nothing is skipped, so that the plan cache can replay the
    # launch: it rebuilds views of the buffers a plan allocates, not of its inputs)
    qs, os_, ls, fs = q, o, lse, flags
    if skip:
        qs, os_ = q[:, :, skip:], o[:, :, skip:]
        ls = lse[:, :, skip:] if return_lse else None
        fs = flags[skip // (BLOCK_M // 2):] if flags is not None else None
    if pingpong is None:
        pingpong = _pingpong(tiles, (plan[0] + plan[1]) * fp8)
    scales = _scales(scale, softcap, score_mod, q.device)
    args = (*_descs(qs, k, v, os_, plan), ls if return_lse else os_,
            lse.stride(0) if return_lse else 0, lse.stride(1) if return_lse else 0,
            Nq - skip, Nk, Hq, Hq // Hk, B * Hq, *scales[:2],
            0 if left is None else int(left), 0 if right is None else int(right),
            os_ if fs is None else fs, 0 if fs is None else flag_groups,
            # (varlen only: the ragged tiles' stores, the sequences)
            os_, 0, 0, 0, os_, os_, 0, 0, 0,
            # (the score_mod's tables and scale; the first row's position; the block mask)
            *scales[2:], skip, *_block_mask_args(block_mask, q.device, skip))
    sms = num_sms(q)
    dynamic = False
    if persistent is None:
        # a block mask's items differ in work: the persistent snake order does not even
        # them out (H200, d128 causal document mask, 8 documents in 4K: 296-348 us against
        # 261-264 one program per item), and one program per item pays each program's
        # start for items of a few tiles (MiniLM's key padding: 78.5 us against 60.7); so
        # persistent programs draw them from a counter, each as soon as it is free
        dynamic = block_mask is not None
        persistent = dynamic or persistent_default((left is None) != (right is None),
                                                   len(tiles), sms)
    # the ticket counter of DYNAMIC (zeroed per call: a plan's replays allocate their own)
    args += (plans.new((1,), torch.int32, q.device, zero=True) if dynamic else os_,
             *descale_args)
    kwargs = _constexprs(plan, left, right, softcap, return_lse, pingpong, varlen=False,
                         score_mod=score_mod, block_mask=block_mask, dynamic=dynamic)
    items = len(tiles) * B * Hq
    launches = ((_attn_fwd_ws, (min(items, sms) if persistent else items,), args, kwargs),)
    if skip:
        fill_args = (o, lse if return_lse else o, skip, Dv, Hq, *o.stride(),
                     lse.stride(0) if return_lse else 0, lse.stride(1) if return_lse else 0)
        launches += ((_fill_empty_rows, (B * Hq, skip // FILL_ROWS), fill_args,
                      dict(BLOCK_R=FILL_ROWS, BLOCK_DV=BDV, RETURN_LSE=bool(return_lse),
                           num_warps=4)),)
    if not launch:
        return launches
    for one in launches:
        launcher.launch(*one)
    return o, lse
