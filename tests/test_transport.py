"""Transport of structure: the twisted monoids of the specification, symbolically and numerically."""

import numpy as np
import pytest

import flashfold as ff
from flashfold import ops
from flashfold.algebra.proofs import prove
from flashfold.algebra.transport import (MAX_PLUS, MAX_PLUS_PLUS, POWER_SUMS, base2_rescale,
                                         base2_rescale_inverse, exp_rescale, exp_rescale_inverse,
                                         transported_from, welford_map, welford_map_inverse)
from flashfold.monoids import ATTENTION, ATTENTION2, LOGSUMEXP, LOGSUMEXP2, WELFORD
from flashfold.schedules import SCHEDULES
from flashfold.testing import assert_close

CASES = [
    (LOGSUMEXP, MAX_PLUS, exp_rescale, exp_rescale_inverse, True),
    (ATTENTION, MAX_PLUS_PLUS, exp_rescale, exp_rescale_inverse, True),
    (WELFORD, POWER_SUMS, welford_map, welford_map_inverse, True),
    (LOGSUMEXP2, LOGSUMEXP, base2_rescale, base2_rescale_inverse, False),
]


@pytest.mark.parametrize("twisted,base,psi,psi_inv,adjoined", CASES, ids=lambda x: getattr(x, "name", ""))
def test_builtins_are_their_bases_transported(twisted, base, psi, psi_inv, adjoined):
    """LOGSUMEXP and ATTENTION are (max, +, +) twisted by e^-m; WELFORD is the power sums
    twisted by (n, T/n, W - T^2/n); LOGSUMEXP2 is LOGSUMEXP rescaled by log2 e."""
    report = ff.check_transport(twisted, base, psi, psi_inv)
    assert report.ok, report.text()
    assert report.homomorphism.proved and report.identity.proved and report.inverse.proved
    assert report.adjoined is adjoined
    assert report.numeric_ok and report.numeric_max_rel_error < 1e-13
    assert "PROVED" in str(report)


def test_attention_homomorphism_cases_are_the_two_orderings_of_the_maxima():
    report = ff.check_transport(ATTENTION, MAX_PLUS_PLUS, exp_rescale)
    conds = sorted(c.conditions for c in report.homomorphism.cases)
    assert conds == [("x_m < y_m",), ("x_m >= y_m",)]
    assert report.inverse is None and report.ok


def test_a_wrong_twist_is_refuted():
    """(n, T/n, W - T^2) is not Welford's map: the homomorphism fails, with states."""
    wrong = lambda s: (s.n, s.T / s.n, s.W - s.T * s.T)  # noqa: E731
    report = ff.check_transport(WELFORD, POWER_SUMS, wrong)
    assert not report.ok and not report.homomorphism.proved and not report.numeric_ok
    cex = report.homomorphism.counterexample
    assert cex is not None and [n for n, _ in cex.residue] == ["m2"]
    assert report.numeric_report["m2"]["max_abs"] > 1e-3


def test_literal_transport_is_a_monoid_but_not_a_stable_one():
    """Associativity is free, stability is not: psi(psi^-1(a) + psi^-1(b)) is proved
    associative, equals the stable built-in on moderate inputs, and overflows on large ones."""
    lit = ff.transport(MAX_PLUS, exp_rescale, exp_rescale_inverse, name="lse_transported",
                       fields=("m", "d"), identity=(-ops.inf, 0.0))
    assert transported_from(lit)[0] is MAX_PLUS and transported_from(lit)[3] is True
    assert prove(lit).ok
    rng = np.random.default_rng(0)
    x = rng.normal(0.0, 3.0, size=(257, 4))
    x[rng.random(x.shape) < 0.1] = -np.inf
    x[:, 3] = -np.inf                                    # a fully masked row
    for schedule in SCHEDULES:
        got = ff.fold(lit, x, schedule, blocks=[100, 0, 1, 156])
        want = ff.fold(LOGSUMEXP, x, schedule, blocks=[100, 0, 1, 156])
        assert np.array_equal(got.m, want.m)
        assert_close(got.d, want.d, "float64", scale=1.0 + np.abs(want.d), name=schedule)
        assert_close(ff.finalize(lit, got), ff.finalize(LOGSUMEXP, want), "float64",
                     scale=10.0, name=schedule)
    big = np.array([800.0, 799.0, 1.0])                  # e^800 overflows float64
    assert not np.isfinite(ff.fold(lit, big).d)
    stable = ff.fold(LOGSUMEXP, big)
    assert stable.m == 800.0 and stable.d == pytest.approx(1.0 + np.exp(-1.0) + np.exp(-799.0))
    assert not ff.check_laws(lit, trials=300).ok         # inputs of 1e4 overflow e^x
    # ... and the stable built-in is proven to be this very monoid
    assert ff.check_transport(LOGSUMEXP, MAX_PLUS, exp_rescale, exp_rescale_inverse).ok


def test_literal_attention_transport_runs_on_every_schedule():
    lit = ff.transport(MAX_PLUS_PLUS, exp_rescale, exp_rescale_inverse, name="attention_transported",
                       fields=("m", "d", "o"), identity=(-ops.inf, 0.0, 0.0))
    assert lit.fields[2].vector and prove(lit).ok
    rng = np.random.default_rng(1)
    s = rng.normal(0.0, 3.0, size=63)
    s[5:9] = -np.inf
    v = rng.normal(size=(63, 5))
    for schedule in ("sequential", "tree", "shuffled"):
        out, lse = ff.finalize(lit, ff.fold(lit, (s, v), schedule, blocks=[7, 0, 56]))
        want_out, want_lse = ff.finalize(ATTENTION, ff.fold(ATTENTION, (s, v), schedule))
        assert_close(out, want_out, "float64", name=schedule)
        assert_close(lse, want_lse, "float64", scale=10.0, name=schedule)


def test_literal_welford_transport_cancels_catastrophically():
    lit = ff.transport(POWER_SUMS, welford_map, welford_map_inverse, name="welford_transported",
                       fields=("n", "mean", "m2"), identity=(0.0, 0.0, 0.0))
    assert prove(lit).ok
    small = np.random.default_rng(2).normal(0.0, 1.0, size=1000)
    _, var = ff.finalize(lit, ff.fold(lit, small, "tree"))
    assert var == pytest.approx(np.var(small), rel=1e-10)
    big = 1e9 + small                                    # the spec's failure of the naive formula
    _, var_lit = ff.finalize(lit, ff.fold(lit, big, "tree"))
    _, var_w = ff.finalize(WELFORD, ff.fold(WELFORD, big, "tree"))
    assert abs(var_w - np.var(big)) / np.var(big) < 1e-6
    assert abs(var_lit - np.var(big)) / np.var(big) > 0.1


def test_logsumexp2_is_derived_by_transport_and_keeps_its_behaviour():
    base, psi, psi_inv, adjoined = transported_from(LOGSUMEXP2)
    assert base is LOGSUMEXP and psi is base2_rescale and not adjoined
    assert LOGSUMEXP2.name == "logsumexp2" and LOGSUMEXP2.field_names == ("m", "d")
    assert LOGSUMEXP2.identity == (-np.inf, 0.0) and LOGSUMEXP2.output_names == ("lse",)
    assert LOGSUMEXP2.commutative and "exp2" in LOGSUMEXP2.combine_graph.text()
    x = np.random.default_rng(3).normal(0.0, 30.0, size=(100, 3))
    x[:, 2] = -np.inf
    st = ff.fold(LOGSUMEXP2, x, "tree", blocks=[50, 50])
    assert np.allclose(st.m[:2], x[:, :2].max(axis=0) * ops.LOG2E, rtol=1e-15)
    assert st.m[2] == -np.inf and st.d[2] == 0.0
    want = ff.finalize(LOGSUMEXP, ff.fold(LOGSUMEXP, x, "tree"))
    assert_close(ff.finalize(LOGSUMEXP2, st), want, "float64", scale=100.0)



def test_attention2_is_derived_by_transport_and_keeps_attention_behaviour():
    """ATTENTION2 is ATTENTION through psi(m, d, o) = (m log2 e, d, o): proven a transport
    and a monoid; its exp2 lift, block lift, combine and finalize agree with ATTENTION's
    (m in base-2 units, the same output and natural-log LSE), empty and NaN rows included."""
    base, psi, psi_inv, adjoined = transported_from(ATTENTION2)
    assert base is ATTENTION and psi is base2_rescale and not adjoined
    assert ATTENTION2.field_names == ("m", "d", "o") and ATTENTION2.output_names == ("out", "lse")
    assert all("exp2" in g.text() and "exp(" not in g.text()
               for g in (ATTENTION2.combine_graph, ATTENTION2.block_lift_graph))
    assert ff.check_transport(ATTENTION2, ATTENTION, base2_rescale)
    assert ff.prove(ATTENTION2)
    rng = np.random.default_rng(5)
    s = rng.normal(0.0, 20.0, size=(90, 3))
    s[:, 1] = -np.inf                                   # an empty row
    s[7, 2] = np.nan                                    # a NaN score
    v = rng.normal(size=(90, 3, 4))
    for schedule, kw in (("sequential", {}), ("tree", {}), ("blocks", {"blocks": [1, 40, 49]})):
        st2 = ff.fold(ATTENTION2, (s, v), schedule, **kw)
        st = ff.fold(ATTENTION, (s, v), schedule, **kw)
        assert np.allclose(st2.m[[0]], st.m[[0]] * ops.LOG2E, rtol=1e-15)
        for a, b in zip(ff.finalize(ATTENTION2, st2), ff.finalize(ATTENTION, st)):
            assert_close(a, b, "float64", scale=100.0)
    out, lse = ff.finalize(ATTENTION2, ff.fold(ATTENTION2, (s, v), "tree"))
    assert lse[1] == -np.inf and np.all(out[1] == 0.0)
    assert np.isnan(lse[2]) and np.all(np.isnan(out[2]))

def test_transport_validates_its_arguments():
    with pytest.raises(TypeError, match="base"):
        ff.transport("max_plus", exp_rescale, exp_rescale_inverse, name="x")
    with pytest.raises(TypeError, match="psi"):
        ff.transport(MAX_PLUS, None, exp_rescale_inverse, name="x")
    with pytest.raises(ValueError, match="identity: psi is undefined"):
        ff.transport(MAX_PLUS, exp_rescale, exp_rescale_inverse, name="x", fields=("m", "d"))
    with pytest.raises(ValueError, match="identity: psi maps"):
        ff.transport(LOGSUMEXP, base2_rescale, base2_rescale_inverse, name="x", identity=(0.0, 0.0))
    with pytest.raises(ValueError, match="psi: returns 1 values"):
        ff.transport(LOGSUMEXP, lambda s: (s.m,), base2_rescale_inverse, name="x")
    with pytest.raises(ValueError, match="fields"):
        ff.transport(LOGSUMEXP, base2_rescale, base2_rescale_inverse, name="x", fields=("m",))
    with pytest.raises(TypeError, match="twisted"):
        ff.check_transport("logsumexp", MAX_PLUS, exp_rescale)
    for kw, words in ((dict(width=0), "width: expected a positive int"),
                      (dict(scale=float("nan")), "scale: expected a finite number > 0"),
                      (dict(scale=-1.0), "scale: expected a finite number > 0")):
        with pytest.raises(ValueError, match=words):
            ff.check_transport(LOGSUMEXP2, LOGSUMEXP, base2_rescale, **kw)
    with pytest.raises(ValueError, match="trials"):
        ff.check_transport(LOGSUMEXP, MAX_PLUS, exp_rescale, trials=0)
    with pytest.raises(ValueError, match="twisted: has 3 fields"):
        ff.check_transport(ATTENTION, MAX_PLUS, exp_rescale)


def test_a_map_may_return_one_value_for_a_one_field_carrier():
    """psi / psi_inv returning a single value (not a 1-tuple) passed the checks of
    transport, which read them as 1-tuples, and then failed inside the derived combine
    ("SumState() argument after * must be an iterable, not Node")."""
    from flashfold.monoids import SUM
    double = ff.transport(SUM, lambda s: s.s * 2.0, lambda t: t.s / 2.0, name="double_sum")
    x = np.array([1.0, 2.0, 4.0])
    for schedule in ("sequential", "tree"):
        assert float(ff.fold(double, x, schedule).s) == 14.0
    assert ff.check_laws(double)


def test_an_infinite_identity_in_an_int_field_names_psi():
    """An int field cannot hold psi's image of the identity when it is infinite (it was
    an OverflowError from int(inf))."""
    from flashfold.algebra.monoid import Field, Monoid
    imax = Monoid("imax", (Field("m", dtype="int"),), (0,), lambda x: (ops.to_int(x),),
                  lambda a, b: (ops.maximum(a.m, b.m),))
    with pytest.raises(ValueError, match="psi maps the base identity .* int field 'm'"):
        ff.transport(imax, lambda s: (s.m - ops.inf,), lambda t: (t.m,), name="shifted")


def test_check_transport_names_a_bad_seed():
    """A seed that is not an int used to fail inside NumPy's SeedSequence."""
    with pytest.raises(TypeError, match="seed: expected an int"):
        ff.check_transport(LOGSUMEXP2, LOGSUMEXP, base2_rescale, seed="x")
    with pytest.raises(ValueError, match="seed: expected an int >= 0"):
        ff.check_transport(LOGSUMEXP2, LOGSUMEXP, base2_rescale, seed=-1)


def test_without_psi_inv_the_report_does_not_claim_an_isomorphism():
    """psi = max(m, 0) (keeping -inf) is a homomorphism MAX -> MAX but merges every
    negative state into 0; without psi_inv the report used to print "'max' is 'max'
    transported through psi: PROVED"."""
    from flashfold.monoids import MAX
    psi = lambda s: (ops.where(s.m > -ops.inf, ops.maximum(s.m, 0.0), s.m),)  # noqa: E731
    report = ff.check_transport(MAX, MAX, psi)
    assert report.ok and report.inverse is None
    assert "transported through psi" not in str(report)
    assert "bijection not checked" in str(report) and "bijection not checked" in repr(report)
    assert not ff.check_transport(MAX, MAX, psi, lambda t: (t.m,)).ok


def test_transport_checks_the_given_identity_before_using_it():
    """identity="ab" failed in float() ("could not convert string to float: 'a'")."""
    with pytest.raises(TypeError, match="identity: expected a tuple of 2 numbers, got str"):
        ff.transport(LOGSUMEXP, base2_rescale, base2_rescale_inverse, name="x", identity="ab")
    with pytest.raises(TypeError, match="identity: expected numbers"):
        ff.transport(LOGSUMEXP, base2_rescale, base2_rescale_inverse, name="x",
                     identity=(None, 0.0))
    with pytest.raises(ValueError, match="identity: expected 2 values, got 1"):
        ff.transport(LOGSUMEXP, base2_rescale, base2_rescale_inverse, name="x", identity=(0.0,))


def test_a_psi_defined_at_the_identity_still_needs_a_twisted_identity():
    """psi(e) = e' held and the homomorphism held on reachable (finite) states, so a
    twisted combine that adds 1 whenever its right operand is the identity -inf was
    reported "'max_plus_one' is 'max' transported through psi: PROVED"."""
    from flashfold.monoids import MAX
    bad = ff.Monoid("max_plus_one", fields=("m",), identity=(-ops.inf,),
                    inputs=(ff.Input("x", domain="finite"),), lift=lambda x: (x,),
                    combine=lambda a, b: (ops.where(ops.isinf(b.m), a.m + 1.0,
                                                    ops.maximum(a.m, b.m)),),
                    commutative=True)
    assert not ff.check_laws(bad).identity
    base = ff.Monoid("max_finite", fields=("m",), identity=(-ops.inf,),
                     inputs=(ff.Input("x", domain="finite"),), lift=lambda x: (x,),
                     combine=MAX.combine, commutative=True)
    report = ff.check_transport(bad, base, lambda s: (s.m,), lambda t: (t.m,))
    assert not report.adjoined and report.homomorphism.proved
    assert not report.identity.proved and not report.ok, report.text()
    assert "FAILED" in str(report)
