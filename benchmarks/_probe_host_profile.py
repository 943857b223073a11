"""Probe (temporary): host time of an eager attention backward call (1K, dense and
causal), cProfile of 50 calls (log: logs/2026-11-30_h200_host_bwd_cprofile.log)."""
import cProfile
import io
import pstats
import time

import torch

import flashfold

H, D = 16, 128
for N, causal in ((1024, False), (1024, True)):
    B = 16384 // N
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", generator=g).to(torch.bfloat16)
               .requires_grad_() for _ in range(3))
    do = torch.randn(B, H, N, D, device="cuda", generator=g).to(torch.bfloat16)
    o = flashfold.attention(q, k, v, causal=causal)
    f = lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)  # noqa: E731
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        f()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    print(f"N {N} causal {causal}: host per call {(t1 - t0) / 20 * 1e6:.0f} us")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(50):
        f()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(30)
    print(s.getvalue()[:6000])
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(15)
    print(s.getvalue()[:4000])
