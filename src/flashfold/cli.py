"""The ``flashfold`` command.

* ``flashfold demo``: the specification's order experiment and what the state saves.
* ``flashfold check MODULE:NAME``: law checking of a user's monoid (exit 1 on failure).
* ``flashfold trace SCORES... --block K [--values ...]``: the (m, l, O) state after each block.

Subcommands are registered in :data:`COMMANDS`; each is a function taking the parsed
arguments and returning an exit status. A mistake on the command line (a malformed
option, a target that does not name a monoid) prints one line to stderr and exits
non-zero (2 for options, argparse's status), without a traceback: options are checked
by the argument types below as they are parsed.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from typing import Callable

import numpy as np

COMMANDS: dict[str, tuple[Callable, Callable, str]] = {}


def register_command(name: str, fn: Callable, configure: Callable | None, help: str):
    """Register ``fn(args) -> exit status`` as ``flashfold NAME``; ``configure(parser)`` adds options."""
    COMMANDS[name] = (fn, configure or (lambda p: None), help)


# --- argument types -----------------------------------------------------------------
# A user's mistake on the command line is one line on stderr and exit status 2 (argparse's
# convention), never a traceback: options are checked by these types as they are parsed,
# so the functions behind the commands never see an invalid value.

class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with its errors on one line: ``flashfold CMD: error: ...``."""

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


# --- demo ------------------------------------------------------------------------------

def order_experiment(n: int = 1000, d: int = 64, std: float = 30.0, seed: int = 0):
    """The specification's experiment: one row of ``n`` keys merged in several orders.

    Scores ~ N(0, std), values ~ N(0, 1) of width ``d``; uneven random blocks including one
    of length 1, one empty, and one fully masked (its scores set to -inf). Returns
    ``(rows, sizes)`` where each row is ``(order, rel. dev. of output, rel. dev. of l,
    |lse - lse_ref|)`` against a direct float64 softmax.
    """
    from . import fold, finalize
    from .monoids import ATTENTION

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


register_command("demo", demo, None, "the specification's order experiment (no arguments)")


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
    for hook in CHECK_HOOKS:
        status = max(status, hook(monoid, args))
    return status


#: extra checks run by ``flashfold check`` (e.g. ``--prove``); each returns an exit status
CHECK_HOOKS: list[Callable] = []
CHECK_OPTIONS: list[Callable] = []


def _configure_check(p):
    p.add_argument("target", help="MODULE:NAME of a flashfold Monoid (MODULE importable from here)")
    p.add_argument("--trials", type=int_at_least(1), default=1000,
                   help="random triples to check (default 1000)")
    p.add_argument("--seed", type=int_at_least(0), default=0)
    for add in CHECK_OPTIONS:
        add(p)


register_command("check", check, _configure_check, "check a monoid's laws: flashfold check MODULE:NAME")


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
    v = np.eye(len(s)) if values is None else np.asarray(values, dtype=np.float64)
    if v.ndim != 2 or v.shape[0] != len(s):
        raise ValueError(f"values: expected one vector per score ({len(s)}), got shape {v.shape}")
    ex = numpy_monoid(ATTENTION)
    state = ex.identity((), v.shape[1])
    rows = []
    for k, start in enumerate(range(0, len(s), block)):
        part = (s[start:start + block], v[start:start + block])
        new = ex.combine(state, ex.block_lift(part, v.shape[1]))
        scale = float(np.exp(state[0] - new[0])) if np.isfinite(new[0]) else 0.0
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
    p.add_argument("--block", type=int, required=True, help="block size")
    p.add_argument("--values", nargs="+", metavar="V", help="one comma-separated vector per score")
    p.add_argument("--precision", type=int_at_least(0, 50), default=4,
                   help="decimals printed (default 4)")


register_command("trace", trace, _configure_trace, "print the (m, l, O) state after each block")


# --- entry point ------------------------------------------------------------------------

#: modules that register subcommands or ``check`` options when imported (absent ones are skipped)
PLUGINS = ("flashfold.error_analysis", "flashfold.algebra.proofs", "flashfold.bench")


def _load_plugins():
    """Subcommands that live with their feature register themselves on import."""
    for mod in PLUGINS:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


def main(argv=None) -> int:
    _load_plugins()
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
    # run as `python -m flashfold.cli`: use the package's module, where plugins register
    from flashfold.cli import main as _main
    sys.exit(_main())
