"""The kernel templates compile for an H200 (sm_90) with Triton's real compiler.

The interpreter accepts programs the compiler rejects, so every template variant that the
public functions launch is compiled here, without a GPU, by
:mod:`flashfold.kernels.reduce.aot` (in a subprocess: the kernels must not be
interpreted). Checks what the performance reasoning relies on: no register spills, and
16-byte vector loads/stores on the hot paths (16K-element rows, fp32 and bf16).
"""

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "flashfold.kernels.reduce.aot", "--json"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return {(row["name"], row["launch"]): row for row in json.loads(r.stdout.strip().splitlines()[-1])}


#: spills accepted, each bounded so that growth shows: (variant, launch) -> bytes
KNOWN_SPILLS_OTHER_PTXAS = {
    # Triton 3.9's ptxas (CUDA 13) spills 8 bytes in the reduce-then-scan block scan since
    # row maxima propagate NaN (tl.reduce over maximum(propagate_nan=ALL)); the ptxas of
    # 3.6, the GPU machine's, spills nothing there, and the H200 measured no cost on the
    # block scans (logcumsumexp 16K x 16K: fp32 1.000x, bf16 0.997x the time before)
    ("scan logcumsumexp reduce-then-scan 1x2^22", 1): 8,
}


def test_every_variant_compiles_without_spills(compiled):
    """No spills, except the look-back scans, capped at 128 registers (two programs per
    SM) at the price of a few spilled bytes (see launch._plan_lookback), and, with another
    ptxas than the one the budgets were measured with, :data:`KNOWN_SPILLS_OTHER_PTXAS`."""
    from compile_worker import spill_budgets_apply

    assert len(compiled) >= 30
    known = {} if spill_budgets_apply() else KNOWN_SPILLS_OTHER_PTXAS
    spilled = {k: v["spill_stores"] for k, v in compiled.items()
               if v["spill_stores"] and not (v["kernel"] == "lookback_scan_kernel"
                                             and v["spill_stores"] <= 64 and v["registers"] <= 128)
               and not v["spill_stores"] <= known.get(k, 0)}
    assert not spilled, spilled


@pytest.mark.parametrize("name", ["reduce sum", "reduce logsumexp2", "reduce welford",
                                  "reduce argmax", "softmax", "cumsum", "logcumsumexp"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hot_paths_use_vector_loads(compiled, name, dtype):
    """16-byte vectors everywhere (logcumsumexp included: its block scan loads like
    cumsum's, where the chunked scan it replaced had 8-byte vectors in 16-bit dtypes)."""
    row = compiled[(f"{name} 64x16384 {dtype}", 0)]
    want = "ld.global.v4.b32"
    assert set(row["loads"]) == {want}, row["loads"]
    if name in ("softmax", "cumsum", "logcumsumexp"):
        assert set(row["stores"]) == {want.replace("ld.", "st.")}, row["stores"]


def test_fused_softmax_keeps_two_programs_per_sm(compiled):
    """16 warps x 64 registers: two programs fit the 64K registers of an SM."""
    row = compiled[("softmax 64x16384 float32", 0)]
    assert row["num_warps"] == 16 and row["registers"] <= 64


def test_misaligned_rows_realigned_by_default_scalar_when_switched_off(compiled):
    """4096 x 12345 fp32 rows start off 16-byte boundaries. The default plans realign the
    tiles and load nothing but 16-byte vectors (faster in kernel time on the H200); with
    ``ALIGN_ROWS`` off the same rows load as scalars."""
    for name in ("reduce logsumexp2 4096x12345", "reduce welford 4096x12345"):
        assert set(compiled[(name, 0)]["loads"]) == {"ld.global.v4.b32"}, name
    for m in ("logsumexp2", "welford"):
        row = compiled[(f"reduce {m} 4096x12345 scalar loads", 0)]
        assert set(row["loads"]) == {"ld.global.b32"}, row["loads"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefetching_chunked_scan_keeps_vector_loads(compiled, dtype):
    """The chunked scan that loads the next tile early (PREFETCH): the loop's loads stay
    vectors (the row's first tile is loaded with a mask, as scalars)."""
    row = compiled[(f"logcumsumexp prefetch 64x16384 {dtype}", 0)]
    want = "ld.global.v4.b32" if dtype == "float32" else "ld.global.v2.b32"
    assert want in row["loads"], row["loads"]
    assert set(row["stores"]) == {want.replace("ld.", "st.")}, row["stores"]


@pytest.mark.parametrize("name,loads,stores", [
    ("reduce weighted_mean 64x16384 float32", 32, None),
    ("reduce weighted_mean 64x16384 bfloat16", 16, None),
    ("reduce weighted_mean broadcast row 64x16384", 32, None),
    ("reduce covariance 64x16384", 32, None),
    ("scan linear_recurrence 1024x16384 float32", 16, 8),
    ("scan linear_recurrence 1024x16384 bfloat16", 8, 4),
])
def test_several_inputs_load_16_byte_vectors(compiled, name, loads, stores):
    """Monoids of two inputs on the hot paths: every input of the tile is read as 16-byte
    vectors (two per element position: the loop's tile and the masked tail's, for each
    input), the scan's output written as 16-byte vectors, no spills; a broadcast row of
    weights (stride 0 over the rows) loads like a full input."""
    row = compiled[(name, 0)]
    assert row["loads"] == {"ld.global.v4.b32": loads}, row["loads"]
    if stores is not None:
        assert row["stores"] == {"st.global.v4.b32": stores}, row["stores"]
    assert not row["spill_stores"], row["spill_stores"]


def test_several_inputs_registers(compiled):
    """Registers of the two-input variants (sm_90, Triton 3.6), for occupancy: the
    weighted mean at most 64 (4 programs of 8 warps per SM, as SUM's 42), the recurrence
    scan at most 96 (2 programs of 8 warps). Checked with the ptxas these budgets were
    measured with (``compile_worker.SPILL_BUDGET_TRITON``)."""
    from compile_worker import spill_budgets_apply
    if not spill_budgets_apply():
        pytest.skip("register budgets are measured with Triton 3.6's ptxas")
    assert compiled[("reduce weighted_mean 64x16384 float32", 0)]["registers"] <= 64
    assert compiled[("scan linear_recurrence 1024x16384 float32", 0)]["registers"] <= 96


def test_ordered_reduce_folds_vectors_in_registers(compiled):
    """An in-order reduce (AFFINE_HALF, not commutative) of 16K-element rows: its lanes
    fold a 16-byte vector of consecutive elements in registers, then are scanned in order
    once per tile; against the one-element lanes (scanned once per element) it loads the
    same 16-byte vectors and runs under half the SASS instructions per element (loop and
    tail bodies over the elements a thread holds in a tile)."""
    new = compiled[("reduce affine ordered 1024x16384", 0)]
    old = compiled[("reduce affine ordered 1024x16384 one-element lanes", 0)]
    assert set(new["loads"]) == {"ld.global.v4.b32"}, new["loads"]
    per_new = new["sass"] / (2 * 4 * 512 // (32 * new["num_warps"]))
    per_old = old["sass"] / (2 * 512 * 2 // (32 * old["num_warps"]))
    assert per_new <= 32 and per_new < 0.5 * per_old, (per_new, per_old)


_STATE_TYPES = """
import torch
from flashfold import Field, Monoid, ops
from flashfold.kernels.aot import compile_launch
from flashfold.kernels.reduce import launch as L
monoids = (
    Monoid("any_positive", fields=("s",), identity=(0.0,), lift=lambda x: (x > 0,),
           combine=lambda a, b: (ops.logical_or(a.s, b.s),), commutative=True),
    Monoid("floor_sum", fields=(Field("s", dtype="int"),), identity=(0,),
           lift=lambda x: (ops.floor(x),), combine=lambda a, b: (a.s + b.s,),
           commutative=True))
x = torch.empty(64, 4096)
for m in monoids:
    for plan in (L.plan_reduce(m, x, 1, sms=132)[0], L.plan_scan(m, x, 1, sms=132)[0]):
        for launch in plan:
            compile_launch(launch.kernel, launch.args, launch.kwargs)
"""


def test_state_fields_take_their_type_from_the_field():
    """A lift or combine may give a field a value of another type, which the reference
    stores as the field's (a truth value in a float field, ``floor`` of a float in an int
    field): the kernels convert it too, where ``tl.reduce`` / ``tl.associative_scan``
    refused to compile a combine whose results differ in type from its operands (the
    interpreter ran it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _STATE_TYPES], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
