"""The ``flashfold`` command.

* ``flashfold demo``: the specification's order experiment and what the state saves.
* ``flashfold check MODULE:NAME [--prove]``: law checking of a user's monoid, and its
  symbolic proof (:mod:`flashfold.algebra.proofs`); exit 1 on failure.
* ``flashfold trace SCORES... --block K [--values ...]``: the (m, l, O) state after each block.
* ``flashfold numerics``: measured error of the state against the bound
  (:mod:`flashfold.error_analysis`).
* ``flashfold bench``: the GPU benchmarks, their plots and results page (:mod:`flashfold.bench`).

This module owns the command line: :data:`COMMANDS` lists every subcommand with the
function that adds its options and the function that runs it (the parsed arguments ->
an exit status). The features behind the commands are imported when a command runs (the
parser itself imports :mod:`flashfold.bench` for the names of its scripts); no module
registers anything at import. A mistake on the command line (a malformed option, a
target that does not name a monoid) prints one line to stderr and exits non-zero (2 for
options, argparse's status), without a traceback: options are checked by the argument
types below as they are parsed.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import platform
import re
import sys
from typing import Callable

import numpy as np

# --- argument types -----------------------------------------------------------------
# A user's mistake on the command line is one line on stderr and exit status 2 (argparse's
# convention), never a traceback: options are checked by these types as they are parsed,
# so the functions behind the commands never see an invalid value.

class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with its errors on one line: ``flashfold CMD: error: ...``, and
    negative numbers in every form ``float`` reads (``-inf``, a masked score; ``-1e5``)
    taken as values, where argparse knows ``-1`` and ``-.5`` only and reads the others as
    unknown options (none of flashfold's options looks like a number)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(
            r"^-(\d+\.?\d*(e[+-]?\d+)?|\.\d+(e[+-]?\d+)?|inf(inity)?|nan)$", re.IGNORECASE)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def int_at_least(lo: int, hi: int | None = None):
    """An argparse type: an int in ``[lo, hi]``."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            want = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise argparse.ArgumentTypeError(f"expected an int {want}, got {text!r}")
        return v
    parse.__name__ = "int"
    return parse


def size_at_least(lo: int):
    """An argparse type: a whole number >= ``lo``, also written as ``1e7``."""
    def parse(text: str) -> int:
        try:
            v = float(text)
        except ValueError:
            msg = f"expected a number such as 1e6, got {text!r}"
            raise argparse.ArgumentTypeError(msg) from None
        if not math.isfinite(v) or not v.is_integer() or v < lo:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {lo:g} such as 1e6, "
                                             f"got {text!r}")
        return int(v)
    parse.__name__ = "size"
    return parse


def writable_dir(text: str) -> str:
    """An argparse type: a directory that exists or can be made (checked, not made)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a directory, got ''")
    path = os.path.abspath(text)
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"cannot make {text!r}: {parent!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot make {text!r}: {parent!r} is not writable")
    return text


def file_prefix(text: str) -> str:
    """An argparse type: the start of a file name (no folder in it)."""
    if os.sep in text or (os.altsep and os.altsep in text):
        raise argparse.ArgumentTypeError(f"expected the start of a file name, got {text!r} "
                                         f"(name the folder with --out)")
    return text


# --- demo ------------------------------------------------------------------------------

def order_experiment(n: int = 1000, d: int = 64, std: float = 30.0, seed: int = 0):
    """The specification's experiment: one row of ``n`` keys merged in several orders.

    Scores ~ N(0, std), values ~ N(0, 1) of width ``d``; uneven random blocks including one
    of length 1, one empty, and one fully masked (its scores set to -inf). Returns
    ``(rows, sizes)`` where each row is ``(order, rel. dev. of output, rel. dev. of l,
    |lse - lse_ref|)`` against a direct float64 softmax.
    """
    from .monoids import ATTENTION
    from .schedules import finalize, fold

    rng = np.random.default_rng(seed)
    scores = rng.normal(0.0, std, size=n)
    values = rng.normal(0.0, 1.0, size=(n, d))
    sizes = _uneven_blocks(rng, n)
    masked = int(np.argmax(np.array(sizes) >= 5))            # one block of >= 5 keys, fully masked
    start = sum(sizes[:masked])
    scores[start:start + sizes[masked]] = -np.inf

    live = np.isfinite(scores)
    m_ref = scores[live].max()
    p = np.exp(scores[live] - m_ref)
    l_ref = p.sum()
    out_ref = (p / l_ref) @ values[live]
    lse_ref = m_ref + np.log(l_ref)

    rows = []
    for order in ("sequential", "reversed", "shuffled", "tree"):
        st = fold(ATTENTION, (scores, values), order, blocks=sizes, seed=seed)
        out, lse = finalize(ATTENTION, st)
        l_rel = abs(st.d * np.exp(st.m - m_ref) - l_ref) / l_ref
        rows.append((order, float(np.max(np.abs(out - out_ref)) / np.max(np.abs(out_ref))),
                     float(l_rel), float(abs(lse - lse_ref))))
    return rows, sizes, masked


def _uneven_blocks(rng, n: int) -> list[int]:
    sizes = [1, 0]                                            # a length-1 and an empty block
    left = n - 1
    while left > 0:
        s = int(min(left, rng.integers(2, 97)))
        sizes.append(s)
        left -= s
    rng.shuffle(sizes)
    return sizes


def attention_bytes(seq: int, heads: int = 16, d: int = 128, batch: int = 1,
                    dtype_bytes: int = 2) -> tuple[int, int]:
    """Bytes of a materialized score matrix vs. bytes of the per-row (m, l, o) state."""
    scores = batch * heads * seq * seq * dtype_bytes
    state = batch * heads * seq * (4 + 4 + 4 * d)            # m, l and o in float32
    return scores, state


def _mib(b: int) -> str:
    return f"{b / 2**20:,.1f} MiB" if b < 2**30 else f"{b / 2**30:,.2f} GiB"


def demo(args) -> int:
    out = sys.stdout
    out.write("flashfold demo: online softmax is a monoid, so every order gives the same answer\n\n")
    rows, sizes, masked = order_experiment()
    out.write("1. The order experiment (specification): 1,000 keys, scores ~ N(0, 30^2), values "
              "of width 64,\n")
    out.write(f"   {len(sizes)} uneven blocks (sizes {min(sizes)}..{max(sizes)}; one of length 1, "
              f"one empty, block {masked} of {sizes[masked]} keys fully masked),\n")
    out.write("   block states merged in four orders, against a direct float64 softmax:\n\n")
    out.write(f"   {'order':<12}{'output rel. dev.':>18}{'l rel. dev.':>14}{'|lse - ref|':>14}\n")
    for order, o, l, lse in rows:
        out.write(f"   {order:<12}{o:>18.2e}{l:>14.2e}{lse:>14.2e}\n")
    worst = max(max(r[1], r[2]) for r in rows)
    out.write(f"\n   worst relative deviation {worst:.1e} (specification: 1.3e-15); "
              f"{'all orders agree' if worst <= 1e-14 else 'ORDERS DISAGREE'}\n\n")

    out.write("2. What the state saves: one layer of 16 heads, head_dim 128, bf16 inputs\n\n")
    out.write(f"   {'seq':>7}{'score matrix S (bf16)':>24}{'state (m, l, o) fp32':>24}{'ratio':>8}\n")
    for seq in (1024, 4096, 8192, 16384, 131072):
        s, st = attention_bytes(seq)
        out.write(f"   {seq:>7,}{_mib(s):>24}{_mib(st):>24}{s / st:>7.0f}x\n")
    out.write("\n   FlashAttention keeps only the state; the N x N scores never reach memory.\n")
    out.write("   Next: `flashfold trace 2 4 1 3 --block 2`, `flashfold check mymod:MYMONOID`.\n")
    return 0 if worst <= 1e-14 else 1


# --- check ------------------------------------------------------------------------------

def _load_monoid(spec: str):
    from .algebra.monoid import Monoid
    mod_name, colon, attr = spec.partition(":")
    dotted = lambda t: bool(t) and all(p.isidentifier() for p in t.split("."))  # noqa: E731
    if not (colon and dotted(mod_name) and dotted(attr)):
        raise SystemExit(f"flashfold check: expected MODULE:NAME (e.g. mymonoids:AVG), "
                         f"got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise SystemExit(f"flashfold check: cannot import module {mod_name!r}: {e}")
    except Exception as e:                  # the module itself raised (a bad monoid, a typo)
        raise SystemExit(f"flashfold check: importing {mod_name!r} raised "
                         f"{type(e).__name__}: {e}")
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SystemExit(f"flashfold check: {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not isinstance(obj, Monoid):
        raise SystemExit(f"flashfold check: {spec} is a {type(obj).__name__}, not a flashfold Monoid")
    return obj


def check(args) -> int:
    from .algebra.laws import check_laws
    monoid = _load_monoid(args.target)
    report = check_laws(monoid, trials=args.trials, seed=args.seed)
    print(report)
    status = 0 if report.ok else 1
    if args.prove:
        status = max(status, _prove(monoid))
    return status


def _prove(monoid) -> int:
    """``--prove``: print the symbolic proof (SymPy); 1 unless every law is proved."""
    from .algebra.proofs import ProofError, prove
    try:
        proof = prove(monoid)
    except ProofError as e:
        print(f"symbolic proof of {monoid.name!r}: not carried out ({e})")
        return 1
    print(proof)
    return 0 if proof.ok else 1


def _configure_check(p):
    p.add_argument("target", help="MODULE:NAME of a flashfold Monoid (MODULE importable from here)")
    p.add_argument("--trials", type=int_at_least(1), default=1000,
                   help="random triples to check (default 1000)")
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.add_argument("--prove", action="store_true",
                   help="also prove associativity and the identity law symbolically (SymPy)")


# --- trace ------------------------------------------------------------------------------

def _parse_vector(text: str) -> list[float]:
    try:
        return [float(t) for t in text.split(",")]
    except ValueError:
        raise SystemExit(f"flashfold trace: cannot parse value vector {text!r} (write e.g. 1,0)")


def trace_blocks(scores, block: int, values=None):
    """The (m, l, O) state after each block, as in the specification's worked examples.

    Returns a list of dicts ``{block, scores, m, scale, l, o}`` and the final output
    ``O / l`` (or the softmax probabilities when no values are given).
    """
    from .algebra.evaluate import numpy_monoid
    from .monoids import ATTENTION

    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1:
        raise ValueError(f"scores: expected a 1-D list of scores, got shape {s.shape}")
    if block < 1:
        raise ValueError(f"block: expected a positive block size, got {block}")
    if values is not None and len({len(row) for row in values}) > 1:
        raise ValueError(f"values: expected vectors of one length, got lengths "
                         f"{[len(row) for row in values]}")
    v = np.eye(len(s)) if values is None else np.asarray(values, dtype=np.float64)
    if v.ndim != 2 or v.shape[0] != len(s):
        raise ValueError(f"values: expected one vector per score ({len(s)}), got shape {v.shape}")
    ex = numpy_monoid(ATTENTION)
    state = ex.identity((), v.shape[1])
    rows = []
    for k, start in enumerate(range(0, len(s), block)):
        part = (s[start:start + block], v[start:start + block])
        new = ex.combine(state, ex.block_lift(part, v.shape[1]))
        # the factor on the previous state: 0 while every score so far is -inf (nothing
        # to rescale), NaN once the running max is NaN (never a number made up from it)
        scale = (float(np.exp(state[0] - new[0])) if np.isfinite(new[0]) else
                 math.nan if np.isnan(new[0]) else 0.0)
        rows.append({"block": k + 1, "scores": part[0].tolist(), "m": float(new[0]),
                     "scale": scale, "l": float(new[1]), "o": new[2].tolist()})
        state = new
    out, lse = ex.finalize(state)
    return rows, out.tolist(), float(lse)


def trace(args) -> int:
    values = None if not args.values else [_parse_vector(t) for t in args.values]
    try:
        rows, out, lse = trace_blocks(args.scores, args.block, values)
    except ValueError as e:
        raise SystemExit(f"flashfold trace: {e}")
    p = args.precision
    fmt = lambda xs: "[" + ", ".join(f"{x:.{p}f}" for x in xs) + "]"  # noqa: E731
    for r in rows:
        print(f"after block {r['block']} {fmt(r['scores'])}: m = {r['m']:.{p}g}  "
              f"scale = {r['scale']:.{p}f}  l = {r['l']:.{p}f}  O = {fmt(r['o'])}")
    label = "output O / l" if values else "softmax"
    print(f"{label} = {fmt(out)}   lse = {lse:.{p}f}")
    return 0


def _configure_trace(p):
    p.add_argument("scores", nargs="+", type=float, help="the scores of one row")
    p.add_argument("--block", type=int_at_least(1), required=True, help="block size")
    p.add_argument("--values", nargs="+", metavar="V", help="one comma-separated vector per score")
    p.add_argument("--precision", type=int_at_least(0, 50), default=4,
                   help="decimals printed (default 4)")


# --- numerics ---------------------------------------------------------------------------

def numerics(args) -> int:
    from .bench import progress_bar                # a text bar on stderr
    from .error_analysis import PLOT_HINT, have_matplotlib
    from .error_analysis import numerics as measure
    draw = have_matplotlib()
    if not draw:                                   # said before the (long) computation
        print(f"flashfold numerics: matplotlib is not installed: writing the table only, "
              f"no figure ({PLOT_HINT} for it)", file=sys.stderr)
    import torch
    print(f"flashfold numerics: CPU {platform.machine()}, torch {torch.__version__}, "
          f"python {platform.python_version()}")
    bar = None if args.quiet else progress_bar("numerics")
    try:
        report = measure(args.max_n, block=args.block, width=args.width, seed=args.seed,
                         out=args.out, plot=draw, progress=bar or False)
    except (OSError, ValueError) as e:          # --out not writable after all (/proc as root)
        raise SystemExit(f"flashfold numerics: {e}")
    finally:
        if bar is not None:
            bar.close()
    print(report.table())
    # FP8 attention's error next to bf16's (random and outlier-heavy inputs, rotated or
    # not): a few seconds on the CPU
    from .error_analysis import fp8_error_table
    fp8 = fp8_error_table(seed=args.seed)
    fp8_md = os.path.join(args.out, "fp8.md")
    try:
        with open(fp8_md, "w") as f:
            f.write("# FP8 attention: error against float64\n\n" + fp8)
    except OSError as e:
        raise SystemExit(f"flashfold numerics: cannot write {fp8_md}: {e}")
    print("\n" + fp8)
    if report.png:
        print(f"\nwrote {report.markdown}, {fp8_md} and {report.png}")
    else:
        print(f"\nwrote {report.markdown} and {fp8_md} (figure skipped: matplotlib is not "
              f"installed; {PLOT_HINT})")
    return 0 if report.ok else 1


def _configure_numerics(p):
    p.add_argument("--max-n", default=10**7, type=size_at_least(10),
                   help="largest row length, >= 10 (default 1e7; sizes 10, 100, ... up to it)")
    p.add_argument("--out", default="flashfold-numerics", type=writable_dir,
                   help="directory for numerics.md and numerics.png (default ./flashfold-numerics)")
    p.add_argument("--block", type=int_at_least(1), default=128,
                   help="tile size of the blocked order")
    p.add_argument("--width", type=int_at_least(1), default=2, help="width of the value vectors")
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")


# --- bench ------------------------------------------------------------------------------

def bench(args) -> int:
    from . import bench as feature
    return feature.command(args)


def _configure_bench(p):
    from .bench import SCRIPTS
    p.add_argument("--from-log", nargs="+", metavar="FILE",
                   help="plot the printed output of benchmarks/*.py (e.g. benchmarks/logs/*.log)")
    p.add_argument("--from-table", nargs="+", metavar="FILE",
                   help="plot the markdown result tables found in FILE (e.g. benchmarks/RESULTS.md)")
    p.add_argument("--run", nargs="+", choices=SCRIPTS + ("all",), metavar="NAME",
                   help="run benchmarks/NAME.py on this machine's GPU first (attention, decode, "
                        "reductions, all)")
    p.add_argument("--quick", action="store_true", help="with --run: the scripts' --quick grids")
    p.add_argument("--bench-dir", help="the benchmarks/ folder (default: found above the cwd)")
    # (no default here: argparse would check it even where nothing is drawn, --results)
    p.add_argument("--out", type=writable_dir,
                   help="output folder (default ./flashfold-bench)")
    p.add_argument("--prefix", default="", type=file_prefix,
                   help="prefix of the PNG file names")
    p.add_argument("--results", nargs="?", const="", metavar="FILE",
                   help="write the results page (one table per family, from the latest log of "
                        "each) to FILE (default benchmarks/RESULTS.md), from --from-log files or "
                        "every benchmarks/logs/*.log; no plots")


# --- entry point ------------------------------------------------------------------------

#: ``flashfold NAME``: (run, add options, help); ``run(args)`` returns the exit status
COMMANDS: dict[str, tuple[Callable, Callable, str]] = {
    "demo": (demo, lambda p: None, "the specification's order experiment (no arguments)"),
    "check": (check, _configure_check, "check a monoid's laws: flashfold check MODULE:NAME"),
    "trace": (trace, _configure_trace, "print the (m, l, O) state after each block"),
    "numerics": (numerics, _configure_numerics,
                 "measured error of the softmax/attention state vs the bound (table + PNG)"),
    "bench": (bench, _configure_bench,
              "run the GPU benchmarks or plot saved results (PNG: TFLOP/s, GB/s)"),
}

#: the modules behind the commands, imported when a command runs
FEATURES = ("flashfold.algebra.laws", "flashfold.algebra.proofs", "flashfold.error_analysis",
            "flashfold.bench")


def _load_plugins():
    """Import every module behind a command at once (:data:`FEATURES`; the commands import
    theirs when they run): none of them may import matplotlib, SymPy or torch at import."""
    for mod in FEATURES:
        importlib.import_module(mod)


def main(argv=None) -> int:
    parser = ArgumentParser(prog="flashfold", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND")
    for name, (fn, configure, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_)
        configure(p)
        p.set_defaults(_fn=fn)
    args = parser.parse_args(argv)
    if not getattr(args, "_fn", None):
        parser.print_help()
        return 2
    return int(args._fn(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
