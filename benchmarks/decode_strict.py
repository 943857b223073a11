"""What the non-finite rule costs split-KV decode, for a before/after comparison of two
trees on the GPU: CUDA-graph replays timed by ``triton.testing.do_bench`` (L2 flushed), GB/s
of K + V read, default and batch-invariant mode, contiguous and paged (16) caches.

Run (H200), alternating the trees, twice each::

    PYTHONPATH=<tree>/src python benchmarks/decode_strict.py

Rows: ``q_len`` 1 (the tile loop is unchanged there; only the epilogue's selects), ``q_len``
4 and 16 (the keys some rows see and others do not: ``_partial_keys``), windows. Predicted:
~0 at ``q_len`` 1; under 0.5% in default mode at ``q_len`` > 1; batch-invariant ``q_len`` > 1
compiles to 219-243 registers per thread (168 before), 2 blocks per SM instead of 3: up to
a few percent, less where two blocks still saturate the memory.

Before each call is timed, its output for sequence 0 (every head and query row) is checked
against float64 decode of the same inputs (``decode_reference``) with the tolerance
table's row for bf16 (:func:`flashfold.testing.compare`). Exit status 1 if any check fails.
"""
import torch, triton
import flashfold as ff
from flashfold.bench import graph_replay
from flashfold.kernels.decode.reference import decode_reference
from flashfold.testing import compare

HQ, HKV, D = 32, 8, 128
ROWS = [(8, 8192, 1, None), (8, 65536, 1, None), (64, 8192, 1, None), (8, 8192, 1, (1000, None)),
        (8, 8192, 4, None), (64, 4096, 4, None), (1, 32768, 4, None), (8, 8192, 4, (1000, None)),
        (8, 8192, 16, None)]


def check(what, q, k, v, lens, table, window, inv) -> bool:
    """``ff.decode``'s output for sequence 0 against float64 ``decode_reference`` of the
    same inputs (tolerance table row of q's dtype); prints one line."""
    o = ff.decode(q, k, v, lens, block_table=table, window=window, batch_invariant=inv)
    if table is None:
        want, _ = decode_reference(q[:1], k[:1], v[:1], lens[:1], window=window)
    else:
        want, _ = decode_reference(q[:1], k, v, lens[:1], table[:1], window=window)
    r = compare(o[:1], want, q.dtype)
    why = r.get("why") or (f"max abs err {r['max_abs']:.3g}, {r['n_bad']} bad, NaN/inf "
                           f"parity {r['nan_inf_parity']}")
    print(f"  {'ok  ' if r['ok'] else 'FAIL'} {what}: sequence 0 vs float64: {why}", flush=True)
    return r["ok"]


def main():
    torch.manual_seed(0)
    failed = []
    for batch, n, q_len, window in ROWS:
        q = torch.randn(batch, HQ, q_len, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, HKV, n, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lens = torch.full((batch,), n, dtype=torch.int32, device="cuda")
        page = 16
        kp = k.permute(0, 2, 1, 3).reshape(batch * n // page, page, HKV, D).contiguous()
        vp = v.permute(0, 2, 1, 3).reshape(batch * n // page, page, HKV, D).contiguous()
        table = torch.arange(batch * n // page, dtype=torch.int32, device="cuda").view(batch, -1)
        gb = 2 * batch * HKV * n * D * 2 / 1e9
        for inv in (False, True):
            for name, kk, vv, tb in (("contig", k, v, None), ("paged16", kp, vp, table)):
                what = (f"{batch} x {n} q_len {q_len} window {window} "
                        f"{'inv' if inv else 'def'} {name}")
                if not check(what, q, kk, vv, lens, tb, window, inv):
                    failed.append(what)
                fn = lambda: ff.decode(q, kk, vv, lens, block_table=tb,  # noqa: E731
                                       window=window, batch_invariant=inv)
                g = graph_replay(fn)
                ms = triton.testing.do_bench(g, warmup=50, rep=300)
                print(f"{batch:3d} x {n:6d} q_len {q_len:2d} window {str(window):12s} "
                      f"{'inv' if inv else 'def'} {name:8s} {ms * 1e3:8.1f} us "
                      f"{gb / ms * 1e3:6.0f} GB/s", flush=True)
        del q, k, v, kp, vp
        torch.cuda.empty_cache()
    print(f"correctness failures: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
