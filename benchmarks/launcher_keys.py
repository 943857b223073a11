"""Host time of the launcher's fast path, on the CPU: the cache key, and a whole cache hit.

Run from the repository root on any machine (no GPU: the driver and the compiled kernel
are fakes, so what is timed is Python, not a launch), a few seconds::

    PYTHONPATH=src python benchmarks/launcher_keys.py
    # side by side with another version of the launcher, e.g. an older commit's:
    git show REV:src/flashfold/kernels/launcher.py > /tmp/old_launcher.py
    PYTHONPATH=src python benchmarks/launcher_keys.py --against /tmp/old_launcher.py

Argument lists timed:

* ``synthetic``: 49 positionals (8 tensors, two tuples of two tensors, a tuple of
  floats, 35 ints of mixed sizes, 3 floats) and 24 keyword arguments (12 JITFunctions,
  6 ints, 4 bools, ``num_warps``, ``num_stages``);
* ``reduce``: the plan of ``flashfold.argmax`` over a 2^20 x 7 fp32 tensor (18
  positionals with tuples of outputs, 24 keyword constexprs, 11 of them JITFunctions);
* ``attention``: the forward launch of causal attention, (2, 8, 1024, 64) fp32 (64
  positionals, 24 of them ``None``, two positional constexprs; 22 keyword constexprs);
* ``gluon``: the Gluon forward's launch, causal (16, 16, 1024, 128) bf16 (four Gluon TMA
  descriptors, 13 positionals, 10 keyword constexprs and options).

Columns, in microseconds per call, best of 7 timeit repeats: ``key``, the key alone
(``launcher._key``, for a module that has one); ``hit``, :func:`launch` on a cache hit
(checks, key, lookup, argument list, the fake launcher's call). The script fails if a
timed call missed the cache.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import timeit

import torch
import triton
import triton.language as tl


@triton.jit
def _kernel(t0, t1, t2, t3, t4, t5, t6, t7, outs, ins, fl,
            i0, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10, i11, i12, i13, i14, i15, i16, i17,
            i18, i19, i20, i21, i22, i23, i24, i25, i26, i27, i28, i29, i30, i31, i32, i33,
            i34, f0, f1, f2,
            J0: tl.constexpr, J1: tl.constexpr, J2: tl.constexpr, J3: tl.constexpr,
            J4: tl.constexpr, J5: tl.constexpr, J6: tl.constexpr, J7: tl.constexpr,
            J8: tl.constexpr, J9: tl.constexpr, J10: tl.constexpr, J11: tl.constexpr,
            K0: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr,
            K4: tl.constexpr, K5: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
            B2: tl.constexpr, B3: tl.constexpr):
    pass


def _jit_functions(n):
    """``n`` distinct JITFunctions (flashfold's generated combines, in the real kernels)."""
    def f(x):
        return x
    return [triton.runtime.jit.JITFunction(f) for _ in range(n)]


def synthetic():
    ts = [torch.empty(4096) for _ in range(12)]
    ints = [1, 0, 7, 16, 4096, 1 << 20, 12345, 2 ** 33, -1, 3, 64, 255, 256, 1024, 2048, 1,
            17, 48, 2 ** 31 - 1, 2 ** 31, 5, 6, 7, 8, 9, 10, 11, 12, 13, 32, 96, 128, 100, 0, 1]
    args = (*ts[:8], (ts[8], ts[9]), (ts[10], ts[11]), (0.5, 2.0), *ints, 0.125, 1e-6, 3.0)
    kwargs = {f"J{i}": j for i, j in enumerate(_jit_functions(12))}
    kwargs.update(K0=8, K1=1, K2=256, K3=0, K4=64, K5=4096, B0=False, B1=True, B2=False,
                  B3=True, num_warps=4, num_stages=1)
    return _kernel, (1024,), args, kwargs


def reduce_plan():
    from flashfold import monoids
    from flashfold.kernels.reduce import launch as RL
    RL.num_sms = lambda device: 132                  # a CPU tensor has no SM count
    plan, _ = RL.plan_reduce(monoids.ARGMAX, torch.randn(1 << 20, 7), 1)
    (step,) = plan
    return step.kernel, step.grid, step.args, step.kwargs


def attention_launch():
    from flashfold.kernels.attention import fwd
    q, k, v = (torch.randn(2, 8, 1024, 64) for _ in range(3))
    _, _, (grid, args, kwargs) = fwd.prepare_forward(q, k, v, scale=0.125, right=0)
    return fwd._attn_fwd, grid, args, kwargs


def gluon_attention_launch():
    from flashfold.kernels.attention import gluon_fwd
    q, k, v = (torch.empty(16, 16, 1024, 128, dtype=torch.bfloat16) for _ in range(3))
    (kernel, grid, args, kwargs), = gluon_fwd.gluon_attention_fwd(q, k, v, causal=True,
                                                                  return_lse=True, launch=False)
    return kernel, grid, args, kwargs


class _FakeCompiled:
    function = packed_metadata = None

    @staticmethod
    def run(*args):
        pass


class _FakeDriver:
    class active:
        @staticmethod
        def get_current_device():
            return 0

        @staticmethod
        def get_current_stream(device):
            return 0


def load(path):
    spec = importlib.util.spec_from_file_location("launcher_against", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", help="another launcher.py, timed side by side (interleaved)")
    ap.add_argument("--number", type=int, default=1000, help="calls per timeit repeat")
    opts = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: the launcher is off under the interpreter")
    from flashfold.kernels import launcher
    modules = {"this": launcher}
    if opts.against:
        modules = {"against": load(opts.against), **modules}
    misses = []
    for L in modules.values():
        L._driver = _FakeDriver
        L._slow = lambda kernel, grid, args, kwargs: misses.append(kernel) or _FakeCompiled()
    cases = [(name, make()) for name, make in (("synthetic", synthetic), ("reduce", reduce_plan),
                                               ("attention", attention_launch),
                                               ("gluon", gluon_attention_launch))]
    best: dict = {}
    for _ in range(7):                  # interleaved repeats: both see the same machine load
        for name, (kernel, grid, args, kwargs) in cases:
            for label, L in modules.items():
                L.cache_clear()
                L.launch(kernel, grid, args, kwargs)       # the miss: caches the fake
                misses.clear()
                timed = {"hit": lambda: L.launch(kernel, grid, args, kwargs)}
                if hasattr(L, "_key"):
                    timed["key"] = lambda: L._key(kernel, args, kwargs)
                for what, fn in timed.items():
                    us = timeit.timeit(fn, number=opts.number) / opts.number * 1e6
                    best[name, label, what] = min(best.get((name, label, what), us), us)
                assert not misses, f"{name}: a cache hit took Triton's path"
    print(f"{'arguments':<10} {'args':>4} {'kwargs':>6} " + " ".join(
        f"{label + ' ' + what:>12}" for label in modules for what in ("key", "hit")))
    for name, (kernel, grid, args, kwargs) in cases:
        cells = [best.get((name, label, what)) for label in modules for what in ("key", "hit")]
        print(f"{name:<10} {len(args):>4} {len(kwargs):>6} "
              + " ".join("           -" if c is None else f"{c:12.1f}" for c in cells))


if __name__ == "__main__":
    main()
