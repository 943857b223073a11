"""Rescale twists read off a combine, and the tile step derived from them
(``flashfold.algebra.twist``), against the monoid's own fold in float64.

The tile step is what every FlashAttention-style kernel inlines (the Triton forward, the
split-KV decode, the Gluon forward): ``S ⊕ lift(x_1) ⊕ ... ⊕ lift(x_n)`` in one pass at
the common reference. Its outputs must equal the sequential fold on every input the
kernels see: masked scores (``-inf``), rows with nothing visible, ``+inf`` and NaN
scores, empty and NaN states.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from flashfold import Field, Input, Monoid, ops
from flashfold.algebra.evaluate import numpy_monoid
from flashfold.algebra.ir import Var, trace
from flashfold.algebra.lower import compile_graph
from flashfold.algebra.rewrite import assume_above_minus_inf, hoist_uniform
from flashfold.algebra.twist import rescale_twist, tile_step, tile_weights
from flashfold.monoids import (ARGMAX, ATTENTION, ATTENTION2, LOGSUMEXP, LOGSUMEXP2, MAX, SUM,
                               WELFORD)


# --- the twist, read off the combine -------------------------------------------------------

@pytest.mark.parametrize("monoid, linear, base", [
    (ATTENTION, ("d", "o"), "exp"), (ATTENTION2, ("d", "o"), "exp2"),
    (LOGSUMEXP, ("d",), "exp"), (LOGSUMEXP2, ("d",), "exp2")], ids=lambda x: getattr(x, "name", ""))
def test_rescale_twist_of_the_softmax_family(monoid, linear, base):
    tw = rescale_twist(monoid)
    assert tw.ref == "m" and tw.linear == linear
    g = compile_graph(tw.factor, "numpy")
    m = np.array([-math.inf, -3.0, 0.5, 2.0])
    r = np.array([2.0, 2.0, 2.0, 2.0])
    (got,) = g(m, r)
    want = (np.exp if base == "exp" else np.exp2)(m - 2.0)
    np.testing.assert_allclose(got, want, rtol=1e-15)
    (empty,) = g(np.array([-math.inf]), np.array([-math.inf]))      # the finite pivot
    assert empty[0] == 0.0


@pytest.mark.parametrize("monoid", [SUM, WELFORD, ARGMAX, MAX], ids=lambda m: m.name)
def test_other_monoids_are_not_rescale_twists(monoid):
    with pytest.raises(ValueError, match="not a rescale twist"):
        rescale_twist(monoid)


def test_factors_must_be_one_function_of_each_side():
    """``b`` rescaled by a factor of ``a``'s max: not the twist's shape."""
    bad = Monoid("lopsided", fields=("m", "d"), identity=(-ops.inf, 0.0),
                 lift=lambda x: (x, 1.0),
                 combine=lambda a, b: (ops.maximum(a.m, b.m),
                                       a.d * ops.exp(a.m - ops.maximum(a.m, b.m))
                                       + b.d * ops.exp(a.m - ops.maximum(a.m, b.m))))
    with pytest.raises(ValueError, match="not one function"):
        rescale_twist(bad)


def test_a_vector_field_must_be_linear_in_its_input():
    squared = Monoid("squares", fields=("m", "d", Field("o", vector=True)),
                     identity=(-ops.inf, 0.0, 0.0), inputs=("s", Input("v", vector=True)),
                     lift=lambda s, v: (s, 1.0, v * v),
                     combine=lambda a, b: ATTENTION.combine(a, b))
    rescale_twist(squared)                      # the combine is the twist's
    with pytest.raises(ValueError, match="not linear"):
        tile_step(squared)


# --- the derived step is the hand-scheduled FlashAttention step -------------------------------

def test_attention2_step_is_flashattentions():
    """After the generic rewrites the step has exactly the hand-written step's work: the
    row max on the raw scores times ``scale log2 e`` (one multiply per row), one FMA and
    one exp2 per score, one exp2 per row, no select per score."""
    st = tile_step(ATTENTION2, scale="score")
    g = st.graph
    ops_ = [n.op for n in g.nodes()]
    assert ops_.count("exp2") == 2 and ops_.count("rmax") == 1 and ops_.count("rsum") == 1
    assert "gt" not in ops_ and "isnan" not in ops_
    rmax = next(n for n in g.nodes() if n.op == "rmax")
    assert rmax.args[0].op == "var" and rmax.args[0].attr == "score"
    assert st.state == ("m", "d") and st.tile == ("score",) and st.uniform == ("scale",)
    assert st.contract == (("o", "value"),)


def _fold_reference(monoid, m, d, o, scores, values):
    """The sequential fold ``S ⊕ lift(x_1) ⊕ ... ⊕ lift(x_n)`` of each row, float64."""
    nm = numpy_monoid(monoid)
    state = (m, d, o) if o is not None else (m, d)
    width = None if o is None else o.shape[1]
    for j in range(scores.shape[1]):
        x = [scores[:, j]] + ([np.broadcast_to(values[j], o.shape)] if o is not None else [])
        state = nm.combine(state, nm.lift(x, width))
    return state


def _special_rows(rng, rows, cols):
    s = rng.normal(size=(rows, cols)) * 3
    s[0] = -math.inf                            # nothing visible
    s[1, ::2] = -math.inf                       # masked keys
    s[2, 3] = math.nan                          # a NaN score
    s[3, 1] = math.inf                          # a +inf score
    s[4, :] = 40.0                              # ties at a large score
    return s


@pytest.mark.parametrize("monoid", [ATTENTION, ATTENTION2], ids=lambda m: m.name)
@pytest.mark.parametrize("scale", [1.0, 0.125, 7.0])
def test_attention_step_equals_the_fold(monoid, scale):
    rng = np.random.default_rng(0)
    rows, cols, width = 12, 9, 3
    x = _special_rows(rng, rows, cols)
    v = rng.normal(size=(cols, width))
    m = rng.normal(size=rows) * 2
    m[[0, 5]] = -math.inf                       # empty running states
    m[6] = math.nan                             # a NaN state
    d = np.where(m == -math.inf, 0.0, rng.uniform(0.5, 3.0, size=rows))
    o = np.where((m == -math.inf)[:, None], 0.0, rng.normal(size=(rows, width)))
    st = tile_step(monoid, scale="score")
    fn = compile_graph(st.graph, "numpy")       # NumPy lowering: the block axis leads
    with np.errstate(all="ignore"):
        m2, d2, alpha, p = fn(m, d, x.T, np.float64(scale))
        o2 = alpha[:, None] * o + p.T @ v
    rm, rd, ro = _fold_reference(monoid, m, d, o, x * scale, v)
    for got, want, name in ((m2, rm, "m"), (d2, rd, "d"), (o2, ro, "o")):
        assert np.array_equal(np.isnan(got), np.isnan(want)), name
        ok = ~np.isnan(want)
        np.testing.assert_allclose(got[ok], want[ok], rtol=1e-12, atol=1e-300, err_msg=name)
    assert m2[0] == -math.inf and d2[0] == 0.0 and np.all(o2[0] == 0.0)    # nothing visible


@pytest.mark.parametrize("monoid, base", [(ATTENTION, math.e), (ATTENTION2, 2.0)],
                         ids=lambda x: getattr(x, "name", ""))
@pytest.mark.parametrize("shift", [math.log2(448.0), -3.5])
def test_shifted_step_is_the_state_re_referenced(monoid, base, shift):
    """With a reference shift ``s`` the step keeps the running max and returns every
    linear field and weight times ``b^s``: fed states in those units, its outputs are the
    fold's times ``b^s``, and finalizing at ``m - s`` gives the plain finalize. The shift
    costs one subtraction per row, no operation per element."""
    rng = np.random.default_rng(2)
    rows, cols, width = 12, 9, 3
    x = _special_rows(rng, rows, cols)
    v = rng.normal(size=(cols, width))
    m = rng.normal(size=rows) * 2
    m[[0, 5]] = -math.inf
    m[6] = math.nan
    d = np.where(m == -math.inf, 0.0, rng.uniform(0.5, 3.0, size=rows))
    o = np.where((m == -math.inf)[:, None], 0.0, rng.normal(size=(rows, width)))
    c = base ** shift
    st = tile_step(monoid, scale="score", shift=True)
    assert st.uniform == ("scale", "shift")
    with np.errstate(all="ignore"):
        m2, d2, alpha, p = compile_graph(st.graph, "numpy")(m, c * d, x.T, np.float64(0.125),
                                                            np.float64(shift))
        o2 = alpha[:, None] * (c * o) + p.T @ v
    rm, rd, ro = _fold_reference(monoid, m, d, o, x * 0.125, v)
    for got, want, name in ((m2, rm, "m"), (d2, c * rd, "d"), (o2, c * ro, "o")):
        assert np.array_equal(np.isnan(got), np.isnan(want)), name
        ok = ~np.isnan(want)
        np.testing.assert_allclose(got[ok], want[ok], rtol=1e-12, atol=1e-300, err_msg=name)
    fin = numpy_monoid(monoid).finalize
    with np.errstate(all="ignore"):
        got = fin((m2 - shift, d2, o2))
        want = fin((rm, rd, ro))
    for g_, w_ in zip(got, want):
        assert np.array_equal(np.isnan(g_), np.isnan(w_))
        ok = ~np.isnan(w_)
        np.testing.assert_allclose(g_[ok], w_[ok], rtol=1e-12)
    plain = [n.op for n in tile_step(monoid, scale="score").graph.nodes()]
    shifted = [n.op for n in st.graph.nodes()]
    assert shifted.count("exp2" if base == 2.0 else "exp") == plain.count(
        "exp2" if base == 2.0 else "exp") and shifted.count("mul") == plain.count("mul")


def test_shift_needs_an_exponential_factor():
    """``g(m, r) = 1 / (1 + r - m)`` rebases like a twist but a shifted reference does not
    scale it by a constant."""
    def g(m, r):
        return 1.0 / (1.0 + r - m)
    odd = Monoid("harmonic", fields=("m", "d"), identity=(-ops.inf, 0.0),
                 lift=lambda x: (x, 1.0),
                 combine=lambda a, b: (ops.maximum(a.m, b.m),
                                       a.d * g(a.m, ops.maximum(a.m, b.m))
                                       + b.d * g(b.m, ops.maximum(a.m, b.m))))
    rescale_twist(odd)                          # the combine has the twist's shape
    tile_step(odd)
    with pytest.raises(ValueError, match="shift needs an exponential factor"):
        tile_step(odd, shift=True)


@pytest.mark.parametrize("monoid", [LOGSUMEXP, LOGSUMEXP2], ids=lambda m: m.name)
def test_logsumexp_step_equals_the_fold(monoid):
    rng = np.random.default_rng(1)
    x = _special_rows(rng, 10, 7)
    m = rng.normal(size=10)
    m[[0, 7]] = -math.inf
    d = np.where(m == -math.inf, 0.0, 1.5)
    st = tile_step(monoid, scale="x")
    with np.errstate(all="ignore"):
        m2, d2, _ = compile_graph(st.graph, "numpy")(m, d, x.T, np.float64(0.5))
    rm, rd = _fold_reference(monoid, m, d, None, x * 0.5, None)
    for got, want in ((m2, rm), (d2, rd)):
        assert np.array_equal(np.isnan(got), np.isnan(want))
        ok = ~np.isnan(want)
        np.testing.assert_allclose(got[ok], want[ok], rtol=1e-12)


def test_step_without_scale_takes_the_scores_as_they_are():
    st = tile_step(ATTENTION2)
    assert st.uniform == () and [v.name for v in st.graph.inputs] == ["m", "d", "score"]


@pytest.mark.parametrize("monoid", [ATTENTION, ATTENTION2], ids=lambda m: m.name)
@pytest.mark.parametrize("assume", [False, True])
def test_weights_against_the_final_state_are_the_softmax(monoid, assume):
    """``tile_weights`` against a row's log-normalizer (the backward's lambda: ``lse`` in
    the factor's base, ``+inf`` for a row without keys) gives each element's share of the
    finished row, ``P_j = e^(s_j - lse)``: summed over a row, 1; the same value as the
    fold's ``g(lift_m, m) / d``; 0 for hidden scores and for rows without keys; NaN only
    in a row whose normalizer is NaN (a NaN score makes it so)."""
    rng = np.random.default_rng(3)
    x = _special_rows(rng, 8, 11)[:, :]
    x[2, 3] = 0.5                                # (NaN below, on its own row)
    x[3, 1] = 1.0
    x[5, 4] = math.nan
    scale = 0.3
    w = tile_weights(monoid, scale="score", reference_above_minus_inf=assume)
    assert w.fields == ("d", "o") and w.tile == ("score",) and w.uniform == ("scale",)
    ops_ = [n.op for n in w.graph.nodes()]
    assert ("where" in ops_) is (not assume)     # the pivot's select, gone under the fact
    s = x * scale
    with np.errstate(all="ignore"):
        top = np.max(np.where(np.isnan(s), -math.inf, s), axis=1, keepdims=True)
        lse = top + np.log(np.sum(np.exp(s - top), axis=1, keepdims=True))
        lse[0] = -math.inf                       # row 0: every score hidden
        base = 2.0 if monoid is ATTENTION2 else math.e
        ref = np.where(lse == -math.inf, math.inf, lse / math.log(base))
        p, p_o = compile_graph(w.graph, "numpy")(ref.T, x.T, np.float64(scale))
    p = p.T
    assert np.array_equal(p, p_o.T, equal_nan=True)
    assert np.all(p[0] == 0.0) and np.all(p[1, ::2] == 0.0)
    assert np.isnan(p[5]).all() and not np.isnan(np.delete(p, 5, axis=0)).any()
    with np.errstate(all="ignore"):
        want = np.exp(s - lse)
    ok = (lse != -math.inf)[:, 0]
    ok[5] = False
    np.testing.assert_allclose(p[ok], want[ok], rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(p[ok].sum(1), 1.0, rtol=1e-12)


def test_step_arguments_are_checked():
    """A flag given as a string was truthy: ``reference_above_minus_inf="no"`` dropped the
    pivot's select (wrong weights for a ``-inf`` reference) and ``shift="no"`` added a
    shift argument; a monoid that is not one failed deep inside with an AttributeError."""
    with pytest.raises(TypeError, match="^reference_above_minus_inf: expected a bool"):
        tile_weights(ATTENTION2, reference_above_minus_inf="no")
    with pytest.raises(TypeError, match="^shift: expected a bool"):
        tile_step(ATTENTION2, shift="no")
    with pytest.raises(TypeError, match="^scale: expected an input name"):
        tile_step(ATTENTION2, scale=0.5)
    for fn in (rescale_twist, tile_step, tile_weights):
        with pytest.raises(TypeError, match="^monoid: expected a flashfold Monoid, got str"):
            fn("attention")


# --- the generic rewrites ------------------------------------------------------------------

def _graph(fn, names):
    return trace(fn, [Var(n) for n in names], "g")


def test_hoist_uniform_pulls_a_positive_scale_out_of_the_row_max():
    g = _graph(lambda x, c: ops.reduce_max(x * c * 2.0), ["x", "c"])
    h = hoist_uniform(g, uniform=["c"], positive=["c"])
    (out,) = h.outputs
    assert out.op == "mul" and out.args[0].op == "rmax" and out.args[0].args[0].op == "var"
    x = np.array([[1.0, -3.0, 2.0], [-1.0, math.nan, 0.5]]).T
    for c in (0.25, 3.0):
        np.testing.assert_array_equal(compile_graph(h, "numpy")(x, c)[0],
                                      compile_graph(g, "numpy")(x, c)[0])


def test_hoist_uniform_keeps_a_scale_of_unknown_sign_inside():
    """max(x c) = max(x) c only for c > 0: without the fact, the reduction stays."""
    g = _graph(lambda x, c: ops.reduce_max(x * c), ["x", "c"])
    h = hoist_uniform(g, uniform=["c"])
    assert h.outputs[0].op == "rmax"
    x = np.array([1.0, -3.0, 2.0])
    assert compile_graph(h, "numpy")(x, -1.0)[0] == 3.0


def test_hoist_uniform_multiplies_uniform_factors_first():
    g = _graph(lambda x, c: ops.exp2(x * c * 1.5 - 1.0), ["x", "c"])
    h = hoist_uniform(g, uniform=["c"])
    text = h.text()
    assert "mul(c, 1.5)" in text and "mul(x, t0)" in text, text


def test_rewrites_refuse_a_string_of_names():
    """A single name given as a string was read as its characters, which name no input:
    ``assume_above_minus_inf(g, "ref")`` silently left the graph unchanged."""
    g = _graph(lambda r, x: ops.where(r == -ops.inf, 0.0, r) + x, ["ref", "x"])
    with pytest.raises(TypeError, match="^names: expected a sequence of input names, got str"):
        assume_above_minus_inf(g, "ref")
    with pytest.raises(TypeError, match="^uniform: expected a sequence of input names, got str"):
        hoist_uniform(g, uniform="x")
    with pytest.raises(TypeError, match="^positive: expected a sequence of input names"):
        hoist_uniform(g, positive=[1.0])
    with pytest.raises(TypeError, match="^graph: expected a traced flashfold Graph"):
        hoist_uniform(None)
    assert "where" not in [n.op for n in assume_above_minus_inf(g, ("ref",)).nodes()]


def test_assume_above_minus_inf_drops_the_pivot_only_for_named_inputs():
    g = _graph(lambda m, r: ops.exp2(m - ops.where(r == -math.inf, 0.0, r)), ["m", "r"])
    h = assume_above_minus_inf(g, ["r"])
    assert [n.op for n in h.nodes() if n.op not in ("var", "const")] == ["sub", "exp2"]
    assert assume_above_minus_inf(g, ["m"]).text() == g.text()
    fn, fh = compile_graph(g, "numpy"), compile_graph(h, "numpy")
    for r in (math.inf, 2.0, -1e300, math.nan):          # every value but -inf: the same
        with np.errstate(all="ignore"):
            a, b = fn(np.float64(1.5), np.float64(r))[0], fh(np.float64(1.5), np.float64(r))[0]
        assert (a == b) or (np.isnan(a) and np.isnan(b)), r


# --- lowering: the kernels' tile convention -------------------------------------------------

def test_generated_step_source_broadcasts_rows_against_the_tile():
    from flashfold.kernels.codegen import tile_step_functions
    fns = tile_step_functions(ATTENTION2, scale="score")
    src = fns.source
    assert "def tile_step(m, d, score, scale):" in src
    assert "tl.reduce(score, 1, _max_nan)" in src and "axis=1" in src
    step = src.split("def finalize_rows")[0]
    assert "[:, None]" in step and step.count("tl.exp2(") == 2
    assert "def finalize_rows(m, d, o):" in src
    # the backward's weights: one FMA and one exp2 per score, no select, no broadcast of
    # the reference (the caller passes it broadcastable, transposed tiles included)
    weights = src.split("def tile_weights(ref, score, scale):")[1]
    assert weights.count("tl.exp2(") == 1 and "where" not in weights and "None]" not in weights
    g = tile_step_functions(ATTENTION2, scale="score", gluon=True).source
    assert "@gluon.jit" in g and "gl.reduce(score, 1, _max_nan)" in g and "tl.exp2" not in g
