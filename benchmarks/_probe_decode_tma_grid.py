"""Probe (temporary): K/V through TMA (tma=True) against the cp.async pointer default over
a subset of the decode grid, contiguous and paged 64, default and batch_invariant, GB/s
from CUDA-graph replays (clean L2 on the target rows), 2 interleaved repetitions; outputs
checked equal between the two load paths first (bitwise: same math, other loads)."""
import sys

import torch

sys.path.insert(0, "benchmarks")
from decode import D, Cache, timed  # noqa: E402
from flashfold.kernels.decode import splitkv  # noqa: E402

ROWS = [(8, 8192), (8, 65536), (1, 131072), (1, 8192), (8, 512), (64, 8192), (64, 32768),
        (256, 4096), (256, 16384), (1, 512)]

if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__)
    print("| batch x len | layout | mode | pointers | TMA | TMA / pointers | bitwise |")
    print("|---|---|---|---:|---:|---:|---|")
    for batch, length in ROWS:
        c = Cache(batch, length, pages=(64,))
        nbytes = c.kv_bytes()
        clean = (batch, length) in ((8, 8192), (8, 65536))
        for layout in ("contiguous", "paged64"):
            k, v, t = (c.k, c.v, None) if layout == "contiguous" else c.paged[64]
            for inv in (False, True):
                fns = {tma: (lambda tma=tma: splitkv.splitkv_decode(
                    c.q, k, v, c.lens, t, scale=D ** -0.5, batch_invariant=inv, tma=tma))
                    for tma in (False, True)}
                same = torch.equal(fns[False]()[0], fns[True]()[0])
                res = {False: [], True: []}
                for rep in range(2):
                    for tma, fn in fns.items():
                        res[tma].append(nbytes / timed(fn, True, clean=clean) / 1e6)
                p, q = max(res[False]), max(res[True])
                print(f"| {batch} x {length} | {layout} | {'invariant' if inv else 'default'}"
                      f"{' (clean)' if clean else ''} | {p:.0f} | {q:.0f} | {q / p:.3f} | {same} |",
                      flush=True)
        del c
        torch.cuda.empty_cache()
