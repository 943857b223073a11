"""TEMPORARY probe (removed in the next commit; thirteenth session): dK/dV by TMA stores
against register stores for long dense programs (4K: 64 steps, 8K: 128, 16K: 256), kernel
alone, 5 interleaved repetitions; dK, dV bitwise equal.
Run: ``PYTHONPATH=src python benchmarks/_probe_s13.py`` (H200, ~1.5 min)."""
import math
import sys

import torch

sys.path.insert(0, "benchmarks")
from attention import _bench  # noqa: E402

from flashfold.kernels import launcher  # noqa: E402
from flashfold.kernels.attention import bwd, fwd, gluon_bwd  # noqa: E402

H, D, tokens = 16, 128, 16384
for N in (4096, 8192, 16384):
    B = tokens // N
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", generator=g).to(torch.bfloat16)
                   for _ in range(4))
    scale = 1 / math.sqrt(D)
    o, lse = fwd.attention_forward(q, k, v, scale=scale)
    dq, dk, dv, launches = bwd.prepare_backward(do, q, k, v, o, lse, scale=scale)
    dd, lam, acc = launches[0][2][4:7]
    fl = 2.5 * 4 * B * H * N * N * D
    outs, res = {}, {True: [], False: []}
    for tma in (False, True):
        m = gluon_bwd.gluon_attention_bwd(q, k, v, do, lam, dd, acc, dk, dv, causal=False,
                                          scale=scale, launch=False, tma_store=tma)
        launcher.launch(*m)
        torch.cuda.synchronize()
        outs[tma] = (m, dk.clone(), dv.clone())
    assert torch.equal(outs[True][1], outs[False][1]) and torch.equal(outs[True][2], outs[False][2])
    for rep in range(5):
        for tma in (False, True):
            res[tma].append(fl / _bench(lambda: launcher.launch(*outs[tma][0])) / 1e9)
    print(f"N {N} full kernel TFLOP/s: register " + "/".join(f"{t:.0f}" for t in res[False])
          + "; TMA " + "/".join(f"{t:.0f}" for t in res[True]) + " (TMA/register "
          + "/".join(f"{a / b:.3f}" for a, b in zip(res[True], res[False])) + ")", flush=True)
    del q, k, v, do, o, lse, dq, dk, dv, launches, outs
    torch.cuda.empty_cache()
