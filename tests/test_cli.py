"""The `flashfold` command: check, trace, and the console script itself."""

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


def test_trace_prints_the_worked_example(capsys):
    assert main(["trace", "1", "2", "5", "3", "--block", "2",
                 "--values", "1,0", "0,1", "2,0", "0,2", "--precision", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "m = 2" in out[0] and "l = 1.368" in out[0]
    assert "m = 5" in out[1] and "scale = 0.050" in out[1] and "l = 1.203" in out[1]
    assert "O = [2.018, 0.320]" in out[1]
    assert "output O / l = [1.677, 0.266]" in out[2]


def test_trace_rejects_bad_values():
    with pytest.raises(SystemExit, match="values"):
        main(["trace", "1", "2", "--block", "1", "--values", "1,0"])
    with pytest.raises(SystemExit, match="block"):
        main(["trace", "1", "2", "--block", "0"])


def test_console_script_runs_demo():
    r = subprocess.run([sys.executable, "-m", "flashfold.cli", "demo"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "all orders agree" in r.stdout


def test_no_command_prints_help(capsys):
    assert main([]) == 2
