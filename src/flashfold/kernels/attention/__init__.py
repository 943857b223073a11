"""Exact attention kernels (the ATTENTION monoid's hand-tuned family).

* :mod:`.fwd`: the forward Triton template (FlashAttention-2 schedule), its tile table and
  launcher (:func:`~.fwd.attention_forward`), with a plan cache for calls without mods;
* :mod:`.bwd`: the backward Triton kernels (the preprocess of ``D`` and ``lambda``, the
  dK/dV and dQ passes, the dQ conversion) and their dispatcher
  (:func:`~.bwd.attention_backward`), which sends the calls it supports to the Gluon
  backward;
* :mod:`.gluon_fwd`, :mod:`.gluon_bwd`: warp-specialized Gluon kernels for Hopper (sm_90),
  forward and backward (dK/dV with dQ added by TMA reduce-add), each with its scope
  (``supported`` / ``eligible``) and the schedule rules measured on the H200;
* :mod:`.dispatch`: which kernel runs which call (one table for the forward and the
  backward) and the policy of switches that are not arguments of a call
  (:class:`~.dispatch.Policy`, changed by ``flashfold.attention_policy`` blocks);
* :mod:`.autograd`: ``flashfold.attention`` as a differentiable ``torch.library`` custom
  op (``flashfold::attn_fwd`` / ``attn_bwd``) and an eager ``autograd.Function`` over the
  same implementations, the mods registry (:func:`~.autograd.register_mods`), and the
  choice of implementation (the kernels on CUDA, the blocked references on CPU);
* :mod:`.merge`: merging normalized partial results ``(o, lse)`` with a kernel generated
  from ATTENTION (ring attention, split-KV decode);
* :mod:`.mods`: score_mod / mask_mod tracing and lowering (torch and Triton), table
  bounds, block masks (:func:`~.mods.create_block_mask`); the ready-made mods users call
  live above the kernels, in :mod:`flashfold.mods`;
* :mod:`.reference`: pure-torch references (no Triton import): the blocked forward and
  backward the CPU path runs, the naive oracle the tests compare with, merging partial
  states.

Ahead-of-time compile checks use the shared :mod:`flashfold.kernels.aot`. Nothing is
imported eagerly: :mod:`.reference` and :mod:`.mods` work without Triton. The public entry
points are :func:`flashfold.attention` and :func:`flashfold.merge_states`
(:mod:`flashfold.api.attention`).
"""
