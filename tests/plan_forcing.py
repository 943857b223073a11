"""The ``force`` fixture of the reduce/scan kernel tests: pin the launcher's heuristics so
that a test runs one dispatch branch (``from plan_forcing import force`` in the module
that uses it)."""

import pytest

from flashfold.kernels.reduce import launch as L


@pytest.fixture
def force(monkeypatch):
    """``force(reduce=Config, split=(n_split, chunk) | None, states=Config, scan=Config,
    n64=bool)``: each given heuristic returns that value for the rest of the test (``scan``
    also sets the look-back scan's config, or a 16-element vector one for a scalar
    config)."""
    def apply(reduce=None, split=None, states=None, scan=None, n64=None):
        if reduce is not None:
            monkeypatch.setattr(L, "reduce_config", lambda g, e, o, *a: reduce)
        if states is not None:
            monkeypatch.setattr(L, "states_config", lambda g, o: states)
        if split is not None:
            monkeypatch.setattr(L, "split_plan", lambda g, tile, n, sms, min_tiles=2: split)
        if scan is not None:
            monkeypatch.setattr(L, "scan_config", lambda g, e, *a: scan)
            monkeypatch.setattr(L, "LOOKBACK_CONFIG",
                                scan if scan.vec else L.Config(16, 1, 1, 4, vec=2))
        if n64 is not None:
            monkeypatch.setattr(L, "_n64", lambda g, *e: n64)
    return apply


def lookback_aggregates_only(monkeypatch, window: int = 4):
    """Look-back scans in which only chunk 0 publishes an inclusive prefix, over windows of
    ``window`` predecessors, one chunk per program: every look-back then folds aggregates
    over several windows back to it, in order."""
    monkeypatch.setattr(L, "LOOKBACK_TILES", 1)
    monkeypatch.setattr(L, "LOOKBACK_WINDOW", window)
    orig = L._plan_lookback

    def aggregates_only(*a, **k):
        plan = orig(*a, **k)
        plan[0].kwargs["INCLUSIVE"] = False
        return plan
    monkeypatch.setattr(L, "_plan_lookback", aggregates_only)
