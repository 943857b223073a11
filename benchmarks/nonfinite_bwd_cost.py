"""What the backward's non-finite handling (rule 4: hidden pairs add exactly 0, NaN or not)
costs on valid input: the causal rows of the targets grid, with and without it, in one run.

Run on the GPU (from the repository root)::

    PYTHONPATH=src python benchmarks/nonfinite_bwd_cost.py [--reps 5] [--dims 128,64]

For each row (bf16, 16 heads, batch x seq = 16K tokens, causal, N = 1K / 4K / 16K) it times
the backward launches (:func:`flashfold.kernels.attention.bwd.attention_backward`, from
saved ``o`` and ``lse``) of the default mode (the Gluon kernel on sm_90) and of
``deterministic=True`` (the Triton kernels), with the policy's ``strict_nonfinite`` on and off,
interleaved, ``--reps`` times: CUDA-graph medians (``triton.testing.do_bench_cudagraph``:
GPU time only; the handling adds launches, whose host time this leaves out, and the eager
host time is printed apart from it, ``do_bench`` medians). "on" adds, for these causal
calls, a ``lambda`` read and a check in the dQ conversion and two guarded launches of the
strict Triton kernels that return at once (Gluon path), or the epilogue checks and the
same guarded launches (Triton path). The selects of P and dS at hidden pairs in the Triton
kernels' masked tiles are compiled in either way (not switched off here).
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import triton

from flashfold.kernels.attention import bwd, dispatch


def _row(D, N, H, tokens, deterministic, reps):
    B = max(1, tokens // N)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", generator=g).to(torch.bfloat16)
                   for _ in range(4))
    o = torch.randn_like(q)
    lse = torch.randn(B, H, N, device="cuda", generator=g) + math.log(N)
    scale = 1 / math.sqrt(D)

    def step():
        bwd.attention_backward(do, q, k, v, o, lse, scale=scale, right=0,
                               deterministic=deterministic)
    times = {True: [], False: []}
    host = {True: [], False: []}
    for _ in range(reps):
        for on in (True, False):
            with dispatch.using(strict_nonfinite=on):
                step()
                try:
                    times[on].append(triton.testing.do_bench_cudagraph(step, rep=100))
                except Exception:          # capture refused: event timing
                    times[on].append(triton.testing.do_bench(step, warmup=25, rep=100,
                                                             return_mode="median"))
                host[on].append(triton.testing.do_bench(step, warmup=25, rep=100,
                                                        return_mode="median"))
    flops = 2.5 * 4 * B * H * N * N * D / 2          # causal: half the pairs, 2.5x forward
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"d{D} N={N:>5} B={B:>2} {'det   ' if deterministic else 'default'} "
          f"on {on * 1e3:8.1f} us ({flops / on / 1e9:5.0f} TFLOP/s)  off {off * 1e3:8.1f} us  "
          f"on/off {on / off:.4f}  [reps {', '.join(f'{a / b:.3f}' for a, b in zip(times[True], times[False]))}]  "
          f"eager on/off {statistics.median(host[True]) / statistics.median(host[False]):.4f}",
          flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dims", default="128", help="head dims, comma separated")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("nonfinite_bwd_cost: needs a CUDA device")
    for D in (int(d) for d in args.dims.split(",")):
        for N in (1024, 4096, 16384):
            for det in (False, True):
                _row(D, N, args.heads, args.tokens, det, args.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
