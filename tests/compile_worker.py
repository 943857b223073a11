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


#: the Triton whose ptxas the register and spill budgets of the compile tests were tuned
#: and measured with: the GPU machine's (3.6 assembles sm_90 with CUDA 12.8's ptxas). Triton
#: 3.9 assembles with CUDA 13's ptxas-blackwell, which allocates the same kernels
#: differently (sm_90, measured: +8 to +200 bytes of spills on a handful of variants, fewer
#: on others), and no GPU timing says what those spills cost there. On other versions the
#: compile tests still check that every variant compiles and every instruction fact (TMA,
#: wgmma, shared memory); the spill budgets are checked where they were measured.
SPILL_BUDGET_TRITON = "3.6."


def spill_budgets_apply() -> bool:
    """Whether the installed Triton is the one the spill budgets were measured with."""
    import triton
    return triton.__version__.startswith(SPILL_BUDGET_TRITON)


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


#: shared memory per block on sm_90
SMEM_LIMIT = 227 * 1024


def ws_facts(compiled) -> dict:
    """What the warp-specialization checks read from a compiled Gluon kernel
    (:func:`flashfold.kernels.aot.compile_launch`): registers, spill stores, shared memory,
    TMA and wgmma use, the ``setmaxnreg`` values and the thread counts of named barriers."""
    import re
    res = compiled.resources()
    return dict(
        regs=compiled.registers, spill=res["spill_stores"], serialized=res["wgmma_serialized"],
        smem=compiled.shared, tma=compiled.uses_tma, wgmma=compiled.uses_wgmma,
        setmaxnreg=sorted({int(n) for n in re.findall(
            r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", compiled.ptx)}),
        bar_threads=sorted({int(n) for n in re.findall(r"bar\.sync\s+\d+,\s*(\d+)",
                                                       compiled.ptx)}))


def assert_warp_specialized(r: dict, vid: str) -> None:
    """A worker row (:func:`ws_facts` and ``ok``) of a producer / two-consumer Gluon kernel:
    compiled, TMA and wgmma, the producer warp down to 24 registers and the consumers up to
    240, shared memory within the limit, and no named barrier spanning both consumer
    warpgroups (one that did held them in lockstep: see ``tests/test_attention_gluon.py``),
    and wgmma that ptxas did not serialize."""
    assert r is not None, f"{vid} was not compiled"
    assert r["ok"], r.get("error")
    assert r["tma"] and r["wgmma"], f"{vid}: TMA {r['tma']}, wgmma {r['wgmma']}"
    assert 24 in r["setmaxnreg"] and 240 in r["setmaxnreg"], r["setmaxnreg"]
    assert r["smem"] <= SMEM_LIMIT, f"{vid}: {r['smem']} bytes of shared memory"
    assert r["bar_threads"] and all(t <= 128 for t in r["bar_threads"]), r["bar_threads"]
    # ptxas's warning C7515: the wgmma were serialized (each waits for the previous one)
    assert not r["serialized"], f"{vid}: ptxas serialized the wgmma"


def emit_rows(variants, facts) -> None:
    """Print one worker row per variant ``(vid, *args)``: ``{"id": vid, "ok": True,
    **facts(*args)}``, or the error that ``facts`` raised (``ok`` false; the test then
    fails with it)."""
    for vid, *args in variants:
        try:
            row = dict(id=vid, ok=True, **facts(*args))
        except Exception as e:  # reported, then asserted by the test
            row = dict(id=vid, ok=False, error=repr(e)[-2000:])
        print(json.dumps(row), flush=True)


def gluon_rows(path: str) -> dict:
    """The rows of a Gluon compile worker (``python path``) by id. Gluon ships with Triton
    >= 3.5 (flashfold accepts >= 3.2, which dispatches no call to a Gluon kernel); CI's
    Triton 3.6 has it, so these compile tests run there."""
    pytest.importorskip("triton.experimental.gluon")
    return {r["id"]: r for r in worker_rows(path)}
