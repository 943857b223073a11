"""Tensors of more than 2^31 elements: the int64 index rules of the kernels.

Element indices along a dim, chunk bounds, row indices and address offsets must not wrap
in int32 (``flashfold.kernels.reduce.kernels``: row bases, row indices and chunk starts
are int64; indices along the dim are int64 when ``N64``). The CPU tests run the index
helpers themselves under the interpreter with values past 2^31, and the launchers'
rules; the GPU tests (marked ``gpu``, on the H200) run each kernel family on a tensor of
more than 2^31 elements against float64 torch, in chunks (each test under ~40 GiB).
"""

import pytest
import torch
import triton
import triton.language as tl

import flashfold as ff
from flashfold import monoids as M
from flashfold.kernels.reduce import kernels as K_
from flashfold.kernels.reduce import launch as L
from flashfold.testing import assert_close

I31 = 2**31
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# --- CPU: the index helpers under the interpreter, with values past 2^31 -----------------

@triton.jit
def _bounds_probe(split_ptr, out_ptr, chunk, N, N64: tl.constexpr):
    split = tl.load(split_ptr)                 # int32, as a program id or ticket is
    lo, hi = K_._chunk_bounds(split, chunk, N, N64)
    tl.store(out_ptr, lo.to(tl.int64))
    tl.store(out_ptr + 1, hi.to(tl.int64))


def _bounds(split, chunk, n, n64):
    out = torch.zeros(2, dtype=torch.int64)
    _bounds_probe[(1,)](torch.tensor([split], dtype=torch.int32), out, chunk, n, N64=n64)
    return tuple(out.tolist())


def test_last_chunk_bounds_past_int32():
    """The split of a 1-D scan or reduce of 2^31 + 3 elements (the split-K plan of the
    H200): the last chunk ends at N, although ``n_split·chunk`` passes 2^31."""
    g = L.Geometry(I31 + 3, 1, 1, (1, 1, 1), (0, 0, 0), (0, 0, 0))
    n_split, chunk = L.split_plan(g, 8192, 1, 132)
    assert L._n64(g) and n_split * chunk >= I31
    for j in (0, n_split // 2, n_split - 1):
        assert _bounds(j, chunk, g.N, True) == (j * chunk, min((j + 1) * chunk, g.N))


def test_last_chunk_bounds_int32_rows_near_2_31():
    """int32 plans (N below 2^31 - slack): the last chunk's ``(j + 1)·chunk`` passes 2^31
    and must not be formed."""
    n, chunk = I31 - L._N64_SLACK - 1, 2**30 + 1
    g = L.Geometry(n, 1, 1, (1, 1, 1), (0, 0, 0), (0, 0, 0))
    assert not L._n64(g)
    assert _bounds(1, chunk, n, False) == (chunk, n)
    assert _bounds(0, chunk, n, False) == (0, chunk)


@triton.jit
def _rows_probe(pid_ptr, out_ptr, n_split, n_inner, B1, B2, s0, s1, s2, ROWS: tl.constexpr):
    pid = tl.load(pid_ptr)
    split, row_ok, row_in, row_out, flat = K_._program_rows(
        pid, n_split, n_inner, B1, B2, (s0,), (s1,), (s2,), s0, s1, s2, ROWS)
    r = tl.arange(0, ROWS)
    tl.store(out_ptr + r, row_in[0])           # (input strides: a tuple, one per input)
    tl.store(out_ptr + ROWS + r, row_ok.to(tl.int64))
    tl.store(out_ptr + 2 * ROWS + r, flat)


def test_row_indices_past_int32():
    """A (2^31 + 64, 2) input reduced over dim 1: B2 passes 2^31, and the rows of the last
    row blocks must keep their indices (and their mask) instead of wrapping negative."""
    rows, b2 = 512, I31 + 64
    n_inner = -(-b2 // rows)
    out = torch.zeros(3 * rows, dtype=torch.int64)
    pid = n_inner - 1
    _rows_probe[(1,)](torch.tensor([pid], dtype=torch.int32), out, 1, n_inner, 1, b2, 0, 0, 2,
                      ROWS=rows)
    want = torch.arange(rows, dtype=torch.int64) + pid * rows
    assert torch.equal(out[:rows], want * 2)
    assert torch.equal(out[rows:2 * rows], (want < b2).long())
    assert torch.equal(out[2 * rows:], want)


def test_n64_covers_the_tail_tile():
    """The last tile of a row reaches up to a tile past N: rows just under 2^31 elements
    (or offsets) take int64 indices, so no masked lane's index wraps to pass ``n < hi``."""
    def g(n, sn=1):
        return L.Geometry(n, sn, 1, (1, 1, 1), (0, 0, 0), (0, 0, 0))
    assert L._n64(g(I31 - 100))
    assert L._n64(g(I31 // 16, 16))
    assert not L._n64(g(2**26))
    assert not L._n64(g(16384, 16384))              # dim 0 of 16K x 16K keeps int32


def test_positions_past_int32_raise():
    """ARGMAX / ARGMIN hold positions in int32 state fields: a dim of more than 2^31
    elements is a ValueError naming x, not wrapped indices (a stride-0 view: no memory)."""
    x = torch.zeros(1).expand(I31 + 1)
    for plan in (lambda m: L.plan_reduce(m, x, 0), lambda m: L.plan_scan(m, x, 0)):
        with pytest.raises(ValueError, match="x: argmax"):
            plan(M.ARGMAX)
    assert L.plan_reduce(M.ARGMAX, torch.zeros(1).expand(I31), 0)[0]     # 2^31 is fine
    long = torch.zeros(1).expand(I31 + 4)
    with pytest.raises(ValueError, match="a segment"):
        L.launch_segment_reduce(M.ARGMAX, long, torch.tensor([0, 3, I31 + 4]), 0)


def test_lookback_scan_int64_path(monkeypatch):
    """The decoupled look-back scan takes int64 chunk starts (N64) instead of falling back
    to reduce-then-scan, so single-pass scans of more than 2^31 elements stay one pass."""
    monkeypatch.setattr(L, "_n64", lambda g, *e: True)
    x = torch.randn(1, 40000, generator=torch.Generator().manual_seed(3))
    plan, _ = L.plan_scan(M.SUM, x, 1)
    assert plan[-1].kernel is K_.lookback_scan_kernel and plan[-1].kwargs["N64"]
    (out,) = L.launch_scan(M.SUM, x, 1)
    want = torch.cumsum(x.double(), 1)
    assert_close(out, want, "float32", scale=torch.cumsum(x.double().abs(), 1), name="cumsum")


def test_segments_past_2_31_on_a_sparse_tensor():
    """Segments that start past element 2^31 of a 4 GiB fp16 tensor whose pages are never
    touched but for the few read (virtual memory only): int64 offsets, loads and the
    segment positions (ARGMAX's index counts from the segment's start)."""
    try:
        big = torch.empty(I31 + 64, dtype=torch.float16)
    except RuntimeError:                                   # pragma: no cover
        pytest.skip("cannot reserve 4 GiB of virtual memory")
    tail = torch.linspace(-3, 3, 67).to(torch.float16)
    big[I31 - 3:] = tail
    offsets = torch.tensor([I31 - 3, I31 + 5, I31 + 40, I31 + 64])
    outs = L.launch_segment_reduce(M.SUM, big, offsets, 0)
    t = tail.double()
    want = torch.stack([t[0:8].sum(), t[8:43].sum(), t[43:].sum()])
    assert_close(outs[0], want, "float16", scale=t.abs().sum(), name="sum")
    _, idx = L.launch_segment_reduce(M.ARGMAX, big, offsets, 0)
    assert idx.tolist() == [7, 34, 23]


# --- GPU: each kernel family above 2^31 elements -----------------------------------------

def _prefix_check(out, x, name, chunk=2**27):
    """``out`` against the float64 inclusive cumsum of ``x`` (1-D), chunk by chunk; each
    prefix's scale is the sum of |x| up to it."""
    carry = torch.zeros((), dtype=torch.float64, device=x.device)
    acarry = torch.zeros((), dtype=torch.float64, device=x.device)
    for a in range(0, x.numel(), chunk):
        xs = x[a:a + chunk].double()
        ref = torch.cumsum(xs, 0) + carry
        scale = torch.cumsum(xs.abs(), 0) + acarry
        assert_close(out[a:a + chunk], ref, "float32", scale=scale, name=f"{name}[{a}:]")
        carry, acarry = ref[-1], scale[-1]


def _suffix_check(out, x, name, chunk=2**27):
    _prefix_check(out.flip(0), x.flip(0), name, chunk)


def _chunked_sum(x, chunk=2**27):
    return sum(x[a:a + chunk].double().sum() for a in range(0, x.numel(), chunk))


@pytest.mark.gpu
@gpu
def test_cumsum_past_2_31_reproduction():
    """The reported case: x[:2^31 + 3] of a randn tensor; its last prefix was -1.67e28."""
    x = torch.randn(2**31 + 4099, device="cuda")
    xs = x[:2**31 + 3]
    last = ff.cumsum(xs, 0)[-1]
    want = _chunked_sum(xs)
    assert_close(last, want, "float32", scale=_chunked_sum(xs.abs()), name="cumsum[-1]")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("path", ["lookback", "split", "reverse"])
def test_scan_past_2_31(path, monkeypatch):
    """Every prefix of a 2^31 + 3 element scan of positive values (a lost chunk would show
    at its full size): the look-back, reduce-then-scan and reverse paths."""
    torch.manual_seed(0)
    x = torch.rand(2**31 + 3, device="cuda")
    if path == "split":
        monkeypatch.setattr(L, "LOOKBACK", False)
    (out,) = L.launch_scan(M.SUM, x, 0, reverse=path == "reverse")
    if path == "reverse":
        _suffix_check(out, x, path)
    else:
        _prefix_check(out, x, path)


@pytest.mark.gpu
@gpu
def test_reduce_past_2_31():
    """Split-K over one row of 2^31 + 3 elements (sum, logsumexp) and a (2^31 + 64, 2)
    input reduced over dim 1 (more than 2^31 rows)."""
    torch.manual_seed(0)
    x = torch.rand(2**31 + 3, device="cuda")
    (total,) = L.launch_reduce(M.SUM, x, 0)
    assert_close(total, _chunked_sum(x), "float32", scale=_chunked_sum(x), name="sum")
    lse = ff.logsumexp(x, 0)
    want = sum(torch.logsumexp(x[a:a + 2**27].double(), 0).exp() / 1e9
               for a in range(0, x.numel(), 2**27)).log() + torch.tensor(1e9).log().double()
    assert_close(lse, want.to(lse.device), "float32", scale=2.0, name="logsumexp")
    del x
    y = torch.rand(2**31 + 64, 2, device="cuda", dtype=torch.float16)
    (s,) = L.launch_reduce(M.SUM, y, 1)
    for a in range(0, y.shape[0], 2**28):
        assert_close(s[a:a + 2**28], y[a:a + 2**28].double().sum(1), "float16",
                     scale=y[a:a + 2**28].double().abs().sum(1), name=f"rows[{a}:]")


@pytest.mark.gpu
@gpu
def test_segment_reduce_past_2_31():
    """Segments straddling and past element 2^31, one longer than 2^30."""
    torch.manual_seed(0)
    x = torch.rand(2**31 + 4099, device="cuda")
    n = x.numel()
    offs = [0, 5, 2**30, I31 - 7, I31 + 4000, n]
    got = ff.segment_reduce(M.SUM, x, torch.tensor(offs, device="cuda"), 0)
    got = got[0] if isinstance(got, tuple) else got
    for j in range(len(offs) - 1):
        want = _chunked_sum(x[offs[j]:offs[j + 1]])
        assert_close(got[j], want, "float32", scale=want, name=f"segment {j}")


@pytest.mark.gpu
@gpu
def test_softmax_past_2_31():
    """One row of 2^31 + 3 elements (the split normalize path)."""
    torch.manual_seed(0)
    x = torch.rand(2**31 + 3, device="cuda")
    y = ff.softmax(x, 0)
    m = x.max().double()
    z = sum((x[a:a + 2**27].double() - m).exp().sum() for a in range(0, x.numel(), 2**27))
    for a in (0, 2**30, I31 - 5):
        ref = (x[a:a + 2**20].double() - m).exp() / z
        assert_close(y[a:a + 2**20], ref, "float32", name=f"softmax[{a}:]")


@pytest.mark.gpu
@gpu
def test_attention_past_2_31():
    """q, k, v of 2^31 + 2^24 elements each (bf16, 4 GiB), forward and backward, checked
    on the last head's rows (whose offsets pass 2^31) against float64."""
    b, h, n, d = 1, 8, 2**21 + 2**17, 128
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    assert q.numel() > I31
    q.requires_grad_(True)
    o = ff.attention(q, k, v, causal=True)
    last = slice(n - 256, n)
    qs, ks, vs = (t[0, -1].double() for t in (q.detach(), k, v))
    s = (qs[last] @ ks.T) / d**0.5
    rows = torch.arange(n - 256, n, device="cuda")[:, None]
    s = s.masked_fill(torch.arange(n, device="cuda")[None, :] > rows, float("-inf"))
    ref = torch.softmax(s, -1) @ vs
    assert_close(o[0, -1, last], ref, "bfloat16", name="o")
    g = torch.zeros_like(o)
    g[0, -1, last] = 1.0
    o.backward(g)
    p = torch.softmax(s, -1)
    dp = torch.ones_like(ref) @ vs.T
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    dq = ds @ ks / d**0.5
    assert_close(q.grad[0, -1, last], dq, "bfloat16",
                 scale=float(dq.abs().max()), name="dq")


@pytest.mark.gpu
@gpu
def test_decode_past_2_31():
    """A contiguous KV cache of 2^31 + 2^27 elements per tensor (bf16): decode of the last
    batch entry (offsets past 2^31) against float64."""
    batch, hkv, cap, d = 17, 8, 2**17, 128
    torch.manual_seed(0)
    k = torch.randn(batch, hkv, cap, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    assert k.numel() > I31
    q = torch.randn(batch, hkv * 4, 1, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((batch,), cap, dtype=torch.int32, device="cuda")
    o, lse = ff.decode(q, k, v, lens, return_lse=True)
    qb = q[-1, :, 0].double().view(hkv, 4, d)
    s = torch.einsum("hgd,hnd->hgn", qb, k[-1].double()) / d**0.5
    ref = torch.einsum("hgn,hnd->hgd", torch.softmax(s, -1), v[-1].double()).reshape(hkv * 4, d)
    assert_close(o[-1, :, 0], ref, "bfloat16", name="decode o")
    assert_close(lse[-1].reshape(-1), torch.logsumexp(s, -1).reshape(-1), "float32",
                 scale=float(s.abs().max()) + 1.0, name="decode lse")


@pytest.mark.gpu
@gpu
def test_merge_states_past_2_31():
    """Two parts of 2^31 + 2^24 elements each (bf16 ``(1, 8, 2^21 + 2^17, 128)``): the last
    rows (offsets past 2^31) against float64."""
    shape = (1, 8, 2**21 + 2**17, 128)
    torch.manual_seed(0)
    o_a, o_b = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lse_a, lse_b = (torch.randn(shape[:-1], device="cuda") for _ in range(2))
    assert o_a.numel() > I31
    o, lse = ff.merge_states(o_a, lse_a, o_b, lse_b)
    last = slice(shape[2] - 4096, shape[2])
    la, lb = lse_a[0, -1, last].double(), lse_b[0, -1, last].double()
    ref_lse = torch.logaddexp(la, lb)
    ref = ((la - ref_lse).exp()[:, None] * o_a[0, -1, last].double()
           + (lb - ref_lse).exp()[:, None] * o_b[0, -1, last].double())
    assert_close(o[0, -1, last], ref, "bfloat16", name="merge o")
    assert_close(lse[0, -1, last], ref_lse, "float32", scale=ref_lse.abs() + 1.0, name="merge lse")
