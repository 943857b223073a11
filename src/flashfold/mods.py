"""Ready-made ``score_mod`` / ``mask_mod`` functions for :func:`flashfold.attention`.

Each is written over :mod:`flashfold.ops` (traced and compiled into the kernel); factories
return closures with a stable ``__name__``. Compose masks with :func:`and_masks` /
:func:`or_masks`. See :mod:`flashfold.kernels.attention.mods` for the conventions.

mask_mods: :func:`causal_mask`, :func:`sliding_window_mask`, :func:`document_mask`,
:func:`prefix_lm_mask`, :func:`key_padding_mask`; score_mods: :func:`alibi`,
:func:`relative_bias`, :func:`softcap_mod`.
"""

from .kernels.attention.mods import (alibi, alibi_slopes, and_masks, causal_mask,  # noqa: F401
                                     document_mask, key_padding_mask, or_masks,
                                     prefix_lm_mask, relative_bias, sliding_window_mask,
                                     softcap_mod)

__all__ = ["alibi", "alibi_slopes", "and_masks", "causal_mask", "document_mask",
           "key_padding_mask", "or_masks", "prefix_lm_mask", "relative_bias",
           "sliding_window_mask", "softcap_mod"]
