"""TEMPORARY probe (removed in the next commit): fewer, deeper streams at the decode target
rows (split count x tile x pipeline depth), against cuDNN; and cuDNN's kernels' grids.
PYTHONPATH=src python benchmarks/_probe_streams.py
"""
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, "benchmarks")
import decode as bd  # noqa: E402
from flashfold.kernels.decode import splitkv  # noqa: E402
from torch.nn.attention import SDPBackend  # noqa: E402

CONFIGS = [  # (splits as programs per (b, kv head) x n_bh ~ programs, block_n, warps, stages)
    (None, 64, 4, 3), ("sm", 64, 4, 4), ("sm", 64, 4, 5), ("sm", 128, 4, 2), ("sm", 64, 8, 4),
    ("sm", 32, 4, 6), ("sm", 32, 4, 8), ("2sm", 64, 4, 4),
]


def cudnn_grids(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "t.json")
    prof.export_chrome_trace(path)
    ev = json.load(open(path))["traceEvents"]
    out = []
    for e in ev:
        if e.get("cat") == "kernel":
            a = e.get("args", {})
            out.append((e["name"][:90], a.get("grid"), a.get("block"),
                        a.get("registers per thread"), a.get("shared memory"), e.get("dur")))
    return out


def main():
    for batch, length in ((8, 65536), (8, 32768), (8, 16384), (1, 131072), (8, 8192)):
        c = bd.Cache(batch, length)
        nbytes = c.kv_bytes()
        scale = bd.D ** -0.5
        cudnn = bd.sdpa(SDPBackend.CUDNN_ATTENTION, c.q, c.k, c.v)
        for g in cudnn_grids(cudnn):
            print(f"  {batch} x {length} cuDNN kernel {g}")
        ref = splitkv.splitkv_decode(c.q, c.k, c.v, c.lens, None, scale=scale)[0]
        fns = {}
        for s, bn, w, st in CONFIGS:
            cfg = splitkv.DecodeConfig(block_n=bn, num_warps=w, num_stages=st)
            if s in ("sm", "2sm"):  # programs ~ SMs (or 2 x): splits = SMs // (batch x 8)
                s = max(1, (128 if s == "sm" else 256) // (batch * 8))
            name = f"{s}s {bn}/{w}w/{st}st"
            try:
                o = splitkv.splitkv_decode(c.q, c.k, c.v, c.lens, None, scale=scale,
                                           num_splits=s, config=cfg)[0]
                torch.cuda.synchronize()
            except Exception as e:                                  # noqa: BLE001
                print(f"  {name}: failed {type(e).__name__}: {str(e)[:100]}")
                continue
            err = (o.float() - ref.float()).abs().max().item()
            print(f"  {name}: max|o - default| {err:.2e}", flush=True)
            fns[name] = (lambda s=s, cfg=cfg: splitkv.splitkv_decode(
                c.q, c.k, c.v, c.lens, None, scale=scale, num_splits=s, config=cfg))
        res = {}
        for rep in range(3):
            for name, fn in list(fns.items()) + [("cuDNN", cudnn)]:
                for clean in (False, True):
                    ms = bd.timed(fn, True, clean=clean)
                    res.setdefault((name, clean), []).append(nbytes / ms / 1e6)
        for clean in (False, True):
            base = res[("cuDNN", clean)]
            print(f"{batch} x {length} {'clean' if clean else 'graph'} (GB/s, / cuDNN):")
            for name in list(fns) + ["cuDNN"]:
                print(f"  {name:18s} " + "/".join(f"{x:.0f}" for x in res[(name, clean)]) + "  ("
                      + "/".join(f"{x / b:.3f}" for x, b in zip(res[(name, clean)], base)) + ")")
        del c, fns, cudnn
        torch.cuda.empty_cache()


main()
