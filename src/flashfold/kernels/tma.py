"""What the Tensor Memory Accelerator (Hopper's bulk tensor copies) can address, and the
strides a descriptor gets: the rule shared by the attention, decode and Gluon kernels.

A kernel has one more rule to keep, at run time: the start coordinate of a box along the
innermost dim times the element size must be a multiple of 16 bytes (otherwise an
illegal instruction). Tiles along an outer dim (rows of ``(B, H, N, D)``, the innermost
coordinate 0) keep it; a box along the rows of a per-row statistic (``(B, H, 1, N)``
fp32) keeps it only if the tile's first row is a multiple of 4."""

from __future__ import annotations

import torch

__all__ = ["addressable", "box_strides"]


def addressable(t: torch.Tensor) -> bool:
    """Unit last stride, a 16-byte aligned base, and the stride of every other dim longer
    than 1 a non-zero multiple of 16 bytes (a size-1 dim's stride is never used: see
    :func:`box_strides`)."""
    es = t.element_size()
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        return False
    return not any(s == 0 or (s * es) % 16
                   for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)


def box_strides(t: torch.Tensor) -> list[int]:
    """``t``'s strides for a descriptor: a size-1 dim's (irrelevant, possibly unaligned)
    replaced by an aligned value, the last one 1."""
    align = 16 // t.element_size()
    strides = [s if n > 1 else align for s, n in zip(t.stride(), t.shape)]
    strides[-1] = 1
    return strides
