"""TEMPORARY probe (fifteenth session; removed in the next commit): launch attributes
(grid, block, registers, shared memory; kineto trace) of SDPA cuDNN's backward kernels and
flashfold's, on the targets grid. ``PYTHONPATH=src python benchmarks/_probe_cudnn_attrs.py``"""
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import flashfold

H, tokens = 16, 16384
for D in (128, 64):
    for N in (1024, 4096, 16384):
        for causal in (False, True):
            B = tokens // N
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (torch.randn(B, H, N, D, device="cuda", generator=g)
                           .to(torch.bfloat16) for _ in range(4))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                oc = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            of = flashfold.attention(q, k, v, causal=causal)
            for o in (oc, of):
                torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for o in (oc, of):
                    torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
                torch.cuda.synchronize()
            prof.export_chrome_trace("/tmp/trace.json")
            print(f"D {D} N {N} {'causal' if causal else 'full'}", flush=True)
            for e in json.load(open("/tmp/trace.json"))["traceEvents"]:
                a = e.get("args", {})
                if e.get("cat") == "kernel" and e.get("dur", 0) > 100:
                    print(f"    {e['name'][:100]} grid {a.get('grid')} block {a.get('block')} "
                          f"regs {a.get('registers per thread')} smem {a.get('shared memory')} "
                          f"{e['dur']:.0f} us", flush=True)
            del q, k, v, do, oc, of
            torch.cuda.empty_cache()
