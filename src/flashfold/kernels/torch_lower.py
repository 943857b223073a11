"""The torch lowering of the IR: traced graphs as torch expressions.

Used by the CPU paths of the tensor entry points (score_mod / mask_mod on CPU tensors) and
wherever autograd must differentiate through a traced function. Python scalars are
promoted to tensors of the other operand's dtype/device where torch needs tensors; one
without a tensor operand (a constant, a finalize parameter) to a float64 0-d tensor, as
the NumPy lowering computes it (a 0-d tensor keeps a float32 / float16 operand's dtype;
torch's default dtype, float32, would round it for the float64 paths).
"""

from __future__ import annotations

import math

import torch

from ..algebra.lower import Backend, register_backend


def _t(x, like):
    if isinstance(x, torch.Tensor):
        return x
    ref = like if isinstance(like, torch.Tensor) else None
    if ref is None:
        return _num(x)
    if isinstance(x, float):
        return torch.as_tensor(x, dtype=ref.dtype if ref.is_floating_point() else torch.float64,
                               device=ref.device)
    return torch.as_tensor(x, device=ref.device)


def _max(a, b):
    return torch.maximum(_t(a, b), _t(b, a))


def _min(a, b):
    return torch.minimum(_t(a, b), _t(b, a))


def _num(x):
    """A Python (or NumPy) number as a 0-d tensor: a float one in float64."""
    x = torch.as_tensor(x)
    return x.double() if x.is_floating_point() else x


def _float(x):
    if not isinstance(x, torch.Tensor):
        return torch.as_tensor(x, dtype=torch.float64)
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())


def _unary(fn):
    def f(x):
        return fn(x if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=torch.float64))
    return f


def _const(v) -> str:
    if isinstance(v, (bool, int)):
        return repr(v)
    if math.isinf(v):
        return "math.inf" if v > 0 else "(-math.inf)"
    return repr(float(v))


def _load(buf, idx):
    idx = torch.as_tensor(idx)
    return buf[idx.clamp(0, buf.numel() - 1).long()]


_UNARY = {"exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "log2": torch.log2,
          "log1p": torch.log1p, "expm1": torch.expm1, "sqrt": torch.sqrt, "abs": torch.abs,
          "tanh": torch.tanh, "sigmoid": torch.sigmoid, "floor": torch.floor,
          "not": torch.logical_not, "isnan": torch.isnan, "isinf": torch.isinf}

TORCH = register_backend(Backend(
    "torch",
    {**{op: f"_u_{op}({{0}})" for op in _UNARY},
     "neg": "(-{0})", "to_float": "_float({0})", "to_int": "torch.as_tensor({0}).long()",
     "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})",
     "floordiv": "({0} // {1})", "mod": "({0} % {1})", "pow": "torch.pow(_t({0}, {1}), {1})",
     "maximum": "_max({0}, {1})", "minimum": "_min({0}, {1})",
     "lt": "({0} < {1})", "le": "({0} <= {1})", "gt": "({0} > {1})", "ge": "({0} >= {1})",
     "eq": "({0} == {1})", "ne": "({0} != {1})",
     "and": "torch.logical_and(_t({0}, {1}), _t({1}, {0}))",
     "or": "torch.logical_or(_t({0}, {1}), _t({1}, {0}))",
     "where": "torch.where({0}, {1}, {2})",
     "rsum": "torch.sum({0}, dim={axis})", "rmax": "torch.amax({0}, dim={axis})",
     "rmin": "torch.amin({0}, dim={axis})", "csum": "torch.cumsum({0}, dim={axis})",
     "load": "_load({buf}, {0})"},
    _const,
    {"torch": torch, "math": math, "_t": _t, "_max": _max, "_min": _min, "_float": _float,
     "_load": _load, **{f"_u_{op}": _unary(fn) for op, fn in _UNARY.items()}},
    reduce_axis=0,
    convert_buffer=lambda data: torch.as_tensor(data).reshape(-1)))
TORCH.check_complete()
