"""Invalid input raises ValueError/TypeError naming the argument."""

import numpy as np
import pytest

import flashfold as ff
from flashfold import Monoid, ops
from flashfold.monoids import ATTENTION, SUM


def test_non_float_scores():
    with pytest.raises(TypeError, match="xs.*floating"):
        ff.fold(SUM, np.arange(4))
    with pytest.raises(TypeError, match="xs.*floating"):
        ff.fold(SUM, ["a", "b"])


def test_wrong_shapes():
    with pytest.raises(ValueError, match="xs.*2 inputs"):
        ff.fold(ATTENTION, np.ones(4))
    with pytest.raises(ValueError, match="xs.*does not match"):
        ff.fold(ATTENTION, (np.ones(4), np.ones((5, 2))))
    with pytest.raises(ValueError, match="xs.*at least 2"):
        ff.fold(ATTENTION, (np.ones(4), np.ones(4)))
    with pytest.raises(ValueError, match="xs.*at least 1"):
        ff.fold(SUM, np.float64(1.0))


def test_unknown_schedule_and_bad_blocks():
    with pytest.raises(ValueError, match="schedule.*'zigzag'"):
        ff.fold(SUM, np.ones(4), "zigzag")
    with pytest.raises(ValueError, match="blocks.*sum to 3"):
        ff.fold(SUM, np.ones(4), blocks=[1, 2])
    with pytest.raises(ValueError, match="blocks.*non-negative"):
        ff.fold(SUM, np.ones(4), blocks=[5, -1])
    with pytest.raises(TypeError, match="blocks"):
        ff.fold(SUM, np.ones(4), blocks=4)


def test_not_a_monoid():
    with pytest.raises(TypeError, match="monoid"):
        ff.fold("sum", np.ones(3))


def test_monoid_definition_errors():
    with pytest.raises(ValueError, match="identity has 1 values for 2 fields"):
        Monoid("bad", fields=("a", "b"), identity=(0.0,), lift=lambda x: (x, x),
               combine=lambda a, b: (a.a, a.b))
    with pytest.raises(ValueError, match="combine returned 1 values, expected 2"):
        Monoid("bad", fields=("a", "b"), identity=(0.0, 0.0), lift=lambda x: (x, x),
               combine=lambda a, b: (a.a,))
    with pytest.raises(TypeError, match="ops.where"):
        Monoid("bad", fields=("m",), identity=(0.0,), lift=lambda x: (x,),
               combine=lambda a, b: (a.m if a.m > b.m else b.m,))
    with pytest.raises(TypeError, match="commutative"):
        Monoid("bad", fields=("m",), identity=(0.0,), lift=lambda x: (x,),
               combine=lambda a, b: (a.m + b.m,), commutative="yes")
    with pytest.raises(ValueError, match="unique"):
        Monoid("bad", fields=("m", "m"), identity=(0.0, 0.0), lift=lambda x: (x, x),
               combine=lambda a, b: (a.m, b.m))
    with pytest.raises(ValueError, match="vector value for the scalar field"):
        Monoid("bad", fields=("m", ff.Field("o", vector=True)), identity=(0.0, 0.0),
               inputs=("s", ff.Input("v", vector=True)),
               lift=lambda s, v: (v, v), combine=lambda a, b: (a.m, a.o))


def test_ops_outside_tracing():
    with pytest.raises(RuntimeError, match="only be applied while tracing"):
        ops.exp(1.0)
