"""prove(): symbolic proofs of the monoid laws, with case splits and counterexamples."""

import subprocess
import sys
import time

import numpy as np
import pytest

import flashfold as ff
from flashfold import Monoid, ops
from flashfold.algebra.proofs import ProofError, prove, reachable_domains
from flashfold.cli import main
from flashfold.monoids import ARGMAX, ATTENTION, BUILTINS, LOGSUMEXP, WELFORD

import user_monoids as U


@pytest.mark.parametrize("monoid", BUILTINS, ids=lambda m: m.name)
def test_every_builtin_is_proved(monoid):
    t0 = time.perf_counter()
    proof = prove(monoid)
    assert proof.ok, proof.text()
    assert [l.name for l in proof.laws] == ["associativity", "identity", "commutativity"]
    assert all(l.proved and l.counterexample is None for l in proof.laws)
    assert all(c.holds for c in proof.steps)
    assert time.perf_counter() - t0 < 10.0          # the proof stays interactive


@pytest.mark.parametrize("monoid", [U.MINMAX, U.MATMUL2, U.MAX_PREFIX_SUM], ids=lambda m: m.name)
def test_user_monoids_of_the_tests_are_proved(monoid):
    proof = prove(monoid)
    assert proof.ok, proof.text()
    names = [l.name for l in proof.laws]
    assert ("commutativity" in names) is monoid.commutative


@pytest.mark.parametrize("monoid", [U.AVERAGE, U.SUBTRACT, U.FORGOT_RESCALE], ids=lambda m: m.name)
def test_non_associative_combines_fail_with_a_counterexample(monoid):
    proof = prove(monoid)
    assert not proof.ok
    assert proof.failure.name == "associativity"
    cex = proof.counterexample
    assert cex is not None and cex.law == "associativity"
    assert cex.residue and all(res != "0" for _, res in cex.residue)
    # the concrete states also break associativity in the code that runs (NumPy lowering)
    assert cex.confirmed, cex.text()
    assert "counterexample" in str(proof)


def test_average_counterexample_reproduces_by_hand():
    cex = prove(U.AVERAGE).counterexample
    (_, a), (_, b), (_, c) = cex.states
    a, b, c = float(a["x"]), float(b["x"]), float(c["x"])
    assert ((a + b) / 2 + c) / 2 != (a + (b + c) / 2) / 2
    assert float(dict(cex.lhs)["x"]) == ((a + b) / 2 + c) / 2
    assert float(dict(cex.rhs)["x"]) == (a + (b + c) / 2) / 2


def test_forgotten_rescale_is_located_in_the_accumulator():
    """The spec's bug: d is right, o is off by a factor that depends on where the max falls."""
    proof = prove(U.FORGOT_RESCALE)
    failing = [c for c in proof.law("associativity").cases if not c.holds]
    assert failing
    for case in failing:
        bad = [name for name, _, _, method in case.sides if method is None]
        assert bad == ["o"]                              # m and d are proven equal in the case
    cex = proof.counterexample
    assert [n for n, _ in cex.residue] == ["o"]
    assert "b_o" in dict(cex.residue)["o"]
    # the failing case needs the max to move: some maximum is not in the first state
    assert any("<" in cond for cond in cex.conditions)


def test_attention_proof_prints_its_case_split():
    proof = prove(ATTENTION)
    text = str(proof)
    assert "case a_m >= b_m, a_m >= c_m, b_m >= c_m" in text
    assert "expand + powsimp" in text                   # e^x e^y = e^(x+y) closes the case
    assert "e = (-oo, 0, 0)" in text and "e ⊕ e" in text
    assert "d > 0" in text                              # the reachable-state invariant
    assert "one symbol stands for every coordinate" in text
    assoc = proof.law("associativity")
    assert len(assoc.cases) >= 5                        # orderings of the three maxima
    assert repr(proof).startswith("Proof('attention', ok; associativity: proved")


def test_ties_are_closed_with_the_equalities_they_imply():
    comm = prove(LOGSUMEXP).law("commutativity")
    tie = [c for c in comm.cases if "a_m >= b_m" in c.conditions and "b_m >= a_m" in c.conditions]
    assert tie and all("using b_m = a_m" in method for _, _, _, method in tie[0].sides)


def test_reachable_state_invariants():
    d = {x.name: x for x in reachable_domains(WELFORD)[0]}
    assert "positive" in d["n"].facts and "nonnegative" in d["m2"].facts
    assert not d["mean"].facts
    d = {x.name: x for x in reachable_domains(U.MAX_PREFIX_SUM)[0]}
    assert ("ge", "s") in d["best"].facts               # best >= s: an order invariant
    d = {x.name: x for x in reachable_domains(ARGMAX)[0]}
    assert d["v"].infinities and "index" in d["i"].facts  # (-inf, position) is reachable
    d = {x.name: x for x in reachable_domains(LOGSUMEXP)[0]}
    assert not d["m"].infinities                         # -inf only in the adjoined identity


def test_counterexamples_are_searched_inside_the_failing_case():
    """min(a + b, 10) breaks associativity only once a sum passes 10: the witness is drawn
    from the case's own linear facts, not from a fixed pool of small numbers."""
    clamp = ff.Monoid("clamp_sum", fields=("s",), identity=(0.0,),
                      inputs=(ff.Input("x", domain="finite"),), lift=lambda x: (x,),
                      combine=lambda a, b: (ops.minimum(a.s + b.s, 10.0),), commutative=True)
    proof = prove(clamp)
    assert proof.failure.name == "associativity"
    cex = proof.counterexample
    assert cex is not None and cex.confirmed, proof.text()
    vals = [float(st["s"]) for _, st in cex.states]
    assert max(vals[0] + vals[1], vals[1] + vals[2]) > 10


def test_a_case_split_on_a_nonlinear_condition_gives_a_counterexample():
    """A bonus where ``a·b > 1`` breaks associativity; the failing case is selected by
    that nonlinear comparison, and testing a candidate against it failed with
    ``int() argument must be ... not 'BooleanTrue'`` instead of giving the witness."""
    bonus = ff.Monoid("product_bonus", fields=("s",), identity=(0.0,),
                      inputs=(ff.Input("x", domain="finite"),), lift=lambda x: (x,),
                      combine=lambda a, b: (a.s + b.s + ops.where(a.s * b.s > 1.0, 1.0, 0.0),),
                      commutative=True)
    proof = prove(bonus)
    assert proof.failure.name == "associativity"
    assert proof.counterexample is not None and proof.counterexample.confirmed, proof.text()


def test_wrong_identity_fails():
    bad = ff.Monoid("sum_with_identity_one", fields=("s",), identity=(1.0,),
                    inputs=(ff.Input("x", domain="finite"),),
                    lift=lambda x: (x,), combine=lambda a, b: (a.s + b.s,), commutative=True)
    proof = prove(bad)
    assert proof.law("associativity").proved
    assert proof.failure.name == "identity" and proof.counterexample.confirmed


def test_wrongly_declared_commutativity_fails():
    wrong = ff.Monoid("mps_claims_commutative", fields=U.MAX_PREFIX_SUM.fields,
                      identity=U.MAX_PREFIX_SUM.identity, inputs=U.MAX_PREFIX_SUM.inputs,
                      lift=U.MAX_PREFIX_SUM.lift, combine=U.MAX_PREFIX_SUM.combine,
                      commutative=True)
    proof = prove(wrong)
    assert proof.law("associativity").proved
    assert proof.failure.name == "commutativity" and proof.counterexample.confirmed


def test_missing_pivot_guard_breaks_the_adjoined_identity():
    """Without where(isinf(m), 0, m), e ⊕ e computes exp(-inf - (-inf)) = NaN."""
    naive = ff.Monoid(
        "lse_without_guard", fields=("m", "d"), identity=(-ops.inf, 0.0),
        lift=lambda x: (x, ops.where(x > -ops.inf, 1.0, 0.0)),
        combine=lambda a, b: (ops.maximum(a.m, b.m),
                              a.d * ops.exp(a.m - ops.maximum(a.m, b.m))
                              + b.d * ops.exp(b.m - ops.maximum(a.m, b.m))),
        commutative=True)
    proof = prove(naive)
    assert proof.law("associativity").proved
    ident = proof.law("identity")
    assert not ident.proved
    bad = [c for c in ident.cases if not c.holds]
    assert [c.conditions for c in bad] == [("e ⊕ e",)]
    assert "nan" in bad[0].text()


def test_ops_without_symbolic_meaning_are_reported():
    table = ff.ops.Buffer(np.arange(4.0))
    with_load = ff.Monoid("with_load", fields=("s",), identity=(0.0,), lift=lambda x: (x,),
                          combine=lambda a, b: (a.s + b.s * table[0],))
    with pytest.raises(ProofError, match="load"):
        prove(with_load)


def test_a_field_holding_a_truth_value_is_reported():
    """ANY (lift ``x > 0``, combine ``a.s | b.s``) keeps comparisons in its field; prove
    fed them to SymPy and failed with ``SympifyError: cannot sympify ... _Rel``, which
    ``flashfold check --prove`` does not catch. It is a ProofError naming the result."""
    any_positive = ff.Monoid("any_positive", fields=("s",), identity=(0.0,),
                             lift=lambda x: (x > 0,),
                             combine=lambda a, b: (ops.logical_or(a.s, b.s),), commutative=True)
    assert ff.check_laws(any_positive)
    with pytest.raises(ProofError, match="any_positive.lift: result 0 is a truth value"):
        prove(any_positive)


def test_a_law_whose_sides_are_nan_is_not_proved():
    """SymPy's ``nan == nan`` is True: a combine that makes NaN of valid states (inf + -inf;
    0 x inf) must not pass as "identical" on both sides. check_laws rejects the same
    monoids (its "no NaN" law)."""
    signs = Monoid("signs", ("s",), (0.0,), lift=lambda x: (ops.where(x > 0, ops.inf, -ops.inf),),
                   combine=lambda a, b: (a.s + b.s,), commutative=True)
    product = Monoid("product", ("s",), (1.0,), lift=lambda x: (x,),
                     combine=lambda a, b: (a.s * b.s,), commutative=True)
    for m in (signs, product):
        assert not ff.prove(m), m.name
        assert not ff.check_laws(m, trials=300, seed=0).ok, m.name


def test_prove_validates_its_argument():
    with pytest.raises(TypeError, match="monoid"):
        prove("sum")


def test_check_prove_on_the_command_line(capsys, monkeypatch):
    import os
    monkeypatch.chdir(os.path.dirname(__file__))
    assert main(["check", "user_monoids:MAX_PREFIX_SUM", "--trials", "100", "--prove"]) == 0
    out = capsys.readouterr().out
    assert "is a monoid: PROVED" in out and "best >= s" in out
    assert main(["check", "user_monoids:FORGOT_RESCALE", "--trials", "100", "--prove"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "counterexample (associativity)" in out and "confirmed" in out
    # without --prove, no proof is printed
    assert main(["check", "user_monoids:MATMUL2", "--trials", "100"]) == 0
    assert "is a monoid" not in capsys.readouterr().out


def test_import_flashfold_stays_light():
    code = ("import sys, flashfold, flashfold.monoids, flashfold.error_analysis, flashfold.cli;"
            "import flashfold.algebra.transport, flashfold.algebra.homomorphism;"
            "assert 'sympy' not in sys.modules, 'sympy'; "
            "assert 'matplotlib' not in sys.modules, 'matplotlib'; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_a_small_max_paths_is_named_in_the_error():
    """prove(MAX, max_paths=1) blamed a non-terminating case split, not the limit the
    caller chose."""
    from flashfold.monoids import MAX
    with pytest.raises(ProofError, match=r"more than max_paths=1 cases: pass a larger max_paths"):
        prove(MAX, max_paths=1)


def test_a_lift_that_gives_nan_is_not_assumed_finite():
    """lift(-inf) = -inf - -inf + -inf is NaN, on which this comparison-based max is neither
    commutative nor has -inf as identity (NumPy: e ⊕ NaN = NaN, NaN ⊕ e = -inf); the
    NaN was taken for "finiteness not shown, assumed finite" and the proof said PROVED."""
    nan_lift = ff.Monoid("nan_lift", fields=("s",), identity=(-ops.inf,),
                         lift=lambda x: (x - x + x,),
                         combine=lambda a, b: (ops.where(a.s > b.s, a.s, b.s),),
                         commutative=True)
    assert not ff.check_laws(nan_lift).ok
    proof = prove(nan_lift)
    assert not proof.ok, proof.text()
    assert not proof.law("identity").proved and not proof.law("commutativity").proved
    cex = proof.law("identity").counterexample
    assert cex is not None and cex.confirmed
