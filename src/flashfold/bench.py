r"""``flashfold bench``: run the GPU benchmarks, plot their saved results as PNG files, or
write the results page (``benchmarks/RESULTS.md``) from them.

Three benchmark scripts live in ``benchmarks/`` of a source checkout
(``attention.py``, ``decode.py``, ``reductions.py``); each prints its results as text
(the logs in ``benchmarks/logs/`` are such output). This module reads that text and draws:

* ``attention_fwd.png``: TFLOP/s against sequence length, one panel per head dim and mask
  (no mask, causal; sliding window / document as bars), one line per implementation
  (flashfold, cuDNN, FlashAttention 2, memory-efficient, FlexAttention), the bf16 matmul
  rate measured in the same run drawn as the ceiling;
* ``attention_bwd.png``: the same for the backward pass (``--bwd`` runs: flashfold default
  and deterministic, cuDNN, FlashAttention 2; forward + backward dotted);
* ``decode.png``: GB/s of K and V read against the cached length, one panel per batch size,
  one line per implementation and cache layout (CUDA-graph replays, and flashfold eager),
  the device-to-device copy of the same run as the ceiling;
* ``reductions.png``: GB/s per operation and shape, flashfold next to torch, the copy as the
  ceiling.

Titles carry the device, the software versions and the date of the run; axes carry units.

The results page has one table per family (attention forward and backward, decode,
reductions and scans, ring attention, transformers), each drawn from the family's latest
full log (:func:`latest`) with its date, device, versions, the command that printed it
(:func:`command_of`), every peer the run measured with flashfold's ratio to it, and the
run's own check lines; ``benchmarks/ring.py``, ``benchmarks/transformers_gpu.py`` and
``benchmarks/workloads.py`` logs feed tables only.

Usage::

    flashfold bench --from-log benchmarks/logs/2026-11-30_h200_attention_fwd.log
    flashfold bench --from-log benchmarks/logs/*.log --out docs
    flashfold bench --from-table benchmarks/RESULTS.md     # the markdown tables in a file
    flashfold bench --run attention decode [--quick]       # on a GPU, from the checkout
    flashfold bench --results                              # benchmarks/logs/*.log -> RESULTS.md

A missing file, ``--run`` without a CUDA device, or a benchmark that fails prints one line
on stderr and exits non-zero.

``--run`` starts each script (``python benchmarks/NAME.py``) with ``src`` on the path,
saves its output to ``OUT/<date>_<name>.log``, shows a progress bar on stderr (timing rows
done / rows in the script's grid) and plots the result. matplotlib (Agg backend) is
imported only when a plot is drawn.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# =====================================================================================
# progress bar
# =====================================================================================


class ProgressBar:
    """A text progress bar on stderr (``\\r``-redrawn on a terminal, a line per 10% or at
    most one line every 5 s otherwise).

    ``bar.update(done, total=None, label="")``; ``bar(msg)`` also accepts a message with a
    ``[done/total]`` counter (the form :func:`flashfold.numerics` reports), so a bar can be
    passed as its ``progress`` callable. ``total=None``: a counter without a bar.
    """

    def __init__(self, name: str, total: int | None = None, stream=None, width: int = 28):
        self.name = name
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.done = 0
        self.t0 = time.perf_counter()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_pct = -1
        self._last_t = 0.0
        self._open = False

    def __call__(self, msg: str):
        m = re.search(r"\[(\d+)/(\d+)\]\s*(.*)", msg)
        if m:
            self.update(int(m.group(1)), int(m.group(2)), m.group(3))
        else:
            self.update(self.done, label=msg)

    def _elapsed(self) -> str:
        s = int(time.perf_counter() - self.t0)
        return f"{s // 60:02d}:{s % 60:02d}"

    def render(self, label: str = "") -> str:
        if self.total:
            frac = min(1.0, self.done / self.total)
            fill = int(round(frac * self.width))
            bar = "#" * fill + "-" * (self.width - fill)
            head = f"{self.name} [{bar}] {self.done}/{self.total} {100 * frac:3.0f}%"
        else:
            head = f"{self.name} [{self.done} done]"
        line = f"{head} {self._elapsed()}"
        return f"{line}  {label}"[:160] if label else line

    def update(self, done: int, total: int | None = None, label: str = ""):
        self.done = done
        if total is not None:
            self.total = total
        line = self.render(label)
        if self._tty:
            self.stream.write("\r\x1b[2K" + line)
            self._open = True
        else:
            pct = int(10 * self.done / self.total) if self.total else -1
            now = time.perf_counter()
            if pct != self._last_pct or now - self._last_t >= 5.0:
                self.stream.write(line + "\n")
                self._last_pct, self._last_t = pct, now
        self.stream.flush()

    def close(self, label: str = "done"):
        if self._tty and self._open:
            self.stream.write("\r\x1b[2K" + self.render(label) + "\n")
        elif not self._tty:
            self.stream.write(self.render(label) + "\n")
        self.stream.flush()
        self._open = False


def progress_bar(name: str, total: int | None = None) -> ProgressBar:
    """A :class:`ProgressBar` on stderr (for ``progress=`` arguments)."""
    return ProgressBar(name, total)


# =====================================================================================
# parsed results
# =====================================================================================

@dataclass
class Run:
    """One benchmark's results, parsed from its printed output.

    ``kind``: ``"attention"``, ``"attention_bwd"``, ``"decode"``, ``"reductions"``,
    ``"ring"``, ``"transformers"`` or ``"workloads"``. ``rows``: dicts, per kind: attention ``{D, N, mask,
    values: {impl: TFLOP/s}}``; attention_bwd the same plus ``fwd+bwd`` and ``graph``
    (forward + backward, eager and from a CUDA graph); decode ``{batch, length, values:
    {impl: GB/s}}`` (impl names as printed, e.g. ``"flashfold p16 [graph]"``); reductions
    ``{op, shape, dtype, values: {"flashfold": GB/s, "torch": GB/s}, ms: {...}}``; ring
    ``{layout, N, fwd: {...}, fwd+bwd: {...}}`` (ms single / ring / compute-only, eff and
    overlap in %); transformers ``{case, values: {"flashfold": ms, "sdpa": ms}}``; workloads
    ``{direction, mode, model, shape, ms, values: {impl: TFLOP/s}, ratio, check}`` (one per
    measurement of a row: ``fwd``/``bwd``/``fwd+bwd``, ``eager``/``graph``).
    ``ceiling``: the measured roof (TFLOP/s of a bf16 matmul, or GB/s of a device copy) and
    its label. ``setup``: the run's own description of its grid (its ``== ...`` header
    line); ``command``: the command that printed it (:func:`command_of`); ``quick``: a
    ``--quick`` grid; ``verdicts``: the run's own summary lines (checks passed, targets,
    rows slower than the peer), as printed.
    """

    kind: str
    rows: list = field(default_factory=list)
    ceiling: float | None = None
    ceiling_label: str = ""
    device: str = ""
    software: str = ""
    date: str = ""
    source: str = ""
    setup: str = ""
    command: str = ""
    quick: bool = False
    verdicts: list = field(default_factory=list)

    def subtitle(self) -> str:
        parts = [p for p in (self.device, self.software, self.date) if p]
        return ", ".join(parts)


_ATT_ROW = re.compile(r"^\s*d(\d+)\s+N(\d+)\s+(\S+)\s+(?:([\d.]+) ms\s+)?((?:\w+=[\d.-]+\s*)+)")
_ATT_CEIL = re.compile(r"matmul 8192\^3 in this run:\s*([\d.]+)\s*TFLOP/s")
_DEC_ROW = re.compile(r"^\s*batch\s+(\d+)\s+len\s+(\d+)\s*\(.*?\):\s*(.*)$")
_DEC_COPY = re.compile(r"== device copy:\s*([\d.]+)\s*GB/s")
_RED_COPY = re.compile(r"copy of 1 GiB:.*?=\s*([\d.]+)\s*GB/s")
_RED_ROW = re.compile(r"^\s*(\S.*?)\s+(\d+x\d+(?: dim \d+| /\d+)?)\s+(float32|bfloat16|float16)\s+"
                      r"([\d.]+) ms\s+([\d.]+) GB/s\s*\|\s*torch\s+([\d.]+|nan) ms")
_RED_GRAPH = re.compile(r"\|\s*graph\s+([\d.]+) ms\s+torch\s+([\d.]+|nan) ms")
_VERSIONS = re.compile(r"torch\s+([\w.+]+),\s*triton\s+([\w.]+),\s*(NVIDIA [^,]+)")
_DATE = re.compile(r"(20\d\d-\d\d-\d\d)")

#: attention impl keys in the logs -> legend names
ATTENTION_IMPLS = {"flashfold": "flashfold", "cudnn": "cuDNN (SDPA)", "flash": "FlashAttention 2 (SDPA)",
                   "efficient": "mem-efficient (SDPA)", "flex": "FlexAttention"}
_ATT_TABLE_COLS = {"flashfold": "flashfold", "cuDNN": "cudnn", "FA2 (flash)": "flash",
                   "efficient": "efficient", "Flex": "flex"}


def _device_info(text: str, run: Run):
    m = _VERSIONS.search(text)
    if m:
        run.software = f"torch {m.group(1)}, triton {m.group(2)}"
        run.device = m.group(3).strip()
        return
    m = re.search(r"^([\d.]+\+\S+)\s+([\d.]+)\s+(NVIDIA .*?)\s+\d+ SMs", text, re.M)  # decode
    if m:
        run.software = f"torch {m.group(1)}, triton {m.group(2)}"
        run.device = m.group(3).strip()
        return
    m = re.search(r"flashfold reductions:\s*(NVIDIA [^,]+),.*?torch ([\w.+]+), triton ([\w.]+)",
                  text)
    if m:
        run.device = m.group(1).strip()
        run.software = f"torch {m.group(2)}, triton {m.group(3)}"


def _date_of(source: str) -> str:
    m = _DATE.search(os.path.basename(source))
    if m:
        return m.group(1)
    try:
        return _dt.date.fromtimestamp(os.path.getmtime(source)).isoformat()
    except OSError:
        return ""


def parse_attention(text: str) -> Run:
    """The ``== speed`` lines of ``benchmarks/attention.py`` (or its markdown table)."""
    run = Run("attention", ceiling_label="bf16 matmul 8192³ (same run)")
    m = _ATT_CEIL.search(text)
    if m:
        run.ceiling = float(m.group(1))
    for line in text.splitlines():
        r = _ATT_ROW.match(line)
        if not r:
            continue
        vals = {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", r.group(5))}
        vals = {k: v for k, v in vals.items() if k in ATTENTION_IMPLS}
        if vals:
            run.rows.append({"D": int(r.group(1)), "N": int(r.group(2)), "mask": r.group(3),
                             "values": vals})
    if not run.rows:
        run.rows = _attention_table_rows(text)
    _device_info(text, run)
    return run


_BWD_ROW = re.compile(r"^\s*d(\d+)\s+N(\d+)\s+(\S+)\s+bwd\s+((?:[\w-]+=[\d.]+\s*)+)"
                      r"(?:fwd\+bwd\s+((?:[\w-]+=[\d.]+\s*)+))?"
                      r"(?:fwd\+bwd CUDA graph\s+((?:[\w-]+=[\d.]+\s*)+))?")
#: backward impl keys in the logs -> legend names
BACKWARD_IMPLS = {"flashfold": "flashfold", "ff-det": "flashfold, deterministic=True",
                  "cudnn": "cuDNN (SDPA)", "flash": "FlashAttention 2 (SDPA)"}


def parse_attention_backward(text: str) -> Run:
    """The ``== backward speed`` lines of ``benchmarks/attention.py --bwd``: ``values``
    holds the backward TFLOP/s per impl, ``fwd+bwd`` (a dict) forward + backward, ``graph``
    forward + backward replayed from a CUDA graph (flashfold and cuDNN)."""
    run = Run("attention_bwd", ceiling_label="bf16 matmul 8192³ (same run)")
    m = _ATT_CEIL.search(text)
    if m:
        run.ceiling = float(m.group(1))
    for line in text.splitlines():
        r = _BWD_ROW.match(line)
        if not r:
            continue
        vals = {k: float(v) for k, v in re.findall(r"([\w-]+)=([\d.]+)", r.group(4))
                if k in BACKWARD_IMPLS}
        both = {k: float(v) for k, v in re.findall(r"([\w-]+)=([\d.]+)", r.group(5) or "")
                if k in BACKWARD_IMPLS}
        graph = {k: float(v) for k, v in re.findall(r"([\w-]+)=([\d.]+)", r.group(6) or "")
                 if k in BACKWARD_IMPLS}
        if vals:
            run.rows.append({"D": int(r.group(1)), "N": int(r.group(2)), "mask": r.group(3),
                             "values": vals, "fwd+bwd": both, "graph": graph})
    _device_info(text, run)
    return run


def _md_tables(text: str):
    """Markdown tables as (header cells, list of row cells)."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip().startswith("|") and i + 1 < len(lines) and \
                re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[i + 1]):
            head = [c.strip() for c in lines[i].strip().strip("|").split("|")]
            rows = []
            j = i + 2
            while j < len(lines) and lines[j].strip().startswith("|"):
                rows.append([c.strip() for c in lines[j].strip().strip("|").split("|")])
                j += 1
            yield head, rows
            i = j
        else:
            i += 1


def _num(cell: str):
    cell = cell.replace(",", "").replace("x", "").replace("%", "").strip()
    try:
        return float(cell)
    except ValueError:
        return None


def _attention_table_rows(text: str) -> list:
    out = []
    for head, rows in _md_tables(text):
        if head[:3] != ["D", "N", "mask"]:
            continue
        for cells in rows:
            vals = {}
            for name, key in _ATT_TABLE_COLS.items():
                if name in head:
                    v = _num(cells[head.index(name)])
                    if v is not None:
                        vals[key] = v
            D, N = _num(cells[0]), _num(cells[1])
            if vals and D and N:
                out.append({"D": int(D), "N": int(N), "mask": cells[2], "values": vals})
    return out


def parse_decode(text: str) -> Run:
    """The ``== timing`` lines of ``benchmarks/decode.py``: ``batch B len L (...): name
    GB/s, name GB/s, ...``."""
    run = Run("decode", ceiling_label="device-to-device copy, read + write (same run)")
    m = _DEC_COPY.search(text)
    if m:
        run.ceiling = float(m.group(1))
    for line in text.splitlines():
        r = _DEC_ROW.match(line)
        if not r:
            continue
        vals = {}
        for item in r.group(3).split(","):
            mm = re.match(r"^\s*(.*?)\s+([\d.]+|n/a)\s*$", item)
            if mm and mm.group(2) != "n/a":
                vals[mm.group(1)] = float(mm.group(2))
        if vals:
            run.rows.append({"batch": int(r.group(1)), "length": int(r.group(2)), "values": vals})
    _device_info(text, run)
    return run


def parse_reductions(text: str) -> Run:
    """The ``== timings`` lines of ``benchmarks/reductions.py`` (or its summary table)."""
    run = Run("reductions", ceiling_label="device-to-device copy, read + write (same run)")
    m = _RED_COPY.search(text)
    if m:
        run.ceiling = float(m.group(1))
    seen = set()
    for line in text.splitlines():
        r = _RED_ROW.match(line)
        if not r:
            continue
        op, shape, dtype = r.group(1).strip(), r.group(2), r.group(3)
        ms, gbs, tms = float(r.group(4)), float(r.group(5)), r.group(6)
        vals = {"flashfold": gbs}
        times = {"flashfold": ms}
        if tms != "nan" and float(tms) > 0:
            vals["torch"] = gbs * ms / float(tms)          # the same bytes in torch's time
            times["torch"] = float(tms)
        g = _RED_GRAPH.search(line)
        if g:
            times["flashfold graph"] = float(g.group(1))
            if g.group(2) != "nan":
                times["torch graph"] = float(g.group(2))
        key = (op, shape, dtype)
        if key not in seen:
            seen.add(key)
            run.rows.append({"op": op, "shape": shape, "dtype": dtype, "values": vals,
                             "ms": times})
    if not run.rows:
        for head, rows in _md_tables(text):
            if head[:3] != ["op", "shape", "dtype"] or "GB/s" not in head:
                continue
            for cells in rows:
                vals = {"flashfold": _num(cells[head.index("GB/s")])}
                if "torch GB/s" in head:
                    vals["torch"] = _num(cells[head.index("torch GB/s")])
                vals = {k: v for k, v in vals.items() if v is not None}
                if vals:
                    run.rows.append({"op": cells[0], "shape": cells[1], "dtype": cells[2],
                                     "values": vals})
    _device_info(text, run)
    return run


_RING_HEAD = re.compile(r"ring attention benchmark:\s*(\d+) rank\(s\), backend (\w+), device "
                        r"(NVIDIA [^,]+), torch ([\w.+]+)")
_RING_ROW = re.compile(
    r"^\s*(zigzag|contiguous)\s+causal=(True|False)\s+N=\s*(\d+)\s+"
    r"fwd single\s+([\d.]+) ms.*?ring\s+([\d.]+) ms.*?compute-only\s+([\d.]+) ms\s+"
    r"eff ([\d.]+)% overlap ([\d.]+)%\s*\|\s*fwd\+bwd single\s+([\d.]+) ms.*?ring\s+([\d.]+) ms"
    r"\s+compute-only\s+([\d.]+) ms\s+eff ([\d.]+)% overlap ([\d.]+)%")


def parse_ring(text: str) -> Run:
    """The ``== timing`` lines of ``benchmarks/ring.py`` run on several GPUs (``torchrun``):
    per layout and total length, forward and forward + backward times of single-GPU
    ``flashfold.attention`` on the whole sequence, of ``ring_attention`` (slowest rank) and
    of the ring's schedule with every block local (compute-only), the scaling efficiency
    ``t_single / (W t_ring)`` and the overlap ``t_compute / t_ring``. A simulated ring (one
    GPU, no communication) prints estimates only and gives no rows."""
    run = Run("ring")
    m = _RING_HEAD.search(text)
    if m:
        n = int(m.group(1))
        run.device = f"{n} x {m.group(3).strip()}" if n > 1 else m.group(3).strip()
        run.software = f"torch {m.group(4)}, {m.group(2).upper()} (Triton's version not printed)"
    for line in text.splitlines():
        r = _RING_ROW.match(line)
        if not r:
            continue
        f = [float(x) for x in r.groups()[3:]]
        layout = f"{r.group(1)} {'causal' if r.group(2) == 'True' else 'non-causal'}"
        run.rows.append({"layout": layout, "N": int(r.group(3)),
                         "fwd": dict(zip(("single", "ring", "compute", "eff", "overlap"), f[:5])),
                         "fwd+bwd": dict(zip(("single", "ring", "compute", "eff", "overlap"),
                                             f[5:]))})
    if run.rows:
        run.setup = next((l.strip("= ").strip() for l in text.splitlines()
                          if l.startswith("== timing")), "")
    return run


_TF_HEAD = re.compile(r"torch ([\w.+]+), transformers ([\w.]+), (NVIDIA .+?)\s*$", re.M)
_TF_ROW = re.compile(r"^\s{2}(\S.*?)\s{2,}([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")


def parse_transformers(text: str) -> Run:
    """The ``== timing`` table of ``benchmarks/transformers_gpu.py``: ms per case for a model
    with ``attn_implementation`` = flashfold and = SDPA."""
    run = Run("transformers")
    m = _TF_HEAD.search(text)
    if m:
        run.device = m.group(3).strip()
        run.software = f"torch {m.group(1)}, transformers {m.group(2)} (Triton's version not printed)"
    in_table = False
    for line in text.splitlines():
        if line.startswith("== timing"):
            run.setup = line.strip("= ").strip()
        elif "flashfold ms" in line and "sdpa ms" in line:
            in_table = True
        elif in_table:
            r = _TF_ROW.match(line)
            if not r:
                in_table = False
                continue
            run.rows.append({"case": r.group(1).strip(),
                             "values": {"flashfold": float(r.group(2)), "sdpa": float(r.group(3))}})
    return run


_WL_ROW = re.compile(r"^\s+(fwd|bwd|fwd\+bwd)\s+(eager|graph)\s+\| (.+?) \| (.+?) \| "
                     r"flashfold (\S+) ms (\S+) \| (.+?) \| best (\S+) (\S+) \| ratio (\S+) "
                     r"\| (.+?)\s*$")
#: workloads impl keys in the logs -> column names
WORKLOAD_IMPLS = {"flashfold": "flashfold", "cudnn": "cuDNN", "flash": "FA2", "fa4": "FA4",
                  "flex": "Flex"}


def parse_workloads(text: str) -> Run:
    """The measurement lines of ``benchmarks/workloads.py`` (one per row, direction and
    mode: ``fwd eager | model | shape | flashfold MS ms TFLOPS | peer TFLOPS (ratio) | ... |
    best PEER TFLOPS | ratio R | check``); the last line of a measurement wins."""
    run = Run("workloads", ceiling_label="bf16 matmul 8192³ (same run)")
    m = _ATT_CEIL.search(text)
    if m:
        run.ceiling = float(m.group(1))
    rows = {}
    for line in text.splitlines():
        r = _WL_ROW.match(line)
        if not r:
            continue
        vals = {"flashfold": _num(r.group(6))}
        for name, val in re.findall(r"(\w+) ([\d.]+|-)", r.group(7)):
            if name in WORKLOAD_IMPLS:
                vals[name] = _num(val)
        key = (r.group(1), r.group(2), r.group(3), r.group(4))
        rows[key] = {"direction": r.group(1), "mode": r.group(2), "model": r.group(3),
                     "shape": r.group(4), "ms": _num(r.group(5)),
                     "values": {k: v for k, v in vals.items() if v is not None},
                     "ratio": _num(r.group(10)), "check": r.group(11)}
    run.rows = list(rows.values())
    run.setup = next((l.strip("= ").strip() for l in text.splitlines()
                      if l.startswith("== workloads")), "")
    _device_info(text, run)
    return run


_DET_ROW = re.compile(
    r"^\s+(.+?)\s+\| default\s+([\d.]+) ms\s+(\d+) TFLOP/s \(runs equal: (\w+)\) \| "
    r"deterministic\s+([\d.]+) ms\s+(\d+) TFLOP/s \(runs equal: (\w+)\) \| det/default "
    r"([\d.]+) \| max diff (\S+) \| (\w+)")


def parse_deterministic(text: str) -> Run:
    """The rows of ``benchmarks/deterministic_bwd.py``: per shape, the default and the
    ``deterministic=True`` backward's time and TFLOP/s in one process, whether each mode's
    two runs gave the same bits, and the printed ratio."""
    run = Run("deterministic")
    for line in text.splitlines():
        r = _DET_ROW.match(line)
        if r:
            run.rows.append({"case": r.group(1), "values": {"flashfold": float(r.group(3)),
                                                             "det": float(r.group(6))},
                             "ms": {"flashfold": float(r.group(2)), "det": float(r.group(5))},
                             "equal": (r.group(4) == "True", r.group(7) == "True"),
                             "ratio": float(r.group(8)), "check": r.group(10)})
    _device_info(text, run)
    return run


_FP8_DEC_ROW = re.compile(
    r"^\s*(\d+)\s+(\d+)\s+\|\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+([\d.]+)\s+\|"
    r"\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")


def parse_decode_fp8(text: str) -> Run:
    """The table of ``benchmarks/decode.py --fp8``: per (batch, length), flashfold's bf16
    and FP8 decode in us (contiguous, then pages of 64), the speedup (bf16 time / FP8
    time) and the FP8 call's bytes per second against the device copy."""
    run = Run("decode_fp8")
    if "== FP8 against bf16" not in text:
        return run
    for line in text[text.index("== FP8 against bf16"):].splitlines():
        r = _FP8_DEC_ROW.match(line)
        if r:
            g = r.groups()
            run.rows.append({"batch": int(g[0]), "length": int(g[1]),
                             "us": {"bf16": float(g[2]), "fp8": float(g[3]),
                                    "bf16 p64": float(g[7]), "fp8 p64": float(g[8])},
                             "speedup": float(g[4]), "gbps": float(g[5]),
                             "copy_pct": float(g[6]), "speedup_p64": float(g[9])})
    _device_info(text, run)
    m = _DEC_COPY.search(text)
    if m:
        run.ceiling, run.ceiling_label = float(m.group(1)), "device-to-device copy, read + write"
    return run


#: the columns of ``benchmarks/attention_fp8.py``'s table, as printed
_FP8_ATT_COLS = ("fp8", "bf16", "cuDNN bf16", "fp8 graph", "bf16 graph", "cuDNN graph",
                 "cuDNN fp8", "/bf16", "/cuDNN", "/bf16 graph", "/cuDNN graph", "/cuDNN fp8")


def parse_attention_fp8(text: str) -> Run:
    """The table of ``benchmarks/attention_fp8.py``: per row, TFLOP/s of flashfold FP8,
    flashfold bf16 and cuDNN bf16 (eager and CUDA graph) and cuDNN FP8 (eager), FP8's
    ratios to each, and whether the row's checks passed."""
    run = Run("attention_fp8")
    n = len(_FP8_ATT_COLS)
    for head, rows in _md_tables(text):
        if head[:1] != ["row"] or tuple(head[1:n + 1]) != _FP8_ATT_COLS:
            continue
        for cells in rows:
            run.rows.append({"row": cells[0],
                             "values": {c: _num(cells[1 + i]) for i, c in
                                        enumerate(_FP8_ATT_COLS)},
                             "check": "failed" if "FAILED" in " ".join(cells[n + 1:])
                             else "ok"})
    _device_info(text, run)
    return run


def parse_numerics(text: str) -> Run:
    """``flashfold numerics``: the FP8 table (per input kind, rotated or not: RMS and max
    error against float64 of bf16, FP8 and a naive FP8 attention, and FP8's max over the
    naive one's); its heading as the setup, the statistics' summary lines as verdicts."""
    run = Run("numerics")
    for head, rows in _md_tables(text):
        if head[:2] != ["inputs", "q, k rotated"]:
            continue
        for cells in rows:
            run.rows.append({"inputs": cells[0], "rotated": cells[1],
                             "values": {h: _num(c) for h, c in zip(head[2:], cells[2:])}})
    m = re.search(r"^FP8 \(E4M3\) attention against float64.*$", text, re.M)
    run.setup = m.group(0) if m else ""
    m = re.search(r"^flashfold numerics: (.+?), torch ([\w.+]+), python ([\w.]+)", text, re.M)
    if m:
        run.device, run.software = m.group(1), f"torch {m.group(2)}"
    return run


PARSERS = {"attention": parse_attention, "attention_bwd": parse_attention_backward,
           "decode": parse_decode, "reductions": parse_reductions, "ring": parse_ring,
           "transformers": parse_transformers, "workloads": parse_workloads,
           "deterministic": parse_deterministic, "decode_fp8": parse_decode_fp8,
           "attention_fp8": parse_attention_fp8, "numerics": parse_numerics}

#: the line of a log that describes each benchmark's grid (kept as ``Run.setup``)
_SETUP = {"attention": "== speed", "attention_bwd": "== backward speed", "decode": "== timing",
          "reductions": "== timings"}


def _is_quick(run: Run) -> bool:
    if run.kind in ("attention", "attention_bwd"):
        return len(run.rows) <= 3
    if run.kind == "decode":
        return all(r["batch"] == 8 and r["length"] in (8192, 65536) for r in run.rows)
    if run.kind == "reductions":
        return all(r["shape"] == "16384x16384" and r["dtype"] == "float32" for r in run.rows)
    if run.kind == "ring":
        return max(r["N"] for r in run.rows) <= 32768
    if run.kind == "workloads":                    # a --quick grid, or a --rows subset
        return "grid quick" in run.setup or "rows all" not in run.setup
    return False


def command_of(run: Run, text: str) -> str:
    """The command that printed ``run`` (from a checkout's root), read off the output:
    its kind, a ``--quick`` grid (fewer rows), and the sections it printed (the
    reductions' variants after its timings, or none; transformers' checks, or none)."""
    base = "PYTHONPATH=src python benchmarks/"
    quick = " --quick" if run.quick else ""
    if run.kind == "attention":
        return f"{base}attention.py{quick}"
    if run.kind == "attention_bwd":
        return f"{base}attention.py --bwd{quick}"
    if run.kind == "decode":
        return f"{base}decode.py{quick}"
    if run.kind == "reductions":
        if quick:
            return f"{base}reductions.py --quick"
        var, tim = text.find("== heuristic variants"), text.find("== timings")
        return f"{base}reductions.py" + ("" if var > tim >= 0 else " --no-variants")
    if run.kind == "ring":
        n = re.search(r"benchmark:\s*(\d+) rank", text)
        ranks = int(n.group(1)) if n else 1
        if ranks > 1:
            return (f"PYTHONPATH=src python -m torch.distributed.run --nproc_per_node={ranks} "
                    f"benchmarks/ring.py{quick}")
        return f"{base}ring.py{quick}"
    if run.kind == "transformers":
        return f"{base}transformers_gpu.py" + ("" if "== correctness" in text else " --timing-only")
    if run.kind == "deterministic":
        return f"{base}deterministic_bwd.py"
    if run.kind == "decode_fp8":
        return f"{base}decode.py --fp8"
    if run.kind == "attention_fp8":
        # (the cuDNN FP8 peer's wheel, unpacked to /tmp/site, where its column has numbers)
        site = "/tmp/site:" if "cuDNN FP8 peer: nvidia-cudnn-frontend " in text and \
            "not usable" not in text else ""
        acc = " --accumulation" if "## tl.dot accumulation" in text else ""
        return f"PYTHONPATH={site}src python benchmarks/attention_fp8.py{acc}"
    if run.kind == "numerics":
        return "flashfold numerics"
    if run.kind == "workloads":
        rows = re.search(r"rows '(.*?)'", run.setup)
        return ("PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:src python "
                "benchmarks/workloads.py" + (" --quick" if "grid quick" in run.setup else "")
                + (f" --rows '{rows.group(1)}'" if rows else "")
                + (" --fwd-only" if "directions fwd," in run.setup else "")
                + (" --no-peers" if "peers none" in run.setup else ""))
    return ""


#: the ratio columns the scripts print in their markdown tables, per kind: (the columns
#: that name a row, the ratio columns); the table of an attention run holds no "ff bwd"
_PRINTED = {"attention": (("D", "N", "mask"), ("ff/cuDNN", "ff/FA2", "ff/Flex")),
            "attention_bwd": (("D", "N", "mask"), ("ff/cuDNN", "det/cuDNN", "ff/FA2",
                                                   "f+b ff/cuDNN", "graph ratio")),
            "reductions": (("op", "shape", "dtype"), ("speedup", "graph speedup"))}


#: the summary lines each script prints about its own checks and targets
_VERDICTS = {"attention": (r"^== correctness: \d+/\d+", r"^total .*correctness"),
             "attention_bwd": (r"^== backward correctness: \d+/\d+", r"^total .*PASSED|^total .*FAIL"),
             "decode": (r"^== checks:", r"^\s+target \(", r"^\s+batch_invariant cost over"),
             "reductions": (r"^rows slower than torch", r"^correctness failures"),
             "ring": (r"^\s+ok\s|^\s+BAD\s|^\s+FAIL",),
             "transformers": (r"^all checks passed|^\s*FAIL",),
             "workloads": (r"^== checks: \d+/\d+", r"^varlen / equal", r"^total .*checks"),
             "deterministic": (r"^checks (PASSED|FAILED)",),
             "decode_fp8": (r"^== checks:",),
             "attention_fp8": (r"^checks: ", r"FP8 peer:")}


def _verdicts(kind: str, text: str) -> list[str]:
    pats = [re.compile(p) for p in _VERDICTS.get(kind, ())]
    out = []
    row, over_budget = None, []
    for line in text.splitlines():
        if any(p.search(line) for p in pats):
            line = line.strip()
            if kind == "ring":                   # the check's verdict and layout, not its errors
                line = " ".join(line.split()[:3])
            out.append(line)
        elif kind == "workloads":               # rows whose peers the --budget left untimed
            head = re.match(r"^-- \[\d+/\d+\] (\S+):", line)
            if head:
                row = head.group(1)
            elif "skipped (time budget)" in line and row and row not in over_budget:
                over_budget.append(row)
    if over_budget:
        out.append("peers not timed (the run's --budget ran out first): "
                   + ", ".join(over_budget))
    return out


def _attach_printed(run: Run, text: str):
    """``row["printed"]``: the ratios the script printed for the row (computed from its
    unrounded times), so that a table shows the run's own ratios, not ratios of rounded
    rates."""
    if run.kind not in _PRINTED:
        return
    keys, cols = _PRINTED[run.kind]
    found = {}
    for head, rows in _md_tables(text):
        if tuple(head[:3]) != keys or (run.kind == "attention_bwd") != ("ff bwd" in head):
            continue
        for cells in rows:
            key = tuple(cells[:3])
            found[key] = {c: _num(cells[head.index(c)]) for c in cols
                          if c in head and _num(cells[head.index(c)]) is not None}
    for r in run.rows:
        if run.kind == "reductions":
            key = (r["op"], r["shape"], r["dtype"])
        else:
            key = (str(r["D"]), str(r["N"]), r["mask"])
        if key in found:
            r["printed"] = found[key]


def parse(text: str, source: str = "") -> list[Run]:
    """Every benchmark found in ``text`` (a log or a file with markdown tables)."""
    runs = []
    for kind, parser in PARSERS.items():
        run = parser(text)
        if run.rows:
            run.source = source
            run.date = _date_of(source) if source else ""
            run.quick = _is_quick(run)
            run.verdicts = _verdicts(kind, text)
            _attach_printed(run, text)
            run.command = command_of(run, text)
            if not run.setup and kind in _SETUP:
                run.setup = next((l.strip("= ").strip() for l in text.splitlines()
                                  if l.startswith(_SETUP[kind])), "")
            runs.append(run)
    return runs


def parse_file(path: str) -> list[Run]:
    with open(path, encoding="utf-8", errors="replace") as f:
        return parse(f.read(), path)


# =====================================================================================
# plots
# =====================================================================================

#: colors and markers per implementation family (flashfold always blue, solid, thick)
_STYLE = {
    "flashfold": ("tab:blue", "o"), "cudnn": ("tab:green", "s"), "flash": ("tab:orange", "^"),
    "efficient": ("tab:gray", "v"), "flex": ("tab:purple", "D"), "torch": ("tab:orange", "s"),
    "sdpa flash": ("tab:orange", "^"), "sdpa cudnn": ("tab:green", "s"),
    "sdpa paged": ("tab:red", "x"),
}


def _style(name: str):
    for key in sorted(_STYLE, key=len, reverse=True):
        if name.startswith(key):
            return _STYLE[key]
    return ("tab:brown", "P")


def _pyplot():
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    return plt


def _pow2_axis(ax, xs):
    ax.set_xscale("log", base=2)
    ticks = sorted(set(xs))
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{x // 1024}K" if x >= 1024 and x % 1024 == 0 else str(x) for x in ticks])
    ax.minorticks_off()


def _ceiling(ax, run: Run, unit: str):
    if run.ceiling:
        ax.axhline(run.ceiling, color="black", ls="--", lw=1.2,
                   label=f"ceiling: {run.ceiling_label}, {run.ceiling:,.0f} {unit}")


def _describe(fig) -> dict:
    """What a reader sees: titles, axis labels and legend entries (for tests)."""
    axes = []
    for ax in fig.axes:
        leg = ax.get_legend()
        axes.append({"title": ax.get_title(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
                     "legend": [t.get_text() for t in leg.get_texts()] if leg else [],
                     "lines": len(ax.get_lines()), "bars": len(ax.patches)})
    sup = fig._suptitle.get_text() if getattr(fig, "_suptitle", None) else ""
    legend = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    legend += [t for a in axes for t in a["legend"]]
    return {"suptitle": sup, "axes": axes, "legend": legend}


def _top(ax, run: Run, values):
    """Room above the highest bar/line and the ceiling."""
    vals = [v for v in values if v == v] + ([run.ceiling] if run.ceiling else [])
    if vals:
        ax.set_ylim(0, 1.12 * max(vals))


def _legend_below(fig, axes, ncol=4):
    """One legend for the figure, below the panels (entries deduplicated)."""
    seen = {}
    for ax in axes:
        for h, l in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(l, h)
    leg = fig.legend(list(seen.values()), list(seen.keys()), loc="lower center", ncol=ncol,
                     fontsize=8, frameon=False)
    return leg


def _finish(fig, axes, path: str, *, ncol: int, bottom: float) -> dict:
    """A figure's last steps: one legend below the panels (``bottom`` of the height kept
    for it), saved to ``path`` and closed; returns :func:`_describe` of it."""
    _legend_below(fig, axes, ncol=ncol)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    desc = _describe(fig)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return desc


def _line_panel(ax, run: Run, xs, unit: str, title: str, xlabel: str, ylabel: str):
    """Axes of a line panel over power-of-two ``xs``: the run's ceiling, labels, a grid."""
    if xs:
        _pow2_axis(ax, xs)
    _ceiling(ax, run, unit)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)


def plot_attention(run: Run, path: str) -> dict:
    """TFLOP/s vs N: one panel per (head dim, no mask / causal), lines per implementation;
    a bar panel for the masked rows (sliding window, documents). Returns :func:`_describe`."""
    plt = _pyplot()
    dims = sorted({r["D"] for r in run.rows})
    dense = [m for m in ("full", "causal") if any(r["mask"] == m for r in run.rows)]
    masked = [r for r in run.rows if r["mask"] not in ("full", "causal")]
    n_rows = len(dims) + (1 if masked else 0)
    fig = plt.figure(figsize=(6.0 * max(2, len(dense)), 3.6 * n_rows + 1.2))
    gs = fig.add_gridspec(n_rows, max(1, len(dense)))
    names = {"full": "no mask", "causal": "causal"}
    axes, allv = [], []
    for i, D in enumerate(dims):
        for j, col in enumerate(dense):
            ax = fig.add_subplot(gs[i, j])
            axes.append(ax)
            rows = sorted((r for r in run.rows if r["D"] == D and r["mask"] == col),
                          key=lambda r: r["N"])
            impls = [k for k in ATTENTION_IMPLS if any(k in r["values"] for r in rows)]
            for impl in impls:
                pts = [(r["N"], r["values"][impl]) for r in rows if impl in r["values"]]
                color, marker = _style(impl)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", color=color, marker=marker,
                        lw=2.6 if impl == "flashfold" else 1.3, ms=5,
                        label=ATTENTION_IMPLS[impl], zorder=3 if impl == "flashfold" else 2)
                allv += [p[1] for p in pts]
            _line_panel(ax, run, [r["N"] for r in rows], "TFLOP/s", f"head dim {D}, {names[col]}",
                        "sequence length N (tokens; batch = 16K / N)", "TFLOP/s")
    for ax in axes:
        _top(ax, run, allv)
    if masked:
        ax = fig.add_subplot(gs[len(dims), :])
        axes.append(ax)
        masked.sort(key=lambda r: (r["mask"], r["D"], r["N"]))
        impls = [k for k in ATTENTION_IMPLS if any(k in r["values"] for r in masked)]
        w = 0.8 / max(1, len(impls))
        for k, impl in enumerate(impls):
            xs = [i + (k - (len(impls) - 1) / 2) * w for i in range(len(masked))]
            color, _ = _style(impl)
            ax.bar(xs, [r["values"].get(impl, math.nan) for r in masked], w, color=color,
                   label=ATTENTION_IMPLS[impl])
        ax.set_xticks(range(len(masked)))
        ax.set_xticklabels([f"{r['mask']}\nhead dim {r['D']}, N = {r['N'] // 1024}K" for r in masked],
                           fontsize=8)
        _ceiling(ax, run, "TFLOP/s")
        _top(ax, run, [v for r in masked for v in r["values"].values()])
        ax.set_title("causal with a sliding window of 1024 keys (window1024) or a document mask "
                     "(both as block-sparse masks)")
        ax.set_xlabel("mask, head dim, sequence length")
        ax.set_ylabel("TFLOP/s (visible pairs only)")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("Exact attention forward, bf16, 16 heads, B·N = 16K tokens: TFLOP/s = "
                 f"4·B·H·D·(visible query-key pairs) / time\n{run.subtitle()}", fontsize=11)
    return _finish(fig, axes, path, ncol=6, bottom=0.05)


def plot_attention_backward(run: Run, path: str) -> dict:
    """Backward TFLOP/s vs N per (head dim, mask) panel; forward + backward dotted."""
    plt = _pyplot()
    dims = sorted({r["D"] for r in run.rows})
    masks = [m for m in ("full", "causal") if any(r["mask"] == m for r in run.rows)]
    masks += sorted({r["mask"] for r in run.rows} - {"full", "causal"})
    fig, grid = plt.subplots(len(dims), len(masks), figsize=(6.0 * len(masks), 3.6 * len(dims) + 1.2),
                             squeeze=False)
    axes, allv = [], []
    names = {"full": "no mask", "causal": "causal"}
    for i, D in enumerate(dims):
        for j, mask in enumerate(masks):
            ax = grid[i][j]
            axes.append(ax)
            rows = sorted((r for r in run.rows if r["D"] == D and r["mask"] == mask),
                          key=lambda r: r["N"])
            for impl, label in BACKWARD_IMPLS.items():
                pts = [(r["N"], r["values"][impl]) for r in rows if impl in r["values"]]
                if not pts:
                    continue
                color, marker = _style("flashfold" if impl == "ff-det" else impl)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "--" if impl == "ff-det" else "-",
                        color=color, marker=marker, lw=2.6 if impl == "flashfold" else 1.3, ms=5,
                        label=f"{label}: backward", zorder=3 if impl == "flashfold" else 2)
                allv += [p[1] for p in pts]
            for impl in ("flashfold", "cudnn"):
                pts = [(r["N"], r["fwd+bwd"][impl]) for r in rows if impl in r.get("fwd+bwd", {})]
                if pts:
                    color, _ = _style(impl)
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], ":", color=color, lw=1.2,
                            label=f"{BACKWARD_IMPLS[impl]}: forward + backward")
                    allv += [p[1] for p in pts]
            _line_panel(ax, run, [r["N"] for r in rows], "TFLOP/s",
                        f"head dim {D}, {names.get(mask, mask)}",
                        "sequence length N (tokens; batch = 16K / N)", "TFLOP/s")
    for ax in axes:
        _top(ax, run, allv)
    roof = "" if run.ceiling else " (no matmul ceiling measured in this run)"
    fig.suptitle("Exact attention backward, bf16, 16 heads, B·N = 16K tokens: TFLOP/s = "
                 f"2.5·4·B·H·D·(visible pairs) / time{roof}\n{run.subtitle()}", fontsize=11)
    return _finish(fig, axes, path, ncol=3, bottom=0.1)


_DECODE_IMPLS = ("flashfold", "flashfold p64", "flashfold p16", "flashfold inv", "sdpa flash",
                 "sdpa cudnn", "sdpa paged p16")
_DECODE_NAMES = {"flashfold": "flashfold, contiguous cache", "flashfold p64": "flashfold, pages of 64",
                 "flashfold p16": "flashfold, pages of 16",
                 "flashfold inv": "flashfold, batch-invariant",
                 "sdpa flash": "SDPA flash (contiguous)", "sdpa cudnn": "SDPA cuDNN (contiguous)",
                 "sdpa paged p16": "SDPA flash on gathered pages of 16"}


def plot_decode(run: Run, path: str) -> dict:
    """GB/s vs cached length per batch size; CUDA-graph replays when the log has them."""
    plt = _pyplot()
    batches = sorted({r["batch"] for r in run.rows})
    graph = any(k.endswith("[graph]") for r in run.rows for k in r["values"])
    ncol = 2 if len(batches) > 1 else 1
    nrow = -(-len(batches) // ncol)
    fig, grid = plt.subplots(nrow, ncol, figsize=(6.2 * ncol, 3.8 * nrow + 1.3), squeeze=False)
    axes = [a for row in grid for a in row]
    allv = []
    for ax, b in zip(axes, batches):
        rows = sorted((r for r in run.rows if r["batch"] == b), key=lambda r: r["length"])
        for impl in _DECODE_IMPLS:
            key = impl + (" [graph]" if graph else "")
            pts = [(r["length"], r["values"][key]) for r in rows if key in r["values"]]
            if not pts:
                continue
            color, marker = _style(impl)
            ls = "--" if ("p16" in impl or "inv" in impl) else "-"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, color=color, marker=marker,
                    lw=2.6 if impl == "flashfold" else 1.2, ms=4, label=_DECODE_NAMES[impl],
                    zorder=3 if impl == "flashfold" else 2)
            allv += [p[1] for p in pts]
        if graph:
            pts = [(r["length"], r["values"]["flashfold"]) for r in rows if "flashfold" in r["values"]]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ":", color="tab:blue", lw=1.2,
                        label="flashfold, contiguous, launched eagerly (no graph)")
        _line_panel(ax, run, [r["length"] for r in rows], "GB/s", f"batch {b}",
                    "cached tokens per sequence", "GB/s of K and V read")
    for ax in axes[len(batches):]:
        ax.axis("off")
    for ax in axes[:len(batches)]:
        _top(ax, run, allv)
    mode = "CUDA-graph replays" if graph else "eager launches"
    fig.suptitle("Decoding against a KV cache (q_len 1, bf16, 32 query / 8 KV heads of 128): "
                 f"GB/s = bytes of K and V / time, {mode}\n{run.subtitle()}", fontsize=11)
    return _finish(fig, axes[:len(batches)], path, ncol=3, bottom=0.09)


def _short_dtype(d: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(d, d)


def plot_reductions(run: Run, path: str) -> dict:
    """Grouped bars: GB/s of flashfold and torch per operation and shape."""
    plt = _pyplot()
    square = [r for r in run.rows if r["shape"] == "16384x16384"]
    rest = [r for r in run.rows if r["shape"] != "16384x16384"]
    groups = [("16384 x 16384, along rows", square), ("other shapes (awkward sizes, columns, "
                                                      "segments)", rest)]
    groups = [(t, rs) for t, rs in groups if rs]
    width = max(9.0, 0.6 * max(len(g[1]) for g in groups))
    fig, grid = plt.subplots(len(groups), 1, figsize=(width, 4.3 * len(groups) + 0.8),
                             squeeze=False)
    axes = list(grid[:, 0])
    for ax, (title, rows) in zip(axes, groups):
        x = list(range(len(rows)))
        w = 0.4
        ff = [r["values"].get("flashfold", math.nan) for r in rows]
        th = [r["values"].get("torch", math.nan) for r in rows]
        ax.bar([i - w / 2 for i in x], ff, w, color="tab:blue", label="flashfold (generated kernel)")
        ax.bar([i + w / 2 for i in x], th, w, color="tab:orange", label="torch")
        labels = [f"{r['op']}\n{_short_dtype(r['dtype'])}" if r["shape"] == "16384x16384" else
                  f"{r['op']}\n{r['shape']} {_short_dtype(r['dtype'])}" for r in rows]
        ax.set_xticks(x)
        ax.set_xticklabels(labels, fontsize=7, rotation=40, ha="right")
        _ceiling(ax, run, "GB/s")
        _top(ax, run, ff + th)
        ax.set_title(title)
        ax.set_xlabel("operation, shape, dtype")
        ax.set_ylabel("GB/s = bytes / time\n(input; + output for softmax, scans)")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"Reductions and scans from generated Triton kernels vs torch\n{run.subtitle()}",
                 fontsize=11)
    return _finish(fig, axes, path, ncol=3, bottom=0.04)


PLOTS = {"attention": (plot_attention, "attention_fwd.png"),
         "attention_bwd": (plot_attention_backward, "attention_bwd.png"),
         "decode": (plot_decode, "decode.png"), "reductions": (plot_reductions, "reductions.png")}


def render(runs: list[Run], out: str, prefix: str = "") -> dict[str, dict]:
    """Plot every run into ``out``; returns ``{path: description}`` (see :func:`_describe`)."""
    os.makedirs(out, exist_ok=True)
    done = {}
    for run in runs:                 # a backward run without a roof: the forward run's matmul
        if run.kind == "attention_bwd" and not run.ceiling:
            fwd = [r for r in runs if r.kind == "attention" and r.ceiling and
                   (r.device, r.date) == (run.device, run.date)]
            if fwd:
                run.ceiling = fwd[0].ceiling
                run.ceiling_label = "bf16 matmul 8192³ (the forward run, same day)"
    for run in runs:
        if run.kind not in PLOTS:                  # ring, transformers: tables only
            continue
        fn, name = PLOTS[run.kind]
        path = os.path.join(out, prefix + name)
        if path in done:                           # two runs of one kind: keep both
            stem = os.path.splitext(os.path.basename(run.source))[0] or str(len(done))
            path = os.path.join(out, f"{prefix}{stem}_{name}")
        done[path] = fn(run, path)
    return done


# =====================================================================================
# result tables (benchmarks/RESULTS.md)
# =====================================================================================

#: the families of RESULTS.md, in its order, with their section titles
FAMILIES = {"attention": "Attention forward", "attention_bwd": "Attention backward",
            "decode": "Decoding against a KV cache", "reductions": "Reductions and scans",
            "ring": "Ring attention across GPUs", "transformers": "Hugging Face transformers",
            "workloads": "Attention workloads (models)",
            "deterministic": "Deterministic backward",
            "attention_fp8": "FP8 attention forward",
            "decode_fp8": "Decoding over an FP8 KV cache",
            "numerics": "Numerics: FP8 and bf16 against float64"}


def latest(runs: list[Run]) -> dict[str, Run]:
    """The run each family's table is drawn from: the latest full run (a ``--quick`` run
    only where a family has no full one); among runs of one date, the one with more rows,
    then the later file name."""
    best: dict[str, tuple] = {}
    for run in runs:
        key = (not run.quick, run.date, len(run.rows), os.path.basename(run.source))
        if run.kind not in best or key > best[run.kind][0]:
            best[run.kind] = (key, run)
    return {k: best[k][1] for k in FAMILIES if k in best}


def _peers_measured(run: Run) -> set:
    """The implementations other than flashfold that have a number in some row of ``run``."""
    return {k for r in run.rows for k, v in r.get("values", {}).items()
            if v and k != "flashfold"}


def supplements(runs: list[Run], chosen: dict[str, Run]) -> dict[str, list[Run]]:
    """Per workloads table (the family whose rows name their peers), the runs after it
    (a later date, or the same date and a later log name) that timed some of its rows
    again: ``--rows`` runs with a peer the grid lacked (e.g. FlashAttention-4), or after a
    kernel change to those rows; oldest first. The page shows each as a table of its own,
    so every ratio still comes from one run. A run that timed no peer (``--no-peers``, a
    diagnostic of flashfold's own kernels, which the notes cite) has no ratio to show and
    is left to its log."""
    out = {}
    for kind, run in chosen.items():
        if kind != "workloads":
            continue
        after = (run.date or "", os.path.basename(run.source))
        extra = [r for r in runs if r.kind == kind and r is not run and r.rows
                 and (r.date or "", os.path.basename(r.source)) > after
                 and _peers_measured(r)]
        if extra:
            out[kind] = sorted(extra, key=lambda r: (r.date or "", os.path.basename(r.source)))
    return out


def _f(v, digits: int = 0) -> str:
    if v is None or v != v:
        return "-"
    return f"{v:,.{digits}f}"


def _ratio(a, b, printed: float | None = None) -> str:
    """``a / b`` to two decimals, or the ratio the run printed for it."""
    if printed is not None:
        return f"{printed:.2f}"
    return f"{a / b:.2f}" if a and b else "-"


def _table(head: list[str], rows: list[list[str]], keys: int = 3) -> list[str]:
    """A markdown table; the first ``keys`` columns name the row, the rest are numbers."""
    out = ["| " + " | ".join(head) + " |",
           "|" + "|".join("---" if i < keys else "---:" for i in range(len(head))) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def _below(rows, label: str) -> list[str]:
    """``(name, ratio)`` pairs under 1.00 (two decimals) as one sentence."""
    low = [f"{name} {q:.2f}" for name, q in rows if q is not None and round(q, 2) < 1.0]
    if not low:
        return [f"Below {label} in this run: none."]
    return [f"Below {label} in this run (ratio < 1.00): " + "; ".join(low) + "."]


def _att_table(run: Run) -> list[str]:
    peers = [("cudnn", "cuDNN"), ("flash", "FA2 (flash)"), ("efficient", "efficient"),
             ("flex", "Flex")]
    head = ["D", "N", "mask", "flashfold"] + [n for _, n in peers] + \
        [f"ff/{n.split()[0]}" for _, n in peers]
    printed = {"cudnn": "ff/cuDNN", "flash": "ff/FA2", "flex": "ff/Flex"}
    rows, low = [], []
    for r in run.rows:
        v, pr = r["values"], r.get("printed", {})
        ff = v.get("flashfold")
        ratios = {k: _ratio(ff, v.get(k), pr.get(printed.get(k, ""))) for k, _ in peers}
        rows.append([str(r["D"]), str(r["N"]), r["mask"], _f(ff)] +
                    [_f(v.get(k)) for k, _ in peers] + [ratios[k] for k, _ in peers])
        if ratios["cudnn"] != "-":
            low.append((f"d{r['D']} {r['N'] // 1024}K {r['mask']}", float(ratios["cudnn"])))
    return _table(head, rows) + ["", *_below(low, "cuDNN")]


def _bwd_table(run: Run) -> list[str]:
    head = ["D", "N", "mask", "ff bwd", "ff det bwd", "cuDNN bwd", "FA2 bwd", "ff/cuDNN",
            "det/cuDNN", "ff/FA2", "ff f+b", "cuDNN f+b", "FA2 f+b", "f+b ff/cuDNN",
            "graph ff f+b", "graph cuDNN f+b", "graph ratio"]
    rows, low = [], []
    for r in run.rows:
        v, fb, g = r["values"], r.get("fwd+bwd", {}), r.get("graph", {})
        pr = r.get("printed", {})
        ff = v.get("flashfold")
        main = _ratio(ff, v.get("cudnn"), pr.get("ff/cuDNN"))
        rows.append([str(r["D"]), str(r["N"]), r["mask"], _f(ff), _f(v.get("ff-det")),
                     _f(v.get("cudnn")), _f(v.get("flash")), main,
                     _ratio(v.get("ff-det"), v.get("cudnn"), pr.get("det/cuDNN")),
                     _ratio(ff, v.get("flash"), pr.get("ff/FA2")),
                     _f(fb.get("flashfold")), _f(fb.get("cudnn")), _f(fb.get("flash")),
                     _ratio(fb.get("flashfold"), fb.get("cudnn"), pr.get("f+b ff/cuDNN")),
                     _f(g.get("flashfold")), _f(g.get("cudnn")),
                     _ratio(g.get("flashfold"), g.get("cudnn"), pr.get("graph ratio"))])
        if main != "-":
            low.append((f"d{r['D']} {r['N'] // 1024}K {r['mask']}", float(main)))
    return _table(head, rows) + ["", *_below(low, "cuDNN (backward alone)")]


_DEC_COLS = [("flashfold", "flashfold"), ("flashfold inv", "ff invariant"),
             ("flashfold p16", "ff pages 16"), ("flashfold p64", "ff pages 64"),
             ("sdpa flash", "SDPA flash"), ("sdpa cudnn", "SDPA cuDNN"),
             ("sdpa paged p16", "SDPA on gathered pages 16")]


def _dec_table(run: Run) -> list[str]:
    head = ["batch", "length", "timing"] + [n for _, n in _DEC_COLS] + \
        ["ff/cuDNN", "ff/flash", "invariant cost"]
    rows, low = [], []
    for r in run.rows:
        for mode, suffix in (("eager", ""), ("graph", " [graph]"), ("clean L2", " [clean]")):
            v = {k: r["values"].get(k + suffix) for k, _ in _DEC_COLS}
            ff = v["flashfold"]
            if ff is None:
                continue
            inv = v["flashfold inv"]
            cost = f"{100 * (1 - inv / ff):.1f}%" if inv and ff else "-"
            rows.append([str(r["batch"]), str(r["length"]), mode] + [_f(v[k]) for k, _ in _DEC_COLS]
                        + [_ratio(ff, v["sdpa cudnn"]), _ratio(ff, v["sdpa flash"]), cost])
            if mode != "eager" and v["sdpa cudnn"]:
                low.append((f"{r['batch']} x {r['length']} {mode}", ff / v["sdpa cudnn"]))
    return _table(head, rows) + ["", *_below(low, "cuDNN (graph and clean-L2 timings)")]


def _red_table(run: Run) -> list[str]:
    head = ["op", "shape", "dtype", "flashfold ms", "GB/s", "% copy", "torch ms", "torch GB/s",
            "speedup", "graph ms", "torch graph ms", "graph speedup"]
    rows, low = [], []
    for r in run.rows:
        v, t, pr = r["values"], r.get("ms", {}), r.get("printed", {})
        copy = f"{100 * v['flashfold'] / run.ceiling:.1f}%" if run.ceiling else "-"
        sp = t["torch"] / t["flashfold"] if t.get("torch") and t.get("flashfold") else None
        gsp = (t["torch graph"] / t["flashfold graph"]
               if t.get("flashfold graph") and t.get("torch graph") else None)
        sp, gsp = pr.get("speedup", sp), pr.get("graph speedup", gsp)
        sp, gsp = (x if x is not None and math.isfinite(x) else None for x in (sp, gsp))
        rows.append([r["op"], r["shape"], r["dtype"], _f(t.get("flashfold"), 3),
                     _f(v["flashfold"]), copy, _f(t.get("torch"), 3), _f(v.get("torch")),
                     f"{sp:.2f}x" if sp else "-", _f(t.get("flashfold graph"), 3),
                     _f(t.get("torch graph"), 3), f"{gsp:.2f}x" if gsp else "-"])
        name = f"{r['op']} {r['shape']} {r['dtype']}"
        low.append((name + " (eager)", sp))
        low.append((name + " (graph)", gsp))
    return _table(head, rows) + ["", *_below(low, "torch")]


def _ring_table(run: Run) -> list[str]:
    head = ["layout", "N", "passes", "single-GPU ms", "ring ms", "compute-only ms",
            "efficiency", "overlap"]
    rows = []
    for r in run.rows:
        for passes in ("fwd", "fwd+bwd"):
            d = r[passes]
            rows.append([r["layout"], str(r["N"]), passes, _f(d["single"], 2), _f(d["ring"], 2),
                         _f(d["compute"], 2), f"{d['eff']:.1f}%", f"{d['overlap']:.1f}%"])
    longest = max(r["N"] for r in run.rows)
    summary = "; ".join(f"{r['layout']} {r['fwd']['eff']:.1f}% forward, "
                        f"{r['fwd+bwd']['eff']:.1f}% forward + backward"
                        for r in run.rows if r["N"] == longest)
    return _table(head, rows) + ["", f"Scaling efficiency at N = {longest:,}: {summary}."]


def _tf_table(run: Run) -> list[str]:
    head = ["case", "flashfold ms", "SDPA ms", "ff vs SDPA"]
    rows, low = [], []
    for r in run.rows:
        ff, sd = r["values"]["flashfold"], r["values"]["sdpa"]
        rows.append([r["case"], _f(ff, 2), _f(sd, 2), _ratio(sd, ff)])
        low.append((r["case"], sd / ff))
    return _table(head, rows, keys=1) + ["", *_below(low, "SDPA")]


_WL_TITLES = {("fwd", "eager"): "Forward, eager", ("fwd", "graph"): "Forward, CUDA graph replay",
              ("bwd", "eager"): "Backward alone, eager",
              ("fwd+bwd", "graph"): "Forward + backward, CUDA graph replay"}


def _wl_table(run: Run) -> list[str]:
    """One row per workload row, one column per direction and mode (forward eager,
    forward from a CUDA graph, backward eager, forward + backward from a graph): flashfold's
    TFLOP/s, the best peer's and the ratio (``-``: not measured), then the cells below the
    best peer in one sentence. Every peer's number is in the log."""
    peers = [k for k in WORKLOAD_IMPLS if k != "flashfold"]
    cols = [key for key in _WL_TITLES if any((r["direction"], r["mode"]) == key
                                                for r in run.rows)]
    by_row: dict = {}
    for r in run.rows:
        by_row.setdefault((r["model"], r["shape"]), {})[(r["direction"], r["mode"])] = r
    rows, low = [], []
    for (model, shape), cells in by_row.items():
        line = [model, shape]
        for key in cols:
            r = cells.get(key)
            if r is None:
                line.append("-")
                continue
            v = r["values"]
            best = max((k for k in peers if v.get(k)), key=lambda k: v[k], default=None)
            ratio = _ratio(v.get("flashfold"), v.get(best) if best else None, r["ratio"])
            failed = "" if r["check"] == "ok" else f" ({r['check'].lower()})"
            peer = f"{WORKLOAD_IMPLS[best]} {_f(v[best])}" if best else "-"
            line.append(f"{_f(v.get('flashfold'))}{failed} · {peer} · {ratio}")
            title = _WL_TITLES[key]
            low.append((f"{model} {shape} ({title[0].lower()}{title[1:]})", r["ratio"]))
        rows.append(line)
    head = ["model", "shape"] + [_WL_TITLES[key] for key in cols]
    return [*_table(head, rows, keys=2), "", *_below(low, "the best peer")]


def _det_table(run: Run) -> list[str]:
    head = ["case", "default ms", "default TFLOP/s", "deterministic ms",
            "deterministic TFLOP/s", "det / default", "bitwise equal runs (default, det)"]
    rows, low = [], []
    for r in run.rows:
        eq = ", ".join("yes" if e else "no" for e in r["equal"])
        case = r["case"] + ("" if r["check"] == "ok" else " (check failed)")
        rows.append([case, _f(r["ms"]["flashfold"], 3), _f(r["values"]["flashfold"]),
                     _f(r["ms"]["det"], 3), _f(r["values"]["det"]), f"{r['ratio']:.2f}", eq])
        low.append((r["case"], r["ratio"]))
    below = [f"{c} {x:.2f}" for c, x in low if x < 0.9]
    return _table(head, rows, keys=1) + [
        "", "Below the target of 0.90x the default: " + ("; ".join(below) if below else "none")
        + "."]


def _dec_fp8_table(run: Run) -> list[str]:
    head = ["batch", "length", "bf16 us", "FP8 us", "FP8 speedup", "FP8 GB/s", "% of copy",
            "bf16 us, pages 64", "FP8 us, pages 64", "FP8 speedup, pages 64"]
    rows, low = [], []
    for r in run.rows:
        u = r["us"]
        rows.append([str(r["batch"]), str(r["length"]), _f(u["bf16"], 1), _f(u["fp8"], 1),
                     f"{r['speedup']:.2f}", _f(r["gbps"]), f"{r['copy_pct']:.1f}",
                     _f(u["bf16 p64"], 1), _f(u["fp8 p64"], 1), f"{r['speedup_p64']:.2f}"])
        if r["speedup"] < 1.8 or r["copy_pct"] < 90:
            low.append(f"{r['batch']} x {r['length']} {r['speedup']:.2f}x, "
                       f"{r['copy_pct']:.0f}%")
    return _table(head, rows, keys=2) + [
        "", "Below the targets (1.8x bf16, 90% of the copy rate; contiguous cache): "
        + ("; ".join(low) or "none") + "."]


def _att_fp8_table(run: Run) -> list[str]:
    head = ["row", *_FP8_ATT_COLS]
    rows, low = [], []
    for r in run.rows:
        v = r["values"]
        cells = [_f(v[c]) if not c.startswith("/") else
                 "-" if v[c] is None else f"{v[c]:.2f}" for c in _FP8_ATT_COLS]
        rows.append([r["row"] + ("" if r["check"] == "ok" else " (check failed)"), *cells])
        if v["/bf16 graph"] is not None and v["/bf16 graph"] < 1.6:
            low.append(f"{r['row']} {v['/bf16 graph']:.2f}")
    return _table(head, rows, keys=1) + [
        "", "Below the target of 1.6x flashfold's bf16 forward (graph): "
        + ("; ".join(low) if low else "none") + "."]


def _numerics_table(run: Run) -> list[str]:
    cols = list(run.rows[0]["values"]) if run.rows else []
    head = ["inputs", "q, k rotated", *cols]
    rows = [[r["inputs"], r["rotated"], *(
        "-" if r["values"][c] is None else (f"{r['values'][c]:.2f}" if "/" in c
                                             else f"{r['values'][c]:.2e}") for c in cols)]
        for r in run.rows]
    return _table(head, rows, keys=2)


_FAMILY_TEXT = {
    "attention": ("TFLOP/s = 4·B·H·D·(visible query-key pairs) / time (dense causal counts "
                  "N²/2); bf16, 16 heads, B·N = 16K tokens, eager calls. Peers: SDPA's cuDNN, "
                  "FlashAttention 2 (flash) and memory-efficient backends, FlexAttention. "
                  "Ratios: flashfold's TFLOP/s / the peer's (above 1: flashfold faster).",
                  _att_table),
    "attention_bwd": ("TFLOP/s: backward = 2.5·4·B·H·N²·D (halved when causal), forward + "
                      "backward = 3.5·4·B·H·N²·D; backward alone is `torch.autograd.grad` of "
                      "a retained graph. ff = the default mode, det = `deterministic=True`; "
                      "graph = forward + backward replayed from a CUDA graph (no eager host "
                      "time). Ratios: flashfold / peer (above 1: flashfold faster).", _bwd_table),
    "decode": ("GB/s = bytes of K and V read / time; bf16, 32 query / 8 KV heads of 128, "
               "q_len 1. eager = do_bench of the call; graph = CUDA-graph replays; clean L2 = "
               "graph replays after a read flush of L2 (target rows only). invariant cost = "
               "1 - batch_invariant / default. Ratios: flashfold default / peer.", _dec_table),
    "reductions": ("GB/s counts input bytes (+ output bytes for softmax and scans); ms are "
                   "do_bench medians, eager and from CUDA graphs. speedup = torch time / "
                   "flashfold time (above 1: flashfold faster).", _red_table),
    "ring": ("bf16, B = 1, 16 heads of 128; times of the slowest rank. efficiency = "
             "t_single / (W·t_ring) against single-GPU `flashfold.attention` on the whole "
             "sequence (no other ring implementation was measured); overlap = compute-only / "
             "ring (the ring's kernels with every block local, against the real ring).",
             _ring_table),
    "transformers": ("ms per case, the same model with `attn_implementation` = flashfold "
                     "and = SDPA. ff vs SDPA = SDPA time / flashfold time (above 1: "
                     "flashfold faster).", _tf_table),
    "workloads": ("One row per model's attention layer, bf16, 16K tokens per batch, every peer "
                  "that can express the row measured in the same process (SDPA cuDNN and "
                  "FLASH, FlashAttention-4, compiled FlexAttention; an empty cell: the peer "
                  "cannot express the row or failed, as the log says). TFLOP/s = 4·B·Hq·D̄·"
                  "(visible query-key pairs) / time, D̄ = (D_qk + D_v) / 2, pairs counted "
                  "exactly for windows, documents, varlen, padding and prefix-LM (dense causal: "
                  "N²/2); backward 2.5x, forward + backward 3.5x. Ratio to best = flashfold's "
                  "TFLOP/s / the best peer's (above 1: flashfold faster); a cell reads "
                  "flashfold's TFLOP/s · the best peer and its TFLOP/s · the ratio, a failed "
                  "check marked after flashfold's number.", _wl_table),
    "deterministic": ("`deterministic=True` against the default backward of the same call, "
                      "both in one process: bf16, eager `torch.autograd.grad` of a retained "
                      "forward, do_bench median; TFLOP/s = 2.5 x the forward's 2·B·Hq·"
                      "(visible pairs)·(D + Dv). Each deterministic call ran twice and gave "
                      "the same bits (the default's runs differ in the last bits: its dQ "
                      "adds come in any order). det / default = the default's time / "
                      "deterministic's (target 0.90 or above).", _det_table),
    "attention_fp8": ("flashfold's FP8 forward (E4M3 q, k, v with per (batch, KV head) "
                      "descales; P in E4M3, statistics fp32) against flashfold's bf16 forward "
                      "and SDPA cuDNN's bf16 on the same shapes, in one run; TFLOP/s = "
                      "4·B·Hq·D·(visible pairs) / time (dense causal N²/2), eager and replayed "
                      "from a CUDA graph; ratios: FP8's TFLOP/s / the other's (target 1.6x "
                      "bf16 on the d128 and d256 rows). Checked first at each row's full "
                      "shape against float64 and a naive FP8 attention.", _att_fp8_table),
    "decode_fp8": ("flashfold's decode over an E4M3 cache (per (sequence, KV head) "
                   "descales) against its decode over the bf16 cache of the same tokens: "
                   "32 query / 8 KV heads of 128, q_len 1, CUDA-graph replays after a read "
                   "flush of L2. speedup = bf16 time / FP8 time (target 1.8); GB/s = the "
                   "FP8 cache's bytes read / time, against the device copy's rate "
                   "(target 90%).", _dec_fp8_table),
    "numerics": ("Causal attention's output error against the float64 attention of the "
                 "unquantized inputs (CPU): flashfold in bf16, in FP8 (`quantize_fp8`, "
                 "per (batch, KV head) factors, P in E4M3) and a naive FP8 attention "
                 "(dequantized to bf16, bf16 matmuls, softmax in fp32); random inputs, and "
                 "inputs with a few outlier channels of q and k, quantized as they are "
                 "and after one random rotation of q and k (FlashAttention-3's incoherent "
                 "processing; flashfold does not rotate by default). The statistics' "
                 "table (fp32 against bf16 `m`, `l`, by fold order) is in "
                 "`flashfold numerics`' own output.", _numerics_table),
}


def _anchor(title: str) -> str:
    """A section's link target as GitHub makes it: lower case, punctuation dropped, spaces
    to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def results_markdown(runs: list[Run], logs_dir: str = "logs") -> str:
    """RESULTS.md: one table per family (:data:`FAMILIES`) from its latest run
    (:func:`latest`), each with its date, device, software versions, command and log, the
    ratios against every peer the run measured, and the rows where flashfold is below its
    main peer; after the workloads table, the later runs that measured more peers
    (:func:`supplements`)."""
    chosen = latest(runs)
    later = supplements(runs, chosen)
    for run in chosen.values():         # the backward's roof: the forward's matmul, same day
        if run.kind == "attention_bwd" and not run.ceiling:
            fwd = [r for r in runs if r.kind == "attention" and r.ceiling and
                   (r.device, r.date) == (run.device, run.date)]
            if fwd:
                run.ceiling = fwd[0].ceiling
                run.ceiling_label = "bf16 matmul 8192³ (the forward run, same day)"
    out = ["# Benchmark results", "",
           "Current numbers, one table per family, each from the latest full run in "
           "`benchmarks/logs/`.",
           "Generated by `flashfold bench --results` (do not edit by hand); what was tried "
           "and why the kernels are built as they are is in `docs/notes/`.", ""]
    out += [f"- [{FAMILIES[k]}](#{_anchor(FAMILIES[k])})" for k in chosen]
    missing = [FAMILIES[k] for k in FAMILIES if k not in chosen]
    if missing:
        out += ["", "No log for: " + ", ".join(missing) + "."]
    for kind, run in chosen.items():
        text, table = _FAMILY_TEXT[kind]
        log = os.path.basename(run.source)
        out += ["", f"## {FAMILIES[kind]}", "",
                f"{run.date or 'date not recorded'} · {run.device or 'device not recorded'} · "
                f"{run.software or 'versions not recorded'} · log `{logs_dir}/{log}`", "",
                "```", run.command, "```", ""]
        if run.setup:
            setup = run.setup.split(": ", 1)[-1].rstrip(".")
            out += [f"As the run describes its grid: {setup}.", ""]
        out += [text]
        if run.ceiling:
            unit = "TFLOP/s" if kind.startswith("attention") or kind == "workloads" else "GB/s"
            out += ["", f"Ceiling measured in the same run: {run.ceiling_label}, "
                        f"{run.ceiling:,.0f} {unit}."]
        out += ["", *table(run)]
        if run.verdicts:
            out += ["", "The run's own checks, as printed:", "", "```", *run.verdicts, "```"]
        for extra in later.get(kind, ()):
            names = ", ".join(sorted(WORKLOAD_IMPLS.get(k, k) for k in
                                     _peers_measured(extra) - _peers_measured(run)))
            why = (f"timed again with every peer, {names} included, in one run" if names
                   else "timed again in a later run (the tree of that run), every peer "
                        "in the same run")
            out += ["", "### Rows measured again" + (f" with {names}" if names else ""), "",
                    f"{extra.date or 'date not recorded'} · "
                    f"{extra.device or 'device not recorded'} · "
                    f"{extra.software or 'versions not recorded'} · log "
                    f"`{logs_dir}/{os.path.basename(extra.source)}`", "",
                    "```", extra.command, "```", "",
                    f"Rows of the grid above, {why}.", "",
                    *table(extra)]
            if extra.verdicts:
                out += ["", "The run's own checks, as printed:", "", "```", *extra.verdicts,
                        "```"]
    return "\n".join(out) + "\n"


def write_results(paths: list[str], out: str) -> dict[str, Run]:
    """Parse the logs ``paths`` and write :func:`results_markdown` of them to ``out``;
    returns the run behind each family's table. Raises ``ValueError`` (``out`` left as it
    was) when no log holds a benchmark's results."""
    runs = [r for p in paths for r in parse_file(p)]
    if not runs:
        raise ValueError(f"paths: no benchmark results recognized in {len(paths)} log(s)")
    rel = os.path.relpath(os.path.dirname(os.path.abspath(paths[0])) if paths else "logs",
                          os.path.dirname(os.path.abspath(out)))
    text = results_markdown(runs, rel.replace(os.sep, "/"))
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    return latest(runs)


# =====================================================================================
# running the benchmarks
# =====================================================================================

SCRIPTS = ("attention", "decode", "reductions")


def find_benchmarks(start: str | None = None) -> Path | None:
    """The ``benchmarks/`` folder of a source checkout: above ``start`` (default: the
    working directory), else above this package."""
    for base in (Path(start or os.getcwd()).resolve(), Path(__file__).resolve().parent):
        for p in (base, *base.parents):
            if (p / "benchmarks" / "attention.py").is_file():
                return p / "benchmarks"
    return None


def _expected_rows(name: str, bench_dir: Path, quick: bool) -> int | None:
    """Timing rows the script will print, from its grid (its module is imported, not
    run); ``None`` (a counter without a bar) when that is not known."""
    import importlib.util
    try:
        spec = importlib.util.spec_from_file_location(f"_flashfold_bench_{name}",
                                                      bench_dir / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        if name == "attention":
            return len(mod._default_grid(quick))
        if name == "decode":
            return len(mod.TARGETS) + len(mod.QUICK_GRID if quick else mod.GRID)
    except (Exception, SystemExit):                # noqa: BLE001 - a bar without a total
        return None
    return None


class BenchmarkFailed(RuntimeError):
    """A benchmark script exited non-zero (a failed check) after printing results: ``log``
    holds them."""

    def __init__(self, message: str, log: str):
        super().__init__(message)
        self.log = log


def run_script(name: str, bench_dir: Path, out: str, quick: bool = False, extra=(),
               python: str | None = None, stream=None) -> str:
    """Run ``benchmarks/NAME.py``, tee its output to ``OUT/<date>_<name>.log`` with a
    progress bar on stderr; returns the log's path. Raises ``RuntimeError`` when the script
    exits non-zero: :class:`BenchmarkFailed`, with the log, where it printed results."""
    os.makedirs(out, exist_ok=True)
    log = os.path.join(out, f"{_dt.date.today().isoformat()}_{name}.log")
    cmd = [python or sys.executable, str(bench_dir / f"{name}.py")] + (["--quick"] if quick else []) \
        + list(extra)
    env = dict(os.environ)
    src = str(bench_dir.parent / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    bar = ProgressBar(f"bench {name}", _expected_rows(name, bench_dir, quick), stream=stream)
    row = {"attention": _ATT_ROW, "decode": _DEC_ROW, "reductions": _RED_ROW}[name]
    done = 0
    with open(log, "w") as f, subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True, env=env,
                                               cwd=str(bench_dir.parent)) as proc:
        for line in proc.stdout:
            f.write(line)
            f.flush()
            if row.match(line):
                done += 1
                bar.update(done, label=line.strip()[:60])
            elif line.startswith("=="):
                bar.update(done, label=line.strip()[:60])
        rc = proc.wait()
    bar.close("done" if rc == 0 else f"exit status {rc}")
    if rc != 0:
        msg = f"benchmarks/{name}.py exited with status {rc}; see {log}"
        if parse_file(log):
            raise BenchmarkFailed(msg, log)
        raise RuntimeError(msg)
    return log


# =====================================================================================
# `flashfold bench`
# =====================================================================================

def _fail(msg: str, status: int = 2) -> int:
    """A user mistake or a missing resource: one line on stderr, an exit status, no
    traceback."""
    print(f"flashfold bench: {msg}", file=sys.stderr)
    return status


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _gpu_available() -> bool:
    """Whether torch sees a CUDA device (the benchmark scripts time GPU kernels)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def command(args) -> int:
    """``flashfold bench``: the options :mod:`flashfold.cli` parsed -> the exit status."""
    for path in (args.from_log or []) + (args.from_table or []):
        if not os.path.isfile(path):
            return _fail(f"no such file: {path}" if not os.path.exists(path)
                         else f"not a file: {path}")
    if args.results is not None:
        return _results_command(args)
    out = args.out or "flashfold-bench"
    runs: list[Run] = []
    failed: list[str] = []
    for path in args.from_log or []:
        try:
            found = parse(_read(path), path)
        except OSError as e:
            return _fail(f"cannot read {path}: {e.strerror or e}")
        if not found:
            print(f"flashfold bench: no timing results recognized in {path} (skipped)",
                  file=sys.stderr)
        runs += found
    for path in args.from_table or []:
        try:
            text = _read(path)
        except OSError as e:
            return _fail(f"cannot read {path}: {e.strerror or e}")
        tables = "\n".join(l for l in text.splitlines() if l.strip().startswith("|"))
        found = parse(tables, path)
        for r in found:
            r.device = r.device or "(device not recorded in the table)"
        if not found:
            print(f"flashfold bench: no benchmark table recognized in {path} (skipped)",
                  file=sys.stderr)
        runs += found
    if args.run:
        bench_dir = Path(args.bench_dir) if args.bench_dir else find_benchmarks()
        if bench_dir is None or not (bench_dir / "attention.py").is_file():
            return _fail("--run: benchmarks/ not found (run from a source checkout or pass "
                         "--bench-dir)")
        if not _gpu_available():
            return _fail("--run: no CUDA GPU visible here (torch.cuda.is_available() is "
                         "False); the benchmarks time GPU kernels. Plot saved logs with "
                         "--from-log FILE")
        names = SCRIPTS if "all" in args.run else args.run
        for name in names:
            try:
                log = run_script(name, bench_dir, out, quick=args.quick)
            except BenchmarkFailed as e:         # its results are drawn, the status is 1
                failed.append(str(e))
                log = e.log
            except (RuntimeError, OSError) as e:
                return _fail(f"--run: {e}", 1)
            print(f"wrote {log}")
            runs += parse_file(log)
    if runs and not any(r.kind in PLOTS for r in runs):
        kinds = ", ".join(sorted({r.kind for r in runs}))
        return _fail(f"nothing to plot: the {kinds} results have no plot (they are tables of "
                     f"the results page: flashfold bench --results --from-log FILE ...)")
    if not any(r.kind in PLOTS for r in runs):
        return _fail("nothing to plot; pass --from-log FILE, --from-table FILE or --run NAME "
                     "(see flashfold bench --help)")
    try:
        drawn = render(runs, out, args.prefix)
    except OSError as e:
        return _fail(f"cannot write the plots to {out}: {e.strerror or e}", 1)
    for path, desc in drawn.items():
        n = sum(a["lines"] + a["bars"] for a in desc["axes"])
        print(f"wrote {path} ({len(desc['axes'])} panels, {n} lines/bars)")
    if failed:
        return _fail("--run: " + "; ".join(failed), 1)
    return 0


def _results_command(args) -> int:
    """``--results [FILE]``: the tables of RESULTS.md from ``--from-log`` files, or from
    every log in the checkout's ``benchmarks/logs/``."""
    logs = list(args.from_log or [])
    bench_dir = Path(args.bench_dir) if args.bench_dir else find_benchmarks()
    if not logs:
        if bench_dir is None or not (bench_dir / "logs").is_dir():
            return _fail("--results: benchmarks/logs/ not found (run from a source checkout, "
                         "pass --bench-dir or --from-log FILE ...)")
        logs = sorted(str(p) for p in (bench_dir / "logs").glob("*.log"))
    out = args.results or (str(bench_dir / "RESULTS.md") if bench_dir else "")
    if not out:
        return _fail("--results: no output file given and no benchmarks/ folder found")
    if os.path.isdir(out):
        return _fail(f"--results: {out} is a folder; name the markdown file to write")
    try:
        chosen = write_results(logs, out)
    except ValueError:
        return _fail(f"--results: no benchmark results recognized in {len(logs)} log(s)")
    except OSError as e:
        if e.filename is not None and os.path.abspath(e.filename) != os.path.abspath(out):
            return _fail(f"--results: cannot read {e.filename}: {e.strerror or e}")
        return _fail(f"--results: cannot write {out}: {e.strerror or e}")
    for kind, run in chosen.items():
        print(f"{FAMILIES[kind]}: {os.path.basename(run.source)}")
    print(f"wrote {out}")
    return 0


def graph_replay(fn, warmup: int = 2):
    """``fn`` captured once in a CUDA graph; returns the graph's ``replay`` (kernel time
    without host time when timed). ``warmup`` calls run first on a side stream, so kernels
    compile and memory is allocated outside the capture. The graph, and the memory pool
    holding the outputs of the captured call, live as long as the returned callable."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def kernel_times(fn, reps: int = 5, warmup: int = 1, cuda: bool = True) -> list:
    """What one call of ``fn`` runs, by torch.profiler over ``reps`` calls after ``warmup``
    unprofiled ones: ``[(us, calls, name)]`` per call, longest first; the kernels' device
    times (``cuda``), or the operators' own CPU times (CPU runs: not a measurement)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = e.device_time_total if cuda else e.self_cpu_time_total
        if t > 0:
            rows.append((t / reps, e.count / reps, e.key))
    return sorted(rows, reverse=True)


__all__ = ["ProgressBar", "progress_bar", "Run", "parse", "parse_file", "parse_attention",
           "parse_attention_backward", "parse_decode", "parse_reductions", "render",
           "plot_attention", "plot_attention_backward", "plot_decode", "plot_reductions",
           "run_script", "BenchmarkFailed", "find_benchmarks", "graph_replay", "kernel_times",
           "parse_ring", "parse_transformers", "parse_workloads",
           "command_of", "latest", "results_markdown", "write_results", "FAMILIES", "command"]
