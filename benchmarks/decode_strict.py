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
"""
import torch, triton
import flashfold as ff
from flashfold.bench import graph_replay

HQ, HKV, D = 32, 8, 128
ROWS = [(8, 8192, 1, None), (8, 65536, 1, None), (64, 8192, 1, None), (8, 8192, 1, (1000, None)),
        (8, 8192, 4, None), (64, 4096, 4, None), (1, 32768, 4, None), (8, 8192, 4, (1000, None)),
        (8, 8192, 16, None)]
torch.manual_seed(0)
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
            fn = lambda: ff.decode(q, kk, vv, lens, block_table=tb, window=window,  # noqa: E731
                                   batch_invariant=inv)
            g = graph_replay(fn)
            ms = triton.testing.do_bench(g, warmup=50, rep=300)
            print(f"{batch:3d} x {n:6d} q_len {q_len:2d} window {str(window):12s} "
                  f"{'inv' if inv else 'def'} {name:8s} {ms * 1e3:8.1f} us {gb / ms * 1e3:6.0f} GB/s",
                  flush=True)
    del q, k, v, kp, vp
    torch.cuda.empty_cache()
