"""Reductions and scans from generated kernels: correctness on the GPU, then speed.

Run on the GPU machine from the repository root::

    PYTHONPATH=src python benchmarks/reductions.py            # ~4-5 min, ~135 kernel compiles
    PYTHONPATH=src python benchmarks/reductions.py --quick    # fp32 16K rows only

1. Correctness at real sizes against float64 torch on the GPU, with the tolerance table
   of :mod:`flashfold.testing` (same rule as ``assert_close``): every convenience on
   16K x 16K (fp32, bf16; fp16: -inf rows), the awkward shapes (1 x 2^26 split-K / multi-block,
   2^20 x 7, 4096 x 12345, dim 0), rows that are all -inf, rows of length 1, empty dims,
   and the non-commutative user monoids of ``tests/user_monoids.py`` against sequential
   folds (MAX_PREFIX_SUM: a closed form in float64; MATMUL2: a NumPy left fold), which
   the CPU interpreter cannot check (it folds ``tl.reduce`` sequentially).
2. Timings: median of ``triton.testing.do_bench`` for flashfold and the torch
   equivalent, and a device-to-device copy of 1 GiB, all in this run. GB/s counts the
   input bytes for reductions and input + output bytes for softmax and scans (as
   TARGETS.md); "% copy" is flashfold's GB/s over the copy's (read + write) GB/s.
   Each row is also timed as a CUDA-graph replay (``graph``; ``--no-graphs`` skips it):
   eager do_bench counts host time (Python, Triton's launch) as kernel time whenever a
   call's host time exceeds its kernels' time plus do_bench's L2 flush (~0.07 ms), which
   the short rows (2^20 x 7, 4096 x 12345, 16-bit 16K reductions, dim 0) are near.
3. (not with ``--quick``) Variants of the tile heuristics on 16K x 16K fp32 and on the
   misaligned 4096 x 12345 rows, to tune them (eager and graph times), and of the example
   monoids' rows below; each variant's output checked first (float64 torch on 256 rows, the
   whole row of the 1 x 2^26 scans), a wrong one reported and not timed.

Monoids of the example library (:mod:`flashfold.examples`), checked and timed like the
rest: the linear recurrence ``h_t = a_t h_{t-1} + b_t`` (two inputs) scanned over
(8 x 1536, 16384) and (8 x 1536, 65536) fp32 (``--quick``: the first) against torch's
``associative_scan`` compiled by inductor (``combine_mode="pointwise"``; if it fails to
compile, the error is printed once and its column stays empty; PyTorch has no stable
loop-free form: ``cumprod(a)`` underflows long before 16K steps with ``a < 1``), and the
weighted mean (two inputs) and the one-input affine map AFFINE_HALF at 16K x 16K against
the copy (the weighted mean also against eager ``(w * x).sum(1) / w.sum(1)``). Their
bytes: every input read once (+ one fp32 output written for scans). After the timings,
the recurrence against ``accelerated-scan``'s CUDA warp kernel and its Triton kernel where
that package imports (its own ``(batch, channels, steps)`` layout, the same inputs), and
softmax against QuACK's CuTeDSL kernel where ``quack`` imports (``PYTHONPATH`` with the
peers' site folder, unpacked as ``benchmarks/workloads.py`` says).

Exit status 1 if any correctness check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time

if "--smoke" in sys.argv:                        # before any @triton.jit is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

import flashfold as ff  # noqa: E402
from flashfold import examples as EX  # noqa: E402
from flashfold import monoids as M  # noqa: E402
from flashfold.bench import graph_replay  # noqa: E402
from flashfold.kernels.reduce import launch as L  # noqa: E402
from flashfold.testing import TOLERANCES  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import user_monoids as U  # noqa: E402

DEV = "cuda"
NINF = -float("inf")
FAILED: list[str] = []
#: sizes (shrunk by --smoke, a CPU run of this script's logic under the interpreter)
BIG, LONG, MANY, WIDE = 16384, 2**26, 2**20, 12345
#: the linear recurrence's rows (batch x channels of a Mamba-like layer) and steps
REC_ROWS, REC_STEPS = 8 * 1536, (16384, 65536)
#: rows of a variant's output checked before it is timed
CHECK_ROWS = 256


def sz(n):
    return n


# --- correctness ------------------------------------------------------------------------

def close(name, got, want, dtype, scale=1.0):
    """``flashfold.testing.compare`` on the GPU: |a - e| <= atol·scale + rtol·|e|, NaN/inf
    parity; prints one line and records failures."""
    atol, rtol = TOLERANCES[str(dtype).replace("torch.", "")]
    a, e = got.double(), want.double().to(got.device)
    if a.shape != e.shape:
        ok, err = False, float("nan")
        print(f"  FAIL {name}: shape {tuple(a.shape)} != {tuple(e.shape)}")
    else:
        scale = torch.as_tensor(scale, dtype=torch.float64, device=a.device)
        fin = torch.isfinite(a) & torch.isfinite(e)
        diff = torch.where(fin, (a - e).abs(), torch.zeros_like(a))
        bad = diff > atol * scale + rtol * e.abs()
        bad |= torch.isnan(a) != torch.isnan(e)
        bad |= torch.isinf(a) != torch.isinf(e)
        bad |= torch.isinf(a) & torch.isinf(e) & (torch.sign(a) != torch.sign(e))
        ok = not bool(bad.any())
        err = float(diff.max()) if diff.numel() else 0.0
    print(f"  {'ok  ' if ok else 'FAIL'} {name:58s} max abs err {err:.3g}")
    if not ok:
        FAILED.append(name)
    return ok


def equal(name, got, want):
    ok = got.shape == want.shape and bool((got == want.to(got.device)).all())
    print(f"  {'ok  ' if ok else 'FAIL'} {name:58s} exact")
    if not ok:
        FAILED.append(name)
    return ok


def cumabs(x, dim):
    a = x.double().abs()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a)).cumsum(dim).clamp_min(1.0)


def rowmax(x, dim, keepdim=True):
    a = x.double().abs()
    return 1.0 + torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax(dim, keepdim=keepdim)


def check_conveniences(x, tag, dim=1):
    dt = x.dtype
    xd = x.double()
    close(f"logsumexp {tag}", ff.logsumexp(x, dim), torch.logsumexp(xd, dim), dt)
    close(f"softmax {tag}", ff.softmax(x, dim), torch.softmax(xd, dim), dt)
    var, mean = ff.var_mean(x, dim)
    wv, wm = torch.var_mean(xd, dim)
    close(f"var_mean.mean {tag}", mean, wm, dt, rowmax(x, dim, False))
    close(f"var_mean.var {tag}", var, wv, dt, rowmax(x, dim, False) ** 2)
    equal(f"argmax {tag}", ff.argmax(x, dim), torch.argmax(x, dim))
    equal(f"argmin {tag}", ff.argmin(x, dim), torch.argmin(x, dim))
    close(f"sum {tag}", ff.reduce(M.SUM, x, dim), xd.sum(dim), dt, cumabs(x, dim).amax(dim))
    equal(f"amax {tag}", ff.reduce(M.MAX, x, dim), x.amax(dim))
    close(f"cumsum {tag}", ff.cumsum(x, dim), torch.cumsum(xd, dim), dt, cumabs(x, dim))
    close(f"logcumsumexp {tag}", ff.logcumsumexp(x, dim), torch.logcumsumexp(xd, dim), dt,
          rowmax(x, dim))


def check_edges(dt):
    n = BIG                                            # the 16K configs: no new compiles
    x = torch.randn(64, n, device=DEV).to(dt)
    x[:8] = NINF                                       # all -inf rows
    x[8:16, :n - 1] = NINF                             # one finite element
    tag = f"-inf rows {str(dt)[6:]}"
    xd = x.double()
    close(f"logsumexp {tag}", ff.logsumexp(x, 1), torch.logsumexp(xd, 1), dt)
    close(f"softmax {tag}", ff.softmax(x, 1), torch.softmax(xd, 1), dt)
    close(f"logcumsumexp {tag}", ff.logcumsumexp(x, 1), torch.logcumsumexp(xd, 1), dt, rowmax(x, 1))
    equal(f"argmax {tag}", ff.argmax(x, 1), torch.argmax(x, 1))
    if dt == torch.float16:                            # -inf rows only (compile time)
        return
    one = torch.randn(4096, 1, device=DEV).to(dt)
    tag = f"length-1 rows {str(dt)[6:]}"
    close(f"logsumexp {tag}", ff.logsumexp(one, 1), torch.logsumexp(one.double(), 1), dt)
    close(f"softmax {tag}", ff.softmax(one, 1), torch.softmax(one.double(), 1), dt)
    close(f"cumsum {tag}", ff.cumsum(one, 1), one.double(), dt)
    var, mean = ff.var_mean(one, 1)
    wv, wm = torch.var_mean(one.double(), 1)
    close(f"var_mean {tag}", var, wv, dt)
    empty = torch.empty(16, 0, device=DEV, dtype=dt)
    tag = f"empty dim {str(dt)[6:]}"
    close(f"logsumexp {tag}", ff.logsumexp(empty, 1), torch.logsumexp(empty.double(), 1), dt)
    var, mean = ff.var_mean(empty, 1)
    close(f"var_mean {tag}", var, torch.full((16,), float("nan")), dt)
    ok = ff.softmax(empty, 1).shape == (16, 0) and ff.cumsum(empty, 1).shape == (16, 0)
    equal(f"softmax/cumsum shapes {tag}", torch.tensor(ok), torch.tensor(True))
    try:
        ff.argmax(empty, 1)
        equal(f"argmax raises {tag}", torch.tensor(False), torch.tensor(True))
    except IndexError:
        equal(f"argmax raises {tag}", torch.tensor(True), torch.tensor(True))


def max_prefix(xd, dim=-1):
    return torch.cumsum(xd, dim).amax(dim)


def suffix_best(xd):
    """y_i = max_{j >= i} sum_{k=i..j} x_k (reverse MAX_PREFIX_SUM scan), float64."""
    c = torch.cumsum(xd, -1)
    best_end = torch.flip(torch.cummax(torch.flip(c, [-1]), -1).values, [-1])
    prev = torch.cat([torch.zeros_like(c[..., :1]), c[..., :-1]], -1)
    return best_end - prev


def numpy_sequential(monoid, x):
    """Left fold of each row (elements along the last dim) and its prefix states."""
    xs = x.double().cpu().numpy()
    from flashfold.algebra.evaluate import numpy_monoid
    ex = numpy_monoid(monoid)
    st = ex.lift([xs[:, 0]], None)
    prefix = [st]
    for i in range(1, xs.shape[1]):
        st = ex.combine(st, ex.lift([xs[:, i]], None))
        prefix.append(st)
    return st, prefix


def check_non_commutative(quick):
    print(" non-commutative user monoids (order must be kept on the GPU):")
    for shape in ([(BIG // 4, BIG)] if quick else [(BIG // 4, BIG), (16, MANY), (1, LONG // 4)]):
        x = torch.randn(*shape, device=DEV)
        xd = x.double()
        tag = "x".join(map(str, shape))
        close(f"MAX_PREFIX_SUM reduce {tag}", ff.reduce(U.MAX_PREFIX_SUM, x, 1), max_prefix(xd), 
              torch.float32, cumabs(x, 1).amax(1))
        if shape[1] <= MANY:
            close(f"MAX_PREFIX_SUM scan {tag}", ff.scan(U.MAX_PREFIX_SUM, x, 1),
                  torch.cummax(torch.cumsum(xd, 1), 1).values, torch.float32, cumabs(x, 1)[:, -1:])
            close(f"MAX_PREFIX_SUM reverse scan {tag}", ff.scan(U.MAX_PREFIX_SUM, x, 1, reverse=True),
                  suffix_best(xd), torch.float32, cumabs(x, 1)[:, -1:])
        else:
            close(f"MAX_PREFIX_SUM multi-block scan {tag}", ff.scan(U.MAX_PREFIX_SUM, x, 1),
                  torch.cummax(torch.cumsum(xd, 1), 1).values, torch.float32, cumabs(x, 1)[:, -1:])
    shapes = [((BIG // 4, 64), 0.3), ((8, BIG // 2), 0.01)]
    if not quick:
        shapes.append(((2, MANY // 8), 0.0005))        # long rows: the look-back scan
    for shape, sigma in shapes:
        x = torch.randn(*shape, device=DEV) * sigma
        st, prefix = numpy_sequential(U.MATMUL2, x)
        mag, mag_prefix = numpy_sequential(U.MATMUL2, x.abs())   # magnitude of the terms
        tag = "x".join(map(str, shape))
        got = ff.reduce(U.MATMUL2, x, 1)
        for k, f in enumerate(U.MATMUL2.field_names):
            close(f"MATMUL2 reduce .{f} {tag}", got[k], torch.from_numpy(st[k]), torch.float32,
                  torch.from_numpy(mag[k]).to(DEV))
        got = ff.scan(U.MATMUL2, x, 1)
        for k, f in enumerate(U.MATMUL2.field_names):
            want = torch.from_numpy(np.stack([p[k] for p in prefix], -1))
            scale = torch.from_numpy(np.stack([p[k] for p in mag_prefix], -1)).to(DEV)
            close(f"MATMUL2 scan .{f} {tag}", got[k], want, torch.float32, scale)


def recurrence_inputs(rows, steps, seed=0):
    """``(a, b)`` of the linear recurrence: a decay ``a`` in [0.9, 1) and ``b`` ~ N(0, 1)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    a = 0.9 + 0.1 * torch.rand(rows, steps, device=DEV, generator=g)
    return a, torch.randn(rows, steps, device=DEV, generator=g)


def recurrence_f64(a, b):
    """float64 ``h_t = a_t h_{t-1} + b_t`` along the last dim (a loop over the steps)."""
    a, b = a.double(), b.double()
    out = torch.empty_like(a)
    h = torch.zeros(a.shape[0], dtype=torch.float64, device=a.device)
    for t in range(a.shape[1]):
        h = torch.addcmul(b[:, t], a[:, t], h)
        out[:, t] = h
    return out


def check_several_inputs(quick):
    """The example monoids of several inputs at the benchmark's sizes: the recurrence on
    256 of its rows (a float64 loop over the steps; every row finite), the weighted mean
    on every row (float64 sums), AFFINE_HALF reduce and scan on 256 rows."""
    print(" monoids of several inputs (flashfold.examples):")
    for steps in REC_STEPS[:1] if quick else REC_STEPS:
        a, b = recurrence_inputs(REC_ROWS, steps)
        h = ff.scan(EX.LINEAR_RECURRENCE, (a, b), dim=-1)
        tag = f"{REC_ROWS}x{steps}"
        equal(f"linear recurrence scan {tag} finite", torch.isfinite(h).all().cpu(),
              torch.tensor(True))
        rows = torch.arange(0, REC_ROWS, max(1, REC_ROWS // 256), device=DEV)
        want = recurrence_f64(a[rows], b[rows])
        scale = 1.0 + recurrence_f64(a[rows], b[rows].abs())
        close(f"linear recurrence scan {tag} (256 rows)", h[rows], want, torch.float32, scale)
        last = ff.reduce(EX.LINEAR_RECURRENCE, (a, b), dim=-1)
        close(f"linear recurrence reduce {tag} (256 rows)", last[rows], want[:, -1],
              torch.float32, scale[:, -1])
        del a, b, h
    w = torch.rand(BIG, BIG, device=DEV) + 0.1
    x = torch.randn(BIG, BIG, device=DEV)
    got = ff.reduce(EX.WEIGHTED_MEAN, (w, x), dim=1)
    sw = w.double().sum(1)
    wx = w.double() * x.double()
    close(f"weighted mean {BIG}x{BIG}", got, wx.sum(1) / sw, torch.float32,
          1.0 + wx.abs().sum(1) / sw)
    del wx
    xr = x[:256]
    st, prefix = numpy_sequential(EX.AFFINE_HALF, xr)
    mag, mag_prefix = numpy_sequential(EX.AFFINE_HALF, xr.abs())
    got = ff.reduce(EX.AFFINE_HALF, x, 1)
    close(f"affine_half reduce .b {BIG}x{BIG} (256 rows)", got.b[:256], torch.from_numpy(st[1]),
          torch.float32, 1.0 + torch.from_numpy(mag[1]).to(DEV))
    got = ff.scan(EX.AFFINE_HALF, x, 1)
    want = torch.from_numpy(np.stack([p[1] for p in prefix], -1))
    scale = 1.0 + torch.from_numpy(np.stack([p[1] for p in mag_prefix], -1)).to(DEV)
    close(f"affine_half scan .b {BIG}x{BIG} (256 rows)", got.b[:256], want, torch.float32, scale)


def guarded(name, fn, *args):
    """Run a group of checks; an exception counts as a failed check, the run goes on."""
    try:
        fn(*args)
    except Exception as e:
        print(f"  FAIL {name}: {type(e).__name__}: {str(e)[:400]}")
        FAILED.append(name)


def correctness(quick):
    print("== correctness on the GPU (vs float64, tolerances of flashfold.testing) ==")
    torch.manual_seed(0)
    for dt in ((torch.float32,) if quick else (torch.float32, torch.bfloat16, torch.float16)):
        if dt != torch.float16:                      # fp16: edge rows only (compile time)
            x = (torch.randn(BIG, BIG, device=DEV) * 3).to(dt)
            guarded(f"{BIG}x{BIG} {dt}", check_conveniences, x, f"{BIG}x{BIG} {str(dt)[6:]}")
            del x
        guarded(f"edges {dt}", check_edges, dt)
    if not quick:
        for shape, dim in (((1, LONG), 1), ((MANY, 7), 1), ((BIG // 4, WIDE), 1), ((BIG, BIG // 4), 0)):
            x = torch.randn(*shape, device=DEV) * 3
            tag = "x".join(map(str, shape)) + f" dim {dim}"
            guarded(tag, check_conveniences, x, tag, dim)
        x = torch.randn(MANY, 64, device=DEV)
        off = torch.sort(torch.randint(0, MANY + 1, (257,), device=DEV)).values
        off[0], off[-1] = 0, MANY
        want = torch.stack([x[a:b].double().sum(0) for a, b in zip(off[:-1].tolist(), off[1:].tolist())])
        close("segment_reduce SUM 2^20x64, 256 segments", ff.segment_reduce(M.SUM, x, off), want,
              torch.float32, x.double().abs().sum(0).clamp_min(1))
    guarded("non-commutative", check_non_commutative, quick)
    guarded("several inputs", check_several_inputs, quick)


# --- timings ------------------------------------------------------------------------------

def bench(fn):
    if DEV == "cpu":                                   # --smoke: no CUDA events
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


#: time rows from CUDA graphs too (``--no-graphs`` turns it off)
GRAPHS = True


def _cell(x, fmt, unit=""):
    """A summary cell: ``x`` formatted, or ``-`` where it was not measured (NaN: graphs
    off, or torch has no such op)."""
    return f"{x:{fmt}}{unit}" if math.isfinite(x) else "-"


def bench_graph(fn):
    """Median ms of ``fn`` captured once in a CUDA graph and replayed by do_bench (L2
    flushed between replays as for the eager time): the kernels' time without the host's.
    NaN when off, on the CPU, or if the call cannot be captured."""
    if DEV == "cpu" or not GRAPHS:
        return float("nan")
    replay = None
    try:
        replay = graph_replay(fn)
        return triton.testing.do_bench(replay, warmup=25, rep=100, return_mode="median")
    except Exception as e:                             # noqa: BLE001 - reported, run goes on
        print(f"  (graph capture failed: {type(e).__name__}: {str(e)[:160]})")
        return float("nan")
    finally:
        del replay                                     # the graph's pool holds the outputs
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()


def rows(quick):
    """(op, shape label, dtype, flashfold fn, torch fn, bytes)."""
    out = []
    dts = (torch.float32,) if quick else (torch.float32, torch.bfloat16)
    for dt in dts:
        x = torch.randn(BIG, BIG, device=DEV).to(dt)
        nb = x.numel() * x.element_size()
        lab = f"{BIG}x{BIG}"
        out += [
            ("logsumexp", lab, dt, lambda x=x: ff.logsumexp(x, 1), lambda x=x: torch.logsumexp(x, 1), nb),
            ("softmax", lab, dt, lambda x=x: ff.softmax(x, 1), lambda x=x: torch.softmax(x, 1), 2 * nb),
            ("var_mean", lab, dt, lambda x=x: ff.var_mean(x, 1), lambda x=x: torch.var_mean(x, 1), nb),
            ("amax", lab, dt, lambda x=x: ff.reduce(M.MAX, x, 1), lambda x=x: torch.amax(x, 1), nb),
            ("sum", lab, dt, lambda x=x: ff.reduce(M.SUM, x, 1), lambda x=x: torch.sum(x, 1), nb),
            ("argmax", lab, dt, lambda x=x: ff.argmax(x, 1), lambda x=x: torch.argmax(x, 1), nb),
            ("cumsum", lab, dt, lambda x=x: ff.cumsum(x, 1), lambda x=x: torch.cumsum(x, 1), 2 * nb),
            ("logcumsumexp", lab, dt, lambda x=x: ff.logcumsumexp(x, 1),
             lambda x=x: torch.logcumsumexp(x, 1), 2 * nb),
        ]
    awkward = [((1, LONG), 1, ("logsumexp", "sum", "softmax", "cumsum", "logcumsumexp")),
               ((MANY, 7), 1, ("logsumexp", "softmax", "cumsum", "argmax")),
               ((BIG // 4, WIDE), 1, ("logsumexp", "softmax", "var_mean", "cumsum", "logcumsumexp"))]
    if not quick:
        awkward.append(((BIG, BIG), 0, ("logsumexp", "sum", "cumsum")))
    for shape, dim, ops in awkward:
        x = torch.randn(*shape, device=DEV)
        nb = x.numel() * 4
        lab = "x".join(map(str, shape)) + ("" if dim == 1 else f" dim {dim}")
        table = {
            "logsumexp": (lambda x=x: ff.logsumexp(x, dim), lambda x=x: torch.logsumexp(x, dim), nb),
            "sum": (lambda x=x: ff.reduce(M.SUM, x, dim), lambda x=x: torch.sum(x, dim), nb),
            "softmax": (lambda x=x: ff.softmax(x, dim), lambda x=x: torch.softmax(x, dim), 2 * nb),
            "var_mean": (lambda x=x: ff.var_mean(x, dim), lambda x=x: torch.var_mean(x, dim), nb),
            "argmax": (lambda x=x: ff.argmax(x, dim), lambda x=x: torch.argmax(x, dim), nb),
            "cumsum": (lambda x=x: ff.cumsum(x, dim), lambda x=x: torch.cumsum(x, dim), 2 * nb),
            "logcumsumexp": (lambda x=x: ff.logcumsumexp(x, dim),
                             lambda x=x: torch.logcumsumexp(x, dim), 2 * nb),
        }
        for op in ops:
            f, t, b = table[op]
            out.append((op, lab, torch.float32, f, t, b))
    out += several_input_rows(quick)
    if not quick:
        x = torch.randn(MANY, 256, device=DEV)
        off = torch.arange(0, MANY + 1, MANY // 256, device=DEV)       # 256 segments
        out.append(("segment_reduce sum", f"{MANY}x256 /256", torch.float32,
                    lambda: ff.segment_reduce(M.SUM, x, off, unsafe=True),
                    lambda: torch.segment_reduce(x, "sum", offsets=off, axis=0),
                    x.numel() * 4))
    return out


#: the first failure to compile torch's associative_scan (printed once; its column empty)
_SCAN_PEER_ERROR: list = []


def torch_recurrence_scan():
    """torch's ``associative_scan`` of the recurrence's affine maps, compiled by inductor
    (``combine_mode="pointwise"``), as a function ``(a, b) -> h``; None where it cannot be
    built (CPU smoke runs: inductor's CPU compile is not what is measured)."""
    if DEV == "cpu":
        return None
    try:
        from torch._higher_order_ops.associative_scan import associative_scan
    except Exception as e:                             # noqa: BLE001 - reported once
        _SCAN_PEER_ERROR.append(f"{type(e).__name__}: {e}")
        return None

    def combine(l, r):                                 # (earlier map, later map)
        return l[0] * r[0], r[0] * l[1] + r[1]

    @torch.compile(dynamic=False)
    def scan(a, b):
        return associative_scan(combine, (a, b), dim=-1, combine_mode="pointwise")[1]
    return scan


def _peer(fn, want):
    """``fn`` if it runs and agrees with flashfold's output ``want`` (fp32 tolerance on the
    recurrence's scale), else None; the first error is printed (once per run)."""
    if fn is None:
        return None
    try:
        got = fn()
        torch.cuda.synchronize()
        bad = float(((got.double() - want.double()).abs() / (1.0 + want.double().abs())).max())
        if not bad < 1e-3:
            raise AssertionError(f"differs from flashfold by {bad:.3g} (relative)")
        return fn
    except Exception as e:                             # noqa: BLE001 - reported once
        if not _SCAN_PEER_ERROR:
            print(f"  torch associative_scan (compiled): {type(e).__name__}: {str(e)[:600]}")
        _SCAN_PEER_ERROR.append(repr(e))
        return None


def _none():
    raise RuntimeError("no torch equivalent in this run")


def several_input_rows(quick):
    """Rows of the example monoids (see the module notes)."""
    out = []
    peer = torch_recurrence_scan()
    for steps in REC_STEPS[:1] if quick else REC_STEPS:
        a, b = recurrence_inputs(REC_ROWS, steps)
        f = (lambda a=a, b=b: ff.scan(EX.LINEAR_RECURRENCE, (a, b), dim=-1))
        t = _peer(peer and (lambda a=a, b=b: peer(a, b)), f()) or _none
        out.append(("linear recurrence scan", f"{REC_ROWS}x{steps}", torch.float32, f, t,
                    3 * a.numel() * 4))
    if quick:
        return out
    w = torch.rand(BIG, BIG, device=DEV) + 0.1
    x = torch.randn(BIG, BIG, device=DEV)
    nb = x.numel() * 4
    lab = f"{BIG}x{BIG}"
    out += [
        ("weighted mean", lab, torch.float32,
         lambda: ff.reduce(EX.WEIGHTED_MEAN, (w, x), dim=1), lambda: (w * x).sum(1) / w.sum(1),
         2 * nb),
        ("affine_half reduce", lab, torch.float32, lambda: ff.reduce(EX.AFFINE_HALF, x, 1),
         _none, nb),
        ("affine_half scan", lab, torch.float32, lambda: ff.scan(EX.AFFINE_HALF, x, 1), _none,
         3 * nb),
    ]
    return out


def accelerated_scan_rows(quick):
    """The linear recurrence against ``accelerated-scan`` (``pip install accelerated-scan``,
    importable where the run happens): its CUDA warp kernel (``accelerated_scan.warp``,
    built at import by ``torch.utils.cpp_extension``) and its Triton kernel
    (``accelerated_scan.scalar``), on the rows' ``(8, 1536, steps)`` layout. One line per
    implementation and length: its time, GB/s, and its time over flashfold's (above 1:
    flashfold faster); an implementation that does not import or disagrees says why."""
    if DEV == "cpu":
        return
    print("\n== linear recurrence against accelerated-scan (same inputs, fp32) ==")
    impls = {}
    for name in ("warp", "scalar"):
        try:
            mod = __import__(f"accelerated_scan.{name}", fromlist=["scan"])
            impls[name] = mod.scan
        except Exception as e:                         # noqa: BLE001 - reported, run goes on
            print(f"  accelerated-scan {name}: did not import: {type(e).__name__}: "
                  f"{str(e)[:300]}")
    for steps in REC_STEPS[:1] if quick else REC_STEPS:
        a, b = recurrence_inputs(REC_ROWS, steps)
        f = (lambda a=a, b=b: ff.scan(EX.LINEAR_RECURRENCE, (a, b), dim=-1))
        want = f()
        ms = bench(f)
        nb = 3 * a.numel() * 4
        g3, t3 = a.view(8, REC_ROWS // 8, steps), b.view(8, REC_ROWS // 8, steps)
        print(f"  flashfold            {REC_ROWS}x{steps}  {ms:8.3f} ms {nb / ms / 1e6:6.0f} GB/s")
        for name, scan in impls.items():
            try:
                got = scan(g3, t3).view(REC_ROWS, steps)
                bad = float(((got.double() - want.double()).abs()
                             / (1.0 + want.double().abs())).max())
                if not bad < 1e-3:
                    raise AssertionError(f"differs from flashfold by {bad:.3g} (relative)")
                pms = bench(lambda: scan(g3, t3))
            except Exception as e:                     # noqa: BLE001 - reported, run goes on
                print(f"  accelerated-scan {name} {REC_ROWS}x{steps}: {type(e).__name__}: "
                      f"{str(e)[:300]}")
                continue
            print(f"  accelerated-scan {name:6s} {REC_ROWS}x{steps}  {pms:8.3f} ms "
                  f"{nb / pms / 1e6:6.0f} GB/s | flashfold {pms / ms:.2f}x faster",
                  flush=True)


def quack_rows(quick):
    """Softmax against QuACK (``quack-kernels``, the CuTeDSL row reductions; its archives
    unpacked into a site folder on ``PYTHONPATH`` as ``benchmarks/workloads.py`` says):
    ``quack.softmax.softmax_fwd`` (rows of a 2-D tensor, one output allocated per call, as
    ``ff.softmax``) on the rows' shapes, same inputs. One line per shape and dtype: both
    times, GB/s (input + output bytes) and QuACK's time over flashfold's (above 1:
    flashfold faster); a QuACK that does not import, fails or disagrees says why."""
    if DEV == "cpu":
        return
    print("\n== softmax against QuACK (same inputs) ==")
    try:
        from quack.softmax import softmax_fwd
    except Exception as e:                             # noqa: BLE001 - reported, run goes on
        print(f"  quack: did not import: {type(e).__name__}: {str(e)[:300]}")
        return
    shapes = [(BIG, BIG)] if quick else [(BIG, BIG), (MANY, 7), (BIG // 4, WIDE), (4, 2**17)]
    dtypes = [torch.float32] if quick else [torch.float32, torch.bfloat16]
    for shape in shapes:
        for dt in dtypes:
            x = torch.randn(*shape, device=DEV, dtype=dt)
            f = (lambda x=x: ff.softmax(x, 1))
            want = f()
            ms = bench(f)
            nb = 2 * x.numel() * x.element_size()
            lab = f"{shape[0]}x{shape[1]}"
            try:
                got = softmax_fwd(x)
                # each within the dtype's tolerance of the true softmax: twice it apart
                atol, rtol = TOLERANCES[str(dt)[6:]]
                gap = (got.double() - want.double()).abs() - 2 * (atol + rtol * want.double().abs())
                if not bool((gap <= 0).all()):
                    raise AssertionError(f"differs from flashfold by up to "
                                         f"{float((got.double() - want.double()).abs().max()):.3g}")
                qms = bench(lambda x=x: softmax_fwd(x))
            except Exception as e:                     # noqa: BLE001 - reported, run goes on
                print(f"  quack softmax {lab} {str(dt)[6:]}: {type(e).__name__}: {str(e)[:300]}")
                continue
            print(f"  softmax {lab:14s} {str(dt)[6:]:9s} flashfold {ms:8.3f} ms "
                  f"{nb / ms / 1e6:6.0f} GB/s | quack {qms:8.3f} ms {nb / qms / 1e6:6.0f} GB/s "
                  f"| flashfold {qms / ms:.2f}x faster", flush=True)


def timings(quick, copy_gbs):
    print("\n== timings (median of triton.testing.do_bench) ==")
    results = []
    for op, lab, dt, f, t, nb in rows(quick):
        try:
            f()
            ms = bench(f)
        except Exception as e:
            print(f"  {op} {lab} {dt}: flashfold failed: {type(e).__name__}: {str(e)[:300]}")
            FAILED.append(f"timing {op} {lab}")
            continue
        try:
            tms = bench(t)
        except Exception as e:          # a torch op that does not exist for this case
            print(f"  torch {op} {lab}: {type(e).__name__}: {e}")
            tms = float("nan")
        gms = bench_graph(f)
        tgms = bench_graph(t) if math.isfinite(tms) else float("nan")
        results.append((op, lab, str(dt)[6:], ms, nb / ms / 1e6, tms, nb / tms / 1e6, gms, tgms))
        graph = f" | graph {gms:8.3f} ms torch {tgms:8.3f} ms" if GRAPHS and DEV != "cpu" else ""
        print(f"  {op:20s} {lab:18s} {str(dt)[6:]:9s} {ms:8.3f} ms {nb / ms / 1e6:7.0f} GB/s "
              f"| torch {tms:8.3f} ms{graph}", flush=True)
    return results


@contextlib.contextmanager
def patched(**fns):
    old = {k: getattr(L, k) for k in fns}
    for k, v in fns.items():
        setattr(L, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(L, k, v)


def _once(f):
    """``f()`` computed at the first call and kept (a reference shared by a case's
    variants, built only where the case runs)."""
    box = []

    def get():
        if not box:
            box.append(f())
        return box[0]
    return get


def variants(copy_gbs, only=None):
    """Alternative tiles on 16K x 16K fp32 and 4096 x 12345 (to tune the heuristics;
    default first); GB/s and % copy from the eager time, then the CUDA-graph time. Each
    variant's output is checked first (``close`` / ``equal``: float64 torch on CHECK_ROWS
    rows, the whole row of the 1 x 2^26 scans) and a wrong one is not timed."""
    print("\n== heuristic variants, 16384x16384 float32 and 4096x12345 (GB/s, % copy; graph ms) ==")
    x = torch.randn(BIG, BIG, device=DEV)
    xh = x.to(torch.bfloat16)
    nb = x.numel() * 4
    C = L.Config
    R = CHECK_ROWS
    f32, bf16 = torch.float32, torch.bfloat16

    def rows_close(ref, dt=f32, scale=None):
        """A check of the first R rows of an output against ``ref(rows)`` in float64."""
        def check(out, name, src):
            xs = src[:R]
            return close(name, out[:R], ref(xs.double(), 1), dt,
                         1.0 if scale is None else scale(xs, 1))
        return check

    lse, smax = rows_close(torch.logsumexp), rows_close(torch.softmax)
    csum = rows_close(torch.cumsum, scale=cumabs)
    lcse = rows_close(torch.logcumsumexp, scale=rowmax)
    lcse_h = rows_close(torch.logcumsumexp, bf16, rowmax)
    cases = [
        ("logsumexp", nb, lambda: ff.logsumexp(x, 1), "reduce_config", [
            ("K=8 L=1024 w8 (default)", None), ("K=4 L=1024 w8", C(4, 1024, 1, 8)),
            ("K=16 L=512 w4", C(16, 512, 1, 4))], lambda o, n: lse(o, n, x)),
        ("softmax", 2 * nb, lambda: ff.softmax(x, 1), "normalize_config", [
            ("fused w16 maxnreg64 (default)", None),
            ("fused w16 no register cap", (C(8, 2048, 1, 16), True)),
            ("fused w8 K=16", (C(16, 1024, 1, 8), True)),
            ("two loops K=8 w8", (C(8, 1024, 1, 8), False))], lambda o, n: smax(o, n, x)),
        ("cumsum", 2 * nb, lambda: ff.cumsum(x, 1), "scan_config", [
            ("block scan 4096 w8 (default)", None), ("block scan 2048 w8", C(2048, 1, 1, 8)),
            ("chunked 2048 w4", C(2048, 1, 1, 4, vec=4))], lambda o, n: csum(o, n, x)),
        ("logcumsumexp", 2 * nb, lambda: ff.logcumsumexp(x, 1), "scan_config", [
            ("block scan 1024 w1 (default)", None), ("block scan 2048 w4", C(2048, 1, 1, 4)),
            ("block scan 1024 w2", C(1024, 1, 1, 2)), ("block scan 512 w1", C(512, 1, 1, 1)),
            ("chunked 1024 w2 prefetch (before)", C(1024, 1, 1, 2, vec=4, prefetch=True))],
         lambda o, n: lcse(o, n, x)),
        ("logcumsumexp bf16", nb, lambda: ff.logcumsumexp(xh, 1), "scan_config", [
            ("block scan 1024 w1 (default)", None), ("block scan 2048 w2", C(2048, 1, 1, 2)),
            ("block scan 2048 w4", C(2048, 1, 1, 4)),
            ("chunked 2048 w4 (before)", C(2048, 1, 1, 4, vec=4))],
         lambda o, n: lcse_h(o, n, xh)),
    ]
    xl = torch.randn(1, LONG, device=DEV)
    cumsum_l = _once(lambda: (torch.cumsum(xl.double(), 1), cumabs(xl, 1)))
    lcse_l = _once(lambda: (torch.logcumsumexp(xl.double(), 1), rowmax(xl, 1)))
    cases += [
        ("cumsum 1xLONG", 2 * xl.numel() * 4, lambda: ff.cumsum(xl, 1), "LOOKBACK", [
            ("look-back (default)", None), ("reduce-then-scan", False)],
         lambda o, n: close(n, o, cumsum_l()[0], f32, cumsum_l()[1])),
        ("logcumsumexp 1xLONG", 2 * xl.numel() * 4, lambda: ff.logcumsumexp(xl, 1), "LOOKBACK", [
            ("look-back (default)", None), ("reduce-then-scan", False)],
         lambda o, n: close(n, o, lcse_l()[0], f32, lcse_l()[1])),
        ("cumsum 1xLONG", 2 * xl.numel() * 4, lambda: ff.cumsum(xl, 1), "LOOKBACK_TILES", [
            ("look-back 2 tiles/chunk", 2), ("look-back 8 tiles/chunk", 8)],
         lambda o, n: close(n, o, cumsum_l()[0], f32, cumsum_l()[1])),
    ]

    def sum0(o, n):                                     # the first R columns
        xs = x[:, :R]
        return close(n, o[:R], xs.double().sum(0), f32, cumabs(xs, 0).amax(0))
    cases += [                                          # columns: the reduced dim strided
        ("sum dim 0", nb, lambda: ff.reduce(M.SUM, x, 0), "reduce_config", [
            ("512 cols K=16 w4 (default)", None), ("512 cols K=8 w4 (before)", C(8, 1, 512, 4)),
            ("1024 cols K=4 w8", C(4, 1, 1024, 8)), ("1024 cols K=8 w8", C(8, 1, 1024, 8)),
            ("2048 cols K=2 w16", C(2, 1, 2048, 16))], sum0),
        # the split of the reduced dim (default 33 chunks of 504 rows, then a second pass)
        ("sum dim 0", nb, lambda: ff.reduce(M.SUM, x, 0), "split_plan", [
            ("8 chunks of 2048", (8, 2048)), ("17 chunks of 968 (before)", (17, 968)),
            ("64 chunks of 256", (64, 256))], sum0),
    ]
    x7 = torch.randn(MANY, 7, device=DEV)               # rows of 7: one row per thread
    n7 = x7.numel() * 4
    cases += [
        ("argmax 2^20x7", n7, lambda: ff.argmax(x7, 1), "reduce_config", [
            ("128 rows w4 (default)", None), ("256 rows w4 (before)", C(8, 1, 256, 4, small=True)),
            ("512 rows w4", C(8, 1, 512, 4, small=True)), ("1024 rows w8", C(8, 1, 1024, 8, small=True)),
            ("tile path 8 x 128 rows", C(8, 1, 128, 4))],
         lambda o, n: equal(n, o[:R], torch.argmax(x7[:R], 1))),
    ]
    xw = torch.randn(BIG // 4, WIDE, device=DEV)        # rows start off 16-byte boundaries
    nw = xw.numel() * 4

    def var_mean_w(out, name):
        xs = xw[:R]
        wv, wm = torch.var_mean(xs.double(), 1)
        var, mean = out
        ok = close(f"{name} .mean", mean[:R], wm, f32, rowmax(xs, 1, False))
        return close(f"{name} .var", var[:R], wv, f32, rowmax(xs, 1, False) ** 2) and ok
    cases += [
        ("logsumexp 12345", nw, lambda: ff.logsumexp(xw, 1), "ALIGN_ROWS", [
            ("realigned tiles (default)", None), ("scalar loads", False)],
         lambda o, n: lse(o, n, xw)),
        ("var_mean 12345", nw, lambda: ff.var_mean(xw, 1), "ALIGN_ROWS", [
            ("realigned tiles (default)", None), ("scalar loads", False)], var_mean_w),
        ("cumsum 12345", 2 * nw, lambda: ff.cumsum(xw, 1), "scan_config", [
            ("block scan 4096 w8 (default)", None), ("chunked 4096 w8", C(4096, 1, 1, 8, vec=4))],
         lambda o, n: csum(o, n, xw)),
    ]
    cases += several_input_variants()
    for op, b, fn, hook, options, check in cases:
        if only is not None and only not in op:
            continue
        for label, cfg in options:
            def checked():
                """``fn``'s output checked, then its times (None where it is wrong)."""
                if not check(fn(), f"variant {op}: {label}"):
                    return None
                return bench(fn), bench_graph(fn)
            try:
                if cfg is None:
                    times = checked()
                else:
                    value = cfg if hook.isupper() else (lambda *a, cfg=cfg: cfg)
                    with patched(**{hook: value}):
                        times = checked()
            except Exception as e:                  # report and go on with the others
                print(f"  {op:14s} {label:32s} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            if times is None:                       # wrong: FAILED has it, not timed
                continue
            ms, gms = times
            gbs = b / ms / 1e6
            print(f"  {op:14s} {label:32s} {ms:7.3f} ms {gbs:6.0f} GB/s {100 * gbs / copy_gbs:5.1f}%"
                  f"  graph {gms:7.3f} ms", flush=True)


def several_input_variants():
    """Tiles for the example monoids (see the module notes), default first: the
    recurrence's scan, the weighted mean's reduce, and the in-order reduce of AFFINE_HALF
    with lanes that fold a vector of consecutive elements (``VFOLD``) or one element."""
    C = L.Config
    a, b = recurrence_inputs(REC_ROWS, REC_STEPS[0])
    w = torch.rand(BIG, BIG, device=DEV) + 0.1
    x = torch.randn(BIG, BIG, device=DEV)
    nb = x.numel() * 4
    R = CHECK_ROWS
    f32 = torch.float32
    rows = torch.arange(0, REC_ROWS, max(1, REC_ROWS // R), device=DEV)
    rec = _once(lambda: (recurrence_f64(a[rows], b[rows]),
                         1.0 + recurrence_f64(a[rows], b[rows].abs())))
    affine = _once(lambda: (numpy_sequential(EX.AFFINE_HALF, x[:R])[0],
                            numpy_sequential(EX.AFFINE_HALF, x[:R].abs())[0]))

    def weighted_mean(out, name):
        wd, xd = w[:R].double(), x[:R].double()
        sw = wd.sum(1)
        return close(name, out[:R], (wd * xd).sum(1) / sw, f32, 1.0 + (wd * xd).abs().sum(1) / sw)

    def affine_b(out, name):
        st, mag = affine()
        return close(name, out.b[:R], torch.from_numpy(st[1]), f32,
                     1.0 + torch.from_numpy(mag[1]).to(DEV))
    return [
        ("recurrence scan", 3 * a.numel() * 4,
         lambda: ff.scan(EX.LINEAR_RECURRENCE, (a, b), dim=-1), "scan_config", [
             ("block scan 4096 w8 (default)", None), ("block scan 2048 w4", C(2048, 1, 1, 4)),
             ("block scan 2048 w8", C(2048, 1, 1, 8)), ("chunked 2048 w4", C(2048, 1, 1, 4, vec=4)),
             ("chunked 1024 w2 prefetch", C(1024, 1, 1, 2, vec=4, prefetch=True))],
         lambda o, n: close(n, o[rows], rec()[0], f32, rec()[1])),
        ("weighted mean", 2 * nb, lambda: ff.reduce(EX.WEIGHTED_MEAN, (w, x), dim=1),
         "reduce_config", [
             ("K=8 L=1024 w8 (default)", None), ("K=4 L=1024 w8", C(4, 1024, 1, 8)),
             ("K=16 L=512 w4", C(16, 512, 1, 4))], weighted_mean),
        ("affine_half reduce", nb, lambda: ff.reduce(EX.AFFINE_HALF, x, 1), "VFOLD", [
            ("vector lanes K=4 L=512 w4 (default)", None),
            ("one-element lanes 512 x 2 rows", False)], affine_b),
        ("affine_half reduce", nb, lambda: ff.reduce(EX.AFFINE_HALF, x, 1), "reduce_config", [
            ("vector lanes K=4 L=512 w2", C(4, 512, 1, 2, vfold=True)),
            ("vector lanes K=8 L=512 w4", C(8, 512, 1, 4, vfold=True)),
            ("vector lanes K=4 L=1024 w8", C(4, 1024, 1, 8, vfold=True))], affine_b),
    ]


def measure_copy():
    """(ms, GB/s) of a device-to-device copy of 1 GiB, counting read + write bytes."""
    src = torch.empty(2**28 if DEV == "cuda" else 2**10, device=DEV)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return ms, 2 * src.numel() * 4 / ms / 1e6


def _smoke():
    """Shrink every size and route flashfold to the kernels on CPU tensors (interpreter)."""
    global DEV, BIG, LONG, MANY, WIDE, REC_ROWS, REC_STEPS
    from flashfold.api import reductions as api
    api._use_kernels = lambda x: True
    DEV, BIG, LONG, MANY, WIDE = "cpu", 64, 2**12, 2**9, 77
    REC_ROWS, REC_STEPS = 6, (300, 1100)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fp32 16K rows only, fewer checks")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness section")
    ap.add_argument("--no-variants", action="store_true", help="skip the heuristic variants")
    ap.add_argument("--no-graphs", action="store_true",
                    help="time eagerly only (no CUDA-graph replays)")
    ap.add_argument("--variants", metavar="OP",
                    help="only the heuristic variants whose op name contains OP (e.g. "
                         "logcumsumexp), after the copy measurement")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU run at tiny sizes through the interpreter (tests this script)")
    args = ap.parse_args()
    global GRAPHS
    GRAPHS = not args.no_graphs
    t0 = time.time()
    if args.smoke:
        _smoke()
        print("smoke run: CPU, interpreter, tiny sizes; numbers are meaningless")
    else:
        props = torch.cuda.get_device_properties(0)
        print(f"flashfold reductions: {props.name}, {props.multi_processor_count} SMs, torch "
              f"{torch.__version__}, triton {triton.__version__}, python {sys.version.split()[0]}")
    copy_ms, copy_gbs = measure_copy()
    print(f"device-to-device copy of 1 GiB: {copy_ms:.3f} ms = {copy_gbs:.0f} GB/s (read + write)")
    if args.variants:
        variants(copy_gbs, args.variants)
        print(f"correctness failures: {FAILED or 'none'}")
        return 1 if FAILED else 0
    if not args.no_check:
        correctness(args.quick)
        print(f"  [{time.time() - t0:.0f} s]")
    res = timings(args.quick, copy_gbs)
    accelerated_scan_rows(args.quick)
    quack_rows(args.quick)
    if not (args.quick or args.smoke or args.no_variants):
        variants(copy_gbs)
    print(f"\n== summary (copy {copy_gbs:.0f} GB/s in this run) ==")
    print("| op | shape | dtype | flashfold ms | GB/s | % copy | torch ms | torch GB/s | speedup "
          "| graph ms | torch graph ms | graph speedup |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    slower, slower_graph = [], []
    for op, lab, dt, ms, gbs, tms, tgbs, gms, tgms in res:
        sp = tms / ms if math.isfinite(tms) else float("nan")
        gsp = tgms / gms if math.isfinite(tgms) and math.isfinite(gms) else float("nan")
        if sp < 1.0:
            slower.append(f"{op} {lab} {dt}")
        if gsp < 1.0:
            slower_graph.append(f"{op} {lab} {dt}")
        print(f"| {op} | {lab} | {dt} | {ms:.3f} | {gbs:.0f} | {100 * gbs / copy_gbs:.1f}% | "
              f"{_cell(tms, '.3f')} | {_cell(tgbs, '.0f')} | {_cell(sp, '.2f', 'x')} | "
              f"{_cell(gms, '.3f')} | {_cell(tgms, '.3f')} | {_cell(gsp, '.2f', 'x')} |")
    print(f"\nrows slower than torch: {slower or 'none'}")
    if GRAPHS and not args.smoke:
        print(f"rows slower than torch from CUDA graphs (kernel time only): {slower_graph or 'none'}")
    print(f"correctness failures: {FAILED or 'none'}")
    print(f"total {time.time() - t0:.0f} s")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
