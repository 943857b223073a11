"""The traced IR and its lowerings."""

import numpy as np
import pytest

from flashfold import ops
from flashfold.algebra import Var, compile_graph, function_source, get_backend, trace
from flashfold.monoids import ATTENTION, LOGSUMEXP


def test_trace_shares_subexpressions():
    g = trace(lambda x, y: (ops.exp(x - y), ops.exp(x - y) + 1.0), [Var("x"), Var("y")], "f")
    assert sum(1 for n in g.nodes() if n.op == "exp") == 1
    assert "exp" in g.text()


def test_graph_key_is_stable_and_content_based():
    f = lambda x: (ops.maximum(x, 0.0),)  # noqa: E731
    k1 = trace(f, [Var("x")], "relu").key()
    k2 = trace(f, [Var("x")], "relu").key()
    k3 = trace(lambda x: (ops.minimum(x, 0.0),), [Var("x")], "relu").key()
    assert k1 == k2 != k3


def test_python_branching_on_traced_values_is_rejected():
    with pytest.raises(TypeError, match="ops.where"):
        trace(lambda x: (x if x > 0 else -x,), [Var("x")], "abs")
    with pytest.raises(TypeError, match="ops.where"):
        trace(lambda x: (max(x, 0.0),), [Var("x")], "relu")


def test_numpy_lowering_matches_the_formula():
    f = compile_graph(LOGSUMEXP.combine_graph, "numpy")
    m, d = f(np.array([1.0, -np.inf]), np.array([2.0, 0.0]), np.array([3.0, -np.inf]), np.array([1.0, 0.0]))
    assert m[0] == 3.0 and d[0] == pytest.approx(2.0 * np.exp(-2.0) + 1.0)
    assert m[1] == -np.inf and d[1] == 0.0          # both sides empty: no NaN


def test_vector_shape_class_propagates():
    g = ATTENTION.combine_graph
    assert [o.vector for o in g.outputs] == [False, False, True]


def test_generated_source_is_readable():
    src = function_source(LOGSUMEXP.combine_graph, get_backend("numpy"), "combine")
    assert src.startswith("def combine(a_m, a_d, b_m, b_d):")
    assert "np.maximum(a_m, b_m)" in src and "return" in src


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend"):
        get_backend("fortran")


def test_nan_constants_are_rejected():
    with pytest.raises(ValueError, match="NaN"):
        trace(lambda x: (x + float("nan"),), [Var("x")], "bad")


def test_compile_graph_and_numpy_monoid_name_a_wrong_argument():
    """Both are exported by flashfold.algebra; a string used to fail with
    AttributeError ('str' object has no attribute 'inputs' / 'lift_graph')."""
    from flashfold.algebra import compile_graph, numpy_monoid
    with pytest.raises(TypeError, match=r"graph: expected a traced flashfold Graph .*got str"):
        compile_graph("combine", "numpy")
    with pytest.raises(TypeError, match="monoid: expected a flashfold Monoid, got str"):
        numpy_monoid("sum")


def test_compile_graph_names_a_backend_that_is_neither_a_name_nor_a_backend():
    """A backend given as a number (or None) failed with AttributeError ('int' object has
    no attribute 'reduce_axis') inside the emitter."""
    from flashfold.algebra import compile_graph
    for bad in (3, None):
        with pytest.raises(TypeError, match="^backend: expected a Backend or a registered"):
            compile_graph(LOGSUMEXP.combine_graph, bad)
