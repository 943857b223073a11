"""Beyond one device: ring attention over ``torch.distributed``.

:func:`ring_attention` computes exact attention of a sequence sharded across the ranks of a
process group (K/V blocks pass around the ring, partial results merge with the attention
monoid); :func:`shard`, :func:`unshard` and :func:`shard_lengths` convert between a full
tensor and the per-rank shards of a layout (``"contiguous"`` or ``"zigzag"``). Details and
the math in :mod:`flashfold.distributed.ring`.
"""

from .ring import LAYOUTS, chunk_lengths, ring_attention, shard, shard_lengths, unshard

__all__ = ["ring_attention", "shard", "unshard", "shard_lengths", "chunk_lengths", "LAYOUTS"]
