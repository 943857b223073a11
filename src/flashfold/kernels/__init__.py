"""Layer 3: kernels.

* :mod:`~flashfold.kernels.codegen`: the Triton lowering of the IR and the generated-source
  cache (monoid functions, score_mod / mask_mod);
* :mod:`~flashfold.kernels.torch_lower`: the torch lowering (CPU paths, autograd);
* :mod:`~flashfold.kernels.aot`: compile any launch for sm_90 on a CPU machine (registers,
  spills, shared memory, TMA/wgmma, access widths) — the CI check of the real compiler;
* one package per kernel family, each with a pure-torch ``reference.py`` beside it.

Nothing here is imported by ``import flashfold``; Triton is imported only by the modules
that need it.
"""
