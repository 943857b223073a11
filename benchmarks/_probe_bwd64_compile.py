"""TEMPORARY compile-only probe (fourteenth session; removed in the next commit): compile
``kernels/attention/_probe_bwd64.py`` (64-key CTAs of one consumer warpgroup) for sm_90 on
the CPU and print registers, spills, shared memory and the setmaxnreg budgets, against the
committed two-warpgroup kernel's spill count. ``PYTHONPATH=src python
benchmarks/_probe_bwd64_compile.py``"""
import torch
from flashfold.kernels.attention import _probe_bwd64 as P
from flashfold.kernels import aot
for D, N, causal in ((128, 4096, False), (128, 4096, True)):
    B, H = 16384 // N, 16
    q = torch.empty(B, H, N, D, dtype=torch.bfloat16)
    lam = torch.empty(B, H, N, dtype=torch.float32)
    dq = torch.empty(B, H, N, D, dtype=torch.float32)
    for stages, split, nb, kf in ((1, 2, 2, False), (2, 8, 1, False), (2, 8, 1, True), (2, 4, 1, False)):
        kern, grid, args, kw = P.bwd64(q, q, q, q, lam, lam, dq, q, q, causal=causal, scale=0.1, stages=stages, dq_split=split, dq_bufs=nb, dk_first=kf)
        try:
            c = aot.compile_launch(kern, args, kw)
            print(D, N, 'causal' if causal else 'full', 'stages', stages, 'dq_split', split, 'bufs', nb, 'dk_first', kf, c.resources(), 'smem', c.shared, 'warps', c.num_warps, flush=True)
        except Exception as e:
            print(D, N, causal, stages, split, nb, 'FAILED', type(e).__name__, str(e)[:400], flush=True)

import re
B, H, N, D = 4, 16, 4096, 128
q = torch.empty(B, H, N, D, dtype=torch.bfloat16)
lam = torch.empty(B, H, N, dtype=torch.float32)
dq = torch.empty(B, H, N, D, dtype=torch.float32)
kern, grid, args, kw = P.bwd64(q, q, q, q, lam, lam, dq, q, q, causal=False, scale=0.1)
c = aot.compile_launch(kern, args, kw)
print(sorted(set(re.findall(r'setmaxnreg\.\w+\.sync\.aligned\.u32 \d+', c.ptx))))
sass = aot._run_on_cubin(c.cubin, "-sass")
print('LDL', sass.count('LDL'), 'STL', sass.count('STL'), 'HGMMA', sass.count('HGMMA'), 'UTMAREDG', sass.count('UTMAREDG'))
print([l.strip()[:80] for l in sass.splitlines() if 'MAXREG' in l][:6])
print([l.strip()[:80] for l in c.ptx.splitlines() if 'maxnreg' in l.lower()][:6])
