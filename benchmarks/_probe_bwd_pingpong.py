"""TEMPORARY probe (fifteenth session; removed in the next commit): the Gluon backward with
its consumer warpgroups taking turns (``pingpong`` 1: the step's S^T, dP^T issues; 3: also
dV and dQ + dK) against without, kernel alone, 3 interleaved repetitions; dK, dV must be
bitwise equal. ``PYTHONPATH=src python benchmarks/_probe_bwd_pingpong.py``"""
import math
import sys

import torch

sys.path.insert(0, "benchmarks")
from attention import _bench  # noqa: E402

from flashfold.kernels import launcher  # noqa: E402
from flashfold.kernels.attention import bwd, fwd, gluon_bwd  # noqa: E402

H, tokens = 16, 16384
ROWS = [(128, 1024, False), (128, 1024, True), (128, 4096, False), (128, 4096, True),
        (128, 16384, False), (128, 16384, True), (64, 1024, False), (64, 4096, False),
        (64, 4096, True), (64, 16384, False)]
VARIANTS, REPS = (0, 1, 3), 3
if sys.argv[1:] == ["causal"]:   # second run: the causal rows, ping-pong 1 only, 5 repetitions
    ROWS = [(D, N, True) for D in (128, 64) for N in (1024, 4096, 16384)]
    VARIANTS, REPS = (0, 1), 5
for D, N, causal in ROWS:
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
    outs, res = {}, {}
    for pp in VARIANTS:
        acc.zero_()
        m = gluon_bwd.gluon_attention_bwd(q, k, v, do, lam, dd, acc, dk, dv, causal=causal,
                                          scale=scale, launch=False, pingpong=pp)
        launcher.launch(*m)
        torch.cuda.synchronize()
        outs[pp] = (m, dk.clone(), dv.clone(), acc.clone())
        res[pp] = []
    tag = f"D {D} N {N} {'causal' if causal else 'full'}"
    for pp in VARIANTS[1:]:
        same = all(torch.equal(outs[pp][i], outs[0][i]) for i in (1, 2))
        err = ((outs[pp][3] - outs[0][3]).abs().max() / outs[0][3].abs().max()).item()
        print(f"{tag} pingpong {pp}: dK, dV bitwise equal: {same}; dQ acc rel. diff {err:.1e}",
              flush=True)
        if not (same and err < 1e-4):
            res.pop(pp)
    for rep in range(REPS):
        for pp in res:
            res[pp].append(fl / _bench(lambda: launcher.launch(*outs[pp][0])) / 1e9)
    print(f"{tag} kernel TFLOP/s " + " | ".join(
        f"pp{pp}: " + " ".join(f"{x:.0f}" for x in res[pp]) for pp in res)
        + " | ratios to pp0: " + " | ".join(
        f"pp{pp}: " + " ".join(f"{x / b:.3f}" for x, b in zip(res[pp], res[0]))
        for pp in res if pp), flush=True)
    del q, k, v, do, o, lse, dq, dk, dv, launches, outs
    torch.cuda.empty_cache()
