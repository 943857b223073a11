"""Which attention kernel runs a call, and the switches that change it (the policy).

The table (forward: :func:`forward_gluon`; backward: :func:`backward_gluon`), read by the
planners of :mod:`.fwd` and :mod:`.bwd` and by the block-mask tiling that must agree with
them (``fwd.mask_tiles``, ``bwd.mask_tiles``):

============================================  =========================  =====================
call                                          forward                    backward
============================================  =========================  =====================
sm_90, ``policy.gluon``, 16-bit ``q, k, v``   the Gluon kernel           the Gluon kernel
TMA can address, head dims of a Gluon tile    (:mod:`.gluon_fwd`)        (:mod:`.gluon_bwd`)
plan, no forced ``config`` (backward: nor
``atomic_dq=False``, nor the interpreter),
in the kernel's scope: dense, causal,
window, softcap, GQA, packed sequences, a
score_mod Gluon lowers, a block mask of
whole tiles (forward: dense calls;
backward: :func:`.gluon_bwd.fits_mods`)
FP8 (E4M3 ``q, k, v`` with ``descales``) on   the Gluon kernel on its    (raises: forward
sm_90, ``policy.gluon``, no forced            E4M3 descriptors           only)
``config``, a Gluon head-dim plan, ``v``
keys-contiguous with its transpose TMA
can address (``Nk`` a multiple of 16)
FP8 elsewhere (GPUs before Hopper, the CPU    the Triton template's      (raises)
interpreter, ``policy.gluon`` off, other      ``FP8`` flag
head dims or ``v`` layouts)
everything else: GPUs before Hopper, the CPU  the Triton template        the Triton kernels
interpreter, ``policy.gluon`` off, calls      (:mod:`.fwd`)              (:mod:`.bwd`)
outside the Gluon scopes above
============================================  =========================  =====================

Inside each kernel its schedule's variants (ping-pong, persistent programs, late
statistics, TMA stores) are chosen by the measured rules beside it
(``gluon_fwd.pingpong_default``, ``gluon_bwd.persistent_default``, ...), and the Triton
kernels' tiles by their tables (``fwd.HOPPER_CONFIGS``, ``bwd.HOPPER_BWD_CONFIGS``).

The policy (:class:`Policy`) holds the switches that are not arguments of a call: which
kernels may run and which guards are on. :func:`current` is the one in force: the
last-entered open :func:`using` block's, else the default, whose ``gluon`` follows the
``FLASHFOLD_GLUON`` environment variable (``0``: off) as it is at the call. A block's
policy holds for the whole process while it runs, as ``torch.backends`` switches do:
autograd runs a CUDA backward on its own thread, which a per-thread setting would not
reach. The planners key their cached plans on it, so a change takes effect at the next
call, and both settings keep their plans.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

from .. import launcher


@dataclass(frozen=True)
class Policy:
    """The attention kernels' switches (every field on by default).

    ``gluon``: the warp-specialized Gluon kernels run where the table above sends a call
    (off: the Triton kernels everywhere). ``tma``: the Triton kernels load through TMA
    descriptors where strides allow (off: pointers). ``atomic_dq``: the Triton backward's
    default mode adds ``dQ`` with fp32 atomics where its configuration table picks them
    (off: the deterministic dQ kernel everywhere, as ``deterministic=True`` runs).
    ``strict_hidden``: forwards whose masked tiles can hold hidden keys flag non-finite
    output tiles and recompute them strictly, so a hidden key's NaN never reaches a row
    (off: ``0 x NaN`` may reach it, FlashAttention's behaviour; only to measure the
    guard, ``benchmarks/attention_strict.py``). ``strict_nonfinite``: the backward's
    flag and strict recompute of the same rule (off only to measure it,
    ``benchmarks/nonfinite_bwd_cost.py``)."""

    gluon: bool = True
    tma: bool = True
    atomic_dq: bool = True
    strict_hidden: bool = True
    strict_nonfinite: bool = True

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if not isinstance(getattr(self, field.name), bool):
                raise TypeError(f"{field.name}: expected a bool, got "
                                f"{type(getattr(self, field.name)).__name__}")
        # every plan-cache lookup hashes the policy: computed once here (dev machine: a
        # lookup's hash of it 400 -> 120 ns)
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:
        return self._hash


class _Blocks:
    """The :func:`using` blocks open now, in the order they were entered, and the policy
    in force (the last one's; None: none open). A block leaves its own entry on exit, so
    blocks that close out of order (two threads' blocks, interleaved) leave the policy of
    the blocks still open, and the default once all are closed. (An object compared by
    identity: the plan caches watch this module's globals, and it stays the same.)"""

    __slots__ = ("open", "policy", "lock")

    def __init__(self):
        self.open: list = []
        self.policy: Policy | None = None
        self.lock = threading.Lock()

    def enter(self, block, policy: Policy):
        with self.lock:
            self.open.append((block, policy))
            self.policy = policy

    def leave(self, block):
        with self.lock:
            for i in range(len(self.open) - 1, -1, -1):     # (its last entry: re-entered)
                if self.open[i][0] is block:
                    del self.open[i]
                    break
            self.policy = self.open[-1][1] if self.open else None


_DEFAULT = Policy()
_NO_GLUON = Policy(gluon=False)
_ACTIVE = _Blocks()


def current() -> Policy:
    """The policy in force: the last-entered open :func:`using` block's, else the default
    (``gluon`` off while the environment has ``FLASHFOLD_GLUON=0``)."""
    active = _ACTIVE.policy
    if active is not None:
        return active
    return _NO_GLUON if launcher.env("FLASHFOLD_GLUON") == "0" else _DEFAULT


class using:
    """A block (``with using(gluon=False):``) run under the current policy with
    ``changes`` (fields of :class:`Policy`), process-wide; the policy of the blocks still
    open is back on exit. ``as`` gives the policy in force inside. The switches are checked
    when the block is made; its policy is the one in force on entry with ``changes`` (a
    block object can be entered again)."""

    def __init__(self, **changes):
        names = {f.name for f in dataclasses.fields(Policy)}
        for name in changes:
            if name not in names:
                raise TypeError(f"{name}: not a switch of the attention policy (its "
                                f"switches: {', '.join(sorted(names))})")
        Policy(**changes)                       # the values' check, before the block
        self.changes = changes

    def __enter__(self) -> Policy:
        policy = dataclasses.replace(current(), **self.changes)
        _ACTIVE.enter(self, policy)
        return policy

    def __exit__(self, *exc):
        _ACTIVE.leave(self)
        return False


def forward_gluon(q, k, v, *, scale, softcap=None, left=None, right=None, score_mod=None,
                  block_mask=None, varlen: bool = False, config=None,
                  policy: Policy | None = None) -> bool:
    """Whether the forward of this call runs the Gluon kernel (the table's first row):
    the policy lets it, no forced Triton ``config``, a score_mod Gluon lowers
    (:attr:`.mods.TracedMod.gluon_ok`), :func:`.gluon_fwd.eligible` (sm_90, dtypes, E4M3
    included, head dims, strides, bounds), and a block mask only on dense calls in
    whole tiles (:func:`.gluon_fwd.fits_block_mask`). An FP8 call has no mods, and
    takes the Gluon kernel's E4M3 descriptors where it is eligible."""
    from . import gluon_fwd          # (Triton: imported by the planners, not by the policy)

    policy = policy or current()
    return (policy.gluon and config is None
            and (score_mod is None or score_mod.gluon_ok)
            and gluon_fwd.eligible(q, k, v, scale=scale, left=left, right=right,
                                   softcap=softcap)
            and (block_mask is None
                 or (not varlen and gluon_fwd.fits_block_mask(q, v, block_mask))))


def backward_gluon(q, k, v, do, *, softcap=None, left=None, right=None, score_mod=None,
                   mask_mod=None, mask_block=None, cu_seqlens_q=None, cu_seqlens_k=None,
                   deterministic: bool = False, config=None, atomic_dq: bool | None = None,
                   interpret: bool | None = None, policy: Policy | None = None) -> bool:
    """Whether the backward of this call runs the Gluon kernel (the table's first row):
    the policy lets it, not interpreted (``interpret``: as the launch is built; default
    ``TRITON_INTERPRET``), no forced Triton ``config``, ``atomic_dq`` not ``False``
    (which asks for the Triton dQ kernel), :func:`.gluon_bwd.eligible` (sm_90, the
    forward's head dims, every row seeing a key), the mods it lowers
    (:func:`.gluon_bwd.fits_mods`: a score_mod, a block mask of ``mask_mod`` in blocks of
    ``mask_block``), and packed sequences in its varlen scope
    (:func:`.gluon_bwd.supported_varlen`)."""
    from . import gluon_bwd

    policy = policy or current()
    varlen = cu_seqlens_q is not None
    interpret = launcher.interpreting() if interpret is None else interpret
    return (policy.gluon and config is None and atomic_dq is not False and not interpret
            and gluon_bwd.eligible(q, k, v, do, left=left, right=right, softcap=softcap)
            and gluon_bwd.fits_mods(q, v, score_mod=score_mod, mask_mod=mask_mod,
                                    mask_block=mask_block, left=left, right=right,
                                    deterministic=deterministic, varlen=varlen)
            and (not varlen or gluon_bwd.supported_varlen(
                q, k, v, do, cu_seqlens_q, cu_seqlens_k, deterministic=deterministic,
                left=left, right=right, softcap=softcap)))


__all__ = ["Policy", "current", "using", "forward_gluon", "backward_gluon"]
