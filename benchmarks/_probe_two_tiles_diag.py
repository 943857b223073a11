"""TEMPORARY probe (eleventh session): why two key tiles per program ran slower. The Gluon
backward kernel alone (TFLOP/s, 3 interleaved repetitions): HEAD~1's kernel (old), the
two-tile code with one tile per program (tiles=1), the two-tile code with its second tile
compiled but never live (one tile per program: _var_gluon_bwd, DIAG), and two tiles."""
import math
import sys

import torch

sys.path.insert(0, "benchmarks")
from attention import _bench  # noqa: E402

from flashfold.kernels import launcher  # noqa: E402
from flashfold.kernels.attention import _old_gluon_bwd as O  # noqa: E402
from flashfold.kernels.attention import _var_gluon_bwd as V  # noqa: E402
from flashfold.kernels.attention import bwd, fwd, gluon_bwd  # noqa: E402

H, D, tokens = 16, 128, 16384
for N, causal in ((1024, False), (4096, False), (16384, False), (16384, True)):
    B = tokens // N
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", generator=g).to(torch.bfloat16)
                   for _ in range(4))
    scale = 1 / math.sqrt(D)
    right = 0 if causal else None
    o, lse = fwd.attention_forward(q, k, v, scale=scale, right=right)
    dq, dk, dv, ls = bwd.prepare_backward(do, q, k, v, o, lse, scale=scale, right=right)
    dd, lam, acc = ls[0][2][4], ls[0][2][5], ls[0][2][6]
    args = (q, k, v, do, lam, dd, acc, dk, dv)
    kw = dict(causal=causal, scale=scale, launch=False)
    variants = {"old": O.gluon_attention_bwd(*args, **kw),
                "tiles=1": gluon_bwd.gluon_attention_bwd(*args, tiles=1, **kw),
                "2 compiled, 1 live": V.gluon_attention_bwd(*args, tiles=2, **kw),
                "tiles=2": gluon_bwd.gluon_attention_bwd(*args, tiles=2, **kw)}
    outs = {}
    for name, lz in variants.items():
        launcher.launch(*ls[0])
        launcher.launch(*lz)
        torch.cuda.synchronize()
        outs[name] = (dk.clone(), dv.clone())
    same = {n: torch.equal(outs[n][0], outs["old"][0]) and torch.equal(outs[n][1], outs["old"][1])
            for n in outs}
    fl = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
    res = {n: [] for n in variants}
    for rep in range(3):
        for name, lz in variants.items():
            res[name].append(fl / _bench(lambda lz=lz: launcher.launch(*lz)) / 1e9)
    print(f"N {N} {'causal' if causal else 'full'}: dK dV equal to old {same}")
    for name, xs in res.items():
        print(f"   {name:20s} " + " ".join(f"{x:5.0f}" for x in xs)
              + "   /old " + " ".join(f"{x / y:.3f}" for x, y in zip(xs, res["old"])), flush=True)
