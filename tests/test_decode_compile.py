"""The decode kernels compiled ahead of time for the H200 (sm_90) with Triton's real
compiler, on the CPU: every constexpr branch compiles (nothing interpreter-only), without
register spills, within shared memory, with the K/V tiles multi-buffered (cp.async
pipelining, paged as well as contiguous). Runs in a subprocess because the interpreter is
chosen when kernels are defined (conftest sets TRITON_INTERPRET=1 without a GPU)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from compile_worker import SMEM_LIMIT, spill_budgets_apply  # SMEM_LIMIT: opt-in, per block

SCRIPT = textwrap.dedent(r'''
    import json, os, re, sys
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    from flashfold.kernels.decode import splitkv
    from flashfold.kernels.aot import compile_launch

    def variant(name, dtype=torch.bfloat16, hq=32, hkv=8, q_len=1, d=128, page=None,
                splits=4, batch=2, fp8=False, **kw):
        q = torch.zeros(batch, hq, q_len, d, dtype=dtype)
        kv = torch.float8_e4m3fn if fp8 else dtype
        if page is None:
            k = torch.zeros(batch, hkv, 1024, d, dtype=kv)
            table = None
        else:
            k = torch.zeros(batch * 1024 // page, page, hkv, d, dtype=kv)
            table = torch.zeros(batch, 1024 // page, dtype=torch.int32)
        if fp8:
            kw["k_descale"] = kw["v_descale"] = torch.ones(batch, hkv)
        lens = torch.full((batch,), 1000, dtype=torch.int32)
        if not kw.get("batch_invariant"):
            kw["num_splits"] = splits
        kw.setdefault("pdl", True)            # the defaults on sm_90 (off on the CPU)
        kw.setdefault("tma", False)           # the pointer path (TMA: the _tma variants)
        launch = splitkv.prepare(q, k, k, lens, table, scale=0.1, **kw)
        out = {}
        for kind, kernel, spec in (("split", splitkv._splitkv_kernel, launch.split),
                                   ("merge", splitkv._merge_kernel, launch.merge)):
            if spec is None:
                continue
            info = compile_launch(kernel, spec[1], spec[2])
            # K/V tile buffers: memdescs of >= 3 dims (stage x tile) in the data dtype
            bufs = [int(n) for n in re.findall(r"memdesc<(\d+)x\d+x\d+(?:x\d+)*x(?:bf16|f16|f32|f8E4M3FN)",
                                               info.ttgir)]
            # copies left in flight at a loop's first wait (async_wait num): the software
            # pipeline overlaps the next tiles' loads with this tile's math only if > 0
            waits = []
            for body in info.ttgir.split("scf.for")[1:]:
                found = re.findall(r"async_wait[^{]*\{num = (\d+)", body.split("scf.yield")[0])
                waits.append(int(found[0]) if found else 0)
            out[kind] = dict(shared=info.shared, registers=info.registers, in_flight=max(waits or [0]),
                             spill=info.spill_bytes, kv_buffers=max(bufs) if bufs else 0,
                             cp_async="cp.async" in info.ptx,
                             pdl="griddepcontrol" in info.ptx,
                             tma="cp.async.bulk.tensor" in info.ptx,
                             evict_first="L2::evict_first" in info.ptx,
                             # fusable arithmetic: mul/add/sub without a rounding mode
                             # (ptxas may fuse them) or LLVM's contracted fma.rn.f32 (the
                             # math library's own fma.rn.ftz are written out, not fused)
                             contracts=bool(re.search(r"\b(?:mul|add|sub)\.f32\b|\bfma\.rn\.f32\b",
                                                      info.ptx)))
        return name, out

    cases = [
        variant("contiguous"),
        variant("paged16", page=16),
        variant("paged64", page=64),
        variant("paged16_q4_window_softcap", page=16, q_len=4, window=(100, None), softcap=30.0),
        variant("single_split", splits=1),
        variant("invariant", batch_invariant=True),
        # a batch large enough for one program per sequence: it folds its splits (FOLD)
        variant("invariant_fold", batch_invariant=True, batch=256),
        variant("rowblocks_q16_group8", hq=64, hkv=8, q_len=16, page=16),
        variant("fp16_d64_mqa", dtype=torch.float16, hkv=1, d=64),
        variant("fp32", dtype=torch.float32),
        variant("d256", d=256, page=16),
        variant("paged24", page=24),
        variant("no_pdl", pdl=False),
        variant("contiguous_tma", tma=True),
        variant("paged64_tma", page=64, tma=True),
        variant("invariant_tma", batch_invariant=True, tma=True),
        # a first key per sequence (left padding): masked first tile, clipped page lookups
        variant("paged16_start_window", page=16, q_len=4, window=(100, None),
                cache_start=torch.zeros(2, dtype=torch.int32)),
        variant("invariant_start", batch_invariant=True,
                cache_start=torch.zeros(2, dtype=torch.int32)),
        variant("paged64_start_tma", page=64, tma=True,
                cache_start=torch.zeros(2, dtype=torch.int32)),
        # masked tiles that hide keys of the sequence (q_len > 1, window): the non-finite
        # value check and its rare sanitized P V, through TMA and in fixed splits
        variant("q4_tma", q_len=4, tma=True),
        variant("invariant_q4_window", batch_invariant=True, q_len=4, window=(100, None)),
        # E4M3 caches: tiles widened to fp16 as they are loaded, descales folded in
        variant("fp8", fp8=True),
        variant("fp8_paged16_q4_window_softcap", fp8=True, page=16, q_len=4,
                window=(100, None), softcap=30.0),
        variant("fp8_tma", fp8=True, tma=True),
        variant("invariant_fp8", fp8=True, batch_invariant=True),
    ]
    print(json.dumps(dict(cases)))
''')


@pytest.fixture(scope="module")
def compiled():
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root / "src") + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_variant_compiles_without_spills(compiled):
    assert len(compiled) == 25
    for name, kernels in compiled.items():
        for kind, info in kernels.items():
            if spill_budgets_apply():
                assert info["spill"] == 0, (name, kind, info)
            assert info["shared"] <= SMEM_LIMIT, (name, kind, info)
            assert 0 < info["registers"] <= 255, (name, kind, info)


TMA = {"contiguous_tma", "paged64_tma", "invariant_tma", "paged64_start_tma", "q4_tma",
       "fp8_tma"}


def test_split_kernel_pipelines_kv(compiled):
    """K/V tiles multi-buffered: through TMA boxes (contiguous caches, pages a multiple of
    the key tile), or through cp.async (the masked edge tiles' plain loads with an L2
    evict_first hint: Triton 3.6 drops it from the pipelined cp.async)."""
    for name, kernels in compiled.items():
        split = kernels["split"]
        assert split["tma"] == (name in TMA), (name, split)
        assert split["tma"] or (split["cp_async"] and split["evict_first"]), name
        if name != "fp32":                 # fp32: 2 stages, i.e. one tile in flight
            assert split["kv_buffers"] >= 2, (name, split)
            # cp.async: the next tile's K and V (and, paged, its page numbers) stay in
            # flight at the loop's wait; TMA waits on barriers instead
            assert split["tma"] or split["in_flight"] >= 2, (name, split)


def test_invariant_kernels_round_every_operation_as_written(compiled):
    """Batch-invariant kernels compile without FP contraction (every mul/add/sub in their
    PTX is ``.rn``, no contracted ``fma.rn.f32``; ptxas gets ``--fmad=false``): the merge
    kernel and a FOLD program must round their combines alike, whichever products each
    compiler context would have fused. The default mode keeps contraction."""
    for name, kernels in compiled.items():
        for kind, info in kernels.items():
            assert info["contracts"] == (not name.startswith("invariant")), (name, kind)


def test_merge_pass_only_with_several_splits(compiled):
    assert "merge" not in compiled["single_split"] and "merge" not in compiled["invariant_fold"]
    assert "merge" in compiled["contiguous"] and "merge" in compiled["invariant"]


def test_merge_launches_programmatically(compiled):
    """On sm_90 the merge kernel is launched with programmatic dependent launch: the split
    kernel signals, the merge waits (griddepcontrol) before reading the partials."""
    for name, kernels in compiled.items():
        if "merge" in kernels:
            want = name != "no_pdl"
            assert kernels["split"]["pdl"] == want and kernels["merge"]["pdl"] == want, name
    assert not compiled["single_split"]["split"]["pdl"]
