"""Spills of the Gluon backward's variants, from the sm_90 compile on any machine (no GPU).

Run (from the repository root)::

    PYTHONPATH=src python benchmarks/gluon_bwd_sass.py            # the head_dim-128 variants
    PYTHONPATH=src python benchmarks/gluon_bwd_sass.py --dims 128,64 --sass /tmp/sass

For each variant of :func:`flashfold.kernels.attention.gluon_bwd.gluon_attention_bwd` (one
program per key tile or persistent, ``lambda``/``D`` read before or after the waits, dense
or causal) at two shapes (16 heads at N = 4096; the GQA shape of the compile tests, 2 x 4
query heads on 2 key heads at N = 1000: Triton specializes a group of 1 away), prints
ptxas's spill stores and, for each step loop of the consumer warpgroups (a backward branch
over the 32 wgmma of one step), its instruction count and its local loads and stores
(``LDL``, ``STL``): a spill inside the step loop costs every step, one outside it once a
key tile. The compile is the real one (``flashfold.kernels.aot``); SM count 132 (H200).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from unittest import mock

import torch

from flashfold.kernels.aot import _run_on_cubin, compile_launch
from flashfold.kernels.attention import gluon_bwd as G

SHAPES = {"MHA N=4096": (4, 16, 16, 4096), "GQA N=1000": (2, 4, 2, 1000)}


def step_loops(sass: str, wgmma_per_step: int):
    """``(instructions, LDL, STL)`` of each innermost loop whose body holds
    ``wgmma_per_step`` wgmma (``HGMMA``, K = 16 each) instructions: the consumers' step
    loops. (A loop around one, such as the query heads' loop of a GQA group, holds the
    same wgmma; a branch back from a barrier's retry stub spans more of them.)"""
    code = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    spans = []
    for addr, text in code:
        m = re.search(r"\bBRA\s+.*?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            if sum("HGMMA" in t for a, t in code if lo <= a <= addr) == wgmma_per_step:
                spans.append((lo, addr))
    loops = []
    for lo, hi in spans:
        if any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in spans):
            continue                      # an inner one is the step loop
        body = [t for a, t in code if lo <= a <= hi]
        loops.append((len(body), sum(bool(re.match(r"(@\S+\s+)?LDL", t)) for t in body),
                      sum(bool(re.match(r"(@\S+\s+)?STL", t)) for t in body)))
    return loops


def wgmma_per_step(D: int) -> int:
    """K-steps of 16 in one consumer step: S^T and dP^T (K = D each), dV and dK (K = the
    64 query rows), dQ (K = the 128 keys)."""
    return 2 * (D // 16) + 2 * (G.BLOCK_M // 16) + G.BLOCK_N // 16


def facts(D, causal, persistent, late_stats, shape, sass_dir=None):
    B, hq, hk, N = shape
    q = torch.empty(B, hq, N, D, dtype=torch.bfloat16)
    k = torch.empty(B, hk, N, D, dtype=torch.bfloat16)
    lam, acc = torch.empty(B, hq, N), torch.empty(B, hq, N, D)
    with mock.patch.object(G.gluon_fwd, "num_sms", lambda t: 132):
        kernel, _, args, kwargs = G.gluon_attention_bwd(
            q, k, k, q, lam, lam, acc, k, k, causal=causal, scale=0.1, launch=False,
            persistent=persistent, late_stats=late_stats)
    c = compile_launch(kernel, args, kwargs)
    sass = _run_on_cubin(c.cubin, "-sass")
    if sass_dir:
        name = (f"d{D}_{'causal' if causal else 'dense'}_{'persistent' if persistent else 'tile'}"
                f"_{'late' if late_stats else 'early'}"
                f"_{hq}x{hk}_{N}.sass")
        Path(sass_dir, name).write_text(sass)
    return dict(spill=c.resources()["spill_stores"], smem=c.shared,
                store_tma=kwargs["STORE_TMA"], pingpong=kwargs["PINGPONG"],
                loops=step_loops(sass, wgmma_per_step(D)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", default="128", help="head dims, comma-separated")
    ap.add_argument("--sass", default=None, help="folder to write each variant's SASS into")
    args = ap.parse_args(argv)
    if args.sass:
        Path(args.sass).mkdir(parents=True, exist_ok=True)
    print("| D | shape | mask | programs | lambda, D | dK/dV stores | turns "
          "| spill bytes | smem | step loops (instructions, LDL, STL) |")
    print("|---|---|---|---|---|---|---|---:|---:|---|")
    for D in (int(x) for x in args.dims.split(",")):
        for shape_name, shape in SHAPES.items():
            for causal, persistent in ((False, False), (False, True), (True, False)):
                for late in (False, True):
                    f = facts(D, causal, persistent, late, shape, args.sass)
                    print(f"| {D} | {shape_name} | {'causal' if causal else 'dense'} | "
                          f"{'persistent' if persistent else 'one per tile'} | "
                          f"{'after waits' if late else 'before waits'} | "
                          f"{'TMA' if f['store_tma'] else 'registers'} | "
                          f"{'yes' if f['pingpong'] else 'no'} | {f['spill']} | {f['smem']} | "
                          f"{f['loops']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
