"""Score modifications, mask modifications and block masks for exact attention.

A *score_mod* and a *mask_mod* are small Python functions over :mod:`flashfold.ops`::

    def alibi_mod(score, b, h, q_idx, kv_idx):          # -> the modified score
        return score + slopes[h] * ops.to_float(kv_idx - q_idx)

    def document(b, h, q_idx, kv_idx):                  # -> True where the key is visible
        return docs[q_idx] == docs[kv_idx]

``b`` is the batch index (the sequence index with ``cu_seqlens``), ``h`` the *query* head,
``q_idx`` / ``kv_idx`` the positions inside the sequence (0-based, before any bottom-right
alignment), ``score`` the scaled (and soft-capped) score in natural-log units. Tables a
function reads are captured with ``ops.Buffer(tensor)``. A table must cover every index
the function forms for ``b < B`` (batch, or sequences with ``cu_seqlens``), ``h < H``
(query heads), ``q_idx < N_q``, ``kv_idx < N_k`` (per sequence): ``attention`` and
:func:`create_block_mask` raise ``ValueError`` naming the mod, the table and the sizes
before computing anything (:meth:`TracedMod.check_tables`; e.g. ``document_mask`` with 10
ids for 16 positions, ``alibi(2)`` on 4 heads). To read a shorter table on purpose, clamp
the index in the function (``tab[ops.minimum(q_idx, n - 1)]``); an index computed from a
value (the score, another table's entry) is not checked. A mask_mod returns a truth value
(a comparison, ``&``, ``|``, ``~``, a bool, an entry of a bool table, or a ``where``
between them) and a score_mod a score: the trace raises ``TypeError`` naming the mod
otherwise (an integer mask would be read as "nonzero is visible", a boolean score as 0 / 1:
both silently wrong), and for a function that does not take its positions.

Each function is traced once (per function object) into the same IR the monoids use
(:func:`trace_score_mod`, :func:`trace_mask_mod` -> :class:`TracedMod`) and lowered

* to torch (:meth:`TracedMod.torch_fn`), for the CPU path and for the block-mask
  computation;
* to one ``@triton.jit`` function with a *fixed* signature (:meth:`TracedMod.triton_fn`)::

      score_fn(score, b, h, q_idx, kv_idx, BUFS) -> score
      mask_fn(b, h, q_idx, kv_idx, BUFS)        -> visible

  ``BUFS`` is the tuple ``(B0, N0, B1, N1, ...)`` of the pointer and element count of
  each captured buffer (:meth:`TracedMod.buffer_args`; ``()`` for a mod without tables),
  one kernel argument whatever the mod captures. The
  kernel calls it on a ``[BLOCK_M, BLOCK_N]`` score tile with ``q_idx`` of shape
  ``[BLOCK_M, 1]`` and ``kv_idx`` of shape ``[1, BLOCK_N]`` (int32); ``b`` and ``h``
  are scalars.

The traced :class:`~flashfold.algebra.ir.Graph` stays reachable (``TracedMod.graph``) so
that the backward pass can differentiate the same expression.

Block masks
-----------
A mask_mod is evaluated once per ``(BLOCK_M x BLOCK_N)`` tile of the score matrix
(:func:`create_block_mask`): a tile is EMPTY (no visible pair: skipped entirely), FULL
(every pair of a real query row is visible: no mask is evaluated) or PARTIAL (the kernel
evaluates ``mask_mod`` elementwise). The kernel walks, per query tile, the list of PARTIAL
tiles and then the list of FULL tiles, so hidden tiles cost nothing and the loads stay
pipelinable. :class:`BlockMask` holds the dense state table and the two sorted lists;
``attention`` computes one from a callable ``mask_mod`` on first use and caches it (keyed
by the traced expression, the captured tables' identity and version, the shapes and the
built-in masks), or takes a precomputed one.

The ready-made mods users call (:func:`~flashfold.mods.causal_mask`,
:func:`~flashfold.mods.document_mask`, :func:`~flashfold.mods.alibi`, ...) are user code
written over :mod:`flashfold.ops` like any other, and live above the kernels, in
:mod:`flashfold.mods`; nothing here imports them.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import numbers
import threading
import weakref
from collections import OrderedDict

import torch

from ...algebra.autodiff import derivative
from ...algebra.ir import BOOLEAN, Buffer, Graph, Var, is_bool, trace
from ...algebra.lower import function_source
from ..torch_lower import TORCH

SCORE_INPUTS = (Var("score"), Var("b"), Var("h"), Var("q_idx"), Var("kv_idx"))
MASK_INPUTS = (Var("b"), Var("h"), Var("q_idx"), Var("kv_idx"))

#: block states in :attr:`BlockMask.state`
EMPTY, PARTIAL, FULL = 0, 1, 2


# --- traced mods ----------------------------------------------------------------------

class TracedMod:
    """A score_mod or mask_mod traced into the IR, with its torch and Triton lowerings.

    Attributes: ``kind`` (``"score"`` or ``"mask"``), ``fn`` (the user's function),
    ``graph`` (the traced :class:`Graph`), ``name``. ``key`` is the content hash of the
    expression (captured tables enter by shape, not value).
    """

    def __init__(self, kind: str, fn, graph: Graph):
        self.kind = kind
        self.fn = fn
        self.graph = graph
        self.name = getattr(fn, "__name__", kind + "_mod")
        self.key = graph.key()
        self._torch: dict = {}
        self._args: dict = {}
        self._triton = None
        self._gluon = None
        self._lock = threading.Lock()
        self.reads = _table_reads(graph)
        self._shapes = tuple(tuple(b.shape) for b in graph.buffers)
        self._in_range: set = set()               # sizes already checked (eager calls)
        #: for a mask made by :func:`as_intervals`: the graph of its bounds ``(first,
        #: last)`` (two outputs, the same tables in the same order), else None
        self.intervals: Graph | None = None
        self._bounds = None

    def __repr__(self):
        return f"TracedMod({self.kind}, {self.name!r}, key={self.key})"

    @property
    def buffers(self) -> tuple:
        return self.graph.buffers

    def uses(self, name: str) -> bool:
        """Whether the expression depends on input ``name`` (``"b"``, ``"h"``, ...)."""
        return name in _used_vars(self.graph)

    def reads_at(self, name: str) -> bool:
        """Whether the expression reads a table at an index formed from input ``name``
        (``"kv_idx"``: a document id per key, a keep flag per key): a load per key column
        of every tile a kernel walks along the keys, which :func:`compute_block_mask`
        replaces by intervals where it can (:func:`as_intervals`)."""
        return bool(self.reads) and any(name in uses for _, _, _, uses, _ in self.reads[1])

    def buffer_versions(self) -> tuple:
        """Identity and version of the captured tables (a cache key component)."""
        out = []
        for b in self.buffers:
            data = b.data
            out.append((id(data), _data_ptr(data), version(data), b.shape))
        return tuple(out)

    def check_tables(self, B, H, Nq, Nk):
        """Raise ``ValueError`` unless every captured table covers every index the
        expression forms for ``b < B``, ``h < H``, ``q_idx < Nq``, ``kv_idx < Nk``
        (:func:`table_bounds`). A cheap host check, memoized per sizes; plain Python over
        :attr:`reads`, so ``torch.compile`` traces it (it then guards on the sizes)."""
        if not self.reads:
            return
        compiling = torch.compiler.is_compiling()
        sizes = (B, H, Nq, Nk)
        if 0 in (B, H, Nq, Nk):
            return                                # nothing is evaluated
        if not compiling and sizes in self._in_range:
            return
        for table, dim, extent, uses, (lo, hi) in table_bounds(self.reads, sizes):
            if (hi is not None and hi >= extent) or (lo is not None and lo < 0):
                bad = hi if hi is not None and hi >= extent else lo
                given = ", ".join(f"{_SIZE_NAMES[i]}={sizes[i]}" for i in range(4))
                raise ValueError(
                    f"{self.kind}_mod {self.name!r} reads its table {table} of shape "
                    f"{self._shapes[table]} at index {bad} along dim {dim} (from "
                    f"{'/'.join(uses) or 'constants'}), past its {extent} entries: with {given} "
                    f"the mod forms indices {'?' if lo is None else lo}.."
                    f"{'?' if hi is None else hi} there (b < B, h < H, q_idx < Nq, "
                    f"kv_idx < Nk); pass a table that covers them, or clamp the index in the "
                    f"mod to read a shorter table on purpose")
        if not compiling:
            if len(self._in_range) >= 64:
                self._in_range.clear()
            self._in_range.add(sizes)

    def check_device(self, device) -> None:
        """Raise ``ValueError`` naming the mod and the table if a captured table is a meta
        tensor and ``device`` is not the meta device: a meta table has no values to copy
        or compute with (meta tables with meta q, k, v give meta outputs, which need none).
        Called before a table is moved to the call's device (:meth:`torch_fn`,
        :meth:`buffer_args`)."""
        device = torch.device(device)
        if device.type == "meta":
            return
        for i, b in enumerate(self.buffers):
            if isinstance(b.data, torch.Tensor) and b.data.device.type == "meta":
                raise ValueError(
                    f"{self.kind}_mod {self.name!r} captures its table {i} on the meta device "
                    f"(shape {self._shapes[i]}), which has no values to compute with on "
                    f"{device}: pass the table on a real device (a meta table gives meta "
                    f"outputs with meta q, k, v only)")

    # torch ------------------------------------------------------------------------
    def torch_fn(self, device):
        """The torch lowering, with captured tables moved to ``device`` (cached per device).

        Call it as ``fn(score, b, h, q_idx, kv_idx)`` / ``fn(b, h, q_idx, kv_idx)`` on
        broadcastable tensors; returns one tensor (a Python scalar output is returned as a
        0-d tensor).
        """
        device = torch.device(device)
        key = (str(device), self.buffer_versions())
        fn = self._torch.get(key)
        if fn is not None:
            return fn
        self.check_device(device)
        src = function_source(self.graph, TORCH, "_mod")
        ns = dict(TORCH.namespace)
        exec(compile(src, f"<flashfold:torch:{self.graph.name}>", "exec"), ns)
        inner = ns["_mod"]
        bufs = [_flat_tensor(b.data, device) for b in self.buffers]

        def fn(*args):
            out = inner(*args, *bufs)[0]
            return out if isinstance(out, torch.Tensor) else torch.as_tensor(out, device=device)
        fn.__flashfold_source__ = src
        self._torch = {key: fn}                    # keep only the latest tables' version
        return fn

    # triton -----------------------------------------------------------------------
    def triton_fn(self):
        """The ``@triton.jit`` function with the fixed signature (module docstring)."""
        if self._triton is None:
            with self._lock:
                if self._triton is None:
                    self._triton = _triton_wrapper(self)
        return self._triton

    # gluon ------------------------------------------------------------------------
    @functools.cached_property
    def gluon_ok(self) -> bool:
        """Whether the Gluon lowering covers every operation of the expression (not
        ``scan_sum``, a scan across the tile's lanes, :data:`.codegen.GLUON`: a mod using
        it runs on the Triton kernels), and a mask_mod's output is not a constant. Computed once (the
        graph does not change; every call's dispatch reads it)."""
        from ..codegen import GLUON
        # (a mask_mod's constant output would broadcast against the scalar b: no layout)
        constant = self.kind == "mask" and any(n.op == "const" for n in self.graph.outputs)
        return not constant and _used_ops(self.graph) <= set(GLUON.templates) | {"var", "const"}

    def gluon_fn(self):
        """The ``@gluon.jit`` function with the fixed signature of :meth:`triton_fn` (the
        Gluon kernels call only Gluon functions); needs :attr:`gluon_ok`."""
        if not self.gluon_ok:
            raise ValueError(f"{self.kind}_mod {self.name!r}: uses an operation that Gluon "
                             f"lacks ({sorted(_used_ops(self.graph))})")
        if self._gluon is None:
            with self._lock:
                if self._gluon is None:
                    self._gluon = _triton_wrapper(self, gluon=True)
        return self._gluon

    def bounds_fn(self):
        """For a mask of intervals (:attr:`intervals`): the ``@gluon.jit`` function
        ``bounds_fn(b, h, q_idx, kv_idx, BUFS) -> (first, last)`` over the mask's tables
        (the ``BUFS`` of :meth:`buffer_args`), which a kernel walking a query tile's keys
        evaluates once per row and intersects with its own bounds (causal, window), where
        the mask itself would cost two compares per pair in every masked tile."""
        if self.intervals is None:
            raise ValueError(f"{self.kind}_mod {self.name!r} is not a mask of intervals")
        if self._bounds is None:
            with self._lock:
                if self._bounds is None:
                    self._bounds = _jit_wrapper(self.intervals, "bounds_fn", len(self.buffers),
                                                2, "mask_bounds", gluon=True)
        return self._bounds

    def buffer_args(self, device) -> tuple:
        """The kernel argument ``BUFS = (B0, N0, B1, N1, ...)``: each captured table
        (flattened, on ``device``) and its element count.

        Cached per device and tables' version (:meth:`buffer_versions`), like
        :meth:`torch_fn`: a table captured on the host is copied to the device once, not on
        every call (a per-call copy synchronised each eager call and could not be captured
        in a CUDA graph); writing to the table in place bumps its version and recopies it.
        """
        key = (str(device), self.buffer_versions())
        out = self._args.get(key)
        if out is None:
            self.check_device(device)
            flat = [_flat_tensor(b.data, device) for b in self.buffers]
            out = tuple(x for t in flat for x in (t, t.numel()))
            self._args = {key: out}                # keep only the latest tables' version
        return out


def plan_tables(score_mod: TracedMod | None, block_mask: "BlockMask | None", device) -> tuple:
    """The tensors that a planned attention launch holds for its mods: the score_mod's
    tables, the block mask's four tile lists and its mask_mod's tables (the kernel
    arguments, as :meth:`TracedMod.buffer_args` caches them). A plan cache takes them as
    inputs of the plan, so that a replay reads the call's tables
    (:mod:`flashfold.kernels.plans`)."""
    out: tuple = ()
    if score_mod is not None:
        out += score_mod.buffer_args(device)[0::2]
    if block_mask is not None:
        bm = block_mask
        out += (bm.partial_num, bm.partial_idx, bm.full_num, bm.full_idx)
        for m in {id(m): m for m in (bm.row_mod, bm.column_mod)}.values():
            out += m.buffer_args(device)[0::2]
    return out


_UNTRACKED = itertools.count()


def version(data):
    """A tensor's write counter, as a cache-key component: ``t._version``, which every
    in-place write bumps. An inference tensor (made under ``torch.inference_mode``) has
    none and may be written in place unseen, so each call gets a new value and the
    caches keyed on it miss. A NumPy array has none either: its contents stand for it (a
    hash of its bytes, computed at each call: tables are small)."""
    if isinstance(data, torch.Tensor):
        if data.is_inference():
            return ("inference", next(_UNTRACKED))
        return data._version
    tobytes = getattr(data, "tobytes", None)
    if tobytes is not None:
        return ("contents", hash(tobytes()))
    return ("untracked", next(_UNTRACKED))


def _data_ptr(data) -> int:
    try:
        return int(data.data_ptr())
    except Exception:                             # NumPy arrays, lists
        return 0


def _flat_tensor(data, device):
    """A captured table as a flat tensor on ``device`` (moved there once if needed)."""
    t = data if isinstance(data, torch.Tensor) else torch.as_tensor(data)
    if t.device != torch.device(device):
        t = t.to(device)
    if not t.is_contiguous():
        t = t.contiguous()                        # documented: tables are small
    return t.reshape(-1)


def _nodes(graph: Graph) -> list:
    """The nodes that the expression's outputs depend on, each once."""
    seen, out, stack = set(), [], list(graph.outputs)
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        out.append(n)
        stack.extend(n.args)
    return out


def _used_ops(graph: Graph) -> set:
    """The operations of the expression's outputs."""
    return {n.op for n in _nodes(graph)}


def _used_vars(graph: Graph) -> set:
    return {n.attr for n in _nodes(graph) if n.op == "var"}


# --- table bounds ---------------------------------------------------------------------
#
# A captured table is indexed by expressions of the positions, which range over the call's
# sizes: ``0 <= b < B``, ``0 <= h < H``, ``0 <= q_idx < Nq``, ``0 <= kv_idx < Nk``. The
# lowerings clamp every index into the table (masked-off lanes of a kernel must not read
# out of bounds), so a table shorter than what the expression reaches would silently
# repeat its last entry. Each TracedMod therefore carries, from its trace, the index
# expressions of its table reads as a small interval program (:func:`_table_reads`); the
# callers evaluate it for their sizes (:meth:`TracedMod.check_tables`) before anything is
# computed. Intervals are exact for what indices are made of (sums, differences, products
# with constants, clamps, min / max, where, floordiv / mod by a constant: each position
# ranges independently), so a reported read really happens; an index that depends on a
# value (a score, another table's entry) is unbounded and not checked.

_SIZE_OF = {"b": 0, "h": 1, "q_idx": 2, "kv_idx": 3}
_SIZE_NAMES = ("B", "H", "Nq", "Nk")
_BOUNDED = ("var", "const", "add", "sub", "neg", "mul", "div", "floordiv", "mod", "maximum",
            "minimum", "abs", "where", "to_int", "to_float", "floor")


def _table_reads(graph: Graph):
    """``(steps, reads)``: the index expressions of ``graph``'s table reads as a flat
    interval program (``steps[i] = (op, argument slots, attr)``, one slot per node, in
    topological order) and, per read and dim of the table, ``(table, dim, extent, uses,
    slot)``. A 2-D table's read ``t[i, j]`` is the flat index ``i * cols + j``
    (:class:`~flashfold.algebra.ir.Buffer`): each of ``i``, ``j`` is checked against its
    dim; a flat index that is not of that form is checked against the table's size."""
    loads = [n for n in graph.nodes() if n.op == "load"]
    if not loads:
        return ()
    buffers = graph.buffers
    slot: dict = {}
    steps: list = []

    def emit(n):
        if id(n) in slot:
            return slot[id(n)]
        if n.op in _BOUNDED and n.op not in ("var", "const"):
            args = tuple(emit(a) for a in n.args)
        else:
            args = ()
        if n.op == "const":
            attr = n.attr
        elif n.op == "var":
            attr = _SIZE_OF.get(n.attr)           # None: score (any value)
        else:
            attr = None
        op = n.op if n.op in _BOUNDED else ("bool" if n.op in BOOLEAN else "any")
        steps.append((op, args, attr))
        slot[id(n)] = len(steps) - 1
        return slot[id(n)]

    reads = []
    for n in loads:
        buf, flat = n.attr, n.args[0]
        table = [i for i, b in enumerate(buffers) if b is buf][0]
        dims = [(0, flat, buf.numel)]
        if len(buf.shape) == 2:
            rows, cols = buf.shape
            if (flat.op == "add" and flat.args[0].op == "mul"
                    and _const_is(flat.args[0].args[1], cols)):
                dims = [(0, flat.args[0].args[0], rows), (1, flat.args[1], cols)]
            elif flat.op == "mul" and _const_is(flat.args[1], cols):
                dims = [(0, flat.args[0], rows)]              # t[i, 0]
        for dim, index, extent in dims:
            uses = tuple(v for v in _SIZE_OF if v in _used_vars_of(index))
            reads.append((table, dim, extent, uses, emit(index)))
    return tuple(steps), tuple(reads)


def _const_is(n, value) -> bool:
    return n.op == "const" and not isinstance(n.attr, bool) and n.attr == value


def _used_vars_of(node) -> set:
    out, seen, stack = set(), set(), [node]
    while stack:
        n = stack.pop()
        if id(n) not in seen:
            seen.add(id(n))
            if n.op == "var":
                out.add(n.attr)
            stack.extend(n.args)
    return out


def _lo_add(a, b):
    return None if a is None or b is None else a + b


def _scale(iv, c):
    """``iv * c`` for a constant ``c``."""
    lo, hi = iv
    if c == 0:
        return (0, 0)
    lo2 = None if lo is None else lo * c
    hi2 = None if hi is None else hi * c
    return (lo2, hi2) if c > 0 else (hi2, lo2)


def _step(op, a, attr, sizes):
    """The interval ``(lo, hi)`` (``None``: unbounded side) of one node from its
    arguments' intervals ``a``."""
    if op == "var":
        if attr is None:
            return (None, None)                   # the score
        return (0, None if sizes[attr] is None else sizes[attr] - 1)
    if op == "const":
        v = int(attr) if isinstance(attr, bool) else attr
        return (None, None) if isinstance(v, float) and math.isinf(v) else (v, v)
    if op == "add":
        return (_lo_add(a[0][0], a[1][0]), _lo_add(a[0][1], a[1][1]))
    if op == "sub":
        return (_lo_add(a[0][0], None if a[1][1] is None else -a[1][1]),
                _lo_add(a[0][1], None if a[1][0] is None else -a[1][0]))
    if op == "neg":
        lo, hi = a[0]
        return (None if hi is None else -hi, None if lo is None else -lo)
    if op == "mul":
        (l0, h0), (l1, h1) = a
        if l1 is not None and l1 == h1:
            return _scale(a[0], l1)
        if l0 is not None and l0 == h0:
            return _scale(a[1], l0)
        if None in (l0, h0, l1, h1):
            return (None, None)
        corners = (l0 * l1, l0 * h1, h0 * l1, h0 * h1)
        return (min(corners), max(corners))
    if op == "div":
        lo, hi = a[1]
        if lo is None or lo != hi or lo <= 0:
            return (None, None)
        return _scale(a[0], 1.0 / lo)
    if op in ("floordiv", "mod"):
        (l0, h0), (d, d1) = a
        if d is None or d != d1 or not isinstance(d, int) or d <= 0:
            return (None, None)
        if op == "floordiv":             # floor or truncation: both lie in these bounds
            lo = None if l0 is None else l0 // d
            hi = None if h0 is None else (h0 // d if h0 >= 0 else -((-h0) // d))
            return (lo, hi)
        if l0 is not None and l0 >= 0:
            return (l0, h0) if h0 is not None and h0 < d else (0, d - 1)
        return (0, d - 1)                # floored: the divisor's sign, on every lowering
    if op == "maximum":
        (l0, h0), (l1, h1) = a
        lo = l1 if l0 is None else (l0 if l1 is None else max(l0, l1))
        return (lo, None if h0 is None or h1 is None else max(h0, h1))
    if op == "minimum":
        (l0, h0), (l1, h1) = a
        hi = h1 if h0 is None else (h0 if h1 is None else min(h0, h1))
        return (None if l0 is None or l1 is None else min(l0, l1), hi)
    if op == "abs":
        lo, hi = a[0]
        if lo is not None and lo >= 0:
            return (lo, hi)
        if hi is not None and hi <= 0:
            return (-hi, None if lo is None else -lo)
        return (0, None if lo is None or hi is None else max(-lo, hi))
    if op == "where":
        (l1, h1), (l2, h2) = a[1], a[2]
        return (None if l1 is None or l2 is None else min(l1, l2),
                None if h1 is None or h2 is None else max(h1, h2))
    if op in ("to_int", "floor"):         # monotone: the ends map to the ends
        f = math.floor if op == "floor" else math.trunc
        return tuple(v if v is None or not isinstance(v, float) else f(v) for v in a[0])
    if op == "to_float":
        return a[0]
    if op == "bool":
        return (0, 1)
    return (None, None)


def table_bounds(reads, sizes):
    """Evaluate a TracedMod's :attr:`~TracedMod.reads` for ``sizes = (B, H, Nq, Nk)``
    (``None``: a size not known): a list of ``(table, dim, extent, uses, (lo, hi))``, one
    per read (``None``: an unbounded side)."""
    steps, table_reads = reads
    vals: list = []
    for op, args, attr in steps:
        vals.append(_step(op, [vals[i] for i in args], attr, sizes))
    return [(table, dim, extent, uses, vals[slot])
            for table, dim, extent, uses, slot in table_reads]


_TRACES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_TRACE_LOCK = threading.Lock()


def _trace(kind: str, fn, inputs) -> TracedMod:
    if isinstance(fn, TracedMod):
        if fn.kind != kind:
            raise TypeError(f"expected a {kind}_mod, got a traced {fn.kind}_mod")
        return fn
    if not callable(fn):
        raise TypeError(f"{kind}_mod must be a callable, got {type(fn).__name__}")
    try:
        hit = _TRACES.get(fn)
    except TypeError:                              # not weak-referenceable
        hit = None
    if hit is not None:
        return hit
    name = getattr(fn, "__name__", kind + "_mod")
    try:
        inspect.signature(fn).bind(*inputs)
    except TypeError as e:
        raise TypeError(f"{kind}_mod {name!r} must take ({', '.join(v.name for v in inputs)}): "
                        f"{e}") from None
    except ValueError:                             # (no signature to read: traced as is)
        pass
    try:
        graph = trace(fn, list(inputs), f"{kind}_mod.{name}", n_outputs=1)
    except ValueError as e:
        raise ValueError(f"{kind}_mod {name!r} must return exactly one value: {e}") from None
    except (TypeError, IndexError, RuntimeError) as e:
        # the mod used a traced position as a Python value: indexing a captured tensor or
        # list, or branching on it
        raise TypeError(f"{kind}_mod {name!r} cannot be traced ({type(e).__name__}: {e}). "
                        f"Its arguments are traced values: a table it indexes must be a "
                        f"flashfold.ops.Buffer (ops.Buffer(t)[b]), and a choice must be "
                        f"ops.where / & / | rather than if / and / or") from e
    truth = _truth_value(graph.outputs[0])
    if kind == "mask" and not truth:
        raise TypeError(f"mask_mod {name!r} must return a truth value (a comparison, &, |, ~, "
                        f"a bool or an entry of a bool table), got a value of "
                        f"{graph.outputs[0].op!r}; compare it (e.g. != 0) to say which keys "
                        f"are visible")
    if kind == "score" and truth:
        raise TypeError(f"score_mod {name!r} returns a truth value, not a score: a mask "
                        f"belongs in mask_mod")
    mod = TracedMod(kind, fn, graph)
    try:
        with _TRACE_LOCK:
            _TRACES[fn] = mod
    except TypeError:
        pass
    return mod


def _truth_value(n) -> bool:
    """Whether a traced value is a truth value: a comparison or logical op, a bool
    constant, an entry of a bool table, or a ``where`` between truth values."""
    if is_bool(n):                                # (the IR's rule: comparisons, bools)
        return True
    if n.op == "load":
        return str(getattr(n.attr.data, "dtype", "")) in ("torch.bool", "bool")
    if n.op == "where":
        return _truth_value(n.args[1]) and _truth_value(n.args[2])
    return False


def trace_score_mod(fn) -> TracedMod:
    """Trace ``fn(score, b, h, q_idx, kv_idx) -> score`` (cached per function object)."""
    return _trace("score", fn, SCORE_INPUTS)


def trace_mask_mod(fn) -> TracedMod:
    """Trace ``fn(b, h, q_idx, kv_idx) -> bool`` (cached per function object)."""
    return _trace("mask", fn, MASK_INPUTS)


def buffer_slots(n: int) -> str:
    """The arguments a generated body takes after its inputs, read from the kernel's
    ``BUFS`` tuple of ``n`` tables: ``", BUFS[0], BUFS[1], ..."``."""
    return "".join(f", BUFS[{i}]" for i in range(2 * n))


def _triton_wrapper(mod: TracedMod, gluon: bool = False):
    fname = "score_fn" if mod.kind == "score" else "mask_fn"
    return _jit_wrapper(mod.graph, fname, len(mod.buffers), 1, f"{mod.kind}_mod", gluon,
                        float_outputs=(mod.kind == "score",))


def _jit_wrapper(graph: Graph, fname: str, n_buffers: int, results: int, stem: str,
                 gluon: bool = False, float_outputs: tuple | None = None):
    """``fname(*inputs, BUFS)``, the first ``results`` outputs of ``graph`` lowered to one
    ``@triton.jit`` (or ``@gluon.jit``) function that reads its ``n_buffers`` captured
    tables from the kernel's ``BUFS`` tuple (:func:`buffer_slots`); loaded from the cache
    of generated sources under ``stem``. ``float_outputs``: as :func:`.codegen.jit_source`
    (the type of a constant output: a mask's truth value is an int, not a float)."""
    from ..codegen import _GLUON_HEADER, _HEADER, GLUON, TRITON, jit_source, load_source

    names = [v.name for v in graph.inputs]
    body = jit_source(graph, "body", names, float_outputs=float_outputs,
                      backend=GLUON if gluon else TRITON)
    deco = "@gluon.jit" if gluon else "@triton.jit"
    wrapper = (f"{deco}\ndef {fname}({', '.join(names)}, BUFS):\n"
               f"    r = body({', '.join(names)}{buffer_slots(n_buffers)})\n"
               f"    return {', '.join(f'r[{i}]' for i in range(results))}\n")
    module = load_source(body + "\n\n" + wrapper, ("gluon_" if gluon else "") + stem,
                         header=_GLUON_HEADER if gluon else _HEADER)
    return getattr(module, fname)


_GRAD_FNS: dict = {}
_GRAD_OK: dict = {}
_GRAD_LOCK = threading.Lock()


def _grad_graph(mod: TracedMod) -> Graph:
    """The graph of ``(value, d value / d score)`` of a traced score_mod
    (:func:`~flashfold.algebra.autodiff.derivative`), its tables in the mod's order."""
    graph = derivative(mod.graph, "score", name=f"{mod.graph.name}.grad")
    if len(graph.buffers) != len(mod.buffers) or any(a is not b for a, b in zip(graph.buffers, mod.buffers)):
        raise RuntimeError(f"derivative of {mod.name!r} reorders its captured tables")
    return graph


def score_grad_gluon_ok(mod: TracedMod) -> bool:
    """Whether the Gluon lowering covers the score_mod's value and derivative
    (:meth:`TracedMod.gluon_ok` for both graphs); cached per expression (the dispatch asks
    on every eager backward with a callable mask_mod)."""
    ok = _GRAD_OK.get(mod.key)
    if ok is None:
        from ..codegen import GLUON
        ok = mod.gluon_ok and _used_ops(_grad_graph(mod)) <= set(GLUON.templates) | {"var", "const"}
        _GRAD_OK[mod.key] = ok
    return ok


def score_grad_fn(mod: TracedMod, gluon: bool = False):
    """``score_grad(score, b, h, q_idx, kv_idx, BUFS) -> (value, d value / d score)`` for a
    traced score_mod: the graph of :func:`~flashfold.algebra.autodiff.derivative`, lowered
    to one ``@triton.jit`` function, or ``@gluon.jit`` with ``gluon=True`` (needs
    :func:`score_grad_gluon_ok`); cached per expression. Same signature as
    :meth:`TracedMod.triton_fn` but two results."""
    key = (mod.key, gluon)
    fn = _GRAD_FNS.get(key)
    if fn is not None:
        return fn
    if gluon and not score_grad_gluon_ok(mod):
        raise ValueError(f"score_mod {mod.name!r}: its derivative uses an operation that "
                         f"Gluon lacks")
    fn = _jit_wrapper(_grad_graph(mod), "score_grad", len(mod.buffers), 2, "score_grad", gluon)
    with _GRAD_LOCK:
        _GRAD_FNS[key] = fn
    return fn


# --- block masks ----------------------------------------------------------------------

#: every live BlockMask by its ``handle`` (weak: the registry never keeps one alive)
_BLOCK_MASKS: "weakref.WeakValueDictionary[int, BlockMask]" = weakref.WeakValueDictionary()
_HANDLES = iter(range(1, 1 << 62))
_HANDLES_LOCK = threading.Lock()


def block_mask_by_handle(handle: int) -> "BlockMask":
    """The live :class:`BlockMask` whose ``handle`` is ``handle`` (``KeyError`` if gone)."""
    return _BLOCK_MASKS[handle]


class BlockMask:
    """Which ``(BLOCK_M x BLOCK_N)`` tiles of the score matrix a mask hides.

    Shapes (``Bm``/``Hm`` are 1 when the mask does not depend on ``b``/``h``; the
    kernel broadcasts them):

    * ``state``: int8 ``(Bm, Hm, nM, nN)``: ``EMPTY`` (0), ``PARTIAL`` (1), ``FULL`` (2);
    * ``partial_num`` / ``full_num``: int32 ``(Bm, Hm, nM)``: tiles per query block;
    * ``partial_idx`` / ``full_idx``: int32 ``(Bm, Hm, nM, nN)``: their key-block
      indices, ascending, in the first ``*_num`` entries of each row.

    ``exact`` is True when FULL tiles need no masking at all in the kernel (the table
    already accounts for sequence bounds and any causal/window mask); otherwise the
    kernel also applies its built-in masks inside FULL tiles.

    ``mod`` is the user's traced mask_mod (its meaning: the CPU path evaluates it, errors
    name it). The kernels evaluate, inside PARTIAL tiles, ``row_mod`` where they walk a
    query tile's keys (the forward, dQ) and ``column_mod`` where they walk a key tile's
    queries (dK, dV): ``mod`` itself, or, for a mask whose every row sees one interval of
    keys (every column one interval of queries), those intervals (:func:`as_intervals`),
    the same visibility without a table read per step of the walk.
    """

    def __init__(self, *, mask_mod: TracedMod, state, partial_num, partial_idx, full_num,
                 full_idx, shape, block_size, exact: bool, builtins=(None, None),
                 row_mod: TracedMod | None = None, column_mod: TracedMod | None = None):
        self.mod = mask_mod
        self.row_mod = mask_mod if row_mod is None else row_mod
        self.column_mod = mask_mod if column_mod is None else column_mod
        self.state = state
        self.partial_num = partial_num
        self.partial_idx = partial_idx
        self.full_num = full_num
        self.full_idx = full_idx
        self.shape = tuple(shape)                 # (B, H, Q_LEN, KV_LEN); None = broadcast
        self.BLOCK_SIZE = tuple(block_size)
        self.exact = exact
        self.builtins = builtins                  # (left, right) folded into the table
        # an int that stands for this mask where only constants may pass: torch.compile
        # (Dynamo) cannot hand a BlockMask object to a constant-result function on every
        # torch (2.11 refuses it), but reads and guards an int attribute
        with _HANDLES_LOCK:
            self.handle = next(_HANDLES)
        _BLOCK_MASKS[self.handle] = self

    @property
    def mask_mod(self):
        """The user's mask function."""
        return self.mod.fn

    @property
    def graph(self) -> Graph:
        return self.mod.graph

    @property
    def device(self):
        return self.state.device

    def gluon_mask(self, walk: str):
        """``(MASK_FN, BOUNDS)`` for a Gluon kernel that walks a query tile's keys (``walk
        = "keys"``: the forward, :attr:`row_mod`) or a key tile's queries (``"queries"``:
        the backward's dK, dV, :attr:`column_mod`). Where every row (column) is one
        interval, the intervals' :meth:`TracedMod.bounds_fn` and True: the kernel reads
        each row's (column's) bounds once and compares each pair against them; otherwise
        the mask's :meth:`TracedMod.gluon_fn`, evaluated per pair, and False."""
        if walk not in ("keys", "queries"):
            raise ValueError(f"walk: 'keys' or 'queries', got {walk!r}")
        mod = self.row_mod if walk == "keys" else self.column_mod
        if mod.intervals is not None:
            return mod.bounds_fn(), True
        return mod.gluon_fn(), False

    def sparsity(self) -> float:
        """Fraction of tiles skipped (EMPTY)."""
        return float((self.state == EMPTY).float().mean())

    def to_dense(self):
        """The int8 state table ``(Bm, Hm, nM, nN)``."""
        return self.state

    def __repr__(self):
        counts = [int((self.state == s).sum()) for s in (EMPTY, PARTIAL, FULL)]
        forms = [f", {what} as intervals" for what, m in (("rows", self.row_mod),
                                                         ("columns", self.column_mod))
                 if m is not self.mod]
        return (f"BlockMask({self.mod.name!r}, shape={self.shape}, block={self.BLOCK_SIZE}, "
                f"tiles empty/partial/full={counts[0]}/{counts[1]}/{counts[2]}, "
                f"sparsity={self.sparsity():.1%}{''.join(forms)})")


def _lists(state):
    """Sorted index lists of the PARTIAL and FULL tiles of each query block."""
    nN = state.shape[-1]
    idx = torch.arange(nN, device=state.device, dtype=torch.int32)
    out = []
    for s in (PARTIAL, FULL):
        hit = state == s
        key = torch.where(hit, idx, idx + nN)     # hits first, ascending
        order = torch.argsort(key, dim=-1).to(torch.int32).contiguous()
        out += [hit.sum(-1, dtype=torch.int32).contiguous(), order]
    return out


_COLUMNS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def column_lists(bm: BlockMask):
    """The block mask's per-*key-block* lists (the transpose of its per-query-block lists):
    ``(partial_num, partial_idx, full_num, full_idx)`` with shapes ``(Bm, Hm, nN)`` and
    ``(Bm, Hm, nN, nM)``; cached per BlockMask (the backward kernels walk them)."""
    hit = _COLUMNS.get(bm)
    if hit is None:
        hit = tuple(_lists(bm.state.transpose(-1, -2).contiguous()))
        _COLUMNS[bm] = hit
    return hit


def _visible_chunk(mask_fn, b, h, q, kv, lq, lk, left, right):
    """Visibility of pairs ``(h, q, kv)`` of sequence ``b`` (bool ``(Hm, R, C)``)."""
    vis = kv < lk
    off = lk - lq
    if right is not None:
        vis = vis & (kv <= q + off + right)
    if left is not None:
        vis = vis & (kv >= q + off - left)
    if mask_fn is not None:
        m = mask_fn(b, h, q, kv)
        vis = vis & (m if m.dtype == torch.bool else m != 0)
    return vis


#: ``first`` of a row (column) that sees no key (query): above every index
_NONE = 2 ** 31 - 1


def _spans(vis, axis: int, start: int):
    """``(first, last, count)`` along ``axis`` of ``vis`` (bool ``(Hm, R, C)``; the
    positions along ``axis`` from ``start``): the first and last visible position
    (:data:`_NONE` and -1 where there is none) and how many there are, int32, ``axis``
    reduced."""
    v = vis.to(torch.uint8)
    count = v.sum(axis, dtype=torch.int32)
    seen = count > 0
    first = v.argmax(axis).to(torch.int32) + start            # argmax: the first maximum
    last = (v.shape[axis] - 1 + start) - v.flip(axis).argmax(axis).to(torch.int32)
    return torch.where(seen, first, _NONE), torch.where(seen, last, -1), count


def as_intervals(mod: TracedMod, along: str, first, last) -> TracedMod:
    """The mask ``first[b, h, i] <= j <= last[b, h, i]``, traced, for ``along="kv_idx"``
    with ``i = q_idx``, ``j = kv_idx`` (each row's interval of keys: the form of the
    kernels that walk a query tile's keys), for ``along="q_idx"`` the transpose (each
    column's interval of queries). ``first``, ``last``: int32 ``(Bm, Hm, N)``, a dim of
    1 not indexed.

    A mask that reads a table per key (``doc[q_idx] == doc[kv_idx]``: a load and a compare
    per key column of every PARTIAL tile, 43% of the causal document-mask forward on an
    H200, ``docs/notes/attention_fwd.md``) so becomes two compares against two entries
    per row, read once per tile. Document masks (causal or not), key padding from a keep
    table and windows or prefixes read through tables have one interval per row and per
    column; :func:`compute_block_mask` checks that they do before it uses this."""
    Bm, Hm, N = first.shape
    flat = (N,) if Bm * Hm == 1 else (Bm * Hm, N)
    lo, hi = Buffer(first.reshape(flat).contiguous()), Buffer(last.reshape(flat).contiguous())

    def bounds(b, h, q_idx, kv_idx):
        i = q_idx if along == "kv_idx" else kv_idx
        if Bm * Hm == 1:
            return lo[i], hi[i]
        r = b * Hm + h if Bm > 1 and Hm > 1 else (b if Bm > 1 else h)
        return lo[r, i], hi[r, i]

    def intervals(b, h, q_idx, kv_idx):
        a, z = bounds(b, h, q_idx, kv_idx)
        j = kv_idx if along == "kv_idx" else q_idx
        return (j >= a) & (j <= z)
    what = "rows" if along == "kv_idx" else "columns"
    intervals.__name__ = intervals.__qualname__ = f"{mod.name}_{what}"
    out = trace_mask_mod(intervals)
    graph = trace(bounds, list(MASK_INPUTS), f"mask_bounds.{out.name}", n_outputs=2)
    if len(graph.buffers) != 2 or any(a is not b for a, b in zip(graph.buffers, out.buffers)):
        raise RuntimeError(f"the bounds of {out.name!r} read other tables than its mask")
    out.intervals = graph
    return out


def compute_block_mask(mod: TracedMod, *, batch: int | None, heads: int | None, q_len: int,
                       kv_len: int, block_m: int, block_n: int, device, lens_q=None,
                       lens_k=None, left=None, right=None, exact=True) -> BlockMask:
    """Evaluate ``mod`` tile by tile (chunked: at most ~16M pairs at a time).

    ``lens_q``/``lens_k`` are per-sequence lengths (varlen; default ``q_len``/``kv_len``);
    ``left``/``right`` fold a bottom-right aligned window (causal is ``right=0``) into the
    table. ``batch``/``heads`` of ``None`` broadcast (the mask must then not use b / h).
    A mask that reads a table per key (:meth:`TracedMod.reads_at`) also gets each row's
    first and last visible key and their count, and the kernels that walk a query tile's
    keys evaluate those intervals where every row's are exactly its keys
    (:func:`as_intervals`); per query and column alike. One flag is read back from the
    device for it (not while a CUDA graph is being captured: the mask then stays as
    written).
    """
    device = torch.device(device)
    for name, val in (("B", batch), ("H", heads)):
        if val is None and mod.uses(name.lower()):
            raise ValueError(f"mask_mod {mod.name!r} depends on {name.lower()}; pass {name} "
                             f"(not None) to create_block_mask")
    mod.check_tables(batch or 1, heads or 1, q_len, kv_len)
    per_seq = lens_q is not None or lens_k is not None
    Bm = batch if (batch is not None and (mod.uses("b") or per_seq)) else 1
    Hm = heads if (heads is not None and mod.uses("h")) else 1
    nM, nN = -(-q_len // block_m), -(-kv_len // block_n)
    lq_all = list(lens_q) if lens_q is not None else [q_len] * Bm
    lk_all = list(lens_k) if lens_k is not None else [kv_len] * Bm
    state = torch.zeros((Bm, Hm, nM, nN), dtype=torch.int8, device=device)
    fn = mod.torch_fn(device)
    budget = 1 << 24
    cols = max(1, min(nN, budget // max(1, Hm * block_m * block_n)))
    rows = max(1, min(nM, budget // max(1, Hm * block_m * cols * block_n)))
    h = torch.arange(Hm, device=device).view(Hm, 1, 1)
    from .. import launcher
    capturing = launcher.capturing(device)
    # for a walk along the keys ("kv_idx") each row's (first, last, count) of visible keys,
    # along the queries each column's: where the mask reads a table per step of the walk
    # (not on the meta device: whether the rows are intervals is a value, which meta
    # tensors lack; the block mask there is for shapes only)
    spans = {along: tuple(torch.full((Bm, Hm, n), v, dtype=torch.int32, device=device)
                          for v in (_NONE, -1, 0))
             for along, n in (("kv_idx", q_len), ("q_idx", kv_len))
             if mod.reads_at(along) and not capturing and device.type != "meta"}
    for bi in range(Bm):
        b = torch.tensor(bi, device=device)
        lq, lk = int(lq_all[bi]), int(lk_all[bi])
        for r0 in range(0, nM, rows):
            r1 = min(nM, r0 + rows)
            q = torch.arange(r0 * block_m, r1 * block_m, device=device).view(1, -1, 1)
            qvalid = q < lq
            for c0 in range(0, nN, cols):
                c1 = min(nN, c0 + cols)
                kv = torch.arange(c0 * block_n, c1 * block_n, device=device).view(1, 1, -1)
                vis = _visible_chunk(fn, b, h, q, kv, lq, lk, left, right)
                vis = vis.expand(Hm, q.shape[1], kv.shape[2])
                tiles = (Hm, r1 - r0, block_m, c1 - c0, block_n)
                any_ = (vis & qvalid).reshape(tiles).any(4).any(2)
                full = (vis | ~qvalid).reshape(tiles).all(4).all(2)
                st = torch.where(any_, torch.where(full, FULL, PARTIAL), EMPTY).to(torch.int8)
                state[bi, :, r0:r1, c0:c1] = st
                if spans:
                    rs = slice(r0 * block_m, min(r1 * block_m, q_len))
                    cs = slice(c0 * block_n, min(c1 * block_n, kv_len))
                    seen = (vis & qvalid)[:, :rs.stop - rs.start, :cs.stop - cs.start]
                    for along, (first, last, count) in spans.items():
                        # a row's keys (axis 2, from key cs.start), a column's queries
                        axis, at, idx = ((2, cs.start, rs) if along == "kv_idx" else
                                         (1, rs.start, cs))
                        f, z, c = _spans(seen, axis, at)
                        first[bi, :, idx] = torch.minimum(first[bi, :, idx], f)
                        last[bi, :, idx] = torch.maximum(last[bi, :, idx], z)
                        count[bi, :, idx] += c
    pn, pi, fn_, fi = _lists(state)
    forms = {}
    if spans:
        # each row (column) sees exactly its interval: one read back for both walks
        exact_spans = torch.stack([((c == 0) | (c == z - f + 1)).all()
                                   for f, z, c in spans.values()]).tolist()
        forms = {along: as_intervals(mod, along, f, z)
                 for (along, (f, z, _)), ok in zip(spans.items(), exact_spans) if ok}
    return BlockMask(mask_mod=mod, state=state, partial_num=pn, partial_idx=pi, full_num=fn_,
                     full_idx=fi, shape=(batch, heads, q_len, kv_len),
                     block_size=(block_m, block_n), exact=exact, builtins=(left, right),
                     row_mod=forms.get("kv_idx"), column_mod=forms.get("q_idx"))


def _is_int(v) -> bool:
    """An integer that is not a bool (a NumPy integer too)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_block(name, v) -> int:
    if not _is_int(v) or v < 16 or v & (v - 1):
        raise ValueError(f"BLOCK_SIZE: {name} must be a power of two >= 16, got {v!r}")
    return int(v)


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128) -> BlockMask:
    """Precompute the block mask of ``mask_mod(b, h, q_idx, kv_idx)`` (cache and reuse it).

    ``B``/``H`` may be ``None`` when the mask does not depend on ``b``/``h`` (it is then
    broadcast). ``BLOCK_SIZE`` is an int or ``(BLOCK_M, BLOCK_N)`` (powers of two >= 16;
    the kernel's tiles must divide them, which holds for the default 128). Pass the result
    as ``attention(..., mask_mod=block_mask)``; positions are those of the un-aligned
    score matrix (``q_idx < Q_LEN``, ``kv_idx < KV_LEN``). ``device``: where the tables
    are made (default: CUDA when available, else the CPU), ``q``'s device. The
    :class:`BlockMask`'s ``shape`` is ``(B, H, Q_LEN, KV_LEN)``; its tables are shaped
    ``(Bm, Hm, ceil(Q_LEN / BLOCK_M), ceil(KV_LEN / BLOCK_N))`` (:class:`BlockMask`).

    The result is the mask as its tables hold at creation: make a new one after writing
    to them. A mask that reads a table per key (``doc[q_idx] == doc[kv_idx]``) is
    summarized per row too, and where every row sees one interval of keys (documents,
    padding), the kernels compare against those intervals instead of reading the table
    per key; finding that out reads one flag back from the device.
    """
    mod = trace_mask_mod(mask_mod)
    if _is_int(BLOCK_SIZE):
        bm = bn = BLOCK_SIZE
    elif isinstance(BLOCK_SIZE, (tuple, list)) and len(BLOCK_SIZE) == 2:
        bm, bn = BLOCK_SIZE
    else:
        raise ValueError(f"BLOCK_SIZE: expected an int or a pair (BLOCK_M, BLOCK_N), got "
                         f"{BLOCK_SIZE!r}")
    bm, bn = _check_block("BLOCK_M", bm), _check_block("BLOCK_N", bn)
    for name, val in (("B", B), ("H", H)):
        if val is not None and (not _is_int(val) or val < 1):
            raise ValueError(f"{name} must be a positive int or None, got {val!r}")
    for name, val in (("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if not _is_int(val) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    B, H = (None if B is None else int(B)), (None if H is None else int(H))
    Q_LEN, KV_LEN = int(Q_LEN), int(KV_LEN)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return compute_block_mask(mod, batch=B, heads=H, q_len=Q_LEN, kv_len=KV_LEN, block_m=bm,
                              block_n=bn, device=device, exact=True)


_CACHE: "OrderedDict[tuple, BlockMask]" = OrderedDict()
_CACHE_SIZE = 16
_CACHE_LOCK = threading.Lock()


def cached_block_mask(mod: TracedMod, *, batch, heads, q_len, kv_len, block_m, block_n, device,
                      lens_q=None, lens_k=None, left=None, right=None) -> BlockMask:
    """:func:`compute_block_mask`, memoized (LRU of 16) on everything it depends on."""
    key = (mod.key, mod.buffer_versions(), batch, heads, q_len, kv_len, block_m, block_n,
           str(torch.device(device)), None if lens_q is None else tuple(lens_q),
           None if lens_k is None else tuple(lens_k), left, right)
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit
    bm = compute_block_mask(mod, batch=batch, heads=heads, q_len=q_len, kv_len=kv_len,
                            block_m=block_m, block_n=block_n, device=device, lens_q=lens_q,
                            lens_k=lens_k, left=left, right=right, exact=True)
    with _CACHE_LOCK:
        _CACHE[key] = bm
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return bm


__all__ = ["TracedMod", "BlockMask", "trace_score_mod", "trace_mask_mod", "create_block_mask",
           "compute_block_mask", "cached_block_mask", "as_intervals", "EMPTY", "PARTIAL",
           "FULL", "buffer_slots"]
