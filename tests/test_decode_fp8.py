"""Decoding over an E4M3 KV cache (``torch.float8_e4m3fn`` with per-(sequence, kv head)
descales): the float64 reference of the dequantized cache, the split-KV kernels under
``TRITON_INTERPRET=1`` (natively on a GPU) against it in every dispatch branch, the
error against float64 of the unquantized values next to a naive FP8 implementation's,
quantization on write (``append_kv``, ``PagedKVCache``), batch invariance, and the errors
that name the argument."""

import math

import pytest
import torch

import flashfold as ff
from flashfold.api import decode as api
from flashfold.api.decode import FP8, quantize_fp8_cache
from flashfold.kernels.decode import splitkv
from flashfold.kernels.decode.reference import decode_reference
from flashfold.testing import assert_close
from test_decode_common import make_case, strict_interpreter_masks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _kernels(monkeypatch):
    """flashfold.decode on the kernels (the interpreter on CPU tensors), boolean masks only."""
    monkeypatch.setattr(api, "_use_kernels", lambda q: True)
    splitkv.plan_cache_clear()
    if DEVICE == "cuda":
        yield
        return
    with strict_interpreter_masks():
        yield


def quantized(case, paged, spread=True):
    """``case``'s cache quantized to E4M3 with per-(sequence, kv head) descales (each the
    head's largest magnitude over 448, times a factor that differs per head when
    ``spread``, so that a swapped index shows); returns ``(k8, v8, table, kd, vd)``."""
    k, v = case.k.float(), case.v.float()
    B, H = k.shape[:2]
    f = (1.0 + torch.arange(B * H, dtype=torch.float32, device=k.device).view(B, H) / 3
         if spread else 1.0)
    kd = (k.abs().amax(dim=(2, 3)) / 448 * f).to(DEVICE)
    vd = (v.abs().amax(dim=(2, 3)) / 448 * f.T.reshape(B, H) if spread else
          v.abs().amax(dim=(2, 3)) / 448).to(DEVICE)
    k8, v8 = quantize_fp8_cache(k, kd), quantize_fp8_cache(v, vd)
    if not paged:
        return k8, v8, None, kd, vd
    page = case.k_pages.shape[1]
    table = case.block_table
    kp = torch.zeros(case.k_pages.shape, dtype=FP8, device=DEVICE)
    vp = torch.zeros_like(kp)
    cap = k.shape[2]
    per_seq = table.shape[1]
    pad = per_seq * page - cap
    for b in range(B):
        kb = torch.nn.functional.pad(k8[b].transpose(0, 1).float(), (0, 0, 0, 0, 0, pad))
        vb = torch.nn.functional.pad(v8[b].transpose(0, 1).float(), (0, 0, 0, 0, 0, pad))
        kp[table[b].long()] = kb.reshape(per_seq, page, H, -1).to(FP8)
        vp[table[b].long()] = vb.reshape(per_seq, page, H, -1).to(FP8)
    return kp, vp, table, kd, vd


def reference(case, k8, v8, table, kd, vd, **kw):
    """float64 reference over the dequantized cache."""
    return decode_reference(case.q.double(), k8, v8, case.seqlens, table, k_descale=kd,
                            v_descale=vd, compute_dtype=torch.float64, **kw)


def test_reference_dequantizes_each_sequence_and_head_with_its_own_descale():
    case = make_case([5, 9], heads_q=4, heads_kv=2, head_dim=16, dtype=torch.float32, seed=1)
    k8, v8, _, kd, vd = quantized(case, False)
    k = k8.double() * kd.double()[:, :, None, None]
    v = v8.double() * vd.double()[:, :, None, None]
    ro, rl = decode_reference(case.q.double(), k8, v8, case.seqlens, k_descale=kd, v_descale=vd)
    eo, el = decode_reference(case.q.double(), k, v, case.seqlens)
    assert torch.equal(ro, eo) and torch.equal(rl, el)


@pytest.mark.parametrize("dtype, layout, splits, q_len, mods", [
    (torch.bfloat16, "contiguous", 1, 1, {}),
    (torch.bfloat16, "contiguous", 3, 2, {}),
    (torch.bfloat16, "paged8", 2, 1, {}),
    (torch.float16, "paged64", 3, 3, {"window": (20, None)}),
    (torch.bfloat16, "paged8", 2, 2, {"softcap": 2.0, "scale": 0.5}),
    (torch.float32, "contiguous", 2, 1, {}),
], ids=["bf16-one-split", "bf16-q2", "bf16-paged", "fp16-paged64-window", "softcap", "fp32-q"])
def test_kernel_matches_the_reference_of_the_dequantized_cache(dtype, layout, splits, q_len, mods):
    page = {"contiguous": None, "paged8": 8, "paged64": 64}[layout]
    case = make_case([0, 1, 77, 150], heads_q=4, heads_kv=2, q_len=q_len, head_dim=32,
                     capacity=150, page_size=page or 8, dtype=dtype, device=DEVICE, seed=3)
    k8, v8, table, kd, vd = quantized(case, page is not None)
    scale = mods.pop("scale", 1 / math.sqrt(32))
    o, lse = ff.decode(case.q, k8, v8, case.seqlens, block_table=table, num_splits=splits,
                       scale=scale, return_lse=True, k_descale=kd, v_descale=vd, **mods)
    ro, rl = reference(case, k8, v8, table, kd, vd, scale=scale, **mods)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert_close(o, ro, dtype, name="o")
    assert_close(lse, rl, "float32", name="lse")
    assert not torch.isnan(o).any()


def test_queries_beyond_the_fp16_range():
    """The kernel multiplies fp16 operands (E4M3 widens to fp16 exactly): a bfloat16 query
    with entries beyond fp16's 65504 is divided by a power of two first (exact), so it
    neither overflows nor loses the row."""
    case = make_case([40, 90], heads_q=4, heads_kv=2, q_len=1, head_dim=32, capacity=96,
                     dtype=torch.bfloat16, device=DEVICE, seed=2)
    case.q[0, 1] *= 3e5
    case.q[1] *= 1e-3
    k8, v8, _, kd, vd = quantized(case, False)
    o, lse = ff.decode(case.q, k8, v8, case.seqlens, scale=1e-6, return_lse=True,
                       k_descale=kd, v_descale=vd)
    ro, rl = reference(case, k8, v8, None, kd, vd, scale=1e-6)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert_close(o, ro, torch.bfloat16, name="o")
    assert_close(lse, rl, "float32", name="lse")


def test_a_non_finite_query_entry_reaches_its_own_row_only():
    """The power-of-two divisor of the query tile is taken over its finite entries: a NaN
    or an inf in one query row makes that row NaN and leaves the group's other rows as
    the reference computes them."""
    case = make_case([60, 70], heads_q=4, heads_kv=1, q_len=2, head_dim=32, capacity=72,
                     dtype=torch.bfloat16, device=DEVICE, seed=4)
    case.q[0, 1, 0, 3] = math.nan
    case.q[1, 2, 1, 5] = math.inf
    k8, v8, _, kd, vd = quantized(case, False)
    o = ff.decode(case.q, k8, v8, case.seqlens, k_descale=kd, v_descale=vd)
    ro, _ = reference(case, k8, v8, None, kd, vd)
    bad = torch.zeros(o.shape[:3], dtype=torch.bool, device=DEVICE)
    bad[0, 1, 0] = bad[1, 2, 1] = True
    assert torch.isnan(o[bad]).all()
    assert_close(o[~bad], ro[~bad], torch.bfloat16, name="o of the other rows")


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_tma_and_pointers_read_the_same_values(tma):
    case = make_case([3, 64, 190], heads_q=4, heads_kv=2, q_len=1, head_dim=32, capacity=256,
                     dtype=torch.bfloat16, device=DEVICE, seed=5)
    k8, v8, _, kd, vd = quantized(case, False)
    launch = splitkv.prepare(case.q, k8, v8, case.seqlens, scale=0.2, num_splits=2, tma=tma,
                             k_descale=kd, v_descale=vd)
    o, lse = launch.run()
    ro, rl = reference(case, k8, v8, None, kd, vd, scale=0.2)
    assert_close(o, ro, torch.bfloat16, name="o")
    assert_close(lse, rl, "float32", name="lse")


def test_error_against_float64_is_within_twice_a_naive_fp8_implementation():
    """The issue's criterion on the unquantized values: flashfold's FP8 decode against the
    float64 decode of the original bf16 cache, next to a naive PyTorch FP8 decode (the
    cache dequantized to bf16, bf16 matmuls, softmax in float32)."""
    g = torch.Generator().manual_seed(9)
    B, Hq, Hk, L, D = 2, 8, 2, 300, 64
    q = torch.randn(B, Hq, 1, D, generator=g).to(torch.bfloat16).to(DEVICE)
    k = torch.randn(B, Hk, L, D, generator=g)
    k[..., :4] *= 8                                      # a few large channels
    v = torch.randn(B, Hk, L, D, generator=g)
    k, v = k.to(torch.bfloat16).to(DEVICE), v.to(torch.bfloat16).to(DEVICE)
    lens = torch.tensor([L, 173], dtype=torch.int32, device=DEVICE)
    kd = k.float().abs().amax(dim=(2, 3)) / 448
    vd = v.float().abs().amax(dim=(2, 3)) / 448
    k8, v8 = quantize_fp8_cache(k, kd), quantize_fp8_cache(v, vd)
    o = ff.decode(q, k8, v8, lens, k_descale=kd, v_descale=vd)
    exact, _ = decode_reference(q.double(), k.double(), v.double(), lens)
    kn = (k8.float() * kd[:, :, None, None]).to(torch.bfloat16)
    vn = (v8.float() * vd[:, :, None, None]).to(torch.bfloat16)
    naive = torch.zeros_like(exact)
    for b in range(B):
        n = int(lens[b])
        kb = kn[b, :, :n].repeat_interleave(Hq // Hk, 0)
        vb = vn[b, :, :n].repeat_interleave(Hq // Hk, 0)
        s = (q[b] @ kb.transpose(-1, -2)).float() / math.sqrt(D)
        naive[b] = (torch.softmax(s, -1).to(torch.bfloat16) @ vb).double()
    err = (o.double() - exact).abs().max().item()
    naive_err = (naive - exact).abs().max().item()
    assert err <= 2 * naive_err, (err, naive_err)


def test_append_quantizes_on_write_and_decode_reads_it_back():
    """bf16 keys and values written into an E4M3 cache by append_kv, then decoded: the
    same as the reference over their quantized values; finite values past the range
    saturate to +-448, infinities and NaN are stored as NaN."""
    g = torch.Generator().manual_seed(4)
    B, Hk, Hq, cap, D = 2, 2, 4, 64, 32
    kc = torch.zeros(B, Hk, cap, D, dtype=FP8, device=DEVICE)
    vc = torch.zeros_like(kc)
    kd = torch.tensor([[0.01, 0.02], [0.03, 0.04]], device=DEVICE)
    vd = torch.tensor([[0.05, 0.01], [0.02, 0.03]], device=DEVICE)
    lens = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    k_new = torch.randn(B, Hk, 7, D, generator=g).to(torch.bfloat16).to(DEVICE)
    v_new = torch.randn(B, Hk, 7, D, generator=g).to(torch.bfloat16).to(DEVICE)
    lens2 = ff.append_kv(kc, vc, k_new, v_new, lens, k_descale=kd, v_descale=vd)
    assert lens2.tolist() == [7, 12]
    want = quantize_fp8_cache(k_new, kd)
    assert torch.equal(kc[0, :, :7].view(torch.uint8), want[0].view(torch.uint8))
    q = torch.randn(B, Hq, 1, D, generator=g).to(torch.bfloat16).to(DEVICE)
    o = ff.decode(q, kc, vc, lens2, k_descale=kd, v_descale=vd)
    ro, _ = decode_reference(q.double(), kc, vc, lens2, k_descale=kd, v_descale=vd)
    assert_close(o, ro, torch.bfloat16, name="o")
    edge = torch.tensor([1e9, -1e9, math.inf, math.nan, 1.0], device=DEVICE)
    x = edge.view(1, 1, 5, 1).expand(1, 1, 5, 2)
    stored = quantize_fp8_cache(x, torch.ones(1, 1, device=DEVICE)).float()[0, 0, :, 0]
    assert stored[0] == 448 and stored[1] == -448 and stored[4] == 1
    assert torch.isnan(stored[2]) and torch.isnan(stored[3])
    # finite values whose quotient overflows float32 saturate too (a tiny descale, a
    # float64 value past float32's range), through append_kv itself
    kc1 = torch.zeros(1, 1, 4, 2, dtype=FP8, device=DEVICE)
    vc1 = torch.zeros_like(kc1)
    one = torch.ones(1, 1, device=DEVICE)
    ff.append_kv(kc1, vc1, torch.tensor([[[[1e30, 1.0]]]], device=DEVICE),
                 torch.zeros(1, 1, 1, 2, device=DEVICE),
                 torch.zeros(1, dtype=torch.int32, device=DEVICE),
                 k_descale=torch.full((1, 1), 1e-10, device=DEVICE), v_descale=one)
    assert kc1[0, 0, 0].float().tolist() == [448.0, 448.0]
    big = torch.tensor([1e300, -1e300, math.inf], dtype=torch.float64, device=DEVICE)
    stored = quantize_fp8_cache(big.view(1, 1, 3, 1), one).float()[0, 0, :, 0]
    assert stored[:2].tolist() == [448.0, -448.0] and torch.isnan(stored[2])


def test_tokens_of_a_zero_or_nan_factor_are_stored_as_nan():
    """A zero or NaN descale represents no value: every token quantized with it is stored
    as NaN whatever its value (``x / 0`` is no quotient to saturate to +-448), through
    ``quantize_fp8_cache`` and ``append_kv``; the other heads' tokens as usual."""
    x = torch.tensor([0.5, -3.0, 0.0, -0.0, 1e-30], device=DEVICE)
    x = x.view(1, 1, 5, 1).expand(1, 3, 5, 2)
    descale = torch.tensor([[0.0, math.nan, 0.25]], device=DEVICE)
    stored = quantize_fp8_cache(x, descale).float()
    assert torch.isnan(stored[0, :2]).all()
    assert stored[0, 2, :, 0].tolist() == [2.0, -12.0, 0.0, 0.0, 0.0]
    kc = torch.zeros(1, 3, 8, 2, dtype=FP8, device=DEVICE)
    vc = torch.zeros_like(kc)
    ones = torch.ones(1, 3, device=DEVICE)
    ff.append_kv(kc, vc, x.contiguous(), x.contiguous(),
                 torch.zeros(1, dtype=torch.int32, device=DEVICE), k_descale=descale,
                 v_descale=ones)
    assert torch.isnan(kc[0, :2, :5].float()).all() and not torch.isnan(vc.float()).any()


def test_paged_cache_of_fp8_pages():
    g = torch.Generator().manual_seed(6)
    cache = ff.PagedKVCache.allocate(2, 40, 2, 32, page_size=8, dtype=FP8, device=DEVICE,
                                     shuffle=True)
    assert cache.k_descale.shape == (2, 2) and cache.k_descale.dtype == torch.float32
    cache.k_descale.fill_(0.02)
    cache.v_descale.fill_(0.01)
    for n in (13, 9):
        k = torch.randn(2, 2, n, 32, generator=g).to(torch.bfloat16).to(DEVICE)
        cache.append(k, -k)
    q = torch.randn(2, 4, 1, 32, generator=g).to(torch.bfloat16).to(DEVICE)
    o = cache.decode(q)
    ro, _ = decode_reference(q.double(), cache.k_pages, cache.v_pages, cache.seqlens,
                             cache.block_table, k_descale=cache.k_descale,
                             v_descale=cache.v_descale)
    assert_close(o, ro, torch.bfloat16, name="o")


def test_batch_invariant_fp8_is_bitwise_the_same_in_any_batch():
    case = make_case([700, 40, 333], heads_q=4, heads_kv=2, q_len=1, head_dim=32,
                     capacity=704, dtype=torch.bfloat16, device=DEVICE, seed=8)
    k8, v8, _, kd, vd = quantized(case, False)
    both = ff.decode(case.q, k8, v8, case.seqlens, batch_invariant=True, k_descale=kd,
                     v_descale=vd)
    alone = ff.decode(case.q[:1], k8[:1], v8[:1], case.seqlens[:1], batch_invariant=True,
                      k_descale=kd[:1], v_descale=vd[:1])
    assert torch.equal(both[:1], alone)


def _cache(dtype=FP8, B=2, H=2):
    return torch.zeros(B, H, 16, 32, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("kw, exc, pattern", [
    (dict(), ValueError, "k_descale: required with a float8_e4m3fn cache"),
    (dict(k_descale=torch.ones(2, 2)), ValueError, "v_descale: required"),
    (dict(k_descale=torch.ones(2, 3), v_descale=torch.ones(2, 2)), ValueError,
     r"k_descale: expected shape \(batch=2, heads_kv=2\)"),
    (dict(k_descale=torch.ones(2, 2, dtype=torch.float64), v_descale=torch.ones(2, 2)),
     TypeError, "k_descale: dtype must be torch.float32"),
], ids=["no-descales", "no-v-descale", "shape", "dtype"])
def test_fp8_cache_errors_name_the_argument(kw, exc, pattern):
    q = torch.zeros(2, 4, 1, 32, dtype=torch.bfloat16, device=DEVICE)
    kw = {k: v.to(DEVICE) for k, v in kw.items()}
    with pytest.raises(exc, match=pattern):
        ff.decode(q, _cache(), _cache(), torch.ones(2, dtype=torch.int32, device=DEVICE), **kw)


def test_other_formats_and_mixed_caches_are_refused_by_name():
    q = torch.zeros(2, 4, 1, 32, dtype=torch.bfloat16, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    ones = torch.ones(2, 2, device=DEVICE)
    with pytest.raises(TypeError, match="k_cache: torch.float8_e5m2 caches are not supported"):
        ff.decode(q, _cache(torch.float8_e5m2), _cache(torch.float8_e5m2), lens,
                  k_descale=ones, v_descale=ones)
    with pytest.raises(TypeError, match="k_cache: dtype torch.float8_e4m3fn differs from q's "
                                        r"torch.bfloat16 \(an 8-bit cache needs both"):
        ff.decode(q, _cache(), _cache(torch.bfloat16), lens, k_descale=ones, v_descale=ones)
    with pytest.raises(ValueError, match="k_descale: only with a float8_e4m3fn cache"):
        ff.decode(q, _cache(torch.bfloat16), _cache(torch.bfloat16), lens, k_descale=ones,
                  v_descale=ones)
    with pytest.raises(TypeError, match="q: dtype must be one of"):
        ff.decode(q.to(FP8), _cache(), _cache(), lens, k_descale=ones, v_descale=ones)
    with pytest.raises(TypeError, match="k_new: dtype must be one of"):
        ff.append_kv(_cache(), _cache(), _cache()[:, :, :1], _cache()[:, :, :1], lens,
                     k_descale=ones, v_descale=ones)
    # the message states k_new's own dtype, not the cache's
    with pytest.raises(TypeError, match="k_new: dtype must be one of .*got torch.int32$"):
        ff.append_kv(_cache(), _cache(), torch.zeros(2, 2, 1, 32, dtype=torch.int32,
                                                     device=DEVICE),
                     torch.zeros(2, 2, 1, 32, device=DEVICE), lens, k_descale=ones,
                     v_descale=ones)
    with pytest.raises(TypeError, match="v_new: dtype must be one of .*got torch.int64$"):
        ff.append_kv(_cache(), _cache(), torch.zeros(2, 2, 1, 32, device=DEVICE),
                     torch.zeros(2, 2, 1, 32, dtype=torch.int64, device=DEVICE), lens,
                     k_descale=ones, v_descale=ones)


def test_an_fp8_cache_on_another_device_is_refused_by_name():
    """The caches' device is checked as for a 16-bit cache: an E4M3 cache elsewhere than
    ``q`` (``meta`` stands for any other device) is a ``ValueError`` naming it, not a read
    of foreign memory by the kernels or a write that goes nowhere."""
    q = torch.zeros(2, 4, 1, 32, dtype=torch.bfloat16, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    ones = torch.ones(2, 2, device=DEVICE)
    new = torch.zeros(2, 2, 1, 32, device=DEVICE)
    away = torch.zeros(2, 2, 16, 32, dtype=FP8, device="meta")
    for k8, v8, name in ((_cache(), away, "v_cache"), (away, _cache(), "k_cache"),
                         (away, away.clone(), "k_cache")):
        with pytest.raises(ValueError, match=f"{name}: on meta, q on {DEVICE}"):
            ff.decode(q, k8, v8, lens, k_descale=ones, v_descale=ones)
        with pytest.raises(ValueError, match=f"{name}: on meta, k_new on {DEVICE}"):
            ff.append_kv(k8, v8, new, new.clone(), lens, k_descale=ones, v_descale=ones)
    pages = torch.zeros(4, 8, 2, 32, dtype=FP8, device=DEVICE)
    table = torch.arange(4, dtype=torch.int32, device=DEVICE).view(2, 2)
    with pytest.raises(ValueError, match="v_pages: on meta"):
        ff.PagedKVCache(pages, pages.to("meta"), table, lens, ones, ones)


def test_a_paged_cache_of_mixed_pages_is_refused_naming_both():
    """An E4M3 ``k_pages`` beside 16-bit ``v_pages`` (or the reverse): the message names
    the two page tensors and their dtypes, not ``k_pages`` against itself."""
    pages = torch.zeros(4, 8, 2, 32, dtype=FP8, device=DEVICE)
    table = torch.arange(4, dtype=torch.int32, device=DEVICE).view(2, 2)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    ones = torch.ones(2, 2, device=DEVICE)
    half = pages.to(torch.bfloat16)
    for k8, v8 in ((pages, half), (half, pages)):
        with pytest.raises(TypeError, match=f"v_pages: dtype {v8.dtype} differs from "
                                            f"k_pages's {k8.dtype} .*both k_pages and v_pages"):
            ff.PagedKVCache(k8, v8, table, lens, ones, ones)


# real sizes need the GPU (the interpreter would take hours); CI has none, the device
# machine runs it with ``-m gpu``, as the other gpu-marked tests
@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "invariant"])
def test_gpu_real_sizes(paged, batch_invariant):
    """Llama-3-8B's decode step (32 query heads on 8 KV heads, head_dim 128) over 8K-token
    E4M3 caches of uneven lengths, against the float64 reference of the dequantized cache."""
    lens = [8192, 5000, 1, 7777]
    case = make_case(lens, heads_q=32, heads_kv=8, q_len=1, head_dim=128, capacity=8192,
                     page_size=64 if paged else None, dtype=torch.bfloat16, device=DEVICE,
                     seed=10)
    k8, v8, table, kd, vd = quantized(case, paged)
    o, lse = ff.decode(case.q, k8, v8, case.seqlens, block_table=table, return_lse=True,
                       batch_invariant=batch_invariant, k_descale=kd, v_descale=vd)
    ro, rl = reference(case, k8, v8, table, kd, vd)
    assert_close(o, ro, torch.bfloat16, name="o")
    assert_close(lse, rl, "float32", name="lse")
