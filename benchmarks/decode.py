"""Split-KV decoding on the GPU: correctness first, then K/V bandwidth against SDPA.

Run (H200, from the repository root)::

    PYTHONPATH=src python benchmarks/decode.py            # checks + full grid (~3-4 min)
    PYTHONPATH=src python benchmarks/decode.py --quick    # checks + target rows (~1 min)
    PYTHONPATH=src python benchmarks/decode.py --check-only
    PYTHONPATH=src python benchmarks/decode.py --tune     # splits / tile configs at the targets
    PYTHONPATH=src python benchmarks/decode.py --tune-invariant  # batch_invariant's cost, by row
    PYTHONPATH=src python benchmarks/decode.py --fp8      # E4M3 caches against bf16 (~1 min)
    PYTHONPATH=src python benchmarks/decode.py --fp8-tune # E4M3: split-kernel configurations

1. Correctness at real sizes (bf16, 32 query / 8 KV heads, head_dim 128): lengths 0, 1,
   ragged and full, q_len 1 and 4 (speculative), softcap, window, left padding (a first
   key per sequence, ``cache_start``), contiguous and paged (pages of 16 and 64,
   shuffled), default and batch-invariant mode. FlashAttention's
   criterion: the max error of flashfold's output against a float32 reference must be at
   most twice the max error of a naive bf16 PyTorch decode (matmuls in bf16, softmax in
   fp32 rounded to bf16) against the same reference, plus 1e-5; LSE within 1e-3 of the
   reference's, empty rows exactly (0, -inf), no NaN. Then batch invariance: one sequence
   decoded alone and inside batches of 8 and 64 other sequences (other lengths, positions,
   capacities, page tables) must give bitwise equal output with ``batch_invariant=True``;
   the default mode is reported (equal or not, with the split counts it chose). Paged and
   contiguous caches are compared on the same tokens.
2. Speed: ``triton.testing.do_bench`` medians (L2 flushed between calls) of flashfold
   (default and batch-invariant, contiguous and paged), SDPA's flash and cuDNN backends
   (``enable_gqa=True`` when the backend takes it, else K/V expanded to the query heads:
   the line says which), and a paged baseline built from SDPA (gather the pages into a
   contiguous K/V, then SDPA flash; the gather is timed). Every method is timed eagerly and
   as a CUDA-graph replay (``--no-graphs``: eager only; ``--quick``: graphs on the target
   rows only), the same for flashfold and the peers: graphs remove the host's launch
   overhead (Python, argument binding) from all of them, which dominates the small rows.
   The target rows are also timed after a *read* flush of L2 (``[clean]``: do_bench's
   flush writes 256 MB, and the dirty lines it leaves are written back during the timed
   call, ~12 us for every method, ~15% of an 8K x batch 8 call). Metric: bytes of K and V
   read, ``2 * batch * heads_kv * length * head_dim * 2``,
   divided by the time (the same bytes for every method, whatever it actually moves),
   next to a device-to-device copy measured in the same run (read + write bytes). Each row
   also times ``flashfold lpad``: the same cache left-padded (sequence ``b`` starts at
   ``b * length / (4 * batch)``, up to 25% padding, ``cache_start``), in GB/s of the keys
   it attends to (its own bytes), next to the row's unpadded flashfold figure.

``--fp8``: decoding over E4M3 caches (``torch.float8_e4m3fn``, per-(sequence, kv head)
descales: each head's largest magnitude / 448). Checks first, on a bf16 cache with a few
large key channels: the FP8 decode's max error against the float64 decode of the
*unquantized* cache must be at most twice a naive FP8 decode's (the cache dequantized to
bf16, then as :func:`naive_bf16`), plus 1e-5; no NaN; batch-invariant mode bitwise equal
to the same sequence alone. Then flashfold FP8 against flashfold bf16 on the same tokens
(graph replays after a read flush, contiguous and pages of 64): the time ratio (tokens per
second), and the FP8 call's bytes read (K and V at one byte per element) over the device
copy's rate. No peer in this environment decodes over an FP8 cache (SDPA takes none).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import triton

import flashfold as ff
from flashfold.kernels import launcher
from flashfold.bench import graph_replay
from flashfold.kernels.decode import splitkv
from flashfold.kernels.decode.reference import decode_reference, gather_kv_padded

DEV = "cuda"
HQ, HKV, D = 32, 8, 128
DT = torch.bfloat16


# --- inputs ---------------------------------------------------------------------------------

class Cache:
    """q, a contiguous K/V cache and paged copies (shuffled pages) holding the same tokens."""

    def __init__(self, batch, capacity, lens=None, q_len=1, pages=(), seed=0, starts=None):
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.q = torch.randn(batch, HQ, q_len, D, generator=g, device=DEV, dtype=DT)
        self.k = torch.randn(batch, HKV, capacity, D, generator=g, device=DEV, dtype=DT)
        self.v = torch.randn(batch, HKV, capacity, D, generator=g, device=DEV, dtype=DT)
        lens = [capacity] * batch if lens is None else lens
        self.lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
        #: first key of each sequence (cache_start) or None
        self.starts = None if starts is None else torch.tensor(starts, dtype=torch.int32,
                                                                device=DEV)
        self.capacity = capacity
        self.paged = {p: self._pages(p, seed) for p in pages}

    def _pages(self, page, seed):
        batch, _, cap, _ = self.k.shape
        per = -(-cap // page)
        n = batch * per
        perm = torch.randperm(n + 1, generator=torch.Generator().manual_seed(seed + page))[:n]
        table = perm.view(batch, per).to(torch.int32).to(DEV)
        out = []
        for x in (self.k, self.v):
            pool = torch.empty(n + 1, page, HKV, D, device=DEV, dtype=DT)
            xp = F.pad(x, (0, 0, 0, per * page - cap)) if per * page != cap else x
            pool[perm.to(DEV)] = xp.view(batch, HKV, per, page, D).permute(0, 2, 3, 1, 4).reshape(n, page, HKV, D)
            out.append(pool)
        return out[0], out[1], table

    def kv_bytes(self, starts=None):
        """Bytes of K and V attended to (the keys ``[start, length)`` with ``starts``)."""
        n = self.lens if starts is None else self.lens - torch.minimum(starts.clamp(min=0),
                                                                       self.lens)
        return 2 * int(n.sum()) * HKV * D * self.k.element_size()

    def decode(self, page=None, **kw):
        if self.starts is not None:
            kw.setdefault("cache_start", self.starts)
        if page is None:
            return ff.decode(self.q, self.k, self.v, self.lens, **kw)
        kp, vp, table = self.paged[page]
        return ff.decode(self.q, kp, vp, self.lens, block_table=table, **kw)


def naive_bf16(c: Cache, *, scale=None, softcap=None, window=None):
    """Decode as a PyTorch user writes it: bf16 matmuls, softmax in fp32 rounded to bf16."""
    B, _, q_len, _ = c.q.shape
    g = HQ // HKV
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    o = torch.zeros_like(c.q)
    starts = [0] * B if c.starts is None else c.starts.tolist()
    for b, n in enumerate(c.lens.tolist()):
        a = min(max(starts[b], 0), n)
        if n == a:
            continue
        kk = c.k[b, :, a:n].repeat_interleave(g, 0)
        vv = c.v[b, :, a:n].repeat_interleave(g, 0)
        s = torch.matmul(c.q[b] * scale, kk.transpose(-1, -2))
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        pos = torch.arange(q_len, device=DEV)[:, None] + n - q_len
        j = torch.arange(a, n, device=DEV)[None, :]
        keep = j <= pos
        if window is not None and window[0] is not None:
            keep = keep & (j >= pos - window[0])
        s32 = s.float().masked_fill(~keep, -math.inf)
        row = torch.logsumexp(s32, -1, keepdim=True)
        p = torch.where(torch.isfinite(row), torch.exp(s32 - torch.where(torch.isfinite(row), row, 0.0)), 0.0)
        o[b] = torch.matmul(p.to(DT), vv)
    return o


# --- correctness ----------------------------------------------------------------------------

class Checker:
    def __init__(self):
        self.failures = []

    def ok(self, cond, what):
        print(f"  [{'ok' if cond else 'FAIL'}] {what}")
        if not cond:
            self.failures.append(what)


def check_case(chk: Checker, name, c: Cache, **mods):
    win = mods.get("window")
    ro, rl = decode_reference(c.q, c.k, c.v, c.lens, scale=mods.get("scale"),
                              softcap=mods.get("softcap"),
                              window=None if win is None else tuple(win), cache_start=c.starts,
                              compute_dtype=torch.float32)
    base = (naive_bf16(c, **mods).float() - ro).abs().max().item()
    bound = 2 * base + 1e-5
    empty = ~torch.isfinite(rl)
    for page in [None, *c.paged]:
        for inv in (False, True):
            o, lse = c.decode(page, batch_invariant=inv, return_lse=True, **mods)
            err = (o.float() - ro).abs().max().item()
            lerr = (lse - rl)[~empty].abs().max().item() if (~empty).any() else 0.0
            sane = (not torch.isnan(o).any().item() and not torch.isnan(lse).any().item()
                    and bool((lse[empty] == -math.inf).all()) and bool((o[empty] == 0).all()))
            layout = "contiguous" if page is None else f"paged{page}"
            chk.ok(err <= bound and lerr <= 1e-3 and sane,
                   f"{name:28s} {layout:10s} {'invariant' if inv else 'default  '} "
                   f"err {err:.2e} <= 2 x naive bf16 {base:.2e}; lse err {lerr:.1e}; "
                   f"empty rows (0, -inf), no NaN: {sane}")


def check_invariance(chk: Checker, pages=(16,), target_len=7000, cap=8192):
    """One sequence alone and inside batches of 8, 64 and 256: bitwise equal in invariant
    mode (batch 256: one program per sequence, folding its splits in registers)."""
    g = torch.Generator().manual_seed(1)
    comps = [(1, 0, cap), (8, 3, cap), (64, 40, 3 * cap // 2), (256, 100, cap)]
    tq = torch.randn(1, HQ, 1, D, device=DEV, dtype=DT)
    tk = torch.randn(1, HKV, target_len, D, device=DEV, dtype=DT)
    tv = torch.randn(1, HKV, target_len, D, device=DEV, dtype=DT)
    results = {}
    for batch, pos, capacity in comps:
        lens = torch.randint(0, capacity + 1, (batch,), generator=g).tolist()
        lens[pos] = target_len
        c = Cache(batch, capacity, lens, pages=pages, seed=batch)
        c.q[pos] = tq[0]
        c.k[pos, :, :target_len], c.v[pos, :, :target_len] = tk[0], tv[0]
        c.paged = {p: c._pages(p, batch) for p in pages}
        for page in [None, *pages]:
            for inv in (True, False):
                o, lse = c.decode(page, batch_invariant=inv, return_lse=True)
                p = splitkv.plan(c.q.shape, HKV, capacity if page is None else
                                 c.paged[page][2].shape[1] * page, capacity, None,
                                 c.q.device, splitkv.default_config(D, DT, page),
                                 batch_invariant=inv)
                results.setdefault((page, inv), []).append((o[pos].clone(), lse[pos].clone(),
                                                            batch, p.n_splits))
        del c
        torch.cuda.empty_cache()
    for (page, inv), rs in results.items():
        same = all(torch.equal(r[0], rs[0][0]) and torch.equal(r[1], rs[0][1]) for r in rs[1:])
        layout = "contiguous" if page is None else f"paged{page}"
        splits = ", ".join(f"batch {r[2]}: {r[3]} splits" for r in rs)
        if inv:
            chk.ok(same, f"batch_invariant=True  {layout:10s} bitwise equal across batches 1/8/64/256 ({splits})")
        else:
            maxdiff = max((r[0].float() - rs[0][0].float()).abs().max().item() for r in rs[1:])
            print(f"  [info] default mode        {layout:10s} bitwise equal across batches: {same} "
                  f"(max diff {maxdiff:.1e}; {splits})")
    return results


def run_checks(chk: Checker, quick=False):
    print("== correctness (bf16, 32/8 heads, head_dim 128; criterion: err <= 2 x naive bf16 err)")
    pages = (16, 64)
    cases = [
        ("full 8K, batch 8", Cache(8, 8192, pages=pages), {}),
        ("ragged incl. 0 and 1", Cache(6, 8192, [0, 1, 777, 8192, 5000, 64], pages=pages, seed=1), {}),
        ("q_len 4 (speculative)", Cache(4, 4096, [4, 100, 3000, 4096], q_len=4, pages=pages, seed=2), {}),
        ("softcap 30, q_len 2", Cache(3, 4096, [1, 2048, 4096], q_len=2, pages=(16,), seed=3),
         {"softcap": 30.0}),
        ("window (1000, 0)", Cache(3, 8192, [500, 4000, 8192], q_len=2, pages=(16,), seed=4),
         {"window": (1000, 0)}),
        ("left-padded (cache_start)", Cache(6, 8192, [0, 1, 8192, 8192, 6000, 4097], q_len=2,
                                            starts=[5, 0, 2049, 8192, 5999, 1000],
                                            pages=pages, seed=6), {}),
        ("left-padded + window (700, 0)", Cache(3, 8192, [8192, 5000, 3000], q_len=3,
                                                starts=[7800, 100, 2999], pages=(16,), seed=7),
         {"window": (700, 0)}),
    ]
    if not quick:
        cases.append(("64K, batch 2", Cache(2, 65536, [65536, 40000], pages=(64,), seed=5), {}))
    for name, c, mods in cases:
        check_case(chk, name, c, **mods)
        del c
        torch.cuda.empty_cache()
    print("== batch invariance (a 7000-token sequence alone, in batch 8, in batch 64)")
    check_invariance(chk)


# --- timing ---------------------------------------------------------------------------------

_FLUSH = {}


def _clean_bench(call, reps=60):
    """Median ms of ``call`` after evicting L2 with a *read* of 256 MB (clean lines), where
    do_bench's flush *writes* 256 MB: the ~50 MB of dirty lines it leaves in L2 are written
    back during the timed call (~12 us at the DRAM limit), a tax on every method that
    weighs on short calls (8K x batch 8: ~15%)."""
    buf = _FLUSH.get("buf")
    if buf is None:
        buf = _FLUSH["buf"] = torch.ones(2**26, device=DEV, dtype=torch.float32)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for _ in range(3):
        call()
    for i in range(reps):
        buf.sum()
        starts[i].record()
        call()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in zip(starts, ends))
    return times[len(times) // 2]


def timed(fn, graph=False, rep=100, clean=False):
    """Median ms of ``fn``: do_bench (L2 flushed by a write between calls), or with
    ``clean`` the read-flushed loop of :func:`_clean_bench`; with ``graph`` the call is
    captured in a CUDA graph once and the replay is timed."""
    fn()
    torch.cuda.synchronize()
    call = graph_replay(fn) if graph else fn
    if clean:
        return _clean_bench(call)
    return triton.testing.do_bench(call, warmup=25, rep=rep, return_mode="median")


_GQA_MODE = {}


def sdpa(backend, q, k, v):
    """SDPA on one backend; GQA natively (``enable_gqa``) when the backend takes it, else
    with K/V expanded to the query heads (materialized once, outside the timing)."""
    from torch.nn.attention import sdpa_kernel

    def native():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    mode = _GQA_MODE.get(backend)
    if mode is None:
        try:
            native()
            torch.cuda.synchronize()
            mode = "enable_gqa"
        except Exception:                                        # noqa: BLE001
            mode = "expanded"
        _GQA_MODE[backend] = mode
    if mode == "enable_gqa":
        return native
    g = q.shape[1] // k.shape[1]
    if 2 * g * k.numel() * k.element_size() > 40e9:
        raise MemoryError("K/V expanded to the query heads would exceed 40 GB")
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)

    def expanded():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, ke, ve)
    return expanded


def copy_gbps(n=2**28):
    a = torch.empty(n, device=DEV, dtype=torch.float32)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), return_mode="median")
    return 2 * a.numel() * 4 / ms / 1e6


def time_row(batch, length, pages, graphs, copy, with_peers=True, clean=False):
    from torch.nn.attention import SDPBackend

    c = Cache(batch, length, pages=pages)
    nbytes = c.kv_bytes()
    res = {}

    # left padding: sequence b starts at b * length / (4 * batch) (up to 25% padding)
    starts = torch.tensor([b * length // (4 * batch) for b in range(batch)], dtype=torch.int32,
                          device=DEV)

    def add(name, fn, graph, cleaned=False, nbytes=nbytes):
        key = name + (" [clean]" if cleaned else " [graph]" if graph else "")
        try:
            ms = timed(fn, graph, clean=cleaned)
            res[key] = nbytes / ms / 1e6                         # GB/s
        except Exception as e:                                    # noqa: BLE001
            res[key] = None
            print(f"    {key}: failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")

    modes = [False, True] if graphs else [False]
    for graph in modes:
        add("flashfold", lambda: c.decode(), graph)
        add("flashfold inv", lambda: c.decode(batch_invariant=True), graph)
        add("flashfold lpad", lambda: c.decode(cache_start=starts), graph,
            nbytes=c.kv_bytes(starts))
        for p in pages:
            add(f"flashfold p{p}", lambda p=p: c.decode(p), graph)
            add(f"flashfold inv p{p}", lambda p=p: c.decode(p, batch_invariant=True), graph)
        if with_peers:
            add("sdpa flash", sdpa(SDPBackend.FLASH_ATTENTION, c.q, c.k, c.v), graph)
            add("sdpa cudnn", sdpa(SDPBackend.CUDNN_ATTENTION, c.q, c.k, c.v), graph)
            if pages:
                p = pages[0]
                kp, vp, table = c.paged[p]
                flash = SDPBackend.FLASH_ATTENTION

                def paged_sdpa(p=p, kp=kp, vp=vp, table=table):
                    k, v = gather_kv_padded(kp, vp, table, length)
                    return sdpa(flash, c.q, k, v)()
                add(f"sdpa paged p{p}", paged_sdpa, graph)
    if clean:                 # graph replays after a read flush (clean L2), for every method
        add("flashfold", lambda: c.decode(), True, True)
        add("flashfold inv", lambda: c.decode(batch_invariant=True), True, True)
        for p in pages:
            add(f"flashfold p{p}", lambda p=p: c.decode(p), True, True)
            add(f"flashfold inv p{p}", lambda p=p: c.decode(p, batch_invariant=True), True, True)
        if with_peers:
            add("sdpa flash", sdpa(SDPBackend.FLASH_ATTENTION, c.q, c.k, c.v), True, True)
            add("sdpa cudnn", sdpa(SDPBackend.CUDNN_ATTENTION, c.q, c.k, c.v), True, True)
    plan = splitkv.plan(c.q.shape, HKV, length, length, None, c.q.device,
                        splitkv.default_config(D, DT, None))
    del c
    torch.cuda.empty_cache()
    return res, plan.n_splits


def fmt(x, w=6):
    return f"{x:{w}.0f}" if x is not None else " " * (w - 3) + "n/a"


def ratio(a, b):
    return f"{a / b:5.2f}" if a and b else "  n/a"


TARGETS = [(8, 8192), (8, 65536)]
GRID = [(1, 512), (1, 8192), (1, 131072), (8, 512), (8, 32768), (8, 131072),
        (64, 512), (64, 8192), (64, 32768), (256, 512), (256, 4096), (256, 16384)]
QUICK_GRID = [(1, 8192), (64, 8192)]


def run_timing(quick, graphs, targets=None, grid=None, copy_elems=2**28):
    copy = copy_gbps(copy_elems)
    print(f"== device copy: {copy:.0f} GB/s (read + write bytes)")
    targets = TARGETS if targets is None else targets
    grid = targets + ((QUICK_GRID if quick else GRID) if grid is None else grid)
    rows = []
    print("== timing: GB/s of K and V read (bf16, 32/8 heads, head_dim 128, q_len 1)")
    for batch, length in grid:
        is_target = (batch, length) in targets
        pages = (16, 64) if (is_target or not quick) else (16,)
        t = time.time()
        res, splits = time_row(batch, length, pages, graphs and (is_target or not quick), copy,
                               clean=is_target)
        rows.append((batch, length, splits, res))
        print(f"  batch {batch:3d} len {length:6d} ({splits:2d} splits, {time.time() - t:4.1f}s): "
              + ", ".join(f"{k} {fmt(v, 0)}" for k, v in res.items()))
    print()
    print(f"GQA in SDPA: " + ", ".join(f"{b.name}: {m}" for b, m in _GQA_MODE.items()))
    print("final table (GB/s; % = of the device copy; inv cost = 1 - inv/default; ratios = flashfold default / peer)")
    hdr = (f"{'batch':>5} {'len':>6} {'spl':>3} | {'ff':>6} {'%':>4} {'inv':>6} {'cost':>5} | "
           f"{'ff p16':>6} {'ff p64':>6} {'inv16':>6} | {'flash':>6} {'cuDNN':>6} {'paged':>6} | "
           f"{'/flash':>6} {'/cuDNN':>6} {'p16/pg':>6}")
    print(hdr)
    print("-" * len(hdr))
    worst, verdicts = {}, []
    for batch, length, splits, r in rows:
        for suffix in ("", " [graph]", " [clean]"):
            ffd = r.get("flashfold" + suffix)
            if ffd is None and suffix:
                continue
            inv = r.get("flashfold inv" + suffix)
            cost = 1 - inv / ffd if (inv and ffd) else None
            mode = suffix.strip(" []") or "eager"
            costs = [("contiguous", cost)] if cost is not None else []
            for p in (16, 64):
                a, b = r.get(f"flashfold p{p}" + suffix), r.get(f"flashfold inv p{p}" + suffix)
                if a and b:
                    costs.append((f"paged {p}", 1 - b / a))
            for layout, c in costs:        # the worst row per mode and layout, with its name
                kind = "contiguous" if layout == "contiguous" else "paged"
                if c > worst.setdefault(mode, {}).get(kind, (-1.0, ""))[0]:
                    worst[mode][kind] = (c, f"{batch} x {length} {layout}")
            fl, cu, pg = (r.get("sdpa flash" + suffix), r.get("sdpa cudnn" + suffix),
                          r.get("sdpa paged p16" + suffix))
            print(f"{batch:5d} {length:6d} {splits:3d} | {fmt(ffd)} {fmt(100 * ffd / copy if ffd else None, 4)} "
                  f"{fmt(inv)} {(f'{100 * cost:4.1f}%' if cost is not None else '  n/a')} | "
                  f"{fmt(r.get('flashfold p16' + suffix))} {fmt(r.get('flashfold p64' + suffix))} "
                  f"{fmt(r.get('flashfold inv p16' + suffix))} | {fmt(fl)} {fmt(cu)} {fmt(pg)} | "
                  f"{ratio(ffd, fl):>6} {ratio(ffd, cu):>6} {ratio(r.get('flashfold p16' + suffix), pg):>6}"
                  f"{'  ' + suffix.strip(' []') if suffix else ''}")
            if (batch, length) in targets:
                verdicts.append((batch, length, ffd, cu, suffix.strip(" []") or "eager"))
    print()
    for batch, length, ffd, cu, mode in verdicts:
        if length == 8192:
            print(f"  target ({mode}): batch 8 len 8K >= 3.8 TB/s: "
                  f"{'PASS' if ffd and ffd >= 3800 else 'FAIL'} ({fmt(ffd, 0)} GB/s)")
        print(f"  target ({mode}): batch {batch} len {length} >= SDPA cuDNN: "
              f"{'PASS' if ffd and cu and ffd >= cu else 'FAIL'} (ratio {ratio(ffd, cu).strip()})")
    for mode, by_kind in worst.items():
        w = max(c for c, _ in by_kind.values())
        rows = "; ".join(f"{kind} {100 * c:.1f}% at {where}" for kind, (c, where) in by_kind.items())
        print(f"  batch_invariant cost over the grid ({mode}; worst row, contiguous and paged): "
              f"{100 * w:.1f}% ({'PASS' if w <= 0.10 else 'FAIL'} at <= 10%; {rows})")


def run_tune():
    """At the target rows, per layout: split counts, TMA vs pointers, PDL, the invariant
    split size and a few tile configs (GB/s of K and V; eager unless marked)."""
    print("== tune: GB/s at the target rows (default config unless stated)")
    configs = {None: [(64, 4, 3), (64, 4, 4), (64, 8, 3), (32, 4, 4), (128, 4, 2), (128, 8, 3)],
               # paged: the page-number read takes a pipeline stage of its own
               "paged": [(64, 4, 5), (64, 4, 6), (64, 8, 5), (32, 4, 6), (32, 4, 7), (128, 4, 4)]}
    for batch, length in TARGETS:
        c = Cache(batch, length, pages=(16, 64))
        nbytes = c.kv_bytes()
        gbps = lambda ms: f"{nbytes / ms / 1e6:5.0f}"               # noqa: E731
        for page in (None, 16, 64):
            k, v, t = (c.k, c.v, None) if page is None else c.paged[page]
            run = lambda **kw: splitkv.splitkv_decode(c.q, k, v, c.lens, t,   # noqa: E731
                                                      scale=D ** -0.5, **kw)
            name = f"batch {batch} len {length} {'contiguous' if page is None else f'paged{page}'}"
            line = [f"{n}:{gbps(timed(lambda: run(num_splits=n)))}".replace(" ", "")
                    for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)]
            print(f"  {name}: splits -> " + " ".join(line))
            if page in (None, 64):
                print(f"    TMA {gbps(timed(lambda: run(tma=True)))}, "
                      f"cp.async pointers {gbps(timed(lambda: run(tma=False)))}")
            print(f"    merge with PDL {gbps(timed(lambda: run(pdl=True)))} / graph "
                  f"{gbps(timed(lambda: run(pdl=True), True))}; without "
                  f"{gbps(timed(lambda: run(pdl=False)))} / graph "
                  f"{gbps(timed(lambda: run(pdl=False), True))}")
            print("    batch_invariant split " + ", ".join(
                f"{sp}: {gbps(timed(lambda: run(batch_invariant=True, invariant_split=sp)))}"
                for sp in (256, 512, 1024, 2048)))
            for bn, w, st in configs[None if page is None else "paged"]:
                cfg = splitkv.DecodeConfig(block_n=bn, num_warps=w, num_stages=st)
                try:
                    print(f"    BLOCK_N {bn:3d} warps {w} stages {st}: default "
                          f"{gbps(timed(lambda: run(config=cfg)))}, invariant "
                          f"{gbps(timed(lambda: run(config=cfg, batch_invariant=True)))}")
                except Exception as e:                            # noqa: BLE001
                    print(f"    BLOCK_N {bn:3d} warps {w} stages {st}: failed {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:100]}")
        del c
        torch.cuda.empty_cache()


#: rows where batch_invariant cost the most before its cost came down (17% at 256 x 4K,
#: ~10% at 1 x 131K and 256 x 16K; docs/notes/decode.md, "batch_invariant"), and a row
#: where it cost nothing, for contrast
INVARIANT_ROWS = [(256, 4096), (1, 131072), (256, 16384), (64, 8192)]


def run_tune_invariant():
    """Where the invariant mode's time goes, from CUDA-graph replays (GB/s of K and V):
    default vs invariant at several fixed split sizes, with and without PDL, and the
    default mode forced to the invariant grid's split count."""
    print("== tune-invariant: graph GB/s, default vs batch_invariant (contiguous cache)")
    for batch, length in INVARIANT_ROWS:
        c = Cache(batch, length)
        nbytes = c.kv_bytes()
        run = lambda **kw: splitkv.splitkv_decode(c.q, c.k, c.v, c.lens, None,   # noqa: E731
                                                  scale=D ** -0.5, **kw)
        gbps = lambda **kw: f"{nbytes / timed(lambda: run(**kw), True) / 1e6:5.0f}"  # noqa: E731
        inv = splitkv.prepare(c.q, c.k, c.v, c.lens, None, scale=D ** -0.5,
                              batch_invariant=True).plan
        dflt = splitkv.prepare(c.q, c.k, c.v, c.lens, None, scale=D ** -0.5).plan
        print(f"  batch {batch} len {length}: default {gbps()} (splits {dflt.n_splits}), "
              f"invariant {gbps(batch_invariant=True)} (programs/seq {inv.n_splits}, "
              f"splits {inv.ws_splits} of {inv.split_size})")
        print("    invariant split " + ", ".join(
            f"{sp}: {gbps(batch_invariant=True, invariant_split=sp)}"
            for sp in (512, 1024, 2048, 4096, 8192)))
        print(f"    invariant without PDL {gbps(batch_invariant=True, pdl=False)}; default "
              f"with {inv.n_splits} splits {gbps(num_splits=inv.n_splits)}, with "
              f"{max(2, inv.ws_splits)} splits {gbps(num_splits=max(2, inv.ws_splits))}")
        parts = []
        for label, kw in (("invariant", dict(batch_invariant=True)),
                          ("invariant 2048", dict(batch_invariant=True, invariant_split=2048)),
                          (f"default {max(2, inv.ws_splits)} splits",
                           dict(num_splits=max(2, inv.ws_splits)))):
            lp = splitkv.prepare(c.q, c.k, c.v, c.lens, None, scale=D ** -0.5, **kw)
            us = [1e3 * timed(lambda: launcher.launch(splitkv._splitkv_kernel, *lp.split), True)]
            if lp.merge is not None:
                us.append(1e3 * timed(lambda: launcher.launch(splitkv._merge_kernel, *lp.merge),
                                      True))
            parts.append(f"{label}: split {us[0]:.1f} us" + (f" + merge {us[1]:.1f} us"
                                                              if len(us) > 1 else ""))
        print("    kernels alone (graph): " + "; ".join(parts))
        del c
        torch.cuda.empty_cache()


#: split-kernel tiles tried by --tune-splits: (BLOCK_N, warps, stages)
TUNE_CONFIGS = [(64, 4, 3), (64, 4, 4), (64, 4, 5), (64, 8, 3), (128, 4, 2), (128, 4, 3),
                (128, 8, 2), (128, 8, 3), (32, 4, 4), (32, 2, 4)]


def run_tune_splits():
    """The default mode's split count, then the split kernel's tiles (at the default split
    count), at the target rows (contiguous cache): GB/s from CUDA graphs and with a clean
    L2, against cuDNN measured the same way."""
    print("== tune-splits: GB/s at the target rows, graph / clean L2")
    for batch, length in TARGETS:
        c = Cache(batch, length)
        nbytes = c.kv_bytes()
        chosen = splitkv.prepare(c.q, c.k, c.v, c.lens, None, scale=D ** -0.5).plan.n_splits

        def gbps(**kw):
            fn = lambda: splitkv.splitkv_decode(c.q, c.k, c.v, c.lens, None,  # noqa: E731
                                                scale=D ** -0.5, **kw)
            return (f"{nbytes / timed(fn, True) / 1e6:.0f}/"
                    f"{nbytes / timed(fn, True, clean=True) / 1e6:.0f}")
        row = [f"{n}:{gbps(num_splits=n)}" for n in (2, 3, 4, 5, 6, 8, 12, 16)]
        tiles = []
        for bn, w, st in TUNE_CONFIGS:
            cfg = splitkv.DecodeConfig(block_n=bn, num_warps=w, num_stages=st)
            try:
                tiles.append(f"{bn}/{w}w/{st}s:{gbps(config=cfg)}")
            except Exception as e:                                 # noqa: BLE001
                tiles.append(f"{bn}/{w}w/{st}s:failed ({type(e).__name__})")
        from torch.nn.attention import SDPBackend
        ref = sdpa(SDPBackend.CUDNN_ATTENTION, c.q, c.k, c.v)
        print(f"  batch {batch} len {length} (default {chosen} splits): " + " ".join(row)
              + f" | cuDNN {nbytes / timed(ref, True) / 1e6:.0f}/"
                f"{nbytes / timed(ref, True, clean=True) / 1e6:.0f}")
        print("    tiles (BLOCK_N/warps/stages): " + " ".join(tiles))
        del c
        torch.cuda.empty_cache()


FP8_ROWS = [(8, 8192), (8, 32768), (8, 131072), (1, 131072), (64, 8192), (64, 32768)]


def _fp8_cache(c: Cache):
    """E4M3 copies of ``c``'s K and V (contiguous and its paged copies) and the descales."""
    from flashfold.api.decode import quantize_fp8_cache
    kd = c.k.float().abs().amax(dim=(2, 3)) / 448
    vd = c.v.float().abs().amax(dim=(2, 3)) / 448
    k8, v8 = quantize_fp8_cache(c.k, kd), quantize_fp8_cache(c.v, vd)
    paged = {}
    for p, (kp, vp, table) in c.paged.items():
        # page rows of sequence b hold its tokens: quantize each page with its owner's scales
        owner = torch.full((kp.shape[0],), -1, dtype=torch.long, device=DEV)
        owner[table.long().flatten()] = torch.arange(table.shape[0], device=DEV).repeat_interleave(
            table.shape[1])
        owner = owner.clamp(min=0)

        def pages8(x, d):        # (pages, page, heads, D) with its owners' descales
            return quantize_fp8_cache(x.transpose(1, 2), d[owner]).transpose(1, 2).contiguous()
        paged[p] = (pages8(kp, kd), pages8(vp, vd), table)
    return k8, v8, kd, vd, paged


def run_fp8(chk: Checker, quick=False):
    print("== FP8 (E4M3) caches: correctness (criterion: err vs float64 of the unquantized "
          "cache <= 2 x a naive FP8 decode's)")
    for name, c in (("full 8K, batch 8", Cache(8, 8192, pages=(64,), seed=11)),
                    ("ragged incl. 0 and 1", Cache(6, 8192, [0, 1, 777, 8192, 5000, 64],
                                                   pages=(64,), seed=12))):
        c.k[..., :4] *= 8                                  # a few large channels
        c.paged = {p: c._pages(p, 11) for p in c.paged}
        k8, v8, kd, vd, paged = _fp8_cache(c)
        exact, _ = decode_reference(c.q, c.k, c.v, c.lens, compute_dtype=torch.float64)
        deq = Cache.__new__(Cache)
        deq.__dict__.update(c.__dict__)
        deq.k = (k8.float() * kd[:, :, None, None]).to(DT)
        deq.v = (v8.float() * vd[:, :, None, None]).to(DT)
        naive = (naive_bf16(deq).double() - exact).abs().max().item()
        for page in (None, 64):
            for inv in (False, True):
                if page is None:
                    o = ff.decode(c.q, k8, v8, c.lens, batch_invariant=inv, k_descale=kd,
                                  v_descale=vd)
                else:
                    kp, vp, table = paged[page]
                    o = ff.decode(c.q, kp, vp, c.lens, block_table=table, batch_invariant=inv,
                                  k_descale=kd, v_descale=vd)
                err = (o.double() - exact).abs().max().item()
                layout = "contiguous" if page is None else f"paged{page}"
                chk.ok(err <= 2 * naive + 1e-5 and not torch.isnan(o).any().item(),
                       f"fp8 {name:22s} {layout:10s} {'invariant' if inv else 'default  '} "
                       f"err {err:.2e} <= 2 x naive FP8 {naive:.2e}")
        alone = ff.decode(c.q[2:3], k8[2:3], v8[2:3], c.lens[2:3], batch_invariant=True,
                          k_descale=kd[2:3], v_descale=vd[2:3])
        inside = ff.decode(c.q, k8, v8, c.lens, batch_invariant=True, k_descale=kd,
                           v_descale=vd)[2:3]
        chk.ok(torch.equal(alone, inside), f"fp8 {name:22s} batch_invariant: sequence 2 alone "
               f"== inside the batch, bitwise")
        del c, k8, v8, paged
        torch.cuda.empty_cache()
    copy = copy_gbps()
    print(f"== device copy: {copy:.0f} GB/s (read + write bytes)")
    print("== FP8 against bf16, flashfold, graph replays after a read flush (32/8 heads, "
          "head_dim 128, q_len 1)")
    hdr = (f"{'batch':>5} {'len':>6} | {'bf16 us':>8} {'fp8 us':>8} {'speedup':>7} "
           f"{'fp8 GB/s':>8} {'% copy':>6} | {'bf16 p64':>8} {'fp8 p64':>8} {'speedup':>7}")
    rows = []
    for batch, length in (FP8_ROWS[:2] if quick else FP8_ROWS):
        c = Cache(batch, length, pages=(64,), seed=13)
        k8, v8, kd, vd, paged = _fp8_cache(c)
        kp, vp, table = c.paged[64]
        k8p, v8p, _ = paged[64]
        t = {
            "bf16": timed(lambda: ff.decode(c.q, c.k, c.v, c.lens), True, clean=True),
            "fp8": timed(lambda: ff.decode(c.q, k8, v8, c.lens, k_descale=kd, v_descale=vd),
                         True, clean=True),
            "bf16 p64": timed(lambda: ff.decode(c.q, kp, vp, c.lens, block_table=table),
                              True, clean=True),
            "fp8 p64": timed(lambda: ff.decode(c.q, k8p, v8p, c.lens, block_table=table,
                                               k_descale=kd, v_descale=vd), True, clean=True),
        }
        fp8_bytes = 2 * batch * HKV * length * D
        rows.append((batch, length, t, fp8_bytes / t["fp8"] / 1e6))
        del c, k8, v8, paged, kp, vp, k8p, v8p
        torch.cuda.empty_cache()
    print(hdr)
    print("-" * len(hdr))
    for batch, length, t, gbps in rows:
        print(f"{batch:5d} {length:6d} | {1e3 * t['bf16']:8.1f} {1e3 * t['fp8']:8.1f} "
              f"{t['bf16'] / t['fp8']:7.2f} {gbps:8.0f} {100 * gbps / copy:6.1f} | "
              f"{1e3 * t['bf16 p64']:8.1f} {1e3 * t['fp8 p64']:8.1f} "
              f"{t['bf16 p64'] / t['fp8 p64']:7.2f}")
    print()
    for batch, length, t, gbps in rows:
        sp = t["bf16"] / t["fp8"]
        print(f"  target: batch {batch} len {length}: fp8 >= 1.8x bf16 tokens/s: "
              f"{'PASS' if sp >= 1.8 else 'FAIL'} ({sp:.2f}x); K/V read >= 90% of copy: "
              f"{'PASS' if gbps >= 0.9 * copy else 'FAIL'} ({100 * gbps / copy:.1f}%)")


def run_fp8_tune():
    """The split kernel's tiles over E4M3 caches at the FP8 rows: keys per tile (64, 128),
    ring depth, warps, and the split count (the planner's, or fixed), against the bf16
    default, graph replays after a read flush; contiguous caches (TMA by the default
    rule), and pages of 64 at 8 x 32K."""
    from flashfold.api.decode import quantize_fp8_cache
    scale = 1 / math.sqrt(D)
    configs = [(64, 3, 4), (64, 4, 4), (128, 2, 4), (128, 3, 4), (128, 3, 8), (128, 4, 8)]
    for batch, length in [(8, 8192), (8, 32768), (1, 131072), (64, 8192)]:
        c = Cache(batch, length, pages=(64,) if (batch, length) == (8, 32768) else ())
        kd = c.k.float().abs().amax(dim=(2, 3)) / 448
        vd = c.v.float().abs().amax(dim=(2, 3)) / 448
        k8, v8 = quantize_fp8_cache(c.k, kd), quantize_fp8_cache(c.v, vd)
        _, _, _, _, paged = _fp8_cache(c)
        base = timed(lambda: splitkv.splitkv_decode(c.q, c.k, c.v, c.lens, scale=scale), True,
                     clean=True)
        dflt = timed(lambda: splitkv.splitkv_decode(c.q, k8, v8, c.lens, scale=scale,
                                                    k_descale=kd, v_descale=vd), True,
                     clean=True)
        nbytes = 2 * batch * HKV * length * D
        print(f"== {batch} x {length}: bf16 default {base * 1e3:.1f} us; fp8 default "
              f"{dflt * 1e3:.1f} us speedup {base / dflt:.2f} ({nbytes / dflt / 1e6:.0f} GB/s)",
              flush=True)
        layouts = [("contiguous", k8, v8, None)]
        if paged:
            kp, vp, table = paged[64]
            layouts.append(("paged64", kp, vp, table))
            pb = timed(lambda: splitkv.splitkv_decode(
                c.q, c.paged[64][0], c.paged[64][1], c.lens, c.paged[64][2], scale=scale),
                True, clean=True)
            print(f"   bf16 paged64 default {pb * 1e3:.1f} us", flush=True)
        for layout, kc, vc, table in layouts:
            for bn, stages, warps in configs:
                cfg = splitkv.DecodeConfig(block_n=bn, num_warps=warps, num_stages=stages)
                for splits in (None, 2, 4, 6, 8, 12, 16, 32, 48):
                    if splits and batch * HKV * splits > 4 * 132:
                        continue
                    try:
                        t = timed(lambda: splitkv.splitkv_decode(
                            c.q, kc, vc, c.lens, table, scale=scale, config=cfg,
                            num_splits=splits, k_descale=kd, v_descale=vd), True, clean=True)
                    except Exception as e:                              # noqa: BLE001
                        print(f"   {layout} block_n={bn} stages={stages} warps={warps} "
                              f"splits={splits}: failed ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:80]})", flush=True)
                        break
                    ref = base if table is None else pb
                    print(f"   {layout} block_n={bn} stages={stages} warps={warps} "
                          f"splits={splits or 'plan'}: {t * 1e3:.1f} us speedup "
                          f"{ref / t:.2f} ({nbytes / t / 1e6:.0f} GB/s)", flush=True)
        del c, k8, v8, paged, layouts
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--tune-splits", action="store_true",
                    help="split counts and split-kernel tiles at the target rows, against cuDNN")
    ap.add_argument("--tune-invariant", action="store_true",
                    help="where batch_invariant's cost goes, on the rows where it is largest")
    ap.add_argument("--no-graphs", action="store_true", help="time eagerly only (no CUDA graphs)")
    ap.add_argument("--fp8", action="store_true",
                    help="E4M3 caches: checks, then FP8 against bf16 (the docstring)")
    ap.add_argument("--fp8-tune", action="store_true",
                    help="E4M3 caches: split-kernel tiles and split counts, against bf16")
    args = ap.parse_args()
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(),
          f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs")
    t0 = time.time()
    if args.tune:
        run_tune()
        return 0
    if args.tune_invariant:
        run_tune_invariant()
        return 0
    if args.tune_splits:
        run_tune_splits()
        return 0
    if args.fp8_tune:
        run_fp8_tune()
        return 0
    chk = Checker()
    if args.fp8:
        try:
            run_fp8(chk, args.quick)
        except Exception:                                          # noqa: BLE001
            traceback.print_exc()
            chk.failures.append("exception during the FP8 run")
        print(f"== checks: {'all passed' if not chk.failures else f'{len(chk.failures)} FAILED'}")
        for f in chk.failures:
            print("   FAILED:", f)
        print(f"total {time.time() - t0:.0f}s")
        return 1 if chk.failures else 0
    try:
        run_checks(chk, args.quick)
    except Exception:                                              # noqa: BLE001
        traceback.print_exc()
        chk.failures.append("exception during checks")
    print(f"== checks: {'all passed' if not chk.failures else f'{len(chk.failures)} FAILED'} "
          f"({time.time() - t0:.0f}s)")
    if chk.failures:
        for f in chk.failures:
            print("   FAILED:", f)
    if not args.check_only:
        run_timing(args.quick, not args.no_graphs)
    print(f"total {time.time() - t0:.0f}s")
    return 1 if chk.failures else 0


if __name__ == "__main__":
    sys.exit(main())
