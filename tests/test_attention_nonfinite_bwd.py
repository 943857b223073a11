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
from flashfold import mods, ops
from flashfold.api import attention as API
from flashfold.kernels.attention import autograd as AG
from flashfold.kernels.attention import reference as REF
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
    return REF.backward_reference(do, q, k, v, o, lse, dlse, scale=c.scale, left=c.left,
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


# --- the Triton kernels under the interpreter ----------------------------------------------------

interpreter = pytest.mark.skipif(ON_GPU, reason="interpreter tests run on CPU machines")
#: the interpreter's tiles: 16 x 16 (key tiles meet masked and unmasked query tiles)
POINTERS = BwdConfig(16, 16, 4, 1, 16, 16, 4, 1, use_tma=False, atomic_dq=True)
TMA = BwdConfig(16, 16, 4, 1, 16, 16, 4, 1, use_tma=True, atomic_dq=True)


def _nan_alloc(*shape, dtype=None, device=None, **kw):
    return torch.full(*shape, NAN, dtype=dtype, device=device)


def _kernels(c: Case, dtype, monkeypatch, *, config=POINTERS, deterministic=False):
    """``kernel_backward`` (the launcher's dispatch) with ``config``; gradients allocated
    NaN-filled, so an element a kernel fails to write fails the finiteness check."""
    monkeypatch.setattr(bwd, "default_config",
                        lambda q, d, dv, features=False, causal=False: config)
    monkeypatch.setattr(bwd, "_alloc", _nan_alloc)
    do, q, k, v, o, lse, dlse = c.args(dtype)
    return AG.kernel_backward(do, q, k, v, o, lse, dlse, scale=c.scale, softcap=None,
                              left=c.left, right=c.right, score=None, mask=c.mask,
                              block_mask=None, cu_q=c.cu_q, cu_k=c.cu_k,
                              deterministic=deterministic)


@interpreter
@pytest.mark.parametrize("cid", [c[0] for c in CASES])
def test_kernels_follow_rule_4_atomic_dq(cid, monkeypatch):
    c = _case(cid)
    c.check(_kernels(c, torch.float32, monkeypatch), torch.float32, f"kernels {cid}")


@interpreter
@pytest.mark.parametrize("cid", ["causal-v15", "causal-k15", "causal-q-row", "causal-do-row",
                                 "causal-k-inf-channel", "window-3-2", "key-padding", "varlen",
                                 "empty-rows"])
def test_kernels_follow_rule_4_deterministic(cid, monkeypatch):
    """The dK/dV kernel without atomics and the dQ kernel (``deterministic=True``)."""
    c = _case(cid)
    c.check(_kernels(c, torch.float32, monkeypatch, deterministic=True), torch.float32,
            f"kernels {cid} deterministic")


@interpreter
@pytest.mark.parametrize("cid", ["causal-v15", "document-mask"])
def test_kernels_follow_rule_4_fp16(cid, monkeypatch):
    c = _case(cid)
    c.check(_kernels(c, torch.float16, monkeypatch), torch.float16, f"kernels {cid} fp16")


#: varlen calls whose first sequence's last query tile reads (by TMA) rows of the second,
#: NaN there: with and without a mask_mod (whose exact table makes that tile FULL)
VARLEN_TAIL = dict(B=1, HQ=2, HK=2, NQ=45, NK=50, cu=([0, 21, 45], [0, 19, 50]),
                   poison=dict(q=[((0, 0, 26), NAN)], do=[((0, 1, 23), NAN)],
                               k=[((0, 0, 24), NAN)], v=[((0, 1, 27), NAN)]))


@interpreter
@pytest.mark.parametrize("mode", ["atomic", "deterministic"])
@pytest.mark.parametrize("extra", [dict(), dict(right=0), dict(mask_mod=lambda b, h, q, kv: kv != 3)],
                         ids=["dense", "causal", "mask-mod"])
def test_kernels_varlen_tails_read_by_tma_add_nothing(mode, extra):
    """Rows and keys past a sequence's end that TMA reads from the next sequence (NaN
    there) add nothing to the first sequence's gradients."""
    mp = pytest.MonkeyPatch()
    try:
        c = Case(**VARLEN_TAIL, **extra)
        got = _kernels(c, torch.float32, mp, config=TMA, deterministic=mode == "deterministic")
        c.check(got, torch.float32, f"varlen tails {mode} {extra}")
    finally:
        mp.undo()


@interpreter
def test_kernels_precomputed_block_mask_with_conservative_full_tiles(monkeypatch):
    """A user's BlockMask (its FULL tiles masked by the kernels' bounds: ``full_needs_mask``)."""
    from flashfold.kernels.attention.mods import create_block_mask
    c = _case("key-padding")
    bm = create_block_mask(mods.key_padding_mask(torch.tensor([29, 13])), 2, 2, 40, 40,
                           BLOCK_SIZE=16)
    monkeypatch.setattr(bwd, "default_config",
                        lambda q, d, dv, features=False, causal=False: POINTERS)
    do, q, k, v, o, lse, dlse = c.args(torch.float32)
    for det in (False, True):
        got = AG.kernel_backward(do, q, k, v, o, lse, dlse, scale=c.scale, softcap=None,
                                 left=None, right=None, score=None, mask=bm.mod, block_mask=bm,
                                 deterministic=det)
        c.check(got, torch.float32, f"block mask deterministic={det}")


# --- the guarded strict recompute that follows the Gluon kernel (simulated) ----------------------

def _gluon_path(c: Case, dtype, monkeypatch, fake, lse_edit=None):
    """``prepare_backward``'s launches for an sm_90 Gluon call (eligibility mocked), run
    under the interpreter with ``fake(dq_acc, dk, dv)`` in place of the Gluon kernel;
    ``(dq, dk, dv, launches, flag)`` (the flag: the preprocess's last argument)."""
    from flashfold.kernels.attention import gluon_bwd

    def gluon(q, k, v, do, lam, dd, dq_acc, dk, dv, *, causal, left, right, softcap, scale,
              deterministic, launch, cu_seqlens_q=None, cu_seqlens_k=None, score_mod=None,
              block_mask=None):
        assert not deterministic and cu_seqlens_q is None and cu_seqlens_k is None
        assert score_mod is None and block_mask is None
        return ("gluon", (1,), (dq_acc, dk, dv), {})
    monkeypatch.setattr(gluon_bwd, "eligible", lambda *a, **kw: True)
    monkeypatch.setattr(gluon_bwd, "gluon_attention_bwd", gluon)
    do, q, k, v, o, lse, dlse = c.args(dtype)
    if lse_edit is not None:
        lse_edit(lse)
    dq, dk, dv, launches = bwd.prepare_backward(do, q, k, v, o, lse, dlse=dlse, scale=c.scale,
                                                left=c.left, right=c.right, interpret=False)
    flag = launches[0][2][-1]
    if flag is not None:
        flag.fill_(1)                   # garbage: the preprocess clears it
    for kernel, grid, args, kwargs in launches:
        if kernel == "gluon":
            fake(*args)
            continue
        kwargs = dict(kwargs)
        if "INTERPRET" in kwargs:
            kwargs["INTERPRET"] = True
        kernel[grid](*args, **kwargs)
    return dq, dk, dv, launches, flag


@interpreter
@pytest.mark.parametrize("cid", ["causal-v15", "causal-k15", "causal-q-row", "causal-dlse"])
@pytest.mark.parametrize("fault", ["all", "dq"])
def test_gluon_path_recomputes_when_an_output_is_not_finite(cid, fault, monkeypatch):
    """The Gluon kernel (unchanged) leaks like FlashAttention's; every such leak in its
    scope comes with a non-finite dQ accumulator (module comment in ``prepare_backward``),
    which the conversion flags (simulated: the fake writes NaN everywhere, or one NaN into
    the accumulator and finite garbage elsewhere); the guarded Triton kernels then
    recompute dq, dk, dv strictly."""
    def fake(dq_acc, dk, dv):
        if fault == "all":
            dk.fill_(NAN)
            dv.fill_(NAN)
            dq_acc.fill_(NAN)
        else:
            dk.fill_(7.0)
            dv.fill_(7.0)
            dq_acc.fill_(7.0)
            dq_acc[0, 0, 0, 0] = NAN
    c = _case(cid)
    dq, dk, dv, launches, flag = _gluon_path(c, torch.float32, monkeypatch, fake)
    assert flag is not None and int(flag) == 1
    names = [k if isinstance(k, str) else k.fn.__name__ for k, *_ in launches]
    assert names == ["_bwd_preprocess", "gluon", "_dq_convert", "_attn_bwd_dkdv", "_attn_bwd_dq"]
    assert launches[3][3]["STRICT"] and not launches[3][3]["DQ_ATOMIC"] and launches[4][3]["STRICT"]
    c.check((dq, dk, dv), torch.float32, f"gluon path {cid} fault {fault}")


@interpreter
def test_gluon_path_guard_returns_at_once_when_every_output_is_finite(monkeypatch):
    """With finite outputs the flag stays clear (the preprocess cleared the garbage) and the
    guarded kernels write nothing: the (fake) Gluon kernel's outputs stand."""
    def fake(dq_acc, dk, dv):
        dk.fill_(7.0)
        dv.fill_(7.0)
        dq_acc.fill_(7.0)
    c = _case("causal-v15")
    dq, dk, dv, _, flag = _gluon_path(c, torch.float32, monkeypatch, fake)
    assert int(flag) == 0
    assert (dk == 7.0).all() and (dv == 7.0).all()
    assert torch.equal(dq, torch.full_like(dq, 7.0 * c.scale))


@interpreter
def test_gluon_path_flags_rows_without_a_visible_weight(monkeypatch):
    """A row with lse = -inf in the Gluon scope (every row sees a key) has only -inf
    scores, from a non-finite input whose leak need not show in dq: the conversion flags
    it."""
    def fake(dq_acc, dk, dv):
        for t in (dq_acc, dk, dv):
            t.fill_(1.0)
    c = Case(right=0, poison=())
    *_, flag = _gluon_path(c, torch.float32, monkeypatch, fake,
                           lse_edit=lambda lse: lse[0, 1, 9].fill_(-INF))
    assert int(flag) == 1


@interpreter
def test_dense_gluon_calls_need_no_guard(monkeypatch):
    """Every key of a dense call is visible and the tiles past the tensors read zeros: no
    flag, no guarded kernels."""
    c = Case(poison=dict(v=[((0, 0, 15), NAN)]))

    def fake(dq_acc, dk, dv):
        for t in (dq_acc, dk, dv):
            t.fill_(1.0)
    *_, launches, flag = _gluon_path(c, torch.float32, monkeypatch, fake)
    names = [k if isinstance(k, str) else k.fn.__name__ for k, *_ in launches]
    assert flag is None and names == ["_bwd_preprocess", "gluon", "_dq_convert"]


# --- the GPU: the Gluon path (sm_90) and the Triton paths at real sizes ---------------------------

#: (id, Case keywords at real sizes, the backward's keywords): the Gluon path (bf16, d128,
#: causal, default mode; windows, head_dim 96 padded), the deterministic Triton kernels
#: and a mask_mod
GPU_CASES = [
    ("causal-v", dict(NQ=1000, NK=1000, HQ=4, HK=2, D=128, right=0,
                      poison=dict(v=[((0, 1, 700), NAN)])), {}),
    ("causal-k", dict(NQ=1000, NK=1000, HQ=4, HK=2, D=128, right=0,
                      poison=dict(k=[((0, 0, 129), NAN)])), {}),
    ("causal-q-do", dict(NQ=700, NK=1000, HQ=4, HK=2, D=128, right=0,
                         poison=dict(q=[((0, 2, 300), NAN)], do=[((0, 0, 64, 5), NAN)])), {}),
    ("causal-v-det", dict(NQ=1000, NK=1000, HQ=4, HK=2, D=128, right=0,
                          poison=dict(v=[((0, 1, 700), NAN)], q=[((0, 3, 200), NAN)])),
     dict(deterministic=True)),
    ("causal-d64", dict(NQ=1000, NK=1000, HQ=2, HK=2, D=64, right=0,
                        poison=dict(k=[((0, 0, 513), NAN)], do=[((0, 1, 77), NAN)])), {}),
    ("window", dict(NQ=1000, NK=1000, HQ=2, HK=2, D=128, left=100, right=30,
                    poison=dict(k=[((0, 0, 500), NAN)], q=[((0, 1, 250), NAN)])), {}),
    ("window-d96", dict(NQ=1000, NK=1000, HQ=4, HK=2, D=96, left=300, right=0,
                        poison=dict(v=[((0, 1, 290), NAN)], k=[((0, 0, 810), NAN)])), {}),
    ("key-padding", dict(B=2, NQ=600, NK=600, HQ=2, HK=2, D=128,
                         mask_mod=mods.key_padding_mask(torch.tensor([555, 300])),
                         poison=dict(k=[((0, 0, 590), NAN), ((1, 1, 400), NAN)],
                                     v=[((1, 0, 301), INF)])), {}),
]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("cid, case, kw", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_backward_follows_rule_4(cid, case, kw):
    """bf16 on the H200: finiteness exactly as the yardstick's; finite gradients equal the
    same path's gradients of the clean inputs (bf16 tolerances, scale max |clean|)."""
    from flashfold.kernels.attention import gluon_bwd
    from unittest import mock
    c = Case(**case)
    dt = torch.bfloat16

    def run(inputs):
        x = {n: (t.cuda() if t is not None else None) for n, t in inputs.items()}
        o, lse = c.o.cuda().to(dt), c.lse.cuda().float()
        with mock.patch.object(gluon_bwd, "gluon_attention_bwd",
                               wraps=gluon_bwd.gluon_attention_bwd) as spy:
            g = AG.kernel_backward(x["do"].to(dt), x["q"].to(dt), x["k"].to(dt), x["v"].to(dt),
                                   o, lse, x["dlse"], scale=c.scale, softcap=None, left=c.left,
                                   right=c.right, score=None, mask=c.mask, block_mask=None,
                                   **kw)
        return [t.cpu() for t in g], spy.call_count
    got, gluon_calls = run(c.inputs)
    clean, _ = run(c.clean)
    if c.right == 0 and c.left is None and c.mask is None and not kw and gluon_bwd.eligible(
            *(c.inputs[n].cuda().to(dt) for n in ("q", "k", "v", "do")), causal=True):
        assert gluon_calls == 1, "the Gluon path did not run"
    for n, a, w, cl in zip("qkv", got, c.want, clean):
        fa, fw = torch.isfinite(a), torch.isfinite(w)
        assert torch.equal(fa, fw), (f"{cid}: d{n} finite at {int((fa & ~fw).sum())}, "
                                     f"non-finite at {int((~fa & fw).sum())} against the yardstick")
        assert_close(torch.where(fw, a.double(), 0.0), torch.where(fw, cl.double(), 0.0), dt,
                     scale=max(1.0, float(cl.double().abs().max())), name=f"{cid}: d{n}")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_gpu_end_to_end_causal_nan_value_reaches_no_hidden_row():
    """The report's case through ``flashfold.attention`` (forward and backward, bf16, d128,
    causal): ``v[0, 0, 15] = NaN`` leaves o and dq of rows 0-14 finite (needs the
    forward's rules 1-3 too)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 2, 1024, 128, device="cuda", generator=g).to(torch.bfloat16)
               for _ in range(3))
    v[0, 0, 15] = NAN
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = flashfold.attention(*leaves, causal=True)
    o.backward(torch.ones_like(o))
    assert torch.isfinite(o[0, 0, :15]).all() and torch.isnan(o[0, 0, 15:]).all()
    dq, dk, dv = (t.grad for t in leaves)
    assert torch.isfinite(dq[0, 0, :15]).all() and torch.isnan(dq[0, 0, 15:]).all()
    # dV does not depend on v; every key is seen by a row that sees key 15: dK is NaN
    assert torch.isfinite(dv[0, 0]).all() and torch.isnan(dk[0, 0]).all()
    assert all(torch.isfinite(t[0, 1]).all() for t in (dq, dk, dv))


# --- a score_mod's -inf: weight 0, as a mask ------------------------------------------------------

def _grads_via_api(q, k, v, do, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = flashfold.attention(q, k, v, **kw)
    return (o.detach(), *torch.autograd.grad(o, (q, k, v), do))


@pytest.mark.parametrize("path", ["reference", pytest.param("kernels", marks=interpreter)])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_score_mod_minus_inf_masks_a_nan_value(path, causal, monkeypatch):
    """A NaN value of a key that a score_mod scores -inf reaches nothing, forward or
    backward: the outputs and gradients equal those of the mask_mod that hides the key
    with a clean value (dv of the key: exactly 0)."""
    if path == "kernels":
        monkeypatch.setattr(API, "_use_kernel", lambda t: True)
        monkeypatch.setattr(bwd, "default_config",
                            lambda q, d, dv, features=False, causal=False: POINTERS)
    dtype = torch.float32 if path == "reference" else torch.float16
    g = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(1, 2, 40, 16, generator=g).to(dtype) for _ in range(4))
    v_nan, v_clean = v.clone(), v.clone()
    v_nan[0, :, 7], v_clean[0, :, 7] = NAN, 0.0
    got = _grads_via_api(q, k, v_nan, do, causal=causal,
                         score_mod=lambda s, b, h, i, j: ops.where(j == 7, -ops.inf, s))
    want = _grads_via_api(q, k, v_clean, do, causal=causal, mask_mod=lambda b, h, i, j: j != 7)
    for name, a, w in zip(("o", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), f"{path}: {name} not finite"
        assert_close(a, w.double(), dtype, scale=max(1.0, float(w.abs().max())),
                     name=f"{path} {name}")
    assert (got[3][0, :, 7] == 0).all()
