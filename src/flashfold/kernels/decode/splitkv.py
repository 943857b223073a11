r"""Split-KV decoding (Flash-Decoding): one read of K/V per GQA group, merged by the monoid.

The math. For one query row the ATTENTION monoid's state over a set of keys ``J`` is
``(m, d, o) = (max s_j, sum e^(s_j - m), sum e^(s_j - m) v_j)``; it finalizes to
``(o / d, m + log d)`` and two states over disjoint key sets merge by

.. math::  (m_a, d_a, o_a) \oplus (m_b, d_b, o_b)
           = (m,\; d_a e^{m_a - m} + d_b e^{m_b - m},\; o_a e^{m_a - m} + o_b e^{m_b - m}),
           \quad m = \max(m_a, m_b),

associative with identity ``(-inf, 0, 0)`` (the pivot is kept finite when ``m = -inf``).
So the keys ``[0, n_b)`` of a sequence are cut into splits, each split's state is computed
by its own program, and the states are folded:

1. **split kernel**, grid ``(batch * heads_kv * m_blocks, splits)``: a program loads the
   query rows of *all* query heads of its GQA group (``group * q_len`` rows, padded to
   ``BLOCK_M >= 16`` for ``tl.dot``) once, then streams its split of K and V in tiles of
   ``BLOCK_N`` keys, software-pipelined: on Hopper, TMA boxes where the cache allows
   (contiguous caches, or pages a multiple of ``BLOCK_N`` tokens; :func:`_tma_default`),
   else ``cp.async`` with int64 pointer offsets (pages gathered through ``block_table``,
   whose reads the pipeliner issues a stage ahead of the K/V loads they address; the
   masked edge tiles' loads carry an L2 ``evict_first`` hint, which Triton 3.6 drops from
   the pipelined ``cp.async``). Tiles every
   row sees entirely run without masks; only the tiles at the first key / the window's
   left edge and at the sequence end / causal diagonal are masked (and there, with TMA,
   rows outside the sequence are zeroed: a cache slot may hold anything). Per tile, ``S = Q K^T`` on the
   tensor cores, then the online-softmax update in base 2 (``sigma = s log2 e``, folded
   into the scale, so every exponential is ``exp2``)::

       m' = max(m, rowmax S);  alpha = 2^(m - m');  P = 2^(S - m')
       d  = d alpha + rowsum P;  o = o alpha + P V;  m = m'

   i.e. the monoid's block lift followed by its combine, under the base-2 twist: the
   update is ATTENTION2's tile step, generated from the monoid
   (:func:`flashfold.algebra.twist.tile_step`, passed as the constexpr ``STEP``), which
   takes the scores as ``x * step_scale`` (``(qk, scale)``, or ``(tanh(qk scale / cap),
   cap)`` with softcap) and returns ``m', d', alpha, P``; ``P V`` stays here. The
   split's state is finalized with the generated ATTENTION ``finalize`` into a partial
   ``(o_s, lse_s)`` (fp32; batch-invariant mode keeps the raw state, see below), or, when
   one program covers the sequence, straight into the output.
   Grid order: query heads of a group share a program; a sequence's split programs are
   ``program_id(1)``.
2. **merge kernel**, grid ``(batch * heads_q * q_len,)``: a partial ``(o_s, lse_s)`` is
   exactly the state of one "virtual key" with score ``lse_s`` and value ``o_s``
   (``lift(lse_s, o_s) = (lse_s, 1, o_s)``; ``(0, -inf)`` lifts to the identity), so the
   merge is ``finalize(fold(combine, map(lift, partials)))``, computed with the
   ``block_lift``, ``combine`` and ``finalize`` generated from
   :data:`flashfold.monoids.ATTENTION` by :func:`flashfold.kernels.codegen.triton_monoid`.
   The bracketing is fixed. Default mode: the splits ``[16 k, 16 k + 16)`` of a row form
   one tile whose state the block lift computes at once (max, then sums in an order fixed
   by the constant tile width), and the tile states are combined left to right.
   Batch-invariant mode: the partials are the splits' raw states ``(m, d, o)`` (``m`` in
   base 2, ``o`` unnormalized), folded one at a time, left to right, by the combine
   (:func:`_fold`), which is what lets one program fold all of a sequence's splits itself
   (below). Missing splits
   (past a sequence's last) load as the identity and contribute exact zeros, so the
   result depends only on the sequence's own splits; a single split merges to itself bit
   for bit (``e^0 = 1``, ``e^-inf = 0``), the same bits the one-split kernel writes.

Split plan (one jit function, :func:`_split_plan`, used by both kernels). The keys any row
of a group can see start at ``lo = max(a_b, n_b - q_len - window_left)``, where ``a_b`` is
the sequence's first key (``cache_start``, clamped to ``[0, n_b]``; 0 without it).

* default mode: ``S`` split programs per sequence, ``S`` from the host heuristic
  :func:`choose_num_splits` (batch x heads_kv programs, the SM count, a host bound on the
  lengths: enough programs to fill the GPU, splits of at least ``MIN_SPLIT`` keys). A
  sequence's split size is ``ceil(ceil((n_b - base) / S) / BLOCK_N) * BLOCK_N`` from
  ``base = floor(lo / BLOCK_N) * BLOCK_N``, computed on the device from its own length,
  so every length is covered whatever the host assumed, and where the boundaries fall
  depends on ``S``, i.e. on the batch: the default mode's rounding is batch-dependent.
  Long rows of a contiguous head_dim-128 cache (a host bound of at least
  :data:`LONG_KV` keys) instead take ``S = floor(SMs / programs)``, one program per SM,
  with a deeper ring (:data:`LONG_STAGES`; :func:`_one_per_sm`): fewer, longer streams
  read DRAM faster there (H200: 8 x 64K +0.8%, 1 x 131K +2%, and -0.5% at 8K and 16K,
  where the rule does not apply). The ring depth changes no bit.
* ``batch_invariant``: split ``s`` of a sequence covers keys
  ``[c (floor(lo / c) + s), c (floor(lo / c) + s + 1))`` with ``c = INVARIANT_SPLIT``,
  doubled until the sequence's ``n_b - lo`` keys fit in ``INVARIANT_MAX_SPLITS`` splits,
  or halved (at most twice) until they span ``INVARIANT_MIN_SPLITS`` (so ``c`` is a
  function of the sequence alone). The grid's split programs are still chosen by occupancy (the
  same heuristic), but each program folds a run of *whole* fixed splits and flushes every
  split as it ends: the split's partial is written and the state reset to the identity,
  so each split is folded from the identity over its own tiles whichever program, run or
  grid it lands in. The splits, the tiles inside them (tiles start at multiples of
  ``BLOCK_N``), the kernel configuration (a function of head_dim, dtype, page size, group
  and q_len only) and the merge bracketing then depend only on the sequence: its output
  is bitwise the same in any batch, at the cost of a few more partials to write and merge
  (not of more, shorter programs). Split 0 may begin several tiles before ``lo``: those
  tiles hold no visible key and are skipped (they would fold to the identity exactly).
  When the grid has one program per sequence (large batches) that program does not write
  partials at all (``FOLD``): at each split's end it folds the split's raw state into a
  run state with the merge kernel's own step, :func:`_fold`, on the same fp32
  values in the same order (the raw state: no finalize, no division on the way), so the
  output has the merged bits without the partials'
  traffic or the merge launch. This is the specification's point in one place: with the
  bracketing fixed, where each combine runs (registers of one program, or a second
  kernel) is free.

A first key ``a_b`` (``cache_start``, e.g. left padding) is one more left bound, like the
window's: it moves ``lo`` (so every split, in both modes, is planned from the sequence's
own ``a_b``, never from the batch), the tile holding ``a_b`` is masked, and keys before it
are never loaded (masked loads; TMA tiles zero their values), nor are the pages of a paged
cache that hold no key of ``[a_b, n_b)`` looked up in the block table. The causal alignment
stays bottom-right against ``n_b``.

Non-finite inputs follow the rule of :mod:`~flashfold.kernels.decode.reference` (hidden keys
contribute nothing whatever they hold; a NaN or +inf score makes the row's ``o`` and ``lse``
NaN; a non-finite value entry only its ``(row, channel)``); the loop over the tiles every
row sees entirely is unchanged:

* a masked tile loads and sees only the keys that *every* row of the program sees (inside
  ``[a_b, n_b)``, at or before the first row's causal bound, at or after the last row's
  window bound); the others are never loaded there (TMA boxes: their values zeroed);
* the *partial* keys, which some rows see and others do not (after the first row's causal
  bound, left of the last row's window bound: fewer than ``q_len`` each, none with
  ``q_len = 1``), are folded by :func:`_partial_keys` with each row's own visibility, one
  key at a time, strictly: a non-finite value is zeroed in ``P V`` and its ``(row,
  channel)`` pairs that see the key are set to NaN (``0 x NaN`` would have reached the rows
  that do not). Default mode: once per program, after its loop (a program is one split);
  batch-invariant mode: in the tile, so that each fixed split holds its own keys;
* a visible NaN or +inf score makes ``d`` NaN (``2^(s - m)``), and ``d`` stays NaN through
  every rescale and combine (``NaN x 0 = NaN``), in the splits, the merge and the fold;
  the finalize (:func:`_finalize`) turns a NaN ``d`` into a NaN row, which the monoid's
  finalize alone may read as an empty one (``o = 0``: it tests ``d > 0``, or ``m = -inf``
  where every visible score is NaN and the max ignores NaN).

The order of the sums depends on the tiles and the sequence only, so batch invariance is
unaffected.

Workspace: partials ``o`` fp32 ``(batch, heads_q, q_len, ws, head_dim)`` and ``lse``
``(batch, heads_q, q_len, ws)`` (batch-invariant: ``o``, ``m`` and ``d``), contiguous, ``ws``
splits reserved per row; only the
splits a sequence uses are written and read (no padding traffic). The merge is this
module's own kernel rather than :func:`flashfold.merge_states` because decode needs a
per-sequence number of splits read from the device (``merge_states`` folds a fixed
leading axis: every row would read ``ws`` parts, padded with identities the split kernel
would have to write), the output in the input dtype directly (no extra cast pass), and a
programmatic dependent launch: on sm_90+ the merge is launched with ``launch_pdl`` while
the split kernel runs; each split program signals ``griddepcontrol.launch_dependents`` as
it starts and the merge waits (``griddepcontrol.wait``) before it reads a partial, so the
merge's launch latency hides behind the split kernel. Both merges fold the same generated
ATTENTION functions (``tests/test_decode_kernel.py`` checks split-KV against
``merge_states`` of ``attention`` over key chunks).

Lengths and first keys are read on the device (``cache_seqlens`` clamped to ``[0,
capacity]``, ``cache_start`` to ``[0, n_b]``), never on the host: nothing here synchronises, so a decode step can be captured in a CUDA graph.

Plan cache
----------
:func:`splitkv_decode` replays the launches recorded for its call signature
(:mod:`flashfold.kernels.plans`): the key holds shape, strides, dtype, device and 16-byte
alignment of every tensor, the options, the ``FLASHFOLD_DECODE_PDL`` / ``FLASHFOLD_DECODE_TMA``
switches and ``TRITON_INTERPRET``, never a tensor's values (other lengths, first keys or block
tables replay the same plan). Tensor checks run once per signature, options on every call
(``check_lengths``: everything, eagerly). Bypassed with ``FLASHFOLD_PLAN_CACHE=0`` and while
a global that :func:`prepare` reads is patched; at most :data:`PLAN_CACHE_SIZE` entries.
Why, and the host time it saves: ``docs/notes/decode.md``, "Plan cache and host time".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.3: host-side TMA descriptors
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None
try:  # Triton >= 3.3: grid dependency control (programmatic dependent launch, sm_90+)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None

from ...monoids import ATTENTION, ATTENTION2
from .. import launcher, plans, tma
from ..codegen import tile_step_functions, triton_monoid

#: tokens per split in batch-invariant mode (a multiple of every BLOCK_N used), doubled
#: for a sequence until its keys fit in INVARIANT_MAX_SPLITS splits (a function of the
#: sequence alone). H200, 1 x 131K (`decode.py --tune-invariant`): 256 splits of 512 ran at
#: 3,310-3,411 GB/s against 3,454-3,484 for 64 of 2048 (default mode: 3,789); the merge
#: of 256 partials per row took 22 us, of 64 10 us. 32 since the merge folds one partial
#: at a time (64 partials per row cost 8 x 32K 10.9% against the default mode;
#: docs/notes/decode.md, "batch_invariant")
INVARIANT_SPLIT = 512
INVARIANT_MAX_SPLITS = tl.constexpr(32)
#: ... and halved for a short sequence (at most twice, staying a multiple of BLOCK_N) until
#: its keys span INVARIANT_MIN_SPLITS splits: a batch of one 512-key sequence otherwise
#: ran 8 programs of 512 keys where the default mode ran 16 of 256 (12% slower, H200);
#: a large batch pays nothing for the extra splits, which one program folds in
#: registers (see ``FOLD``)
INVARIANT_MIN_SPLITS = tl.constexpr(4)
#: partials the batch-invariant merge loads at once before folding them one by one (the
#: fold's order is fixed; only how many loads are in flight depends on this)
INVARIANT_MERGE_GROUP = tl.constexpr(8)
#: partial states per merge tile (fixed: the merge's bracketing must not depend on the
#: batch), with the next tile's loads in flight during a combine, and the merge's warps.
#: One program merges one query row, so programs are many and short: at 256 x 4K (8192
#: rows of 8 partials) tiles of 64 at 8 warps took 142 us, against ~1 ms for the split
#: kernel (H200, `benchmarks/decode.py --tune-invariant`): a program's 8 warps mostly
#: loaded masked rows. 16 x 128 values at 2 warps is 32 per thread.
MERGE_BLOCK = 16
MERGE_WARPS = 2
#: smallest split the default heuristic makes, the most splits it makes, the split programs
#: resident per SM (~120-150 registers x 128 threads, 70 KB of shared memory: 3 fit on an
#: H100/H200), and the programs per SM that saturate DRAM with a 16-bit cache (measured
#: on the H200: 256 programs of 4 splits x 8 kv heads x batch 8 streamed 4.54 TB/s at 128K
#: keys; a cache of 1-byte entries needs more, :func:`saturating_per_sm`)
MIN_SPLIT = 256
MAX_SPLITS = 128
CTAS_PER_SM = 3
SATURATING_PER_SM = 2.0
#: long sequences: from a host bound of LONG_KV keys on, a contiguous head_dim-128 cache is
#: read by one split program per SM with a LONG_STAGES-deep ring instead of ~2 per SM with
#: 3 stages (:func:`_one_per_sm`). H200, graph replays / after a read flush, against cuDNN
#: timed alongside, 3 repetitions (docs/notes/decode.md, "One program per SM with a
#: deeper ring for long rows"): 8 x 64K
#: 1.001 / 1.000-1.001 (was 0.993 / 0.992), 1 x 131K 1.000 / 1.003-1.009 (was 0.98 /
#: 0.99), 8 x 32K 0.997 / 0.998-1.000 (was 0.996 / 0.997); shorter rows lose with it (8 x
#: 16K 1.000 against 1.006, 8 x 8K 0.995 against 1.003). 5 stages read 2% slower, 128-key
#: tiles (2 stages) or 8 warps 11-13%
LONG_KV = 32768
LONG_STAGES = 4
#: K + V bytes of a cache (its capacity: what a plan can see) from which the default reads
#: it through TMA: a TMA launch costs ~17-30 us more host time on the H200 host (Triton
#: walks all ~57 launch arguments in Python to expand the two descriptors, ~23 us under
#: cProfile; encoding them ~2 us), which made eager 1 x 8K calls host-bound (H200: 866
#: GB/s against 1,402 through pointers). From 256 MiB on, the kernel's >= ~60 us at the
#: DRAM rate hide it when the host is quick (8 x 8K eagerly: 3,406 GB/s, graph 3,399; on a
#: slower host eager 8 x 8K calls were host-bound either way). TMA and pointers give the
#: same bits, so the switch keeps outputs independent of the batch (docs/notes/decode.md,
#: "Tiles and the load path")
TMA_MIN_BYTES = 1 << 28
#: "unbounded" window side, as an int32 the kernels can subtract from positions
NO_WINDOW = 1 << 30


# --- jit helpers ------------------------------------------------------------------------

@triton.jit
def _tanh(x):
    # 1 - 2 / (e^{2x} + 1): exact limits +-1 (e^{2x} overflowing to inf is fine)
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _fold(m, d, o, m2_s, d_s, o_s, COMBINE: tl.constexpr):
    """``(m, d, o) (+) (m2_s ln 2, d_s, o_s)``: a fixed split's raw state (base-2 max, sum,
    unnormalized output) folded into a run state in natural-log units. The merge kernel
    (batch-invariant mode) and a FOLD program call this same function on the same fp32
    values in the same order, so both give the same bits."""
    return COMBINE(m, d, o, m2_s * 0.6931471805599453, d_s, o_s)


@triton.jit
def _finalize(m, d, o, FINALIZE: tl.constexpr):
    """The monoid's ``finalize(m, d, o) = (o / d, m + log d)``, then: a NaN ``d`` (a visible
    key scored NaN or +inf: ``2^(s - m)`` is NaN) makes ``o`` NaN too, where the finalize
    may take it for an empty row and give 0. Nothing changes for a finite ``d``."""
    out, lse = FINALIZE(m, d, o)
    nan_row = d != d
    return tl.where(nan_row, float("nan"), out), tl.where(nan_row, float("nan"), lse)


@triton.jit
def _partial_keys(q, m, l, acc, pos, b, lo, hi, seqlen, k_base, v_base, BT,
                  stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd,
                  stride_btb, stride_btp, win_left, step_scale, cap_in, STEP: tl.constexpr,
                  Q_LEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr,
                  SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, KV_FP8: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """Fold into the base-2 state ``(m, d, o)`` the *partial* keys among ``[lo, hi)`` (a
    masked tile's keys, or a program's): the keys that some query rows see and others do
    not, after the first row's causal bound (``seqlen - q_len + 1 .. seqlen - 1``) and,
    with ``WINDOW``, left of the last row's window bound (``seqlen - q_len - win_left ..``,
    up to the causal ones); fewer than ``q_len`` each, left out of the masked tiles. In
    steps of 16 keys (skipped when ``[lo, hi)`` holds none): their scores from one masked
    load of their K rows, each row seeing its own keys (causal, window); then ``P V`` one
    key at a time in fp32, its value row read again (an L2 hit), strictly: a non-finite
    entry is zeroed in the product (the rows that do not see the key get nothing of it,
    not ``0 x NaN``) and its ``(row, channel)`` is set to NaN in the rows that see it. No
    tensor-core product for ``P V``: a second accumulator layout cost ~70 registers."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    # slot u of the 16-key steps: edge u // (q_len - 1), its (u % (q_len - 1))-th key
    PER: tl.constexpr = Q_LEN - 1
    EDGES: tl.constexpr = 2 if WINDOW else 1
    first_c = tl.maximum(lo, seqlen - Q_LEN + 1)                 # causal edge in the tile
    first_w = tl.maximum(lo, seqlen - Q_LEN - win_left)          # window edge in the tile
    # (up to the causal edge: with a window narrower than q_len - 1 the two edges meet)
    last_w = tl.minimum(tl.minimum(hi, seqlen - 1 - win_left), seqlen - Q_LEN + 1)
    if WINDOW:
        any_key = (first_c < hi) | (first_w < last_w)
    else:
        any_key = first_c < hi
    for u0 in tl.static_range(0, EDGES * PER, 16):
        if any_key:                                      # the tile holds a partial key
            offs_t = tl.arange(0, 16)
            u = u0 + offs_t
            t = u % PER
            if WINDOW:
                keys = tl.where(u < PER, first_c + t, first_w + t)        # [16]
                k_ok = tl.where(u < PER, keys < hi, keys < last_w) & (u < EDGES * PER)
            else:
                keys = first_c + t
                k_ok = (keys < hi) & (u < PER)
            if PAGED:
                page = tl.load(BT + b * stride_btb + (keys // PAGE_SIZE) * stride_btp,
                               mask=k_ok, other=0).to(tl.int64)
                k_row = page * stride_kb + (keys % PAGE_SIZE).to(tl.int64) * stride_kn
            else:
                k_row = b * stride_kb + keys.to(tl.int64) * stride_kn
            k = tl.load(k_base + k_row[:, None] + offs_d[None, :] * stride_kd,
                        mask=k_ok[:, None] & d_ok[None, :], other=0.0)   # [16, BD]
            if KV_FP8:      # E4M3 -> q's operand dtype, exactly (descales applied outside)
                k = k.to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)    # [BM, 16]
            if SOFTCAP:
                s = _tanh(s * cap_in)                # the step multiplies by the cap
            sees = k_ok[None, :] & (keys[None, :] <= pos[:, None])
            if WINDOW:
                sees = sees & (keys[None, :] >= pos[:, None] - win_left)
            s = tl.where(sees, s, float("-inf"))
            m, l, alpha, p = STEP(m, l, s, step_scale)                     # ATTENTION2's step
            acc = acc * alpha[:, None]
            # P V one key at a time (fp32 FMAs, no tensor-core product: few keys, and
            # no accumulator layout of its own): the key's value row read again, its
            # non-finite entries zeroed in the product and marked NaN in the rows that
            # see the key
            for j in tl.static_range(16):
                if u0 + j < EDGES * PER:
                    if u0 + j < PER:
                        key = first_c + (u0 + j)
                        last = hi
                    else:
                        key = first_w + (u0 + j - PER)
                        last = last_w
                    if PAGED:
                        pg = tl.load(BT + b * stride_btb + (key // PAGE_SIZE) * stride_btp,
                                     mask=key < last, other=0).to(tl.int64)
                        v_row1 = pg * stride_vb + (key % PAGE_SIZE).to(tl.int64) * stride_vn
                    else:
                        v_row1 = b * stride_vb + key.to(tl.int64) * stride_vn
                    val = tl.load(v_base + v_row1 + offs_d * stride_vd,
                                  mask=d_ok & (key + offs_d * 0 < last), other=0.0)
                    val = val.to(tl.float32)                                  # [BD]
                    finite = tl.abs(val) < float("inf")
                    col = offs_t[None, :] == j
                    p_j = tl.sum(tl.where(col, p, 0.0), 1)                    # [BM]
                    sees_j = tl.max(tl.where(col & sees, 1, 0), 1) > 0        # [BM]
                    acc = acc + p_j[:, None] * tl.where(finite, val, 0.0)[None, :]
                    acc = tl.where(sees_j[:, None] & ~finite[None, :], float("nan"), acc)
    return m, l, acc


@triton.jit
def _raw_partial(LSEP, DP, OP, ws, split, n_used, offs_d, d_ok, HEAD_DIM: tl.constexpr):
    """Split ``split``'s raw state from the workspace slot ``ws``: ``(m2 [1], d [1], o
    [BD])``; the identity ``(-inf, 0, 0)`` past the sequence's ``n_used`` splits."""
    w = ws + tl.zeros([1], tl.int64)
    ok = split + tl.zeros([1], tl.int32) < n_used        # a [1] mask (see _page_of)
    m2 = tl.load(LSEP + w, mask=ok, other=float("-inf"))
    d = tl.load(DP + w, mask=ok, other=0.0)
    o = tl.load(OP + ws * HEAD_DIM + offs_d, mask=d_ok & ok, other=0.0)
    return m2, d, o


@triton.jit
def _split_plan(seqlen, kstart, win_left, n_splits, split_size, Q_LEN: tl.constexpr,
                BLOCK_N: tl.constexpr, FIXED_SPLIT: tl.constexpr):
    """(first key of split 0, keys per split, number of non-empty splits, first tile with a
    visible key) of one sequence, from its length and first key ``kstart`` only."""
    lo = tl.maximum(seqlen - Q_LEN - win_left, kstart)                  # kstart >= 0
    first_tile = (lo // BLOCK_N) * BLOCK_N
    if FIXED_SPLIT:                                                      # the sequence's own
        keys = seqlen - lo
        size = split_size
        while size * INVARIANT_MAX_SPLITS < keys:
            size = size * 2
        while ((size * INVARIANT_MIN_SPLITS > keys)
               & (size * INVARIANT_MIN_SPLITS >= 2 * split_size)
               & ((size // 2) % BLOCK_N == 0)):
            size = size // 2
        base = (lo // size) * size
    else:
        base = first_tile
        size = tl.cdiv(tl.cdiv(seqlen - base, n_splits), BLOCK_N) * BLOCK_N
        size = tl.maximum(size, BLOCK_N)
    return base, size, tl.cdiv(seqlen - base, size), first_tile


@triton.jit
def _page_of(BT, b, n0, kstart, end, stride_btb, stride_btp, PAGE_SIZE: tl.constexpr,
             BLOCK_N: tl.constexpr, CLIP_START: tl.constexpr):
    """The page holding the tile of keys ``[n0, n0 + BLOCK_N)``, which lies in one page
    (int32 scalar; page 0, not looked up, when the tile holds no key of ``[kstart, end)``;
    the ``kstart`` bound only with ``CLIP_START``)."""
    # "meets [kstart, end)" as one comparison, max(first, kstart) < min(last + 1, end), not
    # an ``&`` of comparisons with the scalar ``kstart < end``: the interpreter gives such
    # masks int32 data, which Triton 3.9's rejects (mask conditions below follow the same rule)
    if CLIP_START:  # the tile meets [kstart, end)
        live = tl.maximum(n0, kstart) < tl.minimum(n0 + BLOCK_N, end)
    else:
        live = n0 < end
    return tl.load(BT + b * stride_btb + (n0 // PAGE_SIZE) * stride_btp, mask=live, other=0)


@triton.jit
def _kv_rows(BT, b, n0, kstart, end, stride_btb, stride_btp,
             PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CLIP_START: tl.constexpr):
    """Page number of each key ``n0 .. n0 + BLOCK_N`` of a tile (int64; 0, not looked up,
    for a page holding no key of ``[kstart, end)``; the ``kstart`` bound only with
    ``CLIP_START``: tiles of the unmasked run lie inside the live keys).

    Tiles start at multiples of BLOCK_N: with ``PAGE_SIZE % BLOCK_N == 0`` a tile lies in
    one page (one scalar read), with ``BLOCK_N % PAGE_SIZE == 0`` it spans
    ``BLOCK_N / PAGE_SIZE`` whole pages (one small vector read, broadcast), else each key's
    page is read."""
    if PAGE_SIZE % BLOCK_N == 0:
        page = _page_of(BT, b, n0, kstart, end, stride_btb, stride_btp, PAGE_SIZE, BLOCK_N,
                        CLIP_START).to(tl.int64)
        return tl.full([BLOCK_N], 0, tl.int64) + page
    elif BLOCK_N % PAGE_SIZE == 0:
        NP: tl.constexpr = BLOCK_N // PAGE_SIZE
        offs_p = tl.arange(0, NP)
        first = n0 + offs_p * PAGE_SIZE                                  # each page's first key
        if CLIP_START:  # the page meets [kstart, end)
            live = tl.maximum(first, kstart) < tl.minimum(first + PAGE_SIZE, end)
        else:
            live = first < end
        pages = tl.load(BT + b * stride_btb + (n0 // PAGE_SIZE + offs_p) * stride_btp,
                        mask=live, other=0).to(tl.int64)
        return tl.reshape(tl.broadcast_to(pages[:, None], (NP, PAGE_SIZE)), (BLOCK_N,))
    else:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        live = offs_n < end
        if CLIP_START:
            live = live & (offs_n >= kstart)
        return tl.load(BT + b * stride_btb + (offs_n // PAGE_SIZE) * stride_btp,
                       mask=live, other=0).to(tl.int64)


@triton.jit
def _kv_step(q, m_i, l_i, acc, rm, rd, ro, n0, pos, b, h, kstart, end, seqlen, K_DESC, V_DESC,
             k_base, v_base, BT, OP, LSEP, DP, ws_row, row_ok, base, split_size,
             stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_btb,
             stride_btp, win_left, step_scale, cap_in, v_scale, STEP: tl.constexpr,
             FINALIZE: tl.constexpr,
             COMBINE: tl.constexpr, Q_LEN: tl.constexpr, HEAD_DIM: tl.constexpr,
             BLOCK_N: tl.constexpr,
             BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr,
             USE_TMA: tl.constexpr, MASKED: tl.constexpr, FLUSH: tl.constexpr,
             FOLD: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
             HAS_START: tl.constexpr, KV_FP8: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold the key tile ``[n0, n0 + BLOCK_N)`` into the base-2 state ``(m, d, o)``.

    Paged caches: the tile's page numbers are read here too; the software pipeliner puts
    that read a stage before the K/V loads it feeds (NUM_STAGES 5: two K/V tiles
    buffered). Unmasked tiles (``MASKED=False``) hold keys every row sees, all in
    ``[kstart, end)``; in masked tiles the keys outside ``[kstart, end)`` are neither
    loaded nor seen. With ``FLUSH`` (fixed splits of ``split_size`` keys from ``base``), a
    tile that ends a split writes the split's raw state ``(m, d, o)`` to the workspace
    and resets the state to the identity, so every split is folded from the identity over
    its own tiles, whichever program and key range it is part of. With ``FOLD``
    (batch-invariant, one program per sequence) the split's state is instead folded into
    the run state ``(rm, rd, ro)`` (natural-log units) with :func:`_fold`, the merge
    kernel's step: the same bits without writing or merging partials.

    ``KV_FP8``: the cache holds E4M3 keys and values; a tile is widened to ``q``'s
    operand dtype as it is loaded (fp16, or fp32 for fp32 queries: exact), the keys'
    descale is folded into the score scale by the caller, and ``o`` stays in units of the
    stored values: a split's raw state is written times ``v_scale`` (their descale)."""
    CLIP_START: tl.constexpr = MASKED and HAS_START
    offs_n = n0 + tl.arange(0, BLOCK_N)                                  # [BN] key positions
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < end
    if CLIP_START:  # keys before the sequence's first key: never loaded (may hold anything)
        n_ok = n_ok & (offs_n >= kstart)
    if MASKED:
        # only the keys every row sees: the others (after the first row's causal bound,
        # left of the last row's window bound; fewer than q_len each) are neither loaded
        # nor seen here but folded by :func:`_partial_keys` (after the tile with fixed
        # splits, after the loop in default mode)
        if Q_LEN > 1:
            n_ok = n_ok & (offs_n <= seqlen - Q_LEN)
        if WINDOW:
            n_ok = n_ok & (offs_n >= seqlen - 1 - win_left)
    if USE_TMA:     # one TMA box per tile; rows past the tensor read as 0
        if PAGED:
            slot = n0 % PAGE_SIZE
            page = _page_of(BT, b, n0, kstart, end, stride_btb, stride_btp, PAGE_SIZE, BLOCK_N,
                            CLIP_START)
            k = K_DESC.load([page, slot, h.to(tl.int32), 0]).reshape([BLOCK_N, BLOCK_D])
            v = V_DESC.load([page, slot, h.to(tl.int32), 0]).reshape([BLOCK_N, BLOCK_D])
        else:
            k = K_DESC.load([b.to(tl.int32), h.to(tl.int32), n0, 0]).reshape([BLOCK_N, BLOCK_D])
            v = V_DESC.load([b.to(tl.int32), h.to(tl.int32), n0, 0]).reshape([BLOCK_N, BLOCK_D])
        if KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if MASKED:  # rows outside [kstart, end) hold whatever the cache holds (0 * NaN = NaN)
            v = tl.where(n_ok[:, None], v, 0.0)
    else:
        if PAGED:
            slot = (offs_n % PAGE_SIZE).to(tl.int64)
            page = _kv_rows(BT, b, n0, kstart, end, stride_btb, stride_btp, PAGE_SIZE,
                            BLOCK_N, CLIP_START)
            k_off = page * stride_kb + slot * stride_kn
            v_off = page * stride_vb + slot * stride_vn
        else:
            k_off = b * stride_kb + offs_n.to(tl.int64) * stride_kn
            v_off = b * stride_vb + offs_n.to(tl.int64) * stride_vn
        kv_ok = n_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_base + k_off[:, None] + offs_d[None, :] * stride_kd, mask=kv_ok,
                    other=0.0, eviction_policy="evict_first")           # [BN, BD]
        v = tl.load(v_base + v_off[:, None] + offs_d[None, :] * stride_vd, mask=kv_ok,
                    other=0.0, eviction_policy="evict_first")           # [BN, BD]
        if KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)           # [BM, BN]
    if SOFTCAP:
        s = _tanh(s * cap_in)                      # scores cap tanh(scale qk / cap)
    if MASKED:
        s = tl.where(n_ok[None, :], s, float("-inf"))   # keys every row sees, in [kstart, end)
    # ATTENTION2's generated step: m' = max(m, rowmax(s c log2 e)), alpha = 2^(m - m'),
    # P = 2^(s c log2 e - m') (finite pivot), l' = alpha l + rowsum P (c: step_scale)
    m_new, l_i, alpha, p = STEP(m_i, l_i, s, step_scale)                # p: [BM, BN]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    if MASKED and Q_LEN > 1 and (FLUSH or FOLD):
        # fixed splits: the tile's partial keys now, in its split (default mode: once
        # after the loop, see _splitkv_kernel)
        m_new, l_i, acc = _partial_keys(
            q, m_new, l_i, acc, pos, b, tl.maximum(n0, kstart), tl.minimum(n0 + BLOCK_N, end),
            seqlen, k_base, v_base, BT,
            stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_btb,
            stride_btp, win_left, step_scale, cap_in, STEP, Q_LEN, HEAD_DIM, BLOCK_N,
            BLOCK_D, PAGE_SIZE, PAGED, SOFTCAP, WINDOW, KV_FP8, DOT_PRECISION)
    if FLUSH or FOLD:
        done = ((n0 + BLOCK_N - base) % split_size == 0) | (n0 + BLOCK_N >= end)
        if done:
            if FOLD:
                rm, rd, ro = _fold(rm, rd, ro, m_new[:, None], l_i[:, None], acc, COMBINE)
            else:
                ws = ws_row + (n0 - base) // split_size                  # [BM] int64
                raw = acc * v_scale if KV_FP8 else acc
                tl.store(OP + ws[:, None] * HEAD_DIM + offs_d[None, :], raw,
                         mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :])
                tl.store(LSEP + ws, m_new, mask=row_ok)
                tl.store(DP + ws, l_i, mask=row_ok)
        m_new = tl.where(done, float("-inf"), m_new)
        l_i = tl.where(done, 0.0, l_i)
        acc = tl.where(done, 0.0, acc)
    return m_new, l_i, acc, rm, rd, ro


@triton.jit
def _attend(q, pos, b, h, K_DESC, V_DESC, k_base, v_base, BT, OP, LSEP, DP, ws_row, row_ok, base,
            split_size, start, end, seqlen, kstart,
            stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_btb,
            stride_btp, win_left, step_scale, cap_in, v_scale, STEP: tl.constexpr,
            FINALIZE: tl.constexpr,
            COMBINE: tl.constexpr, Q_LEN: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
            PAGED: tl.constexpr, USE_TMA: tl.constexpr, FLUSH: tl.constexpr, FOLD: tl.constexpr,
            SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, HAS_START: tl.constexpr,
            KV_FP8: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Base-2 state ``(m, d, o)`` of the rows ``q`` [BM, BD] over the keys ``[start, end)``
    (``start`` a multiple of BLOCK_N; no key when ``start >= end``); with ``FLUSH`` the
    partial of every fixed split is written on the way, with ``FOLD`` folded into the run
    state ``(rm, rd, ro)``, returned after ``(m, d, o)`` (see :func:`_kv_step`).

    Three runs of tiles: ``[start, lo)`` masked (keys before the first key ``kstart`` or
    left of some row's window), ``[lo, hi)`` unmasked (every key visible to every row: at
    or after ``kstart`` and the last row's window bound, below ``end`` and below the first
    row's causal bound ``seqlen - q_len``), ``[hi, end)`` masked (the sequence end and the
    causal diagonal of speculative rows). A tile's run depends on its position and the
    sequence only, and a masked step on a fully visible tile computes the same values as
    an unmasked one."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)                 # base-2 running max
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    rm = tl.full([BLOCK_M, 1], float("-inf"), tl.float32)               # FOLD's run state
    rd = tl.zeros([BLOCK_M, 1], tl.float32)
    ro = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(end, seqlen - Q_LEN + 1)
    hi = start + tl.maximum(hi - start, 0) // BLOCK_N * BLOCK_N
    lo = start
    if WINDOW or HAS_START:
        # every row sees the keys >= kstart and >= seqlen - 1 - win_left (the last row's
        # window bound); kstart is 0 without a first key
        first = kstart
        if WINDOW:
            first = tl.maximum(first, seqlen - 1 - win_left)
        lo = start + tl.cdiv(tl.maximum(first - start, 0), BLOCK_N) * BLOCK_N
        lo = tl.minimum(lo, hi)
    # the three runs [start, lo) masked, [lo, hi) unmasked and software-pipelined, [hi, end)
    # masked: one static loop, unrolled (the first run exists only with a left bound); the
    # masked runs hold at most q_len + BLOCK_N keys: no pipelining there
    bounds = (start, lo, hi, end)
    for run in tl.static_range(3):
        if run != 0 or WINDOW or HAS_START:
            for n0 in tl.range(bounds[run], bounds[run + 1], BLOCK_N,
                               num_stages=NUM_STAGES if run == 1 else 1):
                m_i, l_i, acc, rm, rd, ro = _kv_step(
                    q, m_i, l_i, acc, rm, rd, ro, n0, pos, b, h, kstart, end, seqlen, K_DESC,
                    V_DESC,
                    k_base, v_base, BT, OP, LSEP, DP, ws_row, row_ok, base, split_size,
                    stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd,
                    stride_btb, stride_btp, win_left, step_scale, cap_in, v_scale, STEP,
                    FINALIZE, COMBINE, Q_LEN, HEAD_DIM, BLOCK_N, BLOCK_D, PAGE_SIZE, PAGED,
                    USE_TMA, run != 1, FLUSH, FOLD, SOFTCAP, WINDOW, HAS_START, KV_FP8,
                    DOT_PRECISION)
    return m_i, l_i, acc, rm, rd, ro


# --- kernels ----------------------------------------------------------------------------

@triton.jit
def _splitkv_kernel(
        Q, K, V, K_DESC, V_DESC, BT, SEQ, START, O, LSE, OP, LSEP, DP, KD, VD,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_btb, stride_btp,
        stride_ob, stride_oh, stride_om, stride_od,
        stride_kdb, stride_kdh, stride_vdb, stride_vdh,
        heads_kv, capacity, n_splits, ws_splits, split_size, win_left,
        step_scale, cap_in,
        STEP: tl.constexpr, FINALIZE: tl.constexpr, COMBINE: tl.constexpr,
        Q_LEN: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, USE_TMA: tl.constexpr,
        FIXED_SPLIT: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
        HAS_START: tl.constexpr, WRITE_FINAL: tl.constexpr, KV_FP8: tl.constexpr,
        NUM_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:       # the merge kernel may be scheduled once every split program has begun
        gdc_launch_dependents()
    ROWS: tl.constexpr = GROUP * Q_LEN
    M_BLOCKS: tl.constexpr = (ROWS + BLOCK_M - 1) // BLOCK_M
    pid = tl.program_id(0)
    m_blk = pid % M_BLOCKS
    bh = pid // M_BLOCKS
    b = (bh // heads_kv).to(tl.int64)
    h = (bh % heads_kv).to(tl.int64)
    # clamped in the lengths' own dtype, then narrowed: an int64 length past int32's
    # range must clamp, not wrap
    seqlen = tl.minimum(tl.maximum(tl.load(SEQ + b), 0), capacity).to(tl.int32)
    if HAS_START:  # the sequence's first key (left padding), clamped to [0, seqlen]
        kstart = tl.minimum(tl.maximum(tl.load(START + b).to(tl.int32), 0), seqlen)
    else:
        kstart = seqlen * 0
    base, size, n_used, first_tile = _split_plan(seqlen, kstart, win_left, n_splits,
                                                 split_size, Q_LEN, BLOCK_N, FIXED_SPLIT)
    v_scale = step_scale * 0.0 + 1.0
    if KV_FP8:
        # the sequence's descales: the keys' folded into the score scale (inside the
        # tanh with a softcap), the values' into the outputs (o is linear in V)
        k_scale = tl.load(KD + b * stride_kdb + h * stride_kdh)
        v_scale = tl.load(VD + b * stride_vdb + h * stride_vdh)
        if SOFTCAP:
            cap_in = cap_in * k_scale
        else:
            step_scale = step_scale * k_scale

    # the group's query rows: row r is query head h * GROUP + r // Q_LEN, token r % Q_LEN
    rows = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)                     # [BM]
    row_ok = rows < ROWS
    qi = rows % Q_LEN
    hq = h * GROUP + rows // Q_LEN                                       # int64 [BM]
    pos = seqlen - Q_LEN + qi                                            # absolute position
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + hq[:, None] * stride_qh + qi[:, None] * stride_qm
                + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)       # [BM, BD]
    if KV_FP8 and Q.dtype.element_ty != tl.float32:
        # E4M3 widens to fp16 exactly, one conversion per two entries (to bf16 it took
        # three instructions per entry through fp32): a 16-bit q becomes fp16 as well,
        # divided by a power of two that keeps its largest entry below 2^16 (exact), which
        # the score scale multiplies back
        # (over the finite entries: a NaN or inf query entry reaches its own row only)
        qa = tl.abs(q.to(tl.float32))
        qmax = tl.max(tl.max(tl.where(qa < float("inf"), qa, 0.0), 1), 0)
        shift = tl.exp2(tl.maximum(tl.ceil(tl.log2(qmax)) - 15.0, 0.0))
        q = (q.to(tl.float32) / shift).to(tl.float16)
        if SOFTCAP:
            cap_in = cap_in * shift
        else:
            step_scale = step_scale * shift
    k_base = K + h * stride_kh
    v_base = V + h * stride_vh
    ws_row = ((b * (heads_kv * GROUP) + hq) * Q_LEN + qi) * ws_splits   # [BM] int64

    # FOLD: one program per sequence in batch-invariant mode folds its fixed splits itself
    FOLD: tl.constexpr = FIXED_SPLIT and WRITE_FINAL
    if WRITE_FINAL:                                # the whole sequence, no merge
        start = base
        end = seqlen
    elif FIXED_SPLIT:
        # this program's run of whole fixed splits; each is flushed as it ends, so how the
        # runs are cut (from the batch, through the grid) never changes a split's bits
        per = tl.cdiv(n_used, n_splits)
        start = base + tl.program_id(1) * per * size
        end = tl.minimum(start + per * size, seqlen)
    else:
        start = base + tl.program_id(1) * size
        end = tl.minimum(start + size, seqlen)
    if FIXED_SPLIT:
        # split 0 starts at a multiple of the split size: its tiles before the first one
        # with a visible key would fold to the identity; they are skipped (never read)
        start = tl.maximum(start, first_tile)
    m_i, l_i, acc, rm, rd, ro = _attend(
        q, pos, b, h, K_DESC, V_DESC, k_base, v_base, BT, OP, LSEP, DP, ws_row, row_ok, base,
        size, start, end, seqlen, kstart, stride_kb, stride_kn, stride_kd, stride_vb,
        stride_vn, stride_vd, stride_btb, stride_btp, win_left, step_scale, cap_in, v_scale,
        STEP, FINALIZE, COMBINE, Q_LEN, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, PAGE_SIZE, PAGED,
        USE_TMA, FIXED_SPLIT and not WRITE_FINAL, FOLD, SOFTCAP, WINDOW, HAS_START, KV_FP8,
        NUM_STAGES, DOT_PRECISION)
    if Q_LEN > 1 and not FIXED_SPLIT:
        # the partial keys of the program's range, which its masked tiles left out (a
        # program is one split here: they may come last)
        m_i, l_i, acc = _partial_keys(
            q, m_i, l_i, acc, pos, b, tl.maximum(start, kstart), end, seqlen, k_base, v_base,
            BT, stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_btb,
            stride_btp, win_left, step_scale, cap_in, STEP, Q_LEN, HEAD_DIM, BLOCK_N,
            BLOCK_D, PAGE_SIZE, PAGED, SOFTCAP, WINDOW, KV_FP8, DOT_PRECISION)
    if WRITE_FINAL or not FIXED_SPLIT:
        # the monoid's finalize in natural-log units: (o / d, m + log d); (0, -inf) if empty
        if FOLD:
            out, lse = _finalize(rm, rd, ro, FINALIZE)
        else:
            out, lse = _finalize(m_i[:, None] * 0.6931471805599453, l_i[:, None], acc, FINALIZE)
        if KV_FP8:
            out = out * v_scale
        if WRITE_FINAL:
            tl.store(O + b * stride_ob + hq[:, None] * stride_oh + qi[:, None] * stride_om
                     + offs_d[None, :] * stride_od, out.to(O.dtype.element_ty),
                     mask=row_ok[:, None] & d_ok[None, :])
            tl.store(LSE + (b * (heads_kv * GROUP) + hq[:, None]) * Q_LEN + qi[:, None], lse,
                     mask=row_ok[:, None])
        elif tl.program_id(1) < n_used:            # programs past the last split write nothing
            # (a branch, not a scalar folded into the masks: the interpreter would splat it to
            # int32 data, which Triton 3.9's rejects as a mask)
            ws = ws_row + tl.program_id(1)
            tl.store(OP + ws[:, None] * HEAD_DIM + offs_d[None, :], out,
                     mask=row_ok[:, None] & d_ok[None, :])
            tl.store(LSEP + ws[:, None], lse, mask=row_ok[:, None])


@triton.jit
def _merge_kernel(
        OP, LSEP, DP, SEQ, START, O, LSE,
        stride_ob, stride_oh, stride_om, stride_od,
        heads_q, capacity, n_splits, ws_splits, split_size, win_left,
        BLOCK_LIFT: tl.constexpr, COMBINE: tl.constexpr,
        FINALIZE: tl.constexpr, Q_LEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, FIXED_SPLIT: tl.constexpr,
        HAS_START: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)                 # (b, hq, qi) row-major
    qi = row % Q_LEN
    hq = (row // Q_LEN) % heads_q
    b = row // (Q_LEN * heads_q)
    seqlen = tl.minimum(tl.maximum(tl.load(SEQ + b), 0), capacity).to(tl.int32)
    if HAS_START:
        kstart = tl.minimum(tl.maximum(tl.load(START + b).to(tl.int32), 0), seqlen)
    else:
        kstart = seqlen * 0
    _, _, n_used, _ = _split_plan(seqlen, kstart, win_left, n_splits, split_size, Q_LEN,
                                  BLOCK_N, FIXED_SPLIT)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    if USE_PDL:       # launched early: wait until the split kernel's partials are visible
        gdc_wait()
    m = tl.full([1], float("-inf"), tl.float32)          # the identity (-inf, 0, 0)
    d = tl.zeros([1], tl.float32)
    o = tl.zeros([BLOCK_D], tl.float32)
    if FIXED_SPLIT:
        # raw split states one at a time, left to right: the fold a FOLD program runs. A
        # group of partials is loaded before its combines (one load per step waited on L2
        # every step: 1 x 131K's 64 partials took ~4 us more than the tiled merge, H200);
        # a slot past the sequence's last split loads as the identity, which every
        # combine passes through exactly
        for s0 in tl.range(0, n_used, INVARIANT_MERGE_GROUP):
            ws = row * ws_splits + s0
            parts = ()
            for j in tl.static_range(INVARIANT_MERGE_GROUP):        # the loads, all in flight
                parts = parts + (_raw_partial(LSEP, DP, OP, ws + j, s0 + j, n_used, offs_d,
                                              d_ok, HEAD_DIM),)
            for j in tl.static_range(INVARIANT_MERGE_GROUP):        # then the combines
                m, d, o = _fold(m, d, o, parts[j][0], parts[j][1], parts[j][2], COMBINE)
    else:
        for s0 in tl.range(0, n_used, BLOCK_S, num_stages=2):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            s_ok = offs_s < n_used
            ws = row * ws_splits + offs_s                                # [BS]
            lse_s = tl.load(LSEP + ws, mask=s_ok, other=float("-inf"))
            o_s = tl.load(OP + ws[:, None] * HEAD_DIM + offs_d[None, :],
                          mask=s_ok[:, None] & d_ok[None, :], other=0.0)   # [BS, BD]
            # the tile's state at once: split s is a virtual key with score lse_s, value o_s
            t_m, t_d, t_o = BLOCK_LIFT(lse_s[:, None], o_s, s_ok[:, None])  # [1], [1], [BD]
            m, d, o = COMBINE(m, d, o, t_m, t_d, t_o)                    # left to right
    out, lse = _finalize(m, d, o, FINALIZE)                              # [BD], [1]
    tl.store(O + b * stride_ob + hq * stride_oh + qi * stride_om + offs_d * stride_od,
             out.to(O.dtype.element_ty), mask=d_ok)
    tl.store(LSE + row + tl.arange(0, 1), lse)


# --- launcher ---------------------------------------------------------------------------

@dataclass(frozen=True)
class DecodeConfig:
    """Tile configuration of the split kernel (never chosen from the batch: bitwise
    invariance needs the same tiles, warps and reductions whatever the batch; the default
    mode deepens the ring of long rows, :data:`LONG_STAGES`, which changes no bit)."""
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    block_m_max: int = 64


def default_config(head_dim: int, dtype: torch.dtype, page_size: int | None) -> DecodeConfig:
    """The split kernel's tiles for a head dim / dtype / page size.

    Paged caches take two more pipeline stages: the page-number read occupies a stage
    before the K/V loads, and 5 stages are what keeps two K/V tiles buffered (checked on
    the sm_90 compile: the main loop waits with two tiles' copies in flight)."""
    extra = 2 if page_size is not None else 0
    if dtype == torch.float32:      # exact fp32 dots (no TF32) run on FMA units: small tiles
        return DecodeConfig(block_n=16, num_warps=8, num_stages=2 + extra)
    if head_dim > 128:
        return DecodeConfig(block_n=32, num_warps=4, num_stages=3 + extra)
    return DecodeConfig(num_stages=3 + extra)


def _exact_ops(batch_invariant: bool) -> dict:
    """Compile options of the batch-invariant kernels: no FP contraction (``mul`` + ``add``
    into ``fma``), neither by LLVM nor by ptxas. The merge kernel and a FOLD program run the
    same combines on the same values; with contraction the compiler chose per kernel, by
    context, which products to fuse, and they differed (unrolling the merge loop changed
    its bits; ``docs/notes/decode.md``, "batch_invariant"). Without it every operation
    rounds as written."""
    return {"enable_fp_fusion": False} if batch_invariant else {}


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << max(0, int(n) - 1).bit_length())


@functools.lru_cache(maxsize=4096)
def choose_num_splits(programs: int, kv_len: int, num_sms: int, ctas_per_sm: int = CTAS_PER_SM,
                      saturating_per_sm: float = SATURATING_PER_SM, min_split: int = MIN_SPLIT,
                      max_splits: int = MAX_SPLITS) -> int:
    """Number of splits for ``programs`` (batch x heads_kv x row blocks) over ``kv_len`` keys.

    A bandwidth model: ``slots = num_sms * ctas_per_sm`` programs run at once, and
    ``sat = num_sms * saturating_per_sm`` of them already saturate DRAM. With ``s`` splits
    there are ``n = programs * s`` programs of ``kv_len / s`` keys each, run in waves of at
    most ``slots``; a wave of ``c`` programs takes ``max(1, c / sat)`` program-times (fewer
    than ``sat`` programs cannot use all the bandwidth, more share it). Efficiency is the
    ideal time ``n / sat`` program-times over the modelled one; take the fewest splits
    (fewest partials to merge) within 90% of ideal, else the best, among
    ``1 .. min(max_splits, ceil(kv_len / min_split))``.
    """
    limit = max(1, min(max_splits, -(-max(kv_len, 1) // min_split)))
    slots = max(1, num_sms * ctas_per_sm)
    sat = max(1.0, num_sms * saturating_per_sm)
    best, best_eff = 1, -1.0
    for s in range(1, limit + 1):
        n = programs * s
        full, rest = divmod(n, slots)
        waves = full * max(1.0, slots / sat) + (max(1.0, rest / sat) if rest else 0.0)
        eff = (n / sat) / waves              # ideal / modelled, in program-times
        if eff >= 0.9:
            return s
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best


def saturating_per_sm(kv_itemsize: int) -> float:
    """Split programs per SM that saturate DRAM for a cache of ``kv_itemsize``-byte
    entries: :data:`SATURATING_PER_SM` for 16-bit (and fp32) caches; for narrower ones
    scaled by the bytes a tile holds, at most :data:`CTAS_PER_SM`. A program's loop takes
    about as long per tile whatever the entries' width (an E4M3 tile, widened as it is
    loaded, ran at the bf16 tile's time per tile on the H200), so a cache of 1-byte
    entries streams half the bytes per program. With 3 per SM E4M3 decode ran at
    1.66-2.07x the bf16 decode on an H100, 77-102% of the copy rate (docs/notes/fp8.md,
    "The split plan of an E4M3 cache")."""
    if kv_itemsize >= 2:
        return SATURATING_PER_SM
    return min(float(CTAS_PER_SM), SATURATING_PER_SM * 2 / kv_itemsize)


@functools.cache
def _attention_fns():
    """ATTENTION's generated Triton functions (generated once per process)."""
    return triton_monoid(ATTENTION)


@functools.cache
def _step_fns():
    """ATTENTION2's generated tile step (:func:`~flashfold.kernels.codegen.tile_step_functions`),
    the scores passed as ``x * step_scale``."""
    return tile_step_functions(ATTENTION2, scale="score")


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return launcher.sm_count(device)
    return 132                                   # the interpreter: plan as for an H100/H200


def _hopper(device: torch.device) -> bool:
    return device.type == "cuda" and launcher.capability(device)[0] >= 9


def _pdl_default(device: torch.device) -> bool:
    """Programmatic dependent launch of the merge: CUDA, Hopper or newer, not disabled by
    ``FLASHFOLD_DECODE_PDL=0``."""
    return (device.type == "cuda" and gdc_wait is not None
            and launcher.env("FLASHFOLD_DECODE_PDL") != "0" and _hopper(device))


def _tma_default(device: torch.device) -> bool:
    """K/V through TMA descriptors by default on Hopper or newer (``FLASHFOLD_DECODE_TMA=0``:
    the cp.async pointers) for caches of at least :data:`TMA_MIN_BYTES`. Same values bit
    for bit; on the H200 TMA read 0.99-1.03x the pointers' GB/s on every row of a 40-row
    sample of the grid (CUDA graphs; contiguous and paged 64, default and
    batch-invariant), +0.4-0.7% on the target rows and +2-3% at 64 x 8K-32K
    (``docs/notes/decode.md``, "Tiles and the load path")."""
    return (device.type == "cuda" and TensorDescriptor is not None
            and launcher.env("FLASHFOLD_DECODE_TMA") != "0" and _hopper(device))


def _tma_eligible(k: torch.Tensor, v: torch.Tensor, page_size: int | None, block_n: int) -> bool:
    """Whether TMA boxes can read the cache: unit last stride, 16-byte aligned base and
    strides (of dims longer than 1), dims nested in row-major order (any other layout, e.g.
    a (batch, seq, heads, dim) tensor viewed as (batch, heads, seq, dim), reads through
    pointers), and for pages, a key tile inside one page."""
    if TensorDescriptor is None or (page_size is not None and page_size % block_n):
        return False
    for t in (k, v):
        if not tma.addressable(t) or (t.shape[-1] * t.element_size()) % 16:
            return False
        dims = [(st, n) for st, n in zip(t.stride(), t.shape) if n > 1]
        if any(outer < inner * n for (outer, _), (inner, n) in zip(dims, dims[1:])):
            return False
    return True


def _descriptor(t: torch.Tensor, box: list[int]):
    """A 4-D TMA descriptor over ``t`` loading ``box``-shaped blocks (the stride of a
    size-1 dim is irrelevant: replaced by an aligned value)."""
    return TensorDescriptor(t, list(t.shape), tma.box_strides(t), box)


@dataclass(frozen=True)
class SplitPlan:
    """What the launcher decided: programs per sequence along the split axis of the grid
    (``n_splits``), partial states reserved per row (``ws_splits``), the fixed split size
    (0: derived per sequence from ``n_splits``), and whether the split kernel writes the
    output itself (one program per sequence: no merge pass; with fixed splits it folds
    them in registers)."""
    n_splits: int
    ws_splits: int
    split_size: int
    write_final: bool
    block_m: int
    m_blocks: int
    num_stages: int = 0                 # the split kernel's ring depth (0: the config's)


def plan(q_shape, heads_kv: int, capacity: int, kv_bound: int, window_left: int | None,
         device: torch.device, config: DecodeConfig, *, num_splits: int | None = None,
         batch_invariant: bool = False, invariant_split: int = INVARIANT_SPLIT,
         paged: bool = False, kv_itemsize: int = 2) -> SplitPlan:
    """Host-side split plan from shapes, the cache capacity and a host bound on the lengths
    (``kv_bound``, a performance hint only); reads nothing on the device. Default mode:
    one program per SM for long sequences (:func:`_one_per_sm`), else the occupancy
    heuristic :func:`choose_num_splits` with the DRAM saturation of the cache's entry
    width (``kv_itemsize`` bytes, :func:`saturating_per_sm`); ``paged``: the cache is
    paged."""
    sat = saturating_per_sm(kv_itemsize)
    batch, heads_q, q_len, _ = q_shape
    rows = (heads_q // heads_kv) * q_len
    block_m = min(_pow2(rows), _pow2(config.block_m_max))
    m_blocks = -(-rows // block_m)
    span = kv_bound if window_left is None else min(kv_bound, window_left + q_len)
    if batch_invariant:
        if invariant_split % config.block_n:
            raise ValueError(f"invariant split {invariant_split} is not a multiple of "
                             f"BLOCK_N={config.block_n}")
        ws = invariant_slots(capacity, invariant_split)   # every length <= capacity fits
        size = invariant_size(span, invariant_split, config.block_n)  # the longest's splits
        used = min(ws, max(1, -(-span // size) + (window_left is not None)))
        # programs fold runs of whole splits: from the occupancy heuristic's count, the
        # run length rounds down and the program count up, so that the runs are even
        # (64 splits over 30 programs would leave runs of 3 on 22 programs, the critical
        # path 41% above an even cut; 32 programs take runs of 2)
        target = choose_num_splits(batch * heads_kv * m_blocks, span, _num_sms(device),
                                   saturating_per_sm=sat)
        n = min(used, -(-used // max(1, used // target)))
        # one program per sequence: it folds its splits itself (FOLD), no partials, no merge
        return SplitPlan(n, ws, invariant_split, n == 1, block_m, m_blocks)
    stages = 0
    if num_splits is None:
        programs, sms = batch * heads_kv * m_blocks, _num_sms(device)
        num_splits = _one_per_sm(programs, span, sms, q_shape[3], block_m, config, paged,
                                 device, kv_itemsize)
        if num_splits:
            stages = LONG_STAGES
        else:
            num_splits = choose_num_splits(programs, span, sms, saturating_per_sm=sat)
    n = int(num_splits)
    return SplitPlan(n, n, 0, n == 1, block_m, m_blocks, stages)


def _one_per_sm(programs: int, span: int, num_sms: int, head_dim: int, block_m: int,
                config: DecodeConfig, paged: bool, device: torch.device,
                kv_itemsize: int = 2) -> int:
    """Splits that make one split program per SM for a long sequence (see :data:`LONG_KV`),
    or 0 where that does not apply: another GPU than the one measured (an sm_90 H100/H200;
    the interpreter plans as for one), a paged cache or another configuration than the
    measured one (contiguous, head_dim 128, a 16-bit cache and query with the default
    tiles, fewer than 64 query rows per program: 4 warps; an E4M3 cache's program reads
    half the bytes per tile, and one per SM leaves DRAM idle), a bound under LONG_KV, or
    rows whose programs cannot fill 90% of the SMs one each. (The deeper ring needs 128 KB
    of shared memory: more than GPUs with ~100 KB per block have.)"""
    if device.type == "cuda" and launcher.capability(device) != (9, 0):
        return 0
    if (paged or head_dim != 128 or block_m >= 64 or config != DecodeConfig()
            or kv_itemsize != 2 or span < LONG_KV):
        return 0
    n = num_sms // max(1, programs)
    return n if n * programs >= 0.9 * num_sms else 0        # n = 0 fails this too


def invariant_size(keys: int, invariant_split: int = INVARIANT_SPLIT, block_n: int = 16) -> int:
    """Batch-invariant split size of a sequence with ``keys`` keys from its first visible
    one: ``invariant_split`` doubled until they fit in INVARIANT_MAX_SPLITS splits, or
    halved (down to ``invariant_split / INVARIANT_MIN_SPLITS``, a multiple of ``block_n``)
    until they span INVARIANT_MIN_SPLITS splits (the host's mirror of :func:`_split_plan`)."""
    size, most, least = invariant_split, INVARIANT_MAX_SPLITS.value, INVARIANT_MIN_SPLITS.value
    while size * most < keys:
        size *= 2
    while (size * least > keys and size * least >= 2 * invariant_split
           and (size // 2) % block_n == 0):
        size //= 2
    return size


def invariant_slots(capacity: int, invariant_split: int = INVARIANT_SPLIT) -> int:
    """Partials reserved per row in batch-invariant mode: the most splits any sequence of at
    most ``capacity`` keys can use. Splits of ``invariant_split`` keys or more number at
    most ``ceil(capacity / invariant_split)`` (they start at ``floor(lo / c) c >= 0``); a
    halved split ``c`` serves fewer than ``2 INVARIANT_MIN_SPLITS c`` keys, so at most
    ``2 INVARIANT_MIN_SPLITS + 1`` splits counting a misaligned first one."""
    least = INVARIANT_MIN_SPLITS.value
    short = min(-(-capacity // max(1, invariant_split // least)), 2 * least + 1)
    return max(1, -(-capacity // invariant_split), short)


@dataclass
class Launch:
    """Both kernel launches of one decode call, prepared but not run: ``(grid, args, kwargs)``
    of the split kernel and of the merge kernel (``None`` with a single split), the output
    tensors they write, and the plan. :func:`splitkv_decode` runs it (and replays it from
    the plan cache); tests compile it ahead of time for a GPU target. ``memos``: the
    launcher's memos of the two launches (:func:`flashfold.kernels.launcher.launch`),
    shared by the replays of a cached plan."""
    split: tuple
    merge: tuple | None
    out: torch.Tensor
    lse: torch.Tensor
    plan: SplitPlan
    memos: tuple = field(default_factory=lambda: ([None], [None]), repr=False, compare=False)

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        with launcher.on_device(self.out.device):
            grid, args, kwargs = self.split
            launcher.launch(_splitkv_kernel, grid, args, kwargs, self.memos[0])
            if self.merge is not None:
                grid, args, kwargs = self.merge
                launcher.launch(_merge_kernel, grid, args, kwargs, self.memos[1])
        return self.out, self.lse


def prepare(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None, *,
            scale: float, softcap: float | None = None,
            window: tuple[int | None, int | None] | None = None,
            num_splits: int | None = None, batch_invariant: bool = False,
            max_seqlen: int | None = None, cache_start: torch.Tensor | None = None,
            config: DecodeConfig | None = None, invariant_split: int = INVARIANT_SPLIT,
            pdl: bool | None = None, tma: bool | None = None, k_descale=None,
            v_descale=None) -> Launch:
    """Plan the splits, allocate the outputs and workspace, and bind the kernel arguments
    (arguments as :func:`splitkv_decode`)."""
    batch, heads_q, q_len, head_dim = q.shape
    paged = block_table is not None
    if paged:
        page_size, heads_kv = k_cache.shape[1], k_cache.shape[2]
        capacity = block_table.shape[1] * page_size
        # (page, slot, head, dim) -> (b-or-page, head, token, dim) strides
        sk = (k_cache.stride(0), k_cache.stride(2), k_cache.stride(1), k_cache.stride(3))
        sv = (v_cache.stride(0), v_cache.stride(2), v_cache.stride(1), v_cache.stride(3))
        sbt = (block_table.stride(0), block_table.stride(1))
    else:
        page_size, heads_kv, capacity = 1, k_cache.shape[1], k_cache.shape[2]
        sk, sv, sbt = k_cache.stride(), v_cache.stride(), (0, 0)
    group = heads_q // heads_kv
    config = config or default_config(head_dim, q.dtype, page_size if paged else None)
    left = None if window is None else window[0]      # the right side is causal: 0
    bound = capacity if max_seqlen is None else max(0, min(int(max_seqlen), capacity))
    p = plan(q.shape, heads_kv, capacity, bound, left, q.device, config, num_splits=num_splits,
             batch_invariant=batch_invariant, invariant_split=invariant_split, paged=paged,
             kv_itemsize=k_cache.element_size())
    stages = p.num_stages or config.num_stages
    tm = _attention_fns()
    block_d = _pow2(head_dim)
    # outputs and workspace through plans.new: noted while splitkv_decode records a plan
    out = plans.new(q.shape, q.dtype, q.device)
    lse = plans.new((batch, heads_q, q_len), torch.float32, q.device)
    # partials: default mode (o, lse) finalized; batch-invariant (o, m, d) raw, m in base 2
    op = lsep = dp = lse                              # unused with one program per sequence
    if not p.write_final:
        rows = batch * heads_q * q_len * p.ws_splits
        op = plans.new(rows * head_dim, torch.float32, q.device)
        lsep = plans.new(rows, torch.float32, q.device)
        if batch_invariant:
            dp = plans.new(rows, torch.float32, q.device)
    win_left = NO_WINDOW if left is None else int(left)
    pdl = _pdl_default(q.device) if pdl is None else bool(pdl)
    page_arg = page_size if paged else None
    if tma is None:             # 16-bit caches (an fp32 tile through TMA spills registers)
        use_tma = (_tma_default(q.device) and q.dtype != torch.float32
                   and 2 * k_cache.numel() * k_cache.element_size() >= TMA_MIN_BYTES
                   and _tma_eligible(k_cache, v_cache, page_arg, config.block_n))
    elif tma:
        if not _tma_eligible(k_cache, v_cache, page_arg, config.block_n):
            raise ValueError("tma=True: the cache cannot be read through TMA descriptors (unit "
                             "last stride, 16-byte aligned base and strides, pages a multiple "
                             f"of BLOCK_N={config.block_n})")
        use_tma = True
    else:
        use_tma = False
    if use_tma:
        box = [1, config.block_n, 1, block_d] if paged else [1, 1, config.block_n, block_d]
        k_desc, v_desc = _descriptor(k_cache, box), _descriptor(v_cache, box)
    else:
        k_desc, v_desc = k_cache, v_cache
    # scores x c for the step (:func:`_kv_step`): (tanh(qk scale / cap), cap) or (qk, scale)
    step_scale, cap_in = (softcap, scale / softcap) if softcap else (scale, 0.0)
    fp8 = k_descale is not None
    descales = (k_descale, v_descale) if fp8 else (cache_seqlens, cache_seqlens)
    descale_strides = (*k_descale.stride(), *v_descale.stride()) if fp8 else (0, 0, 0, 0)
    split = ((batch * heads_kv * p.m_blocks, p.n_splits),
             (q, k_cache, v_cache, k_desc, v_desc, block_table if paged else cache_seqlens,
              cache_seqlens, cache_seqlens if cache_start is None else cache_start,
              out, lse, op, lsep, dp, *descales,
              *q.stride(), *sk, *sv, *sbt, *out.stride(), *descale_strides,
              heads_kv, capacity, p.n_splits, p.ws_splits, p.split_size, win_left,
              step_scale, cap_in),
             dict(STEP=_step_fns().tile_step, FINALIZE=tm.finalize, COMBINE=tm.combine,
                  Q_LEN=q_len, GROUP=group, HEAD_DIM=head_dim,
                  BLOCK_M=p.block_m, BLOCK_N=config.block_n, BLOCK_D=block_d,
                  PAGE_SIZE=page_size, PAGED=paged, USE_TMA=use_tma,
                  FIXED_SPLIT=batch_invariant,
                  SOFTCAP=bool(softcap), WINDOW=left is not None,
                  HAS_START=cache_start is not None, WRITE_FINAL=p.write_final,
                  KV_FP8=fp8, NUM_STAGES=stages,
                  USE_PDL=pdl and not p.write_final,
                  DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                  **_exact_ops(batch_invariant),
                  num_warps=config.num_warps * (2 if p.block_m >= 64 else 1),
                  num_stages=stages))
    merge = None
    if not p.write_final:
        merge = ((batch * heads_q * q_len,),
                 (op, lsep, dp, cache_seqlens,
                  cache_seqlens if cache_start is None else cache_start, out, lse, *out.stride(),
                  heads_q, capacity, p.n_splits, p.ws_splits, p.split_size, win_left),
                 dict(BLOCK_LIFT=tm.block_lift, COMBINE=tm.combine,
                      FINALIZE=tm.finalize,
                      Q_LEN=q_len, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=MERGE_BLOCK,
                      BLOCK_N=config.block_n, FIXED_SPLIT=batch_invariant,
                      HAS_START=cache_start is not None, USE_PDL=pdl,
                      num_warps=MERGE_WARPS, num_stages=2, **_exact_ops(batch_invariant),
                      **({"launch_pdl": True} if pdl else {})))
    return Launch(split, merge, out, lse, p)


def splitkv_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None, *,
                   scale: float, softcap: float | None = None,
                   window: tuple[int | None, int | None] | None = None,
                   num_splits: int | None = None, batch_invariant: bool = False,
                   max_seqlen: int | None = None, cache_start: torch.Tensor | None = None,
                   config: DecodeConfig | None = None, invariant_split: int = INVARIANT_SPLIT,
                   pdl: bool | None = None, tma: bool | None = None,
                   k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
                   check=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV decode on CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``).

    Inputs as :func:`flashfold.decode`, already validated; ``window`` normalized to
    ``(left, right)`` with ``None`` for unbounded; ``cache_start`` ``None`` or ``(batch,)``
    int32 on the device (each sequence's first key, clamped there to ``[0, n_b]``).
    ``config`` and ``invariant_split`` override the tiles and the batch-invariant split
    size, ``pdl`` the programmatic dependent launch of the merge (default: on for CUDA
    sm_90+ unless ``FLASHFOLD_DECODE_PDL=0``), ``tma`` the K/V loads through TMA
    descriptors (default: on Hopper for caches TMA can address of at least
    :data:`TMA_MIN_BYTES`, unless ``FLASHFOLD_DECODE_TMA=0``; both paths give the same
    values) -- benchmarks and tests. ``k_descale``, ``v_descale``: float32 ``(batch,
    heads_kv)`` with an E4M3 cache (``torch.float8_e4m3fn``; a key is ``k_descale[b, h]``
    times its stored value, a value likewise), else None. ``check``: the caller's checks
    of the tensors (the public API's), called as ``check(q, k_cache, v_cache,
    cache_seqlens, block_table, cache_start, k_descale, v_descale)`` before a plan is built; a call that replays a cached plan does not
    call it again, so it may read no more of them than their signatures (see "Plan
    cache"). Returns ``(o, lse)``: ``o`` (batch, heads_q, q_len, head_dim) in
    ``q.dtype``, ``lse`` (batch, heads_q, q_len) float32; new tensors on every call.
    """
    sig = plans.signature
    # what prepare reads: the tensors' signatures, the options, the PDL / TMA switches
    key = (sig(q), sig(k_cache), sig(v_cache), sig(cache_seqlens),
           None if block_table is None else sig(block_table),
           None if cache_start is None else sig(cache_start),
           None if k_descale is None else sig(k_descale),
           None if v_descale is None else sig(v_descale), scale, softcap, window,
           num_splits, batch_invariant, max_seqlen, config, invariant_split, pdl, tma,
           launcher.env("FLASHFOLD_DECODE_PDL"), launcher.env("FLASHFOLD_DECODE_TMA"), check)
    inputs = (q, k_cache, v_cache, cache_seqlens, block_table, cache_start, k_descale,
              v_descale)
    return _CACHE.planned(key, None, inputs, _checked_prepare, check, *inputs, scale=scale,
                          softcap=softcap, window=window, num_splits=num_splits,
                          batch_invariant=batch_invariant, max_seqlen=max_seqlen,
                          config=config, invariant_split=invariant_split, pdl=pdl,
                          tma=tma).run()


def _checked_prepare(check, q, k_cache, v_cache, cache_seqlens, block_table, cache_start,
                     k_descale, v_descale, **options) -> Launch:
    """``check`` the tensors (if given), then :func:`prepare` the launches."""
    if check is not None:
        check(q, k_cache, v_cache, cache_seqlens, block_table, cache_start, k_descale,
              v_descale)
    return prepare(q, k_cache, v_cache, cache_seqlens, block_table, cache_start=cache_start,
                   k_descale=k_descale, v_descale=v_descale, **options)


# --- plan cache -------------------------------------------------------------------------

#: entries the plan cache holds; when full it is dropped wholesale
PLAN_CACHE_SIZE = 1024
#: :func:`splitkv_decode`'s plans (:mod:`flashfold.kernels.plans`), bypassed while any
#: global that :func:`prepare` reads (heuristics, constants, which tests monkeypatch)
#: differs from what it was at import
_CACHE = plans.PlanCache("decode", globals(), (_checked_prepare,))


def plan_cache_info() -> dict:
    """Hits and misses of the decode plan cache since it was last cleared, and its entries."""
    return _CACHE.info()


def plan_cache_clear():
    """Drop every cached decode plan and zero the counters."""
    _CACHE.clear()
