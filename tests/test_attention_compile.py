"""The attention kernels through the *real* Triton compiler, for sm_90, on a CPU machine.

Triton's NVIDIA backend compiles for any target without a GPU, so CI checks what the
interpreter cannot: every dispatch variant compiles (no interpreter-only construct), the
Hopper path really uses TMA and wgmma, nothing spills, shared memory fits the H200's 227 KB.
The compilation runs in a subprocess without ``TRITON_INTERPRET`` (this file is the worker).
"""

from __future__ import annotations

import json
import math
import re

import pytest

from compile_worker import SMEM_LIMIT, spill_budgets_apply, worker_rows


def _variants():
    """(id, launch keywords, shapes) of the variants to compile: the default Hopper config of
    each head dim, the pointer fallback, and every feature flag at least once."""
    from flashfold.kernels.attention.fwd import HOPPER_CONFIGS, FwdConfig

    def cfg(d, tma=True, causal=False):
        bm, bn, w, s = HOPPER_CONFIGS[(d, causal)]
        return FwdConfig(bm, bn, w, s, use_tma=tma)
    out = []
    for d in (64, 128, 256):
        out.append((f"d{d}-tma", dict(D=d, config=cfg(d)), True))
        out.append((f"d{d}-causal-tma", dict(D=d, causal=True, config=cfg(d, causal=True)), True))
    out.append(("d128-pointers", dict(D=128, config=cfg(128, False)), False))
    out.append(("d96-padded-tma", dict(D=96, config=cfg(128)), True))
    out.append(("d80-padded-tma", dict(D=80, config=cfg(128)), True))
    out.append(("d128-causal-fp16", dict(D=128, causal=True, dtype="float16", config=cfg(128, causal=True)), True))
    out.append(("d128-window-softcap", dict(D=128, window=(256, 0), softcap=30.0, config=cfg(128, causal=True)), True))
    # "everything" has a right bound (window (512, 0)): the causal table entry applies
    out.append(("d128-everything-tma", dict(D=128, everything=True, config=cfg(128, causal=True)), True))
    out.append(("d128-everything-pointers", dict(D=128, everything=True, config=cfg(128, False, causal=True)), False))
    out.append(("d64-varlen-blockmask-pointers", dict(D=64, varlen=True, config=cfg(64, False)), False))
    # the FP8 flag (E4M3 q, k, v; P quantized for an 8-bit P V): dense, causal, a window
    # (flagged for the guard), head dim 256, and packed sequences through pointers
    out.append(("d128-fp8-tma", dict(D=128, fp8=True, config=cfg(128)), True))
    out.append(("d128-causal-fp8-tma", dict(D=128, fp8=True, causal=True, config=cfg(128, causal=True)), True))
    out.append(("d128-window-softcap-fp8-tma", dict(D=128, fp8=True, window=(256, 0), softcap=30.0,
                                                    config=cfg(128, causal=True)), True))
    out.append(("d256-causal-fp8-tma", dict(D=256, fp8=True, causal=True, config=cfg(256, causal=True)), True))
    out.append(("d64-varlen-fp8-pointers", dict(D=64, fp8=True, varlen_only=True, config=cfg(64, False)), False))
    return out


def _compile_all():
    """Worker: compile every variant, print one JSON line per variant."""
    import torch

    from flashfold import mods
    from flashfold.kernels.attention import fwd, merge
    from flashfold.kernels.aot import compile_launch
    from flashfold.kernels.attention.mods import compute_block_mask, trace_score_mod

    for vid, kw, want_tma in _variants():
        try:
            D = kw["D"]
            dtype = torch.float8_e4m3fn if kw.get("fp8") else getattr(torch, kw.get("dtype", "bfloat16"))
            N, H, HK = 1024, 4, 2
            q = torch.empty(1, H, N, D, dtype=dtype)
            k = torch.empty(1, HK, N, D, dtype=dtype)
            v = torch.empty(1, HK, N, D, dtype=dtype)
            if kw.get("fp8"):
                # (an E4M3 v keys-contiguous, as flashfold.attention passes it)
                v = torch.empty(1, HK, D, N, dtype=dtype).transpose(2, 3)
            left, right = kw.get("window", (None, None))
            if kw.get("causal"):
                right = 0
            extra = {}
            if kw.get("everything") or kw.get("varlen"):
                docs = torch.arange(N) // 300
                mm = compute_block_mask(
                    __import__("flashfold.kernels.attention.mods", fromlist=["x"]).trace_mask_mod(
                        mods.document_mask(docs)),
                    batch=1, heads=H, q_len=N, kv_len=N, block_m=kw["config"].block_m,
                    block_n=kw["config"].block_n, device="cpu")
                extra.update(block_mask=mm, full_needs_mask=bool(kw.get("varlen")))
            if kw.get("everything"):
                extra.update(score_mod=trace_score_mod(mods.alibi(H)), softcap=20.0)
                left, right = 512, 0
            if kw.get("varlen") or kw.get("varlen_only"):
                cu = torch.tensor([0, 300, 1024], dtype=torch.int32)
                extra.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=724, max_seqlen_k=724)
            if kw.get("fp8"):
                rows = 2 if kw.get("varlen_only") else 1
                extra.update(descales=tuple(torch.empty(rows, HK) for _ in range(3)),
                             out_dtype=torch.bfloat16)
            extra.setdefault("softcap", kw.get("softcap"))
            _, _, (grid, args, kwargs) = fwd.prepare_forward(
                q, k, v, scale=1 / math.sqrt(D), left=left, right=right, config=kw["config"],
                interpret=False, flagged=left is not None or "cu_seqlens_q" in extra, **extra)
            info = compile_launch(fwd._attn_fwd, args, kwargs)
            e4m3 = "e4m3" in " ".join(l for l in info.ptx.splitlines() if "wgmma.mma_async" in l)
            # single-byte stores to shared memory: an 8-bit tile rearranged element by
            # element (an E4M3 V transposed for its K-major product)
            byte_stores = len(re.findall(r"st\.shared(\.v\d)?\.[bu]8\b", info.ptx))
            print(json.dumps(dict(id=vid, ok=True, regs=info.registers, spill=info.spill_bytes,
                                  smem=info.shared, tma=info.uses_tma, wgmma=info.uses_wgmma,
                                  want_tma=want_tma, e4m3=e4m3, byte_stores=byte_stores)),
                  flush=True)
        except Exception as e:  # reported, then asserted by the test
            print(json.dumps(dict(id=vid, ok=False, error=repr(e)[-2000:])), flush=True)
    # the merge kernel generated from ATTENTION's combine (stacked and pair forms)
    from flashfold.kernels.codegen import triton_monoid
    from flashfold.monoids import ATTENTION
    fns = triton_monoid(ATTENTION)
    for pair in (False, True):
        try:
            o = torch.empty(3, 2, 4, 100, 128, dtype=torch.bfloat16)
            lse = torch.empty(3, 2, 4, 100, dtype=torch.float32)
            out = torch.empty(2, 4, 100, 128, dtype=torch.bfloat16)
            lo = torch.empty(2, 4, 100, dtype=torch.float32)
            args = [o, lse, o[1] if pair else None, lse[1] if pair else None, out, lo, 3, 800, 4,
                    100, 128, *o.stride(), *lse.stride(), *(o[1].stride() if pair else [0] * 4),
                    *(lse[1].stride() if pair else [0] * 3), *out.stride(), *lo.stride(),
                    fns.lift, fns.combine, fns.finalize]
            info = compile_launch(merge._merge_kernel, args, dict(
                PAIR=pair, BLOCK_R=merge.rows_per_program(128), BLOCK_D=128, INTERPRET=False, num_warps=4))
            print(json.dumps(dict(id=f"merge-{'pair' if pair else 'stacked'}", ok=True,
                                  regs=info.registers, spill=info.spill_bytes, smem=info.shared,
                                  tma=False, wgmma=False, want_tma=False)), flush=True)
        except Exception as e:
            print(json.dumps(dict(id=f"merge-{pair}", ok=False, error=repr(e)[-2000:])), flush=True)


@pytest.fixture(scope="module")
def compiled():
    return {r["id"]: r for r in worker_rows(__file__)}


EXPECTED = [v[0] for v in [("d64-tma",), ("d128-tma",), ("d256-tma",), ("d128-pointers",),
                           ("d96-padded-tma",), ("d80-padded-tma",), ("d128-causal-fp16",), ("d128-window-softcap",),
                           ("d128-everything-tma",), ("d128-everything-pointers",),
                           ("d64-varlen-blockmask-pointers",), ("d128-fp8-tma",),
                           ("d128-causal-fp8-tma",), ("d128-window-softcap-fp8-tma",),
                           ("d256-causal-fp8-tma",), ("d64-varlen-fp8-pointers",),
                           ("merge-stacked",), ("merge-pair",)]]


@pytest.mark.parametrize("vid", EXPECTED)
def test_compiles_for_sm90(compiled, vid):
    r = compiled.get(vid)
    assert r is not None, f"{vid} was not compiled"
    assert r["ok"], r.get("error")
    if spill_budgets_apply():
        assert r["spill"] == 0, f"{vid}: {r['spill']} bytes of register spills ({r['regs']} regs)"
    assert r["smem"] <= SMEM_LIMIT, f"{vid}: {r['smem']} bytes of shared memory"
    if vid.startswith("d"):
        assert r["wgmma"], f"{vid}: no wgmma in the PTX"
        assert r["tma"] == r["want_tma"], f"{vid}: TMA use {r['tma']}, expected {r['want_tma']}"
        # E4M3 products exactly where the FP8 flag is on (both matmuls on 8-bit operands)
        assert r["e4m3"] == ("fp8" in vid), f"{vid}: E4M3 wgmma {r['e4m3']}"
        if "fp8" in vid and r["want_tma"]:
            # V's tiles reach the 8-bit P V product K-major as TMA wrote them
            assert r["byte_stores"] == 0, f"{vid}: {r['byte_stores']} byte stores to shared"


if __name__ == "__main__":
    _compile_all()
