r"""``flashfold bench``: run the GPU benchmarks, or plot their saved results, as PNG files.

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

Usage::

    flashfold bench --from-log benchmarks/logs/2026-11-29_h200_attention_fwd_run1.log
    flashfold bench --from-log benchmarks/logs/*.log --out docs
    flashfold bench --from-table benchmarks/RESULTS.md     # the markdown tables in a file
    flashfold bench --run attention decode [--quick]       # on a GPU, from the checkout

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

    ``kind``: ``"attention"``, ``"decode"`` or ``"reductions"``. ``rows``: dicts, per kind:
    attention ``{D, N, mask, values: {impl: TFLOP/s}}``; decode ``{batch, length, values:
    {impl: GB/s}}`` (impl names as printed, e.g. ``"flashfold p16 [graph]"``); reductions
    ``{op, shape, dtype, values: {"flashfold": GB/s, "torch": GB/s}}``. ``ceiling``: the
    measured roof (TFLOP/s of a bf16 matmul, or GB/s of a device copy) and its label.
    """

    kind: str
    rows: list = field(default_factory=list)
    ceiling: float | None = None
    ceiling_label: str = ""
    device: str = ""
    software: str = ""
    date: str = ""
    source: str = ""

    def subtitle(self) -> str:
        parts = [p for p in (self.device, self.software, self.date) if p]
        return ", ".join(parts)


_ATT_ROW = re.compile(r"^\s*d(\d+)\s+N(\d+)\s+(\S+)\s+(?:([\d.]+) ms\s+)?((?:\w+=[\d.-]+\s*)+)")
_ATT_CEIL = re.compile(r"matmul 8192\^3 in this run:\s*([\d.]+)\s*TFLOP/s")
_DEC_ROW = re.compile(r"^\s*batch\s+(\d+)\s+len\s+(\d+)\s*\(.*?\):\s*(.*)$")
_DEC_COPY = re.compile(r"== device copy:\s*([\d.]+)\s*GB/s")
_RED_COPY = re.compile(r"copy of 1 GiB:.*?=\s*([\d.]+)\s*GB/s")
_RED_ROW = re.compile(r"^\s*(\S.*?)\s{2,}(\S+(?: dim \d+| /\d+)?)\s+(float32|bfloat16|float16)\s+"
                      r"([\d.]+) ms\s+([\d.]+) GB/s\s*\|\s*torch\s+([\d.]+|nan) ms")
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
                      r"(?:fwd\+bwd\s+((?:[\w-]+=[\d.]+\s*)+))?")
#: backward impl keys in the logs -> legend names
BACKWARD_IMPLS = {"flashfold": "flashfold", "ff-det": "flashfold, deterministic=True",
                  "cudnn": "cuDNN (SDPA)", "flash": "FlashAttention 2 (SDPA)"}


def parse_attention_backward(text: str) -> Run:
    """The ``== backward speed`` lines of ``benchmarks/attention.py --bwd``: ``values``
    holds the backward TFLOP/s per impl, ``fwd+bwd`` (a dict) forward + backward."""
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
        if vals:
            run.rows.append({"D": int(r.group(1)), "N": int(r.group(2)), "mask": r.group(3),
                             "values": vals, "fwd+bwd": both})
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
        if tms != "nan" and float(tms) > 0:
            vals["torch"] = gbs * ms / float(tms)          # the same bytes in torch's time
        key = (op, shape, dtype)
        if key not in seen:
            seen.add(key)
            run.rows.append({"op": op, "shape": shape, "dtype": dtype, "values": vals})
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


PARSERS = {"attention": parse_attention, "attention_bwd": parse_attention_backward,
           "decode": parse_decode, "reductions": parse_reductions}


def parse(text: str, source: str = "") -> list[Run]:
    """Every benchmark found in ``text`` (a log or a file with markdown tables)."""
    runs = []
    for parser in PARSERS.values():
        run = parser(text)
        if run.rows:
            run.source = source
            run.date = _date_of(source) if source else ""
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
        fn, name = PLOTS[run.kind]
        path = os.path.join(out, prefix + name)
        if path in done:                           # two runs of one kind: keep both
            stem = os.path.splitext(os.path.basename(run.source))[0] or str(len(done))
            path = os.path.join(out, f"{prefix}{stem}_{name}")
        done[path] = fn(run, path)
    return done


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


def run_script(name: str, bench_dir: Path, out: str, quick: bool = False, extra=(),
               python: str | None = None, stream=None) -> str:
    """Run ``benchmarks/NAME.py``, tee its output to ``OUT/<date>_<name>.log`` with a
    progress bar on stderr; returns the log's path. Raises ``RuntimeError`` on failure."""
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
    if rc != 0 and not parse_file(log):
        raise RuntimeError(f"benchmarks/{name}.py exited with status {rc}; see {log}")
    return log


# =====================================================================================
# `flashfold bench`
# =====================================================================================

def _cli(args) -> int:
    runs: list[Run] = []
    for path in args.from_log or []:
        found = parse_file(path)
        if not found:
            print(f"flashfold bench: no timing results recognized in {path} (skipped)",
                  file=sys.stderr)
        runs += found
    for path in args.from_table or []:
        with open(path, encoding="utf-8") as f:
            text = f.read()
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
            print("flashfold bench --run: benchmarks/ not found (run from a source checkout or "
                  "pass --bench-dir)", file=sys.stderr)
            return 2
        names = SCRIPTS if "all" in args.run else args.run
        for name in names:
            log = run_script(name, bench_dir, args.out, quick=args.quick)
            print(f"wrote {log}")
            runs += parse_file(log)
    if not runs:
        print("flashfold bench: nothing to plot; pass --from-log FILE, --from-table FILE or "
              "--run NAME (see flashfold bench --help)", file=sys.stderr)
        return 2
    for path, desc in render(runs, args.out, args.prefix).items():
        n = sum(a["lines"] + a["bars"] for a in desc["axes"])
        print(f"wrote {path} ({len(desc['axes'])} panels, {n} lines/bars)")
    return 0


def _configure(p):
    p.add_argument("--from-log", nargs="+", metavar="FILE",
                   help="plot the printed output of benchmarks/*.py (e.g. benchmarks/logs/*.log)")
    p.add_argument("--from-table", nargs="+", metavar="FILE",
                   help="plot the markdown result tables found in FILE (e.g. benchmarks/RESULTS.md)")
    p.add_argument("--run", nargs="+", choices=SCRIPTS + ("all",), metavar="NAME",
                   help="run benchmarks/NAME.py on this machine's GPU first (attention, decode, "
                        "reductions, all)")
    p.add_argument("--quick", action="store_true", help="with --run: the scripts' --quick grids")
    p.add_argument("--bench-dir", help="the benchmarks/ folder (default: found above the cwd)")
    p.add_argument("--out", default="flashfold-bench", help="output folder (default ./flashfold-bench)")
    p.add_argument("--prefix", default="", help="prefix of the PNG file names")


def _register_cli():
    from . import cli
    cli.register_command("bench", _cli, _configure,
                         "run the GPU benchmarks or plot saved results (PNG: TFLOP/s, GB/s)")


_register_cli()

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


__all__ = ["ProgressBar", "progress_bar", "Run", "parse", "parse_file", "parse_attention",
           "parse_attention_backward", "parse_decode", "parse_reductions", "render",
           "plot_attention", "plot_attention_backward", "plot_decode", "plot_reductions",
           "run_script", "find_benchmarks", "graph_replay"]
