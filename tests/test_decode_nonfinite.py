"""Decode and non-finite inputs: a NaN or inf reaches exactly the outputs that depend on it.

The rule (``flashfold.kernels.decode.reference``): a key hidden from a query row (causal
inside the cache, the window, or outside ``[cache_start, cache_seqlens)``) contributes
nothing to it whatever it holds; a visible key with a NaN or +inf score makes the row's
``o`` and ``lse`` NaN (never the empty row's ``(0, -inf)``); a non-finite value entry of a
visible key makes only ``o[row, channel]`` non-finite. Checked against an oracle written
from the rule row by row, for the float64 / float32 reference (the CPU path of
``flashfold.decode``) and the split-KV kernels (under ``TRITON_INTERPRET=1`` on the CPU,
fp16 / fp32; natively on a GPU) in every mode: one split, merged splits, batch-invariant
fixed splits folded in one program or merged; contiguous and paged caches, pointers and
TMA. Tests marked ``gpu`` repeat it at real sizes in bf16.
"""

import math

import pytest
import torch

import flashfold as ff
from flashfold.kernels.decode import splitkv
from flashfold.kernels.decode.reference import decode_reference
from flashfold.testing import assert_close
from test_decode_common import make_case, repage, strict_interpreter_masks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def _strict_masks():
    if DEVICE == "cuda":
        yield
        return
    with strict_interpreter_masks():
        yield


def oracle(q, k, v, lens, *, starts=None, window_left=None, scale=None, softcap=None):
    """``(o, lse)`` in float64 from the rule, one query row at a time: its visible keys
    ``J`` (``a_b <= j < n_b``, ``j <= p_i``, ``j >= p_i - window_left``); none, or every
    score ``-inf``: ``(0, -inf)``; a NaN or +inf score: NaN everywhere; else the softmax of
    the scores over ``J`` with ``o[c]`` NaN wherever some ``v_j[c]`` (``j`` in ``J``) is not
    finite. ``k`` / ``v`` contiguous ``(batch, heads_kv, capacity, head_dim)``."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    batch, heads_q, q_len, dim = q.shape
    group = heads_q // k.shape[1]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    o = torch.zeros(batch, heads_q, q_len, dim, dtype=torch.float64)
    lse = torch.full((batch, heads_q, q_len), -math.inf, dtype=torch.float64)
    for b, n in enumerate(int(x) for x in lens):
        a = 0 if starts is None else min(max(int(starts[b]), 0), n)
        for h in range(heads_q):
            for i in range(q_len):
                p = n - q_len + i
                keys = [j for j in range(a, n)
                        if j <= p and (window_left is None or j >= p - window_left)]
                if not keys:
                    continue
                s = scale * (k[b, h // group, keys] @ q[b, h, i])
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                if (torch.isnan(s) | (s == math.inf)).any():
                    o[b, h, i], lse[b, h, i] = NAN, NAN
                    continue
                if (s == -math.inf).all():
                    continue
                m = s.max()
                w = torch.exp(s - m)
                vals = v[b, h // group, keys]
                finite = torch.isfinite(vals)
                o[b, h, i] = (w[:, None] * torch.where(finite, vals, 0.0)).sum(0) / w.sum()
                o[b, h, i][~finite.all(0)] = NAN
                lse[b, h, i] = m + torch.log(w.sum())
    return o, lse


def check_rule(o, lse, expected, dtype, name=""):
    """Finiteness parity element by element (NaN vs inf not distinguished for ``o``), ``lse``
    NaN exactly on NaN rows and ``-inf`` exactly on empty ones, finite values close."""
    eo, el = (x.detach().double().cpu() for x in expected)
    o, lse = o.detach().double().cpu(), lse.detach().double().cpu()
    bad_o = torch.isfinite(o) != torch.isfinite(eo)
    assert not bad_o.any(), (f"{name} o: finiteness differs at {bad_o.nonzero()[:6].tolist()} "
                             f"(o finite {torch.isfinite(o)[bad_o][:6].tolist()})")
    assert torch.equal(torch.isnan(lse), torch.isnan(el)), f"{name} lse: NaN rows differ"
    assert torch.equal(lse == -math.inf, el == -math.inf), f"{name} lse: empty rows differ"
    assert not (lse == math.inf).any(), f"{name} lse: +inf"
    fin = torch.isfinite(eo)
    assert_close(torch.where(fin, o, 0.0), torch.where(fin, eo, 0.0), dtype, name=f"{name} o")
    fin = torch.isfinite(el)
    assert_close(torch.where(fin, lse, 0.0), torch.where(fin, el, 0.0), "float32",
                 name=f"{name} lse")


# --- the reference (the CPU path of flashfold.decode) ------------------------------------

def _small(q_len=4, lens=(64,), capacity=64, seed=0, dtype=torch.float32, **kw):
    return make_case(list(lens), heads_q=4, heads_kv=2, q_len=q_len, head_dim=16,
                     capacity=capacity, dtype=dtype, seed=seed, **kw)


def _reference(case, paged=False, **mods):
    k, v, table = case.cache(paged)
    return decode_reference(case.q.double(), k.double(), v.double(), case.seqlens, table,
                            **mods)


@pytest.mark.parametrize("what", ["k", "v", "v-channel", "k-inf"])
def test_reference_last_key_reaches_only_the_rows_that_see_it(what):
    """q_len 4, a non-finite entry in the last key (63): rows 0-2 cannot see it and equal the
    clean result; row 3 follows the rule (NaN k: o and lse NaN; NaN v: o NaN, lse finite;
    NaN in one channel of v: that channel only; +inf in k: a +inf score for the rows whose
    q is positive in that channel (NaN), -inf for the others (weight 0))."""
    case = _small()
    clean = _reference(case)
    x = case.k if what.startswith("k") else case.v
    if what == "v-channel":
        x[0, :, 63, 5] = NAN
    elif what == "k-inf":
        x[0, :, 63, 2] = INF
    else:
        x[0, :, 63] = NAN
    o, lse = _reference(case)
    check_rule(o, lse, oracle(case.q, case.k, case.v, case.seqlens), "float64", what)
    assert_close(o[..., :3, :], clean[0][..., :3, :], "float64", name="rows 0-2")
    assert_close(lse[..., :3], clean[1][..., :3], "float64", name="rows 0-2 lse")
    if what == "v-channel":
        assert torch.isnan(o[..., 3, 5]).all() and torch.isfinite(o[..., 3, :5]).all()
    if what == "k-inf":                       # q's sign in channel 2 decides: +inf or -inf
        up = case.q[0, :, 3, 2] > 0
        assert up.any() and (~up).any()
        assert torch.isnan(lse[0, up, 3]).all() and torch.isfinite(lse[0, ~up, 3]).all()


def test_reference_nan_query_is_not_an_empty_row():
    """A NaN in q gives its row NaN (o and lse), never ``o = 0``; a row that sees no key
    stays empty (0, -inf) whatever its q holds."""
    case = _small(lens=(64, 10), capacity=64)
    case.q[0, 1, 2, 0] = NAN
    case.q[1, 0, 0, 3] = NAN
    start = torch.tensor([0, 8], dtype=torch.int32)   # sequence 1: keys [8, 10); rows 0-1 see none
    o, lse = _reference(case, cache_start=start)
    check_rule(o, lse, oracle(case.q, case.k, case.v, case.seqlens, starts=start), "float64")
    assert torch.isnan(o[0, 1, 2]).all() and torch.isnan(lse[0, 1, 2])
    assert torch.equal(o[1, 0, 0], torch.zeros_like(o[1, 0, 0])) and lse[1, 0, 0] == -math.inf


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_reference_hidden_and_foreign_slots_hold_anything(paged):
    """NaN in every slot outside ``[cache_start, cache_seqlens)`` (in the paged cache also in
    pages no table names) and in the keys left of the window: nothing changes."""
    lens, starts = [50, 64, 0, 30], [0, 20, 0, 35]
    case = _small(q_len=3, lens=lens, capacity=64, page_size=16)
    window = (9, None)
    start = torch.tensor(starts, dtype=torch.int32)
    clean = _reference(case, paged, cache_start=start, window=window)
    for b, (n, a) in enumerate(zip(lens, starts)):
        for x in (case.k, case.v):
            x[b, :, n:] = NAN
            x[b, :, :min(a, n)] = NAN
            x[b, :, min(a, n):max(min(a, n), n - 3 - 9)] = NAN    # left of every row's window
    if paged:
        case = repage(case, 16)
        spare = sorted(set(range(case.k_pages.shape[0])) - set(case.block_table.flatten().tolist()))
        case.k_pages[spare], case.v_pages[spare] = NAN, NAN
    o, lse = _reference(case, paged, cache_start=start, window=window)
    assert torch.isfinite(o).all() and not torch.isnan(lse).any()
    assert_close(o, clean[0], "float64", name="o")
    assert_close(lse, clean[1], "float64", name="lse")


def test_public_cpu_decode_follows_the_rule():
    """``flashfold.decode`` on CPU tensors (the float32 reference), the reproduction: q_len 4,
    NaN in value 63: rows 0-2 finite, row 3 NaN."""
    case = _small(dtype=torch.float16)
    case.v[0, :, 63] = NAN
    case.k[0, 1, 40, 2] = NAN                         # heads 2-3 see it in every row
    o, lse = ff.decode(case.q, case.k, case.v, case.seqlens, return_lse=True)
    check_rule(o, lse, oracle(case.q, case.k, case.v, case.seqlens), "float16")
    assert torch.isfinite(o[0, :2, :3]).all() and torch.isnan(o[0, :, 3]).all()


# --- the split-KV kernels ----------------------------------------------------------------

MODES = {
    "one-split": dict(num_splits=1),
    "splits3": dict(num_splits=3),
    # fixed splits of 32 keys (64 halved), several programs: partials merged
    "invariant": dict(batch_invariant=True, invariant_split=64),
    # a length bound of one program per sequence: the splits folded in registers (FOLD)
    "invariant-fold": dict(batch_invariant=True, invariant_split=64, max_seqlen=16),
}


def _run(case, paged, **kw):
    k, v, table = case.cache(paged)
    scale = kw.pop("scale", 1.0 / math.sqrt(case.q.shape[-1]))
    launch = splitkv.prepare(case.q, k, v, case.seqlens, table, scale=scale, **kw)
    o, lse = launch.run()
    return o, lse, launch


def _kernel_case(q_len, dtype, page=None, seed=31):
    # a partial tile, a tile edge, several tiles (a masked last tile with hidden pairs)
    lens = [77, 64, 150, 5]
    case = make_case(lens, heads_q=4, heads_kv=2, q_len=q_len, head_dim=32, capacity=160,
                     page_size=page or 16, dtype=dtype, device=DEVICE, seed=seed)
    return case


def _poison_last_keys(case):
    """NaN value at each sequence's last key (only its last query row sees it), a NaN key one
    before (the last two rows see it: o and lse NaN there), one NaN value channel in a key
    every row sees (one channel non-finite in every row)."""
    for b, n in enumerate(case.seqlens.tolist()):
        case.v[b, :, n - 1] = NAN
        if n >= 2:
            case.k[b, 1, n - 2, 3] = NAN
        if n >= 8:
            case.v[b, 0, 2, 7] = INF


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype, layout, q_len", [
    (torch.float16, "contiguous", 4),
    (torch.float32, "paged16", 3),
    (torch.float16, "paged64", 2),
], ids=["fp16-contiguous-q4", "fp32-paged16-q3", "fp16-paged64-q2"])
def test_kernel_causal_hidden_keys_contribute_nothing(mode, dtype, layout, q_len):
    """Keys past a row's causal bound (inside the last, masked tiles) hold NaN: the rows
    that cannot see them equal the clean result; the rows that do follow the rule."""
    page = None if layout == "contiguous" else int(layout[5:])
    case = _kernel_case(q_len, dtype, page)
    _poison_last_keys(case)
    expected = oracle(case.q, case.k, case.v, case.seqlens)
    if page:
        case = repage(case, page)
    o, lse, _ = _run(case, page is not None, **MODES[mode])
    check_rule(o, lse, expected, dtype, mode)


@pytest.mark.parametrize("q_len, left, tma", [(3, 20, False), (3, 20, True), (4, 1, False)],
                         ids=["pointers", "tma", "narrow-window"])
def test_kernel_window_and_first_key(q_len, left, tma):
    """Keys left of the window (masked first tiles) and slots before ``cache_start`` or past
    the length hold NaN; one visible NaN key and value on top: the rule, in every mode.
    A window narrower than q_len - 1: the keys left of the last row's window bound and
    those after the first row's causal bound overlap (each key must count once)."""
    case = _kernel_case(q_len, torch.float16, seed=32)
    lens, starts = case.seqlens.tolist(), [3, 0, 70, 0]
    for b, (n, a) in enumerate(zip(lens, starts)):
        for x in (case.k, case.v):
            x[b, :, n:] = NAN
            x[b, :, :a] = NAN
            x[b, :, a:max(a, n - q_len - left)] = NAN  # left of every row's window
            x[b, :, max(a, n - q_len - left)] = NAN    # only row 0's window holds it
    case.k[2, 0, 140, 1] = NAN                          # visible to every row of heads 0-1
    start = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    expected = oracle(case.q, case.k, case.v, case.seqlens, starts=starts, window_left=left)
    for mode, kw in MODES.items():
        o, lse, launch = _run(case, False, cache_start=start, window=(left, None), tma=tma, **kw)
        assert launch.split[2]["USE_TMA"] == tma
        check_rule(o, lse, expected, torch.float16, mode)


def test_kernel_nan_query_and_softcap():
    """A NaN in q (one row NaN, never ``o = 0``), +inf in a key (rows with a +inf score NaN),
    under a softcap (tanh keeps infinite scores finite: the rows stay finite)."""
    for softcap in (None, 2.0):
        case = _kernel_case(2, torch.float32, seed=33)
        case.q[0, 2, 1, 4] = NAN
        case.k[1, 0, 30, 6] = INF
        expected = oracle(case.q, case.k, case.v, case.seqlens, softcap=softcap)
        assert torch.isnan(expected[1][0, 2, 1]) and torch.isfinite(expected[1][0, :2]).all()
        assert torch.isnan(expected[1][1]).any() == (softcap is None)
        for mode, kw in MODES.items():
            o, lse, _ = _run(case, False, softcap=softcap, **kw)
            check_rule(o, lse, expected, torch.float32, f"{mode} softcap={softcap}")


def test_kernel_q_len1_unused_slots_and_visible_nan():
    """q_len 1 (no key inside a sequence is hidden): slots past the length hold NaN and are
    never read; a NaN value channel and a NaN key that the row sees reach it."""
    case = make_case([77, 150, 1], heads_q=4, heads_kv=2, q_len=1, head_dim=32, capacity=160,
                     dtype=torch.float16, device=DEVICE, seed=34)
    for b, n in enumerate(case.seqlens.tolist()):
        case.k[b, :, n:], case.v[b, :, n:] = NAN, NAN
    case.v[0, 1, 76, 0] = NAN
    case.k[1, 0, 3, 0] = NAN
    expected = oracle(case.q, case.k, case.v, case.seqlens)
    for mode, kw in MODES.items():
        o, lse, _ = _run(case, False, **kw)
        check_rule(o, lse, expected, torch.float16, mode)


def same_bits(a, b):
    """Bitwise equal where finite or infinite, NaN at the same places (a NaN's payload is
    not part of the result)."""
    if not torch.equal(torch.isnan(a), torch.isnan(b)):
        return False
    a, b = torch.where(torch.isnan(a), 0.0, a), torch.where(torch.isnan(b), 0.0, b)
    view = torch.int16 if a.element_size() == 2 else torch.int32
    return torch.equal(a.view(view), b.view(view))


def test_kernel_batch_invariant_bitwise_with_nonfinite_inputs():
    """batch_invariant keeps its meaning with NaN inputs: a sequence holding hidden and
    visible NaN gives the same bits alone and among other sequences (fixed splits merged,
    or folded in one program)."""
    target = make_case([150], heads_q=4, heads_kv=2, q_len=3, head_dim=32, capacity=150,
                       dtype=torch.float32, device=DEVICE, seed=35)
    target.v[0, :, 149] = NAN                           # only the last row sees it
    target.k[0, 0, 100, 2] = NAN                        # every row of heads 0-1
    outs = []
    for lens, pos, kw in [([150], 0, {}), ([30, 150, 7], 1, {}),
                          ([150, 64], 0, dict(max_seqlen=16))]:
        case = make_case(lens, heads_q=4, heads_kv=2, q_len=3, head_dim=32, capacity=160,
                         dtype=torch.float32, device=DEVICE, seed=len(lens))
        case.q[pos] = target.q[0]
        case.k[pos, :, :150], case.v[pos, :, :150] = target.k[0], target.v[0]
        o, lse, launch = _run(case, False, batch_invariant=True, invariant_split=64, **kw)
        outs.append((o[pos], lse[pos]))
    assert launch.merge is None                        # the folding program
    for o, lse in outs:
        assert same_bits(o, outs[0][0]) and same_bits(lse, outs[0][1])
    check_rule(outs[0][0][None], outs[0][1][None],
               oracle(target.q, target.k, target.v, target.seqlens), torch.float32)


# --- at real sizes on the GPU (bf16) -----------------------------------------------------

HQ, HKV, D = 32, 8, 128


@pytest.mark.parametrize("page", [None, 16, 64], ids=["contiguous", "paged16", "paged64"])
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "invariant"])
@pytest.mark.parametrize("window", [None, (1000, None)], ids=["full", "window"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_real_sizes(page, q_len, batch_invariant, window):
    """32 / 8 heads, head_dim 128, bf16, lengths up to 8K: NaN in the unused slots and
    pages, in the last key (hidden from all but the last row), left of the window, one
    visible NaN value channel and a visible NaN key: finiteness parity with the float64
    reference (which the CPU tests check against the rule's oracle) and its values
    elsewhere; batch-invariant: one sequence alone gives the same bits as in the batch."""
    lens = [0, 1, 511, 4096, 8192, 6000, 8191, 3]
    case = make_case(lens, heads_q=HQ, heads_kv=HKV, q_len=q_len, head_dim=D, capacity=8192,
                     dtype=torch.bfloat16, device="cuda", seed=41)
    left = None if window is None else window[0]
    for b, n in enumerate(lens):
        for x in (case.k, case.v):
            x[b, :, n:] = NAN
            if left is not None and n - q_len - left > 0:
                x[b, :, :n - q_len - left] = NAN          # left of every row's window
        if n >= 2:
            case.v[b, :, n - 1] = NAN                     # the last row only (q_len 1: all)
    case.v[4, 3, 8000, 17] = NAN                          # visible: channel 17 of heads 12-15
    case.k[3, 5, 4000, 9] = NAN                           # visible: heads 20-23 all NaN
    # every score of one row NaN: the GPU's max ignores NaN (m = -inf), and the row must
    # still come out NaN, not the empty row's 0
    case.q[2, 7, 0, 5] = NAN
    if page is not None:
        case = repage(case, page)
        spare = sorted(set(range(case.k_pages.shape[0])) - set(case.block_table.flatten().tolist()))
        case.k_pages[spare], case.v_pages[spare] = NAN, NAN
    k, v, table = case.cache(page is not None)
    ro, rl = decode_reference(case.q.double(), case.k.double(), case.v.double(), case.seqlens,
                              window=window)
    o, lse = ff.decode(case.q, k, v, case.seqlens, block_table=table, window=window,
                       batch_invariant=batch_invariant, return_lse=True)
    check_rule(o, lse, (ro, rl), "bfloat16")
    assert torch.isnan(o[3, 20:24]).all() and torch.isnan(lse[3, 20:24]).all()
    assert torch.isnan(o[2, 7, 0]).all() and torch.isnan(lse[2, 7, 0])
    assert torch.isnan(o[4, 12:16, :, 17]).all()
    assert torch.isfinite(o[4, 12:16, :max(q_len - 1, 0), :17]).all()
    if batch_invariant:                                   # sequence 4 alone: the same bits
        one = slice(4, 5)
        alone = ff.decode(case.q[one], k if table is not None else k[one],
                          v if table is not None else v[one], case.seqlens[one],
                          block_table=None if table is None else table[one], window=window,
                          batch_invariant=True)
        assert same_bits(alone[0], o[4])
