"""``flashfold bench --results``: the results page (``benchmarks/RESULTS.md``) written from
benchmark logs, on small synthetic logs in the scripts' output format.

Each family's table comes from its latest full log and carries the run's date (from the
file name), device, torch/Triton versions, the command that printed it, every peer with
flashfold's ratio to it (the ratio the run printed where it printed one), and the run's
own check lines. The command's user mistakes (a missing log, ``--run`` without a GPU)
print one line and exit non-zero, without a traceback.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flashfold import bench
from flashfold.cli import main

ROOT = Path(__file__).resolve().parents[1]

ATTENTION = """torch 2.11.0+cu130, triton 3.6.0, NVIDIA H200, python 3.12.3
== correctness: 2/2 cases passed

== speed: bfloat16, H=16, B*N = 16384 tokens, do_bench median
   bf16 matmul 8192^3 in this run: 680 TFLOP/s (the ceiling column)
   d128 N4096  full       0.891 ms  flashfold=617 cudnn=629 flash=345 efficient=173 flex=476 (91% of matmul)
   d128 N4096  causal     0.477 ms  flashfold=576 cudnn=533 flash=302 efficient=160 flex=369 (85% of matmul)
   d128 N16384 full       3.465 ms  flashfold=635 cudnn=606 flash=355 efficient=175 flex=487 (94% of matmul)
   d128 N16384 document   0.667 ms  flashfold=310 flex=304 (46% of matmul)

| D | N | mask | flashfold | cuDNN | FA2 (flash) | efficient | Flex | ff/cuDNN | ff/FA2 | ff/Flex | ff/matmul |
|---|---|---|---|---|---|---|---|---|---|---|---|
| 128 | 4096 | full | 617 | 629 | 345 | 173 | 476 | 0.97 | 1.79 | 1.30 | 91% |
| 128 | 4096 | causal | 576 | 533 | 302 | 160 | 369 | 1.08 | 1.91 | 1.56 | 85% |
| 128 | 16384 | full | 635 | 606 | 355 | 175 | 487 | 1.05 | 1.79 | 1.30 | 94% |
| 128 | 16384 | document | 310 | - | - | - | 304 | - | - | 1.02 | 46% |
total 142s; correctness PASSED
"""

QUICK_ATTENTION = """torch 2.11.0+cu130, triton 3.6.0, NVIDIA H200, python 3.12.3
== speed: bfloat16, H=16, B*N = 16384 tokens, do_bench median
   bf16 matmul 8192^3 in this run: 690 TFLOP/s (the ceiling column)
   d128 N4096  full       0.891 ms  flashfold=700 cudnn=600 flash=345 efficient=173 flex=476 (91% of matmul)
"""

BACKWARD = """torch 2.11.0+cu130, triton 3.6.0, NVIDIA H200, python 3.12.3
== backward correctness: 4/4 cases passed
== backward speed: bfloat16, H=16, B*N = 16384 tokens, do_bench median; backward = autograd.grad of a retained graph, fwd+bwd = both
   d128 N1024  full   bwd flashfold=438 ff-det=284 cudnn=435 flash=227  fwd+bwd flashfold=450 ff-det=335 cudnn=446 flash=249  fwd+bwd CUDA graph flashfold=450 cudnn=453
   d128 N4096  full   bwd flashfold=512 ff-det=368 cudnn=505 flash=287  fwd+bwd flashfold=531 ff-det=413 cudnn=535 flash=305  fwd+bwd CUDA graph flashfold=529 cudnn=526
   d64 N4096  full   bwd flashfold=414 ff-det=295 cudnn=440 flash=266  fwd+bwd flashfold=424 ff-det=330 cudnn=435 flash=275  fwd+bwd CUDA graph flashfold=419 cudnn=432
   d64 N4096  causal bwd flashfold=360 ff-det=265 cudnn=369 flash=223  fwd+bwd flashfold=377 ff-det=296 cudnn=375 flash=233  fwd+bwd CUDA graph flashfold=377 cudnn=377
total 265s; backward correctness PASSED, determinism PASSED, torch.compile PASSED
"""

DECODE = """2.11.0+cu130 3.6.0 NVIDIA H200 132 SMs
== checks: all passed (46s)
== device copy: 4244 GB/s (read + write bytes)
== timing: GB/s of K and V read (bf16, 32/8 heads, head_dim 128, q_len 1)
  batch   8 len   8192 ( 4 splits,  3.6s): flashfold 2119, flashfold inv 1986, flashfold p16 2788, flashfold p64 2062, sdpa flash 3231, sdpa cudnn 3366, sdpa paged p16 1123, flashfold [graph] 3380, flashfold inv [graph] 3219, sdpa flash [graph] 3231, sdpa cudnn [graph] 3370, flashfold [clean] 3844, flashfold inv [clean] 3606, sdpa cudnn [clean] 3830
  batch   1 len    512 ( 2 splits,  8.7s): flashfold 33, flashfold inv 23, sdpa flash 34, sdpa cudnn 38, flashfold [graph] 174, flashfold inv [graph] 168, sdpa cudnn [graph] 177
  target (graph): batch 8 len 8192 >= SDPA cuDNN: PASS (ratio 1.00)
"""

REDUCTIONS = """flashfold reductions: NVIDIA H200, 132 SMs, torch 2.11.0+cu130, triton 3.6.0, python 3.12.3
device-to-device copy of 1 GiB: 0.506 ms = 4248 GB/s (read + write)
== timings (median of triton.testing.do_bench) ==
  logsumexp            16384x16384        float32      0.253 ms    4247 GB/s | torch    1.825 ms | graph    0.253 ms torch    1.816 ms
  sum                  16384x16384 dim 0  float32      0.259 ms    4145 GB/s | torch    0.259 ms | graph    0.258 ms torch    0.258 ms
  argmax               1048576x7          float32      0.024 ms    1223 GB/s | torch    0.025 ms | graph    0.024 ms torch    0.026 ms
== summary (copy 4250 GB/s in this run) ==
| op | shape | dtype | flashfold ms | GB/s | % copy | torch ms | torch GB/s | speedup | graph ms | torch graph ms | graph speedup |
|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|
| logsumexp | 16384x16384 | float32 | 0.253 | 4247 | 99.9% | 1.825 | 588 | 7.22x | 0.253 | 1.816 | 7.17x |
| sum | 16384x16384 dim 0 | float32 | 0.259 | 4145 | 97.5% | 0.259 | 4149 | 0.99x | 0.258 | 0.258 | 1.00x |
| argmax | 1048576x7 | float32 | 0.024 | 1223 | 28.8% | 0.025 | 1161 | 1.05x | 0.024 | 0.026 | 1.08x |

rows slower than torch: ['sum 16384x16384 dim 0 float32']
correctness failures: none
"""

RING = """flashfold ring attention benchmark: 2 rank(s), backend nccl, device NVIDIA H200, torch 2.11.0+cu130
== correctness (ring): max err <= 2 * naive torch.bfloat16 err + fp32 rounding, reference float64; B=2 Hq=8 Hk=4 D=128 N=3007
  ok  zigzag     causal=True  o 7.5e-03 (naive 1.6e-02, single 7.5e-03)
== timing (ring over 2 ranks, nccl on cuda): torch.bfloat16, B=1, Hq=16, Hk=16, D=128; mean ms per call, slowest rank
  zigzag     causal=True  N= 65536  fwd single    35.24 ms (  499 TF/s)  ring    19.71 ms (  893 TF/s aggregate)  compute-only    18.58 ms  eff 89.4% overlap 94.3%  | fwd+bwd single   151.18 ms (  407 TF/s) ring    81.17 ms  compute-only    78.15 ms eff 93.1% overlap 96.3%
  zigzag     causal=True  N=131072  fwd single   143.53 ms (  490 TF/s)  ring    74.36 ms (  946 TF/s aggregate)  compute-only    72.89 ms  eff 96.5% overlap 98.0%  | fwd+bwd single   600.27 ms (  410 TF/s) ring   322.46 ms  compute-only   312.01 ms eff 93.1% overlap 96.8%
"""

TRANSFORMERS = """torch 2.11.0+cu130, transformers 5.17.0, NVIDIA H200

== timing: Llama-shaped (hidden 2048, 16/8 heads of 128, 4 layers), bfloat16, batch 8 x 2048 tokens, do_bench median
  case                                      flashfold ms     sdpa ms  ff / sdpa
  prefill                                          19.57       19.09       1.02
  prefill + 64 decode steps                       332.88      405.74       0.82

all checks passed (31 s)
"""

WORKLOADS = """torch 2.11.0+cu130, triton 3.6.0, NVIDIA H200, python 3.12.3
== workloads: grid full, rows all, directions fwd+bwd, peers cudnn flash fa4 flex, bfloat16, 16384 tokens per batch, do_bench median
   bf16 matmul 8192^3 in this run: 690 TFLOP/s
   FlashAttention-4 4.0.0b36, nvidia-cutlass-dsl 4.8.1
== second pass: check against a peer, then time (3 rows)
-- [1/3] llama-4k: Llama-3 8B / Qwen2.5 training | d128 32:8 causal N4096 B4
   check flashfold vs FA4: ok: o 3.1e-03, lse 2.0e-06, dq/dk/dv 1.1e-02/9.0e-03/8.7e-03
   fwd     eager | Llama-3 8B / Qwen2.5 training | d128 32:8 causal N4096 B4 | flashfold 0.912 ms 603 | cudnn 571 (1.06) | flash 310 (1.95) | fa4 622 (0.97) | flex - | best FA4 622 | ratio 0.97 | ok
   fwd     graph | Llama-3 8B / Qwen2.5 training | d128 32:8 causal N4096 B4 | flashfold 0.900 ms 611 | cudnn 580 (1.05) | flash 312 (1.96) | fa4 600 (1.02) | flex - | best cuDNN 600 | ratio 1.02 | ok
   bwd     eager | Llama-3 8B / Qwen2.5 training | d128 32:8 causal N4096 B4 | flashfold 2.600 ms 529 | cudnn 498 (1.06) | flash 280 (1.89) | fa4 510 (1.04) | flex - | best FA4 510 | ratio 1.04 | ok
-- [2/3] llama-varlen: Llama-3 8B / Qwen2.5, packed documents | d128 32:8 causal varlen 24 docs 41-1302 16384 tokens
   fwd     eager | Llama-3 8B / Qwen2.5, packed documents | d128 32:8 causal varlen 24 docs 41-1302 16384 tokens | flashfold 0.700 ms 480 | cudnn - | flash - | fa4 500 (0.96) | flex 300 (1.60) | best FA4 500 | ratio 0.96 | CHECK FAILED
-- [3/3] minilm-padding: MiniLM | d32 12 heads key padding 64-512 N512 B32
   fwd     graph | MiniLM | d32 12 heads key padding 64-512 N512 B32 | flashfold - ms - | cudnn 200 | flash - | fa4 250 | flex 100 | best FA4 250 | ratio - | ok
varlen / equal lengths (llama-equal, TFLOP/s ratio; target >= 0.97): fwd eager flashfold 0.80 (FA4 0.85)
== checks: 2/3 rows passed, 0 not checked
total 412s; checks FAILED
"""

QUICK_WORKLOADS = WORKLOADS.replace("grid full", "grid quick").replace("| 603 |", "| 700 |")

DETERMINISTIC = """$ PYTHONPATH=src python benchmarks/deterministic_bwd.py
torch 2.11.0+cu130, triton 3.6.0, NVIDIA H200, python 3.12.3
== deterministic=True against the default backward (bf16, eager, do_bench median)
  d128 dense 4K x4                           | default   2.704 ms  508 TFLOP/s (runs equal: False) | deterministic   2.858 ms  481 TFLOP/s (runs equal: True) | det/default 0.946 | max diff 2.0e-03 | ok
  MLA qk192 v128 causal 4K x4                | default   2.779 ms  309 TFLOP/s (runs equal: False) | deterministic   3.721 ms  231 TFLOP/s (runs equal: True) | det/default 0.747 | max diff 2.9e-03 | ok
checks PASSED
"""


@pytest.fixture
def logs(tmp_path):
    d = tmp_path / "benchmarks" / "logs"
    d.mkdir(parents=True)
    files = {"2026-11-30_h200_attention_fwd.log": ATTENTION,
             "2026-12-01_h200_attention_fwd_quick.log": QUICK_ATTENTION,
             "2026-11-29_h200_attention_fwd_old.log": ATTENTION.replace("617", "500"),
             "2026-11-30_h200_attention_bwd.log": BACKWARD,
             "2026-11-30_h200_decode.log": DECODE,
             "2026-11-30_h200_reductions.log": REDUCTIONS,
             "2026-11-29_h200x2_ring.log": RING,
             "2026-11-29_h200_transformers_timing.log": TRANSFORMERS,
             "2026-12-02_h200_workloads.log": WORKLOADS,
             "2026-12-03_h200_workloads_quick.log": QUICK_WORKLOADS,
             "2026-12-02_h200_deterministic_bwd.log": DETERMINISTIC,
             "2026-12-02_h200_decode_fp8.log": DECODE_FP8,
             "2026-12-05_h200_attention_fp8.log": ATTENTION_FP8,
             "2026-12-04_cpu_numerics.log": NUMERICS,
             "2026-11-30_h200_notes.log": "nothing a parser knows\n"}
    for name, text in files.items():
        (d / name).write_text(text)
    return d


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_the_page_has_one_table_per_family_with_its_provenance(logs):
    out = logs.parent / "RESULTS.md"                  # benchmarks/RESULTS.md beside logs/
    chosen = bench.write_results(sorted(str(p) for p in logs.glob("*.log")), str(out))
    assert list(chosen) == list(bench.FAMILIES)
    text = out.read_text()
    assert len(text.splitlines()) < 400
    for kind, title in bench.FAMILIES.items():
        sec = _section(text, title)
        if kind == "numerics":                        # a CPU run of the command line
            assert "CPU x86_64" in sec and "\nflashfold numerics\n" in sec
            assert sec.count("\n| ") >= 3
            continue
        assert "NVIDIA H200" in sec and "torch 2.11.0+cu130" in sec, title
        assert sec.count("```") >= 2 and "benchmarks/" in sec, title        # the command
        assert sec.count("\n| ") >= 3, title                                # a table
    fwd = _section(text, "Attention forward")
    assert "2026-11-30" in fwd and "triton 3.6.0" in fwd
    assert "\nPYTHONPATH=src python benchmarks/attention.py\n" in fwd
    assert "log `logs/2026-11-30_h200_attention_fwd.log`" in fwd
    assert "680 TFLOP/s" in fwd                                   # the run's own ceiling
    for peer in ("cuDNN", "FA2", "efficient", "Flex"):
        assert f"ff/{peer.split()[0]}" in fwd, peer
    # the run's printed ratio (0.97), not the ratio of the rounded rates (617 / 629 = 0.98)
    assert "| 128 | 4096 | full | 617 | 629 | 345 | 173 | 476 | 0.97 | 1.79 | 3.57 | 1.30 |" in fwd
    assert "| 128 | 16384 | document | 310 | - | - | - | 304 | - | - | - | 1.02 |" in fwd
    assert "Below cuDNN in this run (ratio < 1.00): d128 4K full 0.97." in fwd
    assert "== correctness: 2/2 cases passed" in fwd
    bwd = _section(text, "Attention backward")
    assert "attention.py --bwd\n" in bwd and "680 TFLOP/s" in bwd      # the forward's roof
    assert "| 128 | 1024 | full | 438 | 284 | 435 | 227 | 1.01 | 0.65 | 1.93 | 450 | 446 | 249 " \
           "| 1.01 | 450 | 453 | 0.99 |" in bwd
    dec = _section(text, "Decoding against a KV cache")
    assert "decode.py\n" in dec and "4,244 GB/s" in dec
    assert "| 8 | 8192 | clean L2 | 3,844 | 3,606 |" in dec and "| 1 | 512 | graph | 174 |" in dec
    assert "1 x 512 graph 0.98" in dec and "PASS (ratio 1.00)" in dec
    red = _section(text, "Reductions and scans")
    assert "reductions.py --no-variants" in red and "4,248 GB/s" in red
    assert "| sum | 16384x16384 dim 0 | float32 | 0.259 | 4,145 | 97.6% | 0.259 |" in red
    assert "sum 16384x16384 dim 0 float32 (eager) 0.99" in red
    ring = _section(text, "Ring attention across GPUs")
    assert "2 x NVIDIA H200" in ring and "--nproc_per_node=2 benchmarks/ring.py" in ring
    assert "| zigzag causal | 131072 | fwd | 143.53 | 74.36 | 72.89 | 96.5% | 98.0% |" in ring
    assert "N = 131,072: zigzag causal 96.5% forward, 93.1% forward + backward" in ring
    tf = _section(text, "Hugging Face transformers")
    assert "transformers_gpu.py --timing-only" in tf and "transformers 5.17.0" in tf
    assert "| prefill + 64 decode steps | 332.88 | 405.74 | 1.22 |" in tf
    assert "Below SDPA in this run (ratio < 1.00): prefill 0.98." in tf


def test_the_workload_tables_come_from_the_workload_log(logs):
    out = logs.parent / "RESULTS.md"
    chosen = bench.write_results(sorted(str(p) for p in logs.glob("*.log")), str(out))
    run = chosen["workloads"]
    assert run.date == "2026-12-02" and not run.quick            # the later quick run loses
    text = out.read_text()
    assert "- [Attention workloads (models)](#attention-workloads-models)" in text
    sec = _section(text, "Attention workloads (models)")
    assert "\nPYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:src python " \
           "benchmarks/workloads.py\n" in sec
    assert "690 TFLOP/s" in sec and "2026-12-02 · NVIDIA H200" in sec
    # one table: a column per direction and mode the log has (no forward + backward here)
    head = ("| model | shape | Forward, eager | Forward, CUDA graph replay | Backward alone, "
            "eager |")
    # (the later quick run's rows follow as a table of their own)
    main, _, later = sec.partition("### Rows measured again")
    assert main.count(head) == 1 and "Forward + backward" not in main
    assert "workloads.py --quick" in later
    # flashfold's TFLOP/s, the best peer by name and the run's own ratio (0.97)
    assert ("| Llama-3 8B / Qwen2.5 training | d128 32:8 causal N4096 B4 | 603 · FA4 622 · 0.97 "
            "| 611 · FA4 600 · 1.02 | 529 · FA4 510 · 1.04 |") in sec
    # a failed check marks the timing; a flashfold that did not run leaves its ratio empty;
    # a direction without a measurement reads -
    assert "| 480 (check failed) · FA4 500 · 0.96 | - | - |" in sec
    assert "| MiniLM | d32 12 heads key padding 64-512 N512 B32 | - | - · FA4 250 · - | - |" \
        in sec
    assert ("Below the best peer in this run (ratio < 1.00): Llama-3 8B / Qwen2.5 training d128 "
            "32:8 causal N4096 B4 (forward, eager) 0.97; Llama-3 8B / Qwen2.5, packed documents") \
        in sec
    assert "== checks: 2/3 rows passed" in sec and "varlen / equal lengths (llama-equal" in sec
    quick = bench.parse(QUICK_WORKLOADS, "x.log")[0]
    assert quick.quick and quick.command.endswith("workloads.py --quick")
    sub = bench.parse(WORKLOADS.replace("rows all", "rows 'gemma'").replace(
        "directions fwd+bwd", "directions fwd"), "x.log")[0]
    assert sub.quick and sub.command.endswith("workloads.py --rows 'gemma' --fwd-only")
    assert not any("--budget" in v for v in run.verdicts)      # every peer ran


def test_later_runs_with_more_peers_get_tables_of_their_own(tmp_path):
    """A grid run without FA4 keeps its table; each later ``--rows`` run gets a section of
    its own after it, oldest first (each ratio from one run): one that timed FA4 says so,
    one with no new peer is a re-measurement; an earlier run gets none."""
    no_fa4 = re.sub(r"fa4 \d+( \([\d.]+\))?", "fa4 -", WORKLOADS)
    subset = WORKLOADS.replace("rows all", "rows 'llama-4k'")
    # a later --no-peers run (flashfold's kernels alone) has no ratio: left to its log
    alone = re.sub(r"\| (cudnn|flash|fa4|flex) [^|]*", r"| \1 - ", subset).replace(
        "best FA4 622", "best -").replace("best cuDNN 600", "best -").replace(
        "best FA4 510", "best -")
    files = {"2026-12-02_h200_workloads.log": no_fa4,
             "2026-12-02_h200_workloads_rows.log": subset,
             "2026-12-03_h200_workloads_again.log": no_fa4.replace("rows all", "rows 'x'"),
             "2026-12-04_h200_workloads_kernels.log": alone,
             "2026-12-01_h200_workloads_rows.log": subset}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    runs = [r for p in sorted(tmp_path.glob("*.log")) for r in bench.parse_file(str(p))]
    chosen = bench.latest(runs)
    assert os.path.basename(chosen["workloads"].source) == "2026-12-02_h200_workloads.log"
    extra = bench.supplements(runs, chosen)["workloads"]
    assert [os.path.basename(r.source) for r in extra] == [
        "2026-12-02_h200_workloads_rows.log", "2026-12-03_h200_workloads_again.log"]
    sec = _section(bench.results_markdown(runs), "Attention workloads (models)")
    head, _, more = sec.partition("### Rows measured again with FA4")
    assert "| 603 · cuDNN 571 · " in head and "FA4" not in head.split("Below")[0]
    more, _, again = more.partition("### Rows measured again\n")
    assert "logs/2026-12-02_h200_workloads_rows.log" in more
    assert "workloads.py --rows 'llama-4k'" in more
    assert "| 603 · FA4 622 · 0.97 |" in more
    assert "logs/2026-12-03_h200_workloads_again.log" in again and "timed again in a later" \
        in again and "| 603 · cuDNN 571 · " in again
    assert "workloads_kernels" not in sec
    assert [r for r in runs if "kernels" in r.source][0].rows      # parsed, with no peer
    assert "2026-12-01" not in sec




def test_the_deterministic_backward_has_a_table():
    run, = bench.parse(DETERMINISTIC, "2026-12-02_h200_deterministic_bwd.log")
    assert run.kind == "deterministic" and len(run.rows) == 2 and not run.quick
    assert run.device == "NVIDIA H200" and run.software == "torch 2.11.0+cu130, triton 3.6.0"
    assert run.command == "PYTHONPATH=src python benchmarks/deterministic_bwd.py"
    assert run.rows[1]["ratio"] == 0.747 and run.rows[1]["equal"] == (False, True)
    assert run.verdicts == ["checks PASSED"]
    sec = _section(bench.results_markdown([run]), "Deterministic backward")
    assert "| d128 dense 4K x4 | 2.704 | 508 | 2.858 | 481 | 0.95 | no, yes |" in sec
    assert "Below the target of 0.90x the default: MLA qk192 v128 causal 4K x4 0.75." in sec


def test_a_deterministic_row_that_failed_its_check_is_marked():
    """A row whose deterministic backward differed from the default (or gave different
    bits twice) is marked in the table, as the FP8 and workload tables mark theirs."""
    failed = DETERMINISTIC.replace("max diff 2.0e-03 | ok", "max diff 3.0e-01 | FAILED").replace(
        "checks PASSED", "checks FAILED")
    run, = bench.parse(failed, "2026-12-02_h200_deterministic_bwd.log")
    assert [r["check"] for r in run.rows] == ["FAILED", "ok"]
    sec = _section(bench.results_markdown([run]), "Deterministic backward")
    assert "| d128 dense 4K x4 (check failed) | 2.704 | 508 | 2.858 | 481 | 0.95 | no, yes |" \
        in sec
    assert "| MLA qk192 v128 causal 4K x4 | 2.779 |" in sec


DECODE_FP8 = """2.11.0+cu130 3.6.0 NVIDIA H200 132 SMs
== FP8 (E4M3) caches: correctness (criterion: err vs float64 of the unquantized cache <= 2 x a naive FP8 decode's)
  [ok] fp8 full 8K, batch 8       contiguous default   err 3.05e-01 <= 2 x naive FP8 2.82e-01
== device copy: 4227 GB/s (read + write bytes)
== FP8 against bf16, flashfold, graph replays after a read flush (32/8 heads, head_dim 128, q_len 1)
batch    len |  bf16 us   fp8 us speedup fp8 GB/s % copy | bf16 p64  fp8 p64 speedup
------------------------------------------------------------------------------------
    8   8192 |     68.4     55.9    1.22     2399   56.8 |     68.9     63.0    1.09
   64  32768 |   2159.9   1437.3    1.50     2988   70.7 |   1927.0   1271.8    1.52

  target: batch 8 len 8192: fp8 >= 1.8x bf16 tokens/s: FAIL (1.22x); K/V read >= 90% of copy: FAIL (56.8%)
== checks: all passed
"""

NUMERICS = """flashfold numerics: CPU x86_64, torch 2.13.0+cpu, python 3.11.7
| N | stats | order | rel. err. d | err. o | spec bound γ_{N-1} | γ_K (K) | √N·u |
|---:|:---|:---|---:|---:|---:|---:|---:|
| 10 | float32 | sequential | 4.69e-08 | 3.68e-08 | 5.36e-07 | 8.34e-07 (14) | 1.88e-07 |

bound violated in: no configuration
relative error of d at N = 10, fp32 vs bf16 statistics: sequential 4.7e-08 vs 2.8e-04: statistics must stay in fp32

FP8 (E4M3) attention against float64, next to bf16: causal, 1 x 4 heads x 1024 x 128, seed 0; outliers: 3 channels of q and k x 20.

| inputs | q, k rotated | bf16 RMS | bf16 max | FP8 RMS | FP8 max | naive FP8 RMS | naive FP8 max | FP8 max / naive |
|---|---|---:|---:|---:|---:|---:|---:|---:|
| random | no | 3.77e-04 | 9.33e-03 | 5.72e-03 | 1.51e-01 | 5.21e-03 | 1.49e-01 | 1.01 |
| outliers | yes | 2.71e-02 | 1.20e+00 | 9.25e-02 | 3.49e+00 | 9.77e-02 | 3.60e+00 | 0.97 |
"""

ATTENTION_FP8 = """torch 2.11.0+cu130, triton 3.6.0, NVIDIA H200, python 3.12.3
## Checks (last 256 rows of batch 0, head 0, at the full shape)
  ok   dense d128: no NaN
checks: all passed

## FP8 forward, TFLOP/s (eager | CUDA graph) and ratios of FP8 over each
| row | fp8 | bf16 | cuDNN bf16 | fp8 graph | bf16 graph | cuDNN graph | cuDNN fp8 | /bf16 | /cuDNN | /bf16 graph | /cuDNN graph | /cuDNN fp8 | |
|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|
| dense d128 | 900 | 600 | 610 | 1000 | 620 | 630 | 950 | 1.50 | 1.48 | 1.61 | 1.59 | 0.95 | |
| gemma2 d256 causal softcap | 700 | 500 | nan | 750 | 520 | nan | nan | 1.40 | - | 1.44 | - | - | CHECK FAILED |

cuDNN FP8 peer: nvidia-cudnn-frontend is not installed on this machine
FlashAttention-4 FP8 peer: none on SM90 (4.0.0b36 runs FP8 on SM100 only)
"""


def test_the_fp8_families_have_tables():
    """FP8 decode (``decode.py --fp8``), the FP8 forward (``attention_fp8.py``) and the
    numerics table (``flashfold numerics``, a CPU run) each get their own section."""
    dec, = bench.parse(DECODE_FP8, "2026-12-02_h200_decode_fp8.log")
    assert dec.kind == "decode_fp8" and len(dec.rows) == 2 and dec.ceiling == 4227
    assert dec.command == "PYTHONPATH=src python benchmarks/decode.py --fp8"
    assert dec.rows[1]["us"]["fp8 p64"] == 1271.8 and dec.rows[1]["speedup"] == 1.50
    assert dec.verdicts == ["== checks: all passed"]
    num, = bench.parse(NUMERICS, "2026-12-04_cpu_numerics.log")
    assert num.kind == "numerics" and num.command == "flashfold numerics"
    assert num.device == "CPU x86_64" and num.software == "torch 2.13.0+cpu"
    assert num.rows[1]["values"]["FP8 max / naive"] == 0.97
    att, = bench.parse(ATTENTION_FP8, "2026-12-05_h200_attention_fp8.log")
    assert att.kind == "attention_fp8" and [r["check"] for r in att.rows] == ["ok", "failed"]
    assert att.rows[1]["values"]["/cuDNN"] is None and att.rows[0]["values"]["/bf16 graph"] == 1.61
    page = bench.results_markdown([dec, num, att])
    sec = _section(page, "Decoding over an FP8 KV cache")
    assert "| 8 | 8192 | 68.4 | 55.9 | 1.22 | 2,399 | 56.8 | 68.9 | 63.0 | 1.09 |" in sec
    assert ("Below the targets (1.8x bf16, 90% of the copy rate; contiguous cache): "
            "8 x 8192 1.22x, 57%; 64 x 32768 1.50x, 71%.") in sec
    sec = _section(page, "Numerics: FP8 and bf16 against float64")
    assert "| outliers | yes | 2.71e-02 | 1.20e+00 | 9.25e-02 | 3.49e+00 | 9.77e-02 | 3.60e+00 | 0.97 |" in sec
    assert "CPU x86_64" in sec and "own checks" not in sec
    sec = _section(page, "FP8 attention forward")
    assert ("| gemma2 d256 causal softcap (check failed) | 700 | 500 | - | 750 | 520 | - | - | "
            "1.40 | - | 1.44 | - | - |") in sec
    assert att.rows[0]["values"]["/cuDNN fp8"] == 0.95
    assert ("Below the target of 1.6x flashfold's bf16 forward (graph): gemma2 d256 causal "
            "softcap 1.44.") in sec
    assert "FlashAttention-4 FP8 peer: none on SM90" in sec


def test_rows_whose_peers_the_budget_left_untimed_are_named():
    text = WORKLOADS.replace(
        "   check flashfold vs FA4: ok: o 3.1e-03",
        "   warm: flashfold 2.0s, cudnn skipped (time budget), flex skipped (time budget)\n"
        "   check flashfold vs FA4: ok: o 3.1e-03").replace(
        "-- [3/3] minilm-padding: MiniLM | d32 12 heads key padding 64-512 N512 B32\n",
        "-- [3/3] minilm-padding: MiniLM | d32 12 heads key padding 64-512 N512 B32\n"
        "   warm: flashfold 1.0s, fa4 skipped (time budget)\n")
    run = bench.parse(text, "x.log")[0]
    assert run.verdicts[-1] == ("peers not timed (the run's --budget ran out first): "
                                "llama-4k, minilm-padding")


def test_latest_full_run_wins_over_a_later_quick_one_and_an_older_full_one(logs):
    runs = [r for p in sorted(logs.glob("*attention_fwd*.log")) for r in bench.parse_file(str(p))]
    assert sorted((r.date, r.quick) for r in runs) == [("2026-11-29", False), ("2026-11-30", False),
                                                       ("2026-12-01", True)]
    chosen = bench.latest(runs)["attention"]
    assert chosen.date == "2026-11-30" and chosen.command.endswith("attention.py")
    quick = [r for r in runs if r.quick][0]
    assert quick.command.endswith("attention.py --quick")
    assert bench.latest([quick])["attention"] is quick          # no full run: the quick one


def test_commands_read_off_the_output():
    red = bench.parse(REDUCTIONS, "x.log")[0]
    assert red.command == "PYTHONPATH=src python benchmarks/reductions.py --no-variants"
    variants_after = REDUCTIONS.replace("== summary", "== heuristic variants ==\n== summary")
    assert bench.parse(variants_after, "x.log")[0].command.endswith("reductions.py")
    tf = bench.parse(TRANSFORMERS.replace("\n\n==", "\n== correctness\n=="), "x.log")[0]
    assert tf.command.endswith("transformers_gpu.py")
    simulated = RING.replace("2 rank(s)", "1 rank(s)").replace("compute-only", "est.")
    assert bench.parse(simulated, "x.log") == []                 # estimates make no table


def test_the_command_writes_the_page(logs, tmp_path, capsys):
    bench_dir = logs.parent
    (bench_dir / "attention.py").write_text("")
    assert main(["bench", "--results", "--bench-dir", str(bench_dir)]) == 0
    out = capsys.readouterr().out
    assert (bench_dir / "RESULTS.md").is_file() and "wrote" in out
    assert "Attention forward: 2026-11-30_h200_attention_fwd.log" in out
    other = tmp_path / "page.md"
    assert main(["bench", "--results", str(other), "--from-log",
                 str(logs / "2026-11-29_h200x2_ring.log")]) == 0
    text = other.read_text()
    assert "## Ring attention across GPUs" in text and "No log for: Attention forward" in text


def test_a_log_that_cannot_be_read_is_named(logs, capsys):
    """A log that cannot be read (a dangling link, a folder named *.log) is named as what
    failed, not the page being written."""
    bench_dir = logs.parent
    (bench_dir / "attention.py").write_text("")
    for bad in (logs / "2026-12-07_gone.log", logs / "2026-12-08_folder.log"):
        if bad.name.endswith("gone.log"):
            bad.symlink_to(logs / "no_such_target")
        else:
            bad.mkdir()
        assert main(["bench", "--results", "--bench-dir", str(bench_dir)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--results: cannot read {bad}" in err, err
        assert "cannot write" not in err and not (bench_dir / "RESULTS.md").exists()
        bad.rmdir() if bad.is_dir() else bad.unlink()


def test_a_log_of_a_family_without_a_plot_says_so(logs, tmp_path, capsys):
    """A ring (or workloads, transformers...) log given to --from-log feeds the results page
    only: the command says that, not that no log was passed."""
    ring = str(logs / "2026-11-29_h200x2_ring.log")
    assert main(["bench", "--from-log", ring, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass --from-log" not in err, err
    assert "ring" in err and "--results" in err, err


def test_the_checked_in_page_is_what_the_logs_give():
    """benchmarks/RESULTS.md is regenerated from benchmarks/logs/ (no hand edits)."""
    logs = sorted((ROOT / "benchmarks" / "logs").glob("*.log"))
    page = bench.results_markdown([r for p in logs for r in bench.parse_file(str(p))], "logs")
    assert page == (ROOT / "benchmarks" / "RESULTS.md").read_text()


# --- user mistakes: one line, non-zero exit, no traceback --------------------------------------

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "flashfold.cli", *args], capture_output=True,
                          text=True, timeout=300, cwd=str(ROOT))


def test_a_missing_log_is_one_line():
    res = _cli("bench", "--from-log", "/missing.log")
    assert res.returncode == 2, res
    assert "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == ["flashfold bench: no such file: /missing.log"]


def test_run_without_a_gpu_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(bench, "_gpu_available", lambda: False)
    assert main(["bench", "--run", "attention", "--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA GPU" in err[0], err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_run_without_a_gpu_is_one_line_from_the_shell():
    res = _cli("bench", "--run", "attention", "--quick")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert len(res.stderr.strip().splitlines()) == 1 and "no CUDA GPU" in res.stderr


def test_kernel_times_lists_what_a_call_runs_per_call():
    """``kernel_times`` (CPU operators here): per-call times and counts, longest first."""
    import torch
    a = torch.randn(256, 256)
    rows = bench.kernel_times(lambda: (a @ a, a @ a, a.sum()), reps=3, cuda=False)
    names = {name: calls for _, calls, name in rows}
    assert names["aten::mm"] == 2 and names["aten::sum"] == 1, rows
    assert [t for t, _, _ in rows] == sorted((t for t, _, _ in rows), reverse=True)
    assert all(t > 0 for t, _, _ in rows)


def test_an_output_folder_that_cannot_be_written_is_one_line(tmp_path, capsys):
    """``--out`` naming a file (or a folder under one) and a ``--prefix`` that names a
    folder are refused on the command line, before any log is read or benchmark run."""
    log = str(ROOT / "benchmarks" / "logs" / "2026-11-30_h200_attention_fwd.log")
    f = tmp_path / "a_file"
    f.write_text("")
    for argv, msg in ((["--out", str(f)], "--out"), (["--out", str(f / "sub")], "--out"),
                      (["--out", str(tmp_path / "o"), "--prefix", "a/b_"], "--prefix")):
        with pytest.raises(SystemExit) as e:
            main(["bench", "--from-log", log, *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and msg in err, err
        assert "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_logs_with_no_results_leave_the_page_alone(logs, tmp_path, capsys):
    """``--results`` over logs that hold no benchmark (a tuning log, a note) fails without
    replacing the page it would have written with an empty one."""
    page = logs.parent / "RESULTS.md"
    page.write_text("the page as it was\n")
    (logs.parent / "attention.py").write_text("")
    note = str(logs / "2026-11-30_h200_notes.log")
    assert main(["bench", "--results", "--bench-dir", str(logs.parent), "--from-log", note]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no benchmark results recognized in 1 log(s)" in err, err
    assert page.read_text() == "the page as it was\n"
    with pytest.raises(ValueError, match="^paths: no benchmark results recognized"):
        bench.write_results([note], str(page))
    assert page.read_text() == "the page as it was\n"
    assert not (tmp_path / "new.md").exists()
    assert main(["bench", "--results", str(tmp_path / "new.md"), "--from-log", note]) == 2
    assert not (tmp_path / "new.md").exists()
