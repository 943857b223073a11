"""The cached launch path (:mod:`flashfold.kernels.launcher`) without a GPU.

Triton's own path (``kernel[grid]``) is replaced by a recorder returning a fake compiled
kernel, and the driver by a fake device/stream: what is tested is the cache key (a hit
exactly when Triton would pick the same compiled kernel) and that the launcher receives
every argument in signature order, keyword arguments and defaults included.
"""

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from flashfold.kernels import launcher as L

_enabled = L.enabled                            # the fixture below replaces it


def _k_fn(x, y, n, s: tl.constexpr, f, BLOCK: tl.constexpr, FLAG: tl.constexpr = 0, m=7):
    pass


def _other_fn(x):
    pass


# JITFunctions even under TRITON_INTERPRET=1 (where triton.jit makes interpreted ones)
_k, _other = JITFunction(_k_fn), JITFunction(_other_fn)


class FakeCompiled:
    def __init__(self, log):
        self.log = log
        self.function = "fn"
        self.packed_metadata = "meta"

    def run(self, *a):
        self.log.append(("fast", a))


class FakeDriver:
    class active:
        @staticmethod
        def get_current_device():
            return 0

        @staticmethod
        def get_current_stream(device):
            return 1234


@pytest.fixture
def log(monkeypatch):
    calls = []

    def slow(kernel, grid, args, kwargs):
        calls.append(("slow", kernel, grid, args, dict(kwargs)))
        return FakeCompiled(calls)

    monkeypatch.setattr(L, "_slow", slow)
    monkeypatch.setattr(L, "_driver", FakeDriver)
    monkeypatch.setattr(L, "enabled", lambda: True)
    L.cache_clear()
    yield calls
    L.cache_clear()


def buf(n=64, offset=0):
    return torch.zeros(n + offset)[offset:]


def test_second_call_is_fast_with_arguments_in_signature_order(log):
    x, y = buf(), buf()
    L.launch(_k, (3, 2), (x, y, 100, 5, 0.5), dict(BLOCK=32, num_warps=4))
    assert [c[0] for c in log] == ["slow"]
    L.launch(_k, (3, 2), (x, y, 100, 5, 0.5), dict(BLOCK=32, num_warps=4))
    kind, a = log[-1]
    assert kind == "fast"
    # grid, stream, function, metadata, no launch metadata or hooks, then the arguments:
    # positionals, then BLOCK (keyword), FLAG and m (defaults); num_warps is an option
    assert a == (3, 2, 1, 1234, "fn", "meta", None, None, None, x, y, 100, 5, 0.5, 32, 0, 7)


@pytest.mark.parametrize("change", [
    "misaligned pointer", "dtype", "int becomes 1", "int loses divisibility by 16",
    "int needs 64 bits", "positional constexpr", "keyword constexpr", "option", "kernel",
])
def test_anything_triton_specializes_on_misses_the_cache(log, change):
    args = [buf(), buf(), 96, 5, 0.5]
    kw = dict(BLOCK=32, num_warps=4)
    kernel = _k
    L.launch(kernel, (1,), tuple(args), kw)
    if change == "misaligned pointer":
        args[0] = buf(offset=1)                # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        args[1] = torch.zeros(64, dtype=torch.float16)
    elif change == "int becomes 1":
        args[2] = 1
    elif change == "int loses divisibility by 16":
        args[2] = 97
    elif change == "int needs 64 bits":
        args[2] = 2 ** 33
    elif change == "positional constexpr":
        args[3] = 6
    elif change == "keyword constexpr":
        kw = dict(BLOCK=64, num_warps=4)
    elif change == "option":
        kw = dict(BLOCK=32, num_warps=8)
    elif change == "kernel":
        kernel, args, kw = _other, [buf()], {}
    L.launch(kernel, (1,), tuple(args), kw)
    assert [c[0] for c in log] == ["slow", "slow"]


def test_same_specialization_hits_the_cache(log):
    """Other addresses with the same alignment, other ints with the same properties and
    other floats reuse the compiled kernel (as Triton's own cache would)."""
    L.launch(_k, (1,), (buf(), buf(), 96, 5, 0.5), dict(BLOCK=32))
    L.launch(_k, (1,), (buf(128), buf(32), 160, 5, 2.0), dict(BLOCK=32))
    assert [c[0] for c in log] == ["slow", "fast"]


def test_jit_functions_are_keyed_by_identity(log):
    L.launch(_k, (1,), (buf(), buf(), 96, _other, 0.5), dict(BLOCK=_other))
    L.launch(_k, (1,), (buf(), buf(), 96, _other, 0.5), dict(BLOCK=_other))
    L.launch(_k, (1,), (buf(), buf(), 96, _k, 0.5), dict(BLOCK=_other))
    assert [c[0] for c in log] == ["slow", "fast", "slow"]


def test_unknown_argument_types_always_take_tritons_path(log):
    for _ in range(2):
        L.launch(_k, (1,), (buf(), buf(), 96, 5, object()), dict(BLOCK=32))
    assert [c[0] for c in log] == ["slow", "slow"]


def test_off_under_the_interpreter_and_by_environment(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not L.enabled()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("FLASHFOLD_FAST_LAUNCH", "0")
    assert not L.enabled()


def test_a_launch_hook_sends_every_call_through_triton(log):
    """Profilers (proton) install launch hooks that the cached path would skip."""
    from triton import knobs

    def hook(metadata):
        pass

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        for _ in range(2):
            L.launch(_k, (1,), (buf(), buf(), 96, 5, 0.5), dict(BLOCK=32))
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert [c[0] for c in log] == ["slow", "slow"]


def test_kernels_other_than_jit_functions_take_tritons_path(log):
    """An autotuner or an interpreted function has no compiled kernel of its own to cache."""
    class NotJit:
        params = _k.params
    for _ in range(2):
        L.launch(NotJit(), (1,), (buf(),), {})
    assert [c[0] for c in log] == ["slow", "slow"]


def test_none_constexprs_and_tuples_of_tensors_are_cached(log):
    """What the kernels pass (the H200 run that first used this module found every launch
    on Triton's path): ``None`` for an absent optional function or table, by position or
    keyword, and tuples of output tensors and of JITFunctions."""
    outs = (buf(), buf())
    for _ in range(2):
        L.launch(_k, (1,), (buf(), outs, 96, None, (0.5, 2)), dict(BLOCK=None, FLAG=(_other, None)))
    assert [c[0] for c in log] == ["slow", "fast"]
    kind, a = log[-1]
    assert a[10] is outs and a[12] is None and a[14] is None and a[15] == (_other, None)


@pytest.mark.parametrize("change", ["tuple element misaligned", "tuple element dtype",
                                    "tuple length", "constexpr None -> 0", "jit in tuple"])
def test_tuple_and_none_changes_miss_the_cache(log, change):
    outs = [buf(), buf()]
    s, flag = None, (_other,)
    L.launch(_k, (1,), (buf(), tuple(outs), 96, s, 0.5), dict(BLOCK=32, FLAG=flag))
    if change == "tuple element misaligned":
        outs[1] = buf(offset=2)
    elif change == "tuple element dtype":
        outs[0] = torch.zeros(64, dtype=torch.float64)
    elif change == "tuple length":
        outs.append(buf())
    elif change == "constexpr None -> 0":
        s = 0
    elif change == "jit in tuple":
        flag = (_k,)
    L.launch(_k, (1,), (buf(), tuple(outs), 96, s, 0.5), dict(BLOCK=32, FLAG=flag))
    assert [c[0] for c in log] == ["slow", "slow"]


def _exact_key(kernel, args, kwargs=None):
    return L._exact(L._key(kernel, args, kwargs or {})[2])


def test_keys_are_never_coarser_than_tritons_specialization(log):
    """Two values whose exact keys are equal are specialized alike by Triton itself
    (``native_specialize_impl``, what ``kernel[grid]`` calls for each argument); for ints
    and tensors the converse holds too (no extra misses)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    ints = [0, 1, 2, 15, 16, 17, 32, 96, 97, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31,
            2**31 + 16, -2**31, -2**31 - 1, -2**31 - 16, 2**32, 2**63 - 16, 2**63 - 1, 2**63,
            2**63 + 16, 2**64 - 16]
    tensors = [torch.zeros(64, dtype=d)[o:] for d in (torch.float32, torch.float16, torch.int64)
               for o in range(5)]
    others = [0.5, -2.0, True, False, None, (buf(), buf(offset=1)), (buf(), buf()), (1, 16),
              (16, 1), (0.5, None), (None, None), (0.5, 0.5), ((1,), 2.0), ((1.0,), 2.0)]

    def triton(v):
        return native_specialize_impl(BaseBackend, v, False, True, True)

    for group, iff in ((ints, True), (tensors, True), (ints + tensors + others, False)):
        for a in group:
            for b in group:
                same_key = _exact_key(_other, (a,)) == _exact_key(_other, (b,))
                same_triton = triton(a) == triton(b)
                assert same_key == same_triton if iff else same_triton or not same_key, (a, b)


def test_keys_differ_in_one_property(log):
    """One int's divisibility by 16, one tensor's alignment, one constexpr's value or type,
    one JITFunction's identity: each alone changes the exact key."""
    x, y = buf(), buf()
    base = _exact_key(_k, (x, y, 96, 5, 0.5), dict(BLOCK=32, FLAG=_other))
    for args, kwargs in [((x, y, 97, 5, 0.5), dict(BLOCK=32, FLAG=_other)),
                         ((x, buf(offset=2), 96, 5, 0.5), dict(BLOCK=32, FLAG=_other)),
                         ((x, y, 96, 6, 0.5), dict(BLOCK=32, FLAG=_other)),
                         ((x, y, 96, 5, 0.5), dict(BLOCK=64, FLAG=_other)),
                         ((x, y, 96, 5, 0.5), dict(BLOCK=32.0, FLAG=_other)),
                         ((x, y, 96, 5, 0.5), dict(BLOCK=32, FLAG=_k)),
                         ((x, y, 96, 5, 0.5), dict(BLOCK=32, FLAG=_other, num_warps=8))]:
        assert _exact_key(_k, args, kwargs) != base
    # other addresses, ints and floats of the same properties: the same key
    assert _exact_key(_k, (buf(), buf(), 160, 5, 2.0), dict(BLOCK=32, FLAG=_other)) == base


def test_constexprs_are_keyed_by_type_and_value(log):
    """1, True and 1.0 are equal in Python but are different constexprs, alone or in tuples."""
    for block in (1, True, 1.0, 1, (1,), (True,), (1,)):
        L.launch(_k, (1,), (buf(), buf(), 96, 5, 0.5), dict(BLOCK=block))
    assert [c[0] for c in log] == ["slow", "slow", "slow", "fast", "slow", "slow", "fast"]


def test_new_ints_of_known_properties_hit_the_exact_cache(log):
    """Ints key by value first; new values are looked up by their properties (no Triton
    call) and remembered by value too, even after the by-value cache was emptied."""
    for n in (96, 160, 160, 32):
        L.launch(_k, (1,), (buf(), buf(), n, 5, 0.5), dict(BLOCK=32))
    assert [c[0] for c in log] == ["slow", "fast", "fast", "fast"]
    assert len(L._CACHE) == 1 and len(L._BY_VALUE) == 3
    L._BY_VALUE.clear()
    L.launch(_k, (1,), (buf(), buf(), 48, 5, 0.5), dict(BLOCK=32))
    assert log[-1][0] == "fast" and len(L._BY_VALUE) == 1


def test_the_caches_are_bounded(log, monkeypatch):
    """A full cache is emptied: emptying the by-value one costs no Triton call, emptying
    the exact one a Triton call for each key seen again."""
    monkeypatch.setattr(L, "_MAX", 2)
    for n in (16, 32, 48, 64):                  # one exact key, four by-value keys
        L.launch(_k, (1,), (buf(), buf(), n, 5, 0.5), dict(BLOCK=32))
        assert len(L._BY_VALUE) <= 2
    for block in (16, 48, 32):                  # the third exact key empties the cache
        L.launch(_k, (1,), (buf(), buf(), 16, 5, 0.5), dict(BLOCK=block))
        assert len(L._CACHE) <= 2
    assert [c[0] for c in log] == ["slow", "fast", "fast", "fast", "slow", "slow", "slow"]


def test_keyword_order_and_defaults_reach_the_launcher_in_signature_order(log):
    x, y = buf(), buf()
    L.launch(_k, (1,), (x, y, 100, 5, 0.5), dict(m=3, BLOCK=32))
    for kw in (dict(BLOCK=32, m=3), dict(m=3, BLOCK=32)):
        L.launch(_k, (1,), (x, y, 100, 5, 0.5), kw)
    assert [c[0] for c in log] == ["slow", "slow", "fast"]   # a new keyword order: a new plan
    assert log[-1][1][9:] == (x, y, 100, 5, 0.5, 32, 0, 3)


def test_every_parameter_in_order_reaches_the_launcher_without_the_options(log):
    """Keywords in the signature's order, options after them, or every parameter
    positional: the launcher passes the values up to the options as one slice."""
    x, y = buf(), buf()
    for args, kw in (((x, y, 100, 5, 0.5), dict(BLOCK=32, FLAG=1, m=9, num_warps=4,
                                                num_stages=2)),
                     ((x, y, 100, 5, 0.5, 32, 1, 9), {}),
                     ((x, y, 100, 5, 0.5, 32, 1), dict(m=9, num_warps=4))):
        log.clear()
        for _ in range(2):
            L.launch(_k, (1,), args, kw)
        assert [c[0] for c in log] == ["slow", "fast"]
        assert log[-1][1][9:] == (x, y, 100, 5, 0.5, 32, 1, 9)


@pytest.mark.parametrize("args, kwargs", [
    ((buf(), buf(), 96, 5, 0.5), dict(BLOCK=[32])),           # unhashable constexpr
    ((buf(), (buf(), object()), 96, 5, 0.5), dict(BLOCK=32)),  # unknown type in a tuple
    ((buf(), buf(), 96, 5, 0.5), dict(BLOCK=((1, [2]),))),     # unhashable inside a tuple
    ((buf(), buf(), 96, 5, 0.5, 32, 0, 7, 8), {}),             # more positionals than params
])
def test_what_the_key_cannot_hold_takes_tritons_path(log, args, kwargs):
    for _ in range(2):
        L.launch(_k, (1,), args, kwargs)
    assert [c[0] for c in log] == ["slow", "slow"]


def test_tensor_subclasses_and_tma_descriptors_are_keyed(log):
    from triton.tools.tensor_descriptor import TensorDescriptor

    def desc(block):
        return TensorDescriptor(torch.zeros(64, 64), [64, 64], [64, 1], [block, 16])

    p = torch.nn.Parameter(buf())
    for d in (desc(16), desc(16), desc(32)):
        L.launch(_k, (1,), (p, d, 96, 5, 0.5), dict(BLOCK=32))
    assert [c[0] for c in log] == ["slow", "fast", "slow"]


def test_gluon_descriptors_are_keyed_with_their_layout(log):
    """Gluon's descriptors take the cached path; one that differs only in its shared-memory
    layout (which Triton specializes on) misses; the descriptor itself reaches the
    compiled kernel's launcher, which builds the TMA map from it as on Triton's path."""
    hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon import language as gl

    def desc(swizzle):
        layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=32, rank=2)
        return hopper.TensorDescriptor(torch.zeros(64, 64), [64, 64], [64, 1], [16, 16], layout)

    for d in (desc(64), desc(64), desc(32)):
        L.launch(_k, (1,), (buf(), d, 96, 5, 0.5), dict(BLOCK=32))
    assert [c[0] for c in log] == ["slow", "fast", "slow"]
    d = desc(64)
    L.launch(_k, (1,), (buf(), d, 96, 5, 0.5), dict(BLOCK=32))
    assert log[-1][0] == "fast" and log[-1][1][10] is d


def test_interpreter_and_environment_send_launches_through_triton(log, monkeypatch):
    """The real :func:`launcher.enabled` reads the environment on every call."""
    monkeypatch.setattr(L, "enabled", _enabled)
    monkeypatch.delenv("FLASHFOLD_FAST_LAUNCH", raising=False)
    args = (buf(), buf(), 96, 5, 0.5)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    L.launch(_k, (1,), args, dict(BLOCK=32))
    L.launch(_k, (1,), args, dict(BLOCK=32))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    L.launch(_k, (1,), args, dict(BLOCK=32))
    L.launch(_k, (1,), args, dict(BLOCK=32))
    monkeypatch.setenv("FLASHFOLD_FAST_LAUNCH", "0")
    L.launch(_k, (1,), args, dict(BLOCK=32))
    monkeypatch.delenv("FLASHFOLD_FAST_LAUNCH")
    monkeypatch.delenv("TRITON_INTERPRET")
    L.launch(_k, (1,), args, dict(BLOCK=32))
    assert [c[0] for c in log] == ["slow", "slow", "slow", "fast", "slow", "fast"]


def test_device_facts_are_read_once_per_device(monkeypatch):
    """capability / sm_count: one ``get_device_properties`` call per device index (the
    plans ask on every call; torch's query costs ~10 us of host time)."""
    import types
    reads = []

    def props(index):
        reads.append(index)
        return types.SimpleNamespace(major=9, minor=0, multi_processor_count=132 + index)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    L._properties.cache_clear()
    try:
        assert L.capability("cuda:0") == (9, 0) and L.sm_count("cuda:0") == 132
        assert L.sm_count("cuda") == 133 and L.capability(torch.device("cuda", 1)) == (9, 0)
        assert reads == [0, 1]
    finally:
        L._properties.cache_clear()


# --- memos: the launch resolved once for the replays of a cached plan ---------------------

@pytest.fixture
def keys(monkeypatch):
    """The calls that built a key."""
    made = []
    key = L._key

    def counting(*args):
        made.append(args[0])
        return key(*args)

    monkeypatch.setattr(L, "_key", counting)
    return made


def test_a_memo_keeps_the_launch_and_skips_the_key(log, keys):
    memo = [None]
    L.launch(_k, (3, 2), (buf(), buf(), 100, 5, 0.5), dict(BLOCK=32, num_warps=4), memo)
    assert memo[0] is not None                       # kept from the compiling call
    x, y = buf(), buf()
    L.launch(_k, (3, 2), (x, y, 100, 5, 0.25), dict(BLOCK=32, num_warps=4), memo)
    assert [c[0] for c in log] == ["slow", "fast"] and len(keys) == 1
    assert log[-1][1] == (3, 2, 1, 1234, "fn", "meta", None, None, None, x, y, 100, 5, 0.25,
                          32, 0, 7)
    fresh = [None]                                   # a memo from a hit of the key cache
    L.launch(_k, (1,), (buf(), buf(), 100, 5, 0.5), dict(BLOCK=32, num_warps=4), fresh)
    L.launch(_k, (1,), (buf(), buf(), 100, 5, 0.5), dict(BLOCK=32, num_warps=4), fresh)
    assert [c[0] for c in log] == ["slow", "fast", "fast", "fast"] and len(keys) == 2


def _hook(metadata):
    pass


@pytest.mark.parametrize("change", ["cache cleared", "other device", "other kernel",
                                    "launcher off", "launch hook"])
def test_a_memo_is_not_used_when_the_launch_could_differ(log, keys, monkeypatch, change):
    from triton import knobs
    memo = [None]
    args, kwargs, kernel = (buf(), buf(), 96, 5, 0.5), dict(BLOCK=32), _k
    L.launch(kernel, (1,), args, kwargs, memo)
    L.launch(kernel, (1,), args, kwargs, memo)
    assert [c[0] for c in log] == ["slow", "fast"] and len(keys) == 1
    hooked = False
    if change == "cache cleared":
        L.cache_clear()
    elif change == "other device":
        monkeypatch.setattr(FakeDriver.active, "get_current_device", staticmethod(lambda: 1))
    elif change == "other kernel":
        kernel, args = _other, (buf(),)
    elif change == "launcher off":
        monkeypatch.setattr(L, "enabled", lambda: False)
    else:
        knobs.runtime.launch_enter_hook.add(_hook)
        hooked = True
    try:
        L.launch(kernel, (1,), args, kwargs, memo)
    finally:
        if hooked:
            knobs.runtime.launch_enter_hook.remove(_hook)
    assert log[-1][0] == "slow"                      # a new key (or Triton's path)
    if change in ("cache cleared", "other device", "other kernel"):
        assert len(keys) == 2
        L.launch(kernel, (1,), args, kwargs, memo)   # ... kept for the next call
        assert log[-1][0] == "fast" and len(keys) == 2
