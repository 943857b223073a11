"""TEMPORARY probe (fifteenth session; removed in the next commit): the 64-key backward
(``kernels/attention/_probe_bwd64.py``) on the H200: dK, dV and the dQ accumulator against
the committed Gluon kernel, then kernel-alone TFLOP/s, 3 interleaved repetitions, and
cuDNN's whole backward for scale. ``PYTHONPATH=src python benchmarks/_probe_bwd64_run.py``"""
import math
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, "benchmarks")
from attention import _bench  # noqa: E402

from flashfold.kernels import launcher  # noqa: E402
from flashfold.kernels.attention import _probe_bwd64 as P  # noqa: E402
from flashfold.kernels.attention import bwd, fwd, gluon_bwd, gluon_fwd  # noqa: E402

VARIANTS = {"A 1 stage": dict(),
            "A, dQ not added": dict(add_dq=False),
            "2 stages, dQ/8": dict(stages=2, dq_split=8, dq_bufs=1),
            "2 st, dQ/4 1CTA": dict(stages=2, dq_split=4, dq_bufs=1)}
only = sys.argv[1:]
H, tokens = 16, 16384
ROWS = [(128, 1024, False), (128, 4096, False), (128, 4096, True)]
sms = gluon_fwd.num_sms(torch.empty(1, device="cuda"))
for D, N, causal in ROWS:
    tag = f"D {D} N {N} {'causal' if causal else 'full'}"
    if only and tag.split()[3] + str(N) not in only:
        continue
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
    acc.zero_()
    base = gluon_bwd.gluon_attention_bwd(q, k, v, do, lam, dd, acc, dk, dv, causal=causal,
                                         scale=scale, launch=False)
    launcher.launch(*base)
    torch.cuda.synchronize()
    ref = (dk.clone(), dv.clone(), acc.clone())
    runs = {"committed": base}
    for name, kw in VARIANTS.items():
        dk2, dv2 = torch.zeros_like(dk), torch.zeros_like(dv)
        acc.zero_()
        m = P.bwd64(q, k, v, do, lam, dd, acc, dk2, dv2, causal=causal, scale=scale,
                    num_sms=sms, **kw)
        launcher.launch(*m)
        torch.cuda.synchronize()
        errs = [((a.float() - r.float()).abs().max() / r.float().abs().max()).item()
                for a, r in zip((dk2, dv2, acc), ref)]
        ok = max(errs[:2] if kw.get('add_dq') is False else errs) < 2e-2
        print(f"{tag} {name}: rel. max diff vs committed dK {errs[0]:.1e} dV {errs[1]:.1e} "
              f"dQacc {errs[2]:.1e} {'OK' if ok else 'WRONG'}", flush=True)
        if ok:
            runs[name] = m
    res = {n: [] for n in runs}
    for rep in range(3):
        for n, m in runs.items():
            res[n].append(fl / _bench(lambda: launcher.launch(*m)) / 1e9)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        oc = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
    cu = fl / _bench(lambda: torch.autograd.grad(oc, (qg, kg, vg), do, retain_graph=True)) / 1e9
    print(f"{tag} kernel-alone TFLOP/s (3 reps); cuDNN whole backward {cu:.0f}", flush=True)
    for n in runs:
        print(f"    {n:18s} " + " ".join(f"{x:.0f}" for x in res[n]) + "   ratio to committed "
              + " ".join(f"{x / c:.3f}" for x, c in zip(res[n], res["committed"])), flush=True)
    if N == 4096 and not causal:   # launch attributes of cuDNN's and our kernels (kineto)
        import json
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.autograd.grad(oc, (qg, kg, vg), do, retain_graph=True)
            for m in runs.values():
                launcher.launch(*m)
            torch.cuda.synchronize()
        prof.export_chrome_trace("/tmp/trace.json")
        for e in json.load(open("/tmp/trace.json"))["traceEvents"]:
            if e.get("cat") == "kernel":
                a = e.get("args", {})
                print("   ", e["name"][:70], {x: a.get(x) for x in ("grid", "block",
                      "registers per thread", "shared memory", "blocks per SM",
                      "est. achieved occupancy %")}, f"{e.get('dur')} us", flush=True)
    del q, k, v, do, o, lse, dq, dk, dv, launches, runs, qg, kg, vg, oc
    torch.cuda.empty_cache()
