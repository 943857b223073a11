"""The CPU path of flashfold.attention (blocked reference) against the float64 naive oracle,
the semantics contract, merge_states properties, block masks, mods and validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flashfold
from flashfold import mods, ops
from flashfold.kernels.attention.mods import (EMPTY, FULL, PARTIAL, create_block_mask,
                                              trace_mask_mod)
from flashfold.kernels.attention.reference import (attention_reference, merge_states_reference,
                                                   naive_attention)
from flashfold.testing import assert_close

from test_attention_cases import FEATURES, Shape, lse_scale, make_qkv, oracle, out_scale, varlen_inputs

SHAPES = [Shape(2, 4, 2, 17, 33, 32), Shape(1, 2, 1, 1, 70, 32), Shape(1, 3, 3, 113, 17, 64),
          Shape(2, 2, 2, 70, 70, 32, 64)]


def _check(out, ref, v, dtype, name):
    o, lse = out
    ro, rl = ref
    assert_close(o, ro, dtype, scale=out_scale(v), name=f"{name}: o")
    assert lse.dtype == torch.float32                      # the contract, for every input dtype
    assert_close(lse, rl, "float32", scale=lse_scale(rl), name=f"{name}: lse")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.id)
@pytest.mark.parametrize("feature", FEATURES, ids=lambda f: f.name)
def test_cpu_path_matches_naive_float64(shape, feature):
    q, k, v = make_qkv(shape, torch.float64, seed=1)
    kw = feature.build(shape)
    out = flashfold.attention(q, k, v, return_lse=True, **kw)
    _check(out, oracle(q, k, v, **kw), v, "float64", feature.name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cpu_path_low_precision_inputs(dtype):
    shape = Shape(2, 4, 1, 33, 70, 64)
    q, k, v = make_qkv(shape, dtype, seed=2, layout="bnhd")
    o, lse = flashfold.attention(q, k, v, causal=True, return_lse=True)
    assert o.dtype == dtype and lse.dtype == torch.float32
    ro, rl = naive_attention(q, k, v, causal=True)
    assert_close(o, ro, dtype, scale=out_scale(v), name="o")
    assert_close(lse, rl, "float32", scale=lse_scale(rl), name="lse")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_equals_per_sequence_calls(causal):
    lens_q, lens_k = [5, 0, 17, 1], [9, 4, 17, 30]
    q, k, v, cu_q, cu_k = varlen_inputs(lens_q, lens_k, 4, 2, 32, torch.float64)
    o, lse = flashfold.attention(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 return_lse=True)
    for s, (a, b) in enumerate(zip(cu_q.tolist(), cu_q.tolist()[1:])):
        c, d = cu_k[s].item(), cu_k[s + 1].item()
        ro, rl = naive_attention(q[:, :, a:b], k[:, :, c:d], v[:, :, c:d], causal=causal)
        assert_close(o[:, :, a:b], ro, "float64", name=f"seq {s}: o")
        assert_close(lse[:, :, a:b], rl, "float32", scale=lse_scale(rl), name=f"seq {s}: lse")


def test_varlen_mask_mod_sees_sequence_index_and_local_positions():
    lens = [6, 9]
    q, k, v, cu_q, cu_k = varlen_inputs(lens, lens, 2, 2, 32, torch.float64)
    seen = {}

    def mask(b, h, q_idx, kv_idx):                  # keys < 3 + 2 b of each sequence
        return kv_idx < 3 + 2 * b
    o = flashfold.attention(q, k, v, mask_mod=mask, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    for s, (a, b) in enumerate([(0, 6), (6, 15)]):
        n = 3 + 2 * s
        ro, _ = naive_attention(q[:, :, a:b], k[:, :, a:a + n], v[:, :, a:a + n])
        assert_close(o[:, :, a:b], ro, "float64", name=f"seq {s}")
        seen[s] = True
    assert seen == {0: True, 1: True}


# --- the semantics contract ------------------------------------------------------------------

def test_spec_worked_example_blocked_like_the_spec():
    # specification 003: scores [1, 2, 5, 3] in two blocks of two; output [1.678, 0.266]
    q = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    k = torch.tensor([1.0, 2.0, 5.0, 3.0], dtype=torch.float64).view(1, 1, 4, 1)
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 2.0]], dtype=torch.float64).view(1, 1, 4, 2)
    o, lse = attention_reference(q, k, v, scale=1.0, block_n=2)
    s = torch.tensor([1.0, 2.0, 5.0, 3.0], dtype=torch.float64)
    p = torch.softmax(s, 0)
    assert_close(o[0, 0, 0], p @ v[0, 0], "float64", name="o")
    assert abs(o[0, 0, 0, 0].item() - 1.678) < 1e-3 and abs(o[0, 0, 0, 1].item() - 0.266) < 1e-3
    assert_close(lse[0, 0, 0], torch.logsumexp(s, 0), "float64", name="lse")


def test_causal_is_aligned_bottom_right():
    # Nq = 2, Nk = 4: row 0 sees keys 0..2, row 1 sees keys 0..3 (FlashAttention 2)
    q = torch.zeros(1, 1, 2, 32, dtype=torch.float64)          # all scores equal
    k = torch.zeros(1, 1, 4, 32, dtype=torch.float64)
    v = torch.arange(4, dtype=torch.float64).view(1, 1, 4, 1).expand(1, 1, 4, 32).contiguous()
    o, lse = flashfold.attention(q, k, v, causal=True, return_lse=True)
    assert torch.allclose(o[0, 0, :, 0], torch.tensor([1.0, 1.5], dtype=torch.float64))
    assert torch.allclose(lse[0, 0], torch.tensor([math.log(3), math.log(4)], dtype=torch.float32))


def test_rows_without_visible_keys_give_zero_and_minus_inf():
    shape = Shape(1, 2, 1, 9, 4, 32)                           # causal, Nq > Nk
    q, k, v = make_qkv(shape, torch.float32)
    o, lse = flashfold.attention(q, k, v, causal=True, return_lse=True)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert (o[:, :, :5] == 0).all() and (lse[:, :, :5] == -math.inf).all()
    assert torch.isfinite(lse[:, :, 5:]).all()
    # a mask that hides everything
    o2, lse2 = flashfold.attention(q, k, v, mask_mod=lambda b, h, i, j: i < 0, return_lse=True)
    assert (o2 == 0).all() and (lse2 == -math.inf).all()


def test_all_equal_scores_average_the_values():
    shape = Shape(2, 2, 2, 5, 19, 32)
    q, k, v = make_qkv(shape, torch.float64)
    o, lse = flashfold.attention(torch.zeros_like(q), k, v, return_lse=True)
    assert_close(o, v.mean(2, keepdim=True).expand_as(o), "float64", name="mean")
    assert_close(lse, torch.full_like(lse, math.log(19)), "float32", name="lse")


def test_huge_scores_and_fp16_overflowing_products_stay_finite():
    g = torch.Generator().manual_seed(3)
    sign = lambda *s: torch.randint(0, 2, s, generator=g).double() * 2 - 1  # noqa: E731
    c = math.sqrt(1e4 / 32)                                     # q.k ~ +-1e4 before scaling
    q, k = c * sign(1, 2, 17, 32), c * sign(1, 2, 33, 32)
    v = torch.randn(1, 2, 33, 32, generator=g).double()
    for dtype in (torch.float16, torch.float32):
        o, lse = flashfold.attention(q.to(dtype), k.to(dtype), v.to(dtype), return_lse=True)
        ro, rl = naive_attention(q.to(dtype), k.to(dtype), v.to(dtype))
        assert torch.isfinite(o).all() and torch.isfinite(lse).all()
        assert_close(o, ro, dtype, scale=out_scale(v), name=f"{dtype} o")
        assert_close(lse, rl, "float32", scale=lse_scale(rl), name=f"{dtype} lse")
    # every product q_d k_d = 9e4 > 65504 (fp16 max): statistics must not be kept in fp16
    q16 = torch.full((1, 1, 3, 32), 300.0, dtype=torch.float16)
    k16 = torch.full((1, 1, 5, 32), 300.0, dtype=torch.float16)
    v16 = torch.randn(1, 1, 5, 32, generator=g).half()
    o, lse = flashfold.attention(q16, k16, v16, return_lse=True)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert_close(o, v16.double().mean(2, keepdim=True).expand(1, 1, 3, 32), torch.float16,
                 name="overflowing products")


def test_window_none_and_minus_one_are_unbounded():
    shape = Shape(1, 2, 2, 17, 33, 32)
    q, k, v = make_qkv(shape, torch.float64)
    a = flashfold.attention(q, k, v)
    for w in [(None, None), (-1, -1), (-1, None)]:
        assert torch.equal(flashfold.attention(q, k, v, window=w), a)
    assert torch.equal(flashfold.attention(q, k, v, window=(-1, 0)),
                       flashfold.attention(q, k, v, causal=True))


def test_cpu_path_is_differentiable():
    shape = Shape(1, 2, 1, 9, 13, 32)
    q, k, v = (t.requires_grad_() for t in make_qkv(shape, torch.float64))
    flashfold.attention(q, k, v, causal=True, softcap=3.0).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    naive_attention(q, k, v, causal=True, softcap=3.0)[0].sum().backward()
    for g, t, n in zip(grads, (q, k, v), "qkv"):
        assert_close(g, t.grad, "float64", name=f"d{n}")


@pytest.mark.parametrize("d,dv", [(300, 300), (264, 520), (1, 257)])
def test_cpu_path_takes_any_head_dim(d, dv):
    """The CPU reference has no tile: head dims past the kernels' 256 compute (as SDPA's
    math path does), forward and backward, against the naive float64 oracle."""
    shape = Shape(1, 4, 2, 9, 13, d, dv)
    q, k, v = (t.requires_grad_() for t in make_qkv(shape, torch.float64, seed=5))
    o, lse = flashfold.attention(q, k, v, causal=True, return_lse=True)
    ro, rl = naive_attention(q, k, v, causal=True)
    assert o.shape == (1, 4, 9, dv)
    _check((o, lse), (ro, rl), v, "float64", f"d{d}/{dv}")
    grads = torch.autograd.grad(o.sum(), (q, k, v))
    want = torch.autograd.grad(ro.sum(), (q, k, v))
    for g, w, n in zip(grads, want, "qkv"):
        assert_close(g, w, "float64", name=f"d{n}")


@pytest.mark.parametrize("d,dv,which", [(300, 300, "q/k"), (64, 257, "v")])
def test_kernel_path_names_a_head_dim_past_its_tiles(monkeypatch, d, dv, which):
    """The GPU kernels' tiles end at 256: the kernel path (here forced on CPU tensors)
    raises before any launch, naming the tensor and the bound."""
    from flashfold.api import attention as api
    monkeypatch.setattr(api, "_use_kernel", lambda q: True)
    q, k, v = make_qkv(Shape(1, 2, 2, 8, 8, d, dv), torch.float16)
    with pytest.raises(ValueError, match=rf"^{which} head_dim must be in 1..256 for the GPU "
                                         rf"kernels, got {dv if which == 'v' else d}"):
        flashfold.attention(q, k, v)


# --- merge_states ------------------------------------------------------------------------------

def _parts(q, k, v, cuts, mask=None):
    """Partial results over key ranges, with float64 LSEs (the reference keeps them)."""
    fn = trace_mask_mod(mask).torch_fn("cpu") if mask is not None else None
    outs, lses = [], []
    for a, b in zip(cuts, cuts[1:]):
        m = (lambda bb, hh, i, j, a=a: fn(bb, hh, i, j + a)) if fn is not None else None
        o, lse = attention_reference(q, k[:, :, a:b], v[:, :, a:b], mask_mod=m)
        assert lse.dtype == torch.float64
        outs.append(o)
        lses.append(lse)
    return outs, lses


@given(cuts=st.lists(st.integers(0, 40), min_size=0, max_size=5), order=st.randoms(),
       masked=st.booleans())
def test_merge_states_any_split_any_order(cuts, order, masked):
    shape = Shape(1, 2, 2, 7, 40, 32)
    q, k, v = make_qkv(shape, torch.float64, seed=5)
    cuts = sorted({0, 40, *cuts})
    mask = (lambda b, h, i, j: (j < 10) | (j >= 30)) if masked else None
    outs, lses = _parts(q, k, v, cuts, mask)             # parts may be empty / fully masked
    perm = list(range(len(outs)))
    order.shuffle(perm)
    o, lse = flashfold.merge_states(torch.stack([outs[i] for i in perm]),
                                    torch.stack([lses[i] for i in perm]))
    ro, rl = oracle(q, k, v, **({"mask_mod": mask} if masked else {}))
    assert_close(o, ro, "float64", name="merged o")
    assert_close(lse, rl, "float32", scale=lse_scale(rl), name="merged lse")
    # pairwise, in the shuffled order (the pair form)
    o2, l2 = outs[perm[0]], lses[perm[0]]
    for i in perm[1:]:
        o2, l2 = merge_states_reference(torch.stack([o2, outs[i]]), torch.stack([l2, lses[i]]))
        o3, _ = flashfold.merge_states(outs[perm[0]], lses[perm[0]], outs[i], lses[i])
        assert torch.isfinite(o3).all()
    assert_close(o2, ro, "float64", name="pairwise o")


def test_merge_states_public_api_with_float32_lse():
    shape = Shape(2, 2, 1, 9, 50, 32)
    q, k, v = make_qkv(shape, torch.float32, seed=6)
    a = flashfold.attention(q, k[:, :, :20], v[:, :, :20], return_lse=True)
    b = flashfold.attention(q, k[:, :, 20:], v[:, :, 20:], return_lse=True)
    o, lse = flashfold.merge_states(*a, *b)
    ro, rl = naive_attention(q, k, v)
    assert_close(o, ro, "float32", name="o")
    assert_close(lse, rl, "float32", scale=lse_scale(rl), name="lse")


def test_merge_states_of_empty_parts_is_zero_and_minus_inf():
    o = torch.randn(3, 2, 4, 5, 32)
    lse = torch.full((3, 2, 4, 5), -math.inf)
    mo, ml = flashfold.merge_states(o, lse)
    assert (mo == 0).all() and (ml == -math.inf).all()
    lse[1, :, :, 2] = 0.5                                   # one live part: returned as is
    mo, ml = flashfold.merge_states(o, lse)
    assert torch.equal(mo[:, :, 2], o[1, :, :, 2]) and (ml[:, :, 2] == 0.5).all()


def test_merge_states_reference_uses_the_monoid_lift():
    outs = torch.randn(2, 3, 4, dtype=torch.float64)
    lses = torch.tensor([[0.0, 1.0, -math.inf], [2.0, -math.inf, -math.inf]], dtype=torch.float64)
    o, lse = merge_states_reference(outs, lses)
    w = torch.softmax(torch.nan_to_num(lses, neginf=-1e300), 0)
    expect = (w[..., None] * outs).sum(0)
    expect[2] = 0
    assert_close(o, expect, "float64", name="o")
    assert_close(lse, torch.logsumexp(lses, 0), "float64", name="lse")


# --- block masks ----------------------------------------------------------------------------------

def _dense(mask, B, H, Q, K):
    fn = trace_mask_mod(mask).torch_fn("cpu")
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    i = torch.arange(Q).view(1, 1, Q, 1)
    j = torch.arange(K).view(1, 1, 1, K)
    return torch.as_tensor(fn(b, h, i, j)).expand(B, H, Q, K)


@pytest.mark.parametrize("name,mask,B,H", [
    ("causal", mods.causal_mask, None, None),
    ("document", mods.document_mask(torch.tensor([0] * 20 + [1] * 33 + [2] * 17)), None, None),
    ("per-batch-prefix", mods.prefix_lm_mask(torch.tensor([3, 40])), 2, None),
    ("head-dependent", lambda b, h, i, j: (j <= i + 16 * h), None, 3),
])
def test_block_mask_classifies_every_tile(name, mask, B, H):
    Q, K, T = 70, 70, 16
    bm = create_block_mask(mask, B, H, Q, K, device="cpu", BLOCK_SIZE=T)
    dense = _dense(mask, B or 1, H or 1, Q, K)
    n = -(-Q // T)
    for b in range(dense.shape[0]):
        for h in range(dense.shape[1]):
            for tm in range(n):
                for tn in range(n):
                    rows = dense[b, h, tm * T:(tm + 1) * T]              # real rows only
                    tile = torch.zeros(rows.shape[0], T, dtype=torch.bool)
                    cols = rows[:, tn * T:(tn + 1) * T]                  # real columns only
                    tile[:, :cols.shape[1]] = cols
                    want = EMPTY if not tile.any() else FULL if tile.all() else PARTIAL
                    got = int(bm.state[min(b, bm.state.shape[0] - 1), min(h, bm.state.shape[1] - 1), tm, tn])
                    assert got == want, (name, b, h, tm, tn)
    for kind, num, idx in ((PARTIAL, bm.partial_num, bm.partial_idx), (FULL, bm.full_num, bm.full_idx)):
        hits = bm.state == kind
        assert torch.equal(num, hits.sum(-1).to(torch.int32))
        for r in range(hits.shape[2]):
            want = hits[0, 0, r].nonzero().flatten().tolist()
            assert idx[0, 0, r, :len(want)].tolist() == want
    assert 0.0 <= bm.sparsity() <= 1.0 and "BlockMask" in repr(bm)


def test_block_mask_broadcasts_and_rejects_missing_batch():
    bm = create_block_mask(mods.causal_mask, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    assert bm.state.shape == (1, 1, 4, 4)
    with pytest.raises(ValueError, match="depends on b"):
        create_block_mask(mods.prefix_lm_mask(torch.tensor([1, 2])), None, None, 8, 8, device="cpu")
    with pytest.raises(ValueError, match="power of two"):
        create_block_mask(mods.causal_mask, None, None, 8, 8, device="cpu", BLOCK_SIZE=24)


def test_block_mask_sizes_may_be_numpy_ints():
    """Sizes and tiles that are NumPy ints (``arr.shape`` of an array, a config) are ints."""
    want = create_block_mask(mods.prefix_lm_mask(torch.tensor([1, 2])), 2, 3, 40, 50,
                             device="cpu", BLOCK_SIZE=(16, 32))
    got = create_block_mask(mods.prefix_lm_mask(torch.tensor([1, 2])), np.int64(2), np.int32(3),
                            np.int64(40), np.int64(50), device="cpu",
                            BLOCK_SIZE=(np.int64(16), np.int64(32)))
    assert got.shape == want.shape == (2, 3, 40, 50)
    assert all(type(n) is int for n in got.shape)
    assert torch.equal(got.state, want.state) and torch.equal(got.to_dense(), want.to_dense())
    one = create_block_mask(mods.causal_mask, None, None, 40, 50, device="cpu",
                            BLOCK_SIZE=np.int64(32))          # one NumPy int: both tiles
    assert one.BLOCK_SIZE == (32, 32) and all(type(n) is int for n in one.BLOCK_SIZE)


def test_block_mask_used_on_cpu_path_and_checked():
    shape = Shape(2, 2, 2, 40, 40, 32)
    q, k, v = make_qkv(shape, torch.float64)
    docs = torch.tensor([0] * 13 + [1] * 27)
    bm = create_block_mask(mods.document_mask(docs), None, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    o = flashfold.attention(q, k, v, mask_mod=bm)
    assert_close(o, oracle(q, k, v, mask_mod=mods.document_mask(docs))[0], "float64", name="o")
    with pytest.raises(ValueError, match="Q_LEN=40"):
        flashfold.attention(q[:, :, :20], k, v, mask_mod=bm)


def test_block_mask_cache_follows_buffer_versions():
    from flashfold.kernels.attention.mods import cached_block_mask
    docs = torch.tensor([0] * 8 + [1] * 8)
    mod = trace_mask_mod(mods.document_mask(docs))
    kw = dict(batch=1, heads=1, q_len=16, kv_len=16, block_m=16, block_n=16, device="cpu")
    a = cached_block_mask(mod, **kw)
    assert cached_block_mask(mod, **kw) is a
    docs[:] = 0                                            # in-place change: recomputed
    b = cached_block_mask(mod, **kw)
    assert b is not a and int(b.state.flatten()[0]) == FULL


def test_numpy_tables_are_read_again_after_a_write_in_place():
    """A mod's ``ops.Buffer`` over a NumPy array (kept by reference, as documented): an
    in-place write moves no torch version counter, so the block mask and the device copies
    cached by version were reused with the old values (a stale mask on the CPU path too).
    Their versions now follow the array's contents."""
    from flashfold.kernels.attention.mods import cached_block_mask
    docs = np.array([0] * 8 + [1] * 8)
    ids = ops.Buffer(docs)

    def same_doc(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]
    mod = trace_mask_mod(same_doc)
    kw = dict(batch=1, heads=1, q_len=16, kv_len=16, block_m=16, block_n=16, device="cpu")
    a = cached_block_mask(mod, **kw)
    assert cached_block_mask(mod, **kw) is a
    here = mod.buffer_args("cpu")
    assert mod.buffer_args("cpu") is here
    docs[:] = 0                                            # in-place change: recomputed
    b = cached_block_mask(mod, **kw)
    assert b is not a and int(b.state.flatten()[0]) == FULL
    again = mod.buffer_args("cpu")
    assert again is not here and torch.equal(again[0], torch.zeros(16, dtype=again[0].dtype))
    q, k, v = make_qkv(Shape(1, 1, 1, 16, 16, 8), torch.float64)
    assert_close(flashfold.attention(q, k, v, mask_mod=same_doc), oracle(q, k, v)[0],
                 "float64", name="o, one document after the write")


def test_inference_tensors_are_read_at_every_call():
    """Tensors made under ``torch.inference_mode`` have no version counter: offsets and a
    mask's tables made there work (they used to raise "Inference tensors do not track
    version counter"), and a write in place between two calls is seen by the second."""
    with torch.inference_mode():
        q, k, v = make_qkv(Shape(1, 2, 2, 12, 12, 8), torch.float64)
        cu = torch.tensor([0, 4, 12], dtype=torch.int32)
        lengths = torch.tensor([9])
        pad = mods.key_padding_mask(lengths)
        for split, keep in ((4, 9), (7, 5)):
            cu[1] = split
            lengths.fill_(keep)
            o = flashfold.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)
            want = torch.cat([oracle(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])[0]
                              for a, b in ((0, split), (split, 12))], 2)
            assert_close(o, want, "float64", name=f"o, sequences split at {split}")
            o = flashfold.attention(q, k, v, mask_mod=pad)
            want = oracle(q, k, v, mask_mod=mods.key_padding_mask(torch.tensor([keep])))[0]
            assert_close(o, want, "float64", name=f"o, {keep} keys kept")


# --- mods helpers ---------------------------------------------------------------------------------

def test_alibi_slopes():
    assert torch.allclose(mods.alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    s = mods.alibi_slopes(12)                             # 8 of n=8, then every other of n=16
    assert len(s) == 12 and torch.allclose(s[8:], torch.tensor([2.0 ** -(0.5 + i) for i in range(4)]))



def test_score_mod_constants_are_float64_on_float64_inputs():
    """A Python number through a function (``exp(0.1)``, a parameter's ``log``) is computed
    in float64 on the float64 path, not in torch's default float32."""
    from flashfold.algebra.lower import compile_graph
    from flashfold.kernels.attention.mods import trace_score_mod
    from flashfold.kernels.torch_lower import TORCH
    s = torch.linspace(-3, 3, 7, dtype=torch.float64)
    f = trace_score_mod(lambda score, b, h, q, kv: score * ops.exp(0.1)).torch_fn("cpu")
    out = f(s, torch.tensor(0), torch.tensor(0), torch.tensor(0), torch.tensor(0))
    assert_close(out, s.numpy() * math.exp(0.1), "float64", name="score * exp(0.1)")
    m = flashfold.Monoid("scaled", fields=("s",), identity=(0.0,), lift=lambda x: (x,),
                         combine=lambda a, b: (a.s + b.s,),
                         finalize=lambda st, k: (st.s + ops.log(k), ops.sqrt(k)),
                         params={"k": 2.0})
    fin = compile_graph(m.finalize_graph, TORCH)
    for k in (0.1, 3, np.float64(0.7)):
        y, r = fin(s, k)
        assert y.dtype == r.dtype == torch.float64
        assert_close(y, s.numpy() + math.log(k), "float64", name=f"s + log({k})")
        assert_close(r, math.sqrt(k), "float64", name=f"sqrt({k})")

def test_relative_bias_clamps_distance():
    table = torch.arange(5, dtype=torch.float64).view(1, 5)    # D = 2
    from flashfold.kernels.attention.mods import trace_score_mod
    f = trace_score_mod(mods.relative_bias(table)).torch_fn("cpu")
    i = torch.tensor([[0], [5]])
    j = torch.tensor([[0, 1, 9]])
    out = f(torch.zeros(2, 3, dtype=torch.float64), torch.tensor(0), torch.tensor(0), i, j)
    assert out.tolist() == [[2.0, 3.0, 4.0], [0.0, 0.0, 4.0]]


def test_mods_are_traced_once_per_function_and_named():
    m = mods.document_mask(torch.zeros(4, dtype=torch.long))
    assert m.__name__ == "document_mask"
    assert trace_mask_mod(m) is trace_mask_mod(m)
    assert "eq" in trace_mask_mod(m).graph.text()
    both = mods.and_masks(mods.causal_mask, mods.sliding_window_mask(2))
    g = trace_mask_mod(both).graph.text()
    assert "and" in g and both.__name__ == "and_masks"


def test_python_branching_in_a_mod_is_rejected():
    def bad(score, b, h, q_idx, kv_idx):
        return score if q_idx > kv_idx else -score
    q = torch.zeros(1, 1, 2, 32)
    with pytest.raises(TypeError, match="ops.where"):
        flashfold.attention(q, q, q, score_mod=bad)


# --- validation ------------------------------------------------------------------------------------

def _qkv(**over):
    d = dict(q=torch.zeros(1, 4, 8, 32), k=torch.zeros(1, 2, 8, 32), v=torch.zeros(1, 2, 8, 32))
    d.update(over)
    return d


@pytest.mark.parametrize("over,kw,exc,match", [
    ({"q": torch.zeros(4, 8, 32)}, {}, ValueError, "q must have 4 dims"),
    ({"k": [1]}, {}, TypeError, "k must be a torch.Tensor"),
    ({"v": torch.zeros(1, 2, 8, 32, dtype=torch.float64)}, {}, TypeError, "v dtype"),
    ({"q": torch.zeros(1, 4, 8, 32, dtype=torch.int32), "k": torch.zeros(1, 2, 8, 32, dtype=torch.int32),
      "v": torch.zeros(1, 2, 8, 32, dtype=torch.int32)}, {}, TypeError, "q dtype"),
    ({"k": torch.zeros(1, 3, 8, 32), "v": torch.zeros(1, 3, 8, 32)}, {}, ValueError, "multiple of k/v heads"),
    ({"v": torch.zeros(1, 2, 9, 32)}, {}, ValueError, "v seq length"),
    ({"k": torch.zeros(1, 2, 8, 64)}, {}, ValueError, "k head_dim"),
    ({"q": torch.zeros(1, 4, 8, 0), "k": torch.zeros(1, 2, 8, 0)}, {}, ValueError,
     "head_dim must be >= 1, got 0"),
    ({"k": torch.zeros(2, 2, 8, 32)}, {}, ValueError, "batch sizes"),
    ({"k": torch.zeros(1, 2, 8, 32, device="meta")}, {}, ValueError, "k is on meta but q is on cpu"),
    ({}, {"window": 3}, ValueError, "window must be a pair"),
    ({}, {"window": (-2, 0)}, ValueError, "window left"),
    ({}, {"window": (1, 2.5)}, ValueError, "window right"),
    ({}, {"scale": 0.0}, ValueError, "scale must be finite and > 0"),
    ({}, {"scale": float("nan")}, ValueError, "scale"),
    ({}, {"softcap": -1.0}, ValueError, "softcap"),
    # past float32's largest value a scale or cap would be inf in the kernels (NaN rows)
    ({}, {"softcap": 1e39}, ValueError, "softcap must be at most 3.40282e"),
    ({}, {"scale": 1e39}, ValueError, "scale must be at most 3.40282e"),
    ({}, {"causal": 1}, TypeError, "causal must be a bool"),
    ({}, {"score_mod": 3}, TypeError, "score_mod must be a callable"),
    # a mask_mod returns a truth value, a score_mod a score; each takes its positions
    ({}, {"mask_mod": lambda b, h, i, j: i - j}, TypeError, "mask_mod .* must return a truth"),
    ({}, {"mask_mod": lambda b, h, i, j: ops.Buffer(torch.ones(8, dtype=torch.int8))[j]},
     TypeError, "mask_mod .* must return a truth"),
    ({}, {"score_mod": lambda s, b, h, i, j: i >= j}, TypeError, "score_mod .* truth value"),
    ({}, {"mask_mod": lambda b, h, i: i >= 0}, TypeError, r"mask_mod .* must take \(b, h, q_idx"),
    ({}, {"score_mod": lambda s, b: s}, TypeError, r"score_mod .* must take \(score, b, h"),
    ({}, {"cu_seqlens_q": torch.tensor([0, 8], dtype=torch.int32)}, ValueError, "given together"),
    ({}, {"cu_seqlens_q": torch.tensor([0, 8]), "cu_seqlens_k": torch.tensor([0, 8])}, TypeError, "int32"),
    ({}, {"cu_seqlens_q": torch.tensor([0, 9, 8], dtype=torch.int32),
          "cu_seqlens_k": torch.tensor([0, 4, 8], dtype=torch.int32)}, ValueError, "non-decreasing"),
    ({}, {"cu_seqlens_q": torch.tensor([0, 7], dtype=torch.int32),
          "cu_seqlens_k": torch.tensor([0, 8], dtype=torch.int32)}, ValueError, "end at the packed length 8"),
    ({}, {"cu_seqlens_q": torch.tensor([0, 4, 8], dtype=torch.int32),
          "cu_seqlens_k": torch.tensor([0, 8], dtype=torch.int32)}, ValueError, "sequences"),
])
def test_validation_names_the_argument(over, kw, exc, match):
    with pytest.raises(exc, match=match):
        flashfold.attention(**_qkv(**over), **kw)


@pytest.mark.parametrize("args,exc,match", [
    ((torch.zeros(2, 3, 32), torch.zeros(2, 3), torch.zeros(2, 3, 32), torch.zeros(2, 4)), ValueError, "lse_b shape"),
    ((torch.zeros(2, 3, 32), torch.zeros(2, 3), torch.zeros(2, 4, 32), torch.zeros(2, 4)), ValueError, "o_a shape"),
    ((torch.zeros(2, 3, 32), torch.zeros(2, 3), torch.zeros(2, 3, 32).half(), torch.zeros(2, 3)), TypeError, "dtype"),
    ((torch.zeros(0, 3, 32), torch.zeros(0, 3)), ValueError, "at least one part"),
    ((torch.zeros(3, 32),), TypeError, "takes"),
    ((torch.zeros(2, 3, 32), torch.zeros(2, 3, device="meta")), ValueError, "lses is on meta"),
    ((torch.zeros(2, 3, 32, dtype=torch.int64), torch.zeros(2, 3)), TypeError, "floating point"),
])
def test_merge_states_validation(args, exc, match):
    with pytest.raises(exc, match=match):
        flashfold.merge_states(*args)


def test_empty_inputs():
    q = torch.zeros(1, 2, 0, 32)
    k = torch.zeros(1, 2, 5, 32)
    assert flashfold.attention(q, k, k).shape == (1, 2, 0, 32)
    o, lse = flashfold.attention(k, q, q, return_lse=True)      # no keys at all
    assert (o == 0).all() and (lse == -math.inf).all()


def test_mask_mods_of_bool_tables_and_where_are_truth_values():
    """A mask_mod may return an entry of a bool table, or a ``where`` between truth
    values: the first gives the attention of the same table applied by the float64
    oracle, the second that of the same mask written with ``|``."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 8, 16, dtype=torch.float64, generator=g) for _ in range(3))
    allowed = torch.rand(8, 8, generator=g) > 0.3
    allowed[:, 0] = True
    tab = ops.Buffer(allowed)
    o = flashfold.attention(q, k, v, mask_mod=lambda b, h, i, j: tab[i, j])
    want, _ = naive_attention(q, k, v, mask_mod=lambda b, h, i, j: allowed[i, j])
    assert_close(o, want)
    o_where = flashfold.attention(q, k, v, mask_mod=lambda b, h, i, j: ops.where(i >= j, True, j == 0))
    o_or = flashfold.attention(q, k, v, mask_mod=lambda b, h, i, j: (i >= j) | (j == 0))
    assert torch.equal(o_where, o_or)
    assert not torch.equal(o_or, o)


@pytest.mark.parametrize("make, exc, match", [
    (lambda: mods.softcap_mod(0), ValueError, r"^cap must be finite and > 0, got 0\.0"),
    (lambda: mods.softcap_mod(-2.0), ValueError, r"^cap must be finite and > 0"),
    (lambda: mods.softcap_mod(1e39), ValueError, r"^cap must be at most"),
    (lambda: mods.softcap_mod("30"), TypeError, r"^cap must be a real number, got str"),
    (lambda: mods.softcap_mod(None), TypeError, r"^cap must be a real number"),
    (lambda: mods.sliding_window_mask(-2), ValueError, r"^window left must be >= 0"),
    (lambda: mods.sliding_window_mask(2.5), TypeError, r"^window left must be an int"),
    (lambda: mods.sliding_window_mask(3, right=True), TypeError, r"^window right must be an int"),
    (lambda: mods.alibi_slopes(2.5), TypeError, r"^num_heads must be an int, got float"),
    (lambda: mods.alibi_slopes("4"), TypeError, r"^num_heads must be an int, got str"),
    (lambda: mods.alibi(2, slopes=torch.ones(2, 2)), ValueError, r"^slopes: expected a 1-D"),
    (lambda: mods.alibi(2, slopes=torch.ones(4)), ValueError,
     r"^slopes: alibi\(num_heads=2\) needs one slope per head, got 4"),
    (lambda: mods.alibi(8, slopes=[0.5, 0.25]), ValueError,
     r"^slopes: alibi\(num_heads=8\) needs one slope per head, got 2"),
    (lambda: mods.alibi(None, slopes=[0.5, 0.25]), TypeError,
     r"^num_heads must be an int, got NoneType"),
    (lambda: mods.alibi(2.0, slopes=[0.5, 0.25]), TypeError, r"^num_heads must be an int"),
    (lambda: mods.alibi(True), TypeError, r"^num_heads must be an int, got bool"),
    (lambda: mods.key_padding_mask(torch.tensor([[3]])), ValueError, r"^lengths: expected a 1-D"),
    # a bool or a float where an int is expected: True was read as 1, 1.5 truncated to 1
    (lambda: mods.relative_bias(torch.zeros(3), max_distance=True), TypeError,
     r"^max_distance must be an int, got bool"),
    (lambda: mods.relative_bias(torch.zeros(3), max_distance=1.0), TypeError,
     r"^max_distance must be an int, got float"),
    (lambda: mods.relative_bias(torch.zeros(3), max_distance=1.5), TypeError,
     r"^max_distance must be an int, got float"),
    (lambda: mods.relative_bias(torch.zeros(3), max_distance=-1), ValueError,
     r"^max_distance must be >= 0, got -1"),
    (lambda: mods.prefix_lm_mask(True), TypeError, r"^prefix_len must be an int"),
    (lambda: mods.prefix_lm_mask(3.0), TypeError, r"^prefix_len must be an int"),
    (lambda: mods.prefix_lm_mask(-2), ValueError, r"^prefix_len must be >= 0, got -2"),
    (lambda: mods.sliding_window_mask(True), TypeError, r"^window left must be an int"),
    (lambda: mods.sliding_window_mask(2.0), TypeError, r"^window left must be an int"),
    (lambda: mods.prefix_lm_mask(torch.tensor([[3]])), ValueError, r"^prefix_len: expected a 1-D"),
])
def test_mod_factories_refuse_what_attention_refuses_naming_the_argument(make, exc, match):
    """A factory checks its arguments as ``attention`` checks the same ones (``softcap``,
    ``window``): ``softcap_mod(0)`` gave every score 0 (uniform weights) and
    ``sliding_window_mask(-2)`` hid every key, both without an error."""
    with pytest.raises(exc, match=match):
        make()


def test_mod_factories_take_what_attention_takes():
    """``sliding_window_mask``'s sides are unbounded at ``None`` or ``-1`` (as
    ``attention``'s ``window``); ``alibi`` takes its slopes as a sequence; a table given as
    a list is a table."""
    q, k, v = make_qkv(Shape(2, 2, 2, 9, 9, 8), torch.float64, seed=3)
    for left in (None, -1):
        assert_close(flashfold.attention(q, k, v, mask_mod=mods.sliding_window_mask(left)),
                     flashfold.attention(q, k, v, mask_mod=mods.causal_mask), "float64",
                     name=f"left={left}")
    assert_close(flashfold.attention(q, k, v, mask_mod=mods.sliding_window_mask(2, 1)),
                 flashfold.attention(q, k, v, window=(2, 1)), "float64", name="window (2, 1)")
    slopes = [0.5, 0.25]
    assert_close(flashfold.attention(q, k, v, score_mod=mods.alibi(2, slopes)),
                 flashfold.attention(q, k, v, score_mod=mods.alibi(2, torch.tensor(slopes))),
                 "float64", name="alibi slopes as a list")
    assert_close(flashfold.attention(q, k, v, mask_mod=mods.key_padding_mask([4, 9])),
                 flashfold.attention(q, k, v, mask_mod=mods.key_padding_mask(torch.tensor([4, 9]))),
                 "float64", name="lengths as a list")
    assert_close(flashfold.attention(q, k, v, score_mod=mods.softcap_mod(2.0)),
                 flashfold.attention(q, k, v, softcap=2.0), "float64", name="softcap")
    assert_close(flashfold.attention(q, k, v, mask_mod=mods.prefix_lm_mask(np.int64(3))),
                 flashfold.attention(q, k, v, mask_mod=mods.prefix_lm_mask(3)), "float64",
                 name="prefix_len as a NumPy int")


def test_prefix_lm_mask_takes_a_0d_int_tensor():
    """A 0-d int tensor is a prefix length shared by the batch, as a Python int is: a
    one-entry table the mod reads at index 0 (so a write to it in place is seen by the next
    call, with no host read of its value); the float64 oracle is the mask written out."""
    from flashfold.kernels.attention.reference import naive_attention
    q, k, v = make_qkv(Shape(2, 2, 2, 9, 9, 8), torch.float64, seed=4)
    prefix = torch.tensor(3)
    mod = mods.prefix_lm_mask(prefix)
    for n in (3, 6):
        prefix.fill_(n)
        want, _ = naive_attention(q, k, v, mask_mod=lambda b, h, i, j, n=n: (j < n) | (j <= i))
        assert_close(flashfold.attention(q, k, v, mask_mod=mod), want, "float64",
                     name=f"0-d prefix {n}")
        assert_close(flashfold.attention(q, k, v, mask_mod=mods.prefix_lm_mask(np.array(n))),
                     want, "float64", name=f"0-d NumPy prefix {n}")
    # per batch: a (batch,) table, as documented
    want, _ = naive_attention(q, k, v, mask_mod=lambda b, h, i, j: (j < 2 + 3 * b) | (j <= i))
    assert_close(flashfold.attention(q, k, v, mask_mod=mods.prefix_lm_mask(torch.tensor([2, 5]))),
                 want, "float64", name="per-batch prefix")
    meta = torch.empty(2, 2, 9, 8, device="meta")
    o = flashfold.attention(meta, meta, meta,
                            mask_mod=mods.prefix_lm_mask(torch.tensor(3, device="meta")))
    assert o.device.type == "meta" and o.shape == (2, 2, 9, 8)


@pytest.mark.parametrize("prefix", [torch.tensor(3.0), torch.tensor([3.0, 4.0]),
                                    torch.tensor(True), torch.tensor([True, False])],
                         ids=["0-d float", "1-D float", "0-d bool", "1-D bool"])
def test_prefix_lm_mask_refuses_a_tensor_that_is_not_of_ints(prefix):
    """A float or bool tensor is not a length (``True`` would read as 1, ``2.5`` as a
    bound between keys): a TypeError that says what to pass."""
    with pytest.raises(TypeError, match=r"^prefix_len: expected an integer tensor"):
        mods.prefix_lm_mask(prefix)


@pytest.mark.parametrize("block", [(16,), (16, 16, 16), "16", None])
def test_create_block_mask_names_a_malformed_block_size(block):
    """``BLOCK_SIZE`` is an int or a pair: a 1-tuple was an unpacking error, a string was
    read as ``BLOCK_M = '1'``."""
    with pytest.raises(ValueError, match=r"^BLOCK_SIZE: expected an int or a pair"):
        create_block_mask(mods.causal_mask, None, None, 8, 8, device="cpu", BLOCK_SIZE=block)
