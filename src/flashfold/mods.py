"""Ready-made ``score_mod`` / ``mask_mod`` functions for :func:`flashfold.attention`.

Each is user code written over :mod:`flashfold.ops`, like any mod (traced and compiled
into the kernel: see :mod:`flashfold.kernels.attention.mods` for the conventions: the
arguments ``(score, b, h, q_idx, kv_idx)``, captured tables, the block masks); factories
return closures with a stable ``__name__`` (the name error messages give). Compose masks
with :func:`and_masks` / :func:`or_masks`.

mask_mods (``(b, h, q_idx, kv_idx) -> visible``): :func:`causal_mask`,
:func:`sliding_window_mask`, :func:`document_mask`, :func:`prefix_lm_mask`,
:func:`key_padding_mask`, :func:`and_masks`, :func:`or_masks`; score_mods (``(score, b, h,
q_idx, kv_idx) -> score``): :func:`alibi` (slopes: :func:`alibi_slopes`),
:func:`relative_bias`, :func:`softcap_mod`. A table a factory captures (``doc_ids``,
``lengths``, ``slopes``, ...) must cover every index the mod forms: ``attention`` raises
``ValueError`` naming the mod, the table and the sizes otherwise.
"""

from __future__ import annotations

import math
import numbers

import torch

from . import ops
from .api.validate import check_int, check_positive, check_window
from .ops import Buffer


def _named(fn, name):
    fn.__name__ = fn.__qualname__ = name
    return fn


def causal_mask(b, h, q_idx, kv_idx):
    """Top-left aligned causal mask: ``kv_idx <= q_idx`` (``causal=True`` of
    ``attention`` is bottom-right aligned instead; both agree when seq_q == seq_k)."""
    return q_idx >= kv_idx


def sliding_window_mask(left, right=0):
    """``q_idx - left <= kv_idx <= q_idx + right`` (top-left aligned). Each side an int
    ``>= 0``, or ``None`` / ``-1`` for unbounded, as ``attention``'s ``window``."""
    left, right = check_window((left, right))

    def sliding_window(b, h, q_idx, kv_idx):
        ok = None
        if left is not None:
            ok = kv_idx >= q_idx - left
        if right is not None:
            r = kv_idx <= q_idx + right
            ok = r if ok is None else ok & r
        return True if ok is None else ok
    return _named(sliding_window, "sliding_window_mask")


def _table(x, what, dims=(1, 2)):
    """``x`` as a tensor of ``dims`` dims (a table a mod captures), else ``ValueError``
    naming it. A torch tensor is captured by reference; anything else (a NumPy array, a
    sequence) is copied: a NumPy write would not move the tensor's version counter, by
    which the device copies of tables are kept."""
    t = x if isinstance(x, torch.Tensor) else torch.tensor(x)
    if t.dim() not in dims:
        want = " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{what}: expected a {want} tensor, got shape {tuple(t.shape)}")
    return t


def document_mask(doc_ids, kv_doc_ids=None):
    """Attend only within a document: ``doc[q_idx] == kv_doc[kv_idx]``.

    ``doc_ids``: int tensor ``(seq,)`` shared by the batch, or ``(batch, seq)``;
    ``kv_doc_ids`` defaults to ``doc_ids`` (self-attention over packed documents).
    Combine with ``causal=True`` for causal document masking. Where each document is one
    run of positions (packed documents), the kernels compare each key against its row's
    document bounds (:func:`~flashfold.kernels.attention.mods.as_intervals`); where an
    id recurs, they load an id per key column, and int32 ids are the fast form on Hopper
    (int64 ones take twice the registers; with Triton 3.9 they spill inside the key loop).
    """
    dq = Buffer(_table(doc_ids, "doc_ids"))
    dk = dq if kv_doc_ids is None else Buffer(_table(kv_doc_ids, "kv_doc_ids"))

    def at(buf, b, i):
        return buf[b, i] if len(buf.shape) == 2 else buf[i]

    def document(b, h, q_idx, kv_idx):
        return at(dq, b, q_idx) == at(dk, b, kv_idx)
    return _named(document, "document_mask")


def prefix_lm_mask(prefix_len):
    """Prefix-LM: the first ``prefix_len`` keys are visible to every query, the rest
    causally: ``kv_idx < prefix_len or kv_idx <= q_idx``. ``prefix_len`` is an int >= 0
    (a NumPy one too; not a bool or a float), a 0-d int tensor (one length for the batch)
    or an int tensor ``(batch,)``.

    A tensor is captured as a table, like any table a mod reads: the mod reads its value
    when it runs (a write to it in place is seen by the next call; no host read, so a
    CUDA or meta tensor works as is), where an int is a constant of the traced mask.
    """
    if prefix_len is None or isinstance(prefix_len, numbers.Number):
        n = check_int("prefix_len", prefix_len, minimum=0)

        def prefix_lm(b, h, q_idx, kv_idx):
            return (kv_idx < n) | (kv_idx <= q_idx)
        return _named(prefix_lm, "prefix_lm_mask")
    t = prefix_len if isinstance(prefix_len, torch.Tensor) else torch.as_tensor(prefix_len)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(f"prefix_len: expected an integer tensor (a 0-d one, or one length "
                        f"per batch row), or an int, got a tensor of {t.dtype}")
    if t.dim() == 0:
        one = Buffer(t.reshape(1))                 # a view: shares the tensor's version

        def prefix_lm(b, h, q_idx, kv_idx):
            return (kv_idx < one[0]) | (kv_idx <= q_idx)
    else:
        lens = Buffer(_table(t, "prefix_len", dims=(1,)))

        def prefix_lm(b, h, q_idx, kv_idx):
            return (kv_idx < lens[b]) | (kv_idx <= q_idx)
    return _named(prefix_lm, "prefix_lm_mask")


def key_padding_mask(lengths):
    """Key padding: sequence ``b`` has ``lengths[b]`` real keys (``kv_idx < lengths[b]``).
    ``lengths``: int tensor ``(batch,)``."""
    lens = Buffer(_table(lengths, "lengths", dims=(1,)))

    def key_padding(b, h, q_idx, kv_idx):
        return kv_idx < lens[b]
    return _named(key_padding, "key_padding_mask")


def and_masks(*mask_mods):
    """Visible where every mask is."""
    def both(b, h, q_idx, kv_idx):
        out = True
        for m in mask_mods:
            out = m(b, h, q_idx, kv_idx) if out is True else out & m(b, h, q_idx, kv_idx)
        return out
    return _named(both, "and_masks")


def or_masks(*mask_mods):
    """Visible where any mask is."""
    def either(b, h, q_idx, kv_idx):
        out = False
        for m in mask_mods:
            out = m(b, h, q_idx, kv_idx) if out is False else out | m(b, h, q_idx, kv_idx)
        return out
    return _named(either, "or_masks")


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi head slopes (Press et al. 2022): ``2^(-8 i / n)``, i = 1..n, for n a power of
    two; otherwise those of the next lower power of two, then every other slope of the
    next higher one."""
    def pow2(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]
    num_heads = check_int("num_heads", num_heads, minimum=1)
    p = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = pow2(p)
    if p < num_heads:
        slopes += pow2(2 * p)[0::2][: num_heads - p]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi(num_heads: int, slopes=None):
    """ALiBi score_mod: ``score + slope[h] * (kv_idx - q_idx)`` (a linear distance penalty
    for keys behind the query). ``num_heads``: an int >= 1; ``slopes``: float
    ``(num_heads,)`` (a tensor or a sequence), default :func:`alibi_slopes` of
    ``num_heads``.

    ``slopes`` must hold exactly ``num_heads`` entries (``ValueError`` naming both): ALiBi's
    slopes depend on the head count, so a table made for another count is a mistake, not a
    prefix to read. A call with more query heads than slopes is refused by ``attention``
    (the mod's table check names the mod and ``H``); fewer heads read the first ones.
    """
    num_heads = check_int("num_heads", num_heads, minimum=1)
    if slopes is None:
        tab = Buffer(alibi_slopes(num_heads))
    else:
        t = _table(slopes, "slopes", dims=(1,))
        if t.shape[0] != num_heads:
            raise ValueError(f"slopes: alibi(num_heads={num_heads}) needs one slope per "
                             f"head, got {t.shape[0]}")
        tab = Buffer(t)

    def alibi_bias(score, b, h, q_idx, kv_idx):
        return score + tab[h] * ops.to_float(kv_idx - q_idx)
    return _named(alibi_bias, "alibi")


def relative_bias(table, max_distance: int | None = None):
    """Learned relative-position bias: ``score + table[h, clamp(kv_idx - q_idx) + D]``.

    ``table``: float ``(heads, 2 D + 1)`` (or ``(2 D + 1,)`` shared by heads), indexed by
    the clamped relative position ``kv_idx - q_idx`` in ``[-D, D]``. ``max_distance``:
    ``D``, an int >= 0 (default: read from the table's last dim, which must match it).
    """
    t = _table(table, "table")
    width = t.shape[-1]
    if width % 2 != 1:
        raise ValueError(f"relative_bias: table's last dim must be 2 D + 1, got {width}")
    d = (width - 1) // 2 if max_distance is None else check_int("max_distance", max_distance,
                                                                 minimum=0)
    if 2 * d + 1 != width:
        raise ValueError(f"relative_bias: max_distance {d} needs a last dim of {2 * d + 1}, got {width}")
    tab = Buffer(t)

    def rel_bias(score, b, h, q_idx, kv_idx):
        r = ops.clamp(kv_idx - q_idx, -d, d) + d
        return score + (tab[h, r] if t.dim() == 2 else tab[r])
    return _named(rel_bias, "relative_bias")


def softcap_mod(cap: float):
    """``cap * tanh(score / cap)`` as a score_mod (``attention(softcap=...)`` is built in);
    ``cap`` a real in ``(0, FLOAT32_MAX]``, as ``attention``'s ``softcap``."""
    c = check_positive("cap", cap)
    if c is None:
        raise TypeError("cap must be a real number, got NoneType")

    def softcap(score, b, h, q_idx, kv_idx):
        return c * ops.tanh(score / c)
    return _named(softcap, "softcap")


__all__ = ["alibi", "alibi_slopes", "and_masks", "causal_mask", "document_mask",
           "key_padding_mask", "or_masks", "prefix_lm_mask", "relative_bias",
           "sliding_window_mask", "softcap_mod"]
