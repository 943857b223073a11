"""TEMPORARY probe (fifteenth session; removed in the next commit): the Gluon backward's
dense programs persistent (one per SM, key tiles pid, pid + grid, ...) against one program
per key tile (default stores, and register stores: the persistent variant's), kernel
alone, 3 interleaved repetitions; dK, dV bitwise equal to the register-store run.
``PYTHONPATH=src python benchmarks/_probe_bwd_persistent.py``"""
import math
import sys

import torch

sys.path.insert(0, "benchmarks")
from attention import _bench  # noqa: E402

from flashfold.kernels import launcher  # noqa: E402
from flashfold.kernels.attention import bwd, fwd, gluon_bwd  # noqa: E402

H, tokens = 16, 16384
VARIANTS = {"default": {}, "register": dict(tma_store=False),
            "persistent": dict(tma_store=False, persistent=True)}
for D in (128, 64):
    for N in (1024, 4096, 16384):
        B = tokens // N
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda", generator=g).to(torch.bfloat16)
                       for _ in range(4))
        scale = 1 / math.sqrt(D)
        o, lse = fwd.attention_forward(q, k, v, scale=scale)
        dq, dk, dv, launches = bwd.prepare_backward(do, q, k, v, o, lse, scale=scale)
        dd, lam, acc = launches[0][2][4:7]
        fl = 2.5 * 4 * B * H * N * N * D
        outs, res = {}, {}
        for name, kw in VARIANTS.items():
            acc.zero_()
            dk.fill_(float("nan"))
            m = gluon_bwd.gluon_attention_bwd(q, k, v, do, lam, dd, acc, dk, dv, causal=False,
                                              scale=scale, launch=False, **kw)
            launcher.launch(*m)
            torch.cuda.synchronize()
            outs[name] = (m, dk.clone(), dv.clone(), acc.clone())
            res[name] = []
        tag = f"D {D} N {N} full"
        ref = outs["register"]
        p = outs["persistent"]
        same = torch.equal(p[1], ref[1]) and torch.equal(p[2], ref[2])
        err = ((p[3] - ref[3]).abs().max() / ref[3].abs().max()).item()
        print(f"{tag} persistent: dK, dV bitwise equal: {same}; dQ acc rel. diff {err:.1e}",
              flush=True)
        if not (same and err < 1e-4):
            res.pop("persistent")
        for rep in range(3):
            for name in res:
                res[name].append(fl / _bench(lambda: launcher.launch(*outs[name][0])) / 1e9)
        print(f"{tag} kernel TFLOP/s " + " | ".join(
            f"{n}: " + " ".join(f"{x:.0f}" for x in res[n]) for n in res) + " | ratios to default: "
            + " | ".join(f"{n}: " + " ".join(f"{x / b:.3f}" for x, b in zip(res[n], res["default"]))
                         for n in res if n != "default"), flush=True)
        del q, k, v, do, o, lse, dq, dk, dv, launches, outs
        torch.cuda.empty_cache()
