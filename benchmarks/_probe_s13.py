"""TEMPORARY probe (removed in the next commit; thirteenth session): GPU kernel times of
one eager backward (autograd.grad of a retained graph), flashfold against SDPA cuDNN, by
kernel name (torch.profiler, 10 calls each), d128 target rows.
Run: ``PYTHONPATH=src python benchmarks/_probe_s13.py`` (H200, ~1 min)."""
import collections

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import flashfold

F = torch.nn.functional
H, D, tokens = 16, 128, 16384
for N, causal in ((1024, False), (4096, False), (16384, False), (1024, True), (4096, True)):
    B = tokens // N
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", generator=g).to(torch.bfloat16)
                   for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    fl = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
    for name, make in (("flashfold", lambda: flashfold.attention(q, k, v, causal=causal)),
                       ("cudnn", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o = make()
        for _ in range(3):
            torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
            torch.cuda.synchronize()
        tot = collections.defaultdict(float)
        cnt = collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                tot[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                cnt[e.name] += 1
        s = sum(tot.values()) / 10
        print(f"N {N} {'causal' if causal else 'full'} {name}: GPU us per backward {s:.1f} "
              f"({fl / s / 1e6:.0f} TFLOP/s of GPU time)", flush=True)
        for kname, t in sorted(tot.items(), key=lambda x: -x[1]):
            print(f"    {t / 10:9.1f} us  x{cnt[kname] / 10:.0f}  {kname[:110]}")
        del o
    del q, k, v, do
    torch.cuda.empty_cache()
