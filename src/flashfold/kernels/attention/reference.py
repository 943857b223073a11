r"""Pure-torch references for exact attention (no Triton import; any device; float64-capable).

Semantics (the order is part of the contract; the Triton kernel follows it exactly). For
query row ``i`` and key ``j`` of one (batch, head):

.. math::

    s_{ij} = \mathrm{scale}\; q_i \cdot k_j                      \qquad (\mathrm{scale} = 1/\sqrt{d} \text{ by default})

    s_{ij} \leftarrow c \tanh(s_{ij} / c)                         \qquad (\text{softcap } c, \text{ if given})

    s_{ij} \leftarrow \mathrm{score\_mod}(s_{ij}, b, h, i, j)      \qquad (\text{if given})

    \text{visible}(i, j) = [j < N_k] \wedge [j \le i + \delta + R] \wedge [j \ge i + \delta - L]
                           \wedge \mathrm{mask\_mod}(b, h, i, j), \qquad \delta = N_k - N_q

where causal is the window ``R = 0`` (bottom-right aligned, as FlashAttention 2), a window
``(L, R)`` bounds each side (``None``/``-1``: unbounded) and ``causal`` with a window uses
``min(R, 0)``. Then, over the visible keys only,

.. math::

    \mathrm{lse}_i = \log \sum_j e^{s_{ij}}, \qquad o_i = \sum_j e^{s_{ij} - \mathrm{lse}_i} v_j,

and a row with no visible key gives ``o_i = 0``, ``lse_i = -inf``.

Non-finite inputs (the rule of :mod:`flashfold.api.attention`): a hidden key contributes
nothing to the row, whatever its ``k`` and ``v`` hold, also inside a partially visible
tile (the tile's ``P V`` is strict: :func:`strict_matmul`); a NaN or ``+inf`` score of a
visible key makes ``o_i`` and ``lse_i`` NaN (a ``-inf`` score is weight 0); a non-finite
``v_{jc}`` of a visible key makes ``o_{ic}`` non-finite and nothing else.

:func:`attention_reference` computes this *blocked*: one ``(block_m x block_n)`` tile of
scores at a time (never more), folding tile states with the ATTENTION monoid's combine and
finalizing with its finalize, both lowered to torch from the same traced IR the kernels
use. :func:`naive_attention` materializes the whole score matrix (the test oracle; write
it differently on purpose). :func:`merge_states_reference` merges normalized partial
results with the same monoid.
"""

from __future__ import annotations

import math
import weakref
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from ...algebra.lower import compile_graph
from ...monoids import ATTENTION
from ..torch_lower import TORCH

if TYPE_CHECKING:  # annotations only
    from .mods import TracedMod


@lru_cache(maxsize=None)
def _monoid_fns():
    """ATTENTION's lift, combine and finalize, lowered to torch."""
    return (compile_graph(ATTENTION.lift_graph, TORCH),
            compile_graph(ATTENTION.combine_graph, TORCH),
            compile_graph(ATTENTION.finalize_graph, TORCH))


def _compute_dtype(dtype, compute_dtype):
    if compute_dtype is not None:
        return compute_dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def _bounds(window, causal):
    """(left, right) window bounds after folding ``causal`` in; ``None`` = unbounded."""
    left = right = None
    if window is not None:
        left, right = window
        left = None if left is None or left < 0 else int(left)
        right = None if right is None or right < 0 else int(right)
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def _window_keep(i, j, nq, nk, left, right):
    """``(nq, nk)`` bool: the pairs of rows ``i [nq, 1]`` and keys ``j [1, nk]`` inside the
    bottom-right aligned window (``None``: that side unbounded)."""
    keep = torch.ones((nq, nk), dtype=torch.bool, device=i.device)
    if right is not None:
        keep &= j - i <= (nk - nq) + right
    if left is not None:
        keep &= i - j <= left - (nk - nq)
    return keep


def _segments(q, k, cu_seqlens_q, cu_seqlens_k):
    """(batch index, q rows slice, k rows slice) per sequence; batch index None = all."""
    if cu_seqlens_q is None:
        return [(None, slice(0, q.shape[2]), slice(0, k.shape[2]))]
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    return [(i, slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])) for i in range(len(cq) - 1)]


def key_tiles(i0, i1, nk, block_n, delta, left, right):
    """The key tiles ``[j0, j1)`` of ``block_n`` keys (of ``nk``) that query rows
    ``i0 .. i1 - 1`` can see under a window ``[left, right]`` around the bottom-right
    diagonal (key ``c`` visible to row ``r`` iff ``r + delta - left <= c <= r + delta +
    right``, ``delta = Nk - Nq``; ``None`` = unbounded): tiles entirely outside the window
    hold no visible key and are skipped. Shared by the blocked forward reference and the
    blocked backward."""
    for j0 in range(0, nk, block_n):
        j1 = min(nk, j0 + block_n)
        if right is not None and j0 > (i1 - 1) + delta + right:
            continue
        if left is not None and j1 - 1 < i0 + delta - left:
            continue
        yield j0, j1


def tile_visible(shape, qi, kj, delta, left, right, mask_fn, bidx, hidx):
    """``visible(i, j)`` of one tile, bool of ``shape`` (``[B, H, bm, bn]``): the window
    ``[i + delta - left, i + delta + right]`` (``None``: unbounded) and ``mask_fn(b, h, i,
    j)`` (a torch callable, or None). ``qi [1, 1, bm, 1]``, ``kj [1, 1, 1, bn]``: positions
    in the sequence. Shared by the blocked forward and backward."""
    vis = torch.ones(shape, dtype=torch.bool, device=qi.device)
    if right is not None:
        vis = vis & (kj <= qi + delta + right)
    if left is not None:
        vis = vis & (kj >= qi + delta - left)
    if mask_fn is not None:
        mm = torch.as_tensor(mask_fn(bidx, hidx, qi, kj))
        vis = vis & (mm if mm.dtype == torch.bool else mm != 0)
    return vis


def mod_masked(s, raw):
    """Pairs a score_mod masks: its score ``s`` is ``-inf`` where the raw score ``raw =
    scale q . k`` is not (rule 2: weight 0, as a mask is; the pair's key contributes
    nothing, forward or backward). A ``-inf`` of ``q . k`` itself comes from an infinite
    input and stays visible (its non-finite products reach what depends on them)."""
    return (s == -math.inf) & (raw != -math.inf)


def strict_matmul(a, vis, x):
    r"""``a @ x`` in which the pairs hidden by ``vis`` add exactly 0, whatever ``x`` holds.

    ``a [..., M, K]`` is 0 where ``vis [..., M, K]`` (bool) is False; ``x [..., K, N]``
    (the forward's ``P V``; the backward's ``dS K``, ``dS^T Q``, ``P^T dO``). When ``x`` is
    finite, or every pair is visible, this is the plain product (IEEE: a visible non-finite
    ``x`` reaches what it multiplies). Otherwise the non-finite entries of ``x`` are
    replaced by 0 in the product, and ``(m, n)`` is NaN when a visible ``k`` has a
    non-finite ``x[k, n]`` (a 0/1 product: visibility times the indicator of non-finite
    entries; :math:`\sum_k a_{mk} x_{kn}` over visible ``k`` is then non-finite in IEEE
    arithmetic, ``0 \cdot \infty`` included). A hidden ``x`` never meets its ``0``.
    """
    fin = torch.isfinite(x)
    if bool(fin.all()) or bool(vis.all()):
        return torch.matmul(a, x)
    out = torch.matmul(a, torch.where(fin, x, 0.0))
    seen = torch.matmul(vis.to(a.dtype), (~fin).to(a.dtype))
    return torch.where(seen > 0, math.nan, out)


def attention_reference(q, k, v, *, causal=False, window=None, scale=None, softcap=None,
                        score_mod=None, mask_mod=None, cu_seqlens_q=None, cu_seqlens_k=None,
                        compute_dtype=None, block_m: int = 64, block_n: int = 64):
    """Blocked exact attention on any device; returns ``(o, lse)``.

    ``q``: ``(B, Hq, Nq, D)``, ``k``: ``(B, Hk, Nk, D)``, ``v``: ``(B, Hk, Nk, Dv)``,
    ``Hq % Hk == 0``; with ``cu_seqlens_*`` (int tensors ``(S + 1,)``) ``B == 1`` and
    sequence ``s`` is rows ``cu[s]:cu[s+1]``. ``score_mod(score, b, h, q_idx, kv_idx)``
    and ``mask_mod(b, h, q_idx, kv_idx)`` are *torch* callables on broadcastable tensors
    (``TracedMod.torch_fn``); indices are int64. Computes in ``compute_dtype`` (default:
    float64 for float64 inputs, else float32). Returns ``o`` in ``q.dtype`` (``(B, Hq,
    Nq, Dv)``) and ``lse`` ``(B, Hq, Nq)`` in float32 (float64 when computing in float64).
    """
    B, Hq, Nq, D = q.shape
    Hk, Dv = k.shape[1], v.shape[-1]
    group = Hq // Hk
    cd = _compute_dtype(q.dtype, compute_dtype)
    dev = q.device
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    left, right = _bounds(window, causal)
    _, combine, finalize = _monoid_fns()
    heads = torch.arange(Hq, device=dev)
    kv_head = heads // group
    o = torch.zeros((B, Hq, Nq, Dv), dtype=cd, device=dev)
    lse = torch.full((B, Hq, Nq), -math.inf, dtype=cd, device=dev)
    for seq, qs, ks in _segments(q, k, cu_seqlens_q, cu_seqlens_k):
        nq, nk = qs.stop - qs.start, ks.stop - ks.start
        delta = nk - nq
        bidx = (torch.arange(B, device=dev) if seq is None
                else torch.tensor([seq], device=dev)).view(-1, 1, 1, 1)
        hidx = heads.view(1, Hq, 1, 1)
        for i0 in range(0, nq, block_m):
            i1 = min(nq, i0 + block_m)
            qb = q[:, :, qs.start + i0: qs.start + i1].to(cd)                 # [B, Hq, bm, D]
            shape = (B, Hq, i1 - i0)
            m = torch.full(shape + (1,), -math.inf, dtype=cd, device=dev)
            d = torch.zeros(shape + (1,), dtype=cd, device=dev)
            acc = torch.zeros(shape + (Dv,), dtype=cd, device=dev)
            qi = torch.arange(i0, i1, device=dev).view(1, 1, -1, 1)
            for j0, j1 in key_tiles(i0, i1, nk, block_n, delta, left, right):
                kb = k[:, kv_head, ks.start + j0: ks.start + j1].to(cd)       # [B, Hq, bn, D]
                vb = v[:, kv_head, ks.start + j0: ks.start + j1].to(cd)       # [B, Hq, bn, Dv]
                kj = torch.arange(j0, j1, device=dev).view(1, 1, 1, -1)
                s = torch.matmul(qb, kb.transpose(-1, -2)) * scale             # [B, Hq, bm, bn]
                raw = s
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                if score_mod is not None:
                    s = torch.as_tensor(score_mod(s, bidx, hidx, qi, kj)).to(cd).expand_as(s)
                vis = tile_visible(s.shape, qi, kj, delta, left, right, mask_mod, bidx, hidx)
                s = torch.where(vis, s, -math.inf)
                # the tile's state (m, d, o): its max, sum e^(s - m), sum e^(s - m) v; the
                # pivot stays +inf for a +inf max (exp(inf - inf) = NaN: rule 2)
                mb = s.amax(-1, keepdim=True)
                p = torch.exp(s - torch.where(mb == -math.inf, 0.0, mb))
                # a score_mod's -inf is weight 0, as a mask is: its key's value is left
                # out too (a -inf of q . k itself is an infinite input's: it stays visible)
                pv = strict_matmul(p, vis & ~mod_masked(s, raw), vb)
                state = (mb, p.sum(-1, keepdim=True), pv)
                m, d, acc = combine(m, d, acc, *state)
            ob, lb = finalize(m, d, acc)
            o[:, :, qs.start + i0: qs.start + i1] = ob
            lse[:, :, qs.start + i0: qs.start + i1] = lb.squeeze(-1)
    lse_dtype = torch.float64 if cd == torch.float64 else torch.float32
    return o.to(q.dtype), lse.to(lse_dtype)


def _masked_sum(p, v, keep, chunk=1 << 24):
    """``o[.., i, c] = sum_{j: keep[.., i, j]} p[.., i, j] v[.., j, c]``, elementwise: a
    key that is not kept never enters the sum, whatever ``v`` holds (the oracle's own
    way, unlike :func:`strict_matmul`). One matmul when ``v`` is finite (then the hidden
    terms are exact zeros); else products formed per block of rows (at most ``chunk``
    elements at a time)."""
    if torch.isfinite(v).all():
        return torch.where(keep, p, 0.0) @ v
    nq = p.shape[-2]
    step = max(1, chunk // max(1, p.shape[0] * p.shape[1] * p.shape[-1] * v.shape[-1]))
    out = []
    for i0 in range(0, nq, step):
        pp, kk = p[..., i0:i0 + step, :], keep[..., i0:i0 + step, :]
        terms = pp[..., :, :, None] * v[..., None, :, :]                     # [.., i, j, c]
        out.append(torch.where(kk[..., None], terms, 0.0).sum(-2))
    return torch.cat(out, dim=-2)


def naive_attention(q, k, v, *, causal=False, window=None, scale=None, softcap=None,
                    score_mod=None, mask_mod=None, cu_seqlens_q=None, cu_seqlens_k=None,
                    dtype=torch.float64):
    """The whole score matrix at once, in ``dtype`` (the test oracle): ``(o, lse)``.

    Same arguments and semantics as :func:`attention_reference` (the non-finite rule
    too); ``o`` and ``lse`` are returned in ``dtype``. Written without the monoid on
    purpose (an independent check): rows with a NaN or ``+inf`` visible score are NaN, and
    ``o`` sums ``p_ij v_j`` over the visible keys only (:func:`_masked_sum`).
    """
    B, Hq, Nq, D = q.shape
    Hk = k.shape[1]
    g = Hq // Hk
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    left, right = _bounds(window, causal)
    dev = q.device
    o = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=dtype, device=dev)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=dtype, device=dev)
    for seq, qs, ks in _segments(q, k, cu_seqlens_q, cu_seqlens_k):
        qq = q[:, :, qs].to(dtype)
        kk = k[:, :, ks].to(dtype).repeat_interleave(g, dim=1)
        vv = v[:, :, ks].to(dtype).repeat_interleave(g, dim=1)
        nq, nk = qq.shape[2], kk.shape[2]
        s = torch.einsum("bhid,bhjd->bhij", qq, kk) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(nq, device=dev)[:, None]
        j = torch.arange(nk, device=dev)[None, :]
        bb = (torch.arange(B, device=dev) if seq is None else torch.tensor([seq], device=dev))
        bb = bb[:, None, None, None]
        hh = torch.arange(Hq, device=dev)[None, :, None, None]
        raw = s
        if score_mod is not None:
            s = torch.as_tensor(score_mod(s, bb, hh, i, j)).to(dtype).expand_as(s)
        keep = _window_keep(i, j, nq, nk, left, right)
        keep = keep.expand_as(s)
        if mask_mod is not None:
            mm = torch.as_tensor(mask_mod(bb, hh, i, j))
            keep = keep & (mm.bool() if mm.dtype != torch.bool else mm)
        # rule 2: a NaN or +inf score of a visible key makes the row NaN
        poisoned = ((torch.isnan(s) | (s == math.inf)) & keep).any(-1)
        s = s.masked_fill(~keep, -math.inf)
        row_lse = torch.logsumexp(s, dim=-1)                                   # -inf if empty
        row_lse = torch.where(poisoned, math.nan, row_lse)
        empty = row_lse == -math.inf
        p = torch.exp(s - torch.where(empty, 0.0, row_lse)[..., None])
        o[:, :, qs] = _masked_sum(p, vv, keep & ~mod_masked(s, raw))
        lse[:, :, qs] = row_lse
    return o, lse


#: the FP8 format of q, k, v and of P, and its largest finite value (E4M3: 448)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def dequantize_fp8(x8, descale, heads_k, cu_seqlens=None, dtype=torch.float32):
    """``x8 (B, H, N, D)`` in FP8 times its descale factors, in ``dtype``.

    ``descale (B, Hk)`` float32 (with ``cu_seqlens``: ``(S, Hk)``, one row per packed
    sequence): head ``h`` of ``x8`` takes column ``h // (H / Hk)`` (a query head its KV
    head's factor, FlashAttention-3's convention)."""
    x = x8.to(dtype)
    g = x8.shape[1] // heads_k
    f = descale.to(dtype).repeat_interleave(g, dim=1)                 # (B or S, H)
    if cu_seqlens is None:
        return x * f[:, :, None, None]
    out = torch.empty_like(x)
    cu = [int(c) for c in cu_seqlens.tolist()]
    for i in range(len(cu) - 1):
        out[:, :, cu[i]:cu[i + 1]] = x[:, :, cu[i]:cu[i + 1]] * f[i][None, :, None, None]
    return out


def fp8_attention_reference(q8, k8, v8, q_descale, k_descale, v_descale, *, causal=False,
                            window=None, scale=None, softcap=None, cu_seqlens_q=None,
                            cu_seqlens_k=None, out_dtype=torch.bfloat16):
    r"""FP8 attention as the E4M3 kernels compute it: ``(o, lse)``.

    ``q8, k8, v8``: :data:`FP8` tensors (``(B, Hq, Nq, D)``, ``(B, Hk, Nk, D)``, ``(B, Hk,
    Nk, Dv)``) standing for ``x8 * descale`` (:func:`dequantize_fp8`). In float32: scores
    ``s = scale (q k^T)`` of the dequantized inputs (softcap, causal / window masks as
    :func:`naive_attention`), the row statistics ``m = max_j s_ij``, ``l = sum_j
    e^{s_ij - m}`` (fp32: the sum loses low bits fast in a narrow format), then

    .. math::

        P^{(8)}_{ij} = \mathrm{fp8}(e^{s_{ij} - m_i} \cdot 448), \qquad
        o_i = \frac{\mathrm{v\_descale}}{448\, l_i} \sum_j P^{(8)}_{ij} v^{(8)}_j

    (P quantized with its own scale, 448 = E4M3's largest value, so ``P <= 1`` uses the
    format's whole range; the product of two FP8 operands accumulated in fp32, as the
    tensor cores do), ``lse = m + log l``. ``o`` in ``out_dtype``, ``lse`` float32. A row
    without a visible key gives ``o = 0``, ``lse = -inf``; a NaN reaches the rows that see
    it. (The kernels quantize ``P`` against the running row max of each key tile, which
    equals this one's on the tile holding the max and lies below it elsewhere: the same
    error bound, not the same bits.)"""
    Hk = k8.shape[1]
    g = q8.shape[1] // Hk
    q = dequantize_fp8(q8, q_descale, Hk, cu_seqlens_q)
    k = dequantize_fp8(k8, k_descale, Hk, cu_seqlens_k)
    scale = 1.0 / math.sqrt(q8.shape[-1]) if scale is None else float(scale)
    left, right = _bounds(window, causal)
    B, Hq, Nq, _ = q8.shape
    Dv = v8.shape[-1]
    o = torch.zeros((B, Hq, Nq, Dv), dtype=torch.float32, device=q8.device)
    lse = torch.full((B, Hq, Nq), -math.inf, dtype=torch.float32, device=q8.device)
    vd = v_descale.to(torch.float32).repeat_interleave(g, dim=1)       # (B or S, Hq)
    for seq, qs, ks in _segments(q8, k8, cu_seqlens_q, cu_seqlens_k):
        qq = q[:, :, qs]
        kk = k[:, :, ks].repeat_interleave(g, dim=1)
        vv = v8[:, :, ks].to(torch.float32).repeat_interleave(g, dim=1)
        nq, nk = qq.shape[2], kk.shape[2]
        if nq == 0 or nk == 0:                  # no rows, or rows without keys: 0 / -inf
            continue
        s = torch.einsum("bhid,bhjd->bhij", qq, kk) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(nq, device=q8.device)[:, None]
        j = torch.arange(nk, device=q8.device)[None, :]
        keep = _window_keep(i, j, nq, nk, left, right)
        keep = keep.expand_as(s)
        poisoned = ((torch.isnan(s) | (s == math.inf)) & keep).any(-1)
        s = s.masked_fill(~keep, -math.inf)
        m = s.amax(-1)
        empty = m == -math.inf
        p = torch.exp(s - torch.where(empty, 0.0, m)[..., None])
        l = p.sum(-1)
        p8 = (p * FP8_MAX).to(FP8).to(torch.float32)
        f = vd[:, :, None] if seq is None else vd[seq][None, :, None]
        acc = _masked_sum(p8, vv, keep)                 # (a hidden key's NaN v adds 0)
        oo = acc * (f / (FP8_MAX * torch.where(empty, 1.0, l)))[..., None]
        oo = torch.where(empty[..., None], 0.0, oo)
        row_lse = torch.where(empty, -math.inf, m + torch.log(torch.where(empty, 1.0, l)))
        o[:, :, qs] = torch.where(poisoned[..., None], math.nan, oo)
        lse[:, :, qs] = torch.where(poisoned, math.nan, row_lse)
    return o.to(out_dtype), lse


def merge_states_reference(outs, lses, compute_dtype=None):
    """Merge normalized partial results over disjoint key sets: ``(o, lse)``.

    ``outs``: ``(S, ..., D)``, ``lses``: ``(S, ...)``. Each part ``(o_s, lse_s)`` is the
    state ``lift(score=lse_s, value=o_s) = (lse_s, 1, o_s)`` of the ATTENTION monoid (an
    empty part, ``lse = -inf``, lifts to the identity whatever its ``o``, NaN too); the
    parts are folded with its combine and finalized: ``lse = log sum_s e^{lse_s}``, ``o =
    sum_s e^{lse_s - lse} o_s``. A NaN ``lse_s`` makes ``o`` and ``lse`` NaN; a non-finite
    ``o_s[c]`` of a part with a finite ``lse_s`` makes ``o[c]`` non-finite.
    """
    lift, combine, finalize = _monoid_fns()
    cd = _compute_dtype(outs.dtype, compute_dtype)
    state = None
    for s in range(outs.shape[0]):
        part = lift(lses[s].to(cd).unsqueeze(-1), outs[s].to(cd))
        state = part if state is None else combine(*state, *part)
    if state is None:
        raise ValueError("merge_states: need at least one part")
    o, lse = finalize(*state)
    lse_dtype = torch.float64 if cd == torch.float64 else torch.float32
    return o.to(outs.dtype), lse.squeeze(-1).to(lse_dtype)


# --- the backward: blocked, any device ---------------------------------------------------

_TORCH_GRADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def torch_score_grad(mod: TracedMod, device):
    """``fn(score, b, h, q_idx, kv_idx) -> (value, d value / d score)``: the derivative
    graph of a traced score_mod lowered to torch (captured tables on ``device``)."""
    from ...algebra.autodiff import derivative
    from ...algebra.lower import function_source

    per_mod = _TORCH_GRADS.setdefault(mod, {})
    key = (str(torch.device(device)), mod.buffer_versions())
    fn = per_mod.get(key)
    if fn is not None:
        return fn
    graph = derivative(mod.graph, "score", name=f"{mod.graph.name}.grad")
    src = function_source(graph, TORCH, "_grad")
    ns = dict(TORCH.namespace)
    exec(compile(src, f"<flashfold:torch:{graph.name}>", "exec"), ns)
    inner = ns["_grad"]
    bufs = []
    for b in graph.buffers:
        t = b.data if isinstance(b.data, torch.Tensor) else torch.as_tensor(b.data)
        bufs.append(t.to(device).reshape(-1))

    def fn(*args):
        val, d = inner(*args, *bufs)
        return torch.as_tensor(val), torch.as_tensor(d)
    per_mod.clear()
    per_mod[key] = fn
    return fn


def _segment_bounds(B, NQ, NK, cu_q, cu_k):
    if cu_q is None:
        return [(None, 0, NQ, 0, NK)]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return [(i, cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)]


def backward_reference(do, q, k, v, o, lse, dlse=None, *, scale, softcap=None, left=None,
                       right=None, score_mod: TracedMod | None = None,
                       mask_mod: TracedMod | None = None, cu_seqlens_q=None, cu_seqlens_k=None,
                       block_m: int = 64, block_n: int = 64):
    """Blocked backward on any device: ``(dq, dk, dv)`` in the input dtype.

    The kernels' math (module docstring of :mod:`.bwd`) in torch, one ``(block_m x
    block_n)`` tile at a time, in float64 for float64 inputs else float32:
    ``P = exp(s - lse)`` (0 for hidden pairs and rows with ``lse = -inf``),
    ``D = rowsum(dO O) - dlse``, ``dS = P (dP - D)``, chained through softcap and the
    score_mod's derivative graph (:func:`torch_score_grad`), ``dQ = scale dS~ K``,
    ``dK = scale dS~^T Q``, ``dV = P^T dO``, summed over the query heads of a GQA group.
    Mods are *traced* mods here (``TracedMod``), windows already folded (``right = 0`` for
    causal).

    Non-finite inputs (rule 4 of the attention API's docstring): hidden pairs add exactly
    0 whatever their values. ``P`` and ``dS`` are *selected* to 0 there (not multiplied),
    and on a tile with hidden pairs whose operand tile (``K`` of ``dS K``, ``Q`` of
    ``dS^T Q``, ``dO`` of ``P^T dO``) holds a non-finite entry the product is strict
    (:func:`strict_matmul`). A row is empty (no gradient) only when ``lse = -inf``; a NaN
    ``lse`` (a visible NaN score) makes NaN what depends on the row.
    """
    B, HQ, NQ, D = q.shape
    HK, NK = k.shape[1], k.shape[2]
    g = HQ // HK
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    sfn = torch_score_grad(score_mod, dev) if score_mod is not None else None
    mfn = mask_mod.torch_fn(dev) if mask_mod is not None else None
    kv_head = torch.arange(HQ, device=dev) // g
    dq = torch.zeros((B, HQ, NQ, D), dtype=cd, device=dev)
    dk = torch.zeros((B, HQ, NK, D), dtype=cd, device=dev)           # per query head
    dv = torch.zeros((B, HQ, NK, v.shape[3]), dtype=cd, device=dev)
    dd = (do.to(cd) * o.to(cd)).sum(-1)                              # [B, HQ, NQ]
    if dlse is not None:
        dd = dd - dlse.to(cd)
    lse = lse.to(cd)
    hidx = torch.arange(HQ, device=dev).view(1, HQ, 1, 1)
    for seq, q0, q1, k0, k1 in _segment_bounds(B, NQ, NK, cu_seqlens_q, cu_seqlens_k):
        nq, nk = q1 - q0, k1 - k0
        delta = nk - nq
        bidx = (torch.arange(B, device=dev) if seq is None
                else torch.tensor([seq], device=dev)).view(-1, 1, 1, 1)
        for i0 in range(0, nq, block_m):
            i1 = min(nq, i0 + block_m)
            rows = slice(q0 + i0, q0 + i1)
            qb, dob = q[:, :, rows].to(cd), do[:, :, rows].to(cd)
            lb = lse[:, :, rows, None]
            live = lb != -math.inf                  # (NaN is not empty: rule 2)
            db = dd[:, :, rows, None]
            qi = torch.arange(i0, i1, device=dev).view(1, 1, -1, 1)
            for j0, j1 in key_tiles(i0, i1, nk, block_n, delta, left, right):
                cols = slice(k0 + j0, k0 + j1)
                kb = k[:, kv_head, cols].to(cd)
                vb = v[:, kv_head, cols].to(cd)
                kj = torch.arange(j0, j1, device=dev).view(1, 1, 1, -1)
                x = torch.matmul(qb, kb.transpose(-1, -2)) * scale        # [B, HQ, bm, bn]
                dfac = None
                if softcap is not None:
                    t = torch.tanh(x / softcap)
                    s = softcap * t
                    dfac = 1.0 - t * t
                else:
                    s = x
                if sfn is not None:
                    s, dmod = sfn(s, bidx, hidx, qi, kj)
                    s = s.to(cd).expand(x.shape)
                    dmod = dmod.to(cd).expand(x.shape)
                    dfac = dmod if dfac is None else dfac * dmod
                vis = tile_visible(x.shape, qi, kj, delta, left, right, mfn, bidx, hidx)
                vis = vis & live & ~mod_masked(s, x)     # a score_mod's -inf: a mask
                p = torch.where(vis, torch.exp(torch.where(vis, s - lb, 0.0)), 0.0)
                dp = torch.matmul(dob, vb.transpose(-1, -2))
                ds = p * (dp - db)
                ds = torch.where(vis, ds if dfac is None else ds * dfac, 0.0)
                vis = vis.expand(x.shape)
                visT = vis.transpose(-1, -2)
                dq[:, :, rows] += strict_matmul(ds, vis, kb) * scale
                dk[:, :, cols] += strict_matmul(ds.transpose(-1, -2), visT, qb) * scale
                dv[:, :, cols] += strict_matmul(p.transpose(-1, -2), visT, dob)
    dk = dk.view(B, HK, g, NK, D).sum(2)
    dv = dv.view(B, HK, g, NK, v.shape[3]).sum(2)
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


__all__ = ["attention_reference", "naive_attention", "merge_states_reference",
           "fp8_attention_reference", "dequantize_fp8", "FP8", "FP8_MAX", "mod_masked",
           "backward_reference", "torch_score_grad"]
