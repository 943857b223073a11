"""The generated reduce kernels against the float64 reference schedules.

Runs the Triton kernels on CPU tensors under ``TRITON_INTERPRET=1`` (conftest) at small,
awkward sizes, for every built-in and for user monoids defined only in the tests
(MATMUL2 and MAX_PREFIX_SUM are associative but not commutative). Each dispatch branch
is forced by patching the launcher's heuristics: lane tiles with a loop and a masked
tail, short rows (many rows per program), columns (reduced dim strided), split-K with
its second in-order pass, int64 offsets, and the copy fallback for >3 batch dims.

Note on ordering: the interpreter runs ``tl.reduce``/``tl.associative_scan`` combines as
a sequential left fold, so it cannot reveal a GPU's reassociation; the *kernel's own*
reorderings (lanes of a tile take elements ``k·LANES + l``) are visible here, which is
what the negative control below checks. ``benchmarks/reductions.py`` repeats the
order-sensitive checks on the GPU.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashfold.monoids as M
from flashfold.kernels.reduce import launch as L
from plan_forcing import force  # noqa: F401  (a fixture)
from flashfold.kernels.reduce import reference as R
from flashfold.testing import assert_close

import user_monoids as U

ALL = (M.SUM, M.MAX, M.MIN, M.LOGSUMEXP, M.LOGSUMEXP2, M.WELFORD, M.ARGMAX, M.ARGMIN,
       U.MINMAX, U.MATMUL2, U.MAX_PREFIX_SUM)
ORDERED = (U.MATMUL2, U.MAX_PREFIX_SUM)
EXACT = {"max", "min", "argmax", "argmin", "minmax"}


def sample(monoid, shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    sigma = 0.1 if monoid is U.MATMUL2 else 1.0
    x = torch.randn(*shape, generator=g) * sigma
    if monoid.name in ("argmax", "argmin", "max", "min", "minmax"):
        x = torch.round(x * 2) / 2          # ties: the lowest index must win
    return x.to(dtype)


def check(monoid, outs, x, dim, params=None, name="", reduced=True):
    """Compare kernel outputs with the float64 reference (exact for selections)."""
    params = params or {}
    if reduced:
        ref = R.reduce_reference(monoid, x, dim, **params)
    else:
        ref = R.scan_reference(monoid, x, dim, **params)
    scale = R.error_scale(monoid, x, dim)
    if reduced:
        scale = np.squeeze(scale, axis=dim)
    assert len(outs) == len(ref)
    for i, (o, r) in enumerate(zip(outs, ref)):
        label = f"{name} {monoid.name} output {i}"
        assert tuple(o.shape) == tuple(r.shape), label
        if not r.dtype.is_floating_point:
            assert o.dtype == torch.int64, label
            assert torch.equal(o, r), label
        elif monoid.name in EXACT:
            assert torch.equal(o.double(), r.to(x.dtype).double()), label
        else:
            assert o.dtype == x.dtype, label
            assert_close(o, r, o.dtype, scale=scale, name=label)


C = L.Config


@pytest.mark.parametrize("n", (7, 37), ids=("small", "short"))
@pytest.mark.parametrize("monoid", ALL, ids=lambda m: m.name)
def test_rows_natural_heuristics(monoid, n):
    """(3, 7): one row per thread, folded in registers (SMALL); (3, 37): short-row
    tiles, many rows per program, the tail masked."""
    x = sample(monoid, (3, n))
    plan, _ = L.plan_reduce(monoid, x, -1)
    assert plan[0].kwargs["SMALL"] == (n <= L.SMALL_N)
    check(monoid, L.launch_reduce(monoid, x, -1), x, -1, name="rows")


@pytest.mark.parametrize("align", (True, False), ids=("realigned", "as-is"))
@pytest.mark.parametrize("monoid", ALL, ids=lambda m: m.name)
def test_lane_tiles_loop_and_tail(monoid, align, force, monkeypatch):
    """Long-row layout: tiles [K=2, LANES=8] (ordered: [1, 8]), 130 = 8 full tiles + 2;
    rows of 130 start off 16-byte boundaries, so the realigned path (tiles shifted to an
    aligned start, masked at both ends) runs unless switched off."""
    monkeypatch.setattr(L, "ALIGN_ROWS", align)
    ordered = monoid in ORDERED
    force(reduce=C(1, 8, 1, 4) if ordered else C(2, 8, 1, 4))
    x = sample(monoid, (2, 130), seed=1)
    plan, _ = L.plan_reduce(monoid, x, 1)
    assert plan[0].kwargs["ALIGN"] == (4 if align else 0)
    check(monoid, L.launch_reduce(monoid, x, 1), x, 1, name="lanes")


@pytest.mark.parametrize("monoid", ORDERED, ids=lambda m: m.name)
def test_ordered_lanes_fold_vectors_in_order(monoid, force, monkeypatch):
    """VFOLD, the default for contiguous ordered rows: each lane folds its 4 consecutive
    elements in registers, then the lanes are scanned in order once per tile. Rows of 130
    (misaligned: realigned head) in tiles of 4 x 8 (4 full tiles, a tail ending inside a
    vector); 3 rows in blocks of 2 (masked rows); split-K chunks of it; and with
    ``VFOLD`` off the natural plan is the one-element lanes of before."""
    x = sample(monoid, (3, 130), seed=12)
    plan, _ = L.plan_reduce(monoid, x, 1)
    assert plan[0].kwargs.get("VFOLD") and plan[0].kwargs["K"] == 4
    check(monoid, L.launch_reduce(monoid, x, 1), x, 1, name="natural")
    force(reduce=C(4, 8, 1, 4, vfold=True))
    assert L.plan_reduce(monoid, x, 1)[0][0].kwargs["ALIGN"] == 4
    check(monoid, L.launch_reduce(monoid, x, 1), x, 1, name="vfold")
    force(reduce=C(4, 8, 2, 4, vfold=True))
    check(monoid, L.launch_reduce(monoid, x, 1), x, 1, name="vfold rows")
    force(reduce=C(4, 4, 1, 4, vfold=True), split=(5, 32), states=C(1, 4, 1, 4))
    check(monoid, L.launch_reduce(monoid, x, 1), x, 1, name="vfold split-K")
    monkeypatch.undo()
    monkeypatch.setattr(L, "VFOLD", False)
    plan, _ = L.plan_reduce(monoid, x, 1)
    assert not plan[0].kwargs.get("VFOLD") and plan[0].kwargs["K"] == 1


def test_folding_lanes_reordered_would_break_a_non_commutative_monoid(force, monkeypatch):
    """Negative control for VFOLD: lanes folded in order over elements that are not
    consecutive (the tile's lane-major layout of the commutative path, ``l + k·LANES``,
    with the in-order fold of ``tile_fold``) are caught by the check."""
    force(reduce=C(4, 8, 1, 4, vfold=True))
    build = L._reduce_launch

    def lane_major(*a, **k):
        launch = build(*a, **k)
        launch.kwargs.pop("VFOLD", None)
        return launch
    monkeypatch.setattr(L, "_reduce_launch", lane_major)
    x = sample(U.MATMUL2, (1, 64), seed=9) * 20
    with pytest.raises(AssertionError):
        check(U.MATMUL2, L.launch_reduce(U.MATMUL2, x, 1), x, 1, name="reordered")


@pytest.mark.parametrize("monoid", ALL, ids=lambda m: m.name)
def test_split_k_two_passes(monoid, force):
    """Few long rows: 5 chunks of 24 (+ a short one), then an in-order pass over states."""
    ordered = monoid in ORDERED
    force(reduce=C(1, 8, 1, 4) if ordered else C(2, 4, 1, 4), split=(5, 24),
          states=C(1, 4, 1, 4) if ordered else C(2, 1, 2, 4))
    x = sample(monoid, (3, 107), seed=2)
    plan, _ = L.plan_reduce(monoid, x, 1)
    assert len(plan) == 2 and plan[1].kwargs["FROM_STATES"]
    check(monoid, L.launch_reduce(monoid, x, 1), x, 1, name="split-K")


@pytest.mark.parametrize("monoid", ALL, ids=lambda m: m.name)
def test_columns(monoid):
    """Reducing dim 0 of a row-major matrix: rows of the tile are contiguous columns."""
    x = sample(monoid, (33, 6), seed=3)
    plan, _ = L.plan_reduce(monoid, x, 0)
    if monoid not in ORDERED:
        assert plan[0].kwargs["LANES"] == 1 and plan[0].kwargs["ROWS"] == 8
    check(monoid, L.launch_reduce(monoid, x, 0), x, 0, name="columns")


@pytest.mark.parametrize("monoid", (M.LOGSUMEXP2, M.ARGMAX, U.MATMUL2), ids=lambda m: m.name)
def test_any_dim_any_strides(monoid):
    """Middle dims, transposed and sliced views: read through strides (no copy)."""
    base = sample(monoid, (4, 9, 3, 14), seed=4)
    views = {
        "middle": (base, 1),
        "transposed": (base.transpose(1, 3), 3),
        "sliced": (base[:, ::2, :, 1:12], 3),
        "dim0": (base, 0),
        "permuted": (base.permute(2, 0, 3, 1), 1),
    }
    for name, (x, dim) in views.items():
        plan, _ = L.plan_reduce(monoid, x, dim)
        assert plan[0].args[0][0] is x, f"{name}: the input was copied"
        check(monoid, L.launch_reduce(monoid, x, dim), x, dim, name=name)


def test_more_than_three_batch_dims_copies():
    """Four batch dims that no strides can merge: the documented contiguous copy."""
    base = torch.randn(3, 2, 4, 2, 5, 3)
    x = base.permute(5, 3, 1, 4, 2, 0)[:, :, :, ::2]       # (3, 2, 2, 3, 4, 3)
    g = L.geometry(x.shape, x.stride(), L._reduced_out_strides(x, 1), 1)
    assert g is None
    plan, _ = L.plan_reduce(M.SUM, x, 1)
    assert plan[0].args[0][0] is not x and plan[0].args[0][0].is_contiguous()
    check(M.SUM, L.launch_reduce(M.SUM, x, 1), x, 1, name="copy")


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("monoid", (M.SUM, M.LOGSUMEXP2, M.WELFORD, M.ARGMIN), ids=lambda m: m.name)
def test_half_inputs_fp32_state(monoid, dtype, force):
    force(reduce=C(2, 8, 1, 4))
    x = sample(monoid, (2, 75), dtype, seed=5)
    check(monoid, L.launch_reduce(monoid, x, 1), x, 1, name=str(dtype))


def test_int64_offsets_path(force):
    """The N64 code path (int64 element offsets) gives the same results."""
    force(n64=True, reduce=C(2, 8, 1, 4))
    x = sample(M.LOGSUMEXP2, (2, 70), seed=6)
    assert L.plan_reduce(M.LOGSUMEXP2, x, 1)[0][0].kwargs["N64"]
    check(M.LOGSUMEXP2, L.launch_reduce(M.LOGSUMEXP2, x, 1), x, 1, name="n64")


def test_welford_correction_parameter():
    x = sample(M.WELFORD, (3, 21), seed=7)
    for corr in (0.0, 1.0, 2.5):
        check(M.WELFORD, L.launch_reduce(M.WELFORD, x, 1, {"correction": corr}), x, 1,
              {"correction": corr}, name=f"correction={corr}")
    with pytest.raises(TypeError, match="unknown parameters"):
        L.launch_reduce(M.WELFORD, x, 1, {"ddof": 1})


@pytest.mark.parametrize("monoid", ALL, ids=lambda m: m.name)
def test_edge_rows(monoid):
    """All -inf rows, rows of length 1, and an empty dim (the finalized identity)."""
    if monoid.inputs[0].domain == "finite":
        x = torch.full((2, 5), -3.0)
    else:
        x = torch.full((2, 5), -float("inf"))
    x[1, 2] = 1.0
    check(monoid, L.launch_reduce(monoid, x, 1), x, 1, name="-inf rows")
    one = sample(monoid, (4, 1), seed=8)
    check(monoid, L.launch_reduce(monoid, one, 1), one, 1, name="length 1")
    empty = torch.empty(3, 0)
    check(monoid, L.launch_reduce(monoid, empty, 1), empty, 1, name="empty dim")


def test_pow_mod_and_floordiv_lower_as_the_reference():
    """The generated code computes ``pow``, ``mod`` and ``floordiv`` as the IR (NumPy)
    does: ``x ** 2`` of a negative ``x`` is positive, an odd power keeps the sign,
    ``0 ** 0 == 1``; ``%`` takes the divisor's sign and ``//`` floors, for floats (which
    Triton's ``//`` refuses) and for the ints of positions; on every pair of zeros,
    halves, integers, infinities and NaN (-0.0 is 0.0 to the kernels' pow: its odd
    powers lose the sign). A row of one element makes each output one lift."""
    from flashfold import Input, Monoid, ops
    fields = ("pow", "mod", "floordiv", "square", "cube_inv", "two_pow", "mod_neg",
              "floordiv_neg", "seven_floordiv", "pos_mod", "pos_floordiv")
    ints = ops.to_float
    lifted = Monoid(
        "pow_mod_floordiv", fields=fields, identity=(0.0,) * len(fields),
        inputs=("a", "b", Input("i", domain="position")),
        lift=lambda a, b, i: (ops.pow(a, b), a % b, a // b, a ** 2, a ** -3, 2.0 ** b,
                              a % -3.0, a // -2.0, 7.0 // b,
                              ints((i - 7) % 3 + (i - 7) % -4),
                              ints((i - 7) // 3 + (i - 7) // -4)),
        combine=lambda p, q: tuple(u + v for u, v in zip(p, q)), commutative=True)
    inf, nan = float("inf"), float("nan")
    vals = torch.tensor([-inf, -7.0, -3.0, -2.5, -2.0, -1.0, -0.5, 0.0, 0.1, 0.5, 1.0, 2.0,
                         2.5, 3.0, 7.0, inf, nan])
    a = vals.repeat_interleave(len(vals))[:, None]
    b = vals.repeat(len(vals))[:, None]
    outs = L.launch_reduce(lifted, (a, b), 1)
    ref = R.reduce_reference(lifted, (a, b), 1)
    for name, o, r in zip(fields[:-2], outs, ref):
        assert_close(o, r, torch.float32, name=name)
        assert torch.equal(o.isnan(), r.isnan()), name
    pos = torch.zeros(1, 12)                       # positions 0..11 along dim 1
    for name, o, r in zip(fields[-2:], L.launch_reduce(lifted, (pos, pos), 1)[-2:],
                          R.reduce_reference(lifted, (pos, pos), 1)[-2:]):
        assert o.item() == r.item(), name


def test_log1p_and_expm1_keep_small_arguments():
    """``log1p`` and ``expm1`` are accurate to a few ulps relative to their value, small
    ones included (``log(1 + x)`` and ``exp(x) - 1`` are 0 below 2^-24 and keep only the
    leading digits above), in a lift and in a scan's per-element finalize (the fast-log
    lowering); their special values are the reference's."""
    from flashfold import Monoid, ops
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([0.0, 1e-30, -1e-30, 1e-10, -1e-10, 1e-7, -1e-7, 3e-5, -3e-5, 1e-3,
                      -0.5, 0.9, -0.999999, 1.0, -1.0, -2.0, 10.0, 88.0, 89.0, -104.0, 1e10,
                      -1e10, 3e38, inf, -inf, nan])[:, None]
    lifted = Monoid("log1p_expm1", fields=("a", "b"), identity=(0.0, 0.0),
                    lift=lambda v: (ops.log1p(v), ops.expm1(v)),
                    combine=lambda p, q: (p.a + q.a, p.b + q.b), commutative=True)
    finalized = Monoid("finalize_log1p_expm1", fields=("s",), identity=(0.0,),
                       lift=lambda v: (v,), combine=lambda p, q: (p.s + q.s,),
                       finalize=lambda s: (ops.log1p(s.s), ops.expm1(s.s)), commutative=True)
    with np.errstate(all="ignore"):
        # (rounded to float32: expm1(89) is beyond its range, so inf)
        ref = [torch.from_numpy(f(x.double().numpy()[:, 0])).float().double()
               for f in (np.log1p, np.expm1)]
    outs = [*L.launch_reduce(lifted, x, 1), *(o[:, 0] for o in L.launch_scan(finalized, x, 1))]
    for name, o, r in zip(("lift log1p", "lift expm1", "finalize log1p", "finalize expm1"),
                          outs, ref * 2):
        assert torch.equal(o.isnan(), r.isnan()), name
        assert torch.allclose(o.double(), r, rtol=1e-6, atol=0.0, equal_nan=True), (name, o, r)


def test_math_of_int_values_as_the_reference():
    """``exp``, ``exp2``, ``log``, ``log1p``, ``expm1``, ``sqrt``, ``floor``, ``sigmoid`` and
    ``pow`` take an int value (a position, ``i + 1``) as the reference does, as a float:
    Triton's math functions take floats only, and the kernel failed to compile."""
    from flashfold import Input, Monoid, ops
    fns = (ops.exp, ops.exp2, ops.log, ops.log1p, ops.expm1, ops.sqrt, ops.floor, ops.sigmoid,
           ops.tanh, lambda v: v ** 2, lambda v: ops.pow(2.0, v))
    by_position = Monoid(
        "int_math", fields=tuple(f"f{k}" for k in range(len(fns))),
        identity=(0.0,) * len(fns), inputs=("x", Input("i", domain="position")),
        lift=lambda x, i: tuple(ops.to_float(f(i - 2)) for f in fns),
        combine=lambda p, q: tuple(u + v for u, v in zip(p, q)), commutative=True)
    x = torch.zeros(2, 9)
    outs = L.launch_reduce(by_position, x, 1)
    for k, (o, r) in enumerate(zip(outs, R.reduce_reference(by_position, x, 1))):
        assert torch.equal(o.isnan(), r.isnan()), k
        assert torch.allclose(o.double(), r, rtol=1e-6, equal_nan=True), (k, o, r)


def test_logical_ops_of_numbers_as_the_reference():
    """``and`` / ``or`` / ``where`` read a number as true when nonzero (the reference's
    ``logical_and``): JOINS counts the merges of non-empty states through
    ``logical_and(a.n, b.n)`` of int counts, where Triton's bitwise ``&`` gave ``2 & 1 = 0``
    (a silently wrong count); FIRST picks by ``where(a.n, ...)``, an int condition."""
    from flashfold import Field, Monoid, ops
    joins = Monoid(
        "joins", fields=(Field("n", dtype="int"), Field("j", dtype="int")), identity=(0, 0),
        lift=lambda x: (1, 0),
        combine=lambda a, b: (a.n + b.n, a.j + b.j + ops.to_int(ops.logical_and(a.n, b.n))),
        commutative=True)
    first = Monoid(
        "first", fields=(Field("n", dtype="int"), "v"), identity=(0, 0.0),
        lift=lambda x: (1, x), combine=lambda a, b: (a.n + b.n, ops.where(a.n, a.v, b.v)))
    x = torch.arange(1.0, 22.0).reshape(3, 7)
    for m in (joins, first):
        for o, r in zip(L.launch_reduce(m, x, 1), R.reduce_reference(m, x, 1)):
            assert torch.equal(o.double(), r.double()), (m.name, o, r)
        for o, r in zip(L.launch_scan(m, x, 1), R.scan_reference(m, x, 1)):
            assert torch.equal(o.double(), r.double()), (m.name, o, r)


def test_unordered_lanes_would_break_a_non_commutative_monoid(force, monkeypatch):
    """Negative control: run MATMUL2 through the commutative lane path (elements of a
    lane are k·LANES + l, so the product is reordered) and see the check fail."""
    force(reduce=C(2, 8, 1, 4))
    monkeypatch.setattr(L, "_is_ordered", lambda monoid: False)
    x = sample(U.MATMUL2, (1, 64), seed=9) * 20
    with pytest.raises(AssertionError):
        check(U.MATMUL2, L.launch_reduce(U.MATMUL2, x, 1), x, 1, name="reordered")


def test_vector_monoids_run_per_feature():
    """The generated helpers take scalar inputs and fields; a monoid with vector ones runs
    as its per-feature monoid (``launch._per_feature``; tests/test_multi_input_kernels.py)."""
    from flashfold.kernels.reduce.generated import reduce_functions
    with pytest.raises(ValueError, match="monoid: the reduce/scan kernels take monoids of scalar"):
        reduce_functions(M.ATTENTION)
    with pytest.raises(ValueError, match="runs per feature"):   # inputs come as a tuple
        L.launch_reduce(M.ATTENTION, torch.randn(2, 3), 1)
    with pytest.raises(ValueError, match="x: 'attention' takes 2 data inputs, got 1"):
        L.launch_reduce(M.ATTENTION, (torch.randn(2, 3),), 1)
    per = L._per_feature(M.ATTENTION)
    assert not per.has_vector and per.field_names == M.ATTENTION.field_names
    assert L._per_feature(M.SUM) is None


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_shapes_dims_and_strides(data):
    """Hypothesis: any rank (1-4), sizes 1-9, any dim, permuted and sliced views: the
    geometry merges what it may, reads through strides, and matches the reference."""
    rank = data.draw(st.integers(1, 4), label="rank")
    shape = data.draw(st.lists(st.integers(1, 9), min_size=rank, max_size=rank), label="shape")
    perm = data.draw(st.permutations(range(rank)), label="perm")
    step = data.draw(st.integers(1, 2), label="step")
    monoid = data.draw(st.sampled_from((M.LOGSUMEXP2, M.ARGMAX, U.MAX_PREFIX_SUM, M.WELFORD)),
                       label="monoid")
    base = sample(monoid, [s * step for s in shape], seed=data.draw(st.integers(0, 99)))
    x = base[tuple(slice(None, None, step) for _ in shape)].permute(*perm)
    dim = data.draw(st.integers(-rank, rank - 1), label="dim")
    check(monoid, L.launch_reduce(monoid, x, dim), x, dim % rank, name="hypothesis")
