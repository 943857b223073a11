"""Layer 3: kernels.

* :mod:`~flashfold.kernels.codegen`: the Triton lowering of the IR and the generated-source
  cache (monoid functions, score_mod / mask_mod);
* :mod:`~flashfold.kernels.torch_lower`: the torch lowering (CPU paths, autograd);
* :mod:`~flashfold.kernels.aot`: compile any launch for sm_90 on a CPU machine (registers,
  spills, shared memory, TMA/wgmma, access widths) — the CI check of the real compiler;
* :mod:`~flashfold.kernels.launcher`: launches through the compiled kernel's own launcher,
  keyed as Triton keys it (less host time than ``kernel[grid]``);
* :mod:`~flashfold.kernels.plans`: plan caches, a call's launches recorded per call
  signature and replayed;
* :mod:`~flashfold.kernels.compat`, :mod:`~flashfold.kernels.tma`: what differs between
  the supported Triton releases, and what the TMA can address;
* one package per kernel family, each with a pure-torch ``reference.py`` beside it:
  :mod:`~flashfold.kernels.reduce` (generated reduce and scan kernels for any monoid),
  :mod:`~flashfold.kernels.attention` (exact attention, forward and backward, Triton and
  Gluon), :mod:`~flashfold.kernels.decode` (split-KV decoding).

Nothing here is imported by ``import flashfold``; Triton is imported only by the modules
that need it.
"""
