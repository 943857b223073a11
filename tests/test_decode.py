"""flashfold.decode / append_kv / PagedKVCache on the CPU (the pure-torch path), and the
float64 reference against flashfold.attention on the same tokens."""

import math

import pytest
import torch

import flashfold as ff
from flashfold.kernels.decode.reference import decode_reference, gather_kv, gather_kv_padded
from flashfold.testing import assert_close
from test_decode_common import attention_per_sequence, make_case

LENS = [0, 1, 5, 37, 64]
#: lengths and first keys (``cache_start``) covering: start > length on an empty sequence,
#: 0, == length (1 and 37), a middle, > length, negative (clamped to 0)
START_LENS = [0, 1, 1, 5, 37, 64, 40, 50]
STARTS = [3, 0, 1, 2, 37, 70, 17, -3]


@pytest.mark.parametrize("q_len", [1, 3], ids=lambda n: f"q_len{n}")
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)], ids=lambda h: f"hq{h[0]}_hkv{h[1]}")
@pytest.mark.parametrize("mods", [{}, {"softcap": 5.0, "scale": 0.4}, {"window": (7, None)},
                                  {"window": (0, 3)}],
                         ids=["plain", "softcap", "window7", "window0"])
def test_reference_is_attention_on_the_same_tokens(q_len, heads, mods):
    case = make_case(LENS, heads_q=heads[0], heads_kv=heads[1], q_len=q_len, head_dim=32,
                     capacity=70, page_size=8, dtype=torch.float64)
    o, lse = decode_reference(case.q, case.k, case.v, case.seqlens, **mods)
    ro, rl = attention_per_sequence(case, **mods)
    assert_close(o, ro, "float64", name="o")
    assert_close(lse, rl, "float32", name="lse")              # attention's LSE is float32
    po, plse = decode_reference(case.q, case.k_pages, case.v_pages, case.seqlens,
                                case.block_table, **mods)
    assert torch.equal(po, o) and torch.equal(plse, lse)      # same tokens, same order


def _poison_before_start(case, firsts):
    """NaN in every contiguous slot before a sequence's first key, and in the paged copy a
    block table whose entries for pages wholly before it point nowhere (-1): neither may be
    read."""
    for b, a in enumerate(firsts):
        case.k[b, :, :max(a, 0)] = float("nan")
        case.v[b, :, :max(a, 0)] = float("nan")
    if case.block_table is not None:
        page = case.k_pages.shape[1]
        for b, (a, n) in enumerate(zip(firsts, case.seqlens.tolist())):
            a = min(max(a, 0), n)
            case.block_table[b, :a // page] = -1
            slots = [(int(case.block_table[b, t // page]), t % page) for t in range(a // page * page, a)]
            for p, s in slots:                    # the first live page's slots before a_b
                case.k_pages[p, s] = float("nan")
                case.v_pages[p, s] = float("nan")
    return case


@pytest.mark.parametrize("q_len", [1, 3], ids=lambda n: f"q_len{n}")
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=lambda h: f"hq{h[0]}_hkv{h[1]}")
@pytest.mark.parametrize("mods", [{}, {"window": (7, None)}, {"softcap": 5.0}],
                         ids=["plain", "window7", "softcap"])
def test_reference_cache_start_is_attention_on_the_visible_tokens(q_len, heads, mods):
    """``cache_start``: the sequence is its tokens ``[a_b, n_b)`` at their cache positions
    (bottom-right alignment against ``n_b``); the slots before ``a_b`` are never read (NaN
    there, unmapped pages), rows with no visible key are (0, -inf)."""
    case = make_case(START_LENS, heads_q=heads[0], heads_kv=heads[1], q_len=q_len,
                     head_dim=32, capacity=70, page_size=8, dtype=torch.float64)
    ro, rl = attention_per_sequence(case, cache_start=STARTS, **mods)
    case = _poison_before_start(case, STARTS)
    start = torch.tensor(STARTS, dtype=torch.int32)
    o, lse = decode_reference(case.q, case.k, case.v, case.seqlens, cache_start=start, **mods)
    assert_close(o, ro, "float64", name="o")
    assert_close(lse, rl, "float32", name="lse")
    po, plse = decode_reference(case.q, case.k_pages, case.v_pages, case.seqlens,
                                case.block_table, cache_start=start, **mods)
    assert torch.equal(po, o) and torch.equal(plse, lse)
    empty = [b for b, (a, n) in enumerate(zip(STARTS, START_LENS)) if a >= n]
    assert empty == [0, 2, 4, 5]
    assert (lse[empty] == -math.inf).all() and (o[empty] == 0).all()
    # a zero start is no start
    zero = torch.zeros(len(STARTS), dtype=torch.int32)
    clean = make_case(START_LENS, heads_q=heads[0], heads_kv=heads[1], q_len=q_len,
                      head_dim=32, capacity=70, dtype=torch.float64)
    assert all(torch.equal(x, y) for x, y in zip(
        decode_reference(clean.q, clean.k, clean.v, clean.seqlens, cache_start=zero, **mods),
        decode_reference(clean.q, clean.k, clean.v, clean.seqlens, **mods)))


def test_cache_start_hides_the_first_query_rows():
    """q_len 3 with the start between the query positions: the rows before it see no key."""
    case = make_case([6], heads_q=2, heads_kv=1, q_len=3, head_dim=16, capacity=6,
                     dtype=torch.float64)
    o, lse = decode_reference(case.q, case.k, case.v, case.seqlens,
                              cache_start=torch.tensor([4], dtype=torch.int32))
    assert (lse[0, :, :1] == -math.inf).all() and (o[0, :, :1] == 0).all()   # position 3
    assert torch.isfinite(lse[0, :, 1:]).all()
    assert_close(o[0, :, 1], case.v[0, 0, 4].expand(2, -1), "float64", name="one key")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_cpu_matches_attention(dtype, paged):
    case = make_case(LENS, heads_q=4, heads_kv=2, q_len=2, head_dim=32, capacity=70,
                     page_size=16, dtype=dtype)
    k, v, table = case.cache(paged)
    o, lse = ff.decode(case.q, k, v, case.seqlens, block_table=table, return_lse=True)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert o.shape == case.q.shape and lse.shape == case.q.shape[:3]
    ro, rl = attention_per_sequence(case)
    assert_close(o, ro, dtype, name="o")
    assert_close(lse, rl, "float32", name="lse")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_cpu_cache_start(dtype, paged):
    """The public function with ``cache_start`` (CPU path): the keys ``[a_b, n_b)``; the
    host-side page check (``check_lengths``) looks only at pages holding such keys (-1 in
    the block table before the first key is fine, a bad page after it is not)."""
    case = make_case(START_LENS, heads_q=4, heads_kv=2, q_len=2, head_dim=32, capacity=70,
                     page_size=8, dtype=dtype)
    ro, rl = attention_per_sequence(case, cache_start=STARTS)
    case = _poison_before_start(case, STARTS)
    k, v, table = case.cache(paged)
    start = torch.tensor(STARTS, dtype=torch.int32)
    o, lse = ff.decode(case.q, k, v, case.seqlens, block_table=table, cache_start=start,
                       return_lse=True, check_lengths=True)
    assert o.dtype == dtype and not torch.isnan(o).any()
    assert_close(o, ro, dtype, name="o")
    assert_close(lse, rl, "float32", name="lse")
    if paged:
        table[7, 6] = 999                       # sequence 7: keys [0, 50), page 6 in use
        with pytest.raises(ValueError, match="block_table: the pages in use"):
            ff.decode(case.q, k, v, case.seqlens, block_table=table, cache_start=start)
        assert (table[6, :17 // 8] == -1).all()  # sequence 6: pages before its first key


def test_empty_and_unseen_rows_are_the_identity():
    # length 0: every row empty; length 1 with q_len 3: rows 0 and 1 sit before the cache
    case = make_case([0, 1, 0], heads_q=2, heads_kv=1, q_len=3, head_dim=16, capacity=8,
                     page_size=4, dtype=torch.float32)
    for paged in (False, True):
        k, v, table = case.cache(paged)
        o, lse = ff.decode(case.q, k, v, case.seqlens, block_table=table, return_lse=True)
        assert not torch.isnan(o).any() and not torch.isnan(lse).any()
        assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.equal(o[2], torch.zeros_like(o[2]))
        assert (lse[0] == -math.inf).all() and (lse[2] == -math.inf).all()
        assert (lse[1, :, :2] == -math.inf).all() and torch.isfinite(lse[1, :, 2]).all()
        assert torch.equal(o[1, :, :2], torch.zeros_like(o[1, :, :2]))
        # one visible key: the output is its value
        assert_close(o[1, :, 2], case.v[1, 0, 0].expand(2, -1), "float32", name="o")


def test_empty_partial_merges_exactly():
    """An empty sequence's (0, -inf) merges with a live part into that part."""
    case = make_case([0, 9], heads_q=2, heads_kv=2, q_len=1, head_dim=16, capacity=9,
                     dtype=torch.float32)
    o, lse = ff.decode(case.q, case.k, case.v, case.seqlens, return_lse=True)
    mo, mlse = ff.merge_states(o[0], lse[0], o[1], lse[1])
    assert torch.equal(mo, o[1]) and torch.equal(mlse, lse[1])


def test_paged_and_contiguous_agree_and_gather():
    case = make_case([3, 40, 17], heads_q=4, heads_kv=4, q_len=1, head_dim=16, capacity=48,
                     page_size=16, dtype=torch.float32)
    for (k1, v1), (k2, v2) in zip(gather_kv(case.k, case.v, case.seqlens),
                                  gather_kv(case.k_pages, case.v_pages, case.seqlens, case.block_table)):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    kp, vp = gather_kv_padded(case.k_pages, case.v_pages, case.block_table, 48)
    assert torch.equal(kp, case.k) and torch.equal(vp, case.v)
    a = ff.decode(case.q, case.k, case.v, case.seqlens)
    b = ff.decode(case.q, case.k_pages, case.v_pages, case.seqlens, block_table=case.block_table)
    assert torch.equal(a, b)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_append_kv_builds_the_cache(paged):
    full = make_case([30, 30], heads_q=2, heads_kv=2, q_len=1, head_dim=16, capacity=32,
                     dtype=torch.float32, seed=3)
    if paged:
        cache = ff.PagedKVCache.allocate(2, 32, 2, 16, page_size=8, dtype=torch.float32,
                                         shuffle=True)
        kc, vc, table = cache.k_pages, cache.v_pages, cache.block_table
    else:
        kc = torch.zeros(2, 2, 32, 16)
        vc = torch.zeros_like(kc)
        table = None
    lens = torch.zeros(2, dtype=torch.int32)
    for lo, hi in [(0, 1), (1, 12), (12, 12), (12, 30)]:          # incl. an empty append
        new = ff.append_kv(kc, vc, full.k[:, :, lo:hi], full.v[:, :, lo:hi], lens, table)
        assert new.dtype == lens.dtype and torch.equal(new, lens + (hi - lo))
        lens = new
    got = gather_kv(kc, vc, lens, table)
    for b in range(2):
        assert torch.equal(got[b][0], full.k[b, :, :30]) and torch.equal(got[b][1], full.v[b, :, :30])
    o = ff.decode(full.q, kc, vc, lens, block_table=table)
    assert torch.equal(o, ff.decode(full.q, full.k, full.v, lens))
    with pytest.raises(ValueError, match="cache_seqlens.*capacity"):
        ff.append_kv(kc, vc, full.k[:, :, :3], full.v[:, :, :3], lens, table)
    with pytest.raises(TypeError, match="k_new.*dtype"):
        ff.append_kv(kc, vc, full.k[:, :, :1].double(), full.v[:, :, :1].double(), lens, table)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_unchecked_append_out_of_range_raises_rather_than_wraps(paged):
    """``check_lengths=False``: a position out of range trips the index check, a negative
    one too (it used to wrap to the row's end and write there without a word)."""
    if paged:
        cache = ff.PagedKVCache.allocate(1, 16, 1, 8, page_size=8, dtype=torch.float32)
        kc, vc, table = cache.k_pages, cache.v_pages, cache.block_table
    else:
        kc, vc, table = torch.zeros(1, 1, 16, 8), torch.zeros(1, 1, 16, 8), None
    new = torch.ones(1, 1, 1, 8)
    for bad in (-1, 16):
        with pytest.raises(IndexError):
            ff.append_kv(kc, vc, new, new, torch.tensor([bad], dtype=torch.int32), table,
                         check_lengths=False)
        assert not kc.any() and not vc.any()
    assert ff.append_kv(kc, vc, new, new, torch.tensor([15], dtype=torch.int32), table,
                        check_lengths=False).tolist() == [16]


def test_unchecked_append_through_a_negative_page_raises_rather_than_wraps():
    """``check_lengths=False`` on a paged cache: a negative block-table entry (an unassigned
    page) trips the index check, as a page past the pool does, instead of wrapping to the
    pool's last pages and overwriting another sequence's tokens."""
    cache = ff.PagedKVCache.allocate(2, 16, 1, 8, page_size=8, dtype=torch.float32)
    kc, vc, table = cache.k_pages, cache.v_pages, cache.block_table.clone()
    table[0, 0] = -1                        # the pool's last page, 3, is sequence 1's
    new = torch.ones(2, 1, 1, 8)
    lens = torch.tensor([0, 8], dtype=torch.int32)
    for check in (False, True):
        with pytest.raises((IndexError, ValueError)):
            ff.append_kv(kc, vc, new, new, lens, table, check_lengths=check)
        assert not kc.any() and not vc.any()


def test_paged_kv_cache_helper():
    cache = ff.PagedKVCache.allocate(3, 20, 2, 16, page_size=8, dtype=torch.float32)
    assert repr(cache) == ("PagedKVCache(batch=3, capacity=24, page_size=8, num_pages=9, "
                           "heads_kv=2, head_dim=16, dtype=float32, device=cpu)")
    k = torch.randn(3, 2, 5, 16)
    v = torch.randn(3, 2, 5, 16)
    assert cache.append(k, v).tolist() == [5, 5, 5]
    q = torch.randn(3, 4, 1, 16)
    o = cache.decode(q)
    assert_close(o, ff.decode(q, k, v, cache.seqlens), "float32", name="o")


def _args():
    case = make_case([3, 5], heads_q=4, heads_kv=2, q_len=1, head_dim=16, capacity=8,
                     page_size=4, dtype=torch.float32)
    return case


@pytest.mark.parametrize("mutate, exc, pattern", [
    (lambda a: a.update(q=a["q"].numpy()), TypeError, "q: expected a torch.Tensor"),
    (lambda a: a.update(q=a["q"].to(torch.int32)), TypeError, "q: dtype"),
    (lambda a: a.update(k_cache=a["k_cache"].double()), TypeError, "k_cache: dtype"),
    (lambda a: a.update(q=a["q"][0]), ValueError, r"q: expected \(batch"),
    (lambda a: a.update(q=torch.randn(2, 4, 17, 16)), ValueError, "q: q_len"),
    (lambda a: a.update(q=torch.randn(2, 4, 1, 8)), ValueError, "k_cache: head_dim"),
    (lambda a: a.update(q=torch.randn(2, 3, 1, 16)), ValueError, "heads_q=3"),
    (lambda a: a.update(q=torch.randn(3, 4, 1, 16)), ValueError, "k_cache: contiguous cache"),
    (lambda a: a.update(v_cache=a["v_cache"][:, :, :4]), ValueError, "v_cache: shape"),
    (lambda a: a.update(cache_seqlens=a["cache_seqlens"].float()), TypeError, "cache_seqlens: dtype"),
    (lambda a: a.update(cache_seqlens=a["cache_seqlens"][:1]), ValueError, "cache_seqlens: expected shape"),
    (lambda a: a.update(cache_seqlens=torch.tensor([3, 9], dtype=torch.int32)), ValueError,
     r"cache_seqlens: lengths must lie in \[0, 8\]"),
    (lambda a: a.update(cache_seqlens=torch.tensor([-1, 2], dtype=torch.int32)), ValueError,
     "cache_seqlens: lengths"),
    (lambda a: a.update(scale=0.0), ValueError, "scale"),
    (lambda a: a.update(scale="x"), TypeError, "scale"),
    (lambda a: a.update(softcap=-1.0), ValueError, "softcap"),
    (lambda a: a.update(softcap=1e39), ValueError, "softcap must be at most"),
    (lambda a: a.update(window=3), TypeError, "window"),
    (lambda a: a.update(window=(-2, 0)), ValueError, "window"),
    (lambda a: a.update(num_splits=0), ValueError, "num_splits"),
    (lambda a: a.update(num_splits=2.0), TypeError, "num_splits"),
    (lambda a: a.update(num_splits=2, batch_invariant=True), ValueError, "num_splits.*batch_invariant"),
    (lambda a: a.update(batch_invariant=1), TypeError, "batch_invariant"),
    (lambda a: a.update(max_seqlen=-1), ValueError, "max_seqlen"),
    (lambda a: a.update(cache_start=[0, 0]), TypeError, "cache_start: expected a torch.Tensor"),
    (lambda a: a.update(cache_start=torch.zeros(2, dtype=torch.int64)), TypeError,
     "cache_start: dtype must be torch.int32"),
    (lambda a: a.update(cache_start=torch.zeros(3, dtype=torch.int32)), ValueError,
     r"cache_start: expected shape \(2,\)"),
    (lambda a: a.update(cache_start=torch.zeros(2, 1, dtype=torch.int32)), ValueError,
     "cache_start: expected shape"),
    (lambda a: a.update(cache_start=torch.zeros(2, dtype=torch.int32, device="meta")), ValueError,
     "cache_start: on meta"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_decode_validation_contiguous(mutate, exc, pattern):
    c = _args()
    a = dict(q=c.q, k_cache=c.k, v_cache=c.v, cache_seqlens=c.seqlens)
    mutate(a)
    q, k, v, s = a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), a.pop("cache_seqlens")
    with pytest.raises(exc, match=pattern):
        ff.decode(q, k, v, s, **a)


@pytest.mark.parametrize("mutate, exc, pattern", [
    (lambda a: a.update(block_table=a["block_table"].long()), TypeError, "block_table: dtype"),
    (lambda a: a.update(block_table=a["block_table"][:1]), ValueError, "block_table: expected shape"),
    (lambda a: a.update(block_table=a["block_table"].numpy()), TypeError, "block_table"),
    (lambda a: a.update(block_table=torch.full((2, 2), 99, dtype=torch.int32)), ValueError,
     r"block_table: the pages in use must lie in \[0, "),
    (lambda a: a.update(cache_seqlens=torch.tensor([3, 9], dtype=torch.int32)), ValueError,
     r"cache_seqlens: lengths must lie in \[0, 8\]"),
    (lambda a: a.update(k_cache=torch.randn(7, 4, 3, 16), v_cache=torch.randn(7, 4, 3, 16)),
     ValueError, "heads_q=4 must be a multiple of the cache's heads_kv=3"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_decode_validation_paged(mutate, exc, pattern):
    c = _args()
    a = dict(q=c.q, k_cache=c.k_pages, v_cache=c.v_pages, cache_seqlens=c.seqlens,
             block_table=c.block_table)
    mutate(a)
    q, k, v, s = a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), a.pop("cache_seqlens")
    with pytest.raises(exc, match=pattern):
        ff.decode(q, k, v, s, **a)


def test_top_level_names():
    from flashfold.api import decode as mod
    assert ff.decode is mod.decode and ff.append_kv is mod.append_kv
    assert ff.PagedKVCache is mod.PagedKVCache


@pytest.mark.parametrize("lens_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("path", ["reference", "kernels"])
def test_unchecked_lengths_are_clamped_to_the_capacity_on_every_path(monkeypatch, path, paged,
                                                                     lens_dtype):
    """With ``check_lengths=False`` a length past the capacity reads the whole cache and a
    negative one reads nothing (o = 0, lse = -inf): the kernels' clamp, which the CPU path
    follows (it raised from deep inside torch), so both paths agree. int64 lengths are
    clamped as they are, beyond int32's range too (``2**32 + 5`` is past the capacity, not
    5; ``-2**32 + 3`` negative, not 3)."""
    from flashfold.api import decode as api
    if path == "kernels":
        monkeypatch.setattr(api, "_use_kernels", lambda q: True)
    g = torch.Generator().manual_seed(7)
    B, H, cap, D, page = 3, 2, 32, 16, 8
    q = torch.randn(B, H, 1, D, generator=g)
    k = torch.randn(B, H, cap, D, generator=g)
    v = torch.randn(B, H, cap, D, generator=g)
    table = None
    if paged:
        table = torch.arange(B * cap // page, dtype=torch.int32).reshape(B, cap // page)
        k = k.permute(0, 2, 1, 3).reshape(-1, page, H, D)
        v = v.permute(0, 2, 1, 3).reshape(-1, page, H, D)
    wild = torch.tensor([cap + 9, -4, 5] if lens_dtype == torch.int32
                        else [2**32 + 5, -2**32 + 3, 5], dtype=lens_dtype)
    o, lse = ff.decode(q, k, v, wild, block_table=table, return_lse=True, check_lengths=False)
    want_o, want_lse = ff.decode(q, k, v, wild.clamp(0, cap), block_table=table, return_lse=True)
    assert_close(o, want_o, "float32", name="o")
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    assert torch.equal(o[1], torch.zeros_like(o[1])) and (lse[1] == -math.inf).all()
