"""The Triton compatibility layer (:mod:`flashfold.kernels.compat`): the adaptation of
``gl.warp_specialize`` to each signature it has had (fakes of each shape), the TMA names
under both spellings, the version gate and the one-time fallback warning of the Gluon
dispatch, and the ``ptxas`` that assembles this Triton's sm_90 PTX (compiled in a worker,
see ``tests/compile_worker.py``). CI runs this file on the oldest and the newest supported
Triton."""

from __future__ import annotations

import inspect
import subprocess
import tempfile
import os
import warnings
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import triton
import triton.language as tl

from compile_worker import emit_rows, worker_rows
from flashfold.kernels import compat

PARTS = [("default_fn", ("a",)), ("worker0", ("b",)), ("worker1", ("c",))]


def _recorder(calls):
    return lambda *args, **kwargs: calls.append((args, kwargs)) or "result"


# --- gl.warp_specialize -------------------------------------------------------------------

def _ws_36(calls):
    """Triton 3.6's shape: the register counts required."""
    def warp_specialize(functions_and_args, worker_num_warps, worker_num_regs, _semantic=None,
                        _generator=None):
        return _recorder(calls)(functions_and_args, worker_num_warps, worker_num_regs,
                                _semantic=_semantic, _generator=_generator)
    return warp_specialize


def _ws_39(calls):
    """Triton 3.7 to 3.9's shape: the register counts optional."""
    def warp_specialize(functions_and_args, worker_num_warps, worker_num_regs=None,
                        _semantic=None, _generator=None):
        return _recorder(calls)(functions_and_args, worker_num_warps, worker_num_regs,
                                _semantic=_semantic, _generator=_generator)
    return warp_specialize


def _ws_keyword_only(calls):
    """The counts keyword-only and in the other order: still bound by name."""
    def warp_specialize(functions_and_args, *, worker_num_regs=None, worker_num_warps,
                        _semantic=None, _generator=None):
        return _recorder(calls)(functions_and_args, worker_num_warps, worker_num_regs,
                                _semantic=_semantic, _generator=_generator)
    return warp_specialize


@pytest.mark.parametrize("shape", [_ws_36, _ws_39, _ws_keyword_only],
                         ids=["triton-3.6", "triton-3.9", "keyword-only"])
def test_warp_specialize_adapts_to_each_signature(shape):
    calls = []
    call = compat.adapt_warp_specialize(shape(calls))
    assert call is not None
    assert call(PARTS, [4, 1], [240, 24], _semantic="S", _generator="G") == "result"
    assert calls == [((PARTS, [4, 1], [240, 24]), {"_semantic": "S", "_generator": "G"})]


def test_warp_specialize_of_an_unknown_signature_is_refused():
    """A split signature (the default partition apart from the workers), a missing
    register count, or no function at all: no adapter, so no Gluon kernel is dispatched."""
    def split(default_args, default_partition, worker_args, worker_partitions,
              worker_num_warps, worker_num_regs, _semantic=None, _generator=None):
        pass

    def no_regs(functions_and_args, worker_num_warps, _semantic=None, _generator=None):
        pass
    assert compat.adapt_warp_specialize(split) is None
    assert compat.adapt_warp_specialize(no_regs) is None
    assert compat.adapt_warp_specialize(None) is None


def test_installed_warp_specialize_is_adapted():
    """The installed Triton's ``gl.warp_specialize`` has a known signature, and the
    kernels' ``warp_specialize`` forwards to it as a Gluon builtin (called at compile
    time with ``_semantic`` and ``_generator``)."""
    gl = pytest.importorskip("triton.experimental.gluon.language")
    assert compat.adapt_warp_specialize(gl.warp_specialize) is not None
    assert compat.gluon_unusable_reason() is None, compat.gluon_unusable_reason()
    assert getattr(compat.warp_specialize, "__triton_builtin__", False)
    assert {"_semantic", "_generator"} <= set(inspect.signature(compat.warp_specialize).parameters)
    calls = []
    with mock.patch.object(compat, "_ws_call", _recorder(calls)):
        compat.warp_specialize(PARTS, [4, 1], [240, 24], _semantic="S", _generator="G")
    assert calls == [((PARTS, [4, 1], [240, 24]), {"_semantic": "S", "_generator": "G"})]


# --- TMA ----------------------------------------------------------------------------------

def test_tma_names_resolve_to_working_functions():
    """Both spellings of the TMA copies name the installed Triton's working function:
    Triton 3.9 keeps the old names (``async_copy_global_to_shared``,
    ``async_copy_shared_to_global``) as stubs that raise "has been removed", 3.6 has only
    them. Called outside a kernel, a working builtin asks for ``@gluon.jit``."""
    pytest.importorskip("triton.experimental.gluon")
    tma = compat.tma
    assert tma.async_copy_global_to_shared is tma.async_load
    assert tma.async_copy_shared_to_global is tma.async_store
    for fn in (tma.async_load, tma.async_store, tma.store_wait, compat.tma_reduce_add):
        assert getattr(fn, "__triton_builtin__", False), fn
        with pytest.raises(ValueError, match="gluon.jit"):
            fn(None, [0], None, _semantic=None)
        assert "has been removed" not in inspect.getsource(inspect.unwrap(fn))
    assert compat.HAS_TMA_REDUCE


def test_tma_namespace_is_a_module():
    """Triton's JIT follows module globals without recording them as values that could
    change between compilations; any other object would be refused or hashed."""
    pytest.importorskip("triton.experimental.gluon")
    assert type(compat.tma) is type(os)


# --- the version gate and the fallback ----------------------------------------------------

@pytest.mark.parametrize("text, version", [("3.6.0", (3, 6, 0)), ("3.9.0", (3, 9, 0)),
                                           ("3.10.0+git1a2b3c", (3, 10, 0)),
                                           ("3.7.1rc2", (3, 7, 1)), ("4.0", (4, 0, 0))])
def test_parse_version(text, version):
    assert compat.parse_version(text) == version


def test_parse_version_rejects_text():
    with pytest.raises(ValueError, match="version"):
        compat.parse_version("nightly")


@pytest.mark.parametrize("version, ok", [((3, 5, 1), False), ((3, 6, 0), True),
                                         ((3, 7, 1), True), ((3, 8, 0), True),
                                         ((3, 9, 0), True), ((3, 9, 4), True),
                                         ((3, 10, 0), False), ((4, 0, 0), False)])
def test_gluon_runs_on_the_tested_versions_only(version, ok):
    reason = compat.gluon_unusable_reason(version, missing=None)
    assert (reason is None) == ok, reason
    if not ok:
        assert "3.6 to 3.9" in reason


def test_missing_api_is_the_reason():
    assert compat.gluon_unusable_reason((3, 9, 0), missing="Gluon lacks tma.async_store") \
        == "Gluon lacks tma.async_store"


def test_fallback_warns_once_naming_the_version(monkeypatch):
    monkeypatch.setattr(compat, "_MISSING", "Gluon lacks tma.async_store")
    monkeypatch.setattr(compat, "_warned", False)
    with pytest.warns(RuntimeWarning) as record:
        assert not compat.gluon_usable()
    assert len(record) == 1
    text = str(record[0].message)
    assert triton.__version__ in text and "tma.async_store" in text and "Triton kernels" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not compat.gluon_usable()          # said once per process


def test_usable_gluon_says_nothing(monkeypatch):
    monkeypatch.setattr(compat, "_MISSING", None)
    monkeypatch.setattr(compat, "TRITON_VERSION", (3, 9, 0))
    monkeypatch.setattr(compat, "_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compat.gluon_usable()


def _fake_cuda_q():
    return SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))


def test_dispatch_falls_back_where_gluon_cannot_run(monkeypatch):
    """On an sm_90 device (mocked), the Gluon forward and backward are eligible exactly
    where :func:`compat.gluon_usable` says so; otherwise the Triton kernels run, with the
    warning."""
    from flashfold.kernels.attention import gluon_fwd
    monkeypatch.setattr(gluon_fwd, "_is_sm90", lambda index: True)
    monkeypatch.delenv("FLASHFOLD_GLUON", raising=False)
    monkeypatch.setattr(compat, "_warned", False)
    monkeypatch.setattr(compat, "_MISSING", None)
    monkeypatch.setattr(compat, "TRITON_VERSION", (3, 9, 0))
    assert gluon_fwd.on_hopper(_fake_cuda_q())
    monkeypatch.setattr(compat, "TRITON_VERSION", (3, 10, 0))
    with pytest.warns(RuntimeWarning, match="tested on Triton 3.6 to 3.9"):
        assert not gluon_fwd.on_hopper(_fake_cuda_q())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not gluon_fwd.on_hopper(_fake_cuda_q())


def test_cpu_tensors_never_warn(monkeypatch):
    """The fallback is said only where a Gluon kernel would have run: not for CPU calls."""
    from flashfold.kernels.attention import gluon_fwd
    monkeypatch.setattr(compat, "_MISSING", "Gluon lacks everything")
    monkeypatch.setattr(compat, "_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not gluon_fwd.on_hopper(torch.zeros(1))


@pytest.mark.gpu
def test_gpu_gluon_runs_without_a_warning():
    """On the H200's Triton the Gluon forward is dispatched, and nothing is said."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        pytest.skip("needs an sm_90 GPU")
    pytest.importorskip("triton.experimental.gluon")
    import flashfold as ff
    from flashfold.kernels.attention import gluon_fwd
    q = torch.randn(1, 4, 256, 128, device="cuda", dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert gluon_fwd.eligible(q, q, q)
        ff.attention(q, q, q)
    torch.cuda.synchronize()


# --- the NVIDIA tools (a compile worker: no TRITON_INTERPRET) -----------------------------

@triton.jit
def _copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)


def _compile_all():
    """Worker: compile a copy kernel for sm_90; assemble its PTX with
    :func:`compat.nvidia_tool`'s ``ptxas`` and read its resources through ``aot``."""
    from flashfold.kernels.aot import _run_on_cubin, compile_launch

    def facts():
        x = torch.empty(1000)
        c = compile_launch(_copy, (x, x, 1000), {"BLOCK": 256})
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "k.ptx")
            with open(src, "w") as f:
                f.write(c.ptx)
            r = subprocess.run([compat.nvidia_tool("ptxas"), "-arch=sm_90a", src, "-o",
                                os.path.join(d, "k.o")], capture_output=True, text=True)
        return dict(ptxas_rc=r.returncode, ptxas_err=r.stderr[-500:],
                    registers=c.resources()["registers"],
                    sass_lines=len(_run_on_cubin(c.cubin, "-sass").splitlines()))

    emit_rows([("copy",)], facts)


@pytest.fixture(scope="module")
def tools():
    return {r["id"]: r for r in worker_rows(__file__)}


def test_ptxas_assembles_this_tritons_sm90_ptx(tools):
    """Triton 3.9 emits PTX ISA 9.x for sm_90 and assembles it with its CUDA 13 ``ptxas``;
    the CUDA 12 ``bin/ptxas`` it also ships rejects it."""
    r = tools["copy"]
    assert r["ok"], r.get("error")
    assert r["ptxas_rc"] == 0, r["ptxas_err"]
    assert r["sass_lines"] > 0


def test_aot_reads_registers_on_this_triton(tools):
    """``aot.Compiled.resources`` (registers and spills of every compile test) runs the
    ``ptxas`` that accepts this Triton's PTX."""
    r = tools["copy"]
    assert r["ok"], r.get("error")
    assert r["registers"], r


if __name__ == "__main__":
    _compile_all()
