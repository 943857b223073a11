"""Generated reduce, split-K, segmented-reduce, scan and row-map kernels for any monoid.

* :mod:`.generated`: per-monoid helper functions generated next to the codegen lowering
  (:func:`flashfold.kernels.codegen.triton_monoid`);
* :mod:`.kernels`: the ``@triton.jit`` templates (one per schedule, variants by constexpr);
* :mod:`.launch`: geometry, heuristics and launch plans;
* :mod:`.reference`: the float64 NumPy reference of every kernel (no Triton needed);
* :mod:`.aot`: compile every plan for an sm_90 target without a GPU (a CI check).

Import :mod:`.reference` without Triton; the other modules import Triton.
"""
