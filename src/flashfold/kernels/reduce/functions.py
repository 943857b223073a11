"""The monoid and the row map that two torch-like functions launch, beside the kernels.

* :data:`LOGSUMEXP2_SCAN`: ``logcumsumexp``'s scan state, LOGSUMEXP2 with a one-``exp2``
  combine;
* :func:`softmax_map`: ``softmax``'s row map, ``y = 2^(x log2(e) - m) / d`` from the row's
  base-2 state ``(m, d)``.

:mod:`flashfold.api.reductions` re-exports both (``LOGSUMEXP2_SCAN``, ``SOFTMAX_MAP``); the
launch plans compiled ahead of time (:mod:`.aot`) use them from here. Importing this
module imports neither torch nor Triton; :func:`softmax_map` generates Triton source on
its first call.
"""

from __future__ import annotations

import functools

from ...algebra import ops
from ...algebra.monoid import Monoid
from ...monoids import LOGSUMEXP2

__all__ = ["LOGSUMEXP2_SCAN", "softmax_map"]


def _lse2_combine_one_exp2(a, b):
    """LOGSUMEXP2's combine with one ``exp2`` instead of two: the side with the larger max
    keeps its ``d``, the other is rescaled by ``2^(lo - m)`` (``lo = min(a.m, b.m)``).
    Equal maxima (both ``-inf`` or both ``+inf`` included) add without an exponential, so
    no ``inf - inf`` arises. Same function as LOGSUMEXP2's combine (``check_laws``)."""
    m = ops.maximum(a.m, b.m)
    lo = ops.minimum(a.m, b.m)
    a_top = a.m >= b.m
    scale = ops.where(lo == m, 1.0, ops.exp2(lo - m))
    return m, ops.where(a_top, a.d, b.d) + ops.where(a_top, b.d, a.d) * scale


#: LOGSUMEXP2 with a one-exp2 combine, for scans. The block scan (LOGSUMEXP2's: one exp2
#: per element) runs the combine only between tiles and on tiles it cannot take; the
#: chunked and look-back scans run it ~2.75 times per element, and with two exp2 per
#: combine logcumsumexp would exceed the SFU budget at memory speed (an H200 issues 16
#: exp2/clock/SM: ~8 per element at 3.8 TB/s of fp32). Lift, block lift, block scan and
#: finalize are LOGSUMEXP2's.
LOGSUMEXP2_SCAN = Monoid(
    "logsumexp2_scan", fields=("m", "d"), identity=(-ops.inf, 0.0),
    lift=LOGSUMEXP2.lift, combine=_lse2_combine_one_exp2, finalize=LOGSUMEXP2.finalize,
    block_lift=LOGSUMEXP2.block_lift, block_scan=LOGSUMEXP2.block_scan,
    scan_exact=LOGSUMEXP2.scan_exact, commutative=True, outputs=("lse",),
    doc="Base-2 online softmax state (m, d) with a one-exp2 combine; finalize to the "
        "natural-log log-sum-exp.")


@functools.cache
def softmax_map():
    """softmax's :class:`~.generated.RowMap` over LOGSUMEXP2: per row ``(m, 1/d)``, per
    element ``2^(x log2(e) - m) / d``. Built (traced, its source generated) on the first
    call, the same object after."""
    from .generated import row_map
    return row_map(
        "softmax", LOGSUMEXP2,
        prep=lambda s: (s.m, 1.0 / s.d),                 # base-2 max, 1 / sum 2^(x log2e - m)
        fmap=lambda x, m, inv_d: ops.exp2(x * ops.LOG2E - m) * inv_d,
        n_consts=2)
