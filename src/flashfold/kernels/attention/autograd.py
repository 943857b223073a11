r"""``flashfold.attention`` as a differentiable ``torch.library`` custom op.

Two ops in the ``flashfold`` namespace, opaque to ``torch.compile`` (no graph break: the
compiler sees them as single nodes with the shapes of their fake implementations):

* ``flashfold::attn_fwd(q, k, v, cu_seqlens_q?, cu_seqlens_k?, tables[], key, scale,
  softcap?, left?, right?, use_kernel, deterministic) -> (o, lse)``
* ``flashfold::attn_bwd(do, dlse?, q, k, v, o, lse, cu_seqlens_q?, cu_seqlens_k?,
  tables[], key, scale, softcap?, left?, right?, use_kernel, deterministic) -> (dq, dk, dv)``

Under ``torch.compile`` :func:`attention_op` calls the ops; in eager mode it calls
:class:`_Attention`, a plain ``autograd.Function`` over the same two implementations
(:func:`forward_impl`, :func:`backward_impl`), because the dispatcher and
``register_autograd`` wrappers cost ~0.2 ms of host time per forward + backward.

``attn_fwd``'s gradient is registered with :func:`torch.library.register_autograd`: it
saves ``q, k, v, o, lse`` and calls ``attn_bwd`` (for ``q``, ``k``, ``v``; ``dlse`` enters
when the LSE output was used: :math:`D_i = dO_i \cdot O_i - d\mathrm{lse}_i`, see
:mod:`.bwd`). ``use_kernel`` selects the Triton kernels (:mod:`.fwd`, :mod:`.bwd`) or
the CPU implementation: the blocked reference forward
(:func:`.reference.attention_reference`) and :func:`.reference.backward_reference`, a blocked
backward in float64 (float64 inputs) or float32 with the same math as the kernels.

Non-tensor configuration (traced score_mod / mask_mod, a precomputed
:class:`~.mods.BlockMask`) cannot be an op argument. :func:`register_mods` stores it in a
registry under a string ``key`` (passed to the ops) and returns the key; the tensors it
captures (``ops.Buffer`` tables, block-mask tables) are passed as the ``tables`` list so
that the compiler orders the op after any in-place update of them. Under
``torch.compile``, ``register_mods`` runs once at trace time
(``torch.compiler.assume_constant_result``) and the caller passes ``id(score_mod)``,
``id(mask_mod)`` as arguments so that Dynamo guards on the identity of the mods: a new mod
function object recompiles (create mods once, outside the compiled step; mutate their
tables in place to change them). A registry entry lives as long as the mod objects it was
made from, and an autograd graph keeps the entries it needs until its backward.

Not supported: double backward (the backward op is not itself differentiable), gradients
with respect to captured tables (they are constants), and writing to a captured table in
place between a forward and its backward (the backward reads the tables again: in eager
mode it raises, as torch does for a saved tensor written in place).
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import weakref
from typing import List, Optional, Tuple

import torch

from .. import launcher
from .mods import (BlockMask, TracedMod, block_mask_by_handle, cached_block_mask, trace_mask_mod,
                   trace_score_mod, version)
from .reference import attention_reference, backward_reference, fp8_attention_reference


# --- the registry of non-tensor configuration -----------------------------------------------

class ModsEntry:
    """What one ``key`` stands for: ``score`` (TracedMod or None), ``mask`` (the traced
    mask_mod or None), ``block_mask`` (a user's precomputed BlockMask or None) and
    ``tables`` (the tensors they capture, op inputs) and ``host_tables`` (the NumPy arrays
    they capture, whose contents stand for their versions: :func:`.mods.version`)."""

    __slots__ = ("key", "score", "mask", "block_mask", "tables", "host_tables", "__weakref__")

    def __init__(self, key, score, mask, block_mask):
        self.key = key
        self.score = score
        self.mask = mask
        self.block_mask = block_mask
        tables, host = [], []
        for mod in (score, mask):
            if mod is not None:
                tables += [b.data for b in mod.buffers if isinstance(b.data, torch.Tensor)]
                host += [b.data for b in mod.buffers if not isinstance(b.data, torch.Tensor)]
        self.host_tables = host
        if block_mask is not None:
            tables += [block_mask.state, block_mask.partial_num, block_mask.partial_idx,
                       block_mask.full_num, block_mask.full_idx]
        self.tables = tables

    def __repr__(self):
        return (f"ModsEntry({self.key!r}, score={getattr(self.score, 'name', None)}, "
                f"mask={getattr(self.mask, 'name', None)}, block_mask={self.block_mask is not None})")


_ENTRIES: dict = {}                 # key -> ModsEntry (a plain dict: Dynamo reads it)
_BY_OWNERS: dict = {}               # (id(score_mod), id(mask_mod)) -> (weakrefs, key)
_LOCK = threading.Lock()
_COUNTER = itertools.count()


def _ref(obj):
    try:
        return weakref.ref(obj)
    except TypeError:               # not weak-referenceable: kept for the process's lifetime
        return lambda obj=obj: obj


def _drop(ids, key):
    with _LOCK:
        _ENTRIES.pop(key, None)
        if _BY_OWNERS.get(ids, (None, None))[1] == key:
            _BY_OWNERS.pop(ids, None)


@torch.compiler.assume_constant_result
def register_mods(score_mod, mask_mod, score_id: int = 0, mask_id: int = 0) -> str:
    """The registry key of ``(score_mod, mask_mod)`` (``""`` when both are None).

    ``score_mod``: a callable or TracedMod; ``mask_mod``: a callable, TracedMod,
    BlockMask, or a BlockMask's ``handle`` (an int: what a compiled caller passes, since
    a BlockMask object is not a constant to Dynamo). Traces them on first use (cached per
    object). ``score_id`` / ``mask_id`` are ``id(score_mod)`` / ``id(mask_mod)`` (0 for
    None), computed by the caller so that ``torch.compile`` guards on them (this function
    itself runs once, at trace time).
    """
    if isinstance(mask_mod, int) and not isinstance(mask_mod, bool):
        mask_mod = block_mask_by_handle(mask_mod)
    if score_mod is None and mask_mod is None:
        return ""
    ids = (id(score_mod), id(mask_mod))
    with _LOCK:
        hit = _BY_OWNERS.get(ids)
        if hit is not None:
            refs, key = hit
            if refs[0]() is score_mod and refs[1]() is mask_mod and key in _ENTRIES:
                return key
    score = trace_score_mod(score_mod) if score_mod is not None else None
    if isinstance(mask_mod, BlockMask):
        block_mask, mask = mask_mod, mask_mod.mod
    else:
        block_mask, mask = None, (trace_mask_mod(mask_mod) if mask_mod is not None else None)
    key = f"mods{next(_COUNTER)}"
    entry = ModsEntry(key, score, mask, block_mask)
    with _LOCK:
        _ENTRIES[key] = entry
        _BY_OWNERS[ids] = ((_ref(score_mod), _ref(mask_mod)), key)
    for owner in (score_mod, mask_mod):
        if owner is not None:
            try:
                weakref.finalize(owner, _drop, ids, key)
            except TypeError:
                pass
    return key


def entry_tables(key: str) -> list:
    """The tensors of registry entry ``key`` (the ops' ``tables`` input; [] for ``""``)."""
    return _ENTRIES[key].tables if key else []


def mods_entry(key: str) -> ModsEntry | None:
    """The registry entry of ``key`` (from :func:`register_mods`; None for ``""``).

    RuntimeError when the entry is gone (its score_mod / mask_mod was garbage collected).
    """
    if not key:
        return None
    try:
        return _ENTRIES[key]
    except KeyError:
        raise RuntimeError(f"flashfold attention: mods entry {key!r} is gone (its score_mod / "
                           f"mask_mod was garbage collected)") from None


# --- forward and backward implementations ----------------------------------------------------

#: id(cu_seqlens) -> (weak reference, version, lengths): the lengths that
#: :func:`flashfold.attention` validated (:func:`remember_lengths`), so that the forward
#: and the backward of the call do not read them from the device again (each read is a
#: host sync). An in-place write to the offsets bumps their version and forces a read.
_LENGTHS: dict = {}
_LENGTHS_SIZE = 64


def remember_lengths(cu, lens):
    """Note that ``cu`` (at its current version) holds the sequence lengths ``lens``. An
    inference tensor has no version (:func:`.mods.version`): nothing is noted, and each
    call reads it."""
    if cu.is_inference():
        return
    if len(_LENGTHS) >= _LENGTHS_SIZE:
        _LENGTHS.clear()
    _LENGTHS[id(cu)] = (weakref.ref(cu), cu._version, lens)


def known_lengths(cu):
    """The lengths :func:`remember_lengths` noted for ``cu`` at its current version, else
    None."""
    hit = _LENGTHS.get(id(cu))
    if hit is not None and hit[0]() is cu and not cu.is_inference() and hit[1] == cu._version:
        return hit[2]
    return None


def _lengths(cu):
    lens = known_lengths(cu)
    if lens is not None:
        return lens
    vals = cu.tolist()
    return [b - a for a, b in zip(vals, vals[1:])]


def packed_lengths(cu_q, cu_k, lens_q=None, lens_k=None, mask=None):
    """``(lens_q, lens_k, n_seq, max_q, max_k)`` of a packed call (offsets ``cu_q``,
    ``cu_k``): the lengths given, noted or read (a host sync), and the longest. While a
    CUDA graph is captured nothing is read: lengths and longest are None (unknown), and
    the launches, sized from the shapes alone (the packed rows bound every sequence;
    the kernels read the offsets on the device), hold for any offsets a replay finds
    (the same number of sequences over the same rows). A callable ``mask`` (its block
    table is built per sequence on the host) cannot be captured over packed sequences:
    ``ValueError``."""
    n_seq = cu_q.shape[0] - 1
    if lens_q is None and launcher.capturing(cu_q.device):
        if mask is not None:
            raise ValueError("mask_mod: a callable mask_mod over packed sequences (cu_seqlens) "
                             "builds its block table from the sequence lengths, which are "
                             "not read while a CUDA graph is captured; pass a BlockMask "
                             "(create_block_mask) or call outside the capture")
        return None, None, n_seq, None, None
    if lens_q is None:
        lens_q, lens_k = _lengths(cu_q), _lengths(cu_k)
    return lens_q, lens_k, n_seq, max(lens_q, default=0), max(lens_k, default=0)


def kernel_forward(q, k, v, *, scale, softcap, left, right, score: TracedMod | None,
                   mask: TracedMod | None, block_mask: BlockMask | None, cu_q=None, cu_k=None,
                   lens_q=None, lens_k=None, return_lse=True, descales=None, out_dtype=None):
    """The Triton forward with the block mask prepared: a user's BlockMask is used as is
    (with bounds / windows applied inside its FULL tiles when it cannot know them), a
    callable mask_mod gets an exact table for these lengths and window (cached).
    ``lens_*``: per-sequence lengths when already known (else :func:`packed_lengths`).
    ``descales``, ``out_dtype``: an FP8 call's (:func:`.fwd.attention_forward`)."""
    from . import fwd

    B, HQ, NQ, _ = q.shape
    DV = v.shape[3]
    if B == 0 or HQ == 0 or NQ == 0 or k.shape[2] == 0:
        # nothing to compute, or no key at all: o = 0, lse = -inf
        o = torch.zeros((B, HQ, NQ, DV), dtype=out_dtype or q.dtype, device=q.device)
        lse = torch.full((B, HQ, NQ), -math.inf, dtype=torch.float32, device=q.device)
        return o, (lse if return_lse else None)
    varlen = cu_q is not None
    n_seq, seq_q, seq_k = B, NQ, k.shape[2]
    if varlen:
        lens_q, lens_k, n_seq, seq_q, seq_k = packed_lengths(
            cu_q, cu_k, lens_q, lens_k, mask if block_mask is None else None)
    full_needs_mask = True
    if block_mask is not None:
        # user tables know only their own bounds: apply ours inside FULL tiles when needed
        full_needs_mask = varlen or left is not None or right is not None
    elif mask is not None:
        block_m, block_n = fwd.mask_tiles(q, k, v, scale=scale, softcap=softcap, left=left,
                                          right=right, score_mod=score, mask_mod=mask,
                                          varlen=varlen)
        block_mask = cached_block_mask(
            mask, batch=n_seq, heads=HQ, q_len=seq_q, kv_len=seq_k, block_m=block_m,
            block_n=block_n, device=q.device, lens_q=lens_q, lens_k=lens_k,
            left=left, right=right)
        full_needs_mask = False                 # exact for these lengths and window
    with launcher.on_device(q.device):
        return fwd.attention_forward(
            q, k, v, scale=scale, softcap=softcap, left=left, right=right, score_mod=score,
            block_mask=block_mask, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=seq_q,
            max_seqlen_k=seq_k, return_lse=return_lse, full_needs_mask=full_needs_mask,
            descales=descales, out_dtype=out_dtype)


def kernel_backward(do, q, k, v, o, lse, dlse, *, scale, softcap, left, right,
                    score: TracedMod | None, mask: TracedMod | None,
                    block_mask: BlockMask | None, cu_q=None, cu_k=None, deterministic=False):
    """The Triton backward, block mask prepared as in :func:`kernel_forward` (a callable
    mask_mod gets a table with tiles the backward kernels divide)."""
    from . import bwd

    varlen = cu_q is not None
    B, HQ, NQ, D = q.shape
    lens_q = lens_k = None
    n_seq, seq_q, seq_k = B, NQ, k.shape[2]
    if varlen:
        lens_q, lens_k, n_seq, seq_q, seq_k = packed_lengths(
            cu_q, cu_k, mask=mask if block_mask is None else None)
    full_needs_mask = True
    if block_mask is not None:
        full_needs_mask = varlen or left is not None or right is not None
    elif mask is not None and B and HQ and NQ and k.shape[2]:
        # a mask_mod: its table for these lengths and window, in tiles the kernels walk
        # (chosen only when there is one: a replayed eager backward has no use for them;
        # H200 host, cProfile of an eager training step at 1K causal: 62 of the ~120 us
        # that this function spent outside attention_backward)
        block_m, block_n = bwd.mask_tiles(q, k, v, do, softcap=softcap, left=left,
                                          right=right, score_mod=score, mask_mod=mask,
                                          cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                          deterministic=deterministic)
        block_mask = cached_block_mask(
            mask, batch=n_seq, heads=HQ, q_len=max(seq_q, 1), kv_len=max(seq_k, 1),
            block_m=block_m, block_n=block_n, device=q.device, lens_q=lens_q,
            lens_k=lens_k, left=left, right=right)
        full_needs_mask = False
    with launcher.on_device(q.device):
        return bwd.attention_backward(
            do, q, k, v, o, lse, scale=scale, dlse=dlse, softcap=softcap, left=left,
            right=right, score_mod=score, block_mask=block_mask, cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k, max_seqlen_q=seq_q, max_seqlen_k=seq_k,
            full_needs_mask=full_needs_mask, deterministic=deterministic)


def reference_forward(q, k, v, *, scale, softcap, left, right, score=None, mask=None,
                      cu_q=None, cu_k=None):
    """The CPU path's forward: :func:`.reference.attention_reference` (blocked, float32 or
    float64) with the traced ``score`` / ``mask`` mods as torch functions; ``(o, lse)``
    as it returns them. The arguments as :func:`kernel_forward`'s."""
    dev = q.device
    return attention_reference(
        q, k, v, causal=False, window=(left, right), scale=scale, softcap=softcap,
        score_mod=score.torch_fn(dev) if score is not None else None,
        mask_mod=mask.torch_fn(dev) if mask is not None else None,
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def _stat_dtype(q):
    """LSE dtype the ops return: float64 for float64 inputs (CPU), else float32."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# --- the custom ops ---------------------------------------------------------------------------

def forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, key, scale, softcap, left, right,
                 use_kernel):
    """The forward both wrappers run: ``(o, lse)`` contiguous, lse float32 (float64 for
    float64 inputs); the kernels or the blocked reference."""
    entry = mods_entry(key)
    score = entry.score if entry else None
    mask = entry.mask if entry else None
    block_mask = entry.block_mask if entry else None
    if use_kernel:
        o, lse = kernel_forward(q, k, v, scale=scale, softcap=softcap, left=left, right=right,
                                score=score, mask=mask, block_mask=block_mask,
                                cu_q=cu_seqlens_q, cu_k=cu_seqlens_k)
    else:
        o, lse = reference_forward(q, k, v, scale=scale, softcap=softcap, left=left,
                                   right=right, score=score, mask=mask, cu_q=cu_seqlens_q,
                                   cu_k=cu_seqlens_k)
    return o.contiguous(), lse.to(_stat_dtype(q)).contiguous()


def backward_impl(do, dlse, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, key, scale, softcap,
                  left, right, use_kernel, deterministic):
    """The backward both wrappers run: ``(dq, dk, dv)`` contiguous in the input dtype."""
    entry = mods_entry(key)
    score = entry.score if entry else None
    mask = entry.mask if entry else None
    block_mask = entry.block_mask if entry else None
    if do is None:
        do = torch.zeros_like(o)
    if use_kernel:
        dq, dk, dv = kernel_backward(do, q, k, v, o, lse, dlse, scale=scale, softcap=softcap,
                                     left=left, right=right, score=score, mask=mask,
                                     block_mask=block_mask, cu_q=cu_seqlens_q,
                                     cu_k=cu_seqlens_k, deterministic=deterministic)
    else:
        dq, dk, dv = backward_reference(do, q, k, v, o, lse, dlse, scale=scale, softcap=softcap,
                                        left=left, right=right, score_mod=score, mask_mod=mask,
                                        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


# --- eager: a plain autograd.Function (the dispatcher costs ~0.2 ms per step) ------------------

class _Refuse(torch.autograd.Function):
    """``apply(name, n, *grads, *inputs)``: the ``n`` gradients unchanged, joined to the
    saved ``inputs`` by a node whose backward raises, naming ``name``."""

    @staticmethod
    def forward(ctx, name, n, *tensors):
        ctx.name = name
        return tuple(g.view_as(g) for g in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"{ctx.name}: double backward (differentiating its gradients, "
                           "create_graph=True) is not supported")


def _first_order(name):
    """``once_differentiable`` that also refuses a second derivative through the saved
    inputs: under ``create_graph=True`` the gradients depend on the saved tensors that
    require grad through a node that raises, naming ``name``. (torch's decorator marks
    them only when an incoming gradient requires grad, and not as functions of the
    inputs: the penalty ``(dq ** 2).sum()`` came out a constant of ``q``, silently, where
    the custom ops raise.)"""
    def wrap(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            with torch.no_grad():
                out = backward(ctx, *grads)
            if not torch.is_grad_enabled():        # (no create_graph: the common case)
                return out
            inputs = [t for t in ctx.saved_tensors if t is not None and t.requires_grad]
            if not inputs:
                return out
            at = [i for i, g in enumerate(out) if g is not None]
            refused = _Refuse.apply(name, len(at), *[out[i] for i in at], *inputs)
            out = list(out)
            for i, g in zip(at, refused):
                out[i] = g
            return tuple(out)
        return wrapper
    return wrap


class _Attention(torch.autograd.Function):
    """Eager wrapper over :func:`forward_impl` / :func:`backward_impl` (same numerics as the
    custom ops, without the ``torch.library`` dispatch; once differentiable)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, key, scale, softcap, left, right, use_kernel,
                deterministic):
        o, lse = forward_impl(q, k, v, cu_q, cu_k, key, scale, softcap, left, right, use_kernel)
        ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
        ctx.args = (key, scale, softcap, left, right, use_kernel, deterministic)
        ctx.entry = _ENTRIES.get(key) if key else None      # the mods live until backward
        ctx.versions = _table_versions(ctx.entry)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    @_first_order("flashfold.attention")
    def backward(ctx, do, dlse):
        q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
        _restore(ctx)
        _check_tables(ctx)
        dq, dk, dv = backward_impl(do, dlse, q, k, v, o, lse, cu_q, cu_k, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def _table_versions(entry):
    """The write counters of the tables ``entry`` captures (None for an inference tensor,
    which has none; a NumPy table's contents: :func:`.mods.version`), noted at the forward
    for :func:`_check_tables`."""
    if entry is None:
        return ()
    return (tuple(None if t.is_inference() else t._version for t in entry.tables)
            + tuple(version(d) for d in entry.host_tables))


def _check_tables(ctx):
    """RuntimeError when a table of the mods was written in place since the forward: the
    backward recomputes ``P`` from the tables as they are now, and would give the
    gradients of other scores (torch raises likewise for a saved tensor)."""
    entry, versions = ctx.entry, getattr(ctx, "versions", None)
    if entry is None or not versions:
        return
    n = len(entry.tables)
    for t, seen in zip(entry.tables, versions):
        if seen is not None and t._version != seen:
            raise RuntimeError(
                "flashfold.attention: a table captured by score_mod / mask_mod was modified "
                f"in place after the forward (version {seen}, now {t._version}); the "
                "backward would use the new values. Run the backward before writing to it, "
                "or write to a copy")
    for d, seen in zip(entry.host_tables, versions[n:]):
        if version(d) != seen:
            raise RuntimeError(
                "flashfold.attention: a NumPy table captured by score_mod / mask_mod was "
                "modified in place after the forward; the backward would use the new "
                "values. Run the backward before writing to it, or write to a copy")


def _restore(ctx):
    key = ctx.args[0]
    if key and ctx.entry is not None and key not in _ENTRIES:
        with _LOCK:
            _ENTRIES[key] = ctx.entry


# --- torch.compile: the custom ops ------------------------------------------------------------

@torch.library.custom_op("flashfold::attn_fwd", mutates_args=())
def attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
             tables: List[torch.Tensor], key: str, scale: float, softcap: Optional[float],
             left: Optional[int], right: Optional[int], use_kernel: bool,
             deterministic: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention forward: ``(o (B, Hq, Nq, Dv) in q's dtype, lse (B, Hq, Nq))``, lse in
    float32 (float64 for float64 inputs). ``tables`` only orders the op after updates of
    the mods' tables (the registry entry ``key`` holds them)."""
    return forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, key, scale, softcap, left, right,
                        use_kernel)


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, tables, key, scale, softcap, left,
                   right, use_kernel, deterministic):
    B, HQ, NQ, _ = q.shape
    o = q.new_empty((B, HQ, NQ, v.shape[3]))
    lse = q.new_empty((B, HQ, NQ), dtype=_stat_dtype(q))
    return o, lse


@torch.library.custom_op("flashfold::attn_bwd", mutates_args=())
def attn_bwd(do: torch.Tensor, dlse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
             cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
             tables: List[torch.Tensor], key: str, scale: float, softcap: Optional[float],
             left: Optional[int], right: Optional[int], use_kernel: bool,
             deterministic: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward: ``(dq, dk, dv)`` contiguous in the input dtype."""
    return backward_impl(do, dlse, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, key, scale,
                         softcap, left, right, use_kernel, deterministic)


@attn_bwd.register_fake
def _attn_bwd_fake(do, dlse, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, tables, key, scale,
                   softcap, left, right, use_kernel, deterministic):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, tables, key, scale, softcap, left, right, use_kernel,
     deterministic) = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
    ctx.set_materialize_grads(False)     # an unused lse output gets dlse = None, not zeros
    ctx.tables = tables
    ctx.args = (key, scale, softcap, left, right, use_kernel, deterministic)
    ctx.entry = _ENTRIES.get(key) if key else None     # keeps the mods alive until backward
    # (traced under torch.compile: no write counters to compare then)
    ctx.versions = None if torch.compiler.is_compiling() else _table_versions(ctx.entry)


def _backward(ctx, do, dlse):
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    _restore(ctx)
    _check_tables(ctx)
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv = attn_bwd(do, dlse, q, k, v, o, lse, cu_q, cu_k, ctx.tables, *ctx.args)
    # one gradient per input of attn_fwd (the tables list gets a list of Nones)
    return dq, dk, dv, None, None, [None] * len(ctx.tables), None, None, None, None, None, None, None


torch.library.register_autograd("flashfold::attn_fwd", _backward, setup_context=_setup_context)


# --- merge_states: the same gradient on every device -----------------------------------------

def merge_grads(do, dlse, outs, lses, o):
    r"""Gradients of :func:`flashfold.merge_states` with respect to its parts: ``(d outs,
    d lses)`` for stacked parts ``outs (S, ..., D)``, ``lses (S, ...)`` and the merged
    ``o (..., D)`` (``do`` / ``dlse`` may be None: no gradient).

    With :math:`w_s = e^{lse_s - lse}` (0 for an empty part, ``lse_s = -inf``, also when
    every part is empty), :math:`o = \sum_s w_s o_s` and :math:`\partial lse /
    \partial lse_s = w_s`:

    .. math::  \bar o_s = w_s \bar o, \qquad
               \bar{lse}_s = w_s \left(\overline{lse} + \langle \bar o, o_s - o\rangle\right)

    computed in float32 (float64 for float64 parts), returned in the parts' dtypes, with
    the merged ``lse`` recomputed from ``lses`` in that precision (the one
    ``merge_states`` returns is float32, whose rounding would bound float64 gradients at
    ~1e-7)."""
    cd = torch.float64 if outs.dtype == torch.float64 else torch.float32
    ls = lses.to(cd)
    w = torch.where(ls == -math.inf, 0.0, torch.exp(ls - torch.logsumexp(ls, 0, keepdim=True)))
    # a part with no weight gets 0, whatever the other values (a non-finite o_s or d o
    # times its zero weight is not a gradient of it)
    empty = w == 0
    d_outs = d_lses = None
    if do is not None:
        dof = do.to(cd).unsqueeze(0)
        d_outs = torch.where(empty.unsqueeze(-1), 0.0, w.unsqueeze(-1) * dof).to(outs.dtype)
        d_lses = w * (dof * (outs.to(cd) - o.to(cd).unsqueeze(0))).sum(-1)
    if dlse is not None:
        extra = w * dlse.to(cd).unsqueeze(0)
        d_lses = extra if d_lses is None else d_lses + extra
    if d_lses is not None:
        d_lses = torch.where(empty, 0.0, d_lses).to(lses.dtype)
    return d_outs, d_lses


def merge_impl(parts, use_kernel: bool):
    """``merge_states``' ``(o, lse)`` of validated parts, ``(o_a, lse_a, o_b, lse_b)`` or
    ``(outs, lses)``: the merge kernels (:mod:`.merge`) or the reference; ``o`` in the
    parts' dtype and shape (less the split axis), ``lse`` float32."""
    pair = len(parts) == 4
    lead = parts[0].shape[:-1] if pair else parts[0].shape[1:-1]
    if use_kernel:
        from .merge import merge_parts, merge_pair
        if pair:
            o, lse = merge_pair(*[_as4(t, 1 - i % 2) for i, t in enumerate(parts)])
        else:
            o, lse = merge_parts(_as4(parts[0], 1, split=True), _as4(parts[1], 0, split=True))
    else:
        from .reference import merge_states_reference
        if pair:                  # the reference takes stacked parts (a copy)
            outs, lses = torch.stack(parts[0::2]), torch.stack(parts[1::2])
        else:
            outs, lses = parts
        o, lse = merge_states_reference(outs, lses)
        lse = lse.to(torch.float32)
    return o.reshape(*lead, o.shape[-1]), lse.reshape(lead)


def _as4(t, has_d, split=False):
    """View with exactly (B, H, N[, D]) after the optional split axis (unsqueezes only)."""
    s = 1 if split else 0
    while t.dim() < s + 3 + has_d:
        t = t.unsqueeze(s)
    return t


def _merge_backward(parts, o, do, dlse) -> list:
    """:func:`merge_grads` for the parts as given (pair or stacked): one gradient each."""
    if len(parts) == 4:
        outs, lses = torch.stack(parts[0::2]), torch.stack(parts[1::2])
    else:
        outs, lses = parts
    d_outs, d_lses = merge_grads(do, dlse, outs, lses, o)
    if len(parts) == 2:
        return [d_outs, d_lses]
    pick = (lambda g, s: None if g is None else g[s])  # noqa: E731
    return [pick(d_outs, 0), pick(d_lses, 0), pick(d_outs, 1), pick(d_lses, 1)]


class MergeStates(torch.autograd.Function):
    """Eager ``merge_states`` with gradients: ``apply(use_kernel, *parts)``
    (:func:`merge_impl`, :func:`merge_grads` as its backward)."""

    @staticmethod
    def forward(ctx, use_kernel, *parts):
        o, lse = merge_impl(parts, use_kernel)
        ctx.save_for_backward(*parts, o)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    @_first_order("flashfold.merge_states")
    def backward(ctx, do, dlse):
        *parts, o = ctx.saved_tensors
        return None, *_merge_backward(parts, o, do, dlse)


@torch.library.custom_op("flashfold::merge_states", mutates_args=())
def merge_op(parts: List[torch.Tensor], use_kernel: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``merge_states`` under ``torch.compile``: :func:`merge_impl` as one op (its gradient
    :func:`merge_grads`)."""
    o, lse = merge_impl(parts, use_kernel)
    return o.contiguous(), lse.contiguous()


@merge_op.register_fake
def _merge_op_fake(parts, use_kernel):
    lead = parts[0].shape[:-1] if len(parts) == 4 else parts[0].shape[1:-1]
    return (parts[0].new_empty((*lead, parts[0].shape[-1])),
            parts[0].new_empty(lead, dtype=torch.float32))


def _merge_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[0], output[0])
    ctx.set_materialize_grads(False)


def _merge_op_backward(ctx, do, dlse):
    *parts, o = ctx.saved_tensors
    return _merge_backward(parts, o, do, dlse), None


torch.library.register_autograd("flashfold::merge_states", _merge_op_backward,
                                setup_context=_merge_setup)


# --- FP8 (forward only) ------------------------------------------------------------------------

def fp8_forward_impl(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k,
                     scale, softcap, left, right, use_kernel, out_dtype, lens_q=None,
                     lens_k=None, return_lse=True):
    """An FP8 forward (:func:`.reference.fp8_attention_reference`'s semantics): ``(o in
    out_dtype, lse float32)``, by the kernels (the Gluon kernel's E4M3 descriptors on
    sm_90, else the Triton template's FP8 flag: :mod:`.dispatch`) or the CPU reference.
    ``lens_*``: per-sequence lengths when already read from ``cu_seqlens_*``; without
    ``return_lse`` the kernel may return None for the LSE. The kernels read ``v`` with its
    keys contiguous (the 8-bit ``P V`` product takes V K-major), each row of keys
    16-byte aligned (TMA's strides): a ``v`` made as ``vt.transpose(-1, -2)`` of a
    ``(B, Hk, Dv, Nk)`` tensor with ``Nk`` a multiple of 16 is read as it is; any other
    is transposed into a new buffer first (``Nk Dv`` bytes per KV head, its rows padded
    to a multiple of 16 keys)."""
    if use_kernel:
        from ..tma import addressable
        from .fwd import keys_contiguous
        if not (keys_contiguous(v) and addressable(v.transpose(2, 3))):
            B, H, N, D = v.shape
            vt = torch.empty((B, H, D, -(-N // 16) * 16), dtype=v.dtype, device=v.device)
            vt = vt[..., :N]
            vt.copy_(v.transpose(2, 3))
            v = vt.transpose(2, 3)
        return kernel_forward(q, k, v, scale=scale, softcap=softcap, left=left, right=right,
                              score=None, mask=None, block_mask=None, cu_q=cu_seqlens_q,
                              cu_k=cu_seqlens_k, lens_q=lens_q, lens_k=lens_k,
                              return_lse=return_lse, descales=(q_descale, k_descale, v_descale),
                              out_dtype=out_dtype)
    return fp8_attention_reference(q, k, v, q_descale, k_descale, v_descale,
                                   window=(-1 if left is None else left,
                                           -1 if right is None else right),
                                   scale=scale, softcap=softcap, cu_seqlens_q=cu_seqlens_q,
                                   cu_seqlens_k=cu_seqlens_k, out_dtype=out_dtype)


@torch.library.custom_op("flashfold::attn_fwd_fp8", mutates_args=())
def attn_fwd_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: torch.Tensor,
                 k_descale: torch.Tensor, v_descale: torch.Tensor,
                 cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
                 scale: float, softcap: Optional[float], left: Optional[int],
                 right: Optional[int], use_kernel: bool,
                 out_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """FP8 attention forward under ``torch.compile``: ``(o (B, Hq, Nq, Dv) in out_dtype,
    lse (B, Hq, Nq) float32)``, contiguous (:func:`fp8_forward_impl`; no gradient: FP8
    inputs do not require one)."""
    o, lse = fp8_forward_impl(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q,
                              cu_seqlens_k, scale, softcap, left, right, use_kernel, out_dtype)
    return o.contiguous(), lse.contiguous()


@attn_fwd_fp8.register_fake
def _attn_fwd_fp8_fake(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k,
                       scale, softcap, left, right, use_kernel, out_dtype):
    B, HQ, NQ, _ = q.shape
    return (q.new_empty((B, HQ, NQ, v.shape[3]), dtype=out_dtype),
            q.new_empty((B, HQ, NQ), dtype=torch.float32))


# --- the entry point used by flashfold.attention ------------------------------------------------

def attention_op(q, k, v, *, key: str, scale: float, softcap=None, left=None, right=None,
                 cu_seqlens_q=None, cu_seqlens_k=None, use_kernel: bool, deterministic=False,
                 custom_op: bool | None = None):
    """Differentiable, compilable attention: ``(o, lse)`` (``key`` from
    :func:`register_mods`; ``lse`` float32, float64 for float64 inputs). Under
    ``torch.compile`` (or ``custom_op=True``) through ``flashfold::attn_fwd``; in eager
    through :class:`_Attention` (the same implementations without the dispatcher)."""
    args = (None if softcap is None else float(softcap),
            None if left is None else int(left), None if right is None else int(right),
            bool(use_kernel), bool(deterministic))
    if custom_op is None:
        custom_op = torch.compiler.is_compiling()
    if custom_op:
        return attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, entry_tables(key), key,
                        float(scale), *args)
    return _Attention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, key, float(scale), *args)


__all__ = ["attention_op", "register_mods", "entry_tables", "attn_fwd", "attn_bwd",
           "attn_fwd_fp8", "fp8_forward_impl", "MergeStates", "merge_grads", "merge_impl",
           "merge_op",
           "remember_lengths",
           "forward_impl", "backward_impl",
           "kernel_forward", "kernel_backward", "ModsEntry"]
