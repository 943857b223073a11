"""A CPU dry run of ``benchmarks/attention.py --bwd`` (interpreter, fp16/fp32, tiny sizes): the
script that spends scarce GPU time is known to run, and its gradient checks are known to
fail on a broken backward."""

from __future__ import annotations

import math
import time

import pytest
import torch

from bench_script import load_benchmark
from flashfold import mods
from flashfold.api import attention as api
from flashfold.kernels.attention import bwd, dispatch, fwd
from flashfold.kernels.attention.bwd import BwdConfig
from flashfold.kernels.attention.fwd import FwdConfig

if torch.cuda.is_available():  # pragma: no cover - on the GPU, run the script itself
    pytest.skip("dry run for CPU machines", allow_module_level=True)


@pytest.fixture
def bench(monkeypatch):
    mod = load_benchmark("attention", "bench_attention_bwd")
    monkeypatch.setattr(mod, "DEV", "cpu")
    monkeypatch.setattr(api, "_use_kernel", lambda t: True)
    monkeypatch.setattr(fwd, "default_config",
                        lambda q, d, dv, causal=False: FwdConfig(16, 16, use_tma=dispatch.current().tma))
    monkeypatch.setattr(bwd, "default_config",
                        lambda q, d, dv, features=False, causal=False: BwdConfig(16, 16, 4, 1, 16, 16, 4, 1,
                                                                   use_tma=True, atomic_dq=True))
    return mod


def test_grad_check_cases_pass(bench):
    h = torch.float16
    c = bench.GradChecker()
    c.case("causal GQA", 2, 4, 2, 17, 33, 32, h, causal=True)
    c.case("window + dlse", 1, 2, 2, 33, 33, 32, h, window=(5, 2), with_lse=True)
    c.case("pointers (fallback config)", 1, 2, 1, 20, 20, 32, h, tma=False, softcap=5.0)
    c.case("varlen", 1, 2, 1, 0, 0, 32, make=bench._varlen([5, 0, 17], [9, 4, 1], 2, 1, 32, h),
           causal=True)
    c.case("document + alibi", 1, 2, 2, 40, 40, 32, h, mask_mod=mods.document_mask(bench._docs(40)),
           score_mod=mods.alibi(2))
    c.case("no visible key", 1, 2, 2, 30, 5, 32, h, causal=True)
    c.case("one key: dq = dk = 0 up to fp32 rounding", 2, 4, 2, 1, 1, 32, h)
    c.case("naive overflows", 1, 2, 2, 17, 17, 32, h,            # naive fp16 scores are inf
           make=lambda g: (torch.full((1, 2, 17, 32), 300.0).half(),
                           torch.full((1, 2, 17, 32), 300.0).half(),
                           torch.randn(1, 2, 17, 32, generator=g).half(), {}))
    d = bench.GradChecker(deterministic=True)
    d.case("deterministic", 1, 2, 1, 33, 17, 32, h, causal=True)
    assert c.failed == 0 and d.failed == 0, (c.rows, d.rows)
    assert all(len(r[2]) == 3 for r in c.rows)


def test_grad_check_catches_a_wrong_gradient(bench, monkeypatch):
    real = bwd.attention_backward

    def off(*a, **kw):
        dq, dk, dv = real(*a, **kw)
        return dq, dk * 1.01, dv
    monkeypatch.setattr(bwd, "attention_backward", off)
    c = bench.GradChecker()
    c.case("dk off by 1%", 1, 2, 2, 17, 17, 32, torch.float16)
    assert c.failed == 1


def test_grad_check_catches_an_unwritten_element(bench, monkeypatch):
    real = bwd.prepare_backward

    def skips(*a, **kw):
        dq, dk, dv, launches = real(*a, **kw)
        return dq, dk, dv, launches[:-1]              # the dQ conversion never runs
    monkeypatch.setattr(bwd, "prepare_backward", skips)
    c = bench.GradChecker()
    c.case("dq never written", 1, 2, 2, 17, 17, 32, torch.float16)
    assert c.failed == 1


def test_determinism_and_compile_checks(bench):
    small = [("tiny causal", dict(B=1, H=2, HK=1, N=40, D=32), dict(causal=True)),
             ("tiny alibi + document", dict(B=1, H=2, HK=2, N=40, D=32),
              dict(score_mod=mods.alibi(2), mask_mod=mods.document_mask(bench._docs(40))))]
    assert bench.determinism_check(small, dtype=torch.float16)
    assert bench.compile_check(backend="aot_eager", N=32, D=32, dtype=torch.float32)


def test_speed_rows_and_table(bench, monkeypatch, capsys):
    def cpu_bench(fn):
        t = time.perf_counter()
        fn()
        return max(1e-3, (time.perf_counter() - t) * 1e3)
    monkeypatch.setattr(bench, "_bench", cpu_bench)
    rows = bench.speed_bwd(False, grid=[(32, 32, False), (32, 32, True)], tokens=32, H=2,
                           dtype=torch.float16)
    out = capsys.readouterr().out
    assert len(rows) == 2 and all("flashfold" in r[3]["bwd"] and "ff-det" in r[3]["fb"] for r in rows)
    assert "| 32 | 32 | causal |" in out
    for peer in ("flash", "cudnn"):                  # measured, or its error printed
        assert peer in rows[0][3]["bwd"] or f"{peer} failed" in out, (peer, out)
    assert math.isfinite(rows[0][3]["bwd"]["flashfold"])


def test_tune_bwd_runs_and_checks(bench, monkeypatch, capsys):
    monkeypatch.setattr(bench, "_bench", lambda fn: (fn(), 1.0)[1])
    best, ok = bench.tune_bwd(N=32, B=1, H=2, candidates={32: [(16, 16, 4, 1, 16, 16, 4, 1),
                                                                (16, 32, 4, 1, 32, 16, 4, 1)]},
                              dtype=torch.float16)
    out = capsys.readouterr().out
    assert ok and len(best) == 2 and "WRONG" not in out and "failed" not in out, out
    assert out.count("TFLOP/s (compile+run") == 8          # 2 configs x {atomic, det} x {full, causal}


def test_tune_bwd_rejects_a_nan_gradient(bench, monkeypatch, capsys):
    """A configuration whose dK is NaN is WRONG, not timed (a NaN difference compares
    False against the bound), and the run reports the failure (``--tune-bwd`` exits 1)."""
    real = bwd.attention_backward

    def nan_dk_when_atomic(*a, **kw):
        dq, dk, dv = real(*a, **kw)
        if not kw.get("deterministic"):
            dk = torch.full_like(dk, math.nan)
        return dq, dk, dv
    monkeypatch.setattr(bwd, "attention_backward", nan_dk_when_atomic)
    monkeypatch.setattr(bench, "_bench", lambda fn: (fn(), 1.0)[1])
    best, ok = bench.tune_bwd(N=32, B=1, H=2, candidates={32: [(16, 16, 4, 1, 16, 16, 4, 1)]},
                              dtype=torch.float16)
    out = capsys.readouterr().out
    assert not ok and out.count("WRONG dk") == 2, out      # atomic dQ, full and causal
    assert all(not cfg.atomic_dq for _, _, cfg, _ in best), best


def test_gradient_difference_keeps_a_nan_of_any_gradient(bench):
    """``--bwd-kernels``' agreement with cuDNN: a NaN in dK (not the first gradient) makes
    the difference NaN, which fails its bound, instead of leaving dQ's finite one."""
    want = [torch.ones(2, 3) for _ in range(3)]
    got = [w.clone() for w in want]
    got[0][0, 0] = 1.01
    assert bench._max_rel_diff(got, want) == pytest.approx(1e-2, rel=1e-3)
    got[1][1, 2] = math.nan
    assert not bench._max_rel_diff(got, want) <= 5e-2


def _fake_gluon_bwd(monkeypatch, bench, nan_in=None):
    """``--gluon-bwd-variants``' GPU-only parts replaced: the Gluon kernel eligible, a
    forward, a ``prepare_backward`` whose launches are the preprocess (it zeroes the dQ
    accumulator) and the default kernel, and kernels that add 1 to the accumulator and
    write dK, dV; the variant whose options include ``nan_in`` writes a NaN into it."""
    from flashfold.kernels import launcher
    from flashfold.kernels.attention import gluon_bwd

    def prepare(do, q, k, v, o, lse, **kw):
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        acc = torch.full(q.shape, 7.0)
        pre = ("pre", None, [None] * 4 + [torch.zeros(1), torch.zeros(1), acc], {})
        return None, dk, dv, [pre, ("variant", None, [acc, dk, dv], {})]

    def variant(q, k, v, do, lam, dd, acc, dk, dv, launch=True, **kw):
        return ("variant", None, [acc, dk, dv], kw)

    def launch(kernel, grid, args, kw):
        if kernel == "pre":
            args[6].zero_()
            return
        acc, dk, dv = args
        acc.add_(1.0)
        if nan_in is not None and kw.get(nan_in[0]) == nan_in[1]:
            acc[0, 0, 0, 0] = math.nan
        dk.fill_(1.0)
        dv.fill_(2.0)
    monkeypatch.setattr(gluon_bwd, "eligible", lambda *a, **kw: True)
    monkeypatch.setattr(gluon_bwd, "gluon_attention_bwd", variant)
    monkeypatch.setattr(launcher, "launch", launch)
    monkeypatch.setattr(fwd, "attention_forward",
                        lambda q, k, v, **kw: (torch.zeros_like(q), torch.zeros(q.shape[:3])))
    monkeypatch.setattr(bwd, "prepare_backward", prepare)
    monkeypatch.setattr(bench, "_bench", lambda fn: (fn(), 1.0)[1])


def test_gluon_bwd_variants_rerun_the_preprocess_and_agree(bench, monkeypatch, capsys):
    """Each variant runs after the preprocess (which zeroes the dQ accumulator its atomic
    adds land in): without it, the second variant's accumulator holds twice the first's."""
    _fake_gluon_bwd(monkeypatch, bench)
    assert bench.gluon_bwd_variants(tokens=1, H=4, D=16, reps=1) == 0
    out = capsys.readouterr().out
    assert "WRONG" not in out and "variants agree" in out, out


def test_gluon_bwd_variants_reject_a_nan_accumulator(bench, monkeypatch, capsys):
    """A NaN in a variant's dQ accumulator fails the check (NaN > bound is False)."""
    _fake_gluon_bwd(monkeypatch, bench, nan_in=("late_stats", True))
    assert bench.gluon_bwd_variants(tokens=1, H=4, D=16, reps=1) == 1
    out = capsys.readouterr().out
    assert "late stats: dK/dV equal True, dQ acc rel nan WRONG" in out, out
    assert "variants DIFFER" in out


def _fake_gluon_compare(monkeypatch, bench, nan_dk=False):
    """``--gluon-bwd``'s GPU-only parts replaced (see :func:`_fake_gluon_bwd`), the
    backward returning the same gradients in every mode (with ``nan_dk``: a NaN in dK of
    the default mode's), cuDNN a stand-in."""
    from flashfold.kernels.attention import gluon_bwd
    _fake_gluon_bwd(monkeypatch, bench)

    def backward(do, q, k, v, o, lse, deterministic=False, **kw):
        dq, dk, dv = do.clone(), k.clone(), v.clone()
        if nan_dk and not deterministic:
            dk[0, 0, -1, -1] = math.nan
        return dq, dk, dv
    monkeypatch.setattr(bwd, "attention_backward", backward)
    monkeypatch.setattr(gluon_bwd, "store_tma", lambda causal, n: True)
    monkeypatch.setattr(bench, "_sdpa_train", lambda name: lambda q, k, v, causal: q * k * v)


def test_gluon_bwd_compare_agrees(bench, monkeypatch, capsys):
    _fake_gluon_compare(monkeypatch, bench)
    assert bench.gluon_bwd_compare(tokens=1, H=1, dims=(16,)) == 0
    out = capsys.readouterr().out
    assert "WRONG" not in out and "gradients agree" in out, out


def test_gluon_bwd_compare_rejects_a_nan_dk(bench, monkeypatch, capsys):
    """A NaN in dK (not the first gradient) makes the row WRONG and the run fail."""
    _fake_gluon_compare(monkeypatch, bench, nan_dk=True)
    assert bench.gluon_bwd_compare(tokens=1, H=1, dims=(16,)) == 1
    out = capsys.readouterr().out
    assert out.count(" WRONG |") == 6 and "gradients DIFFER" in out, out
