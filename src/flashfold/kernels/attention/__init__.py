"""Exact attention kernels (the ATTENTION monoid's hand-tuned family).

* :mod:`.reference`: pure-torch blocked reference and naive oracle (no Triton import);
* :mod:`.mods`: score_mod / mask_mod tracing and lowering, block masks, user helpers;
* :mod:`.fwd`: the forward Triton template and launcher;
* :mod:`.merge`: merging partial results with a kernel generated from ATTENTION;
* ahead-of-time compile checks use the shared :mod:`flashfold.kernels.aot`.

Nothing is imported eagerly: :mod:`.reference` and :mod:`.mods` work without Triton.
"""
