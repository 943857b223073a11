"""Compile workers: a test file that, run as a script, compiles kernels for sm_90 and
prints one JSON line per variant (``tests/test_attention_compile.py`` and its siblings).

It must run in a fresh process without ``TRITON_INTERPRET`` (``@triton.jit`` returns
interpreter objects when it is set, and ``tests/conftest.py`` sets it), with the
checkout's ``src`` on the path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def have_ptxas() -> bool:
    """Whether Triton's NVIDIA backend, with its ``ptxas``, is installed."""
    try:
        import triton
    except ImportError:
        return False
    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia",
                                       "bin", "ptxas"))


def compile_env() -> dict:
    """The environment of a compile worker: this one without ``TRITON_INTERPRET``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


def worker_rows(path: str, timeout: int = 600) -> list[dict]:
    """The JSON rows printed by ``python path``; skips the test without ``ptxas``, fails
    it when the worker printed none."""
    if not have_ptxas():
        # an environment without Triton's NVIDIA backend (CI's Linux wheel ships it, so
        # these tests run there): nothing can be compiled
        pytest.skip("Triton's NVIDIA backend (ptxas) is not installed")
    proc = subprocess.run([sys.executable, os.path.abspath(path)], env=compile_env(),
                          capture_output=True, text=True, timeout=timeout)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if not rows:
        pytest.fail(f"compile worker produced nothing:\n{proc.stderr[-3000:]}")
    return rows
