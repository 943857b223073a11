"""Gradients of ``flashfold.merge_states`` (pair and stacked forms) against a float64
oracle: the merge written with torch's ``logsumexp`` and ``softmax`` and differentiated by
autograd. On the CPU reference path and on the merge kernels (on CUDA where there is a
GPU, else under the interpreter): the kernels have no gradient of their own, and before
:class:`~flashfold.kernels.attention.autograd.MergeStates` their outputs silently did not
require one. Empty parts (``lse = -inf``) and rows whose parts are all empty get zero
gradients, never NaN.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashfold
from flashfold.api import attention as api
from flashfold.testing import assert_close

S, B, H, N, D = 3, 2, 2, 7, 16


def _parts(seed=0, dtype=torch.float32):
    """Stacked parts ``(S, B, H, N, D)``, ``(S, B, H, N)``: part 1 empty in row 2 of every
    head, every part empty in row 4, and one part far above the others in row 5."""
    g = torch.Generator().manual_seed(seed)
    outs = torch.randn(S, B, H, N, D, generator=g)
    lses = torch.randn(S, B, H, N, generator=g) * 3
    lses[1, :, :, 2] = -math.inf
    lses[:, :, :, 4] = -math.inf
    lses[0, :, :, 5] += 40.0
    return outs.to(dtype), lses


def _oracle(outs, lses, g_o, g_l):
    """Float64 gradients of ``<o, g_o> + <lse, g_l>`` by autograd of the textbook merge,
    on rows with a non-empty part (the others: zero, the documented rule)."""
    o64 = outs.detach().double().requires_grad_()
    l64 = lses.detach().double().requires_grad_()
    empty_row = (lses == -math.inf).all(0)
    safe = torch.where(empty_row.unsqueeze(0), 0.0, l64)         # (keeps autograd finite)
    lse = torch.logsumexp(safe, 0)
    w = torch.softmax(safe, 0)
    o = (w.unsqueeze(-1) * o64).sum(0)
    loss = (o * g_o.double()).sum() + (torch.where(empty_row, 0.0, lse) * g_l.double()).sum()
    d_o, d_l = torch.autograd.grad(loss, (o64, l64))
    zero = empty_row.unsqueeze(0)
    return torch.where(zero.unsqueeze(-1), 0.0, d_o), torch.where(zero, 0.0, d_l)


@pytest.fixture(params=["reference", "kernels"])
def path(request, monkeypatch):
    """``(name, device)``: the CPU reference; or the merge kernels, on CUDA where there is
    a GPU, else under the interpreter (on CPU tensors)."""
    if request.param == "kernels":
        if torch.cuda.is_available():
            return request.param, "cuda"
        monkeypatch.setattr(api, "_use_kernel", lambda t: True)
    return request.param, "cpu"


@pytest.mark.parametrize("uses", ["o-and-lse", "o", "lse"])
def test_stacked_merge_gradients(path, uses):
    path, dev = path
    outs, lses = (t.to(dev).requires_grad_() for t in _parts(1))
    o, lse = flashfold.merge_states(outs, lses)
    assert o.requires_grad and lse.requires_grad
    g = torch.Generator().manual_seed(2)
    g_o = (torch.randn(o.shape, generator=g) if uses != "lse" else torch.zeros(o.shape)).to(dev)
    g_l = (torch.randn(lse.shape, generator=g) if uses != "o" else torch.zeros(lse.shape)).to(dev)
    loss = 0
    if uses != "lse":
        loss = loss + (o * g_o).sum()
    if uses != "o":
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * g_l).sum()
    d_o, d_l = torch.autograd.grad(loss, (outs, lses), allow_unused=uses == "lse")
    if d_o is None:                        # lse does not depend on outs
        d_o = torch.zeros_like(outs)
    w_o, w_l = _oracle(outs, lses, g_o, g_l)
    assert_close(d_o, w_o, "float32", name=f"{path} d outs")
    assert_close(d_l, w_l, "float32", scale=10.0, name=f"{path} d lses")
    assert torch.isfinite(d_o).all() and torch.isfinite(d_l).all()
    assert (d_o[:, :, :, 4] == 0).all() and (d_l[1, :, :, 2] == 0).all()


def test_pair_merge_gradients(path):
    """The pair form gives each part the stacked form's gradient."""
    path, dev = path
    outs, lses = (t.to(dev) for t in _parts(3))
    pair = [t.clone().requires_grad_() for t in (outs[0], lses[0], outs[1], lses[1])]
    o, lse = flashfold.merge_states(*pair)
    g = torch.Generator().manual_seed(4)
    g_o, g_l = (torch.randn(t.shape, generator=g).to(dev) for t in (o, lse))
    loss = (o * g_o).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * g_l).sum()
    got = torch.autograd.grad(loss, pair)
    w_o, w_l = _oracle(outs[:2], lses[:2], g_o, g_l)
    for i, (a, b) in enumerate(zip(got, (w_o[0], w_l[0], w_o[1], w_l[1]))):
        assert_close(a, b, "float32", scale=10.0, name=f"{path} pair grad {i}")


def test_bf16_parts_get_bf16_gradients(path):
    path, dev = path
    outs, lses = (t.to(dev).requires_grad_() for t in _parts(5, torch.bfloat16))
    o, lse = flashfold.merge_states(outs, lses)
    g_o = torch.randn(o.shape, generator=torch.Generator().manual_seed(6)).to(dev)
    d_o, d_l = torch.autograd.grad((o.float() * g_o).sum(), (outs, lses))
    assert d_o.dtype == torch.bfloat16 and d_l.dtype == torch.float32
    w_o, w_l = _oracle(outs, lses, g_o, torch.zeros(lse.shape, device=dev))
    assert_close(d_o, w_o, "bfloat16", name=f"{path} d outs")
    assert_close(d_l, w_l, "bfloat16", scale=10.0, name=f"{path} d lses")


def test_without_gradients_nothing_is_recorded():
    outs, lses = _parts(7)
    o, lse = flashfold.merge_states(outs, lses)
    assert o.grad_fn is None and not o.requires_grad


def test_double_backward_is_refused_not_a_constant():
    # the parts' gradients under create_graph=True used to be constants of the parts: a
    # penalty on them was silently dropped from the gradient
    outs, lses = (t.requires_grad_() for t in _parts(8))
    d_outs, = torch.autograd.grad(flashfold.merge_states(outs, lses)[0].sum(), (outs,),
                                  create_graph=True)
    with pytest.raises(RuntimeError, match="flashfold.merge_states: double backward"):
        torch.autograd.grad((d_outs ** 2).sum(), (lses,))


def test_a_nan_reaches_only_the_gradients_that_depend_on_it(path):
    """A NaN in ``d o`` of one row reaches that row's gradients of the parts that weigh
    in it, not those of an empty part (zero weight) nor other rows; a NaN ``o_s`` of an
    empty part reaches nothing."""
    path, dev = path
    outs, lses = (t.to(dev) for t in _parts(9))
    outs[1, :, :, 2] = float("nan")                # part 1 is empty in row 2
    outs, lses = outs.requires_grad_(), lses.requires_grad_()
    o, lse = flashfold.merge_states(outs, lses)
    assert torch.isfinite(o).all()
    g_o = torch.ones_like(o)
    g_o[:, :, 2, 0] = float("nan")
    d_o, d_l = torch.autograd.grad((o * g_o).sum(), (outs, lses))
    bad_o, bad_l = ~torch.isfinite(d_o), ~torch.isfinite(d_l)
    assert bad_l[[0, 2]][:, :, :, 2].all() and not bad_l[1].any()
    assert bad_o[[0, 2]][:, :, :, 2, 0].all() and not bad_o[1].any()
    bad_l[:, :, :, 2] = False
    bad_o[:, :, :, 2, 0] = False
    assert not bad_l.any() and not bad_o.any()


def test_float64_parts_get_float64_gradients():
    """Float64 parts: gradients to float64 accuracy. The merged lse that ``merge_states``
    returns is float32; weights built from it bounded the gradients at ~1e-7 relative
    (gradcheck failed), so the backward recomputes it from the parts."""
    outs, lses = _parts(5, torch.float64)
    lses = lses.double()
    outs, lses = outs.requires_grad_(), lses.requires_grad_()
    o, lse = flashfold.merge_states(outs, lses)
    g = torch.Generator().manual_seed(6)
    g_o, g_l = (torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (o, lse))
    g_l = g_l.float().double()        # (lse is float32: the gradient reaching it is too)
    loss = (o * g_o).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * g_l).sum()
    d_o, d_l = torch.autograd.grad(loss, (outs, lses))
    assert d_o.dtype == d_l.dtype == torch.float64
    w_o, w_l = _oracle(outs, lses, g_o, g_l)
    assert_close(d_o, w_o, "float64", name="d outs")
    assert_close(d_l, w_l, "float64", name="d lses")
    a, b = (t[:, :1, :1, :3].detach().clone().requires_grad_() for t in (outs, lses))
    assert torch.autograd.gradcheck(lambda x, y: flashfold.merge_states(x, y)[0], (a, b))


@pytest.mark.parametrize("stacked", [False, True], ids=["pair", "stacked"])
def test_a_merge_of_parts_without_features_still_merges_the_lse(path, stacked):
    """Parts of head_dim 0 have no ``o`` to merge, but their LSEs still merge: the LSE is
    ``log sum_s e^{lse_s}`` on every path, never left unwritten."""
    _, dev = path
    _, lses = _parts(3)
    outs = torch.empty(S, B, H, N, 0, device=dev)
    lses = lses.to(dev)
    args = (outs, lses) if stacked else (outs[0], lses[0], outs[1], lses[1])
    o, lse = flashfold.merge_states(*args)
    want = torch.logsumexp(lses.double() if stacked else lses[:2].double(), 0)
    assert o.shape == (B, H, N, 0)
    assert_close(lse, want, "float32", name="lse")
