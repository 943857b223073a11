"""The `flashfold` command: check, trace, and the console script itself."""

import math
import os
import subprocess
import sys

import pytest

from flashfold.cli import main

HERE = os.path.dirname(__file__)


def test_check_passes_on_a_lawful_user_monoid(capsys, monkeypatch):
    monkeypatch.chdir(HERE)
    assert main(["check", "user_monoids:MATMUL2", "--trials", "300"]) == 0
    out = capsys.readouterr().out
    assert "associativity : ok" in out and "commutativity : n/a" in out


def test_check_fails_with_a_counterexample(capsys, monkeypatch):
    monkeypatch.chdir(HERE)
    assert main(["check", "user_monoids:AVERAGE", "--trials", "300"]) == 1
    out = capsys.readouterr().out
    assert "associativity : FAILED" in out and "counterexample" in out and "(a*b)*c" in out


@pytest.mark.parametrize("target,msg", [
    ("user_monoids", "MODULE:NAME"),
    ("no_such_module_xyz:M", "cannot import"),
    ("user_monoids:NOPE", "no attribute"),
    ("user_monoids:NOT_A_MONOID", "not a flashfold Monoid"),
])
def test_check_reports_bad_targets(target, msg, monkeypatch):
    monkeypatch.chdir(HERE)
    with pytest.raises(SystemExit, match=msg):
        main(["check", target])


def test_check_reports_a_module_that_raises_at_import(tmp_path, monkeypatch):
    """A user module that raises while it is imported (a bad monoid, a typo) is one line,
    not a traceback."""
    (tmp_path / "raises_at_import_cli.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit, match="importing 'raises_at_import_cli' raised "
                                         "RuntimeError: boom"):
        main(["check", "raises_at_import_cli:M"])


def test_trace_prints_the_worked_example(capsys):
    assert main(["trace", "1", "2", "5", "3", "--block", "2",
                 "--values", "1,0", "0,1", "2,0", "0,2", "--precision", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "m = 2" in out[0] and "l = 1.368" in out[0]
    assert "m = 5" in out[1] and "scale = 0.050" in out[1] and "l = 1.203" in out[1]
    assert "O = [2.018, 0.320]" in out[1]
    assert "output O / l = [1.677, 0.266]" in out[2]


def test_trace_keeps_a_nan_max_nan():
    """A NaN score makes the running max NaN: the factor on the previous state is NaN from
    there on (it was printed as 0); all-masked blocks so far keep the factor 0."""
    from flashfold.cli import trace_blocks
    rows, out, lse = trace_blocks([1.0, math.nan, 2.0], 1)
    assert rows[0]["scale"] == 0.0                      # the identity state: nothing to scale
    assert all(math.isnan(r["scale"]) and math.isnan(r["m"]) for r in rows[1:])
    assert all(math.isnan(x) for x in out) and math.isnan(lse)
    rows, _, _ = trace_blocks([-math.inf, -math.inf, 3.0], 1)
    assert [r["scale"] for r in rows] == [0.0, 0.0, 0.0]


def test_trace_takes_masked_and_exponent_scores(capsys):
    """``-inf`` (a masked score) and ``-1e5`` are values, not unknown options."""
    assert main(["trace", "-inf", "2", "-1e5", "-INF", "--block", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "softmax = [0.0000, 1.0000, 0.0000, 0.0000]" in out[-1]


def test_trace_rejects_bad_values():
    with pytest.raises(SystemExit, match="values"):
        main(["trace", "1", "2", "--block", "1", "--values", "1,0"])


def test_trace_names_value_vectors_of_different_lengths():
    """``--values 1,0 0,1,1`` is one line naming the values (it was NumPy's message about
    an inhomogeneous shape)."""
    with pytest.raises(SystemExit, match=r"^flashfold trace: values: expected vectors of one "
                                         r"length, got lengths \[2, 3\]"):
        main(["trace", "1", "2", "--block", "1", "--values", "1,0", "0,1,1"])


def test_console_script_runs_demo():
    r = subprocess.run([sys.executable, "-m", "flashfold.cli", "demo"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "all orders agree" in r.stdout


def test_no_command_prints_help(capsys):
    assert main([]) == 2


# --- a user's mistake: one line on stderr, a non-zero exit, no traceback ----------------

USAGE_ERRORS = [
    (["check", "user_monoids:AVERAGE", "--trials", "0"], "--trials: expected an int >= 1"),
    (["check", "user_monoids:AVERAGE", "--trials", "x"], "--trials: expected an int"),
    (["check", "user_monoids:AVERAGE", "--seed", "-1"], "--seed: expected an int >= 0"),
    (["trace", "2", "4", "--block", "2", "--precision", "-1"], "--precision: expected an int"),
    (["trace", "2", "4", "--block", "0"], "--block: expected an int >= 1"),
    (["numerics", "--max-n", "5"], "--max-n: expected a whole number >= 10"),
    (["numerics", "--max-n", "abc"], "--max-n: expected a number"),
    (["numerics", "--max-n", "1e400"], "--max-n: expected a whole number"),
    (["numerics", "--max-n", "10.5"], "--max-n: expected a whole number"),
    (["numerics", "--block", "0"], "--block: expected an int >= 1"),
    (["numerics", "--width", "0"], "--width: expected an int >= 1"),
    (["numerics", "--seed", "-3"], "--seed: expected an int >= 0"),
    (["no_such_command"], "invalid choice"),
]


@pytest.mark.parametrize("argv,msg", USAGE_ERRORS,
                         ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_bad_options_are_one_line_and_exit_2(argv, msg, capsys, monkeypatch):
    monkeypatch.chdir(HERE)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and msg in err and "Traceback" not in err, err
    assert err.startswith("flashfold")


@pytest.mark.parametrize("target", [":AVERAGE", "user_monoids:", ".user_monoids:AVERAGE",
                                    "user monoids:AVERAGE", "user_monoids:AVERAGE:x"])
def test_malformed_targets_are_one_line(target, monkeypatch):
    monkeypatch.chdir(HERE)
    with pytest.raises(SystemExit, match="^flashfold check: expected MODULE:NAME") as e:
        main(["check", target])
    assert "\n" not in str(e.value)


def test_an_output_directory_that_cannot_be_made_is_refused_before_computing(tmp_path, capsys):
    f = tmp_path / "a_file"
    f.write_text("")
    for out, msg in ((f / "sub", "is not a directory"), (f, "exists and is not a directory")):
        with pytest.raises(SystemExit) as e:
            main(["numerics", "--max-n", "10", "--quiet", "--out", str(out)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and "--out" in err and msg in err, err


def test_numerics_library_checks_out_and_seed_before_computing(tmp_path):
    from flashfold.error_analysis import numerics
    f = tmp_path / "a_file"
    f.write_text("")
    said = []
    with pytest.raises(ValueError, match="^out: cannot make the directory"):
        numerics(10, out=str(f / "sub"), progress=said.append)
    with pytest.raises(ValueError, match="^seed: expected an int >= 0"):
        numerics(10, seed=-1, progress=said.append)
    with pytest.raises(TypeError, match="^seed"):
        numerics(10, seed="x", progress=said.append)
    assert said == []                                   # nothing was computed


def test_numerics_and_fp8_table_arguments_are_named(tmp_path):
    """Bad arguments raise TypeError / ValueError naming them, before anything is computed;
    NumPy ints are ints."""
    import numpy as np

    from flashfold.error_analysis import fp8_error_table, numerics
    said = []
    for kw, exc, name in [(dict(std="1"), TypeError, "std"), (dict(std=None), TypeError, "std"),
                          (dict(std=math.inf), ValueError, "std"),
                          (dict(block=0), ValueError, "block"),
                          (dict(width="2"), TypeError, "width"),
                          (dict(dtypes="float32"), TypeError, "dtypes"),
                          (dict(orders="tree"), TypeError, "orders")]:
        with pytest.raises(exc, match=f"^{name}: "):
            numerics(10, progress=said.append, **kw)
    assert said == []
    r = numerics(n_values=[10], block=np.int64(4), width=np.int64(2), progress=False)
    assert r.ok and r.block == 4 and r.width == 2
    for kw, exc, name in [(dict(n=0), ValueError, "n"), (dict(n=-1), ValueError, "n"),
                          (dict(head_dim=0), ValueError, "head_dim"),
                          (dict(heads=1.5), TypeError, "heads"),
                          (dict(outlier_channels=9, head_dim=8), ValueError, "outlier_channels"),
                          (dict(outlier_scale=math.nan), ValueError, "outlier_scale")]:
        with pytest.raises(exc, match=f"^{name}: "):
            fp8_error_table(**kw)
    assert "1 x 1 heads x 16 x 8" in fp8_error_table(n=16, head_dim=8, heads=1)


@pytest.fixture
def no_matplotlib(monkeypatch):
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import raises ImportError


def test_numerics_without_matplotlib_writes_the_table_and_says_so_first(tmp_path, capsys,
                                                                        no_matplotlib):
    out = tmp_path / "n"
    assert main(["numerics", "--max-n", "10", "--quiet", "--out", str(out)]) == 0
    cap = capsys.readouterr()
    assert "pip install 'flashfold[plot]'" in cap.err and "Traceback" not in cap.err
    assert (out / "numerics.md").exists() and not (out / "numerics.png").exists()
    assert "figure skipped" in cap.out and "numerics.md" in cap.out


def test_numerics_plot_true_without_matplotlib_fails_before_computing(tmp_path, no_matplotlib):
    from flashfold.error_analysis import numerics
    said = []
    with pytest.raises(ImportError, match=r"flashfold\[plot\]"):
        numerics(10, out=str(tmp_path), plot=True, progress=said.append)
    assert said == []
    r = numerics(10, out=str(tmp_path / "t"), plot=None, progress=False)
    assert r.png is None and os.path.exists(r.markdown)


WRONG_CLAIMS = '''
import flashfold as ff
from flashfold import ops
BADMAX = ff.Monoid("badmax", fields=("m",), identity=(0.0,), lift=lambda x: (x,),
                   combine=lambda a, b: (ops.maximum(a.m, b.m),), commutative=True)
KEEP_LEFT = ff.Monoid("keep_left", fields=("a",), identity=(0.0,), lift=lambda x: (x,),
                      combine=lambda a, b: (a.a,), commutative=True)
'''


@pytest.mark.parametrize("name,law", [("BADMAX", "identity      : FAILED"),
                                      ("KEEP_LEFT", "commutativity : FAILED")])
def test_check_fails_a_wrong_identity_and_a_wrong_commutativity(name, law, tmp_path, capsys,
                                                                monkeypatch):
    (tmp_path / "wrong_claims_cli.py").write_text(WRONG_CLAIMS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["check", f"wrong_claims_cli:{name}", "--trials", "300"]) == 1
    assert law in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["check", ":AVERAGE"], ["numerics", "--max-n", "1e400"],
                                  ["bench", "--from-log", "/no/such/file.log"]],
                         ids=lambda a: " ".join(a))
def test_console_prints_no_traceback(argv):
    r = subprocess.run([sys.executable, "-m", "flashfold.cli", *argv], capture_output=True,
                       text=True, timeout=120, cwd=HERE)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
