"""The decode plan cache (``splitkv._CACHE``, :mod:`flashfold.kernels.plans`).

``flashfold.decode`` is sent to the split-KV kernels on CPU tensors (``TRITON_INTERPRET=1``,
``api.decode._use_kernels`` patched). A repeated call signature replays the recorded
launches: a hit, with outputs bitwise equal to the same call with the cache off, new
output tensors every call, and the new call's tensors (q, caches, lengths, block table)
read, never an earlier call's; every part of the signature misses when it changes; the
API's tensor checks run once per signature, and an invalid call raises every time; TMA
descriptors are rebuilt around the new caches; patched heuristics and the environment
switch bypass the cache; an input passed twice is planned with its aliasing; entries hold no tensor of a call.
Tests that only look at the plans replace the launches with a recorder (no kernel runs).
"""

import gc
import weakref
from dataclasses import dataclass

import pytest
import torch

import flashfold as ff
from flashfold.api import decode as api
from flashfold.kernels import launcher
from flashfold.kernels.decode import splitkv
from flashfold.kernels.decode.reference import decode_reference
from flashfold.testing import assert_close
from test_decode_common import make_case


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    monkeypatch.delenv("FLASHFOLD_PLAN_CACHE", raising=False)
    monkeypatch.setattr(api, "_use_kernels", lambda q: True)
    splitkv.plan_cache_clear()
    yield
    splitkv.plan_cache_clear()


@pytest.fixture
def launches(monkeypatch):
    """The launches, recorded instead of run: ``(kernel, grid, args, kwargs, memo)``."""
    seen = []

    def record(kernel, grid, args=(), kwargs=None, memo=None):
        seen.append((kernel, grid, args, kwargs, memo))

    monkeypatch.setattr(launcher, "launch", record)
    return seen


def counts():
    info = splitkv.plan_cache_info()
    return info["hits"], info["misses"]


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    lens: torch.Tensor
    table: torch.Tensor | None


def inputs(layout, q_len, lens, seed, capacity=64):
    """fp16, batch 2, 2 query heads / 1 KV head, head_dim 16; ``paged16``: pages of 16
    tokens, shuffled (another seed: other values, other lengths, another block table, the
    same shapes)."""
    c = make_case(lens, heads_q=2, heads_kv=1, q_len=q_len, head_dim=16, capacity=capacity,
                  page_size=16, dtype=torch.float16, seed=seed)
    k, v, table = c.cache(layout == "paged16")
    return Inputs(c.q, k, v, c.seqlens, table)


def decode(x: Inputs, **kw):
    """``flashfold.decode`` on the kernels' path, always as ``(o, lse)``."""
    kw.setdefault("check_lengths", False)
    lse = kw.pop("return_lse", True)
    got = ff.decode(x.q, x.k, x.v, x.lens, block_table=x.table, return_lse=lse, **kw)
    return got if lse else (got,)


def uncached(monkeypatch, call, *args, **kw):
    with monkeypatch.context() as m:
        m.setenv("FLASHFOLD_PLAN_CACHE", "0")
        return call(*args, **kw)


def assert_bitwise(got, want, name):
    assert len(got) == len(want), name
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), f"{name}: max diff {(g.float() - w.float()).abs().max()}"


def padded(t):
    """``t``'s values in a view of a tensor twice as wide in the last dim (other strides)."""
    wide = t.new_zeros(*t.shape[:-1], 2 * t.shape[-1])
    wide[..., :t.shape[-1]] = t
    return wide[..., :t.shape[-1]]


def reference(x: Inputs, layout):
    """float64 reference of ``x`` (gathered from the pages when paged)."""
    return decode_reference(x.q.double(), x.k.double(), x.v.double(), x.lens, x.table,
                            scale=x.q.shape[-1] ** -0.5)


@pytest.mark.parametrize("return_lse", [False, True], ids=["o", "o+lse"])
@pytest.mark.parametrize("q_len", [1, 4], ids=["q1", "q4"])
@pytest.mark.parametrize("mode", ["default", "invariant"])
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_hits_replay_bitwise_with_the_new_tensors(layout, mode, q_len, return_lse, monkeypatch):
    """Default mode with two splits (split kernel, workspace, merge kernel); invariant mode
    with one program per sequence (FOLD: outputs only)."""
    opts = dict(num_splits=2) if mode == "default" else dict(batch_invariant=True)
    opts["return_lse"] = return_lse
    a = inputs(layout, q_len, [40, 64], seed=1)
    b = inputs(layout, q_len, [0, 59], seed=2)                 # other values, same signature
    ref_a, ref_b = uncached(monkeypatch, decode, a, **opts), uncached(monkeypatch, decode, b, **opts)
    assert counts() == (0, 0)
    first = decode(a, **opts)
    assert counts() == (0, 1)
    again = decode(a, **opts)
    assert counts() == (1, 1)                                  # (i) the same call hits
    second = decode(b, **opts)
    assert counts() == (2, 1)                                  # other values: a hit too
    assert_bitwise(first, ref_a, "miss")
    assert_bitwise(again, ref_a, "hit")                        # (ii) as with the cache off
    assert_bitwise(second, ref_b, "hit, other tensors")        # (iii) the new tensors read
    ro, rl = reference(b, layout)
    assert_close(second[0], ro, torch.float16, name="o vs float64 reference")
    if return_lse:
        assert_close(second[1], rl, torch.float32, name="lse vs float64 reference")
    # (v) every call its own outputs: writing an earlier call's changes no later one
    ptrs = {t.data_ptr() for t in (*first, *again, *second)}
    assert len(ptrs) == 3 * len(first)
    kept = [t.clone() for t in second]
    for t in (*first, *again):
        t.fill_(0)
    assert_bitwise(second, kept, "after writing the earlier outputs")
    # (iv) another signature (q's strides) misses, and reads the same values
    strided = Inputs(padded(a.q), a.k, a.v, a.lens, a.table)
    assert_bitwise(decode(strided, **opts), ref_a, "miss, other strides")
    assert counts() == (2, 2)


@pytest.fixture
def runs(monkeypatch):
    """The :class:`splitkv.Launch` records run by the calls, in order."""
    seen = []
    run = splitkv.Launch.run

    def spy(self):
        seen.append(self)
        return run(self)

    monkeypatch.setattr(splitkv.Launch, "run", spy)
    return seen


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_invariant_merge_replays_with_new_workspace(layout, monkeypatch, runs):
    """300 keys: batch-invariant splits of 128 keys over three split programs, raw partial
    states (o, m, d) to a workspace, then the merge kernel: the hit allocates a new
    workspace and gives the uncached bits."""
    a = inputs(layout, 1, [300, 250], seed=3, capacity=300)
    b = inputs(layout, 1, [131, 300], seed=4, capacity=300)
    ref_b = uncached(monkeypatch, decode, b, batch_invariant=True)
    first = decode(a, batch_invariant=True)
    second = decode(b, batch_invariant=True)
    assert counts() == (1, 1)
    assert_bitwise(second, ref_b, "hit")
    built, replayed = runs[1:]
    assert replayed.merge is not None and replayed.plan.n_splits == 3
    assert replayed.plan == built.plan
    # OP, LSEP, DP: new buffers, written by the split kernel and read by the merge
    ws = replayed.split[1][10:13]
    assert all(t is u for t, u in zip(ws, replayed.merge[1][:3]))
    assert all(t is not u for t, u in zip(ws, built.split[1][10:13]))
    assert first[0].data_ptr() != second[0].data_ptr()


def test_tma_descriptors_are_rebuilt_around_the_new_caches(monkeypatch, runs):
    """``tma=True`` (contiguous fp16 cache, 16-byte aligned): the split kernel reads K/V
    through descriptors, rebuilt on a hit around the call's caches."""
    a = inputs("contiguous", 2, [40, 64], seed=5)
    b = inputs("contiguous", 2, [64, 33], seed=6)

    def call(x):
        return splitkv.splitkv_decode(x.q, x.k, x.v, x.lens, scale=0.25, num_splits=2, tma=True)

    ref_b = uncached(monkeypatch, call, b)
    call(a)
    got = call(b)
    assert counts() == (1, 1)
    assert_bitwise(got, ref_b, "TMA hit")
    built, replayed = runs[1:]
    k_desc, v_desc = replayed.split[1][3:5]
    assert replayed.split[2]["USE_TMA"]
    assert k_desc.base is b.k and v_desc.base is b.v
    assert k_desc is not built.split[1][3] and built.split[1][3].base is a.k
    assert k_desc.shape == built.split[1][3].shape and k_desc.block_shape == built.split[1][3].block_shape


# --- the plans alone (launches recorded, not run) ---------------------------------------

def test_replayed_launches_are_the_built_ones_with_new_tensors(launches):
    a = inputs("paged16", 4, [40, 64], seed=1)
    b = inputs("paged16", 4, [64, 3], seed=2)
    o_a, _ = decode(a, num_splits=2)
    o_b, lse_b = decode(b, num_splits=2)
    (ka, ga, args_a, kw_a, memo_a), (_, _, margs_a, mkw_a, mmemo_a) = launches[:2]
    (kb, gb, args_b, kw_b, memo_b), (_, _, margs_b, mkw_b, mmemo_b) = launches[2:]
    assert ka is kb is splitkv._splitkv_kernel and ga == gb
    assert kw_b == kw_a and mkw_b == mkw_a
    # the launcher memos are shared by the replays, one per launch
    assert memo_b is memo_a and mmemo_b is mmemo_a and memo_a is not mmemo_a
    same = lambda xs, ys: all(x is y for x, y in zip(xs, ys, strict=True))  # noqa: E731
    # Q, K, V, K_DESC, V_DESC (the caches: no TMA), BT, SEQ, START (the lengths), O, LSE
    assert same(args_b[:10], (b.q, b.k, b.v, b.k, b.v, b.table, b.lens, b.lens, o_b, lse_b))
    assert args_a[0] is a.q and args_a[8] is o_a
    for x, y in zip(args_a, args_b):
        if isinstance(x, torch.Tensor):
            assert x is not y
        else:
            assert x == y
    # OP, LSEP, DP (written by the split kernel), SEQ, START, O, LSE
    assert same(margs_b[:7], (*args_b[10:13], b.lens, b.lens, o_b, lse_b))


def _changes():
    """(name, keyword changes) of the call below that change its signature."""
    flat = torch.zeros(2 * 2 * 1 * 16 + 1, dtype=torch.float16)
    return [
        ("q strides", lambda x: {"q": padded(x.q)}),
        ("q misaligned", lambda x: {"q": flat[1:].view(2, 2, 1, 16)}),
        ("q dtype (and the caches')", lambda x: {"q": x.q.float(), "k": x.k.float(),
                                                 "v": x.v.float()}),
        ("k strides", lambda x: {"k": padded(x.k)}),
        ("v strides", lambda x: {"v": padded(x.v)}),
        ("cache_seqlens int64", lambda x: {"lens": x.lens.long()}),
        ("block_table strides", lambda x: {"table": x.table.t().contiguous().t()}),
        ("cache_start", lambda x: {"cache_start": torch.zeros(2, dtype=torch.int32)}),
        ("scale", lambda x: {"scale": 0.5}),
        ("softcap", lambda x: {"softcap": 30.0}),
        ("window", lambda x: {"window": (8, 0)}),
        ("num_splits", lambda x: {"num_splits": 3}),
        ("batch_invariant", lambda x: {"batch_invariant": True}),
        ("max_seqlen", lambda x: {"max_seqlen": 32}),
        ("check_lengths (the API's checks: eager)", lambda x: {"check_lengths": True}),
    ]


@pytest.mark.parametrize("change", _changes(), ids=lambda c: c[0])
def test_every_part_of_the_signature_misses(change, launches):
    name, make = change
    x = inputs("paged16", 1, [40, 64], seed=1)
    base = dict(q=x.q, k=x.k, v=x.v, lens=x.lens, table=x.table)

    def call(**kw):
        t = {**base, **{n: kw.pop(n) for n in list(kw) if n in base}}
        ff.decode(t["q"], t["k"], t["v"], t["lens"], block_table=t["table"],
                  **{"check_lengths": False, **kw})

    call()
    call()
    assert counts() == (1, 1)
    call(**make(x))
    assert counts() == (1, 2), name
    call(**make(x))
    assert counts() == (2, 2), name


@pytest.mark.parametrize("env", ["FLASHFOLD_DECODE_PDL", "FLASHFOLD_DECODE_TMA",
                                 "TRITON_INTERPRET"])
def test_environment_switches_are_part_of_the_signature(env, launches, monkeypatch):
    x = inputs("contiguous", 1, [40, 64], seed=1)
    decode(x)
    with monkeypatch.context() as m:
        m.setenv(env, "" if env == "TRITON_INTERPRET" else "0")     # (the switches' off)
        decode(x)
        assert counts() == (0, 2)
        decode(x)
        assert counts() == (1, 2)
    decode(x)
    assert counts() == (2, 2)


def test_the_api_checks_run_once_per_signature_and_invalid_calls_always_raise(
        launches, monkeypatch):
    checked = []
    check = api._check_tensors

    def counting(*args):
        checked.append(args)
        check(*args)

    monkeypatch.setattr(api, "_check_tensors", counting)
    x = inputs("contiguous", 1, [40, 64], seed=1)
    for _ in range(3):
        decode(x)
    assert len(checked) == 1 and counts() == (2, 1)
    bad = Inputs(x.q, x.k, x.v.float(), x.lens, None)          # v's dtype differs from q's
    for _ in range(2):
        with pytest.raises(TypeError, match="v_cache: dtype"):
            decode(bad)
    assert len(checked) == 3 and counts() == (2, 3) and splitkv.plan_cache_info()["size"] == 1
    for kw, exc, pattern in [(dict(scale=0.0), ValueError, "scale"),
                             (dict(num_splits=2, batch_invariant=True), ValueError, "num_splits"),
                             (dict(batch_invariant=1), TypeError, "batch_invariant")]:
        with pytest.raises(exc, match=pattern):                 # the options: every call
            decode(x, **kw)
    with pytest.raises(TypeError, match="block_table: expected a torch.Tensor"):
        decode(Inputs(x.q, x.k, x.v, x.lens, [[0]]))
    assert counts() == (2, 3)


def test_an_input_passed_twice_is_planned_with_its_aliasing(launches):
    """``k`` as ``v`` too: one slot for both, and which places share a tensor is part of
    the key; the replay puts the new call's one tensor in both places, and a later call
    with two caches is another plan that reads each of them."""
    x = inputs("contiguous", 1, [40, 64], seed=1)
    decode(Inputs(x.q, x.k, x.k, x.lens, None))
    y = inputs("contiguous", 1, [40, 64], seed=2)
    decode(Inputs(y.q, y.k, y.k, y.lens, None))
    args = launches[-1][2]
    assert args[1] is y.k and args[2] is y.k and counts() == (1, 1)
    decode(x)
    args = launches[-1][2]
    assert args[1] is x.k and args[2] is x.v and counts() == (1, 2)


def test_patched_heuristics_and_the_switch_bypass_the_cache(launches, monkeypatch):
    x = inputs("contiguous", 1, [40, 64], seed=1)
    decode(x)
    assert counts() == (0, 1)
    def grids():
        return [grid for kernel, grid, *_ in launches if kernel is splitkv._splitkv_kernel]

    with monkeypatch.context() as m:
        m.setattr(splitkv, "choose_num_splits", lambda *a, **k: 3)
        decode(x)
        assert grids()[-1] == (2, 3)                            # the patched plan ran
    with monkeypatch.context() as m:
        m.setenv("FLASHFOLD_PLAN_CACHE", "0")
        decode(x)
    assert counts() == (0, 1)
    decode(x)
    assert counts() == (1, 1) and grids() == [(2, 1), (2, 3), (2, 1), (2, 1)]


def test_entries_hold_no_tensor_of_the_call(launches):
    x = inputs("paged16", 4, [40, 64], seed=1)
    o, lse = decode(x, num_splits=2)
    refs = [weakref.ref(t) for t in (x.q, x.k, x.v, x.lens, x.table, o, lse)]
    del x, o, lse
    launches.clear()
    gc.collect()
    assert splitkv.plan_cache_info()["size"] == 1
    assert all(r() is None for r in refs)


def test_the_cache_is_bounded(launches, monkeypatch):
    monkeypatch.setattr(splitkv, "PLAN_CACHE_SIZE", 2)
    for scale in (0.1, 0.2, 0.3, 0.4):
        decode(inputs("contiguous", 1, [40, 64], seed=1), scale=scale)
        assert splitkv.plan_cache_info()["size"] <= 2
