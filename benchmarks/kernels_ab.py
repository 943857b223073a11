"""Before/after timing of the kernels a change touches, one tree per process.

Run (H200), alternating two source trees, twice each, then compare::

    PYTHONPATH=<before>/src python benchmarks/kernels_ab.py --out before1.txt
    PYTHONPATH=<after>/src  python benchmarks/kernels_ab.py --out after1.txt
    ... (before2, after2) ...
    python benchmarks/kernels_ab.py --before before1.txt before2.txt --after after1.txt after2.txt

Every row is a public call replayed from a CUDA graph and timed with
``triton.testing.do_bench`` (median, L2 flushed), so host time and launch gaps stay out;
a row that fails prints its error and is left out of the comparison. The rows: the
attention forward on the Triton template (``FLASHFOLD_GLUON=0``: dense and causal at
head_dim 64 / 128 / 256 and 96, a window, softcap, ALiBi) and on the default path, split-KV
decode (one and four query tokens, softcap, paged), and the row reductions whose block
lifts take a row max (bf16, 16 heads, 16K tokens per batch; decode: 32 / 8 heads of 128).
``--before`` / ``--after`` print, per row, the faster time of each side and after / before.
"""

from __future__ import annotations

import argparse
import math
import os
import sys


def rows():
    """(label, environment, builder) of every row; a builder returns the call to time."""
    import torch

    import flashfold as ff
    from flashfold import mods

    def attn(d, n, causal=False, window=None, softcap=None, alibi=False, dv=None):
        def build():
            b, h = 16384 // n, 16
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
            k = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
            v = torch.randn(b, h, n, dv or d, device="cuda", dtype=torch.bfloat16, generator=g)
            kw = dict(causal=causal, window=window, softcap=softcap)
            if alibi:
                kw["score_mod"] = mods.alibi(h)
            return lambda: ff.attention(q, k, v, **kw)
        return build

    def decode(n, q_len=1, softcap=None, paged=False):
        def build():
            batch, hq, hkv, d = 8, 32, 8, 128
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(batch, hq, q_len, d, device="cuda", dtype=torch.bfloat16, generator=g)
            k = torch.randn(batch, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
            v = torch.randn_like(k)
            lens = torch.full((batch,), n, dtype=torch.int32, device="cuda")
            if not paged:
                return lambda: ff.decode(q, k, v, lens, softcap=softcap)
            page = 16
            kp = k.permute(0, 2, 1, 3).reshape(batch * n // page, page, hkv, d).contiguous()
            vp = v.permute(0, 2, 1, 3).reshape(batch * n // page, page, hkv, d).contiguous()
            table = torch.arange(batch * n // page, dtype=torch.int32, device="cuda").view(batch, -1)
            return lambda: ff.decode(q, kp, vp, lens, block_table=table, softcap=softcap)
        return build

    def reduction(name):
        def build():
            x = torch.randn(16384, 16384, device="cuda")
            return {"amax": lambda: ff.reduce(ff.monoids.MAX, x, 1),
                    "logsumexp": lambda: ff.logsumexp(x, 1),
                    "softmax": lambda: ff.softmax(x, 1)}[name]
        return build

    triton_path = {"FLASHFOLD_GLUON": "0"}
    out = []
    for d in (64, 128):
        for causal in (False, True):
            out.append((f"fwd triton d{d} 4K {'causal' if causal else 'dense'}", triton_path,
                        attn(d, 4096, causal)))
    out += [("fwd triton d128 16K causal", triton_path, attn(128, 16384, True)),
            ("fwd triton d256 4K causal", triton_path, attn(256, 4096, True)),
            ("fwd triton d96 4K causal", triton_path, attn(96, 4096, True)),
            ("fwd triton d128 16K window 1024", triton_path, attn(128, 16384, True, (1024, 0))),
            ("fwd triton d128 4K causal softcap 30", triton_path, attn(128, 4096, True, softcap=30.0)),
            ("fwd triton d128 4K causal alibi", triton_path, attn(128, 4096, True, alibi=True)),
            ("fwd default d128 4K dense", {}, attn(128, 4096)),
            ("fwd default d128 4K causal", {}, attn(128, 4096, True)),
            ("fwd default d64 16K causal", {}, attn(64, 16384, True)),
            ("fwd default d128 16K window 4096", {}, attn(128, 16384, True, (4096, 0))),
            ("fwd default d128 4K causal softcap 50", {}, attn(128, 4096, True, softcap=50.0)),
            ("fwd default d256 4K causal", {}, attn(256, 4096, True)),
            ("fwd default d96 4K causal", {}, attn(96, 4096, True)),
            ("decode 8 x 8K q1", {}, decode(8192)),
            ("decode 8 x 64K q1", {}, decode(65536)),
            ("decode 8 x 8K q4", {}, decode(8192, 4)),
            ("decode 8 x 8K q1 softcap", {}, decode(8192, softcap=30.0)),
            ("decode 8 x 8K q1 paged", {}, decode(8192, paged=True)),
            ("reduce amax 16K x 16K fp32", {}, reduction("amax")),
            ("logsumexp 16K x 16K fp32", {}, reduction("logsumexp")),
            ("softmax 16K x 16K fp32", {}, reduction("softmax"))]
    return out


def measure(path: str):
    import torch
    import triton

    from flashfold.bench import graph_replay

    with open(path, "w") as f:
        for label, env, build in rows():
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                fn = build()
                fn()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(graph_replay(fn), warmup=50, rep=200,
                                             return_mode="median")
                line = f"{label}\t{ms:.5f}"
            except Exception as e:  # a failed row is printed, not compared
                line = f"{label}\tFAILED {type(e).__name__}: {str(e)[:200]}"
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
                torch.cuda.empty_cache()
            print(line, flush=True)
            f.write(line + "\n")


def _read(paths):
    best: dict = {}
    for p in paths:
        for line in open(p):
            label, _, value = line.rstrip("\n").partition("\t")
            try:
                ms = float(value)
            except ValueError:
                continue
            best[label] = min(ms, best.get(label, math.inf))
    return best


def compare(before, after):
    b, a = _read(before), _read(after)
    print("| row | before ms | after ms | after / before |\n|---|---:|---:|---:|")
    for label in b:
        if label in a:
            print(f"| {label} | {b[label]:.4f} | {a[label]:.4f} | {a[label] / b[label]:.3f} |")
    for label in set(b) ^ set(a):
        print(f"| {label} | {b.get(label, '-')} | {a.get(label, '-')} | only one side |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="measure this tree, write the times here")
    ap.add_argument("--before", nargs="+", help="time files of the tree before the change")
    ap.add_argument("--after", nargs="+", help="time files of the tree after it")
    args = ap.parse_args(argv)
    if args.before or args.after:
        if not (args.before and args.after):
            ap.error("--before and --after go together")
        compare(args.before, args.after)
    elif args.out:
        measure(args.out)
    else:
        ap.error("give --out FILE, or --before FILES --after FILES")
    return 0


if __name__ == "__main__":
    sys.exit(main())
