"""A CPU dry run of ``benchmarks/decode.py`` at toy sizes: every code path of the script
(correctness checks, batch-invariance check, timing rows with and without CUDA graphs,
SDPA peers failing gracefully, the final table and verdicts) runs, so the one GPU run the
lead makes does not die on a typo. CUDA-only calls are replaced by stand-ins; decode runs
its CPU reference path, the timings are fake."""

import contextlib
import re

import pytest
import torch

from bench_script import load_benchmark


class _Graph:
    def replay(self):
        pass


@pytest.fixture
def bench(monkeypatch):
    mod = load_benchmark("decode")
    monkeypatch.setattr(mod, "DEV", "cpu")
    monkeypatch.setattr(mod, "HQ", 4)
    monkeypatch.setattr(mod, "HKV", 2)
    monkeypatch.setattr(mod, "D", 32)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: type("S", (), {
        "wait_stream": lambda self, other: None})())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: type("S", (), {
        "wait_stream": lambda self, other: None})())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    class _Event:
        def __init__(self, **kw):
            pass

        def record(self):
            pass

        def elapsed_time(self, other):
            return 1.0

    monkeypatch.setattr(torch.cuda, "Event", _Event)
    orig_gen = torch.Generator
    monkeypatch.setattr(torch, "Generator", lambda device=None: orig_gen())
    calls = []

    def fake_bench(fn, warmup=25, rep=100, return_mode="median"):
        fn()
        calls.append(fn)
        return 1.0 + 0.01 * len(calls)

    monkeypatch.setattr(mod.triton.testing, "do_bench", fake_bench)
    mod._calls = calls
    return mod


def test_checks_run(bench, capsys):
    chk = bench.Checker()
    c = bench.Cache(3, 64, [0, 1, 60], q_len=2, pages=(16,), seed=1)
    bench.check_case(chk, "toy", c)
    bench.check_case(chk, "toy softcap", c, softcap=30.0)
    bench.check_case(chk, "toy window", c, window=(10, 0))
    lp = bench.Cache(3, 64, [0, 40, 60], q_len=2, pages=(16,), seed=2, starts=[1, 5, 59])
    bench.check_case(chk, "toy left-padded", lp)
    bench.check_case(chk, "toy left-padded window", lp, window=(10, 0))
    bench.check_invariance(chk, pages=(16,), target_len=40, cap=64)
    out = capsys.readouterr().out
    assert not chk.failures, out
    assert "bitwise equal across batches 1/8/64" in out and "default mode" in out


def test_timing_runs_and_prints_the_table(bench, capsys):
    bench.run_timing(False, True, targets=[(2, 64)], grid=[(1, 32)], copy_elems=1024)
    out = capsys.readouterr().out
    assert "final table" in out and "target (eager)" in out and "target (graph)" in out
    assert "flashfold lpad" in out and "flashfold lpad [graph]" in out
    assert "target (clean)" in out and "batch_invariant cost over the grid (graph" in out
    # the worst row is named, per layout
    lines = [ln for ln in out.splitlines() if "batch_invariant cost over the grid" in ln]
    assert lines and all(re.search(r"contiguous -?\d+\.\d% at \d+ x \d+ contiguous", ln)
                         and re.search(r"paged -?\d+\.\d% at \d+ x \d+ paged 16", ln)
                         for ln in lines), lines
    assert bench._calls                                       # every method was timed


def test_tune_runs(bench, monkeypatch, capsys):
    monkeypatch.setattr(bench, "TARGETS", [(2, 128)])
    calls = []

    def fake_decode(q, k, v, lens, table, *, scale, **kw):     # records the knobs tried
        calls.append(kw)
        return q, q[..., 0]

    monkeypatch.setattr(bench.splitkv, "splitkv_decode", fake_decode)
    bench.run_tune()
    out = capsys.readouterr().out
    assert "paged16" in out and "TMA" in out and "batch_invariant split" in out
    assert {"tma": True} in calls and {"pdl": False} in calls and {"num_splits": 32} in calls
