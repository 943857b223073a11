"""TEMPORARY probe (removed in the next commit; thirteenth session): the Gluon backward's
Q/dO ring 3 deep against 2 (kernel alone, 3 interleaved repetitions; dK, dV bitwise
equal), head_dim 64 on the six target rows, head_dim 128 at 1K and 4K dense.
Run: ``PYTHONPATH=src python benchmarks/_probe_s13.py`` (H200, ~1.5 min)."""
import math
import sys

import torch

sys.path.insert(0, "benchmarks")
from attention import _bench  # noqa: E402

from flashfold.kernels import launcher  # noqa: E402
from flashfold.kernels.attention import bwd, fwd, gluon_bwd  # noqa: E402

H, tokens = 16, 16384
rows = [(64, N, c) for N in (1024, 4096, 16384) for c in (False, True)]
rows += [(128, 1024, False), (128, 4096, False)]
for D, N, causal in rows:
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
    outs, res = {}, {2: [], 3: []}
    for st in (2, 3):
        gluon_bwd.STAGES = st
        m = gluon_bwd.gluon_attention_bwd(q, k, v, do, lam, dd, acc, dk, dv, causal=causal,
                                          scale=scale, launch=False)
        gluon_bwd.STAGES = 2
        assert m[3]["STAGES"] == st
        launcher.launch(*m)
        torch.cuda.synchronize()
        outs[st] = (m, dk.clone(), dv.clone())
    assert torch.equal(outs[2][1], outs[3][1]) and torch.equal(outs[2][2], outs[3][2])
    for rep in range(3):
        for st in (2, 3):
            res[st].append(fl / _bench(lambda: launcher.launch(*outs[st][0])) / 1e9)
    print(f"d{D} N {N} {'causal' if causal else 'full'} kernel TFLOP/s: 2 stages "
          + "/".join(f"{t:.0f}" for t in res[2]) + "; 3 stages " + "/".join(f"{t:.0f}" for t in res[3])
          + " (3/2 " + "/".join(f"{a / b:.3f}" for a, b in zip(res[3], res[2])) + ")", flush=True)
    del q, k, v, do, o, lse, dq, dk, dv, launches, outs
    torch.cuda.empty_cache()
