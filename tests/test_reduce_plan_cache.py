"""The plan cache of the reduce, scan and row-map launchers (``launch._planned``).

Under ``TRITON_INTERPRET=1`` on CPU tensors: a repeated call replays the recorded plan
with fresh outputs and scratch buffers (never a tensor of an earlier call) and gives the
same results as the miss, both equal to the float64 reference; a different layout,
dtype, dim, alignment or finalize parameter misses; split-K, reduce-then-scan, split
softmax and the look-back scan (whose flags must start at zero) replay right; patched
heuristics, the ``FLASHFOLD_PLAN_CACHE=0`` switch and plans holding a copy of the input
bypass the cache; entries hold no tensor of the call.
"""

import gc
import threading
import weakref

import pytest
import torch

import flashfold as ff
import flashfold.monoids as M
from flashfold.algebra.monoid import Monoid
from flashfold.api import reductions as api
from flashfold.api.reductions import ARGMAX_INDEX, SOFTMAX_MAP
from flashfold.kernels.reduce import launch as L
from flashfold.kernels.reduce import reference as R
from flashfold.testing import assert_close

C = L.Config


@pytest.fixture(autouse=True)
def empty_cache(monkeypatch):
    monkeypatch.delenv("FLASHFOLD_PLAN_CACHE", raising=False)
    L.plan_cache_clear()
    yield
    L.plan_cache_clear()


@pytest.fixture
def plans(monkeypatch):
    """The plans the launchers run, in order."""
    seen = []
    run = L._run

    def spy(plan, device=None):
        seen.append(plan)
        run(plan, device)

    monkeypatch.setattr(L, "_run", spy)
    return seen


def counts():
    info = L.plan_cache_info()
    return info["hits"], info["misses"]


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def reduce_ref(monoid, x, dim, **params):
    return R.reduce_reference(monoid, x, dim, **params)


# (name, call(x) -> tuple of outputs, float64 reference(x) -> tuple, shape)
CASES = [
    ("argmax small rows", lambda x: L.launch_reduce(ARGMAX_INDEX, x, 1),
     lambda x: (torch.argmax(x, 1),), (4096, 7)),
    ("logsumexp", lambda x: L.launch_reduce(M.LOGSUMEXP2, x, 1),
     lambda x: (torch.logsumexp(x.double(), 1),), (6, 300)),
    ("var_mean", lambda x: L.launch_reduce(M.WELFORD, x, 0, {"correction": 0.0}),
     lambda x: reduce_ref(M.WELFORD, x, 0, correction=0.0), (37, 5)),
    ("softmax", lambda x: (L.launch_normalize(SOFTMAX_MAP, x, 1),),
     lambda x: (torch.softmax(x.double(), 1),), (8, 100)),
    ("cumsum", lambda x: L.launch_scan(M.SUM, x, 1),
     lambda x: (torch.cumsum(x.double(), 1),), (5, 40)),
    ("reverse logsumexp scan", lambda x: L.launch_scan(M.LOGSUMEXP2, x, 1, True),
     lambda x: R.scan_reference(M.LOGSUMEXP2, x, 1, True), (3, 50)),
]


def check(outs, refs, name):
    assert len(outs) == len(refs), name
    for o, r in zip(outs, refs):
        if r.dtype.is_floating_point:
            assert_close(o, r, o.dtype, name=name)
        else:
            assert o.dtype == torch.int64 and torch.equal(o, r), name


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_second_call_hits_with_fresh_outputs(case):
    name, call, ref, shape = case
    first_x, second_x = randn(*shape, seed=1), randn(*shape, seed=2)
    first = call(first_x)
    assert counts() == (0, 1)
    again = call(first_x)
    second = call(second_x)
    assert counts() == (2, 1), name
    check(first, ref(first_x), name + " (miss)")
    check(second, ref(second_x), name + " (hit, other data)")
    for a, b in zip(first, again):
        assert torch.equal(a, b), name                   # hit and miss agree exactly
        assert a.data_ptr() != b.data_ptr(), name        # no tensor of an earlier call
    before = second[0].clone()
    first[0].fill_(0)
    again[0].fill_(0)
    assert torch.equal(second[0], before), name


def test_replayed_launches_are_the_built_ones(plans):
    x = randn(4096, 7)
    L.launch_reduce(ARGMAX_INDEX, x, 1)
    (out,) = L.launch_reduce(ARGMAX_INDEX, x, 1)
    (built,), (replayed,) = plans
    assert replayed.kernel is built.kernel and replayed.grid == built.grid
    assert replayed.kwargs == built.kwargs
    assert len(replayed.args) == len(built.args)
    for a, b in zip(replayed.args, built.args):
        if isinstance(a, torch.Tensor):
            assert a is x and b is x
        elif a and type(a) is tuple and isinstance(a[0], torch.Tensor) and a[0] is x:
            assert len(a) == 1 and b[0] is x                    # the inputs
        elif a and type(a) is tuple and isinstance(a[0], torch.Tensor):
            assert a == (out,) and b[0] is not out              # the outputs
        else:
            assert a == b


def test_signature_changes_miss_and_stay_correct(plans):
    """Strides, dtype, dim and a start off 16 bytes miss; an input at another address
    with the same alignment hits. Rows of 1030 fp32 start off 16-byte boundaries: from
    an aligned address they are realigned (ALIGN = 4), from a misaligned one not."""
    flat = randn(4 * 1030 + 4)
    aligned = flat[:4 * 1030].view(4, 1030)
    moved = flat[4:].view(4, 1030)                       # 16 bytes on: same signature
    misaligned = flat[1:4 * 1030 + 1].view(4, 1030)      # 4 bytes on
    calls = [(aligned, 1), (aligned.t().contiguous().t(), 1), (aligned.half(), 1),
             (aligned, 0), (misaligned, 1)]
    for i, (x, dim) in enumerate(calls):
        (got,) = L.launch_reduce(M.LOGSUMEXP2, x, dim)
        assert counts() == (0, i + 1)
        assert_close(got, torch.logsumexp(x.double(), dim), x.dtype, name=f"call {i}")
    assert plans[0][0].kwargs["ALIGN"] == 4 and plans[-1][0].kwargs["ALIGN"] == 0
    (got,) = L.launch_reduce(M.LOGSUMEXP2, moved, 1)
    assert counts() == (1, 5) and plans[-1][0].kwargs["ALIGN"] == 4
    assert_close(got, torch.logsumexp(moved.double(), 1), torch.float32, name="moved")
    for x, dim in calls:
        L.launch_reduce(M.LOGSUMEXP2, x, dim)
    assert counts() == (6, 5)
    L.launch_reduce(M.WELFORD, aligned, 1, {"correction": 0.0})
    L.launch_reduce(M.WELFORD, aligned, 1, {"correction": 1.0})
    assert counts() == (6, 7)


@pytest.mark.parametrize("monoid", (M.LOGSUMEXP2, M.WELFORD, ARGMAX_INDEX),
                         ids=lambda m: m.name)
def test_split_k_replays_with_new_partial_states(monoid, plans):
    """Two rows of 40000: split-K (partial states to a [rows, n_split] buffer, then a
    FROM_STATES pass); the hit writes new partial-state buffers."""
    xs = [randn(2, 40000, seed=s) for s in (1, 2)]
    results = [L.launch_reduce(monoid, x, 1) for x in xs]
    assert counts() == (1, 1)
    for x, outs in zip(xs, results):
        check(outs, reduce_ref(monoid, x, 1), monoid.name)
    built, replayed = plans
    assert len(built) == len(replayed) == 2
    parts = replayed[0].args[1]
    assert all(a is b for a, b in zip(replayed[1].args[0], parts))   # written, then read
    assert all(a is not b for a, b in zip(parts, built[0].args[1]))


def test_reverse_scan_of_long_rows_replays(plans):
    """A reverse scan of one long row: chunk states, then each chunk scanned from them."""
    xs = [randn(1, 40000, seed=s) for s in (1, 2)]
    for x in xs:
        (got,) = L.launch_scan(M.SUM, x, 1, True)
        ref = torch.cumsum(x.double().flip(1), 1).flip(1)
        assert_close(got, ref, torch.float32, scale=x.abs().sum().item(), name="reverse")
    assert counts() == (1, 1) and len(plans[1]) == 2


def test_split_softmax_replays(plans):
    xs = [randn(1, 40000, seed=s) for s in (1, 2)]
    for x in xs:
        assert_close(L.launch_normalize(SOFTMAX_MAP, x, 1), torch.softmax(x.double(), 1),
                     torch.float32, name="split softmax")
    assert counts() == (1, 1) and len(plans[1]) == 2


def test_look_back_scan_replays_with_zeroed_flags(monkeypatch):
    """One long forward row scans with a decoupled look-back: its flags and ticket are
    zeroed on a hit too (the miss's flags were set by its run), the ticket a view of the
    flags."""
    built = []
    run = L._run

    def check_flags(plan, device=None):
        (launch,) = plan
        assert launch.kernel is L.K_.lookback_scan_kernel
        flags, ticket = launch.args[5], launch.args[6]
        assert not flags.any()
        assert ticket.data_ptr() == flags.data_ptr() + (flags.numel() - 1) * 4
        assert all(flags is not f for f in built)
        built.append(flags)
        run(plan, device)

    monkeypatch.setattr(L, "_run", check_flags)
    for seed in (1, 2, 3):
        x = randn(1, 40000, seed=seed)
        (got,) = L.launch_scan(M.SUM, x, 1)
        assert_close(got, torch.cumsum(x.double(), 1), torch.float32,
                     scale=x.abs().sum().item(), name="look-back")
    assert counts() == (2, 1) and built[0].any()


def test_segment_reduce_replays_with_the_new_offsets():
    x = randn(50, 6)
    for offsets in (torch.tensor([0, 10, 10, 33, 50]), torch.tensor([0, 5, 20, 21, 48])):
        (got,) = L.launch_segment_reduce(M.SUM, x, offsets, 0)
        check((got,), R.segment_reduce_reference(M.SUM, x, offsets, 0), "segments")
    assert counts() == (1, 1)


def test_patched_heuristics_bypass_the_cache(monkeypatch, plans):
    x = randn(4, 1030)
    L.launch_reduce(M.LOGSUMEXP2, x, 1)
    assert counts() == (0, 1) and plans[-1][0].kwargs["ALIGN"] == 4
    with monkeypatch.context() as m:
        m.setattr(L, "reduce_config", lambda g, e, o, *a: C(2, 4, 1, 4))
        (got,) = L.launch_reduce(M.LOGSUMEXP2, x, 1)
        assert plans[-1][0].kwargs["K"] == 2 and plans[-1][0].kwargs["LANES"] == 4
        assert_close(got, torch.logsumexp(x.double(), 1), torch.float32, name="patched")
    with monkeypatch.context() as m:
        m.setattr(L, "ALIGN_ROWS", False)
        L.launch_reduce(M.LOGSUMEXP2, x, 1)
        assert plans[-1][0].kwargs["ALIGN"] == 0
    with monkeypatch.context() as m:
        m.setattr(L, "num_sms", lambda device: 132)
        L.launch_reduce(M.LOGSUMEXP2, x, 1)
    assert counts() == (0, 1) and L.plan_cache_info()["size"] == 1
    L.launch_reduce(M.LOGSUMEXP2, x, 1)                   # restored: the entry again
    assert counts() == (1, 1) and plans[-1][0].kwargs["ALIGN"] == 4


def test_environment_switch_turns_it_off(monkeypatch):
    x = randn(6, 300)
    monkeypatch.setenv("FLASHFOLD_PLAN_CACHE", "0")
    for _ in range(2):
        (got,) = L.launch_reduce(M.LOGSUMEXP2, x, 1)
        assert_close(got, torch.logsumexp(x.double(), 1), torch.float32, name="off")
    assert counts() == (0, 0) and L.plan_cache_info()["size"] == 0
    monkeypatch.setenv("FLASHFOLD_PLAN_CACHE", "1")
    L.launch_reduce(M.LOGSUMEXP2, x, 1)
    L.launch_reduce(M.LOGSUMEXP2, x, 1)
    assert counts() == (1, 1)


def test_a_plan_holding_a_copy_of_the_input_is_not_cached():
    """Four batch dims that cannot merge: the plan reads a contiguous copy of ``x``."""
    base = randn(4, 4, 4, 4, 8)
    x = base[::2, ::2, ::2, ::2]
    for seed in (1, 2):
        base.copy_(randn(4, 4, 4, 4, 8, seed=seed))
        (got,) = L.launch_reduce(M.SUM, x, 4)
        assert_close(got, x.double().sum(4), torch.float32, name="copied input")
    assert counts() == (0, 2) and list(L._PLANS.values()) == [False]


def test_entries_hold_no_tensor_of_the_call():
    x = randn(2, 40000)
    outs = L.launch_reduce(M.WELFORD, x, 1)
    refs = [weakref.ref(t) for t in (x, *outs)]
    del x, outs
    gc.collect()
    assert L.plan_cache_info()["size"] == 1
    assert all(r() is None for r in refs)


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(L, "PLAN_CACHE_SIZE", 2)
    for n in (3, 4, 5, 6):
        L.launch_reduce(M.SUM, randn(2, n), 1)
        assert L.plan_cache_info()["size"] <= 2


def test_threads_get_their_own_buffers():
    """Plans replayed on several threads at once (not run): each call its own outputs."""
    x = randn(2, 40000)
    key = ("reduce", id(M.WELFORD), L._sig(x), 1, ())
    results, errors = [], []

    def plan():
        try:
            for _ in range(50):
                results.append(L._planned(key, M.WELFORD, (x,), L.plan_reduce, M.WELFORD, x, 1))
        except Exception as e:          # reported below: a thread's exception is lost
            errors.append(e)

    threads = [threading.Thread(target=plan) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    outs = [o for _, outs in results for o in outs]
    parts = [p for plan, _ in results for p in plan[0].args[1]]
    assert len(results) == 200 and len(outs) + len(parts) == 200 * (2 + 3)  # WELFORD
    assert len({id(t) for t in outs + parts}) == len(outs) + len(parts)
    hits, misses = counts()
    assert misses >= 1 and hits + misses <= 200


def test_public_functions_hit(monkeypatch):
    monkeypatch.setattr(api, "_use_kernels", lambda t: True)
    x, s = randn(4096, 7), randn(8, 1024)
    for _ in range(2):
        assert torch.equal(ff.argmax(x, 1), torch.argmax(x, 1))
        assert_close(ff.softmax(s, 1), torch.softmax(s.double(), 1), torch.float32,
                     name="softmax")
    assert counts() == (2, 2)


def test_finalize_parameters_other_than_numbers_are_not_cached():
    """A tensor parameter could change in place: its plan (which holds it as a float)
    is built on every call."""
    x = randn(37, 5)
    correction = torch.tensor(0.0)
    for c in (0.0, 1.0):
        correction.fill_(c)
        mean, var = L.launch_reduce(M.WELFORD, x, 0, {"correction": correction})
        assert_close(var, x.double().var(0, correction=int(c)), torch.float32, name="var")
    assert counts() == (0, 0)


def test_a_monoid_redefined_under_its_name_runs_its_own_identity():
    """A monoid defined again under the same name with the same lift and combine but
    another identity (a mistake corrected in a notebook) runs its own generated helpers,
    whose identity pads the masked lanes, not those of the first definition."""
    def total(identity):
        return Monoid(name="redefined_total", fields=("s",), identity=(identity,),
                      lift=lambda x: (x,), combine=lambda a, b: (a.s + b.s,),
                      commutative=True)

    x = randn(3, 37)                     # 37 columns: tiles with masked lanes
    (wrong,) = L.launch_reduce(total(1.0), x, 1)
    assert not torch.allclose(wrong.double(), x.double().sum(1))
    (out,) = L.launch_reduce(total(0.0), x, 1)
    assert_close(out, x.double().sum(1), torch.float32, name="sum")
