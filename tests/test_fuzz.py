"""The fuzz suite: random shapes, dtypes, strides, masks and values against float64.

Hypothesis draws the cases; every public entry point is compared with an *independent*
float64 reference (torch in float64, the naive attention oracle that materializes the
score matrix, sequential folds), never with the library's own reference schedules:

* ``attention``: dtypes fp16/bf16/fp32/fp64, batch, GQA/MQA ratios, awkward lengths (0,
  1, primes), every supported head dim (q/k and v independent), layouts (contiguous,
  (B, S, H, D) storage, sliced with a non-unit last stride, expanded along heads or batch:
  stride 0), causal, windows (-1 / None / 0 / wider than the sequence), scale, softcap,
  score_mods (ALiBi, relative bias), mask_mods (key padding, documents, prefix-LM, sliding
  window, compositions, a mask hiding every key), extreme values (scores ~1e4, all-equal
  scores, tiny values); varlen ``cu_seqlens`` with empty sequences;
* ``decode``: contiguous and paged caches (shuffled block tables, NaN in every unused
  slot), lengths 0..capacity (also shorter than ``q_len``), first keys ``cache_start``
  (0, inside, == and past the length, negative; NaN in the slots before them), q_len
  1..16, head dims 1..256, windows, softcap, GQA, int32/int64 lengths, non-contiguous
  caches and queries;
* ``merge_states``: the parts of a random key partition (empty parts, a fully masked part)
  merged stacked and pairwise in random order, against the unsplit attention; random
  states with ``-inf`` and ±1e4 LSEs against the float64 formula;
* ``reduce`` / ``scan`` (and ``segment_reduce``): built-in and user monoids (a
  non-commutative one), ranks 0-4, empty dims, several dims at once, keepdim, permuted /
  sliced / expanded inputs, fp32/fp16/bf16, -inf rows, ties, reverse scans;
* the Triton kernels under ``TRITON_INTERPRET`` (small sizes: reductions, scans, attention
  forward with varlen/GQA/masks) where that is cheap on the CPU;
* FP8 attention (E4M3 inputs, random shapes, features and magnitudes): the reference and
  the kernel within the bound E4M3 weights allow;
* every invalid-argument class (wrong rank, mismatched batch/heads/dims/devices/dtypes,
  bad or non-monotone ``cu_seqlens`` and offsets, unsupported head dims, bad windows,
  scales, lengths, block tables, dims, ...): each must raise ``ValueError`` /
  ``TypeError`` (``IndexError`` for a dim out of range, as torch) whose message names
  the argument.

Tolerances are :data:`flashfold.testing.TOLERANCES` through ``assert_close``, with its
``scale`` = the magnitude of the terms summed (for attention: ``max |v|`` times the
largest ``scale * sum_d |q_d k_d|`` plus |softcap| and |score_mod bias|, the size of the
scores whose rounding the output inherits; for reductions ``error_scale``).

Size: the profile of ``tests/conftest.py``. CI (default "ci" profile): ``8 x
max_examples`` = 480 cases in all. ``FLASHFOLD_HYPOTHESIS_PROFILE=large
FLASHFOLD_FUZZ_EXAMPLES=N``: N cases in all (>= 10,000 for the recorded run), split over
the tests by the weights below. The last test prints the number of cases each test ran
(and writes them to ``$FLASHFOLD_FUZZ_REPORT`` as JSON when set) and, in the large
profile, checks that the total reached N.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashfold
import flashfold.monoids as M
from flashfold import mods
from flashfold.ops import Buffer
from flashfold.api import attention as api_attention
from flashfold.api import reductions as api_reductions
from flashfold.api.decode import MAX_Q_LEN
from flashfold.api.reductions import LOGSUMEXP2_SCAN
from flashfold.kernels.attention import fwd
from flashfold.kernels.attention.mods import trace_score_mod
from flashfold.kernels.attention.reference import naive_attention
from flashfold.kernels.reduce.reference import error_scale
from flashfold.testing import assert_close

import user_monoids as U
from test_attention_cases import oracle

PROFILE = os.environ.get("FLASHFOLD_HYPOTHESIS_PROFILE", "ci")
LARGE = PROFILE == "large"
#: total cases of the suite: FLASHFOLD_FUZZ_EXAMPLES in the large profile, 8 x the ci
#: profile's max_examples otherwise
TOTAL = settings.default.max_examples if LARGE else 8 * settings.default.max_examples
#: share of TOTAL per test (the invalid-argument share is split over its classes)
WEIGHTS = {"attention": 0.22, "attention_varlen": 0.09, "decode": 0.16, "merge_split": 0.07,
           "merge_states": 0.05, "reduce": 0.12, "segment_reduce": 0.04, "scan": 0.08,
           "kernels": 0.04, "fp8": 0.03, "invalid": 0.10}
COUNTS: Counter = Counter()
STARTED = time.time()

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
#: head dims the attention cases draw (any of 1 .. MAX_HEAD_DIM is valid)
HEAD_DIMS = (3, 8, 20, 32, 64, 80, 96, 128, 192, 256)
INF = math.inf


def fuzz(name: str, share: float | None = None, floor: int = 3):
    """Settings for the test ``name``: ``max_examples`` = its share of TOTAL."""
    n = max(floor, math.ceil(TOTAL * (WEIGHTS[name] if share is None else share)))
    return settings(settings.default, max_examples=n, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


def counted(name: str):
    COUNTS[name] += 1


# --- shared drawing helpers ---------------------------------------------------------------

def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def lengths(lo=0, hi=80):
    """Awkward lengths: 0, 1, primes, powers of two +- 1, anything else."""
    return st.one_of(st.sampled_from([0, 1, 2, 7, 16, 17, 31, 33, 63, 64, 65, 79]),
                     st.integers(lo, hi)).filter(lambda n: lo <= n <= hi)


def layout_tensor(draw, g, shape, dtype, magnitude=1.0, kind=None, allow_expand=True):
    """A tensor of ``shape`` (B, H, N, D) in one of several stride layouts."""
    B, H, N, D = shape
    kinds = ["contiguous", "bnhd", "sliced"] + (["expand_heads", "expand_batch"]
                                                if allow_expand else [])
    kind = kind or draw(st.sampled_from(kinds))
    if kind == "contiguous":
        x = torch.randn(B, H, N, D, generator=g)
    elif kind == "bnhd":                      # (B, S, H, D) storage
        x = torch.randn(B, N, H, D, generator=g).transpose(1, 2)
    elif kind == "sliced":                    # non-unit last stride, offset start
        x = torch.randn(B, H, N + 3, 2 * D, generator=g)[:, :, 2:N + 2, ::2]
    elif kind == "expand_heads":              # stride 0 over heads
        x = torch.randn(B, 1, N, D, generator=g).expand(B, H, N, D)
    else:                                     # stride 0 over batch
        x = torch.randn(1, H, N, D, generator=g).expand(B, H, N, D)
    x = x * magnitude
    return x.to(dtype) if x.dtype != dtype else x


def score_scale(q, k, scale, softcap=None, bias=0.0):
    """``max_ij scale * sum_d |q_id k_jd|`` (+ softcap, + |bias|): the size of the scores."""
    if q.numel() == 0 or k.numel() == 0:
        return 1.0
    g = q.shape[1] // k.shape[1]
    qa = q.double().abs()
    ka = k.double().abs().repeat_interleave(g, dim=1)
    s = float(torch.einsum("bhid,bhjd->bhij", qa, ka).max()) * scale
    return max(1.0, s + (softcap or 0.0) + bias)


def mod_bias(score_mod, B, H, NQ, NK) -> float:
    """max |score_mod(0, b, h, i, j)| over the grid (the bias a score_mod adds)."""
    if score_mod is None or NQ == 0 or NK == 0:
        return 0.0
    fn = trace_score_mod(score_mod).torch_fn("cpu")
    b = torch.arange(B).view(-1, 1, 1, 1)
    h = torch.arange(H).view(1, -1, 1, 1)
    i = torch.arange(NQ).view(1, 1, -1, 1)
    j = torch.arange(NK).view(1, 1, 1, -1)
    out = fn(torch.zeros((), dtype=torch.float64), b, h, i, j)
    return float(torch.as_tensor(out).double().abs().max())


def check_attention(o, lse, ro, rl, q, k, v, kw, name):
    """o, lse against the float64 oracle; empty rows exactly (0, -inf); no NaN."""
    dtype = q.dtype
    assert o.dtype == dtype and lse.dtype == F32, name
    assert tuple(o.shape) == tuple(ro.shape) and tuple(lse.shape) == tuple(rl.shape), name
    assert not torch.isnan(o).any() and not torch.isnan(lse).any(), f"{name}: NaN"
    scale = kw.get("scale") or 1.0 / math.sqrt(q.shape[-1])
    s = score_scale(q, k, scale, kw.get("softcap"),
                    mod_bias(kw.get("score_mod"), q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    vmax = max(1.0, float(v.double().abs().max())) if v.numel() else 1.0
    assert_close(o, ro, kw.get("tolerance_dtype", dtype), scale=vmax * s, name=f"{name}: o")
    assert_close(lse, rl, F32, scale=s, name=f"{name}: lse")
    empty = torch.isinf(rl) & (rl < 0)
    if empty.any():
        assert (o[empty] == 0).all(), f"{name}: a row with no visible key is not 0"


# --- attention ------------------------------------------------------------------------------

MAGNITUDES = {"normal": 1.0, "large": None, "tiny": 1e-3, "zero_q": 0.0}


@st.composite
def attention_case(draw, varlen=False, dtypes=(F32, F64, F16, BF16), head_dims=HEAD_DIMS,
                   max_len=70):
    seed = draw(st.integers(0, 2**31 - 1))
    g = gen(seed)
    dtype = draw(st.sampled_from(dtypes))
    HK = draw(st.integers(1, 3))
    HQ = HK * draw(st.sampled_from([1, 2, 3, 4]))
    D = draw(st.sampled_from(head_dims))
    DV = draw(st.one_of(st.just(D), st.sampled_from(head_dims)))
    if varlen:
        n_seq = draw(st.integers(1, 5))
        lens_q = [draw(lengths(0, min(30, max_len))) for _ in range(n_seq)]
        lens_k = [draw(lengths(0, min(30, max_len))) for _ in range(n_seq)]
        B, NQ, NK = 1, sum(lens_q), sum(lens_k)
    else:
        B, NQ, NK = draw(st.integers(1, 3)), draw(lengths(0, max_len)), draw(lengths(0, max_len))
    mag = draw(st.sampled_from(list(MAGNITUDES)))
    if mag == "large":                        # q.k ~ 1e4 before scaling
        qm = km = 100.0 / D ** 0.25
    else:
        qm, km = (MAGNITUDES[mag], 1.0)
    if dtype == F16:
        qm, km = min(qm, 60.0), min(km, 60.0)
    q = layout_tensor(draw, g, (B, HQ, NQ, D), dtype, qm, allow_expand=not varlen)
    k = layout_tensor(draw, g, (B, HK, NK, D), dtype, km, allow_expand=not varlen)
    v = layout_tensor(draw, g, (B, HK, NK, DV), dtype, draw(st.sampled_from([1.0, 30.0])),
                      allow_expand=not varlen)
    kw = {}
    if draw(st.booleans()):
        kw["causal"] = True
    if draw(st.integers(0, 2)) == 0:
        side = st.one_of(st.none(), st.just(-1), st.integers(0, 12), st.integers(60, 90))
        kw["window"] = (draw(side), draw(side))
    if draw(st.integers(0, 3)) == 0:
        kw["scale"] = draw(st.floats(0.01, 3.0))
    if draw(st.integers(0, 4)) == 0:
        kw["softcap"] = draw(st.floats(0.5, 50.0))
    sm = draw(st.sampled_from(["none", "none", "alibi", "relbias"]))
    if sm == "alibi":
        kw["score_mod"] = mods.alibi(HQ)
    elif sm == "relbias":
        kw["score_mod"] = mods.relative_bias(torch.randn(HQ, 2 * 5 + 1, generator=g))
    n_b = len(lens_q) if varlen else B
    max_k = max(lens_k) if varlen else NK
    max_q = max(lens_q) if varlen else NQ
    mm = draw(st.sampled_from(["none", "none", "padding", "document", "document-recurring",
                               "keep", "prefix", "sliding", "and", "hide_all"]))
    if mm == "padding":
        kw["mask_mod"] = mods.key_padding_mask(
            torch.tensor([draw(st.integers(0, max_k)) for _ in range(n_b)]))
    elif mm == "document":
        n = max(max_q, max_k, 1)
        docs = torch.sort(torch.randint(0, draw(st.integers(1, 5)), (n,), generator=g)).values
        kw["mask_mod"] = mods.document_mask(docs)
    elif mm == "document-recurring":          # ids that recur: no intervals of keys
        n = max(max_q, max_k, 1)
        kw["mask_mod"] = mods.document_mask(torch.randint(0, draw(st.integers(1, 4)), (n,),
                                                          generator=g))
    elif mm == "keep":                        # a keep flag per (sequence, key): a prefix
        n = max(max_k, 1)                     # (one interval) or scattered
        keep = (torch.arange(n)[None, :] < torch.randint(0, n + 1, (n_b, 1), generator=g)
                if draw(st.booleans()) else torch.rand(n_b, n, generator=g) < 0.6)
        table = Buffer(keep)

        def keep_mask(b, h, q_idx, kv_idx):
            return table[b, kv_idx]
        kw["mask_mod"] = keep_mask
    elif mm == "prefix":
        kw["mask_mod"] = mods.prefix_lm_mask(draw(st.integers(0, 10)))
    elif mm == "sliding":
        kw["mask_mod"] = mods.sliding_window_mask(draw(st.integers(0, 9)),
                                                  draw(st.one_of(st.none(), st.integers(0, 4))))
    elif mm == "and":
        kw["mask_mod"] = mods.and_masks(mods.causal_mask, mods.sliding_window_mask(5, None))
    elif mm == "hide_all":
        def hide_all(b, h, q_idx, kv_idx):
            return kv_idx < 0
        kw["mask_mod"] = hide_all
    if varlen:
        cu = lambda ls: torch.tensor([0] + [sum(ls[:i + 1]) for i in range(len(ls))],  # noqa: E731
                                     dtype=torch.int32)
        kw["cu_seqlens_q"], kw["cu_seqlens_k"] = cu(lens_q), cu(lens_k)
    label = (f"{str(dtype)[6:]} B{B} H{HQ}:{HK} q{NQ} k{NK} d{D}/{DV} {mag} "
             f"{sorted(k_ for k_ in kw if not k_.startswith('cu'))} sm={sm} mm={mm}"
             f"{' varlen' if varlen else ''}")
    return q, k, v, kw, label


def run_attention_case(case):
    q, k, v, kw, label = case
    o, lse = flashfold.attention(q, k, v, return_lse=True, **kw)
    ro, rl = oracle(q, k, v, **kw)
    check_attention(o, lse, ro, rl, q, k, v, kw, label)


@fuzz("attention")
@given(attention_case())
def test_attention(case):
    run_attention_case(case)
    counted("attention")


@fuzz("attention_varlen")
@given(attention_case(varlen=True))
def test_attention_varlen(case):
    run_attention_case(case)
    counted("attention_varlen")


# --- decode ---------------------------------------------------------------------------------

@st.composite
def decode_case(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    g = gen(seed)
    dtype = draw(st.sampled_from([F32, F64, F16, BF16]))
    batch, hkv = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    hq = hkv * draw(st.sampled_from([1, 2, 4]))
    q_len = draw(st.integers(1, MAX_Q_LEN))
    d = draw(st.sampled_from([1, 3, 8, 32, 33, 64, 100, 128, 256]))
    paged = draw(st.booleans())
    lens = []
    if paged:
        page = draw(st.sampled_from([1, 2, 3, 8, 16]))
        per_seq = draw(st.integers(1, 6))
        capacity = page * per_seq
        n_pages = batch * per_seq + draw(st.integers(0, 3))
        order = torch.randperm(n_pages, generator=g)[:batch * per_seq]
        table = order.view(batch, per_seq).to(torch.int32)
        k_cache = torch.full((n_pages, page, hkv, d), math.nan)
        v_cache = torch.full((n_pages, page, hkv, d), math.nan)
    else:
        capacity = draw(st.integers(0, 48))
        table = None
        # (batch, L, H, D) storage viewed as (batch, H, L, D) half the time
        if draw(st.booleans()):
            k_cache = torch.full((batch, capacity, hkv, d), math.nan).transpose(1, 2)
            v_cache = torch.full((batch, capacity, hkv, d), math.nan).transpose(1, 2)
        else:
            k_cache = torch.full((batch, hkv, capacity, d), math.nan)
            v_cache = torch.full((batch, hkv, capacity, d), math.nan)
    for b in range(batch):
        lens.append(draw(st.one_of(st.sampled_from([0, min(1, capacity), capacity]),
                                   st.integers(0, capacity))))
    starts = None
    if draw(st.integers(0, 2)) == 0:        # a first key per sequence (left padding)
        starts = [draw(st.one_of(st.sampled_from([0, n, n + 1, -1]), st.integers(0, n)))
                  for n in lens]
    mag = draw(st.sampled_from([1.0, 1.0, 30.0]))
    keys, values = [], []
    for b, n in enumerate(lens):            # write the real tokens; the rest stays NaN
        a = 0 if starts is None else min(max(starts[b], 0), n)
        kb = torch.randn(hkv, n - a, d, generator=g) * mag
        vb = torch.randn(hkv, n - a, d, generator=g)
        keys.append(kb)
        values.append(vb)
        for t in range(n - a):
            t, i = t + a, t
            if paged:
                p, s = int(table[b, t // page]), t % page
                k_cache[p, s] = kb[:, i]
                v_cache[p, s] = vb[:, i]
            else:
                k_cache[b, :, t] = kb[:, i]
                v_cache[b, :, t] = vb[:, i]
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    if draw(st.booleans()):
        q = torch.randn(batch, q_len, hq, d, generator=g).transpose(1, 2) * mag
    else:
        q = torch.randn(batch, hq, q_len, d, generator=g) * mag
    q = q.to(dtype)
    kw = {}
    if draw(st.booleans()):
        kw["window"] = (draw(st.one_of(st.integers(0, 4), st.none(), st.just(-1),
                                       st.integers(0, 40))),
                        draw(st.one_of(st.none(), st.just(-1), st.integers(0, 3))))
    if draw(st.integers(0, 3)) == 0:
        kw["softcap"] = draw(st.floats(0.5, 40.0))
    if draw(st.integers(0, 3)) == 0:
        kw["scale"] = draw(st.floats(0.05, 2.0))
    seqlens = torch.tensor(lens, dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    if starts is not None:
        kw["cache_start"] = torch.tensor(starts, dtype=torch.int32)
    label = (f"{str(dtype)[6:]} b{batch} H{hq}:{hkv} q{q_len} d{d} "
             f"{'paged' + str(page) if paged else 'contiguous'} lens {lens} starts {starts} "
             f"{sorted(kw)}")
    return q, k_cache, v_cache, seqlens, table, keys, values, kw, label


@fuzz("decode")
@given(decode_case())
def test_decode(case):
    q, k_cache, v_cache, seqlens, table, keys, values, kw, label = case
    o, lse = flashfold.decode(q, k_cache, v_cache, seqlens, block_table=table, return_lse=True,
                              **kw)
    window = kw.get("window")
    left = None if window is None or window[0] is None or window[0] < 0 else window[0]
    ro = torch.zeros(q.shape, dtype=F64)
    rl = torch.full(q.shape[:-1], -INF, dtype=F64)
    for b in range(q.shape[0]):
        # the reference reads the rounded cache values of the keys [a_b, n_b), aligned
        # bottom-right like the whole sequence
        kb = keys[b].to(q.dtype)[None]
        vb = values[b].to(q.dtype)[None]
        ob, lb = naive_attention(q[b:b + 1], kb, vb, causal=True, window=(left, None),
                                 scale=kw.get("scale"), softcap=kw.get("softcap"))
        ro[b], rl[b] = ob[0], lb[0]
    vmax = max([1.0] + [float(v.abs().max()) for v in values if v.numel()])
    kcat = [kk for kk in keys if kk.numel()]
    s = 1.0
    if kcat:
        scale = kw.get("scale") or 1.0 / math.sqrt(q.shape[-1])
        s = max(score_scale(q[b:b + 1], keys[b].to(q.dtype)[None], scale, kw.get("softcap"))
                for b in range(q.shape[0]))
    assert o.dtype == q.dtype and lse.dtype == F32 and o.shape == q.shape, label
    assert not torch.isnan(o).any() and not torch.isnan(lse).any(), f"{label}: NaN"
    assert_close(o, ro, q.dtype, scale=vmax * s, name=f"{label}: o")
    assert_close(lse, rl, F32, scale=s, name=f"{label}: lse")
    empty = torch.isinf(rl)
    assert (o[empty] == 0).all(), f"{label}: an empty row is not 0"
    counted("decode")


# --- merge_states -----------------------------------------------------------------------------

@fuzz("merge_split")
@given(st.data())
def test_merge_states_of_a_key_partition(data):
    """Attention over the parts of a random key partition (empty parts, one fully masked
    part), merged stacked and pairwise in a random order = attention over all keys."""
    draw = data.draw
    g = gen(draw(st.integers(0, 2**31 - 1)))
    dtype = draw(st.sampled_from([F32, F64, F16, BF16]))
    B, HK = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    HQ = HK * draw(st.sampled_from([1, 2]))
    NQ, NK = draw(lengths(1, 40)), draw(lengths(0, 60))
    D = draw(st.sampled_from([32, 64, 96]))
    mag = draw(st.sampled_from([1.0, 1.0, 40.0]))
    q = layout_tensor(draw, g, (B, HQ, NQ, D), dtype, mag)
    k = layout_tensor(draw, g, (B, HK, NK, D), dtype, mag)
    v = layout_tensor(draw, g, (B, HK, NK, D), dtype)
    S = draw(st.integers(1, 5))
    owner = torch.randint(0, S, (NK,), generator=g)
    masked = draw(st.integers(-1, S - 1))            # part whose keys a mask hides (-1: none)

    def hide(b, h, q_idx, kv_idx):
        return kv_idx < 0
    outs, lses = [], []
    for s in range(S):
        idx = torch.nonzero(owner == s).reshape(-1)
        kw = {"mask_mod": hide} if s == masked else {}
        o_s, l_s = flashfold.attention(q, k[:, :, idx], v[:, :, idx], return_lse=True, **kw)
        outs.append(o_s)
        lses.append(l_s)
    o, lse = flashfold.merge_states(torch.stack(outs), torch.stack(lses))
    keep = torch.nonzero(owner != masked).reshape(-1)
    ro, rl = naive_attention(q, k[:, :, keep], v[:, :, keep])
    # LSEs are float32 whatever the input dtype (DESIGN.md), so the merge weights, and a
    # float64 merge with them, are exact to float32 rounding: compare in that row
    kw = {"tolerance_dtype": F32 if dtype == F64 else dtype}
    label = f"{str(dtype)[6:]} B{B} H{HQ}:{HK} q{NQ} k{NK} d{D} S{S} masked {masked}"
    check_attention(o, lse, ro, rl, q, k[:, :, keep], v[:, :, keep], kw, f"{label} stacked")
    order = draw(st.permutations(range(S)))
    acc_o, acc_l = outs[order[0]], lses[order[0]]
    for s in order[1:]:
        acc_o, acc_l = flashfold.merge_states(acc_o, acc_l, outs[s], lses[s])
    check_attention(acc_o, acc_l, ro, rl, q, k[:, :, keep], v[:, :, keep], kw,
                    f"{label} pairwise {order}")
    counted("merge_split")


@fuzz("merge_states")
@given(st.data())
def test_merge_states_of_random_states(data):
    """Random parts, LSEs with -inf and +-1e4 offsets, against the float64 formula
    ``lse = log sum_s e^{lse_s}``, ``o = sum_s e^{lse_s - lse} o_s``."""
    draw = data.draw
    g = gen(draw(st.integers(0, 2**31 - 1)))
    dtype = draw(st.sampled_from([F32, F64, F16, BF16]))
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))  # (..., N, D)
    N, D = draw(lengths(0, 20)), draw(st.integers(1, 70))
    S = draw(st.integers(1, 6))
    mag = draw(st.sampled_from([1.0, 50.0]))
    outs = (torch.randn((S,) + lead + (N, D), generator=g) * mag).to(dtype)
    lses = torch.randn((S,) + lead + (N,), generator=g) * draw(st.sampled_from([1.0, 20.0]))
    lses = lses + draw(st.sampled_from([0.0, 1e4, -1e4]))
    lses = torch.where(torch.rand(lses.shape, generator=g) < draw(st.sampled_from([0.0, 0.3, 1.0])),
                       -INF, lses).to(F32)
    o, lse = flashfold.merge_states(outs, lses)
    l64 = lses.double()
    rl = torch.logsumexp(l64, 0)
    w = torch.where(torch.isinf(rl), 0.0, torch.exp(l64 - torch.where(torch.isinf(rl), 0.0, rl)))
    ro = (w.unsqueeze(-1) * outs.double()).sum(0)
    label = f"{str(dtype)[6:]} S{S} lead{lead} N{N} D{D}"
    assert o.dtype == dtype and lse.dtype == F32 and o.shape == outs.shape[1:], label
    omax = max(1.0, float(outs.double().abs().max())) if outs.numel() else 1.0
    finite = l64[torch.isfinite(l64)]
    lmax = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    # the weights e^{lse_s - lse} inherit the rounding of LSEs of size lmax (as attention
    # inherits its scores'): o's scale is max |o_s| x lmax
    assert_close(o, ro, dtype, scale=omax * lmax, name=f"{label}: o")
    assert_close(lse, rl, F32, scale=lmax, name=f"{label}: lse")
    counted("merge_states")


# --- reductions and scans ---------------------------------------------------------------------

REDUCE_MONOIDS = [M.SUM, M.MAX, M.MIN, M.LOGSUMEXP, M.LOGSUMEXP2, M.WELFORD, M.ARGMAX, M.ARGMIN,
                  U.MAX_PREFIX_SUM, U.MINMAX]
SCAN_MONOIDS = [M.SUM, M.MAX, M.MIN, LOGSUMEXP2_SCAN, M.LOGSUMEXP2, M.WELFORD,
                U.MAX_PREFIX_SUM, M.ARGMAX]
EXACT = {"max", "min", "argmax", "argmin", "minmax"}


def finite_only(monoid) -> bool:
    return any(i.domain == "finite" for i in monoid.inputs) or monoid.name in ("sum",)


@st.composite
def reduce_input(draw, monoid, max_rank=4, big=300, dtypes=(F32, F32, F16, BF16), min_rank=0):
    """A float tensor for ``monoid`` in some layout: sizes 0..9 (one dim up to ``big``)."""
    g = gen(draw(st.integers(0, 2**31 - 1)))
    dtype = draw(st.sampled_from(dtypes))
    rank = draw(st.integers(min_rank, max_rank))
    shape = [draw(st.sampled_from([0, 1, 2, 3, 5, 7, 9])) for _ in range(rank)]
    if rank and draw(st.booleans()):
        shape[draw(st.integers(0, rank - 1))] = draw(st.integers(10, big))
    layout = draw(st.sampled_from(["contiguous", "permuted", "sliced", "expanded"]))
    base_shape = list(shape)
    if layout == "sliced" and rank:
        base_shape = [2 * s + 1 for s in shape]
    perm = list(range(rank))
    if layout == "permuted" and rank > 1:
        perm = list(draw(st.permutations(range(rank))))
        base_shape = [shape[p] for p in perm]
    x = torch.randn(base_shape, generator=g) * draw(st.sampled_from([1.0, 1.0, 100.0]))
    if draw(st.booleans()) and monoid.name in EXACT:
        x = torch.round(x * 2) / 2                           # ties: the lowest index wins
    if not finite_only(monoid) and x.numel() and draw(st.integers(0, 3)) == 0:
        x = torch.where(torch.rand(x.shape, generator=g) < 0.4, -INF, x)
        if rank and draw(st.booleans()):
            x.select(0, 0).fill_(-INF)                        # rows that are all -inf
    if layout == "permuted" and rank > 1:                     # same shape, permuted strides
        x = x.permute(*[perm.index(i) for i in range(rank)])
    elif layout == "sliced" and rank:
        x = x[tuple(slice(1, None, 2) for _ in range(rank))]
    elif layout == "expanded" and rank:
        d = draw(st.integers(0, rank - 1))
        x = x.narrow(d, 0, min(1, x.shape[d])).expand(*shape) if x.shape[d] else x
    x = x.to(dtype)
    assert tuple(x.shape) == tuple(shape), (layout, tuple(x.shape), shape)
    return x, layout


def reduced_view(x, dims):
    """``x`` with the kept dims first and the reduced ones flattened last (float64)."""
    kept = [i for i in range(x.dim()) if i not in dims]
    y = x.double().permute(*kept, *dims) if x.dim() else x.double().reshape(1)
    n = math.prod(x.shape[i] for i in dims) if x.dim() else 1
    return y.reshape(*[x.shape[i] for i in kept], n)


def reduce_reference(monoid, y):
    """Float64 results of ``monoid`` over the last dim of ``y`` (torch, independent)."""
    n = y.shape[-1]
    name = monoid.name
    if name == "sum":
        return (y.sum(-1),)
    if name in ("max", "min", "minmax", "argmax", "argmin"):
        if n == 0:
            lo = torch.full(y.shape[:-1], INF, dtype=F64)
            hi = torch.full(y.shape[:-1], -INF, dtype=F64)
            idx = torch.full(y.shape[:-1], M.INDEX_IDENTITY, dtype=torch.int64)
            return {"max": (hi,), "min": (lo,), "minmax": (lo, hi), "argmax": (hi, idx),
                    "argmin": (lo, idx)}[name]
        mx, imx = y.max(-1)
        mn, imn = y.min(-1)
        return {"max": (mx,), "min": (mn,), "minmax": (mn, mx), "argmax": (mx, imx),
                "argmin": (mn, imn)}[name]
    if name in ("logsumexp", "logsumexp2", "logsumexp2_scan"):
        return (torch.logsumexp(y, -1),)
    if name == "welford":
        mean = y.mean(-1) if n else torch.zeros(y.shape[:-1], dtype=F64)
        var = ((y - mean.unsqueeze(-1)) ** 2).sum(-1) / n if n else torch.full(y.shape[:-1], math.nan,
                                                                               dtype=F64)
        return (mean, var)
    if name == "max_prefix_sum":
        if n == 0:
            return (torch.full(y.shape[:-1], -INF, dtype=F64),)
        return (y.cumsum(-1).max(-1).values,)
    raise AssertionError(name)


def check_outputs(monoid, got, want, x, scale, label):
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(want), label
    for i, (o, r) in enumerate(zip(got, want)):
        lab = f"{label} output {i}"
        assert tuple(o.shape) == tuple(r.shape), f"{lab}: shape {tuple(o.shape)} != {tuple(r.shape)}"
        if not r.dtype.is_floating_point:
            assert o.dtype == torch.int64 and torch.equal(o, r), lab
        elif monoid.name in EXACT:
            assert torch.equal(o.double(), r.to(x.dtype).double()), lab
        else:
            assert o.dtype == x.dtype, lab
            # an exact value beyond the output dtype's range (a float16 variance of entries
            # a few hundred apart) is that dtype's +-inf: the output must be inf there
            rounded = r.to(x.dtype)
            r = torch.where(rounded.isinf() & r.isfinite(), rounded.double(), r)
            assert_close(o, r, x.dtype, scale=scale, name=lab)


def scale_of(monoid, y):
    """error_scale over the last dim of the float64 view ``y`` (kept dims' shape)."""
    if y.shape[-1] == 0 or y.numel() == 0:
        return 1.0
    return error_scale(monoid, y, y.dim() - 1).squeeze(-1)


@fuzz("reduce")
@given(st.data())
def test_reduce(data):
    draw = data.draw
    monoid = draw(st.sampled_from(REDUCE_MONOIDS))
    x, layout = draw(reduce_input(monoid))
    rank = x.dim()
    form = draw(st.sampled_from(["int", "tuple", "none"]))
    if rank == 0 or form == "none":
        dim, dims = None, list(range(rank))
    elif form == "int":
        d = draw(st.integers(-rank, rank - 1))
        dim, dims = d, [d % rank]
    else:
        dims = sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1)))
        dim = tuple(draw(st.permutations(dims)))
    keepdim = draw(st.booleans())
    got = flashfold.reduce(monoid, x, dim, keepdim=keepdim)
    y = reduced_view(x, dims)
    want = reduce_reference(monoid, y)
    if keepdim:
        kshape = [1 if i in dims else x.shape[i] for i in range(rank)]
        want = tuple(w.reshape(kshape) for w in want)
    scale = scale_of(monoid, y)
    if keepdim and not isinstance(scale, float):
        scale = scale.reshape([1 if i in dims else x.shape[i] for i in range(rank)])
    check_outputs(monoid, got, want, x, scale,
                  f"reduce {monoid.name} {str(x.dtype)[6:]} {tuple(x.shape)} {layout} dim={dim} "
                  f"keepdim={keepdim}")
    counted("reduce")


@fuzz("segment_reduce")
@given(st.data())
def test_segment_reduce(data):
    """Ragged segments (empty ones too, not covering the whole dim) of any dim."""
    draw = data.draw
    monoid = draw(st.sampled_from([M.SUM, M.MAX, M.LOGSUMEXP2, M.WELFORD, M.ARGMAX]))
    x, layout = draw(reduce_input(monoid, max_rank=3, big=60, min_rank=1))
    d = draw(st.integers(-x.dim(), x.dim() - 1))
    n = x.shape[d]
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=1, max_size=6)))
    offsets = torch.tensor(cuts, dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    got = flashfold.segment_reduce(monoid, x, offsets, d)
    got = got if isinstance(got, tuple) else (got,)
    dd = d % x.dim()
    for j in range(len(cuts) - 1):
        seg = x.narrow(dd, cuts[j], cuts[j + 1] - cuts[j])
        y = reduced_view(seg, [dd])
        want = reduce_reference(monoid, y)
        part = tuple(o.select(dd, j) for o in got)
        check_outputs(monoid, part, want, x, scale_of(monoid, y),
                      f"segment_reduce {monoid.name} {tuple(x.shape)} {layout} dim {d} "
                      f"offsets {cuts} segment {j}")
    counted("segment_reduce")


def scan_reference(monoid, y, reverse):
    """Float64 inclusive scan of ``monoid`` over the last dim of ``y``."""
    name = monoid.name
    if reverse and name not in ("max_prefix_sum", "argmax"):
        return tuple(t.flip(-1) for t in scan_reference(monoid, y.flip(-1), False))
    if y.shape[-1] == 0:
        return tuple(torch.zeros(y.shape, dtype=F64) for _ in monoid.output_names)
    if name == "sum":
        return (y.cumsum(-1),)
    if name == "max":
        return (y.cummax(-1).values,)
    if name == "min":
        return (y.cummin(-1).values,)
    if name in ("logsumexp2", "logsumexp2_scan"):
        return (torch.logcumsumexp(y, -1),)
    if name == "argmax":                      # ties: the lowest index of the range wins
        n = y.shape[-1]
        vals, idx = [None] * n, [None] * n
        best_v = torch.full(y.shape[:-1], -INF, dtype=F64)
        best_i = torch.zeros(y.shape[:-1], dtype=torch.int64)
        for step, i in enumerate(range(n - 1, -1, -1) if reverse else range(n)):
            # forward: a later element wins only if larger; reverse: an earlier one on ties
            better = (y[..., i] >= best_v) if reverse else (y[..., i] > best_v)
            if step == 0:
                better = torch.ones_like(better)
            best_v = torch.where(better, y[..., i], best_v)
            best_i = torch.where(better, torch.full_like(best_i, i), best_i)
            vals[i], idx[i] = best_v, best_i
        return torch.stack(vals, -1), torch.stack(idx, -1)
    if name == "welford":                     # running mean and variance (correction 0)
        n = torch.arange(1, y.shape[-1] + 1, dtype=F64)
        mean = y.cumsum(-1) / n
        return (mean, ((y * y).cumsum(-1) - n * mean * mean).clamp(min=0.0) / n)
    if name == "max_prefix_sum":
        p = y.cumsum(-1)
        if not reverse:
            return (p.cummax(-1).values,)
        # y_i = max_{k >= i} sum(x_i..x_k) = (max_{k >= i} P_k) - P_{i-1}
        suffix_best = p.flip(-1).cummax(-1).values.flip(-1)
        before = torch.cat([torch.zeros(y.shape[:-1] + (1,), dtype=F64), p[..., :-1]], -1)
        return (suffix_best - before,)
    raise AssertionError(name)


def scan_scale(monoid, y, reverse):
    """Per-element scale: the terms accumulated up to each position (sum |x| so far)."""
    if monoid.name in ("sum", "max_prefix_sum"):
        a = y.abs()
        a = torch.where(torch.isfinite(a), a, 0.0)
        c = a.flip(-1).cumsum(-1).flip(-1) if reverse else a.cumsum(-1)
        if monoid.name == "max_prefix_sum":
            c = a.sum(-1, keepdim=True).expand_as(a)
        return torch.clamp(c, min=1.0).numpy()
    a = torch.where(torch.isfinite(y), y.abs(), 0.0)
    big = a.amax(-1, keepdim=True) if a.shape[-1] else torch.zeros(a.shape[:-1] + (1,))
    if monoid.name == "welford":              # error_scale's rule: max |x|^2 n + max |x|
        return torch.clamp(big * big * max(a.shape[-1], 1) + big, min=1.0).expand_as(a).numpy()
    return (1.0 + big).expand_as(a).numpy()


@fuzz("scan")
@given(st.data())
def test_scan(data):
    draw = data.draw
    monoid = draw(st.sampled_from(SCAN_MONOIDS))
    x, layout = draw(reduce_input(monoid, max_rank=3))
    rank = x.dim()
    dim = draw(st.integers(-max(rank, 1), max(rank, 1) - 1))
    reverse = draw(st.booleans())
    got = flashfold.scan(monoid, x, dim, reverse=reverse)
    d = dim % max(rank, 1)
    xt = x.reshape(1) if rank == 0 else x
    y = xt.double().movedim(d, -1)
    want = tuple(w.movedim(-1, d).reshape(x.shape) for w in scan_reference(monoid, y, reverse))
    scale = torch.from_numpy(scan_scale(monoid, y, reverse)).movedim(-1, d).reshape(x.shape)
    check_outputs(monoid, got, want, x, scale.numpy(),
                  f"scan {monoid.name} {str(x.dtype)[6:]} {tuple(x.shape)} {layout} dim={dim} "
                  f"reverse={reverse}")
    counted("scan")


# --- the Triton kernels under the interpreter ---------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter runs on CPU machines")
@fuzz("kernels")
@given(st.data())
def test_kernels_under_the_interpreter(data):
    """The generated reduction / scan kernels and the attention forward kernel on CPU
    tensors (``TRITON_INTERPRET=1``), small sizes, fp32/fp16."""
    draw = data.draw
    what = draw(st.sampled_from(["reduce", "scan", "attention"]))
    if what == "attention":
        case = draw(attention_case(varlen=draw(st.booleans()), dtypes=(F16, F32),
                                   head_dims=(32, 64), max_len=40))
        with mock.patch.object(api_attention, "_use_kernel", lambda t: True), \
                mock.patch.object(fwd, "default_config",
                                  lambda q, d, dv, causal=False: fwd.FwdConfig(16, 16)):
            run_attention_case(case)
    else:
        monoids = [M.SUM, M.MAX, M.LOGSUMEXP2, M.WELFORD, M.ARGMAX, U.MAX_PREFIX_SUM]
        monoid = draw(st.sampled_from(monoids + ([LOGSUMEXP2_SCAN] if what == "scan" else [])))
        x, layout = draw(reduce_input(monoid, max_rank=3, big=130, dtypes=(F32, F16), min_rank=1))
        rank = x.dim()
        d = draw(st.integers(0, rank - 1))
        with mock.patch.object(api_reductions, "_use_kernels", lambda t: True):
            if what == "reduce":
                got = flashfold.reduce(monoid, x, d)
            else:
                reverse = draw(st.booleans())
                got = flashfold.scan(monoid, x, d, reverse=reverse)
        if what == "reduce":
            y = reduced_view(x, [d])
            check_outputs(monoid, got, reduce_reference(monoid, y), x, scale_of(monoid, y),
                          f"kernel reduce {monoid.name} {tuple(x.shape)} {layout} dim {d}")
        else:
            y = x.double().movedim(d, -1)
            want = tuple(w.movedim(-1, d) for w in scan_reference(monoid, y, reverse))
            scale = torch.from_numpy(scan_scale(monoid, y, reverse)).movedim(-1, d)
            check_outputs(monoid, got, want, x, scale.numpy(),
                          f"kernel scan {monoid.name} {tuple(x.shape)} {layout} dim {d} "
                          f"reverse={reverse}")
    counted("kernels")


# --- FP8 attention ---------------------------------------------------------------------------

@fuzz("fp8")
@given(st.data())
def test_fp8_attention(data):
    """FP8 attention (E4M3 q, k, v with per (batch or sequence, KV head) factors from
    ``quantize_fp8``) within the bound E4M3 weights allow, against the float64 attention
    of the dequantized inputs (``tests/test_attention_fp8.py``): the CPU reference, and
    the Triton template's FP8 flag (under the interpreter on CPU machines, small sizes;
    compiled on a GPU). Random GQA, awkward lengths, head dims padded inside the tile, Dv
    != D, causal / windows / softcap, packed sequences with empty ones, magnitudes 1e-3
    to 1e3 per tensor, a few outlier channels."""
    from flashfold.api.fp8 import quantize_fp8
    from test_attention_fp8 import assert_within_e4m3_bound
    draw = data.draw
    gpu = torch.cuda.is_available()
    kernel = gpu or draw(st.booleans())
    hk = draw(st.integers(1, 2))
    hq = hk * draw(st.integers(1, 3))
    d = draw(st.sampled_from([16, 32, 48, 64, 80, 128]))
    dv = draw(st.sampled_from([d, 16, 64]))
    top = 40 if kernel and not gpu else 300
    varlen = draw(st.booleans())
    if varlen:
        n_seq = draw(st.integers(1, 3))
        lq = [draw(st.integers(0, top // 2)) for _ in range(n_seq)]
        lk = [draw(st.integers(0, top // 2)) for _ in range(n_seq)]
        b, nq, nk = 1, sum(lq), sum(lk)
        cq, ck = (torch.tensor([0] + [sum(x[:i + 1]) for i in range(n_seq)], dtype=torch.int32)
                  for x in (lq, lk))
    else:
        b, nq, nk = draw(st.integers(1, 2)), draw(st.integers(1, top)), draw(st.integers(1, top))
        cq = ck = None
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, w, generator=g) * 10.0 ** draw(st.floats(-3, 3))
               for h, n, w in ((hq, nq, d), (hk, nk, d), (hk, nk, dv)))
    if draw(st.booleans()):
        q[..., :2] *= 20.0
        k[..., :2] *= 20.0
    kw = {}
    if draw(st.booleans()):
        kw["causal"] = True
    if draw(st.booleans()):
        kw["window"] = (draw(st.integers(0, 50)), draw(st.integers(0, 50)))
    if draw(st.booleans()):
        kw["softcap"] = draw(st.floats(1.0, 50.0))
    (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(q, hk, cu_seqlens=cq),
                                    quantize_fp8(k, cu_seqlens=ck), quantize_fp8(v, cu_seqlens=ck))
    inputs = (q8, k8, v8, qd, kd, vd)
    dev = "cuda" if gpu else "cpu"
    on = [None if t is None else t.to(dev) for t in (*inputs, cq, ck)]
    with mock.patch.object(api_attention, "_use_kernel", lambda t: kernel):
        o, lse = flashfold.attention(*on[:3], q_descale=on[3], k_descale=on[4],
                                     v_descale=on[5], cu_seqlens_q=on[6], cu_seqlens_k=on[7],
                                     return_lse=True, **kw)
    label = (f"fp8 {'kernel' if kernel else 'reference'} B{b} H{hq}:{hk} q{nq} k{nk} d{d}/{dv} "
             f"{'varlen ' if varlen else ''}{kw} seed {seed}")
    assert_within_e4m3_bound(o.cpu(), lse.cpu(), inputs, (cq, ck), label,
                             tensor_cores=o.is_cuda, **kw)
    counted("fp8")


# --- invalid arguments ---------------------------------------------------------------------------

def _qkv(draw, B=None, HQ=None, HK=None, NQ=None, NK=None, D=None, DV=None, dtype=F32):
    B = B or draw(st.integers(1, 2))
    HK = HK or draw(st.integers(1, 2))
    HQ = HQ or HK * draw(st.integers(1, 2))
    NQ = NQ if NQ is not None else draw(st.integers(1, 9))
    NK = NK if NK is not None else draw(st.integers(1, 9))
    D = D or draw(st.sampled_from([32, 64]))
    DV = DV or D
    return (torch.randn(B, HQ, NQ, D, dtype=dtype), torch.randn(B, HK, NK, D, dtype=dtype),
            torch.randn(B, HK, NK, DV, dtype=dtype))


def _att(draw, **kw):
    q, k, v = _qkv(draw)
    return lambda: flashfold.attention(q, k, v, **kw)


def _varlen(draw, lens_q=(3, 0, 4), lens_k=(2, 5, 1), cu_q=None, cu_k=None, B=1, **kw):
    q, k, v = _qkv(draw, B=B, NQ=sum(lens_q), NK=sum(lens_k))

    def cu(ls):
        return torch.tensor([0] + [sum(ls[:i + 1]) for i in range(len(ls))], dtype=torch.int32)
    cq = cu(lens_q) if cu_q is None else cu_q
    ck = cu(lens_k) if cu_k is None else cu_k
    return lambda: flashfold.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, **kw)


def _dec(draw, q_shape=None, cache_shape=None, lens=None, table=None, dtype=F32,
         cache_dtype=None, lens_dtype=torch.int32, **kw):
    b, hkv, d = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.sampled_from([8, 64]))
    q = torch.randn(*(q_shape or (b, hkv * 2, 1, d)), dtype=dtype)
    cache = torch.randn(*(cache_shape or (b, hkv, 16, d)), dtype=cache_dtype or dtype)
    seqlens = torch.tensor(lens if lens is not None else [5] * b, dtype=lens_dtype)
    return lambda: flashfold.decode(q, cache, cache, seqlens, block_table=table, **kw)


def _paged(draw, table_fn, lens=None):
    b = 2
    kp = torch.randn(6, 4, 2, 32)
    table = table_fn(b)
    seqlens = torch.tensor(lens or [5, 7], dtype=torch.int32)
    q = torch.randn(b, 2, 1, 32)
    return lambda: flashfold.decode(q, kp, kp, seqlens, block_table=table)


def _red(draw, x=None, monoid=M.SUM, dim=-1, fn="reduce", **kw):
    x = torch.randn(3, 5) if x is None else x
    f = {"reduce": flashfold.reduce, "scan": flashfold.scan}[fn]
    return lambda: f(monoid, x, dim, **kw)


def _seg(draw, offsets, x=None, **kw):
    x = torch.randn(7, 3) if x is None else x
    return lambda: flashfold.segment_reduce(M.SUM, x, offsets, 0, **kw)


META = torch.device("meta")
VE, TE = ValueError, TypeError
#: class -> (builder(draw) -> call, expected exception types, text the message must contain)
INVALID = {
    # attention: tensors
    "attention q not a tensor": (lambda d: lambda: flashfold.attention([[1.0]], *_qkv(d)[1:]),
                                 TE, "q"),
    "attention q rank 3": (lambda d: (lambda q, k, v: lambda: flashfold.attention(q[0], k, v))(
        *_qkv(d)), VE, "q"),
    "attention k rank 5": (lambda d: (lambda q, k, v: lambda: flashfold.attention(
        q, k[None], v))(*_qkv(d)), VE, "k"),
    "attention v rank 2": (lambda d: (lambda q, k, v: lambda: flashfold.attention(
        q, k, v[0, 0]))(*_qkv(d)), VE, "v"),
    "attention k dtype mismatch": (lambda d: (lambda q, k, v: lambda: flashfold.attention(
        q, k.double(), v))(*_qkv(d)), TE, "k dtype"),
    "attention v dtype mismatch": (lambda d: (lambda q, k, v: lambda: flashfold.attention(
        q, k, v.half()))(*_qkv(d)), TE, "v dtype"),
    "attention integer dtype": (lambda d: (lambda q, k, v: lambda: flashfold.attention(
        q.int(), k.int(), v.int()))(*_qkv(d)), TE, "q dtype"),
    "attention k on another device": (lambda d: (lambda q, k, v: lambda: flashfold.attention(
        q, k.to(META), v))(*_qkv(d)), VE, "k is on meta"),
    "attention v on another device": (lambda d: (lambda q, k, v: lambda: flashfold.attention(
        q, k, v.to(META)))(*_qkv(d)), VE, "v is on meta"),
    "attention batch mismatch": (lambda d: (lambda q, k, v: lambda: flashfold.attention(
        q, k[:1].expand(3, -1, -1, -1), v))(*_qkv(d, B=2)), VE, "batch"),
    "attention heads not a multiple": (lambda d: (lambda q, k, v: lambda: flashfold.attention(
        q, k, v))(*_qkv(d, HQ=3, HK=2)), VE, "heads"),
    "attention v heads != k heads": (lambda d: (lambda q, k, v: lambda: flashfold.attention(
        q, k, v[:, :1]))(*_qkv(d, HQ=2, HK=2)), VE, "v has 1 heads"),
    "attention k/v seq mismatch": (lambda d: (lambda q, k, v: lambda: flashfold.attention(
        q, k, v[:, :, :-1]))(*_qkv(d, NK=5)), VE, "seq length"),
    "attention q/k head_dim mismatch": (lambda d: (lambda q, k, v: lambda: flashfold.attention(
        q, torch.randn(*k.shape[:3], 64 if q.shape[-1] == 32 else 32), v))(*_qkv(d)), VE,
        "head_dim"),
    "attention empty head_dim": (lambda d: (lambda q, k, v: lambda: flashfold.attention(
        q[..., :0], k[..., :0], v))(*_qkv(d)), VE, "head_dim must be >= 1"),
    "attention empty v head_dim": (lambda d: (lambda q, k, v: lambda: flashfold.attention(
        q, k, v[..., :0]))(*_qkv(d)), VE, "v head_dim must be >= 1"),
    # attention: options
    "attention causal not a bool": (lambda d: _att(d, causal=d(st.sampled_from([1, "yes", None]))),
                                    TE, "causal"),
    "attention return_lse not a bool": (lambda d: _att(d, return_lse=1), TE, "return_lse"),
    "attention window not a pair": (lambda d: _att(d, window=d(st.sampled_from([3, (1, 2, 3), "w"]))),
                                    VE, "window"),
    "attention window side < -1": (lambda d: _att(d, window=(d(st.integers(-50, -2)), 0)), VE,
                                   "window left"),
    "attention window side not an int": (lambda d: _att(d, window=(0, 1.5)), VE, "window right"),
    "attention scale <= 0 or not finite": (lambda d: _att(d, scale=d(st.sampled_from(
        [0.0, -1.0, math.inf, math.nan]))), VE, "scale"),
    "attention scale not a number": (lambda d: _att(d, scale="1"), TE, "scale"),
    "attention softcap <= 0": (lambda d: _att(d, softcap=d(st.sampled_from([0.0, -2.0]))), VE,
                               "softcap"),
    "attention mask_mod not callable": (lambda d: _att(d, mask_mod=3), TE, "mask_mod"),
    "attention score_mod not callable": (lambda d: _att(d, score_mod="alibi"), TE, "score_mod"),
    "attention mask_mod returns two values": (lambda d: _att(
        d, mask_mod=lambda b, h, i, j: (i >= j, i < j)), VE, "mask_mod"),
    # attention: cu_seqlens
    "cu_seqlens only one given": (lambda d: (lambda q, k, v: lambda: flashfold.attention(
        q, k, v, cu_seqlens_q=torch.tensor([0, q.shape[2]], dtype=torch.int32)))(
        *_qkv(d, B=1)), VE, "cu_seqlens_q and cu_seqlens_k"),
    "cu_seqlens wrong dtype": (lambda d: _varlen(d, cu_q=torch.tensor([0, 3, 3, 7], dtype=d(
        st.sampled_from([torch.int64, torch.float32])))), TE, "cu_seqlens_q"),
    "cu_seqlens not starting at 0": (lambda d: _varlen(d, cu_k=torch.tensor(
        [1, 2, 7, 8], dtype=torch.int32)), VE, "cu_seqlens_k"),
    "cu_seqlens non-monotone": (lambda d: _varlen(d, cu_q=torch.tensor(
        [0, 5, 3, 7], dtype=torch.int32)), VE, "cu_seqlens_q must be non-decreasing"),
    "cu_seqlens wrong end": (lambda d: _varlen(d, cu_k=torch.tensor(
        [0, 2, 7, d(st.sampled_from([5, 9]))], dtype=torch.int32)), VE, "cu_seqlens_k"),
    "cu_seqlens 2-D or too short": (lambda d: _varlen(d, cu_q=d(st.sampled_from([
        torch.tensor([[0, 7]], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)]))),
        VE, "cu_seqlens_q"),
    "cu_seqlens sequence counts differ": (lambda d: _varlen(d, lens_q=(3, 4), lens_k=(2, 5, 1)),
                                          VE, "cu_seqlens_q"),
    "cu_seqlens with batch > 1": (lambda d: _varlen(d, B=2), VE, "cu_seqlens"),
    "cu_seqlens on another device": (lambda d: _varlen(d, cu_q=torch.tensor(
        [0, 3, 3, 7], dtype=torch.int32, device=META)), VE, "cu_seqlens_q"),
    # decode
    "decode q rank 3": (lambda d: _dec(d, q_shape=(2, 4, 64)), VE, "q"),
    "decode q_len > 16": (lambda d: _dec(d, q_shape=(1, 2, d(st.integers(17, 40)), 8),
                                         cache_shape=(1, 1, 16, 8), lens=[16]), VE, "q_len"),
    "decode head_dim > 256": (lambda d: _dec(d, q_shape=(1, 2, 1, 300),
                                             cache_shape=(1, 1, 16, 300)), VE, "head_dim"),
    "decode cache dtype mismatch": (lambda d: _dec(d, q_shape=(1, 2, 1, 8), cache_shape=(
        1, 1, 16, 8), lens=[3], cache_dtype=F64), TE, "k_cache"),
    "decode cache on another device": (lambda d: (lambda q: lambda: flashfold.decode(
        q, torch.randn(1, 1, 8, 8, device=META), torch.randn(1, 1, 8, 8, device=META),
        torch.tensor([3], dtype=torch.int32)))(torch.randn(1, 2, 1, 8)), VE, "k_cache"),
    "decode heads not a multiple": (lambda d: _dec(d, q_shape=(1, 3, 1, 8),
                                                   cache_shape=(1, 2, 16, 8), lens=[3]), VE,
                                    "heads"),
    "decode head_dim mismatch": (lambda d: _dec(d, q_shape=(1, 2, 1, 8),
                                                cache_shape=(1, 1, 16, 16), lens=[3]), VE,
                                 "head_dim"),
    "decode batch mismatch": (lambda d: _dec(d, q_shape=(2, 2, 1, 8),
                                             cache_shape=(3, 1, 16, 8), lens=[3, 3]), VE,
                              "k_cache"),
    "decode cache_seqlens float": (lambda d: (lambda q: lambda: flashfold.decode(
        q, torch.randn(1, 1, 8, 8), torch.randn(1, 1, 8, 8), torch.tensor([3.0])))(
        torch.randn(1, 2, 1, 8)), TE, "cache_seqlens"),
    "decode cache_seqlens wrong shape": (lambda d: _dec(d, q_shape=(2, 2, 1, 8),
                                                        cache_shape=(2, 1, 16, 8), lens=[3]),
                                         VE, "cache_seqlens"),
    "decode lengths beyond the capacity": (lambda d: _dec(d, q_shape=(1, 2, 1, 8), cache_shape=(
        1, 1, 16, 8), lens=[d(st.sampled_from([17, 100, -1]))]), VE, "cache_seqlens"),
    "decode block_table int64": (lambda d: _paged(d, lambda b: torch.zeros(b, 2, dtype=torch.int64)),
                                 TE, "block_table"),
    "decode block_table pages out of range": (lambda d: _paged(
        d, lambda b: torch.tensor([[0, 9], [1, 2]], dtype=torch.int32)), VE, "block_table"),
    "decode block_table wrong shape": (lambda d: _paged(
        d, lambda b: torch.zeros(b + 1, 2, dtype=torch.int32)), VE, "block_table"),
    "decode window bad": (lambda d: _dec(d, q_shape=(1, 2, 1, 8), cache_shape=(1, 1, 16, 8),
                                         lens=[3], window=d(st.sampled_from([5, (1, 2, 3), (-3, 0),
                                                                              (1.5, 0)]))),
                          (VE, TE), "window"),
    "decode num_splits bad": (lambda d: _dec(d, q_shape=(1, 2, 1, 8), cache_shape=(1, 1, 16, 8),
                                             lens=[3], num_splits=d(st.sampled_from([0, -2, 70000]))),
                              VE, "num_splits"),
    "decode scale zero or not finite": (lambda d: _dec(d, q_shape=(1, 2, 1, 8), cache_shape=(
        1, 1, 16, 8), lens=[3], scale=d(st.sampled_from([0.0, math.inf, math.nan]))), VE,
        "scale"),
    "decode softcap <= 0": (lambda d: _dec(d, q_shape=(1, 2, 1, 8), cache_shape=(1, 1, 16, 8),
                                           lens=[3], softcap=-1.0), VE, "softcap"),
    "decode cache_start not int32": (lambda d: _dec(d, q_shape=(1, 2, 1, 8), cache_shape=(
        1, 1, 16, 8), lens=[3], cache_start=d(st.sampled_from([
            torch.zeros(1, dtype=torch.int64), torch.zeros(1), [0]]))), TE, "cache_start"),
    "decode cache_start wrong shape or device": (lambda d: _dec(
        d, q_shape=(1, 2, 1, 8), cache_shape=(1, 1, 16, 8), lens=[3], cache_start=d(
            st.sampled_from([torch.zeros(2, dtype=torch.int32), torch.zeros((), dtype=torch.int32),
                             torch.zeros(1, dtype=torch.int32, device=META)]))), VE,
        "cache_start"),
    # merge_states
    "merge_states wrong argument count": (lambda d: (lambda o: lambda: flashfold.merge_states(
        o, o[..., 0], o))(torch.randn(2, 3, 4)), TE, "merge_states"),
    "merge_states shapes differ": (lambda d: (lambda: flashfold.merge_states(
        torch.randn(2, 3, 4), torch.randn(2, 3), torch.randn(2, 5, 4), torch.randn(2, 5))),
        VE, "o_a shape"),
    "merge_states lse shape": (lambda d: (lambda: flashfold.merge_states(
        torch.randn(2, 3, 4), torch.randn(2, 4), torch.randn(2, 3, 4), torch.randn(2, 3))),
        VE, "lse_a"),
    "merge_states dtypes differ": (lambda d: (lambda: flashfold.merge_states(
        torch.randn(2, 3, 4), torch.randn(2, 3), torch.randn(2, 3, 4).double(),
        torch.randn(2, 3))), TE, "dtype"),
    "merge_states integer parts": (lambda d: (lambda: flashfold.merge_states(
        torch.ones(2, 3, 4, dtype=torch.int32), torch.randn(2, 2, 3))), TE, "outs"),
    "merge_states no parts": (lambda d: (lambda: flashfold.merge_states(
        torch.randn(0, 2, 3, 4), torch.randn(0, 2, 3))), VE, "outs"),
    "merge_states lse on another device": (lambda d: (lambda: flashfold.merge_states(
        torch.randn(2, 3, 4), torch.randn(2, 3, device=META), torch.randn(2, 3, 4),
        torch.randn(2, 3))), VE, "lse_a"),
    "merge_states wrong rank": (lambda d: (lambda: flashfold.merge_states(
        torch.randn(4), torch.randn(()), torch.randn(4), torch.randn(()))), VE, "o_a"),
    # reduce / scan / segment_reduce
    "reduce x not a tensor": (lambda d: _red(d, x=[1.0, 2.0]), TE, "x"),
    "reduce integer or float64 x": (lambda d: _red(d, x=d(st.sampled_from([
        torch.ones(3, 2, dtype=torch.int64), torch.randn(3, 2, dtype=F64)]))), TE, "x"),
    "reduce not a monoid": (lambda d: _red(d, monoid=d(st.sampled_from([sum, "sum", None]))),
                            TE, "monoid"),
    "reduce two-input monoid, one tensor": (lambda d: _red(d, monoid=M.ATTENTION), TE,
                                            "x: 'attention' takes 2 inputs"),
    "reduce dim not an int": (lambda d: _red(d, dim=d(st.sampled_from([1.0, "0", [0.5]]))), TE,
                              "dim"),
    "reduce dim twice": (lambda d: _red(d, dim=(1, -1)), VE, "dim"),
    "reduce dim out of range": (lambda d: _red(d, dim=d(st.sampled_from([2, -3, 7]))),
                                IndexError, "dim"),
    "scan dim out of range": (lambda d: _red(d, fn="scan", dim=d(st.sampled_from([2, -3]))),
                              IndexError, "dim"),
    "scan reverse not a bool": (lambda d: _red(d, fn="scan", reverse=1), TE, "reverse"),
    "scan dim not an int": (lambda d: _red(d, fn="scan", dim=(0, 1)), TE, "dim"),
    "var_mean correction not a number": (lambda d: lambda: flashfold.var_mean(
        torch.randn(3, 4), 1, correction="1"), TE, "correction"),
    "softmax dtype not float": (lambda d: lambda: flashfold.softmax(
        torch.randn(3, 4), 1, dtype=torch.int32), TE, "dtype"),
    "segment_reduce offsets non-monotone": (lambda d: _seg(d, torch.tensor(
        d(st.sampled_from([[0, 4, 2], [3, 1], [0, 7, 6, 7]])))), VE, "offsets"),
    "segment_reduce offsets out of range": (lambda d: _seg(d, torch.tensor(
        d(st.sampled_from([[0, 8], [-1, 3]])))), VE, "offsets"),
    "segment_reduce offsets float": (lambda d: _seg(d, torch.tensor([0.0, 3.0])), TE, "offsets"),
    "segment_reduce offsets 2-D": (lambda d: _seg(d, torch.tensor([[0, 3]])), TE, "offsets"),
    "segment_reduce offsets empty": (lambda d: _seg(d, torch.zeros(0, dtype=torch.int64)), VE,
                                     "offsets"),
    "segment_reduce offsets on another device": (lambda d: _seg(d, torch.tensor(
        [0, 3], device=META)), VE, "offsets"),
    "segment_reduce 0-d x": (lambda d: _seg(d, torch.tensor([0, 0]), x=torch.tensor(1.0)), VE,
                             "x"),
}


@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_arguments(name):
    build, exc, needle = INVALID[name]
    per_class = max(2, math.ceil(TOTAL * WEIGHTS["invalid"] / len(INVALID)))

    @fuzz("invalid", floor=per_class, share=0.0)
    @given(st.integers(0, 2**31 - 1), st.data())
    def case(seed, data):
        torch.manual_seed(seed)                   # the values of the valid arguments
        call = build(data.draw)
        with pytest.raises(exc) as e:
            call()
        assert needle in str(e.value), (f"{name}: the message does not name {needle!r}: "
                                        f"{type(e.value).__name__}: {e.value}")
        counted("invalid")

    case()


# --- the count ---------------------------------------------------------------------------------

def test_zz_case_count(request):
    """Print (and record) how many cases ran; in the large profile, check the total."""
    total = sum(COUNTS.values())
    elapsed = time.time() - STARTED
    line = (f"fuzz suite ({PROFILE} profile): {total} cases in {elapsed:.0f} s: "
            + ", ".join(f"{k} {v}" for k, v in sorted(COUNTS.items())))
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line("")
        tr.write_line(line)
    path = os.environ.get("FLASHFOLD_FUZZ_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"profile": PROFILE, "target": TOTAL, "cases": total,
                       "per_test": dict(COUNTS), "seconds": round(elapsed, 1)}, f, indent=1)
    ran_all = len(COUNTS) == len(WEIGHTS) - (1 if torch.cuda.is_available() else 0)
    if LARGE and ran_all:
        assert total >= TOTAL, f"only {total} of {TOTAL} fuzz cases ran"
