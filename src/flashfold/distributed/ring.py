r"""Ring attention: exact attention over a sequence sharded across a process group.

Every rank ``r`` of a ``torch.distributed`` group of ``W`` ranks holds ``q_r, k_r, v_r``
``(B, H, N_r, D)``: the rows of one shard of the sequence (the same positions for q, k
and v; ``N_r`` may differ from rank to rank, even be 0). Attention of ``q_r`` against the
*whole* key sequence is assembled from partial results over disjoint key blocks, because
the attention state is a monoid (the spec's split-KV argument): with
:math:`\mathrm{lse}_t = \log \sum_{j \in K_t} e^{s_{ij}}` and :math:`o_t` the attention
of ``q_r`` over the keys of block ``K_t`` alone,

.. math::

    \mathrm{lse} = \log \sum_t e^{\mathrm{lse}_t}, \qquad
    o = \sum_t w_t\, o_t, \qquad w_t = e^{\mathrm{lse}_t - \mathrm{lse}},

which is :func:`flashfold.merge_states` (the ATTENTION monoid's combine; an empty block,
``lse_t = -inf``, is its identity). No rank ever holds more than two K/V blocks.

**Schedule** (forward). At step ``t = 0 .. W-1`` rank ``r`` holds the K/V block of rank
``(r - t) mod W``. It first posts the exchange of that block for the next step (send to
``r + 1``, receive from ``r - 1``; ``batch_isend_irecv``, so on NCCL the transfer runs on
the communication stream while the attention kernels run on the compute stream, and on
gloo in its worker threads), then computes its partial result(s) on the current block with
flashfold's attention kernel, folds them into the running state with the merge, and waits
for the exchange. The fold order is fixed (steps in order, then tasks in order), so the
result is deterministic. Running states are kept in float32 (float64 for float64 inputs)
and cast to the input dtype once at the end.

**Causal masking** uses *global* positions: key ``j`` is visible to query ``i`` iff
``pos(j) <= pos(i)``. Each shard is a list of *segments* (global offset, length), stored
one after the other in increasing global order: one segment (``layout="contiguous"``) or
two (``layout="zigzag"``). Segments of different ranks are disjoint, so a (query segment,
key segment) pair from different ranks is either fully visible (every key before every
query: no mask) or invisible (skipped); the diagonal block (the rank's own K/V) is exactly
flashfold's ``causal=True`` over the whole shard, because the local order is monotone in
the global order and ``N_q = N_k`` there (bottom-right alignment is then top-left). Fully
visible pairs that are adjacent in memory are coalesced into one kernel call. Non-causal
attention is one call per step.

**Layouts.** ``"contiguous"``: rank ``r`` holds positions
``[sum(N_<r), sum(N_<=r))`` (any lengths). ``"zigzag"``: the sequence of ``N`` positions is
split into ``2W`` chunks of lengths :func:`chunk_lengths` (``N // 2W``, the first
``N mod 2W`` one longer) and rank ``r`` holds chunks ``r`` and ``2W - 1 - r``, which
balances causal work (every rank gets one early and one late chunk). :func:`shard`,
:func:`unshard` and :func:`shard_lengths` convert between full tensors and shards.

**Backward** (``torch.autograd.Function``). The forward saves ``q, k, v``, the merged
``o`` and the merged ``lse`` (float32; float64 for float64 inputs). With the *global*
``lse`` every block's probabilities are the global ones,
:math:`P_{ij} = e^{s_{ij} - \mathrm{lse}_i}`, and with
:math:`D_i = dO_i \cdot O_i - d\mathrm{lse}_i` the block's score gradient is the global one,
:math:`dS_{ij} = P_{ij}(dO_i \cdot v_j - D_i)`; so a block's contributions to ``dq``,
``dk``, ``dv`` are exactly what a FlashAttention backward kernel computes when it is given
``(q, k_blk, v_blk, O, dO, lse, dlse)``. K/V travel around the ring again (same schedule),
together with float32 (float64) ``dK/dV`` accumulators: at step ``t`` the accumulator of
block ``(r - t) mod W`` arrives from ``r - 1``, the rank adds its contribution after
computing it (the arrival overlaps the computation) and passes it on; after ``W`` steps
each accumulator is back at its owner. ``dq`` accumulates locally. Per-block backward
paths (:func:`_block_backward_fn`):

* the global-statistics formula: on CUDA the Triton backward kernel
  (:func:`flashfold.kernels.attention.bwd.attention_backward`), on CPU the blocked
  reference backward with the same math
  (:func:`flashfold.kernels.attention.reference.backward_reference`, float64 for float64
  inputs), each called with ``(q, k_blk, v_blk, O, dO, lse, dlse)``;
* where those are missing, autograd: recompute the block's ``(o_t, lse_t)`` with grad
  enabled and call ``torch.autograd.grad`` with the upstream gradients the merge gives it
  (differentiate :math:`o = \sum_s w_s o_s`,
  :math:`\mathrm{lse} = \log\sum_s e^{\mathrm{lse}_s}`; :math:`\partial w_s/\partial
  \mathrm{lse}_t = w_s(\delta_{st} - w_t)`):

  .. math::

      d o_t = w_t\, dO, \qquad
      d\mathrm{lse}_t = w_t \big(dO \cdot (o_t - O) + d\mathrm{lse}\big).

  Substituting into the block's own backward gives the same :math:`dS` as above.

Every rank must call the forward and the backward (both communicate).

**Backends.** gloo with CPU tensors, NCCL with CUDA tensors (call
``torch.cuda.set_device`` first). On CPU the partial results come from the blocked
reference (:func:`flashfold.kernels.attention.reference.attention_reference`), whose LSE
stays float64 for float64 inputs, and they merge with
:func:`~flashfold.kernels.attention.reference.merge_states_reference` in float64 (the public
:func:`flashfold.attention` rounds LSE to float32, which would cap float64 accuracy at
1e-7). On CUDA the partials come from :func:`flashfold.attention` (Triton) and merge with
the merge kernel behind :func:`flashfold.merge_states` (float32 running state and a
bf16/fp16 part in one launch, no cast copy).

**Copies** (documented, none silent): the rank's own K/V are packed once into a flat
contiguous send buffer (``torch.distributed`` sends contiguous memory only; ``k`` then
``v``), and the received blocks are used in place as views of such buffers; the float32
running output is cast to the input dtype once at the end; zigzag :func:`shard` and
:func:`unshard` concatenate chunks (contiguous-layout :func:`shard` returns a view).
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..api.validate import check_kernel_head_dims, check_positive, check_qkv

LAYOUTS = ("contiguous", "zigzag")

_TAG_KV, _TAG_DKV = 11, 12


# --- layouts ----------------------------------------------------------------------------------

def _check_world(world, rank=None):
    if isinstance(world, bool) or not isinstance(world, numbers.Integral) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, numbers.Integral)
                             or not 0 <= rank < world):
        raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def chunk_lengths(n: int, parts: int) -> list[int]:
    """Lengths of ``parts`` near-equal chunks of ``n`` items: ``n // parts`` each, the
    first ``n % parts`` one longer (as ``numpy.array_split``)."""
    base, extra = divmod(int(n), int(parts))
    return [base + (i < extra) for i in range(parts)]


def shard_lengths(n: int, world: int, layout: str = "contiguous") -> list[int]:
    """Per-rank shard lengths of a sequence of ``n`` positions under ``layout``.

    ``"contiguous"``: :func:`chunk_lengths` ``(n, world)``. ``"zigzag"``: rank ``r`` gets
    chunks ``r`` and ``2 world - 1 - r`` of :func:`chunk_lengths` ``(n, 2 world)``.
    """
    _check_world(world)
    _check_layout(layout)
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    if layout == "contiguous":
        return chunk_lengths(n, world)
    c = chunk_lengths(n, 2 * world)
    return [c[r] + c[2 * world - 1 - r] for r in range(world)]


def _segments(layout: str, lengths: list[int]) -> list[list[tuple[int, int]]]:
    """Per rank: its segments ``[(global offset, length), ...]`` in local (= increasing
    global) order. Validates that ``lengths`` fit the layout."""
    world = len(lengths)
    if layout == "contiguous":
        offs = [sum(lengths[:r]) for r in range(world)]
        return [[(offs[r], lengths[r])] for r in range(world)]
    n = sum(lengths)
    expected = shard_lengths(n, world, "zigzag")
    if list(lengths) != expected:
        raise ValueError(
            f"shard lengths {list(lengths)} do not match the zigzag layout of {n} positions "
            f"over {world} ranks (expected {expected}); shard with "
            f"flashfold.distributed.shard(x, rank, world, layout='zigzag')")
    c = chunk_lengths(n, 2 * world)
    offs = [sum(c[:i]) for i in range(2 * world)]
    return [[(offs[r], c[r]), (offs[2 * world - 1 - r], c[2 * world - 1 - r])]
            for r in range(world)]


def _check_dim(x, dim, name="x"):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [{-x.dim()}, {x.dim()}) for {name} of shape "
                         f"{tuple(x.shape)}, got {dim!r}")
    return dim % x.dim()


def shard(x: torch.Tensor, rank: int, world: int, *, layout: str = "contiguous",
          dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s shard of the full tensor ``x`` along ``dim`` (the sequence axis;
    2 for ``(B, H, N, D)``), lengths as :func:`shard_lengths` (uneven when ``world`` or
    ``2 world`` does not divide ``N``).

    ``"contiguous"`` returns a view (``x.narrow``); ``"zigzag"`` returns a new tensor, the
    concatenation of chunks ``rank`` and ``2 world - 1 - rank`` (a copy).
    """
    _check_world(world, rank)
    _check_layout(layout)
    dim = _check_dim(x, dim)
    segs = _segments(layout, shard_lengths(x.shape[dim], world, layout))[rank]
    if layout == "contiguous":
        return x.narrow(dim, *segs[0])
    return torch.cat([x.narrow(dim, off, n) for off, n in segs], dim=dim)


def unshard(shards, *, layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
    """The full tensor from the ranks' shards (a list, rank order) along ``dim``: the
    inverse of :func:`shard` (a new tensor). ``"contiguous"`` accepts any shard lengths;
    ``"zigzag"`` needs the lengths :func:`shard_lengths` gives for their total."""
    _check_layout(layout)
    if not isinstance(shards, (list, tuple)) or not shards:
        raise TypeError(f"shards must be a non-empty list of tensors (one per rank), got "
                        f"{type(shards).__name__}")
    for i, s in enumerate(shards):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"shards[{i}] must be a torch.Tensor, got {type(s).__name__}")
    dim = _check_dim(shards[0], dim, "shards[0]")
    for i, s in enumerate(shards):
        if s.dim() != shards[0].dim():
            raise ValueError(f"shards[{i}] has {s.dim()} dims, shards[0] has {shards[0].dim()}")
    if layout == "contiguous":
        return torch.cat(list(shards), dim=dim)
    world = len(shards)
    lengths = [s.shape[dim] for s in shards]
    _segments(layout, lengths)                              # validates the lengths
    c = chunk_lengths(sum(lengths), 2 * world)
    chunks = [None] * (2 * world)                           # chunk index -> piece
    for r, s in enumerate(shards):
        chunks[r] = s.narrow(dim, 0, c[r])
        chunks[2 * world - 1 - r] = s.narrow(dim, c[r], c[2 * world - 1 - r])
    return torch.cat(chunks, dim=dim)


# --- the ring ---------------------------------------------------------------------------------

class _Ring:
    """Rank, world and neighbours in ``group``; posts the neighbour exchanges."""

    def __init__(self, group, device=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next = glob((self.rank + 1) % self.world)
        self.prev = glob((self.rank - 1) % self.world)
        self.backend = str(dist.get_backend(group)).lower()
        self.comm_device = torch.device("cpu")
        if "nccl" in self.backend:           # NCCL moves CUDA memory only
            self.comm_device = (device if device is not None and device.type == "cuda"
                                else torch.device("cuda", torch.cuda.current_device()))

    def gather_meta(self, values: list[int]) -> list[list[int]]:
        """All ranks' ``values`` (small ints), in rank order (one all_gather)."""
        t = torch.tensor(values, dtype=torch.int64, device=self.comm_device)
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t, group=self.group)
        return [o.tolist() for o in out]

    def shift(self, send, recv, tag):
        """Post ``send -> next`` and ``prev -> recv`` (either may be empty: skipped, both
        sides know the sizes); returns the pending works (``_wait`` them)."""
        ops = []
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send, self.next, self.group, tag))
        if recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, self.prev, self.group, tag))
        return dist.batch_isend_irecv(ops) if ops else []


def _wait(works):
    for w in works:
        w.wait()


@dataclass(frozen=True)
class _Task:
    """One kernel call: query rows ``q`` against key rows ``k`` of the held block."""
    q: slice
    k: slice
    causal: bool


@dataclass(frozen=True)
class _Plan:
    """One rank's schedule: every rank's shard length and, per source rank, the kernel
    calls on that rank's K/V block."""
    lengths: tuple
    tasks: tuple          # tasks[src] = tuple of _Task for the block of rank src


def _tasks(q_segs, k_segs, n_q, n_k, causal, diagonal):
    """The kernel calls of queries with segments ``q_segs`` on a K/V block with segments
    ``k_segs`` (``diagonal``: the same shard). Non-causal: one call. Causal: the diagonal
    block is one ``causal=True`` call; otherwise each (query segment, key segment) pair is
    fully visible or hidden (segments of different ranks are disjoint), fully visible key
    ranges adjacent in memory are coalesced, and so are adjacent query segments that see
    the same key ranges."""
    if n_q == 0 or n_k == 0:
        return ()
    if not causal:
        return (_Task(slice(0, n_q), slice(0, n_k), False),)
    if diagonal:
        # local order is monotone in global order and N_q = N_k: flashfold's causal is exact
        return (_Task(slice(0, n_q), slice(0, n_k), True),)
    rows = []                             # (q local range, tuple of visible k local ranges)
    qo = 0
    for qa, qn in q_segs:
        ranges, ko = [], 0
        for ka, kn in k_segs:
            if qn and kn:
                if ka + kn <= qa:                                  # every key before every query
                    if ranges and ranges[-1][1] == ko:
                        ranges[-1] = (ranges[-1][0], ko + kn)      # adjacent in memory: coalesce
                    else:
                        ranges.append((ko, ko + kn))
                elif ka < qa + qn:                                 # disjoint segments only
                    raise AssertionError(f"overlapping segments {(qa, qn)} and {(ka, kn)}")
            ko += kn
        if qn and ranges:
            if rows and rows[-1][0][1] == qo and rows[-1][1] == tuple(ranges):
                rows[-1] = ((rows[-1][0][0], qo + qn), rows[-1][1])
            else:
                rows.append(((qo, qo + qn), tuple(ranges)))
        qo += qn
    return tuple(_Task(slice(*qr), slice(*kr), False) for qr, krs in rows for kr in krs)


def _plan(layout, lengths, rank, causal):
    segs = _segments(layout, lengths)
    tasks = tuple(_tasks(segs[rank], segs[src], lengths[rank], lengths[src], causal,
                         src == rank) for src in range(len(lengths)))
    return _Plan(tuple(lengths), tasks)


# --- per-block compute --------------------------------------------------------------------------

def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _on_kernel(q) -> bool:
    from ..api import attention as api
    return api._use_kernel(q)


def _partial(q, k, v, causal, scale, softcap):
    """``(o_t, lse_t)`` of ``q`` over the keys ``k, v`` alone (differentiable).

    Kernel path: :func:`flashfold.attention` (LSE float32). Reference path: the blocked
    reference directly, so that float64 inputs keep a float64 LSE.
    """
    if _on_kernel(q):
        from ..api.attention import attention
        return attention(q, k, v, causal=causal, scale=scale, softcap=softcap, return_lse=True)
    from ..kernels.attention.reference import attention_reference
    return attention_reference(q, k, v, causal=causal, scale=scale, softcap=softcap)


def _merge(o_a, lse_a, o_b, lse_b):
    """The merge of two partial states (``o_a`` float32/64 running state, ``o_b`` any
    float dtype): the kernel behind :func:`flashfold.merge_states` on CUDA (mixed dtypes
    in one launch), the reference monoid fold on CPU (keeps float64)."""
    if _on_kernel(o_a):
        from ..kernels.attention.merge import merge_pair
        return merge_pair(o_a, lse_a, o_b, lse_b)
    from ..kernels.attention.reference import merge_states_reference
    return merge_states_reference(torch.stack([o_a, o_b.to(o_a.dtype)]),
                                  torch.stack([lse_a, lse_b.to(lse_a.dtype)]))


def _fold(o, lse, rows: slice, o_t, lse_t, q):
    """Running state ``(o, lse)`` (``None``: nothing folded yet) with rows ``rows`` merged
    with the part ``(o_t, lse_t)``; returns the new state: the merge's output itself when
    ``rows`` are all rows, the part itself (cast to the accumulation dtype) when it is the
    first and covers every row (merging with the identity would only cost a pass)."""
    whole = rows.stop - rows.start == q.shape[2]
    if o is None:
        if whole:
            acc = _acc_dtype(q.dtype)
            return o_t.to(acc), lse_t.to(acc)
        o, lse = _empty_state(q, o_t)
    mo, ml = _merge(o[:, :, rows], lse[:, :, rows], o_t, lse_t)
    if whole:
        return mo, ml
    o[:, :, rows] = mo
    lse[:, :, rows] = ml
    return o, lse


def _formula_block_backward(bwd, q, k, v, o, lse, do, dlse, causal, scale, softcap):
    """Contributions ``(dq, dk, dv)`` of one block from a FlashAttention backward ``bwd``
    (the Triton kernel, or the CPU reference with the same math) fed with the *global*
    ``o``, ``lse`` and ``dlse``: ``P = e^{s - lse}``, ``D = rowsum(dO O) - dlse``,
    ``dS = P (dO v^T - D)``."""
    return bwd(do, q, k, v, o, lse, scale=scale, dlse=dlse, softcap=softcap,
               right=0 if causal else None)


def _autograd_block_backward(q, k, v, o, lse, do, dlse, causal, scale, softcap):
    """Contributions ``(dq, dk, dv)`` of one block by recomputing its ``(o_t, lse_t)``
    under autograd, with upstream gradients ``d o_t = w_t dO`` and
    ``d lse_t = w_t (dO . (o_t - O) + dlse)``, ``w_t = e^{lse_t - lse}`` (0 where
    ``lse = -inf``)."""
    acc = lse.dtype
    with torch.enable_grad():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        o_t, l_t = _partial(qq, kk, vv, causal, scale, softcap)
        live = torch.isfinite(lse)
        w = torch.where(live, torch.exp(l_t.detach().to(acc) - torch.where(live, lse, 0.0)), 0.0)
        do_a = do.to(acc)
        g_l = (do_a * (o_t.detach().to(acc) - o.to(acc))).sum(-1)
        if dlse is not None:
            g_l = g_l + dlse.to(acc)
        g_o = (w.unsqueeze(-1) * do_a).to(o_t.dtype)
        g_l = (w * g_l).to(l_t.dtype)
        return torch.autograd.grad((o_t, l_t), (qq, kk, vv), (g_o, g_l), allow_unused=True)


def _block_backward_fn(q, deterministic=False):
    """The per-block backward for tensors like ``q`` (the dispatch heuristic): on CUDA the
    Triton backward kernel :func:`flashfold.kernels.attention.bwd.attention_backward`, on
    CPU the blocked reference backward
    :func:`flashfold.kernels.attention.reference.backward_reference`, both fed with the
    global statistics; where that module is missing, autograd through the recomputed block
    forward (:func:`_autograd_block_backward`). ``deterministic``: the kernel without
    atomics (the other paths always are)."""
    try:
        if _on_kernel(q):
            from ..kernels.attention.bwd import attention_backward
            bwd = functools.partial(attention_backward, deterministic=deterministic)
        else:
            from ..kernels.attention.reference import backward_reference as bwd
    except ImportError:
        return _autograd_block_backward
    return functools.partial(_formula_block_backward, bwd)


# --- K/V buffers --------------------------------------------------------------------------------

class _Blocks:
    """Two flat contiguous buffers for K/V blocks (``k`` then ``v``, shapes
    ``(B, Hk, n, D)``, ``(B, Hk, n, Dv)``), or for their gradient accumulators."""

    def __init__(self, k, v, n_max, dtype):
        self.B, self.H, _, self.D = k.shape
        self.Dv = v.shape[3]
        per = self.B * self.H * n_max * (self.D + self.Dv)
        self.bufs = [torch.empty(per, dtype=dtype, device=k.device) for _ in range(2)]

    def flat(self, i, n):
        return self.bufs[i % 2][: self.B * self.H * n * (self.D + self.Dv)]

    def views(self, i, n):
        f = self.flat(i, n)
        nk = self.B * self.H * n * self.D
        return (f[:nk].view(self.B, self.H, n, self.D),
                f[nk:].view(self.B, self.H, n, self.Dv))

    def pack(self, i, k, v):
        """Copy ``k``, ``v`` into buffer ``i`` (the documented send-buffer copy)."""
        kb, vb = self.views(i, k.shape[2])
        kb.copy_(k)
        vb.copy_(v)


# --- forward and backward rings -----------------------------------------------------------------

def _empty_state(q, v):
    """The merge's identity for every local query row: ``o = 0``, ``lse = -inf``
    (float32 / float64)."""
    B, Hq, n, _ = q.shape
    acc = _acc_dtype(q.dtype)
    o = torch.zeros((B, Hq, n, v.shape[3]), dtype=acc, device=q.device)
    lse = torch.full((B, Hq, n), -math.inf, dtype=acc, device=q.device)
    return o, lse


def _forward_block(q, kb, vb, tasks, o, lse, scale, softcap):
    """Fold the partial results of ``q`` over the held block ``(kb, vb)`` (its ``tasks``)
    into the running state (``None, None`` before the first); returns the new state."""
    for task in tasks:
        o_t, l_t = _partial(q[:, :, task.q], kb[:, :, task.k], vb[:, :, task.k],
                            task.causal, scale, softcap)
        o, lse = _fold(o, lse, task.q, o_t, l_t, q)
    return o, lse


def _backward_block(block_bwd, q, kb, vb, tasks, o, lse, do, dlse, dq, scale, softcap):
    """The held block's gradient contributions: adds to ``dq`` in place, returns
    ``[(key rows, dk_t, dv_t), ...]`` for the block's accumulator."""
    parts = []
    for task in tasks:
        rows = task.q
        dq_t, dk_t, dv_t = block_bwd(
            q[:, :, rows], kb[:, :, task.k], vb[:, :, task.k], o[:, :, rows],
            lse[:, :, rows], do[:, :, rows], None if dlse is None else dlse[:, :, rows],
            task.causal, scale, softcap)
        dq[:, :, rows] += dq_t
        parts.append((task.k, dk_t, dv_t))
    return parts


def _ring_forward(ring, plan, q, k, v, causal, scale, softcap):
    """Merged ``(o, lse)`` of the local queries over every rank's keys; ``o`` in the
    accumulation dtype (float32/float64), ``lse`` float32 (float64 for float64 inputs)."""
    o = lse = None
    r, W, lens = ring.rank, ring.world, plan.lengths
    blocks = None
    if W > 1:
        blocks = _Blocks(k, v, max(lens), k.dtype)
        blocks.pack(0, k, v)
    for t in range(W):
        src, nxt = (r - t) % W, (r - t - 1) % W
        pending = []
        if t < W - 1:
            pending = ring.shift(blocks.flat(t, lens[src]), blocks.flat(t + 1, lens[nxt]), _TAG_KV)
        kb, vb = (k, v) if t == 0 else blocks.views(t, lens[src])
        o, lse = _forward_block(q, kb, vb, plan.tasks[src], o, lse, scale, softcap)
        _wait(pending)
    return (o, lse) if o is not None else _empty_state(q, v)


def _ring_backward(ring, plan, q, k, v, o, lse, do, dlse, causal, scale, softcap,
                   deterministic):
    """``(dq, dk, dv)`` of the local shard (input dtype)."""
    acc = _acc_dtype(q.dtype)
    r, W, lens = ring.rank, ring.world, plan.lengths
    block_bwd = _block_backward_fn(q, deterministic)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    blocks = None
    grads = _Blocks(k, v, max(lens), acc)
    if W > 1:
        blocks = _Blocks(k, v, max(lens), k.dtype)
        blocks.pack(0, k, v)
    pending_g = []
    for t in range(W):
        src, nxt = (r - t) % W, (r - t - 1) % W
        pending = []
        if t < W - 1:
            pending = ring.shift(blocks.flat(t, lens[src]), blocks.flat(t + 1, lens[nxt]), _TAG_KV)
        kb, vb = (k, v) if t == 0 else blocks.views(t, lens[src])
        parts = _backward_block(block_bwd, q, kb, vb, plan.tasks[src], o, lse, do, dlse, dq,
                                scale, softcap)
        # the accumulator of block src: ours (zero) at t = 0, else just arrived from prev
        if t == 0:
            grads.flat(0, lens[src]).zero_()
        _wait(pending_g)
        dk_acc, dv_acc = grads.views(t, lens[src])
        for ks, dk_t, dv_t in parts:
            dk_acc[:, :, ks] += dk_t
            dv_acc[:, :, ks] += dv_t
        if W > 1:
            pending_g = ring.shift(grads.flat(t, lens[src]), grads.flat(t + 1, lens[nxt]),
                                   _TAG_DKV)
        _wait(pending)
    _wait(pending_g)
    dk, dv = grads.views(W if W > 1 else 0, lens[r])    # back home after W shifts
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """Ring attention forward and backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, ring, plan, causal, scale, softcap, deterministic):
        o, lse = _ring_forward(ring, plan, q, k, v, causal, scale, softcap)
        out = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (ring, plan, causal, scale, softcap, deterministic)
        ctx.set_materialize_grads(False)
        return out, lse.to(torch.float32)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        ring, plan, causal, scale, softcap, deterministic = ctx.args
        if do is None:
            do = torch.zeros_like(o)
        if dlse is not None:
            dlse = dlse.to(lse.dtype).contiguous()   # documented: kernels read it row-major
        dq, dk, dv = _ring_backward(ring, plan, q, k, v, o, lse, do, dlse, causal, scale,
                                    softcap, deterministic)
        return dq, dk, dv, None, None, None, None, None, None


# --- public function ------------------------------------------------------------------------------

_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


def _gather_lengths(ring, q, k, v, causal, layout, error=None):
    """Every rank's ``N_r`` (one all_gather), after checking that the rest agrees.

    ``error``: the exception this rank's own argument checks raised (None: they passed).
    It still takes part in the all_gather, with a flag in place of its metadata, so that
    every rank raises (the rank with the bad argument its own error, the others a
    ``ValueError`` naming that rank) instead of the others waiting in the collective."""
    names = ["N", "batch", "q heads", "k/v heads", "head_dim", "v head_dim", "dtype",
             "causal", "layout"]
    if error is None:
        B, Hq, n, D = q.shape
        mine = [0, n, B, Hq, k.shape[1], D, v.shape[3], _DTYPE_CODES[q.dtype], int(causal),
                LAYOUTS.index(layout)]
    else:
        mine = [1] + [0] * len(names)
    metas = ring.gather_meta(mine)
    if error is not None:
        raise error
    bad = [r for r, m in enumerate(metas) if m[0]]
    if bad:
        raise ValueError(f"q/k/v: rank(s) {bad} of the group rejected their arguments to "
                         f"ring_attention (see the error raised there); no rank ran")
    metas = [m[1:] for m in metas]
    for i, name in enumerate(names[1:], start=1):
        vals = [m[i] for m in metas]
        if len(set(vals)) > 1:
            if name == "dtype":
                inv = {c: str(d) for d, c in _DTYPE_CODES.items()}
                vals = [inv[x] for x in vals]
            elif name == "layout":
                vals = [LAYOUTS[x] for x in vals]
            arg = {"causal": "causal", "layout": "layout"}.get(name, "q/k/v")
            raise ValueError(f"{arg}: {name} differs across ranks (rank order): {vals}")
    return [m[0] for m in metas]


def _check_args(ring, q, k, v, causal, layout, scale, softcap, return_lse, deterministic,
                lengths):
    """This rank's own argument checks (no communication); returns ``scale`` (the default
    filled in), ``softcap`` and ``lengths`` (ints, or None). ``ring`` None (no process
    group yet): ``lengths`` is returned unchecked."""
    check_qkv(q, k, v)
    if _on_kernel(q):
        check_kernel_head_dims(q, v)
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k/v must hold the same positions of the sequence: q has "
                         f"{q.shape[2]} rows, k/v {k.shape[2]}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    _check_layout(layout)
    scale = check_positive("scale", scale)
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else scale
    softcap = check_positive("softcap", softcap)
    if lengths is not None and ring is not None:
        if (not isinstance(lengths, (list, tuple)) or len(lengths) != ring.world
                or any(isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 0
                       for x in lengths)):
            raise ValueError(f"lengths must be a list of {ring.world} ints >= 0 (one per "
                             f"rank), got {lengths!r}")
        if lengths[ring.rank] != q.shape[2]:
            raise ValueError(f"lengths[{ring.rank}] = {lengths[ring.rank]} but this rank's "
                             f"q/k/v hold {q.shape[2]} rows")
        lengths = [int(x) for x in lengths]
    return scale, softcap, lengths


def ring_attention(q, k, v, *, group=None, causal=False, layout="contiguous", scale=None,
                   softcap=None, return_lse=False, deterministic=False, lengths=None):
    r"""Exact attention over a sequence sharded across the ranks of a process group.

    Parameters
    ----------
    q: ``(B, Hq, N_r, D)``; k: ``(B, Hk, N_r, D)``; v: ``(B, Hk, N_r, Dv)``: this rank's
        shard of the sequence (same positions for q, k and v), any strides, ``Hq`` a
        multiple of ``Hk`` (GQA/MQA), dtypes and head dims as :func:`flashfold.attention`
        on the device. ``B``, heads, head dims and dtype must agree across ranks; ``N_r``
        may differ (even be 0).
    group: a ``torch.distributed`` process group (default: the default group); gloo with
        CPU tensors, NCCL with CUDA tensors.
    causal: causal over *global* positions (key ``j`` visible to query ``i`` iff
        ``pos(j) <= pos(i)``).
    layout: ``"contiguous"`` (rank ``r`` holds positions ``[sum(N_<r), sum(N_<=r))``) or
        ``"zigzag"`` (chunks ``r`` and ``2W-1-r`` of ``2W``: :func:`shard`).
    scale, softcap: as :func:`flashfold.attention` (the same on every rank).
    return_lse: also return ``lse (B, Hq, N_r)``, float32, natural log.
    deterministic: bitwise reproducible gradients (the CUDA backward kernel without
        atomics; the ring's own sums always have a fixed order).
    lengths: every rank's ``N_r`` (rank order), when the caller knows them (e.g. from
        :func:`shard_lengths`): skips the one ``all_gather`` per call that otherwise
        exchanges them (a host synchronization on NCCL) and, with it, the cross-rank
        checks of batch, heads, head dims, dtype, ``causal`` and ``layout``.

    A rank whose own arguments are bad raises its ``TypeError`` / ``ValueError``, and
    (without ``lengths``) the other ranks raise a ``ValueError`` naming it, from the same
    ``all_gather``: no rank is left waiting in a collective. With ``lengths`` there is no
    collective to report it through: every rank must then pass valid arguments.

    Returns ``o`` ``(B, Hq, N_r, Dv)`` in the input dtype (and ``lse``): the rows of
    ``attention(Q, K, V, causal=causal)`` over the full sequence that belong to this
    shard, assembled as :math:`o = \sum_t e^{\mathrm{lse}_t - \mathrm{lse}} o_t`,
    :math:`\mathrm{lse} = \log\sum_t e^{\mathrm{lse}_t}` over the ``W`` key blocks.
    Differentiable (``o`` and ``lse``); every rank must run the forward and the backward.
    """
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got "
                        f"{type(group).__name__}")
    ready = dist.is_available() and dist.is_initialized()
    ring = _Ring(group, q.device if isinstance(q, torch.Tensor) else None) if ready else None
    try:
        scale, softcap, lengths = _check_args(ring, q, k, v, causal, layout, scale, softcap,
                                              return_lse, deterministic, lengths)
    except (TypeError, ValueError) as e:
        if ring is None or lengths is not None:
            raise            # no collective to report it through (documented)
        _gather_lengths(ring, q, k, v, causal, layout, error=e)     # raises on every rank
        raise
    if ring is None:
        raise RuntimeError("ring_attention needs torch.distributed initialized "
                           "(torch.distributed.init_process_group)")
    if lengths is None:
        lengths = _gather_lengths(ring, q, k, v, causal, layout)
    plan = _plan(layout, lengths, ring.rank, causal)
    o, lse = _RingAttention.apply(q, k, v, ring, plan, causal, scale, softcap, deterministic)
    return (o, lse) if return_lse else o


__all__ = ["ring_attention", "shard", "unshard", "shard_lengths", "chunk_lengths", "LAYOUTS"]
