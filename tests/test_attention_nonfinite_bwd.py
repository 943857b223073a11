"""Rule 4 of the non-finite rule (module docstring of :mod:`flashfold.api.attention`) in the
backward: ``dq_i``, ``dk_j``, ``dv_j`` are non-finite only where they depend, through a
*visible* pair ``(i, j)``, on a non-finite input (q, k, v, dO, dlse); hidden pairs add
exactly 0, NaN-carrying or not, and a row without a visible key adds no gradient.

Yardstick: float64 autograd through :func:`strict_attention`, a naive attention written
here that *selects* hidden pairs away (``torch.where`` on every input before any
arithmetic) rather than multiplying them by zero. For each case, inputs carry NaN / inf at
some positions; the implementation's gradients (fed the yardstick's ``o`` and ``lse``, so
that the backward alone is tested; the end-to-end tests run the forward too) must

* be finite exactly where the yardstick's are (``torch.isfinite``, per element), and
* equal the yardstick's where finite (tolerances of :data:`flashfold.testing.TOLERANCES`),
  which, for NaN inputs, are its gradients of the same inputs with the NaN entries replaced
  by finite ones (checked too: hidden pairs add nothing).

Implementations: the blocked CPU backward (:func:`backward_reference`), the Triton kernels
under the interpreter (fp16 / fp32; every dispatch branch: atomic and deterministic dQ,
pointer and TMA loads, block-mask rows and columns, exact FULL tiles, varlen tails, the
guarded strict recompute that follows the Gluon kernel), and on the GPU (marked ``gpu``)
the Gluon and Triton paths at real sizes.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashfold
from flashfold import mods
from flashfold.kernels.attention import autograd as AG
from flashfold.kernels.attention import bwd
from flashfold.kernels.attention.bwd import BwdConfig
from flashfold.kernels.attention.mods import trace_mask_mod
from flashfold.testing import assert_close

NAN, INF = float("nan"), float("inf")
ON_GPU = torch.cuda.is_available()


# --- the yardstick -----------------------------------------------------------------------------

def visibility(B, H, NQ, NK, *, left=None, right=None, mask=None, cu_q=None, cu_k=None):
    """``[B, H, NQ, NK]`` bool: key ``j`` visible to row ``i`` (same sequence, inside the
    bottom-right aligned window ``[i + d - left, i + d + right]`` with ``d = nk - nq`` of
    the sequence, and ``mask(b, h, i, j)``; ``mask`` a torch function of index tensors)."""
    vis = torch.zeros(B, H, NQ, NK, dtype=torch.bool)
    if cu_q is None:
        segs = [(b, b, 0, NQ, 0, NK) for b in range(B)]
    else:
        cq, ck = cu_q.tolist(), cu_k.tolist()
        segs = [(0, s, cq[s], cq[s + 1], ck[s], ck[s + 1]) for s in range(len(cq) - 1)]
    for b, seq, q0, q1, k0, k1 in segs:
        i = torch.arange(q1 - q0).view(-1, 1)
        j = torch.arange(k1 - k0).view(1, -1)
        d = (k1 - k0) - (q1 - q0)
        ok = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
        if right is not None:
            ok = ok & (j <= i + d + right)
        if left is not None:
            ok = ok & (j >= i + d - left)
        for h in range(H):
            m = ok
            if mask is not None:
                mm = torch.as_tensor(mask(torch.tensor(seq), torch.tensor(h), i, j))
                m = m & (mm.bool() if mm.dtype != torch.bool else mm)
            vis[b, h, q0:q1, k0:k1] = m
    return vis


def strict_attention(q, k, v, vis, scale):
    """``(o, lse)`` in float64, differentiable: hidden pairs are selected away from q, k
    and v before any product, so a hidden NaN reaches neither the outputs nor, through
    autograd, any gradient. A visible NaN / +inf score gives ``lse = NaN``; a row whose
    visible scores are all ``-inf`` (or that has none) gives ``o = 0, lse = -inf``."""
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, 1)
    v = v.repeat_interleave(g, 1)
    m = vis[..., None]
    qs = torch.where(m, q[..., :, None, :], 0.0)
    ks = torch.where(m, k[..., None, :, :], 0.0)
    s = torch.where(vis, (qs * ks).sum(-1) * scale, -INF)
    lse = torch.logsumexp(s, -1)
    lse = torch.where(lse == INF, NAN, lse)
    piv = torch.where(lse == -INF, 0.0, lse)
    p = torch.where(vis, torch.exp(s - piv[..., None]), 0.0)
    vs = torch.where(m, v[..., None, :, :], 0.0)
    return (p[..., None] * vs).sum(-2), lse


def yardstick(q, k, v, do, dlse, vis, scale):
    """``(o, lse, (dq, dk, dv))`` of :func:`strict_attention` in float64."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o, lse = strict_attention(*leaves, vis, scale)
    outs, grads = [o], [do.double()]
    if dlse is not None:
        outs.append(lse)
        grads.append(dlse.double())
    dq, dk, dv = torch.autograd.grad(outs, leaves, grads, allow_unused=True)
    return o.detach(), lse.detach(), (dq, dk, dv)


def _clean(t, where):
    """``t`` with the entries at ``where`` replaced by finite values."""
    return torch.where(where, torch.full_like(t, 0.37), t)


class Case:
    """Inputs with non-finite entries (``poison``: name -> (index, value) list) and their
    clean twins, the visibility of the pairs, and the yardstick's results."""

    def __init__(self, B=1, HQ=2, HK=1, NQ=40, NK=40, D=16, *, left=None, right=None,
                 mask_mod=None, cu=None, poison=(), dlse=False, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.shape = (B, HQ, HK, NQ, NK, D)
        self.scale = 1 / math.sqrt(D)
        self.left, self.right = left, right
        self.mask = trace_mask_mod(mask_mod) if mask_mod is not None else None
        self.cu_q = self.cu_k = None
        if cu is not None:
            self.cu_q = torch.tensor(cu[0], dtype=torch.int32)
            self.cu_k = torch.tensor(cu[1], dtype=torch.int32)
        t = dict(q=torch.randn(B, HQ, NQ, D, generator=g), k=torch.randn(B, HK, NK, D, generator=g),
                 v=torch.randn(B, HK, NK, D, generator=g), do=torch.randn(B, HQ, NQ, D, generator=g))
        t["dlse"] = torch.randn(B, HQ, NQ, generator=g) if dlse else None
        bad = {n: torch.zeros_like(x, dtype=torch.bool) for n, x in t.items() if x is not None}
        self.nan_only = all(math.isnan(val) for entries in dict(poison).values()
                            for _, val in entries)
        for name, entries in dict(poison).items():
            for idx, val in entries:
                t[name][idx] = val
                bad[name][idx] = True
        self.inputs = t
        self.clean = {n: (_clean(x, bad[n]) if x is not None else None) for n, x in t.items()}
        self.vis = visibility(B, HQ, NQ, NK, left=left, right=right,
                              mask=self.mask.torch_fn("cpu") if self.mask is not None else None,
                              cu_q=self.cu_q, cu_k=self.cu_k)
        c, x = self.clean, self.inputs
        self.o, self.lse, self.want = yardstick(x["q"], x["k"], x["v"], x["do"], x["dlse"],
                                                self.vis, self.scale)
        _, _, self.want_clean = yardstick(c["q"], c["k"], c["v"], c["do"], c["dlse"],
                                          self.vis, self.scale)

    def args(self, dtype):
        """``(do, q, k, v, o, lse, dlse)`` in ``dtype`` (stats float32, float64 inputs:
        float64), the non-finite entries kept."""
        x = self.inputs
        sd = torch.float64 if dtype == torch.float64 else torch.float32
        dl = x["dlse"].to(sd) if x["dlse"] is not None else None
        return (x["do"].to(dtype), x["q"].to(dtype), x["k"].to(dtype), x["v"].to(dtype),
                self.o.to(dtype), self.lse.to(sd), dl)

    def check(self, got, dtype, name):
        for n, a, w, c in zip("qkv", got, self.want, self.want_clean):
            assert a.shape == w.shape and a.dtype == dtype, (name, n, a.shape, a.dtype)
            fa, fw = torch.isfinite(a), torch.isfinite(w)
            if not torch.equal(fa, fw):
                where = (fa != fw).nonzero()
                raise AssertionError(
                    f"{name}: d{n} finite at {int((fa & ~fw).sum())} and non-finite at "
                    f"{int((~fa & fw).sum())} elements against the yardstick; first "
                    f"{where[0].tolist()}: got {a[tuple(where[0])].item()}, "
                    f"want {w[tuple(where[0])].item()}")
            if self.nan_only:
                # a visible NaN makes NaN all that depends on it, and the yardstick is
                # strict: its finite gradients are those of the clean inputs (an infinity
                # can give a finite result that depends on it: a score of -inf, weight 0)
                assert_close(torch.where(fw, w, 0.0), torch.where(fw, c, 0.0), "float64",
                             scale=max(1.0, float(c.abs().max())),
                             name=f"{name}: yardstick d{n}")
            assert_close(torch.where(fw, a.double(), 0.0), torch.where(fw, w, 0.0), dtype,
                         scale=max(1.0, float(c.abs().max())), name=f"{name}: d{n}")


def _row(b, h, i):
    return (b, h, i)


#: (id, Case keywords): a NaN / inf that hidden pairs must not carry, for each way a pair
#: is hidden (causal, window, mask_mod, key padding, another sequence), and visible ones that
#: must reach exactly what depends on them
CASES = [
    # the report's case: v of key 15 is NaN; rows 0-14 never see it (causal)
    ("causal-v15", dict(right=0, poison=dict(v=[((0, 0, 15), NAN)]))),
    ("causal-k15", dict(right=0, poison=dict(k=[((0, 0, 15), NAN)]))),
    ("causal-k-inf-channel", dict(right=0, poison=dict(k=[((0, 0, 21, 3), INF)]))),
    ("causal-v-inf-channel", dict(right=0, poison=dict(v=[((0, 0, 9, 5), -INF)]))),
    ("causal-q-row", dict(right=0, poison=dict(q=[((0, 1, 17), NAN)]))),
    ("causal-q-inf-channel", dict(right=0, poison=dict(q=[((0, 0, 6, 2), INF)]))),
    ("causal-do-row", dict(right=0, poison=dict(do=[((0, 0, 3, 7), NAN)]))),
    ("causal-dlse", dict(right=0, dlse=True, poison=dict(dlse=[((0, 1, 12), NAN)]))),
    ("causal-rect-k", dict(NQ=24, NK=40, right=0, poison=dict(k=[((0, 0, 35), NAN)]))),
    ("window-3-2", dict(left=3, right=2, poison=dict(k=[((0, 0, 20), NAN)], v=[((0, 0, 7), NAN)],
                                                   q=[((0, 1, 30), NAN)]))),
    ("window-left-5", dict(left=5, poison=dict(do=[((0, 0, 11), NAN)], v=[((0, 0, 33, 1), INF)]))),
    ("key-padding", dict(B=2, mask_mod=mods.key_padding_mask(torch.tensor([29, 13])),
                         poison=dict(k=[((0, 0, 35), NAN), ((1, 0, 20), INF)],
                                     v=[((0, 0, 30), NAN), ((1, 0, 13, 4), NAN)]))),
    ("document-mask", dict(mask_mod=mods.document_mask(torch.arange(40) // 13),
                           poison=dict(q=[((0, 0, 14), NAN)], k=[((0, 0, 27), NAN)],
                                       do=[((0, 1, 39), NAN)]))),
    # row 0..4 have no visible key (mask): NaN dO there adds nothing
    ("empty-rows", dict(mask_mod=lambda b, h, q, kv: q >= 5,
                        poison=dict(do=[((0, 0, 2), NAN)], q=[((0, 1, 3), NAN)]))),
    ("varlen", dict(B=1, HQ=2, HK=2, NQ=45, NK=50, cu=([0, 21, 45], [0, 19, 50]), right=0,
                    poison=dict(q=[((0, 0, 30), NAN)], k=[((0, 1, 40), NAN)],
                                v=[((0, 0, 25), NAN)], do=[((0, 1, 22), NAN)]))),
]
_CASE_CACHE: dict = {}


def _case(cid) -> Case:
    if cid not in _CASE_CACHE:
        _CASE_CACHE[cid] = Case(**dict(CASES)[cid])
    return _CASE_CACHE[cid]


def test_yardstick_is_strict_and_matches_the_naive_oracle_on_finite_input():
    """On finite input the yardstick is ordinary attention (the suite's float64 oracle)."""
    from test_attention_cases import oracle
    c = Case(right=0, poison=())
    q, k, v = (c.inputs[n].double() for n in "qkv")
    o, lse = oracle(q, k, v, causal=True)
    assert_close(c.o, o, "float64", name="o")
    assert_close(c.lse, lse, "float64", name="lse")


# --- the CPU backward ---------------------------------------------------------------------------

def _reference(c: Case, dtype, block=64):
    do, q, k, v, o, lse, dlse = c.args(dtype)
    return AG.backward_reference(do, q, k, v, o, lse, dlse, scale=c.scale, left=c.left,
                                 right=c.right, mask_mod=c.mask, cu_seqlens_q=c.cu_q,
                                 cu_seqlens_k=c.cu_k, block_m=block, block_n=block)


@pytest.mark.parametrize("cid", [c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_reference_backward_follows_rule_4(cid, dtype):
    c = _case(cid)
    c.check(_reference(c, dtype), dtype, f"reference {cid}")


@pytest.mark.parametrize("cid", ["causal-v15", "causal-q-row", "window-3-2", "varlen"])
def test_reference_backward_small_tiles(cid):
    """Tiles of 16 (partly visible, fully visible and skipped ones)."""
    c = _case(cid)
    c.check(_reference(c, torch.float32, block=16), torch.float32, f"reference {cid} tiles 16")


def test_reference_backward_nan_lse_is_not_an_empty_row():
    """A row whose lse is NaN (a visible NaN score) has NaN gradients where they depend on
    it; before, ``isfinite(lse)`` treated it as a row without keys: zero gradients."""
    c = _case("causal-q-row")
    assert torch.isnan(c.lse[0, 1, 17])
    dq, dk, dv = _reference(c, torch.float64)
    assert torch.isnan(dq[0, 1, 17]).all() and torch.isnan(dv[0, 0, :18]).all()
    assert torch.isfinite(dv[0, 0, 18:]).all()
