"""TEMPORARY probe (removed in the next commit; twelfth session): where the time between
two programs of the Gluon backward goes on one SM, from the %globaltimer stamps of
``_ts_gluon_bwd.py`` (the committed kernel plus stamps at kernel entry, each partition's
start and end, and the kernel's exit). Run: ``PYTHONPATH=src python
benchmarks/_probe_ts.py`` (H200, ~60 s). Prints medians per program, in us."""
import math
import sys

import torch

sys.path.insert(0, "benchmarks")
from attention import _bench  # noqa: E402

from flashfold.kernels import launcher  # noqa: E402
from flashfold.kernels.attention import _ts_gluon_bwd as tsm  # noqa: E402
from flashfold.kernels.attention import bwd, fwd, gluon_bwd  # noqa: E402

H, D, tokens = 16, 128, 16384
rows = [(1024, False), (1024, True), (4096, False), (16384, False)]


def med(x):
    return x.double().median().item() / 1e3


for N, causal in rows:
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
    items = (N // 128) * B * H
    ts = torch.zeros(items, 12, dtype=torch.int64, device="cuda")
    mo = gluon_bwd.gluon_attention_bwd(q, k, v, do, lam, dd, acc, dk, dv, causal=causal,
                                       scale=scale, launch=False)
    mi = tsm.gluon_attention_bwd(q, k, v, do, lam, dd, acc, dk, dv, ts, causal=causal,
                                 scale=scale, launch=False)
    t_o = fl / _bench(lambda: launcher.launch(*mo)) / 1e9
    t_i = fl / _bench(lambda: launcher.launch(*mi)) / 1e9
    for rep in range(2):
        ts.zero_()
        torch.cuda.synchronize()
        launcher.launch(*mi)
        torch.cuda.synchronize()
        t = ts.cpu()
        sm, entry, p0, p1, w0s, kv, loop, w0e, w1s, w1e, ex = (t[:, i] for i in range(11))
        gaps, launch_gap = [], []
        for s in sm.unique():
            sel = (sm == s).nonzero().flatten()
            order = sel[entry[sel].argsort()]
            gaps.append(entry[order][1:] - ex[order][:-1])
        gaps = torch.cat(gaps)
        wend = torch.maximum(torch.maximum(w0e, w1e), p1)
        span = (ex.max() - entry.min()).item() / 1e3
        busy = ((ex - entry).sum().item() / 1e3) / (len(sm.unique()) * span)
        print(f"N {N} {'causal' if causal else 'full'} rep {rep}: committed {t_o:.0f} TFLOP/s, "
              f"stamped {t_i:.0f}; span {span:.1f} us, busy (entry..exit) {busy:.3f}", flush=True)
        print(f"   entry->WG0 start {med(w0s - entry):.2f}, entry->producer start {med(p0 - entry):.2f}, "
              f"WG1 start - WG0 start {med(w1s - w0s):.2f}, K/V wait {med(kv - w0s):.2f}, "
              f"loop {med(loop - kv):.2f}, loop end->WG0 end {med(w0e - loop):.2f}, "
              f"WG1 end - WG0 end {med(w1e - w0e):.2f}, last partition end->exit {med(ex - wend):.2f}, "
              f"exit->next entry on the SM: median {med(gaps):.2f} mean {gaps.double().mean().item() / 1e3:.2f} "
              f"p10 {gaps.double().quantile(0.1).item() / 1e3:.2f} p90 {gaps.double().quantile(0.9).item() / 1e3:.2f}",
              flush=True)
    del q, k, v, do, o, lse, dq, dk, dv, launches, ts
