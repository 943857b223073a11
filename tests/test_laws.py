"""check_laws on every built-in and on user monoids; non-associative combines are caught."""

import pytest

import flashfold as ff
from flashfold.monoids import BUILTINS

import user_monoids as U


@pytest.mark.parametrize("monoid", BUILTINS, ids=lambda m: m.name)
def test_builtins_satisfy_the_laws(monoid):
    report = ff.check_laws(monoid, trials=3000, seed=1)
    assert report.ok, str(report)
    assert report.identity_exact, str(report)
    assert report.nan_free
    assert report.worst_ratio <= 1.0


@pytest.mark.parametrize("monoid", [U.MINMAX, U.MATMUL2, U.MAX_PREFIX_SUM], ids=lambda m: m.name)
def test_user_monoids_satisfy_the_laws(monoid):
    report = ff.check_laws(monoid, trials=2000)
    assert report.ok, str(report)
    assert report.commutative is (True if monoid.commutative else None)


@pytest.mark.parametrize("monoid,law", [
    (U.AVERAGE, "associativity"), (U.SUBTRACT, "associativity"),
    (U.FORGOT_RESCALE, "associativity")], ids=lambda x: getattr(x, "name", x))
def test_non_associative_combines_are_caught_with_a_counterexample(monoid, law):
    report = ff.check_laws(monoid, trials=200)
    assert not report.ok and not report.associative
    cex = report.counterexample
    assert cex["law"] == law
    assert cex["(a*b)*c"] != cex["a*(b*c)"]
    assert "counterexample" in str(report)


def test_counterexample_is_concrete_and_reproducible():
    r1, r2 = ff.check_laws(U.AVERAGE, seed=3), ff.check_laws(U.AVERAGE, seed=3)
    assert r1.counterexample == r2.counterexample
    # the printed states reproduce the failure by hand
    a = float(r1.counterexample["a"].split("=")[1].rstrip(")"))
    b = float(r1.counterexample["b"].split("=")[1].rstrip(")"))
    c = float(r1.counterexample["c"].split("=")[1].rstrip(")"))
    assert ((a + b) / 2 + c) / 2 != (a + (b + c) / 2) / 2


def test_wrongly_declared_commutativity_is_caught():
    wrong = ff.Monoid("mps_claims_commutative", fields=U.MAX_PREFIX_SUM.fields,
                      identity=U.MAX_PREFIX_SUM.identity, inputs=U.MAX_PREFIX_SUM.inputs,
                      lift=U.MAX_PREFIX_SUM.lift, combine=U.MAX_PREFIX_SUM.combine,
                      commutative=True)
    report = ff.check_laws(wrong)
    assert report.associative and report.commutative is False and not report.ok
    assert report.counterexample["law"] == "commutativity"


def test_wrong_identity_is_caught():
    bad = ff.Monoid("sum_with_identity_one", fields=("s",), identity=(1.0,),
                    lift=lambda x: (x,), combine=lambda a, b: (a.s + b.s,), commutative=True,
                    inputs=(ff.Input("x", domain="finite"),))
    report = ff.check_laws(bad)
    assert report.associative and not report.identity
    assert report.counterexample["law"] == "identity"


def test_check_laws_validates_arguments():
    with pytest.raises(TypeError, match="monoid"):
        ff.check_laws("sum")
    with pytest.raises(ValueError, match="trials"):
        ff.check_laws(ff.monoids.SUM, trials=0)


def test_tolerance_comes_from_the_error_bound_not_a_fixed_epsilon():
    """Sums of 1e4-scale values differ across bracketings by more than 1e-12 absolute,
    yet stay within the propagated bound; the average fails by ~1e14 times it."""
    ok = ff.check_laws(ff.monoids.SUM, trials=3000)
    assert ok.worst_error > 0 and ok.worst_ratio <= 1
    bad = ff.check_laws(U.AVERAGE, trials=3000)
    assert bad.worst_ratio > 1e6


# --- states that do not come from the claimed identity --------------------------------

#: max with the identity 0: a monoid only on the non-negative reals. A sample folded from
#: the identity is max(0, ...) >= 0, on which 0 does act as the identity.
BADMAX = ff.Monoid("badmax", fields=("m",), identity=(0.0,), lift=lambda x: (x,),
                   combine=lambda a, b: (ff.ops.maximum(a.m, b.m),), commutative=True)

#: keeps its left operand: associative, neither commutative nor with a two-sided identity.
#: Folded from the identity, every sample is the identity itself.
KEEP_LEFT = ff.Monoid("keep_left", fields=("a",), identity=(0.0,), lift=lambda x: (x,),
                      combine=lambda a, b: (a.a,), commutative=True)


def test_identity_is_tested_on_states_not_built_from_it():
    report = ff.check_laws(BADMAX)
    assert report.associative and not report.identity and not report.ok, str(report)
    cex = report.counterexample
    assert cex["law"] == "identity"
    a = float(cex["a"].split("=")[1].rstrip(")"))
    assert a < 0                                       # max(0, a) != a exactly there


def test_commutativity_is_tested_on_distinct_states():
    report = ff.check_laws(KEEP_LEFT)
    assert report.associative and report.commutative is False and not report.ok, str(report)
    assert not report.identity                        # e * a = e
    assert report.counterexample["law"] == "identity"


def test_commutativity_alone_is_reported_with_two_distinct_states():
    keep_left_no_identity_claim = ff.Monoid(
        "keep_left_max", fields=("a", "m"), identity=(0.0, -ff.ops.inf),
        lift=lambda x: (x, x),
        # a.a where a is a real state, b.a where a is the identity: a two-sided identity
        combine=lambda a, b: (ff.ops.where(a.m > -ff.ops.inf, a.a, b.a), ff.ops.maximum(a.m, b.m)),
        commutative=True, inputs=(ff.Input("x", domain="finite"),))
    report = ff.check_laws(keep_left_no_identity_claim)
    assert report.associative and report.identity and report.commutative is False, str(report)
    cex = report.counterexample
    assert cex["law"] == "commutativity" and cex["a"] != cex["b"]


def test_identity_combined_with_itself_is_checked():
    """e * e == e: the samples are never the identity, so it is checked on its own."""
    wrong_at_ee = ff.Monoid(
        "wrong_at_ee", fields=("m",), identity=(-ff.ops.inf,), lift=lambda x: (x,),
        inputs=(ff.Input("x", domain="finite"),),
        combine=lambda a, b: (ff.ops.where((a.m == -ff.ops.inf) & (b.m == -ff.ops.inf), 0.0,
                                           ff.ops.maximum(a.m, b.m)),),
        commutative=True)
    report = ff.check_laws(wrong_at_ee)
    assert report.associative and not report.identity and not report.ok, str(report)
    assert report.counterexample["law"] == "identity"
    assert report.counterexample["a"] == report.counterexample["e"]


def test_states_are_folds_of_lifted_inputs_only():
    import numpy as np
    from flashfold.algebra.laws import random_states
    s, counts, _ = random_states(BADMAX, np.random.default_rng(0), 400)
    assert counts.min() >= 1
    assert (s[0] < 0).mean() > 0.2                    # negative states exist: not max(0, ...)


@pytest.mark.parametrize("kwargs,exc,name", [
    ({"width": 0}, ValueError, "width"), ({"width": -1}, ValueError, "width"),
    ({"width": 2.5}, TypeError, "width"), ({"width": True}, TypeError, "width"),
    ({"seed": "x"}, TypeError, "seed"), ({"seed": -1}, ValueError, "seed"),
    ({"seed": 1.5}, TypeError, "seed"), ({"trials": "3"}, TypeError, "trials"),
])
def test_check_laws_names_the_bad_argument(kwargs, exc, name):
    with pytest.raises(exc, match=f"^{name}: "):
        ff.check_laws(ff.monoids.SUM, **kwargs)


def test_prove_agrees_on_the_monoids_that_were_accepted():
    """ff.prove (symbolic) and check_laws (random) reject the same two monoids."""
    pytest.importorskip("sympy")
    for m in (BADMAX, KEEP_LEFT):
        assert not ff.prove(m), m.name
        assert not ff.check_laws(m), m.name


# --- Monoid arguments -----------------------------------------------------------------

def _welford_like(**kw):
    base = dict(fields=("n", "s"), identity=(0.0, 0.0), lift=lambda x: (1.0, x),
                combine=lambda a, b: (a.n + b.n, a.s + b.s),
                finalize=lambda st, correction: st.s / (st.n - correction))
    return ff.Monoid("mean_like", **{**base, **kw})


@pytest.mark.parametrize("params,exc", [
    (3, TypeError), ("correction", TypeError), ((("correction",),), TypeError),
    ({"correction": "a"}, TypeError), ({"correction": True}, TypeError),
    ({3: 1.0}, TypeError), ({"not an identifier": 1.0}, ValueError),
    ((("correction", 0.0), ("correction", 1.0)), ValueError),
], ids=repr)
def test_monoid_params_are_validated_and_named(params, exc):
    with pytest.raises(exc, match="^monoid 'mean_like': params"):
        _welford_like(params=params)


def test_monoid_params_accept_a_mapping_or_pairs():
    a = _welford_like(params={"correction": 0})
    b = _welford_like(params=[("correction", 0.0)])
    assert a.param_defaults == b.param_defaults == {"correction": 0}


def test_a_combine_with_a_block_reduction_is_refused_by_name():
    """``reduce_max`` in a combine reduces along the block axis (the fold's tree and
    sequential schedules then disagree); check_laws used to fail with a
    NotImplementedError from its error-bound lowering."""
    m = ff.Monoid("with_rmax", fields=(ff.Field("v", vector=True),), identity=(0.0,),
                  inputs=(ff.Input("x", vector=True, domain="finite"),), lift=lambda x: (x,),
                  combine=lambda a, b: (a.v + ff.ops.reduce_max(b.v),))
    with pytest.raises(ValueError, match=r"monoid: 'with_rmax' combine uses rmax"):
        ff.check_laws(m)
