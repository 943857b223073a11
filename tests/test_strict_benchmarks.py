"""The correctness checks of ``benchmarks/attention_strict.py`` and
``benchmarks/decode_strict.py`` (run on the GPU before each timed setting) on the CPU at
tiny sizes: they pass on flashfold's outputs and fail on a wrong or NaN one."""

from __future__ import annotations

import math

import pytest
import torch

import flashfold
from bench_script import load_benchmark


def _attention_inputs(poison=False):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 40, 32, generator=g).to(torch.bfloat16) for _ in range(3))
    if poison:
        v[:, :, 0] = math.nan
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
def test_attention_strict_check_passes(causal, capsys):
    bench = load_benchmark("attention_strict")
    bench.CHECK_ROWS = 16
    assert bench.check("row", *_attention_inputs(), causal)
    assert bench.FAILED == [] and "ok   row: last 16 rows" in capsys.readouterr().out


def test_attention_strict_check_keeps_nan_parity():
    """A NaN value every row sees: the reference's rows are NaN, and so must flashfold's."""
    bench = load_benchmark("attention_strict")
    assert bench.check("poisoned", *_attention_inputs(poison=True), True)


@pytest.mark.parametrize("wrong", [lambda o: o * 1.05,
                                   lambda o: o.index_fill(2, torch.tensor([39]), math.nan)])
def test_attention_strict_check_fails_a_wrong_output(monkeypatch, capsys, wrong):
    bench = load_benchmark("attention_strict")
    real = flashfold.attention
    monkeypatch.setattr(flashfold, "attention", lambda *a, **kw: wrong(real(*a, **kw)))
    assert not bench.check("broken", *_attention_inputs(), True)
    assert bench.FAILED == ["broken"] and "FAIL broken" in capsys.readouterr().out


def _decode_inputs(paged):
    g = torch.Generator().manual_seed(0)
    batch, hq, hkv, n, d, page = 2, 4, 2, 48, 16, 8
    q = torch.randn(batch, hq, 3, d, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(batch, hkv, n, d, generator=g).to(torch.bfloat16) for _ in range(2))
    lens = torch.full((batch,), n, dtype=torch.int32)
    if not paged:
        return q, k, v, lens, None
    kp, vp = (t.permute(0, 2, 1, 3).reshape(batch * n // page, page, hkv, d).contiguous()
              for t in (k, v))
    table = torch.arange(batch * n // page, dtype=torch.int32).view(batch, -1)
    return q, kp, vp, lens, table


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("window", [None, (10, None)])
def test_decode_strict_check_passes(paged, window, capsys):
    bench = load_benchmark("decode_strict")
    assert bench.check("row", *_decode_inputs(paged), window, False)
    assert "ok   row: sequence 0" in capsys.readouterr().out


@pytest.mark.parametrize("paged", [False, True])
def test_decode_strict_check_fails_a_wrong_output(monkeypatch, capsys, paged):
    bench = load_benchmark("decode_strict")
    real = flashfold.decode

    def wrong(*a, **kw):
        o = real(*a, **kw)
        o[0, 1, 2, 3] = math.nan
        return o
    monkeypatch.setattr(flashfold, "decode", wrong)
    assert not bench.check("broken", *_decode_inputs(paged), None, False)
    assert "FAIL broken" in capsys.readouterr().out
