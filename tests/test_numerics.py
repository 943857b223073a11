"""numerics(): measured error of the softmax/attention state vs float64, next to the bound.

The vectorized emulation of fp32/bf16 statistics is first checked bit for bit against
plain scalar loops; then the experiment runs at small N on the CPU.
"""

import math
import os

import numpy as np
import pytest

import flashfold as ff
from flashfold.cli import main
from flashfold.error_analysis import (UNIT_ROUNDOFF, _data, _Format, _run_order, _seq_sum_lowp,
                                gamma, round_to_bits)

BITS = {"float32": 24, "bfloat16": 8}


def rnd(x: float, bits: int) -> float:
    """Round to nearest even with ``bits`` significand bits (independent of the module)."""
    if x == 0 or not math.isfinite(x):
        return x
    m, e = math.frexp(x)
    return math.ldexp(round(m * 2**bits) / 2**bits, e)


def test_rounding_is_round_to_nearest_even():
    rng = np.random.default_rng(0)
    x = rng.normal(size=5000) * np.exp(rng.normal(size=5000) * 8)
    assert np.array_equal(round_to_bits(x, 24), x.astype(np.float32).astype(np.float64))
    assert all(round_to_bits(np.array([v]), 8)[0] == rnd(v, 8) for v in x[:2000])
    ties = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 257.0, 259.0])
    assert round_to_bits(ties, 8).tolist() == [1.0, 1.015625, -1.0, 256.0, 260.0]


def test_rounding_keeps_every_nan_a_nan():
    """Rounding adds to the bit pattern: a NaN whose payload carries out of its bits must
    stay NaN (not 0, -0 or inf), as float32 and bfloat16 conversions keep it."""
    bits = np.array([0x7FFFFFFFFFFFFFFF, -1, 0x7FF0000000000001, 0x7FFFF00000000000,
                     0x7FF8000000000000], dtype=np.int64)
    nans = bits.view(np.float64)
    assert np.isnan(nans).all()
    for b in (1, 8, 24, 52):
        assert np.isnan(round_to_bits(nans, b)).all(), b
    assert np.isnan(round_to_bits(nans[0], 8))


def test_rounding_takes_bits_from_1_to_53_and_names_others():
    x = np.array([1 / 3, -2.5e-300, 7.0])
    assert np.array_equal(round_to_bits(x, 53), x)               # float64 itself: exact
    assert round_to_bits(np.array([1.75]), 1).tolist() == [2.0]
    for bits in (0, -3, 54, 60):
        with pytest.raises(ValueError, match="^bits: expected an int in 1..53"):
            round_to_bits(x, bits)
    for bits in (8.0, True, None):
        with pytest.raises(TypeError, match="^bits: expected an int in 1..53"):
            round_to_bits(x, bits)


@pytest.mark.parametrize("kind", ["positive", "signed", "ties"])
def test_sequential_bf16_sum_is_bit_exact(kind):
    rng = np.random.default_rng({"positive": 1, "signed": 2, "ties": 3}[kind])
    fmt = _Format("bfloat16")
    for _ in range(40):
        n = int(rng.integers(1, 2500))
        if kind == "positive":
            t = round_to_bits(np.exp(rng.normal(-3.0, 1.0, size=n)), 8)
        elif kind == "signed":
            t = round_to_bits(rng.normal(0.0, 1.0, size=n), 8)
        else:
            t = rng.integers(-4, 5, size=n) / 4.0
        acc0 = rnd(float(rng.normal()), 8)
        acc = acc0
        for x in t:
            acc = rnd(acc + float(x), 8)
        assert _seq_sum_lowp(acc0, t, fmt) == acc


def _scalar_merge(a, b, bits):
    """The online merge of two states with every operation rounded (scalar reference)."""
    (ma, da, oa), (mb, db, ob) = a, b
    m = max(ma, mb)
    fa = 1.0 if ma == m else rnd(math.exp(ma - m), bits)
    fb = 1.0 if mb == m else rnd(math.exp(mb - m), bits)
    d = rnd(rnd(da * fa, bits) + rnd(db * fb, bits), bits)
    o = [rnd(rnd(x * fa, bits) + rnd(y * fb, bits), bits) for x, y in zip(oa, ob)]
    return m, d, o


def _scalar_sequential(s, v, bits):
    st = (s[0], 1.0, list(v[0]))
    for k in range(1, len(s)):
        st = _scalar_merge(st, (s[k], 1.0, list(v[k])), bits)
    return st


def _scalar_tree(states, bits):
    while len(states) > 1:
        nxt = [_scalar_merge(states[i], states[i + 1], bits) for i in range(0, len(states) - 1, 2)]
        if len(states) % 2:
            nxt.append(states[-1])
        states = nxt
    return states[0]


def _scalar_blocked(s, v, bits, block):
    tiles = []
    for start in range(0, len(s), block):
        ts, tv = s[start:start + block], v[start:start + block]
        mt = max(ts)
        p = [rnd(math.exp(x - mt), bits) for x in ts]
        dsum = _scalar_tree([(0.0, x, []) for x in p], bits)[1]      # tree sum of the weights
        cols = []
        for j in range(v.shape[1]):
            terms = [(0.0, rnd(pi * float(vi[j]), bits), []) for pi, vi in zip(p, tv)]
            cols.append(_scalar_tree(terms, bits)[1])
        tiles.append((mt, dsum, cols))
    st = tiles[0]
    for t in tiles[1:]:
        st = _scalar_merge(st, t, bits)
    return st


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [1, 2, 7, 130, 600])
def test_vectorized_orders_are_bit_exact(dtype, n):
    s, v = _data(n, 2, 1.0, 5)
    fmt, bits = _Format(dtype), BITS[dtype]
    want = {
        "sequential": _scalar_sequential(s, v, bits),
        "tree": _scalar_tree([(s[k], 1.0, list(v[k])) for k in range(n)], bits),
        "blocked": _scalar_blocked(s, v, bits, 64),
    }
    for order, (_, d_ref, o_ref) in want.items():
        d, o, k_d, k_o = _run_order(order, s, v, fmt, 64)
        assert d == d_ref, order
        assert np.array_equal(o, np.array(o_ref)), order
        assert k_d >= 0 and k_o >= k_d


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("numerics")
    return ff.numerics(n_values=[10, 100, 1000, 10_000, 30_000], out=str(out), progress=False)


def test_the_bound_is_never_violated(report):
    assert len(report.rows) == 5 * 2 * 3
    for r in report.rows:
        where = f"N={r.n} {r.dtype} {r.order}"
        assert r.bound == gamma(r.n - 1, UNIT_ROUNDOFF[r.dtype])
        assert r.err_d <= r.bound, where                  # the specification's (N-1)u/(1-(N-1)u)
        assert r.err_d <= r.rigorous_d, where             # γ_K with every rounding counted
        assert r.err_o <= r.rigorous_o, where
        assert r.err_d > 0 or r.n <= 10                   # a measurement, not a tautology
    assert report.ok and "no configuration" in report.summary()


def test_bf16_statistics_are_clearly_worse_than_fp32(report):
    """The specification: d is a long sum of terms in (0, 1] and loses low bits fast in a
    narrow format, so the statistics must stay in fp32."""
    rows = {(r.n, r.dtype, r.order): r for r in report.rows}
    for n in (100, 1000, 10_000, 30_000):
        for order in ("sequential", "tree", "blocked"):
            f32, b16 = rows[(n, "float32", order)], rows[(n, "bfloat16", order)]
            assert b16.err_d > 100 * f32.err_d, (n, order)
            assert f32.err_d < 1e-4
    assert rows[(10_000, "bfloat16", "sequential")].err_d > 0.5    # most of the sum is lost
    assert rows[(30_000, "float32", "tree")].err_d < rows[(30_000, "float32", "sequential")].err_d


def test_table_and_plot_are_written(report):
    assert report.png and os.path.getsize(report.png) > 20_000
    with open(report.png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    text = open(report.markdown).read()
    assert "| N | stats | order | rel. err. d |" in text
    assert "inf (vacuous)" in text                        # bf16: (N-1)u >= 1 from N = 257 on
    assert "statistics must stay in fp32" in text
    assert "| 30,000 | float32 | blocked |" in str(report)


def test_cli_numerics(tmp_path, capsys):
    assert main(["numerics", "--max-n", "1e3", "--out", str(tmp_path), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "| 1,000 | bfloat16 | sequential |" in out
    assert (tmp_path / "numerics.png").exists() and (tmp_path / "numerics.md").exists()
    # FP8 attention's error next to bf16's, random and outlier-heavy, rotated or not
    fp8 = (tmp_path / "fp8.md").read_text()
    rows = [line.split("|") for line in fp8.splitlines() if line.startswith("| random")
            or line.startswith("| outliers")]
    assert len(rows) == 4 and "does not rotate by default" in fp8 and "| outliers | yes |" in out
    for cells in rows:
        bf16_rms, fp8_rms, ratio = float(cells[3]), float(cells[5]), float(cells[9])
        assert bf16_rms < fp8_rms and ratio <= 2.0, cells      # the yardstick
    # rotating q and k lowers the error of outlier-heavy inputs
    out_rows = {c[2].strip(): float(c[5]) for c in rows if c[1].strip() == "outliers"}
    assert out_rows["yes"] < out_rows["no"]


def test_progress_lines():
    lines = []
    ff.numerics(n_values=[50], dtypes=("float32",), orders=("tree",), progress=lines.append)
    assert len(lines) == 1 and "N=50 float32" in lines[0]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="dtypes"):
        ff.numerics(n_values=[10], dtypes=("float16",))
    with pytest.raises(ValueError, match="orders"):
        ff.numerics(n_values=[10], orders=("random",))
    with pytest.raises(ValueError, match="max_n"):
        ff.numerics(5)
    with pytest.raises(ValueError, match="n_values"):
        ff.numerics(n_values=[0])
    with pytest.raises(ValueError, match="block"):
        ff.numerics(n_values=[10], block=0)


def test_the_lazy_top_level_name_is_the_function(tmp_path):
    import subprocess
    import sys
    code = ("import flashfold as ff; r = ff.numerics(n_values=[10], dtypes=('float32',), "
            "orders=('tree',)); print(type(r).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "NumericsReport", out.stderr


def test_dtypes_and_orders_are_nonempty_sequences_of_names():
    """No format or no order would give a report without rows (``ok`` vacuously); a
    generator is read once, not exhausted by the checks; others are named."""
    for kw in ({"dtypes": ()}, {"orders": []}):
        with pytest.raises(ValueError, match=f"^{next(iter(kw))}: expected at least one"):
            ff.numerics(n_values=[10], **kw)
    for kw in ({"dtypes": None}, {"orders": 3}):
        with pytest.raises(TypeError, match=f"^{next(iter(kw))}: expected a sequence"):
            ff.numerics(n_values=[10], **kw)
    with pytest.raises(ValueError, match="^dtypes: unknown statistics format"):
        ff.numerics(n_values=[10], dtypes=[["float32"]])
    r = ff.numerics(n_values=[10], dtypes=(d for d in ["float32"]),
                    orders=(o for o in ["tree", "blocked"]))
    assert [(x.dtype, x.order) for x in r.rows] == [("float32", "tree"), ("float32", "blocked")]


def test_max_n_takes_numpy_ints_and_n_values_must_be_a_sequence():
    r = ff.numerics(np.int64(10), dtypes=("float32",), orders=("tree",))
    assert [x.n for x in r.rows] == [10]
    with pytest.raises(TypeError, match="^n_values: expected a sequence of positive ints"):
        ff.numerics(n_values=10)
