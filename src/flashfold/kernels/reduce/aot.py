"""Compile launch plans for a GPU target without a GPU (a CI check of the real compiler).

The interpreter (``TRITON_INTERPRET=1``) executes kernels as Python and accepts programs
the compiler rejects; this module runs Triton's real pipeline (TTIR -> TTGIR -> LLVM ->
PTX -> cubin, with the ``ptxas`` Triton ships) for an ``sm_90`` target through the shared
:func:`flashfold.kernels.aot.compile_launch`, on every launch plan the public reductions
build: the width of global loads/stores, registers and spills of each variant.

Usage (in a process *without* ``TRITON_INTERPRET``)::

    python -m flashfold.kernels.reduce.aot [--json]   # compile every template variant

Nothing here launches a kernel.
"""

from __future__ import annotations

import sys

from ..aot import compile_launch

__all__ = ["plans", "main", "SMS"]


def _affine():
    """Composition of affine maps ``h -> a·h + b`` (not commutative), for the ORDERED
    variants: ``(a1, b1) ⊕ (a2, b2) = (a1·a2, b1·a2 + b2)``."""
    from ...algebra.monoid import Monoid
    return Monoid("affine", fields=("a", "b"), identity=(1.0, 0.0),
                  lift=lambda x: (0.5, x), combine=lambda p, q: (p.a * q.a, p.b * q.a + q.b),
                  commutative=False)


#: streaming multiprocessors the plans are made for: split decisions as on an H200
SMS = 132


def plans(sms: int = SMS):
    """``(name, plan)`` covering every template variant the public functions launch, with
    the split decisions of a GPU of ``sms`` streaming multiprocessors. The variants off
    the default path (reduce-then-scan, the prefetching chunked scan, scalar loads of
    misaligned rows) are asked of the planners by keyword (``lookback=``, ``config=``,
    ``align_rows=``); no global of :mod:`.launch` is changed."""
    from functools import partial

    import torch

    from ... import monoids as M
    from . import launch as L
    from .functions import LOGSUMEXP2_SCAN as LSE2_SCAN
    from .functions import softmax_map

    SOFTMAX = softmax_map()
    reduce_ = partial(L.plan_reduce, sms=sms)
    segment = partial(L.plan_segment_reduce, sms=sms)
    scan = partial(L.plan_scan, sms=sms)
    normalize = partial(L.plan_normalize, sms=sms)
    out = []
    for dt in (torch.float32, torch.bfloat16):
        x = torch.empty(64, 16384, dtype=dt)
        tag = str(dt).replace("torch.", "")
        for m in (M.SUM, M.MAX, M.LOGSUMEXP2, M.WELFORD, M.ARGMAX):
            out.append((f"reduce {m.name} 64x16384 {tag}", reduce_(m, x, 1)[0]))
        out.append((f"softmax 64x16384 {tag}", normalize(SOFTMAX, x, 1)[0]))
        out.append((f"cumsum 64x16384 {tag}", scan(M.SUM, x, 1)[0]))
        out.append((f"logcumsumexp 64x16384 {tag}", scan(LSE2_SCAN, x, 1)[0]))
    f32 = torch.float32
    aff = _affine()
    out += [
        ("reduce logsumexp2 split-K 1x2^22", reduce_(M.LOGSUMEXP2, torch.empty(1, 2**22), 1)[0]),
        ("reduce logsumexp2 4096x12345", reduce_(M.LOGSUMEXP2, torch.empty(4096, 12345), 1)[0]),
        ("reduce welford 4096x12345", reduce_(M.WELFORD, torch.empty(4096, 12345), 1)[0]),
        ("cumsum 4096x12345", scan(M.SUM, torch.empty(4096, 12345), 1)[0]),
        ("reduce logsumexp2 2^16x7", reduce_(M.LOGSUMEXP2, torch.empty(2**16, 7), 1)[0]),
        ("reduce welford columns", reduce_(M.WELFORD, torch.empty(4096, 1024), 0)[0]),
        ("reduce affine ordered", reduce_(aff, torch.empty(512, 5000), 1)[0]),
        ("reduce affine ordered split-K", reduce_(aff, torch.empty(1, 2**22), 1)[0]),
        ("reduce affine ordered 1024x16384", reduce_(aff, torch.empty(1024, 16384), 1)[0]),
        ("reduce affine ordered 1024x16384 one-element lanes", reduce_(
            aff, torch.empty(1024, 16384), 1, config=L.Config(1, 512, 2, 4))[0]),
        ("segment logsumexp2", segment(
            M.LOGSUMEXP2, torch.empty(10000, 64), torch.tensor([0, 100, 10000]), 0)[0]),
        ("scan logsumexp2 reverse", scan(M.LOGSUMEXP2, torch.empty(64, 16384), 1, True)[0]),
        ("scan sum look-back 1x2^22", scan(M.SUM, torch.empty(1, 2**22), 1)[0]),
        ("scan logcumsumexp look-back 4x2^20", scan(LSE2_SCAN, torch.empty(4, 2**20), 1)[0]),
        ("scan affine look-back 1x2^22", scan(aff, torch.empty(1, 2**22), 1)[0]),
        ("scan argmax look-back 1x2^22 bf16", scan(M.ARGMAX, torch.empty(1, 2**22, dtype=torch.bfloat16), 1)[0]),
        ("scan affine multi-block reverse", scan(aff, torch.empty(1, 2**22), 1, True)[0]),
        ("scan argmax 2^16x7", scan(M.ARGMAX, torch.empty(2**16, 7), 1)[0]),
        ("scan sum columns", scan(M.SUM, torch.empty(1024, 1024), 0)[0]),
        ("softmax 2-loop 64x65536", normalize(SOFTMAX, torch.empty(64, 65536), 1)[0]),
        ("softmax split 1x2^22", normalize(SOFTMAX, torch.empty(1, 2**22), 1)[0]),
        ("segment sum 2^20x256", segment(
            M.SUM, torch.empty(2**20, 256), torch.arange(0, 2**20 + 1, 2**14), 0)[0]),
        ("softmax 2^16x7", normalize(SOFTMAX, torch.empty(2**16, 7, dtype=f32), 1)[0]),
    ]
    out.append(("scan logcumsumexp reduce-then-scan 1x2^22",
                scan(LSE2_SCAN, torch.empty(1, 2**22), 1, lookback=False)[0]))
    prefetch = L.Config(2048, 1, 1, 4, vec=4, prefetch=True)
    for dt in (torch.float32, torch.bfloat16):
        tag = str(dt).replace("torch.", "")
        out.append((f"logcumsumexp prefetch 64x16384 {tag}",
                    scan(LSE2_SCAN, torch.empty(64, 16384, dtype=dt), 1, lookback=False,
                         config=prefetch)[0]))
    for m in (M.LOGSUMEXP2, M.WELFORD):           # realignment: on by default, switchable
        out.append((f"reduce {m.name} 4096x12345 scalar loads",
                    reduce_(m, torch.empty(4096, 12345), 1, align_rows=False)[0]))
    out += _several_inputs(reduce_, segment, scan)
    return out


def _several_inputs(reduce_, segment, scan):
    """Monoids of several inputs (the examples): two tiles loaded per element, each
    through its own strides (a broadcast one with stride 0)."""
    import torch

    from ... import examples as ex

    wm, rec, cov = ex.WEIGHTED_MEAN, ex.LINEAR_RECURRENCE, ex.COVARIANCE
    out = []
    for dt in (torch.float32, torch.bfloat16):
        tag = str(dt).replace("torch.", "")
        two = (torch.empty(64, 16384, dtype=dt), torch.empty(64, 16384, dtype=dt))
        out.append((f"reduce weighted_mean 64x16384 {tag}", reduce_(wm, two, 1)[0]))
        many = (torch.empty(1024, 16384, dtype=dt), torch.empty(1024, 16384, dtype=dt))
        out.append((f"scan linear_recurrence 1024x16384 {tag}", scan(rec, many, 1)[0]))
    x = torch.empty(64, 16384)
    row = torch.empty(16384).expand(64, 16384)
    out += [
        ("reduce weighted_mean broadcast row 64x16384", reduce_(wm, (row, x), 1)[0]),
        ("reduce weighted_mean bf16 w 64x16384", reduce_(
            wm, (torch.empty(64, 16384, dtype=torch.bfloat16), x), 1)[0]),
        ("reduce covariance 64x16384", reduce_(cov, (x, x.clone()), 1)[0]),
        ("reduce weighted_mean columns", reduce_(wm, (torch.empty(4096, 1024),) * 2, 0)[0]),
        ("reduce linear_recurrence ordered", reduce_(rec, (x, x.clone()), 1)[0]),
        ("reduce weighted_mean split-K 1x2^22", reduce_(
            wm, (torch.empty(1, 2**22), torch.empty(1, 2**22)), 1)[0]),
        ("scan linear_recurrence reverse 64x16384", scan(rec, (x, x.clone()), 1, True)[0]),
        ("scan linear_recurrence look-back 1x2^22", scan(
            rec, (torch.empty(1, 2**22), torch.empty(1, 2**22)), 1)[0]),
        ("scan linear_recurrence 0-d a 1024x16384", scan(
            rec, (torch.empty(()).expand(1024, 16384), torch.empty(1024, 16384)), 1)[0]),
        ("segment weighted_mean 2^20x256", segment(
            wm, (torch.empty(2**20, 256), torch.empty(2**20, 256)),
            torch.arange(0, 2**20 + 1, 2**14), 0)[0]),
    ]
    # a vector input and field (ATTENTION2 over (scores, values)): the per-feature monoid,
    # the feature axis a batch dim, the scores broadcast along it with stride 0
    from ... import monoids as M
    from . import launch as L
    per = L._per_feature(M.ATTENTION2)
    views, d, _ = L._feature_views(M.ATTENTION2, (torch.empty(64, 4096),
                                                  torch.empty(64, 4096, 64)), 1)
    out += [("reduce attention2 (s, v) 64x4096x64", reduce_(per, views, d)[0]),
            ("scan attention2 (s, v) 64x4096x64", scan(per, views, d)[0])]
    return out


def main(argv=None) -> int:
    import json
    argv = sys.argv[1:] if argv is None else argv
    rows = []
    for name, plan in plans():
        for i, launch in enumerate(plan):
            c = compile_launch(launch.kernel, launch.args, launch.kwargs)
            rows.append({"name": name, "launch": i, "kernel": c.name, "num_warps": c.num_warps,
                         **c.resources(), "loads": c.loads(), "stores": c.stores(),
                         "sass": c.sass_instructions()})
    if "--json" in argv:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(f"{r['name']:36s} #{r['launch']} {r['kernel']:16s} warps={r['num_warps']:2d} "
                  f"regs={r['registers']} spills={r['spill_stores']} loads={r['loads']} "
                  f"stores={r['stores']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
