"""The FP8 (E4M3) forward kernels against the float64 attention of the dequantized inputs
and against the issue's yardstick: the Triton template's ``FP8`` flag under
``TRITON_INTERPRET`` on CPU machines (the dispatch forced to the kernel) and at real sizes
on a GPU, and on Hopper the Gluon kernel's E4M3 descriptors (spied: the call went through
it), which no interpreter runs.

The kernel quantizes ``P`` against the running row max of each key tile, not the row's
final max, so its bits differ from :func:`fp8_attention_reference`'s; both stay within the
bound E4M3 weights allow (``tests/test_attention_fp8.py``: ``_p_bound``), which is what is
checked here, case by case, with the same cases.

Under the interpreter, conversions to and from E4M3 go through the session shim of
``conftest.py`` (the interpreter's own round half up without a carry and read NaN as 480);
the first test checks that shim against torch, on the GPU the hardware's ``cvt``.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
import triton
import triton.language as tl

import flashfold as ff
from flashfold.api import attention as api
from flashfold.kernels.attention import fwd, gluon_fwd
from flashfold.kernels.attention.reference import FP8, naive_attention

from test_attention_fp8 import CASES, _inputs, _naive_fp8, _truth, assert_within_e4m3_bound

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


@pytest.fixture
def kernel(monkeypatch):
    """Route FP8 calls on CPU tensors to the Triton template (the interpreter's tiles: 16
    rows, and 32 keys, since an 8-bit product reduces over at least 32)."""
    if GPU:
        pytest.skip("the interpreter's kernel tests run on CPU machines; the GPU runs "
                    "test_gpu_fp8_forward_at_real_sizes")
    monkeypatch.setattr(api, "_use_kernel", lambda t: True)


# --- the conversions the kernel relies on --------------------------------------------------

@triton.jit
def _round_trip(x_ptr, y8_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    y8 = tl.load(x_ptr + offs).to(tl.float8e4nv)
    tl.store(y8_ptr + offs, y8)
    tl.store(y_ptr + offs, y8.to(tl.float32))


def test_e4m3_conversions_round_to_nearest_even_and_saturate():
    """fp32 -> E4M3 rounds to nearest even (127.75 -> 128, carrying into the exponent;
    ties 72 -> 72, 76 -> 80), keeps subnormals (2^-9 steps) and NaN, saturates at 448;
    E4M3 -> fp32 is exact and keeps NaN."""
    vals = [127.75, 125.2, 72.0, 76.0, 7.93, 2.0 ** -9, 3 * 2.0 ** -10, 2.0 ** -11, 0.0,
            -0.3, 447.0, 460.0, 1000.0, -1000.0, float("nan"), 1.0]
    g = torch.Generator().manual_seed(0)
    rand = ((torch.rand(240, generator=g) * 2 - 1) * 460).tolist()
    x = torch.tensor(vals + rand, dtype=torch.float32, device=DEV)
    y8 = torch.empty(x.shape, dtype=FP8, device=DEV)
    y = torch.empty_like(x)
    _round_trip[(1,)](x, y8, y, N=x.numel())
    want = x.clamp(-448.0, 448.0).to(FP8)
    assert torch.equal(y8.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(y.isnan(), x.isnan())
    assert torch.equal(y[~x.isnan()], want.float()[~x.isnan()])
    assert y[0].item() == 128.0 and y[12].item() == 448.0 and y[13].item() == -448.0


# --- the kernel against the bound, under the interpreter -----------------------------------

@pytest.mark.parametrize("cid, shape, kw", CASES, ids=[c[0] for c in CASES])
def test_kernel_stays_within_the_e4m3_weights_bound(kernel, cid, shape, kw):
    inputs, (cq, ck) = _inputs(**shape)
    q8, k8, v8, qd, kd, vd = inputs
    o, lse = ff.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                          cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True, **kw)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    # within the bound, which the error uses a good part of (it is not vacuous)
    assert assert_within_e4m3_bound(o, lse, inputs, (cq, ck), cid, **kw) > 0.05
    # and the yardstick: within 2x a naive FP8 attention against the unquantized
    q, k, v = _inputs.unquantized
    truth = naive_attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, dtype=torch.float64,
                            **kw)[0]
    naive = _naive_fp8(q8, k8, v8, qd, kd, vd, cq, ck, **kw)
    assert (o.double() - truth).abs().max() <= 2 * (naive - truth).abs().max()


def test_kernel_fully_masked_rows_give_zero_and_minus_inf(kernel):
    (q8, k8, v8, qd, kd, vd), _ = _inputs(NQ=50, NK=20)
    o, lse = ff.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True,
                          return_lse=True)
    assert (o[:, :, :30] == 0).all() and (lse[:, :, :30] == -math.inf).all()
    assert torch.isfinite(o[:, :, 30:]).all() and torch.isfinite(lse[:, :, 30:]).all()


def test_kernel_nan_reaches_exactly_the_rows_that_see_it(kernel):
    """A NaN value of key 10: causal rows 10.. see it in its channel only. A NaN value of a
    key a window hides from part of a tile stays out of those rows (the guard's strict
    recompute), and an empty packed sequence is 0 / -inf."""
    (q8, k8, v8, qd, kd, vd), _ = _inputs(B=1, HQ=2, HK=1, NQ=40, NK=40)
    v8 = v8.clone()
    v8[0, 0, 10, 3] = float("nan")
    o = ff.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
    bad = torch.isnan(o.float())
    assert not bad[:, :, :10].any()
    assert bad[:, :, 10:, 3].all() and not bad[:, :, :, :3].any()
    # window (4, 0): row i sees keys i-4..i; key 10 is seen by rows 10..14 only
    o = ff.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, window=(4, 0))
    bad = torch.isnan(o.float())
    assert bad[:, :, 10:15, 3].all()
    assert bad.sum() == 2 * 5                              # 2 heads x rows 10..14, channel 3


def test_kernel_varlen_with_an_empty_sequence(kernel):
    """A sequence without queries, one without keys (its rows 0 / -inf)."""
    cu = ([0, 0, 30, 70], [0, 10, 10, 90])
    inputs, (cq, ck) = _inputs(B=1, NQ=70, NK=90, cu=cu)
    q8, k8, v8, qd, kd, vd = inputs
    o, lse = ff.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                          cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True, return_lse=True)
    assert (o[:, :, :30] == 0).all() and (lse[:, :, :30] == -math.inf).all()
    assert torch.isfinite(o).all() and torch.isfinite(lse[:, :, 30:]).all()
    assert_within_e4m3_bound(o, lse, inputs, (cq, ck), "varlen-empty", causal=True)


def test_kernel_output_dtype_and_a_replayed_plan_takes_new_factors(kernel):
    """``out_dtype`` is the output's dtype; a second call of the same signature replays
    the plan with the new call's descale factors (o is linear in v's: twice the factor,
    exactly twice the output)."""
    (q8, k8, v8, qd, kd, vd), _ = _inputs(B=1, HQ=2, HK=1, NQ=33, NK=40)
    for dt in (torch.float16, torch.float32):
        o = ff.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=dt)
        assert o.dtype == dt
    fwd.plan_cache_clear()
    a = ff.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=torch.float32)
    b = ff.attention(q8, k8, v8, q_descale=qd.clone(), k_descale=kd.clone(),
                     v_descale=2 * vd, out_dtype=torch.float32)
    assert fwd.plan_cache_info()["hits"] >= 1
    assert torch.equal(b, 2 * a)
    # q's and k's factors reach the scores: a larger q factor sharpens the softmax
    c = ff.attention(q8, k8, v8, q_descale=4 * qd, k_descale=kd, v_descale=vd,
                     out_dtype=torch.float32)
    ref = _truth(q8, k8, v8, 4 * qd, kd, vd, None, None)[0]
    assert (c.double() - ref).abs().max() < 0.1 < (a.double() - ref).abs().max()


def test_kernel_reads_strided_inputs_and_factors(kernel):
    """Inputs stored (B, N, H, D) (a transposed view) and descale factors given as
    expanded views (stride 0) are read through their strides: the same bits as the
    contiguous call."""
    (q8, k8, v8, qd, kd, vd), _ = _inputs(B=2, HQ=4, HK=2, NQ=37, NK=50, D=64)
    want = ff.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
    bnhd = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q8, k8, v8)]
    assert not bnhd[0].is_contiguous()
    got = ff.attention(*bnhd, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
    assert torch.equal(got, want)
    one = [d[:1].expand(2, -1) for d in (qd, kd, vd)]          # batch 0's factors for both
    got = ff.attention(q8, k8, v8, q_descale=one[0], k_descale=one[1], v_descale=one[2],
                       causal=True)
    ref = ff.attention(q8, k8, v8, q_descale=one[0].contiguous(),
                       k_descale=one[1].contiguous(), v_descale=one[2].contiguous(),
                       causal=True)
    assert torch.equal(got, ref) and not torch.equal(got[1], want[1])


def test_kernel_reads_v_keys_contiguous_through_tma_and_pointers(kernel):
    """An E4M3 ``v`` is read keys-contiguous (the 8-bit ``P V`` takes V K-major): a
    row-major ``v`` is transposed by the call (the same bits as one passed keys-contiguous),
    and the TMA descriptor over its transpose loads the tiles the pointer path loads.
    Packed sequences load through pointers (a sequence's first key, an innermost TMA
    coordinate there, need not be 16-byte aligned)."""
    (q8, k8, v8, qd, kd, vd), _ = _inputs(B=2, HQ=4, HK=2, NQ=96, NK=96, D=64)
    vt = v8.transpose(2, 3).contiguous().transpose(2, 3)
    assert vt.stride(2) == 1
    assert torch.equal(ff.attention(q8, k8, vt, q_descale=qd, k_descale=kd, v_descale=vd),
                       ff.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd))
    cu = torch.tensor([0, 30, 96], dtype=torch.int32)
    packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=66, max_seqlen_k=66)
    for extra, (q, k, v) in ((dict(), (q8, k8, vt)),
                             (packed, (q8[:1], k8[:1], vt[:1]))):
        o = []
        for tma in (False, True):
            cfg = fwd.FwdConfig(16, 32, 4, 1, use_tma=tma)
            assert fwd.prepare_forward(q, k, v, scale=0.125, right=0, config=cfg,
                                       descales=(qd, kd, vd), **extra)[2][2]["USE_TMA"] == (
                tma and not extra)
            o.append(fwd.attention_forward(q, k, v, scale=0.125, right=0, config=cfg,
                                           descales=(qd, kd, vd),
                                           out_dtype=torch.bfloat16, **extra))
        assert torch.equal(o[0][0], o[1][0]) and torch.equal(o[0][1], o[1][1])
    with pytest.raises(ValueError, match="keys-contiguous"):
        fwd.prepare_forward(q8, k8, v8, scale=0.125, descales=(qd, kd, vd))


def test_a_row_major_v_is_copied_with_rows_the_gluon_kernel_can_address():
    """The keys-contiguous copy of a row-major ``v`` pads its rows to 16 keys (Nk = 50:
    a row stride of 64 bytes), so that TMA can address its transpose and the Gluon
    kernel's scope takes the call; a ``v`` already keys-contiguous in such rows is passed
    as it is, one in rows of 50 bytes is copied as a row-major one is (it would
    otherwise miss the Gluon kernel)."""
    from flashfold.kernels.attention import autograd
    (q8, k8, v8, qd, kd, vd), _ = _inputs(B=1, HQ=2, HK=1, NQ=40, NK=50, D=64)
    seen = []
    with mock.patch.object(autograd, "kernel_forward",
                           side_effect=lambda q, k, v, **kw: seen.append(v)):
        autograd.fp8_forward_impl(q8, k8, v8, qd, kd, vd, None, None, 0.125, None, None,
                                  None, True, torch.bfloat16)
        autograd.fp8_forward_impl(q8, k8, seen[0], qd, kd, vd, None, None, 0.125, None, None,
                                  None, True, torch.bfloat16)
        unpadded = v8.transpose(2, 3).contiguous().transpose(2, 3)
        autograd.fp8_forward_impl(q8, k8, unpadded, qd, kd, vd, None, None, 0.125, None,
                                  None, None, True, torch.bfloat16)
    got = seen[0]
    assert got.stride(2) == 1 and got.stride(3) == 64 and torch.equal(
        got.view(torch.uint8), v8.view(torch.uint8))
    assert gluon_fwd.supported(q8, k8, got) and not gluon_fwd.supported(
        q8, k8, v8.transpose(2, 3).contiguous().transpose(2, 3))
    assert seen[1] is got
    assert seen[2] is not unpadded and seen[2].stride(3) == 64 and torch.equal(
        seen[2].view(torch.uint8), v8.view(torch.uint8))


# --- real sizes on a GPU --------------------------------------------------------------------

GPU_CASES = [
    ("d128-causal", dict(B=2, HQ=8, HK=2, NQ=2048, NK=2048, D=128), dict(causal=True)),
    ("d128-dense", dict(B=1, HQ=4, HK=4, NQ=1000, NK=3000, D=128), dict()),
    ("d256-window", dict(B=1, HQ=4, HK=1, NQ=1500, NK=1500, D=256),
     dict(causal=True, window=(700, 0))),
    ("d64-softcap", dict(B=2, HQ=4, HK=2, NQ=1024, NK=1024, D=64), dict(softcap=30.0)),
    ("d96-dv64", dict(B=1, HQ=4, HK=2, NQ=777, NK=1025, D=96, DV=64), dict(causal=True)),
    ("varlen", dict(B=1, HQ=4, HK=2, NQ=2100, NK=2100, D=128,
                    cu=([0, 0, 700, 2049, 2100], [0, 0, 700, 2049, 2100])), dict(causal=True)),
]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("cid, shape, kw", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_fp8_forward_at_real_sizes(cid, shape, kw):
    """The template's compiled kernel (TMA, wgmma on sm_90) at real sizes within the E4M3
    weights' bound (the references computed on the CPU, in float64); the Gluon kernel
    off, which takes most of these calls on sm_90 (``test_gpu_gluon_fp8_forward``)."""
    from flashfold.kernels.attention import dispatch
    inputs, cu = _inputs(**shape)
    on = [None if t is None else t.cuda() for t in (*inputs, *cu)]
    with dispatch.using(gluon=False):
        o, lse = ff.attention(*on[:3], q_descale=on[3], k_descale=on[4], v_descale=on[5],
                              cu_seqlens_q=on[6], cu_seqlens_k=on[7], return_lse=True, **kw)
    # checked on the CPU, in float64
    assert_within_e4m3_bound(o.cpu(), lse.cpu(), inputs, cu, cid, tensor_cores=True, **kw)


# --- the Gluon kernel's E4M3 descriptors (sm_90) --------------------------------------------
# (GPU tests, skipped elsewhere: Gluon kernels do not run under Triton's interpreter; on
# the CPU the FP8 variants are compiled for sm_90 in tests/test_attention_gluon.py)

def _sm90():
    return GPU and torch.cuda.get_device_capability()[0] == 9


#: calls the Gluon kernel takes: causal GQA, softcap at 256, a two-sided window with
#: ``Nk`` not a multiple of 16 (the call's keys-contiguous copy of v pads its rows),
#: DeepSeek's 192 / 128 dense over 3K keys, and packed sequences whose offsets are not
#: multiples of 16 keys (tiles start at a sequence's first key rounded down), with a
#: sequence without queries and one without keys
GLUON_CASES = [
    ("d128-causal-gqa", dict(B=2, HQ=8, HK=2, NQ=2048, NK=2048, D=128), dict(causal=True)),
    ("d256-causal-softcap", dict(B=1, HQ=4, HK=2, NQ=1500, NK=1500, D=256),
     dict(causal=True, softcap=30.0)),
    ("d64-window", dict(B=2, HQ=4, HK=2, NQ=1024, NK=1000, D=64), dict(window=(300, 50))),
    ("d192-128-dense", dict(B=1, HQ=4, HK=4, NQ=1000, NK=3000, D=192, DV=128), dict()),
    ("varlen-causal-empty", dict(B=1, HQ=4, HK=2, NQ=2100, NK=2100, D=128,
                                 cu=([0, 0, 700, 2049, 2100], [0, 0, 700, 2049, 2100])),
     dict(causal=True)),
    ("varlen-window-no-keys", dict(B=1, HQ=4, HK=2, NQ=1040, NK=1701, D=128,
                                   cu=([0, 0, 40, 340, 1040], [0, 10, 10, 527, 1701])),
     dict(window=(150, 10))),
]


def _gluon_fp8(inputs, cu, **kw):
    """``flashfold.attention`` of CUDA copies of ``inputs``, planned anew and spied: ``(o,
    lse)`` on the CPU, and whether the Gluon kernel ran it with the call's factors."""
    on = [None if t is None else t.cuda() for t in (*inputs, *cu)]
    fwd.plan_cache_clear()                 # (a replayed plan would not call the spy)
    with mock.patch.object(gluon_fwd, "gluon_attention_fwd",
                           wraps=gluon_fwd.gluon_attention_fwd) as spy:
        o, lse = ff.attention(*on[:3], q_descale=on[3], k_descale=on[4], v_descale=on[5],
                              cu_seqlens_q=on[6], cu_seqlens_k=on[7], return_lse=True, **kw)
    ran = spy.call_count == 1 and spy.call_args.kwargs["descales"][0] is on[3]
    return o.cpu(), lse.cpu(), ran


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("cid, shape, kw", GLUON_CASES, ids=[c[0] for c in GLUON_CASES])
def test_gpu_gluon_fp8_forward(cid, shape, kw):
    """The Gluon kernel runs the call and stays within the E4M3 weights' bound and the
    issue's yardstick, as the template does (the references in float64 on the CPU)."""
    inputs, cu = _inputs(**shape)
    o, lse, ran = _gluon_fp8(inputs, cu, **kw)
    assert ran, f"{cid}: not the Gluon kernel"
    assert o.dtype == torch.bfloat16
    assert_within_e4m3_bound(o, lse, inputs, cu, cid, tensor_cores=True, **kw)
    q, k, v = _inputs.unquantized
    truth = naive_attention(q, k, v, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1],
                            dtype=torch.float64, **kw)[0]
    naive = _naive_fp8(*inputs, *cu, **kw)
    assert (o.double() - truth).abs().max() <= 2 * (naive - truth).abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
def test_gpu_gluon_fp8_nan_rows_and_replayed_factors():
    """A NaN value of key 10 reaches causal rows 10.. in its channel only, and with a
    window (4, 0) rows 10..14 only (the kernel's flags and the template's strict guard);
    a replayed plan takes the next call's factors (twice v's factor: exactly twice the
    output); ``out_dtype`` float32."""
    (q8, k8, v8, qd, kd, vd), _ = _inputs(B=1, HQ=2, HK=1, NQ=256, NK=256, D=128)
    clean = v8
    v8 = v8.clone()
    v8[0, 0, 10, 3] = float("nan")
    on = [t.cuda() for t in (q8, k8, v8, qd, kd, vd)]
    o, _, ran = _gluon_fp8((q8, k8, v8, qd, kd, vd), (None, None), causal=True)
    bad = torch.isnan(o.float())
    assert ran and not bad[:, :, :10].any()
    assert bad[:, :, 10:, 3].all() and bad.sum() == 2 * 246
    o, _, ran = _gluon_fp8((q8, k8, v8, qd, kd, vd), (None, None), window=(4, 0))
    bad = torch.isnan(o.float())
    assert ran and bad[:, :, 10:15, 3].all() and bad.sum() == 2 * 5
    on[2] = clean.cuda()
    fwd.plan_cache_clear()
    a = ff.attention(*on[:3], q_descale=on[3], k_descale=on[4], v_descale=on[5],
                     causal=True, out_dtype=torch.float32)
    b = ff.attention(*on[:3], q_descale=on[3].clone(), k_descale=on[4].clone(),
                     v_descale=2 * on[5], causal=True, out_dtype=torch.float32)
    assert fwd.plan_cache_info()["hits"] >= 1
    assert a.dtype == torch.float32 and torch.equal(b, 2 * a)
