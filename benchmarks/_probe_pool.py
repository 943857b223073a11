"""TEMPORARY probe (removed in the next commit): the default mode's pool (each split's last
chunks claimed by whichever program is free) at the decode target rows, against pool 0 and
cuDNN; graph replays and graph replays after a read flush (clean), 3 interleaved reps.
PYTHONPATH=src python benchmarks/_probe_pool.py
"""
import sys
from unittest import mock

import torch

sys.path.insert(0, "benchmarks")
import decode as bd  # noqa: E402
from flashfold.kernels.decode import splitkv  # noqa: E402
from torch.nn.attention import SDPBackend  # noqa: E402

ROWS = ((8, 65536), (8, 8192), (1, 131072), (8, 32768))
VARIANTS = {  # name: (pool, chunk)
    "pool0": (0, 256), "default": (None, 256), "p1c256": (1, 256), "p2c256": (2, 256),
    "p4c256": (4, 256), "p2c128": (2, 128), "p4c128": (4, 128), "p4c64": (4, 64),
}


def main():
    for batch, length in ROWS:
        c = bd.Cache(batch, length)
        nbytes = c.kv_bytes()
        scale = bd.D ** -0.5
        ref = splitkv.splitkv_decode(c.q, c.k, c.v, c.lens, None, scale=scale, pool=0)[0]
        exact = bd.decode_reference(c.q.double().cpu(), c.k.double().cpu(), c.v.double().cpu(),
                                    c.lens.cpu())[0] if length * batch <= 65536 else None
        fns = {}
        for name, (pool, chunk) in VARIANTS.items():
            with mock.patch.object(splitkv, "POOL_CHUNK_N", chunk):
                plan = splitkv.prepare(c.q, c.k, c.v, c.lens, None, scale=scale, pool=pool).plan
                o = splitkv.splitkv_decode(c.q, c.k, c.v, c.lens, None, scale=scale, pool=pool)[0]
                o2 = splitkv.splitkv_decode(c.q, c.k, c.v, c.lens, None, scale=scale, pool=pool)[0]
                torch.cuda.synchronize()
            err = (o.float() - ref.float()).abs().max().item()
            xerr = (o.double().cpu() - exact).abs().max().item() if exact is not None else float("nan")
            print(f"{batch} x {length} {name}: splits {plan.n_splits} pool {plan.pool} chunk "
                  f"{chunk}: max|o - pool0| {err:.2e}, max|o - f64| {xerr:.2e}, "
                  f"repeat bitwise {torch.equal(o, o2)}", flush=True)

            def fn(pool=pool, chunk=chunk):
                with mock.patch.object(splitkv, "POOL_CHUNK_N", chunk):
                    return splitkv.splitkv_decode(c.q, c.k, c.v, c.lens, None, scale=scale,
                                                  pool=pool)
            fns[name] = fn
        cudnn = bd.sdpa(SDPBackend.CUDNN_ATTENTION, c.q, c.k, c.v)
        res = {}
        for rep in range(3):
            for name, fn in list(fns.items()) + [("cuDNN", cudnn)]:
                for clean in (False, True):
                    ms = bd.timed(fn, True, clean=clean)
                    res.setdefault((name, clean), []).append(nbytes / ms / 1e6)
        for clean in (False, True):
            base = res[("cuDNN", clean)]
            print(f"  {batch} x {length} {'clean' if clean else 'graph'}: " + " | ".join(
                f"{name} " + "/".join(f"{x:.0f}" for x in res[(name, clean)]) + " ("
                + "/".join(f"{x / b:.3f}" for x, b in zip(res[(name, clean)], base)) + ")"
                for name in list(fns) + ["cuDNN"]), flush=True)
        del c, fns, cudnn
        torch.cuda.empty_cache()


main()
