"""Attention backward, ``deterministic=True`` against the default mode, on the GPU.

Correctness first: for every row, two deterministic backward passes must give the same
bits (the run fails otherwise), and the deterministic gradients must agree with the
default's within bf16 rounding (max difference relative to the largest gradient entry
below 2e-2); the default's own run-to-run equality is printed, not required. Then both
modes are timed in the same process (``triton.testing.do_bench`` median of
``torch.autograd.grad`` of a retained forward, eager) and the ratio printed: the target
of ``deterministic=True`` is 0.9x the default or better.

TFLOP/s: backward = 2.5 * 2 * B * Hq * N * (visible keys per row) * (D + Dv).

Usage (GPU)::

    PYTHONPATH=src python benchmarks/deterministic_bwd.py            # every row
    PYTHONPATH=src python benchmarks/deterministic_bwd.py --rows d64  # rows naming d64
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

#: (label, B, Hq, Hk, N, D, Dv, causal, window)
ROWS = [
    ("d128 dense 4K x4", 4, 16, 16, 4096, 128, 128, False, None),
    ("d128 causal 4K x4", 4, 16, 16, 4096, 128, 128, True, None),
    ("d128 dense 16K", 1, 16, 16, 16384, 128, 128, False, None),
    ("d128 causal 16K", 1, 16, 16, 16384, 128, 128, True, None),
    ("d128 causal 1K x16", 16, 16, 16, 1024, 128, 128, True, None),
    ("d128 GQA 32:8 causal 4K x4 (Llama-3)", 4, 32, 8, 4096, 128, 128, True, None),
    ("d128 GQA 32:8 window 4096 16K (Mistral)", 1, 32, 8, 16384, 128, 128, True, (4096, 0)),
    ("d64 dense 4K x4", 4, 16, 16, 4096, 64, 64, False, None),
    ("d64 causal 4K x4", 4, 16, 16, 4096, 64, 64, True, None),
    ("d64 dense 512 x32 (BERT)", 32, 12, 12, 512, 64, 64, False, None),
    ("d256 GQA 16:8 causal 8K x2 (Gemma)", 2, 16, 8, 8192, 256, 256, True, None),
    ("MLA qk192 v128 causal 4K x4", 4, 16, 16, 4096, 192, 128, True, None),
]


def flops(B, H, N, D, DV, causal, window):
    """Backward FLOPs: 2.5 x the forward's 2 B H N (keys per row) (D + Dv)."""
    if window is not None:
        keys = sum(min(i + 1, window[0] + 1) for i in range(N)) / N
    else:
        keys = (N + 1) / 2 if causal else N
    return 2.5 * 2 * B * H * N * keys * (D + DV)


def max_rel_diff(got, want) -> float:
    """The largest over the gradients of max|g - w| / max|w|; NaN when any is (Python's
    ``max`` keeps the first of a number and a NaN)."""
    diffs = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
             for a, b in zip(got, want)]
    return math.nan if any(map(math.isnan, diffs)) else max(diffs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="", help="only rows whose label contains one of these "
                                               "comma-separated words")
    args = ap.parse_args(argv)
    import triton
    from triton.testing import do_bench

    import flashfold as ff
    if not torch.cuda.is_available():
        print("needs a GPU")
        return 2
    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name()}, python {sys.version.split()[0]}")
    print("== deterministic=True against the default backward (bf16, eager, do_bench median)")
    words = [w for w in args.rows.split(",") if w]
    ok = True
    for label, B, H, HK, N, D, DV, causal, window in ROWS:
        if words and not any(w in label for w in words):
            continue
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
                       for shape in ((B, H, N, D), (B, HK, N, D), (B, HK, N, DV),
                                     (B, H, N, DV)))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        res = {}
        for det in (False, True):
            o = ff.attention(*leaves, causal=causal, window=window, deterministic=det)

            def grad():
                return torch.autograd.grad(o, leaves, do, retain_graph=True)
            first, second = grad(), grad()
            same = all(torch.equal(a, b) for a, b in zip(first, second))
            ms = do_bench(grad, warmup=50, rep=300)
            res[det] = (ms, same, first)
        diff = max_rel_diff(res[True][2], res[False][2])
        good = res[True][1] and diff < 2e-2
        ok &= good
        f = flops(B, H, N, D, DV, causal, window)
        (ms0, same0, _), (ms1, _, _) = res[False], res[True]
        print(f"  {label:42s} | default {ms0:7.3f} ms {f / ms0 / 1e9:4.0f} TFLOP/s "
              f"(runs equal: {same0}) | deterministic {ms1:7.3f} ms {f / ms1 / 1e9:4.0f} "
              f"TFLOP/s (runs equal: {res[True][1]}) | det/default {ms0 / ms1:.3f} | "
              f"max diff {diff:.1e} | {'ok' if good else 'FAILED'}", flush=True)
    print(f"checks {'PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
