"""Probe (temporary): the split kernel's tiles and load path (cp.async pointers or TMA) at
the decode target rows, GB/s from CUDA-graph replays after a read flush of L2 (the
acceptance's clean mode), 3 interleaved repetitions against cuDNN; outputs checked equal
to the default's within bf16 rounding first."""
import sys

import torch

sys.path.insert(0, "benchmarks")
from decode import D, TARGETS, Cache, sdpa, timed  # noqa: E402
from flashfold.kernels.decode import splitkv  # noqa: E402

VARIANTS = [("default 64/4w/3s", None, None), ("64/4w/3s tma", (64, 4, 3), True),
            ("32/4w/4s", (32, 4, 4), False), ("32/4w/4s tma", (32, 4, 4), True),
            ("64/4w/4s tma", (64, 4, 4), True), ("128/8w/2s tma", (128, 8, 2), True),
            ("64/8w/3s tma", (64, 8, 3), True)]

if __name__ == "__main__":
    from torch.nn.attention import SDPBackend
    print(torch.cuda.get_device_name(), torch.__version__)
    for batch, length in TARGETS:
        c = Cache(batch, length)
        nbytes = c.kv_bytes()
        fns = {}
        ref = splitkv.splitkv_decode(c.q, c.k, c.v, c.lens, None, scale=D ** -0.5)[0]
        for name, cfg, tma in VARIANTS:
            kw = {}
            if cfg is not None:
                kw["config"] = splitkv.DecodeConfig(block_n=cfg[0], num_warps=cfg[1],
                                                    num_stages=cfg[2])
            if tma is not None:
                kw["tma"] = tma
            fn = (lambda kw=kw: splitkv.splitkv_decode(c.q, c.k, c.v, c.lens, None,
                                                       scale=D ** -0.5, **kw))
            try:
                err = (fn()[0].float() - ref.float()).abs().max().item()
                assert err < 2e-2, err
                fns[name] = fn
            except Exception as e:  # noqa: BLE001
                print(f"  {name}: failed {type(e).__name__}: {str(e)[:120]}")
        fns["cuDNN"] = sdpa(SDPBackend.CUDNN_ATTENTION, c.q, c.k, c.v)
        res = {}
        for rep in range(3):
            for name, fn in fns.items():
                res.setdefault(name, []).append(nbytes / timed(fn, True, clean=True) / 1e6)
        print(f"batch {batch} len {length} (clean L2, graph; GB/s x3, median / cuDNN median)")
        cud = sorted(res["cuDNN"])[1]
        for name, xs in res.items():
            print(f"  {name:16s} " + " ".join(f"{x:6.0f}" for x in xs)
                  + f"   {sorted(xs)[1] / cud:.3f}")
        del c
        torch.cuda.empty_cache()
