"""``flashfold bench`` and ``flashfold numerics`` plots, rendered on the CPU.

The real H200 logs in ``benchmarks/logs/`` are parsed (values spot-checked against the
text), rendered to PNG, and each figure is checked for what a reader needs without the
code: a title with the device and date, axis labels with units, a legend naming
flashfold, its peers and the measured ceiling (with its value). The runner is exercised
with a stand-in benchmark script (no GPU), and the progress bar on its own.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from flashfold import bench  # noqa: E402
from flashfold.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "benchmarks" / "logs"


def _log(kind: str) -> Path:
    names = {"attention": "attention_fwd", "decode": "decode", "reductions": "reductions"}
    hits = sorted(p for p in LOGS.glob("*.log") if names[kind] in p.name)
    assert hits, f"no {kind} log in {LOGS}"
    return hits[0]


def _is_png(path) -> tuple[int, int]:
    """(width, height) of a valid, non-blank PNG."""
    import matplotlib.image as mpimg
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 500, img.shape
    assert float(img[..., :3].std()) > 0.05, f"{path} looks blank"
    return img.shape[1], img.shape[0]


def _readable(desc: dict, unit: str, ceiling: str, peers: list[str], date: str = "2026-11-30"):
    """Title with device and date; every panel's axes labelled (the unit on y); a legend
    with flashfold, the peers and the ceiling's value."""
    assert "NVIDIA H200" in desc["suptitle"] and date in desc["suptitle"], desc["suptitle"]
    panels = [a for a in desc["axes"] if a["lines"] or a["bars"]]
    assert panels
    for a in panels:
        assert a["title"] and a["xlabel"], a
        assert unit in a["ylabel"], a
    legend = desc["legend"]
    assert any(t.startswith("flashfold") for t in legend), legend
    for p in peers:
        assert any(p in t for t in legend), (p, legend)
    assert any("ceiling" in t and ceiling in t for t in legend), legend


# --- parsing ---------------------------------------------------------------------------------

def test_parse_the_attention_log():
    runs = bench.parse_file(str(_log("attention")))
    assert [r.kind for r in runs] == ["attention"]
    run = runs[0]
    assert run.ceiling == 678 and run.device == "NVIDIA H200" and run.date == "2026-11-30"
    assert "torch 2.11.0+cu130" in run.software and len(run.rows) == 18
    row = next(r for r in run.rows if (r["D"], r["N"], r["mask"]) == (128, 16384, "full"))
    assert row["values"] == {"flashfold": 635, "cudnn": 606, "flash": 355, "efficient": 175,
                             "flex": 487}
    doc = next(r for r in run.rows if (r["D"], r["N"], r["mask"]) == (64, 16384, "document"))
    assert doc["values"] == {"flashfold": 171, "flex": 167}


def test_parse_the_decode_and_reductions_logs():
    dec = bench.parse_file(str(_log("decode")))[0]
    assert dec.kind == "decode" and dec.ceiling == 4244 and dec.device == "NVIDIA H200"
    assert len(dec.rows) == 14
    row = next(r for r in dec.rows if (r["batch"], r["length"]) == (8, 8192))
    assert row["values"]["flashfold"] == 2119 and row["values"]["flashfold [graph]"] == 3380
    assert row["values"]["sdpa cudnn [graph]"] == 3370
    red = bench.parse_file(str(_log("reductions")))[0]
    assert red.kind == "reductions" and red.ceiling == 4251 and len(red.rows) == 39
    lse = red.rows[0]
    assert (lse["op"], lse["shape"], lse["dtype"]) == ("logsumexp", "16384x16384", "float32")
    assert lse["values"]["flashfold"] == 4266
    assert abs(lse["values"]["torch"] - 4266 * 0.252 / 1.817) < 1e-6
    assert lse["ms"] == {"flashfold": 0.252, "torch": 1.817, "flashfold graph": 0.253,
                         "torch graph": 1.811}
    assert any(r["op"] == "segment_reduce sum" for r in red.rows)
    # an op name longer than its printed column, and a row torch has no equivalent of
    rec = next(r for r in red.rows if r["op"] == "linear recurrence scan")
    assert rec["shape"] == "12288x16384" and rec["ms"]["torch"] == 0.794
    aff = next(r for r in red.rows if r["op"] == "affine_half reduce")
    assert "torch" not in aff["values"] and "torch graph" not in aff["ms"]


def test_markdown_tables_give_the_same_numbers():
    """``--from-table``: the markdown tables the scripts print (and RESULTS.md holds)."""
    att_text = _log("attention").read_text()
    tables = "\n".join(line for line in att_text.splitlines() if line.startswith("|"))
    from_table = bench.parse(tables)[0]
    from_lines = bench.parse_file(str(_log("attention")))[0]
    assert [(r["D"], r["N"], r["mask"], r["values"]) for r in from_table.rows] == \
        [(r["D"], r["N"], r["mask"], r["values"]) for r in from_lines.rows]
    red_text = _log("reductions").read_text()
    red_tables = "\n".join(line for line in red_text.splitlines() if line.startswith("|"))
    red = bench.parse(red_tables)[0]
    assert red.kind == "reductions" and len(red.rows) == 39
    assert red.rows[0]["values"] == {"flashfold": 4266, "torch": 591}


def test_unrelated_text_gives_nothing():
    assert bench.parse("hello\n| a | b |\n|---|---|\n| 1 | 2 |\n") == []


# --- rendering -------------------------------------------------------------------------------

def test_attention_plot_is_readable(tmp_path):
    run = bench.parse_file(str(_log("attention")))[0]
    desc = bench.plot_attention(run, str(tmp_path / "a.png"))
    _is_png(tmp_path / "a.png")
    _readable(desc, "TFLOP/s", "678", ["cuDNN", "FlashAttention 2", "FlexAttention"])
    titles = [a["title"] for a in desc["axes"]]
    assert "head dim 128, causal" in titles and "head dim 64, no mask" in titles
    assert all("sequence length" in a["xlabel"] for a in desc["axes"][:4])


def test_decode_plot_is_readable(tmp_path):
    run = bench.parse_file(str(_log("decode")))[0]
    desc = bench.plot_decode(run, str(tmp_path / "d.png"))
    _is_png(tmp_path / "d.png")
    _readable(desc, "GB/s", "4,244", ["SDPA cuDNN", "SDPA flash", "pages of 16"])
    assert [a["title"] for a in desc["axes"]] == ["batch 1", "batch 8", "batch 64", "batch 256"]
    assert "CUDA-graph" in desc["suptitle"]


def test_reductions_plot_is_readable(tmp_path):
    run = bench.parse_file(str(_log("reductions")))[0]
    desc = bench.plot_reductions(run, str(tmp_path / "r.png"))
    _is_png(tmp_path / "r.png")
    _readable(desc, "GB/s", "4,251", ["torch"], date="2026-12-02")
    assert sum(a["bars"] for a in desc["axes"]) == 2 * 39


def test_bench_command_writes_the_pngs(tmp_path, capsys):
    junk = tmp_path / "tune.log"
    junk.write_text("candidate tiles, no timing rows\n")
    logs = [str(p) for p in sorted(LOGS.glob("*.log"))] + [str(junk)]
    out_dir = tmp_path / "out"
    assert main(["bench", "--from-log", *logs, "--out", str(out_dir)]) == 0
    out = capsys.readouterr()
    for name in ("attention_fwd.png", "attention_bwd.png", "decode.png", "reductions.png"):
        assert (out_dir / name).is_file() and f"wrote {out_dir / name}" in out.out
        _is_png(out_dir / name)
    assert sorted(p.name for p in out_dir.iterdir()) == ["attention_bwd.png", "attention_fwd.png",
                                                        "decode.png", "reductions.png"]
    assert "tune.log" in out.err and "skipped" in out.err        # no timing rows in it
    assert main(["bench", "--out", str(tmp_path)]) == 2


def test_numerics_command_plot_is_readable(tmp_path, capsys, monkeypatch):
    """``flashfold numerics`` writes numerics.png with labelled axes and a legend, and
    shows a progress bar on stderr."""
    import matplotlib.figure
    seen = []
    orig = matplotlib.figure.Figure.savefig

    def spy(fig, *a, **k):
        seen.append(bench._describe(fig))
        return orig(fig, *a, **k)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    assert main(["numerics", "--max-n", "1000", "--out", str(tmp_path)]) == 0
    _is_png(tmp_path / "numerics.png")
    err = capsys.readouterr().err
    assert "numerics [" in err and "100%" in err
    (desc,) = seen
    for a in desc["axes"]:
        assert a["xlabel"].startswith("N (keys") and "dimensionless" in a["ylabel"]
    assert any("bound" in t for t in desc["legend"]) and any("fp32" in t or "float32" in t
                                                              for t in desc["legend"])


# --- running the scripts (a stand-in script, no GPU) -------------------------------------------

def test_run_script_tees_the_log_and_plots(tmp_path, monkeypatch):
    """``--run``: the script's output goes to a log (tee), the progress bar counts its
    timing rows, and the log is plotted."""
    fake = tmp_path / "repo" / "benchmarks"
    fake.mkdir(parents=True)
    (fake / "attention.py").write_text(          # its grid: 18 rows, as the real script's
        "import sys\n\ndef _default_grid(quick):\n    return [None] * (3 if quick else 18)\n\n"
        "if __name__ == '__main__':\n    sys.stdout.write(open(%r).read())\n" % str(_log("attention")))
    err = io.StringIO()
    log = bench.run_script("attention", fake, str(tmp_path / "out"), stream=err)
    assert Path(log).read_text() == _log("attention").read_text()
    lines = err.getvalue().splitlines()
    assert any("18/18 100%" in line for line in lines), lines[-3:]
    monkeypatch.setattr(bench, "_gpu_available", lambda: True)     # the stand-in needs none
    assert main(["bench", "--run", "attention", "--bench-dir", str(fake),
                 "--out", str(tmp_path / "out2")]) == 0
    _is_png(tmp_path / "out2" / "attention_fwd.png")
    (fake / "decode.py").write_text("import sys\nprint('boom')\nsys.exit(3)\n")
    with pytest.raises(RuntimeError, match="status 3"):
        bench.run_script("decode", fake, str(tmp_path / "out"), stream=io.StringIO())


def test_a_run_whose_script_fails_its_checks_exits_1(tmp_path, monkeypatch, capsys):
    """A benchmark that printed its timings and then exited non-zero (a failed correctness
    check) has its rows drawn, and ``--run`` says so on stderr and exits 1, not 0."""
    fake = tmp_path / "repo" / "benchmarks"
    fake.mkdir(parents=True)
    (fake / "attention.py").write_text(
        "import sys\n\nif __name__ == '__main__':\n"
        "    sys.stdout.write(open(%r).read())\n    sys.exit(1)\n" % str(_log("attention")))
    with pytest.raises(RuntimeError, match="status 1") as e:
        bench.run_script("attention", fake, str(tmp_path / "out"), stream=io.StringIO())
    assert Path(e.value.log).read_text() == _log("attention").read_text()
    monkeypatch.setattr(bench, "_gpu_available", lambda: True)     # the stand-in needs none
    assert main(["bench", "--run", "attention", "--bench-dir", str(fake),
                 "--out", str(tmp_path / "out2")]) == 1
    _is_png(tmp_path / "out2" / "attention_fwd.png")
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("flashfold bench: --run: benchmarks/attention.py exited with "
                              "status 1"), err[-3:]


def test_progress_bar_text():
    s = io.StringIO()
    bar = bench.ProgressBar("job", 4, stream=s)
    for i in range(1, 5):
        bar.update(i, label=f"step {i}")
    bar("numerics [2/8] N=10 float32")                    # the numerics message form
    bar.close()
    text = s.getvalue()
    assert "job [" in text and "4/4 100%" in text and "2/8  25%" in text and "step 4" in text

    class Tty(io.StringIO):
        def isatty(self):
            return True
    t = Tty()
    bar = bench.ProgressBar("tty", None, stream=t)
    bar.update(3, label="x")
    bar.close()
    assert "\r" in t.getvalue() and "[3 done]" in t.getvalue()


def test_import_flashfold_does_not_import_matplotlib():
    code = ("import sys, flashfold, flashfold.bench, flashfold.cli; flashfold.cli._load_plugins(); "
            "assert 'matplotlib' not in sys.modules; print('ok')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_backward_log_and_plot(tmp_path):
    """``attention.py --bwd`` output: backward TFLOP/s per impl (default and deterministic
    flashfold, cuDNN, FA2) and forward + backward; no matmul in that run, so the forward
    run's roof of the same day is drawn when both logs are plotted together."""
    bwd_logs = sorted(LOGS.glob("*attention_bwd*.log"))
    assert bwd_logs
    run = bench.parse_file(str(bwd_logs[0]))
    assert [r.kind for r in run] == ["attention_bwd"]
    rows = run[0].rows
    assert rows and all(set(r["values"]) <= set(bench.BACKWARD_IMPLS) for r in rows)
    assert all(r["values"]["flashfold"] > 0 and r["fwd+bwd"]["cudnn"] > 0 for r in rows)
    runs = bench.parse_file(str(_log("attention"))) + run
    out = bench.render(runs, str(tmp_path))
    path = str(tmp_path / "attention_bwd.png")
    _is_png(path)
    _readable(out[path], "TFLOP/s", "678", ["cuDNN", "FlashAttention 2", "deterministic"])


def test_graph_replay_warms_up_off_the_capture_then_captures_once(monkeypatch):
    """The CUDA-graph helper the benchmarks time kernels with: ``warmup`` calls on a side
    stream (compiles and allocations stay out of the graph), one captured call, and the
    graph's replay returned. CUDA is faked: only the order of operations is checked."""
    import contextlib

    import torch

    from flashfold.bench import graph_replay

    log = []

    class Stream:
        def wait_stream(self, other):
            log.append("wait")

    class Graph:
        def replay(self):
            log.append("replay")

    @contextlib.contextmanager
    def ctx(name):
        log.append(f"enter {name}")
        yield
        log.append(f"exit {name}")

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: ctx("side"))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: ctx("capture"))
    replay = graph_replay(lambda: log.append("call"), warmup=2)
    assert log == ["wait", "enter side", "call", "call", "exit side", "wait",
                   "enter capture", "call", "exit capture"]
    replay()
    assert log[-1] == "replay"
