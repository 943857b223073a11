"""The warp-specialized Gluon backward (``kernels/attention/gluon_bwd.py``).

On the CPU (CI): its scope, the dispatch from the backward's launcher, and every variant
through the real compiler for sm_90 in a subprocess (warp-specialized, TMA, wgmma,
per-warpgroup barriers, dQ added by TMA reduce-adds, shared memory within the limit). On the GPU (marked ``gpu``): dQ, dK, dV against float64 autograd with
FlashAttention's criterion (at most 2x the error of a naive low-precision backward) over
awkward lengths, GQA, causal with ``Nq < Nk``, fp16 and bf16, and agreement with the
Triton kernels.
"""

from __future__ import annotations

import functools
import math
import re
import zlib
from unittest import mock

import pytest
import torch

from compile_worker import (assert_warp_specialized, emit_rows, gluon_rows,
                            spill_budgets_apply, ws_facts)
from test_attention_gluon import _naive_lowp, _needs_sm90, _qkv, _reference, _score_mod

#: (id, causal, dtype, dK/dV by TMA stores, head_dim, warpgroups take turns, persistent[,
#: late_stats]) of the variants compiled on the CPU (None: the default rule,
#: :func:`pingpong_default` and :func:`persistent_default`; late_stats False if absent).
#: The shape is GQA (4 query heads on 2): the consumers' head loop is not specialized away.
VARIANTS = [("dense", False, "bfloat16", True, 128, None, None),
            ("causal", True, "bfloat16", True, 128, None, None),
            ("causal-no-turns", True, "bfloat16", True, 128, False, None),
            ("dense-turns", False, "bfloat16", True, 128, True, None),
            ("dense-persistent", False, "bfloat16", False, 128, None, True),
            ("dense-fp16", False, "float16", True, 128, None, None),
            ("causal-fp16", True, "float16", True, 128, None, None),
            ("dense-register-stores", False, "bfloat16", False, 128, None, None),
            ("dense-d64", False, "bfloat16", False, 64, None, None),
            ("dense-d64-one-tile", False, "bfloat16", True, 64, None, False),
            ("causal-d64", True, "bfloat16", True, 64, None, None),
            ("dense-d64-one-tile-register-stores", False, "bfloat16", False, 64, None, False),
            ("dense-late-stats", False, "bfloat16", True, 128, None, None, True),
            ("causal-late-stats", True, "bfloat16", True, 128, None, None, True),
            ("dense-persistent-late-stats", False, "bfloat16", False, 128, None, True, True),
            # windows, softcap and padded head dims (the model rows: Mistral's window 4096,
            # Phi-3's head_dim 96 with window 2047, Phi-2's 80, MiniLM's 32)
            ("window", True, "bfloat16", None, 128, None, None, True, dict(left=300)),
            ("window-left-only", False, "bfloat16", None, 128, None, None, True,
             dict(left=300)),
            ("window-two-sided", False, "bfloat16", None, 128, None, None, True,
             dict(left=200, right=100)),
            ("softcap", False, "bfloat16", None, 128, None, None, True, dict(softcap=30.0)),
            ("softcap-window", True, "bfloat16", None, 128, None, None, True,
             dict(left=300, softcap=30.0)),
            ("d96-window", True, "bfloat16", None, 96, None, None, True, dict(left=300)),
            ("d80", False, "bfloat16", None, 80, None, None, True),
            ("d80-register-stores", False, "bfloat16", False, 80, None, False, True),
            ("d32", False, "float16", None, 32, None, None),
            ("d48-causal", True, "bfloat16", None, 48, None, None),
            # the WIDE variant (head dims past 128, Dv != D): Gemma's 256 with softcap and
            # window, DeepSeek's MLA (192 / 128), an awkward 160
            # (no tile options: None)
            ("wide-d256", False, "bfloat16", None, 256, None, None, None),
            ("wide-d256-causal", True, "bfloat16", None, 256, None, None, None),
            ("wide-d256-window-softcap", True, "bfloat16", None, 256, None, None, None,
             dict(left=300, softcap=50.0)),
            ("wide-d256-two-sided-fp16", False, "float16", None, 256, None, None, None,
             dict(left=200, right=100)),
            ("wide-mla", False, "bfloat16", None, 192, None, None, None, None, 128),
            ("wide-mla-causal", True, "bfloat16", None, 192, None, None, None, None, 128),
            ("wide-d160-causal", True, "bfloat16", None, 160, None, None, None),
            # deterministic calls: dQ added in a fixed order by two writer warps
            ("det-dense", False, "bfloat16", None, 128, None, None, None,
             dict(deterministic=True)),
            ("det-causal", True, "bfloat16", None, 128, None, None, None,
             dict(deterministic=True)),
            ("det-d64-window", True, "bfloat16", None, 64, None, None, None,
             dict(deterministic=True, left=300)),
            ("det-softcap-two-sided", False, "float16", None, 96, None, None, None,
             dict(deterministic=True, left=200, right=100, softcap=30.0)),
            ("det-wide-d256-causal", True, "bfloat16", None, 256, None, None, None,
             dict(deterministic=True)),
            ("det-wide-mla", False, "bfloat16", None, 192, None, None, None,
             dict(deterministic=True), 128),
            # head_dim-64 dense: persistent programs (the default), the writers walking
            # the program's key tiles too; and one program per key tile
            ("det-d64-dense", False, "bfloat16", None, 64, None, None, None,
             dict(deterministic=True)),
            ("det-d64-dense-one-tile", False, "bfloat16", None, 64, None, False, None,
             dict(deterministic=True)),
            # packed sequences (of 100, 600 and 300 rows): one program per key-tile slot,
            # dK and dV from registers (no tile options: None)
            ("varlen-causal", True, "bfloat16", None, 128, None, None, None,
             dict(varlen=True)),
            ("varlen-dense-fp16", False, "float16", None, 128, None, None, None,
             dict(varlen=True)),
            ("varlen-d64-window-softcap", False, "bfloat16", None, 64, None, None, None,
             dict(varlen=True, left=100, right=20, softcap=30.0)),
            # score_mod and block masks (the workload grid's mod rows: ALiBi, prefix-LM,
            # causal documents), traced into the kernel
            ("mod-alibi-causal", True, "bfloat16", None, 128, None, None, None,
             dict(mods="alibi")),
            ("mod-capped-causal", True, "bfloat16", None, 128, None, None, None,
             dict(mods="capped")),
            ("mod-alibi-softcap-d64", False, "float16", None, 64, None, None, None,
             dict(mods="alibi", softcap=30.0)),
            ("mod-alibi-det", True, "bfloat16", None, 128, None, None, None,
             dict(mods="alibi", deterministic=True)),
            ("varlen-mod-alibi-causal", True, "bfloat16", None, 128, None, None, None,
             dict(mods="alibi", varlen=True)),
            ("wide-mod-alibi-d256-softcap", True, "bfloat16", None, 256, None, None, None,
             dict(mods="alibi", softcap=50.0)),
            ("wide-mod-alibi-mla", False, "bfloat16", None, 192, None, None, None,
             dict(mods="alibi"), 128),
            ("mask-prefix-lm", False, "bfloat16", None, 128, None, None, None,
             dict(mods="prefix")),
            ("mask-documents-d64", False, "bfloat16", None, 64, None, None, None,
             dict(mods="documents")),
            ("mask-recurring-documents", False, "bfloat16", None, 128, None, None, None,
             dict(mods="recurring")),
            ("mask-documents-alibi", False, "bfloat16", None, 128, None, None, None,
             dict(mods="documents+alibi"))]


def _mods(which: str, B: int, H: int, N: int) -> dict:
    """The ``score_mod`` / ``block_mask`` keywords of a compile variant's ``mods``:
    ``alibi``, ``capped`` (tanh and sigmoid: ``test_attention_gluon._score_mod``),
    ``prefix`` (prefix-LM, 300 rows), ``documents`` (causal, four documents:
    evaluated as each row's interval of keys), ``recurring`` (causal, documents 0 and 2
    sharing an id: their table read per key), joined by ``+``."""
    import flashfold as ff
    from flashfold import mods
    from flashfold.kernels.attention.mods import trace_score_mod
    out = {}
    for part in which.split("+"):
        if part == "alibi":
            out["score_mod"] = trace_score_mod(mods.alibi(H))
        elif part == "capped":
            out["score_mod"] = _score_mod("capped", H)
        else:
            docs = torch.arange(N) * 4 // N
            mm = (mods.prefix_lm_mask(300) if part == "prefix" else mods.and_masks(
                mods.causal_mask, mods.document_mask(docs % 2 if part == "recurring" else docs)))
            out["block_mask"] = ff.create_block_mask(mm, None, None, N, N, device="cpu")
    return out

#: the packed sequences of the "varlen-" variants
VARLEN_CU = [0, 100, 700, 1000]


def _compile_all():
    """Worker: compile every variant, one JSON line each."""
    from flashfold.kernels.aot import _run_on_cubin, compile_launch
    from flashfold.kernels.attention import gluon_bwd as G

    def facts(causal, dtype, tma_store, D, pingpong, persistent, late_stats=False,
              features=None, dv=None):
        features = dict(features or {})
        batch = 2
        if "mods" in features:
            features.update(_mods(features.pop("mods"), batch, 4, 1000))
        if features.pop("varlen", False):
            cu = torch.tensor(VARLEN_CU, dtype=torch.int32)
            features.update(cu_seqlens_q=cu, cu_seqlens_k=cu)
            batch = 1
        q = torch.empty(batch, 4, 1000, D, dtype=getattr(torch, dtype))
        k = torch.empty(batch, 2, 1000, D, dtype=q.dtype)
        v = torch.empty(batch, 2, 1000, dv or D, dtype=q.dtype)
        do = torch.empty(batch, 4, 1000, dv or D, dtype=q.dtype)
        lam = torch.empty(batch, 4, 1000)
        if "cu_seqlens_q" in features:      # (laid out apart: stats_rows)
            lam = torch.empty(1, 4, G.stats_length(1000, len(VARLEN_CU) - 1))
        acc = torch.empty(batch, 4, 1000, D)
        kernel, _, args, kwargs = G.gluon_attention_bwd(q, k, v, do, lam, lam, acc, k, v,
                                                        causal=causal, scale=0.1, launch=False,
                                                        tma_store=tma_store, pingpong=pingpong,
                                                        persistent=persistent,
                                                        late_stats=late_stats,
                                                        **features)
        c = compile_launch(kernel, args, kwargs)
        sass = _run_on_cubin(c.cubin, "-sass")
        return dict(**ws_facts(c), tma_reduce="UTMAREDG" in sass, tma_store="UTMASTG" in sass,
                    red=sorted(set(re.findall(r"\bREDG?\.\S*", sass))), tma_store_asked=kwargs["STORE_TMA"],
                    det=kwargs["DETERMINISTIC"], spin="ld.acquire.gpu" in c.ptx,
                    tiles_outside=kwargs["TILES_OUTSIDE"],
                    varlen=kwargs.get("VARLEN", False),
                    column_bounds=kwargs.get("COLUMN_BOUNDS", False))

    emit_rows(VARIANTS, facts)


@pytest.fixture(scope="module")
def compiled():
    return gluon_rows(__file__)


@pytest.mark.parametrize("vid", [v[0] for v in VARIANTS])
def test_compiles_warp_specialized_for_sm90(compiled, vid):
    r = compiled.get(vid)
    assert_warp_specialized(r, vid)
    # dQ is added by TMA reduce-adds of whole tiles, not by per-thread atomics (those
    # cost 45% of the kernel's time in the first version: 363 against 641 TFLOP/s); a
    # deterministic call's only atomics are its writers' counter releases
    assert r["tma_reduce"]
    assert r["red"] == (["REDG.E.ADD.S32.STRONG.GPU"] if r["det"] else []), r["red"]
    assert r["spin"] == r["det"]       # the writers wait for their turn
    # (GQA) deterministic walks without a left bound take the query tiles outside the
    # group's heads
    assert r["tiles_outside"] == (r["det"] and vid not in LEFT_BOUNDED), vid
    # dK, dV leave by TMA stores exactly in the variants that ask for them
    assert r["tma_store"] == r["tma_store_asked"]
    assert r["varlen"] == vid.startswith("varlen-") and not (r["varlen"] and r["tma_store"])
    # a document mask's columns are intervals of queries, read once per key and head (the
    # recurring documents' are not: their table is read per pair)
    assert r["column_bounds"] == vid.startswith("mask-documents"), r


@pytest.mark.parametrize("early, late", [("dense", "dense-late-stats"),
                                         ("causal", "causal-late-stats"),
                                         ("dense-persistent", "dense-persistent-late-stats")])
def test_late_stats_spill_less_at_head_dim_128(compiled, early, late):
    """Reading lambda and D after the waits of S^T and dP^T (``late_stats``) keeps their
    32 registers per thread out of the step's peak, next to the four wgmma accumulators:
    the reason for the option. sm_90 compile, spill stores in bytes, at these variants'
    GQA shape (2 x 4 query heads, 2 key heads, N = 1000): dense 420 -> 264, causal
    424 -> 256, persistent 356 -> 156 (``benchmarks/gluon_bwd_sass.py``)."""
    a, b = compiled.get(early), compiled.get(late)
    assert a is not None and b is not None and a["ok"] and b["ok"]
    assert b["spill"] < a["spill"], (early, a["spill"], late, b["spill"])


#: the deterministic variants with a left bound: their walks keep the heads outside
LEFT_BOUNDED = ("det-d64-window", "det-softcap-two-sided")

#: spill stores (bytes) of the deterministic variants at the compile shape (2 x 4 query
#: heads on 2 KV heads, N = 1000), sm_90, Triton 3.6; those without a left bound with
#: their walks' query tiles outside the group's heads (``TILES_OUTSIDE``; heads outside
#: they spilled 232, 332, 188, 0 and 392; tiles outside without ``_per_step`` 272, 468,
#: 224, 0 and 748): at most these
DETERMINISTIC_SPILLS = {"det-dense": 224, "det-causal": 300, "det-d64-window": 0,
                        "det-softcap-two-sided": 268, "det-wide-d256-causal": 196,
                        "det-wide-mla": 0, "mod-alibi-det": 276, "det-d64-dense": 0,
                        "det-d64-dense-one-tile": 0}


@pytest.mark.parametrize("vid", sorted(DETERMINISTIC_SPILLS))
def test_deterministic_variants_spill_no_more_than_measured(compiled, vid):
    """The deterministic GQA variants (their walks differ from the default's: query tiles
    outside the group's heads, without a left bound) spill no more than measured (where
    the budgets apply: ``compile_worker.SPILL_BUDGET_TRITON``)."""
    r = compiled.get(vid)
    assert r is not None and r["ok"], r
    assert r["det"] and r["tiles_outside"] == (vid not in LEFT_BOUNDED), r
    if spill_budgets_apply():
        assert r["spill"] <= DETERMINISTIC_SPILLS[vid], (vid, r["spill"], r["regs"])


def test_deterministic_walks_take_the_tiles_outside_only_in_gqa_groups():
    """``TILES_OUTSIDE`` (every partition walks a key tile's query tiles outside the
    group's query heads) for deterministic calls with more than one query head per KV head
    and no left bound, WIDE ones too; with one, both orders are the same walk and the
    kernel keeps the default's loops; with a left bound (a causal window) the heads stay
    outside (measured faster)."""
    from flashfold.kernels.attention import gluon_bwd as G

    def tiles_outside(hq, hk, D=128, **kw):
        q = torch.empty(1, hq, 1000, D, dtype=torch.bfloat16)
        k = torch.empty(1, hk, 1000, D, dtype=torch.bfloat16)
        lam, acc = torch.empty(1, hq, 1000), torch.empty(1, hq, 1000, D)
        return G.gluon_attention_bwd(q, k, k, q, lam, lam, acc, k, k, causal=True,
                                     scale=0.1, launch=False, **kw)[3]["TILES_OUTSIDE"]
    for D in (128, 256):
        assert tiles_outside(4, 2, D, deterministic=True)
        assert not tiles_outside(2, 2, D, deterministic=True)
        assert not tiles_outside(4, 2, D) and not tiles_outside(2, 2, D)
        assert not tiles_outside(4, 2, D, deterministic=True, left=300)


def _host_launch(D, nq, nk=None, *, batch=1, heads=2, causal=False, **kw):
    """``(grid, constexprs)`` that :func:`gluon_attention_bwd` chooses on the host for
    bf16 ``q (batch, heads, nq, D)`` and ``k, v (batch, heads, nk, D)`` (``nk``: ``nq``
    by default); nothing is compiled or launched."""
    from flashfold.kernels.attention import gluon_bwd as G
    q = torch.empty(batch, heads, nq, D, dtype=torch.bfloat16)
    k = torch.empty(batch, heads, nq if nk is None else nk, D, dtype=torch.bfloat16)
    lam, acc = torch.empty(batch, heads, nq), torch.empty(batch, heads, nq, D)
    _, grid, _, constexprs = G.gluon_attention_bwd(q, k, k, q, lam, lam, acc, k, k,
                                                   causal=causal, scale=0.1, launch=False,
                                                   **kw)
    return grid, constexprs


def test_persistent_programs_for_head_dim_64_dense_calls():
    from flashfold.kernels.attention.gluon_bwd import persistent_default
    assert persistent_default(False, 64)
    assert not persistent_default(True, 64)
    assert not persistent_default(False, 128) and not persistent_default(True, 128)


@pytest.mark.parametrize("D", [64, 128])
def test_stats_read_after_the_waits_at_head_dim_128(D):
    """The default reads lambda and D after the waits where reading them before spills
    (head_dim 128), and an explicit ``late_stats`` reaches the kernel either way."""
    from flashfold.kernels.attention import gluon_bwd as G

    def late(**kw):
        return _host_launch(D, 256, **kw)[1]["LATE_STATS"]
    assert late() == (D == 128) == G.late_stats_default(D)
    assert late(late_stats=True) and not late(late_stats=False)


def test_keys_past_nk_masked_only_when_there_are_some():
    """Dense programs zero P of keys past Nk only when Nk is not a multiple of BLOCK_N
    (the mask was 32 of a head_dim-64 step's instructions); forcing it off where such keys
    exist is refused."""
    def mask(nk, **kw):
        return _host_launch(64, 256, nk, **kw)[1]["MASK_TAIL_KEYS"]
    assert mask(1000) and not mask(1024) and mask(1024, mask_tail_keys=True)
    with pytest.raises(ValueError, match="mask_tail_keys"):
        mask(1000, mask_tail_keys=False)


def test_persistent_grid_and_its_scope():
    """One program per SM, never more than key tiles; dense calls with register stores of
    dK, dV only (the ring is reused at once)."""
    from flashfold.kernels.attention import gluon_bwd as G
    launch = functools.partial(_host_launch, 64, 1000, batch=2, heads=4)  # 8 tiles x 2 x 4
    with mock.patch.object(G.gluon_fwd, "num_sms", lambda t: 20):
        grid, kw = launch()
        assert grid == (20,) and kw["PERSISTENT"] and not kw["STORE_TMA"]
        assert launch(persistent=100)[0] == (64,)
        assert launch(persistent=False)[0] == (64,)
        for bad in (dict(causal=True, persistent=True),
                    dict(causal=False, persistent=True, tma_store=True)):
            with pytest.raises(ValueError, match="persistent"):
                launch(**bad)


def test_deterministic_persistent_programs_launch_cooperatively():
    """Deterministic head_dim-64 dense calls run persistent programs too, as the default
    mode's (:func:`persistent_default`; their writers walk the program's key tiles); a
    program then waits for lower key tiles of any other program, so they start as one
    cooperative launch (which fails rather than waits forever when they cannot all be
    resident), and more programs than SMs are refused. Calls that are not deterministic
    launch as before."""
    from flashfold.kernels.attention import gluon_bwd as G
    launch = functools.partial(_host_launch, 64, 1000, batch=2, heads=4)  # 8 tiles x 2 x 4
    with mock.patch.object(G.gluon_fwd, "num_sms", lambda t: 20):
        grid, kw = launch(deterministic=True)
        assert grid == (20,) and kw["PERSISTENT"] and kw["DETERMINISTIC"]
        assert kw["launch_cooperative_grid"] and not kw["STORE_TMA"]
        assert launch(deterministic=True, persistent=12)[0] == (12,)
        grid, kw = launch(deterministic=True, persistent=False)
        assert grid == (64,) and "launch_cooperative_grid" not in kw
        assert "launch_cooperative_grid" not in launch()[1]
        with pytest.raises(ValueError, match="persistent: a deterministic"):
            launch(deterministic=True, persistent=21)
        assert launch(persistent=21)[0] == (21,)
        # causal calls stay one program per key tile, deterministic or not
        grid, kw = _host_launch(64, 1000, batch=2, heads=4, causal=True, deterministic=True)
        assert grid == (64,) and not kw["PERSISTENT"]


def test_warpgroups_take_turns_in_head_dim_128_causal_calls():
    from flashfold.kernels.attention.gluon_bwd import pingpong_default
    assert pingpong_default(True, 128)
    assert not pingpong_default(False, 128)
    assert not pingpong_default(True, 64) and not pingpong_default(False, 64)


def test_dk_dv_by_tma_stores_for_causal_and_short_dense_programs():
    from flashfold.kernels.attention.gluon_bwd import STORE_TMA_MAX_STEPS, store_tma
    assert store_tma(True, 10_000) and store_tma(False, STORE_TMA_MAX_STEPS)
    assert not store_tma(False, STORE_TMA_MAX_STEPS + 1)


def test_scope():
    from flashfold.kernels.attention.gluon_bwd import supported
    q, k, v = _qkv()
    assert supported(q, k, v, q) and supported(q, k, v, q, causal=True)
    # the forward's head dims: D = Dv up to 256 (tiles of 64, 128 or 256 columns: 80 and
    # 96 run as 128, 160 and 192 as 256, in the WIDE variant past 128), and D in 129-256
    # with Dv in 65-128 (MLA: WIDE), dO shaped like the output
    for d in (32, 48, 64, 80, 96, 128, 160, 192, 256):
        assert supported(*_qkv(D=d), _qkv(D=d)[0], causal=True), d
    q3, k3, _ = _qkv(D=192)
    v3 = _qkv(D=128)[2]
    assert supported(q3, k3, v3, torch.randn(1, 4, 256, 128, dtype=q3.dtype))
    assert not supported(q3, k3, v3, q3)                        # dO shaped like q, not o
    assert not supported(*_qkv(D=128)[:2], _qkv(D=64)[2], _qkv(D=128)[0][..., :64])
    assert not supported(*_qkv(D=512)[:3], _qkv(D=512)[0])
    assert not supported(*_qkv(dtype=torch.float32), _qkv(dtype=torch.float32)[0])
    # windows and softcap, where every row sees a key (a right bound r: Nq <= Nk + r)
    assert supported(q, k, v, q, causal=True, left=100) and supported(q, k, v, q, left=7)
    assert supported(q, k, v, q, left=10, right=3) and supported(q, k, v, q, softcap=30.0)
    assert not supported(q, k, v, q, softcap=0.0) and not supported(q, k, v, q, left=-1)
    q2, k2, v2 = _qkv(NQ=300, NK=200)
    assert supported(q2, k2, v2, q2) and not supported(q2, k2, v2, q2, causal=True)
    assert supported(q2, k2, v2, q2, right=100) and not supported(q2, k2, v2, q2, right=99)
    assert supported(q2, k2, v2, q2, left=3)
    assert not supported(q, k, v, q[:, :, :128])               # dO shaped like q
    assert not supported(q, k, v, q.transpose(2, 3).contiguous().transpose(2, 3))


def test_wide_variant_plan_and_its_options():
    """The WIDE variant's tiles (:func:`wide_plan`): power-of-two widths, the dQ split
    that evens the warpgroups' output columns, two ring stages where they fit in shared
    memory (at 256 / 256 with 32-column dQ pieces and one P / dS buffer of each kind, a
    single stage left each step's Q / dO load exposed); the narrow tiles' options are
    refused, not ignored."""
    from flashfold.kernels.attention import gluon_bwd as G
    assert not G.wide(128, 128) and not G.wide(64, 64)
    assert G.wide(192, 128) and G.wide(256, 256) and G.wide(160, 160)
    # (BLOCK_D, BLOCK_DV, DQ_SPLIT, STAGES, dQ piece columns, P / dS buffers)
    assert G.wide_plan(192, 128) == (256, 128, 64, 2, 64, 2)          # MLA
    assert G.wide_plan(256, 256) == (256, 256, 128, 2, 32, 1)         # Gemma
    assert G.wide_plan(192, 192) == (256, 256, 128, 2, 32, 1)
    assert G.wide_plan(256, 128) == (256, 128, 64, 2, 64, 2)
    grid, kw = _host_launch(256, 1000)
    assert kw["WIDE"] and kw["BLOCK_N"] == G.WIDE_BLOCK_N and grid == (16 * 2,)
    assert kw["STAGES"] == 2 and kw["DS_RING"] == 1
    q = torch.empty(1, 2, 100, 256, dtype=torch.bfloat16)
    lam, acc = torch.empty(1, 2, 100), torch.empty(1, 2, 100, 256)
    with pytest.raises(ValueError, match="persistent, pingpong"):
        G.gluon_attention_bwd(q, q, q, q, lam, lam, acc, q, q, causal=False, scale=0.1,
                              launch=False, pingpong=True, persistent=False)


def test_not_on_cpu_tensors():
    from flashfold.kernels.attention.gluon_bwd import eligible
    q, k, v = _qkv()
    assert not eligible(q, k, v, q)


def test_needs_the_tma_reduce_op():
    """The kernel adds dQ through a private Gluon builder op (Triton 3.6 has it; the
    compile tests above fail if it is gone); a Triton without it turns the path off
    instead of failing at import."""
    from flashfold.kernels.attention import gluon_bwd, gluon_fwd
    q, k, v = _qkv()
    with mock.patch.object(gluon_fwd, "on_hopper", return_value=True):
        for has in (True, False):
            with mock.patch.object(gluon_bwd, "HAS_TMA_REDUCE", has):
                assert gluon_bwd.eligible(q, k, v, q) is has


@pytest.mark.parametrize("lens", [[63, 1000, 2049], [1, 0, 2, 3, 5], [100, 600, 300], [0]])
def test_packed_statistics_start_aligned_and_apart(lens):
    """``stats_rows`` (its copy kernel under the interpreter): each sequence's statistics
    in order from a multiple of 4 (TMA's 16-byte rule for the start of a box's innermost
    dim; the kernel's ``_stats_start``: ``4 (ceil(cu[s] / 4) + s)``), no two sequences'
    rows in the same place, rows past the last offset after the last sequence's, zeros
    elsewhere (over a buffer of NaN), and a row length of a multiple of 4 (TMA's 16-byte
    stride)."""
    from flashfold.kernels import plans
    from flashfold.kernels.attention.gluon_bwd import stats_rows
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    T = cu[-1] + 3                                     # (3 rows past the last sequence)
    x = torch.arange(1, 2 * T + 1, dtype=torch.float32).reshape(1, 2, T)
    def nan_buffer(shape, dtype, device, zero=False):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    with mock.patch.object(plans, "new", side_effect=nan_buffer):
        y, y2 = stats_rows(x, -x, torch.tensor(cu, dtype=torch.int32))
    assert torch.equal(y2, -y)
    assert y.shape == (1, 2, 4 * (-(-T // 4) + len(lens) + 1)) and y.shape[-1] % 4 == 0
    starts = [4 * (-(-c // 4) + s) for s, c in enumerate(cu[:-1])]
    for s, st in enumerate(starts):
        assert st % 4 == 0
        assert torch.equal(y[..., st:st + lens[s]], x[..., cu[s]:cu[s + 1]])
    last = starts[-1] + lens[-1]
    assert torch.equal(y[..., last:last + 3], x[..., cu[-1]:])
    # every row once, nothing else written
    assert int((y != 0).sum()) == x.numel()


def test_dispatch_sends_calls_in_the_kernels_scope():
    """``prepare_backward`` builds the Gluon launch for dense, causal, windowed and
    soft-capped calls without a config, deterministic or not (the flag passed on), and
    for packed sequences in the varlen scope (one offsets tensor for both sides under a
    right bound, not deterministic, head dims up to 128: the offsets passed on); not with
    other offsets under a right bound, deterministic varlen or ``atomic_dq=False``
    (``eligible`` mocked true; nothing runs). Mods: a score_mod (deterministic too), a
    block mask of 128 x 128 blocks on a call without bounds (passed on); not a block mask
    under a causal bound, deterministic, in 64-row blocks or on packed sequences."""
    import flashfold as ff
    from flashfold import mods
    from flashfold.kernels.attention import bwd, gluon_bwd
    from flashfold.kernels.attention.mods import trace_score_mod
    calls = []

    def fake(q, k, v, do, lam, dd, dq_acc, dk, dv, *, causal, left, right, softcap, scale,
             deterministic, launch, cu_seqlens_q=None, cu_seqlens_k=None, score_mod=None,
             block_mask=None):
        packed = cu_seqlens_q is not None
        if score_mod is not None or block_mask is not None:
            calls.append((score_mod is not None, block_mask is not None, deterministic))
            return ("gluon", (1,), (), {})
        calls.append((left, right, softcap, deterministic, packed))
        rows = gluon_bwd.stats_length(64, 2) if packed else 64     # (laid out apart)
        assert dq_acc.dtype == torch.float32 and lam.shape == dd.shape == (*q.shape[:2], rows)
        return ("gluon", (1,), (), {})
    q, k, v = _qkv(NQ=64, NK=64)
    do = torch.randn_like(q)
    o, lse = torch.randn_like(q), torch.randn(q.shape[:3])
    with mock.patch.object(gluon_bwd, "eligible", return_value=True), \
            mock.patch.object(gluon_bwd, "gluon_attention_bwd", side_effect=fake):
        def kernels(**kw):
            return [launch[0] for launch in bwd.prepare_backward(
                do, q, k, v, o, lse, scale=0.1, interpret=False, **kw)[3]]
        assert kernels()[1] == "gluon" and kernels(right=0)[1] == "gluon"
        assert kernels(left=8, right=0)[1] == "gluon" and kernels(softcap=20.0)[1] == "gluon"
        assert kernels(right=0, deterministic=True)[1] == "gluon"
        cu = torch.tensor([0, 30, 64], dtype=torch.int32)
        packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=34, max_seqlen_k=34)
        copy_then_gluon = [gluon_bwd._stats_apart, "gluon"]
        assert kernels(right=0, **packed)[1:3] == copy_then_gluon
        assert kernels(**packed)[1:3] == copy_then_gluon
        assert calls == [(None, None, None, False, False), (None, 0, None, False, False),
                         (8, 0, None, False, False), (None, None, 20.0, False, False),
                         (None, 0, None, True, False), (None, 0, None, False, True),
                         (None, None, None, False, True)]
        other = dict(packed, cu_seqlens_k=cu.clone())
        for kw in (dict(atomic_dq=False), dict(packed, deterministic=True),
                   dict(other, right=0)):
            assert "gluon" not in kernels(**kw), kw
        assert kernels(**other)[1:3] == copy_then_gluon     # (no right bound: any offsets)
        assert len(calls) == 8
        alibi = trace_score_mod(mods.alibi(q.shape[1]))
        prefix = mods.prefix_lm_mask(16)
        square = ff.create_block_mask(prefix, None, None, 64, 64, device="cpu")
        small = ff.create_block_mask(prefix, None, None, 64, 64, device="cpu", BLOCK_SIZE=64)
        assert kernels(score_mod=alibi, right=0)[1] == "gluon"
        assert kernels(score_mod=alibi, deterministic=True)[1] == "gluon"
        assert kernels(block_mask=square)[1] == "gluon"
        assert kernels(block_mask=square, score_mod=alibi)[1] == "gluon"
        assert kernels(score_mod=alibi, right=0, **packed)[1:3] == copy_then_gluon
        assert calls[8:] == [(True, False, False), (True, False, True), (False, True, False),
                             (True, True, False), (True, False, False)]
        for kw in (dict(block_mask=square, right=0), dict(block_mask=square, deterministic=True),
                   dict(block_mask=small), dict(block_mask=square, **packed)):
            assert "gluon" not in kernels(**kw), kw
        assert len(calls) == 13


# --- numerics on the GPU -------------------------------------------------------------------

#: (B, Hq, Hk, Nq, Nk); the last, with more query rows than keys, dense only (causal
#: leaves rows without keys, outside the kernel's scope, where the naive yardstick is NaN)
CASES = [(1, 1, 1, 1, 1), (2, 4, 4, 17, 17), (1, 2, 1, 113, 113), (2, 4, 2, 1000, 1000),
         (1, 2, 2, 2049, 2049), (1, 2, 1, 100, 1000), (1, 1, 1, 128, 4096), (1, 3, 3, 256, 300),
         (3, 8, 2, 700, 1500)]
MORE_ROWS = (1, 2, 2, 300, 200)
#: the head_dim 64 cases (a subset: the kernel is the same template)
CASES_D64 = [(1, 1, 1, 1, 1), (1, 2, 1, 113, 113), (2, 4, 2, 1000, 1000), (1, 2, 1, 100, 1000),
             (3, 8, 2, 700, 1500)]


@pytest.mark.parametrize("case, causal, D",
                         [(c, m, 128) for c in CASES for m in (False, True)]
                         + [(MORE_ROWS, False, 128)]
                         + [(c, m, 64) for c in CASES_D64 for m in (False, True)],
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple)
                         else ("causal" if x else "dense") if isinstance(x, bool) else f"d{x}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.gpu
def test_gpu_gradients_flash_criterion(case, causal, D, dtype):
    _needs_sm90()
    import flashfold as ff
    from flashfold.kernels.attention import gluon_bwd
    B, HQ, HK, NQ, NK = case
    g = torch.Generator(device="cuda").manual_seed(hash(case) % 1000)
    q = torch.randn(B, HQ, NQ, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, HK, NK, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, HK, NK, D, device="cuda", dtype=dtype, generator=g)
    do = torch.randn(B, HQ, NQ, D, device="cuda", dtype=dtype, generator=g)
    scale = 1 / math.sqrt(D)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with mock.patch.object(gluon_bwd, "gluon_attention_bwd",
                           wraps=gluon_bwd.gluon_attention_bwd) as spy:
        ff.attention(*leaves, causal=causal).backward(do)
    assert spy.call_count == 1
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    _reference(*ref, causal, scale)[0].backward(do.double())
    low = [t.clone().requires_grad_() for t in (q, k, v)]
    _naive_lowp(*low, causal, scale).backward(do)
    for name, a, r, n in zip("qkv", leaves, ref, low):
        assert torch.isfinite(a.grad).all(), f"d{name} not finite"
        err = (a.grad.double() - r.grad).abs().max().item()
        naive = (n.grad.double() - r.grad).abs().max().item()
        assert err <= 2 * naive + 1e-5, f"d{name}: err {err:.2e} > 2 x naive {naive:.2e}"


#: windows, softcap and padded head dims: (case, causal, D, window, softcap), the model
#: rows' features at awkward sizes (Mistral's window, Phi-3's head_dim 96 with a window,
#: Phi-2's 80, MiniLM's 32, a two-sided window, a window larger than the sequence)
FEATURE_CASES = [
    ((2, 4, 2, 1000, 1000), True, 128, (300, None), None),
    ((1, 2, 1, 2049, 2049), True, 128, (128, None), None),
    ((1, 2, 2, 700, 1500), True, 128, (257, None), None),
    ((1, 2, 2, 1000, 1000), False, 128, (200, 100), None),
    ((1, 2, 2, 1000, 1000), False, 128, (300, None), None),
    ((1, 2, 2, 300, 700), False, 128, (None, 5), None),
    ((1, 2, 2, 63, 63), True, 128, (5000, None), None),
    ((2, 4, 2, 1000, 1000), False, 128, None, 20.0),
    ((1, 3, 3, 1000, 1000), True, 128, (300, None), 30.0),
    ((1, 2, 1, 1000, 1000), True, 96, (511, None), None),
    ((1, 2, 2, 1000, 1000), False, 96, None, None),
    ((1, 2, 2, 1000, 1000), True, 80, None, None),
    ((2, 4, 2, 1000, 1000), False, 80, None, None),
    ((1, 2, 2, 1000, 1000), False, 32, None, None),
    ((1, 2, 2, 700, 1000), True, 48, (100, None), 10.0),
]


@pytest.mark.parametrize("case, causal, D, window, softcap", FEATURE_CASES,
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple)
                         else str(x))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.gpu
def test_gpu_window_softcap_and_padded_head_dims_flash_criterion(case, causal, D, window,
                                                                 softcap, dtype):
    from flashfold.kernels.attention import gluon_bwd
    _check_gluon_gradients(case, causal, D, D, window, softcap, dtype,
                           hash((case, D)) % 1000, gluon_bwd, "gluon_attention_bwd")


def _check_gluon_gradients(case, causal, D, DV, window, softcap, dtype, seed, module, entry,
                           deterministic=False):
    """dQ, dK, dV of one call through ``module.entry`` (asserted called once) within
    FlashAttention's criterion: at most 2x a naive low-precision backward's error against
    float64 autograd; ``deterministic``: two more backward passes give the same bits."""
    _needs_sm90()
    import flashfold as ff
    B, HQ, HK, NQ, NK = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, HQ, NQ, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, HK, NK, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, HK, NK, DV, device="cuda", dtype=dtype, generator=g)
    do = torch.randn(B, HQ, NQ, DV, device="cuda", dtype=dtype, generator=g)
    scale = 1 / math.sqrt(D)
    win = None if window is None else tuple(-1 if w is None else w for w in window)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with mock.patch.object(module, entry, wraps=getattr(module, entry)) as spy:
        out = ff.attention(*leaves, causal=causal, window=win, softcap=softcap,
                           deterministic=deterministic)
        out.backward(do, retain_graph=deterministic)
    assert spy.call_count == 1
    if deterministic:
        for _ in range(2):
            again = torch.autograd.grad(out, leaves, do, retain_graph=True)
            for name, a, b in zip("qkv", leaves, again):
                assert torch.equal(a.grad, b), f"d{name} differs between runs"
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    _reference(*ref, causal, scale, window=win, softcap=softcap)[0].backward(do.double())
    low = [t.clone().requires_grad_() for t in (q, k, v)]
    _naive_lowp(*low, causal, scale, window=win, softcap=softcap).backward(do)
    for name, a, r, n in zip("qkv", leaves, ref, low):
        assert torch.isfinite(a.grad).all(), f"d{name} not finite"
        err = (a.grad.double() - r.grad).abs().max().item()
        naive = (n.grad.double() - r.grad).abs().max().item()
        assert err <= 2 * naive + 1e-5, f"d{name}: err {err:.2e} > 2 x naive {naive:.2e}"


#: the WIDE variant: (case, causal, D, Dv, window, softcap), Gemma's head_dim 256 (with its
#: softcap and window), DeepSeek's MLA (192 / 128), 192 and an awkward 160 at awkward sizes
WIDE_CASES = [
    ((1, 1, 1, 1, 1), False, 256, 256, None, None),
    ((2, 4, 2, 1000, 1000), False, 256, 256, None, None),
    ((2, 4, 2, 1000, 1000), True, 256, 256, None, None),
    ((1, 2, 2, 2049, 2049), True, 192, 128, None, None),
    ((3, 8, 2, 700, 1500), False, 192, 128, None, None),
    ((1, 2, 1, 113, 113), True, 192, 192, None, None),
    ((1, 2, 2, 100, 1000), True, 160, 160, None, None),
    ((2, 4, 2, 1000, 1000), True, 256, 256, (300, None), 50.0),
    ((1, 2, 2, 1000, 1000), False, 256, 256, (200, 100), None),
    ((1, 2, 2, 300, 200), False, 256, 128, None, None),
    ((1, 3, 3, 256, 300), False, 256, 128, None, 30.0),
    ((1, 8, 1, 63, 63), True, 192, 128, None, None),              # GQA 8:1, N = 63
    ((1, 2, 2, 100, 1000), False, 256, 256, (50, None), None),    # key tiles no row sees
]


@pytest.mark.parametrize("case, causal, D, DV, window, softcap", WIDE_CASES,
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple)
                         else str(x))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.gpu
def test_gpu_wide_head_dims_flash_criterion(case, causal, D, DV, window, softcap, dtype):
    from flashfold.kernels.attention import gluon_bwd
    _check_gluon_gradients(case, causal, D, DV, window, softcap, dtype,
                           hash((case, D, DV)) % 1000, gluon_bwd, "_wide_launch")


#: deterministic calls (dQ adds in a fixed order): dense, causal, every window shape,
#: softcap, GQA, tails, more keys than rows, both variants
DETERMINISTIC_CASES = [
    ((1, 1, 1, 1, 1), False, 128, 128, None, None),
    ((2, 4, 2, 1000, 1000), False, 128, 128, None, None),
    ((2, 4, 2, 1000, 1000), True, 128, 128, None, None),
    ((1, 2, 1, 2049, 2049), True, 64, 64, None, None),
    ((3, 8, 2, 700, 1500), False, 64, 64, None, None),
    ((1, 2, 2, 700, 1500), True, 128, 128, (257, None), None),
    ((1, 2, 2, 1000, 1000), False, 128, 128, (200, 100), None),
    ((1, 2, 2, 1000, 1000), False, 128, 128, (300, None), None),
    ((1, 2, 2, 300, 700), False, 96, 96, (None, 5), None),
    ((1, 3, 3, 1000, 1000), True, 128, 128, (300, None), 30.0),
    ((1, 8, 1, 4096, 4096), True, 128, 128, None, None),
    ((2, 4, 2, 1000, 1000), True, 256, 256, None, None),
    ((1, 2, 2, 2049, 2049), True, 192, 128, None, None),
    ((3, 8, 2, 700, 1500), False, 192, 128, None, None),
    ((2, 4, 2, 1000, 1000), True, 256, 256, (300, None), 50.0),
    ((1, 2, 2, 100, 1000), False, 256, 256, (50, None), None),
]


@pytest.mark.parametrize("case, causal, D, DV, window, softcap", DETERMINISTIC_CASES,
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple)
                         else str(x))
@pytest.mark.gpu
def test_gpu_deterministic_bitwise_and_flash_criterion(case, causal, D, DV, window, softcap):
    from flashfold.kernels.attention import gluon_bwd
    _check_gluon_gradients(case, causal, D, DV, window, softcap, torch.bfloat16,
                           hash((case, D, DV, 1)) % 1000, gluon_bwd, "gluon_attention_bwd",
                           deterministic=True)


#: head_dim-64 dense deterministic calls on persistent programs: programs of one tile,
#: of several (more key tiles than SMs), GQA, tails
DETERMINISTIC_PERSISTENT_CASES = [(3, 8, 2, 700, 1500), (8, 8, 4, 1000, 2000),
                                  (4, 16, 16, 1024, 1024), (32, 12, 12, 512, 512)]


@pytest.mark.parametrize("case", DETERMINISTIC_PERSISTENT_CASES,
                         ids=lambda x: "x".join(map(str, x)))
@pytest.mark.gpu
def test_gpu_deterministic_persistent_bitwise_and_flash_criterion(case):
    """The persistent deterministic variant (a cooperative launch, the default of these
    calls: :func:`persistent_default`) is bitwise reproducible and within the criterion."""
    from flashfold.kernels.attention import gluon_bwd
    assert gluon_bwd.persistent_default(False, 64)      # (else this tests one-tile programs)
    _check_gluon_gradients(case, False, 64, 64, None, None, torch.bfloat16,
                           hash(case) % 1000, gluon_bwd, "gluon_attention_bwd",
                           deterministic=True)


#: score_mods and block masks in the kernel: (B, Hq, Hk, Nq, Nk) x head dims, and the
#: features (id, causal, softcap, score_mod, mask_mod) of the forward's mod tests
#: (``tests/test_attention_gluon.py``): ALiBi and a relative bias, dense, causal and
#: soft-capped; causal documents, prefix-LM, documents (both run as intervals of keys and
#: of queries), rows before 200 seeing nothing (fully masked rows: zero gradients), a
#: block mask with ALiBi, and documents whose ids recur (their tables read per step)
MOD_BWD_CASES = [((1, 2, 1, 113, 113), 128, 128), ((2, 4, 2, 1000, 1000), 128, 128),
                 ((1, 2, 2, 2049, 2049), 64, 64), ((1, 2, 1, 100, 1000), 128, 128),
                 ((2, 4, 2, 1000, 1000), 64, 64), ((1, 2, 2, 1000, 1000), 96, 96),
                 ((1, 4, 2, 1000, 1000), 256, 256), ((1, 2, 2, 700, 700), 192, 128)]
MOD_BWD_FEATURES = [("alibi-dense", False, None, "alibi", None),
                    ("alibi-causal", True, None, "alibi", None),
                    ("relative-softcap-causal", True, 30.0, "relative", None),
                    ("capped-causal", True, None, "capped", None),
                    ("documents-causal", False, None, None, "documents-causal"),
                    ("prefix", False, None, None, "prefix"),
                    ("documents", False, None, None, "documents"),
                    ("rows-from-200", False, None, None, "rows-from-200"),
                    ("prefix-alibi", False, None, "alibi", "prefix"),
                    ("documents-recurring", False, None, None, "documents-recurring")]


#: every case with every feature, but block masks only on the head_dim <= 128 tiles
MOD_BWD_GRID = [(c, D, DV, f) for c, D, DV in MOD_BWD_CASES for f in MOD_BWD_FEATURES
                if D == DV <= 128 or f[4] is None]


@pytest.mark.parametrize("case, D, DV, feature", MOD_BWD_GRID,
                         ids=lambda c: c[0] if isinstance(c, tuple) and isinstance(c[0], str)
                         else "x".join(map(str, c)) if isinstance(c, tuple) else f"d{c}")
@pytest.mark.gpu
def test_gpu_mods_flash_criterion(case, D, DV, feature):
    """A score_mod (with its derivative; every variant, WIDE too) and a block mask walked
    by key tile in the Gluon backward (bf16): dQ, dK, dV within FlashAttention's criterion
    against float64 autograd of the attention with the same mods; every gradient
    finite."""
    _needs_sm90()
    import flashfold as ff
    from flashfold.kernels.attention import bwd, gluon_bwd
    from test_attention_gluon import _mask_mod
    B, HQ, HK, NQ, NK = case
    name, causal, softcap, smod, mmod = feature
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((case, name, D, DV)).encode()))
    q = torch.randn(B, HQ, NQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(B, HQ, NQ, DV, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, HK, NK, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, HK, NK, DV, device="cuda", dtype=torch.bfloat16, generator=g)
    score_mod = _score_mod(smod, HQ) if smod else None
    mask_mod = _mask_mod(mmod.replace("-causal", ""), NQ, NK) if mmod else None
    if mmod == "documents-causal":
        from flashfold import mods
        from flashfold.kernels.attention.mods import trace_mask_mod
        mask_mod = trace_mask_mod(mods.and_masks(mods.causal_mask, mask_mod.fn))
    scale = 1 / math.sqrt(D)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    bwd.plan_cache_clear()
    with mock.patch.object(gluon_bwd, "gluon_attention_bwd",
                           wraps=gluon_bwd.gluon_attention_bwd) as spy:
        ff.attention(*leaves, causal=causal, softcap=softcap,
                     score_mod=score_mod.fn if score_mod is not None else None,
                     mask_mod=mask_mod.fn if mask_mod is not None else None).backward(do)
    assert spy.call_count == 1, f"{name}: not the Gluon backward"
    assert (spy.call_args.kwargs["score_mod"] is not None) == (score_mod is not None)
    assert (spy.call_args.kwargs["block_mask"] is not None) == (mask_mod is not None)
    mods_ = dict(softcap=softcap, score_mod=score_mod, mask_mod=mask_mod)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    _reference(*ref, causal, scale, **mods_)[0].backward(do.double())
    low = [t.clone().requires_grad_() for t in (q, k, v)]
    _naive_lowp(*low, causal, scale, **mods_).backward(do)
    for x, a, r, n in zip("qkv", leaves, ref, low):
        assert torch.isfinite(a.grad).all(), f"{name}: d{x} not finite"
        err = (a.grad.double() - r.grad).abs().max().item()
        naive = (n.grad.double() - r.grad).abs().max().item()
        assert err <= 2 * naive + 1e-5, f"{name}: d{x} err {err:.2e} > 2 x naive {naive:.2e}"


@pytest.mark.gpu
def test_gpu_window_nonfinite_hidden_keys_reach_no_gradient():
    """A window hides keys inside the tiles the kernel loads: a NaN in the k and v of a
    key that no row sees, in a key tile that rows 0-83 load (keys 256-383; rows see keys
    from r + 300 on), reaches no gradient (the flag and the strict recompute), and the
    key's own dk, dv are 0."""
    _needs_sm90()
    import flashfold as ff
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, do = (torch.randn(1, 2, 1000, 128, device="cuda", dtype=torch.bfloat16,
                               generator=g) for _ in range(4))
    k[:, :, 290] = float("nan")
    v[:, :, 290] = float("nan")
    q2 = q[:, :, 500:]          # rows r see keys r + 300 .. r + 500: key 290 hidden
    do2 = do[:, :, 500:]
    leaves = [t.clone().requires_grad_() for t in (q2, k, v)]
    ff.attention(*leaves, causal=True, window=(200, 0)).backward(do2)
    dq, dk, dv = (t.grad for t in leaves)
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert (dk[:, :, :300] == 0).all() and (dv[:, :, :300] == 0).all()


@pytest.mark.gpu
def test_gpu_agrees_with_the_triton_kernels_and_strided_layouts():
    """``(B, N, H, D)`` storage and GQA: the Gluon backward and the deterministic Triton
    kernels agree to the criterion's scale."""
    _needs_sm90()
    import flashfold as ff
    g = torch.Generator(device="cuda").manual_seed(3)
    for causal in (False, True):
        q, do = (torch.randn(2, 1000, 8, 128, device="cuda", dtype=torch.bfloat16,
                             generator=g).transpose(1, 2) for _ in range(2))
        k, v = (torch.randn(2, 1000, 2, 128, device="cuda", dtype=torch.bfloat16,
                            generator=g).transpose(1, 2) for _ in range(2))
        got = torch.autograd.grad(ff.attention(*(t.requires_grad_() for t in (q, k, v)),
                                               causal=causal), (q, k, v), do)
        det = torch.autograd.grad(ff.attention(q, k, v, causal=causal, deterministic=True),
                                  (q, k, v), do)
        low = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        _naive_lowp(*low, causal, 1 / math.sqrt(128)).backward(do)
        ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
        _reference(*ref, causal, 1 / math.sqrt(128))[0].backward(do.double())
        for a, b, n, r in zip(got, det, low, ref):
            naive = (n.grad.double() - r.grad).abs().max().item()
            assert (a.double() - b.double()).abs().max().item() <= 2 * naive + 1e-5


def _gluon_variants(causal, D, variants, nk=900):
    """dQ, dK, dV of the Gluon backward launched with each keyword set of ``variants``
    (2 x 4 query heads of 700 rows against 2 x 2 KV heads of ``nk`` keys: by default a
    ragged last key tile, GQA; dK, dV preset to NaN so that an unwritten row shows)."""
    _needs_sm90()
    from flashfold.kernels import launcher
    from flashfold.kernels.attention import bwd, fwd, gluon_bwd
    g = torch.Generator(device="cuda").manual_seed(5)
    q, do = (torch.randn(2, 4, 700, D, device="cuda", dtype=torch.bfloat16, generator=g)
             for _ in range(2))
    k, v = (torch.randn(2, 2, nk, D, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    scale = 1 / math.sqrt(D)
    right = 0 if causal else None
    o, lse = fwd.attention_forward(q, k, v, scale=scale, right=right)
    dq, dk, dv, launches = bwd.prepare_backward(do, q, k, v, o, lse, scale=scale, right=right)
    pre, main, conv = launches[:3]     # (then, causal, the strict recompute guarded by a flag)
    assert main[0] is gluon_bwd._attn_bwd_ws
    dd, lam, acc = pre[2][4], pre[2][5], pre[2][6]
    got = []
    for kw in variants:
        dk.fill_(float("nan"))
        dv.fill_(float("nan"))
        launcher.launch(*pre)
        launcher.launch(*gluon_bwd.gluon_attention_bwd(q, k, v, do, lam, dd, acc, dk, dv,
                                                       causal=causal, scale=scale,
                                                       launch=False, **kw))
        launcher.launch(*conv)
        got.append((dq.clone(), dk.clone(), dv.clone()))
    return got


def _same_gradients(got):
    """dK, dV bitwise equal and finite across variants; dQ the same sum in another order
    of atomic adds."""
    from flashfold.testing import compare
    dq1, dk1, dv1 = got[0]
    assert torch.isfinite(dk1).all() and torch.isfinite(dv1).all()
    for dq2, dk2, dv2 in got[1:]:
        assert torch.equal(dk1, dk2) and torch.equal(dv1, dv2)
        report = compare(dq1, dq2, "bfloat16")
        assert report["ok"], report


@pytest.mark.parametrize("causal, D", [(False, 128), (True, 128), (False, 64)],
                         ids=["dense", "causal", "dense-d64"])
@pytest.mark.gpu
def test_gpu_tma_and_register_stores_of_dk_dv_agree_bitwise(causal, D):
    """The two ways out of dK, dV (TMA stores from the ring, stores from registers)
    write the same values."""
    _same_gradients(_gluon_variants(causal, D, [dict(tma_store=True, persistent=False),
                                                dict(tma_store=False, persistent=False)]))


@pytest.mark.parametrize("causal, D", [(False, 128), (True, 128), (True, 64)],
                         ids=["dense", "causal", "causal-d64"])
@pytest.mark.gpu
def test_gpu_turns_change_no_bit_of_dk_dv(causal, D):
    """Taking turns only delays when each warpgroup issues its products: dK, dV are
    bitwise those without turns."""
    _same_gradients(_gluon_variants(causal, D, [dict(pingpong=True), dict(pingpong=False)]))


@pytest.mark.parametrize("causal, D", [(False, 128), (True, 128), (False, 64)],
                         ids=["dense", "causal", "dense-d64"])
@pytest.mark.gpu
def test_gpu_late_stats_change_no_bit_of_dk_dv(causal, D):
    """Reading lambda and D after the waits only moves two shared-memory loads: dK, dV
    bitwise those with the loads before the waits, in one-tile and (dense) persistent programs."""
    variants = [dict(persistent=False, late_stats=False),
                dict(persistent=False, late_stats=True)]
    if not causal:
        variants += [dict(persistent=p, late_stats=True, tma_store=False) for p in (True, 7)]
    _same_gradients(_gluon_variants(causal, D, variants))


@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.gpu
def test_gpu_unmasked_keys_change_no_bit_when_nk_fills_the_tiles(D):
    """With Nk a multiple of 128 (here 1024) the key mask selects nothing: dK, dV bitwise
    those with the mask, one-tile and persistent."""
    _same_gradients(_gluon_variants(False, D, [
        dict(persistent=False, mask_tail_keys=True), dict(persistent=False),
        dict(persistent=True, mask_tail_keys=True), dict(persistent=True)], nk=1024))


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.gpu
def test_gpu_persistent_programs_cover_every_key_tile_once(D):
    """Persistent programs (as many as SMs, and 5 or 7: tiles per program unequal, the
    ragged last tile in the middle of a program's list) write dK, dV bitwise those of one
    program per tile; the dS buffers and the ring count on correctly across tiles."""
    _same_gradients(_gluon_variants(False, D, [dict(persistent=False, tma_store=False)]
                                    + [dict(persistent=p) for p in (True, 5, 7)]))


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
@pytest.mark.gpu
def test_gpu_program_order_covers_every_key_tile_once(causal):
    """Any number of heads per group of programs (``heads_per_wave``; 3 leaves a partial
    last group of 1 of the 4 heads) gives every key tile exactly one program: dK, dV
    bitwise those of head-major order, no row unwritten."""
    _same_gradients(_gluon_variants(causal, 128, [dict(heads_per_wave=g) for g in (1, 3, 4)]))


@pytest.mark.gpu
def test_gpu_fully_masked_and_empty_rows_give_zero_gradients():
    """A query row with no visible key (lse = -inf; here: dO given for rows that the
    caller masks by passing lse = -inf) adds nothing: no NaN anywhere."""
    _needs_sm90()
    from flashfold.kernels.attention import bwd
    g = torch.Generator(device="cuda").manual_seed(9)
    q, k, v, do = (torch.randn(1, 2, 300, 128, device="cuda", dtype=torch.bfloat16,
                               generator=g) for _ in range(4))
    o = torch.zeros_like(q)
    lse = torch.full((1, 2, 300), float("-inf"), device="cuda")
    dq, dk, dv = bwd.attention_backward(do, q, k, v, o, lse, scale=1 / math.sqrt(128))
    for t in (dq, dk, dv):
        assert torch.isfinite(t).all() and t.abs().max().item() == 0.0


#: packed sequences: (id, lengths, Hq, Hk): awkward lengths (1, 63, 2049), an empty
#: sequence, GQA 8:1, Llama-like documents
VARLEN_CASES = [("one-row", [1], 2, 2), ("awkward", [63, 1000, 2049], 4, 2),
                ("empty", [0, 5, 300, 0, 129], 2, 1), ("gqa8", [129, 640, 255], 16, 2),
                ("docs", [181, 1286, 640, 900, 77, 1024, 333, 512], 8, 2)]
#: (id, causal, window, softcap)
VARLEN_FEATURES = [("dense", False, None, None), ("causal", True, None, None),
                   ("window", False, (100, 30), None), ("causal-left", True, (256, None), None),
                   ("softcap-causal", True, None, 30.0)]


class _SequenceMod:
    """A traced score_mod seen from one sequence taken as a batch of one: its ``b`` is the
    sequence's index ``s`` (what a packed call passes)."""

    def __init__(self, mod, s):
        self.mod, self.s = mod, s

    def torch_fn(self, device):
        fn = self.mod.torch_fn(device)
        return lambda score, b, h, q_idx, kv_idx: fn(score, b + self.s, h, q_idx, kv_idx)


def _packed_grads(lens, HQ, HK, D, causal, window, softcap, seed, nan_key=None,
                  score_mod=None):
    """Gradients of a packed call through the Gluon backward (asserted: the offsets reach
    ``gluon_attention_bwd``), and per sequence the float64 and the naive low-precision
    ones (concatenated); ``score_mod``: a traced score_mod (its ``b``: the sequence)."""
    import flashfold as ff
    from flashfold.kernels.attention import gluon_bwd
    g = torch.Generator(device="cuda").manual_seed(seed)
    N = sum(lens)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(1, HQ, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, HK, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, HK, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(1, HQ, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    if nan_key is not None:
        v[0, :, nan_key] = float("nan")
    scale = 1 / math.sqrt(D)
    win = None if window is None else tuple(-1 if w is None else w for w in window)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with mock.patch.object(gluon_bwd, "gluon_attention_bwd",
                           wraps=gluon_bwd.gluon_attention_bwd) as spy:
        ff.attention(*leaves, causal=causal, window=win, softcap=softcap, cu_seqlens_q=cu,
                     cu_seqlens_k=cu, score_mod=score_mod.fn if score_mod else None
                     ).backward(do)
    assert spy.call_count == 1 and spy.call_args.kwargs["cu_seqlens_q"] is cu
    assert (spy.call_args.kwargs["score_mod"] is not None) == (score_mod is not None)
    got = [t.grad for t in leaves]
    refs, lows = [[], [], []], [[], [], []]
    bounds = cu.tolist()
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if a == b:
            continue
        part = [t[:, :, a:b] for t in (q, k, v)]
        mod = dict(window=win, softcap=softcap,
                   score_mod=_SequenceMod(score_mod, s) if score_mod else None)
        ref = [t.double().requires_grad_() for t in part]
        _reference(*ref, causal, scale, **mod)[0].backward(do[:, :, a:b].double())
        low = [t.clone().requires_grad_() for t in part]
        _naive_lowp(*low, causal, scale, **mod).backward(do[:, :, a:b])
        for i in range(3):
            refs[i].append(ref[i].grad)
            lows[i].append(low[i].grad.double())
    return got, [torch.cat(r, 2) for r in refs], [torch.cat(x, 2) for x in lows], bounds


@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("feature", VARLEN_FEATURES, ids=lambda f: f[0])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.gpu
def test_gpu_varlen_gradients_flash_criterion(case, feature, D):
    """Packed sequences on the Gluon backward (bf16): dQ, dK, dV against each sequence's
    float64 autograd within FlashAttention's criterion; a tile that reads the next
    sequence's rows or keys adds nothing of them."""
    _needs_sm90()
    name, lens, HQ, HK = case
    fname, causal, window, softcap = feature
    got, ref, low, _ = _packed_grads(lens, HQ, HK, D, causal, window, softcap,
                                     zlib.crc32(repr((name, fname, D)).encode()))
    for n, a, r, lo in zip("qkv", got, ref, low):
        assert torch.isfinite(a).all(), f"d{n} not finite"
        err = (a.double() - r).abs().max().item()
        naive = (lo - r).abs().max().item()
        assert err <= 2 * naive + 1e-5, f"{name} {fname} d{n}: err {err:.2e} > 2 x {naive:.2e}"


@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("feature", VARLEN_FEATURES, ids=lambda f: f[0])
@pytest.mark.gpu
def test_gpu_varlen_score_mod_gradients_flash_criterion(case, feature):
    """A score_mod on packed sequences in the Gluon backward: ALiBi plus a bias by the
    sequence's index (the mod's ``b``), positions inside each sequence."""
    _needs_sm90()
    from flashfold import ops
    from flashfold.kernels.attention.mods import trace_score_mod
    from test_attention_gluon import _score_mod
    name, lens, HQ, HK = case
    fname, causal, window, softcap = feature
    alibi = _score_mod("alibi", HQ).fn

    def alibi_by_sequence(score, b, h, q_idx, kv_idx):
        return alibi(score, b, h, q_idx, kv_idx) + 0.25 * ops.to_float(b)
    got, ref, low, _ = _packed_grads(lens, HQ, HK, 128, causal, window, softcap,
                                     zlib.crc32(repr((name, fname, "mod")).encode()),
                                     score_mod=trace_score_mod(alibi_by_sequence))
    for n, a, r, lo in zip("qkv", got, ref, low):
        assert torch.isfinite(a).all(), f"d{n} not finite"
        err = (a.double() - r).abs().max().item()
        naive = (lo - r).abs().max().item()
        assert err <= 2 * naive + 1e-5, f"{name} {fname} d{n}: err {err:.2e} > 2 x {naive:.2e}"


@pytest.mark.gpu
def test_gpu_varlen_replayed_plan_follows_the_offsets():
    """Two calls of the same shapes with other offsets (the second replays the first's
    plan, whose statistics copy then places rows by the new offsets' values): both within
    the criterion."""
    _needs_sm90()
    for seed, lens in enumerate(([181, 1286, 640, 93], [640, 93, 181, 1286])):
        got, ref, low, _ = _packed_grads(lens, 4, 2, 128, True, None, None, 50 + seed)
        for n, a, r, lo in zip("qkv", got, ref, low):
            err = (a.double() - r).abs().max().item()
            naive = (lo - r).abs().max().item()
            assert err <= 2 * naive + 1e-5, f"{lens} d{n}: err {err:.2e} > 2 x {naive:.2e}"


@pytest.mark.gpu
def test_gpu_varlen_nan_stays_in_its_sequence():
    """A NaN value of the second packed sequence's first key, which the first sequence's
    last key tile and query tiles read past their end: no gradient of the first or third
    sequence is NaN, they meet the criterion, and the second sequence's gradients have
    NaN (its rows see the key)."""
    _needs_sm90()
    lens = [300, 700, 200]
    got, ref, low, b = _packed_grads(lens, 4, 2, 128, True, None, None, 41, nan_key=300)
    for n, a, r, lo in zip("qkv", got, ref, low):
        inner = a[:, :, b[1]:b[2]]
        assert torch.isnan(inner).any() or n == "v", f"d{n}: the NaN key reached nothing"
        for lo_, hi_ in ((b[0], b[1]), (b[2], b[3])):
            part = a[:, :, lo_:hi_].double()
            assert torch.isfinite(part).all(), f"d{n} of another sequence is not finite"
            err = (part - r[:, :, lo_:hi_]).abs().max().item()
            naive = (lo[:, :, lo_:hi_] - r[:, :, lo_:hi_]).abs().max().item()
            assert err <= 2 * naive + 1e-5, f"d{n}: err {err:.2e} > 2 x {naive:.2e}"


def test_wave_heads_groups_causal_heads_to_fill_a_wave():
    """Causal programs run tile-major in groups of heads whose tiles fill the GPU (the
    heaviest tiles of every head of a group first); dense ones head-major (equal work)."""
    from flashfold.kernels.attention.gluon_bwd import wave_heads
    assert wave_heads(False, 8, 256, 132) == 1
    assert wave_heads(True, 8, 256, 132) == 32       # the targets' 1K causal: 256 programs
    assert wave_heads(True, 32, 64, 132) == 8        # 4K: 4 heads x 32 tiles = 128 < 132
    assert wave_heads(True, 128, 16, 132) == 2       # 16K
    assert wave_heads(True, 12, 6, 132) == 6         # fewer programs than SMs: one group
    assert wave_heads(True, 8, 7, 16) == 7           # no divisor of 7 reaches 16 but 7


if __name__ == "__main__":
    _compile_all()
