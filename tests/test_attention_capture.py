"""Packed sequences (``cu_seqlens``) inside CUDA-graph capture.

While a graph is captured :func:`flashfold.attention` reads no offsets on the host (a sync
fails there, and the values a replay meets may differ): the launches are sized by the
packed lengths and the kernels read the offsets on the device
(:func:`flashfold.kernels.attention.autograd.packed_lengths`).

On the CPU (CI) the Triton kernels run under the interpreter with the capture simulated
(``launcher.capturing`` answers True and any host read of the lengths fails): forward and
backward against float64 autograd for two sets of offsets over the same rows, and the
refusal of a callable mask_mod. On the GPU (marked ``gpu``): a real capture, replayed
after new offsets are copied into the graph's offsets tensor, against float64, and a NaN
key reaching exactly the rows that see it under each packing (the strict guard's flags).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import flashfold
from flashfold import mods
from flashfold.api import attention as api
from flashfold.kernels import launcher
from flashfold.kernels.attention import autograd, bwd, fwd
from flashfold.kernels.attention.bwd import BwdConfig
from flashfold.kernels.attention.fwd import FwdConfig
from flashfold.testing import assert_close

from test_attention_cases import oracle, varlen_inputs

#: two packings of the same 43 query rows and 63 key rows into 5 sequences (empty ones too)
PACKINGS = [([5, 0, 17, 1, 20], [9, 4, 17, 30, 3]),
            ([20, 1, 17, 0, 5], [3, 30, 17, 4, 9])]


def _offsets(lens):
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


def _ref_grads(q, k, v, do, **kw):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o, _ = oracle(q64, k64, v64, **kw)
    return (o,) + torch.autograd.grad(o, (q64, k64, v64), do.double())


@pytest.fixture
def captured(monkeypatch):
    """flashfold.attention on the interpreted kernels as if a CUDA graph were being
    captured: any host read of the offsets' values fails."""
    if torch.cuda.is_available():
        # (as every interpreter test file: on a GPU machine the kernels run themselves, and
        # the real capture is the gpu-marked test below)
        pytest.skip("interpreter tests run on CPU machines")

    def no_read(cu):
        raise AssertionError("the offsets were read on the host during capture")

    monkeypatch.setattr(api, "_use_kernel", lambda t: True)
    monkeypatch.setattr(launcher, "capturing", lambda device: True)
    monkeypatch.setattr(autograd, "_lengths", no_read)
    monkeypatch.setattr(autograd, "known_lengths", lambda cu: no_read(cu))
    monkeypatch.setattr(fwd, "default_config", lambda q, d, dv, causal=False: FwdConfig(16, 16))
    cfg = BwdConfig(16, 16, 4, 1, 16, 16, 4, 1, use_tma=True, atomic_dq=True)
    monkeypatch.setattr(bwd, "default_config",
                        lambda q, d, dv, features=False, causal=False: cfg)


@pytest.mark.parametrize("causal", [False, True])
def test_packed_call_reads_no_lengths_while_captured(captured, causal):
    """The same launches (sized by the packed lengths) serve two packings of the rows:
    outputs and gradients of both match float64 autograd."""
    q, k, v, _, _ = varlen_inputs(*PACKINGS[0], 4, 2, 32, torch.float32, seed=5)
    for lens_q, lens_k in PACKINGS:
        cu_q, cu_k = _offsets(lens_q), _offsets(lens_k)
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        o = flashfold.attention(qq, kk, vv, causal=causal, cu_seqlens_q=cu_q,
                                cu_seqlens_k=cu_k)
        do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
        got = (o,) + torch.autograd.grad(o, (qq, kk, vv), do)
        want = _ref_grads(q, k, v, do, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
            assert_close(a, b.detach(), torch.float32, scale=max(1.0, float(b.abs().max())),
                         name=f"{lens_q}: {name}")


def test_packed_call_without_grad_reads_no_lengths_while_captured(captured):
    lens_q, lens_k = PACKINGS[1]
    q, k, v, cu_q, cu_k = varlen_inputs(lens_q, lens_k, 2, 2, 32, torch.float32, seed=7)
    o, lse = flashfold.attention(q, k, v, window=(6, 2), cu_seqlens_q=cu_q,
                                 cu_seqlens_k=cu_k, return_lse=True)
    o64, lse64 = oracle(q.double(), k.double(), v.double(), window=(6, 2), cu_seqlens_q=cu_q,
                        cu_seqlens_k=cu_k)
    assert_close(o, o64, torch.float32, scale=max(1.0, float(o64.abs().max())), name="o")
    fin = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(lse), fin)
    assert_close(lse[fin], lse64[fin], torch.float32, scale=float(lse64[fin].abs().max()),
                 name="lse")


def test_callable_mask_mod_over_packed_sequences_is_refused_while_captured(captured):
    """Its block table is built from the lengths: a clear error, not a stale table."""
    lens = PACKINGS[0][0]
    q, k, v, cu_q, cu_k = varlen_inputs(lens, lens, 2, 1, 32, torch.float32, seed=6)
    with pytest.raises(ValueError, match="mask_mod"):
        flashfold.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            mask_mod=mods.prefix_lm_mask(torch.tensor([4, 0, 9, 1, 3])))


def test_capturing_is_false_off_cuda():
    assert launcher.capturing(torch.device("cpu")) is False
    assert launcher.capturing(torch.device("meta")) is False


# --- GPU: a real capture, replayed with other offsets ------------------------------------

def _capture(step):
    """``(graph, outputs)``: ``step`` run twice on a side stream (compiles, plans, the
    allocator's pools), then captured once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    return graph, outs


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_captured_packed_attention_replays_new_offsets(causal, dtype):
    """Forward and backward captured once, replayed after other packings of the same rows
    are copied into the offsets: o, dq, dk, dv within FlashAttention's criterion (2x the
    naive low-precision error against float64) for every packing (a host read of the
    offsets would fail the capture itself)."""
    if not torch.cuda.is_available():
        # (marked gpu: CI deselects it; a capture needs a CUDA stream)
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    packings = [[683] * 16 + [682] * 8, [1286, 949, 630, 1223, 869, 1056, 270, 491, 787, 410,
                                         622, 267, 497, 839, 659, 606, 563, 304, 894, 1048,
                                         310, 910, 181, 713]]
    packings.append(list(reversed(packings[1])))
    total = sum(packings[0])
    assert all(sum(p) == total and len(p) == 24 for p in packings)
    hq, hk, d = 8, 2, 128
    q = torch.randn(1, hq, total, d, generator=g).to(dev, dtype).requires_grad_()
    k = torch.randn(1, hk, total, d, generator=g).to(dev, dtype).requires_grad_()
    v = torch.randn(1, hk, total, d, generator=g).to(dev, dtype).requires_grad_()
    do = torch.randn(1, hq, total, d, generator=g).to(dev, dtype)
    cu = _offsets(packings[0]).to(dev)

    def step():
        o = flashfold.attention(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
        return (o,) + torch.autograd.grad(o, (q, k, v), do)

    graph, outs = _capture(step)
    for lens in packings:
        cu.copy_(_offsets(lens).to(dev))
        graph.replay()
        torch.cuda.synchronize()
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        o64, _ = oracle(q64, k64, v64, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
        want = (o64,) + torch.autograd.grad(o64, (q64, k64, v64), do.double())
        ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
        o_lp = _naive_packed(ql, kl, vl, causal, lens)
        naive = (o_lp,) + torch.autograd.grad(o_lp, (ql, kl, vl), do)
        for name, a, b, c in zip(("o", "dq", "dk", "dv"), outs, want, naive):
            err = float((a.double() - b).abs().max())
            bound = 2 * float((c.double() - b).abs().max()) + 1e-5 * float(b.abs().max())
            assert err <= bound, f"{lens[:3]}...: {name} error {err:.3g} > {bound:.3g}"


def _naive_packed(q, k, v, causal, lens):
    """Per sequence: matmuls in the input dtype, softmax in float32 (the criterion's
    yardstick), packed back."""
    outs, start = [], 0
    g = q.shape[1] // k.shape[1]
    for n in lens:
        qs, ks, vs = (t[:, :, start:start + n] for t in (q, k, v))
        ks, vs = ks.repeat_interleave(g, 1), vs.repeat_interleave(g, 1)
        s = (qs @ ks.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
        if causal:
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                              float("-inf"))
        outs.append(torch.softmax(s, -1).to(q.dtype) @ vs)
        start += n
    return torch.cat(outs, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_captured_packed_nan_reaches_only_its_rows(causal):
    """A NaN value in one key, the forward captured once and replayed under three packings
    of the same rows: exactly the rows that see the key (the float64 oracle's NaN rows)
    are NaN. The tiles before the key's sequence read past their end into it; their
    flags (one per 64-row slot, as a capture knows no lengths) send them to the strict
    guard, which recomputes them. The finite rows are within the criterion of the
    NaN-free problem."""
    if not torch.cuda.is_available():
        # (marked gpu: CI deselects it; a capture needs a CUDA stream)
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(1)
    packings = [[1286, 949, 630, 1223, 869, 1056, 270, 491, 787, 410, 622, 267, 497, 839,
                 659, 606, 563, 304, 894, 1048, 310, 910, 181, 713]]
    packings += [list(reversed(packings[0])), [683] * 16 + [682] * 8]
    total = sum(packings[0])
    hq, hk, d = 4, 2, 128
    q = torch.randn(1, hq, total, d, generator=g).to(dev, torch.bfloat16)
    k = torch.randn(1, hk, total, d, generator=g).to(dev, torch.bfloat16)
    v = torch.randn(1, hk, total, d, generator=g).to(dev, torch.bfloat16)
    clean = v.clone()
    row = sum(packings[0][:5])                    # the first key of packing 0's sequence 5
    v[0, 1, row] = float("nan")
    cu = _offsets(packings[0]).to(dev)

    def step():
        return flashfold.attention(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)

    graph, o = _capture(step)
    for lens in packings:
        cu.copy_(_offsets(lens).to(dev))
        graph.replay()
        torch.cuda.synchronize()
        o64, _ = oracle(q.double(), k.double(), v.double(), causal=causal, cu_seqlens_q=cu,
                        cu_seqlens_k=cu)
        nan_rows = torch.isnan(o).any(-1)
        assert torch.equal(nan_rows, torch.isnan(o64).any(-1)), lens[:3]
        assert nan_rows.any() and not nan_rows[:, :2].any()   # (heads 0, 1 read KV head 0)
        keep = ~nan_rows
        naive = _naive_packed(q, k, clean, causal, lens)
        bound = 2 * float((naive.double() - o64)[keep].abs().max()) + 1e-5
        err = float((o.double() - o64)[keep].abs().max())
        assert err <= bound, f"{lens[:3]}...: o error {err:.3g} > {bound:.3g}"
