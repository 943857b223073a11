"""TEMPORARY probe (removed in the next commit; ninth session): the Gluon backward with a
round loop, one program per key tile (grid = items) against persistent rounds (grid = SMs),
whole call and kernel alone, against the committed kernel (``_old_gluon_bwd.py``, a copy of
the parent commit's ``gluon_bwd.py``) and cuDNN, on the six targets rows.
Run: ``PYTHONPATH=src python benchmarks/_probe_pers.py`` (H200, ~50 s)."""
import math
import sys

import torch

sys.path.insert(0, "benchmarks")
from attention import _bench, _sdpa_train  # noqa: E402

from flashfold.kernels import launcher  # noqa: E402
from flashfold.kernels.attention import _old_gluon_bwd as old  # noqa: E402
from flashfold.kernels.attention import bwd, fwd  # noqa: E402

cudnn = _sdpa_train("CUDNN_ATTENTION")
H, D, tokens = 16, 128, 16384
SMS = launcher.sm_count(torch.device("cuda"))
rows = [(N, c) for N in (1024, 4096, 16384) for c in (False, True)]
data = {}
for N, causal in rows:
    B = tokens // N
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", generator=g).to(torch.bfloat16)
                   for _ in range(4))
    scale = 1 / math.sqrt(D)
    right = 0 if causal else None
    o, lse = fwd.attention_forward(q, k, v, scale=scale, right=right)
    data[N, causal] = (q, k, v, do, o, lse, scale, right)


def launches(key, pers):
    q, k, v, do, o, lse, scale, right = data[key]
    dq, dk, dv, ls = bwd.prepare_backward(do, q, k, v, o, lse, scale=scale, right=right)
    kernel, grid, args, kwargs = ls[1]
    items = (q.shape[2] // 128) * q.shape[0] * k.shape[1]
    ls[1] = (kernel, (min(items, SMS) if pers else items,), args, kwargs)
    return (dq, dk, dv), ls


def call(key, pers):
    out, ls = launches(key, pers)
    for launch in ls:
        launcher.launch(*launch)
    return out


def old_main(key):
    q, k, v, do, o, lse, scale, right = data[key]
    (dq, dk, dv), ls = launches(key, False)
    dd, lam, dq_acc = ls[0][2][4], ls[0][2][5], ls[0][2][6]
    return ls, old.gluon_attention_bwd(q, k, v, do, lam, dd, dq_acc, dk, dv, causal=right == 0,
                                       scale=scale, launch=False)


def old_call(key):
    ls, main = old_main(key)
    launcher.launch(*ls[0]); launcher.launch(*main); launcher.launch(*ls[2])


print("| rep | N | mask | per-item | persistent | cuDNN | pers/item | item/cuDNN | pers/cuDNN "
      "| kernel alone item | pers | pers/item | dK,dV equal | dq rel diff | old call | old alone | item/old alone |")
for rep in range(2):
    for key in rows:
        N, causal = key
        q, k, v, do, o, lse, scale, right = data[key]
        B = tokens // N
        fl = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
        a = call(key, False); b = call(key, True)
        torch.cuda.synchronize()
        diff = ((a[0].float() - b[0].float()).abs().max() / a[0].float().abs().max()).item()
        same = torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
        t_i = fl / _bench(lambda: call(key, False)) / 1e9
        t_p = fl / _bench(lambda: call(key, True)) / 1e9
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        oc = cudnn(qg, kg, vg, causal)
        t_c = fl / _bench(lambda: torch.autograd.grad(oc, (qg, kg, vg), do, retain_graph=True)) / 1e9
        del oc, qg, kg, vg
        alone = []
        for pers in (False, True):
            main = launches(key, pers)[1][1]
            alone.append(fl / _bench(lambda: launcher.launch(*main)) / 1e9)
        t_o = fl / _bench(lambda: old_call(key)) / 1e9
        omain = old_main(key)[1]
        a_o = fl / _bench(lambda: launcher.launch(*omain)) / 1e9
        print(f"| {rep} | {N} | {'causal' if causal else 'full'} | {t_i:.0f} | {t_p:.0f} | {t_c:.0f} | "
              f"{t_p / t_i:.3f} | {t_i / t_c:.3f} | {t_p / t_c:.3f} | {alone[0]:.0f} | {alone[1]:.0f} | "
              f"{alone[1] / alone[0]:.3f} | {same} | {diff:.1e} | {t_o:.0f} | {a_o:.0f} | {alone[0] / a_o:.3f} |",
              flush=True)
