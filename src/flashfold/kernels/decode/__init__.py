"""Split-KV decoding (Flash-Decoding) over a contiguous or paged KV cache.

* :mod:`~flashfold.kernels.decode.reference`: pure torch (no Triton, no GPU): the paged
  gather and the float64 / float32 reference of the decode semantics;
* :mod:`~flashfold.kernels.decode.splitkv`: the Triton split-KV kernel template, the merge
  kernel generated from :data:`flashfold.monoids.ATTENTION`, the split heuristic and the
  launcher.

The public entry points are :func:`flashfold.decode` and :func:`flashfold.append_kv`
(:mod:`flashfold.api.decode`).
"""
