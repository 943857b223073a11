"""Generated reduce, split-K, segmented-reduce, scan and row-map kernels for any monoid.

* :mod:`.generated`: per-monoid helper functions generated next to the codegen lowering
  (:func:`flashfold.kernels.codegen.triton_monoid`);
* :mod:`.kernels`: the ``@triton.jit`` templates (one per schedule, variants by constexpr);
* :mod:`.launch`: geometry, heuristics, launch plans and their plan cache (the planners
  take what their decisions depend on by keyword: ``sms=``, ``align_rows=``, ...);
* :mod:`.functions`: the monoid and the row map that two torch-like functions launch
  (LOGSUMEXP2_SCAN with its block scan, softmax's row map), defined beside the kernels;
* :mod:`.reference`: the float64 NumPy reference of every kernel (no Triton needed);
* :mod:`.aot`: compile every plan for an sm_90 target without a GPU (a CI check).

Import :mod:`.reference` without Triton; the other modules import Triton. The public
entry points are the torch-like functions of :mod:`flashfold.api.reductions`
(``flashfold.logsumexp``, ``flashfold.cumsum``, ...) and ``flashfold.reduce`` /
``flashfold.scan`` for any monoid.
"""
