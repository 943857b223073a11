"""The Triton forward and merge kernels (under TRITON_INTERPRET on CPU machines) against the
float64 oracle, through the public API with the dispatch forced to the kernel.

Interpreter runs use fp16/fp32 (``tl.dot`` on bf16 is wrong under the Triton 3.6
interpreter; bf16 is checked on the GPU by ``benchmarks/attention.py``), tiny shapes and
16 x 16 tiles so that every query tile has masked and unmasked key tiles. Each dispatch
branch is forced at least once: TMA descriptors and plain pointers, dense and
block-sparse iteration, exact and conservative FULL tiles, varlen, GQA, mods with
captured tables.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashfold
from flashfold import mods
from flashfold.api import attention as api
from flashfold.kernels.attention import fwd
from flashfold.kernels.attention.fwd import FwdConfig
from flashfold.kernels.attention.mods import create_block_mask
from flashfold.testing import assert_close

from test_attention_cases import (FEATURES, Shape, lse_scale, make_qkv, oracle, out_scale,
                                  varlen_inputs)

if torch.cuda.is_available():  # pragma: no cover - the GPU runs benchmarks/attention.py
    pytest.skip("interpreter tests run on CPU machines", allow_module_level=True)


@pytest.fixture
def kernel(monkeypatch):
    """Route flashfold.attention / merge_states to the Triton kernels; choose the config."""
    monkeypatch.setattr(api, "_use_kernel", lambda t: True)

    def use(config=FwdConfig(16, 16, use_tma=False)):
        monkeypatch.setattr(fwd, "default_config", lambda q, d, dv, causal=False: config)
    use()
    return use


def _check(q, k, v, dtype, name, **kw):
    o, lse = flashfold.attention(q, k, v, return_lse=True, **kw)
    ro, rl = oracle(q, k, v, **kw)
    assert o.dtype == q.dtype and lse.dtype == torch.float32
    assert_close(o, ro, dtype, scale=out_scale(v), name=f"{name}: o")
    assert_close(lse, rl, "float32", scale=lse_scale(rl), name=f"{name}: lse")
    return o, lse


KERNEL_SHAPES = [Shape(1, 2, 1, 33, 70, 32), Shape(2, 2, 2, 17, 17, 64, 32)]
PICK = ["plain", "causal", "window-3-2", "causal-window-4", "softcap", "alibi", "relbias",
        "document-causal", "prefix-lm", "key-padding", "softcap-mod-mask"]


@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=lambda s: s.id)
@pytest.mark.parametrize("feature", [f for f in FEATURES if f.name in PICK], ids=lambda f: f.name)
def test_kernel_features_fp16(kernel, shape, feature):
    q, k, v = make_qkv(shape, torch.float16, seed=3)
    _check(q, k, v, torch.float16, feature.name, **feature.build(shape))


@pytest.mark.parametrize("shape", [Shape(1, 1, 1, 1, 17, 32), Shape(1, 3, 1, 70, 33, 96),
                                   Shape(2, 4, 2, 17, 1, 32)], ids=lambda s: s.id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kernel_awkward_lengths_fp32(kernel, shape, causal):
    q, k, v = make_qkv(shape, torch.float32, seed=4, layout="bnhd")   # (B, S, H, D) storage
    _check(q, k, v, torch.float32, shape.id, causal=causal)


#: head dims off the power-of-two widths (Phi-2's 80, MiniLM-style 8 and 20, an odd 3 with
#: v 5, DeepSeek-style q/k wider than v): tiles of the next power of two (at least 16),
#: the columns past the head dim masked in the kernel
ODD_DIMS = [Shape(1, 2, 1, 33, 40, 8), Shape(1, 2, 2, 20, 37, 20), Shape(2, 2, 1, 17, 33, 80, 48),
            Shape(1, 1, 1, 9, 24, 3, 5)]


@pytest.mark.parametrize("shape", ODD_DIMS, ids=lambda s: s.id)
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_kernel_any_head_dim(kernel, shape, tma):
    """TMA where the strides allow it (8, 80/48 in fp16), the pointer path elsewhere."""
    kernel(FwdConfig(16, 16, use_tma=tma))
    q, k, v = make_qkv(shape, torch.float16, seed=6)
    _check(q, k, v, torch.float16, shape.id, causal=True)
    _check(q, k, v, torch.float16, shape.id + " window", window=(5, 3))


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_kernel_tma_and_pointer_paths(kernel, tma, dtype):
    kernel(FwdConfig(16, 32, use_tma=tma))
    shape = Shape(2, 4, 2, 33, 40, 64)
    q, k, v = make_qkv(shape, dtype, seed=5)
    assert fwd.tma_ok(q, k, v)
    _check(q, k, v, dtype, f"tma={tma}", causal=True, window=(9, None))


def test_kernel_tma_falls_back_for_unaligned_strides(kernel):
    kernel(FwdConfig(16, 16, use_tma=True))
    base = torch.randn(1, 2, 20, 33, dtype=torch.float16)
    q = base[..., :32]                                      # row stride 33: not 16-byte aligned
    assert not fwd.tma_ok(q)
    _check(q, q, q, torch.float16, "unaligned")


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kernel_varlen(kernel, tma, causal):
    kernel(FwdConfig(16, 16, use_tma=tma))
    lens_q, lens_k = [5, 0, 17, 1, 20], [9, 4, 17, 30, 3]
    q, k, v, cu_q, cu_k = varlen_inputs(lens_q, lens_k, 4, 2, 32, torch.float16, seed=6)
    o, lse = flashfold.attention(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 return_lse=True)
    ro, rl = oracle(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert_close(o, ro, torch.float16, scale=out_scale(v), name="o")
    assert_close(lse, rl, "float32", scale=lse_scale(rl), name="lse")


def test_kernel_varlen_with_mask_mod_and_score_mod(kernel):
    lens = [19, 7, 33]
    q, k, v, cu_q, cu_k = varlen_inputs(lens, lens, 2, 1, 32, torch.float16, seed=7)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, score_mod=mods.alibi(2),
              mask_mod=mods.prefix_lm_mask(torch.tensor([4, 0, 20])))
    o, lse = flashfold.attention(q, k, v, return_lse=True, **kw)
    ro, rl = oracle(q, k, v, **kw)
    assert_close(o, ro, torch.float16, scale=out_scale(v), name="o")
    assert_close(lse, rl, "float32", scale=lse_scale(rl), name="lse")


def test_kernel_score_mod_with_six_tables(kernel):
    """A mod's captured tables reach the kernel as one tuple argument, however many: six
    per-head and per-position tables (a relative bias built from pieces) against the
    oracle, forward and backward."""
    from flashfold import ops
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=g, dtype=torch.float32) for _ in range(3))
    tabs = [ops.Buffer(torch.randn(n, generator=g) * 0.3) for n in (2, 2, 40, 40, 80, 80)]

    def bias(score, b, h, qi, kj):
        return (score + tabs[0][h] * tabs[1][h] + tabs[2][qi] - tabs[3][kj]
                + tabs[4][qi - kj + 40] * tabs[5][kj - qi + 40])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = flashfold.attention(*leaves, score_mod=bias, causal=True, return_lse=True)
    ro, rl = oracle(q, k, v, score_mod=bias, causal=True)
    assert_close(o, ro, torch.float32, scale=out_scale(v), name="o")
    assert_close(lse, rl, "float32", scale=lse_scale(rl), name="lse")
    do = torch.randn(o.shape, generator=g)
    o.backward(do)
    ref = [t.clone().double().requires_grad_() for t in (q, k, v)]
    oracle(*ref, score_mod=bias, causal=True)[0].backward(do.double())
    for name, a, r in zip("qkv", leaves, ref):
        assert_close(a.grad, r.grad, torch.float32, scale=max(1.0, r.grad.abs().max().item()),
                     name=f"d{name}")


def test_captured_tables_are_moved_to_the_device_once_per_version():
    """A table captured on the host reaches the kernel as one device copy, made on the first
    call and reused (a copy on every call synchronised each eager call and broke CUDA-graph
    capture); writing to the table in place makes the next call copy it again."""
    from flashfold.kernels.attention.mods import trace_score_mod
    mod = trace_score_mod(mods.alibi(4))
    (table,) = [b.data for b in mod.buffers]
    first = mod.buffer_args("meta")
    assert first[0].device.type == "meta" and first[1] == table.numel()
    assert mod.buffer_args("meta")[0] is first[0]
    here = mod.buffer_args("cpu")
    table.mul_(2)                                  # an in-place write bumps the version
    again = mod.buffer_args("cpu")
    assert again is not here and torch.equal(again[0], table.reshape(-1))
    assert mod.buffer_args("meta")[0] is not first[0]


@pytest.mark.parametrize("extra", [{}, {"causal": True}, {"window": (20, 3)}],
                         ids=["exact-full-tiles", "causal-masks-full-tiles", "window-masks-full-tiles"])
def test_kernel_precomputed_block_mask(kernel, extra):
    """A BlockMask with EMPTY, PARTIAL and FULL 16 x 16 tiles; with causal/window the kernel
    also masks inside FULL tiles (the table does not know them)."""
    shape = Shape(2, 2, 1, 70, 70, 32)
    q, k, v = make_qkv(shape, torch.float16, seed=8)
    docs = torch.tensor([0] * 16 + [1] * 37 + [2] * 17)      # one document fills whole tiles
    dm = mods.document_mask(docs)
    bm = create_block_mask(dm, None, None, 70, 70, device="cpu", BLOCK_SIZE=16)
    states = set(bm.state.flatten().tolist())
    assert states == {0, 1, 2}, states
    o, lse = flashfold.attention(q, k, v, mask_mod=bm, return_lse=True, **extra)
    ro, rl = oracle(q, k, v, mask_mod=dm, **extra)
    assert_close(o, ro, torch.float16, scale=out_scale(v), name="o")
    assert_close(lse, rl, "float32", scale=lse_scale(rl), name="lse")


def test_kernel_block_mask_larger_than_tiles(kernel):
    """Mask blocks of 32 x 64 walked as 16 x 16 kernel tiles (R = 4 sub-tiles per block)."""
    shape = Shape(1, 2, 2, 70, 100, 32)
    q, k, v = make_qkv(shape, torch.float16, seed=9)
    mask = mods.sliding_window_mask(40, 5)
    bm = create_block_mask(mask, None, None, 70, 100, device="cpu", BLOCK_SIZE=(32, 64))
    o = flashfold.attention(q, k, v, mask_mod=bm)
    assert_close(o, oracle(q, k, v, mask_mod=mask)[0], torch.float16, scale=out_scale(v), name="o")


@pytest.mark.parametrize("mask", [mods.sliding_window_mask(None, None), mods.and_masks(),
                                  lambda b, h, i, j: True], ids=["window-unbounded", "and-none",
                                                                 "true"])
def test_kernel_constant_mask_mod(kernel, mask):
    """A mask_mod that is the constant True (an unbounded ``sliding_window_mask``, an empty
    ``and_masks``) shows every key, forward and backward, as on the CPU path; its Triton
    lowering was a float32 0 / 1, which the kernels' ``mask != 0`` could not combine."""
    q, k, v = make_qkv(Shape(1, 2, 1, 20, 20, 32), torch.float32, seed=12)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = flashfold.attention(*leaves, mask_mod=mask, return_lse=True)
    ro, rl = oracle(q, k, v)
    assert_close(o, ro, torch.float32, scale=out_scale(v), name="o")
    assert_close(lse, rl, "float32", scale=lse_scale(rl), name="lse")
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(13))
    o.backward(do)
    ref = [t.clone().double().requires_grad_() for t in (q, k, v)]
    oracle(*ref)[0].backward(do.double())
    for name, a, r in zip("qkv", leaves, ref):
        assert_close(a.grad, r.grad, torch.float32, scale=max(1.0, r.grad.abs().max().item()),
                     name=f"d{name}")


def test_kernel_rows_with_no_visible_key(kernel):
    shape = Shape(1, 2, 1, 40, 7, 32)
    q, k, v = make_qkv(shape, torch.float16, seed=10)
    o, lse = _check(q, k, v, torch.float16, "causal Nq > Nk", causal=True)
    assert (o[:, :, :33] == 0).all() and (lse[:, :, :33] == -math.inf).all()
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    o, lse = flashfold.attention(q, k, v, mask_mod=lambda b, h, i, j: j > 100, return_lse=True)
    assert (o == 0).all() and (lse == -math.inf).all()


def test_kernel_extreme_scores_and_fp16_overflowing_products(kernel):
    g = torch.Generator().manual_seed(11)
    sign = lambda *s: torch.randint(0, 2, s, generator=g).float() * 2 - 1  # noqa: E731
    c = math.sqrt(1e4 / 32)                                  # q.k ~ +-1e4 before scaling
    q = (c * sign(1, 2, 17, 32)).half()
    k = (c * sign(1, 2, 33, 32)).half()
    v = torch.randn(1, 2, 33, 32, generator=g).half()
    _check(q, k, v, torch.float16, "+-1e4 scores", causal=True)
    big = torch.full((1, 1, 20, 32), 300.0, dtype=torch.float16)   # products 9e4 > fp16 max
    v2 = torch.randn(1, 1, 20, 32, generator=g).half()
    o = flashfold.attention(big, big, v2)
    assert torch.isfinite(o).all()
    assert_close(o, v2.double().mean(2, keepdim=True).expand_as(o), torch.float16, name="mean")
    o = flashfold.attention(torch.zeros_like(big), big, v2, causal=True)   # all-equal scores
    want = v2.double().cumsum(2) / torch.arange(1, 21, dtype=torch.float64).view(1, 1, 20, 1)
    assert_close(o, want, torch.float16, name="causal means")


@pytest.mark.parametrize("n_parts", [1, 2, 5])
def test_merge_kernel(kernel, n_parts):
    shape = Shape(2, 3, 3, 9, 40, 64)
    q, k, v = make_qkv(shape, torch.float32, seed=12)
    cuts = sorted({0, 40, *[(7 * i + 3) % 40 for i in range(n_parts - 1)]})
    parts = [flashfold.attention(q, k[:, :, a:b], v[:, :, a:b], return_lse=True,
                                 mask_mod=(lambda bb, hh, i, j: j < 3) if a == 0 else None)
             for a, b in zip(cuts, cuts[1:])]
    parts.append((torch.full_like(q, float("nan")) * 0 + 7.0,            # an empty part
                  torch.full(q.shape[:-1], -math.inf)))
    parts = parts[::-1]
    outs = torch.stack([p[0] for p in parts])
    lses = torch.stack([p[1] for p in parts])
    o, lse = flashfold.merge_states(outs, lses)
    want_mask = lambda bb, hh, i, j: (j < 3) | (j >= cuts[1])  # noqa: E731
    ro, rl = oracle(q, k, v, mask_mod=want_mask)
    assert_close(o, ro, "float32", scale=out_scale(v), name="stacked o")
    assert_close(lse, rl, "float32", scale=lse_scale(rl), name="stacked lse")
    o2, l2 = flashfold.merge_states(parts[0][0], parts[0][1], parts[1][0], parts[1][1])
    r2, rl2 = flashfold.merge_states(outs[:2], lses[:2])
    assert_close(o2, r2, "float32", name="pair vs stacked o")
    assert_close(l2, rl2, "float32", name="pair vs stacked lse")


def test_merge_kernel_all_empty_is_zero_not_nan(kernel):
    o = torch.randn(4, 1, 2, 3, 32, dtype=torch.float16)
    lse = torch.full((4, 1, 2, 3), -math.inf)
    mo, ml = flashfold.merge_states(o, lse)
    assert (mo == 0).all() and (ml == -math.inf).all() and mo.dtype == torch.float16


def test_merge_of_float64_parts_is_float64_accurate(kernel):
    """The merge kernel's state is fp32: float64 parts keep float64 accuracy (stacked and
    pair forms), within float64's tolerance of the merge written out in float64."""
    g = torch.Generator().manual_seed(14)
    outs = torch.randn(3, 2, 3, 9, 40, generator=g, dtype=torch.float64)
    lses = 10 * torch.randn(3, 2, 3, 9, generator=g, dtype=torch.float64)
    for got, parts in ((flashfold.merge_states(outs, lses), slice(None)),
                       (flashfold.merge_states(outs[0], lses[0], outs[1], lses[1]), slice(0, 2))):
        o, lse = got
        w = torch.softmax(lses[parts], 0)
        assert o.dtype == torch.float64 and lse.dtype == torch.float32
        assert_close(o, (w[..., None] * outs[parts]).sum(0), "float64", name="o")
        assert_close(lse, torch.logsumexp(lses[parts], 0), "float32", scale=lse_scale(lses),
                     name="lse")
