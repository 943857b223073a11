"""``benchmarks/reductions.py --smoke``: the benchmark's own code (checks, rows, the
example monoids' section) runs on the CPU at tiny sizes under the interpreter, so a GPU
run does not die on a Python error. The numbers of a smoke run mean nothing."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the smoke run needs Triton's interpreter (CPU machines)")
def test_smoke_quick_runs_the_recurrence_row_and_its_checks():
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "reductions.py"),
                        "--smoke", "--quick", "--no-graphs"], capture_output=True, text=True,
                       env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    for check in ("linear recurrence scan 6x300 (256 rows)", "weighted mean 64x64",
                  "affine_half scan .b 64x64"):
        assert f"ok   {check}" in out, check
    assert "| linear recurrence scan | 6x300 | float32 |" in out
    assert "correctness failures: none" in out


@pytest.fixture
def smoke_bench(monkeypatch):
    """``benchmarks/reductions.py`` loaded as a module for a ``--smoke`` run in this process
    (its switch of flashfold's CPU routing undone afterwards)."""
    from bench_script import load_benchmark
    from flashfold.api import reductions as api
    monkeypatch.setattr(api, "_use_kernels", api._use_kernels)
    return load_benchmark("reductions")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the smoke run needs Triton's interpreter (CPU machines)")
def test_smoke_variants_are_checked_before_they_are_timed(smoke_bench, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["reductions.py", "--smoke", "--variants", "var_mean"])
    assert smoke_bench.main() == 0
    out = capsys.readouterr().out
    for label in ("realigned tiles (default)", "scalar loads"):
        for field in (".mean", ".var"):
            assert f"ok   variant var_mean 12345: {label} {field}" in out, out
        assert f"var_mean 12345 {label}" in out, out                   # and timed
    assert "correctness failures: none" in out


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the smoke run needs Triton's interpreter (CPU machines)")
def test_smoke_variants_wrong_output_fails_the_run(smoke_bench, monkeypatch, capsys):
    """A variant whose output is wrong (here a mean 1% off) is reported, not timed, and
    sets the exit status."""
    import flashfold
    real = flashfold.var_mean
    monkeypatch.setattr(flashfold, "var_mean",
                        lambda *a, **kw: (lambda v, m: (v, m * 1.01))(*real(*a, **kw)))
    monkeypatch.setattr(sys, "argv", ["reductions.py", "--smoke", "--variants", "var_mean"])
    assert smoke_bench.main() == 1
    out = capsys.readouterr().out
    assert out.count("FAIL variant var_mean 12345:") == 2, out
    assert "var_mean 12345 realigned" not in out and "var_mean 12345 scalar" not in out, out
