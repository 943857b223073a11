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
