"""Exact attention kernels (the ATTENTION monoid's hand-tuned family).

* :mod:`.reference`: pure-torch blocked reference and naive oracle (no Triton import);
* :mod:`.mods`: score_mod / mask_mod tracing and lowering, block masks, user helpers;
* :mod:`.fwd`: the forward Triton template and launcher;
* :mod:`.merge`: merging partial results with a kernel generated from ATTENTION;
* :mod:`.aot`: ahead-of-time compilation checks for a GPU target on a CPU machine.

Nothing is imported eagerly: :mod:`.reference` and :mod:`.mods` work without Triton.
"""
