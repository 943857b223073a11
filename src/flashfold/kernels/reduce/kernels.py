"""Kernel templates: one ``@triton.jit`` template per schedule, every monoid.

Each template takes a monoid's generated functions (:mod:`.generated`) as
``tl.constexpr`` arguments and calls them; states are tuples unpacked at compile time
(``COMBINE(*acc, *s)``). Variants are constexpr flags, never copies.

Geometry shared by all templates
--------------------------------
The reduced (or scanned) dim has ``N`` elements at input stride ``sn``. Every other dim
is a batch dim; after merging adjacent batch dims whose strides allow it, at most three
remain, ``(B0, B1, B2)`` with input strides ``(s0, s1, s2)`` and output strides
``(o0, o1, o2)``. A monoid of several data inputs reads them all through that one
geometry (decided on their broadcast shape): ``src``, ``sn``, ``s0``, ``s1`` and ``s2``
are tuples with one entry per input (a broadcast input has stride 0 where it repeats),
and the loads (:func:`_offsets`, :func:`_load`) give a tuple of tiles, one per input,
which the generated ``lift_xp`` / ``tile_state`` take as ``(*xs, pos)``; a monoid of one
input passes tuples of one, which compile to the kernels of scalar arguments. A program
owns ``ROWS`` consecutive indices of ``B2`` (``b2`` varies
fastest, so rows that are contiguous in memory load as one vector) at one ``(b0, b1)``,
and, for split-K / segments / multi-block scans, one *split* ``j`` of the reduced dim::

    pid = ((b0 * B1 + b1) * n_inner + b2_block) * n_split + j

A reduce tile is ``[K, LANES, ROWS]``: element ``n = t·K·LANES + k·LANES + l`` of the row
sits at ``[k, l, row]``. The block lift reduces axis 0 inside each thread (the ``K``
elements of a lane are separate registers of one thread, loaded as ``LANES``-wide
contiguous vectors), the ``LANES`` accumulators are combined elementwise with the
running state, and one ``reduce_tile`` over the lanes ends the row, so the loop body
has no cross-thread communication at all. For a monoid that is not commutative
(``ORDERED``) each lane holds ``K`` *consecutive* elements (``VFOLD``: one 16-byte
vector of a contiguous row, folded in order in the thread's registers; else ``K = 1``),
the lanes of each tile are reduced in order by a scan (``tl.associative_scan`` keeps
operand order; ``tl.reduce`` does not), and tiles are combined left to right.

A scan tile is ``[BLOCK, ROWS]``, scanned along axis 0, with the running state of each
row carried across tiles: ``out = carry ⊕ scan(tile)``. A reverse scan loads the tile
in reversed element order and scans with the swapped combine ``(a, b) -> b ⊕ a``, so
``out_i = x_i ⊕ (x_{i+1} ⊕ ...)`` keeps operand order without
``associative_scan(reverse=True)``. Forward scans of long contiguous rows use the
*chunked* tile instead (:func:`_chunk_scan_step`: each thread owns four consecutive
vectors, ~2.75 combines per element). Few long rows scan in one pass with a decoupled
look-back (:func:`lookback_scan_kernel`); reverse ones reduce-then-scan (``SPLIT``).

Row maps (softmax): ``y = fmap(x, *prep(state))`` with the row state from the reduce
machinery (:func:`normalize_kernel`).

Loops over runtime bounds are ``while`` loops (the interpreter cannot take a runtime
``range`` bound under NumPy >= 2.3) and never use ``+=`` on tensors (the interpreter
updates in place, so an alias such as ``start = lo`` would move ``lo`` too).

Offsets: row bases are int64; offsets along the reduced dim are int32 unless ``N64``
(set by the launcher when ``N·|sn|`` can pass 2^31).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _program_rows(pid, n_split, n_inner, B1, B2, s0, s1, s2, o0, o1, o2, ROWS: tl.constexpr):
    """Decompose the program id ``pid``: (split j, row mask [ROWS], input row bases (a
    tuple, one per input) and output row bases (int64), flat row index [ROWS] of
    ``(b0, b1, b2)`` in ``B0·B1·B2``). The row index
    ``b2`` is int64: ``B2`` itself may pass 2^31 (a ``(2^31, 2)`` input reduced over dim 1)."""
    split = pid % n_split
    rest = pid // n_split
    ib = rest % n_inner
    outer = rest // n_inner
    b1 = outer % B1
    b0 = outer // B1
    r64 = ib.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = r64 < B2
    row_in = _row_bases(b0, b1, r64, s0, s1, s2)
    row_out = b0.to(tl.int64) * o0 + b1.to(tl.int64) * o1 + r64 * o2
    flat = outer.to(tl.int64) * B2 + r64
    return split, row_ok, row_in, row_out, flat


@triton.jit
def _chunk_bounds(split, chunk, N, N64: tl.constexpr):
    """``[lo, hi) = [j·chunk, min((j+1)·chunk, N))`` of chunk ``j = split`` (an int32
    program or ticket index). ``hi`` is formed as ``lo + min(chunk, N - lo)``, never as
    ``lo + chunk``: the last chunk's end ``n_split·chunk`` can pass 2^31 when ``N`` does
    not, and an int32 ``lo + chunk`` would wrap. With N64 ``lo`` is int64 (``j·chunk``
    itself can pass 2^31)."""
    if N64:
        lo = split.to(tl.int64) * chunk
    else:
        lo = split * chunk
    hi = lo + tl.minimum(chunk, N - lo)
    return lo, hi


@triton.jit
def _row_mask(row_ok, n, hi):
    """``row_ok & (n < hi)`` for a scalar position ``n``, compared as a [ROWS] block.
    (A scalar bool broadcast against a block holds int32 data under the interpreter,
    which Triton 3.9's interpreter refuses as a load or store mask; a block comparison
    is a bool block on every version, and compiles to the same splat and compare.)"""
    return row_ok & ((n + tl.zeros(row_ok.shape, tl.int32)) < hi)


@triton.jit
def _row_bases(b0, b1, r, s0, s1, s2):
    """Row base offsets (int64) of every input, ``b0·s0[i] + b1·s1[i] + r·s2[i]`` (a
    tuple, one per input; ``r`` int64)."""
    bases = (b0.to(tl.int64) * s0[0] + b1.to(tl.int64) * s1[0] + r * s2[0],)
    for i in tl.static_range(1, len(s0)):
        bases = bases + (b0.to(tl.int64) * s0[i] + b1.to(tl.int64) * s1[i] + r * s2[i],)
    return bases


@triton.jit
def _lead(r, LEAD: tl.constexpr):
    """``r`` [ROWS] with LEAD (0-2) leading axes of size 1."""
    if LEAD == 2:
        res = r[None, None, :]
    elif LEAD == 1:
        res = r[None, :]
    else:
        res = r
    return res


@triton.jit
def _offsets(n, sn, row_in, LEAD: tl.constexpr):
    """Element offsets of every input, ``n·sn[i] + row_in[i]`` (the row bases [ROWS]
    given LEAD leading axes to broadcast against ``n``): a tuple, one per input."""
    offs = (n * sn[0] + _lead(row_in[0], LEAD),)
    for i in tl.static_range(1, len(sn)):
        offs = offs + (n * sn[i] + _lead(row_in[i], LEAD),)
    return offs


@triton.jit
def _load(srcs, offs, mask, MASKED: tl.constexpr):
    """The raw tiles of every input at ``offs`` (masked lanes read 0 with MASKED): a
    tuple, one per input, each in its own dtype."""
    if MASKED:
        xs = (tl.load(srcs[0] + offs[0], mask=mask, other=0.0),)
        for i in tl.static_range(1, len(srcs)):
            xs = xs + (tl.load(srcs[i] + offs[i], mask=mask, other=0.0),)
    else:
        xs = (tl.load(srcs[0] + offs[0]),)
        for i in tl.static_range(1, len(srcs)):
            xs = xs + (tl.load(srcs[i] + offs[i]),)
    return xs


@triton.jit
def _load_rows(srcs, n, sn, row_in, mask):
    """Element ``n`` (a scalar) of each row of every input, ``srcs[i] + n·sn[i] +
    row_in[i]`` (masked lanes read 0): a tuple of [ROWS] values, one per input."""
    xs = (tl.load(srcs[0] + n * sn[0] + row_in[0], mask=mask, other=0.0),)
    for i in tl.static_range(1, len(srcs)):
        xs = xs + (tl.load(srcs[i] + n * sn[i] + row_in[i], mask=mask, other=0.0),)
    return xs


@triton.jit
def _f32(xs):
    """Every tile of ``xs`` as float32 (states are float32, whatever the inputs)."""
    ys = (xs[0].to(tl.float32),)
    for i in tl.static_range(1, len(xs)):
        ys = ys + (xs[i].to(tl.float32),)
    return ys


@triton.jit
def _reduce_step(acc, src, n, offs, pos0, lo, hi, row_ok, lane_last,
                 TILE_STATE: tl.constexpr, COMBINE: tl.constexpr, REDUCE_TILE: tl.constexpr,
                 SCAN_TILE: tl.constexpr, TAKE: tl.constexpr, LOAD_STATE: tl.constexpr,
                 K: tl.constexpr, LANES: tl.constexpr, ROWS: tl.constexpr,
                 MASK_N: tl.constexpr, MASK_ROWS: tl.constexpr, ORDERED: tl.constexpr,
                 FROM_STATES: tl.constexpr, VMASK: tl.constexpr = False, vmask=None,
                 inb=None):
    """``acc ⊕ state(tile)`` for the tile of elements ``n`` ([K, LANES, 1]) of each row,
    at offsets ``offs`` ([K, LANES, ROWS], one per input) from the inputs ``src``.

    ``acc`` is [LANES, ROWS] per field (one accumulator per lane), or [ROWS] if ORDERED.
    With MASK_N elements ``>= hi`` are masked; positions are ``n - pos0``. With VMASK
    (realigned rows) the load mask ``vmask`` is constant over each aligned vector, so the
    load stays vectorized, and ``inb`` marks the elements that belong to the row.
    """
    if FROM_STATES:
        # the elements are states already (second pass of split-K): masked -> identity
        m = (n < hi) & row_ok[None, None, :]
        s = REDUCE_TILE(*LOAD_STATE(src, offs[0], m), 0)
    else:
        if VMASK:
            xs = _f32(_load(src, offs, vmask, True))
            valid = tl.broadcast_to(inb, [K, LANES, ROWS])
        elif MASK_N:
            inb = n < hi
            if MASK_ROWS:
                m = inb & row_ok[None, None, :]
            else:
                m = inb
            xs = _f32(_load(src, offs, m, True))
            valid = tl.broadcast_to(inb, [K, LANES, ROWS])
        else:
            if MASK_ROWS:
                xs = _f32(_load(src, offs, tl.broadcast_to(row_ok[None, None, :], [K, LANES, ROWS]),
                                True))
            else:
                xs = _f32(_load(src, offs, None, False))
            # all true (NaN too), written as a function of x: a constant `valid` folds
            # block lifts that count (WELFORD's n) into constants whose layout is not the
            # tile's, and the accumulators then change layout (through shared memory)
            # every tile; LLVM still folds this to true after layouts are assigned
            valid = (xs[0] == xs[0]) | (xs[0] != xs[0])
        pos = tl.broadcast_to((n - pos0).to(tl.int32), [K, LANES, ROWS])
        s = TILE_STATE(*xs, pos, valid)                            # [LANES, ROWS]
    if ORDERED:
        # in-order reduction of the lanes: inclusive scan, then its last element
        s = TAKE(lane_last, 0, *SCAN_TILE(*s, 0, False))                  # [ROWS]
    return COMBINE(*acc, *s)


@triton.jit
def _row_state(src, lo, hi, pos0, sn, row_in, row_ok,
               TILE_STATE: tl.constexpr, COMBINE: tl.constexpr, REDUCE_TILE: tl.constexpr,
               SCAN_TILE: tl.constexpr, TAKE: tl.constexpr, LOAD_STATE: tl.constexpr,
               IDENTITY: tl.constexpr,
               K: tl.constexpr, LANES: tl.constexpr, ROWS: tl.constexpr,
               MASK_ROWS: tl.constexpr, ORDERED: tl.constexpr, FROM_STATES: tl.constexpr,
               ALIGN: tl.constexpr = 0, VFOLD: tl.constexpr = False):
    """State of elements ``[lo, hi)`` of each of the ROWS rows (positions counted from
    ``pos0``): full tiles unmasked, then one masked tail tile. Returns fields [ROWS].
    ``src``, ``sn``, ``row_in``: tuples, one entry per input (with FROM_STATES, ``src``
    holds the field buffers and ``sn``, ``row_in`` one entry).

    ``ALIGN = v > 0`` (one contiguous row, ``sn = 1``, a row start that is not a
    multiple of ``v`` elements): the tile grid starts ``(row_in + lo) mod v`` elements
    early, at an address the compiler knows to be 16-byte aligned, and loads whole
    aligned vectors that hold at least one element of the row (a mask that is constant
    per vector keeps them vectorized; Triton scalarizes any other masked load); the
    elements outside ``[lo, hi)`` are masked by ``valid``. Such a vector may reach up to
    ``v - 1`` elements past the end of the tensor, inside its 16-byte granule of the
    allocation (allocations are at least 16-byte aligned and sized).

    VFOLD (ORDERED): lane ``l`` of a tile holds its ``K`` *consecutive* elements
    ``n = t·K·LANES + l·K + k`` (one 16-byte vector for ``K = 4`` fp32), which TILE_STATE
    (the generated ``tile_fold``) folds in order in the thread's registers; the lanes'
    states are then scanned in order once per tile, a ``K``-th of the cross-thread work
    of ``K = 1``.
    """
    TILE: tl.constexpr = K * LANES
    if VFOLD:
        idx = tl.arange(0, K)[:, None, None] + tl.arange(0, LANES)[None, :, None] * K
    else:
        idx = tl.arange(0, K)[:, None, None] * LANES + tl.arange(0, LANES)[None, :, None]
    lane_last = tl.arange(0, LANES)[:, None] == LANES - 1
    if ORDERED:
        acc = IDENTITY(tl.zeros([ROWS], tl.float32))
    else:
        acc = IDENTITY(tl.zeros([LANES, ROWS], tl.float32))
    # `while`, not `for ... in range(runtime bound)`: the interpreter cannot take a
    # runtime bound under NumPy >= 2.3 (int() of a 1-element array); same code either way.
    # No `+=` on tensors: the interpreter updates in place, and `start` aliases `lo`.
    if ALIGN > 0:
        tl.static_assert(len(src) == 1, "realigned rows: monoids of one input only")
        shift = tl.max(((row_in[0] + lo) % ALIGN).to(lo.dtype), 0)       # scalar
        astart = lo - shift
        abase = tl.multiple_of(row_in[0] + astart, ALIGN)               # aligned, int64
        span = hi - astart
        # head tile (masked), full tiles (unmasked), tail tile (masked)
        rel = idx                                                        # [K, LANES, 1]
        vrel = rel // ALIGN * ALIGN                                      # vector start
        vmask = (vrel + ALIGN > shift) & (vrel < span)
        inb = (rel >= shift) & (rel < span)
        acc = _reduce_step(acc, src, astart + rel, (abase[None, None, :] + rel,), pos0, lo, hi,
                           row_ok, lane_last, TILE_STATE, COMBINE, REDUCE_TILE, SCAN_TILE,
                           TAKE, LOAD_STATE, K, LANES, ROWS, True, MASK_ROWS, ORDERED,
                           FROM_STATES, True, vmask, inb)
        end = span // TILE * TILE
        rel0 = span * 0 + TILE
        while rel0 < end:
            rel = rel0 + idx
            acc = _reduce_step(acc, src, astart + rel, (abase[None, None, :] + rel,), pos0, lo, hi,
                               row_ok, lane_last, TILE_STATE, COMBINE, REDUCE_TILE, SCAN_TILE,
                               TAKE, LOAD_STATE, K, LANES, ROWS, False, MASK_ROWS, ORDERED,
                               FROM_STATES)
            rel0 = rel0 + TILE
        if (end >= TILE) & (end < span):
            rel = end + idx
            vrel = rel // ALIGN * ALIGN
            acc = _reduce_step(acc, src, astart + rel, (abase[None, None, :] + rel,), pos0, lo, hi,
                               row_ok, lane_last, TILE_STATE, COMBINE, REDUCE_TILE, SCAN_TILE,
                               TAKE, LOAD_STATE, K, LANES, ROWS, True, MASK_ROWS, ORDERED,
                               FROM_STATES, True, vrel < span, rel < span)
    else:
        end = lo + (hi - lo) // TILE * TILE
        start = lo
        while start < end:
            n = start + idx
            acc = _reduce_step(acc, src, n, _offsets(n, sn, row_in, 2), pos0, lo, hi, row_ok,
                               lane_last, TILE_STATE, COMBINE, REDUCE_TILE, SCAN_TILE, TAKE,
                               LOAD_STATE, K, LANES, ROWS, False, MASK_ROWS, ORDERED, FROM_STATES)
            start = start + TILE
        if end < hi:
            n = end + idx
            acc = _reduce_step(acc, src, n, _offsets(n, sn, row_in, 2), pos0, lo, hi, row_ok,
                               lane_last, TILE_STATE, COMBINE, REDUCE_TILE, SCAN_TILE, TAKE,
                               LOAD_STATE, K, LANES, ROWS, True, MASK_ROWS, ORDERED, FROM_STATES)
    if ORDERED:
        res = acc
    else:
        res = REDUCE_TILE(*acc, 0)
    return res


@triton.jit
def _small_fold(src, lo, hi, pos0, sn, row_in, row_ok,
                LIFT_XP: tl.constexpr, COMBINE: tl.constexpr, SELECT: tl.constexpr,
                IDENTITY: tl.constexpr, KMAX: tl.constexpr, ROWS: tl.constexpr):
    """State of rows of at most KMAX elements: one row per thread (rows across threads),
    the elements loaded one [ROWS] vector at a time and folded left to right in
    registers, with no cross-thread step (the tile layout would put a short row across
    threads, with three shuffle levels per reduction: 125 instructions per element for
    2^20 x 7 on sm_90, against ~15 here). Order-preserving."""
    acc = IDENTITY(tl.zeros([ROWS], tl.float32))
    for k in tl.static_range(KMAX):
        n = lo + k
        ok = n < hi
        xs = _f32(_load_rows(src, n, sn, row_in, _row_mask(row_ok, n, hi)))
        s = LIFT_XP(*xs, tl.broadcast_to((n - pos0).to(tl.int32), [ROWS]))
        acc = COMBINE(*acc, *SELECT(ok, *s, *IDENTITY(xs[0])))
    return acc


@triton.jit
def reduce_kernel(src, outs, fin_args, seg_ptr,
                  N, sn, B1, B2, s0, s1, s2, o0, o1, o2, o_split, n_inner, n_split, chunk,
                  TILE_STATE: tl.constexpr, COMBINE: tl.constexpr, REDUCE_TILE: tl.constexpr,
                  SCAN_TILE: tl.constexpr, TAKE: tl.constexpr, LOAD_STATE: tl.constexpr,
                  STORE_STATE: tl.constexpr, IDENTITY: tl.constexpr, FINALIZE: tl.constexpr,
                  K: tl.constexpr, LANES: tl.constexpr, ROWS: tl.constexpr,
                  ORDERED: tl.constexpr, FROM_STATES: tl.constexpr, STATE_OUT: tl.constexpr,
                  SEGMENTED: tl.constexpr, MASK_ROWS: tl.constexpr, N64: tl.constexpr,
                  LIFT_XP: tl.constexpr = None, SELECT: tl.constexpr = None,
                  SMALL: tl.constexpr = False, ALIGN: tl.constexpr = 0,
                  VFOLD: tl.constexpr = False):
    """Reduce, split-K partial / combine passes and segmented reduce, one template.

    Program ``(rows, j)`` folds elements ``[lo, hi)`` of its rows, where
    ``[lo, hi) = [j·chunk, min((j+1)·chunk, N))`` (split-K; ``n_split = 1``: the whole
    row) or ``[seg[j], seg[j+1])`` (SEGMENTED), and writes either
    ``finalize(state, *fin_args)`` to ``outs`` (one pointer per output) or, with
    STATE_OUT, the state's fields to ``outs`` (one fp32/int32 buffer per field). ``src``
    holds the inputs' pointers and ``sn``, ``s0``, ``s1``, ``s2`` their strides (tuples,
    one entry per input). With FROM_STATES, ``src`` is a tuple of field buffers holding
    states (the second pass of split-K) instead of input elements, and the strides are
    tuples of one.
    """
    split, row_ok, row_in, row_out, flat = _program_rows(
        tl.program_id(0), n_split, n_inner, B1, B2, s0, s1, s2, o0, o1, o2, ROWS)
    if SEGMENTED:
        lo = tl.load(seg_ptr + split)
        hi = tl.load(seg_ptr + split + 1)
    else:
        lo, hi = _chunk_bounds(split, chunk, N, N64)
    if N64:
        lo = lo.to(tl.int64)
        hi = hi.to(tl.int64)
    else:
        lo = lo.to(tl.int32)
        hi = hi.to(tl.int32)
    if SEGMENTED:
        pos0 = lo                      # positions restart in each segment
    else:
        pos0 = lo * 0                  # split-K chunks count from the row's start
    if SMALL:
        res = _small_fold(src, lo, hi, pos0, sn, row_in, row_ok,
                          LIFT_XP, COMBINE, SELECT, IDENTITY, K, ROWS)
    else:
        res = _row_state(src, lo, hi, pos0, sn, row_in, row_ok,
                         TILE_STATE, COMBINE, REDUCE_TILE, SCAN_TILE, TAKE, LOAD_STATE, IDENTITY,
                         K, LANES, ROWS, MASK_ROWS, ORDERED, FROM_STATES, ALIGN, VFOLD)
    out_off = row_out + split.to(tl.int64) * o_split
    if STATE_OUT:
        STORE_STATE(outs, out_off, row_ok, *res)
    else:
        f = FINALIZE(*res, *fin_args)
        for i in tl.static_range(len(outs)):
            tl.store(outs[i] + out_off, f[i], mask=row_ok)


@triton.jit
def _fold_states(acc, parts, flat, n_split, j_lo, j_hi, row_ok,
                 COMBINE: tl.constexpr, SCAN_TILE: tl.constexpr, TAKE: tl.constexpr,
                 LOAD_STATE: tl.constexpr, PBLOCK: tl.constexpr):
    """``acc ⊕ P_{j_lo} ⊕ ... ⊕ P_{j_hi - 1}`` in order, for each row, from the chunk
    states ``parts`` (one [rows, n_split] buffer per field; ``flat`` [ROWS] row ids)."""
    jj = tl.arange(0, PBLOCK)[:, None]
    j0 = j_lo
    while j0 < j_hi:
        j = j0 + jj
        m = (j < j_hi) & row_ok[None, :]
        s = LOAD_STATE(parts, flat[None, :] * n_split + j, m)         # [PBLOCK, ROWS]
        acc = COMBINE(*acc, *TAKE(jj == PBLOCK - 1, 0, *SCAN_TILE(*s, 0, False)))
        j0 = j0 + PBLOCK
    return acc


@triton.jit
def _scan_combine(carry, xs, n, LIFT_XP: tl.constexpr, COMBINE: tl.constexpr,
                  SCAN_TILE: tl.constexpr, SCAN_TILE_REV: tl.constexpr, BCAST0: tl.constexpr,
                  BLOCK: tl.constexpr, ROWS: tl.constexpr, REVERSE: tl.constexpr):
    """``carry ⊕ prefix`` of a loaded [BLOCK, ROWS] tile (``xs``: one per input) by a
    scan of the combine. Lanes past the end come last in processing order: no prefix of
    a stored lane sees them."""
    s = LIFT_XP(*xs, tl.broadcast_to(n.to(tl.int32), [BLOCK, ROWS]))
    if REVERSE:
        p = SCAN_TILE_REV(*s, 0)             # p_i = x_i ⊕ x_{i+1} ⊕ ... (within the tile)
        return COMBINE(*p, *BCAST0(xs[0], *carry))
    else:
        p = SCAN_TILE(*s, 0, False)
        return COMBINE(*BCAST0(xs[0], *carry), *p)


@triton.jit
def _scan_step(carry, x_ptr, outs, fin_args, i, lo, hi, sn, osn, row_in, row_out, row_ok, i_last,
               LIFT_XP: tl.constexpr, COMBINE: tl.constexpr, SCAN_TILE: tl.constexpr,
               SCAN_TILE_REV: tl.constexpr, TAKE: tl.constexpr, BCAST0: tl.constexpr,
               FINALIZE: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
               MASK_N: tl.constexpr, MASK_ROWS: tl.constexpr, REVERSE: tl.constexpr,
               BLOCK_SCAN: tl.constexpr = None, SCAN_EXACT: tl.constexpr = None):
    """Scan one [BLOCK, ROWS] tile (``i``: [BLOCK, 1] positions in processing order),
    store ``finalize(carry ⊕ prefix)``, return the new carry ([ROWS] per field).

    With BLOCK_SCAN (the monoid's block scan; reverse only for a commutative monoid) the
    tile's prefixes come from it: one shared reference per tile, no combine per element.
    Where SCAN_EXACT fails on any valid element (e.g. a prefix that underflowed against
    the tile's max), the tile is rescanned with the combine."""
    if REVERSE:
        n = hi - 1 - i                       # reversed loads: processing order = x order reversed
    else:
        n = lo + i
    off_in = _offsets(n, sn, row_in, 1)
    off_out = n * osn + row_out[None, :]
    if MASK_N:
        m = i < hi - lo
        if MASK_ROWS:
            m = m & row_ok[None, :]
        xs = _f32(_load(x_ptr, off_in, m, True))
    else:
        if MASK_ROWS:
            m = tl.broadcast_to(row_ok[None, :], [BLOCK, ROWS])
            xs = _f32(_load(x_ptr, off_in, m, True))
        else:
            xs = _f32(_load(x_ptr, off_in, None, False))
    if BLOCK_SCAN is not None:
        if MASK_N:
            valid = tl.broadcast_to(i < hi - lo, [BLOCK, ROWS])
        else:
            valid = tl.full([BLOCK, ROWS], 1, tl.int1)
        if REVERSE:                          # commutative: suffix ⊕ carry = carry ⊕ suffix
            p = COMBINE(*BLOCK_SCAN(*xs, valid), *BCAST0(xs[0], *carry))
        else:
            p = COMBINE(*BCAST0(xs[0], *carry), *BLOCK_SCAN(*xs, valid))
        inexact = tl.max(tl.where(valid & (SCAN_EXACT(*p)[0] == 0), 1, 0))
        if inexact > 0:
            p = _scan_combine(carry, xs, n, LIFT_XP, COMBINE, SCAN_TILE, SCAN_TILE_REV, BCAST0,
                              BLOCK, ROWS, REVERSE)
    else:
        p = _scan_combine(carry, xs, n, LIFT_XP, COMBINE, SCAN_TILE, SCAN_TILE_REV, BCAST0,
                          BLOCK, ROWS, REVERSE)
    f = FINALIZE(*p, *fin_args)
    for j in tl.static_range(len(outs)):
        if MASK_N or MASK_ROWS:
            tl.store(outs[j] + off_out, f[j], mask=m)
        else:
            tl.store(outs[j] + off_out, f[j])
    return TAKE(i_last, 0, *p)


@triton.jit
def _lane_load(x_ptr, n, hi, sn, row_in, MASK_N: tl.constexpr):
    """One [VEC, LANES] sub-tile of raw elements of every input (axis 0 lives in a
    thread): a tuple, one per input."""
    return _load(x_ptr, _offsets(n, sn, row_in, 0), n < hi, MASK_N)


@triton.jit
def _chunk_load(x_ptr, n, hi, sn, row_in, VEC: tl.constexpr, MASK_N: tl.constexpr):
    """The four sub-tiles of a chunked tile (lane ``l`` owns ``n + [0, 4·VEC)``)."""
    return (_lane_load(x_ptr, n, hi, sn, row_in, MASK_N),
            _lane_load(x_ptr, n + VEC, hi, sn, row_in, MASK_N),
            _lane_load(x_ptr, n + 2 * VEC, hi, sn, row_in, MASK_N),
            _lane_load(x_ptr, n + 3 * VEC, hi, sn, row_in, MASK_N))


@triton.jit
def _lane_scan(x, n, LIFT_XP: tl.constexpr, SCAN_TILE: tl.constexpr):
    """In-thread inclusive scan of one loaded [VEC, LANES] sub-tile (one per input)."""
    return SCAN_TILE(*LIFT_XP(*_f32(x), n.to(tl.int32)), 0, False)


@triton.jit
def _lane_store(outs, fin_args, p, base, n, hi, osn, row_out,
                COMBINE: tl.constexpr, BCAST0: tl.constexpr, FINALIZE: tl.constexpr,
                MASK_N: tl.constexpr):
    """Store ``finalize(base ⊕ p)`` for a [VEC, LANES] sub-tile (``base``: [LANES])."""
    f = FINALIZE(*COMBINE(*BCAST0(p[0], *base), *p), *fin_args)
    off = n * osn + row_out
    for j in tl.static_range(len(outs)):
        if MASK_N:
            tl.store(outs[j] + off, f[j], mask=n < hi)
        else:
            tl.store(outs[j] + off, f[j])


@triton.jit
def _chunk_local(xs, n, LIFT_XP: tl.constexpr, COMBINE: tl.constexpr, SCAN_TILE: tl.constexpr,
                 TAKE: tl.constexpr, VEC: tl.constexpr):
    """Local half of a chunked tile scan of the loaded sub-tiles ``xs``: the four in-thread
    vector scans ``p_r`` ([VEC, LANES]), the lane prefixes ``q_1..q_3`` of the vector
    totals and the inclusive scan of the lane totals across the block ``incl`` ([LANES])."""
    k_last = tl.arange(0, VEC)[:, None] == VEC - 1
    p0 = _lane_scan(xs[0], n, LIFT_XP, SCAN_TILE)
    p1 = _lane_scan(xs[1], n + VEC, LIFT_XP, SCAN_TILE)
    p2 = _lane_scan(xs[2], n + 2 * VEC, LIFT_XP, SCAN_TILE)
    p3 = _lane_scan(xs[3], n + 3 * VEC, LIFT_XP, SCAN_TILE)
    q1 = TAKE(k_last, 0, *p0)                                        # lane prefixes [LANES]
    q2 = COMBINE(*q1, *TAKE(k_last, 0, *p1))
    q3 = COMBINE(*q2, *TAKE(k_last, 0, *p2))
    total = COMBINE(*q3, *TAKE(k_last, 0, *p3))
    incl = SCAN_TILE(*total, 0, False)                               # across lanes
    return (p0, p1, p2, p3), (q1, q2, q3), incl


@triton.jit
def _chunk_apply(carry, local, outs, fin_args, n, hi, osn, row_out, lane,
                 COMBINE: tl.constexpr, BCAST0: tl.constexpr, BCAST: tl.constexpr,
                 SHIFT1: tl.constexpr, FINALIZE: tl.constexpr, VEC: tl.constexpr,
                 MASK_N: tl.constexpr):
    """Apply half: ``out = finalize((carry ⊕ exclusive_lane ⊕ q_r) ⊕ p_r)``."""
    p, q, incl = local
    base = COMBINE(*BCAST(q[0][0], *carry), *SHIFT1(lane, *incl))   # carry ⊕ exclusive
    _lane_store(outs, fin_args, p[0], base, n, hi, osn, row_out, COMBINE, BCAST0, FINALIZE, MASK_N)
    _lane_store(outs, fin_args, p[1], COMBINE(*base, *q[0]), n + VEC, hi, osn, row_out,
                COMBINE, BCAST0, FINALIZE, MASK_N)
    _lane_store(outs, fin_args, p[2], COMBINE(*base, *q[1]), n + 2 * VEC, hi, osn, row_out,
                COMBINE, BCAST0, FINALIZE, MASK_N)
    _lane_store(outs, fin_args, p[3], COMBINE(*base, *q[2]), n + 3 * VEC, hi, osn, row_out,
                COMBINE, BCAST0, FINALIZE, MASK_N)


@triton.jit
def _chunk_scan_step(carry, x_ptr, outs, fin_args, n0, hi, sn, osn, row_in, row_out,
                     LIFT_XP: tl.constexpr, COMBINE: tl.constexpr, SCAN_TILE: tl.constexpr,
                     TAKE: tl.constexpr, BCAST0: tl.constexpr, BCAST: tl.constexpr,
                     SHIFT1: tl.constexpr, FINALIZE: tl.constexpr,
                     VEC: tl.constexpr, LANES: tl.constexpr, MASK_N: tl.constexpr):
    """Scan a tile of ``4·VEC·LANES`` elements of one row starting at ``n0``; lane ``l``
    owns the ``4·VEC`` consecutive elements ``n0 + 4·VEC·l + [0, 4·VEC)``, as four
    [VEC, LANES] sub-tiles whose axis 0 is one 16-byte vector in one thread.

    Work-efficient, ~2.75 combines per element (Triton's block scan plus a carry takes
    ~5): in-thread scans of each vector (3 per 4), the chain of the four vector totals
    (3 per lane), one exclusive scan of the lane totals across the block (~10 per lane),
    ``base = carry ⊕ exclusive`` (1 per lane), the vector offsets ``base ⊕ Q_r`` (3 per
    lane) and ``out = (base ⊕ Q_r) ⊕ prefix`` (1 per element). Elements past ``hi``
    come last in order, so no stored prefix sees them. Returns the new carry.
    """
    lane = tl.arange(0, LANES)
    n = n0 + lane[None, :] * (4 * VEC) + tl.arange(0, VEC)[:, None]  # [VEC, LANES]
    xs = _chunk_load(x_ptr, n, hi, sn, row_in, VEC, MASK_N)
    return _chunk_scan_tile(carry, xs, outs, fin_args, n, hi, osn, row_out, LIFT_XP, COMBINE,
                            SCAN_TILE, TAKE, BCAST0, BCAST, SHIFT1, FINALIZE, VEC, LANES,
                            MASK_N)


@triton.jit
def _chunk_scan_tile(carry, xs, outs, fin_args, n, hi, osn, row_out,
                     LIFT_XP: tl.constexpr, COMBINE: tl.constexpr, SCAN_TILE: tl.constexpr,
                     TAKE: tl.constexpr, BCAST0: tl.constexpr, BCAST: tl.constexpr,
                     SHIFT1: tl.constexpr, FINALIZE: tl.constexpr,
                     VEC: tl.constexpr, LANES: tl.constexpr, MASK_N: tl.constexpr):
    """:func:`_chunk_scan_step` on already loaded sub-tiles ``xs`` at positions ``n``."""
    lane = tl.arange(0, LANES)
    local = _chunk_local(xs, n, LIFT_XP, COMBINE, SCAN_TILE, TAKE, VEC)
    _chunk_apply(carry, local, outs, fin_args, n, hi, osn, row_out, lane,
                 COMBINE, BCAST0, BCAST, SHIFT1, FINALIZE, VEC, MASK_N)
    return COMBINE(*carry, *BCAST(carry[0], *TAKE(lane == LANES - 1, 0, *local[2])))


@triton.jit
def _publish(bufs, flags, slot, value, state, STORE_STATE: tl.constexpr):
    """Write ``state`` ([1] per field) to ``bufs[slot]``, then release ``flags[slot] =
    value``: the barrier orders every thread's stores before the releasing atomic.
    Returns the flag's previous value (0 or 1)."""
    one = tl.arange(0, 1)
    STORE_STATE(bufs, slot + one, one == 0, *state)
    tl.debug_barrier()
    return tl.atomic_xchg(flags + slot, value, sem="release")


@triton.jit
def _look_back(c, row0, aggs, incls, flags,
               COMBINE: tl.constexpr, SCAN_TILE: tl.constexpr, TAKE: tl.constexpr,
               LOAD_STATE: tl.constexpr, SELECT: tl.constexpr, IDENTITY: tl.constexpr,
               W: tl.constexpr):
    """Decoupled look-back: ``P_0 ⊕ ... ⊕ P_{c-1}`` of the chunks before chunk ``c`` of a
    row whose flags start at ``row0``. Windows of ``W`` predecessors are read (acquire)
    until each has published (flag 1: its aggregate, 2: its inclusive prefix); the window
    is folded in order from its last inclusive prefix, and the search stops there (chunk
    0 always publishes an inclusive prefix). Predecessors took earlier tickets, so they
    are running or done: the spin cannot deadlock."""
    jj = tl.arange(0, W)[:, None]                                     # [W, 1]
    acc = IDENTITY(tl.zeros([1], tl.float32))
    j_hi = c
    while j_hi > 0:
        j = j_hi - W + jj
        ok = j >= 0
        f = tl.atomic_add(flags + row0 + j, 0, mask=ok, sem="acquire")
        while tl.min(tl.where(ok, f, 1)) == 0:                        # spin until published
            f = tl.atomic_add(flags + row0 + j, 0, mask=ok, sem="acquire")
        last = tl.max(tl.where(ok & (f == 2), j, -1), 0)              # [1]: last inclusive
        use = ok & (j >= last)
        a = LOAD_STATE(aggs, row0 + j, use & (j > last))
        b = LOAD_STATE(incls, row0 + j, use & (j == last))
        s = SELECT(j == last, *b, *a)
        acc = COMBINE(*TAKE(jj == W - 1, 0, *SCAN_TILE(*s, 0, False)), *acc)
        j_hi = tl.where(tl.max(last, 0) >= 0, 0, j_hi - W)
    return acc


@triton.jit
def lookback_scan_kernel(x_ptr, outs, fin_args, aggs, incls, flags, ticket,
                         N, sn, osn, B1, B2, s0, s1, s2, o0, o1, o2, n_chunks, chunk,
                         TILE_STATE: tl.constexpr, LIFT_XP: tl.constexpr, COMBINE: tl.constexpr,
                         REDUCE_TILE: tl.constexpr, SCAN_TILE: tl.constexpr, TAKE: tl.constexpr,
                         BCAST0: tl.constexpr, BCAST: tl.constexpr, SHIFT1: tl.constexpr,
                         FINALIZE: tl.constexpr, IDENTITY: tl.constexpr,
                         LOAD_STATE: tl.constexpr, STORE_STATE: tl.constexpr,
                         SELECT: tl.constexpr, K: tl.constexpr, LANES: tl.constexpr,
                         BLOCK: tl.constexpr, VEC: tl.constexpr, W: tl.constexpr,
                         ORDERED: tl.constexpr, INCLUSIVE: tl.constexpr,
                         N64: tl.constexpr = False, VFOLD: tl.constexpr = False):
    """Single-pass forward scan of few long rows (decoupled look-back, Merrill & Garland).

    Each program takes a ticket (so chunks start in order), folds its chunk
    ``[c·chunk, (c+1)·chunk)`` of row ``r`` with the reduce tiles ``[K, LANES]``, publishes
    that aggregate, looks back for the prefix of the chunks before it, publishes its
    inclusive prefix, and scans the chunk again from that prefix with the chunked scan
    (``BLOCK``-element tiles). The second read of the chunk (a few tens of KB, just read
    by this program) comes from L2, so HBM sees one read and one write of the data, where
    reduce-then-scan reads it twice. With INCLUSIVE=False only chunk 0 publishes an
    inclusive prefix, so every look-back walks back to it (a test of the window loop).
    """
    t = tl.atomic_add(ticket, 1)
    r = t // n_chunks
    c = t % n_chunks
    b2 = r % B2
    q = r // B2
    b1 = q % B1
    b0 = q // B1
    one = tl.zeros([1], tl.int64)
    row_in = _row_bases(b0, b1, one + b2.to(tl.int64), s0, s1, s2)             # [1] each
    row_out = one + b0.to(tl.int64) * o0 + b1.to(tl.int64) * o1 + b2.to(tl.int64) * o2
    lo, hi = _chunk_bounds(c, chunk, N, N64)
    total = _row_state(x_ptr, lo, hi, lo * 0, sn, row_in, one == 0,
                       TILE_STATE, COMBINE, REDUCE_TILE, SCAN_TILE, TAKE, LOAD_STATE, IDENTITY,
                       K, LANES, 1, False, ORDERED, False, 0, VFOLD)  # [1] per field
    if c == 0:
        carry = IDENTITY(tl.zeros([1], tl.float32))
        _publish(incls, flags, t, 2, total, STORE_STATE)
    else:
        _publish(aggs, flags, t, 1, total, STORE_STATE)
        carry = _look_back(c, r * n_chunks, aggs, incls, flags, COMBINE, SCAN_TILE, TAKE,
                           LOAD_STATE, SELECT, IDENTITY, W)
        if INCLUSIVE:
            _publish(incls, flags, t, 2, COMBINE(*carry, *total), STORE_STATE)
    SLANES: tl.constexpr = BLOCK // (4 * VEC)
    end = lo + (hi - lo) // BLOCK * BLOCK
    start = lo
    while start < end:
        carry = _chunk_scan_step(carry, x_ptr, outs, fin_args, start, hi, sn, osn, row_in, row_out,
                                 LIFT_XP, COMBINE, SCAN_TILE, TAKE, BCAST0, BCAST, SHIFT1,
                                 FINALIZE, VEC, SLANES, False)
        start = start + BLOCK
    if end < hi:
        _chunk_scan_step(carry, x_ptr, outs, fin_args, end, hi, sn, osn, row_in, row_out,
                         LIFT_XP, COMBINE, SCAN_TILE, TAKE, BCAST0, BCAST, SHIFT1,
                         FINALIZE, VEC, SLANES, True)


@triton.jit
def scan_kernel(x_ptr, outs, fin_args, parts,
                N, sn, osn, B1, B2, s0, s1, s2, o0, o1, o2, n_inner, n_split, chunk,
                LIFT_XP: tl.constexpr, COMBINE: tl.constexpr, SCAN_TILE: tl.constexpr,
                SCAN_TILE_REV: tl.constexpr, TAKE: tl.constexpr, BCAST0: tl.constexpr,
                IDENTITY: tl.constexpr, LOAD_STATE: tl.constexpr, FINALIZE: tl.constexpr,
                BCAST: tl.constexpr, SHIFT1: tl.constexpr,
                BLOCK: tl.constexpr, ROWS: tl.constexpr, PBLOCK: tl.constexpr,
                REVERSE: tl.constexpr, SPLIT: tl.constexpr, CHUNKED: tl.constexpr,
                VEC: tl.constexpr, MASK_ROWS: tl.constexpr, N64: tl.constexpr,
                SMALL: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                BLOCK_SCAN: tl.constexpr = None, SCAN_EXACT: tl.constexpr = None):
    """Inclusive scan along the dim, state carried across tiles.

    PREFETCH (chunked scans): load the next full tile before scanning the current one.
    BLOCK_SCAN, SCAN_EXACT (block scans): the monoid's block scan inside a tile (see
    :func:`_scan_step`).

    With SPLIT (a multi-block scan of few long rows: reduce-then-scan), program ``j``
    scans elements ``[j·chunk, (j+1)·chunk)`` starting from the carry
    ``P_0 ⊕ ... ⊕ P_{j-1}`` (``P_{j+1} ⊕ ... ⊕ P_{n-1}`` when REVERSE), folded in order
    from the chunk states ``parts`` (one [rows, n_split] buffer per field) that a
    STATE_OUT pass of :func:`reduce_kernel` wrote.
    """
    split, row_ok, row_in, row_out, flat = _program_rows(
        tl.program_id(0), n_split, n_inner, B1, B2, s0, s1, s2, o0, o1, o2, ROWS)
    lo, hi = _chunk_bounds(split, chunk, N, N64)
    if N64:
        hi = hi.to(tl.int64)
    carry = IDENTITY(tl.zeros([ROWS], tl.float32))
    if SPLIT:
        if REVERSE:
            carry = _fold_states(carry, parts, flat, n_split, split + 1, n_split, row_ok,
                                 COMBINE, SCAN_TILE, TAKE, LOAD_STATE, PBLOCK)
        else:
            carry = _fold_states(carry, parts, flat, n_split, split * 0, split, row_ok,
                                 COMBINE, SCAN_TILE, TAKE, LOAD_STATE, PBLOCK)
    if SMALL:
        # rows of at most BLOCK elements, one row per thread, folded in registers
        for kk in tl.static_range(BLOCK):
            if REVERSE:
                n = hi - 1 - kk
            else:
                n = lo + kk
            m = _row_mask(row_ok, kk, hi - lo)
            xs = _f32(_load_rows(x_ptr, n, sn, row_in, m))
            s = LIFT_XP(*xs, tl.broadcast_to(n.to(tl.int32), [ROWS]))
            if REVERSE:
                carry = COMBINE(*s, *carry)
            else:
                carry = COMBINE(*carry, *s)
            f = FINALIZE(*carry, *fin_args)
            for j in tl.static_range(len(outs)):
                tl.store(outs[j] + n * osn + row_out, f[j], mask=m)
    elif CHUNKED:
        # one row (ROWS = 1), forward: lanes of 4 vectors, BLOCK = 4·VEC·LANES
        LANES: tl.constexpr = BLOCK // (4 * VEC)
        end = lo + (hi - lo) // BLOCK * BLOCK
        start = lo
        if PREFETCH:
            # the next full tile's loads are issued before this tile is scanned, so its
            # memory latency overlaps the scan's dependent chains
            nb = tl.arange(0, LANES)[None, :] * (4 * VEC) + tl.arange(0, VEC)[:, None]
            cur = _chunk_load(x_ptr, start + nb, end, sn, row_in, VEC, True)
            while start < end:
                if start + BLOCK < end:
                    nxt = _chunk_load(x_ptr, start + BLOCK + nb, hi, sn, row_in, VEC, False)
                else:
                    nxt = cur
                carry = _chunk_scan_tile(carry, cur, outs, fin_args, start + nb, hi, osn, row_out,
                                         LIFT_XP, COMBINE, SCAN_TILE, TAKE, BCAST0, BCAST, SHIFT1,
                                         FINALIZE, VEC, LANES, False)
                cur = nxt
                start = start + BLOCK
        else:
            while start < end:
                carry = _chunk_scan_step(carry, x_ptr, outs, fin_args, start, hi, sn, osn, row_in,
                                         row_out, LIFT_XP, COMBINE, SCAN_TILE, TAKE, BCAST0, BCAST,
                                         SHIFT1, FINALIZE, VEC, LANES, False)
                start = start + BLOCK
        if end < hi:
            _chunk_scan_step(carry, x_ptr, outs, fin_args, end, hi, sn, osn, row_in, row_out,
                             LIFT_XP, COMBINE, SCAN_TILE, TAKE, BCAST0, BCAST, SHIFT1,
                             FINALIZE, VEC, LANES, True)
    else:
        ii = tl.arange(0, BLOCK)[:, None]
        i_last = ii == BLOCK - 1
        count = hi - lo
        end = count // BLOCK * BLOCK
        start = count * 0
        while start < end:
            carry = _scan_step(carry, x_ptr, outs, fin_args, start + ii, lo, hi, sn, osn,
                               row_in, row_out, row_ok, i_last,
                               LIFT_XP, COMBINE, SCAN_TILE, SCAN_TILE_REV, TAKE, BCAST0, FINALIZE,
                               BLOCK, ROWS, False, MASK_ROWS, REVERSE, BLOCK_SCAN, SCAN_EXACT)
            start = start + BLOCK
        if end < count:
            _scan_step(carry, x_ptr, outs, fin_args, end + ii, lo, hi, sn, osn,
                       row_in, row_out, row_ok, i_last,
                       LIFT_XP, COMBINE, SCAN_TILE, SCAN_TILE_REV, TAKE, BCAST0, FINALIZE,
                       BLOCK, ROWS, True, MASK_ROWS, REVERSE, BLOCK_SCAN, SCAN_EXACT)


@triton.jit
def _map_step(x_ptr, y_ptr, n, hi, sn, osn, row_in, row_out, row_ok, consts,
              FMAP: tl.constexpr, K: tl.constexpr, LANES: tl.constexpr, ROWS: tl.constexpr,
              MASK_N: tl.constexpr, MASK_ROWS: tl.constexpr):
    """``y = fmap(x, *consts)`` on one [K, LANES, ROWS] tile."""
    off_in = n * sn + row_in[None, None, :]
    off_out = n * osn + row_out[None, None, :]
    if MASK_N or MASK_ROWS:
        if MASK_N:
            m = n < hi
            if MASK_ROWS:
                m = m & row_ok[None, None, :]
        else:
            m = tl.broadcast_to(row_ok[None, None, :], [K, LANES, ROWS])
        x = tl.load(x_ptr + off_in, mask=m, other=0.0).to(tl.float32)
        y = FMAP(x, *consts)
        tl.store(y_ptr + off_out, y[0], mask=m)
    else:
        x = tl.load(x_ptr + off_in).to(tl.float32)
        y = FMAP(x, *consts)
        tl.store(y_ptr + off_out, y[0])


@triton.jit
def _map_range(x_ptr, y_ptr, lo, hi, sn, osn, row_in, row_out, row_ok, consts,
               FMAP: tl.constexpr, K: tl.constexpr, LANES: tl.constexpr, ROWS: tl.constexpr,
               MASK_ROWS: tl.constexpr):
    """The map over elements ``[lo, hi)``: full tiles unmasked, then a masked tail."""
    TILE: tl.constexpr = K * LANES
    idx = tl.arange(0, K)[:, None, None] * LANES + tl.arange(0, LANES)[None, :, None]
    end = lo + (hi - lo) // TILE * TILE
    start = lo
    while start < end:
        _map_step(x_ptr, y_ptr, start + idx, hi, sn, osn, row_in, row_out, row_ok,
                  consts, FMAP, K, LANES, ROWS, False, MASK_ROWS)
        start = start + TILE
    if end < hi:
        _map_step(x_ptr, y_ptr, end + idx, hi, sn, osn, row_in, row_out, row_ok,
                  consts, FMAP, K, LANES, ROWS, True, MASK_ROWS)


@triton.jit
def normalize_kernel(x_ptr, y_ptr, parts, N, sn, osn, B1, B2, s0, s1, s2, o0, o1, o2,
                     n_inner, n_split, chunk,
                     TILE_STATE: tl.constexpr, COMBINE: tl.constexpr, REDUCE_TILE: tl.constexpr,
                     SCAN_TILE: tl.constexpr, TAKE: tl.constexpr, LOAD_STATE: tl.constexpr,
                     IDENTITY: tl.constexpr, PREP: tl.constexpr, FMAP: tl.constexpr,
                     K: tl.constexpr, LANES: tl.constexpr, ROWS: tl.constexpr,
                     FUSED: tl.constexpr, SPLIT: tl.constexpr, PBLOCK: tl.constexpr,
                     ORDERED: tl.constexpr, MASK_ROWS: tl.constexpr, N64: tl.constexpr,
                     LIFT_XP: tl.constexpr = None, SELECT: tl.constexpr = None,
                     SMALL: tl.constexpr = False):
    """``y = fmap(x, *prep(state(row)))`` for every element (softmax and kin).

    FUSED (the row fits one tile, ``K·LANES >= N``): the tile is read once, kept in
    registers for the state and the map, and written once. Otherwise a statistics loop
    (:func:`_row_state`) and a map loop that re-reads the row, just read by this program
    and likely still in L2. SPLIT (few long rows): program ``j`` maps chunk
    ``[j·chunk, (j+1)·chunk)`` with the row state folded from the chunk states ``parts``
    that a STATE_OUT pass of :func:`reduce_kernel` wrote.
    """
    # one input (row maps read the row they normalize): the row state's helpers take
    # tuples of one
    split, row_ok, rows_in, row_out, flat = _program_rows(
        tl.program_id(0), n_split, n_inner, B1, B2, (s0,), (s1,), (s2,), o0, o1, o2, ROWS)
    row_in = rows_in[0]
    if N64:
        lo = (split * 0).to(tl.int64)
    else:
        lo = split * 0
    if SMALL:
        # rows of at most K elements: one row per thread; the second read hits L1
        consts = PREP(*_small_fold((x_ptr,), lo, lo + N, lo, (sn,), rows_in, row_ok,
                                   LIFT_XP, COMBINE, SELECT, IDENTITY, K, ROWS))
        for k in tl.static_range(K):
            n = lo + k
            m = _row_mask(row_ok, n, N)
            x = tl.load(x_ptr + n * sn + row_in, mask=m, other=0.0).to(tl.float32)
            y = FMAP(x, *consts)
            tl.store(y_ptr + n * osn + row_out, y[0], mask=m)
    elif SPLIT:
        st = _fold_states(IDENTITY(tl.zeros([ROWS], tl.float32)), parts, flat, n_split,
                          split * 0, n_split, row_ok, COMBINE, SCAN_TILE, TAKE, LOAD_STATE, PBLOCK)
        lo, hi = _chunk_bounds(split, chunk, N, N64)
        _map_range(x_ptr, y_ptr, lo, hi, sn, osn, row_in, row_out, row_ok,
                   PREP(*st), FMAP, K, LANES, ROWS, MASK_ROWS)
    elif FUSED:
        idx = tl.arange(0, K)[:, None, None] * LANES + tl.arange(0, LANES)[None, :, None]
        n = lo + idx
        off_in = n * sn + row_in[None, None, :]
        off_out = n * osn + row_out[None, None, :]
        valid = tl.broadcast_to(n < N, [K, LANES, ROWS])
        if MASK_ROWS:
            m = valid & row_ok[None, None, :]
        else:
            m = valid
        x = tl.load(x_ptr + off_in, mask=m, other=0.0).to(tl.float32)
        pos = tl.broadcast_to(n.to(tl.int32), [K, LANES, ROWS])
        if ORDERED:
            lane_last = tl.arange(0, LANES)[:, None] == LANES - 1
            st = TAKE(lane_last, 0, *SCAN_TILE(*TILE_STATE(x, pos, valid), 0, False))
        else:
            st = REDUCE_TILE(*TILE_STATE(x, pos, valid), 0)        # [ROWS]
        y = FMAP(x, *PREP(*st))
        tl.store(y_ptr + off_out, y[0], mask=m)
    else:
        st = _row_state((x_ptr,), lo, lo + N, lo, (sn,), rows_in, row_ok,
                        TILE_STATE, COMBINE, REDUCE_TILE, SCAN_TILE, TAKE, LOAD_STATE, IDENTITY,
                        K, LANES, ROWS, MASK_ROWS, ORDERED, False)
        _map_range(x_ptr, y_ptr, lo, lo + N, sn, osn, row_in, row_out, row_ok,
                   PREP(*st), FMAP, K, LANES, ROWS, MASK_ROWS)
