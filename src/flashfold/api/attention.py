r"""Exact attention: :func:`attention`, :func:`merge_states`, block masks.

``attention(q, k, v)`` computes, for every (batch, query head, query row ``i``),

.. math::

    o_i = \sum_j \mathrm{softmax}_j(s_{ij})\, v_j, \qquad
    \mathrm{lse}_i = \log \sum_j e^{s_{ij}}

over the *visible* keys ``j``, with the scores formed in this order (documented contract,
identical on every device):

1. ``s = scale * q . k`` (``scale`` defaults to ``1 / sqrt(head_dim)``);
2. ``s = softcap * tanh(s / softcap)`` if ``softcap`` is given;
3. ``s = score_mod(s, b, h, q_idx, kv_idx)`` if given;
4. masks: key ``j`` is visible to query ``i`` iff ``j < N_k`` (per sequence with
   ``cu_seqlens``), ``causal`` => ``j <= i + (N_k - N_q)`` (aligned bottom-right, as
   FlashAttention 2: the last query sees every key), ``window=(left, right)`` =>
   ``i + (N_k - N_q) - left <= j <= i + (N_k - N_q) + right`` (``None`` or ``-1``: that side
   unbounded; with ``causal`` the right side is ``min(right, 0)``), and
   ``mask_mod(b, h, q_idx, kv_idx)``.

Key padding is a mask (``mask_mod=flashfold.mods.key_padding_mask(lengths)``) or, without
padding at all, packed sequences (``cu_seqlens_*``). A row with no visible key gives
``o = 0`` and ``lse = -inf`` (never NaN). ``lse`` is the
natural log, float32.

Non-finite inputs (NaN, ``+-inf``) reach exactly the outputs that depend on them, on every
device and path alike:

1. A key that is not visible to row ``i`` contributes nothing to row ``i``, whatever its
   ``k`` and ``v`` hold (NaN, inf, garbage): keys past a sequence's end or a
   key_padding_mask length, and keys hidden by causal, window or mask_mod, also inside a
   tile that row ``i`` partly sees. (FlashAttention lets a hidden NaN value of such a tile
   reach the row through a ``0 x NaN`` product; flashfold does not.)
2. A NaN or ``+inf`` score of a visible key (from ``q``, ``k``, softcap or score_mod) makes
   ``lse_i`` and every channel of ``o_i`` NaN. A ``-inf`` score is weight 0, as a mask
   is: its key contributes nothing, whatever its value holds (a score_mod that returns
   ``-inf`` masks); ``o_i = 0``, ``lse_i = -inf`` only when every visible score is
   ``-inf`` or no key is visible (a NaN is never an empty row). (An infinite ``q`` or
   ``k`` entry is itself a non-finite input of the rows it meets; a ``-inf`` score it
   makes in a call without masks or score_mod may let its key's non-finite value reach
   the row, as ``0 x NaN``. In the backward a score_mod's ``-inf`` pair adds exactly 0
   through its key's value; a non-finite ``k`` of that key, or ``q`` / ``dO`` of that
   row, may still reach ``dq`` / ``dk`` / ``dv`` as ``0 x NaN``.)
3. A non-finite ``v[j, c]`` of a visible key makes ``o[i, c]`` non-finite (NaN, or
   ``+-inf`` where the sum gives it); ``lse_i`` and the other channels are unaffected.
4. Backward: ``dq_i``, ``dk_j``, ``dv_j`` are non-finite only where they depend, through a
   visible pair ``(i, j)``, on a non-finite input (``q``, ``k``, ``v``, or the upstream
   ``do`` / ``dlse`` of a visible row); a hidden pair contributes exactly 0 (also when
   its ``q``, ``k``, ``v`` or ``do`` hold NaN), and a row with no visible key contributes
   zero gradients.
5. :func:`merge_states`: a part with ``lse = -inf`` contributes nothing, whatever its
   ``o`` (NaN too); a NaN ``lse`` makes the merged ``o`` and ``lse`` NaN; a non-finite
   ``o[c]`` of a part with a finite ``lse`` makes the merged ``o[c]`` non-finite.

On CUDA tensors a Triton kernel runs (FlashAttention-2 schedule,
statistics in fp32, ``exp2`` with ``log2 e`` folded into the scale; see
:mod:`flashfold.kernels.attention.fwd`); on CPU tensors a blocked reference with the same
semantics (:mod:`flashfold.kernels.attention.reference`; never more than one block of
scores in memory).

``score_mod``/``mask_mod`` are Python functions over :mod:`flashfold.ops`, traced into the
IR and compiled into the kernel (see :mod:`flashfold.kernels.attention.mods`; helpers in
:mod:`flashfold.mods`). A function is traced once, at its first call: the Python numbers
and lists it captures are read then (a later change to them is not seen: make a new
function), while a table wrapped in :class:`flashfold.ops.Buffer` is read by every call
as it is then. A mask_mod is summarized once per tile into a :class:`BlockMask`
(cached), so tiles it hides are skipped and tiles it fully shows skip the mask; where
every row sees one interval of keys (document masks, key padding from a table), the
kernels evaluate those intervals instead of the mask's per-key table reads.

Backward: ``attention`` is differentiable with respect to ``q``, ``k``, ``v`` (and through
the returned ``lse``) on every device. Under ``torch.compile`` it calls the
``torch.library`` custom op ``flashfold::attn_fwd`` whose registered backward
``flashfold::attn_bwd`` runs the Triton backward kernels on CUDA
(:mod:`flashfold.kernels.attention.bwd`: FlashAttention-2 schedule, ``P`` recomputed
from the saved LSE) and a blocked backward with the same math on CPU
(:func:`flashfold.kernels.attention.reference.backward_reference`); in eager mode, when
gradients are needed, an ``autograd.Function`` runs the same implementations without the
dispatcher; see :mod:`flashfold.kernels.attention.autograd`.
``torch.compile(fullgraph=True)`` traces it
without graph breaks (mods: create them once outside the compiled step; a new mod
function object recompiles). Gradients of a score_mod flow through its traced expression
(:func:`flashfold.algebra.autodiff.derivative`); captured tables get no gradient; double
backward and the ``torch.func`` transforms vmap, grad, vjp and jacrev are not supported (a
RuntimeError says so). ``deterministic=True`` gives bitwise reproducible gradients
(dQ summed in a fixed order; on sm_90 without a mask_mod or varlen at 0.75-0.96x the
default's speed, H200). By default, on sm_90, dQ is accumulated with fp32 reduce-adds
whose order varies between runs (last-bit differences only): in the Gluon backward's
scope always (every call but mask_mods on packed sequences, past head dim 128 or with a
window or causal bound), elsewhere where the Triton kernels'
configuration picks atomics (causal or right-bounded rows, head dim <= 128, no softcap /
score_mod / mask_mod); every other case is deterministic by default as well.
"""

from __future__ import annotations

import math

import torch

from ..kernels.attention.mods import (BlockMask, TracedMod, create_block_mask, trace_mask_mod,
                                      trace_score_mod)
from .fp8 import check_fp8_call, is_fp8
# the checks shared with decode and ring attention (one rule per argument)
from .validate import MAX_HEAD_DIM
from .validate import check_bool as _check_bool
from .validate import check_cu_seqlens as _check_cu_seqlens
from .validate import check_positive as _check_positive
from .validate import check_kernel_head_dims as _check_kernel_head_dims
from .validate import check_qkv as _check_qkv
from .validate import check_tensor as _check_tensor
from .validate import check_window as _check_window
from .validate import unbounded_beyond


# --- validation ---------------------------------------------------------------------------

def _bounds(left, right, causal):
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def _capturing(device) -> bool:
    """Whether a CUDA graph is being captured for tensors on ``device``
    (:func:`flashfold.kernels.launcher.capturing`; imported here on use: it loads Triton)."""
    from ..kernels.launcher import capturing
    return capturing(device)


def _use_kernel(q) -> bool:
    """Dispatch: the Triton kernel on CUDA tensors, the blocked reference elsewhere (tests
    monkeypatch this to run the kernel under ``TRITON_INTERPRET`` on CPU tensors)."""
    return q.device.type == "cuda"


def _check_not_transformed(q, k, v):
    """``NotImplementedError`` (a RuntimeError) when ``q``, ``k`` or ``v`` is a tensor of
    ``torch.func.vmap`` (the forward reads values on the host and writes its result in
    place) or one of ``torch.func.grad`` / ``vjp`` / ``jacrev`` that requires grad (the
    gradient is an ``autograd.Function`` without functorch rules): either would fail deep
    inside with torch's advice about in-place arithmetic or autograd.Function internals.
    (``torch.func.jvp`` differentiates the CPU forward's torch ops and works.)"""
    if torch.compiler.is_compiling():
        return
    ft = torch._C._functorch
    grad = torch.is_grad_enabled()
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and (
                ft.is_batchedtensor(t)
                or (grad and t.requires_grad and ft.is_gradtrackingtensor(t))):
            raise NotImplementedError(
                f"flashfold.attention does not support torch.func.vmap / grad / vjp / "
                f"jacrev: {name} is a tensor of one. Use torch.autograd.grad / .backward() "
                f"for gradients, and the batch axis (or a loop) instead of vmap")


# --- attention ------------------------------------------------------------------------------

def attention(q, k, v, *, causal=False, window=None, scale=None, softcap=None, score_mod=None,
              mask_mod=None, cu_seqlens_q=None, cu_seqlens_k=None, return_lse=False,
              deterministic=False, q_descale=None, k_descale=None, v_descale=None,
              out_dtype=None):
    """Exact (softmax) attention; semantics in the module docstring.

    Parameters
    ----------
    q: ``(B, Hq, Nq, D)``; k: ``(B, Hk, Nk, D)``; v: ``(B, Hk, Nk, Dv)``: any strides,
        ``Hq`` a multiple of ``Hk`` (GQA/MQA: query head ``h`` reads kv head
        ``h // (Hq // Hk)``), ``D, Dv`` in ``1 .. 256`` on CUDA (:data:`MAX_HEAD_DIM`; the
        kernels pad to the next power of two inside the tile), any ``>= 1`` on the CPU;
        fp16/bf16 (CUDA), also fp32/fp64 on CPU. With ``cu_seqlens_*``: ``B == 1``,
        sequences packed along seq.
    causal: bottom-right aligned causal mask (``j <= i + Nk - Nq``).
    window: ``(left, right)`` sliding window around the aligned diagonal; ``None``/``-1``
        leaves a side unbounded, and so does a side at least as long as the sequence
        (``left >= Nk``, ``right >= Nq``: it hides no key; ``window=(2**70, 0)`` is
        ``causal=True``).
    scale: score scale (> 0), default ``1 / sqrt(D)``.
    softcap: ``c > 0``: scores become ``c tanh(s / c)`` (before score_mod and masks). The
        GPU kernels form ``tanh(y) = 1 - 2 / (e^{2y} + 1)`` in float32, whose error is
        absolute: a score carries up to about ``c 2^-23``, below bf16's rounding of ``P``
        for the caps models use (30, 50) and comparable to it at ``c ~ 10^4``.
    score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` over :mod:`flashfold.ops`.
    mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` over :mod:`flashfold.ops`, or a
        :class:`BlockMask` from :func:`create_block_mask` (precomputed, reusable).
        ``b`` is the batch (sequence) index, ``h`` the query head, ``q_idx``/``kv_idx``
        positions inside the sequence.
    cu_seqlens_q, cu_seqlens_k: int32 ``(S + 1,)`` offsets of ``S`` packed sequences
        (both or neither); sequence ``s`` is rows ``cu[s]:cu[s+1]``; masks and the causal
        alignment apply per sequence. Their values are read on the host (a sync) and
        checked once per tensor and version: calls passing the same tensor again (the
        layers of a model) read nothing until an in-place write changes it. While a
        CUDA graph is captured they are neither read nor checked: the launches are sized
        by the packed lengths (``Nq``, ``Nk``) and the kernels read the offsets on the
        device, so a replay may find other offsets (as many sequences, over the same
        rows; valid ones: nothing checks them then). A callable ``mask_mod`` cannot be
        captured over packed sequences (its table is built from the lengths): pass a
        :class:`BlockMask`.
    return_lse: also return ``lse (B, Hq, Nq)`` float32, natural log (differentiable too).
    deterministic: bitwise reproducible gradients (dQ summed in a fixed order); the
        default may accumulate dQ with atomic adds (see the module docstring).
    q_descale, k_descale, v_descale: with ``torch.float8_e4m3fn`` q, k, v (and only then),
        float32 ``(B, Hk)`` factors (``(S, Hk)`` with ``cu_seqlens``): each tensor stands
        for ``x8 * descale`` (:mod:`flashfold.api.fp8`; ``quantize_fp8`` makes them).
        Forward only; no score_mod / mask_mod; statistics in fp32, ``P`` quantized to FP8
        with its own scale (:func:`~flashfold.kernels.attention.reference.fp8_attention_reference`,
        what the CPU runs). On an sm_90 GPU the warp-specialized Gluon kernel runs it
        on E4M3 tensor-core products, elsewhere (and for shapes outside its plans) the
        Triton template's ``FP8`` flag; head dims up to 256. Its ``P V`` product reads V
        with the keys contiguous, each row of keys 16-byte aligned: one made as
        ``vt.transpose(-1, -2)`` of a contiguous ``(B, Hk, Dv, Nk)`` tensor with ``Nk`` a
        multiple of 16 is read as it is; any other ``v`` is transposed into a new buffer
        first (``Nk Dv`` bytes per KV head, rows padded to 16 keys). Under
        ``torch.compile`` one custom op, ``flashfold::attn_fwd_fp8``, traced without graph
        breaks.
    out_dtype: the output dtype of an FP8 call (bf16 by default; fp16, fp32).

    Returns ``o`` ``(B, Hq, Nq, Dv)`` in the input dtype (an FP8 call's: ``out_dtype``;
    contiguous), and ``lse`` when
    ``return_lse``. Differentiable with respect to ``q``, ``k``, ``v``. On meta tensors:
    meta outputs (and meta gradients) of those shapes, nothing computed; the checks of
    ``cu_seqlens`` values are skipped (shapes are checked as always). A mod's captured
    tables may be meta tensors then; with real ``q`` they are a ``ValueError`` naming the
    mod (:meth:`~flashfold.kernels.attention.mods.TracedMod.check_device`).

    Raises ``TypeError`` / ``ValueError`` naming the argument, before anything runs; also
    when a table captured by ``score_mod`` / ``mask_mod`` is shorter than the indices the
    mod forms for these sizes (:meth:`~flashfold.kernels.attention.mods.TracedMod.check_tables`).
    """
    _check_not_transformed(q, k, v)
    if any(is_fp8(t) for t in (q, k, v)):
        return _fp8_attention(q, k, v, causal=causal, window=window, scale=scale,
                              softcap=softcap, score_mod=score_mod, mask_mod=mask_mod,
                              cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                              return_lse=return_lse, deterministic=deterministic,
                              q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                              out_dtype=out_dtype)
    for name, x in (("q_descale", q_descale), ("k_descale", k_descale),
                    ("v_descale", v_descale), ("out_dtype", out_dtype)):
        if x is not None:
            raise ValueError(f"{name} is for float8_e4m3fn q, k, v; q is "
                             f"{getattr(q, 'dtype', type(q).__name__)}")
    compiling = torch.compiler.is_compiling()
    _check_qkv(q, k, v)
    kernel = _use_kernel(q)
    if kernel:
        _check_kernel_head_dims(q, v)
    _check_bool("causal", causal)
    _check_bool("return_lse", return_lse)
    _check_bool("deterministic", deterministic)
    left, right = _bounds(*_check_window(window), causal)
    # a side as long as the sequence hides nothing: unbounded (no huge int reaches a kernel)
    left, right = unbounded_beyond(left, k.shape[2]), unbounded_beyond(right, q.shape[2])
    scale = _check_positive("scale", scale)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[3])
    softcap = _check_positive("softcap", softcap)
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
    # meta tensors: shapes propagate, nothing is computed, checks that read values (the
    # offsets') are skipped; so are they under torch.compile and while a CUDA graph is
    # captured (a sync)
    meta = q.device.type == "meta"
    varlen = cu_seqlens_q is not None
    values = not compiling and not meta and not (varlen and _capturing(q.device))
    lens_q = lens_k = None
    if varlen:
        if q.shape[0] != 1:
            raise ValueError(f"with cu_seqlens, q/k/v must have batch 1 (packed), got {q.shape[0]}")
        lens_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[2], q.device, values)
        lens_k = (lens_q if cu_seqlens_k is cu_seqlens_q and k.shape[2] == q.shape[2]
                  else _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[2], q.device,
                                         values))
        if values and len(lens_q) != len(lens_k):
            raise ValueError(f"cu_seqlens_q has {len(lens_q)} sequences but cu_seqlens_k has "
                             f"{len(lens_k)}")
        if not values and cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
            raise ValueError("cu_seqlens_q and cu_seqlens_k hold different numbers of sequences")
    # the sizes the mods' positions range over (None: known only from values)
    if not varlen:
        sizes = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    elif values:
        sizes = (len(lens_q), q.shape[1], max(lens_q), max(lens_k))
    else:
        sizes = (cu_seqlens_q.shape[0] - 1, q.shape[1], None, None)
    if isinstance(mask_mod, BlockMask) and not (varlen and not values):
        _check_block_mask(mask_mod, q, *sizes[:1], *sizes[2:], varlen)

    if meta:
        # the custom op's fake implementation: meta outputs (and meta gradients)
        from ..kernels.attention.autograd import attn_fwd
        for mod in _traced(score_mod, mask_mod):
            mod.check_tables(*sizes)
        o, lse = attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, [], "", scale, softcap, left,
                          right, False, deterministic)
        return (o, lse.to(torch.float32)) if return_lse else o
    if compiling or (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        # differentiable / compilable: the custom op (mods go through the registry)
        from ..kernels.attention.autograd import attention_op, mods_entry, register_mods
        if (mask_mod is not None and not isinstance(mask_mod, (BlockMask, TracedMod))
                and not callable(mask_mod)):
            raise TypeError("mask_mod must be a callable or a BlockMask, got "
                            f"{type(mask_mod).__name__}")
        if score_mod is not None and not callable(score_mod) and not isinstance(score_mod, TracedMod):
            raise TypeError(f"score_mod must be a callable, got {type(score_mod).__name__}")
        # Dynamo guards on the ids so that a new mod object recompiles; an absent mod passes
        # 0, never id(None): Dynamo cannot trace id() of None on every torch (2.11 raises
        # inside fullgraph compile of a call without mods), and None needs no guard anyway.
        # A BlockMask passes its int handle (Dynamo cannot pass the object to a
        # constant-result function on every torch; it guards the int)
        if isinstance(mask_mod, BlockMask):
            mask_arg = mask_id = mask_mod.handle
        else:
            mask_arg, mask_id = mask_mod, (0 if mask_mod is None else id(mask_mod))
        key = register_mods(score_mod, mask_arg, 0 if score_mod is None else id(score_mod),
                            mask_id)
        entry = mods_entry(key)
        if entry is not None:
            for mod in (entry.score, entry.mask):
                if mod is not None:
                    mod.check_tables(*sizes)
        o, lse = attention_op(q, k, v, key=key, scale=scale, softcap=softcap, left=left,
                              right=right, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                              use_kernel=kernel, deterministic=deterministic)
        if return_lse:
            return o, (lse if lse.dtype == torch.float32 else lse.to(torch.float32))
        return o
    smod, mmod = _traced(score_mod, mask_mod, pad=True)
    for mod in (smod, mmod):
        if mod is not None:
            mod.check_tables(*sizes)
    if kernel:
        from ..kernels.attention.autograd import kernel_forward
        o, lse = kernel_forward(q, k, v, scale=scale, softcap=softcap, left=left, right=right,
                                score=smod, mask=mmod,
                                block_mask=mask_mod if isinstance(mask_mod, BlockMask) else None,
                                cu_q=cu_seqlens_q, cu_k=cu_seqlens_k, lens_q=lens_q,
                                lens_k=lens_k, return_lse=return_lse)
    else:
        from ..kernels.attention.autograd import reference_forward
        o, lse = reference_forward(q, k, v, scale=scale, softcap=softcap, left=left,
                                   right=right, score=smod, mask=mmod, cu_q=cu_seqlens_q,
                                   cu_k=cu_seqlens_k)
        if q.dtype == torch.float64:
            lse = lse.to(torch.float32)
    return (o, lse) if return_lse else o


def _fp8_attention(q, k, v, *, causal, window, scale, softcap, score_mod, mask_mod,
                   cu_seqlens_q, cu_seqlens_k, return_lse, deterministic, q_descale, k_descale,
                   v_descale, out_dtype):
    """:func:`attention` of float8_e4m3fn inputs (its docstring; :mod:`.fp8`;
    ``deterministic`` is checked and has nothing to choose: forward only)."""
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
    varlen = cu_seqlens_q is not None
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if varlen:
        if q.dim() != 4 or q.shape[0] != 1:
            raise ValueError(f"with cu_seqlens, q/k/v must have batch 1 (packed), got shape "
                             f"{tuple(q.shape)}")
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            _check_cu_seqlens(name, cu, None, q.device, values=False)      # (no value read yet)
    # (a q without 4 dims has no batch to read: check_fp8_call names it before n_seqs is used)
    n_seqs = (cu_seqlens_q.shape[0] - 1 if varlen
              else q.shape[0] if q.dim() == 4 else None)
    out_dtype = check_fp8_call(q, k, v, q_descale, k_descale, v_descale, out_dtype,
                               score_mod=score_mod, mask_mod=mask_mod, n_seqs=n_seqs)
    _check_bool("causal", causal)
    _check_bool("return_lse", return_lse)
    _check_bool("deterministic", deterministic)
    left, right = _bounds(*_check_window(window), causal)
    left, right = unbounded_beyond(left, k.shape[2]), unbounded_beyond(right, q.shape[2])
    scale = _check_positive("scale", scale)
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    softcap = _check_positive("softcap", softcap)
    meta = q.device.type == "meta"
    compiling = torch.compiler.is_compiling()
    # (under compile and CUDA-graph capture: no value read, no sync)
    values = not meta and not compiling and not (varlen and _capturing(q.device))
    lens_q = lens_k = None
    if varlen:
        lens_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[2], q.device, values)
        lens_k = (lens_q if cu_seqlens_k is cu_seqlens_q and k.shape[2] == q.shape[2]
                  else _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[2], q.device,
                                         values))
        if values and len(lens_q) != len(lens_k):
            raise ValueError(f"cu_seqlens_q has {len(lens_q)} sequences but cu_seqlens_k "
                             f"has {len(lens_k)}")
    if meta:
        o = torch.empty(q.shape[:3] + (v.shape[3],), dtype=out_dtype, device="meta")
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device="meta")
        return (o, lse) if return_lse else o
    kernel = _use_kernel(q)
    if kernel:
        _check_kernel_head_dims(q, v)
    from ..kernels.attention import autograd
    if compiling:
        # one custom op, traced without graph breaks (the reference reads values)
        o, lse = autograd.attn_fwd_fp8(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q,
                                       cu_seqlens_k, scale, softcap, left, right, kernel,
                                       out_dtype)
    else:
        o, lse = autograd.fp8_forward_impl(q, k, v, q_descale, k_descale, v_descale,
                                           cu_seqlens_q, cu_seqlens_k, scale, softcap, left,
                                           right, kernel, out_dtype, lens_q, lens_k,
                                           return_lse)
    return (o, lse) if return_lse else o


def _traced(score_mod, mask_mod, pad=False):
    """The TracedMods of ``score_mod`` and ``mask_mod`` (a BlockMask's own mod); with
    ``pad`` always the pair ``(score or None, mask or None)``, else only those given."""
    smod = trace_score_mod(score_mod) if score_mod is not None else None
    if mask_mod is None or isinstance(mask_mod, BlockMask):
        mmod = mask_mod.mod if isinstance(mask_mod, BlockMask) else None
    else:
        mmod = trace_mask_mod(mask_mod)
    return (smod, mmod) if pad else tuple(m for m in (smod, mmod) if m is not None)


def _check_block_mask(bm: BlockMask, q, n_seq, seq_q, seq_k, varlen):
    B, H, QL, KL = bm.shape
    if bm.device != q.device:
        raise ValueError(f"mask_mod BlockMask is on {bm.device} but q is on {q.device}")
    if B is not None and B != n_seq:
        raise ValueError(f"mask_mod BlockMask was made for B={B}, got {n_seq} "
                         f"{'sequences' if varlen else 'batch'}")
    if H is not None and H != q.shape[1]:
        raise ValueError(f"mask_mod BlockMask was made for H={H}, q has {q.shape[1]} heads")
    if varlen:
        if QL < seq_q or KL < seq_k:
            raise ValueError(f"mask_mod BlockMask covers ({QL}, {KL}) but the longest "
                             f"sequences are ({seq_q}, {seq_k})")
    elif (QL, KL) != (seq_q, seq_k):
        raise ValueError(f"mask_mod BlockMask was made for Q_LEN={QL}, KV_LEN={KL}; q/k have "
                         f"seq {seq_q}, {seq_k}")


# --- merging partial results ------------------------------------------------------------------

def _check_parts(name_o, name_l, o, lse, lead_from):
    _check_tensor(name_o, o)
    _check_tensor(name_l, lse)
    if not o.is_floating_point() or not lse.is_floating_point():
        raise TypeError(f"{name_o} and {name_l} must be floating point, got {o.dtype}, {lse.dtype}")
    for name, t in ((name_o, o), (name_l, lse)):
        if is_fp8(t):
            # (an FP8 tensor holds no scale: the merged o would be rounded to 8 bits, and
            # past 448 be NaN)
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got "
                            f"{t.dtype} (merge the parts in the dtype attention returned)")
    if not (lead_from + 2 <= o.dim() <= lead_from + 4):
        raise ValueError(f"{name_o} must have shape ({'S, ' if lead_from else ''}..., seq, "
                         f"head_dim) with 1 to 3 leading dims before head_dim, got "
                         f"{tuple(o.shape)}")
    if tuple(lse.shape) != tuple(o.shape[:-1]):
        raise ValueError(f"{name_l} shape {tuple(lse.shape)} must equal {name_o}'s shape "
                         f"without head_dim {tuple(o.shape[:-1])}")
    if lse.device != o.device:
        raise ValueError(f"{name_l} is on {lse.device} but {name_o} is on {o.device}")


def merge_states(*args):
    """Merge normalized partial attention results over disjoint key sets.

    ``merge_states(o_a, lse_a, o_b, lse_b) -> (o, lse)`` or the stacked form
    ``merge_states(outs, lses) -> (o, lse)`` with a leading split axis (``outs (S, ...,
    D)``, ``lses (S, ...)``). With ``lse_s = log sum_{j in part s} e^{s_j}``,

    ``lse = log sum_s e^{lse_s}``, ``o = sum_s e^{lse_s - lse} o_s``,

    i.e. the ATTENTION monoid's combine (the kernel is generated from it; see
    :mod:`flashfold.kernels.attention.merge`). Empty parts (``lse = -inf``, any ``o``)
    contribute nothing; if every part is empty, ``o = 0`` and ``lse = -inf``. Any split
    of the keys merged in any order equals the unsplit attention up to rounding.
    ``o`` keeps the parts' dtype, ``lse`` is float32; float64 parts are merged in float64
    on every device (the merge kernel's state is fp32: they run the reference). Shapes:
    ``o_* (..., N, D)`` with 1 to 3 leading dims (``(B, H, N, D)`` typically), ``lse_*`` its shape without ``D``.
    Differentiable with respect to every part, by one rule on every device
    (:func:`~flashfold.kernels.attention.autograd.merge_grads`: an empty part, and every
    part of a row whose parts are all empty, gets zero gradients).
    """
    if len(args) == 4:
        o_a, lse_a, o_b, lse_b = args
        _check_parts("o_a", "lse_a", o_a, lse_a, 0)
        _check_parts("o_b", "lse_b", o_b, lse_b, 0)
        if o_a.shape != o_b.shape:
            raise ValueError(f"o_a shape {tuple(o_a.shape)} != o_b shape {tuple(o_b.shape)}")
        if o_a.dtype != o_b.dtype:
            raise TypeError(f"o_a dtype {o_a.dtype} != o_b dtype {o_b.dtype}")
        if o_a.device != o_b.device:
            raise ValueError(f"o_b is on {o_b.device} but o_a is on {o_a.device}")
        lead = o_a.shape[:-1]
    elif len(args) == 2:
        outs, lses = args
        _check_parts("outs", "lses", outs, lses, 1)
        if outs.shape[0] < 1:
            raise ValueError("outs must hold at least one part (leading split axis of size >= 1)")
        lead = outs.shape[1:-1]
    else:
        raise TypeError("merge_states takes (o_a, lse_a, o_b, lse_b) or (outs, lses), got "
                        f"{len(args)} arguments")
    from ..kernels.attention import autograd
    # the merge kernel's state is fp32: float64 parts are merged by the reference (torch
    # ops, any device) in float64
    kernel = _use_kernel(args[0]) and args[0].dtype != torch.float64
    if torch.compiler.is_compiling():
        return autograd.merge_op(list(args), kernel)
    if torch.is_grad_enabled() and any(t.requires_grad for t in args):
        # one gradient rule on every device (the kernels have none of their own)
        return autograd.MergeStates.apply(kernel, *args)
    return autograd.merge_impl(args, kernel)


def attention_policy(**switches):
    """A context manager: the :func:`attention` forwards and backwards that run inside the
    block (a backward runs under the policy in force when it runs, as autograd calls it)
    run under the current policy with ``switches`` changed (each a bool), process-wide as
    ``torch.backends`` switches are; on exit the policy of the blocks still open is back
    (blocks of several threads may close in any order), the default once none is.
    ``as`` gives the policy in force inside.

    The switches (all on by default): ``gluon`` (the warp-specialized Hopper kernels where
    they fit; off: the Triton kernels everywhere, as ``FLASHFOLD_GLUON=0`` does outside
    any block), ``tma`` (TMA loads in the Triton kernels), ``atomic_dq`` (the Triton
    backward's atomic dQ where its table picks it; off: the deterministic dQ kernel),
    ``strict_hidden`` / ``strict_nonfinite`` (the forward's and the backward's guards of
    rules 1 and 4 of the non-finite rules above; off only to measure them). The table of
    which kernel runs which call, and the policy's fields:
    :mod:`flashfold.kernels.attention.dispatch`. Every setting computes the same
    attention (the kernels differ in rounding and in the order of sums; the guards keep
    the non-finite rules), so the policy is a tool for measuring and for working around a
    kernel, not a numerical setting.

    Example::

        with flashfold.attention_policy(gluon=False):
            o = flashfold.attention(q, k, v, causal=True)    # the Triton template

    Raises ``TypeError`` naming a switch that does not exist or a value that is not a
    bool (when called, before the block)."""
    from ..kernels.attention.dispatch import using
    return using(**switches)


__all__ = ["attention", "attention_policy", "merge_states", "BlockMask", "create_block_mask",
           "TracedMod", "MAX_HEAD_DIM"]
