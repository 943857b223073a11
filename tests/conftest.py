"""Shared test setup: hypothesis profiles (small in CI, large on demand)."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("large", max_examples=int(os.environ.get("FLASHFOLD_FUZZ_EXAMPLES", "10000")),
                          deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("FLASHFOLD_HYPOTHESIS_PROFILE", "ci"))
