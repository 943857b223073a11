"""Device smoke test: the codegen mechanisms on a real GPU, plus the copy ceiling.

Run: PYTHONPATH=src python benchmarks/smoke.py
"""
import sys

import torch
import triton
import triton.language as tl

from flashfold.kernels.codegen import triton_monoid
from flashfold.monoids import ARGMAX, LOGSUMEXP, WELFORD


@triton.jit
def _row_reduce(x_ptr, o_ptr, N: tl.constexpr, LIFT: tl.constexpr, REDUCE: tl.constexpr, SCAN: tl.constexpr,
                FIN: tl.constexpr):
    row = tl.program_id(0)
    x = tl.load(x_ptr + row * N + tl.arange(0, N)).to(tl.float32)
    m, d = LIFT(x)
    ms, ds = SCAN(m, d, 0, False)
    m, d = REDUCE(m, d, 0)
    r, = FIN(m, d)
    tl.store(o_ptr + row, r)
    rs, = FIN(ms, ds)
    tl.store(o_ptr + 4096 + row * N + tl.arange(0, N), rs)


def main():
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), sys.version.split()[0])
    props = torch.cuda.get_device_properties(0)
    print("SMs", props.multi_processor_count, "L2", getattr(props, "L2_cache_size", None))
    tm = triton_monoid(LOGSUMEXP)
    for m in (ARGMAX, WELFORD):
        triton_monoid(m)
    x = torch.randn(4096, 1024, device="cuda")
    o = torch.empty(4096 + 4096 * 1024, device="cuda")
    _row_reduce[(4096,)](x, o, N=1024, LIFT=tm.lift, REDUCE=tm.reduce_tile, SCAN=tm.scan_tile,
                         FIN=tm.finalize)
    print("lse max err", (o[:4096] - torch.logsumexp(x, 1)).abs().max().item())
    print("logcumsumexp max err", (o[4096:].view(4096, 1024) - torch.logcumsumexp(x, 1)).abs().max().item())
    a = torch.empty(2**28, device="cuda", dtype=torch.float32)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), return_mode="median")
    print(f"copy: {2 * a.numel() * 4 / ms / 1e6:.0f} GB/s")
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
        print("TensorDescriptor ok")
    except Exception as e:  # pragma: no cover
        print("no TensorDescriptor", e)


if __name__ == "__main__":
    main()
