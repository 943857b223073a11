"""``torch.compile(step, fullgraph=True)`` of a training step around ``flashfold.attention``:
without mods (the common case), with a score_mod, a mask_mod and a precomputed BlockMask,
forward and backward, on the CPU (tiny shapes, ``aot_eager``) and on CUDA (``gpu``, the
default inductor backend), each against the same step in eager mode.

The mod-less call passes ``0`` for an absent mod's id (``id(None)`` is not traceable by
every torch's Dynamo: 2.11 fails to compile the mod-less call with ``fullgraph=True``)."""

import pytest
import torch

import flashfold as ff
from flashfold import mods
from flashfold.testing import assert_close

N = 32
CASES = ["plain", "score_mod", "mask_mod", "block_mask", "window"]


#: where the compile tests run: the CPU (``aot_eager``) and, on a GPU machine, CUDA
#: with both backends
ON = [pytest.param("cpu", "aot_eager", id="cpu")] + [
    pytest.param("cuda", b, id=f"cuda-{b}", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])
    for b in ("inductor", "aot_eager")]


def _assert_same(got, want, case):
    """Compiled outputs equal the eager ones bit for bit, dtypes and shapes too (a tensor
    or a tuple of them, named tuples included)."""
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    assert len(got) == len(want), case
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), case


def _kwargs(case, device):
    docs = (torch.arange(N) // 12).to(device)
    if case == "plain":
        return dict(causal=True)
    if case == "score_mod":
        return dict(causal=True, score_mod=mods.alibi(4))
    if case == "mask_mod":
        return dict(mask_mod=mods.document_mask(docs))
    if case == "block_mask":
        bm = ff.create_block_mask(mods.document_mask(docs), None, None, N, N, device=device)
        return dict(causal=True, mask_mod=bm)
    return dict(window=(2**70, 4))                 # a left side past the sequence: unbounded


def _step(kw):
    def step(q, k, v):
        o, lse = ff.attention(q, k, v, return_lse=True, **kw)
        return (o.float().square().sum() + lse.sum()) / q.numel()
    return step


def _check(case, device, dtype, backend, gqa=False):
    """The compiled step against the eager one: loss and gradients (with ``gqa`` also on
    2 kv heads for 4 query heads: a second compile)."""
    import torch._dynamo
    torch._dynamo.reset()
    g = torch.Generator(device).manual_seed(7)
    q, k, v = (torch.randn(2, 4, N, 32, generator=g, device=device, dtype=dtype).requires_grad_()
               for _ in range(3))
    kvs = [(k, v)]
    if gqa:
        kvs.append(tuple(t.detach()[:, :2].clone().requires_grad_() for t in (k, v)))
    step = _step(_kwargs(case, device))
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for kk, vv in kvs:
        want = step(q, kk, vv)
        grads_want = torch.autograd.grad(want, (q, kk, vv))
        got = compiled(q, kk, vv)
        grads = torch.autograd.grad(got, (q, kk, vv))
        name = str(dtype).replace("torch.", "")
        assert_close(got, want, name, name=f"{case} loss")
        for n, a, b in zip("qkv", grads, grads_want):
            assert_close(a, b, name, name=f"{case} d{n}")


@pytest.mark.parametrize("device,backend", ON)
@pytest.mark.parametrize("case", CASES)
def test_fullgraph_compile_forward_and_backward(case, device, backend):
    if device == "cpu":
        _check(case, "cpu", torch.float32, backend)
    else:
        _check(case, "cuda", torch.bfloat16, backend, gqa=True)


def test_compiled_calls_check_the_tables_against_each_shape():
    """Under ``torch.compile`` the table check is traced with the shapes (guards): a
    longer sequence than the table covers raises, with dynamic shapes too."""
    import torch._dynamo
    torch._dynamo.reset()
    mm = mods.document_mask(torch.zeros(24, dtype=torch.int64))

    def step(q):
        return ff.attention(q, q, q, causal=True, mask_mod=mm).sum()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    for n in (8, 24):
        q = torch.randn(1, 2, n, 32)
        assert_close(compiled(q), step(q), "float32", name=f"n={n}")
    with pytest.raises(Exception, match=r"document_mask' reads its table 0 of shape \(24,\) at "
                                        r"index 31 along dim 0 \(from q_idx\), past its 24"):
        compiled(torch.randn(1, 2, 32, 32))


#: FP8 calls (forward only): dense causal with GQA, a window with softcap and a chosen
#: output dtype, packed sequences
FP8_CASES = ["causal-gqa", "window-softcap-fp16", "varlen"]


@pytest.mark.parametrize("device,backend", ON)
@pytest.mark.parametrize("case", FP8_CASES)
def test_fullgraph_compile_fp8(case, device, backend):
    """``torch.compile(fullgraph=True)`` of an FP8 call (through ``flashfold::attn_fwd_fp8``)
    gives the eager call's o and LSE, bit for bit (the same implementation runs)."""
    import torch._dynamo
    from flashfold.api.fp8 import quantize_fp8
    torch._dynamo.reset()
    g = torch.Generator(device).manual_seed(3)
    hk = 2 if case == "causal-gqa" else 4
    x = [torch.randn(1 if case == "varlen" else 2, h, 48, 64, generator=g, device=device)
         for h in (4, hk, hk)]
    kw = {"causal-gqa": dict(causal=True), "varlen": dict(causal=True),
          "window-softcap-fp16": dict(window=(9, 3), softcap=20.0, out_dtype=torch.float16)}[case]
    if case == "varlen":
        cu = torch.tensor([0, 5, 5, 48], dtype=torch.int32, device=device)
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu)
    (q, qs), (k, ks), (v, vs) = (quantize_fp8(t, hk, cu_seqlens=kw.get("cu_seqlens_q"))
                                 for t in x)
    kw.update(q_descale=qs, k_descale=ks, v_descale=vs)

    def call(q, k, v):
        return ff.attention(q, k, v, return_lse=True, **kw)
    want = call(q, k, v)
    _assert_same(torch.compile(call, fullgraph=True, backend=backend)(q, k, v), want, case)
    assert want[0].dtype == kw.get("out_dtype", torch.bfloat16)


# --- decoding ---------------------------------------------------------------------------------

#: decode calls: a contiguous cache with a window and the LSE; a paged cache with left
#: padding (cache_start), GQA 4:1 and softcap; an E4M3 cache with its descales; batch
#: invariant splits
DECODE_CASES = ["window-lse", "paged-start-softcap", "fp8", "batch-invariant"]


def _decode_inputs(case, device, dtype):
    from flashfold.api.decode import quantize_fp8_cache
    g = torch.Generator(device).manual_seed(5)
    B, H, HK, N, D, P = 3, 8, 2, 96, 64, 16
    q = torch.randn(B, H, 2, D, generator=g, device=device).to(dtype)
    k = torch.randn(B, HK, N, D, generator=g, device=device).to(dtype)
    v = torch.randn(B, HK, N, D, generator=g, device=device).to(dtype)
    lens = torch.tensor([96, 2, 41], dtype=torch.int32, device=device)
    kw = dict(cache_seqlens=lens)
    if case == "window-lse":
        kw.update(window=(17, 0), return_lse=True)
    elif case == "paged-start-softcap":
        order = torch.randperm(B * N // P, generator=torch.Generator().manual_seed(1))
        table = order.view(B, N // P).to(device=device, dtype=torch.int32)
        pages_k = torch.empty(B * N // P, P, HK, D, device=device, dtype=dtype)
        pages_v = torch.empty_like(pages_k)
        pages_k[table.long()] = k.transpose(1, 2).reshape(B, N // P, P, HK, D)
        pages_v[table.long()] = v.transpose(1, 2).reshape(B, N // P, P, HK, D)
        k, v = pages_k, pages_v
        kw.update(block_table=table, softcap=15.0,
                  cache_start=torch.tensor([30, 0, 40], dtype=torch.int32, device=device))
    elif case == "fp8":
        kd = k.float().abs().amax((2, 3)) / 448 + 1e-3
        vd = v.float().abs().amax((2, 3)) / 448 + 1e-3
        k, v = quantize_fp8_cache(k, kd), quantize_fp8_cache(v, vd)
        kw.update(k_descale=kd, v_descale=vd, return_lse=True)
    else:
        kw.update(batch_invariant=True)
    return q, k, v, kw


@pytest.mark.parametrize("device,backend", ON)
@pytest.mark.parametrize("case", DECODE_CASES)
def test_fullgraph_compile_decode(case, device, backend):
    """``flashfold.decode`` compiled with ``fullgraph=True`` (one ``flashfold::decode``
    op) gives the eager call's outputs bit for bit."""
    import torch._dynamo
    torch._dynamo.reset()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, kw = _decode_inputs(case, device, dtype)

    def call(q, k, v):
        return ff.decode(q, k, v, **kw)
    _assert_same(torch.compile(call, fullgraph=True, backend=backend)(q, k, v), call(q, k, v),
                 case)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("fp8", [False, True], ids=["16-bit", "e4m3"])
def test_fullgraph_compile_append_then_decode(paged, fp8):
    """A compiled step that appends two tokens per sequence and decodes them writes the
    same caches and returns the same lengths and outputs as eager; on the CPU the range
    check still runs (inside ``flashfold::checked_lengths``) and raises ValueError."""
    import torch._dynamo
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(9)
    B, HK, N, D, P = 2, 2, 64, 32, 16
    cdt = torch.float8_e4m3fn if fp8 else torch.float32
    shape = (B * N // P, P, HK, D) if paged else (B, HK, N, D)
    k0 = torch.randn(shape, generator=g).to(cdt)
    v0 = torch.randn(shape, generator=g).to(cdt)
    extra = {}
    if paged:
        extra["block_table"] = torch.tensor([[3, 1, 0, 2], [7, 5, 4, 6]], dtype=torch.int32)
    scales = dict(k_descale=torch.full((B, HK), 0.01), v_descale=torch.full((B, HK), 0.02)) \
        if fp8 else {}
    kn, vn = torch.randn(B, HK, 2, D, generator=g), torch.randn(B, HK, 2, D, generator=g)
    q = torch.randn(B, 4, 2, D, generator=g)

    def step(k, v, lens):
        lens = ff.append_kv(k, v, kn, vn, lens, **extra, **scales)
        return ff.decode(q, k, v, lens, **extra, **scales), lens
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    lens = torch.tensor([5, 62], dtype=torch.int32)
    (k1, v1), (k2, v2) = (k0.clone(), v0.clone()), (k0.clone(), v0.clone())
    (o1, l1), (o2, l2) = step(k1, v1, lens), compiled(k2, v2, lens)
    assert torch.equal(l1, l2) and torch.equal(o1, o2)
    assert torch.equal(k1.view(torch.uint8), k2.view(torch.uint8))
    assert torch.equal(v1.view(torch.uint8), v2.view(torch.uint8))
    with pytest.raises(ValueError, match=r"cache_seqlens: lengths \+ 2 new tokens must lie in "
                                         r"\[0, 64\]"):
        compiled(k2, v2, torch.tensor([63, 0], dtype=torch.int32))


def test_fullgraph_compile_paged_kv_cache_step():
    """A serving step on a :class:`~flashfold.PagedKVCache` (append two tokens, decode)
    compiled with ``fullgraph=True``: the same lengths, pages and outputs as eager, step
    after step (the cache object's ``seqlens`` updated by the compiled code)."""
    import torch._dynamo
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(12)
    caches = [ff.PagedKVCache.allocate(2, 64, 2, 32, page_size=16, dtype=torch.float32)
              for _ in range(2)]

    def step(cache, q, kn, vn):
        cache.append(kn, vn)
        return cache.decode(q, return_lse=True)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for _ in range(3):
        q, kn, vn = (torch.randn(2, h, n, 32, generator=g) for h, n in ((4, 2), (2, 2), (2, 2)))
        _assert_same(compiled(caches[1], q, kn, vn), step(caches[0], q, kn, vn), "paged step")
        a, b = caches
        assert torch.equal(a.seqlens, b.seqlens) and torch.equal(a.k_pages, b.k_pages)
        assert torch.equal(a.v_pages, b.v_pages)
    assert caches[1].seqlens.tolist() == [6, 6]


# --- reductions, scans and row maps of monoids -----------------------------------------------

def _monoid_cases(device="cpu"):
    from flashfold.examples import COVARIANCE, LINEAR_RECURRENCE, TOP2, WEIGHTED_MEAN
    from flashfold.monoids import ATTENTION, LOGSUMEXP2
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 40, 6, generator=g).to(device)
    w, a = (torch.rand(3, 40, 6, generator=g).to(device) for _ in range(2))
    s, v = torch.randn(2, 30, generator=g).to(device), torch.randn(2, 30, 8, generator=g).to(device)
    offs = torch.tensor([0, 7, 7, 40], device=device)
    return {
        "logsumexp-keepdim": lambda x: ff.logsumexp(x, 1, keepdim=True),
        "softmax-fp16-out": lambda x: ff.softmax(x, -1, dtype=torch.float16),
        "var_mean-dims-correction": lambda x: ff.var_mean(x, (0, 2), correction=0),
        "argmax-none": lambda x: ff.argmax(x),
        "argmin-dim": lambda x: ff.argmin(x, 2, keepdim=True),
        "cumsum-fp16-out": lambda x: ff.cumsum(x, 1, dtype=torch.float16),
        "logcumsumexp": lambda x: ff.logcumsumexp(x, 0),
        "reduce-top2": lambda x: ff.reduce(TOP2, x, 1),
        "reduce-two-inputs": lambda x: ff.reduce(WEIGHTED_MEAN, (w, x), 1),
        "reduce-covariance-param": lambda x: ff.reduce(COVARIANCE, (x, w), 1, correction=0),
        "reduce-vector-attention": lambda x: ff.reduce(ATTENTION, (s, v), 1),
        "scan-recurrence-reverse": lambda x: ff.scan(LINEAR_RECURRENCE, (a, x), 1,
                                                     reverse=True),
        "segment-reduce": lambda x: ff.segment_reduce(LOGSUMEXP2, x, offs, 1),
    }, x


MONOID_CASES = list(_monoid_cases()[0])


@pytest.mark.parametrize("device,backend", ON)
@pytest.mark.parametrize("case", MONOID_CASES)
def test_fullgraph_compile_monoid_calls(case, device, backend):
    """Each call compiled with ``fullgraph=True`` (one ``flashfold::monoid`` op) gives the
    eager call's outputs bit for bit, named tuples included."""
    import torch._dynamo
    torch._dynamo.reset()
    fns, x = _monoid_cases(device)
    fn = fns[case]
    _assert_same(torch.compile(fn, fullgraph=True, backend=backend)(x), fn(x), case)


def test_cpu_outputs_are_contiguous_as_the_fake_ones():
    """The reference (CPU tensors) returns contiguous outputs, as the kernels and the
    op's fake implementation do: the default backend checks a custom op's outputs
    against the fake's strides, and a reference output laid out as its moved axes (a
    segment_reduce over dim 1, a scan or reduce of a permuted tensor) failed the
    compiled call."""
    import torch._dynamo
    from flashfold.examples import LINEAR_RECURRENCE
    from flashfold.monoids import SUM, WELFORD
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(5))
    calls = {
        "segment-dim-1": lambda x: ff.segment_reduce(WELFORD, x, torch.tensor([0, 4, 8]), 1),
        "scan-transposed": lambda x: ff.scan(SUM, x.T, 1),
        "cumsum-transposed": lambda x: ff.cumsum(x.T, 0),
        "recurrence-transposed": lambda x: ff.scan(LINEAR_RECURRENCE, (x.T, x.T), 1),
        "reduce-permuted": lambda x: ff.reduce(SUM, x.reshape(2, 3, 4).permute(2, 0, 1), 1),
    }
    for name, fn in calls.items():
        outs = fn(x)
        assert all(o.is_contiguous() for o in (outs if isinstance(outs, tuple) else (outs,))), name
    torch._dynamo.reset()
    fn = calls["segment-dim-1"]
    _assert_same(torch.compile(fn, fullgraph=True)(x), fn(x), "segment-dim-1")


def test_fullgraph_compile_differentiable_reductions():
    """The torch-like functions' backward traces with ``fullgraph=True`` too: a loss of
    all five compiled gives the eager loss's gradient bit for bit."""
    import torch._dynamo
    torch._dynamo.reset()

    def loss(x):
        return (ff.logsumexp(x, 1).sum() + ff.softmax(x, 1)[:, 0].sum()
                + ff.var_mean(x, 1)[0].sum() + ff.cumsum(x, 1).sum()
                + ff.logcumsumexp(x, 1).sum())
    x = torch.randn(4, 33, generator=torch.Generator().manual_seed(5))
    grads = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        leaf = x.clone().requires_grad_()
        fn(leaf).backward()
        grads.append(leaf.grad)
    assert torch.equal(grads[0], grads[1])


def test_fullgraph_compile_monoid_checks_and_kernels(monkeypatch):
    """Under compilation the offsets check still runs (inside the op) and raises
    ValueError; with the kernels' route forced (the interpreter on the CPU), the op
    launches them, and their result equals the eager kernels'."""
    import torch._dynamo
    from flashfold.api import reductions
    from flashfold.monoids import LOGSUMEXP2
    torch._dynamo.reset()
    x = torch.randn(4, 33)
    seg = torch.compile(lambda x, o: ff.segment_reduce(LOGSUMEXP2, x, o, 1), fullgraph=True,
                        backend="aot_eager")
    with pytest.raises(ValueError, match=r"offsets: must be non-decreasing indices in \[0, 33\]"):
        seg(x, torch.tensor([0, 20, 10]))
    monkeypatch.setattr(reductions, "_use_kernels", lambda t: True)
    torch._dynamo.reset()
    fn = lambda x: ff.var_mean(x, 1)  # noqa: E731
    want, got = fn(x), torch.compile(fn, fullgraph=True, backend="aot_eager")(x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# --- merge_states ------------------------------------------------------------------------------

@pytest.mark.parametrize("device,backend", ON)
@pytest.mark.parametrize("form", ["pair", "stacked"])
def test_fullgraph_compile_merge_states(form, device, backend):
    """``merge_states`` compiled with ``fullgraph=True`` (``flashfold::merge_states``, its
    gradient registered): the eager outputs bit for bit, and the eager gradients (the
    backward's torch ops may be fused by the compiler: within the dtype's tolerance)."""
    import torch._dynamo
    torch._dynamo.reset()
    g = torch.Generator(device).manual_seed(8)
    outs = torch.randn(3, 2, 4, 9, 16, generator=g, device=device)
    lses = torch.randn(3, 2, 4, 9, generator=g, device=device)
    lses[1, :, :, 3] = -float("inf")
    parts = ([outs[0], lses[0], outs[1], lses[1]] if form == "pair" else [outs, lses])
    parts = [t.clone().requires_grad_() for t in parts]

    def step(*parts):
        o, lse = ff.merge_states(*parts)
        return o, lse, (o.square().sum() + lse.sum())
    want, got = step(*parts), torch.compile(step, fullgraph=True, backend=backend)(*parts)
    _assert_same(tuple(t.detach() for t in got[:2]), tuple(t.detach() for t in want[:2]), form)
    for a, b in zip(torch.autograd.grad(got[2], parts), torch.autograd.grad(want[2], parts)):
        assert_close(a, b, "float32", name=f"{form} gradient")
