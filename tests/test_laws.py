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
