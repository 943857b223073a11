"""The attention dispatch table and its policy (:mod:`flashfold.kernels.attention.dispatch`,
``flashfold.attention_policy``).

The policy is one immutable value: blocks nest and restore it (also on an exception), it
holds process-wide (autograd runs a CUDA backward on another thread), its switches are
checked, and each switch changes what the planners build: the Gluon rows, the forward's
guard, the backward's dQ mode, the backward's configuration without TMA. The launches are
built, not run (the planners' outputs are inspected), so these tests need no GPU.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

import flashfold
from flashfold.kernels import launcher
from flashfold.kernels.attention import bwd, dispatch, fwd, gluon_bwd, gluon_fwd
from flashfold.kernels.attention.dispatch import Policy

from test_attention_cases import Shape, make_qkv


@pytest.fixture(autouse=True)
def plain_env(monkeypatch):
    monkeypatch.delenv("FLASHFOLD_GLUON", raising=False)


def test_blocks_nest_and_restore_the_policy():
    assert dispatch.current() == Policy()
    with flashfold.attention_policy(gluon=False) as outer:
        assert dispatch.current() is outer and not outer.gluon and outer.tma
        with flashfold.attention_policy(tma=False) as inner:
            assert inner == Policy(gluon=False, tma=False)
        assert dispatch.current() is outer
        with pytest.raises(RuntimeError, match="inside"):
            with flashfold.attention_policy(strict_hidden=False):
                raise RuntimeError("inside")
        assert dispatch.current() is outer
    assert dispatch.current() == Policy()


def test_the_environment_switch_is_the_default_and_a_block_overrides_it(monkeypatch):
    monkeypatch.setenv("FLASHFOLD_GLUON", "0")
    assert dispatch.current() == Policy(gluon=False)
    with flashfold.attention_policy(gluon=True):
        assert dispatch.current().gluon
    with flashfold.attention_policy(tma=False):          # the block starts from the default
        assert dispatch.current() == Policy(gluon=False, tma=False)
    monkeypatch.setenv("FLASHFOLD_GLUON", "1")
    assert dispatch.current() == Policy()


def test_the_policy_holds_in_other_threads():
    """A CUDA backward runs on autograd's device thread: the block's policy reaches it."""
    seen = []
    with flashfold.attention_policy(atomic_dq=False):
        worker = threading.Thread(target=lambda: seen.append(dispatch.current()))
        worker.start()
        worker.join()
    assert seen == [Policy(atomic_dq=False)]


def test_blocks_closed_out_of_order_leave_the_open_ones_policy():
    """Two threads' blocks may close in either order: the policy is then the one of the
    block still open, and the default once both are closed (never a closed block's)."""
    a, b = flashfold.attention_policy(gluon=False), flashfold.attention_policy(tma=False)
    a.__enter__()
    b.__enter__()
    assert dispatch.current() == Policy(gluon=False, tma=False)
    a.__exit__(None, None, None)
    assert dispatch.current() == Policy(gluon=False, tma=False)    # b's, still open
    b.__exit__(None, None, None)
    assert dispatch.current() == Policy()
    # two threads, the first entered closing first
    entered, closed = threading.Event(), threading.Event()

    def other():
        with flashfold.attention_policy(strict_hidden=False):
            entered.set()
            closed.wait()
    with flashfold.attention_policy(gluon=False):
        worker = threading.Thread(target=other)
        worker.start()
        entered.wait()
    assert dispatch.current() == Policy(gluon=False, strict_hidden=False)
    closed.set()
    worker.join()
    assert dispatch.current() == Policy()


def test_a_block_object_can_be_entered_again():
    block = flashfold.attention_policy(atomic_dq=False)
    for _ in range(2):
        with block as policy:
            assert policy == dispatch.current() == Policy(atomic_dq=False)
        assert dispatch.current() == Policy()
    with block:
        with block:
            assert dispatch.current() == Policy(atomic_dq=False)
        assert dispatch.current() == Policy(atomic_dq=False)
    assert dispatch.current() == Policy()


def test_bad_switches_raise_naming_them_before_the_block():
    with pytest.raises(TypeError, match="^gluon_please: not a switch"):
        flashfold.attention_policy(gluon_please=False)
    with pytest.raises(TypeError, match="^tma: expected a bool, got int"):
        flashfold.attention_policy(tma=0)
    with pytest.raises(TypeError, match="^strict_hidden: expected a bool, got int"):
        Policy(strict_hidden=1)
    assert dispatch.current() == Policy()


def test_policies_are_values():
    """Hashable and equal by value: they key the plan caches."""
    assert Policy(tma=False) == Policy(tma=False) and Policy() != Policy(tma=False)
    assert len({Policy(), Policy(), Policy(gluon=False)}) == 2
    with pytest.raises(AttributeError):
        Policy().gluon = False


def _qkv(N=40, D=32, dtype=torch.float32):
    q, k, v = make_qkv(Shape(1, 2, 1, N, N, D), dtype, seed=0)
    return q, k, v, torch.randn_like(q)


def test_the_gluon_rows_follow_the_policy(monkeypatch):
    """Where the Gluon scopes hold (mocked), the table sends a call to Gluon exactly while
    the policy lets it; outside the scopes, never."""
    q, k, v, do = _qkv()
    monkeypatch.setattr(gluon_fwd, "eligible", lambda *a, **kw: True)
    monkeypatch.setattr(gluon_bwd, "eligible", lambda *a, **kw: True)
    fwd_kw = dict(scale=0.1, right=0)
    bwd_kw = dict(right=0, interpret=False)              # (as a launch built to compile)
    assert dispatch.forward_gluon(q, k, v, **fwd_kw)
    assert dispatch.backward_gluon(q, k, v, do, **bwd_kw)
    assert not dispatch.forward_gluon(q, k, v, **fwd_kw, policy=Policy(gluon=False))
    assert not dispatch.backward_gluon(q, k, v, do, **bwd_kw, policy=Policy(gluon=False))
    with flashfold.attention_policy(gluon=False):
        assert not dispatch.forward_gluon(q, k, v, **fwd_kw)
        assert not dispatch.backward_gluon(q, k, v, do, **bwd_kw)
    # a forced configuration is the Triton kernels'; so are the backward's dQ kernel
    # (atomic_dq=False) and the interpreter (by default the environment's TRITON_INTERPRET)
    assert not dispatch.forward_gluon(q, k, v, **fwd_kw, config=fwd.FwdConfig(16, 16))
    assert not dispatch.backward_gluon(q, k, v, do, **bwd_kw, config=bwd.default_config(
        q, 32, 32))
    assert not dispatch.backward_gluon(q, k, v, do, **bwd_kw, atomic_dq=False)
    assert dispatch.backward_gluon(q, k, v, do, **bwd_kw, atomic_dq=True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not dispatch.backward_gluon(q, k, v, do, right=0)
    monkeypatch.setattr(gluon_fwd, "eligible", lambda *a, **kw: False)
    monkeypatch.setattr(gluon_bwd, "eligible", lambda *a, **kw: False)
    assert not dispatch.forward_gluon(q, k, v, **fwd_kw)
    assert not dispatch.backward_gluon(q, k, v, do, **bwd_kw)


def _kernels(launches):
    return [launch[0] for launch in launches]


def test_strict_hidden_adds_the_guard_to_masked_forwards():
    q, k, v, _ = _qkv()
    kw = dict(scale=0.1, right=0)
    _, _, on, _ = fwd._plan(q, k, v, None, None, **kw, policy=Policy())
    _, _, off, _ = fwd._plan(q, k, v, None, None, **kw, policy=Policy(strict_hidden=False))
    assert _kernels(on) == [fwd._attn_fwd, fwd._attn_fwd_guard]
    assert _kernels(off) == [fwd._attn_fwd]


def test_atomic_dq_and_strict_nonfinite_shape_the_backward():
    """The default mode on these tiles adds dQ atomically; ``atomic_dq=False`` runs the dQ
    kernel; ``strict_nonfinite`` adds the guarded strict recompute of a causal call."""
    q, k, v, do = _qkv()
    o, lse = torch.zeros_like(q), torch.zeros(q.shape[:3])      # (launches built, not run)

    def kernels(policy):
        *_, launches = bwd.prepare_backward(do, q, k, v, o, lse, scale=0.1, right=0,
                                            policy=policy)
        return _kernels(launches)

    default = kernels(Policy())
    assert bwd._dq_convert in default and default.count(bwd._attn_bwd_dq) == 1   # (strict)
    assert kernels(Policy(atomic_dq=False)).count(bwd._attn_bwd_dq) == 2
    plain = kernels(Policy(strict_nonfinite=False))
    assert bwd._attn_bwd_dq not in plain and len(plain) == len(default) - 2


def test_without_tma_the_backward_takes_its_pointer_configuration(monkeypatch):
    """On sm_90 (mocked) the configuration comes from the Hopper table with TMA, and from
    the pointer table while the policy's ``tma`` is off."""
    monkeypatch.setattr(bwd, "_interpreting", lambda: False)
    monkeypatch.setattr(launcher, "capability", lambda device: (9, 0))
    q = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    with_tma = bwd.default_config(q, 128, 128, causal=True)
    assert with_tma.use_tma == (bwd.TensorDescriptor is not None)
    with flashfold.attention_policy(tma=False):
        pointers = bwd.default_config(q, 128, 128, causal=True)
    want = bwd.POINTER_BWD_CONFIGS[(128, False)]
    assert not pointers.use_tma and not pointers.atomic_dq
    assert (pointers.block_m, pointers.block_n, pointers.num_warps, pointers.num_stages,
            pointers.dq_block_m, pointers.dq_block_n, pointers.dq_warps,
            pointers.dq_stages) == want
    monkeypatch.setattr(fwd, "_interpreting", lambda: False)
    assert fwd.default_config(q, 128, 128).use_tma == (fwd.TensorDescriptor is not None)
    with flashfold.attention_policy(tma=False):
        assert not fwd.default_config(q, 128, 128).use_tma
