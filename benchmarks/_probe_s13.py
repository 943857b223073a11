"""TEMPORARY probe (removed in the next commit; thirteenth session).

1. Gluon backward, kernel alone (do_bench, L2 flushed), causal target rows: program
   orders ``heads_per_wave`` = 1 (head-major, the old order) against the new default
   (:func:`gluon_bwd.wave_heads`) and neighbours; 3 interleaved repetitions. dK, dV must
   be bitwise equal across orders. Dense 4K once as a control (G = 1 either way).
2. Decode split counts 1, 2, 3, 4, 5 at the target rows, graph and clean L2, 3 reps.
Run: ``PYTHONPATH=src python benchmarks/_probe_s13.py`` (H200, ~2-3 min)."""
import math
import sys

import torch

sys.path.insert(0, "benchmarks")
from attention import _bench  # noqa: E402

from flashfold.kernels import launcher  # noqa: E402
from flashfold.kernels.attention import bwd, fwd, gluon_bwd  # noqa: E402

H, D, tokens = 16, 128, 16384
sms = launcher.sm_count(torch.device("cuda"))
if "--decode-only" not in sys.argv:
    for N, causal in ((1024, True), (4096, True), (16384, True), (4096, False)):
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
        n_n, n_bh = N // 128, B * H
        default = gluon_bwd.wave_heads(causal, n_n, n_bh, sms)
        cands = [1, default] + [gg for gg in (default // 2, default * 2, 3)
                                if causal and 1 <= gg <= n_bh]
        variants = list(dict.fromkeys(cands))
        outs, res = {}, {G: [] for G in variants}
        for G in variants:
            acc.zero_()
            m = gluon_bwd.gluon_attention_bwd(q, k, v, do, lam, dd, acc, dk, dv, causal=causal,
                                              scale=scale, launch=False, heads_per_wave=G)
            launcher.launch(*m)
            torch.cuda.synchronize()
            outs[G] = (m, dk.clone(), dv.clone(), acc.clone())
        for G in variants:
            same = all(torch.equal(outs[G][i], outs[1][i]) for i in (1, 2))
            dq_err = (outs[G][3] - outs[1][3]).abs().max().item()
            print(f"N {N} {'causal' if causal else 'full'} G {G}: dK, dV bitwise equal to G 1: "
                  f"{same}; max |dQ acc - G1| {dq_err:.2e}", flush=True)
            assert same and dq_err < 1e-2 * outs[1][3].abs().max().item()
        for rep in range(3):
            for G in variants:
                res[G].append(fl / _bench(lambda: launcher.launch(*outs[G][0])) / 1e9)
        base = res[1]
        print(f"N {N} {'causal' if causal else 'full'} kernel TFLOP/s (default G {default}): "
              + "; ".join(f"G{G} " + "/".join(f"{t:.0f}" for t in ts) + " (" + "/".join(
                  f"{t / b:.3f}" for t, b in zip(ts, base)) + ")" for G, ts in res.items()),
              flush=True)
        del q, k, v, do, o, lse, dq, dk, dv, launches, outs
        torch.cuda.empty_cache()

from decode import D as DD, Cache, TARGETS, sdpa, timed  # noqa: E402

from flashfold.kernels.decode import splitkv  # noqa: E402
from torch.nn.attention import SDPBackend  # noqa: E402

for batch, length in TARGETS:
    c = Cache(batch, length)
    nbytes = c.kv_bytes()
    ref = sdpa(SDPBackend.CUDNN_ATTENTION, c.q, c.k, c.v)
    fns = {"cuDNN": ref}
    o_ref = splitkv.splitkv_decode(c.q, c.k, c.v, c.lens, None, scale=DD ** -0.5)[0]
    for s in (1, 2, 3, 4, 5):
        fn = (lambda c=c, s=s: splitkv.splitkv_decode(c.q, c.k, c.v, c.lens, None,
                                                      scale=DD ** -0.5, num_splits=s))
        assert (fn()[0].float() - o_ref.float()).abs().max().item() < 2e-2, s
        fns[f"s{s}"] = fn
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
