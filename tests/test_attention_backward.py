"""flashfold.attention backward on the CPU path (the custom op with the blocked reference
forward and the blocked backward): float64 gradcheck with every feature, agreement with
torch.autograd through the naive float64 oracle, the LSE gradient, rows without visible
keys, determinism, torch.compile(fullgraph=True), and a small transformer trained with
flashfold attention against SDPA from the same seed."""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flashfold
from flashfold import mods, ops
from flashfold.kernels.attention import autograd as fa_autograd
from flashfold.kernels.attention import reference as fa_reference
from flashfold.kernels.attention.mods import create_block_mask, trace_mask_mod, trace_score_mod
from flashfold.testing import assert_close

from test_attention_cases import FEATURES, Shape, make_qkv, oracle, varlen_inputs


def _grads_ref(q, k, v, do, dlse=None, **kw):
    """dq, dk, dv of the naive float64 oracle through torch.autograd."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o, lse = oracle(q64, k64, v64, **kw)
    outs, grads = [o], [do.double()]
    if dlse is not None:
        fin = torch.isfinite(lse)
        outs.append(torch.where(fin, lse, 0.0))
        grads.append(torch.where(fin, dlse.double(), 0.0))
    return torch.autograd.grad(outs, (q64, k64, v64), grads)


def _grad_scale(g):
    return max(1.0, float(g.abs().max()))


GRADCHECK_SHAPES = [Shape(1, 2, 1, 6, 9, 32), Shape(2, 2, 2, 7, 5, 32, 64)]


@pytest.mark.parametrize("shape", GRADCHECK_SHAPES, ids=lambda s: s.id)
@pytest.mark.parametrize("feature", FEATURES, ids=lambda f: f.name)
def test_gradcheck_float64_every_feature(shape, feature):
    q, k, v = (t.requires_grad_() for t in make_qkv(shape, torch.float64, seed=3))
    kw = feature.build(shape)
    assert torch.autograd.gradcheck(lambda q, k, v: flashfold.attention(q, k, v, **kw),
                                    (q, k, v), fast_mode=True)


def test_gradcheck_float64_all_features_at_once_full_jacobian():
    """Slow-mode gradcheck (every Jacobian entry) with GQA, softcap, a score_mod reading a
    table, a document mask, causal and a window together."""
    shape = Shape(1, 2, 1, 4, 6, 32)
    q, k, v = (t.requires_grad_() for t in make_qkv(shape, torch.float64, seed=4))
    table = torch.randn(2, 13, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    kw = dict(causal=True, window=(3, None), softcap=1.5, score_mod=mods.relative_bias(table),
              mask_mod=mods.document_mask(torch.tensor([0, 1, 1, 1]), torch.tensor([0, 0, 0, 1, 1, 1])))
    assert torch.autograd.gradcheck(lambda q, k, v: flashfold.attention(q, k, v, **kw), (q, k, v))


def test_gradcheck_float64_varlen():
    q, k, v, cu_q, cu_k = varlen_inputs([3, 0, 5], [4, 2, 6], 2, 1, 32, torch.float64, seed=6)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    fn = lambda q, k, v: flashfold.attention(q, k, v, causal=True, cu_seqlens_q=cu_q,  # noqa: E731
                                             cu_seqlens_k=cu_k, score_mod=mods.alibi(2))
    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)


@pytest.mark.parametrize("custom_op", [False, True], ids=["autograd-function", "custom-op"])
def test_gradcheck_float64_through_the_lse_output(custom_op):
    """The op returns lse in float64 for float64 inputs, so the LSE path is gradcheckable;
    both wrappers (eager autograd.Function, torch.library custom op) are checked."""
    shape = Shape(1, 2, 1, 6, 8, 32)
    q, k, v = (t.requires_grad_() for t in make_qkv(shape, torch.float64, seed=7))
    smod = mods.alibi(2)
    key = fa_autograd.register_mods(smod, None)

    def fn(q, k, v):
        o, lse = fa_autograd.attention_op(q, k, v, key=key, scale=0.3, softcap=2.0, right=1,
                                          use_kernel=False, custom_op=custom_op)
        return o, lse
    assert fn(q, k, v)[1].dtype == torch.float64
    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_gradients_match_autograd_of_the_oracle(dtype):
    shape = Shape(2, 4, 2, 33, 70, 64)
    q, k, v = (t.requires_grad_() for t in make_qkv(shape, dtype, seed=8, layout="bnhd"))
    kw = dict(causal=True, softcap=3.0, score_mod=mods.alibi(4))
    o, lse = flashfold.attention(q, k, v, return_lse=True, **kw)
    g = torch.Generator().manual_seed(9)
    do = torch.randn(o.shape, generator=g).to(dtype)
    dlse = torch.randn(lse.shape, generator=g)
    got = torch.autograd.grad((o, lse), (q, k, v), (do, dlse))
    want = _grads_ref(q, k, v, do, dlse, **kw)
    for n, a, b in zip("qkv", got, want):
        assert a.dtype == dtype and a.shape == b.shape
        assert_close(a, b, dtype, scale=_grad_scale(b), name=f"d{n}")


def test_expanded_and_strided_output_gradients():
    """dO from autograd may be expanded (stride 0, from .sum()) or strided: no copy needed
    on the CPU path, same gradients."""
    shape = Shape(1, 2, 2, 9, 11, 32)
    q, k, v = (t.requires_grad_() for t in make_qkv(shape, torch.float64, seed=10))
    got = torch.autograd.grad(flashfold.attention(q, k, v).sum(), (q, k, v))
    want = _grads_ref(q, k, v, torch.ones(1, 2, 9, 32, dtype=torch.float64))
    for n, a, b in zip("qkv", got, want):
        assert_close(a, b, "float64", scale=_grad_scale(b), name=f"d{n}")


def test_traced_mods_are_taken_with_and_without_gradients():
    """A TracedMod (a mod traced once, ``trace_score_mod`` / ``trace_mask_mod``) is taken as
    score_mod and as mask_mod whether or not the inputs require grad: the same output as
    the plain functions, and gradients through it."""
    shape = Shape(1, 2, 1, 9, 11, 32)
    q, k, v = make_qkv(shape, torch.float64, seed=14)
    score, mask = mods.alibi(2), mods.prefix_lm_mask(3)
    traced = dict(score_mod=trace_score_mod(score), mask_mod=trace_mask_mod(mask))
    want = flashfold.attention(q, k, v, score_mod=score, mask_mod=mask)
    assert_close(flashfold.attention(q, k, v, **traced), want, "float64", name="o, no grad")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = flashfold.attention(*leaves, **traced)
    assert_close(o, want, "float64", name="o, grad")
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(15), dtype=torch.float64)
    got = torch.autograd.grad(o, leaves, do)
    for n, a, b in zip("qkv", got, _grads_ref(q, k, v, do, score_mod=score, mask_mod=mask)):
        assert_close(a, b, "float64", scale=_grad_scale(b), name=f"d{n}")


def test_rows_without_visible_keys_have_zero_gradients():
    shape = Shape(1, 2, 1, 12, 5, 32)
    q, k, v = (t.requires_grad_() for t in make_qkv(shape, torch.float64, seed=11))
    o, lse = flashfold.attention(q, k, v, causal=True, return_lse=True)  # rows 0..6 see nothing
    do = torch.randn_like(o)
    dq, dk, dv = torch.autograd.grad((o, torch.where(torch.isfinite(lse), lse, 0.0)), (q, k, v),
                                     (do, torch.ones_like(lse)))
    assert (dq[:, :, :7] == 0).all() and torch.isfinite(dq).all()
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()
    o = flashfold.attention(q, k, v, mask_mod=lambda b, h, i, j: j < 0)      # nothing visible
    grads = torch.autograd.grad(o.sum(), (q, k, v))
    assert all((g == 0).all() for g in grads)


def test_deterministic_flag_cpu_bitwise():
    shape = Shape(2, 4, 2, 33, 40, 32)
    q, k, v = (t.requires_grad_() for t in make_qkv(shape, torch.float32, seed=12))
    runs = []
    for det in (True, True, False):
        o = flashfold.attention(q, k, v, causal=True, deterministic=det)
        runs.append(torch.autograd.grad((o * o).sum(), (q, k, v)))
    for a, b, c in zip(*runs):
        assert torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(TypeError, match="deterministic"):
        flashfold.attention(q, k, v, deterministic=1)


def test_double_backward_is_refused():
    shape = Shape(1, 1, 1, 4, 4, 32)
    q, k, v = (t.requires_grad_() for t in make_qkv(shape, torch.float64, seed=13))
    dq, = torch.autograd.grad(flashfold.attention(q, k, v).sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(dq.sum(), (q,))


def test_double_backward_through_a_gradient_penalty_is_refused():
    # eager: dq of create_graph=True used to be a constant of q (a penalty on it was
    # silently dropped from the gradient) where the custom op raises
    shape = Shape(1, 1, 1, 4, 4, 32)
    q, k, v = (t.requires_grad_() for t in make_qkv(shape, torch.float64, seed=13))
    dq, = torch.autograd.grad(flashfold.attention(q, k, v).sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError, match="flashfold.attention: double backward"):
        torch.autograd.grad((dq ** 2).sum() + q.sum(), (q,))
    grads = torch.autograd.grad(flashfold.attention(q, k, v).sum(), (q, k, v), create_graph=True)
    want = torch.autograd.grad(flashfold.attention(q, k, v).sum(), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(grads, want))


@pytest.mark.parametrize("custom_op", [False, True], ids=["autograd-function", "custom-op"])
def test_a_table_written_in_place_before_the_backward_is_refused(custom_op):
    """The backward recomputes P from the mods' tables: one written in place after the
    forward would give the gradients of other scores (silently); it raises instead, as
    torch does for a saved tensor modified in place."""
    shape = Shape(1, 2, 1, 5, 6, 32)
    q, k, v = (t.requires_grad_() for t in make_qkv(shape, torch.float64, seed=16))
    table = torch.randn(2, 11, generator=torch.Generator().manual_seed(17), dtype=torch.float64)
    smod = mods.relative_bias(table)
    key = fa_autograd.register_mods(smod, None)

    def fwd():
        return fa_autograd.attention_op(q, k, v, key=key, scale=0.3, use_kernel=False,
                                        custom_op=custom_op)[0]
    want = torch.autograd.grad(fwd().sum(), (q, k, v))
    o, orig = fwd(), table.clone()
    table.mul_(3.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        torch.autograd.grad(o.sum(), (q, k, v))
    table.copy_(orig)
    got = torch.autograd.grad(fwd().sum(), (q, k, v))        # a new forward reads it again
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("custom_op", [False, True], ids=["autograd-function", "custom-op"])
def test_a_numpy_table_written_in_place_before_the_backward_is_refused(custom_op):
    """The same for a NumPy table (an ``ops.Buffer`` kept by reference): NumPy writes move
    no version counter, so its contents stand for it; the backward used to read the new
    values without a word."""
    import numpy as np
    shape = Shape(1, 2, 1, 5, 6, 32)
    q, k, v = (t.requires_grad_() for t in make_qkv(shape, torch.float64, seed=16))
    slopes = np.array([0.5, -0.25])
    table = ops.Buffer(slopes)

    def smod(score, b, h, q_idx, kv_idx):
        return score + table[h] * ops.to_float(kv_idx - q_idx)
    key = fa_autograd.register_mods(smod, None)

    def fwd():
        return fa_autograd.attention_op(q, k, v, key=key, scale=0.3, use_kernel=False,
                                        custom_op=custom_op)[0]
    want = torch.autograd.grad(fwd().sum(), (q, k, v))
    o = fwd()
    slopes *= 3.0
    with pytest.raises(RuntimeError, match="NumPy table .* modified in place"):
        torch.autograd.grad(o.sum(), (q, k, v))
    slopes /= 3.0
    got = torch.autograd.grad(fwd().sum(), (q, k, v))        # a new forward reads it again
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("transform", ["vmap", "grad", "jacrev"])
def test_torch_func_transforms_raise_a_clear_error(transform):
    """vmap and the reverse-mode torch.func transforms are not supported: a clear error
    naming flashfold.attention and the transform (vmap used to fail inside the reference
    with torch's advice about in-place arithmetic; grad with one about autograd.Function
    internals). jvp (forward mode through the CPU forward's torch ops) still works."""
    shape = Shape(1, 2, 1, 4, 5, 32)
    q, k, v = make_qkv(shape, torch.float64, seed=18)
    if transform == "vmap":
        call = lambda: torch.func.vmap(lambda q: flashfold.attention(q, k, v))(  # noqa: E731
            torch.stack([q, q]))
    else:
        fn = getattr(torch.func, transform)
        call = lambda: fn(lambda k: flashfold.attention(q, k, v).sum())(k)  # noqa: E731
    with pytest.raises(RuntimeError, match=r"flashfold.attention.*torch\.func.*" + transform):
        call()
    tangent = torch.randn(k.shape, generator=torch.Generator().manual_seed(19),
                          dtype=torch.float64)
    got = torch.func.jvp(lambda k: flashfold.attention(q, k, v, causal=True), (k,),
                         (tangent,))[1]
    want = torch.func.jvp(lambda k: oracle(q, k, v, causal=True)[0], (k,), (tangent,))[1]
    assert_close(got, want, "float64", scale=max(1.0, float(want.abs().max())), name="jvp")


def test_backward_reference_matches_the_oracle_directly():
    """The blocked backward alone (no autograd machinery), with dlse and GQA, tiny tiles."""
    shape = Shape(2, 4, 2, 19, 23, 32)
    q, k, v = make_qkv(shape, torch.float64, seed=14)
    smod = mods.alibi(4)
    o, lse = fa_autograd.attention_op(q, k, v, key=fa_autograd.register_mods(smod, None),
                                      scale=0.2, right=2, use_kernel=False)
    g = torch.Generator().manual_seed(15)
    do, dlse = torch.randn(o.shape, generator=g, dtype=torch.float64), torch.randn(lse.shape, generator=g, dtype=torch.float64)
    traced = fa_autograd._ENTRIES[fa_autograd.register_mods(smod, None)].score
    got = fa_reference.backward_reference(do, q, k, v, o, lse, dlse, scale=0.2, right=2,
                                         score_mod=traced, block_m=5, block_n=7)
    want = _grads_ref(q, k, v, do, dlse, scale=0.2, window=(None, 2), score_mod=smod)
    for n, a, b in zip("qkv", got, want):
        assert_close(a, b, "float64", scale=_grad_scale(b), name=f"d{n}")


# --- torch.compile ------------------------------------------------------------------------------

class _Attn(nn.Module):
    def __init__(self, heads, docs, block_mask=None):
        super().__init__()
        self.score_mod = mods.alibi(heads)
        self.mask_mod = block_mask if block_mask is not None else mods.document_mask(docs)

    def forward(self, q, k, v):
        o = flashfold.attention(q, k, v, causal=True, score_mod=self.score_mod,
                                mask_mod=self.mask_mod)
        return (o * o).sum()


def _recording_backend(graphs):
    from torch._dynamo.backends.common import aot_autograd

    def compiler(kind):
        def fn(gm, example_inputs):
            graphs.append((kind, str(gm.graph)))
            return gm.forward
        return fn
    return aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))


@pytest.mark.parametrize("precomputed", [False, True], ids=["mask-mod", "block-mask"])
def test_torch_compile_fullgraph_forward_and_backward(precomputed):
    import torch._dynamo
    torch._dynamo.reset()
    shape = Shape(2, 4, 2, 24, 24, 32)
    docs = torch.tensor([0] * 10 + [1] * 14)
    bm = create_block_mask(mods.document_mask(docs), None, None, 24, 24, device="cpu",
                           BLOCK_SIZE=16) if precomputed else None
    model = _Attn(4, docs, bm)
    graphs = []
    compiled = torch.compile(model, fullgraph=True, backend=_recording_backend(graphs))
    q, k, v = (t.requires_grad_() for t in make_qkv(shape, torch.float32, seed=16))
    want = torch.autograd.grad(model(q, k, v), (q, k, v))
    loss = compiled(q, k, v)
    got = torch.autograd.grad(loss, (q, k, v))
    assert_close(loss, model(q, k, v), "float32", name="loss")
    for n, a, b in zip("qkv", got, want):
        assert torch.equal(a, b), f"d{n}: compiled and eager gradients differ"
    kinds = [kind for kind, _ in graphs]
    assert kinds == ["fw", "bw"], kinds                     # one graph each: no graph break
    assert "flashfold.attn_fwd" in graphs[0][1] and "flashfold.attn_bwd" in graphs[1][1]


def test_torch_compile_guards_on_the_mods():
    """A new mod object recompiles (the registry key is a trace-time constant guarded by
    the mod's identity); an in-place change of a captured table is seen without one."""
    import torch._dynamo
    torch._dynamo.reset()
    shape = Shape(1, 2, 1, 16, 16, 32)
    q, k, v = make_qkv(shape, torch.float32, seed=17)

    def f(q, k, v, smod):
        return flashfold.attention(q, k, v, score_mod=smod)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    slopes = torch.tensor([0.5, 0.25])
    for s in ([0.5, 0.25], [2.0, 1.0]):
        smod = mods.alibi(2, torch.tensor(s))
        assert_close(compiled(q, k, v, smod), flashfold.attention(q, k, v, score_mod=smod),
                     "float32", name=f"slopes {s}")
    smod = mods.alibi(2, slopes)
    before = compiled(q, k, v, smod)
    slopes.mul_(4.0)                                        # in place: same mod object
    after = compiled(q, k, v, smod)
    assert not torch.equal(before, after)
    assert_close(after, flashfold.attention(q, k, v, score_mod=smod), "float32", name="in place")


def test_torch_compile_varlen_fullgraph():
    import torch._dynamo
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k = varlen_inputs([5, 9, 3], [7, 9, 4], 2, 2, 32, torch.float32, seed=18)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        return flashfold.attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k).sum()
    got = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v), (q, k, v))
    want = torch.autograd.grad(f(q, k, v), (q, k, v))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# --- a small transformer, trained with flashfold and with SDPA --------------------------------------

class TinyTransformer(nn.Module):
    """Pre-norm decoder: token embedding, ``layers`` x (causal GQA attention + MLP), LM head."""

    def __init__(self, attn, vocab=53, dim=128, heads=4, kv_heads=2, layers=3):
        super().__init__()
        self.attn, self.heads, self.kv_heads, self.hd = attn, heads, kv_heads, dim // heads
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict(dict(
                n1=nn.LayerNorm(dim), q=nn.Linear(dim, dim), kv=nn.Linear(dim, 2 * kv_heads * self.hd),
                o=nn.Linear(dim, dim), n2=nn.LayerNorm(dim),
                mlp=nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)))))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        B, N = tokens.shape
        x = self.emb(tokens)
        for blk in self.blocks:
            h = blk["n1"](x)
            q = blk["q"](h).view(B, N, self.heads, self.hd).transpose(1, 2)         # (B, H, N, hd) view
            kv = blk["kv"](h).view(B, N, 2, self.kv_heads, self.hd)
            k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
            if self.attn == "flashfold":
                a = flashfold.attention(q, k, v, causal=True)
            else:
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + blk["o"](a.transpose(1, 2).reshape(B, N, -1))
            x = x + blk["mlp"](blk["n2"](x))
        return self.head(self.norm(x))


def _train(attn, steps=6):
    torch.manual_seed(0)
    model = TinyTransformer(attn).double()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    # a learnable stream: each row counts up by a row-specific stride (mod the vocabulary)
    starts, strides = torch.randint(0, 53, (3, 1), generator=g), torch.randint(1, 5, (3, 1), generator=g)
    tokens = (starts + strides * torch.arange(29)) % 53
    losses = []
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def test_small_transformer_trains_like_sdpa():
    ff, ref = _train("flashfold"), _train("sdpa")
    assert ff[-1] < ff[0]                                      # it learns
    assert_close(ff, ref, "float64", name="losses (flashfold vs SDPA)")
