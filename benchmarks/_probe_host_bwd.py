"""Probe (temporary): host time and eager TFLOP/s of the attention backward through
autograd (``torch.autograd.grad`` of a retained graph, as ``attention.py --bwd`` times it),
with the backward's plan cache on and off (``FLASHFOLD_PLAN_CACHE=0``), against cuDNN's."""
import os
import sys
import time

import torch
import triton

sys.path.insert(0, "benchmarks")
from attention import _sdpa_train  # noqa: E402

import flashfold  # noqa: E402
from flashfold.kernels.attention import bwd  # noqa: E402

H, D = 16, 128
cudnn = _sdpa_train("CUDNN_ATTENTION")


def host_us(f, n=20):
    f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


for N, causal in ((1024, False), (1024, True), (4096, True)):
    B = 16384 // N
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", generator=g).to(torch.bfloat16)
               .requires_grad_() for _ in range(3))
    do = torch.randn(B, H, N, D, device="cuda", generator=g).to(torch.bfloat16)
    fl = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
    o = flashfold.attention(q, k, v, causal=causal)
    oc = cudnn(q, k, v, causal)
    ff = lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)  # noqa: E731
    cu = lambda: torch.autograd.grad(oc, (q, k, v), do, retain_graph=True)  # noqa: E731
    ref = ff()
    res = {}
    for rep in range(2):
        for name, f, cache in (("ff cache", ff, None), ("ff no cache", ff, "0"),
                               ("cuDNN", cu, None)):
            if cache is None:
                os.environ.pop("FLASHFOLD_PLAN_CACHE", None)
            else:
                os.environ["FLASHFOLD_PLAN_CACHE"] = cache
            h = host_us(f)
            ms = triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
            res.setdefault(name, []).append((h, fl / ms / 1e9))
    os.environ.pop("FLASHFOLD_PLAN_CACHE", None)
    same = all(torch.equal(a, b) for a, b in zip(ff()[1:], ref[1:]))
    print(f"N {N} {'causal' if causal else 'full'} (dK, dV replayed = first call: {same}; "
          f"cache {bwd.plan_cache_info()})")
    for name, xs in res.items():
        print(f"   {name:12s} host us/call " + " / ".join(f"{h:.0f}" for h, _ in xs)
              + "   eager TFLOP/s " + " / ".join(f"{t:.0f}" for _, t in xs), flush=True)
