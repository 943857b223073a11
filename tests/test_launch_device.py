"""Kernels launch on their inputs' device, not on whatever device is current.

Triton launches on the current CUDA device. A model whose layers sit on several GPUs
(``device_map="auto"``) calls flashfold with tensors on ``cuda:1`` while ``cuda:0`` is
current, so every kernel family enters :func:`flashfold.kernels.launcher.on_device` with
its inputs' device around its launches. Checked here on the CPU: what ``on_device``
returns for each case, and that attention (forward and backward), merge_states, decode
and the reductions enter it with the right device while their kernels run under the
interpreter.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import flashfold as ff
from flashfold.api import attention as api_attention
from flashfold.api import decode as api_decode
from flashfold.api import reductions as api_reductions
from flashfold.kernels import launcher
from flashfold.kernels.attention import fwd

# the kernels run under the interpreter on CPU tensors here; on a CUDA machine the same
# routing would send them to the GPU, as the other interpreter test files skip there too
if torch.cuda.is_available():  # pragma: no cover - the interpreter runs on CPU machines
    pytest.skip("interpreter tests run on CPU machines", allow_module_level=True)


def test_on_device_switches_only_when_needed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    null = launcher.on_device(torch.device("cpu"))
    assert isinstance(null, contextlib.nullcontext)
    assert launcher.on_device(torch.device("cuda", 0)) is null
    other = launcher.on_device(torch.device("cuda", 1))
    assert isinstance(other, torch.cuda.device) and other.idx == 1


@pytest.fixture
def entered(monkeypatch):
    """The devices ``on_device`` was entered with, kernels routed to the interpreter."""
    seen = []
    real = launcher.on_device

    def spy(device):
        seen.append(torch.device(device))
        return real(device)
    monkeypatch.setattr(launcher, "on_device", spy)
    monkeypatch.setattr(api_attention, "_use_kernel", lambda t: True)
    monkeypatch.setattr(api_decode, "_use_kernels", lambda t: True)
    monkeypatch.setattr(api_reductions, "_use_kernels", lambda t: True)
    monkeypatch.setattr(fwd, "default_config",
                        lambda q, d, dv, causal=False: fwd.FwdConfig(16, 16, use_tma=False))
    return seen


def test_attention_forward_and_backward(entered):
    q, k, v = (torch.randn(1, 2, 20, 32, requires_grad=True) for _ in range(3))
    ff.attention(q, k, v, causal=True).sum().backward()
    assert entered.count(torch.device("cpu")) >= 2          # forward, then backward
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_merge_states(entered):
    o = torch.randn(2, 1, 2, 5, 16)
    lse = torch.randn(2, 1, 2, 5)
    ff.merge_states(o, lse)
    assert entered == [torch.device("cpu")]


def test_decode(entered):
    q = torch.randn(2, 4, 1, 16)
    k = torch.randn(2, 2, 40, 16)
    ff.decode(q, k, torch.randn_like(k), torch.tensor([40, 7], dtype=torch.int32))
    assert entered and set(entered) == {torch.device("cpu")}


def test_reductions(entered):
    ff.logsumexp(torch.randn(3, 50), dim=-1)
    assert entered == [torch.device("cpu")]
