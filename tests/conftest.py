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
