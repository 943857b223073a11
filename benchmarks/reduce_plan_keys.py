"""Host time of the reduction launchers' plan cache, on the CPU: a plan built vs replayed.

Run from the repository root on any machine (no GPU: CPU tensors, and the plans are not
run, so what is timed is Python up to the kernel launch), a few seconds::

    PYTHONPATH=src python benchmarks/reduce_plan_keys.py

Rows: ``flashfold.argmax`` over 2^20 x 7 fp32 (ARGMAX_INDEX, the one-row-per-thread
plan) and ``flashfold.softmax`` over 64 x 1024 fp32 (the fused row map); ``logsumexp``
over 2 x 40000 (split-K: two launches and a partial-state buffer) and ``cumsum`` over
1 x 40000 (the look-back scan: zeroed flags and a view of them). Columns, in
microseconds per call, best of 7 interleaved timeit repeats:

* ``build``: the launcher with ``FLASHFOLD_PLAN_CACHE=0``: the plan built on every call
  (as before the cache, plus one environment lookup);
* ``hit``: the launcher on a cache hit (signature, lookup, new buffers, launches rebuilt);
* ``api build`` / ``api hit``: the public function (checks, views, reshapes) around them.

The launches are replaced by a no-op (``launch._run``); the script fails if a timed hit
missed the cache.
"""

from __future__ import annotations

import os
import timeit

import torch

import flashfold as ff
import flashfold.monoids as M
from flashfold.api import reductions as api
from flashfold.kernels.reduce import launch as L


def cases():
    """(name, launcher call, public call) for each row."""
    x = torch.randn(2**20, 7)
    s = torch.randn(64, 1024)
    few = torch.randn(2, 40000)
    one = torch.randn(1, 40000)
    return [
        ("argmax 2^20 x 7", lambda: L.launch_reduce(api.ARGMAX_INDEX, x, 1, {}),
         lambda: ff.argmax(x, 1)),
        ("softmax 64 x 1024", lambda: L.launch_normalize(api.SOFTMAX_MAP, s, 1),
         lambda: ff.softmax(s, 1)),
        ("logsumexp 2 x 40000 split-K", lambda: L.launch_reduce(M.LOGSUMEXP2, few, 1, {}),
         lambda: ff.logsumexp(few, 1)),
        ("cumsum 1 x 40000 look-back", lambda: L.launch_scan(M.SUM, one, 1, False, {}),
         lambda: ff.cumsum(one, 1)),
    ]


def best(f, number):
    return min(timeit.repeat(f, number=number, repeat=1)) / number * 1e6


def main(number=2000, repeats=7):
    L._run = lambda plan, device=None: None
    api._use_kernels = lambda t: True
    print(f"{'us per call':30s} {'build':>8s} {'hit':>8s} {'api build':>10s} {'api hit':>8s}")
    for name, launcher_call, api_call in cases():
        times = {k: [] for k in ("build", "hit", "api build", "api hit")}
        for _ in range(repeats):
            for cached in (False, True):
                os.environ["FLASHFOLD_PLAN_CACHE"] = "1" if cached else "0"
                for label, f in (("", launcher_call), ("api ", api_call)):
                    f()
                    hits = L.plan_cache_info()["hits"]
                    times[label + ("hit" if cached else "build")].append(best(f, number))
                    if cached and L.plan_cache_info()["hits"] != hits + number:
                        raise SystemExit(f"{name}: a timed call missed the plan cache")
        row = [min(v) for v in times.values()]
        print(f"{name:30s} {row[0]:8.1f} {row[1]:8.1f} {row[2]:10.1f} {row[3]:8.1f}")


if __name__ == "__main__":
    main()
