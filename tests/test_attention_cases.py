"""Shared cases for the attention tests: shapes, features, inputs and the float64 oracle."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from flashfold import mods
from flashfold.kernels.attention.mods import trace_mask_mod, trace_score_mod
from flashfold.kernels.attention.reference import naive_attention


@dataclass(frozen=True)
class Shape:
    B: int
    HQ: int
    HK: int
    NQ: int
    NK: int
    D: int
    DV: int | None = None

    @property
    def id(self):
        dv = "" if self.DV in (None, self.D) else f"-dv{self.DV}"
        return f"B{self.B}-H{self.HQ}:{self.HK}-q{self.NQ}-k{self.NK}-d{self.D}{dv}"


def make_qkv(shape: Shape, dtype, seed=0, scale=1.0, layout="bhnd"):
    """Random q, k, v; ``layout="bnhd"`` gives (B, S, H, D) storage viewed as (B, H, S, D)."""
    g = torch.Generator().manual_seed(seed)
    dv = shape.DV or shape.D

    def rnd(h, n, d):
        if layout == "bnhd":
            return (torch.randn(shape.B, n, h, d, generator=g) * scale).to(dtype).transpose(1, 2)
        return (torch.randn(shape.B, h, n, d, generator=g) * scale).to(dtype)
    return rnd(shape.HQ, shape.NQ, shape.D), rnd(shape.HK, shape.NK, shape.D), rnd(shape.HK, shape.NK, dv)


@dataclass(frozen=True)
class Feature:
    """Keyword arguments of ``flashfold.attention`` (mods as factories of the shape)."""
    name: str
    kwargs: dict = field(default_factory=dict)
    score_mod: object = None          # shape -> score_mod
    mask_mod: object = None           # shape -> mask_mod
    varlen: tuple | None = None       # (lens_q, lens_k): packed sequences

    def build(self, shape: Shape):
        kw = dict(self.kwargs)
        if self.score_mod is not None:
            kw["score_mod"] = self.score_mod(shape)
        if self.mask_mod is not None:
            kw["mask_mod"] = self.mask_mod(shape)
        return kw


def _docs(n, sizes=(5, 11, 3)):
    out, i, doc = [], 0, 0
    while len(out) < n:
        out += [doc] * sizes[i % len(sizes)]
        i += 1
        doc += 1
    return torch.tensor(out[:n])


def _doc_mask(s: Shape):
    return mods.document_mask(_docs(s.NQ), _docs(s.NK))


def _rel_bias(s: Shape):
    g = torch.Generator().manual_seed(7)
    return mods.relative_bias(torch.randn(s.HQ, 2 * 6 + 1, generator=g))


FEATURES = [
    Feature("plain"),
    Feature("causal", {"causal": True}),
    Feature("window-3-2", {"window": (3, 2)}),
    Feature("window-left-5", {"window": (5, None)}),
    Feature("window-right-1", {"window": (-1, 1)}),
    Feature("causal-window-4", {"causal": True, "window": (4, 7)}),
    Feature("softcap", {"softcap": 2.0, "scale": 1.5}),
    Feature("alibi", {"causal": True}, score_mod=lambda s: mods.alibi(s.HQ)),
    Feature("relbias", score_mod=_rel_bias),
    Feature("document", mask_mod=_doc_mask),
    Feature("document-causal", {"causal": True}, mask_mod=_doc_mask),
    Feature("prefix-lm", mask_mod=lambda s: mods.prefix_lm_mask(5)),
    Feature("key-padding", mask_mod=lambda s: mods.key_padding_mask(
        torch.tensor([max(1, s.NK - 7 * b) for b in range(s.B)]))),
    Feature("softcap-mod-mask", {"softcap": 5.0},
            score_mod=lambda s: mods.alibi(s.HQ),
            mask_mod=lambda s: mods.sliding_window_mask(6, 2)),
]


def oracle(q, k, v, **kw):
    """The float64 naive attention for public-API keyword arguments (mods traced to torch)."""
    kw = dict(kw)
    kw.pop("return_lse", None)
    sm, mm = kw.pop("score_mod", None), kw.pop("mask_mod", None)
    if sm is not None:
        kw["score_mod"] = trace_score_mod(sm).torch_fn(q.device)
    if mm is not None:
        mm = getattr(mm, "mod", None) or trace_mask_mod(mm)
        kw["mask_mod"] = mm.torch_fn(q.device)
    window = kw.get("window")
    if window is not None:
        kw["window"] = tuple(None if w is None or w < 0 else w for w in window)
    return naive_attention(q, k, v, **kw)


def varlen_inputs(lens_q, lens_k, HQ, HK, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(1, HQ, tq, D, generator=g).to(dtype)
    k = torch.randn(1, HK, tk, D, generator=g).to(dtype)
    v = torch.randn(1, HK, tk, D, generator=g).to(dtype)
    cu_q = torch.tensor([0] + list(_cumsum(lens_q)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(_cumsum(lens_k)), dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def _cumsum(xs):
    t = 0
    for x in xs:
        t += x
        yield t


def out_scale(v):
    """o is a convex combination of v's rows: its error scales with max |v|."""
    return max(1.0, float(v.abs().max()))


def lse_scale(lse):
    finite = lse[torch.isfinite(lse)]
    return max(1.0, float(finite.abs().max())) if finite.numel() else 1.0


__all__ = ["Shape", "Feature", "FEATURES", "make_qkv", "oracle", "varlen_inputs", "out_scale",
           "lse_scale", "math"]


# --- the oracle itself ----------------------------------------------------------------------

def test_oracle_matches_torch_sdpa_math_in_float64():
    """The naive float64 oracle agrees with torch's own attention (no mods, no GQA)."""
    import pytest
    from flashfold.testing import assert_close
    F = pytest.importorskip("torch.nn.functional")
    s = Shape(2, 3, 3, 17, 17, 32)
    q, k, v = make_qkv(s, torch.float64, seed=11)
    for causal in (False, True):
        o, _ = naive_attention(q, k, v, causal=causal)
        assert_close(o, F.scaled_dot_product_attention(q, k, v, is_causal=causal), "float64",
                     name=f"oracle causal={causal}")
