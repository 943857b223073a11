"""flashfold.decode on a real GPU at real sizes (bf16, 32/8 heads, head_dim 128): accuracy
against float64, paged = contiguous, batch invariance bit for bit, the default mode's batch
dependence, CUDA-graph capture. Runs on the device machine (marked ``gpu``)."""

import math
from unittest import mock

import pytest
import torch

import flashfold as ff
from flashfold.bench import graph_replay
from flashfold.kernels.decode import splitkv
from flashfold.kernels.decode.reference import decode_reference
from flashfold.testing import assert_close
from test_decode_common import make_case, repage

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HQ, HKV, D = 32, 8, 128


def _reference(case, **mods):
    return decode_reference(case.q.double(), case.k.double(), case.v.double(), case.seqlens,
                            **mods)


@pytest.mark.parametrize("page", [None, 16, 64], ids=["contiguous", "paged16", "paged64"])
@pytest.mark.parametrize("q_len", [1, 4])
def test_bf16_real_sizes(page, q_len):
    lens = [0, 1, 511, 4096, 8192, 6000, 8191, 3]
    case = make_case(lens, heads_q=HQ, heads_kv=HKV, q_len=q_len, head_dim=D, capacity=8192,
                     page_size=page or 16, dtype=torch.bfloat16, device="cuda")
    k, v, table = case.cache(page is not None)
    ro, rl = _reference(case)
    for inv in (False, True):
        o, lse = ff.decode(case.q, k, v, case.seqlens, block_table=table, batch_invariant=inv,
                           return_lse=True)
        assert_close(o, ro, "bfloat16", name="o")
        assert_close(lse, rl, "float32", name="lse")
        assert torch.equal(o[0], torch.zeros_like(o[0])) and (lse[0] == -math.inf).all()


def test_paged_equals_contiguous():
    case = make_case([8192, 100, 5000], heads_q=HQ, heads_kv=HKV, head_dim=D, capacity=8192,
                     page_size=16, dtype=torch.bfloat16, device="cuda")
    a = ff.decode(case.q, case.k, case.v, case.seqlens)
    b = ff.decode(case.q, case.k_pages, case.v_pages, case.seqlens, block_table=case.block_table)
    assert_close(b, a.double(), "bfloat16", name="paged vs contiguous")


def _target_in_batches(dtype, batch_invariant, page=None):
    """The same 7000-token sequence alone and in batches of 8, 64 and 16 (other lengths,
    positions, capacities); returns [(output row, chosen split count)]. The batch of 16 is
    planned with one program per sequence (as for large batches; forced here to keep the
    test small): in batch-invariant mode each program folds its splits in registers (no
    partials, no merge), where the others write partials that the merge kernel folds."""
    target = make_case([7000], heads_q=HQ, heads_kv=HKV, head_dim=D, capacity=7000,
                       dtype=dtype, device="cuda", seed=1)
    g = torch.Generator().manual_seed(2)
    outs = []
    for batch, pos, cap in [(1, 0, 8192), (8, 3, 8192), (64, 40, 12288), (16, 5, 8192)]:
        one = (lambda *a, **k: 1) if batch == 16 else splitkv.choose_num_splits
        lens = torch.randint(0, cap + 1, (batch,), generator=g).tolist()
        lens[pos] = 7000
        case = make_case(lens, heads_q=HQ, heads_kv=HKV, head_dim=D, capacity=cap,
                         dtype=dtype, device="cuda", seed=batch)
        case.q[pos] = target.q[0]
        case.k[pos, :, :7000], case.v[pos, :, :7000] = target.k[0], target.v[0]
        k, v, table = case.k, case.v, None
        if page is not None:
            paged = repage(case, page)
            k, v, table = paged.k_pages, paged.v_pages, paged.block_table
        with mock.patch.object(splitkv, "choose_num_splits", one):
            o = ff.decode(case.q, k, v, case.seqlens, block_table=table,
                          batch_invariant=batch_invariant)
            plan = splitkv.plan(case.q.shape, HKV, cap, cap, None, case.q.device,
                                splitkv.default_config(D, dtype, page),
                                batch_invariant=batch_invariant)
        outs.append((o[pos].clone(), plan.n_splits))
    return outs


@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "paged16"])
def test_batch_invariant_bitwise_on_gpu(page):
    outs = _target_in_batches(torch.bfloat16, True, page)
    programs = [n for _, n in outs]
    assert programs[-1] == 1 and min(programs[:-1]) > 1, programs   # FOLD and merged paths
    for o, _ in outs[1:]:
        assert torch.equal(o, outs[0][0])


def test_default_mode_depends_on_the_batch():
    """The default mode chooses its split count from the batch (so the rounding changes):
    in float32 the outputs differ; in bf16 they are printed (they may round alike)."""
    outs = _target_in_batches(torch.float32, False)
    splits = [s for _, s in outs]
    assert len(set(splits)) > 1, splits
    assert any(not torch.equal(o, outs[0][0]) for o, _ in outs[1:]), splits
    bf = _target_in_batches(torch.bfloat16, False)
    print("default mode, bf16, bitwise equal across batches 1/8/64:",
          [torch.equal(o, bf[0][0]) for o, _ in bf[1:]], "splits", [s for _, s in bf])


def _captured(fn):
    """``fn`` captured in a CUDA graph (one warm-up call on a side stream first):
    ``(replay, the output of the captured call)``."""
    box = []
    replay = graph_replay(lambda: box.append(fn()), warmup=1)
    return replay, box[-1]


def test_cuda_graph_capture():
    case = make_case([8192, 4000], heads_q=HQ, heads_kv=HKV, head_dim=D, capacity=8192,
                     page_size=16, dtype=torch.bfloat16, device="cuda")
    fn = lambda: ff.decode(case.q, case.k_pages, case.v_pages, case.seqlens,  # noqa: E731
                           block_table=case.block_table)
    eager = fn()
    replay, out = _captured(fn)
    replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_validation_on_gpu():
    case = make_case([10, 20], heads_q=4, heads_kv=2, head_dim=64, capacity=32,
                     dtype=torch.bfloat16, device="cuda")
    bad = torch.tensor([10, 40], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="cache_seqlens: lengths"):
        ff.decode(case.q, case.k, case.v, bad, check_lengths=True)
    with pytest.raises(ValueError, match="cache_seqlens: on cpu"):
        ff.decode(case.q, case.k, case.v, case.seqlens.cpu())
    with pytest.raises(TypeError, match="q: dtype"):
        ff.decode(case.q.double(), case.k.double(), case.v.double(), case.seqlens)


def test_programmatic_launch_changes_nothing():
    """The merge launched with programmatic dependent launch (waiting on griddepcontrol)
    gives the same bits as a plainly ordered launch."""
    case = make_case([8192, 3000, 0, 6000], heads_q=HQ, heads_kv=HKV, head_dim=D,
                     capacity=8192, dtype=torch.bfloat16, device="cuda")
    runs = [splitkv.splitkv_decode(case.q, case.k, case.v, case.seqlens, scale=D ** -0.5,
                                   num_splits=6, pdl=pdl) for pdl in (True, False)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "paged16"])
def test_one_split_and_merged_paths_agree_bitwise(page):
    """batch_invariant: planned with one program per sequence (as for a large batch; forced
    here), the split kernel folds the sequence's splits itself and skips the merge; the
    same sequence in a larger cache, with several programs, goes through the merge
    kernel; the bits must be the same (the same combines in the same order, no FP
    contraction in either kernel)."""
    small = make_case([300], heads_q=HQ, heads_kv=HKV, head_dim=D, capacity=512,
                      page_size=page or 16, dtype=torch.bfloat16, device="cuda", seed=3)
    big = make_case([300], heads_q=HQ, heads_kv=HKV, head_dim=D, capacity=8192,
                    dtype=torch.bfloat16, device="cuda", seed=3)
    big.q[:], big.k[:, :, :512], big.v[:, :, :512] = small.q, small.k, small.v
    big = repage(big, 16) if page else big
    outs = []
    for c, merged in ((small, False), (big, True)):
        k, v, table = c.cache(page is not None)
        one = splitkv.choose_num_splits if merged else (lambda *a, **kw: 1)
        with mock.patch.object(splitkv, "choose_num_splits", one):
            launch = splitkv.prepare(c.q, k, v, c.seqlens, table, scale=D ** -0.5,
                                     batch_invariant=True)
        assert (launch.merge is not None) == merged
        outs.append(launch.run())
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_long_plan_matches_the_heuristics_plan():
    """A long row (one program per SM, a 4-deep ring: ``splitkv._one_per_sm``) against the
    occupancy heuristic's split count with the default ring, on the same tokens: the same
    values; the ring depth alone never changes the bits."""
    case = make_case([65536, 40001, 1, 0], heads_q=HQ, heads_kv=HKV, head_dim=D,
                     capacity=65536, dtype=torch.bfloat16, device="cuda")
    launch = splitkv.prepare(case.q, case.k, case.v, case.seqlens, scale=D ** -0.5)
    assert launch.plan.num_stages == splitkv.LONG_STAGES
    assert launch.split[2]["NUM_STAGES"] == splitkv.LONG_STAGES
    long = launch.run()
    assert launch.plan.n_splits * 4 * HKV <= splitkv._num_sms(case.q.device)
    splits = splitkv.choose_num_splits(4 * HKV, 65536, splitkv._num_sms(case.q.device))
    short = splitkv.splitkv_decode(case.q, case.k, case.v, case.seqlens, scale=D ** -0.5,
                                   num_splits=splits)
    assert_close(long[0], short[0].double(), "bfloat16", name="o")
    assert_close(long[1], short[1].double(), "float32", name="lse")
    deep = splitkv.splitkv_decode(case.q, case.k, case.v, case.seqlens, scale=D ** -0.5,
                                  num_splits=splits, config=splitkv.DecodeConfig(num_stages=4))
    assert torch.equal(deep[0], short[0]) and torch.equal(deep[1], short[1])


@pytest.mark.parametrize("page", [None, 64], ids=["contiguous", "paged64"])
def test_tma_and_pointer_loads_agree(page):
    """K/V through TMA boxes or through cp.async pointers: the same values, and in
    batch-invariant mode the same bits (the default picks TMA from the cache's size, so
    a sequence in a small batch may run the pointer path: H200, 40 of 40
    rows bitwise equal in both modes)."""
    case = make_case([8192, 5000, 1, 0, 777], heads_q=HQ, heads_kv=HKV, head_dim=D,
                     capacity=8192, page_size=page or 64, dtype=torch.bfloat16, device="cuda")
    k, v, table = case.cache(page is not None)
    for inv in (False, True):
        runs = [splitkv.splitkv_decode(case.q, k, v, case.seqlens, table, scale=D ** -0.5,
                                       batch_invariant=inv, tma=tma) for tma in (True, False)]
        assert_close(runs[0][0], runs[1][0].double(), "bfloat16", name="o")
        assert_close(runs[0][1], runs[1][1].double(), "float32", name="lse")
        same = torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
        print(f"page {page} invariant {inv}: TMA and pointer outputs bitwise equal:", same)
        assert same or not inv


# --- a first key per sequence (cache_start, left padding) ----------------------------------

#: lengths and first keys at real sizes: none, 0, a middle, == length, past it, one tile
#: short of the end, unaligned to any tile, page or invariant split
START_LENS = [0, 1, 8192, 8192, 6000, 7000, 4097, 3]
STARTS = [5, 0, 2049, 8192, 9000, 6999, 1000, 1]


@pytest.mark.parametrize("page", [None, 16, 64], ids=["contiguous", "paged16", "paged64"])
@pytest.mark.parametrize("q_len", [1, 4])
def test_cache_start_real_sizes(page, q_len):
    """bf16 at real sizes with a first key per sequence, default and batch-invariant, with
    and without a window: against the float64 reference on the keys [a_b, n_b); the slots
    before a_b hold NaN and the block-table entries of pages before it are -1 (never
    read); sequences with no key give exactly (0, -inf)."""
    case = make_case(START_LENS, heads_q=HQ, heads_kv=HKV, q_len=q_len, head_dim=D,
                     capacity=8192, page_size=page or 16, dtype=torch.bfloat16, device="cuda")
    start = torch.tensor(STARTS, dtype=torch.int32, device="cuda")
    refs = {w: decode_reference(case.q.double(), case.k.double(), case.v.double(), case.seqlens,
                                window=w, cache_start=start) for w in (None, (1500, None))}
    for b, a in enumerate(STARTS):
        case.k[b, :, :a] = float("nan")
        case.v[b, :, :a] = float("nan")
    if page is not None:
        case = repage(case, page)
        for b, (a, n) in enumerate(zip(STARTS, START_LENS)):
            a = min(a, n)
            case.block_table[b, :a // page] = -1
    k, v, table = case.cache(page is not None)
    for window, (ro, rl) in refs.items():
        for inv in (False, True):
            o, lse = ff.decode(case.q, k, v, case.seqlens, block_table=table, window=window,
                               cache_start=start, batch_invariant=inv, return_lse=True)
            assert_close(o, ro, "bfloat16", name=f"o (window {window}, invariant {inv})")
            assert_close(lse, rl, "float32", name=f"lse (window {window}, invariant {inv})")
            for b in (0, 3, 4):
                assert torch.equal(o[b], torch.zeros_like(o[b])) and (lse[b] == -math.inf).all()


@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "paged16"])
def test_cache_start_batch_invariant_bitwise(page):
    """A left-padded sequence (first key 1234, length 7000) alone and in batches of 8 and
    64 with other lengths and first keys: bitwise the same in batch-invariant mode."""
    target = make_case([7000], heads_q=HQ, heads_kv=HKV, head_dim=D, capacity=7000,
                       dtype=torch.bfloat16, device="cuda", seed=1)
    g = torch.Generator().manual_seed(5)
    outs = []
    for batch, pos, cap in [(1, 0, 8192), (8, 3, 8192), (64, 40, 12288)]:
        lens = torch.randint(0, cap + 1, (batch,), generator=g)
        starts = (torch.rand(batch, generator=g) * lens).to(torch.int32)
        lens[pos], starts[pos] = 7000, 1234
        case = make_case(lens.tolist(), heads_q=HQ, heads_kv=HKV, head_dim=D, capacity=cap,
                         dtype=torch.bfloat16, device="cuda", seed=batch)
        case.q[pos] = target.q[0]
        case.k[pos, :, :7000], case.v[pos, :, :7000] = target.k[0], target.v[0]
        k, v, table = case.k, case.v, None
        if page is not None:
            paged = repage(case, page)
            k, v, table = paged.k_pages, paged.v_pages, paged.block_table
        o = ff.decode(case.q, k, v, case.seqlens, block_table=table, batch_invariant=True,
                      cache_start=starts.cuda())
        outs.append(o[pos].clone())
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def test_cache_start_cuda_graph_capture():
    """No host synchronisation with a first key: the step captures in a CUDA graph, and a
    replay after the first keys change (in place) follows them."""
    case = make_case([8192, 4000], heads_q=HQ, heads_kv=HKV, head_dim=D, capacity=8192,
                     page_size=16, dtype=torch.bfloat16, device="cuda")
    start = torch.tensor([100, 3000], dtype=torch.int32, device="cuda")
    fn = lambda: ff.decode(case.q, case.k_pages, case.v_pages, case.seqlens,  # noqa: E731
                           block_table=case.block_table, cache_start=start)
    eager = fn()
    replay, out = _captured(fn)
    replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    start.copy_(torch.tensor([5000, 0], dtype=torch.int32))
    replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fn())
