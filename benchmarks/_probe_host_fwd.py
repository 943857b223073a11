"""TEMPORARY probe (removed in the next commit; twelfth session): the forward's plan cache
on the H200. Per head_dim (64, 128) at N = 1K causal, B = 16, H = 16, bf16:
1. a replayed forward equals a fresh one bitwise (o and lse);
2. host us per call (50 calls issued back to back, no sync) of the forward and of
   forward + backward, with the plan cache on and off (``FLASHFOLD_PLAN_CACHE=0``), and
   cuDNN's;
3. eager forward + backward TFLOP/s (do_bench) with the cache on / off, cuDNN's, and
   flashfold's from a CUDA graph.
Run: ``PYTHONPATH=src python benchmarks/_probe_host_fwd.py`` (~40 s)."""
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, "benchmarks")
from attention import _bench, _graph_bench  # noqa: E402

import flashfold as ff  # noqa: E402
from flashfold.kernels.attention import fwd  # noqa: E402

B, H, N = 16, 16, 1024


def cudnn(q, k, v):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def host_us(f, n=50):
    f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    dt = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return dt


for D in (64, 128):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", generator=g).to(torch.bfloat16)
                   for _ in range(4))
    fwd.plan_cache_clear()
    a = ff.attention(q, k, v, causal=True, return_lse=True)
    b = ff.attention(q, k, v, causal=True, return_lse=True)
    os.environ["FLASHFOLD_PLAN_CACHE"] = "0"
    c = ff.attention(q, k, v, causal=True, return_lse=True)
    os.environ["FLASHFOLD_PLAN_CACHE"] = "1"
    same = all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a, b, c))
    print(f"d{D}: replayed forward bitwise equal to fresh: {same}; cache {fwd.plan_cache_info()}",
          flush=True)
    assert same
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    fl = 4 * B * H * N * N * D / 2
    runs = {"ff fwd": lambda: ff.attention(q, k, v, causal=True),
            "ff f+b": lambda: torch.autograd.grad(ff.attention(qg, kg, vg, causal=True), (qg, kg, vg), do),
            "cuDNN fwd": lambda: cudnn(q, k, v),
            "cuDNN f+b": lambda: torch.autograd.grad(cudnn(qg, kg, vg), (qg, kg, vg), do)}
    for rep in range(2):
        row = []
        for name, f in runs.items():
            modes = ("on", "off") if name.startswith("ff") else ("-",)
            for mode in modes:
                os.environ["FLASHFOLD_PLAN_CACHE"] = "0" if mode == "off" else "1"
                mult = 3.5 if "f+b" in name else 1.0
                row.append(f"{name}{'' if mode == '-' else ' cache ' + mode}: host {host_us(f):.0f} us, "
                           f"eager {mult * fl / _bench(f) / 1e9:.0f} TFLOP/s")
        os.environ["FLASHFOLD_PLAN_CACHE"] = "1"
        gr = 3.5 * fl / _graph_bench(runs["ff f+b"]) / 1e9
        print(f"d{D} N{N} causal rep {rep}: " + "; ".join(row) + f"; ff f+b graph {gr:.0f}", flush=True)
    del q, k, v, do, qg, kg, vg
