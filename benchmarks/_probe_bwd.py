"""TEMPORARY probe (deleted after the session's runs): the Gluon backward with the fused
dQ conversion against the conversion pass, and cuDNN, on the six targets rows."""
import math
import sys

import torch

sys.path.insert(0, "benchmarks")
from attention import _bench, _sdpa_train  # noqa: E402

from flashfold.kernels import launcher  # noqa: E402
from flashfold.kernels.attention import bwd, fwd, gluon_bwd  # noqa: E402

cudnn = _sdpa_train("CUDNN_ATTENTION")
H, D, tokens = 16, 128, 16384
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

def call(key, fused):
    q, k, v, do, o, lse, scale, right = data[key]
    gluon_bwd.FUSE_DQ = fused
    out = bwd.attention_backward(do, q, k, v, o, lse, scale=scale, right=right)
    return out

print("| rep | N | mask | fused | pass | cuDNN | fused/pass | fused/cuDNN | pass/cuDNN | pass kernel alone | dq rel diff |")
for rep in range(2):
    for key in rows:
        N, causal = key
        q, k, v, do, o, lse, scale, right = data[key]
        B = tokens // N
        fl = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
        a = call(key, True); b = call(key, False)
        diff = (a[0].float() - b[0].float()).abs().max().item() / b[0].float().abs().max().item()
        same_kv = torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
        t_f = fl / _bench(lambda: call(key, True)) / 1e9
        t_p = fl / _bench(lambda: call(key, False)) / 1e9
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        oc = cudnn(qg, kg, vg, causal)
        t_c = fl / _bench(lambda: torch.autograd.grad(oc, (qg, kg, vg), do, retain_graph=True)) / 1e9
        gluon_bwd.FUSE_DQ = False
        launch = bwd.prepare_backward(do, q, k, v, o, lse, scale=scale, right=right)[3][1]
        alone = fl / _bench(lambda: launcher.launch(*launch)) / 1e9
        print(f"| {rep} | {N} | {'causal' if causal else 'full'} | {t_f:.0f} | {t_p:.0f} | {t_c:.0f} | "
              f"{t_f / t_p:.3f} | {t_f / t_c:.3f} | {t_p / t_c:.3f} | {alone:.0f} | {diff:.1e}"
              f"{'' if same_kv else ' dK/dV DIFFER'} |", flush=True)
        del oc, qg, kg, vg
