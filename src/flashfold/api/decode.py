r"""Decoding against a KV cache: split-KV attention merged by the ATTENTION monoid.

:func:`decode` attends a few new query tokens per sequence (``q_len`` from 1 to 16: plain
decoding, or speculative decoding's draft tokens) to each sequence's cached keys and
values, contiguous or paged; :func:`append_kv` writes new keys and values into the cache;
:class:`PagedKVCache` bundles a paged cache, its block table and its lengths.

Semantics (as FlashAttention's KV-cache API). For sequence ``b`` with ``n_b =
cache_seqlens[b]`` cached tokens and first key ``a_b = clamp(cache_start[b], 0, n_b)``
(``0`` without ``cache_start``; left padding: the row's first ``a_b`` slots are not part of
the sequence), the ``q_len`` queries are the *last* ``q_len`` tokens of the cache: query
``i`` sits at position ``p_i = n_b - q_len + i`` and sees key ``j`` iff

.. math::  a_b \le j \le p_i \quad\text{and}\quad j \ge p_i - w_\ell
           \quad (\text{window } (w_\ell, w_r)),

i.e. causal inside the cache (the same as ``flashfold.attention(q, k[a_b:n_b],
v[a_b:n_b], causal=True, window=window)``, whose causal rule aligns the queries
bottom-right, so the window's right side has no further effect). The alignment is against
``n_b`` whatever ``a_b``: keys before ``a_b`` are invisible like keys left of a window, and
their slots are never read. With ``s_j = scale\, q_i \cdot k_j`` (then
``softcap \tanh(s_j / softcap)``):

.. math::  \mathrm{lse}_i = \log \sum_{j\,\mathrm{visible}} e^{s_j}, \qquad
           o_i = \sum_{j\,\mathrm{visible}} e^{s_j - \mathrm{lse}_i} v_j,

and a row with no visible key (``n_b = 0``, ``a_b >= n_b``, or ``p_i < a_b``) gives ``o_i = 0``,
``lse_i = -inf`` (never NaN or +inf), the identity of the monoid, so such a partial result
merges correctly with others (:func:`flashfold.merge_states`).

On CUDA the split-KV Triton kernels of :mod:`flashfold.kernels.decode.splitkv` run (keys
cut into splits across thread blocks, partial states merged by the monoid's generated
combine; nothing synchronises with the host, so a decode step can be captured in a CUDA
graph); on the CPU the pure-torch reference of :mod:`flashfold.kernels.decode.reference`
runs (float32 accumulation; float64 inputs in float64), with the same semantics.
Under ``torch.compile(fullgraph=True)`` a decode call is one custom op,
``flashfold::decode``, and ``append_kv`` traces as the torch ops it is, its length check
(where it runs) inside ``flashfold::checked_lengths``
(:mod:`flashfold.kernels.decode.library`).
Environment: ``FLASHFOLD_DECODE_TMA=0`` reads K/V through ``cp.async`` pointers instead of
TMA boxes (the default on Hopper for caches of >= 256 MiB of K and V that TMA can
address), ``FLASHFOLD_DECODE_PDL=0`` launches the merge without
programmatic dependent launch (both for measurement; the values do not change),
``FLASHFOLD_PLAN_CACHE=0`` plans every call anew (by default a repeated call signature
replays its launches, its tensor checks included: see the "Plan cache" notes of
:mod:`flashfold.kernels.decode.splitkv`).
"""

from __future__ import annotations

import math

import torch

from ..kernels.decode.reference import check_lengths as _check_lengths
from .validate import (MAX_HEAD_DIM, check_bool, check_positive, check_window, is_meta,
                       no_values, unbounded_beyond)

#: the most query tokens per sequence :func:`decode` takes
MAX_Q_LEN = 16

_GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CPU_DTYPES = _GPU_DTYPES + (torch.float64,)
#: the 8-bit cache format: E4M3 (largest finite value 448), with per-(sequence, kv head)
#: descales; the other FP8 formats are refused by name
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_OTHER_FP8 = tuple(getattr(torch, n) for n in ("float8_e5m2", "float8_e4m3fnuz",
                                                "float8_e5m2fnuz") if hasattr(torch, n))


# --- validation -------------------------------------------------------------------------

def _tensor(x, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def _window(window, capacity=None):
    """``(left, right)`` with ``None`` for an unbounded side (``-1`` also means unbounded;
    a left side of at least ``capacity`` reaches past every key: unbounded too), or
    ``None`` when both are."""
    left, right = check_window(window)
    if capacity is not None:
        left = unbounded_beyond(left, capacity)
    return None if left is None and right is None else (left, right)


def _layout(q, k_cache, v_cache, cache_seqlens, block_table, dtypes=None, names=None):
    """Validate shapes/dtypes/devices; returns (heads_kv, page_size or None, capacity).
    ``names`` renames arguments in the messages (``{"q": "k_new"}``: a stand-in query
    built from another argument). The cache holds ``q``'s dtype, or E4M3 (:data:`FP8`,
    both caches; the descales are checked by :func:`_descales`)."""
    n = {"q": "q", "k_cache": "k_cache", "v_cache": "v_cache", "cache_seqlens": "cache_seqlens",
         "block_table": "block_table", **(names or {})}
    qn = n["q"]
    for x, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"),
                    (cache_seqlens, "cache_seqlens")):
        _tensor(x, n[name])
    dev = q.device
    ok = dtypes or (_GPU_DTYPES if dev.type == "cuda" else _CPU_DTYPES)
    if q.dtype not in ok:
        raise TypeError(f"{qn}: dtype must be one of {[str(d) for d in ok]} on {dev.type}, "
                        f"got {q.dtype}")
    for x, name in ((k_cache, n["k_cache"]), (v_cache, n["v_cache"])):
        if x.dtype in _OTHER_FP8:
            raise TypeError(f"{name}: {x.dtype} caches are not supported; the 8-bit cache "
                            f"format is torch.float8_e4m3fn")
        if x.dtype != q.dtype and not (x.dtype == FP8 and k_cache.dtype == v_cache.dtype):
            raise TypeError(f"{name}: dtype {x.dtype} differs from {qn}'s {q.dtype}"
                            + (f" (an 8-bit cache needs both {n['k_cache']} and "
                               f"{n['v_cache']} in float8_e4m3fn)"
                               if FP8 in (k_cache.dtype, v_cache.dtype) else ""))
        if x.device != dev:
            raise ValueError(f"{name}: on {x.device}, {qn} on {dev}")
    if q.ndim != 4:
        raise ValueError(f"{qn}: expected (batch, heads_q, q_len, head_dim), got shape "
                         f"{tuple(q.shape)}")
    batch, heads_q, q_len, head_dim = q.shape
    if not 1 <= q_len <= MAX_Q_LEN:
        raise ValueError(f"{qn}: q_len (dim 2) must be in 1..{MAX_Q_LEN}, got {q_len}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{qn}: head_dim must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
    if batch < 1 or heads_q < 1:
        raise ValueError(f"{qn}: batch and heads must be >= 1, got shape {tuple(q.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{n['v_cache']}: shape {tuple(v_cache.shape)} differs from "
                         f"{n['k_cache']}'s {tuple(k_cache.shape)}")
    if k_cache.ndim != 4:
        raise ValueError(f"{n['k_cache']}: expected 4 dims, got shape {tuple(k_cache.shape)}")
    if block_table is None:
        kb, heads_kv, capacity, kd = k_cache.shape
        page_size = None
        if kb != batch:
            raise ValueError(f"{n['k_cache']}: contiguous cache (batch, heads_kv, max_len, "
                             f"head_dim) has batch {kb}, {qn} has {batch} (pass block_table for "
                             f"a paged cache)")
    else:
        bn = n["block_table"]
        _tensor(block_table, bn)
        if block_table.dtype != torch.int32:
            raise TypeError(f"{bn}: dtype must be torch.int32, got {block_table.dtype}")
        if block_table.device != dev:
            raise ValueError(f"{bn}: on {block_table.device}, {qn} on {dev}")
        if block_table.ndim != 2 or block_table.shape[0] != batch:
            raise ValueError(f"{bn}: expected shape (batch={batch}, max_pages), got "
                             f"{tuple(block_table.shape)}")
        _, page_size, heads_kv, kd = k_cache.shape
        if page_size < 1:
            raise ValueError(f"{n['k_cache']}: paged cache (num_pages, page_size, heads_kv, "
                             f"head_dim) has page_size {page_size}")
        capacity = block_table.shape[1] * page_size
    if kd != head_dim:
        raise ValueError(f"{n['k_cache']}: head_dim {kd} differs from {qn}'s {head_dim}")
    if heads_kv < 1 or heads_q % heads_kv:
        if qn != "q":
            raise ValueError(f"{qn}: {heads_q} heads differ from the cache's heads_kv={heads_kv}")
        raise ValueError(f"q: heads_q={heads_q} must be a multiple of the cache's heads_kv="
                         f"{heads_kv}")
    sn = n["cache_seqlens"]
    if cache_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{sn}: dtype must be torch.int32 or torch.int64, got "
                        f"{cache_seqlens.dtype}")
    if cache_seqlens.device != dev:
        raise ValueError(f"{sn}: on {cache_seqlens.device}, {qn} on {dev}")
    if cache_seqlens.shape != (batch,):
        raise ValueError(f"{sn}: expected shape ({batch},), got {tuple(cache_seqlens.shape)}")
    return heads_kv, page_size, capacity


def _descales(k_cache, v_cache, k_descale, v_descale, batch, heads_kv, dev):
    """Validate the descales of an E4M3 cache: float32 ``(batch, heads_kv)`` on the
    cache's device, both required with an 8-bit cache and refused without one."""
    fp8 = k_cache.dtype == FP8
    for x, name in ((k_descale, "k_descale"), (v_descale, "v_descale")):
        if x is None:
            if fp8:
                raise ValueError(f"{name}: required with a float8_e4m3fn cache (the factor "
                                 f"that turns the stored values back into real ones, "
                                 f"float32 (batch, heads_kv))")
            continue
        _tensor(x, name)
        if not fp8:
            raise ValueError(f"{name}: only with a float8_e4m3fn cache, got a {k_cache.dtype} "
                             f"cache")
        if x.dtype != torch.float32:
            raise TypeError(f"{name}: dtype must be torch.float32, got {x.dtype}")
        if x.device != dev:
            raise ValueError(f"{name}: on {x.device}, the cache on {dev}")
        if x.shape != (batch, heads_kv):
            raise ValueError(f"{name}: expected shape (batch={batch}, heads_kv={heads_kv}), "
                             f"got {tuple(x.shape)}")


def _cache_start(cache_start, batch, dev):
    """Validate the optional ``(batch,)`` int32 first keys (any values: clamped to ``[0, n_b]``)."""
    if cache_start is None:
        return None
    _tensor(cache_start, "cache_start")
    if cache_start.dtype != torch.int32:
        raise TypeError(f"cache_start: dtype must be torch.int32, got {cache_start.dtype}")
    if cache_start.device != dev:
        raise ValueError(f"cache_start: on {cache_start.device}, q on {dev}")
    if cache_start.shape != (batch,):
        raise ValueError(f"cache_start: expected shape ({batch},), got "
                         f"{tuple(cache_start.shape)}")
    return cache_start


def _options(head_dim, scale, softcap, window, num_splits, batch_invariant, max_seqlen,
             return_lse, capacity=None):
    """Validate the scalar options (the checks of :func:`flashfold.attention` where the two
    share an option: :mod:`.validate`); returns ``(scale, softcap, window)`` normalized
    (the scale's default ``1 / sqrt(head_dim)``; a window side of at least ``capacity``:
    unbounded)."""
    scale = check_positive("scale", scale)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    softcap = check_positive("softcap", softcap)
    win = _window(window, capacity)
    check_bool("return_lse", return_lse)
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant: expected a bool, got {type(batch_invariant).__name__}")
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, int):
            raise TypeError(f"num_splits: expected an int, got {type(num_splits).__name__}")
        if not 1 <= num_splits <= 65535:
            raise ValueError(f"num_splits: must be in 1..65535, got {num_splits}")
        if batch_invariant:
            raise ValueError("num_splits: batch_invariant=True fixes the split size; do not "
                             "pass num_splits with it")
    if max_seqlen is not None:
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
            raise TypeError(f"max_seqlen: expected an int, got {type(max_seqlen).__name__}")
        if max_seqlen < 0:
            raise ValueError(f"max_seqlen: must be >= 0, got {max_seqlen}")
    return scale, softcap, win


def _capacity(k_cache, block_table):
    """The cache's capacity read from the shapes, or None where they are malformed (the
    tensors' checks, which may run later, then say what is wrong)."""
    if k_cache.dim() != 4:
        return None
    if block_table is None:
        return k_cache.shape[2]
    return block_table.shape[1] * k_cache.shape[1] if block_table.dim() == 2 else None


def _check_tensors(q, k_cache, v_cache, cache_seqlens, block_table, cache_start,
                   k_descale=None, v_descale=None):
    """The checks of :func:`decode`'s tensors (``_layout``, ``_cache_start``,
    ``_descales``): they read only what a plan key holds of them (shapes, dtypes,
    devices)."""
    heads_kv, _, _ = _layout(q, k_cache, v_cache, cache_seqlens, block_table)
    _cache_start(cache_start, q.shape[0], q.device)
    _descales(k_cache, v_cache, k_descale, v_descale, q.shape[0], heads_kv, q.device)


def _use_kernels(q: torch.Tensor) -> bool:
    """Whether the call goes to the split-KV kernels (CUDA) or the reference (CPU). Tests
    patch this to drive the kernels on CPU tensors under ``TRITON_INTERPRET=1``."""
    return q.is_cuda


def _kernel_call(q, k_cache, v_cache, cache_seqlens, block_table, cache_start) -> bool:
    """Whether the call goes to the kernels with tensors where tensors belong and a 4-D
    ``q`` with a head dim (what the plan key and the scale's default read before the
    tensors' checks run, :func:`_check_tensors`)."""
    T = torch.Tensor
    return (isinstance(q, T) and isinstance(k_cache, T) and isinstance(v_cache, T)
            and isinstance(cache_seqlens, T) and (block_table is None or isinstance(block_table, T))
            and (cache_start is None or isinstance(cache_start, T)) and q.dim() == 4
            and q.shape[3] >= 1 and _use_kernels(q))


_SPLITKV = []


def _splitkv():
    """The module :mod:`flashfold.kernels.decode.splitkv`, imported on first use (this
    module imports without Triton; an ``import`` statement per call costs ~1 us)."""
    if not _SPLITKV:
        from ..kernels.decode import splitkv
        _SPLITKV.append(splitkv)
    return _SPLITKV[0]


# --- public functions -------------------------------------------------------------------

def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           cache_seqlens: torch.Tensor, *, block_table: torch.Tensor | None = None,
           scale: float | None = None, softcap: float | None = None,
           window: tuple[int | None, int | None] | None = None,
           cache_start: torch.Tensor | None = None, num_splits: int | None = None,
           batch_invariant: bool = False, return_lse: bool = False,
           max_seqlen: int | None = None, check_lengths: bool | None = None,
           k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None):
    r"""Attention of a few new query tokens per sequence against a KV cache (split-KV).

    Args:
        q: ``(batch, heads_q, q_len, head_dim)``, ``1 <= q_len <= 16``; float16, bfloat16
            or float32 (float64 too on the CPU). Any strides.
        k_cache, v_cache: the cache, same dtype and device as ``q`` (or both
            ``torch.float8_e4m3fn``, with ``k_descale`` / ``v_descale``), any strides, either
            *contiguous* ``(batch, heads_kv, max_len, head_dim)`` (``block_table=None``) or
            *paged* ``(num_pages, page_size, heads_kv, head_dim)``. ``heads_q`` must be a
            multiple of ``heads_kv`` (GQA / MQA: query head ``h`` reads key/value head
            ``h // (heads_q / heads_kv)``; the kernel reads each K/V tile once for the
            whole group).
        cache_seqlens: ``(batch,)`` int32 or int64, the number of valid cached tokens of
            each sequence *including* the ``q_len`` new ones (``0`` allowed: the output is
            0 and the LSE ``-inf``). Must not exceed the capacity (``max_len``, or
            ``max_pages * page_size``).
        block_table: ``(batch, max_pages)`` int32 (paged cache only): token ``t`` of
            sequence ``b`` lives at ``k_cache[block_table[b, t // page_size],
            t % page_size]``.
        scale: score scale (finite, ``> 0``), default ``1 / sqrt(head_dim)``.
        softcap: if given (``> 0``), scores become ``softcap * tanh(score / softcap)``.
        window: ``(left, right)``: query ``i`` sees keys ``p_i - left .. p_i`` (``None`` or
            ``-1``: unbounded, and so is a left side ``>=`` the capacity; the right side is
            bounded by causality at 0). scale, softcap and window are checked as by
            :func:`flashfold.attention` (the same errors).
        cache_start: optional ``(batch,)`` int32, same device: sequence ``b``'s first key
            ``a_b`` (left padding: its keys are the cache positions ``[a_b, n_b)``).
            Clamped to ``[0, n_b]`` (any value is allowed; ``a_b >= n_b`` leaves no key:
            output 0, LSE ``-inf``). Positions stay absolute (query ``i`` at ``n_b - q_len
            + i``, the window counted from there); a query row before ``a_b`` sees no key.
            The slots before ``a_b`` are never read (they may hold anything), nor are the
            block-table entries of pages holding no key of ``[a_b, n_b)``. Composes with
            the window (the left bound is ``max(p_i - left, a_b)``), paged caches and
            ``batch_invariant``. Default ``None``: every ``a_b = 0``.
        num_splits: force the number of key splits per sequence (default: chosen from the
            batch, heads, length bound and SM count so the whole GPU is busy). Not allowed
            with ``batch_invariant``.
        batch_invariant: split the keys at fixed multiples of a split size that depends
            on the sequence alone (:data:`~flashfold.kernels.decode.splitkv.INVARIANT_SPLIT`
            tokens, doubled for long sequences up to at most ``INVARIANT_MAX_SPLITS``
            splits, halved for short ones) and fold the splits left to right, in the
            merge kernel or, with one program per sequence (large batches), in that
            program's registers; these kernels compile without FP contraction so both
            round alike. A sequence's output is then bitwise the same whatever else is in
            the batch (a sequence being its query, its keys at their cache positions and
            its ``cache_start``: the splits sit at absolute positions, so moving the same
            tokens to other positions, e.g. another amount of left padding, may round
            differently). The default mode chooses the split size from the batch, so the
            rounding (not the math) can change with the batch.
        return_lse: also return the log-sum-exp.
        max_seqlen: optional host-side upper bound of ``cache_seqlens`` (default: the
            capacity), used only to plan the splits; lengths above it stay correct.
        check_lengths: range-check ``cache_seqlens`` (and the block table's pages in use)
            on the host (a bool, or None for the default). Default: when ``cache_seqlens``
            is on the CPU; on CUDA the check needs a device synchronisation (and cannot run
            inside a CUDA graph), so it is off unless requested. Unchecked lengths are
            clamped to ``[0, capacity]``, by the kernels and the CPU path alike; pages are
            not clamped: unchecked, a page in use outside ``[0, num_pages)`` is read out of
            range by the kernels (the CPU path indexes the pool as torch does, a negative
            page from its end).
        k_descale, v_descale: with an E4M3 cache (``torch.float8_e4m3fn``; :func:`append_kv`
            writes one), float32 ``(batch, heads_kv)``: key ``j`` of sequence ``b``, head
            ``h`` is ``k_descale[b, h] * k_cache[..]`` (values likewise; positive finite
            factors, whose values are not checked: a read would synchronise). The kernel
            widens each tile to ``q``'s dtype as it loads it (values times their descale,
            the keys' descale folded into the score scale), so the statistics and the
            output are computed as for a 16-bit cache, reading half the bytes. Not
            allowed with other caches.

    Returns:
        ``o`` of shape ``(batch, heads_q, q_len, head_dim)`` in ``q.dtype`` (contiguous),
        and with ``return_lse`` also ``lse`` ``(batch, heads_q, q_len)`` float32, natural
        log. On meta tensors: meta outputs of those shapes, nothing read or computed (the
        lengths are values: ``check_lengths=True`` raises ``ValueError``).

    Raises:
        TypeError / ValueError naming the offending argument.
    """
    check_bool("check_lengths", check_lengths, none=True)
    asked = check_lengths
    kernels = _kernel_call(q, k_cache, v_cache, cache_seqlens, block_table, cache_start)
    if check_lengths is None:       # (on the reference's path, cache_seqlens is on the CPU)
        check_lengths = not kernels or cache_seqlens.device.type == "cpu"
    if kernels and not check_lengths and not torch.compiler.is_compiling():
        # the tensors' checks read only their signatures: the decode plan cache runs them
        # once per signature, before the plan is built (splitkv_decode's ``check``); the
        # scalar options are checked first here, on every call
        cap = _capacity(k_cache, block_table) if window is not None else None
        scale, softcap, win = _options(q.shape[-1], scale, softcap, window, num_splits,
                                       batch_invariant, max_seqlen, return_lse, cap)
        o, lse = _splitkv().splitkv_decode(q, k_cache, v_cache, cache_seqlens, block_table,
                                           scale=scale, softcap=softcap, window=win,
                                           num_splits=num_splits,
                                           batch_invariant=batch_invariant,
                                           max_seqlen=max_seqlen, cache_start=cache_start,
                                           k_descale=k_descale, v_descale=v_descale,
                                           check=_check_tensors)
        return (o, lse) if return_lse else o
    heads_kv, page_size, capacity = _layout(q, k_cache, v_cache, cache_seqlens, block_table)
    cache_start = _cache_start(cache_start, q.shape[0], q.device)
    _descales(k_cache, v_cache, k_descale, v_descale, q.shape[0], heads_kv, q.device)
    scale, softcap, win = _options(q.shape[-1], scale, softcap, window, num_splits,
                                   batch_invariant, max_seqlen, return_lse, capacity)
    if is_meta(q):
        # shape propagation: meta outputs, nothing read or computed (the lengths are values)
        if asked:
            raise no_values("cache_seqlens", "check_lengths=True")
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        return (o, lse) if return_lse else o
    from ..kernels.decode import library
    if torch.compiler.is_compiling():
        # one op for the tracer; the length check (a host read) runs inside it
        o, lse = library.decode_op(q, k_cache, v_cache, cache_seqlens, block_table, cache_start,
                               k_descale, v_descale, scale, softcap,
                               *(win if win is not None else (None, None)), win is not None,
                               num_splits, batch_invariant, max_seqlen,
                               capacity if check_lengths else None, _use_kernels(q))
        return (o, lse) if return_lse else o
    if check_lengths:
        _check_lengths(cache_seqlens, capacity, block_table, k_cache.shape[0],
                       cache_start=cache_start)
    o, lse = library.decode_impl(q, k_cache, v_cache, cache_seqlens, block_table, cache_start,
                             k_descale, v_descale, scale=scale, softcap=softcap, window=win,
                             num_splits=num_splits, batch_invariant=batch_invariant,
                             max_seqlen=max_seqlen, use_kernels=_use_kernels(q))
    return (o, lse) if return_lse else o


def append_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
              v_new: torch.Tensor, cache_seqlens: torch.Tensor,
              block_table: torch.Tensor | None = None, *,
              check_lengths: bool | None = None, k_descale: torch.Tensor | None = None,
              v_descale: torch.Tensor | None = None) -> torch.Tensor:
    """Write ``n_new`` new tokens per sequence into the cache, in place, after the cached ones.

    ``k_cache``, ``v_cache``: contiguous ``(batch, heads_kv, max_len, head_dim)``
    (``block_table=None``) or paged ``(num_pages, page_size, heads_kv, head_dim)`` with
    ``block_table`` ``(batch, max_pages)`` int32, as :func:`decode` takes them;
    ``cache_seqlens``: ``(batch,)`` int32 or int64, the tokens already cached.
    ``k_new``, ``v_new``: ``(batch, heads_kv, n_new, head_dim)`` (the SDPA layout of ``q``),
    same dtype and device as the cache; into an E4M3 cache (``torch.float8_e4m3fn``), any
    16/32/64-bit float dtype, quantized on write with the sequence's descales
    (``k_descale``, ``v_descale``: float32 ``(batch, heads_kv)``, as :func:`decode` takes
    them): ``k_new / k_descale[b, h]`` rounded to E4M3, finite values beyond the format's
    range saturated to +-448, infinities and NaN stored as NaN (E4M3 has no infinity; so
    is every token of a zero or NaN factor, whose values are not checked). Token ``j`` of sequence ``b`` goes to position
    ``cache_seqlens[b] + j``: ``k_cache[b, :, pos]`` (contiguous) or slot ``pos %
    page_size`` of page ``block_table[b, pos // page_size]`` (paged; the pages must already
    be assigned in ``block_table``).

    Returns the new lengths ``cache_seqlens + n_new`` as a new tensor (``cache_seqlens`` is
    not modified). The capacity and page checks run on the host when ``cache_seqlens`` is
    on the CPU or ``check_lengths=True`` (a synchronisation on CUDA); otherwise an
    out-of-range position, negative or past the capacity, or a page number of
    ``block_table`` outside the pool, negative or past its end, trips torch's device-side
    index check.
    """
    for x, name in ((k_new, "k_new"), (v_new, "v_new")):
        _tensor(x, name)
    _tensor(k_cache, "k_cache")
    _tensor(v_cache, "v_cache")
    check_bool("check_lengths", check_lengths, none=True)
    if k_new.ndim != 4:
        raise ValueError(f"k_new: expected (batch, heads_kv, n_new, head_dim), got shape "
                         f"{tuple(k_new.shape)}")
    if v_new.shape != k_new.shape:
        raise ValueError(f"v_new: shape {tuple(v_new.shape)} differs from k_new's "
                         f"{tuple(k_new.shape)}")
    batch, heads_kv, n_new, head_dim = k_new.shape
    fp8 = k_cache.dtype == FP8
    if k_cache.dtype not in _CPU_DTYPES and not fp8:
        raise TypeError(f"k_cache: unsupported dtype {k_cache.dtype}"
                        + ("; the 8-bit cache format is torch.float8_e4m3fn"
                           if k_cache.dtype in _OTHER_FP8 else ""))
    for x, name in ((k_new, "k_new"), (v_new, "v_new")):
        if fp8 and x.dtype not in _CPU_DTYPES:
            raise TypeError(f"{name}: dtype must be one of {[str(d) for d in _CPU_DTYPES]} "
                            f"(quantized on write into the float8_e4m3fn cache), got {x.dtype}")
    # validate the cache against a stand-in query of the same batch, heads, head_dim and
    # device
    probe = torch.empty((batch, heads_kv, 1, head_dim),
                        dtype=k_new.dtype if fp8 else k_cache.dtype, device=k_new.device)
    got_heads, page_size, capacity = _layout(probe, k_cache, v_cache, cache_seqlens, block_table,
                                             dtypes=_CPU_DTYPES, names={"q": "k_new"})
    if got_heads != heads_kv:
        raise ValueError(f"k_new: heads_kv {heads_kv} differs from the cache's {got_heads}")
    for x, name in ((k_new, "k_new"), (v_new, "v_new")):
        if not fp8 and x.dtype != k_cache.dtype:
            raise TypeError(f"{name}: dtype {x.dtype} differs from the cache's {k_cache.dtype}")
        if x.device != k_cache.device:
            raise ValueError(f"{name}: on {x.device}, the cache on {k_cache.device}")
        if x.device.type != "meta" and not torch.compiler.is_compiling():
            # (traced tensors have no storage to compare)
            for cache, cname in ((k_cache, "k_cache"), (v_cache, "v_cache")):
                if x.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr():
                    # (the write would read what it overwrites: torch refuses the copy)
                    raise ValueError(f"{name}: shares memory with {cname} (a view of the "
                                     f"cache); pass a copy, e.g. {name}.clone()")
    if (k_cache.device.type != "meta" and not torch.compiler.is_compiling()
            and k_cache.numel() and k_cache.data_ptr() == v_cache.data_ptr()):
        # (the values would be written over the keys just written)
        raise ValueError("v_cache: the same memory as k_cache; the keys and values need "
                         "caches of their own")
    _descales(k_cache, v_cache, k_descale, v_descale, batch, heads_kv, k_cache.device)
    if check_lengths and is_meta(cache_seqlens):
        raise no_values("cache_seqlens", "check_lengths=True")
    if check_lengths is None:
        check_lengths = cache_seqlens.device.type == "cpu"
    if check_lengths:
        if torch.compiler.is_compiling():
            # (the check reads values: inside an op, whose copy the positions come from)
            from ..kernels.decode.library import checked_lengths
            cache_seqlens = checked_lengths(cache_seqlens, block_table, capacity,
                                            k_cache.shape[0], n_new)
        else:
            _check_lengths(cache_seqlens, capacity, block_table, k_cache.shape[0],
                           extra=n_new)
    if n_new == 0:
        return cache_seqlens.clone()
    pos = cache_seqlens.to(torch.int64)[:, None] + torch.arange(n_new, device=k_cache.device)
    if not check_lengths:
        # a negative position would wrap around to the row's end: one past the capacity
        # trips the index check instead, as a position past the end does
        pos = pos.masked_fill(pos < 0, capacity)
    rows = torch.arange(batch, device=k_cache.device)[:, None].expand(batch, n_new)
    if fp8:
        k_new, v_new = quantize_fp8_cache(k_new, k_descale), quantize_fp8_cache(v_new, v_descale)
    kn, vn = k_new.transpose(1, 2), v_new.transpose(1, 2)            # (batch, n_new, Hkv, D)
    if block_table is None:
        k_cache.transpose(1, 2)[rows, pos] = kn                      # (batch, L, Hkv, D) view
        v_cache.transpose(1, 2)[rows, pos] = vn
    else:
        pages = block_table.to(torch.int64)[rows, pos // page_size]
        if not check_lengths:
            # a negative page would wrap around to the pool's last pages (another
            # sequence's): one past the pool trips the index check instead
            pages = pages.masked_fill(pages < 0, k_cache.shape[0])
        k_cache[pages, pos % page_size] = kn
        v_cache[pages, pos % page_size] = vn
    return cache_seqlens + n_new


def quantize_fp8_cache(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """``x`` ``(batch, heads_kv, n, head_dim)`` as E4M3 cache entries for the descales
    ``(batch, heads_kv)``: ``x / descale`` rounded to nearest, finite values beyond +-448
    saturated, infinities and NaN stored as NaN (E4M3 has no infinity), and so is every
    entry of a zero or NaN factor."""
    d = descale.to(torch.float32)[:, :, None, None]
    y = x.to(torch.float32) / d
    # (finiteness of x itself: a finite x whose quotient overflows float32 saturates; a
    # zero or NaN factor stands for no value: x / 0 is not a quotient to saturate)
    y = torch.where(torch.isfinite(x) & (d.abs() > 0), y.clamp(-FP8_MAX, FP8_MAX), math.nan)
    return y.to(FP8)


class PagedKVCache:
    """A paged KV cache with its block table and lengths (a convenience around
    :func:`append_kv` and :func:`decode`).

    ``k_pages``, ``v_pages``: ``(num_pages, page_size, heads_kv, head_dim)``;
    ``block_table``: ``(batch, max_pages)`` int32; ``seqlens``: ``(batch,)`` int32. Page
    assignment is static: :meth:`allocate` gives every sequence ``ceil(max_len /
    page_size)`` pages (in a seeded random order when ``shuffle``, to exercise the
    gather). :meth:`append` updates ``seqlens``. An E4M3 cache (pages of
    ``torch.float8_e4m3fn``) carries its descales ``k_descale``, ``v_descale`` (float32
    ``(batch, heads_kv)``), which :meth:`append` quantizes with and :meth:`decode` reads.
    """

    def __init__(self, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                 seqlens: torch.Tensor, k_descale: torch.Tensor | None = None,
                 v_descale: torch.Tensor | None = None):
        for x, name in ((k_pages, "k_pages"), (v_pages, "v_pages"), (block_table, "block_table"),
                        (seqlens, "seqlens")):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if k_pages.ndim != 4:
            raise ValueError(f"k_pages: expected 4 dims (num_pages, page_size, heads_kv, "
                             f"head_dim), got shape {tuple(k_pages.shape)}")
        if block_table.ndim != 2:
            raise ValueError(f"block_table: expected shape (batch, max_pages), got "
                             f"{tuple(block_table.shape)}")
        if block_table.shape[0] < 1:
            raise ValueError(f"block_table: batch must be >= 1, got shape "
                             f"{tuple(block_table.shape)}")
        if (k_pages.dtype == FP8) != (v_pages.dtype == FP8):
            # (before the stand-in query, whose dtype follows k_pages': the message would
            # compare k_pages with itself)
            raise TypeError(f"v_pages: dtype {v_pages.dtype} differs from k_pages's "
                            f"{k_pages.dtype} (an 8-bit cache needs both k_pages and v_pages "
                            f"in float8_e4m3fn)")
        # the cache against a stand-in query of its batch, heads and head dim
        probe = torch.empty((block_table.shape[0], k_pages.shape[2], 1, k_pages.shape[3]),
                            dtype=torch.bfloat16 if k_pages.dtype == FP8 else k_pages.dtype,
                            device=k_pages.device)
        heads_kv, _, _ = _layout(probe, k_pages, v_pages, seqlens, block_table,
                                 names={"q": "k_pages", "k_cache": "k_pages",
                                        "v_cache": "v_pages", "cache_seqlens": "seqlens"})
        _descales(k_pages, v_pages, k_descale, v_descale, block_table.shape[0], heads_kv,
                  k_pages.device)
        self.k_pages, self.v_pages, self.block_table, self.seqlens = (k_pages, v_pages,
                                                                      block_table, seqlens)
        self.k_descale, self.v_descale = k_descale, v_descale

    @classmethod
    def allocate(cls, batch: int, max_len: int, heads_kv: int, head_dim: int, *,
                 page_size: int = 16, dtype: torch.dtype = torch.bfloat16, device=None,
                 shuffle: bool = False, seed: int = 0, k_descale: torch.Tensor | None = None,
                 v_descale: torch.Tensor | None = None) -> "PagedKVCache":
        """An empty cache for ``batch`` sequences of up to ``max_len`` tokens (``batch``,
        ``max_len``, ``heads_kv``, ``page_size`` ints >= 1, ``1 <= head_dim <= 256``); each
        sequence gets whole pages, so its capacity is ``max_len`` rounded up to a multiple
        of ``page_size`` (the appends :meth:`append` accepts).
        ``dtype=torch.float8_e4m3fn`` makes an E4M3 cache with the given descales (default:
        ones, float32 ``(batch, heads_kv)``)."""
        for name, x in (("batch", batch), ("max_len", max_len), ("heads_kv", heads_kv),
                        ("head_dim", head_dim), ("page_size", page_size), ("seed", seed)):
            if isinstance(x, bool) or not isinstance(x, int):
                raise TypeError(f"{name} must be an int, got {type(x).__name__} {x!r}")
            if x < 1 and name != "seed":
                raise ValueError(f"{name} must be an int >= 1, got {x}")
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
        if not -(1 << 63) <= seed < (1 << 64):       # (torch.Generator's seeds)
            raise ValueError(f"seed must fit in 64 bits, got {seed}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
        if dtype not in _CPU_DTYPES + (FP8,):
            raise TypeError(f"dtype must be one of {[str(d) for d in _CPU_DTYPES + (FP8,)]}, "
                            f"got {dtype}")
        check_bool("shuffle", shuffle)
        per_seq = -(-max_len // page_size)
        n_pages = batch * per_seq
        order = (torch.randperm(n_pages, generator=torch.Generator().manual_seed(seed))
                 if shuffle else torch.arange(n_pages))
        table = order.view(batch, per_seq).to(torch.int32).to(device)
        k = torch.zeros(n_pages, page_size, heads_kv, head_dim, dtype=dtype, device=device)
        if dtype == FP8:
            ones = torch.ones(batch, heads_kv, dtype=torch.float32, device=device)
            k_descale = ones if k_descale is None else k_descale
            v_descale = ones.clone() if v_descale is None else v_descale
        return cls(k, torch.zeros_like(k), table,
                   torch.zeros(batch, dtype=torch.int32, device=device), k_descale, v_descale)

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    @property
    def capacity(self) -> int:
        return self.block_table.shape[1] * self.page_size

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor, **kwargs) -> torch.Tensor:
        """:func:`append_kv` into this cache; updates and returns ``seqlens``."""
        self.seqlens = append_kv(self.k_pages, self.v_pages, k_new, v_new, self.seqlens,
                                 self.block_table, k_descale=self.k_descale,
                                 v_descale=self.v_descale, **kwargs).to(self.seqlens.dtype)
        return self.seqlens

    def decode(self, q: torch.Tensor, **kwargs):
        """:func:`decode` against this cache (keyword arguments pass through)."""
        return decode(q, self.k_pages, self.v_pages, self.seqlens,
                      block_table=self.block_table, k_descale=self.k_descale,
                      v_descale=self.v_descale, **kwargs)

    def __repr__(self) -> str:
        n, p, h, d = self.k_pages.shape
        return (f"PagedKVCache(batch={self.block_table.shape[0]}, capacity={self.capacity}, "
                f"page_size={p}, num_pages={n}, heads_kv={h}, head_dim={d}, "
                f"dtype={str(self.k_pages.dtype).replace('torch.', '')}, "
                f"device={self.k_pages.device})")


__all__ = ["decode", "append_kv", "PagedKVCache", "MAX_Q_LEN", "MAX_HEAD_DIM"]
