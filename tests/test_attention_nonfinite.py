"""The non-finite rule of attention and merge_states (module docstring of
:mod:`flashfold.api.attention`), on the CPU reference, the float64 oracle, the Triton
forward and merge kernels (under ``TRITON_INTERPRET`` on CPU machines) and, marked
``gpu``, the Gluon and Triton forwards at real sizes on CUDA.

1. A key hidden from row ``i`` (out of its sequence, or hidden by causal, window or
   mask_mod) contributes nothing to row ``i``, whatever its ``k`` and ``v`` hold.
2. A NaN or ``+inf`` score of a visible key makes the row's ``o`` (every channel) and
   ``lse`` NaN; a ``-inf`` score is weight 0; ``(o, lse) = (0, -inf)`` only for a row
   whose visible scores are all ``-inf`` (or that sees no key).
3. A non-finite ``v[j, c]`` of a visible key makes ``o[i, c]`` non-finite and nothing else.
5. merge_states: a part with ``lse = -inf`` contributes nothing (its ``o`` may be NaN); a
   NaN ``lse`` makes the merged ``o`` and ``lse`` NaN; a non-finite ``o[c]`` of a part with
   a finite ``lse`` makes the merged ``o[c]`` non-finite.

Non-finite results are compared by finiteness (``torch.isfinite``), not NaN against inf;
finite entries against the float64 oracle with the tolerances of
:data:`flashfold.testing.TOLERANCES`.
"""

from __future__ import annotations

import math
import os
from unittest import mock

import pytest
import torch

import flashfold
from flashfold import mods, ops
from flashfold.api import attention as api
from flashfold.kernels.attention import fwd
from flashfold.kernels.attention.fwd import FwdConfig
from flashfold.kernels.attention.reference import (attention_reference, merge_states_reference,
                                                   naive_attention)
from flashfold.testing import assert_close

from test_attention_cases import lse_scale, oracle, out_scale

NAN, INF = float("nan"), float("inf")
ON_CUDA = torch.cuda.is_available()


def _qkv(B=2, H=2, NQ=40, NK=40, D=32, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, n, D, generator=g).to(dtype).to(device)
                 for n in (NQ, NK, NK))


def _docs(n):
    return torch.tensor([min(i // 13, 2) for i in range(n)])


# --- cases: (id, keyword arguments, poison(q, k, v) in place, expectations) -------------------

def _set(t, idx, value):
    t[idx] = value


#: each case: id, kwargs builder (NQ, NK) -> dict, poison(q, k, v), and the expected
#: pattern as a function of (NQ, NK) -> (o_bad [B, H, NQ, D] bool, lse_bad [B, H, NQ] bool,
#: empty [B, H, NQ] bool) for B = H = 2, D = 32; ``None`` pattern = only compare to the oracle
def _pattern(NQ, D=32, rows=(), channels=None, lse_rows=(), empty_rows=()):
    o_bad = torch.zeros(2, 2, NQ, D, dtype=torch.bool)
    lse_bad = torch.zeros(2, 2, NQ, dtype=torch.bool)
    empty = torch.zeros(2, 2, NQ, dtype=torch.bool)
    for b, h, i in rows:
        if channels is None:
            o_bad[b, h, i] = True
        else:
            o_bad[b, h, i, list(channels)] = True
    for b, h, i in lse_rows:
        lse_bad[b, h, i] = True
    for b, h, i in empty_rows:
        empty[b, h, i] = True
    return o_bad, lse_bad, empty


CASES = {
    # rule 2: a NaN in q_3 is that row's NaN, never an empty row
    "q-nan-row": (lambda: {}, lambda q, k, v: _set(q, (0, 0, 3, 0), NAN),
                  lambda NQ, NK: _pattern(NQ, rows=[(0, 0, 3)], lse_rows=[(0, 0, 3)])),
    # rule 1: rows 0-14 never see key 15
    "v-nan-causal": (lambda: {"causal": True}, lambda q, k, v: _set(v, (0, 0, 15), NAN),
                     lambda NQ, NK: _pattern(NQ, rows=[(0, 0, i) for i in range(15, NQ)])),
    # rule 3: one channel
    "v-nan-channel-causal": (lambda: {"causal": True},
                             lambda q, k, v: _set(v, (0, 1, 20, 5), NAN),
                             lambda NQ, NK: _pattern(NQ, rows=[(0, 1, i) for i in range(20, NQ)],
                                                     channels=[5])),
    "v-inf-visible": (lambda: {}, lambda q, k, v: _set(v, (0, 0, 9, 2), INF),
                      lambda NQ, NK: _pattern(NQ, rows=[(0, 0, i) for i in range(NQ)],
                                              channels=[2])),
    # a NaN key is a NaN score for the rows that see it
    "k-nan-causal": (lambda: {"causal": True}, lambda q, k, v: _set(k, (0, 1, 30, 7), NAN),
                     lambda NQ, NK: _pattern(NQ, rows=[(0, 1, i) for i in range(30, NQ)],
                                             lse_rows=[(0, 1, i) for i in range(30, NQ)])),
    # window (3, 2): key 20 is seen by rows 18 .. 23
    "v-nan-window": (lambda: {"window": (3, 2)}, lambda q, k, v: _set(v, (0, 0, 20), NAN),
                     lambda NQ, NK: _pattern(NQ, rows=[(0, 0, i) for i in range(18, 24)])),
    "k-nan-window": (lambda: {"window": (3, 2)}, lambda q, k, v: _set(k, (0, 1, 20), NAN),
                     lambda NQ, NK: _pattern(NQ, rows=[(0, 1, i) for i in range(18, 24)],
                                             lse_rows=[(0, 1, i) for i in range(18, 24)])),
    # mask_mod: documents 0..12, 13..25, 26..; key 14 is seen by rows of document 1
    "v-nan-document": (lambda: {"mask_mod": mods.document_mask(_docs(40), _docs(40))},
                       lambda q, k, v: _set(v, (0, 0, 14), NAN),
                       lambda NQ, NK: _pattern(NQ, rows=[(0, 0, i) for i in range(13, 26)])),
    # padding keys (beyond each sequence's length) hold garbage: nothing reaches any row
    "key-padding-garbage": (
        lambda: {"mask_mod": mods.key_padding_mask(torch.tensor([29, 17]))},
        lambda q, k, v: (_set(k, (0, slice(None), slice(29, None)), NAN),
                         _set(v, (0, slice(None), slice(29, None)), NAN),
                         _set(k, (1, slice(None), slice(17, None)), INF),
                         _set(v, (1, slice(None), slice(17, None)), NAN)),
        lambda NQ, NK: _pattern(NQ)),
    "key-padding-causal": (
        lambda: {"causal": True, "mask_mod": mods.key_padding_mask(torch.tensor([29, 17]))},
        lambda q, k, v: (_set(v, (0, slice(None), slice(29, None)), NAN),
                         _set(v, (1, slice(None), slice(17, None)), NAN),
                         _set(v, (0, 0, 4), NAN)),
        lambda NQ, NK: _pattern(NQ, rows=[(0, 0, i) for i in range(4, NQ)])),
    # rule 2: a +inf score is NaN too (row 4 sees key 7)
    "score-plus-inf": (
        lambda: {"score_mod": lambda s, b, h, i, j: ops.where((i == 4) & (j == 7), ops.inf, s)},
        lambda q, k, v: None,
        lambda NQ, NK: _pattern(NQ, rows=[(b, h, 4) for b in (0, 1) for h in (0, 1)],
                                lse_rows=[(b, h, 4) for b in (0, 1) for h in (0, 1)])),
    # rule 2 for a row of one key: causal row 0 sees key 0 alone, whose score is +inf
    # (ATTENTION's finalize reads such a state as NaN, as it does a longer row's)
    "score-plus-inf-alone": (
        lambda: {"causal": True,
                 "score_mod": lambda s, b, h, i, j: ops.where((i == 0) & (j == 0), ops.inf, s)},
        lambda q, k, v: None,
        lambda NQ, NK: _pattern(NQ, rows=[(b, h, 0) for b in (0, 1) for h in (0, 1)],
                                lse_rows=[(b, h, 0) for b in (0, 1) for h in (0, 1)])),
    # -inf scores are weight 0; a row whose scores are all -inf is empty, even with NaN q
    "score-minus-inf-row": (
        lambda: {"score_mod": lambda s, b, h, i, j: ops.where(i == 2, -ops.inf, s)},
        lambda q, k, v: _set(q, (0, 1, 2), NAN),
        lambda NQ, NK: _pattern(NQ, empty_rows=[(b, h, 2) for b in (0, 1) for h in (0, 1)])),
    # a score_mod's -inf masks as a mask_mod does: the key's NaN value (and its NaN k,
    # whose score the mod replaces) reaches no row, in the tiles that need no mask too
    "score-minus-inf-masks-value": (
        lambda: {"score_mod": lambda s, b, h, i, j: ops.where(j == 14, -ops.inf, s)},
        lambda q, k, v: _set(v, (0, 0, 14), NAN),
        lambda NQ, NK: _pattern(NQ)),
    "score-minus-inf-masks-causal": (
        lambda: {"causal": True,
                 "score_mod": lambda s, b, h, i, j: ops.where(j == 7, -ops.inf, s)},
        lambda q, k, v: (_set(v, (0, 1, 7), NAN), _set(k, (0, 1, 7), NAN)),
        lambda NQ, NK: _pattern(NQ)),
    # rows that see no key (causal with Nq > Nk) are empty whatever q holds
    "empty-rows-nan-q": (lambda: {"causal": True},
                         lambda q, k, v: _set(q, (0, 0, slice(0, 10)), NAN),
                         None),
}


def _finite_parity(a, e, name):
    fa, fe = torch.isfinite(a), torch.isfinite(e)
    bad = (fa != fe).nonzero()
    assert not bad.numel(), (f"{name}: finiteness differs at {bad[:5].tolist()} "
                             f"(got {a[tuple(bad[0])]}, want {e[tuple(bad[0])]})")


def _check(o, lse, ro, rl, dtype, name, v=None):
    """``(o, lse)`` against the oracle's ``(ro, rl)``: same finiteness and same ``-inf``
    rows, finite entries within the tolerance."""
    _finite_parity(o, ro, f"{name}: o")
    _finite_parity(lse, rl, f"{name}: lse")
    assert torch.equal(lse == -INF, rl == -INF), f"{name}: empty rows differ"
    fo, fl = torch.isfinite(ro), torch.isfinite(rl)
    scale = 1.0 if v is None else max(1.0, float(v[torch.isfinite(v)].abs().max()))
    assert_close(torch.where(fo, o.double(), 0.0), torch.where(fo, ro, 0.0), dtype, scale=scale,
                 name=f"{name}: o")
    assert_close(torch.where(fl, lse.double(), 0.0), torch.where(fl, rl, 0.0), "float32",
                 scale=lse_scale(torch.where(fl, rl, 0.0)), name=f"{name}: lse")


def _inputs(case, dtype, device="cpu"):
    kw_fn, poison, pattern = CASES[case]
    NQ, NK = (40, 30) if case == "empty-rows-nan-q" else (40, 40)
    q, k, v = _qkv(NQ=NQ, NK=NK, dtype=dtype, device=device)
    clean = (q.clone(), k.clone(), v.clone())
    poison(q, k, v)
    return q, k, v, clean, kw_fn(), (pattern(NQ, NK) if pattern is not None else None), NQ, NK


def _assert_pattern(o, lse, pattern, clean_o, clean_lse, dtype, name, NQ, NK, kw):
    o_bad, lse_bad, empty = pattern
    assert torch.equal(~torch.isfinite(o), o_bad), \
        f"{name}: non-finite o at {(~torch.isfinite(o) != o_bad).nonzero()[:5].tolist()}"
    want_lse_bad = lse_bad
    assert torch.equal(torch.isnan(lse), want_lse_bad), f"{name}: NaN lse rows differ"
    if empty.any():
        assert (o[empty] == 0).all() and (lse[empty] == -INF).all(), f"{name}: empty rows"
    # the rows the poison cannot reach are the clean result
    keep = ~o_bad.any(-1) & ~lse_bad & ~empty
    assert_close(o[keep], clean_o[keep], dtype, name=f"{name}: untouched rows o")
    assert_close(lse[keep], clean_lse[keep], "float32", name=f"{name}: untouched rows lse")


# --- the float64 oracle and the CPU reference ----------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_oracle_follows_the_rule(case):
    """The test oracle itself, against the rule stated case by case (not against another
    implementation)."""
    q, k, v, clean, kw, pattern, NQ, NK = _inputs(case, torch.float64)
    o, lse = oracle(q, k, v, **kw)
    if pattern is None:                   # empty rows: 0 and -inf; the rest finite
        assert (o[0, 0, :10] == 0).all() and (lse[0, 0, :10] == -INF).all()
        assert torch.isfinite(o).all() and torch.isfinite(lse[:, :, 10:]).all()
        return
    co, cl = oracle(*clean, **kw)
    _assert_pattern(o, lse, pattern, co, cl, torch.float64, case, NQ, NK, kw)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_attention_follows_the_rule(case, dtype):
    """``flashfold.attention`` on CPU tensors (the blocked reference, 64 x 64 tiles: the
    poisoned keys share tiles with visible ones) against the oracle."""
    q, k, v, clean, kw, pattern, NQ, NK = _inputs(case, dtype)
    o, lse = flashfold.attention(q, k, v, return_lse=True, **kw)
    ro, rl = oracle(q, k, v, **kw)
    _check(o, lse, ro, rl, dtype, case, v)
    if pattern is not None:
        co, cl = oracle(*clean, **kw)
        _assert_pattern(o.double(), lse.double(), pattern, co, cl, dtype, case, NQ, NK, kw)


def test_headline_reproductions_on_cpu():
    """``q[0,0,3,0] = nan`` gives a NaN row (it gave ``o = 0``), and ``v[0,0,15] = nan``
    with causal leaves rows 0-14 finite (they were NaN)."""
    q, k, v = _qkv(B=1, H=1, NQ=32, NK=32)
    q2 = q.clone()
    q2[0, 0, 3, 0] = NAN
    o, lse = flashfold.attention(q2, k, v, return_lse=True)
    assert torch.isnan(o[0, 0, 3]).all() and torch.isnan(lse[0, 0, 3])
    v2 = v.clone()
    v2[0, 0, 15] = NAN
    o = flashfold.attention(q, k, v2, causal=True)
    assert torch.isfinite(o[0, 0, :15]).all() and torch.isnan(o[0, 0, 15:]).all()


@pytest.mark.parametrize("block", [(16, 16), (8, 32), (64, 64)])
def test_blocked_reference_tiles(block):
    """The blocked reference with tiles that split the sequence differently: hidden keys in
    partially visible tiles (causal diagonal, window edges) contribute nothing."""
    q, k, v = _qkv(dtype=torch.float64)
    v[0, 0, 15] = NAN
    k[1, 1, 22] = NAN
    for kw in ({"causal": True}, {"window": (3, 2)}):
        o, lse = attention_reference(q, k, v, block_m=block[0], block_n=block[1], **kw)
        ro, rl = naive_attention(q, k, v, **kw)
        _check(o, lse, ro, rl, torch.float64, f"{kw} {block}", v)


def test_varlen_cpu_sequences_do_not_see_each_other():
    lens = [21, 19]
    q, k, v = (torch.randn(1, 2, 40, 32, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 21, 40], dtype=torch.int32)
    clean = flashfold.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    v[0, 0, 25] = NAN                      # sequence 1, key 4
    k[0, 1, 3] = NAN                       # sequence 0, key 3
    o = flashfold.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    assert torch.isfinite(o[0, 0, :25]).all() and torch.isnan(o[0, 0, 25:]).all()
    assert torch.isfinite(o[0, 1, :3]).all() and torch.isnan(o[0, 1, 3:21]).all()
    assert torch.isfinite(o[0, 1, 21:]).all()
    assert_close(o[0, 0, :25], clean[0, 0, :25], "float64", name="untouched")
    del lens


# --- the Triton forward kernel under the interpreter ---------------------------------------------

needs_interpreter = pytest.mark.skipif(ON_CUDA, reason="interpreter tests run on CPU machines")


@pytest.fixture
def kernel(monkeypatch):
    """Route flashfold.attention / merge_states to the Triton kernels; choose the config."""
    monkeypatch.setattr(api, "_use_kernel", lambda t: True)

    def use(config=FwdConfig(16, 16, use_tma=False)):
        monkeypatch.setattr(fwd, "default_config", lambda q, d, dv, causal=False: config)
    use()
    return use


#: the cases the kernel runs (each kernel run costs seconds under the interpreter)
KERNEL_CASES = ["q-nan-row", "v-nan-causal", "v-nan-channel-causal", "k-nan-causal",
                "v-nan-window", "v-nan-document", "key-padding-garbage", "key-padding-causal",
                "score-plus-inf", "score-plus-inf-alone", "score-minus-inf-row",
                "empty-rows-nan-q", "v-inf-visible", "score-minus-inf-masks-value",
                "score-minus-inf-masks-causal"]


@needs_interpreter
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_forward_follows_the_rule(kernel, case):
    """fp16, 16 x 16 tiles, pointer loads: every poisoned key sits in a masked tile next
    to visible keys."""
    dtype = torch.float16
    q, k, v, clean, kw, pattern, NQ, NK = _inputs(case, dtype)
    q, k, v = (t[:1] for t in (q, k, v))             # batch 1 keeps the interpreter quick
    clean = tuple(t[:1] for t in clean)
    if "mask_mod" in kw and case.startswith("key-padding"):
        kw["mask_mod"] = mods.key_padding_mask(torch.tensor([29]))
    o, lse = flashfold.attention(q, k, v, return_lse=True, **kw)
    ro, rl = oracle(q, k, v, **kw)
    _check(o, lse, ro, rl, dtype, case, v)


@needs_interpreter
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_triton_forward_tma_and_fp32(kernel, tma):
    """fp32 through TMA descriptors and pointers, causal and window, with NaN and inf in
    hidden keys of partially visible tiles."""
    kernel(FwdConfig(16, 32, use_tma=tma))
    q, k, v = _qkv(B=1, NQ=33, NK=40)
    assert fwd.tma_ok(q, k, v)
    v[0, 0, 30] = NAN
    v[0, 1, 12, 3] = INF
    k[0, 1, 25] = NAN
    for kw in ({"causal": True}, {"window": (4, 1)}):
        o, lse = flashfold.attention(q, k, v, return_lse=True, **kw)
        ro, rl = oracle(q, k, v, **kw)
        _check(o, lse, ro, rl, torch.float32, f"{kw} tma={tma}", v)


@needs_interpreter
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_triton_varlen_tails(kernel, tma):
    """Packed sequences: a tile past a sequence's end loads the next sequence's keys (TMA
    reads them; pointers mask them): they contribute nothing."""
    kernel(FwdConfig(16, 16, use_tma=tma))
    q, k, v = (torch.randn(1, 2, 40, 32, dtype=torch.float16) for _ in range(3))
    cu = torch.tensor([0, 21, 40], dtype=torch.int32)
    v[0, :, 21] = NAN                      # the first key of sequence 1 (in seq 0's last tile)
    k[0, 1, 22] = NAN
    for causal in (False, True):
        o, lse = flashfold.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal,
                                     return_lse=True)
        ro, rl = oracle(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal)
        _check(o, lse, ro, rl, torch.float16, f"varlen causal={causal}", v)
        assert torch.isfinite(o[0, :, :21]).all()


@needs_interpreter
def test_triton_block_mask_partial_tiles(kernel):
    """A precomputed BlockMask (PARTIAL tiles evaluate mask_mod, FULL tiles with bounds
    applied): hidden keys inside PARTIAL tiles hold NaN."""
    q, k, v = _qkv(B=1, NQ=40, NK=40, dtype=torch.float16)
    docs = _docs(40)
    mm = mods.and_masks(mods.causal_mask, mods.document_mask(docs))
    bm = flashfold.create_block_mask(mm, None, None, 40, 40, BLOCK_SIZE=16)
    v[0, 0, 12] = NAN                      # document 0's last key
    v[0, 1, 27] = NAN                      # document 2's second key
    o, lse = flashfold.attention(q, k, v, mask_mod=bm, return_lse=True)
    ro, rl = oracle(q, k, v, mask_mod=mm)
    _check(o, lse, ro, rl, torch.float16, "block mask", v)
    assert torch.isfinite(o[0, 0, :12]).all() and torch.isfinite(o[0, 0, 13:]).all()


@needs_interpreter
def test_guard_recomputes_exactly_the_flagged_rows():
    """The guard kernel launched after the Gluon forward on causal calls: each program
    reads the flags of its 64-row groups and returns when they are clear; a set flag
    recomputes that group strictly and overwrites it. Driven here with hand-set flags and
    garbage outputs (the Gluon kernel itself needs a GPU)."""
    q, k, v = _qkv(B=1, H=2, NQ=150, NK=150, dtype=torch.float16)
    v[0, 0, 70] = NAN                      # hidden from rows < 70 of head 0
    o = torch.full((1, 2, 150, 32), 7.0, dtype=torch.float16)
    lse = torch.full((1, 2, 150), 7.0)
    flags = torch.zeros(2 * 3, dtype=torch.int32)     # (bh, 64-row group)
    flags[1] = 1                           # head 0, rows 64 .. 127
    flags[5] = 1                           # head 1, rows 128 .. 149
    launch = fwd.prepare_guard(q, k, v, o, lse, flags, scale=1 / math.sqrt(32), right=0,
                               config=FwdConfig(16, 16, use_tma=False))
    fwd.launcher.launch(*launch)
    ro, rl = naive_attention(q, k, v, causal=True)
    for h, rows in ((0, slice(64, 128)), (1, slice(128, 150))):
        _check(o[:, h, rows], lse[:, h, rows], ro[:, h, rows], rl[:, h, rows],
               torch.float16, f"head {h} rows {rows}", v)
    assert torch.isfinite(o[0, 0, 64:70]).all()
    untouched = torch.ones(1, 2, 150, dtype=torch.bool)
    untouched[0, 0, 64:128] = untouched[0, 1, 128:] = False
    assert (o[untouched] == 7.0).all() and (lse[untouched] == 7.0).all()



@needs_interpreter
def test_guard_reads_packed_flags_by_slot():
    """Packed sequences: the Gluon forward's flags are by slot, ``Nq // 64 + S`` per head,
    sequence ``s``'s 64-row group ``g`` at ``cu[s] // 64 + s + g`` (sized by the packed
    rows, so a CUDA-graph capture, which knows no lengths, needs no more). The guard maps
    a set flag back to its sequence and rows, recomputes exactly those, and skips a set
    empty slot. Lengths 100, 40, 150: head slots 0-1, 2, (3 empty), 4-6."""
    cu = torch.tensor([0, 100, 140, 290], dtype=torch.int32)
    q, k, v = _qkv(B=1, H=2, NQ=290, NK=290, dtype=torch.float16)
    v[0, 0, 140 + 100] = NAN               # sequence 2's key 100: hidden from its rows < 100
    o = torch.full((1, 2, 290, 32), 7.0, dtype=torch.float16)
    lse = torch.full((1, 2, 290), 7.0)
    per_head = 290 // 64 + 3
    assert fwd.flag_count(290, 2, 3, varlen=True) == 2 * per_head
    flags = torch.zeros(2 * per_head, dtype=torch.int32)
    flags[5] = 1                           # head 0, sequence 2, rows 64 .. 127
    flags[per_head + 2] = 1                # head 1, sequence 1, rows 0 .. 39
    flags[per_head + 3] = 1                # head 1, an empty slot: nothing to recompute
    launch = fwd.prepare_guard(q, k, v, o, lse, flags, slots=True, scale=1 / math.sqrt(32),
                               right=0, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=None,
                               max_seqlen_k=None, config=FwdConfig(16, 16, use_tma=False))
    fwd.launcher.launch(*launch)
    recomputed = {(0, 140 + 64, 140 + 128): 2, (1, 100, 140): 1}
    for (h, lo, hi), s in recomputed.items():
        a, b = int(cu[s]), int(cu[s + 1])
        ro, rl = naive_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True)
        rows = slice(lo - a, hi - a)
        _check(o[:, h, lo:hi], lse[:, h, lo:hi], ro[:, h, rows], rl[:, h, rows],
               torch.float16, f"head {h} rows {lo}..{hi}", v)
    assert torch.isfinite(o[0, 0, 140 + 64:140 + 100]).all()
    assert torch.isnan(o[0, 0, 140 + 100:140 + 128]).all()
    untouched = torch.ones(1, 2, 290, dtype=torch.bool)
    untouched[0, 0, 204:268] = untouched[0, 1, 100:140] = False
    assert (o[untouched] == 7.0).all() and (lse[untouched] == 7.0).all()


# --- merge_states ---------------------------------------------------------------------------------

def _merge_parts(dtype=torch.float32):
    """Three parts of shape (1, 2, 4, 32): part 0 empty with a NaN o (row 0), part 1 has a
    NaN lse at row 1 and a NaN o[:, 2] at row 2, part 2 finite."""
    g = torch.Generator().manual_seed(3)
    outs = torch.randn(3, 1, 2, 4, 32, generator=g).to(dtype)
    lses = torch.randn(3, 1, 2, 4, generator=g)
    lses[0, 0, 0, 0] = -INF
    outs[0, 0, 0, 0] = NAN                 # empty part: contributes nothing
    lses[1, 0, 0, 1] = NAN                 # NaN lse: the merged row is NaN
    outs[1, 0, 0, 2, 5] = NAN              # finite lse, NaN channel 5: merged channel 5
    outs[2, 0, 1, 3, 7] = INF
    lses[:, 0, 1, 0] = -INF                # every part empty: o = 0, lse = -inf
    outs[:, 0, 1, 0] = NAN
    return outs, lses


def _check_merge(o, lse, outs, lses):
    assert torch.isfinite(o[0, 0, 0]).all() and torch.isfinite(lse[0, 0, 0])
    want = merge_states_reference(outs[1:, :, :, :1].double(), lses[1:, :, :, :1].double())
    assert_close(o[0, 0, 0], want[0][0, 0, 0], "float32", name="empty part")
    assert torch.isnan(o[0, 0, 1]).all() and torch.isnan(lse[0, 0, 1])
    bad = ~torch.isfinite(o[0, 0, 2])
    assert bad.tolist() == [c == 5 for c in range(32)] and torch.isfinite(lse[0, 0, 2])
    bad = ~torch.isfinite(o[0, 1, 3])
    assert bad.tolist() == [c == 7 for c in range(32)] and torch.isfinite(lse[0, 1, 3])
    assert (o[0, 1, 0] == 0).all() and lse[0, 1, 0] == -INF
    fine = torch.ones(2, 4, dtype=torch.bool)
    fine[0, :3] = fine[1, 3] = fine[1, 0] = False
    assert torch.isfinite(o[0][fine]).all() and torch.isfinite(lse[0][fine]).all()


def test_merge_states_reference_rule():
    outs, lses = _merge_parts()
    o, lse = flashfold.merge_states(outs, lses)
    _check_merge(o, lse, outs, lses)
    o2, l2 = flashfold.merge_states(outs[0], lses[0], outs[1], lses[1])
    assert torch.isnan(o2[0, 0, 1]).all() and torch.isnan(l2[0, 0, 1])
    assert torch.isfinite(o2[0, 0, 0]).all()


@needs_interpreter
def test_merge_kernel_rule(kernel):
    outs, lses = _merge_parts()
    o, lse = flashfold.merge_states(outs, lses)
    _check_merge(o, lse, outs, lses)
    o2, l2 = flashfold.merge_states(outs[0], lses[0], outs[1], lses[1])
    assert torch.isnan(o2[0, 0, 1]).all() and torch.isnan(l2[0, 0, 1])
    assert torch.isfinite(o2[0, 0, 0]).all() and torch.isfinite(l2[0, 0, 0])


def test_monoid_finalize_decides_empty_from_m():
    """ATTENTION's finalize: ``m = -inf`` is the empty row; a NaN ``m`` or ``d`` is NaN."""
    import numpy as np
    from flashfold.monoids import ATTENTION
    out, lse = flashfold.finalize(ATTENTION,
                                  flashfold.fold(ATTENTION,
                                                 (np.array([0.5, NAN, 1.0]), np.ones((3, 4)))))
    assert np.isnan(out).all() and np.isnan(lse)
    out, lse = flashfold.finalize(ATTENTION,
                                  flashfold.fold(ATTENTION,
                                                 (np.array([0.5, INF, 1.0]), np.ones((3, 4)))))
    assert np.isnan(out).all() and np.isnan(lse)
    out, lse = flashfold.finalize(ATTENTION,
                                  flashfold.fold(ATTENTION,
                                                 (np.full(3, -INF), np.full((3, 4), NAN))))
    assert (out == 0).all() and lse == -INF


@pytest.mark.parametrize("name", ["ATTENTION", "ATTENTION2"])
def test_monoid_lone_plus_inf_score_is_nan(name):
    """A ``+inf`` score is NaN also where it meets no other state: a row of one key, the
    first prefix of a scan. (Its lift ``(+inf, 1, v)`` is the one state with ``m = +inf``;
    every combine makes it NaN, so a row ``[+inf, -inf]`` was NaN while ``[+inf]`` gave
    ``(v, +inf)``.)"""
    import numpy as np
    from flashfold import monoids
    monoid = getattr(monoids, name)
    v = np.arange(1.0, 5.0)[None]
    for blocks in (None, [1]):
        out, lse = flashfold.finalize(monoid, flashfold.fold(monoid, (np.array([INF]), v),
                                                             blocks=blocks))
        assert np.isnan(out).all() and np.isnan(lse), (blocks, out, lse)
    s = torch.tensor([[INF], [INF], [1.0]])
    res = flashfold.reduce(monoid, (s, torch.ones(3, 1, 4)), -1)
    assert torch.isnan(res.out[:2]).all() and torch.isnan(res.lse[:2]).all()
    assert (res.out[2] == 1).all() and res.lse[2] == 1.0
    res = flashfold.scan(monoid, (torch.tensor([INF, 0.0]), torch.ones(2, 4)), -1)
    assert torch.isnan(res.out).all() and torch.isnan(res.lse).all()
    res = flashfold.scan(monoid, (torch.tensor([-INF, INF]), torch.ones(2, 4)), -1)
    assert (res.out[0] == 0).all() and res.lse[0] == -INF
    assert torch.isnan(res.out[1]).all() and torch.isnan(res.lse[1])


# --- GPU: the Gluon and Triton forwards at real sizes -------------------------------------------

def _gpu_inputs(B, H, N, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(B, H, N, D, device="cuda", dtype=dtype, generator=g)
                 for _ in range(3))


def _gpu_case(q, k, v, kw, dtype, name, *, gluon):
    from flashfold.kernels.attention import gluon_fwd
    env = {} if gluon else {"FLASHFOLD_GLUON": "0"}
    with mock.patch.dict(os.environ, env), \
            mock.patch.object(gluon_fwd, "gluon_attention_fwd",
                              wraps=gluon_fwd.gluon_attention_fwd) as spy:
        o, lse = flashfold.attention(q, k, v, return_lse=True, **kw)
    assert spy.call_count == (1 if gluon else 0), f"{name}: wrong path"
    ro, rl = oracle(q, k, v, **kw)
    _check(o, lse, ro, rl, dtype, name, v)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("gluon", [True, False], ids=["gluon", "triton"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("N", [1000, 2048])
def test_gpu_causal_hidden_nan(gluon, D, N):
    """Causal at real sizes: NaN and inf in keys hidden inside diagonal tiles reach no row
    that cannot see them; a visible NaN reaches exactly its rows and channels; q NaN rows
    are NaN (lse too)."""
    from flashfold.kernels.attention import gluon_fwd
    if gluon and not gluon_fwd.eligible(*_gpu_inputs(1, 1, 128, D, torch.bfloat16),
                                        causal=True, scale=0.1):
        pytest.skip("the Gluon forward needs an sm_90 GPU")
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = _gpu_inputs(2, 4, N, D, dtype, seed=N + D)
        v[0, 0, 300] = NAN                 # hidden from rows < 300 (diagonal tile of 256..)
        v[1, 2, 517, 3] = INF              # one channel
        k[1, 1, 700] = NAN                 # NaN scores from row 700 on
        q[0, 3, 5, 0] = NAN                # one NaN row
        _gpu_case(q, k, v, {"causal": True}, dtype, f"causal {dtype} d{D} N{N}", gluon=gluon)
        o = flashfold.attention(q, k, v, causal=True)
        assert torch.isfinite(o[0, 0, :300]).all() and torch.isnan(o[0, 0, 300:]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("gluon", [True, False], ids=["gluon", "triton"])
def test_gpu_dense_ragged_and_finite_inputs(gluon):
    """Dense with a ragged last key tile (Nk = 1000, not a multiple of 128): keys past the
    end are never real; finite inputs stay finite and equal the oracle; a visible NaN
    reaches every row."""
    from flashfold.kernels.attention import gluon_fwd
    q, k, v = _gpu_inputs(2, 4, 1000, 128, torch.bfloat16, seed=7)
    if gluon and not gluon_fwd.eligible(q, k, v, scale=0.1):
        pytest.skip("the Gluon forward needs an sm_90 GPU")
    _gpu_case(q, k, v, {}, torch.bfloat16, "dense finite", gluon=gluon)
    _gpu_case(q, k, v, {"causal": True}, torch.bfloat16, "causal finite", gluon=gluon)
    v[1, 1, 999, 0] = NAN
    _gpu_case(q, k, v, {}, torch.bfloat16, "dense visible NaN", gluon=gluon)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("gluon", [True, False], ids=["gluon", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_every_case_follows_the_rule(case, dtype, gluon):
    """Every case above on the GPU (the Gluon forward where it runs the call, and the
    Triton kernels with it off), against the float64 oracle: the same non-finite entries,
    the same empty rows, the finite ones within the dtype's tolerance."""
    q, k, v, _, kw, _, _, _ = _inputs(case, dtype, device="cuda")
    env = {} if gluon else {"FLASHFOLD_GLUON": "0"}
    with mock.patch.dict(os.environ, env):
        o, lse = flashfold.attention(q, k, v, return_lse=True, **kw)
    ro, rl = oracle(q, k, v, **kw)
    _check(o, lse, ro, rl, dtype, case, v)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
def test_gpu_triton_features_hidden_nan():
    """The Triton template on CUDA (TMA): window, mask_mod (document), key padding and
    varlen, each with NaN in keys hidden inside partially visible tiles."""
    q, k, v = _gpu_inputs(2, 4, 1500, 128, torch.bfloat16, seed=3)
    v[:, :, 700] = NAN
    k[:, :, 1200] = NAN
    docs = torch.tensor([min(i // 333, 4) for i in range(1500)], device="cuda")
    cases = [("window", {"window": (256, 0)}),
             ("document", {"mask_mod": mods.document_mask(docs)}),
             # a score_mod's -inf masks the NaN keys, dense and causal
             ("score_mod -inf", {"score_mod": lambda s, b, h, i, j: ops.where(
                 (j == 700) | (j == 1200), -ops.inf, s)}),
             ("score_mod -inf causal", {"causal": True, "score_mod": lambda s, b, h, i, j:
                                        ops.where((j == 700) | (j == 1200), -ops.inf, s)}),
             ("padding", {"causal": True,
                          "mask_mod": mods.key_padding_mask(torch.tensor([650, 1190],
                                                                         device="cuda"))})]
    for name, kw in cases:
        _gpu_case(q, k, v, kw, torch.bfloat16, name, gluon=False)
    qv, kv_, vv = (t[:1] for t in (q, k, v))
    cu = torch.tensor([0, 700, 1500], dtype=torch.int32, device="cuda")
    o = flashfold.attention(qv, kv_, vv, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    ro, _ = oracle(qv, kv_, vv, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    _finite_parity(o, ro, "varlen")
    assert torch.isfinite(o[:, :, :700]).all()


# --- sm_90 compiles (CPU): the flagged forward keeps its registers, the guard compiles ---------

#: (id, head_dim, window) of the flagged Triton forwards and their guards compiled for sm_90
#: (the alibi rows: a score_mod's -inf masks, so mod calls are flagged, dense ones too, and
#: their guard recomputes the tiles that need no mask strictly as well)
COMPILE_VARIANTS = [("d128-causal", 128, (None, 0)), ("d64-causal", 64, (None, 0)),
                    ("d128-window", 128, (256, 0)), ("d128-alibi-dense", 128, (None, None)),
                    ("d128-alibi-causal", 128, (None, 0))]


def _compile_all():
    """Worker: compile each flagged forward and its guard, one JSON line each."""
    import json

    from flashfold.kernels.aot import compile_launch
    from flashfold.kernels.attention.fwd import HOPPER_CONFIGS
    from flashfold.kernels.attention.mods import trace_score_mod

    for vid, D, (left, right) in COMPILE_VARIANTS:
        try:
            bm, bn, w, st = HOPPER_CONFIGS[(D, right is not None)]
            cfg = FwdConfig(bm, bn, w, st, use_tma=True)
            q = torch.empty(1, 4, 1024, D, dtype=torch.bfloat16)
            k = torch.empty(1, 2, 1024, D, dtype=torch.bfloat16)
            opts = dict(scale=D ** -0.5, left=left, right=right)
            if "alibi" in vid:
                opts["score_mod"] = trace_score_mod(mods.alibi(4))
            o, lse, (grid, args, kwargs) = fwd.prepare_forward(
                q, k, k, config=cfg, interpret=False, flagged=True, **opts)
            main = compile_launch(fwd._attn_fwd, args, kwargs)
            kernel, _, gargs, gkw = fwd.prepare_guard(q, k, k, o, lse, args[-1], flag_rows=bm,
                                                      config=cfg, interpret=False, **opts)
            guard = compile_launch(kernel, gargs, gkw)
            row = dict(id=vid, ok=True, regs=main.registers, spill=main.spill_bytes,
                       tma=main.uses_tma, guard_regs=guard.registers)
        except Exception as e:  # reported, then asserted by the test
            row = dict(id=vid, ok=False, error=repr(e)[-2000:])
        print(json.dumps(row), flush=True)


@pytest.fixture(scope="module")
def compiled():
    from compile_worker import worker_rows
    return {r["id"]: r for r in worker_rows(__file__)}


@pytest.mark.parametrize("vid", [v[0] for v in COMPILE_VARIANTS])
def test_flagged_forward_and_guard_compile_for_sm90(compiled, vid):
    """The flag costs the forward no spills (its key loops are unchanged; the flag is one
    reduction of the output tile in the epilogue), and the guard compiles."""
    r = compiled.get(vid)
    assert r is not None and r["ok"], r
    assert r["spill"] == 0, f"{vid}: {r['spill']} bytes of spills ({r['regs']} regs)"
    assert r["tma"]


if __name__ == "__main__":
    _compile_all()
