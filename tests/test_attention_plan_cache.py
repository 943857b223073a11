"""The attention forward's and backward's plan caches (``fwd._CACHE``, ``bwd._CACHE``,
:mod:`flashfold.kernels.plans`).

A repeated signature replays the launches recorded for it instead of running its host
code again. The replayed plan must compute what a fresh one computes with the new call's
tensors (bitwise: same kernels, same arguments), allocate new outputs and gradients on
every call, and be bypassed while a global its planner reads (in its module, or in the
Gluon modules it consults) is patched. A score_mod or block mask is part of the signature
by identity, its tables inputs of the plan. Runs the kernels under the interpreter on CPU machines.
"""

from __future__ import annotations

import pytest
import torch

import flashfold
from flashfold import mods
from flashfold.api import attention as api
from flashfold.kernels.attention import bwd, dispatch, fwd, gluon_bwd, gluon_fwd

from test_attention_cases import Shape, make_qkv, varlen_inputs

# These tests run the kernels under TRITON_INTERPRET on CPU tensors (as
# test_attention_backward_kernel.py does); on a CUDA machine the same cached paths are
# exercised by the GPU tests (test_attention_gluon.py, test_attention_gluon_bwd.py).
if torch.cuda.is_available():  # pragma: no cover - interpreter tests run on CPU machines
    pytest.skip("interpreter tests run on CPU machines", allow_module_level=True)


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    """Route flashfold.attention to the kernels; an empty cache before and after."""
    monkeypatch.setattr(api, "_use_kernel", lambda t: True)
    monkeypatch.delenv("FLASHFOLD_PLAN_CACHE", raising=False)
    fwd.plan_cache_clear()
    bwd.plan_cache_clear()
    yield
    fwd.plan_cache_clear()
    bwd.plan_cache_clear()


def _inputs(seed, N=40, D=32):
    """q, k, v of 2 query heads on 1 KV head, and dO."""
    q, k, v = make_qkv(Shape(1, 2, 1, N, N, D), torch.float32, seed=seed)
    return q, k, v, torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 100))


def _grads(q, k, v, do, **kw):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    return torch.autograd.grad(flashfold.attention(*leaves, **kw), leaves, do)


def test_a_repeated_signature_replays_what_a_fresh_plan_computes(monkeypatch):
    first = _grads(*_inputs(0), causal=True)
    assert fwd.plan_cache_info() == bwd.plan_cache_info() == {"hits": 0, "misses": 1, "size": 1}
    inputs = _inputs(1)                                  # same signature, other values
    replayed = _grads(*inputs, causal=True)
    assert fwd.plan_cache_info()["hits"] == bwd.plan_cache_info()["hits"] == 1
    monkeypatch.setenv("FLASHFOLD_PLAN_CACHE", "0")
    fresh = _grads(*inputs, causal=True)
    for a, b, c in zip(replayed, fresh, first):
        assert torch.equal(a, b)
        assert a.data_ptr() != c.data_ptr()              # new gradients on every call
    assert bwd.plan_cache_info()["hits"] == 1            # (the cache was off)


def test_a_replayed_forward_returns_new_outputs_equal_to_a_fresh_plans(monkeypatch):
    q, k, v, _ = _inputs(2)
    first = flashfold.attention(q, k, v, causal=True, return_lse=True)
    replayed = flashfold.attention(q, k, v, causal=True, return_lse=True)
    assert fwd.plan_cache_info() == {"hits": 1, "misses": 1, "size": 1}
    monkeypatch.setenv("FLASHFOLD_PLAN_CACHE", "0")
    fresh = flashfold.attention(q, k, v, causal=True, return_lse=True)
    for a, b, c in zip(replayed, fresh, first):
        assert torch.equal(a, b) and torch.equal(a, c)
        assert a.data_ptr() != c.data_ptr()              # new outputs on every call


def test_other_signatures_and_options_are_other_plans():
    q, k, v, do = _inputs(0)
    _grads(q, k, v, do, causal=True)
    _grads(q, k, v, do)                                  # dense: another plan
    _grads(q[:, :, :33], k[:, :, :33], v[:, :, :33], do[:, :, :33], causal=True)
    _grads(q, k, v, do, causal=True, deterministic=True)
    assert bwd.plan_cache_info() == {"hits": 0, "misses": 4, "size": 4}
    # the forward of the deterministic call is the causal call's
    assert fwd.plan_cache_info() == {"hits": 1, "misses": 3, "size": 3}
    flashfold.attention(q.half(), k.half(), v.half(), causal=True)        # another dtype
    assert fwd.plan_cache_info() == {"hits": 1, "misses": 4, "size": 4}


def _same(f):
    """Another function object that does what ``f`` does (a patch the call survives)."""
    return lambda *a, **kw: f(*a, **kw)


@pytest.mark.parametrize("family, module, name, value", [
    (bwd, bwd, "_alloc", lambda *a, **kw: torch.empty(*a, **kw)),
    (bwd, dispatch, "backward_gluon", lambda *a, **kw: False),
    (bwd, gluon_bwd, "eligible", lambda *a, **kw: False),
    (bwd, gluon_bwd, "STORE_TMA_MAX_STEPS", 0),
    (bwd, gluon_fwd, "on_hopper", lambda q: False),
    (fwd, fwd, "_alloc", lambda *a, **kw: torch.empty(*a, **kw)),
    (fwd, fwd, "default_config", _same(fwd.default_config)),
    (fwd, gluon_fwd, "eligible", lambda *a, **kw: False),
    (fwd, dispatch, "forward_gluon", lambda *a, **kw: False),
    (fwd, gluon_fwd, "PINGPONG_MAX_TILES", 0),
    (fwd, gluon_fwd, "FP8_PINGPONG_MIN_D", 0),
    (fwd, gluon_fwd, "on_hopper", lambda q: False),
], ids=["bwd-allocator", "bwd-dispatch-table", "bwd-gluon-dispatch", "bwd-store-rule",
        "bwd-on-hopper", "fwd-allocator", "fwd-config", "fwd-gluon-dispatch",
        "fwd-dispatch-table", "fwd-pingpong-rule", "fwd-fp8-pingpong-rule",
        "fwd-on-hopper"])
def test_a_patched_planner_global_bypasses_the_cache(monkeypatch, family, module, name, value):
    assert family._CACHE.caching()
    monkeypatch.setattr(module, name, value)
    assert not family._CACHE.caching()
    _grads(*_inputs(0), causal=True)
    assert family.plan_cache_info() == {"hits": 0, "misses": 0, "size": 0}


def test_the_policy_is_part_of_the_key():
    """A plan is keyed on the policy in force, not watched as a global: a block with
    another policy plans anew and replays its own plan on a repeat (both computing what a
    fresh plan computes), and the default's plans replay again after the block."""
    q, k, v, do = _inputs(0)
    plain = _grads(q, k, v, do, causal=True)
    with flashfold.attention_policy(atomic_dq=False, strict_hidden=False):
        assert fwd._CACHE.caching() and bwd._CACHE.caching()
        other = _grads(q, k, v, do, causal=True)
        again = _grads(q, k, v, do, causal=True)
    assert fwd.plan_cache_info() == bwd.plan_cache_info() == {"hits": 1, "misses": 2, "size": 2}
    after = _grads(q, k, v, do, causal=True)
    assert fwd.plan_cache_info() == bwd.plan_cache_info() == {"hits": 2, "misses": 2, "size": 2}
    for a, b, c, d in zip(plain, other, again, after):
        assert torch.equal(b, c) and torch.equal(a, d)
        torch.testing.assert_close(a, b)                 # (another dQ order: not bitwise)


def test_mods_replay_with_the_tables_of_the_call():
    """A score_mod and a block mask enter the plan's signature by identity and their
    tables as inputs: the second call with the same mods replays, bitwise what a fresh
    plan computes; a table written in place between calls is read as it is now; another
    mod object is another plan."""
    from flashfold.ops import Buffer
    table = torch.tensor([0.5, -0.25])
    bias = lambda s, b, h, qi, kj: s + Buffer(table)[h]  # noqa: E731
    bm = flashfold.create_block_mask(mods.prefix_lm_mask(9), None, None, 40, 40, device="cpu",
                                     BLOCK_SIZE=16)
    kw = dict(score_mod=bias, mask_mod=bm)
    inputs = _inputs(0)
    first = _grads(*inputs, **kw)
    table.mul_(-3.0)                                     # read by the replay, not the first
    replayed = _grads(*inputs, **kw)
    assert fwd.plan_cache_info()["hits"] == bwd.plan_cache_info()["hits"] == 1
    fwd.plan_cache_clear()
    bwd.plan_cache_clear()
    fresh = _grads(*inputs, **kw)
    assert fwd.plan_cache_info()["hits"] == bwd.plan_cache_info()["hits"] == 0
    for a, b, c in zip(replayed, fresh, first):
        assert torch.equal(a, b)
        assert not torch.equal(a, c)
    _grads(*inputs, score_mod=lambda s, b, h, qi, kj: s + Buffer(table)[h], mask_mod=bm)
    assert fwd.plan_cache_info()["misses"] == bwd.plan_cache_info()["misses"] == 2


def test_one_cu_seqlens_for_queries_and_keys_is_replayed():
    """Self-attention over packed sequences passes one ``cu_seqlens`` tensor for queries
    and keys: planned once with that aliasing and replayed (bitwise a fresh plan's), while
    a call with two equal but distinct offset tensors is another plan."""
    lens = [7, 0, 19, 12]
    q, k, v, cu, _ = varlen_inputs(lens, lens, 2, 1, 32, torch.float32, seed=3)
    kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    first = flashfold.attention(q, k, v, **kw)
    again = flashfold.attention(q, k, v, **kw)
    assert fwd.plan_cache_info() == {"hits": 1, "misses": 1, "size": 1}
    assert torch.equal(first, again)
    two = flashfold.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu.clone())
    assert fwd.plan_cache_info() == {"hits": 1, "misses": 2, "size": 2}
    assert torch.equal(first, two)


def test_a_packed_call_reads_its_offsets_once(monkeypatch):
    """The offsets drive the launch grid, so the call reads them on the host (one sync):
    the API validates them once, and the forward and the backward reuse what it read; an
    in-place write to the offsets is read again."""
    lens = [7, 0, 19, 12]
    q, k, v, cu, _ = varlen_inputs(lens, lens, 2, 1, 32, torch.float32, seed=4)
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist",
                        lambda t: reads.append(t) or real(t))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = flashfold.attention(*leaves, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    o.sum().backward()
    assert sum(t is cu for t in reads) == 1
    cu[2:] += 0                                          # a write: the version moves on
    flashfold.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert sum(t is cu for t in reads) == 2
