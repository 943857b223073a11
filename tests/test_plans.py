"""The shared plan cache (:mod:`flashfold.kernels.plans`) on synthetic plans, without kernels.

A plan is recorded once and replayed by a function generated for it on its first replay
(``_replay_function``): the replay must rebuild every tuple, list and dataclass holding a
tensor with the new call's inputs and new buffers (zeroed ones zeroed again, views into
them at the recorded offset), share every other value with the recorded plan, and two
plans of one structure (which share the generated code) must each keep their own values.
"""

from dataclasses import dataclass

import pytest
import torch

from flashfold.kernels import plans

PLAN_CACHE_SIZE = 16


@dataclass
class Step:
    kernel: object
    grid: tuple
    args: tuple
    options: dict
    memo: list


#: a placeholder that every plan may share
SHARED = plans.constant(torch.empty(1))


def build(x, y, n, block):
    """A plan of two steps: the second reads a scratch buffer, a zeroed one and a view of
    its tail that the first writes; ``(plan, outputs)``."""
    out = plans.new((n,), torch.float32, x.device)
    scratch = plans.new((n, 2), torch.float32, x.device)
    flags = plans.new(n + 1, torch.int32, x.device, zero=True)
    first = Step("k1", (n, 1), (x, [scratch, 3, "s"], flags, n, block, 1.5, SHARED),
                 {"BLOCK": block}, [None])
    second = Step("k2", (1,), (scratch, y, (out, (flags[n:], n)), block, None),
                  {"BLOCK": block, "N": n}, [None])
    return [first, second], (out,)


_CACHE = plans.PlanCache("test", globals(), (build,))


@pytest.fixture(autouse=True)
def empty(monkeypatch):
    monkeypatch.delenv("FLASHFOLD_PLAN_CACHE", raising=False)
    _CACHE.clear()
    yield
    _CACHE.clear()


def planned(x, y, n, block):
    key = (plans.signature(x), plans.signature(y), n, block)
    return _CACHE.planned(key, None, (x, y), build, x, y, n, block)


def check(result, x, y, n, block):
    """``result`` is ``build(x, y, n, block)`` up to its new buffers."""
    (first, second), (out,) = result
    want, _ = build(x, y, n, block)
    for got, ref in zip((first, second), want):
        assert type(got) is Step and got.kernel == ref.kernel and got.grid == ref.grid
        assert got.options == ref.options
    xa, (scratch, three, s), flags, n1, b1, f1, shared = first.args
    assert xa is x and three == 3 and s == "s" and (n1, b1, f1) == (n, block, 1.5)
    assert shared is SHARED and scratch.shape == (n, 2) and out.shape == (n,)
    assert flags.dtype == torch.int32 and not flags.any()
    s2, ya, (o2, (ticket, n2)), b2, none = second.args
    assert s2 is scratch and ya is y and o2 is out and n2 == n and b2 == block and none is None
    assert ticket._base is flags and ticket.data_ptr() == flags[n:].data_ptr()
    assert ticket.shape == (1,)
    return first, second, out


def test_replays_rebuild_the_plan_around_new_tensors():
    x, y = torch.randn(4), torch.randn(3)
    built = planned(x, y, 8, 64)
    first_replay = planned(torch.randn(4), torch.randn(3), 8, 64)
    x2, y2 = torch.randn(4), torch.randn(3)
    second_replay = planned(x2, y2, 8, 64)
    assert _CACHE.info() == {"hits": 2, "misses": 1, "size": 1}
    steps = [check(r, *a, 8, 64) for r, a in ((built, (x, y)), (second_replay, (x2, y2)))]
    (b1, b2, bout), (r1, r2, rout) = steps
    assert rout is not bout and r1.args[1][0] is not b1.args[1][0]
    assert r1.args[2] is not b1.args[2]                  # new flags
    # values holding no tensor are the recorded plan's, shared
    assert r1.options is b1.options and r1.memo is b1.memo and r2.grid is b2.grid
    assert first_replay[0][0].memo is r1.memo


def test_zeroed_buffers_are_zeroed_on_every_replay():
    x, y = torch.randn(4), torch.randn(3)
    for _ in range(3):
        (first, _), _ = planned(x, y, 8, 64)
        flags = first.args[2]
        assert not flags.any()
        flags.fill_(7)                                   # as a kernel would
    assert _CACHE.info()["hits"] == 2


def test_plans_of_one_structure_keep_their_own_values():
    """The two signatures' plans have the same structure (one generated source, compiled
    once) but other ints and shapes: each replay has its own."""
    calls = [(torch.randn(4), torch.randn(3), 8, 64), (torch.randn(5), torch.randn(2), 5, 16)]
    for _ in range(3):
        for x, y, n, block in calls:
            check(planned(x, y, n, block), x, y, n, block)
    assert _CACHE.info() == {"hits": 4, "misses": 2, "size": 2}
    runs = [e.run for e in _CACHE.entries.values()]
    assert runs[0] is not runs[1] and runs[0].__code__ is runs[1].__code__


def test_an_input_in_a_tuple_and_alone_is_the_same_new_tensor():
    x, y = torch.randn(4), torch.randn(3)
    planned(x, y, 8, 64)
    (first, second), _ = planned(y, x, 8, 64)            # other signature: a miss
    (first, second), _ = planned(x, y, 8, 64)
    assert first.args[0] is x and second.args[1] is y


def test_unreplayable_plans_are_built_every_time():
    """A plan holding a tensor that is neither an input nor a new buffer (a copy)."""
    def copying(x):
        return [Step("k", (1,), (x.clone(),), {}, [None])], ()

    cache = plans.PlanCache("copy", {"__name__": __name__, "PLAN_CACHE_SIZE": 4,
                                     "copying": copying}, (copying,))
    x = torch.randn(2)
    a = cache.planned(("k",), None, (x,), copying, x)
    b = cache.planned(("k",), None, (x,), copying, x)
    assert a[0][0].args[0] is not b[0][0].args[0]
    assert cache.info() == {"hits": 0, "misses": 2, "size": 1}


def test_globals_of_other_modules_read_by_a_planner_are_watched(monkeypatch):
    """``PlanCache(..., modules=...)``: a planner that reads ``module.name`` of a sibling
    module (here the backward's, which reads ``gluon_bwd.eligible``) bypasses the cache
    while that name, or a global of the sibling's functions it reads, is patched."""
    import types

    sibling = types.ModuleType("sibling")
    exec("LIMIT = 4\n\ndef rule(n):\n    return n <= LIMIT\n", vars(sibling))

    def plan_with(x):
        return sibling.rule(x.numel())

    namespace = {"__name__": __name__, "sibling": sibling, "plan_with": plan_with,
                 "PLAN_CACHE_SIZE": 4}
    cache = plans.PlanCache("sibling test", namespace, (plan_with,), modules=(sibling,))
    assert cache.caching()
    monkeypatch.setattr(sibling, "rule", lambda n: False)
    assert not cache.caching()
    monkeypatch.undo()
    assert cache.caching()
    monkeypatch.setattr(sibling, "LIMIT", 1)          # read by the sibling's own function
    assert not cache.caching()


def test_dataclasses_are_rebuilt_without_running_their_checks_again():
    """A replay sets the fields of a new instance (``_rebuild``): the class's
    ``__post_init__`` (a Triton descriptor's validation) ran when the plan was recorded,
    on a call of the same signature, and does not run again."""
    runs = []

    @dataclass
    class Checked:
        base: object
        n: int

        def __post_init__(self):
            runs.append(self.n)

    def build_checked(x):
        out = plans.new(x.shape, x.dtype, x.device)
        return Checked(x, 3), out

    cache = plans.PlanCache("checked", {"__name__": __name__, "build_checked": build_checked,
                                        "plans": plans, "Checked": Checked,
                                        "PLAN_CACHE_SIZE": 4}, (build_checked,))
    x, y = torch.zeros(4), torch.ones(4)
    key = plans.signature(x)
    first = cache.planned(key, None, (x,), build_checked, x)
    again = cache.planned(key, None, (y,), build_checked, y)
    assert runs == [3] and type(again[0]) is Checked
    assert again[0].base is y and again[0].n == 3 and again[1] is not first[1]
