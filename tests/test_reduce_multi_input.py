"""reduce / scan / segment_reduce of monoids with several inputs (a tuple of tensors,
broadcast to one shape), on CPU tensors, against float64 closed forms."""

import pytest
import torch

import flashfold as ff
from flashfold import Input, Monoid
from flashfold.api import reductions as R
from flashfold.testing import assert_close

#: a weighted mean over (w, x)
WMEAN = Monoid("wmean_test", fields=("sw", "swx"), identity=(0.0, 0.0),
               inputs=(Input("w"), Input("x")), lift=lambda w, x: (w, w * x),
               combine=lambda a, b: (a.sw + b.sw, a.swx + b.swx),
               finalize=lambda s: s.swx / s.sw, commutative=True)

#: h_t = a_t h_{t-1} + b_t from h_{-1} = 0: affine maps composed in order (l earlier)
LINREC = Monoid("linrec_test", fields=("A", "B"), identity=(1.0, 0.0),
                inputs=(Input("a"), Input("b")), lift=lambda a, b: (a, b),
                combine=lambda l, r: (l.A * r.A, r.A * l.B + r.B),
                finalize=lambda s: s.B, commutative=False)


def _recurrence(a, b, reverse=False):
    """float64 loop along the last dim; ``reverse``: ``h_t = a_t h_{t+1} + b_t``... in the
    scan's order: the suffix state ``x_t ⊕ ... ⊕ x_{N-1}`` applied to 0."""
    a, b = a.double(), b.double()
    n = a.shape[-1]
    out = torch.empty_like(a)
    if not reverse:
        h = torch.zeros(a.shape[:-1], dtype=torch.float64)
        for t in range(n):
            h = a[..., t] * h + b[..., t]
            out[..., t] = h
        return out
    for t in range(n):          # suffix composition: apply maps t, t+1, ..., n-1 to 0
        h = torch.zeros(a.shape[:-1], dtype=torch.float64)
        for u in range(t, n):
            h = a[..., u] * h + b[..., u]
        out[..., t] = h
    return out


def test_weighted_mean_reduce_dims_keepdim_and_broadcast():
    g = torch.Generator().manual_seed(0)
    w = torch.rand(4, 1, 33, generator=g)            # broadcast over the middle dim
    x = torch.randn(4, 3, 33, generator=g)
    wb = w.expand_as(x).double()
    want = (wb * x.double()).sum(-1) / wb.sum(-1)
    got = ff.reduce(WMEAN, (w, x), dim=-1)
    assert got.shape == (4, 3) and got.dtype == torch.float32
    assert_close(got, want, "float32", scale=(wb * x.double().abs()).sum(-1) / wb.sum(-1) + 1)
    got = ff.reduce(WMEAN, (w, x), dim=(0, 2), keepdim=True)
    want = (wb * x.double()).sum((0, 2), keepdim=True) / wb.sum((0, 2), keepdim=True)
    assert got.shape == (1, 3, 1)
    assert_close(got, want, "float32", scale=2.0)


def test_outputs_take_the_promoted_dtype():
    w = torch.rand(2, 8, dtype=torch.bfloat16)
    x = torch.randn(2, 8)
    assert ff.reduce(WMEAN, (w, x), dim=1).dtype == torch.float32
    assert ff.reduce(WMEAN, (w, x.bfloat16()), dim=1).dtype == torch.bfloat16


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_linear_recurrence_scan_keeps_order(reverse):
    g = torch.Generator().manual_seed(1)
    a = torch.rand(3, 40, generator=g) * 1.5          # some |a| > 1: order matters
    b = torch.randn(3, 40, generator=g)
    got = ff.scan(LINREC, (a, b), dim=1, reverse=reverse)
    want = _recurrence(a, b, reverse)
    scale = 1.0 + _recurrence(a.abs(), b.abs(), reverse)
    assert_close(got, want, "float32", scale=scale)
    # the same recurrence along dim 0 of the transposes
    got0 = ff.scan(LINREC, (a.T, b.T), dim=0, reverse=reverse)
    assert_close(got0, want.T, "float32", scale=scale.T)


def test_linear_recurrence_reduce_is_the_last_state_and_order_matters():
    g = torch.Generator().manual_seed(2)
    a = torch.rand(5, 17, generator=g) * 1.5
    b = torch.randn(5, 17, generator=g)
    want = _recurrence(a, b)[:, -1]
    assert_close(ff.reduce(LINREC, (a, b), dim=1), want, "float32",
                 scale=1.0 + _recurrence(a.abs(), b.abs())[:, -1])
    flipped = ff.reduce(LINREC, (a.flip(1), b.flip(1)), dim=1)
    assert not torch.allclose(flipped, want.float(), atol=1e-3)


def test_segments_of_two_inputs():
    g = torch.Generator().manual_seed(3)
    w = torch.rand(20, 4, generator=g)
    x = torch.randn(20, 4, generator=g)
    offs = torch.tensor([0, 3, 3, 11, 20])
    got = ff.segment_reduce(WMEAN, (w, x), offs, 0)
    assert got.shape == (4, 4)
    for j, (lo, hi) in enumerate(zip(offs[:-1].tolist(), offs[1:].tolist())):
        ws, xs = w[lo:hi].double(), x[lo:hi].double()
        want = (ws * xs).sum(0) / ws.sum(0)           # the empty segment: 0 / 0 = NaN
        assert_close(got[j], want, "float32", scale=2.0)
    assert torch.isnan(got[1]).all()


def test_meta_inputs_give_meta_outputs():
    w, x = torch.empty(3, 5, device="meta"), torch.empty(1, 5, device="meta")
    out = ff.reduce(WMEAN, (w, x), dim=1)
    assert out.is_meta and out.shape == (3,)
    assert ff.scan(LINREC, (w, x), dim=1).shape == (3, 5)


def test_bad_input_names_the_argument(monkeypatch):
    w, x = torch.rand(3, 5), torch.randn(3, 5)
    with pytest.raises(TypeError, match="monoid: expected a flashfold Monoid, got NoneType"):
        ff.reduce(None, w, dim=1)        # (id(None) is no key of the checked-monoid cache)
    with pytest.raises(TypeError, match=r"x: 'wmean_test' takes 2 inputs \['w', 'x'\]"):
        ff.reduce(WMEAN, w, dim=1)
    with pytest.raises(ValueError, match="got a tuple of 3"):
        ff.reduce(WMEAN, (w, x, x), dim=1)
    with pytest.raises(ValueError, match="do not broadcast"):
        ff.reduce(WMEAN, (w, torch.randn(4, 5)), dim=1)
    with pytest.raises(TypeError, match=r"x\[1\] \(b\)"):
        ff.scan(LINREC, (w, torch.arange(5)), dim=1)
    with pytest.raises(ValueError, match=r"x\[1\] \(x\) is on meta"):
        ff.reduce(WMEAN, (w, x.to("meta")), dim=1)
    # (the kernels' path: tests/test_multi_input_kernels.py)


# --- vector inputs and fields: ATTENTION as a reduction over (score, value) ------------------

def test_attention_monoid_reduce_is_softmax_times_values():
    """``reduce(ATTENTION, (s, v))`` over the key dim: ``(softmax(s) v, logsumexp(s))``;
    ``v`` carries a trailing feature axis; the scores broadcast against it."""
    from flashfold.monoids import ATTENTION, ATTENTION2
    g = torch.Generator().manual_seed(6)
    s = torch.randn(3, 4, 50, generator=g) * 3
    v = torch.randn(1, 4, 50, 8, generator=g)              # broadcast over the batch
    p = torch.softmax(s.double(), -1)
    want_o = (p[..., None] * v.double()).sum(2)
    want_l = torch.logsumexp(s.double(), -1)
    for m in (ATTENTION, ATTENTION2):
        o, lse = ff.reduce(m, (s, v), dim=2)
        assert o.shape == (3, 4, 8) and lse.shape == (3, 4)
        assert_close(o, want_o, "float32", scale=float(v.abs().max()), name=f"{m.name} o")
        assert_close(lse, want_l, "float32", scale=1.0 + want_l.abs(), name=f"{m.name} lse")
    o, lse = ff.reduce(ATTENTION, (s, v), dim=(1, 2), keepdim=True)
    assert o.shape == (3, 1, 1, 8) and lse.shape == (3, 1, 1)
    pf = torch.softmax(s.double().flatten(1), -1)
    assert_close(o[:, 0, 0], (pf[..., None] * v.double().expand(3, 4, 50, 8).flatten(1, 2)).sum(1),
                 "float32", scale=float(v.abs().max()))


def test_attention_monoid_scan_is_every_prefix():
    """The scan's row ``t``: attention of the first ``t + 1`` keys (a causal row)."""
    from flashfold.monoids import ATTENTION
    g = torch.Generator().manual_seed(7)
    s, v = torch.randn(2, 30, generator=g), torch.randn(2, 30, 5, generator=g)
    o, lse = ff.scan(ATTENTION, (s, v), dim=1)
    assert o.shape == (2, 30, 5) and lse.shape == (2, 30)
    for t in (0, 7, 29):
        p = torch.softmax(s[:, :t + 1].double(), -1)
        assert_close(o[:, t], (p[..., None] * v[:, :t + 1].double()).sum(1), "float32",
                     scale=float(v.abs().max()), name=f"prefix {t}")
    o_r, _ = ff.scan(ATTENTION, (s, v), dim=1, reverse=True)
    p = torch.softmax(s[:, 11:].double(), -1)
    assert_close(o_r[:, 11], (p[..., None] * v[:, 11:].double()).sum(1), "float32",
                 scale=float(v.abs().max()))
    seg_o, _ = ff.segment_reduce(ATTENTION, (s.T, v.transpose(0, 1)), torch.tensor([0, 12, 30]), 0)
    assert seg_o.shape == (2, 2, 5)
    p = torch.softmax(s[:, 12:].double(), -1)
    assert_close(seg_o[1], (p[..., None] * v[:, 12:].double()).sum(1), "float32",
                 scale=float(v.abs().max()))


def test_vector_inputs_meta_and_errors(monkeypatch):
    from flashfold.monoids import ATTENTION
    s, v = torch.randn(3, 20), torch.randn(3, 20, 6)
    o, lse = ff.reduce(ATTENTION, (s.to("meta"), v.to("meta")), dim=1)
    assert o.is_meta and o.shape == (3, 6) and lse.shape == (3,)
    o, lse = ff.scan(ATTENTION, (s.to("meta"), v.to("meta")), dim=1)
    assert o.shape == (3, 20, 6) and lse.shape == (3, 20)
    with pytest.raises(ValueError, match=r"x\[1\] \(value\) is a vector input"):
        ff.reduce(ATTENTION, (s, torch.tensor(1.0)), dim=1)
    with pytest.raises(ValueError, match="do not broadcast"):
        ff.reduce(ATTENTION, (s, torch.randn(4, 20, 6)), dim=1)
    # the kernels take them too, with the same results (tests/test_multi_input_kernels.py)
    want = ff.reduce(ATTENTION, (s, v), dim=1)
    monkeypatch.setattr(R, "_use_kernels", lambda t: True)
    got = ff.reduce(ATTENTION, (s, v), dim=1)
    for o, r in zip(got, want):
        assert o.shape == r.shape
        assert_close(o, r.double(), "float32", scale=1.0 + float(v.abs().max()))


def test_zero_dim_inputs_and_a_vector_input_first():
    """0-d inputs reduce and scan as one element (a vector input of shape ``(W,)`` as one
    element of width W); a monoid whose first input is the vector one takes its dims from
    the other."""
    from flashfold import Field
    from flashfold.monoids import ATTENTION
    assert_close(ff.reduce(WMEAN, (torch.tensor(2.0), torch.tensor(3.0))),
                 torch.tensor(3.0, dtype=torch.float64), "float32")
    assert ff.scan(WMEAN, (torch.tensor(2.0), torch.tensor(3.0))).shape == ()
    v = torch.randn(4)
    for f in (ff.reduce, ff.scan):
        o, lse = f(ATTENTION, (torch.tensor(1.0), v))
        assert o.shape == (4,) and lse.shape == ()
        assert_close(o, v.double(), "float32")
    vfirst = Monoid("vmean_first", fields=(Field("o", vector=True), "n"), identity=(0.0, 0.0),
                    inputs=(Input("v", vector=True), Input("w")),
                    lift=lambda v, w: (v * w, w), combine=lambda a, b: (a.o + b.o, a.n + b.n),
                    finalize=lambda s: s.o / s.n, commutative=True)
    g = torch.Generator().manual_seed(8)
    v, w = torch.randn(3, 5, 2, generator=g), torch.rand(3, 5, generator=g)
    want = (v.double() * w.double()[..., None]).sum(1) / w.double().sum(1)[..., None]
    assert_close(ff.reduce(vfirst, (v, w), dim=1), want, "float32", scale=2.0)
    assert ff.scan(vfirst, (v, w), dim=1).shape == (3, 5, 2)
    assert ff.reduce(vfirst, (v, w), dim=(0, 1)).shape == (2,)
