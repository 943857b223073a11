"""A user's mistake gets a ValueError / TypeError naming what the user passed, before
anything is computed; never a silently wrong result or a crash deep inside.

Covers: captured tables of score_mod / mask_mod shorter than what the call indexes,
PagedKVCache's arguments, meta tensors (one rule for attention, merge_states and decode),
windows wider than any sequence, and decode's scalar options (the same checks as
attention's)."""

import math
import sys
from unittest import mock

import pytest
import torch

import flashfold as ff
from flashfold import mods, ops
from flashfold.testing import assert_close


def _qkv(B=2, H=4, N=16, D=32, dtype=torch.float64, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, D, generator=g, dtype=dtype, **kw) for _ in range(3)]


# --- captured tables shorter than what they are indexed by -----------------------------------

SHORT_TABLES = [
    ("document_mask", dict(mask_mod=mods.document_mask(torch.zeros(10, dtype=torch.int64))),
     r"mask_mod 'document_mask' reads its table 0 of shape \(10,\) at index 15 along dim 0 "
     r"\(from q_idx\), past its 10 entries: with B=2, H=4, Nq=16, Nk=16"),
    ("kv_doc_ids", dict(mask_mod=mods.document_mask(torch.zeros(16, dtype=torch.int64),
                                                    torch.zeros(12, dtype=torch.int64))),
     r"table 1 of shape \(12,\) at index 15 along dim 0 \(from kv_idx\)"),
    ("document_mask_rows", dict(mask_mod=mods.document_mask(torch.zeros(1, 16, dtype=torch.int64))),
     r"table 0 of shape \(1, 16\) at index 1 along dim 0 \(from b\), past its 1 entries"),
    ("alibi", dict(score_mod=mods.alibi(2)),
     r"score_mod 'alibi' reads its table 0 of shape \(2,\) at index 3 along dim 0 \(from h\).*H=4"),
    ("key_padding_mask", dict(mask_mod=mods.key_padding_mask(torch.tensor([5]))),
     r"mask_mod 'key_padding_mask' .* index 1 along dim 0 \(from b\), past its 1 entries.*B=2"),
    ("prefix_lm", dict(mask_mod=mods.prefix_lm_mask(torch.tensor([3]))), r"prefix_lm_mask.*B=2"),
    ("relative_bias_heads", dict(score_mod=mods.relative_bias(torch.zeros(3, 9))),
     r"relative_bias.*shape \(3, 9\) at index 3 along dim 0 \(from h\)"),
]


@pytest.mark.parametrize("kw, match", [c[1:] for c in SHORT_TABLES], ids=[c[0] for c in SHORT_TABLES])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "differentiable"])
def test_a_short_table_is_a_value_error_naming_the_mod_and_sizes(kw, match, grad):
    q, k, v = _qkv(requires_grad=grad)
    with pytest.raises(ValueError, match=match):
        ff.attention(q, k, v, **kw)


def test_alibi_on_more_query_heads_than_slopes_names_the_score_mod():
    """``alibi(n)`` on ``Hq > n`` heads would read slope ``h >= n`` past its table (the
    lowerings clamp the index: every extra head would get the last slope, silently): the
    call refuses it before computing, naming the score_mod and the head count, on every
    path (CPU, differentiable, meta shapes)."""
    match = r"^score_mod 'alibi' reads its table 0 of shape \(2,\) at index 3 .*H=4"
    for grad in (False, True):
        q, k, v = _qkv(requires_grad=grad)
        with pytest.raises(ValueError, match=match):
            ff.attention(q, k, v, score_mod=mods.alibi(2, slopes=[0.5, 0.25]))
    q = torch.empty(2, 4, 16, 32, device="meta")
    with pytest.raises(ValueError, match=match):
        ff.attention(q, q, q, score_mod=mods.alibi(2))


def test_a_short_table_raises_in_create_block_mask():
    short = mods.document_mask(torch.zeros(10, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"document_mask.*index 15.*Nq=16, Nk=16"):
        ff.create_block_mask(short, None, None, 16, 16, device="cpu", BLOCK_SIZE=16)
    ff.create_block_mask(short, None, None, 10, 10, device="cpu", BLOCK_SIZE=16)   # covers 10
    with pytest.raises(ValueError, match=r"mask_mod '<lambda>' .* \(from h\).*H=4"):
        ff.create_block_mask(lambda b, h, q, kv: mods.alibi(2)(0.0, b, h, q, kv) > 0, 1, 4, 16,
                             16, device="cpu", BLOCK_SIZE=16)


def test_a_short_table_raises_on_the_kernel_path(monkeypatch):
    """The check runs before dispatch, so the Triton path (here under the interpreter)
    refuses the same call without launching."""
    from flashfold.api import attention as api
    monkeypatch.setattr(api, "_use_kernel", lambda q: True)
    q, k, v = _qkv(dtype=torch.float16)
    with pytest.raises(ValueError, match="alibi"):
        ff.attention(q, k, v, score_mod=mods.alibi(2))


def test_tables_that_cover_the_indices_pass():
    """No false alarm: clamped indices (relative_bias), a table longer than needed, an
    index clamped on purpose, per-sequence positions with cu_seqlens."""
    q, k, v = _qkv()
    ff.attention(q, k, v, score_mod=mods.relative_bias(torch.zeros(4, 7)))    # clamp(+-3)
    ff.attention(q, k, v, mask_mod=mods.document_mask(torch.zeros(40, dtype=torch.int64)))
    ff.attention(q, k, v, score_mod=mods.alibi(8), causal=True)
    short = ops.Buffer(torch.zeros(10))

    def clamped(score, b, h, q_idx, kv_idx):
        return score + short[ops.minimum(kv_idx, 9)]
    ff.attention(q, k, v, score_mod=clamped)
    # cu_seqlens: q_idx/kv_idx are positions inside a sequence (longest: 9), b the sequence
    cu = torch.tensor([0, 5, 14], dtype=torch.int32)
    qp, kp, vp = _qkv(B=1, N=14)
    ff.attention(qp, kp, vp, cu_seqlens_q=cu, cu_seqlens_k=cu,
                 mask_mod=mods.document_mask(torch.zeros(9, dtype=torch.int64)))
    ff.attention(qp, kp, vp, cu_seqlens_q=cu, cu_seqlens_k=cu,
                 mask_mod=mods.key_padding_mask(torch.tensor([5, 9])))
    with pytest.raises(ValueError, match=r"index 8 along dim 0 \(from q_idx\).*B=2, H=4, Nq=9"):
        ff.attention(qp, kp, vp, cu_seqlens_q=cu, cu_seqlens_k=cu,
                     mask_mod=mods.document_mask(torch.zeros(8, dtype=torch.int64)))


def test_a_precomputed_block_mask_is_checked_with_the_call_sizes():
    bm = ff.create_block_mask(mods.key_padding_mask(torch.tensor([5])), 1, None, 16, 16,
                              device="cpu", BLOCK_SIZE=16)
    q, k, v = _qkv(B=1)
    ff.attention(q, k, v, mask_mod=bm)
    with pytest.raises(ValueError, match="alibi"):
        ff.attention(q, k, v, mask_mod=bm, score_mod=mods.alibi(2))


def test_the_interval_of_an_index_is_exact():
    """What a table read reaches, for the expressions indices are made of."""
    from flashfold.kernels.attention.mods import table_bounds, trace_score_mod
    t = ops.Buffer(torch.zeros(100))

    def fn(score, b, h, q_idx, kv_idx):
        return (score + t[ops.clamp(kv_idx - q_idx, -3, 3) + 3] + t[(q_idx * 2 + 1) // 3]
                + t[kv_idx % 5] + t[ops.where(q_idx < kv_idx, h, b + 10)] + t[ops.abs(q_idx - 7)]
                + t[ops.to_int(ops.to_float(q_idx) * 0.5)] + t[ops.to_int(score)])
    got = [iv for *_, iv in table_bounds(trace_score_mod(fn).reads, (2, 4, 16, 16))]
    assert got == [(0, 6), (0, 10), (0, 4), (0, 11), (0, 8), (0, 7), (None, None)]


# --- PagedKVCache ----------------------------------------------------------------------------

@pytest.mark.parametrize("kw, exc, match", [
    (dict(page_size=0), ValueError, r"page_size must be an int >= 1, got 0"),
    (dict(page_size=2.5), TypeError, r"page_size must be an int, got float"),
    (dict(max_len=-5), ValueError, r"max_len must be an int >= 1, got -5"),
    (dict(max_len=0), ValueError, r"max_len must be an int >= 1, got 0"),
    (dict(batch=0), ValueError, r"batch must be an int >= 1"),
    (dict(heads_kv=True), TypeError, r"heads_kv must be an int, got bool"),
    (dict(head_dim=300), ValueError, r"head_dim must be in 1..256, got 300"),
    (dict(dtype="bf16"), TypeError, r"dtype must be a torch.dtype"),
    (dict(dtype=torch.int32), TypeError, r"dtype must be one of"),
    (dict(shuffle=1), TypeError, r"shuffle must be a bool"),
    (dict(shuffle=True, seed=2 ** 70), ValueError, r"seed must fit in 64 bits"),
])
def test_paged_kv_cache_allocate_checks_its_arguments(kw, exc, match):
    args = dict(batch=2, max_len=32, heads_kv=2, head_dim=16, dtype=torch.float32)
    args.update(kw)
    with pytest.raises(exc, match=match):
        ff.PagedKVCache.allocate(args.pop("batch"), args.pop("max_len"), args.pop("heads_kv"),
                                 args.pop("head_dim"), **args)


def _cache():
    return ff.PagedKVCache.allocate(2, 32, 2, 16, page_size=8, dtype=torch.float32)


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda a: a.update(k_pages=a["k_pages"].tolist()), TypeError, r"^k_pages must be a torch.Tensor"),
    (lambda a: a.update(v_pages=None), TypeError, r"^v_pages must be a torch.Tensor"),
    (lambda a: a.update(block_table=[[0]]), TypeError, r"^block_table must be a torch.Tensor"),
    (lambda a: a.update(seqlens=3), TypeError, r"^seqlens must be a torch.Tensor"),
    (lambda a: a.update(k_pages=a["k_pages"][0], v_pages=a["v_pages"][0]), ValueError,
     r"^k_pages: expected 4 dims \(num_pages, page_size, heads_kv, head_dim\), got shape \(8, 2, 16\)"),
    (lambda a: a.update(k_pages=torch.zeros(8, 8, 2, 300), v_pages=torch.zeros(8, 8, 2, 300)),
     ValueError, r"^k_pages: head_dim must be in 1..256"),
    (lambda a: a.update(k_pages=a["k_pages"].int(), v_pages=a["v_pages"].int()), TypeError,
     r"^k_pages: dtype must be one of"),
    (lambda a: a.update(v_pages=a["v_pages"][:4]), ValueError, r"^v_pages: shape"),
    (lambda a: a.update(seqlens=a["seqlens"][:1]), ValueError, r"^seqlens: expected shape \(2,\)"),
    (lambda a: a.update(seqlens=a["seqlens"].float()), TypeError, r"^seqlens: dtype"),
    (lambda a: a.update(block_table=a["block_table"][0]), ValueError, r"^block_table: expected shape"),
    (lambda a: a.update(block_table=a["block_table"][:0], seqlens=a["seqlens"][:0]), ValueError,
     r"^block_table: batch must be >= 1"),
])
def test_paged_kv_cache_errors_name_what_the_user_passed(mutate, exc, match):
    c = _cache()
    a = dict(k_pages=c.k_pages, v_pages=c.v_pages, block_table=c.block_table, seqlens=c.seqlens)
    mutate(a)
    with pytest.raises(exc, match=match) as info:
        ff.PagedKVCache(**a)
    assert not str(info.value).startswith(("q:", "q ", "cache_seqlens", "k_cache", "v_cache"))


def test_append_kv_errors_name_k_new_not_q():
    c = _cache()
    with pytest.raises(ValueError, match=r"^k_new: head_dim must be in 1..256"):
        ff.append_kv(torch.zeros(8, 8, 2, 300), torch.zeros(8, 8, 2, 300),
                     torch.zeros(2, 2, 1, 300), torch.zeros(2, 2, 1, 300), c.seqlens, c.block_table)
    with pytest.raises(ValueError, match=r"^k_new: 3 heads.*heads_kv=2"):
        c.append(torch.zeros(2, 3, 1, 16), torch.zeros(2, 3, 1, 16))
    with pytest.raises(ValueError, match=r"^k_new: batch and heads must be >= 1"):
        c.append(torch.zeros(2, 0, 1, 16), torch.zeros(2, 0, 1, 16))


def test_append_kv_from_a_view_of_the_cache_names_the_argument():
    """Appending tokens read from the cache itself (a view sharing its memory): a clear
    ValueError naming k_new / v_new, not torch's error from the overlapping copy; a copy
    appends."""
    kc, vc = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    lens = torch.tensor([2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^k_new: shares memory with k_cache"):
        ff.append_kv(kc, vc, kc[:, :, :2], vc[:, :, :2].clone(), lens)
    with pytest.raises(ValueError, match=r"^v_new: shares memory with v_cache"):
        ff.append_kv(kc, vc, kc[:, :, :2].clone(), vc[:, :, :2], lens)
    k_new, v_new = kc[:, :, :2].clone(), vc[:, :, :2].clone()
    assert ff.append_kv(kc, vc, k_new, v_new, lens).tolist() == [4]
    assert torch.equal(kc[:, :, 2:4], k_new) and torch.equal(vc[:, :, 2:4], v_new)


def test_a_block_table_without_pages_decodes_to_empty_rows():
    """A zero-capacity cache built by hand: lengths must be 0, and every row sees no key
    (o = 0, lse = -inf): no division by the page count."""
    k = torch.zeros(1, 8, 2, 16)
    cache = ff.PagedKVCache(k, k.clone(), torch.zeros(2, 0, dtype=torch.int32),
                            torch.zeros(2, dtype=torch.int32))
    o, lse = cache.decode(torch.randn(2, 2, 1, 16), return_lse=True)
    assert (o == 0).all() and (lse == -math.inf).all()
    with pytest.raises(ValueError, match=r"cache_seqlens: lengths must lie in \[0, 0\]"):
        ff.decode(torch.randn(2, 2, 1, 16), k, k, torch.ones(2, dtype=torch.int32),
                  block_table=torch.zeros(2, 0, dtype=torch.int32))


# --- meta tensors: shape propagation -----------------------------------------------------------

def _meta(*shape, dtype=torch.bfloat16, **kw):
    return torch.empty(*shape, dtype=dtype, device="meta", **kw)


@pytest.mark.parametrize("kw", [{}, dict(causal=True, window=(4, 0)), dict(score_mod=mods.alibi(4)),
                                dict(mask_mod=mods.document_mask(torch.zeros(16, dtype=torch.int64)))],
                         ids=["plain", "window", "score_mod", "mask_mod"])
def test_attention_on_meta_tensors_gives_meta_outputs(kw):
    q, k, v = _meta(2, 4, 16, 32), _meta(2, 2, 16, 32), _meta(2, 2, 16, 64)
    o, lse = ff.attention(q, k, v, return_lse=True, **kw)
    assert (o.device.type, o.shape, o.dtype) == ("meta", (2, 4, 16, 64), torch.bfloat16)
    assert (lse.device.type, lse.shape, lse.dtype) == ("meta", (2, 4, 16), torch.float32)
    with pytest.raises(ValueError, match="alibi"):              # shapes are still checked
        ff.attention(q, k, v, score_mod=mods.alibi(2))


def _meta_tables():
    return dict(score_mod=mods.alibi(4, slopes=torch.empty(4, device="meta")),
                mask_mod=mods.document_mask(torch.empty(16, dtype=torch.int64, device="meta")))


def test_meta_tables_with_meta_inputs_give_meta_outputs():
    """A mod whose table is a meta tensor (a model built on the meta device) propagates
    shapes with meta q, k, v, as a mod with a real table does; its block mask can be made
    on the meta device too (the per-row intervals, which need values, are skipped)."""
    q, k, v = _meta(2, 4, 16, 32), _meta(2, 2, 16, 32), _meta(2, 2, 16, 64)
    tables = _meta_tables()
    o = ff.attention(q, k, v, **tables)
    assert (o.device.type, o.shape, o.dtype) == ("meta", (2, 4, 16, 64), torch.bfloat16)
    for mask in (tables["mask_mod"], mods.document_mask(torch.zeros(16, dtype=torch.int64))):
        bm = ff.create_block_mask(mask, None, None, 16, 16, device="meta", BLOCK_SIZE=16)
        assert bm.state.device.type == "meta" and bm.state.shape == (1, 1, 1, 1)
        o = ff.attention(q, k, v, mask_mod=bm)
        assert o.device.type == "meta" and o.shape == (2, 4, 16, 64)


@pytest.mark.parametrize("which", ["score_mod", "mask_mod"])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "differentiable"])
def test_a_meta_table_with_real_inputs_is_a_value_error_naming_the_mod(which, grad):
    """A meta table has no values to compute with: a call on real q, k, v (or a block
    mask made on a real device) names the mod and the table, where the copy to the
    call's device raised NotImplementedError from deep inside."""
    mod = _meta_tables()[which]
    name = "score_mod 'alibi'" if which == "score_mod" else "mask_mod 'document_mask'"
    match = rf"^{name} captures its table 0 on the meta device"
    q, k, v = _qkv(requires_grad=grad)
    with pytest.raises(ValueError, match=match):
        ff.attention(q, k, v, **{which: mod})
    if which == "mask_mod":
        with pytest.raises(ValueError, match=match):
            ff.create_block_mask(mod, None, None, 16, 16, device="cpu", BLOCK_SIZE=16)


def test_attention_on_meta_tensors_propagates_gradients_and_packed_shapes():
    q, k, v = (_meta(1, 4, 16, 32, requires_grad=True) for _ in range(3))
    cu = torch.empty(3, dtype=torch.int32, device="meta")        # values unknown: shapes are not
    o, lse = ff.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, return_lse=True)
    assert o.device.type == "meta" and o.shape == (1, 4, 16, 32) and lse.shape == (1, 4, 16)
    (o.float().sum() + lse.sum()).backward()
    assert all(t.grad.device.type == "meta" and t.grad.shape == t.shape for t in (q, k, v))
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k hold different"):
        ff.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu[:2])


def test_merge_states_on_meta_tensors_gives_meta_outputs():
    o_a, l_a = _meta(2, 4, 16, 64), _meta(2, 4, 16, dtype=torch.float32)
    o, lse = ff.merge_states(o_a, l_a, o_a, l_a)
    assert (o.device.type, o.shape, o.dtype, lse.shape, lse.dtype) == (
        "meta", (2, 4, 16, 64), torch.bfloat16, (2, 4, 16), torch.float32)
    o, lse = ff.merge_states(_meta(3, 4, 16, 64), _meta(3, 4, 16, dtype=torch.float32))
    assert o.device.type == "meta" and o.shape == (4, 16, 64) and lse.shape == (4, 16)


def test_merge_states_refuses_fp8_parts():
    """An FP8 tensor holds no scale: a merged o rounded to E4M3 (NaN past 448) would be a
    silent loss; the parts' names are given."""
    o = torch.randn(2, 4, 16, 64)
    lse = torch.randn(2, 4, 16)
    o8 = o.to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="o_b must be float16"):
        ff.merge_states(o, lse, o8, lse)
    with pytest.raises(TypeError, match="lses must be float16"):
        ff.merge_states(torch.stack([o, o]), torch.stack([lse, lse]).to(torch.float8_e4m3fn))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_on_meta_tensors_gives_meta_outputs(paged):
    q = _meta(2, 4, 3, 64)
    lens = torch.empty(2, dtype=torch.int32, device="meta")
    if paged:
        k = _meta(8, 16, 2, 64)
        extra = dict(block_table=torch.empty(2, 4, dtype=torch.int32, device="meta"))
    else:
        k, extra = _meta(2, 2, 64, 64), {}
    o, lse = ff.decode(q, k, k, lens, return_lse=True, window=(8, 0), **extra)
    assert (o.device.type, o.shape, o.dtype) == ("meta", (2, 4, 3, 64), torch.bfloat16)
    assert (lse.device.type, lse.shape, lse.dtype) == ("meta", (2, 4, 3), torch.float32)
    with pytest.raises(ValueError, match="^cache_seqlens is a meta tensor: check_lengths=True"):
        ff.decode(q, k, k, lens, check_lengths=True, **extra)
    with pytest.raises(ValueError, match="heads_q=4 must be a multiple"):     # shapes: checked
        ff.decode(q, _meta(2, 3, 64, 64), _meta(2, 3, 64, 64), lens)


def test_a_meta_paged_cache_decodes_to_meta_outputs():
    cache = ff.PagedKVCache.allocate(2, 32, 2, 16, page_size=8, device="meta")
    o = cache.decode(_meta(2, 4, 1, 16))
    assert o.device.type == "meta" and o.shape == (2, 4, 1, 16)


# --- windows wider than any sequence -------------------------------------------------------------

@pytest.mark.parametrize("window, causal, same_as", [
    ((2**70, 0), False, dict(causal=True)),
    ((2**70, 2**70), False, {}),
    ((None, 2**63), True, dict(causal=True)),
    ((2**31 - 1, 2**31 - 2), False, {}),
    ((16, 16), False, {}),
    ((15, 3), False, dict(window=(15, 3))),
], ids=["left-2^70", "both-2^70", "right-2^63-causal", "int32-max", "sequence-long", "inside"])
def test_a_window_wider_than_the_sequence_is_unbounded(window, causal, same_as):
    q, k, v = _qkv(N=16)
    got = ff.attention(q, k, v, window=window, causal=causal)
    assert torch.equal(got, ff.attention(q, k, v, **same_as))


CUDA = torch.cuda.is_available()


def test_a_huge_window_on_the_kernel_paths(monkeypatch):
    """The Triton attention and split-KV decode kernels (on CUDA, else under the
    interpreter) get an unbounded side, never the huge int; decode's plan-cache path
    (``check_lengths=False``) too."""
    from flashfold.api import attention as api
    from flashfold.api import decode as dapi
    dev = "cuda" if CUDA else "cpu"
    if not CUDA:
        monkeypatch.setattr(api, "_use_kernel", lambda q: True)
        monkeypatch.setattr(dapi, "_use_kernels", lambda q: True)
    q, k, v = (t.to(dev) for t in _qkv(B=1, H=2, N=16, dtype=torch.float16))
    assert torch.equal(ff.attention(q, k, v, window=(2**70, 0)), ff.attention(q, k, v, causal=True))
    g = torch.Generator().manual_seed(3)
    kc = torch.randn(2, 2, 24, 32, generator=g).to(dev)
    qd = torch.randn(2, 4, 2, 32, generator=g).to(dev)
    lens = torch.tensor([5, 24], dtype=torch.int32, device=dev)
    want = ff.decode(qd, kc, kc, lens)
    for check in (None, False):
        got = ff.decode(qd, kc, kc, lens, window=(2**70, 0), check_lengths=check)
        assert torch.equal(got, want)


# --- decode's options: the checks of attention ----------------------------------------------------

BAD_OPTIONS = [
    dict(scale=-1.0), dict(scale=0.0), dict(scale=math.inf), dict(scale="x"), dict(scale=True),
    dict(softcap=-1.0), dict(softcap=math.nan), dict(softcap="x"),
    dict(window=3), dict(window=(1, 2.5)), dict(window=(-2, 0)), dict(window=(1, 2, 3)),
    dict(return_lse="no"), dict(return_lse=1),
]


@pytest.mark.parametrize("bad", BAD_OPTIONS, ids=lambda d: "-".join(f"{k}={v!r}" for k, v in d.items()))
def test_decode_rejects_what_attention_rejects_with_the_same_error(bad):
    q, k, v = _qkv(B=2, H=4, N=8, dtype=torch.float32)
    with pytest.raises((TypeError, ValueError)) as want:
        ff.attention(q, k, v, **bad)
    with pytest.raises((TypeError, ValueError)) as got:
        ff.decode(q[:, :, :1], k, v, torch.tensor([3, 8], dtype=torch.int32), **bad)
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_decode_check_lengths_must_be_a_bool_or_none(value):
    q, k, v = _qkv(B=2, H=4, N=8, dtype=torch.float32)
    with pytest.raises(TypeError, match="check_lengths must be a bool or None"):
        ff.decode(q[:, :, :1], k, v, torch.tensor([3, 8], dtype=torch.int32), check_lengths=value)
    with pytest.raises(TypeError, match="check_lengths must be a bool or None"):
        ff.append_kv(k, v, k[:, :, :1], v[:, :, :1], torch.tensor([3, 6], dtype=torch.int32),
                     check_lengths=value)


def test_a_malformed_window_is_both_a_type_and_a_value_error():
    q, k, v = _qkv(N=8, dtype=torch.float32)
    for call in (lambda: ff.attention(q, k, v, window=3),
                 lambda: ff.decode(q[:, :, :1], k, v, torch.tensor([3, 8], dtype=torch.int32),
                                   window=(None, "x"))):
        with pytest.raises(TypeError, match="window"):
            call()
        with pytest.raises(ValueError, match="window"):
            call()


def test_valid_decode_options_still_work():
    q, k, v = _qkv(B=2, H=4, N=8, dtype=torch.float64)
    lens = torch.tensor([3, 8], dtype=torch.int32)
    o, lse = ff.decode(q[:, :, :1], k, v, lens, scale=0.3, softcap=5.0, window=(2, -1),
                       return_lse=True, check_lengths=False)
    ro, rl = ff.attention(q[:1, :, :1], k[:1, :, :3], v[:1, :, :3], scale=0.3, softcap=5.0,
                          window=(2, 0), causal=True, return_lse=True)
    assert_close(o[:1], ro, "float64", name="o")
    assert_close(lse[:1], rl, "float32", name="lse")


def test_packed_offsets_are_read_once_per_version():
    """``cu_seqlens`` values drive the launch, and reading them is a host sync: a tensor
    validated once is not read again (the layers of a model share one), until an in-place
    write bumps its version, after which the new values are checked again; the cached
    lengths still have to match the packed length of the call."""
    q, k, v = (torch.randn(1, 2, 10, 16) for _ in range(3))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    o1 = ff.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    reads = []
    real = torch.Tensor.tolist

    def spy(t):
        # (the CPU reference that computes the call reads the offsets too: count the
        # validation's reads, which a kernel call would wait for)
        reads.append(t is cu and sys._getframe(1).f_code.co_name == "check_cu_seqlens")
        return real(t)
    with mock.patch.object(torch.Tensor, "tolist", spy):
        o2 = ff.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
        assert not any(reads)
        assert torch.equal(o1, o2)
        with pytest.raises(ValueError, match="must end at the packed length 9"):
            ff.attention(q[:, :, :9], k[:, :, :9], v[:, :, :9], cu_seqlens_q=cu,
                         cu_seqlens_k=cu)
        cu[1] = 11                                   # in place: a new version, read again
        with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
            ff.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
        assert any(reads)


def test_a_mod_that_indexes_a_captured_tensor_is_told_to_use_a_buffer():
    """A mod's positions are traced values: indexing a captured tensor or list with them
    (or branching on them) fails inside the user's code; the error names the mod and the
    fix, and the Buffer form runs and masks as the captured table says."""
    q = torch.randn(2, 2, 8, 16)
    lens = torch.tensor([3, 5])
    for mask in (lambda b, h, i, j: j < lens[b], lambda b, h, i, j: j < [3, 5][b]):
        with pytest.raises(TypeError, match=r"mask_mod '<lambda>' cannot be traced .*ops\.Buffer"):
            ff.attention(q, q, q, mask_mod=mask)
    o = ff.attention(q, q, q, mask_mod=lambda b, h, i, j: j < ops.Buffer(lens)[b])
    for b, n in enumerate(lens.tolist()):
        want = ff.attention(q[b:b + 1].double(), q[b:b + 1, :, :n].double(),
                            q[b:b + 1, :, :n].double())
        assert_close(o[b:b + 1], want, "float32", name=f"o[{b}]")


def test_append_kv_into_one_tensor_as_both_caches_is_refused():
    """``append_kv(cache, cache, ...)`` (the same tensor, or views starting at the same
    element, as k_cache and v_cache) wrote the values over the keys just written: a
    ValueError naming v_cache. Two halves of one buffer (``kv[0]``, ``kv[1]``, as serving
    stacks lay a cache out) share its storage without overlapping and append."""
    lens = torch.tensor([2], dtype=torch.int32)
    k_new, v_new = torch.randn(1, 2, 2, 16), torch.randn(1, 2, 2, 16)
    cache = torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"^v_cache: the same memory as k_cache"):
        ff.append_kv(cache, cache, k_new, v_new, lens)
    with pytest.raises(ValueError, match=r"^v_cache: the same memory as k_cache"):
        ff.append_kv(cache, cache.view(1, 2, 8, 16), k_new, v_new, lens)
    assert torch.equal(cache, torch.zeros_like(cache))      # nothing written
    kv = torch.zeros(2, 1, 2, 8, 16)
    assert ff.append_kv(kv[0], kv[1], k_new, v_new, lens).tolist() == [4]
    assert torch.equal(kv[0, :, :, 2:4], k_new) and torch.equal(kv[1, :, :, 2:4], v_new)


def test_mod_tables_given_as_numpy_or_lists_are_copied_when_the_mod_is_made():
    """A mod's table given as a NumPy array (or a sequence) was wrapped without a copy:
    a later in-place write to the array reached the CPU path at once, while the GPU's
    cached device copy (kept per torch version counter, which a NumPy write does not
    move) kept the old values. Such tables are now copied when the mod is made, so every
    path sees the values the mod was made with; a torch tensor stays a reference."""
    import numpy as np
    from flashfold import mods
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g, dtype=torch.float64) for _ in range(3))
    ids = np.array([0, 0, 0, 1, 1, 1, 2, 2])
    want = ff.attention(q, k, v, mask_mod=mods.document_mask(torch.tensor(ids)))
    mod = mods.document_mask(ids)
    slopes = [0.5, 0.25]
    slope_array = np.array(slopes)
    alibi = mods.alibi(2, slopes=slope_array)
    ids[:] = 0                                   # written after the mods were made
    slope_array[:] = 8.0
    assert torch.equal(ff.attention(q, k, v, mask_mod=mod), want)
    want_alibi = ff.attention(q, k, v, score_mod=mods.alibi(2, slopes=torch.tensor(slopes)))
    assert torch.equal(ff.attention(q, k, v, score_mod=alibi), want_alibi)
