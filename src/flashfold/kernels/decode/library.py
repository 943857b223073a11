"""``flashfold.decode`` and ``append_kv``'s length check as ``torch.library`` custom ops.

Under ``torch.compile`` the API calls :func:`decode_op` (``flashfold::decode``), which
Dynamo traces as one node (its fake implementation gives the shapes): the split-KV launch
and the reference's per-sequence loops, which read lengths on the host, run inside it,
unseen by the tracer. Eager calls run :func:`decode_impl` directly (the kernels' eager fast
path, with its plan cache, stays in the API). The op reads the caches and writes nothing
of its inputs. ``append_kv`` is plain torch ops, traced as they are, but its range check
reads the lengths: :func:`checked_lengths` (``flashfold::checked_lengths``) runs it inside
an op whose output the writes' positions are computed from, so the check comes first.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .reference import check_lengths, decode_reference


def decode_impl(q, k_cache, v_cache, cache_seqlens, block_table, cache_start, k_descale,
                v_descale, *, scale, softcap, window, num_splits, batch_invariant, max_seqlen,
                use_kernels):
    """``(o, lse)`` of a validated decode call (:func:`flashfold.decode`'s arguments,
    ``window`` normalized): the split-KV kernels, or the reference in float32 (float64 for
    float64 inputs); ``o`` in ``q``'s dtype, ``lse`` float32."""
    if use_kernels:
        from .splitkv import splitkv_decode
        return splitkv_decode(q, k_cache, v_cache, cache_seqlens, block_table, scale=scale,
                              softcap=softcap, window=window, num_splits=num_splits,
                              batch_invariant=batch_invariant, max_seqlen=max_seqlen,
                              cache_start=cache_start, k_descale=k_descale,
                              v_descale=v_descale)
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    o, lse = decode_reference(q, k_cache, v_cache, cache_seqlens, block_table, scale=scale,
                              softcap=softcap, window=window, cache_start=cache_start,
                              compute_dtype=cd, k_descale=k_descale, v_descale=v_descale)
    return o.to(q.dtype), lse.to(torch.float32)


@torch.library.custom_op("flashfold::decode", mutates_args=())
def decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              cache_seqlens: torch.Tensor, block_table: Optional[torch.Tensor],
              cache_start: Optional[torch.Tensor], k_descale: Optional[torch.Tensor],
              v_descale: Optional[torch.Tensor], scale: float, softcap: Optional[float],
              left: Optional[int], right: Optional[int], windowed: bool,
              num_splits: Optional[int], batch_invariant: bool, max_seqlen: Optional[int],
              check_capacity: Optional[int], use_kernels: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_impl` as an op: ``(o (B, Hq, q_len, D) in q's dtype, lse (B, Hq,
    q_len) float32)``, contiguous. ``windowed``: a window ``(left, right)`` is given
    (``None`` sides unbounded); ``check_capacity``: range-check the lengths against it
    first (:func:`check_lengths`)."""
    if check_capacity is not None:
        check_lengths(cache_seqlens, check_capacity, block_table, k_cache.shape[0],
                      cache_start=cache_start)
    o, lse = decode_impl(q, k_cache, v_cache, cache_seqlens, block_table, cache_start,
                         k_descale, v_descale, scale=scale, softcap=softcap,
                         window=(left, right) if windowed else None, num_splits=num_splits,
                         batch_invariant=batch_invariant, max_seqlen=max_seqlen,
                         use_kernels=use_kernels)
    return o.contiguous(), lse.contiguous()


@torch.library.custom_op("flashfold::checked_lengths", mutates_args=())
def checked_lengths(cache_seqlens: torch.Tensor, block_table: Optional[torch.Tensor],
                    capacity: int, num_pages: int, extra: int) -> torch.Tensor:
    """A copy of ``cache_seqlens`` after :func:`~.reference.check_lengths` (``+ extra``
    new tokens against ``capacity``, the pages in use against ``num_pages``)."""
    check_lengths(cache_seqlens, capacity, block_table, num_pages, extra=extra)
    return cache_seqlens.clone()


@checked_lengths.register_fake
def _checked_lengths_fake(cache_seqlens, block_table, capacity, num_pages, extra):
    return torch.empty_like(cache_seqlens)


@decode_op.register_fake
def _decode_fake(q, k_cache, v_cache, cache_seqlens, block_table, cache_start, k_descale,
                 v_descale, scale, softcap, left, right, windowed, num_splits, batch_invariant,
                 max_seqlen, check_capacity, use_kernels):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


__all__ = ["decode_op", "decode_impl", "checked_lengths"]
