"""flashfold inside Hugging Face transformers (``flashfold.integrations.transformers``).

Small BERT-style (bidirectional, absolute positions) and Llama-style (causal, RoPE, GQA
4:2) models with random, seeded weights are built here and run with flashfold's attention
against the *eager* implementation in float64:

* without padding, against the eager model on the same batch;
* with padding (left, right, mixed), against the eager model run on each sequence alone
  (unpadded, same position ids): eager's own padded float64 batch is not a reference, as
  it softmaxes in float32, where float64's "-inf" (the dtype's minimum) overflows and a
  fully masked row becomes NaN and contaminates the next layer. Only the rows eager
  defines are compared (for BERT every row: its padded query rows still see real keys,
  and those are also checked against eager's padded batch).

flashfold runs in float32 (checked with the float32 tolerances) and in float64 (BERT:
float64 tolerances, the mask semantics must be exact; Llama: eager softmaxes in float32
even in a float64 model, so its reference is exact to float32 rounding only). Also:
decoding with a KV cache (dynamic and static), a decoder padding mask with holes, user 4-D
masks, torch.compile, the Triton kernels under the interpreter, the errors of unsupported
cases, and that ``import flashfold`` registers nothing.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashfold.integrations.transformers as fft  # noqa: E402
from flashfold.testing import assert_close  # noqa: E402
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

VOCAB = 97
SEQ = 13
#: padding patterns: number of (left, right) pad tokens per row of a batch of 4
PADDINGS = {
    "none": [(0, 0)] * 4,
    "left": [(0, 0), (5, 0), (1, 0), (12, 0)],
    "right": [(0, 0), (0, 4), (0, 1), (0, 12)],
    "mixed": [(0, 0), (3, 0), (0, 6), (2, 2)],
}
#: torch.compile backend of the compiled tests (inductor compiles ~90 s on 2 cores; set
#: FLASHFOLD_TEST_COMPILE_BACKEND=inductor to run it)
COMPILE_BACKEND = os.environ.get("FLASHFOLD_TEST_COMPILE_BACKEND", "aot_eager")


def _config(style: str, impl: str, **over):
    if style == "llama":
        over = {"head_dim": 32, **over}
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=64, **over)
    else:
        cfg = BertConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **over)
    cfg._attn_implementation = impl
    return cfg


def build(style: str, impl: str, dtype=torch.float32, **over):
    """The model with the seeded random weights (identical for every impl and dtype)."""
    cfg = _config(style, impl, **over)
    torch.manual_seed(1234)
    model = LlamaForCausalLM(cfg) if style == "llama" else BertModel(cfg)
    return model.to(dtype).eval()


def run(model, ids, mask=None, positions=None, **kw):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **kw)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def cache_kw(model, cache):
    """The cache keyword of this transformers version (``cache``, formerly
    ``past_key_values``)."""
    import inspect
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def batch(padding: str, seed=0):
    """``(ids (4, SEQ), mask (4, SEQ) or None, position ids or None)``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    if padding == "none":
        return ids, None, None
    mask = torch.ones(4, SEQ, dtype=torch.long)
    for b, (left, right) in enumerate(PADDINGS[padding]):
        mask[b, :left] = 0
        mask[b, SEQ - right:] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def reference_alone(ref_model, ids, mask):
    """The eager float64 model on each sequence alone: ``(B, S, ...)``, rows at padded
    positions left 0 (not compared)."""
    out = None
    for b in range(ids.shape[0]):
        real = mask[b].bool()
        if not real.any():
            continue
        r = run(ref_model, ids[b, real][None])[0]
        if out is None:
            out = torch.zeros(ids.shape + r.shape[-1:], dtype=r.dtype)
        out[b, real] = r
    return out


_MODELS: dict = {}


def model(style, impl, dtype):
    key = (style, impl, dtype)
    if key not in _MODELS:
        _MODELS[key] = build(style, impl, dtype)
    return _MODELS[key]


FF = fft.ATTN_IMPLEMENTATION


def check_against_eager(style, padding, ff_model, dtype, name):
    ids, mask, pos = batch(padding)
    ref = model(style, "eager", torch.float64)
    got = run(ff_model, ids, mask, pos)
    assert got.dtype == dtype and torch.isfinite(got).all()
    if style == "llama":
        # Llama's eager attention softmaxes in float32 even for a float64 model, so its
        # float64 outputs are exact to float32 rounding only: the float32 row applies
        dtype = torch.float32
    if mask is None:
        assert_close(got, run(ref, ids), dtype, name=f"{name}: no padding")
        return
    want = reference_alone(ref, ids, mask)
    real = mask.bool()
    assert_close(got[real], want[real], dtype, name=f"{name}: real rows vs each sequence alone")
    if style == "bert":
        # bidirectional: every query row (padded ones too) sees the real keys, as in eager
        full = mask.bool().any(1)
        assert_close(got[full], run(ref, ids, mask, pos)[full], dtype,
                     name=f"{name}: all rows vs eager's padded batch")


# --- registration ---------------------------------------------------------------------------

def test_import_flashfold_registers_nothing():
    code = ("import sys, flashfold; flashfold.attention; "
            "assert 'transformers' not in sys.modules, 'import flashfold imported transformers'; "
            "import transformers.masking_utils as mu; "
            "from transformers import AttentionInterface as A; "
            "assert 'flashfold' not in A._global_mapping and 'ff_attention' not in A._global_mapping; "
            "import flashfold.integrations.transformers as f; "
            "assert f.is_registered('flashfold') and f.is_registered('ff_attention'); "
            "assert 'ff_attention' in mu.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping; "
            "assert f.register() == f.ATTN_IMPLEMENTATION; print('ok')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_register_is_idempotent_and_names_the_usable_implementation():
    assert fft.register() == fft.register() == FF
    assert fft.is_registered(fft.NAME) and fft.is_registered(fft.ALIAS)
    # transformers 5.x treats names containing "flash" as FlashAttention kernels
    assert not fft._reserved_by_transformers(FF)
    assert fft.register("ff_attention_test") == "ff_attention_test"
    assert fft.is_registered("ff_attention_test")
    with pytest.raises(TypeError, match="name"):
        fft.register("")
    m = build("llama", FF)
    assert m.config._attn_implementation == FF


# --- eager and compiled, both model styles, with and without padding --------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("padding", list(PADDINGS))
@pytest.mark.parametrize("style", ["bert", "llama"])
def test_matches_eager(style, padding, dtype):
    check_against_eager(style, padding, model(style, FF, dtype), dtype, f"{style} {padding}")


@pytest.mark.parametrize("style", ["bert", "llama"])
def test_matches_eager_under_torch_compile(style):
    torch._dynamo.reset()
    compiled = torch.compile(build(style, FF), backend=COMPILE_BACKEND)
    for padding in ("none", "mixed"):
        check_against_eager(style, padding, compiled, torch.float32,
                            f"{style} {padding} compiled ({COMPILE_BACKEND})")


def test_padding_becomes_varlen_or_a_table():
    """The compact forms: no mask, packed rows (varlen), the boolean table otherwise."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function
    mk = fft._mask_function_impl
    m = mk(2, 5, 5, 0, 0, causal_mask_function, None)
    assert m.causal and not m.varlen and m.table is None
    pad = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    m = mk(2, 5, 5, 0, 0, causal_mask_function, pad)
    assert m.causal and m.varlen and m.table is None and m.kv_start is None   # right padding
    p = m.plan
    assert p.cu_seqlens_q.tolist() == [0, 3, 6] and p.cu_seqlens_k.tolist() == [0, 3, 6]
    assert p.q_index.tolist() == [2, 3, 4, 5, 6, 7] and p.k_index.tolist() == [2, 3, 4, 5, 6, 7]
    assert m.plan is p                                         # built once, shared
    m = mk(2, 5, 5, 0, 0, bidirectional_mask_function, pad)
    assert not m.causal and m.plan.q_index is None and m.plan.cu_seqlens_q.tolist() == [0, 5, 10]
    # a decode step (1 query, 4 cached keys): the real queries are the ones at real keys
    m = mk(2, 1, 5, 4, 0, causal_mask_function, pad)
    assert m.plan.cu_seqlens_q.tolist() == [0, 1, 1] and m.plan.q_index.tolist() == [0]
    # left padding (a row without real keys too): each row's first real key, on the device
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]],
                        dtype=torch.bool)
    m = mk(4, 1, 5, 4, 0, causal_mask_function, left)
    assert m.varlen and m.kv_start.dtype == torch.int32 and m.kv_start.tolist() == [2, 0, 5, 4]
    assert "plan" not in m.__dict__ and "left-padded" in repr(m)
    assert mk(4, 1, 5, 4, 0, bidirectional_mask_function, left).kv_start is None
    holes = torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    m = mk(2, 5, 5, 0, 0, causal_mask_function, holes)
    assert m.table is not None and m.table.shape == (2, 5, 5)
    assert m.table[0].tolist()[3] == [True, False, True, True, False]
    # a static cache (queries not at the end of the keys): HF's boolean table
    m = mk(2, 2, 8, 3, 0, causal_mask_function, None)
    assert m.table is not None and m.table[0, 0].tolist() == [True] * 4 + [False] * 4


# --- decoding --------------------------------------------------------------------------------

@pytest.mark.parametrize("padding", ["left", "none"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_llama_decoding_with_a_kv_cache(cache, padding, monkeypatch):
    """Prefill a batch, then 3 greedy steps; each step's logits against the eager float64
    model on the sequence so far, alone. Steps against a dynamic cache run flashfold.decode
    (split-KV), from each row's first real key when left-padded (without building the
    varlen plan: only the padded prefill packs); a static cache runs HF's boolean
    table."""
    from transformers import DynamicCache, StaticCache

    from flashfold.api import decode as api_decode
    calls = []
    inner = api_decode.decode
    monkeypatch.setattr(api_decode, "decode",
                        lambda *a, **k: calls.append(k.get("cache_start")) or inner(*a, **k))
    plans = []
    build_plan = fft._varlen_plan
    monkeypatch.setattr(fft, "_varlen_plan", lambda *a: plans.append(a[1]) or build_plan(*a))
    ff = model("llama", FF, torch.float32)
    ref = model("llama", "eager", torch.float64)
    ids, mask, _ = batch(padding, seed=5)
    if mask is None:
        mask = torch.ones_like(ids)
    kv = (DynamicCache(config=ff.config) if cache == "dynamic"
          else StaticCache(config=ff.config, max_cache_len=SEQ + 8))
    seq, am = ids, mask
    step_ids, pos = ids, (mask.cumsum(-1) - 1).clamp(min=0)
    for step in range(4):
        with torch.no_grad():
            out = ff(input_ids=step_ids, attention_mask=am, position_ids=pos, use_cache=True,
                     **cache_kw(ff, kv))
        logits = out.logits[:, -1]
        want = torch.stack([run(ref, seq[b, am[b].bool()][None])[0, -1]
                            for b in range(seq.shape[0])])
        assert_close(logits, want, torch.float32, name=f"{cache} cache, step {step}")
        nxt = logits.argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
        am = torch.cat([am, torch.ones_like(nxt)], 1)
        step_ids, pos = nxt, pos[:, -1:] + 1
    uses_decode = cache == "dynamic"
    assert len(calls) == (3 * 2 if uses_decode else 0)      # 3 steps x 2 layers
    if uses_decode:
        first = (mask == 0).sum(1).to(torch.int32)           # left padding: the pad count
        assert all((s is None) == (padding == "none") for s in calls)
        assert all(torch.equal(s, first) for s in calls if s is not None)
    # the varlen plan: built once, for the padded prefill (shared by its 2 layers)
    assert plans == ([SEQ] if padding == "left" and cache == "dynamic" else []), plans


def test_llama_left_padded_multi_token_steps(monkeypatch):
    """Left-padded prefill, then steps of 3 tokens (as speculative decoding verifies draft
    tokens) against a dynamic cache: flashfold.decode with each row's first real key,
    every step's 3 rows against the eager float64 model on the sequence so far, alone
    (one row is padding up to its last prefill token)."""
    from transformers import DynamicCache

    from flashfold.api import decode as api_decode
    calls = []
    inner = api_decode.decode
    monkeypatch.setattr(api_decode, "decode",
                        lambda *a, **k: calls.append(k["cache_start"]) or inner(*a, **k))
    ff = model("llama", FF, torch.float32)
    ref = model("llama", "eager", torch.float64)
    ids, mask, _ = batch("left", seed=8)
    mask[3, :SEQ - 1] = 0                                 # one real token
    g = torch.Generator().manual_seed(2)
    kv = DynamicCache(config=ff.config)
    seq, am = ids, mask
    step_ids, pos = ids, (mask.cumsum(-1) - 1).clamp(min=0)
    for step in range(3):
        with torch.no_grad():
            logits = ff(input_ids=step_ids, attention_mask=am, position_ids=pos, use_cache=True,
                        **cache_kw(ff, kv)).logits
        if step:
            for b in range(seq.shape[0]):
                want = run(ref, seq[b, am[b].bool()][None])[0, -3:]
                assert_close(logits[b], want, torch.float32, name=f"step {step}, row {b}")
        step_ids = torch.randint(0, VOCAB, (4, 3), generator=g)
        seq = torch.cat([seq, step_ids], 1)
        am = torch.cat([am, torch.ones_like(step_ids)], 1)
        pos = pos[:, -1:] + torch.arange(1, 4)
    assert len(calls) == 2 * 2 and all(c.tolist() == [0, 5, 1, SEQ - 1] for c in calls)


def _qkv_step(S=3, L=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, h, n, 32, generator=g, dtype=torch.float64)
            for h, n in ((4, S), (2, L), (2, L))]


def test_left_padded_step_equals_the_varlen_path(monkeypatch):
    """The attention function on a left-padded 3-token step: flashfold.decode over the
    unpacked cache gives what the varlen path (packing, flashfold.attention) gives, padded
    query rows included (0: a row whose first real key comes after the query, a row with
    no real key); against the naive masked attention on the real rows. A step whose new
    token is padding (not left padding) keeps the varlen path."""
    from flashfold.api import decode as api_decode
    from flashfold.kernels.attention.reference import naive_attention
    import flashfold
    calls = []
    inner = api_decode.decode
    monkeypatch.setattr(api_decode, "decode", lambda *a, **k: calls.append(1) or inner(*a, **k))
    q, k, v = _qkv_step()
    S, L = q.shape[2], k.shape[2]
    module = torch.nn.Module()
    pad = torch.ones(4, L, dtype=torch.long)
    for b, first in enumerate([0, 4, 9, L]):              # row 2: query row 0 (position 8)
        pad[b, :first] = 0                                 # is padding; row 3: no real key
    out, _ = fft.flashfold_attention_forward(module, q, k, v, pad)
    assert len(calls) == 1
    padding = pad.bool()
    want = fft._varlen(flashfold.attention, "test", q, k, v, fft._varlen_plan(padding, S, True),
                       True, {})
    assert_close(out, want, torch.float64, name="decode path vs varlen path")
    assert torch.equal(out[2, 0], torch.zeros_like(out[2, 0])) and not out[3].any()
    visible = padding[:, None, :] & (torch.arange(L)[None, :] <= torch.arange(S)[:, None] + L - S)
    ref, _ = naive_attention(q, k, v, mask_mod=lambda b, h, i, j: visible[b, i, j])
    real = visible.any(-1)                                 # (B, S): rows with a key
    assert_close(out[real], ref.transpose(1, 2)[real], torch.float64, name="vs naive")
    # the newest token is padding in row 1: not left padding, the varlen path
    pad[1, -1] = 0
    out, _ = fft.flashfold_attention_forward(module, q, k, v, pad)
    assert len(calls) == 1
    want = fft._varlen(flashfold.attention, "test", q, k, v, fft._varlen_plan(pad.bool(), S, True),
                       True, {})
    assert torch.equal(out, want) and not out[1, -1].any()


@pytest.mark.parametrize("padding", ["left", "none"])
def test_step_with_a_value_head_dim_of_its_own(padding):
    """A KV-cache step whose values have their own head dim (``Dv != D``, as the attention
    function's contract allows: MLA-style models) is answered, not refused by
    flashfold.decode (whose cache holds K and V of one shape): against the naive masked
    attention on the rows with a real key."""
    from flashfold.kernels.attention.reference import naive_attention
    g = torch.Generator().manual_seed(6)
    B, S, L = 3, 2, 9
    q, k, v = (torch.randn(B, h, n, d, generator=g, dtype=torch.float64)
               for h, n, d in ((4, S, 32), (2, L, 32), (2, L, 16)))
    pad = torch.ones(B, L, dtype=torch.long)
    if padding == "left":
        pad[1, :3] = pad[2, :8] = 0
    module = torch.nn.Module()
    out, _ = fft.flashfold_attention_forward(module, q, k, v, pad)
    assert out.shape == (B, S, 4, 16)
    causal = torch.arange(L)[None, :] <= torch.arange(S)[:, None] + L - S
    visible = pad.bool()[:, None, :] & causal
    ref, _ = naive_attention(q, k, v, mask_mod=lambda b, h, i, j: visible[b, i, j])
    real = visible.any(-1)
    assert_close(out[real], ref.transpose(1, 2)[real], torch.float64, name=f"Dv != D, {padding}")


def test_decoder_padding_with_holes_uses_the_table():
    """A causal mask whose padding has holes is not one run per row: HF's boolean table.
    Every row sees key 0, so eager's float64 padded batch is defined on all rows."""
    ids, _, _ = batch("none", seed=7)
    mask = torch.ones(4, SEQ, dtype=torch.long)
    mask[1, 3:6] = 0
    mask[2, 1::3] = 0
    mask[3, 2] = 0
    got = run(model("llama", FF, torch.float32), ids, mask)
    want = run(model("llama", "eager", torch.float64), ids, mask)
    assert_close(got, want, torch.float32, name="llama, padding with holes")


def test_llama_packed_sequences():
    """Two sequences packed in one row (position ids restart, no attention_mask, no cache):
    HF's packed-sequence mask (a table for flashfold); each against the sequence alone."""
    ids, _, _ = batch("none", seed=9)
    row = torch.cat([ids[0, :6], ids[1, :7]])[None]
    pos = torch.cat([torch.arange(6), torch.arange(7)])[None]
    got = run(model("llama", FF, torch.float32), row, None, pos, use_cache=False)[0]
    ref = model("llama", "eager", torch.float64)
    want = torch.cat([run(ref, ids[0, :6][None])[0], run(ref, ids[1, :7][None])[0]])
    assert_close(got, want, torch.float32, name="llama, packed sequences")


def test_cu_seq_lens_kwargs_without_a_mask():
    """The FlashAttention-style packed call: ``cu_seq_lens_q/k`` kwargs and no mask."""
    from flashfold.kernels.attention.reference import naive_attention
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, 11, 32, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    cu = torch.tensor([0, 4, 4, 11])
    module = torch.nn.Module()
    module.is_causal = True
    out, weights = fft.flashfold_attention_forward(module, q, k, v, None, cu_seq_lens_q=cu,
                                                   cu_seq_lens_k=cu)
    want, _ = naive_attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert weights is None and out.shape == (1, 11, 4, 32)
    assert_close(out, want.transpose(1, 2), torch.float64, name="cu_seq_lens kwargs")


@pytest.mark.parametrize("style", ["bert", "llama"])
def test_training_gradients_match_eager(style):
    """Dropout-free training through the integration: the loss and the gradients of the
    first layer's attention projections against the eager float64 model (right padding:
    every query row of eager's batch is defined)."""
    ff, ref = build(style, FF).train(), build(style, "eager", torch.float64).train()
    ids, mask, pos = batch("right", seed=11)
    for m in (ff, ref):
        out = m(input_ids=ids, attention_mask=mask, position_ids=pos)
        h = out.logits if hasattr(out, "logits") else out.last_hidden_state
        w = torch.randn(h.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        (h.double() * w * mask[..., None]).sum().backward()       # a random linear loss
    layer = (lambda m: m.model.layers[0].self_attn) if style == "llama" else \
        (lambda m: m.encoder.layer[0].attention.self)
    for name in ("q_proj", "k_proj", "v_proj") if style == "llama" else ("query", "key", "value"):
        g, want = getattr(layer(ff), name).weight.grad, getattr(layer(ref), name).weight.grad
        assert_close(g, want, torch.float32, scale=float(want.abs().max()),
                     name=f"{style} d loss / d {name}")


def test_training_two_table_masks_before_one_backward():
    """Two micro-batches whose decoder masks have holes (boolean tables of one shape) run
    forward before a single backward: each layer's backward reads the table of its own
    forward, not the one a later call brought (the loss's gradient against eager)."""
    ids, _, _ = batch("none", seed=12)
    masks = [torch.ones(4, SEQ, dtype=torch.long) for _ in range(2)]
    masks[0][1, 3:6] = masks[0][3, 2] = 0
    masks[1][2, 1::3] = masks[1][0, 4:9] = 0
    ff, ref = build("llama", FF).train(), build("llama", "eager", torch.float64).train()
    w = torch.randn(4, SEQ, VOCAB, generator=torch.Generator().manual_seed(5),
                    dtype=torch.float64)
    for m in (ff, ref):
        losses = [(m(input_ids=ids, attention_mask=mask).logits.double() * w).sum()
                  for mask in masks]
        sum(losses).backward()
    for name in ("q_proj", "k_proj", "v_proj"):
        g = getattr(ff.model.layers[0].self_attn, name).weight.grad
        want = getattr(ref.model.layers[0].self_attn, name).weight.grad
        assert_close(g, want, torch.float32, scale=float(want.abs().max()),
                     name=f"d loss / d {name}, two micro-batches")


# --- user 4-D masks -------------------------------------------------------------------------

def _dense_mask(seed=3):
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(4, 1, SEQ, SEQ, generator=g) < 0.6
    keep[..., 0] = True                                   # every row sees a key
    return keep


@pytest.mark.parametrize("kind", ["bool", "float 0/-inf", "float 0/min"])
def test_bert_user_4d_mask(kind):
    keep = _dense_mask()
    ids, _, _ = batch("none", seed=2)
    ref = model("bert", "eager", torch.float64)
    additive = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(
        ~keep, torch.finfo(torch.float64).min)
    want = run(ref, ids, additive)
    if kind == "bool":
        m = keep
    else:
        low = -torch.inf if kind == "float 0/-inf" else torch.finfo(torch.float32).min
        m = torch.zeros(keep.shape).masked_fill(~keep, low)
    got = run(model("bert", FF, torch.float32), ids, m)
    assert_close(got, want, torch.float32, name=f"bert, 4-D {kind} mask")


@pytest.mark.parametrize("kind", ["bool", "float 0/min"])
def test_bert_user_4d_mask_broadcast_over_queries(kind):
    """A ``(B, 1, 1, L)`` mask (SDPA broadcasts it over the query rows) is key padding:
    the same outputs as eager with the mask spelled out per row, a batch row with no
    hidden key included."""
    g = torch.Generator().manual_seed(4)
    keep = torch.rand(4, 1, 1, SEQ, generator=g) < 0.6
    keep[..., 0] = True                                   # every row sees a key
    keep[1] = True                                        # a row without padding
    ids, _, _ = batch("none", seed=2)
    ref = model("bert", "eager", torch.float64)
    additive = torch.zeros(4, 1, SEQ, SEQ, dtype=torch.float64).masked_fill(
        ~keep.expand(4, 1, SEQ, SEQ), torch.finfo(torch.float64).min)
    want = run(ref, ids, additive)
    m = keep if kind == "bool" else torch.zeros(keep.shape).masked_fill(
        ~keep, torch.finfo(torch.float32).min)
    got = run(model("bert", FF, torch.float32), ids, m)
    assert_close(got, want, torch.float32, name=f"bert, (B, 1, 1, L) {kind} mask")


def test_integer_4d_mask_other_than_0_1_is_refused():
    """An int mask of 0 / -10^9 (an additive bias in ints) would read 0 as hidden."""
    ids, _, _ = batch("none")
    keep = _dense_mask()
    with pytest.raises(NotImplementedError, match="integer 4-D attention_mask"):
        run(model("bert", FF, torch.float32), ids, (keep.long() - 1) * 10**9)
    got = run(model("bert", FF, torch.float32), ids, keep.long())      # 1 / 0: as bool
    assert torch.equal(got, run(model("bert", FF, torch.float32), ids, keep))


def test_additive_float_bias_is_refused():
    ids, _, _ = batch("none")
    bias = torch.randn(4, 1, SEQ, SEQ)
    with pytest.raises(NotImplementedError, match="additive attention bias"):
        run(model("bert", FF, torch.float32), ids, bias)


# --- unsupported cases ---------------------------------------------------------------------

def test_attention_dropout_in_training_is_refused():
    m = build("llama", FF, attention_dropout=0.1).train()
    ids, _, _ = batch("none")
    with pytest.raises(NotImplementedError, match="dropout"):
        m(input_ids=ids)
    m.eval()                                              # inference: dropout is 0
    with torch.no_grad():
        m(input_ids=ids)


def test_output_attentions_is_refused():
    ids, _, _ = batch("none")
    with pytest.raises(NotImplementedError, match="output_attentions"):
        run(model("llama", FF, torch.float32), ids, output_attentions=True)


def test_unsupported_head_dim_names_it(monkeypatch):
    """Past the GPU kernels' 256 (the kernel path forced on CPU tensors) the error names the
    layer; the CPU reference itself takes the head dim."""
    from flashfold.api import attention as api
    m = build("llama", FF, head_dim=264)
    ids, _, _ = batch("none")
    run(m, ids)
    monkeypatch.setattr(api, "_use_kernel", lambda q: True)
    with pytest.raises(ValueError, match="head_dim must be in 1..256 for the GPU") as e:
        run(m, ids)
    assert "LlamaAttention" in str(e.value)


def test_unsupported_mask_types_are_named():
    q = torch.randn(1, 2, 4, 32)
    with pytest.raises(NotImplementedError, match="attention_mask of type"):
        fft.flashfold_attention_forward(torch.nn.Module(), q, q, q, object())
    with pytest.raises(ValueError, match="attention_mask"):
        fft.flashfold_attention_forward(torch.nn.Module(), q, q, q, torch.ones(1, 4, 4,
                                                                               dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="s_aux"):
        fft.flashfold_attention_forward(torch.nn.Module(), q, q, q, None, s_aux=torch.zeros(2))
    with pytest.raises(NotImplementedError, match="per-head"):
        fft.flashfold_attention_forward(torch.nn.Module(), q, q, q,
                                        torch.ones(1, 2, 4, 4, dtype=torch.bool))


# --- the Triton kernels (interpreter) ---------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs benchmarks/transformers_gpu.py")
@pytest.mark.parametrize("style", ["bert", "llama"])
def test_models_through_the_kernels_under_the_interpreter(style, monkeypatch):
    """The dispatch forced to the Triton kernels on CPU tensors (TRITON_INTERPRET=1): the
    varlen path (padding) and the plain path, in float32."""
    from flashfold.api import attention as api
    from flashfold.kernels.attention import fwd
    monkeypatch.setattr(api, "_use_kernel", lambda t: True)
    monkeypatch.setattr(fwd, "default_config",
                        lambda q, d, dv, causal=False: fwd.FwdConfig(16, 16, use_tma=False))
    ff = build(style, FF)
    for padding in ("none", "mixed"):
        check_against_eager(style, padding, ff, torch.float32, f"{style} {padding} (kernels)")


# --- the GPU script ---------------------------------------------------------------------------

def test_gpu_script_dry_run(monkeypatch, capsys):
    """``benchmarks/transformers_gpu.py --cpu``: every code path of the script the lead runs
    on the GPU (checks, decoding, timing table), on the CPU in float32 at toy sizes."""
    from bench_script import load_benchmark
    from flashfold.kernels.attention import fwd
    monkeypatch.setattr(fwd, "attention_forward", fwd.attention_forward)   # restored after
    mod = load_benchmark("transformers_gpu", "transformers_gpu")
    assert mod.main(["--cpu"]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out and "ff / sdpa" in out and "BAD" not in out


def test_gpu_script_error_keeps_a_nan_of_any_row(monkeypatch, capsys):
    """The script's errors over a batch are NaN when any sequence's output holds a NaN
    (Python's ``max`` keeps the first of a NaN and a number), so the verdict fails: the
    prefill rows and the decode steps (which have no separate finiteness check)."""
    from bench_script import load_benchmark
    mod = load_benchmark("transformers_gpu", "transformers_gpu_nan")
    want = torch.zeros(3, 5, 4, dtype=torch.float64)
    out = want.clone().float()
    out[1, 2, 0] = float("nan")
    rows = [(torch.ones(5, dtype=torch.bool), want[b]) for b in range(3)]
    e = mod.max_err(out, rows)
    assert math.isnan(e)
    assert math.isnan(mod.max_err(out[:, 2], [(slice(None), want[b, 2]) for b in range(3)]))
    mod.verdict("a NaN in sequence 1", e, 1e-3, 1e-3)
    assert mod.FAILED == ["a NaN in sequence 1"]


@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "bidirectional"])
def test_sliding_window_kwarg_without_a_mask(is_causal):
    """``sliding_window`` with no mask bounds both sides of a bidirectional layer, as the
    FlashAttention path (``window_size=(w - 1, w - 1)``); a causal one looks back only."""
    from flashfold.kernels.attention.reference import naive_attention
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, h, 9, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    module = torch.nn.Module()
    module.is_causal = is_causal
    out, _ = fft.flashfold_attention_forward(module, q, k, v, None, sliding_window=3)
    want, _ = naive_attention(q, k, v, causal=is_causal, window=(2, None if is_causal else 2))
    assert_close(out, want.transpose(1, 2), torch.float64, name="sliding_window kwarg")


def _windowed_reference(q, k, v, real, sliding_window, is_causal):
    """float64 attention of ``q (B, Hq, S, D)`` over ``k``, ``v`` ``(B, Hkv, L, D)`` where
    query ``i`` (position ``p = L - S + i``) sees key ``j`` iff ``real[b, j]`` and ``p - (w
    - 1) <= j`` and ``j <= p`` (causal) or ``j <= p + (w - 1)`` (bidirectional): ``(out
    (B, S, Hq, D), visible rows (B, S))``."""
    B, Hq, S, D = q.shape
    L = k.shape[2]
    g = Hq // k.shape[1]
    kk, vv = (t.double().repeat_interleave(g, dim=1) for t in (k, v))
    p = torch.arange(L - S, L).view(S, 1)
    j = torch.arange(L).view(1, L)
    w = sliding_window - 1
    vis = (j >= p - w) & ((j <= p) if is_causal else (j <= p + w))
    vis = vis[None] & real.bool()[:, None, :]                       # (B, S, L)
    s = torch.einsum("bhid,bhjd->bhij", q.double(), kk) / D ** 0.5
    s = s.masked_fill(~vis[:, None], -torch.inf)
    o = torch.einsum("bhij,bhjd->bhid", torch.softmax(s, -1).nan_to_num(0.0), vv)
    return o.transpose(1, 2), vis.any(-1)


@pytest.mark.parametrize("padding", ["none", "left", "right", "mixed", "holes"])
@pytest.mark.parametrize("q_len", [9, 2], ids=["prefill", "step"])
@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "bidirectional"])
def test_sliding_window_kwarg_with_a_2d_padding_mask(is_causal, q_len, padding):
    """A 2-D padding mask encodes no window (eager's 4-D masks do; the FlashAttention path
    takes this one and applies ``sliding_window`` to it): the window applies together
    with the padding, as without a mask (Mistral-style models handed the 2-D mask)."""
    g = torch.Generator().manual_seed(6)
    L = 9
    q = torch.randn(3, 4, q_len, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(3, 2, L, 16, generator=g, dtype=torch.float64) for _ in range(2))
    real = torch.ones(3, L, dtype=torch.long)
    pads = {"none": [], "left": [(1, 0, 3), (2, 0, 6)], "right": [(1, 6, L), (2, 8, L)],
            "mixed": [(0, 0, 2), (1, 7, L)], "holes": [(1, 3, 5), (2, 0, 1)]}[padding]
    for b, lo, hi in pads:
        real[b, lo:hi] = 0
    module = torch.nn.Module()
    module.is_causal = is_causal
    out, _ = fft.flashfold_attention_forward(module, q, k, v, real, sliding_window=3)
    want, rows = _windowed_reference(q, k, v, real, 3, is_causal)
    assert_close(out[rows], want[rows], torch.float64, name=f"window with a {padding} mask")


def test_padding_mask_of_another_batch_is_refused():
    """A 2-D padding mask must be ``(batch, kv_len)``, padded or not (never broadcast or
    read past its rows)."""
    q = torch.randn(2, 2, 4, 16, dtype=torch.float64)
    module = torch.nn.Module()
    for is_causal in (True, False):
        module.is_causal = is_causal
        for mask in (torch.ones(3, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long)):
            with pytest.raises(ValueError, match="attention_mask"):
                fft.flashfold_attention_forward(module, q, q, q, mask)
