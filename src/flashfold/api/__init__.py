"""Layer 4: the public tensor entry points (re-exported lazily from :mod:`flashfold`).

* :mod:`~flashfold.api.reductions`: ``reduce``, ``segment_reduce``, ``scan`` and the
  torch-like conveniences, from kernels generated out of monoids;
* :mod:`~flashfold.api.attention`: ``attention``, ``merge_states`` and block masks;
* :mod:`~flashfold.api.decode`: split-KV decoding over a paged KV cache.

Each dispatches to a Triton kernel on CUDA tensors and to the reference implementation
on CPU tensors, with the same semantics.
"""
