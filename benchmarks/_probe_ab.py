"""TEMPORARY probe (removed in the next commit; twelfth session).

1. Gluon backward, kernel alone (do_bench, L2 flushed), variants of the committed kernel in
   one process, 3 interleaved repetitions: ``prefetch`` (the producer asks L2 for the K, V
   tiles of program ``pid + SMs``, which likely follows this one on some SM: a program
   waits ~1.7 us for its K, V from DRAM). dK, dV must be bitwise equal to the committed
   variant's. (The first version of this probe measured EARLY and WIDE variants: both
   lost, see RESULTS.md.)
2. Decode at the target rows: split-kernel tiles 64/4w/3s (default) against 32/4w/4s,
   through TMA and pointers, against cuDNN, graph and clean L2, 3 repetitions.
Run: ``PYTHONPATH=src python benchmarks/_probe_ab.py`` (H200, ~3 min)."""
import math
import sys

import torch

sys.path.insert(0, "benchmarks")
from attention import _bench  # noqa: E402

from flashfold.kernels import launcher  # noqa: E402
from flashfold.kernels.attention import bwd, fwd, gluon_bwd  # noqa: E402

H, D, tokens = 16, 128, 16384
rows = [(1024, False), (1024, True), (4096, False), (4096, True), (16384, False)]
if "--decode-only" not in sys.argv:
    for N, causal in rows:
        B = tokens // N
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda", generator=g).to(torch.bfloat16)
                       for _ in range(4))
        scale = 1 / math.sqrt(D)
        right = 0 if causal else None
        o, lse = fwd.attention_forward(q, k, v, scale=scale, right=right)
        dq, dk, dv, launches = bwd.prepare_backward(do, q, k, v, o, lse, scale=scale, right=right)
        dd, lam, acc = launches[0][2][4:7]
        fl = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
        variants = {"base": {}, "prefetch": dict(prefetch=True)}
        outs, res = {}, {name: [] for name in variants}
        for name, kw in variants.items():
            acc.zero_()
            m = gluon_bwd.gluon_attention_bwd(q, k, v, do, lam, dd, acc, dk, dv, causal=causal,
                                              scale=scale, launch=False, **kw)
            launcher.launch(*m)
            torch.cuda.synchronize()
            outs[name] = (m, dk.clone(), dv.clone(), acc.clone())
        for name in variants:
            same = all(torch.equal(outs[name][i], outs["base"][i]) for i in (1, 2))
            dq_err = (outs[name][3] - outs["base"][3]).abs().max().item()
            print(f"N {N} {'causal' if causal else 'full'} {name}: dK, dV bitwise equal to base: {same}; "
                  f"max |dQ acc - base| {dq_err:.2e}", flush=True)
            assert same and dq_err < 1e-2 * outs["base"][3].abs().max().item()
        for rep in range(3):
            for name in variants:
                res[name].append(fl / _bench(lambda: launcher.launch(*outs[name][0])) / 1e9)
        base = res["base"]
        print(f"N {N} {'causal' if causal else 'full'} kernel TFLOP/s: " + "; ".join(
            f"{name} " + "/".join(f"{t:.0f}" for t in ts) + " (" + "/".join(
                f"{t / b:.3f}" for t, b in zip(ts, base)) + ")" for name, ts in res.items()),
            flush=True)
        del q, k, v, do, o, lse, dq, dk, dv, launches, outs

from decode import D as DD, Cache, TARGETS, sdpa, timed  # noqa: E402

from flashfold.kernels.decode import splitkv  # noqa: E402
from torch.nn.attention import SDPBackend  # noqa: E402

for batch, length in (TARGETS if "--splits" not in sys.argv else ()):
    c = Cache(batch, length)
    nbytes = c.kv_bytes()
    ref = sdpa(SDPBackend.CUDNN_ATTENTION, c.q, c.k, c.v)
    o_ref = splitkv.splitkv_decode(c.q, c.k, c.v, c.lens, None, scale=DD ** -0.5)[0]
    fns = {"cuDNN": ref}
    for bn, w, st in ((64, 4, 3), (32, 4, 4)):
        for tma in (True, False):
            cfg = splitkv.DecodeConfig(block_n=bn, num_warps=w, num_stages=st)
            fn = (lambda c=c, cfg=cfg, tma=tma: splitkv.splitkv_decode(
                c.q, c.k, c.v, c.lens, None, scale=DD ** -0.5, config=cfg, tma=tma))
            o = fn()[0]
            if tma:
                o_tma = o
            else:      # same tiles: the same bits; other tiles: another fold order
                assert torch.equal(o, o_tma), (bn, w, st)
            assert (o.float() - o_ref.float()).abs().max().item() < 2e-2, (bn, w, st, tma)
            fns[f"{bn}/{w}w/{st}s{' tma' if tma else ''}"] = fn
    for mode in ("graph", "clean"):
        res = {name: [] for name in fns}
        for rep in range(3):
            for name, fn in fns.items():
                res[name].append(nbytes / timed(fn, True, clean=mode == "clean") / 1e6)
        cud = res["cuDNN"]
        print(f"decode {batch} x {length} {mode} GB/s: " + "; ".join(
            f"{name} " + "/".join(f"{t:.0f}" for t in ts) + " (" + "/".join(
                f"{t / b:.3f}" for t, b in zip(ts, cud)) + ")" for name, ts in res.items()),
            flush=True)
    del c
    torch.cuda.empty_cache()

# 3. split counts at the target rows (default tiles and load path), graph and clean
if "--splits" in sys.argv:
    for batch, length in TARGETS:
        c = Cache(batch, length)
        nbytes = c.kv_bytes()
        ref = sdpa(SDPBackend.CUDNN_ATTENTION, c.q, c.k, c.v)
        for mode in ("graph", "clean"):
            cud = nbytes / timed(ref, True, clean=mode == "clean") / 1e6
            out = []
            for s in (4, 6, 11, 12, 16, 22, 24, 33, 48, 64, 66, 99, 128):
                fn = (lambda c=c, s=s: splitkv.splitkv_decode(c.q, c.k, c.v, c.lens, None,
                                                              scale=DD ** -0.5, num_splits=s))
                gb = nbytes / timed(fn, True, clean=mode == "clean") / 1e6
                out.append(f"{s}:{gb:.0f} ({gb / cud:.3f})")
            print(f"splits {batch} x {length} {mode}: cuDNN {cud:.0f}; " + " ".join(out), flush=True)
        del c
        torch.cuda.empty_cache()
