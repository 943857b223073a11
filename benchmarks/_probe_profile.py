"""Probe (temporary): per-kernel GPU times of flashfold and cuDNN, decode target rows and
the backward's targets rows, from torch.profiler (kernel durations, averaged)."""
import math
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "benchmarks")
import flashfold as ff  # noqa: E402
from flashfold.kernels.attention import bwd, fwd  # noqa: E402

DEV = "cuda"
FLUSH = torch.ones(2**26, device=DEV)


def kernels(call, reps=20, label=""):
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            FLUSH.sum()
            call()
        torch.cuda.synchronize()
    tot = defaultdict(float)
    cnt = defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            tot[e.name] += e.device_time
            cnt[e.name] += 1
    rows = []
    for n, t in tot.items():
        if "reduce_kernel" in n and cnt[n] == reps and t / reps > 100:  # the flush's sum
            continue
        rows.append((t / reps, cnt[n] / reps, n[:110]))
    rows.sort(reverse=True)
    print(f"-- {label}: sum of kernels {sum(r[0] for r in rows):.1f} us per call")
    for t, c, n in rows:
        print(f"   {t:9.1f} us  x{c:.1f}  {n}")
    # event-timed whole call after a read flush
    st = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    en = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        FLUSH.sum()
        st[i].record()
        call()
        en[i].record()
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) * 1e3 for a, b in zip(st, en))
    print(f"   whole call (events, median) {ts[len(ts)//2]:.1f} us")


def decode_rows():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for L in (8192, 65536):
        g = torch.Generator(device=DEV).manual_seed(0)
        q = torch.randn(8, 32, 1, 128, generator=g, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(8, 8, L, 128, generator=g, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(8, 8, L, 128, generator=g, device=DEV, dtype=torch.bfloat16)
        lens = torch.full((8,), L, dtype=torch.int32, device=DEV)
        kernels(lambda: ff.decode(q, k, v, lens), label=f"flashfold decode 8 x {L}")
        kernels(lambda: ff.decode(q, k, v, lens, batch_invariant=True),
                label=f"flashfold decode invariant 8 x {L}")

        def cud():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        kernels(cud, label=f"cuDNN decode 8 x {L}")


def bwd_rows():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    H, D = 16, 128
    for N, causal in ((1024, False), (1024, True), (4096, False), (16384, False)):
        B = 16384 // N
        g = torch.Generator(device=DEV).manual_seed(0)
        q, k, v, do = (torch.randn(B, H, N, D, device=DEV, generator=g).to(torch.bfloat16)
                       for _ in range(4))
        scale = 1 / math.sqrt(D)
        right = 0 if causal else None
        o, lse = fwd.attention_forward(q, k, v, scale=scale, right=right)
        tag = f"{N} {'causal' if causal else 'full'}"
        kernels(lambda: bwd.attention_backward(do, q, k, v, o, lse, scale=scale, right=right),
                reps=10, label=f"flashfold bwd {tag}")
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            oc = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        kernels(lambda: torch.autograd.grad(oc, (qg, kg, vg), do, retain_graph=True),
                reps=10, label=f"cuDNN bwd {tag}")


def store_rule():
    """Dense rows, whole call: dK, dV by TMA stores (forced) against the committed rule
    (register stores above STORE_TMA_MAX_STEPS steps), 3 interleaved repetitions."""
    import triton
    from flashfold.kernels.attention import gluon_bwd
    H, D = 16, 128
    committed = gluon_bwd.STORE_TMA_MAX_STEPS
    for N in (4096, 16384):
        B = 16384 // N
        g = torch.Generator(device=DEV).manual_seed(0)
        q, k, v, do = (torch.randn(B, H, N, D, device=DEV, generator=g).to(torch.bfloat16)
                       for _ in range(4))
        scale = 1 / math.sqrt(D)
        o, lse = fwd.attention_forward(q, k, v, scale=scale)
        fl = 2.5 * 4 * B * H * N * N * D
        res = {}
        outs = {}
        for rep in range(3):
            for name, lim in (("registers", committed), ("tma", 10**9)):
                gluon_bwd.STORE_TMA_MAX_STEPS = lim
                f = lambda: bwd.attention_backward(do, q, k, v, o, lse, scale=scale)
                outs[name] = f()
                ms = triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median")
                res.setdefault(name, []).append(fl / ms / 1e9)
        gluon_bwd.STORE_TMA_MAX_STEPS = committed
        same = all(torch.equal(a, b) for a, b in zip(outs["registers"][1:], outs["tma"][1:]))
        print(f"store rule N={N} dense: registers {[f'{x:.0f}' for x in res['registers']]} "
              f"tma {[f'{x:.0f}' for x in res['tma']]} ratio tma/reg "
              f"{[f'{a / b:.3f}' for a, b in zip(res['tma'], res['registers'])]} dK,dV equal {same}")


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__)
    what = sys.argv[1:] or ["decode", "bwd", "store"]
    if "store" in what:
        store_rule()
    if "decode" in what:
        decode_rows()
    if "bwd" in what:
        bwd_rows()
