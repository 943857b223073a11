"""A CPU dry run of benchmarks/attention.py (under the interpreter, fp16, tiny sizes), so the
script that spends scarce GPU time is known to run, and its checks are known to fail on a
broken kernel."""

from __future__ import annotations

import math
import time

import pytest
import torch

from bench_script import load_benchmark
from flashfold import mods
from flashfold.api import attention as api
from flashfold.kernels.attention import dispatch, fwd
from flashfold.kernels.attention.fwd import FwdConfig

if torch.cuda.is_available():  # pragma: no cover - on the GPU, run the script itself
    pytest.skip("dry run for CPU machines", allow_module_level=True)


@pytest.fixture
def bench(monkeypatch):
    mod = load_benchmark("attention", "bench_attention")
    monkeypatch.setattr(mod, "DEV", "cpu")
    monkeypatch.setattr(api, "_use_kernel", lambda t: True)
    monkeypatch.setattr(fwd, "default_config",
                        lambda q, d, dv, causal=False: FwdConfig(16, 16, use_tma=dispatch.current().tma))
    return mod


def test_check_grid_cases_pass(bench):
    c = bench.Checker()
    h = torch.float16
    c.case("causal GQA", 2, 4, 2, 17, 33, 32, h, causal=True)
    c.case("pointers window", 1, 2, 2, 33, 33, 32, h, tma=False, window=(5, 2))
    c.case("varlen", 1, 2, 1, 0, 0, 32, make=bench._varlen([5, 0, 17], [9, 4, 1], 2, 1, 32, h),
           causal=True)
    c.case("extreme scores", 1, 2, 2, 17, 17, 32, make=bench._extreme_scores(1, 2, 17, 32, h))
    c.case("document + alibi", 1, 2, 2, 40, 40, 32, h, mask_mod=mods.document_mask(bench._docs(40)),
           score_mod=mods.alibi(2))
    c.case("no visible key", 1, 2, 2, 30, 5, 32, h, causal=True)
    c.case("naive overflows", 1, 2, 2, 17, 17, 32, h,            # naive fp16 scores are inf
           make=lambda g: (torch.full((1, 2, 17, 32), 300.0).half(),
                           torch.full((1, 2, 17, 32), 300.0).half(),
                           torch.randn(1, 2, 17, 32, generator=g).half(), {}))
    assert c.failed == 0, c.rows
    assert not math.isfinite(c.rows[-1][3])                  # ... so the fallback bound ran


def test_check_catches_an_unwritten_row(bench, monkeypatch):
    real = fwd.attention_forward

    def skips_a_row(*a, **kw):
        o, lse = real(*a, **kw)
        o[:, :, 3] = fwd._alloc((1,), dtype=o.dtype, device=o.device)[0]   # the poison value
        return o, lse
    monkeypatch.setattr(fwd, "attention_forward", skips_a_row)
    c = bench.Checker()
    c.case("broken", 1, 2, 2, 17, 17, 32, torch.float16)
    assert c.failed == 1


def test_check_catches_a_wrong_result(bench, monkeypatch):
    real = fwd.attention_forward
    monkeypatch.setattr(fwd, "attention_forward",
                        lambda *a, **kw: (lambda o, l: (o * 1.01, l))(*real(*a, **kw)))
    c = bench.Checker()
    c.case("off by 1%", 1, 2, 2, 17, 17, 32, torch.float16)
    assert c.failed == 1


def test_speed_rows_and_table(bench, monkeypatch, capsys):
    def cpu_bench(fn):
        t = time.perf_counter()
        fn()
        return max(1e-3, (time.perf_counter() - t) * 1e3)
    monkeypatch.setattr(bench, "_bench", cpu_bench)
    monkeypatch.setattr(bench, "_matmul_ceiling", lambda: math.nan)
    grid = [(32, 64, "full"), (32, 64, "causal"), (32, 64, "window1024"), (32, 64, "document")]
    rows = bench.speed(False, grid=grid, tokens=64, H=2, use_flex=False, dtype=torch.float16)
    out = capsys.readouterr().out
    assert len(rows) == 4 and all("flashfold" in r[3] for r in rows), rows
    assert "| 32 | 64 | document |" in out
    for peer in ("flash", "cudnn", "efficient"):            # measured, or its error printed
        assert peer in rows[0][3] or f"peer {peer} failed" in out, (peer, out)


def _fake_gluon_fwd(monkeypatch, bench, differ=None):
    """``--gluon-variants``' GPU-only parts replaced: the Gluon forward eligible, its
    variants returning the same output (the one run with ``differ`` among its options
    one changed bit), cuDNN a stand-in, 132 SMs."""
    import types

    from flashfold.kernels.attention import gluon_fwd

    def variant(q, k, v, causal=False, return_lse=True, **kw):
        o, lse = q.clone(), torch.zeros(q.shape[:3])
        if differ is not None and kw.get(differ[0]) == differ[1]:
            o[0, 0, 0, 0] = math.nan
        return o, lse
    monkeypatch.setattr(gluon_fwd, "eligible", lambda *a, **kw: True)
    monkeypatch.setattr(gluon_fwd, "gluon_attention_fwd", variant)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(bench, "_sdpa", lambda name: lambda q, k, v, causal: q)
    monkeypatch.setattr(bench, "_bench", lambda fn: (fn(), 1.0)[1])


def test_gluon_variants_agree(bench, monkeypatch, capsys):
    _fake_gluon_fwd(monkeypatch, bench)
    assert bench.gluon_variants(tokens=1, H=1) == 0
    out = capsys.readouterr().out
    assert "BITS DIFFER" not in out and "variants agree" in out, out


def test_gluon_variants_fail_where_bits_differ(bench, monkeypatch, capsys):
    """A variant whose output differs (here a NaN) fails the run, not only its row."""
    _fake_gluon_fwd(monkeypatch, bench, differ=("persistent", False))
    assert bench.gluon_variants(tokens=1, H=1) == 1
    out = capsys.readouterr().out
    assert out.count("BITS DIFFER") == 12 and "variants DIFFER" in out, out


@pytest.mark.parametrize("flag, mode", [("--gluon-variants", "gluon_variants"),
                                        ("--gluon-bwd", "gluon_bwd_compare")])
def test_gluon_modes_failures_set_the_exit_status(bench, monkeypatch, flag, mode):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "no GPU (test)")
    monkeypatch.setattr(bench, mode, lambda: 1)
    assert bench.main([flag]) == 1


def test_tune_checks_every_config(bench, monkeypatch, capsys):
    monkeypatch.setattr(bench, "_bench", lambda fn: (fn(), 1.0)[1])
    assert bench.tune(N=32, B=1, H=2, candidates={32: [(16, 16, 4, 1), (32, 16, 4, 1)]},
                      dtype=torch.float16)
    out = capsys.readouterr().out
    assert "WRONG" not in out and "failed" not in out, out
    assert out.count("TFLOP/s (compile+run") == 8          # 2 configs x {TMA, pointers} x 2 masks


@pytest.mark.parametrize("bad", ["causal", "nan"])
def test_tune_rejects_a_wrong_config(bench, monkeypatch, capsys, bad):
    """A causal call that ignores the mask (checked against a causal reference, not the
    dense one), and a NaN output (a NaN difference fails the bound), are WRONG, not
    timed, and fail the run."""
    real = fwd.attention_forward

    def broken(q, k, v, *, right=None, config=None, **kw):
        if config.block_n != 32:
            return real(q, k, v, right=right, config=config, **kw)
        if bad == "causal":
            return real(q, k, v, right=None, config=config, **kw)
        o, lse = real(q, k, v, right=right, config=config, **kw)
        return o.fill_(math.nan), lse
    monkeypatch.setattr(fwd, "attention_forward", broken)
    monkeypatch.setattr(bench, "_bench", lambda fn: (fn(), 1.0)[1])
    cands = {32: [(16, 16, 4, 1), (16, 32, 4, 1)]}
    assert not bench.tune(N=32, B=1, H=2, candidates=cands, dtype=torch.float16)
    out = capsys.readouterr().out
    wrong = 2 if bad == "causal" else 4                    # {TMA, pointers} x masks it breaks
    assert out.count("WRONG RESULT") == wrong, out
    assert out.count("TFLOP/s (compile+run") == 8 - wrong, out
