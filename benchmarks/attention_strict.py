"""What the non-finite rule's strict handling of hidden keys costs the attention forward.

Run (H200, from the repository root)::

    PYTHONPATH=src python benchmarks/attention_strict.py            # causal rows, ~2 min
    PYTHONPATH=src python benchmarks/attention_strict.py --dense    # dense rows too
    PYTHONPATH=src python benchmarks/attention_strict.py --head-dim 64

The rows are the causal rows of the targets grid (bf16, 16 heads, batch x seq = 16K
tokens, N = 1K / 4K / 16K, head_dim 128 by default), through both forward paths: the
Gluon kernel (the default on sm_90) and the Triton template (policy ``gluon=False``);
on both, strict = the epilogue's non-finite flags (one reduction of each output tile)
plus the guard launch that returns at once where they are clear
(:func:`flashfold.kernels.attention.fwd.prepare_guard`). Each row is timed with
the policy's ``strict_hidden`` on and off in the same run, alternating (``--reps`` rounds, median of
the rounds' ``do_bench`` medians):

* ``graph``: CUDA-graph replays of one forward (GPU time, no host time);
* ``eager``: plain calls (host time included: the guard is one more launch).

Then, for information, the Gluon path with a NaN in every head's first value row (every
row sees it: every flag is set and the guard recomputes the whole output), the rare case
the guard exists for. Prints the ratio strict / plain per row; the policy is part of the
plan cache's key, so both settings replay cached plans.

Before each setting of a row is timed, its output is checked: the last 256 query rows of
batch 0 (every head) against float64 attention of the same inputs, with the tolerance
table's row for the dtype (:func:`flashfold.testing.compare`, NaN/inf parity included).
Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import flashfold
from flashfold.bench import graph_replay
from flashfold.kernels.attention import gluon_fwd
from flashfold.kernels.attention.reference import naive_attention
from flashfold.testing import compare

#: query rows checked per setting (the last ones of batch 0: they see the most keys)
CHECK_ROWS = 256
#: the settings whose check failed
FAILED: list[str] = []


def _bench(fn):
    import triton
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _inputs(N, D, tokens, H, dtype, poison=False):
    B = max(1, tokens // N)
    g = torch.Generator(device="cuda").manual_seed(N)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", generator=g).to(dtype) for _ in range(3))
    if poison:
        v[:, :, 0] = float("nan")
    return q, k, v


def check(what, q, k, v, causal) -> bool:
    """``flashfold.attention`` under the policy in force, its last CHECK_ROWS query rows of
    batch 0 against float64 attention of the same inputs (tolerance table row of q's
    dtype); prints one line, records a failure in FAILED."""
    n = q.shape[2]
    rows = min(CHECK_ROWS, n)
    o = flashfold.attention(q, k, v, causal=causal)
    want, _ = naive_attention(q[:1, :, n - rows:], k[:1], v[:1], causal=causal,
                              dtype=torch.float64)
    r = compare(o[:1, :, n - rows:], want, q.dtype)
    why = r.get("why") or (f"max abs err {r['max_abs']:.3g}, {r['n_bad']} bad, NaN/inf "
                           f"parity {r['nan_inf_parity']}")
    print(f"  {'ok  ' if r['ok'] else 'FAIL'} {what}: last {rows} rows of batch 0 vs "
          f"float64: {why}", flush=True)
    if not r["ok"]:
        FAILED.append(what)
    return r["ok"]


def _time(q, k, v, causal, mode):
    call = lambda: flashfold.attention(q, k, v, causal=causal)  # noqa: E731
    if mode == "graph":
        return _bench(graph_replay(call))
    return _bench(call)


def row(N, D, causal, path, reps, tokens=16384, H=16, dtype=torch.bfloat16):
    """``{(mode, strict): ms}`` of one row."""
    q, k, v = _inputs(N, D, tokens, H, dtype)
    if path == "gluon" and not gluon_fwd.eligible(q, k, v, causal=causal, scale=D ** -0.5):
        return None
    for strict in (False, True):
        with flashfold.attention_policy(gluon=path == "gluon", strict_hidden=strict):
            check(f"{path} {'causal' if causal else 'dense'} N={N} strict={strict}", q, k, v,
                  causal)
    times = {}
    for mode in ("graph", "eager"):
        got = {True: [], False: []}
        for _ in range(reps):
            for strict in (False, True):
                with flashfold.attention_policy(gluon=path == "gluon", strict_hidden=strict):
                    got[strict].append(_time(q, k, v, causal, mode))
        for strict in (False, True):
            times[(mode, strict)] = statistics.median(got[strict])
    return times


def poisoned_row(N, D, tokens=16384, H=16, dtype=torch.bfloat16):
    """Gluon causal forward with every flag set (a NaN value every row sees): ms, graph."""
    q, k, v = _inputs(N, D, tokens, H, dtype, poison=True)
    if not gluon_fwd.eligible(q, k, v, causal=True, scale=D ** -0.5):
        return None
    check(f"gluon causal N={N} NaN value row", q, k, v, True)
    return _time(q, k, v, True, "graph")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    ap.add_argument("--dense", action="store_true", help="dense rows too (no guard: ~1.0)")
    ap.add_argument("--reps", type=int, default=3, help="alternating rounds per setting")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_strict: needs a CUDA GPU")
        return 1
    D = args.head_dim
    kinds = [True, False] if args.dense else [True]
    print(f"== strict handling of hidden keys, forward: bf16, H=16, 16K tokens, d{D}; "
          f"do_bench medians (ms), median of {args.reps} alternating rounds")
    print(f"{'path':>6} {'kind':>6} {'N':>6} | {'graph plain':>11} {'graph strict':>12} "
          f"{'ratio':>6} | {'eager plain':>11} {'eager strict':>12} {'ratio':>6}")
    for causal in kinds:
        for path in ("gluon", "triton"):
            for N in (1024, 4096, 16384):
                t = row(N, D, causal, path, args.reps)
                kind = "causal" if causal else "dense"
                if t is None:
                    print(f"{path:>6} {kind:>6} {N:>6} | (not eligible here)")
                    continue
                gp, gs, ep, es = (t[("graph", False)], t[("graph", True)],
                                  t[("eager", False)], t[("eager", True)])
                print(f"{path:>6} {kind:>6} {N:>6} | {gp:11.4f} {gs:12.4f} {gs / gp:6.3f} | "
                      f"{ep:11.4f} {es:12.4f} {es / ep:6.3f}", flush=True)
    print("== the rare case: Gluon causal with a NaN value seen by every row (all flags set)")
    for N in (1024, 4096, 16384):
        ms = poisoned_row(N, D)
        print(f"   N={N:>6}: {'(not eligible here)' if ms is None else f'{ms:.4f} ms (graph)'}",
              flush=True)
    print(f"correctness failures: {FAILED or 'none'}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    raise SystemExit(main())
