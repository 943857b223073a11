"""Numerical analysis of the online-softmax / attention state, measured against the bound.

The specification's perturbation analysis: the computed denominator is the exact sum of
perturbed weights, so

.. math::

    \\frac{|\\hat d - d|}{d} \\le \\gamma_{N-1} = \\frac{(N-1)\\,u}{1 - (N-1)\\,u},
    \\qquad u = 2^{-24}\\ (\\text{fp32}),\\ 2^{-8}\\ (\\text{bf16}),

counting the ``N - 1`` additions only, while in practice the roundings scatter and the
error behaves like ``sqrt(N) u`` (a heuristic, not a bound). For the output accumulator
``o = Σ w_j v_j`` the analogue is componentwise: ``|ô - o| <= γ Σ w_j |v_j|``.

:func:`numerics` measures it. For each ``N`` it draws one row of scores (``N(0, std²)``
on a 1/16 grid, so that every difference of scores is exact in bf16 and the only
roundings are the ones counted below) and values (bf16-representable, width ``width``),
computes the state ``(m, d, o)`` in float64 (the reference), and again with the
statistics rounded to fp32 and to bf16 after *every* operation, in three orders:

* ``sequential``: the online recurrence over single elements (FlashAttention with
  tiles of one key): ``m' = max(m, s)``, ``d' = d e^{m - m'} + e^{s - m'}``;
* ``tree``: pairwise merges of states, ``ceil(log2 N)`` levels (a GPU's in-block tree);
* ``blocked``: tiles of ``block`` keys (FlashAttention): per tile the max, the weights
  ``e^{s - m_t}`` and their tree sum (``tl.sum``), then the online merge across tiles.

Rounding is emulated exactly (round to nearest even to 24 or 8 significand bits after
each add, multiply and exp) and vectorized: tree levels are array operations; a
sequential fp32 sum is ``numpy.cumsum`` in float32 (which adds left to right); a
sequential bf16 sum runs in chunks within which the running sum stays in one binade,
where ``fl(S + t) = S + ulp · round(t / ulp)`` up to ties (resolved through the parity
of ``S``), so 10^7 terms take seconds, not minutes.

Next to the measured errors the table shows the specification's bound ``γ_{N-1}``, the
heuristic ``sqrt(N) u``, and a rigorous bound ``γ_K`` for the order actually run:
``K`` is the largest number of roundings any weight passes through (additions *plus*
each rescale's ``exp`` and multiply, and the weight's own ``exp``), by Higham's lemma
``Π (1 + δ_i) = 1 + θ_K``, ``|θ_K| <= γ_K``. The bf16 rows show the specification's
point: ``d`` is a long sum of terms in (0, 1], and once ``d`` exceeds ``2^8`` times a
term, adding the term changes nothing: the statistics must stay in fp32.

``flashfold numerics [--max-n 1e7] [--out DIR]`` writes the table (Markdown) and a
log-log plot (PNG); matplotlib (``pip install 'flashfold[plot]'``) is imported only to
draw it, and without it the table is written and the figure skipped, as the command
says before it starts.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

#: unit roundoff of the statistics formats (the specification's values)
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8}
_BITS = {"float32": 24, "bfloat16": 8}
ORDERS = ("sequential", "tree", "blocked")
DTYPES = ("float32", "bfloat16")


def gamma(k: int, u: float) -> float:
    """Higham's ``γ_k = k u / (1 - k u)``; ``inf`` (a vacuous bound) when ``k u >= 1``."""
    return k * u / (1.0 - k * u) if k * u < 1.0 else math.inf


# =====================================================================================
# Exact rounding to a p-bit significand (round to nearest, ties to even)
# =====================================================================================

def round_to_bits(x, bits: int) -> np.ndarray:
    """``x`` (float64) rounded to ``bits`` significand bits, RNE; exact, vectorized.

    ``bits = 24`` is float32's rounding, ``bits = 8`` bfloat16's (exponent range of
    float64: no overflow or subnormals at the magnitudes used here); ``bits`` is an int in
    ``1..53`` (53: float64 itself, unchanged).
    """
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)):
        raise TypeError(f"bits: expected an int in 1..53, got {type(bits).__name__} {bits!r}")
    if not 1 <= bits <= 53:
        raise ValueError(f"bits: expected an int in 1..53, got {bits!r}")
    x = np.asarray(x, dtype=np.float64)
    drop = 53 - int(bits)
    if drop == 0:
        return x.copy()
    b = x.view(np.int64)
    b = (b + ((1 << (drop - 1)) - 1) + ((b >> drop) & 1)) & ~((1 << drop) - 1)
    # a NaN's payload can carry into the exponent (inf) or wrap the sign (a number): keep it
    out = np.where(np.isnan(x), x, b.view(np.float64))
    return out if out.ndim else out[()]


class _Format:
    """Arithmetic of one statistics format: every result rounded to ``bits`` bits."""

    def __init__(self, name: str):
        self.name = name
        self.bits = _BITS[name]
        self.u = UNIT_ROUNDOFF[name]

    def r(self, x):
        return round_to_bits(x, self.bits)

    def add(self, a, b):
        return self.r(np.add(a, b))

    def mul(self, a, b):
        return self.r(np.multiply(a, b))

    def exp(self, x):
        with np.errstate(under="ignore"):
            return self.r(np.exp(x))

    def scalar(self, x: float) -> float:
        return float(self.r(np.array([x]))[0])

    def seq_sum(self, acc, terms):
        """``acc <- fl(acc + t)`` for ``t`` in ``terms`` (along axis 0), left to right."""
        if terms.shape[0] == 0:
            return acc
        if self.bits == 24:                  # float32: cumsum adds left to right in fp32
            arr = np.empty((terms.shape[0] + 1,) + terms.shape[1:], dtype=np.float32)
            arr[0] = acc
            arr[1:] = terms
            return np.cumsum(arr, axis=0, dtype=np.float32)[-1].astype(np.float64)
        if terms.ndim == 1:
            return _seq_sum_lowp(float(acc), terms, self)
        return np.array([_seq_sum_lowp(float(a), terms[:, j], self)
                         for j, a in enumerate(np.atleast_1d(acc))])


def _seq_sum_lowp(acc: float, t: np.ndarray, fmt: _Format) -> float:
    """Exact sequential sum with rounding to ``fmt.bits`` bits after every addition.

    Within one binade ``[lo, 2 lo)`` of the running sum ``s = S ulp``, rounding
    ``s + t`` to nearest is ``S + round(t / ulp)``, except at ties (``t / ulp`` ending in
    ``.5``), which go to the even ``S``: the parity of ``S`` is carried in closed form
    (it is 0 after each tie and otherwise flips with each odd increment). A chunk is
    accepted up to the first step that leaves the binade; that step is done in scalar.
    """
    n, i, w = t.shape[0], 0, 256
    scale = float(1 << fmt.bits)
    frexp, ldexp = math.frexp, math.ldexp
    burst = 0
    while i < n:
        if burst or acc == 0.0 or not math.isfinite(acc):
            # short runs between binade changes: plain scalar steps are cheaper
            steps = burst or 1
            for x in t[i:i + steps].tolist():
                fr, ex = frexp(acc + x)
                acc = ldexp(round(fr * scale) / scale, ex)       # round() is half-to-even
            i += steps
            burst = 0
            continue
        sgn = 1.0 if acc > 0 else -1.0         # rounding is symmetric: work with |acc|
        acc = abs(acc)
        _, e = math.frexp(acc)                # acc in [2^(e-1), 2^e)
        lo, hi = math.ldexp(1.0, e - 1), math.ldexp(1.0, e)
        ulp = math.ldexp(1.0, e - fmt.bits)
        chunk = t[i:i + w] if sgn > 0 else -t[i:i + w]
        tau = chunk / ulp                     # exact: scaling by a power of two
        fl = np.floor(tau)
        tie = (tau - fl) == 0.5
        a = np.where(tie, fl, np.rint(tau))
        par = np.abs(np.fmod(a, 2.0))
        s0 = acc / ulp
        idx = np.arange(chunk.shape[0])
        last_tie = np.maximum.accumulate(np.where(tie, idx, -1))
        lt_prev = np.concatenate(([-1], last_tie[:-1]))
        cum = np.cumsum(par)
        cum_prev = np.concatenate(([0.0], cum[:-1]))
        cum_at = np.where(lt_prev >= 0, cum[np.maximum(lt_prev, 0)], 0.0)
        base = np.where(lt_prev >= 0, 0.0, abs(math.fmod(s0, 2.0)))
        p_prev = np.fmod(base + cum_prev - cum_at, 2.0)           # parity of S before step k
        inc = a + np.where(tie, np.fmod(p_prev + par, 2.0), 0.0)
        S = s0 + np.cumsum(inc)
        s_prev = np.concatenate(([s0], S[:-1]))
        s = S * ulp
        low = lo / ulp
        ok = (s < hi) & ((s > lo) | ((s == lo) & ((s_prev - low) + tau >= 0.0)))
        bad = np.flatnonzero(~ok)
        j = int(bad[0]) if bad.size else chunk.shape[0]
        if j > 0:
            acc = float(s[j - 1])
        if j < chunk.shape[0]:
            acc = fmt.scalar(acc + float(chunk[j]))
            i += j + 1
            w = max(64, w // 2) if j < w // 4 else w
            if j < 48:
                burst = 96
        else:
            i += chunk.shape[0]
            w = min(1 << 16, 2 * w)
        acc *= sgn
    return acc


# =====================================================================================
# The three orders, with statistics in a low-precision format
# =====================================================================================

def _online_fold(m, d, o, fmt: _Format):
    """Left fold of states ``(m_k, d_k, o_k)`` with the online merge, rounding every op.

    Vectorized between records of the running max: there the merge is
    ``acc <- fl(acc + fl(d_k fl(e^{m_k - M})))``, a sequential sum; at a record
    ``acc <- fl(fl(acc fl(e^{M - m_k})) + d_k)``. Returns ``(d, o, records)``.
    """
    T = m.shape[0]
    M = np.maximum.accumulate(m)
    rec = np.flatnonzero(m[1:] > M[:-1]) + 1
    f = np.where(m == M, 1.0, fmt.exp(m - M))          # 1 exactly for the current max
    c = fmt.mul(d, f)
    co = fmt.mul(o, f[:, None])
    points = [0] + rec.tolist() + [T]
    acc, acc_o = float(d[0]), o[0].copy()
    for a, b in zip(points[:-1], points[1:]):
        if a > 0:                                    # a new max: rescale the accumulator
            g = float(fmt.exp(np.array([M[a - 1] - m[a]]))[0])
            acc = fmt.scalar(fmt.scalar(acc * g) + float(d[a]))
            acc_o = fmt.add(fmt.mul(acc_o, g), o[a])
        acc = fmt.seq_sum(acc, c[a + 1:b])
        acc_o = fmt.seq_sum(acc_o, co[a + 1:b])
    return float(acc), np.asarray(acc_o, dtype=np.float64), int(rec.size)


def _tree_fold(m, d, o, fmt: _Format):
    """Pairwise merges, level by level (odd element carried), rounding every op."""
    levels = 0
    while m.shape[0] > 1:
        n = m.shape[0]
        ev = n - n % 2
        ma, mb = m[0:ev:2], m[1:ev:2]
        mx = np.maximum(ma, mb)
        fa = np.where(ma == mx, 1.0, fmt.exp(ma - mx))
        fb = np.where(mb == mx, 1.0, fmt.exp(mb - mx))
        dn = fmt.add(fmt.mul(d[0:ev:2], fa), fmt.mul(d[1:ev:2], fb))
        on = fmt.add(fmt.mul(o[0:ev:2], fa[:, None]), fmt.mul(o[1:ev:2], fb[:, None]))
        if n % 2:
            mx, dn, on = (np.concatenate([mx, m[-1:]]), np.concatenate([dn, d[-1:]]),
                          np.concatenate([on, o[-1:]]))
        m, d, o = mx, dn, on
        levels += 1
    return float(d[0]), o[0], levels


def _pairwise_sum(x, fmt: _Format):
    """Tree sum along axis 1 (a tile's ``tl.sum``), rounding every addition."""
    levels = 0
    while x.shape[1] > 1:
        n = x.shape[1]
        ev = n - n % 2
        s = fmt.add(x[:, 0:ev:2], x[:, 1:ev:2])
        if n % 2:
            s = np.concatenate([s, x[:, -1:]], axis=1)
        x = s
        levels += 1
    return x[:, 0], levels


def _run_order(order: str, s, v, fmt: _Format, block: int):
    """``(d, o, K_d, K_o)``: the state's d and o, and the rounding counts of the bound."""
    n = s.shape[0]
    if order == "sequential":
        d, o, rec = _online_fold(s, np.ones(n), v, fmt)
        k = 1 + (n - 1) + 2 * rec                     # own exp, additions, 2 per rescale
        return d, o, k, k
    if order == "tree":
        d, o, levels = _tree_fold(s, np.ones(n), v, fmt)
        return d, o, 3 * levels, 3 * levels             # per level: exp, multiply, add
    if order == "blocked":
        t = -(-n // block)
        pad = t * block - n
        S = np.concatenate([s, np.full(pad, -np.inf)]).reshape(t, block)
        V = np.concatenate([v, np.zeros((pad, v.shape[1]))]).reshape(t, block, v.shape[1])
        mt = S.max(axis=1)
        p = fmt.exp(S - mt[:, None])                  # exact differences; e^-inf = 0
        dt, lv = _pairwise_sum(p, fmt)
        ot, _ = _pairwise_sum(fmt.mul(p[:, :, None], V), fmt)
        d, o, rec = _online_fold(mt, dt, ot, fmt)
        k = (1 + lv) + 2 + (t - 1) + 2 * rec            # tile: exp + tree; merge: exp, mul, adds
        return d, o, k, k + 1                           # o: one more rounding for p * v
    raise ValueError(f"orders: unknown order {order!r}; expected one of {ORDERS}")


# =====================================================================================
# The experiment
# =====================================================================================

@dataclass(frozen=True)
class NumericsRow:
    """One configuration: ``N`` keys, statistics ``dtype``, merge ``order``.

    ``err_d = |d̂ - d| / d``; ``err_o = max_k |ô_k - o_k| / Σ_j w_j |v_jk|``;
    ``bound`` the specification's ``γ_{N-1}``; ``rigorous_d``/``rigorous_o`` the bound
    ``γ_K`` for this order's rounding count ``K``; ``heuristic = sqrt(N) u``.
    """
    n: int
    dtype: str
    order: str
    err_d: float
    err_o: float
    u: float
    bound: float
    k_d: int
    k_o: int
    rigorous_d: float
    rigorous_o: float
    heuristic: float
    seconds: float

    @property
    def within_bound(self) -> bool:
        """Measured ``d`` error within the specification's bound ``γ_{N-1}``."""
        return self.err_d <= self.bound

    @property
    def within_rigorous(self) -> bool:
        """Measured errors within ``γ_K`` (a theorem for this order: must always hold)."""
        return self.err_d <= self.rigorous_d and self.err_o <= self.rigorous_o


def _fmt_bound(x: float) -> str:
    return "inf (vacuous)" if math.isinf(x) else f"{x:.2e}"


@dataclass(frozen=True)
class NumericsReport:
    """Result of :func:`numerics`: the rows, and the files written (if any)."""
    rows: tuple
    block: int
    width: int
    std: float
    seed: int
    png: str | None = None
    markdown: str | None = None

    @property
    def ok(self) -> bool:
        """No measured error above its bound (the specification's and the rigorous one)."""
        return all(r.within_bound and r.within_rigorous for r in self.rows)

    def worst(self, dtype: str) -> float:
        return max((r.err_d for r in self.rows if r.dtype == dtype), default=math.nan)

    def table(self) -> str:
        """The rows as a Markdown table, with a summary of the fp32/bf16 comparison."""
        head = ("| N | stats | order | rel. err. d | err. o | spec bound γ_{N-1} | "
                "γ_K (K) | √N·u |")
        lines = [head, "|---:|:---|:---|---:|---:|---:|---:|---:|"]
        for r in self.rows:
            lines.append(f"| {r.n:,} | {r.dtype} | {r.order} | {r.err_d:.2e} | {r.err_o:.2e} | "
                         f"{_fmt_bound(r.bound)} | {_fmt_bound(r.rigorous_d)} ({r.k_d:,}) | "
                         f"{r.heuristic:.2e} |")
        lines.append("")
        lines.append(self.summary())
        return "\n".join(lines)

    def summary(self) -> str:
        out = []
        violated = [r for r in self.rows if not (r.within_bound and r.within_rigorous)]
        out.append("bound violated in: " + (", ".join(f"N={r.n} {r.dtype} {r.order}" for r in violated)
                                            if violated else "no configuration"))
        dts = {r.dtype for r in self.rows}
        if {"float32", "bfloat16"} <= dts:
            n = max(r.n for r in self.rows)
            at = {(r.dtype, r.order): r.err_d for r in self.rows if r.n == n}
            parts = [f"{o} {at[('float32', o)]:.1e} vs {at[('bfloat16', o)]:.1e}"
                     for o in ORDERS if ("float32", o) in at and ("bfloat16", o) in at]
            out.append(f"relative error of d at N = {n:,}, fp32 vs bf16 statistics: "
                       + "; ".join(parts) + ": statistics must stay in fp32")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        ns = sorted({r.n for r in self.rows})
        return (f"NumericsReport({len(self.rows)} rows, N {ns[0]:,}..{ns[-1]:,}, "
                f"{'within bounds' if self.ok else 'BOUND VIOLATED'})")

    def plot(self, path: str) -> str:
        """Write the log-log plot (error vs N per dtype and order, bounds as lines) to ``path``."""
        import matplotlib
        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        colors = {"float32": "tab:blue", "bfloat16": "tab:red"}
        markers = {"sequential": "o", "tree": "s", "blocked": "^"}
        fig, axes = plt.subplots(1, 2, figsize=(13, 6.2), sharey=True)
        ns = np.array(sorted({r.n for r in self.rows}), dtype=np.float64)
        grid = np.geomspace(max(ns.min(), 2), ns.max(), 200)
        for ax, what, label in ((axes[0], "err_d", "relative error of d  |d̂ - d| / d"),
                                (axes[1], "err_o", "error of o  max |ô - o| / Σ w|v|")):
            for dt in sorted({r.dtype for r in self.rows}):
                u = UNIT_ROUNDOFF[dt]
                spec = np.array([gamma(int(n) - 1, u) for n in grid])
                spec = np.where(np.isfinite(spec), spec, np.nan)
                ax.plot(grid, spec, "--", color=colors.get(dt, "k"), lw=1.2,
                        label=f"{dt}: bound (N-1)u/(1-(N-1)u)")
                ax.plot(grid, np.sqrt(grid) * u, ":", color=colors.get(dt, "k"), lw=1.2,
                        label=f"{dt}: heuristic √N·u")
                for order in [o for o in ORDERS if any(r.order == o for r in self.rows)]:
                    rs = sorted((r for r in self.rows if r.dtype == dt and r.order == order),
                                key=lambda r: r.n)
                    x = np.array([r.n for r in rs], dtype=np.float64)
                    y = np.array([getattr(r, what) for r in rs])
                    y = np.where(y > 0, y, np.nan)              # exact results: not on a log axis
                    ax.plot(x, y, marker=markers.get(order, "x"), color=colors.get(dt, "k"),
                            lw=1, ms=5, label=f"{dt} stats, {order}")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("N (keys in the row)")
            ax.set_ylabel(label + "  (dimensionless)")
            ax.axhline(1.0, color="0.6", lw=0.8)
            ax.grid(True, which="major", alpha=0.3)
        axes[0].set_title("online softmax: denominator d")
        axes[1].set_title(f"attention: accumulator o (width {self.width})")
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
        fig.suptitle("FlashAttention statistics vs float64: fp32 stays far below the bound, "
                     "bf16 loses the sum (statistics must stay in fp32)", fontsize=10)
        fig.tight_layout(rect=(0, 0.13, 1, 1))
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def _data(n: int, width: int, std: float, seed: int):
    """Scores ~ N(0, std²) on a 1/16 grid within (-8, 8) (bf16-exact differences) and
    bf16-representable values of width ``width``."""
    rng = np.random.default_rng([seed, n])
    s = np.clip(np.rint(16.0 * rng.normal(0.0, std, size=n)), -127, 127) / 16.0
    v = round_to_bits(rng.normal(0.0, 1.0, size=(n, width)), 8)
    return s, v


def _reference(s, v):
    m = s.max()
    w = np.exp(s - m)
    return float(w.sum()), w @ v, w @ np.abs(v)


def _default_ns(max_n: int) -> list[int]:
    ns, k = [], 10
    while k <= max_n:
        ns.append(k)
        if 3 * k <= max_n and k >= 1000:
            ns.append(3 * k)
        k *= 10
    if ns[-1] != max_n:
        ns.append(max_n)
    return ns


def have_matplotlib() -> bool:
    """Whether matplotlib (the ``plot`` extra, needed for the figure only) can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


PLOT_HINT = "pip install 'flashfold[plot]'"


def _int_arg(name: str, x, lo: int) -> int:
    """``x`` as an int ``>= lo`` (Python or NumPy int): ``TypeError`` for another type,
    ``ValueError`` below ``lo``, naming the argument."""
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name}: expected an int >= {lo}, got {type(x).__name__} {x!r}")
    if x < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {x!r}")
    return int(x)


def _positive_arg(name: str, x) -> float:
    """``x`` as a positive finite float (Python or NumPy real): ``TypeError`` for another
    type, ``ValueError`` otherwise, naming the argument."""
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a positive number, got {type(x).__name__}")
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name}: expected a positive finite number, got {x!r}")
    return float(x)


def _names_arg(name: str, names) -> list:
    """``names`` (any iterable, read once) as a non-empty list: ``TypeError`` for a str or
    a non-iterable, ``ValueError`` when empty (no rows would be measured)."""
    if isinstance(names, str):
        raise TypeError(f"{name}: expected a sequence of names, got the str {names!r} "
                        f"(write ({names!r},))")
    try:
        names = list(names)
    except TypeError:
        raise TypeError(f"{name}: expected a sequence of names, got "
                        f"{type(names).__name__}") from None
    if not names:
        raise ValueError(f"{name}: expected at least one name, got none")
    return names


def numerics(max_n: int = 10**7, *, n_values: Sequence[int] | None = None,
             dtypes: Sequence[str] = DTYPES, orders: Sequence[str] = ORDERS, block: int = 128,
             width: int = 2, std: float = 1.0, seed: int = 0, out: str | None = None,
             plot: bool | None = None,
             progress: bool | Callable[[str], None] | None = None) -> NumericsReport:
    """Measure the error of the online-softmax / attention state against float64.

    Parameters
    ----------
    max_n: largest row length (default 10^7); the sizes are 10, 100, ..., with 3x steps
        from 1000 on, up to ``max_n`` (ignored when ``n_values`` is given).
    n_values: explicit row lengths.
    dtypes: statistics formats, one or more of ``"float32"``, ``"bfloat16"``.
    orders: one or more of ``"sequential"``, ``"tree"``, ``"blocked"`` (see the module
        docstring).
    block: tile size of the blocked order (keys per tile).
    width: width of the value vectors (the attention accumulator ``o``).
    std: standard deviation of the scores.
    seed: seed of the data (the same data for every format and order of one ``N``).
    out: a directory (made if needed, before anything is computed); when given,
        ``numerics.md`` (the table) and ``numerics.png`` (the plot) are written there.
    plot: whether to draw ``numerics.png`` into ``out``: ``None`` (default) when
        matplotlib is installed (``report.png`` is None otherwise), ``True`` requires it
        (ImportError before anything is computed), ``False`` writes the table only.
    progress: print one line per configuration (to stderr, or to a callable); default:
        on when ``max(N) >= 10^6``.

    Returns a :class:`NumericsReport`; ``report.ok`` when no measured error exceeds the
    specification's bound ``γ_{N-1}`` nor the rigorous ``γ_K`` of its order.
    """
    ns = None
    if n_values is not None:
        try:
            ns = list(n_values)
        except TypeError:
            raise TypeError(f"n_values: expected a sequence of positive ints, got "
                            f"{type(n_values).__name__} {n_values!r}") from None
    if ns is None:
        if isinstance(max_n, float) and max_n.is_integer():
            max_n = int(max_n)
        if isinstance(max_n, np.integer):
            max_n = int(max_n)
        if not isinstance(max_n, int) or isinstance(max_n, bool) or max_n < 10:
            raise ValueError(f"max_n: expected an int >= 10, got {max_n!r}")
        ns = _default_ns(max_n)
    if not ns or any(not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1 for n in ns):
        raise ValueError(f"n_values: expected positive ints, got {n_values!r}")
    dtypes, orders = _names_arg("dtypes", dtypes), _names_arg("orders", orders)
    for dt in dtypes:
        if not isinstance(dt, str) or dt not in _BITS:
            raise ValueError(f"dtypes: unknown statistics format {dt!r}; expected some of {DTYPES}")
    for o in orders:
        if not isinstance(o, str) or o not in ORDERS:
            raise ValueError(f"orders: unknown order {o!r}; expected some of {ORDERS}")
    block = _int_arg("block", block, 1)
    width = _int_arg("width", width, 1)
    std = _positive_arg("std", std)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"seed: expected an int >= 0, got {seed!r}")
    if plot not in (None, True, False):
        raise TypeError(f"plot: expected None, True or False, got {plot!r}")
    draw = False
    if out is not None:
        if not isinstance(out, (str, os.PathLike)):
            raise TypeError(f"out: expected a directory path, got {type(out).__name__}")
        try:                                        # before computing: fail fast
            os.makedirs(out, exist_ok=True)
        except OSError as e:
            raise ValueError(f"out: cannot make the directory {os.fspath(out)!r}: "
                             f"{e.strerror or e}") from None
        draw = plot is not False and (plot is True or have_matplotlib())
        if plot is True and not have_matplotlib():
            raise ImportError(f"plot: drawing numerics.png needs matplotlib ({PLOT_HINT})")
    if progress is None:
        progress = max(ns) >= 10**6
    say = progress if callable(progress) else (
        (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None))

    rows = []
    total = len(ns) * len(dtypes) * len(orders)
    done = 0
    t_all = time.perf_counter()
    for n in ns:
        n = int(n)
        s, v = _data(n, width, std, seed)
        d_ref, o_ref, scale_o = _reference(s, v)
        for dt in dtypes:
            fmt = _Format(dt)
            for order in orders:
                t0 = time.perf_counter()
                d, o, k_d, k_o = _run_order(order, s, v, fmt, block)
                err_d = abs(d - d_ref) / d_ref
                err_o = float(np.max(np.abs(o - o_ref) / scale_o))
                sec = time.perf_counter() - t0
                u = fmt.u
                rows.append(NumericsRow(n, dt, order, float(err_d), err_o, u, gamma(n - 1, u),
                                        k_d, k_o, gamma(k_d, u), gamma(k_o, u),
                                        math.sqrt(n) * u, sec))
                done += 1
                say(f"numerics [{done}/{total}] N={n:,} {dt:<8} {order:<10} "
                    f"err d {err_d:.2e}  o {err_o:.2e}  ({sec:.1f} s, total "
                    f"{time.perf_counter() - t_all:.0f} s)")
    report = NumericsReport(tuple(rows), block, width, std, seed)
    if out is not None:
        md = os.path.join(out, "numerics.md")
        with open(md, "w") as f:
            f.write("# Online-softmax / attention statistics vs float64\n\n")
            f.write(f"Scores ~ N(0, {std}^2) on a 1/16 grid, values bf16, width {width}, "
                    f"tiles of {block}, seed {seed}. u = 2^-24 (fp32), 2^-8 (bf16).\n\n")
            f.write(report.table() + "\n")
        png = report.plot(os.path.join(out, "numerics.png")) if draw else None
        report = NumericsReport(report.rows, block, width, std, seed, png, md)
    return report


def fp8_error_table(*, n: int = 1024, head_dim: int = 128, heads: int = 4, seed: int = 0,
                    outlier_scale: float = 20.0, outlier_channels: int = 3) -> str:
    """The error of FP8 attention against float64, next to bf16's: a Markdown table.

    Causal attention of ``q, k, v ~ N(0, 1)`` ``(1, heads, n, head_dim)``, and the same
    with ``outlier_channels`` channels of ``q`` and ``k`` scaled by ``outlier_scale`` (as
    in real activations), each quantized as is and after one random orthogonal rotation
    of ``q`` and ``k`` (:func:`random_rotation`). Columns: RMS and max absolute error of
    the output against the float64 attention of the unquantized inputs, for flashfold in
    bf16 (inputs rounded to bf16), flashfold in FP8 (:func:`quantize_fp8`, per (batch, KV
    head) factors, ``P`` in E4M3) and a naive FP8 attention (dequantize to bf16, bf16
    matmuls, softmax in fp32), and FP8's max error over the naive one's. CPU, a few
    seconds. ``n``, ``head_dim``, ``heads``: ints >= 1; ``outlier_channels``: 0 to
    ``head_dim``; ``outlier_scale``: finite, > 0 (``TypeError`` / ``ValueError`` naming the
    argument otherwise)."""
    n, head_dim, heads = (_int_arg(a, x, 1) for a, x in
                          (("n", n), ("head_dim", head_dim), ("heads", heads)))
    seed = _int_arg("seed", seed, 0)
    outlier_channels = _int_arg("outlier_channels", outlier_channels, 0)
    if outlier_channels > head_dim:
        raise ValueError(f"outlier_channels: expected at most head_dim = {head_dim}, got "
                         f"{outlier_channels}")
    outlier_scale = _positive_arg("outlier_scale", outlier_scale)
    import torch

    from .api.attention import attention
    from .api.fp8 import quantize_fp8, random_rotation
    from .kernels.attention.reference import dequantize_fp8, naive_attention

    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(1, heads, n, head_dim, generator=g, dtype=torch.float64)
            for _ in range(3)]
    rot = random_rotation(head_dim, seed=seed, dtype=torch.float64)
    rows = []
    for kind in ("random", "outliers"):
        q, k, v = (t.clone() for t in base)
        if kind == "outliers":
            q[..., :outlier_channels] *= outlier_scale
            k[..., :outlier_channels] *= outlier_scale
        truth = naive_attention(q, k, v, causal=True, dtype=torch.float64)[0]

        def errs(o):
            d = (o.double() - truth)
            return d.pow(2).mean().sqrt().item(), d.abs().max().item()
        bf16 = errs(attention(*(t.to(torch.bfloat16) for t in (q, k, v)), causal=True))
        for rotated in (False, True):
            qq, kk = (q @ rot, k @ rot) if rotated else (q, k)
            (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(t.float()) for t in (qq, kk, v))
            fp8 = errs(attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                 causal=True))
            x = [dequantize_fp8(t, d, heads).to(torch.bfloat16)
                 for t, d in ((q8, qd), (k8, kd), (v8, vd))]
            s = (x[0] @ x[1].transpose(-1, -2)).float() / math.sqrt(head_dim)
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
            naive = errs(torch.softmax(s, -1).to(torch.bfloat16) @ x[2])
            rows.append((kind, "yes" if rotated else "no", bf16, fp8, naive))
    head = ("| inputs | q, k rotated | bf16 RMS | bf16 max | FP8 RMS | FP8 max | naive FP8 RMS "
            "| naive FP8 max | FP8 max / naive |\n|---|---|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for kind, rotated, b, f, nv in rows:
        lines.append(f"| {kind} | {rotated} | {b[0]:.2e} | {b[1]:.2e} | {f[0]:.2e} | "
                     f"{f[1]:.2e} | {nv[0]:.2e} | {nv[1]:.2e} | {f[1] / nv[1]:.2f} |")
    return (f"FP8 (E4M3) attention against float64, next to bf16: causal, 1 x {heads} heads "
            f"x {n} x {head_dim}, seed {seed}; outliers: {outlier_channels} channels of q "
            f"and k x {outlier_scale:g}. flashfold does not rotate by default (the caller "
            f"rotates q and k with one orthogonal matrix before quantize_fp8).\n\n"
            + "\n".join(lines) + "\n")


__all__ = ["numerics", "fp8_error_table", "NumericsReport", "NumericsRow", "gamma", "round_to_bits",
           "UNIT_ROUNDOFF", "ORDERS", "DTYPES"]
