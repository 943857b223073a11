"""TEMPORARY probe (removed in the next commit; ninth session): where the Gluon backward's
time goes per key tile, from the %globaltimer stamps of ``_ts_gluon_bwd.py`` (an
instrumented copy of the committed kernel). Run: ``PYTHONPATH=src python
benchmarks/_probe_ts.py`` (H200, ~30 s). Prints per row: the kernel's span and busy
fraction, and per program (medians, us): K/V wait, first step, steady step, last step to
end (the epilogue), and the gap until the next program starts on the same SM."""
import math
import sys

import torch

sys.path.insert(0, "benchmarks")
from attention import _bench  # noqa: E402

from flashfold.kernels import launcher  # noqa: E402
from flashfold.kernels.attention import _ts_gluon_bwd as tsm  # noqa: E402
from flashfold.kernels.attention import bwd, fwd, gluon_bwd  # noqa: E402

H, D, tokens = 16, 128, 16384
rows = [(1024, False), (1024, True), (4096, False), (16384, False), (16384, True)]


def med(x):
    return x.float().median().item()


def report(N, causal, label, t_o, t_i, t, n_n, items):
    sm, p0, p1, c0, c1, c2, c3, c4 = (t[:, i] for i in range(8))
    t0 = torch.minimum(p0.min(), c0.min())
    span = (c4.max() - t0).item() / 1e3
    n_idx = torch.arange(items) % n_n
    steps = torch.full((items,), N // 64) if not causal else (N // 64 - 2 * n_idx)
    dur, kv, first = (c4 - c0) / 1e3, (c1 - c0) / 1e3, (c2 - c1) / 1e3
    steady = (c3 - c2) / 1e3 / (steps - 1).clamp(min=1)
    epi, plag = (c4 - c3) / 1e3, (p0 - c0) / 1e3
    gaps, busy, idle_from = [], 0.0, []
    for s in sm.unique():
        sel = (sm == s).nonzero().flatten()
        order = sel[c0[sel].argsort()]
        st, en = c0[order], c4[order]
        gaps.append(st[1:] - en[:-1])
        busy += (en - st).sum().item() / 1e3
        idle_from.append(en.max().item())
    gaps = torch.cat(gaps) / 1e3
    nsm = len(sm.unique())
    tail = (c4.max() - torch.tensor(idle_from).min()).item() / 1e3
    print(f"N {N} {'causal' if causal else 'full'} {label}: committed {t_o:.0f} TFLOP/s, this {t_i:.0f}; "
          f"span {span:.1f} us on {nsm} SMs, busy {busy / (nsm * span):.3f}; tail {tail:.1f} us", flush=True)
    print(f"   median us: program {med(dur):.2f}, K/V wait {med(kv):.2f}, first step {med(first):.2f}, "
          f"steady step {med(steady):.3f} (x{med(steps.float()):.0f}), last step -> end {med(epi):.2f}, "
          f"producer lag {med(plag):.2f}; gap to the next program on the SM: median {med(gaps):.2f} "
          f"mean {gaps.float().mean().item():.2f}", flush=True)


for N, causal in rows:
    B = tokens // N
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", generator=g).to(torch.bfloat16)
                   for _ in range(4))
    scale = 1 / math.sqrt(D)
    right = 0 if causal else None
    o, lse = fwd.attention_forward(q, k, v, scale=scale, right=right)
    dq, dk, dv, ls = bwd.prepare_backward(do, q, k, v, o, lse, scale=scale, right=right)
    dd, lam, acc = ls[0][2][4], ls[0][2][5], ls[0][2][6]
    fl = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
    n_n = N // 128
    items = n_n * B * H
    ts = torch.zeros(items, 8, dtype=torch.int64, device="cuda")
    mo = gluon_bwd.gluon_attention_bwd(q, k, v, do, lam, dd, acc, dk, dv, causal=causal, scale=scale,
                                       launch=False)
    mi = tsm.gluon_attention_bwd(q, k, v, do, lam, dd, acc, dk, dv, ts, causal=causal, scale=scale,
                                 launch=False)
    t_o = fl / _bench(lambda: launcher.launch(*mo)) / 1e9
    t_i = fl / _bench(lambda: launcher.launch(*mi)) / 1e9
    ts.zero_()
    torch.cuda.synchronize()
    launcher.launch(*mi)
    torch.cuda.synchronize()
    report(N, causal, "committed+stamps", t_o, t_i, ts.cpu(), n_n, items)
    del q, k, v, do, o, lse, dq, dk, dv, ls, ts
