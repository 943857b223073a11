"""The Triton backward kernels (under TRITON_INTERPRET on CPU machines) against torch.autograd
through the float64 oracle, via the public API with the dispatch forced to the kernels.

As for the forward: fp16/fp32 inputs (``tl.dot`` on bf16 is wrong under the Triton 3.6
interpreter; bf16 runs on the GPU in ``benchmarks/attention.py --bwd``), tiny shapes, 16 x 16
tiles so that key tiles meet masked and unmasked query tiles. Gradients are allocated
NaN-filled, so an element a kernel fails to write fails the comparison. Each dispatch branch
runs at least once: atomic and deterministic dQ, TMA and pointer loads (and the pointer
fallback when TMA is refused), dense and block-sparse iteration (rows and columns of the
block mask), exact and conservative FULL tiles, varlen, GQA/MQA, softcap, score_mod, dlse.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashfold
from flashfold import mods
from flashfold.api import attention as api
from flashfold.kernels.attention import bwd, fwd
from flashfold.kernels.attention.bwd import BwdConfig
from flashfold.kernels.attention.fwd import FwdConfig
from flashfold.kernels.attention.mods import create_block_mask
from flashfold.testing import assert_close

from test_attention_cases import FEATURES, Shape, make_qkv, oracle, varlen_inputs

if torch.cuda.is_available():  # pragma: no cover - the GPU runs benchmarks/attention.py --bwd
    pytest.skip("interpreter tests run on CPU machines", allow_module_level=True)


def _nan_alloc(*shape, dtype=None, device=None, **kw):
    return torch.full(*shape, float("nan"), dtype=dtype, device=device)


@pytest.fixture
def kernel(monkeypatch):
    """Route flashfold.attention to the kernels (forward and backward), NaN-poisoned
    gradients; ``use(config)`` sets the backward configuration."""
    monkeypatch.setattr(api, "_use_kernel", lambda t: True)
    monkeypatch.setattr(fwd, "default_config", lambda q, d, dv, causal=False: FwdConfig(16, 16))
    monkeypatch.setattr(bwd, "_alloc", _nan_alloc)

    def use(config=BwdConfig(16, 16, 4, 1, 16, 16, 4, 1, use_tma=False, atomic_dq=True)):
        monkeypatch.setattr(bwd, "default_config", lambda q, d, dv, features=False, causal=False: config)
    use()
    return use


def _ref_grads(q, k, v, do, dlse=None, **kw):
    kw.pop("deterministic", None)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o, lse = oracle(q64, k64, v64, **kw)
    outs, grads = [o], [do.double()]
    if dlse is not None:
        fin = torch.isfinite(lse)
        outs.append(torch.where(fin, lse, 0.0))
        grads.append(torch.where(fin, dlse.double(), 0.0))
    return torch.autograd.grad(outs, (q64, k64, v64), grads)


def _check(q, k, v, dtype, name, with_lse=False, seed=0, **kw):
    """Kernel gradients of ``<o, dO> (+ <lse, dlse>)`` against the oracle's."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o, lse = flashfold.attention(q, k, v, return_lse=True, **kw)
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=g).to(dtype)
    dlse = torch.randn(lse.shape, generator=g) if with_lse else None
    outs, gs = [o], [do]
    if with_lse:
        outs.append(torch.where(torch.isfinite(lse), lse, 0.0))
        gs.append(dlse)
    got = torch.autograd.grad(outs, (q, k, v), gs)
    want = _ref_grads(q, k, v, do, dlse, **kw)
    for n, a, b in zip("qkv", got, want):
        assert a.dtype == q.dtype and a.shape == b.shape
        assert_close(a, b, dtype, scale=max(1.0, float(b.abs().max())), name=f"{name}: d{n}")
    return got


PICK = ["plain", "causal", "window-3-2", "causal-window-4", "softcap", "alibi", "relbias",
        "document-causal", "prefix-lm", "softcap-mod-mask"]


@pytest.mark.parametrize("feature", [f for f in FEATURES if f.name in PICK], ids=lambda f: f.name)
def test_backward_kernel_features_fp16(kernel, feature):
    shape = Shape(1, 2, 1, 33, 40, 32)
    q, k, v = make_qkv(shape, torch.float16, seed=1)
    _check(q, k, v, torch.float16, feature.name, **feature.build(shape))


@pytest.mark.parametrize("shape", [Shape(1, 2, 1, 33, 40, 8), Shape(2, 2, 1, 17, 33, 80, 48),
                                   Shape(1, 1, 1, 9, 24, 3, 5)], ids=lambda s: s.id)
@pytest.mark.parametrize("mode", ["atomic", "deterministic"])
def test_backward_kernel_any_head_dim(kernel, shape, mode):
    """Head dims off the power-of-two widths, q/k wider than v: TMA where the strides allow
    it, pointers elsewhere (head dims 3 and 5)."""
    kernel(BwdConfig(16, 16, 4, 1, 16, 16, 4, 1, use_tma=True, atomic_dq=mode == "atomic"))
    q, k, v = make_qkv(shape, torch.float16, seed=7)
    _check(q, k, v, torch.float16, shape.id, causal=True, deterministic=mode != "atomic")


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("mode", ["atomic", "deterministic"])
def test_backward_kernel_modes_and_loads_fp32(kernel, mode, tma):
    kernel(BwdConfig(16, 32, 4, 1, 32, 16, 4, 1, use_tma=tma, atomic_dq=True))
    shape = Shape(2, 4, 2, 33, 40, 64)
    q, k, v = make_qkv(shape, torch.float32, seed=2)
    assert fwd.tma_ok(q, k, v)
    det = mode == "deterministic"
    got = _check(q, k, v, torch.float32, f"{mode} tma={tma}", causal=True, window=(9, None),
                 deterministic=det)
    if det:     # a second run gives the same bits
        again = _check(q, k, v, torch.float32, "again", causal=True, window=(9, None),
                       deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(got, again))


def test_backward_kernel_uses_the_configured_dq_path(kernel, monkeypatch):
    """deterministic=True launches the dQ kernel and no atomics; the default (atomic
    configuration) launches the dK/dV kernel with DQ_ATOMIC and the conversion."""
    seen = []
    real = bwd.prepare_backward

    def spy(*a, **kw):
        out = real(*a, **kw)
        seen.append([(l[0].fn.__name__, l[3].get("DQ_ATOMIC")) for l in out[3]])
        return out
    monkeypatch.setattr(bwd, "prepare_backward", spy)
    shape = Shape(1, 2, 2, 17, 17, 32)
    q, k, v = (t.requires_grad_() for t in make_qkv(shape, torch.float32, seed=3))
    for det in (False, True):
        flashfold.attention(q, k, v, deterministic=det).sum().backward()
    assert seen[0] == [("_bwd_preprocess", None), ("_attn_bwd_dkdv", True), ("_dq_convert", None)]
    assert seen[1] == [("_bwd_preprocess", None), ("_attn_bwd_dkdv", False), ("_attn_bwd_dq", None)]


@pytest.mark.parametrize("shape", [Shape(1, 4, 1, 70, 33, 32), Shape(2, 3, 3, 1, 17, 32),
                                   Shape(1, 2, 2, 20, 20, 64, 32)], ids=lambda s: s.id)
def test_backward_kernel_awkward_shapes_mqa_and_layout(kernel, shape):
    q, k, v = make_qkv(shape, torch.float32, seed=4, layout="bnhd")      # (B, S, H, D) storage
    _check(q, k, v, torch.float32, shape.id, causal=True, with_lse=True)


@pytest.mark.parametrize("mode,causal", [("atomic", False), ("atomic", True), ("deterministic", True)])
def test_backward_kernel_varlen(kernel, mode, causal):
    """Packed sequences through TMA: a ragged key tile reads the next sequence's keys, which
    must stay masked (their dS would land in this sequence's dQ)."""
    kernel(BwdConfig(16, 16, 4, 1, 16, 16, 4, 1, use_tma=True, atomic_dq=True))
    lens_q, lens_k = [5, 0, 17, 1, 20], [9, 4, 17, 30, 3]
    q, k, v, cu_q, cu_k = varlen_inputs(lens_q, lens_k, 4, 2, 32, torch.float32, seed=5)
    _check(q, k, v, torch.float32, f"varlen {mode}", causal=causal, cu_seqlens_q=cu_q,
           cu_seqlens_k=cu_k, deterministic=mode == "deterministic")


def test_backward_kernel_varlen_with_mask_mod_and_score_mod(kernel):
    lens = [19, 7, 33]
    q, k, v, cu_q, cu_k = varlen_inputs(lens, lens, 2, 1, 32, torch.float16, seed=6)
    _check(q, k, v, torch.float16, "varlen + mods", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
           score_mod=mods.alibi(2), mask_mod=mods.prefix_lm_mask(torch.tensor([4, 0, 20])),
           softcap=4.0)


@pytest.mark.parametrize("extra", [{}, {"causal": True}, {"window": (20, 3)}],
                         ids=["exact-full-tiles", "causal-masks-full-tiles", "window-masks-full-tiles"])
def test_backward_kernel_precomputed_block_mask(kernel, extra):
    """EMPTY, PARTIAL and FULL 16 x 16 tiles, walked by rows (dQ) and by columns (dK/dV)."""
    kernel(BwdConfig(16, 16, 4, 1, 16, 16, 4, 1, use_tma=False, atomic_dq=False))
    shape = Shape(2, 2, 1, 70, 70, 32)
    q, k, v = make_qkv(shape, torch.float16, seed=7)
    docs = torch.tensor([0] * 16 + [1] * 37 + [2] * 17)
    dm = mods.document_mask(docs)
    bm = create_block_mask(dm, None, None, 70, 70, device="cpu", BLOCK_SIZE=16)
    assert set(bm.state.flatten().tolist()) == {0, 1, 2}
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = flashfold.attention(q, k, v, mask_mod=bm, **extra)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(8)).half()
    got = torch.autograd.grad(o, (q, k, v), do)
    want = _ref_grads(q, k, v, do, mask_mod=dm, **extra)
    for n, a, b in zip("qkv", got, want):
        assert_close(a, b, torch.float16, scale=max(1.0, float(b.abs().max())), name=f"d{n}")


def test_backward_kernel_block_mask_larger_than_tiles(kernel):
    """Mask blocks of 32 x 64 walked as 16 x 16 tiles (R = 2 query / 4 key sub-tiles)."""
    shape = Shape(1, 2, 2, 70, 100, 32)
    q, k, v = make_qkv(shape, torch.float32, seed=9)
    mask = mods.sliding_window_mask(40, 5)
    bm = create_block_mask(mask, None, None, 70, 100, device="cpu", BLOCK_SIZE=(32, 64))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    got = torch.autograd.grad(flashfold.attention(q, k, v, mask_mod=bm).sum(), (q, k, v))
    want = _ref_grads(q, k, v, torch.ones(1, 2, 70, 32), mask_mod=mask)
    for n, a, b in zip("qkv", got, want):
        assert_close(a, b, torch.float32, scale=max(1.0, float(b.abs().max())), name=f"d{n}")


def test_backward_kernel_rows_with_no_visible_key(kernel):
    shape = Shape(1, 2, 1, 40, 7, 32)
    q, k, v = make_qkv(shape, torch.float16, seed=10)
    dq, dk, dv = _check(q, k, v, torch.float16, "causal Nq > Nk", causal=True, with_lse=True)
    assert (dq[:, :, :33] == 0).all()
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = flashfold.attention(q, k, v, mask_mod=lambda b, h, i, j: j > 100)
    assert all((g == 0).all() for g in torch.autograd.grad(o.sum(), (q, k, v)))


def test_backward_kernel_extreme_scores_fp16(kernel):
    g = torch.Generator().manual_seed(11)
    sign = lambda *s: torch.randint(0, 2, s, generator=g).float() * 2 - 1  # noqa: E731
    c = math.sqrt(1e4 / 32)                                  # q.k ~ +-1e4 before scaling
    q = (c * sign(1, 2, 17, 32)).half()
    k = (c * sign(1, 2, 33, 32)).half()
    v = torch.randn(1, 2, 33, 32, generator=g).half()
    dq, dk, dv = _check(q, k, v, torch.float16, "+-1e4 scores", causal=True)
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))


def test_backward_kernel_pointer_fallback_when_tma_is_refused(kernel, monkeypatch):
    """TMA asked for, rows not 16-byte aligned: POINTER_BWD_CONFIGS tiles, dQ kernel."""
    kernel(BwdConfig(64, 128, 8, 2, 128, 64, 8, 2, use_tma=True, atomic_dq=True))
    seen = []
    real = bwd.prepare_backward

    def spy(*a, **kw):
        out = real(*a, **kw)
        seen.append({l[0].fn.__name__: (l[3].get("BLOCK_M"), l[3].get("BLOCK_N"), l[3].get("USE_TMA"))
                     for l in out[3]})
        return out
    monkeypatch.setattr(bwd, "prepare_backward", spy)
    base = torch.randn(1, 2, 40, 33, generator=torch.Generator().manual_seed(12))
    q = base[..., :32]                                       # row stride 33: not aligned
    assert not fwd.tma_ok(q)
    _check(q, q, q, torch.float32, "unaligned", softcap=3.0)
    want = bwd.POINTER_BWD_CONFIGS[(32, True)]
    assert seen[0]["_attn_bwd_dkdv"] == (want[0], want[1], False)
    assert seen[0]["_attn_bwd_dq"] == (want[4], want[5], False)


def test_backward_kernel_expanded_output_gradient_and_nan_free(kernel):
    """dO of ``.sum()`` is an expanded (stride 0) tensor: read through its strides."""
    shape = Shape(1, 2, 2, 17, 33, 32)
    q, k, v = (t.requires_grad_() for t in make_qkv(shape, torch.float32, seed=13))
    got = torch.autograd.grad(flashfold.attention(q, k, v, window=(5, 2)).sum(), (q, k, v))
    want = _ref_grads(q, k, v, torch.ones(1, 2, 17, 32), window=(5, 2))
    for n, a, b in zip("qkv", got, want):
        assert_close(a, b, torch.float32, scale=max(1.0, float(b.abs().max())), name=f"d{n}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_kernel_expanded_lse_gradient(kernel, causal):
    """dlse of ``lse.sum()`` is an expanded (stride 0) tensor too: the preprocess reads it
    through its row stride (it assumed 1, read past the one stored element and gave
    garbage dq, dk on the GPU, NaN under the interpreter)."""
    shape = Shape(2, 4, 2, 32, 32, 32)
    q, k, v = (t.requires_grad_() for t in make_qkv(shape, torch.float16, seed=7))
    o, lse = flashfold.attention(q, k, v, causal=causal, return_lse=True)
    got = torch.autograd.grad(o.float().square().sum() + lse.sum(), (q, k, v))
    want = _ref_grads(q, k, v, 2 * o.detach().double(), torch.ones(lse.shape), causal=causal)
    for n, a, b in zip("qkv", got, want):
        assert_close(a, b, torch.float16, scale=max(1.0, float(b.abs().max())), name=f"d{n}")
