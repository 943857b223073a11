"""The warp-specialized Gluon forward (``kernels/attention/gluon_fwd.py``).

On the CPU (CI): its scope (:func:`supported`), the dispatch from
:func:`flashfold.attention`, and every variant through the real compiler for sm_90 in a
subprocess without ``TRITON_INTERPRET``: it compiles, is warp-specialized (``setmaxnreg``),
loads through TMA, multiplies with ``wgmma``, fits shared memory, keeps its key loops
free of local memory, and no named barrier spans both consumer warpgroups (the first version synchronized all 8 consumer warps at
every mbarrier arrive, which held the two warpgroups in lockstep: 0.80-0.87x cuDNN at
head_dim 128 against 0.98-1.07x with one barrier per warpgroup; ``docs/notes/attention_fwd.md``,
"Two 4-warp partitions").
Gluon kernels have no interpreter mode, so the numerics are checked on the GPU (marked
``gpu``): FlashAttention's criterion against float64 over awkward lengths, GQA, causal
with ``Nq < Nk``, strided layouts, fp16 and bf16; equality of the LSE; agreement with the
Triton template; gradients through autograd.
"""

from __future__ import annotations

import functools
import math
import os
import re
import zlib
from unittest import mock

import pytest

from compile_worker import (assert_warp_specialized, emit_rows, gluon_rows, spill_budgets_apply,
                            ws_facts)
import torch

#: (id, head_dim, head_dim of v, options, return_lse, dtype, warpgroup ping-pong) of the
#: variants compiled on the CPU, ``Nq = 1000`` and ``Nk = options.get("nk", 1000)``: every
#: combination of the kernel's flags that the dispatch can choose (a window's sides,
#: softcap, the tile plans of each head dim; calls whose first query tiles see no key),
#: each with and without the LSE where it changes the epilogue
VARIANTS = [("d64", 64, 64, {}, False, "bfloat16", True),
            ("d64-causal-lse", 64, 64, {"causal": True}, True, "bfloat16", True),
            ("d128", 128, 128, {}, False, "bfloat16", True),
            ("d128-lse", 128, 128, {}, True, "float16", True),
            ("d128-causal", 128, 128, {"causal": True}, False, "bfloat16", True),
            ("d128-causal-lse", 128, 128, {"causal": True}, True, "bfloat16", True),
            ("d128-no-pingpong", 128, 128, {}, True, "bfloat16", False),
            ("d128-causal-no-pingpong", 128, 128, {"causal": True}, True, "bfloat16", False),
            # windows: both sides (causal + window is the same kernel), one side each
            ("d128-window", 128, 128, {"left": 256, "right": 256}, False, "bfloat16", True),
            ("d128-causal-window-lse", 128, 128, {"causal": True, "left": 300}, True,
             "bfloat16", True),
            ("d128-causal-window-no-pingpong", 128, 128, {"causal": True, "left": 300}, True,
             "bfloat16", False),
            ("d128-left-lse", 128, 128, {"left": 256}, True, "bfloat16", True),
            ("d64-window-lse", 64, 64, {"left": 100, "right": 20}, True, "float16", True),
            # Nq > Nk with a right bound: the first query tiles see no key (the kernel
            # runs on the rows after them)
            ("d128-causal-empty-lse", 128, 128, {"causal": True, "nk": 500}, True, "bfloat16",
             True),
            ("d128-window-empty", 128, 128, {"left": 100, "right": 100, "nk": 500}, False,
             "bfloat16", True),
            # softcap, alone and with windows
            ("d128-softcap", 128, 128, {"softcap": 50.0}, False, "bfloat16", True),
            ("d128-softcap-lse", 128, 128, {"softcap": 50.0}, True, "bfloat16", True),
            ("d128-softcap-causal-window-lse", 128, 128,
             {"softcap": 50.0, "causal": True, "left": 300}, True, "bfloat16", True),
            ("d64-softcap-causal", 64, 64, {"softcap": 30.0, "causal": True}, False, "bfloat16",
             True),
            # head dims: 32; 80 and 96 on 128-wide tiles; 256 (64-key tiles, the output
            # staged in the query buffer; with both window sides 32-key tiles); 192 / 128
            # (q/k 256-wide, v 128-wide)
            ("d32", 32, 32, {}, True, "bfloat16", True),
            ("d32-causal", 32, 32, {"causal": True}, False, "float16", True),
            ("d80-lse", 80, 80, {}, True, "bfloat16", True),
            ("d96-causal", 96, 96, {"causal": True}, False, "bfloat16", True),
            ("d96-causal-window", 96, 96, {"causal": True, "left": 300}, False, "bfloat16",
             True),
            ("d256", 256, 256, {}, False, "bfloat16", True),
            ("d256-causal-lse", 256, 256, {"causal": True}, True, "bfloat16", True),
            ("d256-softcap-causal-lse", 256, 256, {"softcap": 50.0, "causal": True}, True,
             "bfloat16", True),
            ("d256-left", 256, 256, {"left": 300}, False, "bfloat16", True),
            ("d256-softcap-causal-window-lse", 256, 256,
             {"softcap": 50.0, "causal": True, "left": 300}, True, "bfloat16", True),
            ("d256-causal-window", 256, 256, {"causal": True, "left": 1024, "nk": 2000}, False,
             "bfloat16", True),
            ("d256-window-empty-no-pingpong", 256, 256, {"left": 64, "right": 0, "nk": 500},
             True, "bfloat16", False),
            ("d192-128-lse", 192, 128, {}, True, "bfloat16", True),
            ("d192-128-causal", 192, 128, {"causal": True}, False, "bfloat16", True),
            ("d192-128-causal-window-lse", 192, 128, {"causal": True, "left": 300}, True,
             "bfloat16", True),
            ("d192-128-left", 192, 128, {"left": 300}, False, "bfloat16", True),
            # varlen (packed sequences of 100, 600 and 300 rows): persistent over the
            # sequences' tile slots, ragged tiles stored from registers
            ("d128-varlen-causal-lse", 128, 128, {"varlen": True, "causal": True}, True,
             "bfloat16", True),
            ("d128-varlen", 128, 128, {"varlen": True}, False, "float16", True),
            ("d64-varlen-window-lse", 64, 64, {"varlen": True, "left": 100, "right": 20}, True,
             "bfloat16", False),
            ("d256-varlen-softcap-causal-lse", 256, 256,
             {"varlen": True, "causal": True, "softcap": 50.0}, True, "bfloat16", True),
            ("d192-128-varlen-causal", 192, 128, {"varlen": True, "causal": True}, False,
             "bfloat16", True),
            # score_mods traced into the kernel: ALiBi (a table of slopes), a relative bias
            # (no table), alone and with the other features
            ("d128-mod-alibi", 128, 128, {"mod": "alibi"}, False, "bfloat16", True),
            ("d128-mod-capped-causal", 128, 128, {"mod": "capped", "causal": True}, False,
             "bfloat16", True),
            ("d128-mod-alibi-causal-lse", 128, 128, {"mod": "alibi", "causal": True}, True,
             "bfloat16", True),
            ("d64-mod-relative-softcap-lse", 64, 64, {"mod": "relative", "softcap": 30.0},
             True, "float16", True),
            ("d128-varlen-mod-alibi-causal-lse", 128, 128,
             {"varlen": True, "mod": "alibi", "causal": True}, True, "bfloat16", True),
            ("d256-mod-alibi-causal-window", 256, 256,
             {"mod": "alibi", "causal": True, "left": 300}, False, "bfloat16", True),
            # block masks walked by the kernel: a document mask (evaluated as each row's
            # interval of keys), documents that recur (a table of int32 ids read per key:
            # int64 ids spill into the key loop on Triton 3.9, docs/notes/attention_fwd.md),
            # prefix-LM (no table), with ALiBi; 128 x 256 blocks, two key tiles each
            ("d128-mask-documents-causal-lse", 128, 128, {"mask": "documents", "causal": True},
             True, "bfloat16", True),
            ("d128-mask-recurring-causal-lse", 128, 128, {"mask": "recurring", "causal": True},
             True, "bfloat16", True),
            ("d64-mask-prefix", 64, 64, {"mask": "prefix"}, False, "bfloat16", True),
            ("d128-mask-documents-mod-alibi-causal-lse", 128, 128,
             {"mask": "documents", "mod": "alibi", "causal": True}, True, "bfloat16", True),
            ("d128-mask-prefix-256-blocks-softcap", 128, 128,
             {"mask": "prefix-256-blocks", "softcap": 50.0}, False, "bfloat16", True),
            # q/k in two column chunks with the other features
            ("d96-mask-documents-causal-lse", 96, 96, {"mask": "documents", "causal": True},
             True, "bfloat16", True),
            ("d80-mod-alibi-softcap", 80, 80, {"mod": "alibi", "softcap": 30.0}, False,
             "bfloat16", True),
            ("d96-varlen-window-lse", 96, 96, {"varlen": True, "left": 100, "right": 20},
             True, "bfloat16", False),
            # FP8 (E4M3 q, k, v with descales; v keys-contiguous, Nk a multiple of 16 keys):
            # the same flags on 8-bit tiles, the output in out_dtype (bf16 unless named)
            ("d128-fp8", 128, 128, {"nk": 1024}, False, "float8_e4m3fn", True),
            ("d128-fp8-no-pingpong", 128, 128, {"nk": 1024}, True, "float8_e4m3fn", False),
            ("d128-causal-lse-fp8", 128, 128, {"causal": True, "nk": 1024}, True,
             "float8_e4m3fn", True),
            ("d128-softcap-causal-window-lse-fp8", 128, 128,
             {"softcap": 50.0, "causal": True, "left": 300, "nk": 1024}, True, "float8_e4m3fn",
             True),
            ("d128-causal-empty-lse-fp8", 128, 128, {"causal": True, "nk": 512}, True,
             "float8_e4m3fn", True),
            ("d64-window-lse-fp8-out-fp16", 64, 64,
             {"left": 100, "right": 20, "nk": 1024, "out_dtype": "float16"}, True,
             "float8_e4m3fn", True),
            ("d256-causal-lse-fp8", 256, 256, {"causal": True, "nk": 1024}, True,
             "float8_e4m3fn", True),
            ("d256-fp8-out-fp32", 256, 256, {"nk": 1024, "out_dtype": "float32"}, False,
             "float8_e4m3fn", True),
            ("d192-128-lse-fp8", 192, 128, {"nk": 1024}, True, "float8_e4m3fn", True),
            ("d96-causal-fp8", 96, 96, {"causal": True, "nk": 1024}, False, "float8_e4m3fn",
             True),
            # packed: a sequence's key tiles start at its first key rounded down to 16
            # (_first_key), under the left bound every packed FP8 call has
            ("d128-varlen-causal-lse-fp8", 128, 128, {"varlen": True, "causal": True,
                                                      "nk": 1024}, True, "float8_e4m3fn",
             True),
            ("d64-varlen-window-lse-fp8", 64, 64, {"varlen": True, "left": 100, "right": 20,
                                                   "nk": 1024}, True, "float8_e4m3fn", False)]


def _block_mask(name, nq, nk):
    """The block masks of the "-mask-" variants and tests (broadcast over b and h)."""
    import flashfold as ff
    from flashfold import mods
    if name in ("documents", "recurring"):
        docs = (torch.arange(max(nq, nk)) * 7 // max(nq, nk)).to(torch.int32)  # 7 documents
        if name == "recurring":
            docs = docs % 3                     # documents 0, 3, 6 share an id: no intervals
        return ff.create_block_mask(mods.document_mask(docs), None, None, nq, nk,
                                    device="cpu")
    blocks = (128, 256) if name == "prefix-256-blocks" else 128
    return ff.create_block_mask(mods.prefix_lm_mask(300), None, None, nq, nk, device="cpu",
                                BLOCK_SIZE=blocks)


def _score_mod(name, heads):
    """The traced score_mods of the "-mod-" variants and tests."""
    from flashfold import mods, ops
    from flashfold.kernels.attention.mods import trace_score_mod
    if name == "alibi":
        return trace_score_mod(mods.alibi(heads))
    if name == "capped":
        # a softcap written as a mod (tanh) and a gate on the distance (sigmoid)
        def capped(score, b, h, q_idx, kv_idx):
            return (20.0 * ops.tanh(score / 20.0)
                    - 2.0 * ops.sigmoid(0.01 * ops.to_float(q_idx - kv_idx) - 3.0))
        return trace_score_mod(capped)

    def relative(score, b, h, q_idx, kv_idx):
        return score + 0.01 * ops.to_float(kv_idx - q_idx)
    return trace_score_mod(relative)

#: the packed sequences of the "-varlen" variants
VARLEN_CU = [0, 100, 700, 1000]


def _key_loops(sass: str):
    """``(start, end)`` addresses of the innermost loops that issue ``HGMMA`` (16-bit
    operands) or ``QGMMA`` (8-bit) (the key loops), the addresses of local-memory
    accesses, and the instruction counts of the first key loop (all; wgmma, without the
    warpgroup fences; and the instructions FP8 adds: ``SHFL``, ``PRMT``, ``FMUL``,
    ``F2FP``), from ``cuobjdump -sass``. A loop is a predicated branch back to an earlier
    address; unpredicated ones are the jumps back from the out-of-line retries of
    mbarrier waits, not loops."""
    ops = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", sass)]
    loops = []
    for addr, op in ops:
        m = re.match(r"@!?U?P\d\s+BRA\s+(0x[0-9a-f]+)", op)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    mma = [a for a, op in ops if re.search(r"[HQ]GMMA", op)]
    with_mma = [(lo, hi) for lo, hi in loops if any(lo <= a <= hi for a in mma)]
    inner = [(lo, hi) for lo, hi in with_mma
             if not any((lo, hi) != (l2, h2) and lo <= l2 and h2 <= hi for l2, h2 in with_mma)]
    local = [a for a, op in ops if re.search(r"\b(LDL|STL)\b", op)]
    body = [op for a, op in ops if inner and inner[0][0] <= a <= inner[0][1]]
    counts = dict(all=len(body), gmma=sum(bool(re.search(r"[HQ]GMMA\.", op)) for op in body),
                  **{name: sum(bool(re.match(rf"(@\S+\s+)?{name}\b", op)) for op in body)
                     for name in ("SHFL", "PRMT", "FMUL", "F2FP")})
    return inner, local, counts


def _compile_all():
    """Worker: compile every variant, one JSON line each."""
    from flashfold.kernels.aot import _run_on_cubin, compile_launch
    from flashfold.kernels.attention import gluon_fwd as G

    def facts(d, dv, options, lse, dtype, pingpong):
        options = dict(options)
        nk = options.pop("nk", 1000)
        fp8 = dtype == "float8_e4m3fn"
        out_dtype = getattr(torch, options.pop("out_dtype", "bfloat16"))
        if "mod" in options:
            options["score_mod"] = _score_mod(options.pop("mod"), 4)
        if "mask" in options:
            options["block_mask"] = _block_mask(options.pop("mask"), 1000, nk)
        batch = 2
        if options.pop("varlen", False):
            cu = torch.tensor(VARLEN_CU, dtype=torch.int32)
            cu_k = torch.tensor(VARLEN_CU[:-1] + [nk], dtype=torch.int32)
            longest = int((cu[1:] - cu[:-1]).max())
            options.update(cu_seqlens_q=cu, cu_seqlens_k=cu_k, max_seqlen_q=longest,
                           max_seqlen_k=int((cu_k[1:] - cu_k[:-1]).max()),
                           flags=torch.zeros(4 * (1000 // 64 + len(cu) - 1),
                                             dtype=torch.int32))
            batch = 1
        q = torch.empty(batch, 4, 1000, d, dtype=getattr(torch, dtype))
        k = torch.empty(batch, 2, nk, d, dtype=q.dtype)
        v = torch.empty(batch, 2, nk, dv, dtype=q.dtype)
        if fp8:
            # (keys-contiguous, as flashfold.attention passes an E4M3 v; factors per
            # batch or sequence and KV head)
            v = torch.empty(batch, 2, dv, nk, dtype=q.dtype).transpose(2, 3)
            rows = len(VARLEN_CU) - 1 if "cu_seqlens_q" in options else batch
            options.update(descales=tuple(torch.empty(rows, 2) for _ in range(3)),
                           out_dtype=out_dtype)
        (kernel, _, args, kwargs), *fill = G.gluon_attention_fwd(
            q, k, v, return_lse=lse, launch=False, pingpong=pingpong, **options)
        c = compile_launch(kernel, args, kwargs)
        for fill_kernel, _, fill_args, fill_kwargs in fill:      # (the rows without keys)
            compile_launch(fill_kernel, fill_args, fill_kwargs)
        loops, local, counts = _key_loops(_run_on_cubin(c.cubin, "-sass"))
        mma = [line for line in c.ptx.splitlines() if "wgmma.mma_async" in line]
        return dict(**ws_facts(c), key_loops=loops, loop_counts=counts,
                    # E4M3 products; single-byte stores to shared memory (an 8-bit tile
                    # rearranged entry by entry, as the Triton template's V transpose was)
                    e4m3=bool(mma) and all("e4m3.e4m3" in line for line in mma),
                    byte_stores=len(re.findall(r"st\.shared(\.v\d)?\.[bu]8\b", c.ptx)),
                    out_dtype=str(args[3].base.dtype),      # (o's descriptor)
                    local_in_loops=[a for a in local if any(lo <= a <= hi for lo, hi in loops)],
                    constexprs={n: kwargs[n] for n in ("MASK_LEFT", "MASK_RIGHT", "SOFTCAP",
                                                       "O_IN_Q", "BLOCK_N", "VARLEN",
                                                       "DYNAMIC")},
                    score_mod=kwargs["SCORE_MOD"] is not None,
                    block_mask=kwargs["MASK_FN"] is not None, split=kwargs["SPLIT"],
                    row_bounds=kwargs["ROW_BOUNDS"],
                    skipped_rows=1000 - args[9], fill_launches=len(fill))

    emit_rows(VARIANTS, facts)


#: local-memory accesses accepted in the key loops where the installed Triton is not the
#: one the budgets were measured with (compile_worker.SPILL_BUDGET_TRITON: 3.6, none
#: there), by variant: with Triton 3.9's ptxas, the causal document mask (its intervals
#: as each row's key bounds) together with ALiBi reloads the bounds of its two rows per
#: key tile in each consumer's loop (two LDL at the P V wgmma's issue, four in the two
#: loops; sm_90 SASS), where the mask's per-key form loads 32 ids per thread per tile
#: instead (docs/notes/attention_fwd.md)
ACCEPTED_LOOP_LOCAL = {"d128-mask-documents-mod-alibi-causal-lse": 4}


@pytest.fixture(scope="module")
def compiled():
    return gluon_rows(__file__)


@pytest.mark.parametrize("vid", [v[0] for v in VARIANTS])
def test_compiles_warp_specialized_for_sm90(compiled, vid):
    r = compiled.get(vid)
    # producer warp at 24 registers, consumers at 240, one named barrier per consumer
    # warpgroup (128 threads) and none across both
    assert_warp_specialized(r, vid)
    # the two consumers' key loops (innermost loops issuing wgmma) touch no local memory.
    # Outside them the persistent kernel does spill at head_dim 128 (~20 loop-invariant
    # words, stored once per program and reloaded once per work item, against >= 2 x 8
    # HGMMA per key tile): allowed, and bounded here so that growth is seen
    assert len(r["key_loops"]) == 2, r["key_loops"]
    # the variant is what its name says (the "-empty" ones start at a later query tile;
    # head_dim 256, and 192 / 128 in two chunks, stage the output in the query buffer;
    # 64-key tiles at 256)
    assert (r["skipped_rows"] > 0) == ("-empty" in vid) == (r["fill_launches"] == 1), r
    # (FP8: the output has its own buffers; 8-bit query buffers cannot stage it)
    assert r["constexprs"]["O_IN_Q"] == (vid.startswith(("d256", "d192-128"))
                                         and "-fp8" not in vid), vid
    assert (r["constexprs"]["BLOCK_N"] == 64) == vid.startswith("d256"), r["constexprs"]
    assert r["constexprs"]["VARLEN"] == ("-varlen" in vid), r["constexprs"]
    assert r["score_mod"] == ("-mod-" in vid), r
    assert r["block_mask"] == ("-mask-" in vid), r
    # block masks' items differ in work: persistent programs draw them from a counter
    assert r["constexprs"]["DYNAMIC"] == ("-mask-" in vid), r["constexprs"]
    assert r["split"] == (2 if "-256-blocks" in vid else 1), r
    # a document mask's rows are intervals of keys: read once per item as row bounds
    assert r["row_bounds"] == ("-mask-documents" in vid), r
    accepted = 0 if spill_budgets_apply() else ACCEPTED_LOOP_LOCAL.get(vid, 0)
    assert len(r["local_in_loops"]) <= accepted, \
        f"{vid}: local memory in the key loop at {r['local_in_loops']}"
    assert r["spill"] <= 256, f"{vid}: {r['spill']} bytes of spill stores ({r['regs']} regs)"
    # FP8: both products on E4M3 operands (QGMMA), V's tiles as TMA wrote them (no byte
    # stores to shared memory), the output in its dtype
    fp8 = "-fp8" in vid
    assert r["e4m3"] == fp8 and r["byte_stores"] == 0, (r["e4m3"], r["byte_stores"])
    if fp8:
        assert r["out_dtype"] == ("torch.float32" if "-out-fp32" in vid else "torch.float16"
                                  if "-out-fp16" in vid else "torch.bfloat16"), r["out_dtype"]


def test_fp8_takes_the_448_from_the_step_with_128_key_tiles(compiled):
    """With 128-key tiles an FP8 call's ``P`` comes out times 448 from the tile step's
    reference shift (``gluon_fwd.SHIFT_FP8``), not from a multiply per score: its key loop
    has no more ``FMUL`` than the 16-bit one (sm_90: 66 each at head_dim 128; with the
    multiply, 130)."""
    f8, bf = compiled.get("d128-fp8"), compiled.get("d128")
    assert f8 is not None and bf is not None and f8["ok"] and bf["ok"]
    assert f8["loop_counts"]["FMUL"] <= bf["loop_counts"]["FMUL"], (f8["loop_counts"],
                                                                   bf["loop_counts"])


# --- scope and dispatch (CPU) -------------------------------------------------------------

def _qkv(B=1, HQ=4, HK=2, NQ=256, NK=256, D=128, dtype=torch.bfloat16):
    return (torch.randn(B, HQ, NQ, D, dtype=dtype), torch.randn(B, HK, NK, D, dtype=dtype),
            torch.randn(B, HK, NK, D, dtype=dtype))


def test_qk_chunks():
    """Head dims between powers of two run as two power-of-two column chunks of q and k
    (no padding at 80, 96, 192), where the chunks' width has a tile plan; the chunks cover
    the head dim, each at least one wgmma K step (16) wide."""
    from flashfold.kernels.attention.gluon_fwd import (TILE_PLANS, _plan, block_dims,
                                                       qk_chunks)
    assert qk_chunks(192, 128) == (128, 64) and qk_chunks(96, 96) == (64, 32)
    assert qk_chunks(80, 80) == (64, 16) and qk_chunks(72, 72) == (64, 16)
    assert qk_chunks(160, 128) == (128, 64)
    for d, dv in ((64, 64), (128, 128), (256, 256), (32, 32), (112, 112), (192, 192)):
        assert qk_chunks(d, dv) == (block_dims(d, dv)[0], 0), d
    for d in range(17, 257):
        for dv in (d, 128):
            if block_dims(d, dv) not in TILE_PLANS:
                continue
            lo, hi = qk_chunks(d, dv)
            assert lo + hi >= d and lo & (lo - 1) == 0 and (hi == 0 or hi & (hi - 1) == 0)
            assert hi == 0 or (16 <= hi < lo and lo + hi < block_dims(d, dv)[0])
            plan = _plan(d, dv)
            assert plan[:2] == (lo, hi) and (lo + hi, plan[2]) in TILE_PLANS


def test_scope():
    from flashfold.kernels.attention.gluon_fwd import supported
    q, k, v = _qkv()
    assert supported(q, k, v) and supported(q, k, v, causal=True)
    assert supported(*_qkv(D=64, dtype=torch.float16))
    # head dims: tiles of 32, 64, 128 or 256 columns (80, 96 padded to 128, 192 to 256)
    for d in (32, 48, 80, 96, 192, 256):
        assert supported(*_qkv(D=d)), d
    assert not supported(*_qkv(D=16)) and not supported(*_qkv(D=8))
    # Dv != D: only the plan of q/k 129-256 wide with v 65-128 wide (DeepSeek's 192 / 128)
    q2, k2, _ = _qkv(D=192)
    assert supported(q2, k2, _qkv(D=128)[2]) and supported(q2, k2, _qkv(D=96)[2])
    assert not supported(q, k, _qkv(D=64)[2]) and not supported(q2, k2, _qkv(D=64)[2])
    assert not supported(q2, _qkv(D=128)[1], _qkv(D=128)[2])           # k's D is q's
    assert not supported(*_qkv(dtype=torch.float32))
    # windows and softcap; rows without keys (causal with Nq > Nk) are handled
    assert supported(q, k, v, left=16, right=0) and supported(q, k, v, left=0)
    assert supported(q, k, v, right=5, softcap=30.0)
    assert not supported(q, k, v, softcap=0.0) and not supported(q, k, v, softcap=-1.0)
    assert not supported(q, k, v, left=-1)
    assert supported(*_qkv(NQ=300, NK=200), causal=True)
    assert supported(*_qkv(NQ=300, NK=200))
    assert not supported(*_qkv(HQ=3, HK=2))
    assert not supported(q, k, v, scale=-1.0)
    assert not supported(*_qkv(NK=0)) and not supported(*_qkv(NQ=0))
    # (B, N, H, D) storage is fine (4-D descriptors); a non-unit last stride is not
    t = torch.randn(1, 256, 4, 128, dtype=torch.bfloat16).transpose(1, 2)
    assert supported(t, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1))
    assert not supported(q.transpose(2, 3), k, v)
    # strides that are not 16-byte multiples (odd head_dim-padded rows)
    odd = torch.randn(1, 4, 256, 136, dtype=torch.bfloat16)[..., :128]
    assert supported(odd, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1))
    odd = torch.randn(1, 4, 256, 129, dtype=torch.bfloat16)[..., :128]
    assert not supported(odd, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1))
    assert not supported(*_qkv(D=36))                  # rows of 72 bytes: no TMA stride
    # a zero stride (keys expanded over heads) cannot be a TMA stride; the stride of a
    # size-1 dim is never used, so an unaligned one does not matter
    assert not supported(q, k[:, :1].expand(1, 2, 256, 128), v)
    one = torch.randn(256 * 128 + 8, dtype=torch.bfloat16)[8:].as_strided((1, 1, 256, 128),
                                                                         (3, 3, 128, 1))
    assert supported(one, k[:, :1], v[:, :1])


def test_backward_scope_narrows_the_forwards():
    """The Gluon backward takes the forward's scope (its head dims, 256 and MLA's 192/128
    in the WIDE variant) narrowed to calls where every row sees a key when the rows have
    a right bound."""
    from flashfold.kernels.attention.gluon_bwd import supported
    for d in (32, 96, 128, 192, 256):
        q, k, v = _qkv(D=d)
        assert supported(q, k, v, q), d
    q, k, v = _qkv(D=512)
    assert not supported(q, k, v, q)
    q, k, v = _qkv(NQ=300, NK=200)
    assert supported(q, k, v, q) and not supported(q, k, v, q, causal=True)


def _item_range_brute(q0, nq, nk, left, right, block_n):
    """``(first tile, count, unmasked tiles)`` of the item at row ``q0`` from the
    visibility of every pair: the tiles holding a key some real row sees, and those whose
    every key every real row sees."""
    delta = nk - nq
    rows = range(q0, min(q0 + 128, nq))

    def vis(i, j):
        return (j < nk and (right is None or j <= i + delta + right)
                and (left is None or j >= i + delta - left))
    tiles = -(-nk // block_n)
    seen = [t for t in range(tiles) if any(vis(i, j) for i in rows
                                           for j in range(t * block_n, (t + 1) * block_n))]
    full = {t for t in range(tiles) if all(vis(i, j) for i in rows
                                           for j in range(t * block_n, (t + 1) * block_n))}
    return seen, full


@pytest.mark.parametrize("nq, nk", [(300, 300), (300, 700), (700, 300), (1, 1), (129, 5)])
@pytest.mark.parametrize("bounds", [(None, None), (None, 0), (64, 0), (0, 0), (200, None),
                                    (None, 150), (30, 40), (500, 3)], ids=str)
@pytest.mark.parametrize("block_n", [64, 128])
def test_item_range_matches_visibility(nq, nk, bounds, block_n):
    """The tile range of each work item (:func:`item_range`, the host's copy of the
    kernel's ``_tile``): every tile holding a key that some row of the item sees, and no
    other (none for an item whose rows see no key); the unmasked run ``[t_a, t_c)`` holds
    exactly tiles whose every key every real row sees (the masked edges may hold such
    tiles too)."""
    from flashfold.kernels.attention.gluon_fwd import item_range, item_tiles
    left, right = bounds
    counts = item_tiles(nq, nk, left, right, block_n)
    assert len(counts) == -(-nq // 128)
    for m, count in enumerate(counts):
        t_lo, n_kv, t_a, t_c = item_range(m * 128, nq, nk, left, right, block_n)
        seen, full = _item_range_brute(m * 128, nq, nk, left, right, block_n)
        assert n_kv == count == len(seen)
        assert seen == list(range(t_lo, t_lo + n_kv)), (m, seen, t_lo, n_kv)
        assert t_lo <= t_a <= t_c <= t_lo + n_kv
        assert set(range(t_a, t_c)) <= full, (m, t_a, t_c, full)


def test_kernel_flags_follow_the_call():
    """The constexpr flags and tile plan each call compiles to: a window's sides (causal is
    ``right = 0``), softcap, 64-key tiles and the output staged in the query buffer at
    head_dim 256, the tile step and finalize generated from ATTENTION2, and the scale the
    step folds with its ``log2 e`` (``scale``; with softcap ``c``, after the tanh's ``2
    log2 e scale / c``)."""
    from flashfold.kernels.attention import gluon_fwd as G

    def kw(*qkv, **options):
        launches = G.gluon_attention_fwd(*qkv, launch=False, **options)
        assert launches[0][0] is G._attn_fwd_ws
        return launches[0][2], launches[0][3]
    qkv = _qkv()
    a, k = kw(*qkv)
    assert (k["MASK_LEFT"], k["MASK_RIGHT"], k["SOFTCAP"]) == (False,) * 3
    assert (k["BLOCK_N"], k["BLOCK_D"], k["BLOCK_DV"], k["O_IN_Q"]) == (128, 128, 128, False)
    assert a[14:16] == (0.0, pytest.approx(1 / math.sqrt(128)))
    from flashfold.kernels.codegen import tile_step_functions
    from flashfold.monoids import ATTENTION2
    # (the step with a reference shift: 0 here, log2 448 for an FP8 call's P)
    fns = tile_step_functions(ATTENTION2, scale="score", shift=True, gluon=True)
    assert k["STEP"] is fns.tile_step and k["FINALIZE"] is fns.finalize_rows
    a, k = kw(*qkv, causal=True, left=100)
    assert k["MASK_LEFT"] and k["MASK_RIGHT"] and a[16:18] == (100, 0)
    a, k = kw(*qkv, right=7)
    assert not k["MASK_LEFT"] and k["MASK_RIGHT"] and a[16:18] == (0, 7)
    a, k = kw(*qkv, softcap=50.0, scale=0.25)
    assert k["SOFTCAP"] and a[14:16] == (pytest.approx(2 * G.LOG2E * 0.25 / 50.0), 50.0)
    assert k["BLOCK_D2"] == 0 and a[4] is a[0] and a[5] is a[1]    # (one chunk: unread)
    a, k = kw(*_qkv(D=96))                                   # q/k in chunks of 64 and 32
    assert (k["BLOCK_N"], k["BLOCK_D"], k["BLOCK_D2"], k["BLOCK_DV"], k["O_IN_Q"]) == (
        128, 64, 32, 128, False)
    assert [d.block_shape[-1] for d in a[:6]] == [64, 64, 128, 128, 32, 32]
    k = kw(*_qkv(D=256))[1]
    assert (k["BLOCK_N"], k["BLOCK_D"], k["BLOCK_DV"], k["O_IN_Q"]) == (64, 256, 256, True)
    for one_side in ({"causal": True}, {"left": 100}, {"right": 100}):
        assert kw(*_qkv(D=256), **one_side)[1]["BLOCK_N"] == 64
    k = kw(*_qkv(D=256), causal=True, left=100)[1]            # both sides too
    assert (k["BLOCK_N"], k["BLOCK_D"], k["BLOCK_DV"], k["O_IN_Q"]) == (64, 256, 256, True)
    q, kk, _ = _qkv(D=192)
    args, k = kw(q, kk, _qkv(D=128)[2], return_lse=True)     # MLA: 128 + 64, 128-key tiles
    assert (k["BLOCK_N"], k["BLOCK_D"], k["BLOCK_D2"], k["BLOCK_DV"], k["O_IN_Q"]) == (
        128, 128, 64, 128, True)
    assert args[6].shape == (1, 4, 256)                               # the LSE
    with pytest.raises(ValueError, match="flags"):
        G.gluon_attention_fwd(*qkv, launch=False, flags=torch.zeros(16, dtype=torch.int32))


@pytest.mark.parametrize("lse", [False, True], ids=["no-lse", "lse"])
@pytest.mark.parametrize("flagged", [False, True], ids=["plain", "flagged"])
def test_query_tiles_without_keys_are_filled_not_computed(lse, flagged):
    """With a right bound and ``Nq > Nk`` the first query tiles may see no key (causal:
    when ``Nq - Nk >= 128``): the Gluon kernel runs on the rows from the first tile that
    sees one (views of q, o, the LSE and the flags, with ``Nq`` reduced accordingly, so
    that each row keeps its bottom-right aligned keys), and a second launch,
    ``_fill_empty_rows`` (run here: on the GPU where there is one, else under the
    interpreter), writes ``o = 0``, ``lse = -inf`` into the rows before, and nothing else
    (the flags, which the caller zeroes, are not its to write)."""
    from flashfold.kernels.attention import gluon_fwd as G
    q, k, v = _qkv(B=2, NQ=400, NK=272, D=80)                # 3 query tiles, the first empty
    assert len(G.gluon_attention_fwd(q, k, v, causal=True, launch=False)) == 2
    assert len(G.gluon_attention_fwd(*_qkv(NQ=400, NK=273), causal=True, launch=False)) == 1
    assert len(G.gluon_attention_fwd(*_qkv(NQ=400, NK=100), launch=False)) == 1   # no bound
    o = torch.full((2, 4, 400, 80), 7.0, dtype=q.dtype)
    out_lse = torch.full((2, 4, 400), 7.0) if lse else None
    flags = torch.full((2 * 4 * 7,), 7, dtype=torch.int32) if flagged else None
    # window (3, 10), Nq - Nk = 300: rows r < 290 see no key, so tiles 0 and 1 are skipped
    q, k, v = _qkv(B=2, NQ=400, NK=100, D=80)
    main, fill = G.gluon_attention_fwd(q, k, v, left=3, right=10, return_lse=lse, out=o,
                                       lse=out_lse, flags=flags, launch=False)
    args = main[2]
    assert args[9] == 400 - 256                                       # the kernel's Nq
    assert args[0].base.data_ptr() == q[:, :, 256:].data_ptr()        # q from row 256
    assert args[3].base.data_ptr() == o[:, :, 256:].data_ptr()
    if lse:
        assert args[6].data_ptr() == out_lse[:, :, 256:].data_ptr()
    if flagged:
        assert args[18].data_ptr() == flags[4:].data_ptr() and args[19] == 7
    kernel, grid, fargs, fkw = fill
    assert fargs[0] is o and fargs[1] is (out_lse if lse else o)
    # (on a machine with a GPU, where the interpreter is off, on copies there)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    fargs = tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in fargs)
    kernel[grid](*fargs, **fkw)
    o = fargs[0].cpu()
    assert (o[:, :, :256] == 0).all() and (o[:, :, 256:] == 7).all()
    if lse:
        out_lse = fargs[1].cpu()
        assert (out_lse[:, :, :256] == -math.inf).all() and (out_lse[:, :, 256:] == 7).all()
    if flagged:
        assert (flags == 7).all()


def test_persistent_rule():
    """Dense calls always run persistent; causal ones while a round of ``sms`` work items
    spans at least 4 heads (132 SMs: N <= 4K at 128-row tiles)."""
    from flashfold.kernels.attention.gluon_fwd import persistent_default
    assert persistent_default(False, 128, 132) and persistent_default(False, 1, 132)
    assert persistent_default(True, 8, 132) and persistent_default(True, 33, 132)
    assert not persistent_default(True, 34, 132) and not persistent_default(True, 128, 132)


def test_pingpong_rule():
    """Ping-pong while work items average at most 24 key tiles of 128: dense N <= 3K,
    causal N <= ~6K (items average (N / 2 + 64) / 128 tiles), more when Nk > Nq; a
    window's items average about (left + right + 128) / 128 tiles, whatever N."""
    from flashfold.kernels.attention.gluon_fwd import pingpong_default
    assert pingpong_default(False, 1024, 1024) and pingpong_default(False, 1, 3072)
    assert not pingpong_default(False, 1024, 4096) and not pingpong_default(False, 1, 3073)
    assert pingpong_default(True, 4096, 4096) and pingpong_default(True, 6016, 6016)
    assert not pingpong_default(True, 6272, 6272) and not pingpong_default(True, 16384, 16384)
    assert not pingpong_default(True, 128, 4096)      # 32 key tiles per item
    # Mistral's window (4096, causal): 33 tiles per item at 32K, 16.3 on average at 4K
    assert not pingpong_default(True, 32768, 32768, left=4096)
    assert pingpong_default(True, 4096, 4096, left=4096)
    # Gemma-3's local layers (1024, causal): 9 tiles per item at any length
    assert pingpong_default(True, 32768, 32768, left=1024)
    assert pingpong_default(False, 32768, 32768, left=1024, right=1024)
    assert not pingpong_default(False, 32768, 32768, left=None, right=1024)
    # the tiles of the call's plan: 64-key tiles at head_dim 256
    assert pingpong_default(False, 1024, 3072) and not pingpong_default(False, 1024, 3072,
                                                                        block_n=64)
    # FP8 calls ping-pong whatever their length from q/k tiles 128 wide, and keep the
    # rule below
    assert pingpong_default(False, 4096, 4096, fp8_width=128)
    assert pingpong_default(True, 16384, 16384, block_n=64, fp8_width=256)
    assert pingpong_default(False, 4096, 4096, fp8_width=96 + 32)
    assert not pingpong_default(False, 4096, 4096, fp8_width=64)
    assert pingpong_default(False, 1024, 1024, fp8_width=64)


def test_not_on_cpu_tensors():
    from flashfold.kernels.attention.gluon_fwd import eligible
    assert not eligible(*_qkv())


def test_dispatch_sends_calls_the_template_lowers():
    """``attention_forward`` takes the Gluon path exactly for calls without a forced
    config, with at most a score_mod and a block mask that Gluon can lower (the block
    mask on dense calls, its blocks whole tiles; ``eligible`` mocked true: the call is
    recorded, not run), with its window, softcap and packed sequences; a call with a
    window (causal too), a mod or packed sequences writes the non-finite flags (zeroed,
    one per 64 rows of each batch and head; packed, one per 64-row slot of each head:
    ``Nq // 64 + sequences``, whatever the lengths) and is followed by the
    strict Triton guard, one without is launched alone."""
    import flashfold as ff
    from flashfold import mods, ops
    from flashfold.kernels.attention import fwd, gluon_fwd
    from flashfold.kernels.attention.mods import trace_score_mod
    calls = []

    def fake(q, k, v, *, scale, softcap, left, right, return_lse, out, lse, launch,
             flags=None, **varlen):
        assert not launch                     # (the forward's plan launches it)
        assert flags is None or not flags.any()
        calls.append((left, right, softcap, flags is not None,
                      varlen.get("max_seqlen_q"), None if flags is None else flags.numel(),
                      varlen.get("score_mod"), varlen.get("block_mask")))
        return (("gluon", (1,), (), {}),)
    q, k, v = _qkv(NQ=64, NK=64, D=64, dtype=torch.float32)
    cu = torch.tensor([0, 30, 64], dtype=torch.int32)
    packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=34, max_seqlen_k=34)
    half = trace_score_mod(lambda s, b, h, i, j: s * 0.5)
    prefix = ff.create_block_mask(mods.prefix_lm_mask(20), None, None, 64, 64, device="cpu")
    small = ff.create_block_mask(mods.prefix_lm_mask(20), None, None, 64, 64, device="cpu",
                                 BLOCK_SIZE=64)
    with mock.patch.object(gluon_fwd, "eligible", return_value=True), \
            mock.patch.object(gluon_fwd, "gluon_attention_fwd", side_effect=fake), \
            mock.patch.object(fwd.launcher, "launch") as launch:
        expect = [((), (None, None, None, False, None, None)),
                  ({"right": 0}, (None, 0, None, True, None, 4)),
                  ({"left": 16, "right": 0}, (16, 0, None, True, None, 4)),
                  ({"left": 16}, (16, None, None, True, None, 4)),
                  ({"right": 4}, (None, 4, None, True, None, 4)),
                  ({"softcap": 20.0}, (None, None, 20.0, False, None, None)),
                  ({"softcap": 20.0, "left": 8, "right": 8}, (8, 8, 20.0, True, None, 4)),
                  # 4 heads x (64 // 64 + 2 sequences)
                  (packed, (None, None, None, True, 34, 12)),
                  (dict(packed, right=0), (None, 0, None, True, 34, 12)),
                  ({"score_mod": half}, (None, None, None, True, None, 4)),
                  (dict(packed, score_mod=half), (None, None, None, True, 34, 12)),
                  ({"block_mask": prefix, "score_mod": half}, (None, None, None, True, None, 4))]
        expect = [(o, c + (dict(o).get("score_mod"), dict(o).get("block_mask")))
                  for o, c in expect]
        for options, call in expect:
            launch.reset_mock()
            fwd.attention_forward(q, k, v, scale=0.1, **dict(options))
            assert calls[-1] == call, options
            kernels = [c.args[0] for c in launch.call_args_list]
            assert kernels == (["gluon", fwd._attn_fwd_guard] if call[3] else ["gluon"]), options
        assert len(calls) == len(expect)
        # (the Gluon lowering has no scan_sum; 64-row blocks are not whole query tiles;
        # packed sequences take the Triton kernel's block masks)
        others = [dict(config=fwd.default_config(q, 64, 64)),
                  dict(score_mod=trace_score_mod(lambda s, b, h, i, j: ops.scan_sum(s))),
                  dict(block_mask=small), dict(packed, block_mask=prefix)]
        for options in others:
            fwd.attention_forward(q, k, v, scale=0.1, **options)
        assert len(calls) == len(expect)


@pytest.mark.parametrize("op, want", [("sigmoid", torch.sigmoid), ("tanh", torch.tanh)])
def test_gluon_writes_out_sigmoid_and_tanh_as_triton_computes_them(op, want):
    """Gluon has no ``sigmoid``: its lowering spells out ``1 / (1 + e^-x)`` (Triton's own
    ``tl.sigmoid``) and ``tanh`` through it, as the Triton table does. Evaluated in
    float32 with torch standing in for ``gl``: within a few ulps of torch's (the ``tanh``
    form loses relative accuracy near 0, as Triton's does), saturated at +-inf, NaN kept;
    and the Triton table's form gives the same bits."""
    from types import SimpleNamespace
    from flashfold.kernels.codegen import GLUON, TRITON
    x = torch.cat([torch.linspace(-60, 60, 20001), torch.tensor(
        [0.0, -0.0, 1e-30, 88.0, -88.0, 1e4, -1e4, math.inf, -math.inf, math.nan])])
    def exp(a):           # gl.exp, which does not compile for int tensors
        assert a.is_floating_point(), "gl.exp of an int tensor"
        return torch.exp(a)
    gl = SimpleNamespace(exp=exp)
    tl = SimpleNamespace(sigmoid=lambda a: 1.0 / (1.0 + torch.exp(-a)))
    got = eval(GLUON.templates[op].format("x"), {"gl": gl, "x": x, "_float": lambda a: a})
    triton_form = eval(TRITON.templates[op].format("x"),     # (_float: floats as they are)
                       {"tl": tl, "_float": lambda a: a, "x": x})
    assert got.dtype == torch.float32
    assert torch.equal(got.isnan(), x.isnan())
    assert torch.equal(got[~x.isnan()], triton_form[~x.isnan()])
    ref = want(x.double())
    fin = ~x.isnan()
    assert (got[fin].double() - ref[fin]).abs().max() <= 4 * torch.finfo(torch.float32).eps
    assert got[x == math.inf].item() == 1.0
    assert got[x == -math.inf].item() == (0.0 if op == "sigmoid" else -1.0)
    # an int argument (a distance q_idx - kv_idx), converted as the header's _float does
    i = torch.arange(-40, 41, dtype=torch.int32)
    got_i = eval(GLUON.templates[op].format("i"), {"gl": gl, "i": i,
                                                   "_float": lambda a: a.to(torch.float32)})
    assert torch.equal(got_i, eval(GLUON.templates[op].format("x"),
                                   {"gl": gl, "x": i.float(), "_float": lambda a: a}))


def test_callable_mask_mods_get_tables_of_the_kernel_that_runs():
    """A callable mask_mod's block table has the tiles of the kernel the call will run:
    the Gluon kernel's 128 query rows and its plan's 128-key tile where it walks block
    masks (eligible, q/k tiles up to 128 wide: head_dim 96 too), else the Triton
    template's (head_dim 256, a score_mod Gluon cannot lower, packed sequences)."""
    from flashfold import ops
    from flashfold.kernels.attention import fwd, gluon_fwd
    from flashfold.kernels.attention.mods import trace_mask_mod, trace_score_mod
    mask = trace_mask_mod(lambda b, h, i, j: j <= i)
    q, k, v = _qkv(D=64)
    triton = fwd.default_config(q, 64, 64)
    with mock.patch.object(gluon_fwd, "eligible", return_value=True):
        assert fwd.mask_tiles(q, k, v, scale=0.1, mask_mod=mask) == (128, 128)
        assert fwd.mask_tiles(*_qkv(D=96), scale=0.1, mask_mod=mask) == (128, 128)
        q2, k2, v2 = _qkv(D=256)
        wide = fwd.default_config(q2, 256, 256)
        assert fwd.mask_tiles(q2, k2, v2, scale=0.1, mask_mod=mask) == (wide.block_m,
                                                                        wide.block_n)
        scan = trace_score_mod(lambda s, b, h, i, j: ops.scan_sum(s))
        for kw in (dict(score_mod=scan), dict(varlen=True)):
            assert fwd.mask_tiles(q, k, v, scale=0.1, mask_mod=mask, **kw) == (
                triton.block_m, triton.block_n), kw
    assert fwd.mask_tiles(q, k, v, scale=0.1, mask_mod=mask) == (triton.block_m,
                                                                 triton.block_n)


def test_plans_of_gluon_calls_are_replayed():
    """The forward's plan of a Gluon call can be replayed (a plan cache made while
    ``eligible`` is mocked true; nothing runs): a repeated signature rebuilds the launch
    around the new call's tensors, windowed calls with their guard too; only a call whose
    first query tiles see no key, whose launch holds a view of ``q``, is planned anew every
    time."""
    from flashfold.kernels import plans
    from flashfold.kernels.attention import fwd, gluon_fwd
    with mock.patch.object(gluon_fwd, "eligible", return_value=True):
        for options, shape, replayed in [({}, {}, True), ({"left": 100, "right": 0}, {}, True),
                                         ({"softcap": 30.0}, {"D": 256}, True),
                                         ({"right": 0}, {"NQ": 400, "NK": 100}, False)]:
            cache = plans.PlanCache("test", vars(fwd), (fwd._plan,), modules=(gluon_fwd,))
            for _ in range(2):
                q, k, v = _qkv(**shape)
                inputs = (q, k, v, None, None)
                o, lse, launches, _ = cache.planned(("key",), None, inputs, fwd._plan, *inputs,
                                                   scale=0.1, **options)
                kernel, grid, args, kwargs = launches[0]
                assert kernel is gluon_fwd._attn_fwd_ws
                assert args[0].base.data_ptr() == q[:, :, -args[9]:].data_ptr()   # this q
                assert args[3].base.data_ptr() == o[:, :, -args[9]:].data_ptr()   # this o
                assert len(launches) == 1 + ("right" in options) + (not replayed), launches
            assert cache.info()["hits"] == (1 if replayed else 0), options


def _qkv8(B=1, HQ=4, HK=2, NQ=256, NK=256, D=128, DV=None):
    """E4M3 q, k, v (v keys-contiguous: a (B, Hk, Dv, Nk) tensor transposed) and their
    descale factors ``(B, Hk)``."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, h, n, D, generator=g).to(torch.float8_e4m3fn)
            for h, n in ((HQ, NQ), (HK, NK)))
    v = torch.randn(B, HK, DV or D, NK, generator=g).to(torch.float8_e4m3fn).transpose(2, 3)
    return (q, k, v), tuple(torch.rand(B, HK, generator=g) + 0.5 for _ in range(3))


def test_fp8_scope_and_plan():
    """E4M3 calls are in scope where ``v`` is keys-contiguous and its transposed view is
    TMA-addressable (``Nk`` a multiple of 16 in a dense store, or a padded row stride);
    their plans reduce over 32 columns at least (a second q/k chunk of 32) and stage the
    output in its own buffers."""
    from flashfold.kernels.attention.gluon_fwd import _plan, qk_chunks, supported
    (q, k, v), _ = _qkv8()
    assert supported(q, k, v) and supported(q, k, v, causal=True, left=100, softcap=30.0)
    assert not supported(q, k, v.contiguous())                 # row-major v
    assert not supported(q, k, v.to(torch.bfloat16))           # mixed dtypes
    (q2, k2, v2), _ = _qkv8(NK=1000)
    assert not supported(q2, k2, v2)                           # rows of 1000 bytes
    padded = torch.zeros(1, 2, 128, 1008, dtype=torch.float8_e4m3fn)[..., :1000]
    assert supported(q2, k2, padded.transpose(2, 3))
    for d in (32, 64, 80, 96, 192, 256):
        assert supported(*_qkv8(D=d)[0]), d
    assert not supported(*_qkv8(D=72)[0])                      # rows of 72 bytes
    assert supported(*_qkv8(D=192, DV=128)[0])
    # an output row of 100 bf16 entries is 200 bytes, which TMA cannot step by (o does
    # not have v's layout, as in a 16-bit call)
    assert not supported(*_qkv8(D=192, DV=100)[0])
    from flashfold.kernels.attention import gluon_bwd
    assert not gluon_bwd.supported(q, k, v, q)                 # FP8 has no backward
    assert gluon_bwd.supported(*(t.to(torch.bfloat16).contiguous() for t in (q, k, v, q)))
    assert qk_chunks(80, 80, least=32) == (64, 32) and qk_chunks(96, 96, least=32) == (64, 32)
    assert qk_chunks(192, 128, least=32) == (128, 64)
    assert _plan(80, 80, fp8=True) == (64, 32, 128, 128, False)
    assert _plan(256, 256, fp8=True) == (256, 0, 256, 64, False)
    assert _plan(256, 256) == (256, 0, 256, 64, True)


def test_fp8_dispatch_takes_the_gluon_kernel():
    """``attention_forward`` sends an eligible FP8 call to the Gluon kernel with its
    descales and ``out_dtype`` (the output allocated in it), a windowed one followed by
    the strict guard of the template's FP8 flag; a forced config, or a call Gluon
    refuses (on the CPU: every call), runs the template."""
    from flashfold.kernels.attention import fwd, gluon_fwd
    (q, k, v), d = _qkv8(NQ=64, NK=64, D=64)
    calls = []

    def fake(q, k, v, *, out, lse, launch, flags=None, descales=None, **options):
        calls.append((descales, out.dtype, flags is not None))
        return (("gluon", (1,), (), {}),)
    with mock.patch.object(gluon_fwd, "eligible", return_value=True), \
            mock.patch.object(gluon_fwd, "gluon_attention_fwd", side_effect=fake), \
            mock.patch.object(fwd.launcher, "launch") as launch:
        o, _ = fwd.attention_forward(q, k, v, scale=0.1, descales=d, out_dtype=torch.float16)
        assert o.dtype == torch.float16 and calls[-1] == (d, torch.float16, False)
        assert [c.args[0] for c in launch.call_args_list] == ["gluon"]
        launch.reset_mock()
        fwd.attention_forward(q, k, v, scale=0.1, right=0, descales=d,
                              out_dtype=torch.bfloat16)
        assert calls[-1] == (d, torch.bfloat16, True)
        assert len(launch.call_args_list) == 2
        guard = launch.call_args_list[1].args            # (kernel, grid, args, kwargs, memo)
        assert guard[0] is fwd._attn_fwd_guard and guard[3]["FP8"]
        launch.reset_mock()
        fwd.attention_forward(q, k, v, scale=0.1, descales=d, out_dtype=torch.bfloat16,
                              config=fwd.default_config(q, 64, 64))
        assert len(calls) == 2 and launch.call_args_list[0].args[0] is fwd._attn_fwd
        # without out_dtype: bf16, whichever kernel runs (not q's E4M3)
        o, _ = fwd.attention_forward(q, k, v, scale=0.1, descales=d)
        assert o.dtype == torch.bfloat16 and calls[-1][1] == torch.bfloat16
        o, _ = fwd.attention_forward(q, k, v, scale=0.1, descales=d,
                                     config=fwd.default_config(q, 64, 64))
        assert o.dtype == torch.bfloat16
    assert not gluon_fwd.eligible(q, k, v)                      # (CPU tensors)


def test_plans_of_fp8_calls_are_replayed():
    """An FP8 call's plan is replayed around the next call's tensors: V's descriptor is
    built over ``v`` itself with the transposed shape and strides (a descriptor over the
    view ``v.transpose(2, 3)`` made every plan unreplayable), the descale factors are
    the new call's; for the Gluon kernel (dense, causal with the guard, packed) and the
    template's TMA path."""
    from flashfold.kernels import plans
    from flashfold.kernels.attention import fwd, gluon_fwd
    cu = torch.tensor([0, 100, 256], dtype=torch.int32)
    packed = dict(max_seqlen_q=156, max_seqlen_k=156)
    tma = fwd.FwdConfig(64, 64, 4, 2, use_tma=True)
    with mock.patch.object(gluon_fwd, "eligible", return_value=True):
        for options, cus, kernel in [({}, (None, None), gluon_fwd._attn_fwd_ws),
                                     ({"right": 0}, (None, None), gluon_fwd._attn_fwd_ws),
                                     (dict(packed, right=0), (cu, cu), gluon_fwd._attn_fwd_ws),
                                     ({"right": 0, "config": tma}, (None, None), fwd._attn_fwd)]:
            cache = plans.PlanCache("test", vars(fwd), (fwd._plan,), modules=(gluon_fwd,))
            for _ in range(2):
                (q, k, v), d = _qkv8()
                inputs = (q, k, v, *cus, *d)
                o, lse, launches, _ = cache.planned(("key",), None, inputs, fwd._plan, *inputs,
                                                   scale=0.1, out_dtype=torch.bfloat16,
                                                   **options)
                launched, _, args, _ = launches[0]
                assert launched is kernel and o.dtype == torch.bfloat16
                descs = [a for a in args if hasattr(a, "block_shape")]
                v_desc = descs[2]
                assert v_desc.base is v and list(v_desc.shape) == [1, 2, 128, 256], v_desc
                assert any(isinstance(a, tuple) and a and a[0] is d[0] for a in args)
            assert cache.info()["hits"] == 1, options


# --- numerics on the GPU -------------------------------------------------------------------

def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _needs_sm90():
    """The numerics run only where the kernel does: Gluon kernels have no interpreter
    mode and this one is Hopper-only (the CPU suite compiles it instead, above)."""
    pytest.importorskip("triton.experimental.gluon")
    if not _sm90():
        pytest.skip("needs an sm_90 GPU")


def _reference(q, k, v, causal, scale, window=None, softcap=None, score_mod=None,
               mask_mod=None):
    """float64 attention; ``score_mod`` / ``mask_mod``: traced mods (their torch
    lowerings)."""
    from flashfold.kernels.attention.reference import naive_attention
    fn = score_mod.torch_fn(q.device) if score_mod is not None else None
    mask = mask_mod.torch_fn(q.device) if mask_mod is not None else None
    return naive_attention(q, k, v, causal=causal, window=window, scale=scale, softcap=softcap,
                           score_mod=fn, mask_mod=mask, dtype=torch.float64)


def _naive_lowp(q, k, v, causal, scale, window=None, softcap=None, score_mod=None,
                mask_mod=None):
    """Matmuls in the input dtype, softcap, score_mod and softmax in float32 (the
    criterion's yardstick); a row that sees no key gives 0. ``window``: ``(left, right)``,
    ``None`` or ``-1`` unbounded, bottom-right aligned like the kernels'."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s.float() / softcap)
    if score_mod is not None:
        ar = functools.partial(torch.arange, device=q.device)
        s = score_mod.torch_fn(q.device)(s.float(), ar(q.shape[0])[:, None, None, None],
                                         ar(q.shape[1])[None, :, None, None],
                                         ar(q.shape[2])[:, None], ar(k.shape[2])[None, :])
    left, right = (None, None) if window is None else window
    left = None if left is None or left < 0 else left
    right = None if right is None or right < 0 else right
    if causal:
        right = 0 if right is None else min(right, 0)
    nq, nk = q.shape[2], k.shape[2]
    i = torch.arange(nq, device=q.device)[:, None]
    j = torch.arange(nk, device=q.device)[None, :]
    hidden = torch.zeros(nq, nk, dtype=torch.bool, device=q.device)
    if right is not None:
        hidden |= j > i + nk - nq + right
    if left is not None:
        hidden |= j < i + nk - nq - left
    if mask_mod is not None:
        ar = functools.partial(torch.arange, device=q.device)
        hidden = hidden | ~mask_mod.torch_fn(q.device)(
            ar(q.shape[0])[:, None, None, None], ar(q.shape[1])[None, :, None, None], i, j)
    s = s.masked_fill(hidden, float("-inf"))
    return torch.softmax(s.float(), -1).nan_to_num(0.0).to(q.dtype) @ v


def _gluon_meets_the_criterion(q, k, v, name, causal=False, window=None, softcap=None,
                               scale=None, score_mod=None, mask_mod=None):
    """``flashfold.attention`` on the Gluon path (spied: the call was planned anew and
    went through :func:`gluon_attention_fwd`) against float64: the max error of ``o`` at
    most twice the naive low-precision attention's plus 1e-5, every ``o`` finite, the LSE
    within 1e-3 where a row sees a key, and a row that sees none exactly ``o = 0``, ``lse
    = -inf``. Returns the mask of those rows."""
    import flashfold as ff
    from flashfold.kernels.attention import fwd, gluon_fwd
    scale_ = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    fwd.plan_cache_clear()                 # (a replayed plan would not call the spy)
    with mock.patch.object(gluon_fwd, "gluon_attention_fwd",
                           wraps=gluon_fwd.gluon_attention_fwd) as spy:
        o, lse = ff.attention(q, k, v, causal=causal, window=window, softcap=softcap,
                              scale=scale, return_lse=True,
                              score_mod=score_mod.fn if score_mod is not None else None,
                              mask_mod=mask_mod.fn if mask_mod is not None else None)
    assert spy.call_count == 1, f"{name}: not the Gluon path"
    if mask_mod is not None:
        assert spy.call_args.kwargs["block_mask"] is not None, f"{name}: no block mask walked"
    mod = dict(window=window, softcap=softcap, score_mod=score_mod, mask_mod=mask_mod)
    ro, rl = _reference(q, k, v, causal, scale_, **mod)
    naive = (_naive_lowp(q, k, v, causal, scale_, **mod).double() - ro).abs().max().item()
    return _meets_the_criterion(o, lse, ro, rl, naive, name)


def _meets_the_criterion(o, lse, ro, rl, naive, name):
    """``o`` within twice the naive error ``naive`` (plus 1e-5) of the float64 ``ro``,
    finite; rows without a key (``rl = -inf``) exactly ``o = 0``, ``lse = -inf``; the
    others' LSE within 1e-3. Returns the mask of the empty rows."""
    err = (o.double() - ro).abs().max().item()
    assert torch.isfinite(o).all(), name
    assert err <= 2 * naive + 1e-5, f"{name}: err {err:.2e} > 2 x naive {naive:.2e}"
    empty = rl == -math.inf
    assert (lse[empty] == -math.inf).all() and (o[empty] == 0).all(), name
    assert torch.isfinite(lse[~empty]).all(), name
    if (~empty).any():
        assert (lse.double() - rl)[~empty].abs().max().item() < 1e-3, name
    return empty


#: (B, Hq, Hk, Nq, Nk); the last two have more work items than SMs (persistent rounds)
CASES = [(1, 1, 1, 1, 1), (2, 4, 4, 17, 17), (1, 2, 1, 113, 113), (2, 4, 2, 1000, 1000),
         (1, 2, 2, 2049, 2049), (1, 2, 1, 100, 1000), (1, 1, 1, 128, 4096), (1, 3, 3, 256, 300),
         (4, 16, 4, 1000, 1000), (3, 40, 8, 700, 1500)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.gpu
def test_gpu_flash_criterion(case, D, causal, dtype):
    _needs_sm90()
    import flashfold as ff
    from flashfold.kernels.attention import gluon_fwd
    B, HQ, HK, NQ, NK = case
    g = torch.Generator(device="cuda").manual_seed(hash(case) % 1000)
    q = torch.randn(B, HQ, NQ, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, HK, NK, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, HK, NK, D, device="cuda", dtype=dtype, generator=g)
    scale = 1 / math.sqrt(D)
    assert gluon_fwd.eligible(q, k, v, causal=causal, scale=scale)
    with mock.patch.object(gluon_fwd, "gluon_attention_fwd",
                           wraps=gluon_fwd.gluon_attention_fwd) as spy:
        o, lse = ff.attention(q, k, v, causal=causal, return_lse=True)
    assert spy.call_count == 1
    ro, rl = _reference(q, k, v, causal, scale)
    err = (o.double() - ro).abs().max().item()
    naive = (_naive_lowp(q, k, v, causal, scale).double() - ro).abs().max().item()
    assert torch.isfinite(o).all()
    assert err <= 2 * naive + 1e-5, f"err {err:.2e} > 2 x naive {naive:.2e}"
    assert (lse.double() - rl).abs().max().item() < 1e-3


#: (head_dim, head_dim of v) beyond 64 and 128: each other tile plan; q/k in two column
#: chunks (80 = 64 + 16, 96 = 64 + 32, 192 / 128, DeepSeek's MLA, 128 + 64), and with the
#: second chunk padded (72 as 64 + 16, 160 / 128 as 128 + 64)
DIMS = [(32, 32), (80, 80), (96, 96), (256, 256), (192, 128), (72, 72), (160, 128)]
#: the cases of the other head dims: one row, ragged, Nq < Nk, GQA with several rounds
DIM_CASES = [(1, 1, 1, 1, 1), (1, 2, 1, 113, 113), (2, 4, 2, 1000, 1000), (1, 2, 1, 100, 1000),
             (3, 40, 8, 700, 1500)]


@pytest.mark.parametrize("case", DIM_CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dims", DIMS,
                         ids=lambda d: f"d{d[0]}" + (f"-{d[1]}" if d[1] != d[0] else ""))
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.gpu
def test_gpu_head_dims_criterion(case, dims, causal, dtype):
    """The tile plans of head dims other than 64 and 128 (padding columns read as zeros,
    ``Dv != D``) on the Gluon path meet the criterion."""
    _needs_sm90()
    B, HQ, HK, NQ, NK = case
    D, DV = dims
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((case, dims)).encode()))
    q = torch.randn(B, HQ, NQ, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, HK, NK, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, HK, NK, DV, device="cuda", dtype=dtype, generator=g)
    _gluon_meets_the_criterion(q, k, v, f"d{D}/{DV} {case}", causal=causal)


#: (B, Hq, Hk, Nq, Nk) of the window and softcap numerics: GQA, Nq < Nk, Nq > Nk (rows,
#: and with a right bound whole query tiles, that see no key), more items than SMs
FEATURE_CASES = [(1, 1, 1, 1, 1), (2, 4, 4, 17, 17), (2, 4, 2, 1000, 1000),
                 (1, 2, 1, 113, 1500), (1, 3, 3, 700, 300), (4, 16, 4, 1000, 1000)]
#: (id, causal, window): a left or right side alone, both (narrower than a tile, and
#: wide), causal with a left side (Mistral's sliding window), causal clipping a right side
WINDOWS = [("left", False, (200, -1)), ("right", False, (-1, 150)), ("narrow", False, (40, 30)),
           ("wide", False, (300, 500)), ("causal-left", True, (256, -1)),
           ("causal-both", True, (100, 50))]


@pytest.mark.parametrize("case", FEATURE_CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: w[0])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.gpu
def test_gpu_window_criterion(case, window, D, dtype):
    """Sliding windows on the Gluon path (then the strict guard) meet the criterion;
    rows that see no key (Nq > Nk with a right bound) are exactly 0 / -inf."""
    _needs_sm90()
    B, HQ, HK, NQ, NK = case
    name, causal, win = window
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((case, name)).encode()))
    q = torch.randn(B, HQ, NQ, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, HK, NK, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, HK, NK, D, device="cuda", dtype=dtype, generator=g)
    empty = _gluon_meets_the_criterion(q, k, v, f"{name} {case}", causal=causal, window=win)
    if case == (1, 3, 3, 700, 300) and name in ("right", "narrow", "causal-left"):
        assert empty[..., :128].all()               # a whole query tile without keys


#: (id, softcap, q multiplier, window): Gemma-2's cap, and a small cap the scores saturate
SOFTCAPS = [("cap50", 50.0, 1.0, None), ("cap5-saturated", 5.0, 4.0, None),
            ("cap50-window", 50.0, 1.0, (300, 0)), ("cap5-narrow", 5.0, 4.0, (40, 30))]


@pytest.mark.parametrize("case", FEATURE_CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("softcap", SOFTCAPS, ids=lambda c: c[0])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.gpu
def test_gpu_softcap_criterion(case, softcap, D, dtype):
    """Softcapped scores (``c tanh(s / c)``, masks after it) on the Gluon path meet the
    criterion, alone (no flags, no guard) and with windows."""
    _needs_sm90()
    B, HQ, HK, NQ, NK = case
    name, cap, mult, win = softcap
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((case, name)).encode()))
    q = torch.randn(B, HQ, NQ, D, device="cuda", dtype=dtype, generator=g) * mult
    k = torch.randn(B, HK, NK, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, HK, NK, D, device="cuda", dtype=dtype, generator=g)
    _gluon_meets_the_criterion(q, k, v, f"{name} {case}", window=win, softcap=cap)


@pytest.mark.parametrize("window", [(200, 0), (-1, 64), (100, 100)], ids=str)
@pytest.mark.gpu
def test_gpu_window_hidden_nan(window):
    """The non-finite rule on the Gluon path with windows: a NaN value or key hidden from
    a row inside an edge tile reaches no row that cannot see it (the kernel's flags send
    those rows to the strict guard); rows that see it are NaN (all of o for a NaN value,
    o and lse for a NaN key), the others equal the clean problem's, to the criterion."""
    _needs_sm90()
    import flashfold as ff
    from flashfold.kernels.attention import fwd, gluon_fwd
    g = torch.Generator(device="cuda").manual_seed(17)
    q, k, v = (torch.randn(2, 4, 1500, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    ro, rl = _reference(q, k, v, False, 1 / math.sqrt(128), window=window)
    naive = (_naive_lowp(q, k, v, False, 1 / math.sqrt(128), window=window).double()
             - ro).abs().max().item()
    k[1, 1, 1200] = float("nan")
    v[0, 0, 700] = float("nan")
    fwd.plan_cache_clear()
    with mock.patch.object(gluon_fwd, "gluon_attention_fwd",
                           wraps=gluon_fwd.gluon_attention_fwd) as spy:
        o, lse = ff.attention(q, k, v, window=window, return_lse=True)
    assert spy.call_count == 1
    no, nl = _reference(q, k, v, False, 1 / math.sqrt(128), window=window)
    assert torch.isnan(no).any() and not torch.isnan(no).all()
    assert torch.equal(torch.isnan(o), torch.isnan(no))
    assert torch.equal(torch.isnan(lse), torch.isnan(nl))
    fin = ~torch.isnan(no)
    assert (o.double()[fin] - ro[fin]).abs().max().item() <= 2 * naive + 1e-5
    fin = ~torch.isnan(nl)
    assert (lse.double()[fin] - rl[fin]).abs().max().item() < 1e-3


@pytest.mark.gpu
def test_gpu_schedules_give_the_same_bits():
    """The two grids, with and without ping-pong, run the same per-item math in another
    order of issue: bit-identical outputs, dense, causal, windowed and softcapped, with
    several rounds per program."""
    _needs_sm90()
    from flashfold.kernels.attention.gluon_fwd import gluon_attention_fwd
    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(3, 40, 700, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(3, 8, 1500, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    for options in ({}, {"causal": True}, {"left": 300, "right": 0},
                    {"softcap": 30.0, "left": 200, "right": 100}):
        a = gluon_attention_fwd(q, k, v, return_lse=True, persistent=True, pingpong=False,
                                **options)
        for persistent in (True, False):
            for pingpong in (True, False):
                b = gluon_attention_fwd(q, k, v, return_lse=True, persistent=persistent,
                                        pingpong=pingpong, **options)
                assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), \
                    (options, persistent, pingpong)


@pytest.mark.gpu
def test_gpu_strided_layouts_and_triton_agreement():
    """``(B, N, H, D)`` storage (transposed views) and GQA: the Gluon path and the Triton
    template (``FLASHFOLD_GLUON=0``) agree to the criterion's scale."""
    _needs_sm90()
    import flashfold as ff
    g = torch.Generator(device="cuda").manual_seed(3)
    for causal in (False, True):
        q = torch.randn(2, 1000, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
        k = torch.randn(2, 1000, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
        v = torch.randn(2, 1000, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
        o, lse = ff.attention(q, k, v, causal=causal, return_lse=True)
        with mock.patch.dict(os.environ, {"FLASHFOLD_GLUON": "0"}):
            ot, lt = ff.attention(q, k, v, causal=causal, return_lse=True)
        ro, rl = _reference(q, k, v, causal, 1 / math.sqrt(128))
        naive = (_naive_lowp(q, k, v, causal, 1 / math.sqrt(128)).double() - ro).abs().max().item()
        assert (o.double() - ro).abs().max().item() <= 2 * naive + 1e-5
        assert (o.double() - ot.double()).abs().max().item() <= 2 * naive + 1e-5
        assert (lse - lt).abs().max().item() < 1e-4


@pytest.mark.gpu
def test_gpu_backward_through_the_gluon_forward():
    """Autograd: the Gluon forward's o and LSE feed the Triton backward; gradients meet
    the forward's criterion against float64 autograd."""
    _needs_sm90()
    import flashfold as ff
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(1, 4, 700, 64, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    do = torch.randn_like(q)
    for causal in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ff.attention(*leaves, causal=causal).backward(do)
        ref = [t.double().requires_grad_() for t in (q, k, v)]
        _reference(*ref, causal, 1 / 8)[0].backward(do.double())
        low = [t.clone().requires_grad_() for t in (q, k, v)]
        _naive_lowp(*low, causal, 1 / 8).backward(do)
        for a, r, n in zip(leaves, ref, low):
            err = (a.grad.double() - r.grad).abs().max().item()
            naive = (n.grad.double() - r.grad).abs().max().item()
            assert err <= 2 * naive + 1e-5, f"grad err {err:.2e} > 2 x naive {naive:.2e}"


# --- packed sequences (varlen) on the GPU --------------------------------------------------

#: (id, query lengths, key lengths or None (the same), Hq, Hk): awkward lengths (1, 63,
#: 2049), empty sequences, more rows than keys and the reverse, GQA 8:1, and Llama-like
#: packed documents with many tile slots per head
VARLEN_CASES = [("one-row", [1], None, 2, 2), ("awkward", [63, 1000, 2049], None, 4, 2),
                ("empties", [0, 5, 0, 300, 0], None, 2, 1),
                ("cross", [300, 1, 700, 130], [100, 500, 0, 1300], 4, 4),
                ("gqa8", [129, 640, 255], None, 16, 2),
                ("docs", [181, 1286, 640, 900, 77, 1024, 333, 512], None, 8, 2)]
#: (id, causal, window, softcap)
VARLEN_FEATURES = [("dense", False, None, None), ("causal", True, None, None),
                   ("window", False, (100, 30), None), ("causal-left", True, (256, 0), None),
                   ("softcap-causal", True, None, 30.0)]


def _packed(lens_q, lens_k, HQ, HK, D, DV, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(1, HQ, sum(lens_q), D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(1, HK, sum(lens_k), D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(1, HK, sum(lens_k), DV, device="cuda", dtype=dtype, generator=g)
    return q, k, v, cu_q, cu_k


def _per_sequence(q, k, v, cu_q, cu_k, fn, dv):
    """``fn(q_s, k_s, v_s) -> (o, lse)`` of each packed sequence, concatenated (a sequence
    without keys: o = 0, lse = -inf)."""
    os_, ls = [], []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        qs = q[:, :, cq[i]:cq[i + 1]]
        if cq[i + 1] == cq[i]:
            continue
        if ck[i + 1] == ck[i]:
            os_.append(torch.zeros(*qs.shape[:3], dv, dtype=torch.float64, device=q.device))
            ls.append(torch.full(qs.shape[:3], -math.inf, dtype=torch.float64, device=q.device))
            continue
        o, lse = fn(qs, k[:, :, ck[i]:ck[i + 1]], v[:, :, ck[i]:ck[i + 1]])
        os_.append(o.double())
        ls.append(None if lse is None else lse.double())
    return torch.cat(os_, 2), (None if ls[0] is None else torch.cat(ls, 2))


def _varlen_meets_the_criterion(q, k, v, cu_q, cu_k, name, causal, window, softcap,
                                score_mod=None):
    import flashfold as ff
    from flashfold.kernels.attention import fwd, gluon_fwd
    scale = 1 / math.sqrt(q.shape[-1])
    fwd.plan_cache_clear()
    with mock.patch.object(gluon_fwd, "_varlen_launches",
                           wraps=gluon_fwd._varlen_launches) as spy:
        o, lse = ff.attention(q, k, v, causal=causal, window=window, softcap=softcap,
                              cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True,
                              score_mod=score_mod.fn if score_mod is not None else None)
    assert spy.call_count == 1, f"{name}: not the Gluon path"
    # (each sequence as a batch of one: a score_mod here must not read b)
    mod = dict(window=window, softcap=softcap, score_mod=score_mod)
    ro, rl = _per_sequence(q, k, v, cu_q, cu_k,
                           lambda a, b, c: _reference(a, b, c, causal, scale, **mod),
                           v.shape[-1])
    naive, _ = _per_sequence(q, k, v, cu_q, cu_k,
                             lambda a, b, c: (_naive_lowp(a, b, c, causal, scale, **mod), None),
                             v.shape[-1])
    _meets_the_criterion(o, lse, ro, rl, (naive - ro).abs().max().item(), name)
    return o, lse


@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("feature", VARLEN_FEATURES, ids=lambda f: f[0])
@pytest.mark.parametrize("dims", [(64, 64), (128, 128)], ids=lambda d: f"d{d[0]}")
@pytest.mark.gpu
def test_gpu_varlen_criterion(case, feature, dims):
    """Packed sequences on the Gluon path (bf16) meet the criterion against each
    sequence's float64 attention, every feature of the template; rows that see no key
    (empty key sequences; causal with more rows than keys) give exactly 0 / -inf."""
    _needs_sm90()
    name, lens_q, lens_k, HQ, HK = case
    fname, causal, window, softcap = feature
    lens_k = lens_q if lens_k is None else lens_k
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, HQ, HK, *dims, torch.bfloat16,
                                  zlib.crc32(repr((name, fname, dims)).encode()))
    _varlen_meets_the_criterion(q, k, v, cu_q, cu_k, f"{name} {fname}", causal, window, softcap)


@pytest.mark.parametrize("dims", [(256, 256), (192, 128), (96, 96)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.gpu
def test_gpu_varlen_head_dims(dims, causal, dtype):
    """The wide tile plans (head_dim 256 with its output in the query buffer, 192 / 128,
    96 padded to 128) on packed sequences: the ragged tiles' register stores write only
    their rows and columns."""
    _needs_sm90()
    lens = [63, 1000, 0, 2049, 1]
    q, k, v, cu_q, cu_k = _packed(lens, lens, 4, 2, *dims, dtype, 23)
    _varlen_meets_the_criterion(q, k, v, cu_q, cu_k, f"{dims}", causal, None, None)


#: (B, Hq, Hk, Nq, Nk) of the score_mod tests: the last with more query rows than keys
#: (causal: the first query tiles see no key and are not work items, so the kernel's rows
#: start at a later position, which the mod's q_idx must not lose)
MOD_CASES = [(1, 2, 1, 113, 113), (2, 4, 2, 1000, 1000), (1, 2, 2, 2049, 2049),
             (1, 2, 1, 100, 1000), (1, 4, 4, 1000, 300)]
#: (id, causal, window, softcap)
MOD_FEATURES = [("dense", False, None, None), ("causal", True, None, None),
                ("window", False, (100, 30), None), ("softcap-causal", True, None, 30.0)]


#: (case, head_dim): every case at 64, 96 (q/k in two column chunks), 128 and 256 but the
#: rows without keys (128 only)
MOD_GRID = [(c, D) for c in MOD_CASES for D in (64, 96, 128, 256) if c[3] <= c[4] or D == 128]


@pytest.mark.parametrize("case, D", MOD_GRID, ids=lambda c: "x".join(map(str, c))
                         if isinstance(c, tuple) else f"d{c}")
@pytest.mark.parametrize("feature", MOD_FEATURES, ids=lambda f: f[0])
@pytest.mark.parametrize("mod", ["alibi", "relative", "capped"])
@pytest.mark.gpu
def test_gpu_score_mod_criterion(case, D, feature, mod):
    """A score_mod traced into the Gluon kernel (bf16) meets the criterion against the
    float64 attention with the same mod (applied after the softcap, before the masks, to
    the natural-log scores at the rows' and keys' own positions)."""
    _needs_sm90()
    B, HQ, HK, NQ, NK = case
    fname, causal, window, softcap = feature
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((case, fname, mod, D)).encode()))
    q = torch.randn(B, HQ, NQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, HK, NK, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, HK, NK, D, device="cuda", dtype=torch.bfloat16, generator=g)
    _gluon_meets_the_criterion(q, k, v, f"{mod} {fname}", causal, window, softcap,
                               score_mod=_score_mod(mod, HQ))


#: the mask_mods of the block-mask tests: (id, causal, mask_mod(device, nq, nk))
MASK_FEATURES = [("documents-causal", True), ("prefix", False), ("documents", False),
                 ("rows-from-200", False), ("documents-recurring", True)]


def _mask_mod(name, nq, nk):
    """A traced mask_mod on the GPU: 7 documents over the positions (the kernels
    evaluate each row's interval of keys), the same with ids that recur (``-recurring``:
    their table read per key), prefix-LM with a 300-key prefix, or rows before 200
    seeing nothing (whole empty blocks)."""
    from flashfold import mods
    from flashfold.kernels.attention.mods import trace_mask_mod
    if name.startswith("documents"):
        docs = torch.arange(max(nq, nk), device="cuda") * 7 // max(nq, nk)
        return trace_mask_mod(mods.document_mask(docs % 3 if name.endswith("recurring")
                                                 else docs))
    if name == "prefix":
        return trace_mask_mod(mods.prefix_lm_mask(300))

    def rows_from_200(b, h, q_idx, kv_idx):
        return q_idx >= 200
    return trace_mask_mod(rows_from_200)


@pytest.mark.parametrize("case, D", [(c, D) for c, D in MOD_GRID if D <= 128],
                         ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple) else f"d{c}")
@pytest.mark.parametrize("feature", MASK_FEATURES, ids=lambda f: f[0])
@pytest.mark.parametrize("alibi", [False, True], ids=["", "alibi"])
@pytest.mark.gpu
def test_gpu_block_mask_criterion(case, D, feature, alibi):
    """A mask_mod walked as a block mask by the Gluon kernel (PARTIAL blocks masked by the
    traced mask, FULL ones not, empty ones never loaded; rows whose blocks are all empty
    give 0 / -inf), alone and with ALiBi, meets the criterion against float64."""
    _needs_sm90()
    B, HQ, HK, NQ, NK = case
    name, causal = feature
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((case, name, D)).encode()))
    q = torch.randn(B, HQ, NQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, HK, NK, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, HK, NK, D, device="cuda", dtype=torch.bfloat16, generator=g)
    empty = _gluon_meets_the_criterion(
        q, k, v, f"{name} alibi={alibi}", causal, mask_mod=_mask_mod(name, NQ, NK),
        score_mod=_score_mod("alibi", HQ) if alibi else None)
    if name == "rows-from-200":
        assert empty[:, :, :min(200, NQ)].all() and not empty[:, :, 200:].any()


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.gpu
def test_gpu_block_mask_programs_draw_many_items(D):
    """Block-mask calls run persistent programs that draw their items from a counter
    (``DYNAMIC``): with more items than SMs (2 x 8 heads x 16 query tiles = 256) a program
    takes several in turn, its rings and barrier phases running on across them, and every
    item is computed once (causal documents, GQA 4:1, against float64)."""
    _needs_sm90()
    from flashfold.kernels.attention import gluon_fwd
    B, HQ, HK, N = 2, 8, 2, 2048
    assert B * HQ * (N // gluon_fwd.BLOCK_M) > gluon_fwd.num_sms(torch.empty(1, device="cuda"))
    g = torch.Generator(device="cuda").manual_seed(31 + D)
    q = torch.randn(B, HQ, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, HK, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, HK, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    _gluon_meets_the_criterion(q, k, v, f"many items d{D}", True,
                               mask_mod=_mask_mod("documents-causal", N, N))


@pytest.mark.gpu
def test_gpu_block_mask_hidden_nan():
    """The non-finite rule on the block-mask path (counter-drawn items, flags zeroed per
    call and set by the rows they concern): a NaN value at the first key of a document,
    which the PARTIAL tile of the document before loads and hides, reaches exactly the
    rows of its own document that see it (NaN, never a number), in the heads that read
    its KV head; every other row equals the clean problem's, to the criterion."""
    _needs_sm90()
    import flashfold as ff
    from flashfold.kernels.attention import fwd, gluon_fwd
    B, HQ, HK, N, D = 2, 8, 2, 2048, 128
    g = torch.Generator(device="cuda").manual_seed(47)
    q = torch.randn(B, HQ, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, HK, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, HK, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    mask = _mask_mod("documents-causal", N, N)             # documents of 292-293 keys
    scale = 1 / math.sqrt(D)
    ro, rl = _reference(q, k, v, True, scale, mask_mod=mask)
    naive = (_naive_lowp(q, k, v, True, scale, mask_mod=mask).double() - ro).abs().max().item()
    v[0, 1, 293] = float("nan")                            # document 1's first key
    v[1, 0, 1171] = float("nan")                           # document 4's
    fwd.plan_cache_clear()
    with mock.patch.object(gluon_fwd, "gluon_attention_fwd",
                           wraps=gluon_fwd.gluon_attention_fwd) as spy:
        o, lse = ff.attention(q, k, v, causal=True, mask_mod=mask.fn, return_lse=True)
    assert spy.call_count == 1 and spy.call_args.kwargs["block_mask"] is not None
    nan_rows = torch.isnan(o).any(-1)
    expect = torch.zeros_like(nan_rows)
    expect[0, 4:, 293:586] = True                          # (heads 4-7 read KV head 1)
    expect[1, :4, 1171:1463] = True
    assert torch.equal(nan_rows, expect)
    assert torch.isnan(o[expect]).all() and not torch.isnan(lse).any()
    keep = ~expect
    assert (o.double()[keep] - ro[keep]).abs().max().item() <= 2 * naive + 1e-5
    assert (lse.double() - rl).abs().max().item() < 1e-3


@pytest.mark.parametrize("feature", VARLEN_FEATURES, ids=lambda f: f[0])
@pytest.mark.gpu
def test_gpu_varlen_score_mod_criterion(feature):
    """ALiBi on packed sequences: positions inside each sequence."""
    _needs_sm90()
    fname, causal, window, softcap = feature
    lens = [181, 1286, 0, 640, 63]
    q, k, v, cu_q, cu_k = _packed(lens, lens, 8, 2, 128, 128, torch.bfloat16, 37)
    _varlen_meets_the_criterion(q, k, v, cu_q, cu_k, f"alibi {fname}", causal, window,
                                softcap, score_mod=_score_mod("alibi", 8))


@pytest.mark.gpu
def test_gpu_score_mod_nan_and_hidden_keys():
    """A NaN slope of one head reaches that head's rows only (all NaN, never a number); a
    score_mod that hides keys with -inf keeps a hidden key's NaN value out of every row
    (the flags send the tiles to the strict guard), as a mask would."""
    _needs_sm90()
    import flashfold as ff
    from flashfold import mods, ops
    g = torch.Generator(device="cuda").manual_seed(43)
    q, k, v = (torch.randn(2, 4, 700, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    slopes = mods.alibi_slopes(4).clone()
    slopes[1] = float("nan")
    o = ff.attention(q, k, v, causal=True, score_mod=mods.alibi(4, slopes))
    assert torch.isnan(o[:, 1]).all() and torch.isfinite(o[:, [0, 2, 3]]).all()

    def hide_future(score, b, h, q_idx, kv_idx):
        return ops.where(kv_idx <= q_idx, score, float("-inf"))
    clean = ff.attention(q, k, v, causal=True)
    v[:, :, 500] = float("nan")
    o = ff.attention(q, k, v, score_mod=hide_future)
    assert torch.isnan(o[:, :, 500:]).all(-1).all()
    scale = 1 / math.sqrt(128)
    ro, _ = _reference(q[:, :, :500], k[:, :, :500], v[:, :, :500], True, scale)
    bound = (_naive_lowp(q[:, :, :500], k[:, :, :500], v[:, :, :500], True, scale).double()
             - ro).abs().max().item()
    assert (o[:, :, :500].double() - ro).abs().max().item() <= 2 * bound + 1e-5
    assert (o[:, :, :500].double() - clean[:, :, :500].double()).abs().max().item() \
        <= 2 * bound + 1e-5


@pytest.mark.gpu
def test_gpu_varlen_nan_stays_in_its_sequence():
    """A NaN value at the start of one packed sequence, which the tiles of the sequence
    before read past its end: the rows of that sequence that see the key are NaN, no row
    of any other sequence is (the flags send the leaking tiles to the strict guard), and
    the rest equal the clean problem's."""
    _needs_sm90()
    import flashfold as ff
    lens = [300, 700, 200]
    q, k, v, cu_q, cu_k = _packed(lens, lens, 4, 2, 128, 128, torch.bfloat16, 29)
    scale = 1 / math.sqrt(128)
    ro, _ = _per_sequence(q, k, v, cu_q, cu_k,
                          lambda a, b, c: _reference(a, b, c, True, scale), 128)
    naive, _ = _per_sequence(q, k, v, cu_q, cu_k,
                             lambda a, b, c: (_naive_lowp(a, b, c, True, scale), None), 128)
    bound = (naive - ro).abs().max().item()
    v[0, 1, 300] = float("nan")                  # the second sequence's first key
    o = ff.attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    nan_rows = torch.isnan(o).any(-1)[0]         # (Hq, N)
    # heads 2 and 3 read KV head 1; in the second sequence every row sees its first key
    assert nan_rows[2:, 300:1000].all() and not nan_rows[:2].any()
    assert not nan_rows[:, :300].any() and not nan_rows[:, 1000:].any()
    keep = ~torch.isnan(o)
    assert (o.double()[keep] - ro[keep]).abs().max().item() <= 2 * bound + 1e-5


@pytest.mark.gpu
def test_gpu_varlen_equals_the_triton_template_and_padded_batches():
    """Packed equal lengths against the same batch unpacked (the Gluon kernel on both:
    the same per-item math, so the same bits), and against the Triton template's varlen
    (``FLASHFOLD_GLUON=0``) to the criterion's scale."""
    _needs_sm90()
    import flashfold as ff
    g = torch.Generator(device="cuda").manual_seed(31)
    q, k, v = (torch.randn(3, 8, 700, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    packed = [t.transpose(0, 1).reshape(1, 8, 2100, 128) for t in (q, k, v)]
    cu = torch.tensor([0, 700, 1400, 2100], device="cuda", dtype=torch.int32)
    for causal in (False, True):
        ro, _ = _reference(q, k, v, causal, 1 / math.sqrt(128))
        bound = (_naive_lowp(q, k, v, causal, 1 / math.sqrt(128)).double() - ro).abs().max().item()
        o, lse = ff.attention(q, k, v, causal=causal, return_lse=True)
        op, lp = ff.attention(*packed, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
                              return_lse=True)
        assert torch.equal(op.reshape(8, 3, 700, 128).transpose(0, 1), o)
        assert torch.equal(lp.reshape(8, 3, 700).transpose(0, 1), lse)
        with mock.patch.dict(os.environ, {"FLASHFOLD_GLUON": "0"}):
            ot, lt = ff.attention(*packed, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                  return_lse=True)
        assert (op.double() - ot.double()).abs().max().item() <= 2 * bound + 1e-5
        assert (lp - lt).abs().max().item() < 1e-4


if __name__ == "__main__":
    _compile_all()
