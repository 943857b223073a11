"""Block masks whose rows each see one interval of keys (columns one of queries).

A mask that reads a table per key (``doc[q_idx] == doc[kv_idx]``) costs a load per key
column of every PARTIAL tile that a kernel walking the keys visits (the forward, dQ), and
one per query row where a kernel walks the queries (dK, dV). Where every row's visible keys
form one interval, the block mask carries those intervals (``row_mod``), and where every
column's visible queries do, those (``column_mod``): two compares against two entries read
once per tile (:func:`flashfold.kernels.attention.mods.as_intervals`). Here: both forms
against the user's mask over every pair (with the call's own bounds, windows and packed
lengths), the masks that keep their own form, and the Triton kernels under the
interpreter, forward and backward, against the float64 oracle of the user's mask.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashfold
from flashfold import mods
from flashfold.ops import Buffer
from flashfold.api import attention as api
from flashfold.kernels.attention import bwd, fwd
from flashfold.kernels.attention.bwd import BwdConfig
from flashfold.kernels.attention.fwd import FwdConfig
from flashfold.kernels.attention.mods import (compute_block_mask, create_block_mask,
                                              trace_mask_mod)
from flashfold.testing import assert_close

from test_attention_cases import Shape, lse_scale, make_qkv, oracle, out_scale

B, H, NQ, NK = 2, 3, 45, 70


def _runs(n, sizes, start=0):
    """Document ids over ``n`` positions in runs of ``sizes`` (cycled), from id ``start``."""
    out, i = [], 0
    while len(out) < n:
        out += [start + i] * sizes[i % len(sizes)]
        i += 1
    return torch.tensor(out[:n])


def _keep(lengths, n):
    """A bool keep table ``(len(lengths), n)``: row ``r`` keeps its first ``lengths[r]``."""
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]


def _per_batch_docs():
    ids = torch.stack([_runs(NK, (9, 30, 4)), _runs(NK, (1, 50, 19), start=5)]).int()
    return mods.document_mask(ids[:, :NQ], ids)


def _per_head_keep():
    keep = Buffer(_keep([70, 33, 0], NK))           # head 2 sees no key

    def per_head_keep(b, h, q_idx, kv_idx):
        return keep[h, kv_idx]
    return per_head_keep


#: (name, mask_mod factory, B or None, H or None, columns too): every row one interval
#: of keys; every column one interval of queries where the mask reads a table per query
INTERVAL_MASKS = [
    ("documents", lambda: mods.document_mask(_runs(NQ, (7, 20, 3)), _runs(NK, (11, 30, 2))),
     None, None, True),
    ("documents-causal-int32", lambda: mods.and_masks(
        mods.causal_mask, mods.document_mask(_runs(NK, (5, 16, 1, 40)).int())), None, None,
     True),
    ("documents-per-batch", _per_batch_docs, B, None, True),
    ("keep-per-head-some-empty", _per_head_keep, None, H, False),
    ("documents-per-batch-keep-per-head",
     lambda: mods.and_masks(_per_batch_docs(), _per_head_keep()), B, H, True),
]


def _pairs(mod, b, h, nq, nk):
    """``mod`` (traced) over every ``(b, h, q, kv)``: bool ``(b, h, nq, nk)``."""
    fn = mod.torch_fn("cpu")
    out = fn(torch.arange(b).view(-1, 1, 1, 1), torch.arange(h).view(1, -1, 1, 1),
             torch.arange(nq).view(1, 1, -1, 1), torch.arange(nk).view(1, 1, 1, -1))
    return out.expand(b, h, nq, nk)


@pytest.mark.parametrize("name,make,Bm,Hm,columns", INTERVAL_MASKS,
                         ids=[m[0] for m in INTERVAL_MASKS])
def test_intervals_are_the_mask(name, make, Bm, Hm, columns):
    """Each form of the mask the kernels read shows exactly the user's mask's keys, pair
    by pair, and reads no table per step of its walk."""
    bm = create_block_mask(make(), Bm, Hm, NQ, NK, device="cpu", BLOCK_SIZE=16)
    assert bm.row_mod is not bm.mod and "rows as intervals" in repr(bm)
    assert (bm.column_mod is not bm.mod) == columns == ("columns as intervals" in repr(bm))
    assert bm.mod.reads_at("kv_idx") and not bm.row_mod.reads_at("kv_idx")
    assert not bm.column_mod.reads_at("q_idx")
    want = _pairs(bm.mod, B, H, NQ, NK)
    for form in (bm.row_mod, bm.column_mod):
        got = _pairs(form, B, H, NQ, NK)
        assert torch.equal(got, want), (form.name, int((got != want).sum()))


def test_intervals_with_the_calls_bounds():
    """A callable mask's table for packed lengths and a window (``cached_block_mask``'s
    arguments): where the call's own bounds hold, both forms show the mask's keys."""
    lens_q, lens_k, left, right = [45, 20], [70, 9], 30, 2
    mod = trace_mask_mod(_per_batch_docs())
    bm = compute_block_mask(mod, batch=B, heads=H, q_len=NQ, kv_len=NK, block_m=16,
                            block_n=16, device="cpu", lens_q=lens_q, lens_k=lens_k,
                            left=left, right=right)
    assert bm.row_mod is not mod and bm.column_mod is not mod
    want = _pairs(mod, B, H, NQ, NK)
    q, kv = torch.arange(NQ).view(-1, 1), torch.arange(NK).view(1, -1)
    for form in (bm.row_mod, bm.column_mod):
        got = _pairs(form, B, H, NQ, NK)
        for b in range(B):
            off = lens_k[b] - lens_q[b]                  # bottom-right aligned window
            inside = ((q < lens_q[b]) & (kv < lens_k[b]) & (kv <= q + off + right)
                      & (kv >= q + off - left))
            assert torch.equal(got[b] & inside, want[b] & inside), (form.name, b)


def _other_documents():
    ids = Buffer(_runs(NK, (20, 10, 40)))

    def other_documents(b, h, q_idx, kv_idx):
        return ids[kv_idx] != ids[q_idx]
    return other_documents


#: masks that keep their own form: a key table whose rows are not one interval (a document
#: that recurs; the keys of every document but the query's), and masks that read no table
#: per key (nothing to save, and no read back)
KEPT_MASKS = [
    ("documents-recurring", lambda: mods.document_mask(torch.tensor([0, 1, 2] * 23 + [0]))),
    ("other-documents", _other_documents),
    ("prefix-lm", lambda: mods.prefix_lm_mask(9)),
    ("window", lambda: mods.sliding_window_mask(5, 3)),
]


@pytest.mark.parametrize("name,make", KEPT_MASKS, ids=[m[0] for m in KEPT_MASKS])
def test_masks_that_keep_their_form(name, make):
    bm = create_block_mask(make(), None, None, NQ, NK, device="cpu", BLOCK_SIZE=16)
    assert bm.row_mod is bm.mod and bm.column_mod is bm.mod and "intervals" not in repr(bm)


# --- the kernels (Triton, under the interpreter) ------------------------------------------

# (the 16 x 16 tiles of these tests are the interpreter's; on a GPU machine the compiled
# kernels meet the interval forms in test_attention_gluon.py's block-mask criterion cases,
# whose document masks run as intervals, and in the backward's)
needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter tests run on CPU machines (the GPU runs "
    "the block-mask criterion of tests/test_attention_gluon.py)")


@pytest.fixture
def kernel(monkeypatch):
    """The kernels' dispatch, 16 x 16 tiles, NaN-poisoned gradients."""
    monkeypatch.setattr(api, "_use_kernel", lambda t: True)
    monkeypatch.setattr(fwd, "default_config", lambda q, d, dv, causal=False: FwdConfig(16, 16))
    monkeypatch.setattr(bwd, "_alloc", lambda *s, dtype=None, device=None, **kw:
                        torch.full(*s, float("nan"), dtype=dtype, device=device))
    cfg = BwdConfig(16, 16, 4, 1, 16, 16, 4, 1, use_tma=False, atomic_dq=False)
    monkeypatch.setattr(bwd, "default_config", lambda q, d, dv, features=False, causal=False: cfg)


def _grads(q, k, v, do, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o, lse = flashfold.attention(q, k, v, return_lse=True, **kw)
    return (o, lse), torch.autograd.grad(o, (q, k, v), do)


@needs_interpreter
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kernels_evaluate_the_intervals(kernel, causal):
    """Per-batch documents and per-head keep tables (a head that sees nothing), GQA 3:1:
    o, lse, dq, dk, dv against the oracle of the user's mask; rows without keys 0 / -inf
    with zero gradients."""
    name, make, Bm, Hm, _ = INTERVAL_MASKS[-1]
    mask = make()
    bm = create_block_mask(mask, Bm, Hm, NQ, NK, device="cpu", BLOCK_SIZE=16)
    assert bm.row_mod is not bm.mod and bm.column_mod is not bm.mod
    q, k, v = make_qkv(Shape(B, H, 1, NQ, NK, 32), torch.float16, seed=3)
    do = torch.randn(B, H, NQ, 32, generator=torch.Generator().manual_seed(4)).half()
    (o, lse), got = _grads(q, k, v, do, mask_mod=bm, causal=causal)
    ro, rl = oracle(q, k, v, mask_mod=bm, causal=causal)
    assert_close(o, ro, torch.float16, scale=out_scale(v), name="o")
    assert_close(lse, rl, "float32", scale=lse_scale(rl), name="lse")
    assert (o[:, 2] == 0).all() and (lse[:, 2] == -math.inf).all()
    want = _oracle_grads(q, k, v, do, mask, causal=causal)
    for n, a, b in zip("qkv", got, want):
        assert_close(a, b, torch.float16, scale=max(1.0, float(b.abs().max())), name=f"d{n}")
    assert (got[0][:, 2] == 0).all()


def _oracle_grads(q, k, v, do, mask, **kw):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    return torch.autograd.grad(oracle(q64, k64, v64, mask_mod=mask, **kw)[0],
                               (q64, k64, v64), do.double())


@needs_interpreter
@pytest.mark.parametrize("form", ["row_mod", "column_mod"])
def test_the_kernels_read_each_form(kernel, form):
    """The kernels that walk keys (the forward, dQ) read ``row_mod``, those that walk
    queries (dK, dV) ``column_mod``: replaced by a mask that shows every key, the form
    makes its kernels' outputs wrong and leaves the others right (so the test above checks
    the intervals, not the user's mask)."""
    name, make, Bm, Hm, _ = INTERVAL_MASKS[0]
    mask = make()
    bm = create_block_mask(mask, Bm, Hm, NQ, NK, device="cpu", BLOCK_SIZE=16)
    setattr(bm, form, trace_mask_mod(lambda b, h, q_idx, kv_idx: kv_idx >= 0))
    q, k, v = make_qkv(Shape(1, 2, 2, NQ, NK, 32), torch.float16, seed=5)
    do = torch.randn(1, 2, NQ, 32, generator=torch.Generator().manual_seed(6)).half()
    (o, _), got = _grads(q, k, v, do, mask_mod=bm)
    want = [oracle(q, k, v, mask_mod=mask)[0], *_oracle_grads(q, k, v, do, mask)]
    wrong = {"row_mod": "oqkv", "column_mod": "kv"}[form]    # dq from the forward's P too
    for n, a, b in zip("oqkv", [o, *got], want):
        check = lambda: assert_close(a, b, torch.float16,  # noqa: E731
                                     scale=max(1.0, float(b.abs().max())), name=n)
        if n in wrong:
            with pytest.raises(AssertionError):
                check()
        else:
            check()
