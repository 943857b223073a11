"""FP8 (E4M3) attention on the CPU: the reference's semantics against float64, the
quantization helpers, and the checks of the call (``flashfold.api.fp8``).

Two yardsticks. The issue's: the output's error against the float64 attention of the
unquantized inputs is at most twice that of a naive FP8 attention (dequantize to bf16,
bf16 matmuls, softmax in fp32). And a stricter one on the computation alone: against
the float64 attention of the *dequantized* inputs (the inputs' rounding to FP8, common to
both, set aside), the error stays within what E4M3 weights allow (``P`` keeps 3 mantissa
bits: each weight's relative error is at most 2^-4), row by row and channel by channel.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashfold as ff
from flashfold.api.fp8 import quantize_fp8, random_rotation
from flashfold.kernels.attention.reference import (FP8, dequantize_fp8,
                                                   fp8_attention_reference, naive_attention)


def _inputs(B=2, HQ=4, HK=2, NQ=100, NK=120, D=64, DV=None, seed=0, outliers=False,
            cu=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, NQ, D, generator=g)
    k = torch.randn(B, HK, NK, D, generator=g)
    v = torch.randn(B, HK, NK, DV or D, generator=g)
    if outliers:                    # a few large channels, as in real activations
        q[..., :3] *= 20.0
        k[..., :3] *= 20.0
    cq = ck = None
    if cu is not None:
        cq, ck = (torch.tensor(c, dtype=torch.int32) for c in cu)
    q8, qd = quantize_fp8(q, HK, cu_seqlens=cq)
    k8, kd = quantize_fp8(k, cu_seqlens=ck)
    v8, vd = quantize_fp8(v, cu_seqlens=ck)
    _inputs.unquantized = (q, k, v)
    return (q8, k8, v8, qd, kd, vd), (cq, ck)


def _hidden(nq, nk, *, causal=False, window=None):
    """The pairs a bottom-right aligned causal mask / window hides, ``(nq, nk)``."""
    i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    hidden = torch.zeros(nq, nk, dtype=torch.bool)
    if right is not None:
        hidden |= j > i + nk - nq + right
    if left is not None:
        hidden |= j < i + nk - nq - left
    return hidden


def _naive_fp8(q8, k8, v8, qd, kd, vd, cq, ck, **kw):
    """The naive PyTorch FP8 attention: dequantize to bf16, bf16 matmuls, softmax in
    fp32 (as :func:`naive_attention` in bf16 with fp32 softmax does)."""
    hk = k8.shape[1]
    x = [dequantize_fp8(t, d, hk, c).to(torch.bfloat16)
         for t, d, c in ((q8, qd, cq), (k8, kd, ck), (v8, vd, ck))]
    return _naive_bf16(*x, cq, ck, **kw)


def _naive_bf16(q, k, v, cq, ck, causal=False, window=None, softcap=None, scale=None):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.zeros(q.shape[:3] + (v.shape[-1],), dtype=torch.float64)
    segs = [(slice(None), slice(None))] if cq is None else [
        (slice(int(cq[i]), int(cq[i + 1])), slice(int(ck[i]), int(ck[i + 1])))
        for i in range(len(cq) - 1)]
    for qs, ks in segs:
        s = (q[:, :, qs] @ k[:, :, ks].transpose(-1, -2)).float() * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(_hidden(*s.shape[-2:], causal=causal, window=window), -math.inf)
        p = torch.softmax(s, -1).nan_to_num(0.0).to(torch.bfloat16)
        out[:, :, qs] = (p @ v[:, :, ks]).double()
    return out


def _truth(q8, k8, v8, qd, kd, vd, cq, ck, **kw):
    hk = k8.shape[1]
    x = [dequantize_fp8(t, d, hk, c, dtype=torch.float64)
         for t, d, c in ((q8, qd, cq), (k8, kd, ck), (v8, vd, ck))]
    return naive_attention(*x, cu_seqlens_q=cq, cu_seqlens_k=ck, dtype=torch.float64, **kw)


CASES = [
    ("dense", dict(), dict()),
    ("causal", dict(), dict(causal=True)),
    ("gqa-causal-window", dict(HQ=8, HK=2), dict(causal=True, window=(31, 0))),
    ("two-sided-window", dict(NQ=120), dict(window=(20, 10))),
    ("softcap", dict(), dict(softcap=5.0)),
    ("d128", dict(D=128), dict(causal=True)),
    ("d256", dict(D=256, NQ=63, NK=63), dict(causal=True)),
    ("d80-dv64", dict(D=80, DV=64), dict()),
    ("one-row", dict(NQ=1, NK=1), dict()),
    ("outliers", dict(outliers=True), dict(causal=True)),
    ("varlen", dict(B=1, NQ=70, NK=90, cu=([0, 0, 30, 70], [0, 10, 50, 90])), dict(causal=True)),
]


@pytest.mark.parametrize("cid, shape, kw", CASES, ids=[c[0] for c in CASES])
def test_the_issue_criterion_against_the_unquantized_inputs(cid, shape, kw):
    (q8, k8, v8, qd, kd, vd), (cq, ck) = _inputs(**shape)
    q, k, v = _inputs.unquantized
    o = ff.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                     cu_seqlens_q=cq, cu_seqlens_k=ck, **kw)
    truth = naive_attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, dtype=torch.float64,
                            **kw)[0]
    naive = _naive_fp8(q8, k8, v8, qd, kd, vd, cq, ck, **kw)
    err = (o.double() - truth).abs().max().item()
    yard = (naive - truth).abs().max().item()
    assert err <= 2 * yard, f"{cid}: err {err:.3g} > 2 x naive FP8 {yard:.3g}"


#: how exactly an sm_90 tensor core sums E4M3 products (``wgmma ... e4m3``, fp32
#: accumulator), relative to ``sum_k |a_k b_k|``: far coarser than fp32's ``K 2^-24``.
#: Measured by ``benchmarks/attention_fp8.py --accumulation`` (H100, Triton 3.6): 8.1e-5
#: at K = 32 (one instruction) to 1.5e-4 at K = 256, against 0 for fp16 inputs of the
#: same values; DeepSeek-V3's report puts the accumulation at about 14 bits. The kernels'
#: ``S = Q K^T`` carries it (the LSE's error on a GPU), the interpreter's exact products
#: do not.
E4M3_DOT_EPS = 2.0 ** -12


def _p_bound(q8, k8, v8, qd, kd, vd, cq, ck, ref_lse, **kw):
    """Per (row, channel): the error E4M3 weights may add, ``sum_j |P_j - P8_j| |v_j|``
    with ``|P - P8| <= 2^-4 P`` (normal range) ``+ 2^-10 / 448`` (half the subnormal
    step, in P's units), from the float64 P of the truth; plus the bf16 output's rounding
    (``2^-9 |o|``) and fp32's (``1e-5``). Second result, per row: the largest ``scale
    sum_k |q_k k_k|`` over its visible keys (what bounds a score's error from an E4M3
    product's accumulation, :data:`E4M3_DOT_EPS`)."""
    hk = k8.shape[1]
    g = q8.shape[1] // hk
    q, k, v = [dequantize_fp8(t, d, hk, c, dtype=torch.float64)
               for t, d, c in ((q8, qd, cq), (k8, kd, ck), (v8, vd, ck))]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scale = 1 / math.sqrt(q.shape[-1])
    bound = torch.zeros(q.shape[:3] + (v.shape[-1],), dtype=torch.float64)
    s_abs = torch.zeros(q.shape[:3], dtype=torch.float64)
    segs = [(slice(None), slice(None))] if cq is None else [
        (slice(int(cq[i]), int(cq[i + 1])), slice(int(ck[i]), int(ck[i + 1])))
        for i in range(len(cq) - 1)]
    for qs, ks in segs:
        s = (q[:, :, qs] @ k[:, :, ks].transpose(-1, -2)) * scale
        if s.shape[-1] == 0:                       # a sequence without keys: exactly 0
            continue
        if kw.get("softcap") is not None:
            s = kw["softcap"] * torch.tanh(s / kw["softcap"])
        hidden = _hidden(*s.shape[-2:], causal=kw.get("causal", False), window=kw.get("window"))
        lse = ref_lse[:, :, qs]
        p = torch.exp(s - torch.where(lse == -math.inf, 0.0, lse)[..., None])
        p = p.masked_fill(hidden, 0.0)
        # P8 is quantized against the row max: its relative and absolute steps scale by
        # P's ratio to 1 at the max, e^(m - lse) = 1 / l
        l_inv = p.amax(-1, keepdim=True)
        dp = 2.0 ** -4 * p + (2.0 ** -10 / 448) * l_inv * (~hidden)
        bound[:, :, qs] = dp @ v[:, :, ks].abs()
        sums = (q[:, :, qs].abs() @ k[:, :, ks].abs().transpose(-1, -2)) * scale
        s_abs[:, :, qs] = sums.masked_fill(hidden, 0.0).amax(-1)
    return bound, s_abs


def assert_within_e4m3_bound(o, lse, inputs, cu, cid, tensor_cores=False, **kw) -> float:
    """``o`` (bf16 output) and ``lse`` against the float64 attention of the dequantized
    ``inputs`` (``q8, k8, v8, qd, kd, vd``; ``cu`` the packed offsets or Nones): every
    entry within :func:`_p_bound` plus the output's bf16 rounding and fp32's; the LSE
    within 1e-4 (relative to its largest), empty rows exactly where the truth has them.
    ``tensor_cores``: ``o``, ``lse`` came from a GPU, whose E4M3 products add up to
    :data:`E4M3_DOT_EPS` of ``scale sum_k |q_k k_k|`` to each score, so to each row's
    LSE (a change of every score by at most ``e`` moves the LSE by at most ``e``).
    Returns the largest share of the bound the error uses."""
    ref, ref_lse = _truth(*inputs, *cu, **kw)
    bound, s_abs = _p_bound(*inputs, *cu, ref_lse, **kw)
    err = (o.double() - ref).abs()
    slack = 2.0 ** -9 * ref.abs() + 1e-5
    assert (err <= bound + slack).all(), (
        f"{cid}: worst excess {(err - bound - slack).max().item():.3g}")
    live = ref_lse > -math.inf
    assert torch.equal(live, lse > -math.inf)
    if live.any():
        lse_bound = 1e-4 * max(1.0, ref_lse[live].abs().max().item())
        if tensor_cores:
            lse_bound = lse_bound + E4M3_DOT_EPS * s_abs
        excess = (lse.double() - ref_lse).abs() - lse_bound
        assert excess[live].max().item() <= 0, (
            f"{cid}: LSE error past its bound by {excess[live].max().item():.3g}")
    return (err / (bound + slack)).max().item() if err.numel() else 0.0


@pytest.mark.parametrize("cid, shape, kw", CASES, ids=[c[0] for c in CASES])
def test_reference_stays_within_the_e4m3_weights_bound(cid, shape, kw):
    inputs, cu = _inputs(**shape)
    q8, k8, v8, qd, kd, vd = inputs
    o, lse = ff.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                          cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], return_lse=True, **kw)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert o.shape == q8.shape[:3] + (v8.shape[-1],)
    assert torch.isfinite(o).all()
    # and the bound is not vacuous: the error uses a good part of it somewhere
    assert assert_within_e4m3_bound(o, lse, inputs, cu, cid, **kw) > 0.05


def test_fully_masked_rows_give_zero_and_minus_inf():
    (q8, k8, v8, qd, kd, vd), _ = _inputs(NQ=50, NK=20)
    o, lse = ff.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True,
                          return_lse=True)
    # bottom-right aligned: rows 0..29 see no key
    assert (o[:, :, :30] == 0).all() and (lse[:, :, :30] == -math.inf).all()
    assert torch.isfinite(o[:, :, 30:]).all() and torch.isfinite(lse[:, :, 30:]).all()


def test_calls_without_rows_or_keys():
    """No query rows, no keys, and a packed sequence without keys: shapes kept, rows
    without keys 0 / -inf (they used to raise from an empty reduction)."""
    d = torch.ones(1, 2)
    empty = torch.zeros(1, 2, 0, 16).to(FP8)
    rows = torch.ones(1, 2, 5, 16).to(FP8)
    o = ff.attention(empty, rows, rows, q_descale=d, k_descale=d, v_descale=d)
    assert o.shape == (1, 2, 0, 16)
    o, lse = ff.attention(rows, empty, empty, q_descale=d, k_descale=d, v_descale=d,
                          return_lse=True)
    assert (o == 0).all() and (lse == -math.inf).all()
    (q8, k8, v8, qd, kd, vd), (cq, ck) = _inputs(B=1, NQ=30, NK=20,
                                                 cu=([0, 10, 30], [0, 20, 20]))
    o, lse = ff.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                          cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True)
    assert (o[:, :, 10:] == 0).all() and (lse[:, :, 10:] == -math.inf).all()
    assert torch.isfinite(lse[:, :, :10]).all()


def test_a_nan_reaches_exactly_the_rows_that_see_it():
    (q8, k8, v8, qd, kd, vd), _ = _inputs(B=1, HQ=2, HK=1, NQ=40, NK=40)
    v8 = v8.clone()
    v8[0, 0, 10, 3] = float("nan")             # key 10: seen by causal rows 10..39
    o = ff.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
    bad = torch.isnan(o.float())
    assert not bad[:, :, :10].any()            # the rows before key 10 never see it
    assert bad[:, :, 10:, 3].all() and not bad[:, :, :, :3].any()


def test_the_output_dtype_is_chosen():
    (q8, k8, v8, qd, kd, vd), _ = _inputs()
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        o = ff.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=dt)
        assert o.dtype == dt


def test_meta_tensors_give_shapes():
    (q8, k8, v8, qd, kd, vd), _ = _inputs()
    m = [t.to("meta") for t in (q8, k8, v8, qd, kd, vd)]
    o, lse = ff.attention(*m[:3], q_descale=m[3], k_descale=m[4], v_descale=m[5],
                          return_lse=True)
    assert o.device.type == "meta" and o.shape == q8.shape and lse.shape == q8.shape[:3]


# --- quantization helpers -----------------------------------------------------------------

def test_meta_lse_is_float32_whatever_the_default_dtype():
    """The meta LSE has the dtype of the computed one, float32, not torch's default."""
    (q8, k8, v8, qd, kd, vd), _ = _inputs(NQ=8, NK=8, D=16)
    m = [t.to("meta") for t in (q8, k8, v8, qd, kd, vd)]
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        _, lse = ff.attention(*m[:3], q_descale=m[3], k_descale=m[4], v_descale=m[5],
                              return_lse=True)
    finally:
        torch.set_default_dtype(old)
    assert lse.dtype == torch.float32


def test_quantize_fp8_scales_each_group_to_the_format():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 33, 16, generator=g) * torch.tensor([1.0, 10.0, 100.0, 0.01])[
        None, :, None, None]
    x8, d = quantize_fp8(x, 2)                 # heads (0, 1) and (2, 3) share a factor
    assert x8.dtype == FP8 and d.shape == (2, 2) and d.dtype == torch.float32
    amax = x.abs().reshape(2, 2, -1).amax(-1)
    torch.testing.assert_close(d, amax / 448.0)
    assert x8.float().abs().amax() == 448.0
    back = dequantize_fp8(x8, d, 2)
    # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 above the subnormals
    big = x.abs() >= 2.0 ** -6 * d.repeat_interleave(2, 1)[:, :, None, None]
    assert ((back - x).abs() <= 2.0 ** -4 * x.abs() + 1e-12)[big].all()


def test_quantize_fp8_keeps_non_finite_entries_non_finite():
    x = torch.ones(1, 1, 4, 8)
    x[0, 0, 1, 2] = float("inf")
    x[0, 0, 2, 5] = float("nan")
    x8, d = quantize_fp8(x)
    assert d.item() == torch.tensor(1.0 / 448.0).item()   # from the finite entries only
    y = x8.float()
    assert torch.isnan(y[0, 0, 1, 2]) and torch.isnan(y[0, 0, 2, 5])
    assert torch.isfinite(y).sum() == 30
    x8, d = quantize_fp8(torch.zeros(1, 2, 3, 4))
    assert (d == 1.0).all() and (x8.float() == 0).all()


def test_quantize_fp8_gives_no_nan_for_finite_entries_at_float32s_edges():
    """Finite entries never become NaN: a group below 448 x 2^-149 (amax / 448 would round
    to 0) takes the smallest float32 as its factor and keeps its values; a float64 entry
    past float32's range saturates to 448 and counts in its group's factor."""
    tiny = torch.full((1, 1, 2, 2), 2e-43)
    x8, d = quantize_fp8(tiny)
    assert d.item() == 2.0 ** -149 and not torch.isnan(x8.float()).any()
    back = dequantize_fp8(x8, d, 1)
    assert ((back - tiny).abs() <= 2.0 ** -4 * tiny).all()
    huge = torch.tensor([[[[1e39, -1e300, 1.0, math.nan]]]], dtype=torch.float64)
    x8, d = quantize_fp8(huge)
    y = x8.float()
    assert y[0, 0, 0, :3].tolist() == [448.0, -448.0, 0.0] and torch.isnan(y[0, 0, 0, 3])
    assert d.item() == torch.finfo(torch.float32).max / 448.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_quantize_fp8_takes_16_bit_tensors(dtype):
    """A 16-bit tensor, what a model's projections produce, quantizes as its float32
    values do (the clamp to float32's largest value is done in float32, which a 16-bit
    tensor cannot hold)."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(2, 4, 33, 16, generator=g) * 100).to(dtype)
    x[0, 1, 2, 3] = float("inf")
    x8, d = quantize_fp8(x, 2)
    want8, want = quantize_fp8(x.float(), 2)
    assert torch.equal(d, want)
    assert torch.equal(x8.view(torch.uint8), want8.view(torch.uint8))


@pytest.mark.parametrize("shape", [(0, 4, 8, 16), (1, 4, 0, 16)], ids=["no-batch", "no-rows"])
def test_quantize_fp8_of_empty_tensors(shape):
    """The shapes attention takes without rows or keys: an empty group is all-zero,
    factor 1 (as an empty packed sequence's)."""
    x8, d = quantize_fp8(torch.zeros(shape), 2)
    assert x8.shape == shape and x8.dtype == FP8
    assert d.shape == (shape[0], 2) and (d == 1.0).all()


def test_quantize_fp8_per_packed_sequence():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 2, 30, 8, generator=g)
    x[:, :, 10:] *= 50
    cu = torch.tensor([0, 10, 10, 30], dtype=torch.int32)
    x8, d = quantize_fp8(x, cu_seqlens=cu)
    assert d.shape == (3, 2) and (d[1] == 1.0).all()          # an empty sequence
    torch.testing.assert_close(d[0], x[0, :, :10].abs().amax((-1, -2)) / 448.0)
    torch.testing.assert_close(d[2], x[0, :, 10:].abs().amax((-1, -2)) / 448.0)


def test_random_rotation_is_orthogonal_and_keeps_the_scores():
    r = random_rotation(64, seed=3, dtype=torch.float64)
    torch.testing.assert_close(r @ r.T, torch.eye(64, dtype=torch.float64))
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(5, 64, generator=g, dtype=torch.float64), torch.randn(
        7, 64, generator=g, dtype=torch.float64)
    torch.testing.assert_close((q @ r) @ (k @ r).T, q @ k.T)
    assert not torch.equal(random_rotation(64, seed=3), random_rotation(64, seed=4))


@pytest.mark.parametrize("head_dim, error", [(0, ValueError), (-3, ValueError),
                                             (2.5, TypeError), (True, TypeError),
                                             ("64", TypeError)], ids=repr)
def test_random_rotation_names_a_bad_head_dim(head_dim, error):
    with pytest.raises(error, match="head_dim"):
        random_rotation(head_dim)


@pytest.mark.parametrize("kw, error, name", [
    (dict(seed=1.5), TypeError, "seed"), (dict(seed="0"), TypeError, "seed"),
    (dict(seed=True), TypeError, "seed"), (dict(seed=2 ** 70), ValueError, "seed"),
    (dict(dtype=torch.int64), TypeError, "dtype"), (dict(dtype=FP8), TypeError, "dtype"),
    (dict(dtype="float32"), TypeError, "dtype")], ids=repr)
def test_random_rotation_names_a_bad_seed_or_dtype(kw, error, name):
    """An integer or FP8 dtype would round the orthogonal matrix to one that is not."""
    with pytest.raises(error, match=name):
        random_rotation(8, **kw)


def test_rotation_spreads_outlier_channels_and_lowers_the_fp8_error():
    """Incoherent processing (FlashAttention-3): with a few channels 20x larger, rotating
    q and k before quantizing lowers the output's error against float64."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 256, 64, generator=g) for _ in range(3))
    q[..., :2] *= 20
    k[..., :2] *= 20
    ref = naive_attention(q, k, v, causal=True)[0]

    def err(qq, kk):
        (q8, qd), (k8, kd), (v8, vd) = quantize_fp8(qq), quantize_fp8(kk), quantize_fp8(v)
        o = ff.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
        return (o.double() - ref).abs().max().item()
    r = random_rotation(64, seed=0)
    assert err(q @ r, k @ r) < err(q, k)


# --- the checks of the call ----------------------------------------------------------------

def _good():
    (q8, k8, v8, qd, kd, vd), _ = _inputs(B=1, HQ=2, HK=1, NQ=8, NK=8, D=16)
    return dict(q=q8, k=k8, v=v8, q_descale=qd, k_descale=kd, v_descale=vd)


@pytest.mark.parametrize("change, error, words", [
    (dict(q_descale=None), ValueError, "q_descale is required"),
    (dict(v_descale=None), ValueError, "v_descale is required"),
    (dict(k_descale=torch.ones(1, 1, dtype=torch.float64)), TypeError, "k_descale must be float32"),
    (dict(q_descale=torch.ones(2, 1)), ValueError, "q_descale must have shape (1, 1)"),
    (dict(q_descale=[1.0]), TypeError, "q_descale must be a torch.Tensor"),
    (dict(out_dtype=torch.int8), TypeError, "out_dtype"),
    (dict(score_mod=lambda s, b, h, i, j: s), ValueError, "score_mod"),
    (dict(causal="yes"), TypeError, "causal"),
    (dict(deterministic=5), TypeError, "deterministic"),
    (dict(scale=-1.0), ValueError, "scale"),
    (dict(q=torch.zeros((), dtype=FP8)), ValueError, "q must have 4 dims"),
], ids=lambda x: str(x)[:40])
def test_bad_fp8_input_names_the_argument(change, error, words):
    kw = _good()
    kw.update(change)
    q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        ff.attention(q, k, v, **kw)


def test_bad_packed_sequences_are_named_before_the_descales():
    (q8, k8, v8, qd, kd, vd), _ = _inputs(B=1, NQ=30, NK=30)
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    with pytest.raises(TypeError, match="cu_seqlens_q must be a torch.Tensor"):
        ff.attention(q8, k8, v8, cu_seqlens_q=[0, 30], cu_seqlens_k=[0, 30], **kw)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q_descale must have shape \(2, 2\)"):
        ff.attention(q8, k8, v8, cu_seqlens_q=cu, cu_seqlens_k=cu, **kw)
    two = dict(q_descale=qd.expand(2, 2), k_descale=kd.expand(2, 2), v_descale=vd.expand(2, 2))
    short = torch.tensor([0, 10, 20], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_k must end at the packed length 30"):
        ff.attention(q8, k8, v8, cu_seqlens_q=cu, cu_seqlens_k=short, **two)
    o = ff.attention(q8, k8, v8, cu_seqlens_q=cu, cu_seqlens_k=cu, **two)
    assert o.shape == q8.shape and torch.isfinite(o).all()


@pytest.mark.parametrize("cu, heads_k, error, words", [
    (torch.tensor([0, 5, 3, 6], dtype=torch.int32), None, ValueError,
     "cu_seqlens must be non-decreasing"),
    (torch.tensor([1, 6], dtype=torch.int32), None, ValueError, "cu_seqlens must start at 0"),
    (torch.tensor([0, 5], dtype=torch.int32), None, ValueError,
     "cu_seqlens must end at the packed length 6, got 5"),
    (torch.tensor([0.0, 2.5, 6.0]), None, TypeError, "cu_seqlens must be int32"),
    ([0, 6], None, TypeError, "cu_seqlens must be a torch.Tensor"),
    (None, 2.5, TypeError, "heads_k must be an int, got float"),
    (None, True, TypeError, "heads_k must be an int, got bool"),
    (None, "2", TypeError, "heads_k must be an int, got str"),
    (None, 3, ValueError, "heads_k must divide the 2 heads"),
], ids=lambda x: str(x)[:30])
def test_quantize_fp8_checks_its_packed_offsets_and_heads(cu, heads_k, error, words):
    """The offsets are checked as attention checks them (out-of-order offsets would
    divide rows by another sequence's factor)."""
    x = torch.randn(1, 2, 6, 4)
    with pytest.raises(error, match=words):
        quantize_fp8(x, heads_k, cu_seqlens=cu)


def test_quantize_fp8_of_packed_sequences_scales_each_sequence_apart():
    x = torch.randn(1, 2, 6, 4)
    x[:, :, 4:] *= 100
    x8, d = quantize_fp8(x, 1, cu_seqlens=torch.tensor([0, 4, 4, 6], dtype=torch.int32))
    assert d.shape == (3, 1) and d[1].item() == 1.0                 # (the empty sequence)
    for s, (a, b) in enumerate([(0, 4), (4, 6)]):
        row = 0 if s == 0 else 2
        assert torch.equal(d[row], (x[:, :, a:b].abs().max() / 448).reshape(1))
        assert x8[:, :, a:b].float().abs().max().item() == 448.0


def test_e5m2_and_mixed_dtypes_are_refused():
    kw = _good()
    q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
    with pytest.raises(TypeError, match="E4M3"):
        ff.attention(q.float().to(torch.float8_e5m2), k, v, **kw)
    with pytest.raises(TypeError, match="k is torch.bfloat16"):
        ff.attention(q, k.float().to(torch.bfloat16), v, **kw)


def test_fp8_with_requires_grad_is_refused():
    kw = _good()
    q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
    with pytest.raises(ValueError, match="forward-only"):
        ff.attention(q, k.clone().requires_grad_(), v, **kw)
    # nor a descale factor: no gradient flows to it (the CPU reference would compute one)
    for name in ("q_descale", "k_descale", "v_descale"):
        bad = dict(kw, **{name: kw[name].clone().requires_grad_()})
        with pytest.raises(ValueError, match=f"{name} requires grad"):
            ff.attention(q, k, v, **bad)


def test_descales_without_fp8_inputs_are_refused():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="q_descale is for float8_e4m3fn"):
        ff.attention(q, q, q, q_descale=torch.ones(1, 1))
    with pytest.raises(ValueError, match="out_dtype is for float8_e4m3fn"):
        ff.attention(q, q, q, out_dtype=torch.bfloat16)


def test_the_reference_is_what_the_api_runs():
    (q8, k8, v8, qd, kd, vd), _ = _inputs(B=1, NQ=30, NK=30)
    a = ff.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
    b = fp8_attention_reference(q8, k8, v8, qd, kd, vd, causal=True)[0]
    assert torch.equal(a, b)


def test_the_reference_docstring_states_its_formula():
    """The formula of the semantics reads as written (a control character in its place
    would render ``o_i = rac{...}``)."""
    doc = fp8_attention_reference.__doc__
    assert r"o_i = \frac{\mathrm{v\_descale}}{448\, l_i}" in doc
    assert not any(ord(ch) < 32 and ch not in "\n" for ch in doc)
