r"""flashfold as an attention implementation of Hugging Face ``transformers``.

After ``import flashfold.integrations.transformers`` (or :func:`register`), any model whose
attention goes through ``transformers``' attention interface (Llama, Mistral, Qwen, BERT,
... in transformers >= 4.53) runs its attention through :func:`flashfold.attention`::

    from flashfold.integrations.transformers import ATTN_IMPLEMENTATION   # registers it
    model = AutoModelForCausalLM.from_pretrained(
        name, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.bfloat16).cuda()

The functions are registered as ``"flashfold"`` and ``"ff_attention"``. transformers 5.x
treats every ``attn_implementation`` whose name contains "flash" as a FlashAttention
kernel to load from the Hub (``is_flash_attention_requested``), so a model created with
``"flashfold"`` fails there before any attention runs; :data:`ATTN_IMPLEMENTATION` is
``"ff_attention"`` on those versions and ``"flashfold"`` elsewhere.

On CUDA tensors the Triton kernels run (float16 / bfloat16), on CPU tensors the blocked
reference (float16 to float64). transformers is an optional extra
(``pip install flashfold[transformers]``); ``import flashfold`` never imports it.

Two functions are registered under the same name:

* a **mask function** (``AttentionMaskInterface``), called once per forward pass by the
  model's ``create_causal_mask`` / ``create_bidirectional_mask``. Instead of the dense
  ``(batch, 1, q_len, kv_len)`` bias of the eager path it returns a :class:`FlashfoldMask`:
  the mask's kind (causal or bidirectional) and, when the 2-D ``attention_mask`` has
  padding, the padding mask, classified once on the device (one host read of three flags
  per forward pass): for left padding also each row's first real key (``kv_start``, on the
  device), and on first use a *varlen plan* (which query rows and key positions are real,
  as ``cu_seqlens``), shared by every layer;
* an **attention function** (``AttentionInterface``), ``fn(module, query, key, value,
  attention_mask, scaling=None, dropout=0.0, **kwargs) -> (out (B, S, Hq, Dv), None)``,
  with ``query (B, Hq, S, D)``, ``key``/``value (B, Hkv, L, D|Dv)`` in any strides.

How each case maps onto :func:`flashfold.attention`:

=====================================  ==================================================
transformers                            flashfold
=====================================  ==================================================
decoder (causal) mask, no padding      ``causal=True``: bottom-right aligned, which is
                                       the causal mask of a KV-cache step (query ``i`` is
                                       position ``L - S + i``); a step of 1 to 16 new
                                       tokens against a longer cache runs
                                       :func:`flashfold.decode` (split-KV) when K and V
                                       share a head dim (``Dv = D``, as its cache needs)
KV-cache step (1 to 16 new tokens,     :func:`flashfold.decode` over the unpacked cache
``S < L``), left padding (each row's   with ``cache_start`` = the row's first real key
real keys one run ending at ``L``)     (no packing, no host synchronisation per layer);
                                       query rows before it give 0 (``Dv != D``: the
                                       varlen packing below)
bidirectional (encoder) mask           no mask
key padding, bidirectional             the real keys packed (``cu_seqlens_k``), every query
                                       row kept (the same values as eager on all rows)
padding, causal, contiguous per row    real queries and keys packed (``cu_seqlens_q/k``,
(left or right padding; prefill,       ``causal=True``); padded query rows give 0
right-padded steps)
anything else the model's mask         the boolean mask HF would build, read by a
function encodes (sliding windows,     ``mask_mod`` from a ``(B * S, L)`` table (a boolean
packed sequences, static caches,       table, never an additive float bias)
padding with holes in a decoder)
a 4-D boolean mask passed by the user  the same table ``mask_mod``
a 4-D float mask of 0 / -inf (or the   converted to boolean first
dtype's minimum)
a 4-D mask ``(B|1, 1, 1, L)`` (one     key padding, bidirectional (above)
row broadcast over the queries)
GQA / MQA (``Hq`` a multiple of        passed through (no ``repeat_kv``)
``Hkv``)
``scaling``, ``softcap``               ``scale``, ``softcap``
``sliding_window`` kwarg, no mask     ``window=(sliding_window - 1, None)`` causal,
or a 2-D padding mask                  ``(sliding_window - 1, sliding_window - 1)``
                                       bidirectional, as the FlashAttention path; with
                                       padding, in the table ``mask_mod`` (the model's
                                       and a user's 4-D masks encode the window, as in
                                       eager, and the kwarg is not applied again)
``cu_seq_lens_q/k`` kwargs (packed     ``cu_seqlens_q/k``
batches, as the FlashAttention path)
=====================================  ==================================================

Unsupported, raising ``NotImplementedError`` that names the case: attention dropout
(``dropout > 0``, i.e. training with ``attention_dropout``), a general additive float
bias (values other than 0 and -inf), ``output_attentions=True`` (no weights are formed),
attention sinks (``s_aux``), T5-style ``position_bias``, flex ``BlockMask`` masks.
Unsupported head dims and dtypes raise ``ValueError`` / ``TypeError`` from
:func:`flashfold.attention` (which names the argument), prefixed with the module.

Training without attention dropout works: gradients flow through the autograd of
:func:`flashfold.attention` (the packing is index_select / index_copy, differentiable;
KV-cache steps use :func:`flashfold.decode` only when no gradient is needed: a left-padded
step that needs one takes the varlen plan).

Rows with no visible key (e.g. a left-padded query row of a decoder) give 0, where
eager gives an average of values (its -inf is the dtype's minimum): such rows are
undefined, and the tests compare only rows eager defines. Under ``torch.compile`` both
functions run outside the graph (``torch.compiler.disable``: one graph break per layer).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass

import torch

#: the registered names: ``NAME``, and ``ALIAS`` for transformers versions that reserve
#: names containing "flash" for FlashAttention kernels (see :func:`register`)
NAME = "flashfold"
ALIAS = "ff_attention"


def _unsupported(what: str):
    raise NotImplementedError(f"attn_implementation='{NAME}' does not support {what}")


# --- the compact mask -----------------------------------------------------------------------

@dataclass(frozen=True)
class VarlenPlan:
    """Padded rows packed for :func:`flashfold.attention`'s varlen mode.

    ``cu_seqlens_q`` / ``cu_seqlens_k`` int32 ``(batch + 1,)`` offsets into the packed rows;
    ``q_index`` int64 ``(Tq,)``: the packed query rows as flat indices into ``batch *
    q_len`` (``None``: every row kept); ``k_index`` int64 ``(Tk,)``: the real keys, flat
    indices into ``batch * kv_len``. All on the padding mask's device.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    q_index: torch.Tensor | None
    k_index: torch.Tensor


@dataclass(eq=False)
class FlashfoldMask:
    """What the mask function hands to every layer of one forward pass.

    ``causal``: the model's mask is the decoder (causal) mask, aligned bottom-right (query
    row ``i`` at key position ``kv_len - q_len + i``), or the bidirectional one (False).
    ``batch``, ``q_len``, ``kv_len``: the sizes the mask was made for.
    ``padding``: ``None`` without padding, else the ``(batch, kv_len)`` boolean key-padding
    mask (True: a real key; causal masks only when each row's real keys are one run). Then
    :attr:`plan` packs the real rows (computed on first use, one host read, then shared by
    every layer), and ``kv_start``, int32 ``(batch,)`` on the device, is set when the mask
    is causal and left-padded (each row's real keys are ``[kv_start[b], kv_len)``, ``kv_len``
    for a row without any): KV-cache steps then run :func:`flashfold.decode` with
    ``cache_start=kv_start`` on the unpacked cache, and never build the plan.
    ``table``: instead of all that, a boolean ``(batch or 1, q_len, kv_len)`` visibility
    table (the general case).
    """

    causal: bool
    batch: int
    q_len: int
    kv_len: int
    padding: torch.Tensor | None = None
    kv_start: torch.Tensor | None = None
    table: torch.Tensor | None = None

    @property
    def varlen(self) -> bool:
        return self.padding is not None

    @functools.cached_property
    def plan(self) -> VarlenPlan:
        """The varlen packing of :attr:`padding` (built once per mask, on first use)."""
        if self.padding is None:
            raise ValueError(f"{self!r} has no padding to pack")
        return _varlen_plan(self.padding, self.q_len, self.causal)

    def __repr__(self):
        kind = ("table" if self.table is not None else
                "left-padded varlen" if self.kv_start is not None else
                "varlen" if self.varlen else "plain")
        return (f"FlashfoldMask({'causal' if self.causal else 'bidirectional'}, {kind}, "
                f"batch={self.batch}, q_len={self.q_len}, kv_len={self.kv_len})")


def _as_int(x) -> int:
    return int(x.item()) if isinstance(x, torch.Tensor) else int(x)


def _padding_runs(padding: torch.Tensor):
    """Classify a ``(B, L)`` bool key-padding mask (True: a real key) on its device, with
    one host read of three flags: ``(all_real, one_run, left, kv_start)``.

    ``one_run``: every row's real keys form at most one run; ``left``: every row's run ends
    at ``L`` (left padding; a row without real keys counts); ``kv_start`` int32 ``(B,)`` on
    the device: ``L -`` the row's number of real keys, its first real key under ``left``.
    """
    B, L = padding.shape
    n = padding.sum(1)                                          # real keys per row
    kv_start = (L - n).to(torch.int32)
    if L == 0:
        return True, True, True, kv_start
    runs = padding[:, 0].to(n.dtype) + (padding[:, 1:] & ~padding[:, :-1]).sum(1)
    flags = torch.stack([(n == L).all(), (runs <= 1).all(),
                         ((runs <= 1) & ((n == 0) | padding[:, -1])).all()])
    all_real, one_run, left = flags.tolist()                    # the one host read
    return all_real, one_run, left, kv_start


def _varlen_plan(padding: torch.Tensor, q_len: int, causal: bool) -> VarlenPlan:
    """The :class:`VarlenPlan` of a ``(B, L)`` bool key-padding mask (reads it on the host).

    Bidirectional: the real keys are packed (any pattern), every query row kept. Causal:
    a row's real keys must be one run ``[lo, hi)`` (checked by :func:`_padding_runs`); the
    real queries are then the query positions inside it, ``[max(lo, L - S), hi)``, and
    flashfold's bottom-right alignment within each packed sequence is exactly ``kv <= q``
    in absolute positions.
    """
    B, L = padding.shape
    dev = padding.device
    host = padding.to("cpu", torch.bool)
    counts = host.sum(1)
    k_index = torch.nonzero(host.reshape(-1), as_tuple=False).reshape(-1)
    cu_k = torch.zeros(B + 1, dtype=torch.int32)
    cu_k[1:] = torch.cumsum(counts, 0)
    if not causal:
        cu_q = torch.arange(B + 1, dtype=torch.int32) * q_len
        return VarlenPlan(cu_q.to(dev), cu_k.to(dev), None, k_index.to(dev))
    q_rows, cu_q = [], [0]
    first = L - q_len                                  # key position of query row 0
    for b in range(B):
        n = int(counts[b])
        if n == 0:
            cu_q.append(cu_q[-1])
            continue
        lo = int(torch.argmax(host[b].to(torch.uint8)))
        hi = lo + n                                    # one run: [lo, hi)
        q0 = max(lo, first)
        if hi > q0:
            q_rows.append(torch.arange(q0 - first, hi - first) + b * q_len)
        cu_q.append(cu_q[-1] + max(0, hi - q0))
    q_index = torch.cat(q_rows) if q_rows else torch.zeros(0, dtype=torch.int64)
    return VarlenPlan(torch.tensor(cu_q, dtype=torch.int32, device=dev), cu_k.to(dev),
                      q_index.to(dev), k_index.to(dev))


def _dense_table(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                 attention_mask, device, use_vmap):
    """HF's own boolean mask ``(B or 1, 1, S, L)`` -> ``(B or 1, S, L)``."""
    from transformers.masking_utils import sdpa_mask
    m = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                  q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                  attention_mask=attention_mask, allow_is_causal_skip=False,
                  allow_is_bidirectional_skip=False, use_vmap=use_vmap, device=device)
    return m[:, 0]


def _mask_function_impl(batch_size: int, q_length: int, kv_length: int, q_offset=0,
                        kv_offset=0, mask_function=None, attention_mask=None, device="cpu",
                        use_vmap: bool = False, **kwargs) -> FlashfoldMask:
    """The ``AttentionMaskInterface`` entry: a :class:`FlashfoldMask` (see its docstring).

    ``attention_mask``: the 2-D ``(batch, seen + q_length)`` padding mask or None;
    ``mask_function``: the model's mask pattern. The plain causal and bidirectional
    patterns become a compact mask (varlen when padded, with each row's first real key
    when causal and left-padded); any other pattern, a causal padding with holes, or a
    query offset that is not bottom-right (static caches), becomes the boolean table HF
    would build. Reads three flags of the padding mask on the host (one synchronisation
    per forward pass), nothing else.
    """
    from transformers.masking_utils import (bidirectional_mask_function, causal_mask_function,
                                            prepare_padding_mask)
    if mask_function is None:
        mask_function = causal_mask_function
    q_off, kv_off = _as_int(q_offset), _as_int(kv_offset)
    plain = mask_function is causal_mask_function or mask_function is bidirectional_mask_function
    causal = mask_function is causal_mask_function
    aligned = (not causal) or (q_off - kv_off == kv_length - q_length)
    if plain and aligned:
        runs = None
        if attention_mask is not None:
            padding = prepare_padding_mask(attention_mask, kv_length, kv_off)
            padding = padding[:, kv_off:kv_off + kv_length].to(torch.bool)
            if padding.shape != (batch_size, kv_length):
                raise ValueError(f"attention_mask: padding mask of shape "
                                 f"{tuple(attention_mask.shape)} does not cover "
                                 f"(batch={batch_size}, kv_len={kv_length})")
            runs = _padding_runs(padding)
        if runs is None or runs[0]:
            return FlashfoldMask(causal, batch_size, q_length, kv_length)
        _, one_run, left, kv_start = runs
        if not causal or one_run:
            return FlashfoldMask(causal, batch_size, q_length, kv_length, padding=padding,
                                 kv_start=kv_start if causal and left else None)
    table = _dense_table(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                         attention_mask, device, use_vmap)
    return FlashfoldMask(False, batch_size, q_length, kv_length, table=table)


# --- a boolean table as a mask_mod -------------------------------------------------------------

class _TableMods:
    """One traced ``mask_mod`` per boolean table, reading a private copy of it.

    ``visible(b, h, q, kv) = store[b * S + q, kv]`` (``b * 0`` when the table is shared by
    the batch), ``store`` an int8 ``(Bt * S, L)`` copy of the table made with the mod and
    never written again: a differentiable call keeps its mod for the backward, which must
    read the table of its own forward whatever tables later calls (other layers' masks,
    the next micro-batch) bring. Entries are keyed on the table's device, storage, shape,
    strides and version (:func:`~flashfold.kernels.attention.mods.version`; an entry holds
    its table, so the storage is not reused while it is cached): every layer of a forward
    pass (one table, or views of one user mask) shares one mod and, with it, the Triton
    function (generated once per traced mod) and the block mask.
    """

    #: tables kept (a forward pass's one or two, a few more)
    SIZE = 8

    def __init__(self):
        self._mods: OrderedDict = OrderedDict()

    def get(self, table: torch.Tensor):
        from ..kernels.attention.mods import version
        from ..ops import Buffer
        Bt, S, L = table.shape
        key = (str(table.device), table.data_ptr(), tuple(table.shape), table.stride(),
               version(table))
        entry = self._mods.get(key)
        if entry is not None:
            self._mods.move_to_end(key)
            return entry[0]
        store = table.reshape(Bt * S, L).to(torch.int8, copy=True)
        buf = Buffer(store)
        rows = S if Bt > 1 else 0

        def hf_mask_table(b, h, q_idx, kv_idx):
            return buf[b * rows + q_idx, kv_idx] != 0
        self._mods[key] = (hf_mask_table, store, table)
        while len(self._mods) > self.SIZE:
            self._mods.popitem(last=False)
        return hf_mask_table


_TABLES = _TableMods()


def _table_from_4d(mask: torch.Tensor, B: int, S: int, L: int) -> torch.Tensor:
    """A user's 4-D mask ``(B|1, 1, S, L)`` -> boolean ``(B|1, S, L)`` (``S = 1`` for a
    mask broadcast over the query rows); a float mask must hold only 0 (visible) and
    -inf / the dtype's minimum (hidden), an integer one only 1 (visible) and 0."""
    if mask.shape[1] != 1:
        _unsupported(f"a 4-D attention mask with per-head entries (shape {tuple(mask.shape)})")
    if tuple(mask.shape[2:]) != (S, L) or mask.shape[0] not in (1, B):
        raise ValueError(f"attention_mask: 4-D mask of shape {tuple(mask.shape)} does not match "
                         f"(batch={B} or 1, 1, q_len={S}, kv_len={L})")
    m = mask[:, 0]
    if m.dtype == torch.bool:
        return m
    if not m.is_floating_point():
        # 1 / 0 as bool; other ints read either way (0 visible as a bias, or hidden as a
        # flag): refused rather than guessed
        if not bool(((m == 0) | (m == 1)).all()):
            _unsupported("an integer 4-D attention_mask with values other than 0 and 1 (an "
                         "additive bias?); pass a bool mask or a float mask of 0 / -inf")
        return m != 0
    hidden = m <= torch.finfo(m.dtype).min / 2
    if not bool(((m == 0) | hidden).all()):
        _unsupported("a general additive attention bias (a 4-D float attention_mask with "
                     "values other than 0 and -inf); express it as a flashfold score_mod")
    return ~hidden


# --- the attention function ------------------------------------------------------------------

def _attention_impl(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """The ``AttentionInterface`` entry (see the module docstring).

    ``query (B, Hq, S, D)``, ``key (B, Hkv, L, D)``, ``value (B, Hkv, L, Dv)`` -> ``(out
    (B, S, Hq, Dv) contiguous, None)``.
    """
    # the entry points are looked up in their modules at each call, so a wrapper set there
    # (api.attention.attention, api.decode.decode) applies
    from ..api import attention as api_attention
    from ..api import decode as api_decode

    where = type(module).__name__
    if dropout:
        _unsupported(f"attention dropout (dropout={dropout} in {where}: training with "
                     f"attention_dropout > 0); set attention_dropout=0 or call model.eval()")
    if kwargs.get("output_attentions"):
        _unsupported("output_attentions=True (no attention weights are formed); use "
                     "attn_implementation='eager' to inspect them")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        _unsupported("attention sinks (s_aux)")
    if kwargs.get("position_bias") is not None:
        _unsupported("an additive position_bias (T5-style relative attention bias)")
    B, Hq, S, _ = query.shape
    L = key.shape[2]
    if is_causal is None:
        is_causal = bool(getattr(module, "is_causal", True))
    kw = dict(scale=scaling, softcap=softcap)
    # a model's mask (a FlashfoldMask from the mask function) and a user's 4-D mask already
    # encode its sliding window (as eager, which ignores the kwarg); without a mask, or
    # with a 2-D padding mask, which encodes none, the kwarg is the only source and applies
    # (as the FlashAttention path: (sliding_window - 1) on both sides; the right side is
    # moot when causal)
    window = None
    if sliding_window is not None and (attention_mask is None or (
            isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2)):
        w = int(sliding_window) - 1
        window = (w, None if is_causal else w)

    cu_q_kw, cu_k_kw = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    mask = attention_mask
    if mask is None and cu_q_kw is not None and cu_k_kw is not None:
        # packed batch (batch 1), as transformers' FlashAttention path
        o = _call(api_attention.attention, where, query, key, value, causal=is_causal,
                  window=window, cu_seqlens_q=cu_q_kw.to(torch.int32),
                  cu_seqlens_k=cu_k_kw.to(torch.int32), **kw)
        return o.transpose(1, 2).contiguous(), None
    if mask is None:
        o = _call(api_attention.attention, where, query, key, value, causal=is_causal,
                  window=window, **kw)
        return o.transpose(1, 2).contiguous(), None
    if isinstance(mask, torch.Tensor):
        if mask.dim() == 4 and mask.shape[2] == 1:
            # (B|1, 1, 1, L): the same keys hidden from every query row, a key-padding
            # mask (SDPA broadcasts it): packed as the 2-D padding mask is
            keys = _table_from_4d(mask, B, 1, L)[:, 0].expand(B, L).contiguous()
            mask = (FlashfoldMask(False, B, S, L) if _padding_runs(keys)[0]
                    else FlashfoldMask(False, B, S, L, padding=keys))
        elif mask.dim() == 4:
            mask = FlashfoldMask(False, B, S, L, table=_table_from_4d(mask, B, S, L))
        elif mask.dim() == 2:
            padding = mask
            mask = _mask_function_impl(B, S, L, L - S, 0, _causal_fn(is_causal), padding,
                                       query.device)
            if window is not None and (mask.varlen or mask.table is not None):
                # padded: the window in the table HF's mask function builds (positions
                # are absolute there; packed rows would close up a hole under the window)
                mask = _mask_function_impl(B, S, L, L - S, 0,
                                           _windowed_fn(is_causal, *window), padding,
                                           query.device)
        else:
            raise ValueError(f"attention_mask: expected a 2-D padding mask or a 4-D mask, got "
                             f"shape {tuple(mask.shape)}")
    elif not isinstance(mask, FlashfoldMask):
        _unsupported(f"an attention_mask of type {type(mask).__name__} (flex BlockMask masks "
                     f"belong to attn_implementation='flex_attention')")
    if (mask.batch, mask.q_len, mask.kv_len) != (B, S, L) and not (
            mask.table is not None and mask.table.shape[0] == 1 and (mask.q_len, mask.kv_len) == (S, L)):
        raise ValueError(f"attention_mask: {mask!r} was made for (batch, q_len, kv_len) = "
                         f"{(mask.batch, mask.q_len, mask.kv_len)}, but {where} has query "
                         f"{tuple(query.shape)} and key {tuple(key.shape)}")

    if mask.table is not None:
        mod = _TABLES.get(mask.table.to(query.device))
        o = _call(api_attention.attention, where, query, key, value, mask_mod=mod, **kw)
        return o.transpose(1, 2).contiguous(), None
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    # flashfold.decode's contract: 1..16 new tokens, no gradient, K and V of one head dim
    step = (mask.causal and S < L and S <= _MAX_DECODE_Q and not grad
            and value.shape[-1] == key.shape[-1])
    if step and (not mask.varlen or mask.kv_start is not None):
        # a KV-cache step, unpadded or left-padded: split-KV decoding over the whole cache,
        # each row from its first real key (query rows before it see no key: 0)
        lens = torch.full((B,), L, dtype=torch.int32, device=query.device)
        # (a window here comes from an unpadded 2-D mask: kv_start is None)
        o = _call(api_decode.decode, where, query, key, value, lens, cache_start=mask.kv_start,
                  check_lengths=False, max_seqlen=L, window=window, **kw)
        return o.transpose(1, 2).contiguous(), None
    if not mask.varlen:
        o = _call(api_attention.attention, where, query, key, value, causal=mask.causal,
                  window=window, **kw)
        return o.transpose(1, 2).contiguous(), None
    return _varlen(api_attention.attention, where, query, key, value, mask.plan, mask.causal,
                   kw), None


#: the most query tokens per step that go to :func:`flashfold.decode`
_MAX_DECODE_Q = 16


def _causal_fn(is_causal: bool):
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function
    return causal_mask_function if is_causal else bidirectional_mask_function


def _windowed_fn(is_causal: bool, left: int, right: int | None):
    """The model's mask function (causal or bidirectional) and the window ``q_idx - left
    <= kv_idx <= q_idx + right`` (``right`` None: unbounded), in HF's mask-function form
    over absolute positions (``q_idx`` from the query offset)."""
    base = _causal_fn(is_causal)

    def sliding_window_mask(batch_idx, head_idx, q_idx, kv_idx):
        ok = base(batch_idx, head_idx, q_idx, kv_idx) & (kv_idx >= q_idx - left)
        return ok if right is None else ok & (kv_idx <= q_idx + right)
    return sliding_window_mask


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, D)`` -> ``(B * N, H, D)`` (a view for transformers' ``(B, N, H, D)``
    storage)."""
    B, H, N, D = x.shape
    return x.permute(0, 2, 1, 3).reshape(B * N, H, D)


def _varlen(attention, where, query, key, value, plan: VarlenPlan, causal: bool, kw):
    """Pack real rows, run the varlen attention, scatter back to ``(B, S, Hq, Dv)``."""
    B, Hq, S, _ = query.shape
    Dv = value.shape[-1]
    qr = _rows(query)
    if plan.q_index is not None:
        qr = qr.index_select(0, plan.q_index)
    kr = _rows(key).index_select(0, plan.k_index)
    vr = _rows(value).index_select(0, plan.k_index)
    pack = lambda r: r.permute(1, 0, 2).unsqueeze(0)            # (T, H, D) -> (1, H, T, D)  # noqa: E731
    o = _call(attention, where, pack(qr), pack(kr), pack(vr), causal=causal,
              cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_k=plan.cu_seqlens_k, **kw)
    o = o[0].permute(1, 0, 2)                                     # (Tq, Hq, Dv)
    if plan.q_index is None:
        return o.reshape(B, S, Hq, Dv).contiguous()
    out = torch.zeros(B * S, Hq, Dv, dtype=o.dtype, device=o.device)
    out.index_copy_(0, plan.q_index, o)
    return out.view(B, S, Hq, Dv)


def _call(attention, where, *args, **kwargs):
    try:
        return attention(*args, **kwargs)
    except (ValueError, TypeError) as e:
        raise type(e)(f"attn_implementation='{NAME}' in {where}: {e}") from e


# the registered entry points run outside torch.compile graphs (host-side planning, traced
# mask mods and Triton launches are not traceable by dynamo)
flashfold_attention_forward = torch.compiler.disable(_attention_impl)
flashfold_attention_forward.__doc__ = _attention_impl.__doc__
flashfold_attention_mask = torch.compiler.disable(_mask_function_impl)
flashfold_attention_mask.__doc__ = _mask_function_impl.__doc__


def _reserved_by_transformers(name: str) -> bool:
    """Whether transformers treats ``name`` as a FlashAttention kernel (transformers 5.x
    reserves every implementation name containing "flash" and tries to load a kernel)."""
    try:
        from transformers.utils.generic import is_flash_attention_requested
    except ImportError:                            # other versions: assume the substring rule
        return "flash" in name
    return bool(is_flash_attention_requested(requested_attention_implementation=name))


def register(name: str | None = None) -> str:
    """Register flashfold with transformers (idempotent); returns the name to pass as
    ``attn_implementation``.

    Registers :func:`flashfold_attention_forward` in ``AttentionInterface`` and
    :func:`flashfold_attention_mask` in ``AttentionMaskInterface`` under ``name``, or by
    default under both ``"flashfold"`` and ``"ff_attention"``. transformers 5.x treats
    any name containing "flash" as a FlashAttention kernel to load (model construction
    fails with "Could not find the currently requested flash attention implementation"),
    so there ``"ff_attention"`` is the name to use; :data:`ATTN_IMPLEMENTATION` holds the
    usable one. Raises ``ImportError`` when transformers is missing or older than the
    attention-mask interface (4.53).
    """
    if name is not None and (not isinstance(name, str) or not name):
        raise TypeError(f"name: expected a non-empty str, got {name!r}")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:                       # pragma: no cover - depends on the env
        raise ImportError("flashfold.integrations.transformers needs transformers >= 4.53 "
                          "(AttentionInterface and AttentionMaskInterface): "
                          "pip install 'flashfold[transformers]'") from e
    names = (name,) if name is not None else (NAME, ALIAS)
    for n in names:
        AttentionInterface.register(n, flashfold_attention_forward)
        AttentionMaskInterface.register(n, flashfold_attention_mask)
    usable = [n for n in names if not _reserved_by_transformers(n)]
    return usable[0] if usable else names[0]


def is_registered(name: str = NAME) -> bool:
    """Whether ``name`` is registered in both of transformers' interfaces."""
    import sys
    if "transformers" not in sys.modules:
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    return (AttentionInterface._global_mapping.get(name) is flashfold_attention_forward and
            AttentionMaskInterface._global_mapping.get(name) is flashfold_attention_mask)


#: the ``attn_implementation`` to pass with the installed transformers ("flashfold", or
#: "ff_attention" where transformers reserves names containing "flash")
ATTN_IMPLEMENTATION = register()

__all__ = ["register", "is_registered", "FlashfoldMask", "VarlenPlan",
           "flashfold_attention_forward", "flashfold_attention_mask", "NAME", "ALIAS",
           "ATTN_IMPLEMENTATION"]
