"""Shared test setup: hypothesis profiles (small in CI, large on demand), and Triton's
interpreter on machines without a GPU (it must be chosen before any kernel is defined)."""

import os

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
