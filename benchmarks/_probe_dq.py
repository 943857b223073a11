"""TEMPORARY probe (tenth session; removed in the next commit): what the dQ path of the
Gluon backward costs, and variants of it. Kernel alone, TFLOP/s, variants ``(dq_mode,
dq_bufs)`` of ``kernels/attention/_var_gluon_bwd.py`` interleaved 3 times with the
committed kernel (the parent of this commit's parent: ``aaf83e8``'s parent), after
checking each variant's dQ sum and dK, dV against it. dq_mode: 0 as committed then; 1 a
plain TMA store instead of the reduce-add; 2 the dQ product only; 6 the reduce-add of
stale shared memory (no dQ store); 8 no fence (racy); 9 the dQ store only; 12 dQ stored
after the next step's S is issued; 20 dQ one step late (what ``aaf83e8`` committed);
21 the same with warpgroup 1 started half a step late; 22 dQ(j-1) issued before dS(j) is
stored (10 and 11 compile badly: see ``benchmarks/RESULTS.md``). dq_bufs 2: two staging
buffers per warpgroup. Run: ``PYTHONPATH=src python benchmarks/_probe_dq.py`` (H200,
~1 min); the variant list below is the last run's (``logs/README.md``, "Tenth session")."""
import math
import sys

import torch

sys.path.insert(0, "benchmarks")
from attention import _bench  # noqa: E402

from flashfold.kernels import launcher  # noqa: E402
from flashfold.kernels.attention import _var_gluon_bwd as V  # noqa: E402
from flashfold.kernels.attention import bwd, fwd, gluon_bwd  # noqa: E402

H, D, tokens = 16, 128, 16384
rows = [(1024, False), (4096, False), (16384, False), (1024, True), (4096, True), (16384, True)]
variants = [(0, 1), (20, 1), (22, 1)]
for N, causal in rows:
    B = tokens // N
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", generator=g).to(torch.bfloat16)
                   for _ in range(4))
    scale = 1 / math.sqrt(D)
    right = 0 if causal else None
    o, lse = fwd.attention_forward(q, k, v, scale=scale, right=right)
    dq, dk, dv, ls = bwd.prepare_backward(do, q, k, v, o, lse, scale=scale, right=right)
    dd, lam, acc = ls[0][2][4], ls[0][2][5], ls[0][2][6]
    fl = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
    for kern, grid, args, kw in ls:
        launcher.launch(kern, grid, args, kw)
    ref = acc.clone()
    mo = gluon_bwd.gluon_attention_bwd(q, k, v, do, lam, dd, acc, dk, dv, causal=causal,
                                       scale=scale, launch=False)
    ms = {vv: V.gluon_attention_bwd(q, k, v, do, lam, dd, acc, dk, dv, causal=causal,
                                    scale=scale, launch=False, dq_mode=vv[0], dq_bufs=vv[1])
          for vv in variants}
    # the double-buffered add must give the committed sums (order of adds differs)
    dk_ref, dv_ref = dk.clone(), dv.clone()
    err = []
    for vv in variants[1:]:
        acc.zero_()
        launcher.launch(*ms[vv])
        torch.cuda.synchronize()
        e = ((acc - ref).abs().max() / ref.abs().max()).item()
        err.append(f"{vv}: dQ sum rel err {e:.1e}, dK dV bitwise "
                   f"{torch.equal(dk, dk_ref) and torch.equal(dv, dv_ref)}")
    err = "; ".join(err)
    res = {}
    for rep in range(3):
        t = fl / _bench(lambda: launcher.launch(*mo)) / 1e9
        res.setdefault("committed", []).append(t)
        for vv in variants:
            t = fl / _bench(lambda: launcher.launch(*ms[vv])) / 1e9
            res.setdefault(vv, []).append(t)
    base = res["committed"]
    line = " ".join(f"{name}: " + "/".join(f"{x:.0f}" for x in r)
                    + (" (x" + "/".join(f"{x / b:.3f}" for x, b in zip(r, base)) + ")")
                    for name, r in res.items())
    print(f"N {N} {'causal' if causal else 'full'} [alone TFLOP/s; variant=(dq_mode, dq_bufs)] "
          f"{err}\n   {line}", flush=True)
    del q, k, v, do, o, lse, dq, dk, dv, ls, acc, ref
