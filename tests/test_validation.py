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


def test_blocks_from_an_iterator_are_validated_like_a_list():
    """An iterator was consumed by the sum check, so the sign check saw nothing and
    a negative size slipped through: [3, -1, 1] folded x[2] twice (9 instead of 6)."""
    x = np.arange(1.0, 4.0)
    with pytest.raises(ValueError, match="blocks.*non-negative"):
        ff.fold(SUM, x, blocks=iter([3, -1, 1]))
    with pytest.raises(ValueError, match="blocks.*non-negative"):
        ff.fold(SUM, x, blocks=iter([2.5, 1.5]))
    with pytest.raises(ValueError, match="blocks.*non-negative"):
        ff.fold(SUM, x, blocks=[True, 2])
    with pytest.raises(TypeError, match="blocks"):
        ff.fold(SUM, x, blocks="12")
    assert ff.fold(SUM, x, blocks=iter([1, 0, 2])).s == 6.0
    assert ff.fold(SUM, x, blocks=np.array([2, 1])).s == 6.0


def test_fold_checks_the_monoid_and_seed_before_using_them():
    with pytest.raises(TypeError, match="monoid"):
        ff.fold("sum", np.ones(3), "shuffled")
    with pytest.raises(TypeError, match="seed"):
        ff.fold(SUM, np.ones(3), "shuffled", seed="x")
    with pytest.raises(ValueError, match="seed"):
        ff.fold(SUM, np.ones(3), "shuffled", seed=-1)
    assert ff.fold(SUM, np.ones(3), "shuffled", seed=None).s == 3.0


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


def test_fields_inputs_and_outputs_are_checked_where_the_monoid_is_made():
    """Names of the wrong type, duplicate inputs or outputs, and a non-bool ``vector``
    raise at construction, naming the argument (they used to pass and crash in a later
    fold: a SyntaxError from generated code, an AttributeError, namedtuple's error)."""
    from flashfold import Field, Input
    add = dict(identity=(0.0,), lift=lambda x: (x,), combine=lambda a, b: (a.s + b.s,))
    with pytest.raises(TypeError, match="field name must be a str, got int"):
        Field(3)
    with pytest.raises(TypeError, match="input name must be a str, got NoneType"):
        Input(None)
    with pytest.raises(TypeError, match="field 'a': vector must be True or False"):
        Field("a", vector="yes")
    with pytest.raises(TypeError, match="fields must be a name, a Field / Input or a tuple"):
        Monoid("bad", fields=None, **add)
    with pytest.raises(ValueError, match=r"input names must be unique, got \('x', 'x'\)"):
        Monoid("bad", fields=("s",), inputs=("x", "x"), identity=(0.0,),
               lift=lambda x, y: (x,), combine=lambda a, b: (a.s + b.s,))
    with pytest.raises(ValueError, match="outputs names must be unique"):
        Monoid("bad", fields=("s",), finalize=lambda s: (s.s, s.s), outputs=("a", "a"), **add)
    one = Monoid("one", fields=Field("s"), inputs=Input("x"), **add)     # single objects
    assert one.field_names == ("s",) and one.input_names == ("x",)


def test_folding_a_monoid_without_data_inputs_says_so():
    none = Monoid("no_data", fields=("s",), inputs=(), identity=(0.0,), lift=lambda: (1.0,),
                  combine=lambda a, b: (a.s + b.s,))
    with pytest.raises(ValueError, match="'no_data' has no data input"):
        ff.fold(none, ())


def test_prove_checks_its_options():
    with pytest.raises(ValueError, match="max_paths: must be at least 1, got 0"):
        ff.prove(SUM, max_paths=0)
    with pytest.raises(TypeError, match="max_paths: expected an int, got str"):
        ff.prove(SUM, max_paths="a")
    with pytest.raises(TypeError, match="commutativity: expected True, False or None"):
        ff.prove(SUM, commutativity="yes")


def test_finalize_of_a_hand_built_state_and_its_parameters():
    """A state written by hand (numbers, a list) is finalized as a fold's; a wrong number
    of fields or a parameter that is not a number is refused naming it."""
    from flashfold.examples import COVARIANCE
    from flashfold.monoids import LOGSUMEXP, WELFORD
    assert ff.finalize(LOGSUMEXP, [1.0, 2.0]) == pytest.approx(1.0 + np.log(2.0))
    with pytest.raises(ValueError, match=r"state: expected one value per field \('n', 'mean', "
                                         r"'m2'\), got 1 values"):
        ff.finalize(WELFORD, (1.0,))
    with pytest.raises(ValueError, match="state: expected one value per field"):
        ff.finalize(WELFORD, 3.0)
    state = ff.fold(COVARIANCE, (np.ones(3), np.arange(3.0)))
    with pytest.raises(TypeError, match="correction: expected a number, got str"):
        ff.finalize(COVARIANCE, state, correction="1")


def test_names_that_generated_code_cannot_take_are_refused_where_the_monoid_is_made():
    """A keyword or a leading underscore as a field name, a keyword as an input or a
    parameter name, an input named ``valid`` beside a block lift, and a parameter named as
    a field raise at construction, naming them: they used to fail in namedtuple or as a
    SyntaxError of the generated code (``duplicate argument 's'``) at the first fold."""
    from flashfold import Field, Input
    add = dict(identity=(0.0,), lift=lambda x: (x,), combine=lambda a, b: (a.s + b.s,))
    with pytest.raises(ValueError, match="field name 'class' is not a Python identifier"):
        Field("class")
    with pytest.raises(ValueError, match="field name '_s' starts with an underscore"):
        Field("_s")
    with pytest.raises(ValueError, match="input name 'lambda' is not a Python identifier"):
        Input("lambda")
    with pytest.raises(ValueError, match="params: 'if' is not a Python identifier"):
        Monoid("bad", fields=("s",), finalize=lambda s, **p: s.s, params={"if": 1.0}, **add)
    with pytest.raises(ValueError, match=r"params \['s'\] have the names of fields"):
        Monoid("bad", fields=("s",), finalize=lambda st, s: st.s * s, params={"s": 2.0}, **add)
    with pytest.raises(ValueError, match="an input named 'valid' clashes"):
        Monoid("bad", fields=("s",), inputs=("valid",),
               block_lift=lambda valid, mask: (ops.reduce_sum(ops.where(mask, valid, 0.0)),),
               **add)


@pytest.mark.parametrize("name", ["my sum", "my-sum", "2sum", "sum.v2", "myMonoid"])
def test_a_monoid_name_is_free_text(name):
    """A name is used in reprs and generated names, which sanitize it: any non-empty text
    makes a monoid whose states are named tuples (``"my sum"`` used to fail in namedtuple:
    'My sumState' is not an identifier)."""
    m = Monoid(name, fields=("s", "n"), identity=(0.0, 0.0), lift=lambda x: (x, 1.0),
               combine=lambda a, b: (a.s + b.s, a.n + b.n), commutative=True)
    assert m.State.__name__.isidentifier() and m.State.__name__.endswith("State")
    assert ff.fold(m, np.arange(4.0)) == m.State(6.0, 4.0)


def test_scan_flags_must_be_bools():
    """inclusive="no" was truthy and silently gave the inclusive scan."""
    from flashfold.schedules import scan
    with pytest.raises(TypeError, match="inclusive"):
        scan(SUM, np.ones(3), inclusive="no")
    with pytest.raises(TypeError, match="reverse"):
        scan(SUM, np.ones(3), reverse=None)
    assert scan(SUM, np.ones(3), inclusive=np.bool_(False)).s.tolist() == [0.0, 1.0, 2.0]


def test_finalize_names_a_non_numeric_state_field():
    """A string in a hand-built state failed in NumPy ("could not convert string to
    float: 'a'") without saying which field."""
    from flashfold.monoids import WELFORD
    with pytest.raises(TypeError, match="state: field 'n' must be a number"):
        ff.finalize(WELFORD, ("a", 1.0, 2.0))
    with pytest.raises(TypeError, match="state: field 'm2'"):
        ff.finalize(WELFORD, (1.0, 1.0, object()))


def test_finalize_refuses_an_int_field_that_is_not_a_whole_number():
    """An int field (a position) given as floats was cast by NumPy: 2.7 became 2, NaN
    became -2^63, and 1e30 raised an OverflowError; each is a ValueError naming the field.
    Whole numbers as floats are taken."""
    from flashfold.monoids import ARGMAX
    for bad in (2.7, np.array([1.0, np.nan]), 1e30, np.inf, np.array([3.0, 1e30])):
        with pytest.raises(ValueError, match="state: field 'i' holds whole numbers"):
            ff.finalize(ARGMAX, (np.ones(np.shape(bad)), bad))
    v, i = ff.finalize(ARGMAX, (np.array([1.0, 2.0]), np.array([3.0, 0.0])))
    assert i.dtype == np.int64 and i.tolist() == [3, 0]


def test_an_input_that_is_not_an_array_is_named():
    """Ragged lists failed in NumPy ("setting an array element with a sequence") and a
    bfloat16 tensor in torch ("Got unsupported ScalarType BFloat16"), naming neither the
    argument nor the input."""
    import torch
    with pytest.raises(ValueError, match="^xs: input 'x' is not an array"):
        ff.fold(SUM, [[1.0], [2.0, 3.0]])
    with pytest.raises(TypeError, match="^xs: input 'value' is not an array"):
        ff.fold(ATTENTION, (np.ones(2), torch.ones(2, 3, dtype=torch.bfloat16)))


def test_finalize_broadcasts_the_fields_of_a_hand_built_state():
    """The batch shape was read off the first field alone: ``(0.0, [1, 2])`` for LOGSUMEXP
    failed in NumPy ("cannot broadcast a non-scalar to a scalar array"), and ATTENTION's
    vector field ``o`` given as a number raised an IndexError. Fields broadcast as a fold's
    state does; shapes that do not, or a vector field without its feature axis, are
    ValueErrors naming the state."""
    from flashfold.monoids import LOGSUMEXP, WELFORD
    got = ff.finalize(LOGSUMEXP, (0.0, np.array([1.0, 2.0])))
    assert got.tolist() == pytest.approx([0.0, np.log(2.0)])
    mean, var = ff.finalize(WELFORD, (np.array(2.0), np.array([1.0, 2.0]), np.array([0.0, 1.0])),
                            correction=1)
    assert mean.tolist() == [1.0, 2.0] and var.tolist() == [0.0, 1.0]
    out, lse = ff.finalize(ATTENTION, (0.0, np.array([1.0, 2.0]), np.ones(3)))
    assert out.shape == (2, 3) and out[1].tolist() == [0.5] * 3 and lse.shape == (2,)
    with pytest.raises(ValueError, match=r"^state: the fields' shapes .* do not broadcast"):
        ff.finalize(LOGSUMEXP, (np.zeros(2), np.ones(3)))
    with pytest.raises(ValueError, match="^state: field 'o' is a vector field"):
        ff.finalize(ATTENTION, (0.0, 1.0, 2.0))
