"""TEMPORARY probe (removed in the next commit; fourteenth session).

Gluon backward alone: the last step's dQ added before dK, dV are written (dq_first) against
after (the committed order); 3 interleaved repetitions; dK, dV must be bitwise equal.
Run: ``PYTHONPATH=src python benchmarks/_probe_s14_bwd.py`` (H200, ~3 min)."""
import math
import sys

import torch

sys.path.insert(0, "benchmarks")
from attention import _bench  # noqa: E402

from flashfold.kernels import launcher  # noqa: E402
from flashfold.kernels.attention import bwd, fwd, gluon_bwd  # noqa: E402

H, tokens = 16, 16384
ROWS = [(128, 1024, False), (128, 1024, True), (128, 4096, False), (128, 4096, True),
        (128, 16384, False), (128, 16384, True), (64, 4096, False), (64, 4096, True)]
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
    outs, res = {}, {f: [] for f in (False, True)}
    for first in (False, True):
        acc.zero_()
        m = gluon_bwd.gluon_attention_bwd(q, k, v, do, lam, dd, acc, dk, dv, causal=causal,
                                          scale=scale, launch=False, dq_first=first)
        launcher.launch(*m)
        torch.cuda.synchronize()
        outs[first] = (m, dk.clone(), dv.clone(), acc.clone())
    same = all(torch.equal(outs[True][i], outs[False][i]) for i in (1, 2))
    dq_err = (outs[True][3] - outs[False][3]).abs().max().item()
    tag = f"D {D} N {N} {'causal' if causal else 'full'} ({'TMA' if outs[False][0][3]['STORE_TMA'] else 'register'} stores)"
    print(f"{tag}: dK, dV bitwise equal: {same}; max |dQ acc diff| {dq_err:.2e}", flush=True)
    assert same and dq_err < 1e-2 * outs[False][3].abs().max().item()
    for rep in range(3):
        for first in (False, True):
            res[first].append(fl / _bench(lambda: launcher.launch(*outs[first][0])) / 1e9)
    print(f"{tag} kernel TFLOP/s old / dq_first: " + " ".join(
        f"{a:.0f}/{b:.0f} ({b / a:.3f})" for a, b in zip(res[False], res[True])), flush=True)
    del q, k, v, do, o, lse, dq, dk, dv, launches, outs
    torch.cuda.empty_cache()
