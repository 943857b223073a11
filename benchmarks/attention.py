"""Exact attention forward on the GPU: correctness first, then speed against every peer.

Run (H200, from the repository root)::

    PYTHONPATH=src python benchmarks/attention.py            # check grid + full timing (~5 min)
    PYTHONPATH=src python benchmarks/attention.py --quick    # small check + 1 timing subset (~1 min)
    PYTHONPATH=src python benchmarks/attention.py --check-only
    PYTHONPATH=src python benchmarks/attention.py --tune     # time candidate tile configs
    PYTHONPATH=src python benchmarks/attention.py --bwd      # backward: checks + timings (~5 min)
    PYTHONPATH=src python benchmarks/attention.py --bwd --quick
    PYTHONPATH=src python benchmarks/attention.py --tune-bwd [--tune-n 1024]  # backward configs
    PYTHONPATH=src python benchmarks/attention.py --bwd-kernels  # GPU time per kernel (~1 min)
    PYTHONPATH=src python benchmarks/attention.py --gluon-bwd-variants  # undecided variants

1. Correctness (FlashAttention's own criterion): on a grid of batch, heads, GQA/MQA ratios,
   head dims, awkward lengths, causal, windows, softcap, varlen, score/mask mods and edge
   cases, the max error of flashfold's output against a reference must be at most twice the
   max error of a naive bf16/fp16 PyTorch attention (matmuls in the input dtype, softmax in
   fp32) against the same reference, plus fp32 rounding. The reference is float64, stricter
   than FlashAttention's float32 one (which is itself off by ~1e-2 at scores ~1e5); where
   the naive attention overflows (fp16 products > 65504) the bound is the dtype's rounding.
   Outputs are poisoned (allocated NaN-filled) so any element the kernel skips fails, and
   LSE, -inf rows (no visible key) and NaN-freedom are checked too. TMA and the pointer
   fallback both run; merge_states is checked on split keys.
2. Speed: ``triton.testing.do_bench`` medians, bf16, 16 heads, batch x seq = 16K tokens,
   head_dim 64 and 128, seq 1K/4K/16K, causal and not, plus a sliding window (causal, 1024
   keys back) and a causal document mask; flashfold against SDPA's flash, cuDNN and efficient
   backends and ``torch.compile``d FlexAttention (with the equivalent block mask), each
   peer measured in the same run. FLOPs = 4 * B * H * D * (visible query-key pairs): for
   dense rows N^2 (N^2 / 2 when causal, the usual convention), for window/document rows the
   exact count of visible pairs. Prints TFLOP/s, the fraction of a bf16 matmul measured in
   the same run, and flashfold's ratio to each peer; a peer that fails prints its error.
3. ``--bwd`` (backward, issue 5): the same grid for dQ, dK, dV (each gradient within twice
   the naive low-precision gradient's error against autograd of the float64 attention,
   NaN-poisoned gradients) plus dlse and deterministic-mode cases; ``deterministic=True``
   twice -> bitwise equal gradients; ``torch.compile(fullgraph=True)`` (inductor) of a
   module calling flashfold.attention against eager; then backward alone and forward +
   backward TFLOP/s against SDPA flash and cuDNN (bf16, H=16, 16K tokens, d64/d128 and d256,
   N 1K/4K/16K, causal and not), with a final table of ratios.
4. ``--bwd-kernels``: the GPU time of each kernel of one eager backward (torch.profiler,
   10 calls), flashfold against cuDNN, on the same grid: kernel times do not move with
   the host or with ``do_bench``'s L2 flush and its clock, so they compare the two
   backwards' kernels more steadily than whole-call medians (which moved up to 9% between
   runs on the H200). Gradients first: flashfold's within 5e-2 (relative to the max) of
   cuDNN's.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback

import torch
import torch.nn.functional as F

import flashfold
from flashfold import mods
from flashfold.bench import graph_replay, kernel_times
from flashfold.kernels.attention import bwd, fwd
from flashfold.kernels.attention.bwd import BwdConfig
from flashfold.kernels.attention.fwd import FwdConfig
from flashfold.kernels.attention.mods import trace_mask_mod, trace_score_mod
from flashfold.kernels.attention.reference import naive_attention

DEV = "cuda"


# --- references ------------------------------------------------------------------------------

def _torch_mods(kw):
    """Public keyword arguments -> the naive references' (torch-lowered mods, window)."""
    out = dict(kw)
    if out.get("score_mod") is not None:
        out["score_mod"] = trace_score_mod(out["score_mod"]).torch_fn(DEV)
    mm = out.get("mask_mod")
    if mm is not None:
        out["mask_mod"] = (getattr(mm, "mod", None) or trace_mask_mod(mm)).torch_fn(DEV)
    if out.get("window") is not None:
        out["window"] = tuple(None if w is None or w < 0 else w for w in out["window"])
    return out


def naive_lowp(q, k, v, *, causal=False, window=None, scale=None, softcap=None, score_mod=None,
               mask_mod=None, cu_seqlens_q=None, cu_seqlens_k=None):
    """Naive attention as a PyTorch user writes it: matmuls in the input dtype, softmax in
    fp32 then rounded to the input dtype (FlashAttention's ``attention_ref(upcast=False)``)."""
    dt = q.dtype
    B, HQ, NQ, D = q.shape
    g = HQ // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    left = right = None
    if window is not None:
        left, right = window
    if causal:
        right = 0 if right is None else min(right, 0)
    o = torch.zeros(B, HQ, NQ, v.shape[-1], dtype=dt, device=q.device)
    lse = torch.full((B, HQ, NQ), -math.inf, device=q.device)
    segs = [(None, slice(0, NQ), slice(0, k.shape[2]))]
    if cu_seqlens_q is not None:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        segs = [(i, slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])) for i in range(len(cq) - 1)]
    for seq, qs, ks in segs:
        qq, kk = q[:, :, qs], k[:, :, ks].repeat_interleave(g, 1)
        vv = v[:, :, ks].repeat_interleave(g, 1)
        nq, nk = qq.shape[2], kk.shape[2]
        s = torch.matmul(qq * scale, kk.transpose(-1, -2))                    # input dtype
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(nk, device=q.device)[None, :]
        bb = (torch.arange(B, device=q.device) if seq is None else torch.tensor([seq], device=q.device))
        bb, hh = bb[:, None, None, None], torch.arange(HQ, device=q.device)[None, :, None, None]
        if score_mod is not None:
            s = torch.as_tensor(score_mod(s, bb, hh, i, j)).to(dt).expand_as(s)
        keep = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
        if right is not None:
            keep = keep & (j <= i + (nk - nq) + right)
        if left is not None:
            keep = keep & (j >= i + (nk - nq) - left)
        keep = keep.expand_as(s)
        if mask_mod is not None:
            keep = keep & torch.as_tensor(mask_mod(bb, hh, i, j)).bool()
        s32 = s.float().masked_fill(~keep, -math.inf)
        row = torch.logsumexp(s32, -1)
        empty = torch.isneginf(row)                     # no visible key; an overflow stays NaN
        p = torch.where(empty[..., None], 0.0,
                        torch.exp(s32 - torch.where(empty, 0.0, row)[..., None])).to(dt)
        o[:, :, qs] = torch.matmul(p, vv)
        lse[:, :, qs] = row
    return o, lse


# --- correctness --------------------------------------------------------------------------------

def _nan_alloc(*shape, dtype=None, device=None, **kw):
    return torch.full(*shape, float("nan"), dtype=dtype, device=device)


class Checker:
    def __init__(self):
        self.rows = []
        self.failed = 0

    def case(self, name, B, HQ, HK, NQ, NK, D, dtype=torch.bfloat16, *, tma=True, seed=0,
             q_scale=1.0, make=None, **kw):
        g = torch.Generator(device=DEV).manual_seed(seed)
        try:
            if make is not None:
                q, k, v, extra = make(g)
                kw.update(extra)
            else:
                q = (torch.randn(B, HQ, NQ, D, device=DEV, generator=g) * q_scale).to(dtype)
                k = (torch.randn(B, HK, NK, D, device=DEV, generator=g) * q_scale).to(dtype)
                v = torch.randn(B, HK, NK, D, device=DEV, generator=g).to(dtype)
            saved_alloc, fwd._alloc = fwd._alloc, _nan_alloc
            try:
                with flashfold.attention_policy(tma=tma):
                    o, lse = flashfold.attention(q, k, v, return_lse=True, **kw)
                _sync()
            finally:
                fwd._alloc = saved_alloc
            rk = _torch_mods(kw)
            ro, rl = naive_attention(q, k, v, dtype=torch.float64, **rk)
            po, pl = naive_lowp(q, k, v, **rk)
            err = (o.double() - ro).abs().max().item() if o.numel() else 0.0
            perr = (po.double() - ro).abs().max().item() if o.numel() else 0.0
            atol = 2 * (ro + 0.3 - 0.3 - ro).abs().max().item() if o.numel() else 0.0
            fin = torch.isfinite(rl)
            lerr = (lse[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
            plerr = (pl[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
            why = []
            if torch.isnan(o).any() or torch.isnan(lse).any():
                why.append("NaN in output (unwritten or computed)")
            # the naive attention may itself overflow (fp16 products > 65504): then hold
            # flashfold to the output dtype's rounding instead of 2x an infinite error
            eps = torch.finfo(q.dtype).eps
            mag = max(1.0, ro.abs().max().item()) if o.numel() else 1.0
            bound = 2 * perr + atol if math.isfinite(perr) else 2 * eps * mag
            if not err <= bound:
                why.append(f"o err {err:.2e} > bound {bound:.2e} (naive {perr:.2e})")
            lbound = 2 * plerr + 1e-3 if math.isfinite(plerr) else 1e-3 * max(1.0, rl[fin].abs().max().item())
            if not lerr <= lbound:
                why.append(f"lse err {lerr:.2e} > bound {lbound:.2e} (naive {plerr:.2e})")
            if not torch.equal(torch.isneginf(lse), torch.isneginf(rl)):
                why.append("-inf LSE rows differ from the reference")
            if (~fin).any() and (o.float()[~fin] != 0).any():
                why.append("rows with no visible key are not 0")
            ok = not why
            self.rows.append((name, ok, err, perr, lerr))
            if not ok:
                self.failed += 1
            print(f"  {'ok ' if ok else 'BAD'} {name:<58} err {err:.2e}  naive {perr:.2e}  "
                  f"lse {lerr:.1e}{'  <- ' + '; '.join(why) if why else ''}", flush=True)
        except Exception as e:  # a crash is a failure with its message, not the end of the run
            self.failed += 1
            self.rows.append((name, False, math.nan, math.nan, math.nan))
            print(f"  BAD {name:<58} raised {type(e).__name__}: {str(e)[:300]}", flush=True)
            traceback.print_exc(limit=3, file=sys.stdout)


def _docs(n, seed=0, lo=None, hi=None):
    g = torch.Generator().manual_seed(seed)
    lo, hi = lo or max(1, n // 32), hi or max(2, n // 4)
    out, d = [], 0
    while len(out) < n:
        out += [d] * int(torch.randint(lo, hi + 1, (1,), generator=g))
        d += 1
    return torch.tensor(out[:n], device=DEV)


def _extreme_scores(B, H, N, D, dtype):
    """q, k of entries +-c with c^2 D = 1e4: scores q.k ~ +-1e4 before scaling."""
    c = math.sqrt(1e4 / D)

    def make(g):
        sign = lambda: torch.randint(0, 2, (B, H, N, D), device=DEV, generator=g) * 2 - 1  # noqa: E731
        return ((c * sign()).to(dtype), (c * sign()).to(dtype),
                torch.randn(B, H, N, D, device=DEV, generator=g).to(dtype), {})
    return make


def _varlen(lens_q, lens_k, HQ, HK, D, dtype):
    def make(g):
        q = torch.randn(1, HQ, sum(lens_q), D, device=DEV, generator=g).to(dtype)
        k = torch.randn(1, HK, sum(lens_k), D, device=DEV, generator=g).to(dtype)
        v = torch.randn(1, HK, sum(lens_k), D, device=DEV, generator=g).to(dtype)
        cq = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
        ck = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
        return q, k, v, {"cu_seqlens_q": cq, "cu_seqlens_k": ck}
    return make


def correctness(quick: bool) -> bool:
    print("== correctness: max|o - ref| <= 2 max|naive - ref| (+ fp32 rounding), ref in float64, "
          "poisoned outputs")
    c = Checker()
    grid_cases(c, quick)
    # merge_states on split keys (including an empty and a fully masked part)
    bf = torch.bfloat16
    try:
        g = torch.Generator(device=DEV).manual_seed(1)
        q, k, v = (torch.randn(2, 8, 1000, 128, device=DEV, generator=g).to(bf) for _ in range(3))
        cuts = [0, 0, 333, 500, 1000]
        parts = [flashfold.attention(q, k[:, :, a:b], v[:, :, a:b], return_lse=True) if b > a else
                 (torch.zeros_like(q), torch.full(q.shape[:-1], -math.inf, device=DEV))
                 for a, b in zip(cuts, cuts[1:])]
        parts.append(flashfold.attention(q, k[:, :, :100], v[:, :, :100], return_lse=True,
                                         mask_mod=lambda b, h, i, j: j < 0))
        o, lse = flashfold.merge_states(torch.stack([p[0] for p in parts][::-1]),
                                        torch.stack([p[1] for p in parts][::-1]))
        o2, l2 = flashfold.merge_states(*parts[1], *parts[2])
        ro, rl = naive_attention(q, k, v, dtype=torch.float64)
        po, _ = naive_lowp(q, k, v)
        err, perr = (o.double() - ro).abs().max().item(), (po.double() - ro).abs().max().item()
        ok = err <= 2 * perr + 1e-6 and torch.isfinite(o).all() and torch.isfinite(o2).all()
        c.failed += 0 if ok else 1
        print(f"  {'ok ' if ok else 'BAD'} {'merge_states of 5 parts (empty, masked) vs unsplit':<58} "
              f"err {err:.2e}  naive {perr:.2e}", flush=True)
    except Exception as e:
        c.failed += 1
        print(f"  BAD merge_states raised {type(e).__name__}: {e}")
    print(f"== correctness: {len(c.rows) + 1 - c.failed}/{len(c.rows) + 1} cases passed")
    return c.failed == 0


def grid_cases(c, quick: bool):
    """The correctness grid (shared by the forward's Checker and the backward's GradChecker)."""
    bf = torch.bfloat16
    lengths = [(1, 1), (17, 17), (113, 203), (1000, 1000), (2049, 2049), (1, 2049), (2049, 1000)]
    dims = (32, 64, 96, 128, 192, 256)
    if quick:
        lengths, dims = [(17, 17), (113, 203), (1000, 1000)], (64, 128)
    for D in dims:
        for nq, nk in lengths:
            for causal in (False, True):
                c.case(f"d{D} q{nq} k{nk} {'causal' if causal else 'full'} B2 H4:2", 2, 4, 2, nq, nk, D,
                       causal=causal)
    for D in (64, 128):
        c.case(f"fp16 d{D} q1000 k1000 causal", 2, 4, 4, 1000, 1000, D, torch.float16, causal=True)
        c.case(f"fp16 d{D} q113 k2049", 1, 8, 1, 113, 2049, D, torch.float16)
    c.case("MQA d128 H16:1 q777 causal", 1, 16, 1, 777, 777, 128, causal=True)
    # head dims off the kernel widths (padded inside the tile; 3 and 5: the pointer path) and
    # v narrower than q/k (DeepSeek-style 192 / 128)
    for D, DV in ((80, 80), (40, 40), (8, 8), (3, 5), (192, 128)):
        c.case(f"d{D}/v{DV} q1000 k1000 causal", 2, 4, 2, 1000, 1000, D, causal=True,
               make=lambda g, D=D, DV=DV: tuple(
                   torch.randn(2, h, 1000, d, device=DEV, generator=g).to(bf)
                   for h, d in ((4, D), (2, D), (2, DV))) + ({},))
    c.case("(B,S,H,D) storage d128", 2, 8, 8, 513, 513, 128,
           make=lambda g: tuple(torch.randn(2, 513, 8, 128, device=DEV, generator=g).to(bf).transpose(1, 2)
                                for _ in range(3)) + ({},))
    c.case("pointer path d128 causal", 2, 4, 2, 1000, 1000, 128, tma=False, causal=True)
    c.case("pointer path d64 window", 2, 4, 2, 1000, 1000, 64, tma=False, window=(100, 20))
    c.case("window (37, 5) d128", 2, 4, 2, 1000, 1000, 128, window=(37, 5))
    c.case("causal window 256 d64", 2, 4, 2, 2049, 2049, 64, causal=True, window=(256, None))
    c.case("softcap 30 d128 causal", 2, 4, 2, 1000, 1000, 128, causal=True, softcap=30.0, q_scale=3.0)
    c.case("alibi score_mod d128 causal", 2, 8, 2, 1000, 1000, 128, causal=True,
           score_mod=mods.alibi(8))
    docs = _docs(1000)
    c.case("document mask d128 causal", 2, 4, 2, 1000, 1000, 128, causal=True,
           mask_mod=mods.document_mask(docs))
    c.case("document BlockMask + causal d64 (FULL tiles masked)", 2, 4, 2, 1000, 1000, 64, causal=True,
           mask_mod=flashfold.create_block_mask(mods.document_mask(docs), None, None, 1000, 1000))
    c.case("prefix-LM d128", 2, 4, 2, 1000, 1000, 128, mask_mod=mods.prefix_lm_mask(300))
    c.case("key padding d64", 2, 4, 4, 1000, 1000, 64,
           mask_mod=mods.key_padding_mask(torch.tensor([1000, 17], device=DEV)))
    lq = [1, 17, 113, 1000, 2049]
    lk = [1000, 17, 203, 1, 2049]
    for causal in (False, True):
        c.case(f"varlen {lq}x{lk} d128 {'causal' if causal else 'full'}", 1, 8, 2, 0, 0, 128,
               make=_varlen(lq, lk, 8, 2, 128, bf), causal=causal)
    c.case("varlen + document mask + alibi d64", 1, 4, 4, 0, 0, 64, make=_varlen(lq, lq, 4, 4, 64, bf),
           mask_mod=mods.document_mask(_docs(2049, lo=40, hi=300)), score_mod=mods.alibi(4))
    # edge cases
    c.case("all-equal scores d128", 2, 4, 2, 500, 700, 128, q_scale=0.0)
    c.case("scores ~ +-1e4 before scaling d128 fp16", 1, 4, 4, 300, 300, 128, torch.float16,
           make=_extreme_scores(1, 4, 300, 128, torch.float16))
    c.case("fp16 products overflow fp16 (q=k=300)", 1, 2, 2, 257, 257, 64, torch.float16,
           make=lambda g: (torch.full((1, 2, 257, 64), 300.0, device=DEV).half(),
                           torch.full((1, 2, 257, 64), 300.0, device=DEV).half(),
                           torch.randn(1, 2, 257, 64, device=DEV, generator=g).half(), {}))
    c.case("rows with no visible key (causal q > k)", 2, 4, 2, 1000, 100, 128, causal=True)
    c.case("mask hides everything", 1, 2, 2, 300, 300, 64, mask_mod=lambda b, h, i, j: j < 0)


# --- speed ------------------------------------------------------------------------------------

def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def _bench(fn):
    import triton
    fn()
    _sync()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _sdpa(backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v, causal):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def _matmul_ceiling():
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    ms = _bench(lambda: a @ b)
    return 2 * 8192 ** 3 / ms / 1e9


def speed(quick: bool, grid=None, tokens=16384, H=16, use_flex=True, dtype=torch.bfloat16):
    """Time every row of ``grid`` ((D, N, kind) with kind full/causal/window1024/document)."""
    print(f"== speed: {str(dtype)[6:]}, H={H}, B*N = {tokens} tokens, do_bench median")
    try:
        ceiling = _matmul_ceiling()
        print(f"   bf16 matmul 8192^3 in this run: {ceiling:.0f} TFLOP/s (the ceiling column)")
    except Exception as e:
        ceiling = math.nan
        print(f"   matmul ceiling failed: {e}")
    flex = flex_mask = None
    try:
        if not use_flex:
            raise RuntimeError("disabled")
        import torch._dynamo
        torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
        if hasattr(torch._dynamo.config, "recompile_limit"):
            torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)
        from torch.nn.attention.flex_attention import create_block_mask as flex_mask
        from torch.nn.attention.flex_attention import flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
    except Exception as e:
        flex = flex_mask = None
        print(f"   FlexAttention unavailable: {type(e).__name__}: {e}")
    peers = {"flash": _sdpa("FLASH_ATTENTION"), "cudnn": _sdpa("CUDNN_ATTENTION"),
             "efficient": _sdpa("EFFICIENT_ATTENTION")}
    rows = []
    if grid is None:
        grid = _default_grid(quick)
    errors = {}
    for D, N, kind in grid:
        _time_row(D, N, kind, tokens, H, dtype, flex, flex_mask, peers, rows, errors, ceiling)
    for name, msg in errors.items():
        print(f"   peer {name} failed (first error): {msg}")
    _print_table(rows, ceiling)
    return rows


def _default_grid(quick):
    grid = []
    for D in (64, 128):
        for N in (1024, 4096, 16384):
            for kind in ("full", "causal"):
                grid.append((D, N, kind))
        for N in ((4096, 16384) if D == 128 else (16384,)):
            grid += [(D, N, "window1024"), (D, N, "document")]
    if quick:
        grid = [(128, 4096, "full"), (128, 4096, "causal"), (128, 16384, "document")]
    return grid


def _time_row(D, N, kind, tokens, H, dtype, flex, flex_mask, peers, rows, errors, ceiling):
    B = max(1, tokens // N)
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device=DEV, generator=g).to(dtype) for _ in range(3))
    causal = kind != "full"
    ff_kw, flex_fn, pairs = {}, None, None
    if kind in ("full", "causal"):
        pairs = N * N / (2 if causal else 1)
        ff_kw = {"causal": causal}
        if flex is not None:
            bm = flex_mask(lambda b, h, i, j: i >= j, None, None, N, N) if causal else None
            flex_fn = lambda: flex(q, k, v, block_mask=bm)  # noqa: E731
    elif kind == "window1024":
        W = 1024
        pairs = sum(min(i, W) + 1 for i in range(N))
        ff_kw = {"window": (W, 0)}
        if flex is not None:
            bm = flex_mask(lambda b, h, i, j: (i >= j) & (i - j <= W), None, None, N, N)
            flex_fn = lambda: flex(q, k, v, block_mask=bm)  # noqa: E731
    else:
        docs = _docs(N, seed=N)
        counts = torch.bincount(docs).double()
        pairs = float((counts * (counts + 1) / 2).sum())
        mm = mods.and_masks(mods.causal_mask, mods.document_mask(docs))
        ff_kw = {"mask_mod": flashfold.create_block_mask(mm, None, None, N, N)}
        if flex is not None:
            bm = flex_mask(lambda b, h, i, j: (i >= j) & (docs[i] == docs[j]), None, None, N, N)
            flex_fn = lambda: flex(q, k, v, block_mask=bm)  # noqa: E731
    flops = 4 * B * H * D * pairs
    res = {}
    try:
        out = flashfold.attention(q, k, v, **ff_kw)
        ms = _bench(lambda: flashfold.attention(q, k, v, **ff_kw))
        res["flashfold"] = flops / ms / 1e9
        res["ms"] = ms
    except Exception as e:
        out = None
        errors.setdefault("flashfold", f"{type(e).__name__}: {str(e)[:300]}")
        print(f"   flashfold failed on d{D} N{N} {kind}: {errors['flashfold']}")
    if kind in ("full", "causal"):
        for name, fn in peers.items():
            try:
                ref = fn(q, k, v, causal)
                if out is not None and name == "flash":
                    diff = (out.float() - ref.float()).abs().max().item()
                    if diff > 3e-2:
                        print(f"   WARNING d{D} N{N} {kind}: flashfold vs SDPA flash max diff {diff:.3g}")
                res[name] = flops / _bench(lambda fn=fn: fn(q, k, v, causal)) / 1e9
            except Exception as e:
                errors.setdefault(name, f"{type(e).__name__}: {str(e)[:200]}")
    if flex_fn is not None:
        try:
            ref = flex_fn()
            if out is not None:
                diff = (out.float() - ref.float()).abs().max().item()
                if diff > 3e-2:
                    print(f"   WARNING d{D} N{N} {kind}: flashfold vs FlexAttention max diff {diff:.3g}")
            res["flex"] = flops / _bench(flex_fn) / 1e9
        except Exception as e:
            errors.setdefault("flex", f"{type(e).__name__}: {str(e)[:200]}")
    rows.append((D, N, kind, res))
    _print_row(D, N, kind, res, ceiling)


COLS = ("flashfold", "cudnn", "flash", "efficient", "flex")


def _fmt(x):
    return f"{x:6.0f}" if x is not None and not math.isnan(x) else "     -"


def _print_row(D, N, kind, res, ceiling):
    ff = res.get("flashfold")
    parts = " ".join(f"{c}={_fmt(res.get(c)).strip()}" for c in COLS if c in res)
    if "ms" in res:
        parts = f"{res['ms']:.3f} ms  " + parts
    frac = f" ({ff / ceiling:.0%} of matmul)" if ff and ceiling == ceiling else ""
    print(f"   d{D} N{N:<5} {kind:<10} {parts}{frac}", flush=True)


def _print_table(rows, ceiling):
    print("\n| D | N | mask | flashfold | cuDNN | FA2 (flash) | efficient | Flex | ff/cuDNN | ff/FA2 | ff/Flex | ff/matmul |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for D, N, kind, r in rows:
        ff = r.get("flashfold")

        def ratio(c):
            return f"{ff / r[c]:.2f}" if ff and r.get(c) else "-"
        cells = [_fmt(r.get(c)).strip() for c in COLS]
        frac = f"{ff / ceiling:.0%}" if ff and ceiling == ceiling else "-"
        print(f"| {D} | {N} | {kind} | " + " | ".join(cells) + f" | {ratio('cudnn')} | {ratio('flash')} | "
              f"{ratio('flex')} | {frac} |")
    print("(TFLOP/s; FLOPs = 4 B H D x visible pairs; dense causal counts N^2/2)")


# --- tuning ---------------------------------------------------------------------------------------

CANDIDATES = {
    64: [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
    128: [(128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3)],
    256: [(128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3)],
}


def tune(N=4096, B=None, H=16, candidates=None, dtype=torch.bfloat16) -> bool:
    """Time every candidate tile config at sequence length ``N`` (batch 16K tokens / N),
    each after checking its output against SDPA's of the same mask (max |diff| <= 3e-2);
    False where any is WRONG."""
    B = B or max(1, 16384 // N)
    print(f"== tune: forward TFLOP/s per tile config ({str(dtype)[6:]}, H={H}, N={N}, B={B}); "
          "default marked *")
    ok = True
    for D, cands in (candidates or CANDIDATES).items():
        g = torch.Generator(device=DEV).manual_seed(0)
        q, k, v = (torch.randn(B, H, N, D, device=DEV, generator=g, dtype=dtype) for _ in range(3))
        scale = 1 / math.sqrt(D)
        for causal in (False, True):
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            flops = 4 * B * H * N * N * D / (2 if causal else 1)
            best = None
            for bm, bn, w, s in cands:
                for tma in (True, False):
                    cfg = FwdConfig(bm, bn, w, s, use_tma=tma)
                    try:
                        t0 = time.time()
                        run = lambda: fwd.attention_forward(  # noqa: E731
                            q, k, v, scale=scale, right=0 if causal else None, return_lse=False,
                            config=cfg)
                        o, _ = run()
                        # (not <=: a NaN difference is wrong too)
                        if not (o.float() - ref.float()).abs().max().item() <= 3e-2:
                            ok = False
                            print(f"   d{D} {'causal' if causal else 'full'} {cfg}: WRONG RESULT")
                            continue
                        tf = flops / _bench(run) / 1e9
                        mark = "*" if (bm, bn, w, s) == fwd.HOPPER_CONFIGS[(D, causal)] and tma else " "
                        print(f"  {mark} d{D} {'causal' if causal else 'full  '} {str(cfg):<28} "
                              f"{tf:6.0f} TFLOP/s (compile+run {time.time() - t0:.1f}s)", flush=True)
                        if best is None or tf > best[0]:
                            best = (tf, cfg)
                    except Exception as e:
                        print(f"    d{D} {cfg}: failed: {type(e).__name__}: {str(e)[:200]}")
            if best:
                print(f"  -> d{D} {'causal' if causal else 'full'} best: {best[1]} {best[0]:.0f} TFLOP/s")
    print(f"tile configs {'agree with SDPA' if ok else 'WRONG (see above)'}")
    return ok


# --- backward ----------------------------------------------------------------------------------

def _masked_lse(lse):
    return torch.where(torch.isfinite(lse), lse, 0.0)


def _grad_term_magnitudes(q, k, v, do, *, causal=False, window=None, scale=None, **unused):
    """max over elements of the summed magnitudes behind dQ, dK, dV (float64, plain
    attention with causal / window only): ``scale |dS| |K|``, ``scale |dS|^T |Q|``,
    ``P^T |dO|``. The rounding scale of a gradient whose terms cancel (``testing.compare``'s
    ``scale``); used only where the naive low-precision gradient overflows."""
    q64, k64, v64, do64 = (t.detach().double() for t in (q, k, v, do))
    g = q.shape[1] // k.shape[1]
    k64, v64 = k64.repeat_interleave(g, 1), v64.repeat_interleave(g, 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * q64 @ k64.transpose(-1, -2)
    nq, nk = s.shape[-2:]
    i = torch.arange(nq, device=q.device)[:, None]
    j = torch.arange(nk, device=q.device)[None, :]
    left, right = (window if window is not None else (None, None))
    if causal:
        right = 0 if right is None else min(right, 0)
    keep = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    if right is not None:
        keep &= j <= i + (nk - nq) + right
    if left is not None:
        keep &= j >= i + (nk - nq) - left
    s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.where(torch.isfinite(lse), torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)), 0.0)
    ds = p * (do64 @ v64.transpose(-1, -2) - (do64 * (p @ v64)).sum(-1, keepdim=True))
    mq = (scale * ds.abs() @ k64.abs()).max().item()
    mk = (scale * ds.abs().transpose(-1, -2) @ q64.abs()).max().item() * g
    mv = (p.transpose(-1, -2) @ do64.abs()).max().item() * g
    return mq, mk, mv


def _fp32_rounding(q, k, v, do, scale=None):
    """The "+ fp32 rounding" term of the gradient criterion, per gradient: 2 u32 times the
    natural magnitude of the gradient, not of the reference value (which can be exactly 0:
    a row with one visible key has P = 1 and dS = dP - D = 0, while a kernel forms dP on the
    tensor cores and D = rowsum(dO O) in another order, leaving fp32 rounding of |dP|):
    dQ: ``scale max|k| max||dO_i|| max||v_j||``, dK: the same with ``max|q|``, dV: ``max|dO|``."""
    u32 = 2.0 ** -24
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    dp = (do.detach().float().norm(dim=-1).max() * v.detach().float().norm(dim=-1).max()).item() if do.numel() and v.numel() else 0.0
    amax = lambda t: t.detach().float().abs().max().item() if t.numel() else 0.0  # noqa: E731
    return (2 * u32 * scale * amax(k) * dp, 2 * u32 * scale * amax(q) * dp, 2 * u32 * amax(do))


class GradChecker:
    """The forward's correctness grid for dQ, dK, dV (FlashAttention's criterion): for each
    gradient, max|g - ref| <= 2 max|naive - ref| + fp32 rounding, ``ref`` the gradient of
    the float64 naive attention (torch.autograd), ``naive`` that of ``naive_lowp`` (matmuls in
    the input dtype, softmax in fp32), both for the same ``dO`` (and ``dlse`` when
    ``with_lse``). Gradients are allocated NaN-filled (an element the kernels skip fails);
    rows with no visible key must get ``dq = 0``; no NaN."""

    def __init__(self, deterministic=False):
        self.rows = []
        self.failed = 0
        self.deterministic = deterministic

    def case(self, name, B, HQ, HK, NQ, NK, D, dtype=torch.bfloat16, *, tma=True, seed=0,
             q_scale=1.0, make=None, with_lse=False, **kw):
        g = torch.Generator(device=DEV).manual_seed(seed)
        name = name + (" [det]" if self.deterministic else "") + (" +dlse" if with_lse else "")
        try:
            if make is not None:
                q, k, v, extra = make(g)
                kw.update(extra)
            else:
                q = (torch.randn(B, HQ, NQ, D, device=DEV, generator=g) * q_scale).to(dtype)
                k = (torch.randn(B, HK, NK, D, device=DEV, generator=g) * q_scale).to(dtype)
                v = torch.randn(B, HK, NK, D, device=DEV, generator=g).to(dtype)
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            do = torch.randn(q.shape[:-1] + (v.shape[-1],), device=DEV, generator=g).to(q.dtype)
            dlse = torch.randn(q.shape[:-1], device=DEV, generator=g) if with_lse else None
            saved_alloc, bwd._alloc = bwd._alloc, _nan_alloc
            try:
                # (without TMA the backward takes its pointer configuration)
                with flashfold.attention_policy(tma=tma):
                    o, lse = flashfold.attention(q, k, v, return_lse=True,
                                                 deterministic=self.deterministic, **kw)
                    outs, gouts = [o], [do]
                    if with_lse:
                        outs.append(_masked_lse(lse))
                        gouts.append(dlse)
                    got = torch.autograd.grad(outs, (q, k, v), gouts)
                _sync()
            finally:
                bwd._alloc = saved_alloc
            rk = _torch_mods(kw)
            q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
            ro, rl = naive_attention(q64, k64, v64, dtype=torch.float64, **rk)
            want = torch.autograd.grad([ro, _masked_lse(rl)] if with_lse else [ro], (q64, k64, v64),
                                       [do.double(), dlse.double()] if with_lse else [do.double()])
            ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
            po, pl = naive_lowp(ql, kl, vl, **rk)
            naive = torch.autograd.grad([po, _masked_lse(pl)] if with_lse else [po], (ql, kl, vl),
                                        [do, dlse] if with_lse else [do], allow_unused=True)
            why, errs = [], []
            eps = torch.finfo(q.dtype).eps
            terms, spacing = None, 0.0
            if not all(p is None or bool(torch.isfinite(p).all()) for p in naive):
                # the naive gradient overflowed (fp16 products > 65504): hold flashfold to the
                # rounding of the summed terms instead of 2x an infinite error. The rounding is
                # the dtype's, plus the spacing of the fp32 LSE every backward that recomputes
                # P = exp(s - lse) starts from: |lse| 2^-23 relative in P (0.06 at scores ~5e5)
                plain = not any(kw.get(x) is not None for x in ("score_mod", "mask_mod", "softcap",
                                                                "cu_seqlens_q"))
                terms = _grad_term_magnitudes(q, k, v, do, **kw) if plain else None
                fin = torch.isfinite(rl)
                spacing = rl[fin].abs().max().item() * 2.0 ** -23 if fin.any() else 0.0
            fp32 = _fp32_rounding(q, k, v, do, kw.get("scale"))
            for n, a, r, p, t, f32 in zip("qkv", got, want, naive, terms or (None,) * 3, fp32):
                if a.numel() == 0:
                    errs.append((0.0, 0.0))
                    continue
                if torch.isnan(a).any():
                    why.append(f"NaN in d{n} (unwritten or computed)")
                err = (a.double() - r).abs().max().item()
                perr = (p.double() - r).abs().max().item() if p is not None else 0.0
                atol = 2 * (r + 0.3 - 0.3 - r).abs().max().item() + f32
                mag = max(1.0, r.abs().max().item(), t or 0.0)
                bound = 2 * perr + atol if math.isfinite(perr) else 2 * (eps + spacing) * mag
                if not err <= bound:
                    why.append(f"d{n} err {err:.2e} > bound {bound:.2e} (naive {perr:.2e})")
                errs.append((err, perr))
            empty = torch.isneginf(rl)
            if empty.any() and (got[0][empty] != 0).any():
                why.append("dq of rows with no visible key is not 0")
            ok = not why
            self.rows.append((name, ok, errs))
            if not ok:
                self.failed += 1
            e = " ".join(f"d{n} {a:.1e}/{b:.1e}" for n, (a, b) in zip("qkv", errs))
            print(f"  {'ok ' if ok else 'BAD'} {name:<58} {e}{'  <- ' + '; '.join(why) if why else ''}",
                  flush=True)
        except Exception as e:
            self.failed += 1
            self.rows.append((name, False, []))
            print(f"  BAD {name:<58} raised {type(e).__name__}: {str(e)[:300]}", flush=True)
            traceback.print_exc(limit=3, file=sys.stdout)


def correctness_bwd(quick: bool) -> bool:
    print("== backward correctness: per gradient max|g - ref| <= 2 max|naive - ref| (+ fp32 "
          "rounding), ref = autograd of float64 attention, poisoned gradients; printed: "
          "flashfold err / naive err")
    c = GradChecker()
    grid_cases(c, quick)
    bf = torch.bfloat16
    c.case("dlse: d128 q1000 causal GQA", 2, 8, 2, 1000, 1000, 128, causal=True, with_lse=True)
    c.case("dlse: softcap + alibi d64", 2, 4, 4, 777, 777, 64, softcap=20.0, with_lse=True,
           score_mod=mods.alibi(4))
    d = GradChecker(deterministic=True)
    for D in ((128,) if quick else (64, 128)):
        for causal in (False, True):
            d.case(f"d{D} q2049 k2049 {'causal' if causal else 'full'} B2 H4:2", 2, 4, 2, 2049, 2049, D,
                   causal=causal)
    d.case("window (100, 20) d128", 2, 4, 2, 1000, 1000, 128, window=(100, 20))
    d.case("document mask + alibi + softcap d128", 2, 8, 2, 1000, 1000, 128, causal=True,
           softcap=30.0, score_mod=mods.alibi(8), mask_mod=mods.document_mask(_docs(1000)))
    lq, lk = [1, 17, 113, 1000, 2049], [1000, 17, 203, 1, 2049]
    d.case("varlen d128 causal", 1, 8, 2, 0, 0, 128, make=_varlen(lq, lk, 8, 2, 128, bf), causal=True)
    d.case("pointer path d128 causal", 2, 4, 2, 1000, 1000, 128, tma=False, causal=True)
    n = len(c.rows) + len(d.rows)
    failed = c.failed + d.failed
    print(f"== backward correctness: {n - failed}/{n} cases passed")
    return failed == 0


def determinism_cases(N=4096):
    docs = _docs(N, seed=3)
    return [
        (f"d128 N{N} B2 H16:4 causal", dict(B=2, H=16, HK=4, N=N, D=128), dict(causal=True)),
        (f"d64 N{N} B2 H16:16 full", dict(B=2, H=16, HK=16, N=N, D=64), {}),
        (f"d128 N{N} softcap+alibi+document", dict(B=1, H=8, HK=2, N=N, D=128),
         dict(causal=True, softcap=30.0, score_mod=mods.alibi(8), mask_mod=mods.document_mask(docs))),
    ]


def determinism_check(cases=None, dtype=torch.bfloat16) -> bool:
    """deterministic=True: two runs give bitwise equal dQ, dK, dV. Also reports whether the
    default (atomic dQ) mode happened to be bitwise equal, and its distance to the
    deterministic gradients."""
    print("== determinism: deterministic=True twice -> bitwise equal gradients")
    bf = dtype
    cases = determinism_cases() if cases is None else cases
    ok_all = True
    for name, sh, kw in cases:
        try:
            g = torch.Generator(device=DEV).manual_seed(0)
            q = torch.randn(sh["B"], sh["H"], sh["N"], sh["D"], device=DEV, generator=g).to(bf).requires_grad_()
            k = torch.randn(sh["B"], sh["HK"], sh["N"], sh["D"], device=DEV, generator=g).to(bf).requires_grad_()
            v = torch.randn(sh["B"], sh["HK"], sh["N"], sh["D"], device=DEV, generator=g).to(bf).requires_grad_()
            do = torch.randn(q.shape, device=DEV, generator=g).to(bf)

            def run(det):
                out = flashfold.attention(q, k, v, deterministic=det, **kw)
                return torch.autograd.grad(out, (q, k, v), do)
            a, b = run(True), run(True)
            same = all(torch.equal(x, y) for x, y in zip(a, b))
            c1, c2 = run(False), run(False)
            same_default = all(torch.equal(x, y) for x, y in zip(c1, c2))
            diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(a, c1))
            ok_all &= same
            print(f"  {'ok ' if same else 'BAD'} {name:<40} deterministic bitwise equal: {same}; "
                  f"default mode bitwise equal: {same_default}; max |det - default| {diff:.2e}",
                  flush=True)
        except Exception as e:
            ok_all = False
            print(f"  BAD {name:<40} raised {type(e).__name__}: {str(e)[:300]}", flush=True)
    return ok_all


class _CompiledAttention(torch.nn.Module):
    """A module calling flashfold.attention with mods made once (as the docs ask)."""

    def __init__(self, heads, docs, dim):
        super().__init__()
        self.score_mod = mods.alibi(heads)
        self.mask_mod = mods.document_mask(docs)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, q, k, v):
        o = flashfold.attention(q, k, v, causal=True, score_mod=self.score_mod, mask_mod=self.mask_mod)
        return self.proj(o).float().pow(2).mean()


def compile_check(backend="inductor", N=1024, D=64, dtype=torch.bfloat16) -> bool:
    """torch.compile(fullgraph=True) of a module calling flashfold.attention: same loss and
    gradients as eager (same kernels; the surrounding ops may be fused differently)."""
    print(f"== torch.compile(fullgraph=True, backend={backend!r}) of a module calling flashfold.attention")
    try:
        import torch._dynamo
        torch._dynamo.reset()
        g = torch.Generator(device=DEV).manual_seed(0)
        model = _CompiledAttention(4, _docs(N, seed=5), D).to(DEV).to(dtype)
        q, k, v = (torch.randn(2, 4, N, D, device=DEV, generator=g).to(dtype).requires_grad_() for _ in range(3))
        want_loss = model(q, k, v)
        want = torch.autograd.grad(want_loss, (q, k, v))
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        loss = compiled(q, k, v)
        got = torch.autograd.grad(loss, (q, k, v))
        _sync()
        from flashfold.testing import compare
        reps = [compare(a, b, dtype, scale=max(1.0, b.abs().max().item())) for a, b in zip(got, want)]
        lrep = compare(loss, want_loss, "float32", scale=max(1.0, abs(want_loss.item())))
        ok = all(r["ok"] for r in reps) and lrep["ok"]
        print(f"  {'ok ' if ok else 'BAD'} loss {loss.item():.6f} vs eager {want_loss.item():.6f}; "
              f"grad max abs diff " + " ".join(f"d{n} {r['max_abs']:.1e}" for n, r in zip("qkv", reps)),
              flush=True)
        return ok
    except Exception as e:
        print(f"  BAD torch.compile raised {type(e).__name__}: {str(e)[:500]}", flush=True)
        traceback.print_exc(limit=5, file=sys.stdout)
        return False


def _sdpa_train(backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, backend_name)

    def fwd_(q, k, v, causal):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fwd_


BWD_COLS = ("flashfold", "ff-det", "cudnn", "flash")


def _graph_bench(step):
    """Median time of ``step`` replayed from a CUDA graph (no host overhead)."""
    return _bench(graph_replay(step))


def speed_bwd(quick: bool, grid=None, tokens=16384, H=16, dtype=torch.bfloat16):
    """Backward alone and forward + backward, flashfold (default and deterministic) against
    SDPA's flash and cuDNN backends, on the targets grid. FLOPs: backward 2.5x the forward's
    4 B H N^2 D (halved when causal), forward + backward 3.5x."""
    print(f"== backward speed: {str(dtype)[6:]}, H={H}, B*N = {tokens} tokens, do_bench median; "
          f"backward = autograd.grad of a retained graph, fwd+bwd = both")
    peers = {"cudnn": _sdpa_train("CUDNN_ATTENTION"), "flash": _sdpa_train("FLASH_ATTENTION")}
    if grid is None:
        grid = [(D, N, c) for D in (64, 128) for N in (1024, 4096, 16384) for c in (False, True)]
        # head_dim 256 (Gemma): the Gluon template's WIDE variant
        grid += [(256, N, c) for N in (4096, 16384) for c in (False, True)]
        if quick:
            grid = [(128, 4096, False), (128, 4096, True), (128, 16384, True)]
    rows, errors = [], {}
    for D, N, causal in grid:
        B = max(1, tokens // N)
        g = torch.Generator(device=DEV).manual_seed(0)
        q, k, v = (torch.randn(B, H, N, D, device=DEV, generator=g).to(dtype).requires_grad_() for _ in range(3))
        do = torch.randn(B, H, N, D, device=DEV, generator=g).to(dtype)
        fl = 4 * B * H * D * N * N / (2 if causal else 1)
        res = {"bwd": {}, "fb": {}}
        ff_grads = None
        for name, det in (("flashfold", False), ("ff-det", True)):
            try:
                f = lambda: flashfold.attention(q, k, v, causal=causal, deterministic=det)  # noqa: E731
                o = f()
                grads = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
                if ff_grads is None:
                    ff_grads = grads
                res["bwd"][name] = 2.5 * fl / _bench(
                    lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)) / 1e9
                res["fb"][name] = 3.5 * fl / _bench(lambda: torch.autograd.grad(f(), (q, k, v), do)) / 1e9
                del o
            except Exception as e:
                errors.setdefault(name, f"{type(e).__name__}: {str(e)[:300]}")
        for name, fn in peers.items():
            try:
                o = fn(q, k, v, causal)
                grads = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
                if ff_grads is not None and name == "flash":
                    diff = max((a.float() - b.float()).abs().max().item() / max(1e-6, b.float().abs().max().item())
                               for a, b in zip(ff_grads, grads))
                    if diff > 5e-2:
                        print(f"   WARNING d{D} N{N} causal={causal}: flashfold vs SDPA flash gradients "
                              f"differ by {diff:.3g} (relative to max)")
                res["bwd"][name] = 2.5 * fl / _bench(
                    lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)) / 1e9
                res["fb"][name] = 3.5 * fl / _bench(
                    lambda fn=fn: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), do)) / 1e9
                del o
            except Exception as e:
                errors.setdefault(name, f"{type(e).__name__}: {str(e)[:300]}")
        if DEV == "cuda":
            # fwd + bwd replayed from a CUDA graph: the kernels without eager host overhead
            res["graph"] = {}
            for name, f in (("flashfold", lambda: flashfold.attention(q, k, v, causal=causal)),
                            ("cudnn", lambda: peers["cudnn"](q, k, v, causal))):
                try:
                    res["graph"][name] = 3.5 * fl / _graph_bench(
                        lambda f=f: torch.autograd.grad(f(), (q, k, v), do)) / 1e9
                except Exception as e:
                    errors.setdefault(f"{name} (CUDA graph)", f"{type(e).__name__}: {str(e)[:300]}")
        rows.append((D, N, causal, res))
        b, fb = res["bwd"], res["fb"]
        gr = res.get("graph", {})
        print(f"   d{D} N{N:<5} {'causal' if causal else 'full':<6} bwd " +
              " ".join(f"{c}={b[c]:.0f}" for c in BWD_COLS if c in b) + "  fwd+bwd " +
              " ".join(f"{c}={fb[c]:.0f}" for c in BWD_COLS if c in fb) +
              ("  fwd+bwd CUDA graph " + " ".join(f"{c}={v:.0f}" for c, v in gr.items()) if gr else ""),
              flush=True)
        del q, k, v, do
    for name, msg in errors.items():
        print(f"   {name} failed (first error): {msg}")
    _print_bwd_table(rows)
    return rows


def _print_bwd_table(rows):
    def ratio(r, a, b):
        return f"{r[a] / r[b]:.2f}" if r.get(a) and r.get(b) else "-"
    print("\n| D | N | mask | ff bwd | ff det bwd | cuDNN bwd | FA2 bwd | ff/cuDNN | det/cuDNN | ff/FA2 "
          "| ff f+b | cuDNN f+b | FA2 f+b | f+b ff/cuDNN | graph ff f+b | graph cuDNN f+b | graph ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for D, N, causal, res in rows:
        b, fb, gr = res["bwd"], res["fb"], res.get("graph", {})
        cells = [_fmt(b.get(c)).strip() for c in BWD_COLS]
        print(f"| {D} | {N} | {'causal' if causal else 'full'} | " + " | ".join(cells) +
              f" | {ratio(b, 'flashfold', 'cudnn')} | {ratio(b, 'ff-det', 'cudnn')} | "
              f"{ratio(b, 'flashfold', 'flash')} | {_fmt(fb.get('flashfold')).strip()} | "
              f"{_fmt(fb.get('cudnn')).strip()} | {_fmt(fb.get('flash')).strip()} | "
              f"{ratio(fb, 'flashfold', 'cudnn')} | {_fmt(gr.get('flashfold')).strip()} | "
              f"{_fmt(gr.get('cudnn')).strip()} | {ratio(gr, 'flashfold', 'cudnn')} |")
    print("(TFLOP/s; backward FLOPs = 2.5 x 4 B H N^2 D, fwd+bwd = 3.5x; causal halves them; "
          "ff = default mode, ff det = deterministic=True; graph = fwd+bwd replayed from a CUDA "
          "graph, i.e. without eager host overhead)")


#: backward candidates per head dim: dK/dV (BM, BN, warps, stages), dQ (BM, BN, warps, stages)
BWD_CANDIDATES = {
    64: [(64, 128, 8, 2, 128, 64, 8, 2), (128, 128, 8, 2, 128, 64, 8, 2), (64, 128, 8, 3, 128, 64, 8, 3),
         (64, 64, 4, 2, 64, 64, 4, 2), (128, 64, 8, 2, 128, 128, 8, 2)],
    128: [(64, 128, 8, 2, 128, 64, 8, 2), (32, 128, 8, 2, 128, 64, 8, 2), (64, 64, 8, 2, 128, 64, 8, 2),
          (64, 128, 8, 3, 128, 64, 8, 3), (64, 128, 8, 2, 128, 128, 8, 2), (64, 128, 8, 2, 64, 64, 4, 2),
          (64, 64, 4, 2, 64, 64, 4, 2)],           # the last: 1 warpgroup, 2 CTAs per SM
}


def tune_bwd(N=4096, B=4, H=16, candidates=None, dtype=torch.bfloat16):
    """Time candidate backward configurations, atomic and deterministic dQ (bf16), each
    after checking its gradients against the first candidate's deterministic ones; returns
    ``(best rows, ok)``, ``ok`` False where any configuration was WRONG."""
    print(f"== tune-bwd: backward TFLOP/s per config (bf16, H={H}, N={N}, B={B}); default marked *")
    best_rows, ok = [], True
    for D, cands in (candidates or BWD_CANDIDATES).items():
        g = torch.Generator(device=DEV).manual_seed(0)
        q, k, v, do = (torch.randn(B, H, N, D, device=DEV, generator=g).to(dtype) for _ in range(4))
        scale = 1 / math.sqrt(D)
        for causal in (False, True):
            right = 0 if causal else None
            o, lse = fwd.attention_forward(q, k, v, scale=scale, right=right)
            ref = bwd.attention_backward(do, q, k, v, o, lse, scale=scale, right=right, deterministic=True,
                                         config=BwdConfig(*cands[0], use_tma=True))
            flops = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
            best = None
            for c in cands:
                for atomic in (True, False):
                    cfg = BwdConfig(*c, use_tma=True, atomic_dq=atomic)
                    try:
                        t0 = time.time()
                        run = lambda: bwd.attention_backward(  # noqa: E731
                            do, q, k, v, o, lse, scale=scale, right=right, deterministic=not atomic,
                            atomic_dq=atomic, config=cfg)
                        got = run()
                        # (not <=: a NaN difference is wrong too)
                        bad = [n for n, a, b in zip("qkv", got, ref)
                               if not (a.float() - b.float()).abs().max().item()
                               <= 2e-2 * max(1.0, b.float().abs().max().item())]
                        if bad:
                            print(f"    d{D} {cfg}: WRONG d{'/d'.join(bad)}")
                            ok = False
                            continue
                        tf = flops / _bench(run) / 1e9
                        default = bwd.default_config(q, D, D, causal=causal)
                        mark = "*" if (c == (default.block_m, default.block_n, default.num_warps, default.num_stages,
                                             default.dq_block_m, default.dq_block_n, default.dq_warps,
                                             default.dq_stages) and atomic == default.atomic_dq) else " "
                        print(f"  {mark} d{D} {'causal' if causal else 'full  '} {str(cfg):<60} {tf:6.0f} "
                              f"TFLOP/s (compile+run {time.time() - t0:.1f}s)", flush=True)
                        if best is None or tf > best[0]:
                            best = (tf, cfg)
                    except Exception as e:
                        print(f"    d{D} {cfg}: failed: {type(e).__name__}: {str(e)[:200]}")
            if best:
                print(f"  -> d{D} {'causal' if causal else 'full'} best: {best[1]} {best[0]:.0f} TFLOP/s")
                best_rows.append((D, causal, best[1], best[0]))
    return best_rows, ok


def main_bwd(quick: bool) -> int:
    t0 = time.time()
    ok = correctness_bwd(quick)
    print(f"   ({time.time() - t0:.0f}s)")
    det_ok = determinism_check()
    comp_ok = compile_check()
    print(f"   ({time.time() - t0:.0f}s)")
    speed_bwd(quick)
    print(f"total {time.time() - t0:.0f}s; backward correctness {'PASSED' if ok else 'FAILED'}, "
          f"determinism {'PASSED' if det_ok else 'FAILED'}, torch.compile {'PASSED' if comp_ok else 'FAILED'}")
    return 0 if ok and det_ok and comp_ok else 1


def gluon_variants(tokens=16384, H=16):
    """The Gluon forward's schedule choices side by side: for each head dim, length and
    mask, TFLOP/s of the persistent grid and of one program per work item
    (``gluon_fwd.persistent_default`` picks one: ``*``), of the chosen grid with the
    other ping-pong setting (``gluon_fwd.pingpong_default``), and of SDPA cuDNN, after
    checking that every variant gives the same bits (they change the order of issue, not
    the math). Returns 0 where they all do, 1 where any row's differ (2: no sm_90 GPU)."""
    from flashfold.kernels.attention import gluon_fwd
    if not gluon_fwd.eligible(*(torch.empty(1, 1, 1, 128, device=DEV, dtype=torch.bfloat16),) * 3):
        print("the Gluon forward needs an sm_90 GPU")
        return 2
    ok = True
    cudnn = _sdpa("CUDNN_ATTENTION")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("== Gluon variants (TFLOP/s; the grid chosen: *; ping-pong: the default, flipped)")
    print("| D | N | mask | ping-pong | persistent | per item | ping-pong flipped | cuDNN "
          "| best/cuDNN |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for D in (64, 128):
        for N in (1024, 4096, 16384):
            for causal in (False, True):
                B = max(1, tokens // N)
                q, k, v = (torch.randn(B, H, N, D, device=DEV, dtype=torch.bfloat16)
                           for _ in range(3))
                pick = gluon_fwd.persistent_default(causal, -(-N // gluon_fwd.BLOCK_M), sms)
                pp = gluon_fwd.pingpong_default(causal, N, N)
                opts = [dict(persistent=True), dict(persistent=False),
                        dict(persistent=pick, pingpong=not pp)]
                runs = [lambda o=o: gluon_fwd.gluon_attention_fwd(q, k, v, causal=causal,
                                                                  return_lse=True, **o)
                        for o in opts]
                outs = [f() for f in runs]
                same = all(torch.equal(outs[0][0], r[0]) and torch.equal(outs[0][1], r[1])
                           for r in outs[1:])
                ok &= same
                fl = 4 * B * H * D * N * N * (0.5 if causal else 1.0)
                tf = [fl / _bench(f) / 1e9 for f in runs + [lambda: cudnn(q, k, v, causal)]]
                cells = [f"{t:.0f}" + ("*" if i == (0 if pick else 1) else "")
                         for i, t in enumerate(tf)]
                print(f"| {D} | {N} | {'causal' if causal else 'full'} | {'on' if pp else 'off'} | "
                      + " | ".join(cells)
                      + f" | {max(tf[:3]) / tf[3]:.2f} |" + ("" if same else " BITS DIFFER |"),
                      flush=True)
    print(f"variants {'agree' if ok else 'DIFFER'} (output and LSE bitwise)")
    return 0 if ok else 1


def gluon_bwd_compare(tokens=16384, H=16, dims=(128, 64)):
    """The Gluon backward (``gluon_bwd``) next to the Triton kernels it replaces (default
    and deterministic configurations, forced by passing their config) and SDPA cuDNN's
    backward, head_dim 128 and 64, on the targets grid: TFLOP/s of the backward alone (2.5 x
    4 B H N^2 D, halved when causal), after checking that dQ, dK, dV of the Gluon kernel
    and of the deterministic Triton kernels agree (max |diff| relative to max |grad|).
    Last column: the Gluon kernel alone, without the preprocess and dQ conversion around
    it (same FLOP count), which separates the kernel's time from theirs, then the same with
    dK, dV written the other way (:func:`.gluon_bwd.store_tma`). Returns 0 where every
    row agrees, 1 where any is WRONG (2: no sm_90 GPU)."""
    from flashfold.kernels import launcher
    from flashfold.kernels.attention import gluon_bwd
    probe = torch.empty(1, 1, 1, 128, device=DEV, dtype=torch.bfloat16)
    if not gluon_bwd.eligible(probe, probe, probe, probe):
        print("the Gluon backward needs an sm_90 GPU")
        return 2
    ok = True
    cudnn = _sdpa_train("CUDNN_ATTENTION")
    print("== Gluon backward vs Triton backward vs cuDNN (TFLOP/s, bf16)")
    print("| D | N | mask | Gluon | Triton default | Triton det | cuDNN | Gluon/cuDNN | Gluon/Triton "
          "| max rel diff | Gluon kernel alone | alone, other dK/dV stores |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for D, N, causal in ((D, N, c) for D in dims for N in (1024, 4096, 16384)
                         for c in (False, True)):
        B = max(1, tokens // N)
        g = torch.Generator(device=DEV).manual_seed(0)
        q, k, v, do = (torch.randn(B, H, N, D, device=DEV, generator=g).to(torch.bfloat16)
                       for _ in range(4))
        scale = 1 / math.sqrt(D)
        right = 0 if causal else None
        o, lse = fwd.attention_forward(q, k, v, scale=scale, right=right)
        cfg = bwd.default_config(q, D, D, causal=causal)
        runs = [lambda: bwd.attention_backward(do, q, k, v, o, lse, scale=scale, right=right),
                lambda: bwd.attention_backward(do, q, k, v, o, lse, scale=scale, right=right,
                                               config=cfg),
                lambda: bwd.attention_backward(do, q, k, v, o, lse, scale=scale, right=right,
                                               config=cfg, deterministic=True)]
        got, ref = runs[0](), runs[2]()
        diff = _max_rel_diff(got, ref)          # (NaN where any gradient's is)
        wrong = not diff <= 2e-2
        ok &= not wrong
        fl = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
        tf = [fl / _bench(f) / 1e9 for f in runs]
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        oc = cudnn(qg, kg, vg, causal)
        tf.append(fl / _bench(lambda: torch.autograd.grad(oc, (qg, kg, vg), do,
                                                          retain_graph=True)) / 1e9)
        # the dK/dV/dQ kernel without the preprocess and the dQ conversion (its
        # repeated reduce-adds pile up in the accumulator: timing only)
        launches = bwd.prepare_backward(do, q, k, v, o, lse, scale=scale, right=right)[3]
        alone = fl / _bench(lambda: launcher.launch(*launches[1])) / 1e9
        # and with the other way out of dK, dV (gluon_bwd.store_tma chooses) in one
        # program per key tile (head_dim-64 dense calls are persistent by default)
        dd, lam, acc = launches[0][2][4:7]
        tma = gluon_bwd.store_tma(causal, N // gluon_bwd.BLOCK_M)
        other = gluon_bwd.gluon_attention_bwd(q, k, v, do, lam, dd, acc, got[1].clone(),
                                              got[2].clone(), causal=causal, scale=scale,
                                              launch=False, tma_store=not tma, persistent=False)
        alone_other = fl / _bench(lambda: launcher.launch(*other)) / 1e9
        print(f"| {D} | {N} | {'causal' if causal else 'full'} | "
              + " | ".join(f"{t:.0f}" for t in tf)
              + f" | {tf[0] / tf[3]:.2f} | {tf[0] / max(tf[1], tf[2]):.2f} | {diff:.1e}"
              + (" WRONG" if wrong else "") + f" | {alone:.0f} | "
              + f"{'register' if tma else 'TMA'} stores {alone_other:.0f} |", flush=True)
    print(f"gradients {'agree' if ok else 'DIFFER'} (Gluon against the deterministic Triton "
          "kernels, 2e-2 of the max)")
    return 0 if ok else 1


def gluon_bwd_variants(tokens=16384, H=16, D=128, reps=5):
    """``--gluon-bwd-variants``: the Gluon backward kernel alone (no preprocess, no dQ
    conversion) in the variants whose defaults were decided by it, on the targets grid
    (``--head-dim``, default 128) plus two GQA rows (4 query heads per key head,
    N = 4096): one program per key tile with ``lambda``, ``D`` read before or after the
    waits (``late_stats``), (dense) persistent programs with either, and (dense) the key
    mask the default now skips (``mask_tail_keys``: the key mask in every step). Checked
    first: dK, dV bitwise those of the default kernel, the dQ accumulator within 1e-5 of
    it (atomic adds in another order). Timed ``reps`` times in turn (the H200's run-to-run
    noise is a few percent); prints the median TFLOP/s and each variant's ratio to the
    default."""
    from flashfold.kernels import launcher
    from flashfold.kernels.attention import gluon_bwd
    probe = torch.empty(1, 1, 1, 128, device=DEV, dtype=torch.bfloat16)
    if not gluon_bwd.eligible(probe, probe, probe, probe):
        print("the Gluon backward needs an sm_90 GPU")
        return 2
    print(f"== Gluon backward kernel alone by variant (TFLOP/s, bf16, D={D}, median of {reps})")
    ok = True
    rows = [(N, c, H) for N in (1024, 4096, 16384) for c in (False, True)]
    for N, causal, Hk in rows + [(4096, False, H // 4), (4096, True, H // 4)]:
        variants = {"default": {}, "early stats": dict(late_stats=False),
                    "late stats": dict(late_stats=True)}
        if not causal:      # (the default skips the key mask: N fills the key tiles)
            variants.update({"key mask": dict(mask_tail_keys=True),
                             "one tile": dict(persistent=False),
                             "persistent": dict(persistent=True, late_stats=False),
                             "persistent + late": dict(persistent=True, late_stats=True)})
        B = max(1, tokens // N)
        g = torch.Generator(device=DEV).manual_seed(0)
        q, do = (torch.randn(B, H, N, D, device=DEV, generator=g).to(torch.bfloat16)
                 for _ in range(2))
        k, v = (torch.randn(B, Hk, N, D, device=DEV, generator=g).to(torch.bfloat16)
                for _ in range(2))
        scale, right = 1 / math.sqrt(D), (0 if causal else None)
        o, lse = fwd.attention_forward(q, k, v, scale=scale, right=right)
        _, dk, dv, launches = bwd.prepare_backward(do, q, k, v, o, lse, scale=scale,
                                                   right=right)
        dd, lam, acc = launches[0][2][4:7]     # (the preprocess's buffers)
        runs, outs = {}, {}
        for name, kw in variants.items():
            runs[name] = gluon_bwd.gluon_attention_bwd(q, k, v, do, lam, dd, acc, dk, dv,
                                                       causal=causal, scale=scale,
                                                       launch=False, **kw)
            dk.fill_(float("nan"))
            dv.fill_(float("nan"))
            launcher.launch(*launches[0])      # the preprocess zeroes the dQ accumulator
            launcher.launch(*runs[name])
            outs[name] = (acc.clone(), dk.clone(), dv.clone())
        a0, k0, v0 = outs["default"]
        for name, (a, k1, v1) in outs.items():
            rel = (a - a0).abs().max().item() / max(1e-6, a0.abs().max().item())
            # (not <=: a NaN in the accumulator is wrong too)
            if not (torch.equal(k0, k1) and torch.equal(v0, v1)) or not rel <= 1e-5:
                ok = False
                print(f"   N={N} causal={causal} {name}: dK/dV equal "
                      f"{torch.equal(k0, k1) and torch.equal(v0, v1)}, dQ acc rel {rel:.1e}"
                      " WRONG")
        fl = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
        ms = {name: [] for name in runs}
        for _ in range(reps):
            for name, m in runs.items():
                ms[name].append(_bench(lambda m=m: launcher.launch(*m)))
        med = {name: sorted(t)[len(t) // 2] for name, t in ms.items()}
        print(f"| {N} | {'causal' if causal else 'full'} | {H}/{Hk} heads | " + " | ".join(
            f"{name} {fl / t / 1e9:.0f} ({med['default'] / t:.3f})"
            for name, t in med.items()) + " |", flush=True)
        del q, k, v, do, o, lse, dk, dv, acc, runs, outs
        torch.cuda.empty_cache()
    print(f"variants {'agree' if ok else 'DIFFER'} (dK, dV bitwise; dQ accumulator 1e-5)")
    return 0 if ok else 1


def _max_rel_diff(got, want) -> float:
    """The largest over the gradients of max|g - w| / max(1e-6, max|w|); NaN when any is
    (Python's ``max`` keeps the first of a number and a NaN)."""
    diffs = [(a.float() - b.float()).abs().max().item() / max(1e-6, b.float().abs().max().item())
             for a, b in zip(got, want)]
    return math.nan if any(map(math.isnan, diffs)) else max(diffs)


def bwd_kernels(tokens=16384, H=16, dims=(128, 64), calls=10):
    """``--bwd-kernels``: GPU microseconds per backward by kernel, flashfold (default mode)
    against SDPA cuDNN, and the ratios of the totals and of the main kernels."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def kernel_us(o, q, k, v, do):
        times = kernel_times(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
                             reps=calls, warmup=3)
        return {name: us for us, _, name in times}

    print(f"== backward GPU time by kernel (torch.profiler, {calls} calls; us per backward)")
    print("| D | N | mask | ff total | cuDNN total | ff main | cuDNN main | ff other | cuDNN other "
          "| total ff/cuDNN | main ff/cuDNN | ff TFLOP/s (GPU time) | cuDNN TFLOP/s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ok, names = True, {}
    for D in dims:
        for N in (1024, 4096, 16384):
            for causal in (False, True):
                B = max(1, tokens // N)
                g = torch.Generator(device=DEV).manual_seed(0)
                q, k, v, do = (torch.randn(B, H, N, D, device=DEV, generator=g).to(torch.bfloat16)
                               for _ in range(4))
                q, k, v = (t.requires_grad_() for t in (q, k, v))
                fl = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
                o_ff = flashfold.attention(q, k, v, causal=causal)
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    o_cu = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                g_ff = torch.autograd.grad(o_ff, (q, k, v), do, retain_graph=True)
                g_cu = torch.autograd.grad(o_cu, (q, k, v), do, retain_graph=True)
                diff = _max_rel_diff(g_ff, g_cu)
                if not diff <= 5e-2:
                    ok = False
                    print(f"   d{D} N{N} causal={causal}: gradients differ from cuDNN's by {diff:.3g}")
                ff, cu = kernel_us(o_ff, q, k, v, do), kernel_us(o_cu, q, k, v, do)
                row = []
                for name, us in (("flashfold", ff), ("cuDNN", cu)):
                    main = max(us, key=us.get)
                    names.setdefault(name, {}).update({n: None for n in us})
                    row.append((sum(us.values()), us[main]))
                (tf, mf), (tc, mc) = row
                print(f"| {D} | {N} | {'causal' if causal else 'full'} | {tf:.1f} | {tc:.1f} "
                      f"| {mf:.1f} | {mc:.1f} | {tf - mf:.1f} | {tc - mc:.1f} | {tf / tc:.3f} "
                      f"| {mf / mc:.3f} | {fl / tf / 1e6:.0f} | {fl / tc / 1e6:.0f} |", flush=True)
                del q, k, v, do, o_ff, o_cu, g_ff, g_cu
                torch.cuda.empty_cache()
    for name, ks in names.items():
        print(f"   {name} kernels: " + "; ".join(n[:90] for n in ks))
    print(f"gradients {'agree' if ok else 'DIFFER'} (flashfold against cuDNN, 5e-2 of the max)")
    return 0 if ok else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small check grid, 3 timing rows")
    ap.add_argument("--check-only", action="store_true", help="correctness grid only")
    ap.add_argument("--tune", action="store_true", help="time candidate tile configs only")
    ap.add_argument("--bwd", action="store_true", help="backward: gradient grid, determinism, "
                    "torch.compile, backward and fwd+bwd timings (instead of the forward run)")
    ap.add_argument("--tune-bwd", action="store_true", help="time candidate backward configs only")
    ap.add_argument("--gluon-variants", action="store_true",
                    help="the Gluon forward's grids and ping-pong on/off vs cuDNN only")
    ap.add_argument("--gluon-bwd", action="store_true",
                    help="the Gluon backward vs the Triton backward kernels vs cuDNN only")
    ap.add_argument("--head-dim", type=int, default=128, choices=(64, 128),
                    help="head_dim of --gluon-bwd-variants")
    ap.add_argument("--gluon-bwd-variants", action="store_true",
                    help="the Gluon backward kernel alone in its variants only")
    ap.add_argument("--bwd-kernels", action="store_true",
                    help="GPU time per backward kernel, flashfold vs cuDNN only (torch.profiler)")
    ap.add_argument("--tune-n", type=int, default=4096,
                    help="--tune / --tune-bwd sequence length (batch = 16K tokens / N; default 4096)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    import triton
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}, "
          f"python {sys.version.split()[0]}")
    t0 = time.time()
    if args.tune:
        return 0 if tune(N=args.tune_n) else 1
    if args.tune_bwd:
        return 0 if tune_bwd(N=args.tune_n, B=max(1, 16384 // args.tune_n))[1] else 1
    if args.gluon_variants:
        return gluon_variants()
    if args.gluon_bwd:
        return gluon_bwd_compare()
    if args.gluon_bwd_variants:
        return gluon_bwd_variants(D=args.head_dim)
    if args.bwd_kernels:
        return bwd_kernels()
    if args.bwd:
        return main_bwd(args.quick)
    ok = correctness(args.quick)
    print(f"   ({time.time() - t0:.0f}s)")
    if not args.check_only:
        speed(args.quick)
    print(f"total {time.time() - t0:.0f}s; correctness {'PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
