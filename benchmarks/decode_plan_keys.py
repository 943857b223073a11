"""Host time of an eager decode call on the CPU: its plan built vs replayed from the cache.

Run from the repository root on any machine (no GPU: CPU tensors, and the kernels are not
run, so what is timed is Python up to the kernel launch), ~half a minute::

    PYTHONPATH=src python benchmarks/decode_plan_keys.py
    PYTHONPATH=src python benchmarks/decode_plan_keys.py --launcher   # + the launcher
    # side by side with another version of the package, e.g. an older commit's:
    mkdir /tmp/old && git archive REV src | tar -x -C /tmp/old
    PYTHONPATH=src python benchmarks/decode_plan_keys.py --against /tmp/old/src/flashfold

Rows: the decode steps of ``benchmarks/host_overhead.py`` (bf16, 32 query / 8 KV heads,
head_dim 128, 512 cached keys; batch 1 and 8, default and ``batch_invariant``), and a
paged cache (pages of 16) at batch 8 with q_len 4 and ``return_lse``. Columns, in
microseconds per call, best of ``--repeats`` interleaved timeit repeats of ``--number``
calls:

* ``build``: ``splitkv_decode`` with ``FLASHFOLD_PLAN_CACHE=0``: the plan built on every
  call (as before the cache, plus the key and one environment lookup);
* ``hit``: ``splitkv_decode`` on a cache hit (signature, lookup, new buffers, launches
  rebuilt);
* ``api build`` / ``api hit``: ``flashfold.decode`` (its checks) around them, with
  ``check_lengths=False`` (the default on CUDA: the CPU default reads the lengths).

The launches are no-ops (``launcher.launch`` replaced); with ``--launcher`` they go
through :func:`flashfold.kernels.launcher.launch` instead, with a fake driver and compiled
kernel (as ``benchmarks/launcher_keys.py``), so its key (or the plan's kept launch) is
timed too. ``flashfold.decode`` is sent to the kernels on CPU tensors by replacing
``api.decode._use_kernels`` (a version without that switch is given one). ``--against``
loads another copy of the package (as ``flashfold_against``) and times it in the same
process, interleaved; a version without the plan cache (no ``splitkv.plan_cache_info``)
has only the build columns. The script fails if a timed hit missed the cache.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import timeit

import torch


def load_against(path):
    """The package at ``path`` (a ``flashfold`` source folder) as ``flashfold_against``."""
    name = "flashfold_against"
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(path, "__init__.py"), submodule_search_locations=[path])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def cases(ff, splitkv):
    """(name, splitkv_decode call, flashfold.decode call) for each row."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    rows = []
    for batch in (1, 8):
        q, k, v = randn(batch, 32, 1, 128), randn(batch, 8, 512, 128), randn(batch, 8, 512, 128)
        lens = torch.full((batch,), 512, dtype=torch.int32)
        for inv in (False, True):
            rows.append((f"{batch} x 512{' invariant' if inv else ''}",
                         lambda q=q, k=k, v=v, n=lens, i=inv: splitkv.splitkv_decode(
                             q, k, v, n, scale=128 ** -0.5, batch_invariant=i),
                         lambda q=q, k=k, v=v, n=lens, i=inv: ff.decode(
                             q, k, v, n, batch_invariant=i, check_lengths=False)))
    q = randn(8, 32, 4, 128)
    kp, vp = randn(8 * 32, 16, 8, 128), randn(8 * 32, 16, 8, 128)
    table = torch.randperm(8 * 32, generator=g).view(8, 32).to(torch.int32)
    lens = torch.full((8,), 500, dtype=torch.int32)
    rows.append(("8 x 512 paged16 q4 lse",
                 lambda: splitkv.splitkv_decode(q, kp, vp, lens, table, scale=128 ** -0.5),
                 lambda: ff.decode(q, kp, vp, lens, block_table=table, return_lse=True,
                                   check_lengths=False)))
    return rows


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launcher_keys import _FakeCompiled, _FakeDriver  # noqa: E402  (fake launch, same harness)


def prepare_version(ff, use_launcher):
    """(its splitkv module, its plan_cache_info or None), with launches stubbed out and
    flashfold.decode sent to the kernels."""
    name = ff.__name__
    launcher = importlib.import_module(name + ".kernels.launcher")
    api = importlib.import_module(name + ".api.decode")
    splitkv = importlib.import_module(name + ".kernels.decode.splitkv")
    if use_launcher:
        launcher._driver = _FakeDriver
        launcher._slow = lambda kernel, grid, args, kwargs: _FakeCompiled()
    else:
        launcher.launch = lambda *args, **kwargs: None
    if hasattr(api, "_use_kernels"):
        api._use_kernels = lambda q: True
    else:                       # before the switch: the kernels' branch tested q.is_cuda
        source = api.decode.__code__
        raise SystemExit(f"{name}: api.decode has no _use_kernels switch ({source.co_filename}); "
                         "add `def _use_kernels(q): return q.is_cuda` and call it there")
    return splitkv, getattr(splitkv, "plan_cache_info", None)


def best(f, number):
    return min(timeit.repeat(f, number=number, repeat=1)) / number * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launcher", action="store_true",
                    help="launch through launcher.launch (fake driver) instead of a no-op")
    ap.add_argument("--against", help="another flashfold package folder, timed side by side")
    ap.add_argument("--number", type=int, default=2000, help="calls per timeit repeat")
    ap.add_argument("--repeats", type=int, default=7)
    opts = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: the kernels are not run, and the launcher is off "
                 "under the interpreter")
    import flashfold
    versions = {"this": flashfold}
    if opts.against:
        versions = {"against": load_against(opts.against), **versions}
    timed = []                              # (version label, column, row, call, info)
    for label, ff in versions.items():
        splitkv, info = prepare_version(ff, opts.launcher)
        columns = [("build", "api build")] + ([("hit", "api hit")] if info else [])
        for row, direct, public in cases(ff, splitkv):
            for cached, pair in enumerate(columns):
                for column, f in zip(pair, (direct, public)):
                    timed.append((label, column, row, f, info if cached else None))
    results: dict = {}
    for _ in range(opts.repeats):           # interleaved: every column sees the same load
        for label, column, row, f, info in timed:
            os.environ["FLASHFOLD_PLAN_CACHE"] = "1" if info else "0"
            f()
            hits = info()["hits"] if info else 0
            results.setdefault((label, column), {}).setdefault(row, []).append(
                best(f, opts.number))
            if info and info()["hits"] != hits + opts.number:
                raise SystemExit(f"{label} {row}: a timed call missed the plan cache")
    rows = list(dict.fromkeys(r for _, _, r, _, _ in timed))
    heads = list(results)
    names = [(lab + ": " if len(versions) > 1 else "") + col for lab, col in heads]
    width = max(len(n) for n in names) + 2
    print(f"{'us per call':24s}" + "".join(f"{n:>{width}s}" for n in names))
    for row in rows:
        print(f"{row:24s}" + "".join(f"{min(results[h][row]):{width}.1f}" for h in heads))


if __name__ == "__main__":
    main()
