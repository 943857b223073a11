"""``flashfold::monoid``: a reduction, segmented reduction, scan or row map
(:func:`flashfold.api.folds.run`) as one ``torch.library`` custom op, so that
``torch.compile`` traces :mod:`flashfold.api.reductions` calls as one node each (the
kernel launch and the NumPy reference, which Dynamo cannot trace, run inside it). The
monoid or row map travels as its registry key (:func:`flashfold.api.folds.name`).
Imported by the reductions only while compiling.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from . import folds


@torch.library.custom_op("flashfold::monoid", mutates_args=())
def monoid_op(xs: List[torch.Tensor], offsets: Optional[torch.Tensor], key: str, kind: str,
              tupled: bool, dim: int, reverse: bool, check: bool, names: str,
              values: List[float], out_dtype: torch.dtype, asked: Optional[torch.dtype],
              shape: List[int], width: Optional[int], kernels: bool) -> List[torch.Tensor]:
    """:func:`~flashfold.api.folds.run` of ``kind`` by ``named(key)`` over ``xs`` (one
    tensor, or a monoid's inputs with ``tupled``); ``names`` (comma-separated) /
    ``values`` the finalize parameters; ``shape`` / ``width`` the outputs' (for the fake implementation)."""
    outs = folds.run(kind, folds.named(key), tuple(xs) if tupled else xs[0], dim,
                     _params(names, values), out_dtype, kernels=kernels, asked=asked,
                     reverse=reverse, offsets=offsets, check=check)
    # an op's outputs may not alias its inputs
    inputs = {t.untyped_storage().data_ptr() for t in xs}
    return [o.clone() if o.untyped_storage().data_ptr() in inputs else o for o in outs]


def _params(names: str, values) -> dict:
    return dict(zip(names.split(","), values)) if names else {}


@monoid_op.register_fake
def _monoid_op_fake(xs, offsets, key, kind, tupled, dim, reverse, check, names, values,
                    out_dtype, asked, shape, width, kernels):
    if kind == "normalize":
        return [xs[0].new_empty(shape, dtype=out_dtype)]
    return list(folds.empty_outs(folds.named(key), shape, xs[0], _params(names, values),
                                 out_dtype, width))


__all__ = ["monoid_op"]
