"""flashfold.algebra.autodiff: derivatives of traced graphs against torch.autograd of the same
graph's torch lowering (float64), finite differences of the NumPy lowering, structural zeros,
the kink conventions, tables, errors, and the Triton lowering under the interpreter."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flashfold import mods
from flashfold.algebra import ops
from flashfold.algebra.autodiff import SUPPORTED, derivative
from flashfold.algebra.ir import Buffer, Var, trace
from flashfold.algebra.lower import compile_graph
from flashfold.kernels import torch_lower  # noqa: F401  (registers the torch backend)
from flashfold.kernels.attention.mods import trace_score_mod
from flashfold.testing import assert_close

S, X, I = Var("s"), Var("x"), Var("i")

# (name, f(s, x, i), domain of s): every op with a rule appears at least once
EXPRESSIONS = [
    ("affine", lambda s, x, i: 3.0 * s - x / 2.0 + 1.0, (-3, 3)),
    ("neg-mul-div", lambda s, x, i: -(s * x) / (s * s + 1.0), (-3, 3)),
    ("exp-exp2", lambda s, x, i: ops.exp(s * 0.5) + ops.exp2(-s), (-3, 3)),
    ("log-log2-log1p", lambda s, x, i: ops.log(s) + ops.log2(s * 3.0) + ops.log1p(s * s), (0.1, 4)),
    ("expm1-sqrt", lambda s, x, i: ops.expm1(s) * ops.sqrt(s + 4.0), (-3, 3)),
    ("tanh-sigmoid", lambda s, x, i: 2.0 * ops.tanh(s / 2.0) + ops.sigmoid(s * x), (-3, 3)),
    ("softcap", lambda s, x, i: ops.softcap(s, 1.5), (-4, 4)),
    ("abs", lambda s, x, i: ops.abs(s - 0.25) * x, (-3, 3)),
    ("pow-const-exponent", lambda s, x, i: (s + 4.0) ** 1.5 + s ** 2, (-3, 3)),
    ("pow-variable-exponent", lambda s, x, i: ops.pow(x + 2.0, s), (-2, 2)),
    ("maximum-minimum", lambda s, x, i: ops.maximum(s, x) + ops.minimum(s * 2.0, 1.0), (-3, 3)),
    ("clamp", lambda s, x, i: ops.clamp(s, -1.0, 2.0) * 3.0, (-3, 3)),
    ("where", lambda s, x, i: ops.where(s > x, s * s, ops.exp(s)), (-3, 3)),
    ("mod", lambda s, x, i: (s * 3.0) % 2.5, (0.1, 3)),
    ("integer-index-terms", lambda s, x, i: s + ops.to_float(i * 2 - 1) * 0.5 + ops.to_float(i // 2), (-3, 3)),
    ("floor-and-booleans", lambda s, x, i: s * ops.floor(x) + ops.where((s > 0) & ~(x > 1), s, 0.0), (-3, 3)),
]


def _grid(lo, hi, n=29):
    s = torch.linspace(lo, hi, n, dtype=torch.float64)
    x = torch.linspace(-1.3, 1.7, n, dtype=torch.float64)[torch.randperm(n, generator=torch.Generator().manual_seed(0))]
    i = torch.arange(n) % 5
    return s, x, i


def _autograd(graph, wrt, s, x, i):
    fn = compile_graph(graph, "torch")
    inputs = {"s": s.clone().requires_grad_(wrt == "s"), "x": x.clone().requires_grad_(wrt == "x"), "i": i}
    out = torch.as_tensor(fn(inputs["s"], inputs["x"], inputs["i"])[0]).expand_as(s)
    if not out.requires_grad:                    # the expression does not depend on wrt
        return out.detach(), torch.zeros_like(s)
    g, = torch.autograd.grad(out.sum(), inputs[wrt], allow_unused=True)
    return out.detach(), (torch.zeros_like(s) if g is None else g)


@pytest.mark.parametrize("wrt", ["s", "x"])
@pytest.mark.parametrize("name,f,dom", EXPRESSIONS, ids=[e[0] for e in EXPRESSIONS])
def test_derivative_matches_torch_autograd(name, f, dom, wrt):
    g = trace(f, [S, X, I], name, n_outputs=1)
    d = derivative(g, wrt)
    assert [v.name for v in d.inputs] == ["s", "x", "i"] and len(d.outputs) == 2
    s, x, i = _grid(*dom)
    val, dval = compile_graph(d, "torch")(s, x, i)
    want_val, want_d = _autograd(g, wrt, s, x, i)
    assert_close(torch.as_tensor(val).expand_as(s), want_val, "float64", name=f"{name}: value")
    assert_close(torch.as_tensor(dval).expand_as(s), want_d, "float64", name=f"{name}: d/d{wrt}")


@pytest.mark.parametrize("name,f,dom", EXPRESSIONS, ids=[e[0] for e in EXPRESSIONS])
def test_derivative_numpy_lowering_matches_finite_differences(name, f, dom):
    g = trace(f, [S, X, I], name, n_outputs=1)
    d = derivative(g, "s", with_value=False)
    assert len(d.outputs) == 1
    s, x, i = (t.numpy() for t in _grid(*dom))
    h = 1e-6
    fn = compile_graph(g, "numpy")
    fd = (np.asarray(fn(s + h, x, i)[0]) - np.asarray(fn(s - h, x, i)[0])) / (2 * h)
    got = np.broadcast_to(np.asarray(compile_graph(d, "numpy")(s, x, i)[0], dtype=np.float64), s.shape)
    # away from kinks (where, abs, max/min, mod, floor switch inside [s - h, s + h])
    smooth = np.abs(fd - got) < 1e-3 * (1 + np.abs(got)) + 1e-3
    assert smooth.mean() > 0.85, (name, fd[~smooth], got[~smooth])
    assert_close(got[smooth], fd[smooth], "float64", atol=1e-6, rtol=1e-6, name=name)


def test_structural_zeros_give_constant_derivatives():
    slopes = Buffer(torch.tensor([0.5, 0.25]))
    g = trace(lambda s, b, h, q, kv: s + slopes[h] * ops.to_float(kv - q),
              [Var("score"), Var("b"), Var("h"), Var("q_idx"), Var("kv_idx")], "alibi", n_outputs=1)
    d = derivative(g, "score")
    assert d.outputs[1].op == "const" and d.outputs[1].attr == 1.0
    assert d.buffers[0] is slopes                        # tables are kept, not differentiated
    dh = derivative(g, "h", with_value=False)            # an index: zero everywhere
    assert dh.outputs[0].op == "const" and dh.outputs[0].attr == 0.0
    # the softcap derivative shares tanh with the value and folds 1/c * c
    d = derivative(trace(lambda s: 3.0 * ops.tanh(s / 3.0), [Var("s")], "cap", n_outputs=1), "s")
    ops_used = [n.op for n in d.nodes()]
    assert ops_used.count("tanh") == 1 and "div" in ops_used and ops_used.count("mul") <= 4


def test_kink_conventions_match_torch():
    """abs at 0 -> 0; maximum / minimum ties -> half to each side (torch's conventions)."""
    s = torch.tensor([0.0, 1.0, -1.0], dtype=torch.float64)
    x = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)
    i = torch.zeros(3, dtype=torch.long)
    for f in (lambda s, x, i: ops.abs(s), lambda s, x, i: ops.maximum(s, x),
              lambda s, x, i: ops.minimum(x, s), lambda s, x, i: ops.clamp(s, 0.0, 1.0)):
        g = trace(f, [S, X, I], "kink", n_outputs=1)
        got = torch.as_tensor(compile_graph(derivative(g, "s"), "torch")(s, x, i)[1]).expand_as(s)
        assert torch.equal(got, _autograd(g, "s", s, x, i)[1]), (got, _autograd(g, "s", s, x, i)[1])


def test_reductions():
    """d/dc of red(f(x + c)) over a block x (c broadcast into it): rsum is linear, rmax /
    rmin follow the extremum."""
    x = torch.tensor([0.3, -1.2, 2.5, 0.7], dtype=torch.float64)
    for red in (ops.reduce_sum, ops.reduce_max, ops.reduce_min):
        gc = trace(lambda a, c: red((a + c) * (a + c) + ops.tanh(a + c)), [Var("v"), Var("c")],
                   red.__name__, n_outputs=1)
        got = compile_graph(derivative(gc, "c", with_value=False), "torch")(
            x, torch.tensor(0.0, dtype=torch.float64))[0]
        xc = torch.tensor(0.0, dtype=torch.float64, requires_grad=True)
        want, = torch.autograd.grad(compile_graph(gc, "torch")(x, xc)[0], xc)
        assert_close(got, want, "float64", name=red.__name__)


def test_errors_and_supported_table():
    g = trace(lambda s: s * 2.0, [Var("s")], "f", n_outputs=1)
    with pytest.raises(ValueError, match="no input 'score'"):
        derivative(g, "score")
    with pytest.raises(ValueError, match="outputs"):
        derivative(g, "s", output=1)
    assert {"tanh", "where", "maximum", "load", "pow", "rsum"} <= set(SUPPORTED)


def test_argument_types_are_checked():
    """``output=True`` was taken as output 1, ``output="0"`` and ``output=1.0`` failed in a
    comparison or an index, and a graph that is not one with an AttributeError."""
    g = trace(lambda s: (s * 2.0, s * s), [Var("s")], "f", n_outputs=2)
    for bad in (True, "0", 1.0):
        with pytest.raises(TypeError, match="^output: expected an int"):
            derivative(g, "s", output=bad)
    with pytest.raises(TypeError, match="^with_value: expected a bool"):
        derivative(g, "s", with_value="no")
    with pytest.raises(TypeError, match="^graph: expected a traced flashfold Graph"):
        derivative("f", "s")
    d = derivative(g, "s", output=np.int64(1), with_value=np.bool_(False))
    assert compile_graph(d, "numpy")(np.float64(3.0))[0] == 6.0


def _expr():
    """A builder of random smooth expressions over (s, x) for hypothesis (safe domains)."""
    unary = [lambda a: ops.tanh(a), lambda a: ops.sigmoid(a), lambda a: ops.exp(ops.tanh(a)),
             lambda a: ops.log1p(a * a), lambda a: ops.sqrt(a * a + 1.0), lambda a: -a,
             lambda a: ops.softcap(a, 2.0)]
    binary = [lambda a, b: a + b, lambda a, b: a * b, lambda a, b: a - b,
              lambda a, b: a / (b * b + 1.0), lambda a, b: ops.maximum(a, b * 0.5 + 0.1)]

    def build(node, leaves_):
        kind, payload = node
        if kind == "leaf":
            return leaves_[payload]
        if kind == "u":
            fi, child = payload
            return unary[fi % len(unary)](build(child, leaves_))
        fi, left, right = payload
        return binary[fi % len(binary)](build(left, leaves_), build(right, leaves_))
    return build


_trees = st.recursive(
    st.tuples(st.just("leaf"), st.integers(0, 2)),
    lambda children: st.one_of(
        st.tuples(st.just("u"), st.tuples(st.integers(0, 6), children)),
        st.tuples(st.just("b"), st.tuples(st.integers(0, 4), children, children))),
    max_leaves=6)


@given(tree=_trees)
def test_random_expressions_match_autograd(tree):
    build = _expr()

    def f(s, x):
        return build(tree, [s, x, s * x + 0.5])
    g = trace(f, [Var("s"), Var("x")], "random", n_outputs=1)
    s = torch.linspace(-2.1, 2.3, 17, dtype=torch.float64)
    x = torch.linspace(1.7, -1.1, 17, dtype=torch.float64)
    val, dval = compile_graph(derivative(g, "s"), "torch")(s, x)
    sr = s.clone().requires_grad_()
    out = torch.as_tensor(compile_graph(g, "torch")(sr, x)[0])
    if not out.requires_grad:                       # the expression does not use s
        assert torch.all(torch.as_tensor(dval) == 0)
        return
    want, = torch.autograd.grad(out.expand_as(s).sum(), sr)
    # maximum ties are measure-zero on this grid except by construction; compare elsewhere
    assert_close(torch.as_tensor(dval).expand_as(s), want, "float64", name="d/ds")


def test_triton_lowering_of_score_mod_derivative(monkeypatch):
    """The generated Triton ``score_grad`` (value, derivative) on a tile, under the
    interpreter, against the torch lowering."""
    import triton
    import triton.language as tl

    from flashfold.kernels.attention.bwd import score_grad_fn

    table = torch.randn(3, 2 * 4 + 1, generator=torch.Generator().manual_seed(1))
    base = mods.relative_bias(table)

    def mod(score, b, h, q_idx, kv_idx):          # softcap-like, table read, index terms
        return 2.0 * ops.tanh(base(score, b, h, q_idx, kv_idx) / 2.0) * (1.0 + ops.to_float(h) * 0.1)
    traced = trace_score_mod(mod)
    fn = score_grad_fn(traced)

    @triton.jit
    def kernel(S, V, DV, h, BUFS, BM: tl.constexpr, BN: tl.constexpr, fn: tl.constexpr):
        qi = tl.arange(0, BM)[:, None]
        kj = tl.arange(0, BN)[None, :]
        s = tl.load(S + qi * BN + kj)
        val, d = fn(s, 0, h, qi, kj, BUFS)
        tl.store(V + qi * BN + kj, val)
        tl.store(DV + qi * BN + kj, d)

    s = torch.randn(16, 16, generator=torch.Generator().manual_seed(2)) * 3
    val, dval = torch.empty_like(s), torch.empty_like(s)
    kernel[(1,)](s, val, dval, 2, traced.buffer_args("cpu"), BM=16, BN=16, fn=fn)
    sr = s.double().requires_grad_()
    qi, kj = torch.arange(16).view(-1, 1), torch.arange(16).view(1, -1)
    want = traced.torch_fn("cpu")(sr, torch.tensor(0), torch.tensor(2), qi, kj)
    want_d, = torch.autograd.grad(want.sum(), sr)
    assert_close(val, want, "float32", name="value")
    assert_close(dval, want_d, "float32", name="derivative")
    assert not math.isnan(float(dval.sum()))
