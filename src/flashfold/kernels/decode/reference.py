r"""Pure-torch reference of decoding against a KV cache (no Triton, no GPU needed).

Semantics (shared by :func:`flashfold.decode`, the Triton kernels and this module). For
sequence ``b`` of length ``n_b = cache_seqlens[b]``, first key ``a_b = clamp(cache_start[b],
0, n_b)`` (0 without ``cache_start``; left padding: the first ``a_b`` cache slots of the row
are not part of the sequence) and ``q_len = Lq`` query tokens, the queries are the *last*
``Lq`` tokens of the cache: query row ``i`` sits at absolute position

.. math::  p_i = n_b - L_q + i ,

and key ``j`` (``a_b <= j < n_b``) is visible to it iff

.. math::  j \le p_i \quad\text{and}\quad p_i - w_\ell \le j \le p_i + w_r

(causal inside the cache; ``(w_l, w_r)`` the optional window, ``None`` for unbounded; with
causality ``w_r`` only matters when negative). The alignment stays bottom-right against
``n_b`` whatever ``a_b`` is: keys before ``a_b`` are simply invisible, like keys left of a
window, and their cache slots are never read (they may hold anything). Query head ``h``
reads key/value head ``h // (H_q / H_kv)`` (GQA). With ``s_j = scale * q_i . k_j`` (then
``softcap * tanh(s_j / softcap)`` when a softcap is given):

.. math::  \mathrm{lse}_i = \log \sum_{j\ \mathrm{visible}} e^{s_j}, \qquad
           o_i = \sum_{j\ \mathrm{visible}} e^{s_j - \mathrm{lse}_i}\, v_j ,

and a row with no visible key (empty sequence, ``a_b >= n_b``, or ``p_i < a_b``) gives
``o_i = 0`` and ``lse_i = -inf``: the identity state of the ATTENTION monoid, so it merges
correctly.

Non-finite inputs reach exactly the outputs that depend on them:

1. a key that is not visible to row ``i`` (outside ``[a_b, n_b)``, after ``p_i``, left of
   the window) contributes nothing to it, whatever its key and value hold (NaN, inf,
   garbage);
2. a visible key with a NaN or ``+inf`` score gives ``o_i = NaN`` (every channel) and
   ``lse_i = NaN``; a ``-inf`` score is weight 0, and the empty-row result ``(0, -inf)``
   holds only when every visible score is ``-inf`` or no key is visible (a NaN in ``q_i``
   makes its row NaN unless it sees no key);
3. a non-finite entry ``v_j[c]`` of a visible key makes ``o_i[c]`` non-finite (NaN here)
   and leaves the other channels and ``lse_i`` as they are.

(``p @ v`` alone would carry ``0 x NaN = NaN`` from a hidden key's value into every row;
the reference zeroes non-finite values in the product and marks the ``(row, channel)``
pairs that see one.)

Cache layouts:

* contiguous: ``k_cache``, ``v_cache`` of shape ``(batch, heads_kv, max_len, head_dim)``;
  sequence ``b`` owns ``k_cache[b, :, :n_b]``;
* paged: ``(num_pages, page_size, heads_kv, head_dim)`` with ``block_table`` of shape
  ``(batch, max_pages)`` (int32): token ``t`` of sequence ``b`` lives in page
  ``block_table[b, t // page_size]`` at slot ``t % page_size``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["clamped_lengths", "cache_capacity", "clamped_starts", "gather_kv", "gather_kv_padded",
           "check_lengths", "decode_reference"]


def clamped_lengths(cache_seqlens: torch.Tensor, capacity: int) -> list[int]:
    """Each sequence's length ``clamp(cache_seqlens[b], 0, capacity)``, read on the host:
    unchecked lengths (``check_lengths=False``) mean what the kernels make of them."""
    return [min(max(int(x), 0), capacity) for x in cache_seqlens.tolist()]


def cache_capacity(k_cache: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """Token slots per sequence: ``k_cache``'s ``max_len`` (contiguous ``(batch, heads_kv,
    max_len, D)``), or pages per sequence times the page size (paged)."""
    if block_table is None:
        return k_cache.shape[2]
    return block_table.shape[1] * k_cache.shape[1]


def clamped_starts(cache_seqlens: torch.Tensor, cache_start: torch.Tensor | None,
                   cap: int | None = None) -> list[int]:
    """Each sequence's first key ``clamp(cache_start[b], 0, n_b)`` (all 0 without
    ``cache_start``), read on the host; ``n_b`` the length, clamped to ``cap`` when given."""
    lens = ([int(x) for x in cache_seqlens.tolist()] if cap is None
            else clamped_lengths(cache_seqlens, cap))
    if cache_start is None:
        return [0] * len(lens)
    return [min(max(int(a), 0), n) for a, n in zip(cache_start.tolist(), lens)]


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
              block_table: torch.Tensor | None = None,
              cache_start: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The tokens ``[a_b, n_b)`` of every sequence (``n_b = cache_seqlens[b]`` clamped to
    ``[0, capacity]``, ``a_b`` its clamped ``cache_start``, 0 by default), as ``(heads_kv,
    n_b - a_b, head_dim)``.

    Contiguous caches give views; paged caches give gathered copies (pages in block-table
    order; pages holding no token of ``[a_b, n_b)`` are not looked up). Reads
    ``cache_seqlens`` and ``cache_start`` on the host.
    """
    out = []
    cap = cache_capacity(k_cache, block_table)
    lens = clamped_lengths(cache_seqlens, cap)
    for b, (n, a) in enumerate(zip(lens, clamped_starts(cache_seqlens, cache_start, cap))):
        if block_table is None:
            out.append((k_cache[b, :, a:n], v_cache[b, :, a:n]))
            continue
        page = k_cache.shape[1]
        first = a // page
        pages = block_table[b, first:-(-n // page)].long()
        cut = slice(a - first * page, n - first * page)
        k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[cut]     # (n - a, heads_kv, head_dim)
        v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[cut]
        out.append((k.transpose(0, 1), v.transpose(0, 1)))
    return out


def gather_kv_padded(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged cache -> contiguous ``(batch, heads_kv, length, head_dim)`` (the first ``length``
    token slots of every sequence, whatever its own length): the gather that a paged baseline
    built on SDPA performs before calling it. No host synchronisation."""
    page = k_cache.shape[1]
    n_pages = -(-length // page)
    pages = block_table[:, :n_pages].long()                          # (batch, n_pages)
    k = k_cache[pages].flatten(1, 2)[:, :length].transpose(1, 2)    # (batch, heads_kv, L, D)
    v = v_cache[pages].flatten(1, 2)[:, :length].transpose(1, 2)
    return k, v


def _bound(w) -> float:
    return math.inf if w is None or w < 0 else float(w)


def check_lengths(cache_seqlens, capacity, block_table, num_pages, extra=0,
                  name="cache_seqlens", cache_start=None):
    """Host-side range checks of ``cache_seqlens`` (``+ extra`` new tokens) against the
    ``capacity`` and of the block table's pages in use (those holding a token of
    ``[cache_start, cache_seqlens + extra)``) against ``num_pages``: ``ValueError`` naming
    the argument. Reads the tensors: a device synchronisation on CUDA."""
    lens = cache_seqlens.to("cpu", torch.int64)
    if lens.numel() and (int(lens.min()) < 0 or int(lens.max()) + extra > capacity):
        what = f" + {extra} new tokens" if extra else ""
        raise ValueError(f"{name}: lengths{what} must lie in [0, {capacity}] (the cache "
                         f"capacity), got min {int(lens.min())}, max {int(lens.max())}")
    if block_table is not None and lens.numel() and block_table.shape[1]:
        page = capacity // block_table.shape[1]
        used = (lens + extra + page - 1) // page
        first = torch.zeros_like(lens)
        if cache_start is not None:
            first = torch.minimum(cache_start.to("cpu", torch.int64).clamp(min=0), lens) // page
        bt = block_table.to("cpu", torch.int64)
        cols = torch.arange(bt.shape[1])[None, :]
        live = bt[(cols < used[:, None]) & (cols >= first[:, None])]
        if live.numel() and (int(live.min()) < 0 or int(live.max()) >= num_pages):
            raise ValueError(f"block_table: the pages in use must lie in [0, {num_pages}), got "
                             f"min {int(live.min())}, max {int(live.max())}")


def decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None, *,
                     scale: float | None = None, softcap: float | None = None,
                     window: tuple[int | None, int | None] | None = None,
                     cache_start: torch.Tensor | None = None,
                     compute_dtype: torch.dtype = torch.float64,
                     k_descale: torch.Tensor | None = None,
                     v_descale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode ``q`` (batch, heads_q, q_len, head_dim) against the cache, one sequence at a time.

    ``cache_start``: optional ``(batch,)`` first key of each sequence (clamped to ``[0,
    n_b]``; slots before it are never read). Computes in ``compute_dtype`` (float64 for
    tests, float32 for the public CPU path) and returns ``(o, lse)`` in that dtype: ``o``
    of shape (batch, heads_q, q_len, head_dim), ``lse`` (natural log) of shape (batch,
    heads_q, q_len). See the module docstring for the visibility rule; inputs are assumed
    validated (:func:`flashfold.decode` does that). An E4M3 cache comes with ``k_descale``,
    ``v_descale`` ``(batch, heads_kv)``: sequence ``b``'s keys of head ``h`` are
    dequantized to ``k_descale[b, h]`` times their stored value (values likewise), in
    ``compute_dtype``, before anything else.
    """
    batch, heads_q, q_len, head_dim = q.shape
    heads_kv = k_cache.shape[1] if block_table is None else k_cache.shape[2]
    group = heads_q // heads_kv
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    left, right = (None, None) if window is None else window
    left, right = _bound(left), _bound(right)
    o = torch.zeros(batch, heads_q, q_len, head_dim, dtype=compute_dtype, device=q.device)
    lse = torch.full((batch, heads_q, q_len), -math.inf, dtype=compute_dtype, device=q.device)
    cap = cache_capacity(k_cache, block_table)
    firsts = clamped_starts(cache_seqlens, cache_start, cap)
    lens = clamped_lengths(cache_seqlens, cap)
    for b, (k, v) in enumerate(gather_kv(k_cache, v_cache, cache_seqlens, block_table,
                                         cache_start)):
        n, a = lens[b], firsts[b]                                     # keys [a, n)
        if n == a:
            continue
        k, v = k.to(compute_dtype), v.to(compute_dtype)              # (heads_kv, n - a, D)
        if k_descale is not None:
            k = k * k_descale[b].to(compute_dtype)[:, None, None]
            v = v * v_descale[b].to(compute_dtype)[:, None, None]
        k = k.repeat_interleave(group, dim=0)                         # (heads_q, n - a, D)
        v = v.repeat_interleave(group, dim=0)
        s = q[b].to(compute_dtype) @ k.transpose(-1, -2) * scale      # (heads_q, q_len, n - a)
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        pos = torch.arange(q_len, device=q.device, dtype=torch.float64)[:, None] + (n - q_len)
        j = torch.arange(a, n, device=q.device, dtype=torch.float64)[None, :]
        visible = (j <= pos) & (j >= pos - left) & (j <= pos + right)  # (q_len, n - a)
        s = s.masked_fill(~visible, -math.inf)                        # hidden: any value
        nan_row = (torch.isnan(s) | (s == math.inf)).any(-1)          # (heads_q, q_len)
        s = s.masked_fill(nan_row[..., None], -math.inf)              # NaN again below
        row_lse = torch.logsumexp(s, dim=-1)                          # -inf for empty rows
        pivot = torch.where(torch.isinf(row_lse), torch.zeros_like(row_lse), row_lse)
        p = torch.exp(s - pivot[..., None])                           # 0 where masked
        finite = torch.isfinite(v)
        if finite.all():
            o[b] = p @ v
        else:   # p @ v would carry 0 * NaN from hidden keys: only visible ones may reach o
            seen = visible.to(compute_dtype) @ (~finite).to(compute_dtype)  # (heads_q, q_len, D)
            live = (row_lse > -math.inf)[..., None]
            o[b] = (p @ torch.where(finite, v, 0.0)).masked_fill((seen > 0) & live, math.nan)
        o[b] = o[b].masked_fill(nan_row[..., None], math.nan)
        lse[b] = row_lse.masked_fill(nan_row, math.nan)
    return o, lse
