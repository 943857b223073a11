"""A CPU dry run of ``benchmarks/attention_fp8.py`` at toy sizes: its checks (the FP8
kernel under the interpreter against float64 and a naive FP8 attention), the timing rows
(fake timings: every call runs once), a peer that cannot run (cuDNN on the CPU) reported
on its row, the table and the verdict, so that the GPU run does not die on a typo."""

import pytest
import torch

from bench_script import load_benchmark
from flashfold.api import attention as api


@pytest.fixture
def bench(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a CPU dry run; the GPU runs the script itself")
    mod = load_benchmark("attention_fp8")
    monkeypatch.setattr(mod, "DEVICE", "cpu")
    monkeypatch.setattr(mod, "CHECK_ROWS", 32)
    monkeypatch.setattr(mod, "ROWS", [("toy d64 gqa causal", 1, 4, 2, 96, 64, True, None),
                                      ("toy d32 softcap", 1, 2, 2, 64, 32, False, 30.0)])
    monkeypatch.setattr(mod, "timed", lambda fn, graph: (fn(), 2.0)[1])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "cpu (dry run)")
    # the FP8 calls run the Triton template under the interpreter; bf16 the CPU reference
    monkeypatch.setattr(api, "_use_kernel", lambda t: t.dtype == torch.float8_e4m3fn)
    return mod


def test_dry_run_checks_and_rows(bench, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["attention_fp8.py"])
    assert bench.main() == 0
    out = capsys.readouterr().out
    assert "checks: all passed" in out and "FAIL" not in out
    assert out.count("  ok   toy") == 6                    # 3 checks per row
    rows = [l for l in out.splitlines() if l.startswith("| toy")]
    assert len(rows) == 2 and all("CHECK FAILED" not in r for r in rows)
    # equal fake times: every ratio 1.00, the CPU's missing cuDNN column empty
    assert rows[0].count("1.00") == 2 and rows[0].count(" nan |") == 3
    assert "cudnn bf16 eager failed" in out and "cudnn fp8 not run" in out
    assert "FlashAttention-4 FP8 peer" in out and "cuDNN FP8 peer" in out
    # and the results page reads what the script prints
    from flashfold import bench as pages
    run, = pages.parse(out, "2026-12-05_cpu_attention_fp8.log")
    assert run.kind == "attention_fp8" and [r["row"] for r in run.rows] == [
        "toy d64 gqa causal", "toy d32 softcap"]
    assert run.rows[0]["values"]["/bf16"] == 1.0 and run.rows[0]["values"]["/cuDNN"] is None


def test_a_wrong_output_fails_its_check(bench, monkeypatch, capsys):
    """The check can fail: an FP8 output moved by 0.05 breaks the criterion."""
    real = bench.ff.attention

    def off(*a, **kw):
        out = real(*a, **kw)
        if a[0].dtype != torch.float8_e4m3fn:
            return out
        return (out[0] + 0.05, out[1]) if isinstance(out, tuple) else out + 0.05
    monkeypatch.setattr(bench.ff, "attention", off)
    monkeypatch.setattr("sys.argv", ["attention_fp8.py", "--check-only"])
    assert bench.main() == 1
    assert "FAIL toy d64 gqa causal: o: err" in capsys.readouterr().out


def test_dry_run_tune(bench, monkeypatch, capsys):
    """``--tune`` times the d128 / d256 rows under every configuration (here a toy d128
    row, fake times), the default first."""
    monkeypatch.setattr(bench, "ROWS", [("toy d128", 1, 2, 1, 64, 128, True, None)])
    monkeypatch.setattr(bench, "TUNE_CONFIGS", [(16, 32, 4, 1)])
    monkeypatch.setattr("sys.argv", ["attention_fp8.py", "--tune"])
    assert bench.main() == 0
    out = capsys.readouterr().out
    assert "| toy d128 | default | 0 | 1.00 |" in out
    assert "| toy d128 | BM16-BN32-w4-s1-tma | 0 | 1.00 |" in out


def test_dry_run_accumulation_probe(bench, monkeypatch, capsys):
    """Under the interpreter ``tl.dot`` sums in float32 (NumPy): both inputs' errors sit
    within the fp32 bound ``K 2^-24``, so a GPU floor above it is the hardware's."""
    monkeypatch.setattr(bench, "PROBE_K", (32, 64))
    got = bench.accumulation(ks=(32, 64))
    assert set(got) == {32, 64}
    for K, errs in got.items():
        assert all(0 <= e <= K * 2.0 ** -24 for e in errs), (K, errs)
    monkeypatch.setattr("sys.argv", ["attention_fp8.py", "--accumulation", "--check-only"])
    assert bench.main() == 0
    out = capsys.readouterr().out
    assert "## tl.dot accumulation" in out and out.count("| 32 |") + out.count("| 64 |") == 2
