"""The split-KV Triton kernels (run under TRITON_INTERPRET=1 on the CPU, natively on a GPU):
against the float64 reference and flashfold.attention on the same tokens, every dispatch
branch (one split / merged splits, contiguous / paged, page smaller / larger than a tile,
several row blocks), batch invariance, and the split heuristic."""

import math
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest
import torch

import flashfold as ff
from flashfold.kernels.decode import splitkv
from flashfold.kernels.decode.reference import decode_reference
from flashfold.testing import assert_close
from test_decode_common import attention_per_sequence, make_case, repage, strict_interpreter_masks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _strict_masks():
    """Under the interpreter every kernel here loads and stores through boolean masks only
    (what Triton 3.9's interpreter requires; 3.6 accepts int32 ones)."""
    if DEVICE == "cuda":
        yield
        return
    with strict_interpreter_masks():
        yield


def run(case, paged, **kw):
    k, v, table = case.cache(paged)
    scale = kw.pop("scale", 1.0 / math.sqrt(case.q.shape[-1]))
    launch = splitkv.prepare(case.q, k, v, case.seqlens, table, scale=scale, **kw)
    o, lse = launch.run()
    return o, lse, launch


def check(case, o, lse, dtype, cache_start=None, **mods):
    """Against the float64 reference and against flashfold.attention (float64);
    ``cache_start`` a list of first keys."""
    start = None if cache_start is None else torch.tensor(cache_start, dtype=torch.int32)
    ro, rl = decode_reference(case.q.cpu().double(), case.k.cpu().double(), case.v.cpu().double(),
                              case.seqlens.cpu(), cache_start=start, **mods)
    assert_close(o, ro, dtype, name="o vs reference")
    assert_close(lse, rl, "float32", name="lse vs reference")
    cpu = type(case)(case.q.cpu(), case.k.cpu(), case.v.cpu(), case.seqlens.cpu(), None, None, None)
    ao, al = attention_per_sequence(cpu, cache_start=cache_start, **mods)
    assert_close(o, ao, dtype, name="o vs flashfold.attention")
    assert_close(lse, al, "float32", name="lse vs flashfold.attention")
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert not (lse == math.inf).any()


# pages smaller than a key tile (several per tile), equal, larger, and not dividing it
LAYOUTS = {"contiguous": None, "paged8": 8, "paged64": 64, "paged128": 128, "paged12": 12}


@pytest.mark.parametrize("dtype, layout, splits, q_len", [
    (torch.float16, "contiguous", 1, 1),
    (torch.float16, "contiguous", 2, 3),
    (torch.float16, "contiguous", 3, 1),
    (torch.float16, "paged8", 1, 2),
    (torch.float16, "paged8", 2, 1),
    (torch.float16, "paged64", 3, 2),
    (torch.float16, "paged128", 2, 1),
    (torch.float16, "paged12", 2, 2),
    (torch.float32, "contiguous", 1, 2),
    (torch.float32, "contiguous", 3, 1),
    (torch.float32, "paged8", 3, 3),
    (torch.float32, "paged64", 2, 1),
], ids=lambda x: str(x).replace("torch.", "") if not isinstance(x, int) else str(x))
def test_kernel_matches_reference(dtype, layout, splits, q_len):
    page = LAYOUTS[layout]
    # lengths 0 and 1, a partial tile, several tiles; capacity not a multiple of the page
    case = make_case([0, 1, 77, 150], heads_q=4, heads_kv=2, q_len=q_len, head_dim=32,
                     capacity=150, page_size=page or 8, dtype=dtype, device=DEVICE)
    o, lse, launch = run(case, page is not None, num_splits=splits)
    assert launch.plan.n_splits == splits and (launch.merge is None) == (splits == 1)
    assert o.dtype == dtype and lse.dtype == torch.float32
    check(case, o, lse, dtype)


@pytest.mark.parametrize("name, shape, mods, layout", [
    ("softcap", dict(heads_q=4, heads_kv=2, q_len=2), dict(softcap=2.0, scale=0.5), "paged8"),
    ("window", dict(heads_q=4, heads_kv=2, q_len=3), dict(window=(20, None)), "contiguous"),
    ("window0", dict(heads_q=2, heads_kv=1, q_len=2), dict(window=(0, 0)), "paged64"),
    ("mha", dict(heads_q=3, heads_kv=3, q_len=1), {}, "paged8"),
    ("d96", dict(heads_q=4, heads_kv=1, q_len=1, head_dim=96), {}, "contiguous"),
    # 8 x 16 = 128 query rows per group: two row blocks of 64 read the same K/V
    ("rowblocks", dict(heads_q=8, heads_kv=1, q_len=16), {}, "paged8"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_kernel_features(name, shape, mods, layout):
    page = LAYOUTS[layout]
    shape = {"head_dim": 32, **shape}
    case = make_case([0, 1, 45, 130], capacity=130, page_size=page or 8, dtype=torch.float32,
                     device=DEVICE, seed=7, **shape)
    for splits in (1, 3):
        o, lse, launch = run(case, page is not None, num_splits=splits, **mods)
        if name == "rowblocks":
            assert launch.plan.m_blocks == 2
        check(case, o, lse, torch.float32, **mods)


@pytest.mark.parametrize("layout, q_len, mods", [
    ("contiguous", 1, {}), ("contiguous", 3, {"window": (30, None)}),
    ("paged64", 2, {}), ("paged128", 1, {"softcap": 3.0}),
], ids=["contiguous", "contiguous-q3-window", "paged64-q2", "paged128-softcap"])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_unused_cache_slots_may_hold_nan(layout, q_len, mods, tma):
    """Cache slots past a sequence's length hold anything (here NaN): never read into the
    result, through pointers (masked loads) or TMA boxes (rows zeroed in masked tiles);
    TMA and pointers give the same values."""
    page = LAYOUTS[layout]
    case = make_case([0, 1, 70, 190], heads_q=4, heads_kv=2, q_len=q_len, head_dim=32,
                     capacity=256, page_size=page or 64, dtype=torch.float16, device=DEVICE,
                     seed=13)
    clean = make_case([0, 1, 70, 190], heads_q=4, heads_kv=2, q_len=q_len, head_dim=32,
                      capacity=256, dtype=torch.float16, device=DEVICE, seed=13)
    for b, n in enumerate(case.seqlens.tolist()):
        case.k[b, :, n:] = float("nan")
        case.v[b, :, n:] = float("nan")
    if page is not None:
        case = repage(case, page)
        spare = sorted(set(range(case.k_pages.shape[0])) - set(case.block_table.flatten().tolist()))
        assert len(spare) == 2                           # pages in no table
        case.k_pages[spare] = float("nan")
        case.v_pages[spare] = float("nan")
    for splits in (1, 3):
        o, lse, launch = run(case, page is not None, num_splits=splits, tma=tma, **mods)
        assert launch.split[2]["USE_TMA"] == tma
        check(clean, o, lse, torch.float16, **mods)


#: lengths and first keys (``cache_start``): past the length of an empty sequence, 0 and
#: == length on length 1, a middle and == length at 77 (not a tile or page multiple), past
#: the length, negative (clamped to 0), one before the end (q_len > 1: the first query rows
#: see no key)
START_LENS = [0, 1, 1, 77, 77, 150, 130, 100]
STARTS = [2, 0, 1, 40, 77, 200, -5, 99]
EMPTY = [0, 2, 4, 5]                      # sequences with no key at all


def _start_case(q_len, page, dtype, seed=21):
    """``(clean, poisoned)``: the same tokens; in the poisoned copy every contiguous slot
    before a sequence's first key is NaN, and every block-table entry of a page holding no
    key of ``[a_b, n_b)`` is -1 (such pages must not be looked up)."""
    kw = dict(heads_q=4, heads_kv=2, q_len=q_len, head_dim=32, capacity=150,
              dtype=dtype, device=DEVICE, seed=seed)
    clean = make_case(START_LENS, **kw)
    case = make_case(START_LENS, **kw)
    for b, a in enumerate(STARTS):
        case.k[b, :, :max(a, 0)] = float("nan")
        case.v[b, :, :max(a, 0)] = float("nan")
    if page is not None:
        case = repage(case, page)
        for b, (a, n) in enumerate(zip(STARTS, START_LENS)):
            a = min(max(a, 0), n)
            for i in range(case.block_table.shape[1]):
                if not (i * page < n and a < min((i + 1) * page, n)):
                    case.block_table[b, i] = -1
    return clean, case


@pytest.mark.parametrize("layout, q_len, dtype, mods", [
    ("contiguous", 1, torch.float16, {}),
    ("contiguous", 3, torch.float32, {"window": (20, None)}),
    ("paged8", 2, torch.float16, {}),
    ("paged64", 3, torch.float16, {"window": (30, None), "softcap": 2.0}),
    ("paged12", 1, torch.float32, {}),
], ids=["contiguous-q1", "contiguous-q3-window", "paged8-q2", "paged64-q3-window-softcap",
        "paged12-q1"])
def test_kernel_cache_start(layout, q_len, dtype, mods):
    """A first key per sequence (left padding) in every mode: one split, merged splits,
    batch-invariant fixed splits (several per sequence, several per program): the
    reference and flashfold.attention on the keys ``[a_b, n_b)``; slots before ``a_b``
    never read (NaN there, -1 in the block table); no key: exactly (0, -inf)."""
    page = LAYOUTS[layout]
    clean, case = _start_case(q_len, page, dtype)
    start = torch.tensor(STARTS, dtype=torch.int32, device=DEVICE)
    modes = [dict(num_splits=1), dict(num_splits=3),
             dict(batch_invariant=True, invariant_split=64, max_seqlen=70)]
    for kw in modes:
        o, lse, launch = run(case, page is not None, cache_start=start, **kw, **mods)
        assert launch.split[2]["HAS_START"] and launch.merge is None or launch.merge[2]["HAS_START"]
        check(clean, o, lse, dtype, cache_start=STARTS, **mods)
        assert torch.equal(o[EMPTY], torch.zeros_like(o[EMPTY])) and (lse[EMPTY] == -math.inf).all()
        if kw.get("batch_invariant"):
            # sequence 3 (keys [40, 77)) alone, in a cache of another capacity: the same bits
            alone = make_case([77], heads_q=4, heads_kv=2, q_len=q_len, head_dim=32,
                              capacity=100, dtype=dtype, device=DEVICE)
            alone.q[0], alone.k[0, :, :77], alone.v[0, :, :77] = (
                clean.q[3], clean.k[3, :, :77], clean.v[3, :, :77])
            if page is not None:
                alone = repage(alone, page)
            a = torch.tensor([40], dtype=torch.int32, device=DEVICE)
            o1, l1, _ = run(alone, page is not None, cache_start=a, **kw, **mods)
            assert torch.equal(o1[0], o[3]) and torch.equal(l1[0], lse[3])


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_kernel_cache_start_tma_and_pages_larger_than_a_tile(tma):
    """TMA boxes read whole tiles, the slots before the first key included: their values
    are zeroed in the masked tile (NaN there does not leak); pages of 128 > BLOCK_N."""
    clean, case = _start_case(2, 128, torch.float16, seed=22)
    for paged in (False, True):
        if not paged:
            case.k, case.v = case.k.contiguous(), case.v.contiguous()
        start = torch.tensor(STARTS, dtype=torch.int32, device=DEVICE)
        o, lse, launch = run(case, paged, cache_start=start, num_splits=2, tma=tma)
        assert launch.split[2]["USE_TMA"] == tma
        check(clean, o, lse, torch.float16, cache_start=STARTS)


def test_cache_start_zero_is_no_start_bitwise():
    """``cache_start`` of zeros takes the masked first tile but computes the same bits as
    no start (a masked step on a fully visible tile equals an unmasked one)."""
    case = make_case([0, 1, 70, 150], heads_q=4, heads_kv=2, q_len=2, head_dim=32,
                     capacity=150, page_size=8, dtype=torch.float16, device=DEVICE, seed=23)
    zero = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    for paged, kw in [(False, dict(num_splits=2)), (True, dict(batch_invariant=True,
                                                               invariant_split=64))]:
        a = run(case, paged, **kw)[:2]
        b = run(case, paged, cache_start=zero, **kw)[:2]
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_tma_refused_where_it_cannot_address_the_cache():
    case = make_case([40], heads_q=4, heads_kv=2, head_dim=32, capacity=64, page_size=8,
                     dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="tma=True"):
        run(case, True, tma=True)                         # 8-token pages < BLOCK_N


def test_strided_inputs_and_int64_lengths():
    """q and the cache stored (batch, seq, heads, dim) and viewed as (batch, heads, seq, dim):
    any strides, no copy; int64 lengths."""
    case = make_case([0, 1, 90, 130], heads_q=4, heads_kv=2, q_len=2, head_dim=32,
                     capacity=130, dtype=torch.float16, device=DEVICE, seed=12)
    bshd = type(case)(case.q.transpose(1, 2).contiguous().transpose(1, 2),
                      case.k.transpose(1, 2).contiguous().transpose(1, 2),
                      case.v.transpose(1, 2).contiguous().transpose(1, 2),
                      case.seqlens.long(), None, None, None)
    assert not bshd.k.is_contiguous() and bshd.k.data_ptr() != case.k.data_ptr()
    for splits in (1, 2):
        o, lse, _ = run(bshd, False, num_splits=splits)
        check(case, o, lse, torch.float16)


def test_all_sequences_empty():
    case = make_case([0, 0], heads_q=2, heads_kv=1, q_len=2, head_dim=16, capacity=64,
                     page_size=16, dtype=torch.float16, device=DEVICE)
    for paged in (False, True):
        for kw in (dict(num_splits=1), dict(num_splits=2), dict(batch_invariant=True)):
            o, lse, _ = run(case, paged, **kw)
            assert torch.equal(o, torch.zeros_like(o))
            assert (lse == -math.inf).all()


def test_split_kv_is_merge_states_of_attention_chunks():
    """Split-KV is exactly the monoid: decode with 3 splits agrees with flashfold.merge_states
    of flashfold.attention over any 3 chunks of the keys."""
    case = make_case([140], heads_q=4, heads_kv=2, q_len=1, head_dim=32, capacity=140,
                     dtype=torch.float32, device=DEVICE, seed=5)
    o, lse, _ = run(case, False, num_splits=3)
    parts = [ff.attention(case.q.cpu().double(), case.k[:, :, a:b].cpu().double(),
                          case.v[:, :, a:b].cpu().double(), causal=True, return_lse=True)
             for a, b in [(0, 10), (10, 99), (99, 140)]]
    mo, ml = ff.merge_states(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert_close(o, mo, "float32", name="o")
    assert_close(lse, ml, "float32", name="lse")


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_batch_invariant_bitwise(paged, monkeypatch):
    """The same sequence alone, and among other sequences in batches of other sizes, page
    tables and capacities: bitwise the same output (and the single-split path, used when
    the capacity fits one split, writes the same bits as the merged path)."""
    split = 64
    target = make_case([200], heads_q=4, heads_kv=2, q_len=2, head_dim=32, capacity=200,
                       page_size=16, dtype=torch.float32, device=DEVICE, seed=11)
    outs = []
    for others, cap, pos in [([], 200, 0), ([5, 130], 256, 1), ([0, 17, 250, 64], 256, 3)]:
        lens = others[:pos] + [200] + others[pos:]
        case = make_case(lens, heads_q=4, heads_kv=2, q_len=2, head_dim=32, capacity=cap,
                         page_size=16, dtype=torch.float32, device=DEVICE, seed=len(lens))
        # put the target's tokens in slot ``pos`` (its pages stay wherever the table says)
        case.q[pos] = target.q[0]
        case.k[pos, :, :200], case.v[pos, :, :200] = target.k[0], target.v[0]
        if paged:
            case = repage(case, 16)
        o, lse, launch = run(case, paged, batch_invariant=True, invariant_split=split)
        assert launch.plan.split_size == split
        outs.append((o[pos], lse[pos]))
    for o, lse in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(lse, outs[0][1])
    o, lse, _ = run(target, paged, batch_invariant=True, invariant_split=split)
    assert torch.equal(o[0], outs[0][0])
    # a length bound below the true length: fewer split programs, each folding a run of
    # several splits (flushing each as it ends): the same splits, the same bits
    o, lse, launch = run(target, paged, batch_invariant=True, invariant_split=split,
                         max_seqlen=70)
    assert launch.plan.n_splits < launch.plan.ws_splits
    assert torch.equal(o[0], outs[0][0]) and torch.equal(lse[0], outs[0][1])
    # however the occupancy heuristic cuts the splits into per-program runs (it sees the
    # batch), every split is folded alike. The 200 keys take splits of 32 (64 halved: 200
    # keys < 4 x 64), 7 of them: one program folding all 7 in registers (no partials, no
    # merge), or runs of 3, 2 or 1 split (the plan evens the runs out: a target of 2
    # programs over 7 splits becomes 3 programs of runs 3, 3, 1)
    assert splitkv.invariant_size(200, split, 16) == 32
    for programs, grid in ((1, 1), (2, 3), (3, 4), (4, 7)):
        monkeypatch.setattr(splitkv, "choose_num_splits", lambda *a, n=programs, **k: n)
        o, lse, launch = run(target, paged, batch_invariant=True, invariant_split=split)
        assert launch.plan.n_splits == grid and (launch.merge is None) == (grid == 1)
        assert torch.equal(o[0], outs[0][0]) and torch.equal(lse[0], outs[0][1])
    # one split covering the whole capacity (no merge pass) == the merged path, bit for bit
    # (splits of 16 = 64 halved twice: 50 keys < 4 x 32; halving stops at 64 / 4)
    monkeypatch.setattr(splitkv, "choose_num_splits", lambda *a, **k: 1)
    short = make_case([50], heads_q=4, heads_kv=2, q_len=2, head_dim=32, capacity=50,
                      dtype=torch.float32, device=DEVICE, seed=2)
    o1, l1, la = run(short, False, batch_invariant=True, invariant_split=split)
    assert la.merge is None and la.plan.n_splits == 1
    assert splitkv.invariant_size(50, split, 16) == 16 == splitkv.invariant_size(10, split, 16)
    monkeypatch.setattr(splitkv, "choose_num_splits", lambda *a, **k: 4)
    wide = make_case([50], heads_q=4, heads_kv=2, q_len=2, head_dim=32, capacity=300,
                     dtype=torch.float32, device=DEVICE, seed=2)
    wide.q[:], wide.k[:, :, :50], wide.v[:, :, :50] = short.q, short.k, short.v
    o2, l2, lb = run(wide, False, batch_invariant=True, invariant_split=split)
    assert lb.merge is not None and lb.plan.n_splits > 1
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    check(short, o1, l1, torch.float32)


def test_default_mode_rounding_depends_on_the_split():
    """Why batch_invariant exists: the default mode picks the split count from the batch,
    and another split count rounds differently (same math, other bits)."""
    case = make_case([150], heads_q=4, heads_kv=2, q_len=1, head_dim=32, capacity=150,
                     dtype=torch.float32, device=DEVICE, seed=4)
    o1, l1, _ = run(case, False, num_splits=1)
    o3, l3, _ = run(case, False, num_splits=3)
    assert_close(o3, o1, "float32", name="o")
    assert not torch.equal(o1, o3)
    # and the heuristic does choose differently for different batches
    assert splitkv.choose_num_splits(1 * 8, 8192, 132) != splitkv.choose_num_splits(64 * 8, 8192, 132)


@pytest.mark.parametrize("forced", [1, 3])
def test_heuristic_dispatch(monkeypatch, forced):
    """The public path through the heuristic: one split writes the output directly, more
    splits go through the merge kernel."""
    calls = []

    def fake(programs, kv_len, num_sms, **kw):
        calls.append((programs, kv_len, num_sms))
        return forced

    monkeypatch.setattr(splitkv, "choose_num_splits", fake)
    case = make_case([3, 100], heads_q=4, heads_kv=2, q_len=1, head_dim=32, capacity=100,
                     page_size=8, dtype=torch.float16, device=DEVICE, seed=9)
    o, lse, launch = run(case, True, max_seqlen=90)
    assert calls == [(2 * 2 * 1, 90, splitkv._num_sms(case.q.device))]
    assert (launch.merge is None) == (forced == 1)
    check(case, o, lse, torch.float16)


def test_choose_num_splits():
    sms = 132
    # batch 8 x 8 kv heads at 8K: a few splits, enough to fill every SM
    s = splitkv.choose_num_splits(64, 8192, sms)
    assert 2 <= s <= 16 and 64 * s >= sms
    # a large batch already fills the GPU: no split (no merge pass)
    assert splitkv.choose_num_splits(256 * 8, 4096, sms) == 1
    # 512 programs are 1.3 waves of 396: the last third of a wave cannot saturate DRAM,
    # two splits make 2.6 waves whose last one can
    assert splitkv.choose_num_splits(64 * 8, 8192, sms) == 2
    # batch 1: many splits, bounded by the length / MIN_SPLIT and by MAX_SPLITS
    assert splitkv.choose_num_splits(8, 512, sms) == 512 // splitkv.MIN_SPLIT
    assert splitkv.choose_num_splits(8, 1 << 20, sms) <= splitkv.MAX_SPLITS
    assert splitkv.choose_num_splits(8, 1 << 17, sms) * 8 >= sms
    assert splitkv.choose_num_splits(8, 0, sms) == 1


def test_long_sequences_one_program_per_sm():
    """The default mode's plan for long contiguous head_dim-128 rows: splits making one
    program per SM and a deeper ring; the occupancy heuristic elsewhere (short rows, paged
    caches, other head dims or tiles, batch-invariant mode, rows that cannot fill 90% of
    the SMs one program each, an explicit split count)."""
    cfg, dev, sms = splitkv.DecodeConfig(), torch.device("cpu"), 132
    long = splitkv.plan((8, 32, 1, 128), 8, 65536, 65536, None, dev, cfg)
    assert (long.n_splits, long.num_stages) == (2, splitkv.LONG_STAGES)      # 128 programs
    one = splitkv.plan((1, 32, 1, 128), 8, 1 << 17, 1 << 17, None, dev, cfg)
    assert (one.n_splits, one.num_stages) == (16, splitkv.LONG_STAGES)
    whole = splitkv.plan((16, 32, 1, 128), 8, 65536, 65536, None, dev, cfg)
    assert whole.n_splits == 1 and whole.write_final and whole.num_stages == splitkv.LONG_STAGES
    assert splitkv._one_per_sm(64, splitkv.LONG_KV, sms, 128, 16, cfg, False, dev) == 2
    assert splitkv._one_per_sm(64, splitkv.LONG_KV, sms, 128, 64, cfg, False, dev) == 0
    default = [
        splitkv.plan((8, 32, 1, 128), 8, 65536, 16384, None, dev, cfg),          # short bound
        splitkv.plan((8, 32, 1, 128), 8, 65536, 65536, 1024, dev, cfg),          # window
        splitkv.plan((8, 32, 1, 128), 8, 65536, 65536, None, dev, cfg, paged=True),
        splitkv.plan((8, 32, 1, 64), 8, 65536, 65536, None, dev, cfg),
        splitkv.plan((8, 32, 1, 128), 8, 65536, 65536, None, dev,
                     splitkv.DecodeConfig(block_n=32)),
        splitkv.plan((8, 32, 1, 128), 8, 65536, 65536, None, dev, cfg, num_splits=3),
        splitkv.plan((12, 32, 1, 128), 8, 65536, 65536, None, dev, cfg),         # 96 programs
        splitkv.plan((8, 32, 1, 128), 8, 65536, 65536, None, dev, cfg, batch_invariant=True),
        splitkv.plan((8, 32, 16, 128), 8, 65536, 65536, None, dev, cfg),  # 64 rows: 8 warps
    ]
    assert all(p.num_stages == 0 for p in default)
    assert default[-3].n_splits == splitkv.choose_num_splits(96, 65536, sms)
    # another GPU than an sm_90 H100/H200 (e.g. ~100 KB of shared memory per block)
    with mock.patch.object(splitkv.launcher, "capability", lambda d: (12, 0)):
        assert splitkv._one_per_sm(64, splitkv.LONG_KV, sms, 128, 16, cfg, False,
                                   torch.device("cuda", 0)) == 0


def test_e4m3_caches_fill_the_sms_with_more_programs():
    """An E4M3 cache (1-byte entries) streams half the bytes per tile at the 16-bit tile's
    cost, so its plan saturates DRAM with more programs: no one-program-per-SM plan, and
    the occupancy heuristic counts CTAS_PER_SM programs per SM as saturating (16-bit
    caches keep SATURATING_PER_SM)."""
    cfg, dev, sms = splitkv.DecodeConfig(), torch.device("cpu"), 132
    assert splitkv.saturating_per_sm(2) == splitkv.SATURATING_PER_SM
    assert splitkv.saturating_per_sm(4) == splitkv.SATURATING_PER_SM
    assert splitkv.saturating_per_sm(1) == min(splitkv.CTAS_PER_SM, 2 * splitkv.SATURATING_PER_SM)
    for batch, length in ((8, 8192), (8, 32768), (8, 1 << 17), (1, 1 << 17), (64, 8192)):
        wide = splitkv.plan((batch, 32, 1, 128), 8, length, length, None, dev, cfg)
        narrow = splitkv.plan((batch, 32, 1, 128), 8, length, length, None, dev, cfg,
                              kv_itemsize=1)
        assert narrow.num_stages == 0, (batch, length)
        assert narrow.n_splits == splitkv.choose_num_splits(
            batch * 8, length, sms, saturating_per_sm=splitkv.saturating_per_sm(1))
        # more programs than the 16-bit plan, within the SMs' resident slots per wave
        assert narrow.n_splits > wide.n_splits, (batch, length, narrow, wide)
    assert splitkv.plan((8, 32, 1, 128), 8, 32768, 32768, None, dev, cfg,
                        kv_itemsize=1).n_splits == 6       # 384 programs of 396 slots
    assert splitkv._one_per_sm(64, splitkv.LONG_KV, sms, 128, 16, cfg, False, dev, 1) == 0


def test_plan_invariant_split_ignores_the_batch(monkeypatch):
    cfg = splitkv.DecodeConfig()
    plans = [splitkv.plan((b, 32, 1, 128), 8, cap, cap, None, torch.device("cpu"), cfg,
                          batch_invariant=True) for b, cap in [(1, 8192), (64, 8192), (3, 131072)]]
    assert {p.split_size for p in plans} == {splitkv.INVARIANT_SPLIT}
    assert plans[0].n_splits == 8192 // splitkv.INVARIANT_SPLIT
    # a length bound below the capacity shrinks the grid, never the workspace
    p = splitkv.plan((2, 32, 1, 128), 8, 8192, 1000, None, torch.device("cpu"), cfg,
                     batch_invariant=True)
    # (1000 keys take splits of 128: 512 halved twice, 1000 < 4 x 256)
    assert splitkv.invariant_size(1000, 512, cfg.block_n) == 128
    assert 1 < p.n_splits <= 8 and p.ws_splits == 16 and not p.write_final
    # the workspace covers the short sequences' extra splits: 1000 keys in splits of 128
    assert splitkv.invariant_slots(1000, 512) == 8 and splitkv.invariant_slots(128, 512) == 1
    # a long sequence: splits of 4096 (32 of them); the occupancy heuristic's 12 programs
    # would take runs of 3 splits on 10 programs and 2 on the 11th, so the grid is 16
    # programs of 2
    monkeypatch.setattr(splitkv, "choose_num_splits", lambda *a, **k: 12)
    p = splitkv.plan((1, 32, 1, 128), 8, 131072, 131072, None, torch.device("cpu"), cfg,
                     batch_invariant=True)
    assert splitkv.invariant_size(131072) == 4096 and p.n_splits == 16
    monkeypatch.undo()
    with pytest.raises(ValueError, match="multiple of BLOCK_N"):
        splitkv.plan((2, 32, 1, 128), 8, 8192, 1000, None, torch.device("cpu"), cfg,
                     batch_invariant=True, invariant_split=100)


@st.composite
def _decode_cases(draw):
    heads_kv, group = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4]))
    capacity = draw(st.sampled_from([16, 40, 100, 200]))
    lens = draw(st.lists(st.integers(0, capacity), min_size=1, max_size=3))
    block_n = draw(st.sampled_from([16, 32]))
    page = draw(st.sampled_from([None, 16, 32, 64]))
    invariant = draw(st.booleans())
    starts = (draw(st.lists(st.integers(-2, capacity + 2), min_size=len(lens), max_size=len(lens)))
              if draw(st.booleans()) else None)
    return dict(
        shape=dict(heads_q=heads_kv * group, heads_kv=heads_kv, q_len=draw(st.sampled_from([1, 2, 5])),
                   capacity=capacity, page_size=page or 16, seed=draw(st.integers(0, 99))),
        lens=lens, paged=page is not None, starts=starts,
        config=splitkv.DecodeConfig(block_n=block_n, num_warps=4, num_stages=2),
        split=dict(batch_invariant=True, invariant_split=block_n * draw(st.sampled_from([1, 3])))
        if invariant else dict(num_splits=draw(st.integers(1, 4))),
        tma=(page is None or page % block_n == 0) and draw(st.booleans()),
        mods=dict(window=draw(st.sampled_from([None, (0, None), (7, None), (45, 3)])),
                  softcap=draw(st.sampled_from([None, 2.0])), scale=0.3))


@settings(max_examples=12, deadline=None)
@given(_decode_cases())
def test_fuzz_against_reference(c):
    """Random shapes, lengths, first keys, layouts, tiles, splits, windows, softcaps, both
    modes, TMA or pointers: the masked and unmasked key runs always add up to the
    reference. In batch-invariant mode the same call planned with one program per sequence
    (FOLD: the splits folded in registers, no partials, no merge) gives the same bits."""
    case = make_case(c["lens"], head_dim=32, dtype=torch.float16, device=DEVICE, **c["shape"])
    start = None if c["starts"] is None else torch.tensor(c["starts"], dtype=torch.int32)
    kw = dict(config=c["config"], tma=c["tma"], **c["split"], **c["mods"],
              cache_start=None if start is None else start.to(DEVICE))
    o, lse, _ = run(case, c["paged"], **kw)
    ro, rl = decode_reference(case.q.cpu().double(), case.k.cpu().double(), case.v.cpu().double(),
                              case.seqlens.cpu(), cache_start=start, **c["mods"])
    assert_close(o, ro, torch.float16, name="o")
    assert_close(lse, rl, "float32", name="lse")
    if c["split"].get("batch_invariant"):
        with mock.patch.object(splitkv, "choose_num_splits", lambda *a, **k: 1):
            of, lf, launch = run(case, c["paged"], **kw)
        assert launch.merge is None and launch.plan.n_splits == 1
        assert torch.equal(of, o) and torch.equal(lf, lse)


def test_tma_eligibility():
    k = torch.zeros(2, 4, 64, 32, dtype=torch.float16)
    assert splitkv._tma_eligible(k, k, None, 64)
    assert not splitkv._tma_eligible(k.transpose(1, 2).contiguous().transpose(1, 2),
                                     k, None, 64)                  # heads inside tokens
    assert not splitkv._tma_eligible(k[..., :31], k, None, 64)     # 62-byte rows
    pages = torch.zeros(8, 64, 4, 32, dtype=torch.float16)
    assert splitkv._tma_eligible(pages, pages, 64, 64) and splitkv._tma_eligible(pages, pages, 64, 32)
    assert not splitkv._tma_eligible(pages[:, :16], pages[:, :16], 16, 64)   # 4 pages per tile


def test_invariant_workspace_holds_every_split():
    """The partials reserved per row (``invariant_slots(capacity)``) hold every split any
    sequence of at most ``capacity`` keys can use, whatever its first visible key ``lo``
    (window, first key): otherwise a split program would write into the next row's slots.
    Exhaustive over small capacities, for split sizes that halve and that cannot."""
    for split, block_n in ((64, 16), (48, 16), (16, 16)):
        for cap in range(0, 131):
            ws = splitkv.invariant_slots(cap, split)
            most = 0
            for seqlen in range(cap + 1):
                for lo in range(seqlen + 1):
                    size = splitkv.invariant_size(seqlen - lo, split, block_n)
                    most = max(most, -(-(seqlen - lo // size * size) // size))
            assert most <= ws, (split, cap, most, ws)


def test_invariant_split_doubles_for_long_sequences_halves_for_short():
    """In batch-invariant mode a sequence's split size is INVARIANT_SPLIT doubled until its
    keys fit in INVARIANT_MAX_SPLITS splits, or halved (at most twice, staying a multiple of
    BLOCK_N) until they span INVARIANT_MIN_SPLITS: a function of its own length. A long
    sequence decodes with fewer, longer splits, bitwise alike alone and beside a short
    one (which keeps the base size), and both match the reference."""
    import triton
    import triton.language as tl

    @triton.jit
    def plan_kernel(out, seqlen, split, BLOCK_N: tl.constexpr):
        base, size, n_used, _ = splitkv._split_plan(seqlen, seqlen * 0, 1 << 30, 1, split, 1,
                                                    BLOCK_N, True)
        tl.store(out, size)
        tl.store(out + 1, n_used)

    cap = splitkv.INVARIANT_MAX_SPLITS.value
    cases = [(16, 16 * cap, 16), (16, 16 * cap + 1, 32), (16, 2000, 64), (16, 300, 16),
             (16, 40, 16),                              # 8 is not a multiple of BLOCK_N
             (64, 256, 64), (64, 255, 32), (64, 200, 32), (64, 127, 16), (64, 0, 16)]
    for split, length, size in cases:
        out = torch.zeros(2, dtype=torch.int32, device=DEVICE)
        plan_kernel[(1,)](out, length, split, BLOCK_N=16)
        assert out.tolist() == [size, -(-length // size)], (split, length, out.tolist())
        assert splitkv.invariant_size(length, split, 16) == size

    kw = dict(heads_q=2, heads_kv=1, q_len=1, head_dim=32, dtype=torch.float32, device=DEVICE)
    long = make_case([2000], capacity=2000, seed=21, **kw)
    both = make_case([300, 2000], capacity=2000, seed=22, **kw)
    both.q[1], both.k[1], both.v[1] = long.q[0], long.k[0], long.v[0]
    o1, l1, _ = run(long, False, batch_invariant=True, invariant_split=16)
    o2, l2, _ = run(both, False, batch_invariant=True, invariant_split=16)
    assert torch.equal(o1[0], o2[1]) and torch.equal(l1[0], l2[1])
    check(both, o2, l2, torch.float32)


def test_the_default_reads_caches_through_tma_from_a_size_on(monkeypatch):
    """Where TMA is on by default (Hopper), a cache smaller than ``TMA_MIN_BYTES`` (K and V)
    is still read through pointers: a TMA launch costs more host time, which small eager
    calls cannot hide. ``tma=True`` / ``False`` override it both ways."""
    monkeypatch.setattr(splitkv, "_tma_default", lambda device: True)
    q = torch.zeros(2, 32, 1, 128, dtype=torch.bfloat16)
    k = torch.zeros(2, 8, 1024, 128, dtype=torch.bfloat16)       # 2 x 4 MiB
    lens = torch.full((2,), 1000, dtype=torch.int32)

    def uses_tma(**kw):
        launch = splitkv.prepare(q, k, k, lens, None, scale=0.1, num_splits=2, **kw)
        return launch.split[2]["USE_TMA"]
    assert not uses_tma()
    assert uses_tma(tma=True)
    monkeypatch.setattr(splitkv, "TMA_MIN_BYTES", 8 << 20)
    assert uses_tma() and not uses_tma(tma=False)
    monkeypatch.setattr(splitkv, "TMA_MIN_BYTES", (8 << 20) + 1)
    assert not uses_tma()
