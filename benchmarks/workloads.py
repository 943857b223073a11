r"""Attention workloads of real models: flashfold against every peer, in one run.

Each row is one model's attention layer at 16,384 tokens per batch (``B x N``, or
packed documents), bf16, forward and backward, launched eagerly and replayed from CUDA
graphs, with flashfold and every peer that can express the row measured in this process:
SDPA's cuDNN and FLASH (FlashAttention 2) backends, FlashAttention-4 (``flash_attn.cute``)
and ``torch.compile``d FlexAttention.

FLOPs. For a row with ``Hq`` query heads, head dims ``D_qk``, ``D_v`` and ``P`` visible
query-key pairs per head (summed over the batch),

.. math::

    F_{fwd} = 4\, H_q\, \bar D\, P, \qquad \bar D = (D_{qk} + D_v) / 2, \qquad
    F_{bwd} = 2.5\, F_{fwd}, \qquad F_{fwd+bwd} = 3.5\, F_{fwd}

(two matmuls per pair, ``q.k`` over ``D_qk`` and ``p v`` over ``D_v``). ``P`` per
sequence of ``N`` queries: ``N^2`` dense; ``N^2 / 2`` dense causal (the usual convention,
as ``benchmarks/attention.py``); exact elsewhere: a causal window of ``L`` keys back
``sum_i (min(i, L) + 1)``; causal documents (packed varlen or a document mask)
``sum_d L_d (L_d + 1) / 2``; prefix-LM with prefix ``p`` ``p^2 + N (N + 1) / 2 - p (p + 1) / 2``;
key padding ``N L_b`` for sequence ``b`` with ``L_b`` real keys. TFLOP/s = F / time.

Measurements (``triton.testing.do_bench`` medians; ``flashfold.bench.graph_replay``):

* forward, eager: the training forward (inputs require grad), as each library is called;
* forward, CUDA graph: the same call replayed from a graph (kernel time, no host time);
* backward, eager: ``torch.autograd.grad`` of a retained forward (backward alone);
* forward + backward, CUDA graph: both replayed from one graph (3.5 F).

Every table cell is TFLOP/s; the ratio is flashfold's TFLOP/s over the peer's (above 1:
flashfold faster), per peer and against the best peer of that row and measurement.

Peers, each in its own contiguous layout (conversions outside timing):

* SDPA cuDNN / FLASH: ``(B, H, N, D)``, ``enable_gqa`` for GQA, ``is_causal``; key padding
  as a boolean ``attn_mask``; packed documents as nested (jagged) tensors, whose training
  path needs equal head counts (K/V heads repeated outside timing, dK/dV then not
  compared). They have no sliding window, softcap, score_mod or mask_mod: such rows leave
  them empty.
* FlashAttention-4: ``(B, N, H, D)``; ``window_size``, ``softcap``; packed documents (and
  the document-mask rows) through ``flash_attn_varlen_func`` with ``cu_seqlens``; key
  padding through ``seqused_k``; ALiBi as a CuTe ``score_mod`` (with its ``score_mod_bwd``);
  prefix-LM as a CuTe ``mask_mod`` with block-sparse tiles from a FlexAttention block mask
  of 128 x 128 tiles. Called with ``return_lse=True`` (the training forward computes the
  LSE anyway), which makes the check and the timing one compiled kernel.
* FlexAttention (window, softcap, documents, key padding and mod rows): ``(B, H, N, D)``,
  ``enable_gqa``; the block mask built once outside timing.

Correctness comes before timing. For every row flashfold's output and LSE at the row's full
shape are checked (1) against a float64 reference of the last 256 query rows of batch
element 0, query head 0, computed exactly with the row's mask, window, softcap and
score_mod: ``max|o - ref| <= 2 max|naive - ref| + 2 ulp(ref)`` with ``naive`` the same
rows computed as a PyTorch user does (matmuls in bf16, softmax in fp32), FlashAttention's
criterion as ``benchmarks/attention.py`` applies it (LSE: ``<= 2 naive + 1e-3``), no NaN
anywhere; (2) against the first peer that ran (FA4, cuDNN, FA2, Flex in that order; on packed rows FA4,
Flex, then the nested-tensor SDPA adaptor), each other peer's comparison printed beside it
(where the first peer alone disagrees and flashfold agrees with at least two others, the
first is named the outlier and the check passes, :func:`peer_verdict`):
output within 2e-2 of the peer's largest value (a wrong mask or a skipped tile moves
outputs by 0.1 or more), LSE within 1e-3 relative where the peer returns it (FA4), each
gradient within 5e-2 of the peer's largest. A failed check is printed and marks the row's
timings; nothing is hidden.

Compiles. The run has two passes over the rows. The first warms flashfold, FlexAttention
and SDPA on every row and runs check (1); meanwhile ``--fa4-workers`` processes compile
FA4's kernels for every row (the same calls at the same shapes) into FA4's on-disk cache
(``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED``), so that its compiles (tens of seconds each)
overlap instead of adding up. The workers are ended before the second pass, which loads
FA4 from that cache, runs check (2), and times. ``--budget`` seconds bound the run: past
``budget - 10 s x rows`` no new peer is compiled (its cells stay empty, saying so), past
``budget + 40 s`` remaining rows are listed as not run; the tables always print (also
after Ctrl-C / SIGINT).

Run on the H200, from the repository root, in two device calls made back to back (the
machine stays warm 30 s between calls). The peers' archives come from
``bash /work/shared/peers/fetch.sh .peers`` and ``bash benchmarks/peers_core.sh .peers``
(the CuTeDSL's Python package, ``cutlass.cute``, which fetch.sh's archives lack) run here
(``.peers/`` is ignored by git); together they are over the 64 MiB one call may carry,
hence two steps:

1. carry ``.peers/`` (``cutlass_cu13.tar.xz.part0``, ``fa4_quack_small.tar.xz`` and
   ``cutlass_core.tar.xz``; part1 moved to ``.peers1/``)::

       mkdir -p /tmp/site /tmp/peers && cp .peers/cutlass_cu13.tar.xz.part0 /tmp/peers/ && tar -xJf .peers/fa4_quack_small.tar.xz -C /tmp/site && tar -xJf .peers/cutlass_core.tar.xz -C /tmp/site && ls /tmp/site

2. carry ``.peers1/`` (an ignored folder holding ``cutlass_cu13.tar.xz.part1``; should the
   machine have gone cold between the calls, the unpacking fails, says so, and the run
   goes on without FA4)::

       { cat /tmp/peers/cutlass_cu13.tar.xz.part0 .peers1/cutlass_cu13.tar.xz.part1 | tar -xJf - -C /tmp/site || echo "cutlass runtime not unpacked: no FA4"; }; export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:src PYTHONUNBUFFERED=1; set -o pipefail; timeout -s INT 570 python3 benchmarks/workloads.py 2>&1 | tee $OUT/workloads.log

   (``--quick`` for the 4-row grid; save the log as ``benchmarks/logs/DATE_h200_workloads.log``
   and run ``flashfold bench --results``.)

Options: ``--quick`` (4 rows), ``--fwd-only``, ``--rows SUBSTRING`` (rows whose key, model
or shape contains it), ``--no-peers``, ``--budget SECONDS``, ``--fa4-workers N`` (0:
compile FA4 in this process), ``--kernels`` (after a row's timings, one line per
implementation and direction: what its eager call runs, by torch.profiler, each kernel's
device time per call and their sum against the eager time: an eager time far above the
sum is host time), ``--mask-cost`` (after a block-mask row's timings: flashfold's forward
from a CUDA graph with the row's block mask, as written where it runs as intervals of
keys (the same output), with the same lists but one compare per pair in the PARTIAL
tiles, and with every listed tile FULL; per visited tile per SM, and the share of the row
that evaluating the mask takes; the last two variants' outputs are not the row's),
``--smoke`` (CPU, tiny sizes, flashfold's CPU path and
eager FlexAttention; no CUDA peer, no graphs; times are not measurements; also prints the
FLOP count of every full-size row).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn.functional as F

import flashfold
from flashfold import mods
from flashfold.bench import graph_replay, kernel_times

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENS = 16384
PEERS = ("cudnn", "flash", "fa4", "flex")
PEER_NAMES = {"flashfold": "flashfold", "cudnn": "cuDNN", "flash": "FA2", "fa4": "FA4",
              "flex": "Flex"}
COMPARE_ORDER = ("fa4", "cudnn", "flash", "flex")        # the peer check (2) compares with
# packed rows: FlexAttention's document mask first (nested-tensor SDPA is an adaptor of
# this script's; its gradients are shown as information beside the check)
COMPARE_ORDER_PACKED = ("fa4", "flex", "cudnn", "flash")
MEASURES = (("fwd", "eager"), ("fwd", "graph"), ("bwd", "eager"), ("fwd+bwd", "graph"))
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
TITLES = {("fwd", "eager"): "forward, eager",
          ("fwd", "graph"): "forward, CUDA graph replay",
          ("bwd", "eager"): "backward alone, eager (autograd.grad of a retained forward)",
          ("fwd+bwd", "graph"): "forward + backward, CUDA graph replay"}
CHECK_ROWS = 256                    # query rows of the float64 reference
FA4_CACHE = "/tmp/flashfold_workloads_fa4_cache"
# errors after which the CUDA context is unusable for the rest of the process
_STICKY = ("illegal memory access", "unspecified launch failure", "device-side assert",
           "misaligned address", "illegal instruction", "uncorrectable ECC")


class Unsupported(Exception):
    """A peer that cannot express a row (its reason is printed once per peer)."""


# --- rows ---------------------------------------------------------------------------------------

def doc_lengths(total: int, count: int, lo: int, hi: int, seed: int) -> tuple:
    """``count`` lengths in ``[lo, hi]`` summing to ``total``: uniform draws (seeded CPU
    generator) scaled to the sum, clipped at ``hi`` with the excess spread over the others,
    rounded down with the remainder given to the largest fractional parts."""
    if not count * lo <= total <= count * hi:
        raise ValueError(f"{count} lengths in [{lo}, {hi}] cannot sum to {total}")
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(count, generator=g, dtype=torch.float64).tolist()
    free, cap = total - count * lo, hi - lo
    x = [0.0] * count
    open_ = set(range(count))
    while free > 1e-9 and open_:
        s = sum(w[i] for i in open_)
        add = {i: free * w[i] / s for i in open_}
        free = 0.0
        for i in sorted(open_):
            x[i] += add[i]
            if x[i] > cap:
                free += x[i] - cap
                x[i] = cap
                open_.discard(i)
    out = [int(math.floor(v)) for v in x]
    rest = total - count * lo - sum(out)
    for i in sorted(range(count), key=lambda i: (out[i] - x[i], i))[:rest]:
        out[i] += 1
    return tuple(lo + v for v in out)


def equal_lengths(total: int, count: int) -> tuple:
    """``count`` lengths differing by at most one, summing to ``total``."""
    return tuple(total // count + (1 if i < total % count else 0) for i in range(count))


def window_pairs(n: int, left, right) -> int:
    """``sum_i #{j in [0, n): i - left <= j <= i + right}`` (``None``: that side unbounded)."""
    total = 0
    for i in range(n):
        lo = 0 if left is None else max(0, i - left)
        hi = n - 1 if right is None else min(n - 1, i + right)
        total += max(0, hi - lo + 1)
    return total


@dataclass(frozen=True)
class Workload:
    """One row: a model's attention layer. ``docs``: document lengths, packed through
    ``cu_seqlens`` (``varlen``, one sequence of ``N`` tokens) or, per batch element, as a
    causal document mask; ``key_lens``: real keys per sequence (key padding)."""

    key: str
    model: str
    B: int
    N: int
    Hq: int
    Hk: int
    D: int
    DV: int = 0                           # 0: D
    causal: bool = True
    window: tuple | None = None           # (left, right)
    softcap: float | None = None
    docs: tuple | None = None
    varlen: bool = False
    alibi: bool = False
    prefix: int = 0
    key_lens: tuple | None = None
    quick: bool = False

    @property
    def dv(self) -> int:
        return self.DV or self.D

    @property
    def batch(self) -> int:
        """Leading dim of the tensors (1 for packed documents)."""
        return 1 if self.varlen else self.B

    def pairs(self) -> int:
        """Visible query-key pairs of one head, summed over the batch (exact, except
        dense causal: N^2 / 2)."""
        n = self.N
        if self.key_lens:
            return n * sum(self.key_lens)
        if self.docs:
            per = sum(d * (d + 1) // 2 if self.causal else d * d for d in self.docs)
            return per * (1 if self.varlen else self.B)
        if self.prefix:
            p = min(self.prefix, n)
            return self.B * (p * p + n * (n + 1) // 2 - p * (p + 1) // 2)
        if self.window:
            left, right = self.window
            if self.causal:
                right = 0 if right is None else min(right, 0)
            return self.B * window_pairs(n, left, right)
        return self.B * (n * n // 2 if self.causal else n * n)

    def flops(self, direction: str = "fwd") -> float:
        return FLOP_FACTOR[direction] * 2 * self.Hq * (self.D + self.dv) * self.pairs()

    def shape(self) -> str:
        s = [f"d{self.D}" if self.dv == self.D else f"qk{self.D} v{self.dv}",
             f"{self.Hq}:{self.Hk}" if self.Hq != self.Hk else f"{self.Hq} heads"]
        if self.prefix:
            s.append(f"prefix-LM {self.prefix}")
        elif self.key_lens:
            s.append(f"key padding {min(self.key_lens)}-{max(self.key_lens)}")
        else:
            s.append("causal" if self.causal else "full")
        if self.window:
            s.append(f"window ({self.window[0]}, {self.window[1]})")
        if self.softcap:
            s.append(f"softcap {self.softcap:g}")
        if self.alibi:
            s.append("ALiBi")
        if self.docs:
            s.append(f"{'varlen ' if self.varlen else ''}{len(self.docs)} docs "
                     f"{min(self.docs)}-{max(self.docs)}")
        s.append(f"{self.N} tokens" if self.varlen else f"N{self.N} B{self.B}")
        return " ".join(s)

    def smoke(self) -> "Workload":
        """The same row at CPU size: heads / 8 (ratio kept), N / 64, windows, prefix,
        documents and key lengths scaled with N."""
        r = self.Hq // self.Hk
        hq = max(2, min(self.Hq, 2 * r))
        n = max(32, self.N // 64)

        def scale(x):
            return max(1, x * n // self.N)
        kw = dict(key=self.key + "-smoke", B=min(self.B, 2), N=n, Hq=hq, Hk=hq // r)
        if self.window:
            kw["window"] = tuple(None if x is None else (x if x == 0 else scale(x))
                                 for x in self.window)
        if self.prefix:
            kw["prefix"] = scale(self.prefix)
        if self.docs:
            c = min(4, len(self.docs))
            kw["docs"] = (equal_lengths(n, c) if max(self.docs) - min(self.docs) <= 1 else
                          doc_lengths(n, c, max(1, n // 16), n // 2, seed=1))
        if self.key_lens:
            kw["key_lens"] = tuple(scale(x) for x in self.key_lens[:kw["B"]])
        return replace(self, **kw)


def grid() -> list[Workload]:
    """The rows, in the order they run (most used first)."""
    llama = dict(Hq=32, Hk=8, D=128, causal=True)
    docs24 = doc_lengths(TOKENS, 24, 40, 1340, seed=0)
    docs8 = doc_lengths(4096, 8, 128, 1024, seed=1)
    g = torch.Generator().manual_seed(2)
    lens = [int(x) for x in torch.randint(64, 513, (32,), generator=g)]
    lens[0] = min(lens[0], 448)                      # batch element 0 (the checked one) pads
    rows = [
        Workload("llama-4k", "Llama-3 8B / Qwen2.5 training", 4, 4096, **llama, quick=True),
        Workload("llama-16k", "Llama-3 8B / Qwen2.5 training", 1, 16384, **llama),
        Workload("llama-varlen", "Llama-3 8B / Qwen2.5, packed documents", 1, TOKENS, **llama,
                 docs=docs24, varlen=True, quick=True),
        Workload("llama-equal", "Llama-3 8B / Qwen2.5, equal lengths", 16, 1024, **llama,
                 quick=True),
        Workload("llama-equal-docs", "Llama-3 8B / Qwen2.5, 24 equal documents", 1, TOKENS,
                 **llama, docs=equal_lengths(TOKENS, 24), varlen=True),
        Workload("mistral-w4096", "Mistral-7B", 1, 16384, **llama, window=(4096, 0)),
        Workload("gemma2-softcap", "Gemma-2 9B", 2, 8192, 16, 8, 256, softcap=50.0, quick=True),
        Workload("gemma2-softcap-w4096", "Gemma-2 9B, local layers", 2, 8192, 16, 8, 256,
                 softcap=50.0, window=(4096, 0)),
        Workload("gemma3-w1024", "Gemma-3, local layers", 1, 16384, 16, 8, 256,
                 window=(1024, 0)),
        Workload("gemma3-w512", "Gemma-3, local layers", 1, 16384, 16, 8, 256, window=(512, 0)),
        Workload("phi3-w2047", "Phi-3-mini", 4, 4096, 32, 32, 96, window=(2047, 0)),
        Workload("deepseek-mla", "DeepSeek-V3 MLA", 4, 4096, 16, 16, 192, DV=128),
        Workload("phi2", "Phi-2", 8, 2048, 32, 32, 80),
        Workload("minilm-padding", "MiniLM", 32, 512, 12, 12, 32, causal=False,
                 key_lens=tuple(lens)),
        Workload("bert", "BERT-base", 32, 512, 12, 12, 64, causal=False),
    ]
    for d in (128, 64):
        mh = dict(B=4, N=4096, Hq=16, Hk=16, D=d)
        rows += [
            Workload(f"documents-d{d}", "packed documents (document mask_mod)", **mh, docs=docs8),
            Workload(f"alibi-d{d}", "BLOOM / MPT (ALiBi score_mod)", **mh, alibi=True),
            Workload(f"prefix-lm-d{d}", "prefix-LM (PaliGemma / UL2 mask_mod)", **mh,
                     causal=False, prefix=1024),
        ]
    return rows


# --- static parts of a row: masks, mods, offsets (built once, outside timing) --------------------

class Static:
    """What every pass over a row reuses: document ids, offsets, key lengths, and each
    implementation's keyword arguments with its masks and mods (:meth:`build`, once per
    implementation: a new mod object would recompile FlexAttention and FA4)."""

    def __init__(self, w: Workload, dev: str, fa4=None, fa4_reason: str = ""):
        self.w, self.dev, self.fa4, self.fa4_reason = w, dev, fa4, fa4_reason
        self.kw, self.reason = {}, {}
        if w.docs:
            self.doc_ids = torch.repeat_interleave(torch.arange(len(w.docs), device=dev),
                                                   torch.tensor(w.docs, device=dev))
            self.cu = torch.tensor([0] + torch.tensor(w.docs).cumsum(0).tolist(),
                                   dtype=torch.int32, device=dev)
        if w.key_lens:
            self.lens = torch.tensor(w.key_lens, dtype=torch.int32, device=dev)

    def build(self, name: str):
        """``name``'s keyword arguments (or its reason for not running the row), once."""
        if name in self.kw or name in self.reason:
            return
        try:
            if self.dev != "cuda" and name in ("cudnn", "flash"):
                raise Unsupported("needs CUDA")
            self.kw[name] = {"flashfold": self._flashfold, "cudnn": self._sdpa,
                             "flash": self._sdpa, "flex": self._flex, "fa4": self._fa4}[name]()
        except Unsupported as e:
            self.reason[name] = str(e)

    def _flashfold(self):
        w, dev = self.w, self.dev
        if w.varlen:
            return dict(causal=w.causal, cu_seqlens_q=self.cu, cu_seqlens_k=self.cu)
        if w.docs:
            mm = mods.and_masks(mods.causal_mask, mods.document_mask(self.doc_ids))
            return dict(mask_mod=flashfold.create_block_mask(mm, None, None, w.N, w.N, device=dev))
        if w.prefix:
            return dict(mask_mod=flashfold.create_block_mask(mods.prefix_lm_mask(w.prefix), None,
                                                             None, w.N, w.N, device=dev))
        if w.key_lens:
            return dict(mask_mod=mods.key_padding_mask(self.lens))
        kw = dict(causal=w.causal)
        if w.window:
            kw["window"] = w.window
        if w.softcap:
            kw["softcap"] = w.softcap
        if w.alibi:
            kw["score_mod"] = mods.alibi(w.Hq)
        return kw

    def _sdpa(self):
        w = self.w
        if w.window:
            raise Unsupported("no sliding window")
        if w.softcap:
            raise Unsupported("no softcap")
        if w.alibi or w.prefix or (w.docs and not w.varlen):
            raise Unsupported("no score_mod / mask_mod (only a dense N x N attn_mask)")
        kw = {"enable_gqa": True} if w.Hq != w.Hk else {}
        if w.key_lens:
            keep = torch.arange(w.N, device=self.lens.device)[None, :] < self.lens[:, None].long()
            kw["attn_mask"] = keep[:, None, None, :]
        elif w.causal:
            kw["is_causal"] = True
        return kw

    def _flex(self):
        from torch.nn.attention.flex_attention import create_block_mask
        w = self.w
        if not (w.window or w.softcap or w.docs or w.prefix or w.key_lens or w.alibi):
            raise Unsupported("run on window, softcap, document, padding and mod rows only "
                              "(SDPA's fused kernels are the peers of plain rows)")
        mask, batch = None, None
        if w.docs:
            doc = self.doc_ids
            mask = lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i)  # noqa: E731
        elif w.prefix:
            p = w.prefix
            mask = lambda b, h, i, j: (j < p) | (j <= i)  # noqa: E731
        elif w.key_lens:
            lens, batch = self.lens, w.B
            mask = lambda b, h, i, j: j < lens[b]  # noqa: E731
        elif w.window:
            left, right = w.window
            right = 0 if w.causal else right
            mask = lambda b, h, i, j: (j <= i + right) & (j >= i - left)  # noqa: E731
        elif w.causal:
            mask = lambda b, h, i, j: j <= i  # noqa: E731
        kw = {"enable_gqa": True} if w.Hq != w.Hk else {}
        if mask is not None:
            kw["block_mask"] = create_block_mask(mask, batch, None, w.N, w.N, device=self.dev)
        if w.softcap:
            cap = w.softcap
            kw["score_mod"] = lambda s, b, h, i, j: cap * torch.tanh(s / cap)  # noqa: E731
        if w.alibi:
            slopes = mods.alibi_slopes(w.Hq).to(self.dev)
            kw["score_mod"] = lambda s, b, h, i, j: s + slopes[h] * (j - i)  # noqa: E731
        return kw

    def _fa4(self):
        w = self.w
        if self.fa4 is None:
            raise Unsupported(self.fa4_reason or "flash_attn.cute did not import")
        if w.varlen or w.docs:                   # documents: one varlen sequence each
            docs = list(w.docs) * (1 if w.varlen else w.B)
            cu = torch.tensor([0] + torch.tensor(docs).cumsum(0).tolist(), dtype=torch.int32,
                              device=self.dev)
            return dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(docs),
                        max_seqlen_k=max(docs), causal=w.causal)
        if w.key_lens:
            return dict(seqused_k=self.lens)
        kw = dict(causal=w.causal)
        if w.window:
            kw["window_size"] = tuple(w.window)
        if w.softcap:
            kw["softcap"] = float(w.softcap)
        if w.alibi:
            kw["score_mod"], kw["score_mod_bwd"] = _fa4_alibi(w.Hq)
        if w.prefix:
            kw.update(_fa4_prefix_lm(w, self.dev))
        return kw


def _fa4_alibi(heads: int):
    """ALiBi as FA4 CuTe score_mods: ``s + slope_h (kv - q)``, ``slope_h = 2^(-8 (h+1) / H)``
    (:func:`flashfold.mods.alibi_slopes` for ``H`` a power of two); its gradient passes
    ``dS`` through unchanged."""
    if heads & (heads - 1):
        raise Unsupported("ALiBi slopes in closed form need a power-of-two head count")
    import cutlass
    import cutlass.cute as cute
    c = -8.0 / heads

    @cute.jit
    def alibi(score, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        h = (head_idx + cute.full_like(head_idx, 1)).to(cutlass.Float32)
        slope = cute.math.exp2(h * cute.full_like(score, c))
        return score + slope * (kv_idx - q_idx).to(cutlass.Float32)

    @cute.jit
    def alibi_bwd(grad, score, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return grad

    return alibi, alibi_bwd


def _fa4_prefix_lm(w: Workload, dev):
    """Prefix-LM as an FA4 CuTe mask_mod (``kv < p or kv <= q``), with the tiles it hides
    skipped through block-sparse tensors read off a FlexAttention block mask of 128 x 128
    tiles (forward: key blocks per query block; backward: query blocks per key block)."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    from torch.nn.attention.flex_attention import create_block_mask
    p = w.prefix

    @cute.jit
    def prefix_lm(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        lim = utils.scalar_to_ssa(p, cutlass.Int32)
        return (kv_idx < lim) | (kv_idx <= q_idx)

    bm = create_block_mask(lambda b, h, i, j: (j < p) | (j <= i), 1, 1, w.N, w.N, device=dev,
                           BLOCK_SIZE=(128, 128))
    fwd = BlockSparseTensorsTorch(mask_block_cnt=bm.kv_num_blocks, mask_block_idx=bm.kv_indices,
                                  full_block_cnt=bm.full_kv_num_blocks,
                                  full_block_idx=bm.full_kv_indices, block_size=(128, 128))
    bwd = BlockSparseTensorsTorch(mask_block_cnt=bm.q_num_blocks, mask_block_idx=bm.q_indices,
                                  full_block_cnt=bm.full_q_num_blocks,
                                  full_block_idx=bm.full_q_indices, block_size=(128, 128))
    return dict(causal=False, mask_mod=prefix_lm, block_sparse_tensors=fwd,
                block_sparse_tensors_bwd=bwd)


# --- inputs and implementations ------------------------------------------------------------------

@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor


def make_inputs(w: Workload, dev: str, dtype, seed: int = 0) -> Inputs:
    """q, k, v (requiring grad) and dO in flashfold's layout ``(B, H, N, D)`` (``B = 1``
    for packed documents); softcap rows scale q by 8 so that the cap bends scores."""
    g = torch.Generator(device=dev).manual_seed(seed)
    B, N = w.batch, w.N

    def rnd(h, d, s=1.0):
        return (torch.randn(B, h, N, d, device=dev, generator=g) * s).to(dtype)
    q = rnd(w.Hq, w.D, 8.0 if w.softcap else 1.0).requires_grad_()
    k, v = rnd(w.Hk, w.D).requires_grad_(), rnd(w.Hk, w.dv).requires_grad_()
    return Inputs(q, k, v, rnd(w.Hq, w.dv))


@dataclass
class Impl:
    """One implementation of a row: ``forward()`` is what is timed, ``checked()`` gives
    ``(out, lse or None)``; ``leaves`` (none: no backward) and ``dout`` are in the
    implementation's layout and ``common`` / ``common_lse`` map its tensors to flashfold's."""

    name: str
    forward: Callable
    checked: Callable
    leaves: tuple
    dout: torch.Tensor
    common: Callable = lambda t: t  # noqa: E731
    common_lse: Callable = lambda t: t  # noqa: E731
    #: why the call cannot be captured in a CUDA graph (its graph cells stay empty), or None
    not_capturable: str | None = None


def build_impl(name: str, w: Workload, st: Static, x: Inputs, ctx) -> Impl:
    """The call of ``name`` for row ``w`` on inputs ``x`` (raises :class:`Unsupported`)."""
    st.build(name)
    if name in st.reason:
        raise Unsupported(st.reason[name])
    kw = st.kw[name]
    if name == "flashfold":
        # (packed sequences too: a capture reads no offsets, its launches sized by the
        # packed lengths)
        return Impl(name, lambda: flashfold.attention(x.q, x.k, x.v, **kw),
                    lambda: flashfold.attention(x.q, x.k, x.v, return_lse=True, **kw),
                    (x.q, x.k, x.v), x.do)
    if name in ("cudnn", "flash"):
        return _sdpa_impl(name, w, kw, x)
    if name == "flex":
        flex = ctx.flex
        if flex is None:
            raise Unsupported(ctx.flex_reason)
        if ctx.dev == "cpu":                  # eager FlexAttention has no CPU backward
            q, k, v = x.q.detach(), x.k.detach(), x.v.detach()
            f = lambda: flex(q, k, v, **kw)  # noqa: E731
            return Impl(name, f, lambda: (f(), None), (), x.do)
        f = lambda: flex(x.q, x.k, x.v, **kw)  # noqa: E731
        return Impl(name, f, lambda: (f(), None), (x.q, x.k, x.v), x.do)
    return _fa4_impl(w, kw, x, st.fa4)


def _sdpa_impl(name, w, kw, x) -> Impl:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = SDPBackend.CUDNN_ATTENTION if name == "cudnn" else SDPBackend.FLASH_ATTENTION
    if not w.varlen:
        def f():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(x.q, x.k, x.v, **kw)
        return Impl(name, f, lambda: (f(), None), (x.q, x.k, x.v), x.do)
    # packed documents: nested jagged tensors over (T, H, D) values. Nested tensors train
    # only with equal head counts: K/V heads are repeated (outside timing), as a user must
    offsets = torch.tensor([0] + torch.tensor(w.docs).cumsum(0).tolist(), device=x.q.device)
    lo, hi = min(w.docs), max(w.docs)
    kw = {k: v for k, v in kw.items() if k != "enable_gqa"}

    def values(t, rep=1):
        t4 = t.detach()[0].transpose(0, 1).repeat_interleave(rep, dim=1).contiguous()
        return t4.requires_grad_(t.requires_grad)
    r = w.Hq // w.Hk
    qv, kv, vv, dov = values(x.q), values(x.k, r), values(x.v, r), values(x.do)

    def nested(t):
        return torch.nested.nested_tensor_from_jagged(t, offsets, min_seqlen=lo,
                                                      max_seqlen=hi).transpose(1, 2)

    def f():
        with sdpa_kernel([backend]):
            o = F.scaled_dot_product_attention(nested(qv), nested(kv), nested(vv), **kw)
        return o.transpose(1, 2).values()
    # (capturing them in a CUDA graph fails and poisons the context for every later row)
    return Impl(name, f, lambda: (f(), None), (qv, kv, vv), dov,
                common=lambda t: t.transpose(0, 1).unsqueeze(0),
                not_capturable="nested tensors read their offsets on the host")


def _fa4_impl(w, kw, x, fa4) -> Impl:
    if fa4 is None:
        raise Unsupported("flash_attn.cute did not import")
    packed = "cu_seqlens_q" in kw
    B, N = w.batch, w.N

    def lay(t):                       # (B, H, N, D) -> (B, N, H, D), or (T, H, D) packed
        t4 = t.detach().transpose(1, 2).contiguous()
        t4 = t4.reshape(B * N, t.shape[1], t.shape[-1]) if packed else t4
        return t4.requires_grad_(t.requires_grad)
    q4, k4, v4, do4 = lay(x.q), lay(x.k), lay(x.v), lay(x.do)
    if packed or "seqused_k" in kw:
        call = lambda: fa4.flash_attn_varlen_func(q4, k4, v4, return_lse=True, **kw)  # noqa: E731
    else:
        call = lambda: fa4.flash_attn_func(q4, k4, v4, return_lse=True, **kw)  # noqa: E731
    if packed:
        common = lambda t: t.reshape(B, N, t.shape[-2], t.shape[-1]).transpose(1, 2)  # noqa: E731
        common_lse = lambda t: t.reshape(t.shape[0], B, N).transpose(0, 1)  # noqa: E731
    else:
        common = lambda t: t.transpose(1, 2)  # noqa: E731
        common_lse = lambda t: t  # noqa: E731
    return Impl("fa4", lambda: call()[0], call, (q4, k4, v4), do4, common, common_lse)


# --- checks ----------------------------------------------------------------------------------------

def visible(w: Workload, st: Static, i, j):
    """Key ``j`` visible to query ``i`` (absolute positions in batch element 0, or in the
    packed sequence)."""
    keep = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool, device=i.device)
    if w.docs:
        keep &= st.doc_ids[i] == st.doc_ids[j]
    if w.causal:
        keep &= j <= i
    if w.window:
        left, right = w.window
        if left is not None:
            keep &= j >= i - left
        if right is not None:
            keep &= j <= i + right
    if w.prefix:
        keep &= (j < w.prefix) | (j <= i)
    if w.key_lens:
        keep &= j < w.key_lens[0]
    return keep


def reference_rows(w: Workload, st: Static, x: Inputs, exact: bool, rows: int = CHECK_ROWS):
    """``(o, lse)`` of the last ``rows`` queries of batch element 0, query head 0 (key head
    0): in float64 (``exact``), or as a naive user writes it (matmuls in the input dtype,
    softcap and bias in it too, softmax in fp32, ``p`` rounded to the input dtype)."""
    n = x.q.shape[2]
    r0 = max(0, n - rows)
    dt = torch.float64 if exact else x.q.dtype
    q, k, v = (t.detach()[0, 0].to(dt) for t in (x.q, x.k, x.v))
    i = torch.arange(r0, n, device=q.device)[:, None]
    j = torch.arange(k.shape[0], device=q.device)[None, :]
    s = (q[r0:] * (1.0 / math.sqrt(w.D))) @ k.T
    if w.softcap:
        s = w.softcap * torch.tanh(s / w.softcap)
    if w.alibi:
        slope = float(mods.alibi_slopes(w.Hq)[0])
        s = s + (slope * (j - i)).to(dt)
    s = s.to(torch.float64 if exact else torch.float32).masked_fill(~visible(w, st, i, j),
                                                                     -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[:, None])
    o = p.to(dt) @ v
    return o, lse


def check_reference(w, st, x, o, lse, rows: int = CHECK_ROWS):
    """Check (1): flashfold's ``o``, ``lse`` against :func:`reference_rows` (FlashAttention's
    criterion); returns ``(ok, message)``."""
    ro, rl = reference_rows(w, st, x, exact=True, rows=rows)
    po, pl = reference_rows(w, st, x, exact=False, rows=rows)
    r0 = max(0, o.shape[2] - rows)
    go, gl = o[0, 0, r0:].double(), lse[0, 0, r0:].double()
    err = (go - ro).abs().max().item()
    perr = (po.double() - ro).abs().max().item()
    atol = 2 * (ro + 0.3 - 0.3 - ro).abs().max().item()
    fin = torch.isfinite(rl)
    lerr = (gl[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
    plerr = (pl.double()[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
    why = []
    if torch.isnan(o).any() or torch.isnan(lse).any():
        why.append("NaN in the output")
    bound = 2 * perr + atol
    if not err <= bound:
        why.append(f"o err {err:.2e} > {bound:.2e}")
    if not lerr <= 2 * plerr + 1e-3:
        why.append(f"lse err {lerr:.2e} > {2 * plerr + 1e-3:.2e}")
    msg = (f"o err {err:.2e} (naive {perr:.2e}), lse err {lerr:.1e} (naive {plerr:.1e}) "
           f"on the last {min(rows, o.shape[2])} rows of head 0")
    return not why, msg + ("" if not why else " <- " + "; ".join(why))


def compare_peer(ff, peer):
    """Check (2): flashfold's ``(o, lse, grads)`` against a peer's, in flashfold's layout;
    returns ``(ok, message)``."""
    (o, lse, grads), (po, plse, pgrads) = ff, peer
    why, parts = [], []
    d = ((o.float() - po.float()).abs().max() / po.float().abs().max().clamp(min=1)).item()
    parts.append(f"o {d:.1e}")
    if not d <= 2e-2:
        why.append(f"o differs by {d:.2e} > 2e-2")
    if plse is not None and lse is not None:
        fin = torch.isfinite(plse)
        dl = ((lse[fin] - plse[fin]).abs().max() / plse[fin].abs().max().clamp(min=1)).item()
        parts.append(f"lse {dl:.1e}")
        if not dl <= 1e-3:
            why.append(f"lse differs by {dl:.2e} > 1e-3")
    if grads is not None and pgrads is not None:      # (a peer's repeated K/V heads: dq only)
        dg = [((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()
              for a, b in zip(grads, pgrads) if a.shape == b.shape]
        parts.append("d" + "/d".join("qkv"[:len(dg)]) + " " + "/".join(f"{x:.1e}" for x in dg))
        if not all(x <= 5e-2 for x in dg):
            why.append("gradients differ by more than 5e-2")
    return not why, ", ".join(parts) + ("" if not why else " <- " + "; ".join(why))


def peer_verdict(agreements):
    """Check (2)'s verdict from ``[(peer, agrees), ...]`` in comparison order: flashfold
    passes when it agrees with the first peer, or, where that peer alone disagrees, when
    at least two other peers ran and flashfold agrees with every one of them (they then
    agree with each other within twice the bound, and the first peer is the outlier,
    named); ``(ok, note)``."""
    if not agreements or agreements[0][1]:
        return True, ""
    first, rest = agreements[0][0], agreements[1:]
    if len(rest) >= 2 and all(ok for _, ok in rest):
        others = ", ".join(PEER_NAMES[p] for p, _ in rest)
        return True, (f"check passed: flashfold agrees with {others}; {PEER_NAMES[first]} "
                      "differs from all of them (the outlier)")
    return False, ""


# --- the run ---------------------------------------------------------------------------------------

@dataclass
class RowResult:
    w: Workload
    check: bool | None = None            # None: not checked
    ms: dict = field(default_factory=dict)       # (direction, mode) -> {impl: ms}
    run: bool = False

    def tflops(self, measure, impl):
        t = self.ms.get(measure, {}).get(impl)
        return self.w.flops(measure[0]) / t / 1e9 if t else None


class Context:
    """A run's state: device, peers, budget, per-row statics and warm states, the notes
    printed once, and a sticky CUDA error that ends GPU work."""

    def __init__(self, args, dev, dtype, n_rows):
        self.args, self.dev, self.dtype, self.n_rows = args, dev, dtype, n_rows
        self.t0 = time.perf_counter()
        self.flex, self.flex_reason = None, "not loaded"
        self.fa4, self.fa4_reason = None, "not loaded"
        self.pool = None
        self.peers = () if args.no_peers else PEERS
        self.measures = [m for m in MEASURES if not (args.fwd_only and m[0] != "fwd")
                         and not (dev == "cpu" and m[1] == "graph")]
        self.said = set()
        self.unsupported = {}                   # (peer, reason) -> [row keys]
        self.dead = None
        self.static, self.state = {}, {}        # row key -> Static; (row key, impl) -> state
        self.bench = _cpu_time

    def elapsed(self):
        return time.perf_counter() - self.t0

    def peers_open(self, rows_to_time: int) -> bool:
        """Whether a peer may still be compiled (10 s kept for each row still to time)."""
        return self.elapsed() < self.args.budget - 10 * rows_to_time

    def rows_open(self) -> bool:
        return self.elapsed() < self.args.budget + 40 and self.dead is None

    def sync(self):
        if self.dev == "cuda":
            torch.cuda.synchronize()

    def note(self, peer, w, reason):
        """A peer that cannot express a row: said once per reason, listed at the end."""
        rows = self.unsupported.setdefault((peer, reason), [])
        if not rows:
            print(f"   {PEER_NAMES[peer]}: {reason} (its cells stay empty on such rows)",
                  flush=True)
        rows.append(w.key)

    def error(self, impl, w, what, e, here: bool = True):
        """A failure: its message once (later ones point back to it). ``here``: raised in
        this process (a sticky CUDA error then ends GPU work)."""
        msg = f"{type(e).__name__}: {str(e).strip()[:400]}"
        if here and self.dev == "cuda" and any(s in str(e) for s in _STICKY):
            self.dead = f"{PEER_NAMES[impl]} on {w.key}: {msg}"
        key = (impl, msg.splitlines()[0][:120])
        if key in self.said:
            print(f"   {PEER_NAMES[impl]} failed on {w.key} ({what}): the error above", flush=True)
            return
        self.said.add(key)
        print(f"   {PEER_NAMES[impl]} failed on {w.key} ({what}): {msg}", flush=True)
        if impl == "flashfold":
            traceback.print_exc(limit=-6, file=sys.stdout)


def _cpu_time(fn, reps: int = 1) -> float:
    """Median ms of ``reps`` calls after one (CPU smoke runs: not a measurement)."""
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(1e3 * (time.perf_counter() - t))
    return sorted(ts)[len(ts) // 2]


def _warm(impl: Impl, backward: bool):
    out = impl.forward()
    if backward and impl.leaves:
        torch.autograd.grad(out, impl.leaves, impl.dout)


def _results(impl: Impl, backward: bool):
    """``(o, lse, grads)`` of one call, in flashfold's layout."""
    o, lse = impl.checked()
    grads = None
    if backward and impl.leaves:
        grads = [impl.common(g) for g in torch.autograd.grad(o, impl.leaves, impl.dout)]
    return (impl.common(o.detach()), None if lse is None else impl.common_lse(lse.detach()),
            grads)


def first_pass(w: Workload, ctx: Context, res: RowResult):
    """Warm flashfold, SDPA and Flex (and FA4 when no workers compile it); check (1)."""
    backward = not ctx.args.fwd_only
    st = ctx.static[w.key] = Static(w, ctx.dev, ctx.fa4, ctx.fa4_reason)
    x = make_inputs(w, ctx.dev, ctx.dtype)
    names = ("flashfold",) + tuple(p for p in ctx.peers if p != "fa4" or ctx.pool is None)
    warm = []
    for name in names:
        if name != "flashfold" and not ctx.peers_open(ctx.n_rows):
            ctx.state[(w.key, name)] = "skipped"
            warm.append(f"{name} skipped (time budget)")
            continue
        t = time.perf_counter()
        try:
            impl = build_impl(name, w, st, x, ctx)
            if name == "flashfold":
                o, lse = impl.checked()
                ok, msg = check_reference(w, st, x, o.detach(), lse.detach())
                res.check = ok
                print(f"   check flashfold vs float64: {'ok' if ok else 'FAILED'}: {msg}",
                      flush=True)
                del o, lse
            _warm(impl, backward)
            ctx.sync()
            ctx.state[(w.key, name)] = "warm"
            warm.append(f"{name} {time.perf_counter() - t:.1f}s")
        except Unsupported as e:
            ctx.state[(w.key, name)] = "unsupported"
            ctx.note(name, w, str(e))
        except Exception as e:  # noqa: BLE001 - a failure empties the implementation's cells
            ctx.state[(w.key, name)] = "failed"
            ctx.error(name, w, "warm-up", e)
            if name == "flashfold":
                res.check = False
            if ctx.dead:
                break
    print("   warm: " + (", ".join(warm) or "-"), flush=True)


def second_pass(w: Workload, ctx: Context, rows_left: int, res: RowResult):
    """Check (2) against the first peer that runs, then time every implementation."""
    backward = not ctx.args.fwd_only
    st = ctx.static[w.key]
    x = make_inputs(w, ctx.dev, ctx.dtype)
    impls, outs = {}, {}
    for name in ("flashfold",) + ctx.peers:
        state = ctx.state.get((w.key, name))
        if state is None and name == "fa4":
            state = _fa4_state(w, ctx, rows_left)
        if state != "warm":
            continue
        try:
            impl = build_impl(name, w, st, x, ctx)
            outs[name] = _results(impl, backward)
            ctx.sync()
            impls[name] = impl
        except Unsupported as e:
            ctx.note(name, w, str(e))
        except Exception as e:  # noqa: BLE001
            ctx.error(name, w, "check", e)
            if ctx.dead:
                return
    if "flashfold" in outs:
        order = COMPARE_ORDER_PACKED if w.varlen else COMPARE_ORDER
        ran = [(p, *compare_peer(outs["flashfold"], outs[p])) for p in order if p in outs]
        for i, (peer, ok, msg) in enumerate(ran):
            if i == 0:
                print(f"   check flashfold vs {PEER_NAMES[peer]}: {'ok' if ok else 'FAILED'}: "
                      f"{msg}", flush=True)
            else:
                print(f"   (information) flashfold vs {PEER_NAMES[peer]}: "
                      f"{'agrees' if ok else 'differs'}: {msg}", flush=True)
        ok, why = peer_verdict([(p, ok) for p, ok, _ in ran])
        if why:
            print(f"   {why}", flush=True)
        res.check = bool(res.check) and ok
    else:
        res.check = False
    del outs
    for measure in ctx.measures:
        got = res.ms.setdefault(measure, {})
        for name, impl in impls.items():
            if measure[0] != "fwd" and not impl.leaves:
                continue
            if measure[1] == "graph" and impl.not_capturable:
                ctx.note(name, w, f"not captured in a CUDA graph ({impl.not_capturable})")
                continue
            try:
                got[name] = ctx.bench(_timed(impl, measure))
            except Exception as e:  # noqa: BLE001
                ctx.error(name, w, f"{measure[0]} {measure[1]}", e)
                if ctx.dead:
                    return
            finally:
                if ctx.dev == "cuda":
                    torch.cuda.empty_cache()
        print(measure_line(res, measure), flush=True)
    if ctx.args.kernels:
        for name, impl in impls.items():
            for direction in ("fwd", "bwd") if backward and impl.leaves else ("fwd",):
                eager = res.ms.get((direction, "eager"), {}).get(name)
                times = kernel_times(_timed(impl, (direction, "eager")),
                                     cuda=ctx.dev == "cuda")
                print(kernels_line(name, direction, times, eager), flush=True)
    bm = st.kw.get("flashfold", {}).get("mask_mod")
    if ctx.args.mask_cost and "flashfold" in impls and isinstance(bm, flashfold.BlockMask):
        print(mask_cost_line(w, x, bm, ctx), flush=True)
    res.run = True


def mask_variants(bm) -> dict:
    """The relatives of the block mask ``bm`` (:func:`mask_cost_line`), by name: where
    the kernels evaluate ``bm`` as intervals of keys, ``bm`` with its mask_mod as written
    (a table read per key: the same output, the A/B of the interval form); then, for
    timing only (their outputs are not the row's), its own block lists with a mask_mod
    that compares ``kv_idx >= 0`` only (the PARTIAL tiles evaluate one compare per pair),
    and its tiles all FULL (nothing evaluated)."""
    from flashfold.kernels.attention import mods as km
    one = km.trace_mask_mod(lambda b, h, q_idx, kv_idx: kv_idx >= 0)

    def relisted(state, lists, mod=one):
        pn, pi, fn, fi = lists
        return km.BlockMask(mask_mod=mod, state=state, partial_num=pn, partial_idx=pi,
                            full_num=fn, full_idx=fi, shape=bm.shape,
                            block_size=bm.BLOCK_SIZE, exact=bm.exact, builtins=bm.builtins)
    lists = (bm.partial_num, bm.partial_idx, bm.full_num, bm.full_idx)
    full = torch.where(bm.state == km.PARTIAL, torch.full_like(bm.state, km.FULL), bm.state)
    out = {}
    if bm.row_mod is not bm.mod:
        out["the mask as written"] = relisted(bm.state, lists, bm.mod)
    return {**out, "one compare per pair": relisted(bm.state, lists),
            "no mask evaluated": relisted(full, km._lists(full))}


def visited_tiles(w: Workload, bm) -> int:
    """Key tiles the row's items walk: the block mask's PARTIAL and FULL tiles, over the
    batches and heads it broadcasts across."""
    from flashfold.kernels.attention import mods as km
    Bm, Hm = bm.state.shape[:2]
    return int((bm.state != km.EMPTY).sum()) * (w.batch // Bm) * (w.Hq // Hm)


def mask_cost_line(w: Workload, x: "Inputs", bm, ctx) -> str:
    """``--mask-cost``: flashfold's forward (from a CUDA graph; eager on the CPU, not a
    measurement) with the row's block mask and with its :func:`mask_variants`, each also
    per visited tile per SM, and the share of the row that the mask's evaluation takes
    (the row against the variant that evaluates nothing). A row whose mask runs as
    intervals of keys also times the mask as written (the same output)."""
    q, k, v = (t.detach() for t in (x.q, x.k, x.v))
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if (
        ctx.dev == "cuda") else 1
    tiles = visited_tiles(w, bm)
    cells, times = [], {}
    for name, m in (("as run", bm), *mask_variants(bm).items()):
        def fn(m=m):
            with torch.no_grad():
                return flashfold.attention(q, k, v, mask_mod=m)
        us = 1e3 * ctx.bench(graph_replay(fn) if ctx.dev == "cuda" else fn)
        times[name] = us
        cells.append(f"{name} {us:.1f} us, {us * sms / tiles:.2f} per tile per SM")
    share = 1 - times["no mask evaluated"] / times["as run"]
    return (f"   mask cost fwd flashfold: {' | '.join(cells)} | {tiles} visited tiles; "
            f"evaluating the mask {share:.0%} of the row")


def kernels_line(name: str, direction: str, times: list, eager_ms, top: int = 6) -> str:
    """One implementation's kernels of one direction (``flashfold.bench.kernel_times``):
    their sum against the eager call's time (a call whose eager time is far above its
    kernels' sum is bound by its host code), then the longest ``top``, in us per call."""
    total = sum(t for t, _, _ in times)
    eager = "-" if eager_ms is None else f"{1e3 * eager_ms:.1f}"
    parts = [f"{t:.1f} {k[:48]}" + (f" x{c:g}" if c != 1 else "") for t, c, k in times[:top]]
    return (f"   kernels {direction:<7} {PEER_NAMES[name]}: sum {total:.1f} us, eager {eager} "
            f"us | " + "; ".join(parts))


def _timed(impl: Impl, measure):
    """The callable one measurement times (a graph's replay for ``graph``)."""
    direction, mode = measure
    if direction == "fwd":
        fn = impl.forward
    elif direction == "bwd":
        out = impl.forward()
        fn = lambda: torch.autograd.grad(out, impl.leaves, impl.dout, retain_graph=True)  # noqa: E731
    else:
        fn = lambda: torch.autograd.grad(impl.forward(), impl.leaves, impl.dout)  # noqa: E731
    return graph_replay(fn) if mode == "graph" else fn


# --- FA4 compiles in worker processes --------------------------------------------------------------

def fa4_config(w: Workload) -> tuple:
    """Rows with equal keys share FA4's compiled kernels (one worker compiles them)."""
    return (w.D, w.dv, w.Hq, w.Hk, w.causal, w.window is not None, w.softcap, w.alibi,
            w.prefix > 0, w.key_lens is not None, w.varlen or w.docs is not None, w.B == 1)


def _fa4_worker(rows, queue, backward):
    """In a spawned process: compile FA4 for each row (one forward + backward at its
    shape), putting ``(row key, ok, message)`` on ``queue`` as each is done."""
    try:
        import flash_attn.cute as fa4
    except Exception as e:  # noqa: BLE001
        for w in rows:
            queue.put((w.key, False, f"import: {type(e).__name__}: {e}"))
        return
    for w in rows:
        t = time.perf_counter()
        try:
            st = Static(w, "cuda", fa4)
            st.build("fa4")
            if "fa4" in st.reason:
                raise Unsupported(st.reason["fa4"])
            _warm(_fa4_impl(w, st.kw["fa4"], make_inputs(w, "cuda", torch.bfloat16), fa4),
                  backward)
            torch.cuda.synchronize()
            queue.put((w.key, True, f"compiled in {time.perf_counter() - t:.1f}s"))
        except Exception as e:  # noqa: BLE001
            queue.put((w.key, False, f"{type(e).__name__}: {str(e).strip()[:300]}"))
        finally:
            torch.cuda.empty_cache()


class FA4Pool:
    """``n`` spawned processes compiling FA4 for ``rows`` (one row per configuration,
    round-robin); :meth:`poll` collects what they report, :meth:`close` ends them."""

    def __init__(self, rows, n: int, backward: bool, start_method: str = "spawn"):
        import multiprocessing as mp
        mpc = mp.get_context(start_method)
        self.queue = mpc.Queue()
        firsts = {}
        for w in rows:
            firsts.setdefault(fa4_config(w), w)
        self.config_of = {w.key: fa4_config(w) for w in rows}
        self.expected = len(firsts)
        self.done = {}                            # configuration -> (ok, message)
        jobs = list(firsts.values())
        n = max(1, min(n, len(jobs)))
        self.procs = [mpc.Process(target=_fa4_worker, args=(jobs[i::n], self.queue, backward),
                                  daemon=True) for i in range(n)]
        for p in self.procs:
            p.start()

    def poll(self, timeout: float = 0.0):
        """Collect reports for up to ``timeout`` s (until all are in or no worker lives)."""
        import queue as _queue
        end = time.perf_counter() + timeout
        while len(self.done) < self.expected:
            try:
                key, ok, msg = self.queue.get(timeout=max(0.01, min(1.0, end - time.perf_counter())))
            except _queue.Empty:
                if time.perf_counter() >= end or not any(p.is_alive() for p in self.procs):
                    return
                continue
            self.done[self.config_of[key]] = (ok, msg)
            print(f"   FA4 worker: {key} {'ok, ' if ok else 'failed: '}{msg}", flush=True)

    def result(self, w: Workload):
        """``(ok, message)`` for ``w``'s configuration, or ``None`` (not reported)."""
        return self.done.get(fa4_config(w))

    def close(self):
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(10)


def _fa4_state(w, ctx: Context, rows_left: int) -> str:
    """FA4 in the second pass: compiled by a worker (loads from the disk cache), failed
    there (said once), or compiled here if the budget allows."""
    got = ctx.pool.result(w) if ctx.pool is not None else None
    if got is not None and not got[0]:
        ctx.error("fa4", w, "worker compile", RuntimeError(got[1]), here=False)
        return "failed"
    if got is None and not ctx.peers_open(rows_left):
        print("   FA4 skipped (time budget)", flush=True)
        return "skipped"
    return "warm"


# --- output ----------------------------------------------------------------------------------------

def _tf(x):
    """TFLOP/s as printed (CPU smoke runs give values far below 1)."""
    return "-" if x is None else f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def _best(res: RowResult, measure):
    vals = {p: res.tflops(measure, p) for p in PEERS}
    vals = {p: v for p, v in vals.items() if v}
    if not vals:
        return None, None
    p = max(vals, key=vals.get)
    return p, vals[p]


def _peer_cells(res: RowResult, measure, named: bool):
    ff = res.tflops(measure, "flashfold")
    cells = []
    for p in PEERS:
        v = res.tflops(measure, p)
        cells.append((f"{p} " if named else "") + _tf(v) + (f" ({ff / v:.2f})" if ff and v else ""))
    return cells


def measure_line(res: RowResult, measure) -> str:
    """One measurement of one row, every implementation: the line ``flashfold bench``
    reads (TFLOP/s; in brackets flashfold / peer)."""
    ms = res.ms.get(measure, {}).get("flashfold")
    ff = res.tflops(measure, "flashfold")
    best, bv = _best(res, measure)
    check = {True: "ok", False: "CHECK FAILED", None: "not checked"}[res.check]
    return " | ".join([f"   {measure[0]:<7} {measure[1]:<5}", res.w.model, res.w.shape(),
                       f"flashfold {'-' if ms is None else f'{ms:.3f}'} ms {_tf(ff)}",
                       *_peer_cells(res, measure, True),
                       f"best {PEER_NAMES[best] if best else '-'} {_tf(bv)}",
                       f"ratio {f'{ff / bv:.2f}' if ff and bv else '-'}", check])


def print_tables(results, measures):
    """One markdown table per direction and mode."""
    for measure in measures:
        print(f"\n### {TITLES[measure]} (TFLOP/s; in brackets flashfold / peer)")
        print("| model | shape | flashfold ms | TFLOP/s | cuDNN | FA2 | FA4 | Flex | best peer "
              "| ratio to best |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---|---:|")
        for res in results:
            ff = res.tflops(measure, "flashfold")
            ms = res.ms.get(measure, {}).get("flashfold")
            mark = " (check failed)" if res.check is False else ""
            best, bv = _best(res, measure)
            shape = res.w.shape() + ("" if res.run else " (not run)")
            print(f"| {res.w.model} | {shape} | {'-' if ms is None else f'{ms:.3f}'} | "
                  f"{_tf(ff)}{mark} | " + " | ".join(_peer_cells(res, measure, False)) +
                  f" | {PEER_NAMES[best] + ' ' + _tf(bv) if best else '-'} | "
                  f"{f'{ff / bv:.2f}' if ff and bv else '-'} |")


def print_flop_table(rows):
    """The FLOP count of every full-size row."""
    print("\n== FLOPs of the full-size rows (forward; backward 2.5x)")
    for w in rows:
        print(f"   flops {w.key:<22} pairs={w.pairs()} fwd={w.flops('fwd'):.0f} "
              f"bwd={w.flops('bwd'):.0f}" + (f" docs={','.join(map(str, w.docs))}" if w.docs else ""))


def print_summary(results, ctx: Context):
    """The varlen target (packed documents against equal lengths) and what did not run."""
    by = {r.w.key: r for r in results}
    for var, eq in (("llama-varlen", "llama-equal"), ("llama-varlen", "llama-equal-docs")):
        if not (var in by and eq in by and by[var].run and by[eq].run):
            continue
        parts = []
        for measure in ctx.measures:
            f = [(by[var].tflops(measure, p), by[eq].tflops(measure, p)) for p in ("flashfold", "fa4")]
            parts.append(f"{measure[0]} {measure[1]} flashfold "
                         + (f"{f[0][0] / f[0][1]:.2f}" if f[0][0] and f[0][1] else "-")
                         + (f" (FA4 {f[1][0] / f[1][1]:.2f})" if f[1][0] and f[1][1] else ""))
        print(f"varlen / equal lengths ({eq}, TFLOP/s ratio; target >= 0.97): " + "; ".join(parts))
    for (peer, reason), keys in ctx.unsupported.items():
        print(f"   {PEER_NAMES[peer]} not run ({reason}): {', '.join(keys)}")


# --- main ------------------------------------------------------------------------------------------

def _load_peers(ctx: Context, rows):
    """FlexAttention (compiled on CUDA, eager on CPU) and FlashAttention-4 (CUDA only; its
    workers start here)."""
    if "flex" in ctx.peers:
        try:
            from torch.nn.attention.flex_attention import flex_attention
            if ctx.dev == "cuda":
                import torch._dynamo
                cfg = torch._dynamo.config
                cfg.cache_size_limit = max(64, cfg.cache_size_limit)
                if hasattr(cfg, "recompile_limit"):
                    cfg.recompile_limit = max(64, cfg.recompile_limit)
                # the eager backward is timed as autograd.grad of a retained forward, which
                # a compiled backward with donated buffers refuses
                import torch._functorch.config as functorch_config
                functorch_config.donated_buffer = False
                ctx.flex = torch.compile(flex_attention, dynamic=False)
            else:
                ctx.flex = flex_attention
        except Exception as e:  # noqa: BLE001
            ctx.flex_reason = f"did not load: {type(e).__name__}: {e}"
            print(f"   FlexAttention {ctx.flex_reason}")
    if "fa4" not in ctx.peers:
        return
    if ctx.dev != "cuda":
        ctx.fa4_reason = "needs CUDA"
        return
    # FA4's kernels go to its disk cache too, where the workers' compiles are found
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", FA4_CACHE)
    try:
        import flash_attn.cute as fa4
    except Exception as e:  # noqa: BLE001
        ctx.fa4_reason = f"did not import: {type(e).__name__}: {e}"
        print(f"   FlashAttention-4 {ctx.fa4_reason}")
        return
    ctx.fa4 = fa4
    try:
        from importlib.metadata import version
        print(f"   FlashAttention-4 {version('flash-attn-4')}, nvidia-cutlass-dsl "
              f"{version('nvidia-cutlass-dsl')}")
    except Exception:  # noqa: BLE001
        print("   FlashAttention-4 imported (version not found)")
    if ctx.args.fa4_workers > 0:
        try:
            ctx.pool = FA4Pool(rows, ctx.args.fa4_workers, not ctx.args.fwd_only)
            print(f"   FA4: {ctx.pool.expected} configurations compiling in "
                  f"{len(ctx.pool.procs)} worker processes", flush=True)
        except Exception as e:  # noqa: BLE001
            ctx.pool = None
            print(f"   FA4 workers did not start ({type(e).__name__}: {e}); compiling here")


def select(args) -> list[Workload]:
    """The grid's rows for ``--quick`` / ``--rows``."""
    rows = grid()
    if args.quick:
        rows = [w for w in rows if w.quick]
    if args.rows:
        wanted = [s.strip().lower() for s in args.rows.split(",") if s.strip()]
        rows = [w for w in rows if any(s in w.key.lower() or s in w.model.lower()
                                       or s in w.shape().lower() for s in wanted)]
    return rows


def _attention_helpers():
    """``benchmarks/attention.py`` as a module (its ``_bench`` and ``_matmul_ceiling``)."""
    spec = importlib.util.spec_from_file_location("flashfold_benchmarks_attention",
                                                  os.path.join(HERE, "attention.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_rows(results, ctx: Context):
    """Both passes over the rows (a KeyboardInterrupt ends them; the caller prints)."""
    n = len(results)
    print(f"\n== first pass: warm-up, check against float64 ({n} rows)")
    for i, res in enumerate(results):
        if not ctx.rows_open():
            break
        w, t = res.w, time.perf_counter()
        print(f"-- [{i + 1}/{n}] {w.key}: {w.model} | {w.shape()} | "
              f"{w.flops() / 1e9:.1f} GFLOP forward", flush=True)
        first_pass(w, ctx, res)
        if ctx.pool is not None:
            ctx.pool.poll()
        print(f"   ({time.perf_counter() - t:.1f}s; total {ctx.elapsed():.0f}s)", flush=True)
    if ctx.pool is not None:
        t = time.perf_counter()
        ctx.pool.poll(timeout=max(0.0, ctx.args.budget - 10 * n - ctx.elapsed()))
        ctx.pool.close()
        print(f"   FA4 workers: {len(ctx.pool.done)}/{ctx.pool.expected} configurations "
              f"reported, waited {time.perf_counter() - t:.0f}s; workers ended", flush=True)
    print(f"\n== second pass: check against a peer, then time ({n} rows)")
    for i, res in enumerate(results):
        w = res.w
        if not ctx.rows_open() or w.key not in ctx.static:
            why = "time budget" if ctx.dead is None else f"CUDA error: {ctx.dead}"
            print(f"-- [{i + 1}/{n}] {w.key}: not run ({why})", flush=True)
            continue
        t = time.perf_counter()
        print(f"-- [{i + 1}/{n}] {w.key}: {w.model} | {w.shape()}", flush=True)
        second_pass(w, ctx, n - i, res)
        print(f"   ({time.perf_counter() - t:.1f}s; total {ctx.elapsed():.0f}s)", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="4 rows: Llama 4K, packed documents, equal lengths; Gemma-2 softcap")
    ap.add_argument("--fwd-only", action="store_true", help="forward measurements only")
    ap.add_argument("--rows", default="", help="only rows whose key, model or shape contains one "
                    "of these comma-separated strings")
    ap.add_argument("--no-peers", action="store_true", help="flashfold only")
    ap.add_argument("--kernels", action="store_true",
                    help="after each row's timings, what each implementation's eager call "
                    "runs (torch.profiler): its kernels' device times per call against the "
                    "eager time, which tells a host-bound call from a kernel-bound one")
    ap.add_argument("--mask-cost", action="store_true",
                    help="after the timings of a row with a block mask, flashfold's forward "
                    "from a CUDA graph with the mask as written where it runs as intervals of "
                    "keys, with the same block lists but one compare per pair in their "
                    "PARTIAL tiles, and with every listed tile FULL (timing only): the share "
                    "of the row that evaluating its mask takes")
    ap.add_argument("--smoke", action="store_true", help="CPU dry run at tiny sizes (for CI)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds (default 500, --quick 200): no peer compile past budget - 10 s "
                    "per row still to time, no new row past budget + 40 s")
    ap.add_argument("--fa4-workers", type=int, default=8,
                    help="processes compiling FA4 during the first pass (0: compile here)")
    args = ap.parse_args(argv)
    if args.budget is None:
        args.budget = 200.0 if args.quick else 500.0
    if not args.smoke and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --smoke for the CPU dry run)")
        return 2
    import triton
    dev = "cpu" if args.smoke else "cuda"
    where = ("cpu (smoke run: sizes / 64, times are not measurements)" if args.smoke
             else torch.cuda.get_device_name())
    print(f"torch {torch.__version__}, triton {triton.__version__}, {where}, "
          f"python {sys.version.split()[0]}")
    full = select(args)
    rows = [w.smoke() for w in full] if args.smoke else full
    ctx = Context(args, dev, torch.bfloat16, len(rows))
    print(f"== workloads: grid {'quick' if args.quick else 'full'}, rows "
          f"{repr(args.rows) if args.rows else 'all'}, directions "
          f"{'fwd' if args.fwd_only else 'fwd+bwd'}, peers {' '.join(ctx.peers) or 'none'}, "
          f"bfloat16, {TOKENS} tokens per batch, do_bench median")
    print_flop_table(full)
    if dev == "cuda":
        try:
            att = _attention_helpers()
            ctx.bench = att._bench
            print(f"   bf16 matmul 8192^3 in this run: {att._matmul_ceiling():.0f} TFLOP/s")
        except Exception as e:  # noqa: BLE001
            import triton.testing
            ctx.bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100,  # noqa: E731
                                                           return_mode="median")
            print(f"   benchmarks/attention.py helpers failed ({type(e).__name__}: {e}); "
                  "timing with triton.testing.do_bench directly")
    results = [RowResult(w) for w in rows]
    try:
        _load_peers(ctx, rows)
        run_rows(results, ctx)
    except KeyboardInterrupt:
        print(f"\ninterrupted after {ctx.elapsed():.0f}s; the tables hold what was measured")
    finally:
        if ctx.pool is not None:
            ctx.pool.close()
    print_tables(results, ctx.measures)
    print()
    print_summary(results, ctx)
    checked = [r for r in results if r.check is not None]
    passed = sum(1 for r in checked if r.check)
    print(f"== checks: {passed}/{len(checked)} rows passed, {len(results) - len(checked)} "
          "not checked")
    ok = passed == len(checked) and ctx.dead is None
    print(f"total {ctx.elapsed():.0f}s; checks {'PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
