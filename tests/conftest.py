"""Shared test setup: hypothesis profiles (small in CI, large on demand), Triton's
interpreter on machines without a GPU (it must be chosen before any kernel is defined),
and a shim for that interpreter under NumPy >= 2.4 (see the fixture below)."""

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors under the interpreter (set before @triton.jit runs)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("large", max_examples=int(os.environ.get("FLASHFOLD_FUZZ_EXAMPLES", "10000")),
                          deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("FLASHFOLD_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="session")
def _interpreter_numpy_compat():
    """Triton 3.6's interpreter turns a loop bound into an int with ``int(ndarray)``, which
    NumPy >= 2.4 rejects for its 1-element arrays (triton-lang/triton#9171, fixed upstream
    by #9172): apply the same one-line fix for the whole session (interpreter only; a
    no-op where NumPy still converts them)."""
    try:
        int(np.array([1]))
        yield
        return
    except TypeError:
        pass
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    yield
    interpreter._patch_lang_tensor = original


@pytest.fixture(autouse=True, scope="session")
def _interpreter_e4m3_conversions():
    """Triton's interpreter (3.6 to 3.9) converts to and from E4M3 by bit manipulation
    that rounds half up without carrying into the exponent (127.75 becomes 64, not 128)
    and reads E4M3's NaN as 480; the GPU's conversions (``cvt.rn.satfinite``) round to
    nearest even, keep NaN and saturate finite values at 448. Kernels that make E4M3
    values (the FP8 forward's ``P``) or meet a NaN in an E4M3 tile would fail against the
    reference for the emulator's sake, so, for the whole session, conversions between
    E4M3 and fp32 / fp16 / bf16 go through torch's exact ones with ``cvt``'s saturation
    (interpreter only; every other conversion, and a conversion that asks for another
    rounding mode, is the interpreter's own). ``tests/test_attention_fp8_kernel.py``
    checks the shim against torch."""
    try:
        import triton.language as tl
        from triton._C.libtriton import ir
        from triton.runtime import interpreter
    except ImportError:                                    # pragma: no cover
        yield
        return
    original = interpreter._convert_float
    e4m3 = tl.float8e4nv
    wide = {tl.float32: (np.float32, torch.float32), tl.float16: (np.float16, torch.float16),
            tl.bfloat16: (np.uint16, torch.bfloat16)}

    def to_torch(data, dtype):
        a = np.ascontiguousarray(data)
        if dtype == e4m3:
            return torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
        npt, tt = wide[dtype]
        t = torch.from_numpy(a.view(npt))
        return t.view(tt) if tt == torch.bfloat16 else t

    def to_numpy(t, dtype):
        if dtype == e4m3:
            return t.view(torch.uint8).numpy()
        return t.view(torch.int16).numpy().view(np.uint16) if dtype == tl.bfloat16 else t.numpy()

    def convert(input, input_dtype, output_dtype, rounding_mode):
        pair = {input_dtype, output_dtype}
        if (e4m3 not in pair or not pair - {e4m3} <= set(wide)
                or rounding_mode not in (None, ir.ROUNDING_MODE.RTNE)):
            return original(input, input_dtype, output_dtype, rounding_mode)
        t = to_torch(input, input_dtype)
        if output_dtype == e4m3:
            t = t.float().clamp(-448.0, 448.0)             # satfinite (NaN stays NaN)
        return to_numpy(t.to(torch.float8_e4m3fn if output_dtype == e4m3
                             else wide[output_dtype][1]), output_dtype).reshape(np.shape(input))

    interpreter._convert_float = convert
    yield
    interpreter._convert_float = original
