"""Shared builders for the decode tests (no tests here): a KV cache in both layouts holding
the same tokens, the decode semantics restated through `flashfold.attention`, and a check
that the interpreter's load and store masks hold booleans."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class Case:
    q: torch.Tensor                 # (B, Hq, Lq, D)
    k: torch.Tensor                 # contiguous cache (B, Hkv, L, D)
    v: torch.Tensor
    seqlens: torch.Tensor           # (B,) int32
    k_pages: torch.Tensor | None    # paged cache (P, page, Hkv, D) with the same tokens
    v_pages: torch.Tensor | None
    block_table: torch.Tensor | None

    def cache(self, paged: bool):
        """(k_cache, v_cache, block_table) of one layout."""
        if paged:
            return self.k_pages, self.v_pages, self.block_table
        return self.k, self.v, None


def make_case(lens, heads_q=4, heads_kv=2, q_len=1, head_dim=32, capacity=None,
              page_size=None, dtype=torch.float16, seed=0, device="cpu", spare_pages=3) -> Case:
    """Random q/K/V for sequences of lengths ``lens``; with ``page_size`` also a paged copy
    whose pages are shuffled (and interleaved with unused pages) so the gather matters."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lens)
    capacity = capacity or max(max(lens), 1)
    q = torch.randn(batch, heads_q, q_len, head_dim, generator=g).to(dtype).to(device)
    k = torch.randn(batch, heads_kv, capacity, head_dim, generator=g).to(dtype).to(device)
    v = torch.randn(batch, heads_kv, capacity, head_dim, generator=g).to(dtype).to(device)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    kp = vp = table = None
    if page_size is not None:
        per_seq = -(-capacity // page_size)
        n_pages = batch * per_seq + spare_pages
        perm = torch.randperm(n_pages, generator=g)[:batch * per_seq].view(batch, per_seq)
        kp = torch.randn(n_pages, page_size, heads_kv, head_dim, generator=g).to(dtype).to(device)
        vp = torch.randn(n_pages, page_size, heads_kv, head_dim, generator=g).to(dtype).to(device)
        pad = per_seq * page_size - capacity
        for b in range(batch):
            kb = torch.nn.functional.pad(k[b].transpose(0, 1), (0, 0, 0, 0, 0, pad))
            vb = torch.nn.functional.pad(v[b].transpose(0, 1), (0, 0, 0, 0, 0, pad))
            kp[perm[b].to(device)] = kb.reshape(per_seq, page_size, heads_kv, head_dim)
            vp[perm[b].to(device)] = vb.reshape(per_seq, page_size, heads_kv, head_dim)
        table = perm.to(torch.int32).to(device)
    return Case(q, k, v, seqlens, kp, vp, table)


def attention_per_sequence(case: Case, *, scale=None, softcap=None, window=None,
                           cache_start=None, dtype=torch.float64):
    """``flashfold.attention`` on each sequence's own tokens (causal, bottom-right), in
    ``dtype``: the decode semantics restated through the attention API. With
    ``cache_start`` (a list or tensor), sequence ``b`` is its tokens ``[a_b, n_b)`` only,
    ``a_b`` clamped to ``[0, n_b]`` (bottom-right alignment keeps every position)."""
    import flashfold as ff

    outs, lses = [], []
    lens = case.seqlens.tolist()
    firsts = [0] * len(lens) if cache_start is None else [int(a) for a in cache_start]
    for b, (n, a) in enumerate(zip(lens, firsts)):
        a = min(max(a, 0), n)
        o, lse = ff.attention(case.q[b:b + 1].to(dtype), case.k[b:b + 1, :, a:n].to(dtype),
                              case.v[b:b + 1, :, a:n].to(dtype), causal=True, window=window,
                              scale=scale, softcap=softcap, return_lse=True)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def repage(case: Case, page_size: int) -> Case:
    """A paged copy of ``case``'s contiguous tokens (fresh shuffled pages)."""
    batch, heads_kv, cap, d = case.k.shape
    per_seq = -(-cap // page_size)
    g = torch.Generator().manual_seed(batch)
    perm = torch.randperm(batch * per_seq + 2, generator=g)[:batch * per_seq].view(batch, per_seq)
    kp = torch.zeros(batch * per_seq + 2, page_size, heads_kv, d, dtype=case.k.dtype, device=case.k.device)
    vp = torch.zeros_like(kp)
    pad = per_seq * page_size - cap
    for b in range(batch):
        kb = torch.nn.functional.pad(case.k[b].transpose(0, 1), (0, 0, 0, 0, 0, pad))
        vb = torch.nn.functional.pad(case.v[b].transpose(0, 1), (0, 0, 0, 0, 0, pad))
        kp[perm[b]] = kb.reshape(per_seq, page_size, heads_kv, d)
        vp[perm[b]] = vb.reshape(per_seq, page_size, heads_kv, d)
    return Case(case.q, case.k, case.v, case.seqlens, kp, vp, perm.to(torch.int32).to(case.k.device))


@contextmanager
def strict_interpreter_masks():
    """Under ``TRITON_INTERPRET=1``: every load and store mask must hold booleans (int1).

    Triton's interpreter labels a scalar comparison with its operands' type, so a scalar
    condition splatted into a block mask becomes int32 data; Triton 3.6 loads and stores
    through such masks, 3.9 rejects them ("mask has unsupported dtype"). Checking it on
    every version keeps the kernels free of the older interpreter's leniency. A no-op
    without the interpreter."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    saved = builder.create_masked_load, builder.create_masked_store

    def checked(original, what, at):          # mask: the at-th argument after the pointers
        def wrapper(self, ptrs, *args, **kwargs):
            mask = args[at] if len(args) > at else kwargs["mask"]
            mask = mask if isinstance(mask, np.ndarray) else mask.data   # TMA: bare array
            assert mask.dtype == np.bool_, f"{what} mask holds {mask.dtype}, not booleans"
            return original(self, ptrs, *args, **kwargs)
        return wrapper

    builder.create_masked_load = checked(saved[0], "load", 0)
    builder.create_masked_store = checked(saved[1], "store", 1)
    try:
        yield
    finally:
        builder.create_masked_load, builder.create_masked_store = saved
