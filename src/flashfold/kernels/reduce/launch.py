"""Launchers: geometry, heuristics and launch plans for the templates of :mod:`.kernels`.

Every launcher builds a *plan*, a list of :class:`Launch` (kernel, grid, arguments), and
runs it; :func:`plan_reduce` & co. return the plan without running it, so the kernels
can be compiled ahead of time for an sm_90 target on a machine without a GPU
(:mod:`.aot`). The heuristics below are plain functions of the shape (no autotuning:
compile time on the device is precious); tests monkeypatch them to force each branch.

Geometry (see :mod:`.kernels`): the reduced dim ``(N, sn)``; batch dims merged wherever
their strides allow, in both the input and the output, into at most three
``(B0, B1, B2)``. Non-contiguous inputs are read through their strides; only an input
with more than three unmergeable batch dims is copied (``.contiguous()``), after which
two always suffice. A monoid of several inputs takes them as a tuple of tensors of one
shape (broadcast views): one geometry, decided on that shape, with each input's strides
through the same merge (a dim merges only where it does for every input; a broadcast
input has stride 0); the heuristics read the *lead* input's strides (the one broadcast
least), tiles are sized for the widest dtype, and rows are not realigned (``ALIGN``).

Performance reasoning (H200: 132 SMs, HBM3e ~4.8 TB/s, copy measured 4.25 TB/s)
--------------------------------------------------------------------------------
16K x 16K fp32 is 1 GiB: a reduction at 3.8 TB/s takes 0.28 ms, a scan or softmax (read
+ write) 0.57 ms. Per SM at ~1.9 GHz that is ~1.9 fp32 elements per clock for scans and
maps (3.8 for reductions), against 16 SFU ops (exp2/lg2/rcp) and 4 warp-instructions
(128 thread-instructions) per clock: at most ~8 exp2 and ~65 instructions per element
for a scan, half that for a reduction, and less in practice (issue is never perfect).
Instruction counts below are read off the sm_90 SASS (:mod:`.aot`).

* Long rows (``N >= 1024``, reduced dim contiguous): one row per program, tiles
  ``[K, LANES]`` with ``LANES = 16 B/elem x 32 x warps`` (one 16-byte vector per thread
  and lane group) and 8K-element tiles (``K = 8`` fp32): ``K`` independent 16-byte loads
  per thread per tile, the block lift in registers, lane accumulators combined
  elementwise, one cross-warp reduction per row. SASS per element: SUM 1.6
  instructions, LOGSUMEXP2 6.8 (1.25 exp2), WELFORD 5.8, ARGMAX 8.5; 42-83 registers,
  2-5 programs (16-40 warps, 64-160 KB of loads in flight) per SM: memory-bound.
* Few rows (``programs < 2·SMs``): split-K, chunks of whole tiles, partial states to a
  ``[rows, n_split]`` scratch, then an in-order ``FROM_STATES`` pass.
* Short rows: ``LANES = 1``, ``K = next_pow2(N)``, ``K·ROWS = 1024`` elements per program.
* Reduced dim strided, rows contiguous (dim 0 of a row-major matrix): ``ROWS``
  contiguous rows per program, vectorized along them, ``K`` in registers.
* Softmax: rows up to 16K fp32 / 32K 16-bit elements are fused (read once, kept in
  registers, written once): 16 warps x 32 values per thread, ``maxnreg=64`` for two
  programs per SM; ~19 instructions and 2.8 SFU ops per element. Longer rows: a
  statistics loop and a map loop (the re-read likely from L2); few long rows: split.
* Scans: the block scan (``tl.associative_scan``, coalesced 16-byte accesses, carry
  across 4096-element tiles) for cheap combines: cumsum measured 3.97 TB/s on 16K x 16K
  fp32. For combines with SFU work the chunked scan (lanes own four 4-element vectors,
  ~2.75 combines per element against ~5): logcumsumexp 3.15 TB/s at 2048 elements and 4
  warps, with the one-exp2 combine (LOGSUMEXP2_SCAN) and ``lg2.approx`` in the finalize
  (45 SASS instructions per element; 71 and 12.6 exp2 with the two-exp2 combine and
  libdevice's log2). Reverse scans load in reversed order (scalar, coalesced).
* Scans of few long rows: a single pass with a decoupled look-back (chunks of
  ``LOOKBACK_TILES`` tiles, ticket-ordered; the chunk is folded, then re-read from L2 and
  scanned): 4.1 TB/s for 1 x 2^26 cumsum and logcumsumexp; reverse ones reduce-then-scan.
* Rows of at most 16 contiguous elements: one row per thread, folded in registers
  (2^20 x 7 fp32, sm_90 SASS: argmax 296 instructions per thread for 2 rows, ~5 us of
  issue for the whole grid; the tile path it replaced: 1056 instructions per thread of 8
  elements, <= 37 us).
* Long rows that start off 16-byte boundaries (4096 x 12345 fp32): realigned tiles
  (``ALIGN_ROWS``: vector loads, masked per vector at the head and tail), faster than
  scalar loads in kernel time (see :data:`ALIGN_ROWS`).

Eager timings and host time (the H200 runs of 2026-11-29)
---------------------------------------------------------
``do_bench`` times a call between two events, after a 256 MB memset that flushes L2 (~0.07
ms). A flashfold call spends host time in Python (checks, plan) and in Triton's launch
(binding ~50 arguments and constexprs); when that exceeds the memset plus the kernels'
time, the GPU idles inside the timed window and the excess is measured as kernel time.
The decode benchmark measured ~0.15 ms of host time per flashfold call on that machine
(eager vs CUDA-graph replays). The reductions rows that swing between runs are the ones
with little GPU work: 2^20 x 7 (<= 37 us of issue and ~10 us of DRAM for either plan,
measured 0.12-0.40 ms), 4096 x 12345, and, with byte-identical kernels and grids in both
runs, amax/sum over 16K x 16K bf16 (0.128 -> 0.224 / 0.129 -> 0.177 ms) and the dim-0
reductions (0.26 -> 0.35 ms). Plans here are chosen from rows whose time is the kernels';
``benchmarks/reductions.py`` also times every row from a CUDA graph to separate the two.
``benchmarks/host_overhead.py`` measured the host time itself: 187 us per
``flashfold.argmax`` over 2^20 x 7, of which ~120 us in Triton's ``kernel[grid]`` (binding
and hashing ~60 arguments and constexprs) against 8.6 us for a compiled kernel's launcher
called directly; launches go through :mod:`flashfold.kernels.launcher`, which keys the
compiled kernel itself (``docs/notes/reductions.md``, "Kernel time, not eager time,
decides a plan"; ``docs/notes/host_time.md``).

Plan cache
----------
Building a plan (geometry, heuristics, split, buffers, the ~40 arguments of each launch)
took 64 of the ~95 us of host time of ``flashfold.argmax`` over 2^20 x 7 on the H200
host (cProfile, which inflates ~2x). The launchers (``launch_*``) therefore replay a plan
recorded for the same signature (``_planned``, with the shared mechanism of
:mod:`flashfold.kernels.plans`): the key holds the operation; the monoid or row map, by
identity (the entry keeps it); each input's shape, strides, dtype, device and whether its
address is 16-byte aligned (all that the planners, :func:`_align` included, and Triton's
specialization read of it); the dim, the finalize parameters, the scan's direction, the
output dtype (and ``TRITON_INTERPRET``). A hit allocates new outputs and scratch (split-K
partial states; the look-back's flags zeroed, its ticket a view of them) and rebuilds
each launch's arguments with them and the call's inputs at the positions recorded when
the plan was built: no tensor of an earlier call is returned or kept. All four launchers
use it (segment offsets are an input like ``x``: their values are not part of a plan).
Not cached: plans that read a contiguous copy of the input (more than three unmergeable
batch dims) and finalize parameters that are not plain numbers. The cache is bypassed
while any global that the planners read (found from their code: heuristics,
``ALIGN_ROWS``, ``LOOKBACK``..., which tests monkeypatch) differs from what it was at
import, and with ``FLASHFOLD_PLAN_CACHE=0``. At most :data:`PLAN_CACHE_SIZE` entries,
dropped wholesale when full; one dict lookup and store per call, and each call allocates
its own buffers, so threads may share it. ``plan_*`` still build a plan on every call
(:mod:`.aot`, tests). The launches of a cached plan share a launcher memo
(:attr:`Launch.memo`): once the plan's first run has resolved its compiled kernel, the
replays' launches skip the launcher's key.

Host time per call up to the kernel launch (``_run`` a no-op) on the 2-core CPU dev
machine, CPU tensors, ``PYTHONPATH=src python benchmarks/reduce_plan_keys.py`` (best of
7 interleaved repeats of 2,000 calls, and of 4 runs; us; before: commit 8acb2f1 timed
by the same harness)::

    call                            launcher: before  hit    public function: before  hit
    argmax 2^20 x 7                           20.0    6.9                     31.4   16.9
    softmax 64 x 1024                         16.5    6.7                     18.3    8.2
    logsumexp 2 x 40000 (split-K)             38.9   12.3                     54.8   21.0
    cumsum 1 x 40000 (look-back)              35.9   16.3                     46.7   23.6

(other processes loaded the machine: single runs varied up to ~1.5x). With the cache off
the launchers matched "before" within that noise. The rest of ``flashfold.argmax``'s hit
was the public function's checks and views (``api/reductions``), ~10 us.

Then the hits themselves were cut (same harness, best of 4 runs interleaved with commit
fe060d6 on the same machine, us): a replay runs a straight-line function generated for
its plan (:mod:`flashfold.kernels.plans`) instead of a recursive fill of a template; the
public functions check a monoid once per monoid, import this module once, slice one dim
out of the shape and skip ``reshape`` to an output's own shape::

    call                            launcher hit: before  after    public hit: before  after
    argmax 2^20 x 7                               8.1    5.7                 17.9    9.1
    softmax 64 x 1024                             7.9    6.3                  9.8    6.6
    logsumexp 2 x 40000 (split-K)                12.6    9.3                 21.8   12.0
    cumsum 1 x 40000 (look-back)                 15.9   13.2                 23.0   14.7

What remains of the argmax hit (~9 us): the allocation of its output (~1.6 us on the CPU),
the watched-globals check (``PlanCache.caching``, ~1 us: 55 globals compared), the
signature and key (~1 us), the replay function (~0.7 us), and the public function's
checks, view and result (~3 us).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from ...algebra.monoid import Monoid
from .. import launcher, plans
from . import kernels as K_
from .generated import ReduceFunctions, RowMap, output_kinds, reduce_functions

__all__ = ["Launch", "Geometry", "geometry", "reduce_config", "scan_config", "normalize_config",
           "split_plan", "states_config", "Config", "costly_combine", "plan_reduce", "plan_segment_reduce", "plan_scan", "plan_normalize",
           "launch_reduce", "launch_segment_reduce", "launch_scan", "launch_normalize",
           "num_sms", "fin_args", "FLOAT_DTYPES", "LOOKBACK", "plan_cache_info",
           "plan_cache_clear", "PLAN_CACHE_SIZE"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_I31 = 2**31


# --- geometry ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Geometry:
    """The reduced dim and at most three merged batch dims, with input/output strides.

    ``sn``, ``s``: the input's strides; with several inputs, the *lead* input's (the one
    with the most non-zero strides: what the heuristics read), and ``inputs`` holds every
    input's ``(sn, s)`` (empty for one input)."""
    N: int
    sn: int
    osn: int
    B: tuple            # (B0, B1, B2)
    s: tuple            # input strides of B
    o: tuple            # output strides of B
    inputs: tuple = ()  # several inputs: ((sn, s) of each)

    @property
    def rows(self) -> int:
        return self.B[0] * self.B[1] * self.B[2]

    def in_args(self) -> tuple:
        """``(sn, s0, s1, s2)`` as the kernels take them: tuples, one entry per input."""
        ins = self.inputs
        if not ins:
            s = self.s
            return (self.sn,), (s[0],), (s[1],), (s[2],)
        return (tuple([i[0] for i in ins]), tuple([i[1][0] for i in ins]),
                tuple([i[1][1] for i in ins]), tuple([i[1][2] for i in ins]))

    @property
    def max_sn(self) -> int:
        """The largest ``|sn|`` of the inputs (int32 offsets along the dim must hold it)."""
        return max(abs(i[0]) for i in self.inputs) if self.inputs else abs(self.sn)


def _merge(shape, in_sts, out_st, dim):
    """Batch dims (not ``dim``, size > 1) as ``[size, in_strides, out_stride]`` groups
    (``in_strides``: one per input of ``in_sts``), an outer dim merged into the group after
    it whenever every stride pattern allows it (a broadcast input's stride 0 merges only
    with another of its broadcast dims)."""
    groups: list = []
    for i in range(len(shape)):
        if i == dim or shape[i] == 1:
            continue
        ins = tuple([int(st[i]) for st in in_sts])
        if groups:
            size, si, so = groups[-1]
            if so == out_st[i] * shape[i] and all(a == b * shape[i] for a, b in zip(si, ins)):
                groups[-1] = [size * shape[i], ins, out_st[i]]
                continue
        groups.append([int(shape[i]), ins, int(out_st[i])])
    return groups


def geometry(shape, in_strides, out_strides, dim) -> Geometry | None:
    """Merge the batch dims of ``shape`` around ``dim``; ``None`` if more than three remain.

    ``in_strides``: the input's strides, or for several inputs of that shape a list of
    them (one per input: a group of dims merges only where it does for every input).
    ``out_strides`` has the full rank; its entry at ``dim`` is the output stride along the
    dim (scans, maps) or anything (reductions, where the dim disappears). Memoized: the
    host time of a launch matters for small problems.
    """
    several = len(in_strides) > 0 and not isinstance(in_strides[0], int)
    ins = (tuple(tuple(int(v) for v in st) for st in in_strides) if several else
           (tuple(int(v) for v in in_strides),))
    return _geometry(tuple(int(v) for v in shape), ins, tuple(int(v) for v in out_strides),
                     int(dim))


@functools.lru_cache(maxsize=4096)
def _geometry(shape, in_strides, out_strides, dim) -> Geometry | None:
    groups = _merge(shape, in_strides, out_strides, dim)
    if len(groups) > 3:
        return None
    k = len(in_strides)
    while len(groups) < 3:
        groups.insert(0, [1, (0,) * k, 0])
    B = tuple(g[0] for g in groups)
    per = tuple((int(st[dim]), tuple(g[1][j] for g in groups)) for j, st in enumerate(in_strides))
    # the lead input: not broadcast along the dim, then the most non-zero strides
    lead = max(range(k), key=lambda j: (per[j][0] != 0, sum(v != 0 for v in per[j][1]), -j))
    return Geometry(int(shape[dim]), per[lead][0], int(out_strides[dim]), B, per[lead][1],
                    tuple(g[2] for g in groups), per if k > 1 else ())


# --- heuristics -------------------------------------------------------------------------

def num_sms(device) -> int:
    """Streaming multiprocessors of ``device`` (a small number on the CPU interpreter)."""
    device = torch.device(device)
    return launcher.sm_count(device) if device.type == "cuda" else 4


def _p2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass(frozen=True)
class Config:
    """Tile ``[K, LANES, ROWS]`` (scans: ``[BLOCK=K, ROWS]``), warps, stages, register cap;
    ``vec > 0`` selects the chunked (lane-owned vectors) forward scan with that width;
    ``small`` the one-row-per-thread path for rows of at most ``K`` (<= 16) elements;
    ``prefetch`` (chunked scans) loads the next full tile before scanning the current;
    ``vfold`` (ordered reductions) gives each lane ``K`` consecutive elements, folded in
    order in registers, and scans the lanes once per tile (see ``kernels._row_state``)."""
    K: int
    LANES: int
    ROWS: int
    num_warps: int
    num_stages: int = 1
    maxnreg: int | None = None
    vec: int = 0
    small: bool = False
    prefetch: bool = False
    vfold: bool = False


#: elements of a short-row tile (K x ROWS): 8 per thread at 4 warps
_SHORT_TILE = 1024
#: rows of at most this many contiguous elements take the one-row-per-thread path: the
#: tile path spreads such a row over threads (8 for N = 7) and reduces it with shuffles.
#: sm_90 SASS for 2^20 x 7 fp32, instructions per thread x warps of the grid, tile path
#: -> this path: argmax 1056 x 32K -> 296 x 16K, logsumexp 1000 x 32K -> 384 x 16K, cumsum
#: 608 x 32K -> 152 x 16K (<= 37 us -> <= 7 us of issue at 0.93e12 warp-instructions/s).
#: Eager timings of these rows moved both ways between measurements (host-bound: see the
#: module notes): argmax 0.349 -> 0.216 ms, cumsum 0.306 -> 0.184, logsumexp 0.121 ->
#: 0.341, softmax 0.282 -> 0.401; the kernels cannot account for either direction (0.1-0.4
#: ms against <= 0.05 ms of GPU work), so the path stays on its instruction counts
SMALL_N = 16
#: rows per program on that path (one per thread at 4 warps): argmax 2^20 x 7 measured
#: 0.017 ms from CUDA graphs with 128 against 0.018 with 256 and 0.021 with 512, each of
#: four times on the H200 (``docs/notes/reductions.md``, "Short rows and awkward shapes")
_SMALL_ROWS = 128


def reduce_config(g: Geometry, elsize: int, ordered: bool, costly: bool = False,
                  fields: int | None = None) -> Config:
    """Tile shape ``[K, LANES, ROWS]`` and warps for a reduction (see module docstring).

    ``costly``: the monoid has a block lift and a combine with SFU work (LOGSUMEXP2,
    WELFORD); ``fields``: its state's fields (``None``: not given; taken as one for row
    plans, and as more than one for column plans). In 16-bit dtypes such rows run below the
    copy (74% and 66% for bf16 logsumexp and var_mean at K = 4), and K = 8 halves the lane
    combines per element (9.5 -> 8.0 and 9.4 -> 7.1 instructions). Measured on 16K x 16K
    bf16 (K = 4 -> K = 8): logsumexp 3133 -> 3387 GB/s (64 -> 80 registers: 4 -> 3
    programs of 8 warps per SM), var_mean 2777 -> 2734 (75 -> 105 registers: 3 -> 2
    programs per SM). So K = 8 only for states of at most two fields; Welford's three keep
    K = 4 (``docs/notes/reductions.md``, "Short rows and awkward shapes"). Cheap monoids
    (MAX, SUM) never take K = 8."""
    vec = max(1, 16 // elsize)
    N, B2 = max(g.N, 1), g.B[2]
    if g.sn == 1 and N <= SMALL_N:
        return Config(_p2(N), 1, _SMALL_ROWS, 4, small=True)
    if ordered:
        return _ordered_config(N, B2, vec if g.sn == 1 and VFOLD else 0)
    if g.sn != 1 and g.s[2] == 1 and B2 > 1:
        # columns: rows contiguous in memory, the reduced dim strided: 4 warps over 512
        # columns (8 warps over 1024 helped sum over dim 0 of 16K x 16K, 0.263 against
        # 0.269 ms on the H200, but slowed logsumexp over dim 0, 0.265 -> 0.272, and
        # cumsum over dim 0, whose split pass uses this plan, 0.991 -> 1.027). One-field
        # states load 16 rows per step instead of 8 (more loads in flight: sum over dim
        # 0 0.254 against 0.255 ms, torch 0.254); states of more fields keep 8
        # (registers). docs/notes/reductions.md, "Column reductions"
        rows = min(_p2(B2), vec * 32 * 4)
        k = max(1, min(_p2(N), (8192 if fields == 1 else 4096) // rows))
        return Config(k, 1, rows, 4)
    if N >= 1024:
        warps = 8 if N >= 4096 else 4
        lanes = min(vec * 32 * warps, _p2(N))
        kmax = 16384 if costly and elsize < 4 and (fields or 1) <= 2 else 8192
        k = max(1, min(8, kmax // lanes, _p2(N) // lanes))
        return Config(k, lanes, 1, warps)
    k = _p2(N)
    rows = max(1, min(_p2(B2), _SHORT_TILE // k))
    return Config(k, 1, rows, 4)


#: ordered reductions of contiguous rows fold one 16-byte vector per lane in registers
#: (``Config.vfold``). sm_90 SASS per element of the in-order reduce over 16K x 16K fp32
#: (loop and tail bodies over their elements): AFFINE_HALF ~64 -> ~20, MAX_PREFIX_SUM
#: ~70 -> ~24, the two-input recurrence ~66 -> ~24, MATMUL2 ~146 -> ~49; the lanes' scan
#: across threads, which dominated, runs once per vector instead of once per element.
#: Switchable (a variant of ``benchmarks/reductions.py``) until the H200 has timed both
VFOLD = True


def _ordered_config(N: int, B2: int, vec: int) -> Config:
    """Tile of an in-order reduction: lanes of consecutive elements, scanned in order.
    ``vec > 0`` (contiguous rows, :data:`VFOLD`): each lane folds ``vec`` consecutive
    elements (one 16-byte vector) in registers first, 512 lanes of them per row."""
    if vec and N >= 4 * vec:
        lanes = min(_p2(N) // vec, 512)
        rows = max(1, min(_p2(B2), 2 * _SHORT_TILE // (vec * lanes)))
        return Config(vec, lanes, rows, 4, vfold=True)
    lanes = min(_p2(N), 512)
    rows = max(1, min(_p2(B2), _SHORT_TILE // lanes))
    return Config(1, lanes, rows, 4)


def states_config(g: Geometry, ordered: bool) -> Config:
    """Tile for the second split-K pass, which folds ``n_split`` states per row."""
    N, B2 = max(g.N, 1), g.B[2]
    if ordered:
        lanes = min(_p2(N), 256)
        return Config(1, lanes, max(1, min(_p2(B2), _SHORT_TILE // lanes)), 4)
    k = min(_p2(N), 256)
    return Config(k, 1, max(1, min(_p2(B2), _SHORT_TILE // k)), 4)


def split_plan(g: Geometry, tile: int, n_prog: int, sms: int, min_tiles: int = 2):
    """``(n_split, chunk)`` for split-K: split when fewer than ``2·sms`` programs would run
    and each chunk keeps at least ``min_tiles`` whole tiles.

    Chunks are an odd number of tiles: the programs of a split run in lockstep, and with
    a power-of-two chunk (512 KB for 1 x 2^26 fp32) they might all hit the same HBM
    channels at once (2.0 TB/s was measured for 1 x 2^26 sum and logsumexp with them).
    Odd chunks measured no change (sum 0.130 -> 0.129 ms, logsumexp 0.149 -> 0.149): those
    rows are bound by something else, likely the host time of a two-launch call (module
    notes). Kept: no row measured slower with it.

    The split aims at ``4·sms`` programs, and at ``8·sms`` when the reduced dim is strided
    (columns): a column program's loads in flight are one ``[K, 512]`` tile, and sum over
    dim 0 of 16K x 16K fp32 measured 0.268-0.270 ms with 17 chunks (544 programs) against
    0.261 with 33 (1,056) and 0.272 with 64 (H200; torch 0.259; ``docs/notes/reductions.md``,
    "Column reductions")."""
    target = (8 if g.sn != 1 else 4) * sms
    if n_prog >= 2 * sms or g.N < 2 * min_tiles * tile:
        return 1, max(g.N, 1)
    want = -(-target // n_prog)
    n_split = max(1, min(want, g.N // (min_tiles * tile)))
    tiles = -(-(-(-g.N // n_split)) // tile)
    tiles += 1 - tiles % 2                       # odd
    chunk = tiles * tile
    n_split = -(-g.N // chunk)
    return n_split, chunk


#: combine ops that run on the SFU (or expand to many instructions): a scan whose
#: combine has them is compute-bound and wants the fewest combines per element
_COSTLY = ("exp", "exp2", "log", "log2", "log1p", "expm1", "div", "sqrt", "pow", "tanh",
           "sigmoid")


def costly_combine(monoid: Monoid) -> bool:
    """Whether ``monoid``'s combine runs SFU-class ops (see :data:`_COSTLY`)."""
    hit = _COSTLY_BY_ID.get(id(monoid))
    if hit is None or hit[0] is not monoid:
        hit = _COSTLY_BY_ID[id(monoid)] = (
            monoid, any(n.op in _COSTLY for n in monoid.combine_graph.nodes()))
    return hit[1]


_COSTLY_BY_ID: dict = {}


def _costly_block(monoid: Monoid) -> bool:
    return monoid.block_lift is not None and costly_combine(monoid)


def scan_config(g: Geometry, elsize: int, reverse: bool = False, costly: bool = False,
                block_scan: bool = False) -> Config:
    """Tile ``[BLOCK, ROWS]`` (BLOCK stored in ``K``) and warps for a scan.

    ``block_scan``: the monoid's block scan serves this direction (see ``_scan_step``):
    the combine then runs only between tiles, so costly monoids take the block path too,
    in tiles of 1024 on one warp: each tile reduces its max, scans and checks exactness
    across the block, and within one warp those are shuffles, not shared memory and
    barriers. H200, logcumsumexp 16K x 16K (kernel time, ``benchmarks/reductions.py
    --variants logcumsumexp``): fp32 1024 x 1 warp 0.543 ms (3,964 GB/s, 93% of the copy)
    against 0.639 for the chunked scan it replaced, bf16 0.351 against 0.505; other tiles
    and warps were slower (``docs/notes/reductions.md``, "Scans").

    H200, 16K x 16K fp32 (benchmarks/logs): for a cheap combine (cumsum) the block scan
    (``tl.associative_scan``, coalesced 16-byte accesses) of 4096-element tiles at 8 warps
    reached 3.97 TB/s, the chunked scan 2.7-2.9: its lanes own consecutive vectors, so a
    warp's access is strided and each sector is fetched by several instructions (block
    scan: 4011 GB/s fp32, 3736 bf16). Without a block scan of the monoid's own, a costly
    combine (logcumsumexp: exp2 in the combine) takes the chunked scan (~2.75 combines per
    element against ~5): 3.15 TB/s at 2048 elements and 4 warps, against 2.5 at 8 warps
    and 1.96 for the generic block scan. Reverse scans load in reversed order (scalar,
    coalesced) with the block scan.

    Rows that start off 16-byte boundaries (4096 x 12345 fp32) take the same rule: in
    kernel time (CUDA-graph replays, H200) the block scan did 0.149 ms against 0.202 for
    the chunked scan of 4096 elements at 8 warps; eager times that pointed the other way
    (0.221 vs 0.294) were host time (``docs/notes/reductions.md``, "Short rows and awkward
    shapes").
    """
    vec = max(1, 16 // elsize)
    N, B2 = max(g.N, 1), g.B[2]
    if g.sn != 1 and g.s[2] == 1 and B2 > 1:
        rows = min(_p2(B2), vec * 32 * 4)
        return Config(max(1, min(_p2(N), 2048 // rows)), 1, rows, 4)
    if g.sn == 1 and N <= SMALL_N:
        return Config(_p2(N), 1, _SMALL_ROWS, 4, small=True)
    if block_scan and not reverse and g.sn == 1 and N >= 512:
        # (reverse scans load scalars in reversed order; at 32 values per thread their
        # fallback scan spilled, so they keep the rule below: 8 per thread)
        return Config(min(_p2(N), 1024), 1, 1, 1)
    if costly and not block_scan and not reverse and g.sn == 1 and N >= 2048:
        # 4-element vectors whatever the dtype (8-element ones would hold 32 values per
        # thread in 16-bit dtypes, and spill). fp32: 1024-element tiles at 2 warps with
        # the next tile prefetched (H200, logcumsumexp 16K x 16K, kernel time: 0.639-0.641
        # ms, 3,350-3,363 GB/s, against 0.680 for 2048 at 4 warps with or without
        # prefetch, 0.794 for 1024 at 2 warps without). 16-bit: 2048 at 4 warps (bf16:
        # 0.505 ms; the fp32 plan took 0.539). docs/notes/reductions.md, "Scans"
        if elsize >= 4:
            return Config(1024, 1, 1, 2, vec=4, prefetch=True)
        return Config(2048, 1, 1, 4, vec=4)
    if N >= 512:
        warps = 8 if N >= 2048 else 4
        # costly combines (reverse logcumsumexp) spill at 16 values per thread
        return Config(min(_p2(N), 2048 if costly else 4096), 1, 1, warps)
    block = _p2(N)
    return Config(block, 1, max(1, min(_p2(B2), _SHORT_TILE // block)), 4)


def normalize_config(g: Geometry, elsize: int, ordered: bool) -> tuple[Config, bool]:
    """(tile config, fused): fused when the row fits one tile in registers.

    A fused 16K-fp32 row is 32 values per thread at 16 warps; ``maxnreg=64`` keeps two
    programs per SM (64 K registers), so one program's loads overlap the other's math.
    """
    vec = max(1, 16 // elsize)
    N = max(g.N, 1)
    if g.sn == 1 and N <= SMALL_N:
        return Config(_p2(N), 1, _SMALL_ROWS, 4, small=True), True
    if ordered:
        c = _ordered_config(N, g.B[2], 0)         # (row maps take no VFOLD tiles)
        return c, N <= c.LANES
    if g.sn == 1 and N >= 1024:
        limit = 16384 if elsize >= 4 else 32768
        if N <= limit:
            warps = 16 if N > 8192 else (8 if N > 2048 else 4)
            lanes = min(vec * 32 * warps, _p2(N))
            k = max(1, _p2(N) // lanes)
            return Config(k, lanes, 1, warps, maxnreg=64 if warps == 16 else None), True
    c = reduce_config(g, elsize, False)
    return c, c.K * c.LANES >= N


# --- plans ------------------------------------------------------------------------------

@dataclass
class Launch:
    """One kernel launch: ``kernel[grid](*args, **kwargs)`` (through
    :func:`flashfold.kernels.launcher.launch`)."""
    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict = field(default_factory=dict)
    #: the launcher's memo of the resolved compiled kernel (:func:`launcher.launch`):
    #: shared by the replays of a cached plan, whose launches all key alike
    memo: list = field(default_factory=lambda: [None], repr=False, compare=False)

    def __call__(self):
        launcher.launch(self.kernel, self.grid, self.args, self.kwargs, self.memo)


def _is_ordered(monoid: Monoid) -> bool:
    """A monoid that is not commutative needs the order-preserving (ORDERED) kernels."""
    return not monoid.commutative


def _fns(monoid: Monoid) -> ReduceFunctions:
    return reduce_functions(monoid)


def fin_args(monoid: Monoid, params: dict | None) -> tuple:
    """The finalize parameters of ``monoid`` as a tuple of floats, defaults filled in."""
    params = dict(params or {})
    names = [p for p, _ in monoid.params]
    unknown = set(params) - set(names)
    if unknown:
        raise TypeError(f"{monoid.name}.finalize got unknown parameters {sorted(unknown)}; "
                        f"it takes {names}")
    values = {**monoid.param_defaults, **params}
    return tuple(float(values[p]) for p in names)


def _out_dtype(kind: str, dtype: torch.dtype, float_dtype=None):
    if kind == "f":
        return float_dtype or dtype
    return torch.bool if kind == "b" else torch.int64


def _state_dtype(f) -> torch.dtype:
    return torch.float32 if f.dtype == "float" else torch.int32


def _opts(cfg: Config) -> dict:
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.maxnreg is not None and not _interpreting():
        opts["maxnreg"] = cfg.maxnreg
    return opts


_interpreting = launcher.interpreting


#: elements a tile may reach past the end of its range along the dim: a masked tail tile
#: (at most 16K elements in any plan here; a fused softmax row of ``N <= 32K`` elements
#: is one ``next_pow2(N) < N + 32K`` tile) or a realigned head (fewer than 16)
_N64_SLACK = 2**15


def _n64(g: Geometry, *extra) -> bool:
    """Whether element indices or offsets along the dim need int64: the last index a
    tile forms, ``N - 1 + slack`` (masked lanes included: an index that wrapped to a
    negative value would pass the ``n < hi`` mask), times the larger stride can reach
    2^31. Row bases, row indices and chunk starts of ``N64`` plans are int64 in the
    kernels; everything else is int32."""
    span = (max(g.N, 1) + _N64_SLACK) * max(g.max_sn, abs(g.osn), 1)
    return span >= _I31 or any(e >= _I31 for e in extra)


def _check_positions(fns: ReduceFunctions, g: Geometry, what: str = "the reduced or scanned dim"):
    """Monoids that read positions (ARGMAX, ARGMIN...) carry them in int32 state fields,
    so their dim (a segment, for segmented reductions, whose positions count from the
    segment's start) may have at most 2^31 elements (positions ``0 .. 2^31 - 1``): a
    longer one raises rather than returning wrapped indices."""
    if fns.has_position and g.N > _I31:
        raise ValueError(f"x: {fns.monoid.name} reads element positions, which kernels hold "
                         f"in int32: {what} has {g.N} elements, at most 2^31 = {_I31} are "
                         f"supported")


def _common(fns: ReduceFunctions):
    return dict(TILE_STATE=fns.tile_state, COMBINE=fns.combine, REDUCE_TILE=fns.reduce_tile,
                SCAN_TILE=fns.scan_tile, TAKE=fns.take, LOAD_STATE=fns.load_state,
                IDENTITY=fns.identity)


def _align(xs: tuple, g: Geometry, cfg: Config, align_rows: bool = True) -> int:
    """Vector width (elements) to realign long contiguous rows to, 0 when they already
    are or ``align_rows`` is off (the planners' default: :data:`ALIGN_ROWS`): rows whose
    start is not a multiple of 16 bytes (4096 x 12345 fp32) load as scalars otherwise.
    Monoids of one input only (several inputs' rows need not share a misalignment)."""
    if (cfg.ROWS != 1 or cfg.LANES == 1 or g.sn != 1 or cfg.small or not align_rows
            or len(xs) != 1):
        return 0
    x = xs[0]
    vec = max(1, 16 // x.element_size())
    if x.data_ptr() % 16:            # then no offset can make the addresses aligned
        return 0
    misaligned = any(st % vec for st, b in zip(g.s, g.B) if b > 1)
    return vec if misaligned and vec > 1 else 0


#: realign misaligned long rows (see :func:`_align`; the planners' default for
#: ``align_rows=``). In kernel time (CUDA-graph replays, H200, 4096 x 12345 fp32) the
#: realigned tiles beat scalar loads: logsumexp 0.067 vs 0.085 ms, var_mean 0.084 vs 0.092
#: (``docs/notes/reductions.md``, "Short rows and awkward shapes"). Switchable, and timed
#: both ways as a variant by benchmarks/reductions.py.
ALIGN_ROWS = True


def _reduce_launch(fns, src, outs, fin_args, seg, g: Geometry, o_split, n_split, chunk,
                   cfg: Config, *, from_states=False, state_out=False, segmented=False,
                   align_rows=True):
    """``src``: the inputs (a tuple), or the field buffers of states (``from_states``)."""
    n_inner = -(-g.B[2] // cfg.ROWS)
    grid = (g.B[0] * g.B[1] * n_inner * n_split,)
    sn, s0, s1, s2 = g.in_args()
    args = (tuple(src), tuple(outs), tuple(fin_args), seg,
            g.N, sn, g.B[1], g.B[2], s0, s1, s2, *g.o, o_split, n_inner, n_split, chunk)
    # in the kernel's parameter order: the launcher then passes them (and ``args``) to the
    # compiled kernel as one slice (see ``launcher._Plan``)
    vfold = cfg.vfold and not from_states
    kwargs = dict(TILE_STATE=fns.tile_fold if vfold else fns.tile_state, COMBINE=fns.combine,
                  REDUCE_TILE=fns.reduce_tile,
                  SCAN_TILE=fns.scan_tile, TAKE=fns.take, LOAD_STATE=fns.load_state,
                  STORE_STATE=fns.store_state, IDENTITY=fns.identity, FINALIZE=fns.finalize,
                  K=cfg.K, LANES=cfg.LANES, ROWS=cfg.ROWS,
                  ORDERED=_is_ordered(fns.monoid), FROM_STATES=from_states,
                  STATE_OUT=state_out, SEGMENTED=segmented,
                  MASK_ROWS=g.B[2] % cfg.ROWS != 0, N64=_n64(g),
                  LIFT_XP=fns.lift_xp, SELECT=fns.select, SMALL=cfg.small and not from_states,
                  ALIGN=0 if from_states else _align(src, g, cfg, align_rows),
                  **(dict(VFOLD=True) if vfold else {}), **_opts(cfg))
    return Launch(K_.reduce_kernel, grid, args, kwargs)


def _prepare(xs: tuple, dim: int, out_strides_fn):
    """``(xs, g)``: the geometry of the inputs ``xs`` (a tuple of tensors of one shape),
    decided on their shape with each input's strides; copied to contiguous tensors only
    if more than three batch dims cannot merge (documented; a broadcast input is then
    materialized)."""
    def geo(xs):
        return geometry(xs[0].shape, xs[0].stride() if len(xs) == 1 else
                        [t.stride() for t in xs], out_strides_fn(xs[0]), dim)
    g = geo(xs)
    if g is None:
        xs = tuple(t.contiguous() for t in xs)   # documented: >3 unmergeable batch dims
        g = geo(xs)
    return xs, g


def _as_inputs(fns: ReduceFunctions, x) -> tuple:
    """``x`` as the tuple of the monoid's data inputs: a tensor (one input) or a tuple of
    ``fns.n_inputs`` tensors of one shape (broadcast views: the launchers take each
    input's strides, stride 0 included), on one device. Raises ValueError naming ``x``."""
    xs = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    if len(xs) != fns.n_inputs:
        raise ValueError(f"x: {fns.monoid.name!r} takes {fns.n_inputs} data inputs, got "
                         f"{len(xs)} tensors")
    for j, t in enumerate(xs[1:], 1):
        if t.shape != xs[0].shape:
            raise ValueError(f"x[{j}]: shape {tuple(t.shape)}, but x[0] has "
                             f"{tuple(xs[0].shape)}; the kernels take inputs of one shape "
                             f"(expand them: broadcast views are read through their strides)")
        if t.device != xs[0].device:
            raise ValueError(f"x[{j}] is on {t.device}, x[0] on {xs[0].device}")
    return xs


def _in_dtype(xs: tuple) -> torch.dtype:
    """The inputs' promoted dtype (the float outputs' dtype)."""
    dtype = xs[0].dtype
    for t in xs[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _elsize(xs: tuple) -> int:
    """Bytes per element that tiles are sized for: the widest input's (16-byte vectors
    of it; narrower inputs load narrower vectors)."""
    return max(t.element_size() for t in xs)


def _reduced_out_strides(x: torch.Tensor, dim: int):
    shape = [s for i, s in enumerate(x.shape) if i != dim]
    st = _contig_strides(shape)
    st.insert(dim, 0)
    return st


def _contig_strides(shape):
    return list(_contig_strides_t(tuple(int(v) for v in shape)))


@functools.lru_cache(maxsize=4096)
def _contig_strides_t(shape):
    st, acc = [], 1
    for s in reversed(list(shape)):
        st.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(st))


def _pblock(n_split: int, rows: int) -> int:
    """States folded per step of a carry loop, [PBLOCK, ROWS]: at most 32 x ROWS <= 4096.
    (With 256 or more, ptxas compiled the chunked LOGSUMEXP2 scan into 32 registers and
    6 KB of spills; 32 gives ~90 registers and none. The loop is a few steps anyway.)"""
    return max(1, min(_p2(n_split), 32, 4096 // rows)) if n_split > 1 else 1


_DUMMIES: dict = {}


def _dummy_parts(monoid: Monoid, device):
    """Placeholder state buffers for launches that do not read them (no allocation per call)."""
    key = (tuple(f.dtype for f in monoid.fields), str(device))
    hit = _DUMMIES.get(key)
    if hit is None:
        hit = _DUMMIES[key] = tuple(
            plans.constant(torch.empty((1, 1), dtype=_state_dtype(f), device=device))
            for f in monoid.fields)
    return hit


#: a buffer that a plan writes (an output or scratch; zeroed when its kernels need that),
#: noted while a plan is recorded for the plan cache
_new = plans.new


def _state_buffers(monoid: Monoid, rows: int, n_split: int, device):
    return tuple(_new((rows, n_split), _state_dtype(f), device) for f in monoid.fields)


def _parts_strides(g: Geometry, n_split: int):
    """Strides of (B0, B1, B2) in the [rows, n_split] partial-state buffers."""
    return (g.B[1] * g.B[2] * n_split, g.B[2] * n_split, n_split)


def plan_reduce(monoid: Monoid, x: torch.Tensor, dim: int, params=None, *, sms=None,
                align_rows=None, config=None):
    """(plan, outputs): reduce ``x`` over ``dim`` (outputs have the batch shape).

    Every planner takes, by keyword, what its decisions depend on beyond the input, so a
    caller planning for another GPU or another variant passes it instead of setting a
    module global: ``sms``, the streaming multiprocessors the split decisions assume
    (default :func:`num_sms` of ``x.device``); ``align_rows``, realign misaligned long rows
    (default :data:`ALIGN_ROWS`, see :func:`_align`); ``config``, the first pass's tile
    :class:`Config` (default :func:`reduce_config`'s choice)."""
    align_rows = ALIGN_ROWS if align_rows is None else align_rows
    fns = _fns(monoid)
    fargs = fin_args(monoid, params)
    xs = _as_inputs(fns, x)
    dim = dim % xs[0].dim()
    xs, g = _prepare(xs, dim, lambda t: _reduced_out_strides(t, dim))
    x = xs[0]
    out_shape = [s for i, s in enumerate(x.shape) if i != dim]
    dtype = _in_dtype(xs)
    outs = tuple(_new(out_shape, _out_dtype(k, dtype), x.device) for k in output_kinds(monoid))
    if g.rows == 0:
        return [], outs
    _check_positions(fns, g)
    cfg = config or reduce_config(g, _elsize(xs), _is_ordered(monoid), _costly_block(monoid),
                                  len(monoid.fields))
    n_prog = g.B[0] * g.B[1] * -(-g.B[2] // cfg.ROWS)
    n_split, chunk = split_plan(g, cfg.K * cfg.LANES, n_prog, sms or num_sms(x.device))
    if n_split == 1:
        return [_reduce_launch(fns, xs, outs, fargs, x, g, 0, 1, max(g.N, 1), cfg,
                               align_rows=align_rows)], outs
    # split-K: partial states [rows, n_split], then an in-order combine of each row's states
    parts = _state_buffers(monoid, g.rows, n_split, x.device)
    pst = _parts_strides(g, n_split)
    gp = Geometry(g.N, g.sn, 0, g.B, g.s, pst, g.inputs)
    first = _reduce_launch(fns, xs, parts, (), x, gp, 1, n_split, chunk, cfg, state_out=True,
                           align_rows=align_rows)
    gs = Geometry(n_split, 1, 0, g.B, pst, g.o)
    cfg2 = states_config(gs, _is_ordered(monoid))
    second = _reduce_launch(fns, parts, outs, fargs, x, gs, 0, 1, n_split, cfg2, from_states=True)
    return [first, second], outs


def plan_segment_reduce(monoid: Monoid, x: torch.Tensor, offsets: torch.Tensor, dim: int,
                        params=None, *, sms=None, align_rows=None):
    """(plan, outputs): fold ``x[..., offsets[j]:offsets[j+1], ...]`` along ``dim`` for
    each segment ``j``; outputs have ``x``'s shape with ``dim`` of size ``len(offsets)-1``.
    ``sms``, ``align_rows``: as :func:`plan_reduce`."""
    align_rows = ALIGN_ROWS if align_rows is None else align_rows
    fns = _fns(monoid)
    fargs = fin_args(monoid, params)
    xs = _as_inputs(fns, x)
    x = xs[0]
    dim = dim % x.dim()
    S = offsets.numel() - 1
    out_shape = list(x.shape)
    out_shape[dim] = S
    dtype = _in_dtype(xs)
    outs = tuple(_new(out_shape, _out_dtype(k, dtype), x.device) for k in output_kinds(monoid))
    ost = _contig_strides(out_shape)
    xs, g = _prepare(xs, dim, lambda t: ost)
    x = xs[0]
    if g.rows == 0 or S == 0:
        return [], outs
    # tiles sized for the average segment
    g_avg = Geometry(max(1, g.N // S), g.sn, g.osn, g.B, g.s, g.o, g.inputs)
    cfg = reduce_config(g_avg, _elsize(xs), _is_ordered(monoid))
    ordered = _is_ordered(monoid)
    if cfg.small:                        # segments may be longer than the average
        cfg = Config(cfg.K, 1, max(1, min(_p2(g.B[2]), _SHORT_TILE // cfg.K)), 4)
    # few segments x row blocks: narrower row blocks (down to 32) to fill the SMs (at
    # 2·SMs programs, 2^20 x 256 in 256 segments ran at 1.77 TB/s on the H200, 0.82x torch)
    sms = sms or num_sms(x.device)
    while (cfg.ROWS > 32 and S * g.B[0] * g.B[1] * -(-g.B[2] // cfg.ROWS) < 4 * sms):
        rows = cfg.ROWS // 2
        k = min(cfg.K * 2, max(cfg.K, 2048 // rows)) if cfg.LANES == 1 else cfg.K
        cfg = Config(k, cfg.LANES, rows, cfg.num_warps, vfold=cfg.vfold)
    if ordered and cfg.K > 1 and not cfg.vfold:
        # one lane of K consecutive elements (K elements per lane otherwise only come
        # from VFOLD tiles): folded in order, not by tl.reduce
        assert cfg.LANES == 1, cfg
        cfg = Config(cfg.K, 1, cfg.ROWS, cfg.num_warps, vfold=True)
    launch = _reduce_launch(fns, xs, outs, fargs, offsets, g, ost[dim], S, 1, cfg,
                            segmented=True, align_rows=align_rows)
    return [launch], outs


def plan_scan(monoid: Monoid, x: torch.Tensor, dim: int, reverse: bool = False, params=None,
              out_dtype=None, *, sms=None, align_rows=None, lookback=None, config=None):
    """(plan, outputs): inclusive scan of ``x`` along ``dim`` (outputs shaped like ``x``).

    ``sms``, ``align_rows``: as :func:`plan_reduce`; ``lookback``: scan few long forward
    rows in one pass with the decoupled look-back (default :data:`LOOKBACK`; off:
    reduce-then-scan); ``config``: the scan's tile :class:`Config` (default
    :func:`scan_config`'s choice)."""
    align_rows = ALIGN_ROWS if align_rows is None else align_rows
    lookback = LOOKBACK if lookback is None else lookback
    fns = _fns(monoid)
    fargs = fin_args(monoid, params)
    xs = _as_inputs(fns, x)
    x = xs[0]
    dim = dim % x.dim()
    shape = list(x.shape)
    dtype = _in_dtype(xs)
    outs = tuple(_new(shape, _out_dtype(k, dtype, out_dtype), x.device)
                 for k in output_kinds(monoid))
    ost = _contig_strides(shape)
    xs, g = _prepare(xs, dim, lambda t: ost)
    x = xs[0]
    if g.rows == 0 or g.N == 0:
        return [], outs
    _check_positions(fns, g)
    block_scan = fns.block_scan is not None and (not reverse or monoid.commutative)
    elsize = _elsize(xs)
    cfg = config or scan_config(g, elsize, bool(reverse), costly_combine(monoid), block_scan)
    block, rows = cfg.K, cfg.ROWS
    n_prog = g.B[0] * g.B[1] * -(-g.B[2] // rows)
    rcfg = reduce_config(g, elsize, _is_ordered(monoid))
    n_split, chunk = split_plan(g, max(block, rcfg.K * rcfg.LANES), n_prog,
                                sms or num_sms(x.device))
    plan = []
    parts = ()
    if n_split > 1 and g.sn == 1 and not reverse and lookback:
        return _plan_lookback(fns, xs, outs, fargs, g, LOOKBACK_CONFIG, rcfg), outs
    if n_split > 1:
        parts = _state_buffers(monoid, g.rows, n_split, x.device)
        gp = Geometry(g.N, g.sn, 0, g.B, g.s, _parts_strides(g, n_split), g.inputs)
        plan.append(_reduce_launch(fns, xs, parts, (), x, gp, 1, n_split, chunk, rcfg,
                                   state_out=True, align_rows=align_rows))
    else:
        chunk = max(g.N, 1)
        parts = _dummy_parts(monoid, x.device)
    n_inner = -(-g.B[2] // rows)
    grid = (g.B[0] * g.B[1] * n_inner * n_split,)
    sn, s0, s1, s2 = g.in_args()
    args = (xs, outs, fargs, parts, g.N, sn, g.osn, g.B[1], g.B[2], s0, s1, s2, *g.o,
            n_inner, n_split, chunk)
    kwargs = dict(LIFT_XP=fns.lift_xp, COMBINE=fns.combine, SCAN_TILE=fns.scan_tile,
                  SCAN_TILE_REV=fns.scan_tile_rev, TAKE=fns.take, BCAST0=fns.bcast0,
                  IDENTITY=fns.identity, LOAD_STATE=fns.load_state, FINALIZE=fns.finalize_fast,
                  BCAST=fns.bcast, SHIFT1=fns.shift1, CHUNKED=cfg.vec > 0, VEC=max(cfg.vec, 1),
                  SMALL=cfg.small, PREFETCH=cfg.prefetch and cfg.vec > 0,
                  **(dict(BLOCK_SCAN=fns.block_scan, SCAN_EXACT=fns.scan_exact)
                     if block_scan and not cfg.small and cfg.vec == 0 else {}),
                  BLOCK=block, ROWS=rows,
                  PBLOCK=_pblock(n_split, rows),
                  REVERSE=bool(reverse), SPLIT=n_split > 1, MASK_ROWS=g.B[2] % rows != 0,
                  N64=_n64(g), **_opts(cfg))
    plan.append(Launch(K_.scan_kernel, grid, args, kwargs))
    return plan, outs


#: few long forward rows scan in one pass with a decoupled look-back (else reduce-then-scan)
LOOKBACK = True
#: scan tiles per look-back chunk: the look-back's latency is paid once per chunk
LOOKBACK_TILES = 4
#: predecessors read per look-back step
LOOKBACK_WINDOW = 32
#: the look-back's second-pass tiles (chunked scan); measured 4.1 TB/s for 1 x 2^26
#: cumsum and logcumsumexp on the H200
LOOKBACK_CONFIG = Config(4096, 1, 1, 8, vec=4)


def _plan_lookback(fns, xs, outs, fargs, g: Geometry, cfg: Config, rcfg: Config):
    """Single-pass multi-block scan: chunks of ``LOOKBACK_TILES`` chunked-scan tiles, one
    program each, ordered by a ticket; see :func:`kernels.lookback_scan_kernel`.

    ``maxnreg=128`` for states of up to two fields: the compiler keeps the second pass's
    addresses live through the first pass and the look-back (~177 registers for
    LOGSUMEXP2_SCAN, one program per SM); the cap costs a few bytes of spills and keeps
    two programs of 8 warps per SM. Larger states would spill heavily: no cap."""
    block = cfg.K
    chunk = block * LOOKBACK_TILES
    n_chunks = -(-g.N // chunk)
    slots = g.rows * n_chunks
    device = xs[0].device
    flags = _new(slots + 1, torch.int32, device, zero=True)              # last: the ticket
    aggs = _state_buffers(fns.monoid, g.rows, n_chunks, device)
    incls = _state_buffers(fns.monoid, g.rows, n_chunks, device)
    cap = 128 if len(fns.monoid.fields) <= 2 else None      # 4-field states would spill
    sn, s0, s1, s2 = g.in_args()
    args = (xs, outs, fargs, aggs, incls, flags, flags[slots:], g.N, sn, g.osn, g.B[1], g.B[2],
            s0, s1, s2, *g.o, n_chunks, chunk)
    kwargs = dict(TILE_STATE=fns.tile_fold if rcfg.vfold else fns.tile_state,
                  LIFT_XP=fns.lift_xp, COMBINE=fns.combine,
                  REDUCE_TILE=fns.reduce_tile, SCAN_TILE=fns.scan_tile, TAKE=fns.take,
                  BCAST0=fns.bcast0, BCAST=fns.bcast, SHIFT1=fns.shift1,
                  FINALIZE=fns.finalize_fast, IDENTITY=fns.identity, LOAD_STATE=fns.load_state,
                  STORE_STATE=fns.store_state, SELECT=fns.select, K=rcfg.K, LANES=rcfg.LANES,
                  BLOCK=block, VEC=cfg.vec, W=LOOKBACK_WINDOW, ORDERED=_is_ordered(fns.monoid),
                  INCLUSIVE=True, N64=_n64(g), **(dict(VFOLD=True) if rcfg.vfold else {}),
                  **_opts(Config(cfg.K, 1, 1, cfg.num_warps, maxnreg=cap)))
    return [Launch(K_.lookback_scan_kernel, (slots,), args, kwargs)]


def plan_normalize(rowmap: RowMap, x: torch.Tensor, dim: int, out_dtype=None, *, sms=None,
                   align_rows=None):
    """(plan, y): ``y = map(x, *prep(state(row)))`` along ``dim`` (softmax and kin).

    Few long rows that do not fit a tile are split: chunk states by the reduce kernel,
    then each chunk mapped with the row state folded from all of them. ``sms``,
    ``align_rows``: as :func:`plan_reduce`.
    """
    align_rows = ALIGN_ROWS if align_rows is None else align_rows
    fns = _fns(rowmap.monoid)
    dim = dim % x.dim()
    y = _new(list(x.shape), out_dtype or x.dtype, x.device)
    ost = _contig_strides(list(x.shape))
    (x,), g = _prepare((x,), dim, lambda t: ost)
    if g.rows == 0 or g.N == 0:
        return [], y
    _check_positions(fns, g)
    ordered = _is_ordered(rowmap.monoid)
    cfg, fused = normalize_config(g, x.element_size(), ordered)
    n_inner = -(-g.B[2] // cfg.ROWS)
    n_split, chunk, parts, plan = 1, max(g.N, 1), _dummy_parts(rowmap.monoid, x.device), []
    if not fused:
        n_split, chunk = split_plan(g, cfg.K * cfg.LANES, g.B[0] * g.B[1] * n_inner,
                                    sms or num_sms(x.device))
        if n_split > 1:
            parts = _state_buffers(rowmap.monoid, g.rows, n_split, x.device)
            gp = Geometry(g.N, g.sn, 0, g.B, g.s, _parts_strides(g, n_split))
            rcfg = reduce_config(g, x.element_size(), ordered)
            plan.append(_reduce_launch(fns, (x,), parts, (), x, gp, 1, n_split, chunk, rcfg,
                                       state_out=True, align_rows=align_rows))
    grid = (g.B[0] * g.B[1] * n_inner * n_split,)
    args = (x, y, parts, g.N, g.sn, g.osn, g.B[1], g.B[2], *g.s, *g.o, n_inner, n_split, chunk)
    kwargs = dict(_common(fns), PREP=rowmap.prep_fn, FMAP=rowmap.map_fn,
                  K=cfg.K, LANES=cfg.LANES, ROWS=cfg.ROWS, FUSED=bool(fused),
                  SPLIT=n_split > 1, PBLOCK=_pblock(n_split, cfg.ROWS), ORDERED=ordered,
                  MASK_ROWS=g.B[2] % cfg.ROWS != 0, N64=_n64(g), LIFT_XP=fns.lift_xp,
                  SELECT=fns.select, SMALL=cfg.small, **_opts(cfg))
    plan.append(Launch(K_.normalize_kernel, grid, args, kwargs))
    return plan, y


def _run(plan, device=None):
    """Run the launches in order, on ``device`` (Triton launches on the current device)."""
    if device is None:
        for launch in plan:
            launch()
        return
    with launcher.on_device(device):
        for launch in plan:
            launch()


# --- plan cache -------------------------------------------------------------------------

#: entries the plan cache holds; when full it is dropped wholesale (a rebuilt plan costs
#: ~20 us of host time, and a working set of more signatures than this is rare)
PLAN_CACHE_SIZE = 1024


def plan_cache_info() -> dict:
    """Hits and misses of the plan cache since it was last cleared, and its entries."""
    return _CACHE.info()


def plan_cache_clear():
    """Drop every cached plan and zero the counters."""
    _CACHE.clear()


_sig = plans.signature


def _items(params) -> tuple:
    """Finalize parameters for a key. Plans hold them as floats (:func:`fin_args`): a
    value that is not a plain number (a tensor could change in place) is put in a list,
    which makes the key unhashable and the call uncached."""
    if not params:
        return ()
    items = tuple(params.items())
    return items if all(type(v) in (float, int, bool) for _, v in items) else [items]


# --- launches ---------------------------------------------------------------------------

def _call_inputs(x):
    """``(inputs, signature)`` of the call's data inputs ``x`` (a tensor, or a tuple of
    them for a monoid of several inputs) for the plan cache's key."""
    if type(x) is tuple:
        return x, plans.signatures(x)
    if isinstance(x, list):
        return _call_inputs(tuple(x))
    return (x,), _sig(x)


#: id -> (monoid, its per-feature monoid or None): see :func:`_per_feature`
_PER_FEATURE: dict = {}


def _per_feature(monoid):
    """None for a monoid of scalar inputs and fields; for one with vector inputs or
    fields, the same monoid with them taken as scalars (cached per monoid).

    The IR has no op across the feature axis (elementwise ops broadcast scalars against
    vectors; reductions run over the block axis only), so feature ``w`` of every vector
    value is computed by the same graphs from feature ``w`` of the vector inputs and the
    scalar values: the kernels run this scalar monoid with the feature axis as one more
    batch dim (scalar inputs broadcast along it with stride 0), and the scalar fields are
    computed once per feature."""
    hit = _PER_FEATURE.get(id(monoid))
    if hit is not None and hit[0] is monoid:
        return hit[1]
    per = None
    if monoid.has_vector:
        scalar = functools.partial(dataclasses.replace, vector=False)
        per = dataclasses.replace(monoid, name=f"{monoid.name}_per_feature",
                                  fields=tuple(map(scalar, monoid.fields)),
                                  inputs=tuple(map(scalar, monoid.inputs)))
    if len(_PER_FEATURE) >= PLAN_CACHE_SIZE:
        _PER_FEATURE.clear()
    _PER_FEATURE[id(monoid)] = (monoid, per)
    return per


def _feature_views(monoid, x, dim):
    """``(views, dim, finish)`` of a monoid with vector inputs: its inputs ``x`` (scalar
    ones of shape ``S``, vector ones ``S + (W,)``) as views of shape ``S + (W,)`` (the
    scalar ones with stride 0 along the feature axis), ``dim`` normalized against ``S``,
    and ``finish(outs)``, which keeps the vector outputs and takes feature 0 of each
    scalar one (computed once per feature: a copy of a W-th of the vector outputs'
    size). A feature axis of width 0 runs at width 1 (zeros), the vector outputs empty."""
    data = [i for i in monoid.inputs if i.domain != "position"]
    xs = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    if len(xs) != len(data):
        raise ValueError(f"x: {monoid.name!r} takes {len(data)} data inputs, got {len(xs)} "
                         f"tensors")
    vec = next(t for i, t in zip(data, xs) if i.vector)
    shape, width = tuple(vec.shape[:-1]), vec.shape[-1]
    for j, (i, t) in enumerate(zip(data, xs)):
        want = shape + (width,) if i.vector else shape
        if tuple(t.shape) != want:
            raise ValueError(f"x[{j}]: shape {tuple(t.shape)}, expected {want} (the inputs "
                             f"broadcast to one shape, vector inputs with the feature axis "
                             f"last)")
    w = max(width, 1)
    views = tuple((t if width else t.new_zeros(()).expand(*shape, 1)) if i.vector
                  else t.unsqueeze(-1).expand(*shape, w) for i, t in zip(data, xs))
    vector_out = [o.vector for o in monoid.finalize_graph.outputs]

    def finish(outs):
        return tuple((o if width else o[..., :0].contiguous()) if v else o[..., 0].contiguous()
                     for o, v in zip(outs, vector_out))
    return views, dim % max(len(shape), 1), finish


def _route(monoid, x, dim):
    """How a call's inputs ``x`` reach the kernels: ``(xs, sig, None)``, the data inputs and
    their plan-cache signature, or ``(None, None, (per, views, dim, finish))`` for a monoid
    with vector inputs or fields, which runs as its per-feature scalar monoid ``per`` on
    ``views`` along ``dim`` and whose outputs ``finish`` assembles
    (:func:`_per_feature`, :func:`_feature_views`). A single tensor skips the per-feature
    lookup (host time of the common call)."""
    if type(x) is torch.Tensor:
        return (x,), _sig(x), None
    per = _per_feature(monoid)
    if per is not None:
        views, dim, finish = _feature_views(monoid, x, dim)
        return None, None, (per, views, dim, finish)
    xs, sig = _call_inputs(x)
    return xs, sig, None


def launch_reduce(monoid, x, dim, params=None):
    """Outputs of ``monoid`` reduced over ``dim`` of ``x`` (a tuple, batch shape). ``x``:
    a tensor, or for a monoid of several data inputs a tuple of tensors of one shape
    (broadcast views), in the monoid's input order; vector inputs carry a trailing
    feature axis (:func:`_per_feature`; pass them as a tuple), and vector outputs too."""
    xs, sig, feat = _route(monoid, x, dim)
    if feat is not None:
        per, views, fdim, finish = feat
        return finish(launch_reduce(per, views, fdim, params))
    plan, outs = _planned(("reduce", id(monoid), sig, dim, _items(params)), monoid,
                          xs, plan_reduce, monoid, xs, dim, params)
    _run(plan, xs[0].device)
    return outs


def launch_segment_reduce(monoid, x, offsets, dim, params=None):
    """Outputs per segment (a tuple; ``dim`` replaced by the segments). Segments of more
    than 2^31 elements raise for monoids that read positions (:func:`_check_positions`;
    the segment lengths are read, a device sync, only when the dim itself is that long)."""
    xs, sig, feat = _route(monoid, x, dim)
    if feat is not None:
        per, views, fdim, finish = feat
        return finish(launch_segment_reduce(per, views, offsets, fdim, params))
    x = xs[0]
    n = x.shape[dim] if x.dim() else 1
    if n > _I31 and offsets.numel() > 1 and _fns(monoid).has_position:
        longest = int((offsets[1:] - offsets[:-1]).max())
        _check_positions(_fns(monoid), Geometry(longest, 1, 1, (1, 1, 1), (0, 0, 0), (0, 0, 0)),
                         "a segment")
    plan, outs = _planned(("segment", id(monoid), sig, _sig(offsets), dim, _items(params)),
                          monoid, (*xs, offsets), plan_segment_reduce, monoid, xs, offsets, dim,
                          params)
    _run(plan, x.device)
    return outs


def launch_scan(monoid, x, dim, reverse=False, params=None, out_dtype=None):
    """Finalized inclusive scan outputs (a tuple, shaped like ``x``; ``x`` as for
    :func:`launch_reduce`)."""
    xs, sig, feat = _route(monoid, x, dim)
    if feat is not None:
        per, views, fdim, finish = feat
        return finish(launch_scan(per, views, fdim, reverse, params, out_dtype))
    plan, outs = _planned(("scan", id(monoid), sig, dim, reverse, _items(params), out_dtype),
                          monoid, xs, plan_scan, monoid, xs, dim, reverse, params, out_dtype)
    _run(plan, xs[0].device)
    return outs


def launch_normalize(rowmap, x, dim, out_dtype=None):
    """``map(x, *prep(state(row)))`` along ``dim``."""
    plan, y = _planned(("normalize", id(rowmap), _sig(x), dim, out_dtype), rowmap, (x,),
                       plan_normalize, rowmap, x, dim, out_dtype)
    _run(plan, x.device)
    return y


_PLANNERS = (plan_reduce, plan_segment_reduce, plan_scan, plan_normalize)
#: the plan cache: bypassed while any global that the planners read differs from what it
#: was at import (heuristics, ``ALIGN_ROWS``, ``LOOKBACK``..., which tests monkeypatch)
_CACHE = plans.PlanCache("reduce", globals(), _PLANNERS)
#: ``_planned(key, owner, inputs, build, *args)``: ``build(*args)``, a ``(plan, outputs)``
#: pair, replayed from the plan cache when ``key`` was planned before
#: (:meth:`flashfold.kernels.plans.PlanCache.planned`; the bound method itself: a wrapper
#: function cost ~0.5 us per call on the 2-core dev machine). ``key`` names the
#: operation, ``id(owner)`` (the monoid or row map: the entry keeps a reference to it, so
#: the id cannot be reused while the entry lives), the inputs by :func:`_sig` and every
#: other argument of ``build``. ``inputs``: the tensors of the call that the plan reads
#: (``x``, segment offsets), put into the replayed launches.
_planned = _CACHE.planned
#: call signature -> entry (:class:`flashfold.kernels.plans.PlanCache`), and [hits, misses]
_PLANS, _STATS = _CACHE.entries, _CACHE.stats
