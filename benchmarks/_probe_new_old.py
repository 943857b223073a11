"""TEMPORARY probe (eleventh session): the whole backward call with two key tiles per program (Gluon
kernel (working tree) against the committed kernel (``_old_gluon_bwd``, HEAD's copy) and
SDPA cuDNN's backward, interleaved, TFLOP/s; plus the kernels alone."""
import math
import sys

import torch

sys.path.insert(0, "benchmarks")
from attention import _bench, _sdpa_train  # noqa: E402

from flashfold.kernels import launcher  # noqa: E402
from flashfold.kernels.attention import _old_gluon_bwd as O  # noqa: E402
from flashfold.kernels.attention import bwd, fwd, gluon_bwd  # noqa: E402

H, D, tokens = 16, 128, 16384
cudnn = _sdpa_train("CUDNN_ATTENTION")
for N in (1024, 4096, 16384):
    for causal in (False, True):
        B = tokens // N
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda", generator=g).to(torch.bfloat16)
                       for _ in range(4))
        scale = 1 / math.sqrt(D)
        right = 0 if causal else None
        o, lse = fwd.attention_forward(q, k, v, scale=scale, right=right)
        dq, dk, dv, ls = bwd.prepare_backward(do, q, k, v, o, lse, scale=scale, right=right)
        assert ls[1][0] is gluon_bwd._attn_bwd_ws
        dd, lam, acc = ls[0][2][4], ls[0][2][5], ls[0][2][6]
        old = O.gluon_attention_bwd(q, k, v, do, lam, dd, acc, dk, dv, causal=causal,
                                    scale=scale, launch=False)
        ls_old = [ls[0], old] + ls[2:]

        def run(launches):
            for lz in launches:
                launcher.launch(*lz)
        run(ls_old)
        ref = [t.clone() for t in (dq, dk, dv)]
        run(ls)
        torch.cuda.synchronize()
        dqe = ((dq.float() - ref[0].float()).abs().max() / ref[0].float().abs().max()).item()
        same = torch.equal(dk, ref[1]) and torch.equal(dv, ref[2])
        fl = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        oc = cudnn(qg, kg, vg, causal)
        res = {"new": [], "old": [], "cudnn": [], "new alone": [], "old alone": []}
        for rep in range(3):
            res["new"].append(fl / _bench(lambda: run(ls)) / 1e9)
            res["old"].append(fl / _bench(lambda: run(ls_old)) / 1e9)
            res["cudnn"].append(fl / _bench(lambda: torch.autograd.grad(
                oc, (qg, kg, vg), do, retain_graph=True)) / 1e9)
            res["new alone"].append(fl / _bench(lambda: launcher.launch(*ls[1])) / 1e9)
            res["old alone"].append(fl / _bench(lambda: launcher.launch(*old)) / 1e9)
        f = lambda xs: "/".join(f"{x:.0f}" for x in xs)  # noqa: E731
        r = lambda a, b: "/".join(f"{x / y:.3f}" for x, y in zip(res[a], res[b]))  # noqa: E731
        print(f"N {N} {'causal' if causal else 'full'}: dQ rel diff {dqe:.1e}, dK dV bitwise {same}\n"
              f"   " + "  ".join(f"{k_}: {f(v_)}" for k_, v_ in res.items())
              + f"\n   new/cudnn {r('new', 'cudnn')}  old/cudnn {r('old', 'cudnn')}  "
              f"new/old {r('new', 'old')}  alone new/old {r('new alone', 'old alone')}", flush=True)
        del q, k, v, do, o, lse, dq, dk, dv, ls, ls_old, oc, qg, kg, vg
