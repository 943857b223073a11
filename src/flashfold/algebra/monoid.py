"""The declarative :class:`Monoid`.

A monoid is a carrier (named fields), an identity element and an associative combine.
To reduce *data* with it one also needs a ``lift`` (one input element -> state), and
usually a ``finalize`` (state -> result). Formally, with :math:`\\oplus` the combine and
:math:`e` the identity,

.. math::

    (a \\oplus b) \\oplus c = a \\oplus (b \\oplus c), \\qquad a \\oplus e = e \\oplus a = a,

and a reduction of elements :math:`x_1..x_n` is
:math:`\\mathrm{finalize}(\\mathrm{lift}(x_1) \\oplus \\dots \\oplus \\mathrm{lift}(x_n))`
under *any* bracketing. Schedules (sequential, tree, blocks, split-K, scan, a GPU kernel)
are re-bracketings, so they all compute the same function.

All four functions are written once in Python over :mod:`flashfold.ops` and traced into
the IR at construction (so a mistake surfaces at definition time); backends lower the
traced graphs. The monoid itself never mentions a backend.

Example (the online-softmax state of the specification)::

    LOGSUMEXP = Monoid(
        "logsumexp", fields=("m", "d"), identity=(-ops.inf, 0.0),
        lift=lambda x: (x, 1.0),
        combine=lambda a, b: ...,            # rescale both sides to the larger max
        finalize=lambda s: s.m + ops.log(s.d),
        commutative=True)
"""

from __future__ import annotations

import keyword
import math
from collections import namedtuple
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Mapping

from .ir import Graph, Var, trace

DOMAINS = ("finite", "extended", "positive", "position", "small_int")


@dataclass(frozen=True)
class Field:
    """One field of a monoid's carrier.

    ``vector`` fields carry a trailing feature axis (attention's accumulator ``o`` of
    width ``d``); ``dtype`` is ``"float"`` (float64 in references, float32 in kernels) or
    ``"int"`` (int64 / int32; e.g. an argmax index).
    """
    name: str
    vector: bool = False
    dtype: str = "float"

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"field name must be a str, got {type(self.name).__name__}")
        if not self.name.isidentifier() or keyword.iskeyword(self.name):
            raise ValueError(f"field name {self.name!r} is not a Python identifier (or is a "
                             f"keyword)")
        if self.name.startswith("_"):
            raise ValueError(f"field name {self.name!r} starts with an underscore (a state's "
                             f"fields are attributes of a named tuple)")
        if not isinstance(self.vector, bool):
            raise TypeError(f"field {self.name!r}: vector must be True or False, got "
                            f"{type(self.vector).__name__}")
        if self.dtype not in ("float", "int"):
            raise ValueError(f"field {self.name!r}: dtype must be 'float' or 'int', got {self.dtype!r}")


@dataclass(frozen=True)
class Input:
    """One input of ``lift``.

    ``domain`` says which values are valid (law checking samples from it):
    ``"finite"`` real numbers, ``"extended"`` reals and ``-inf`` (a masked score),
    ``"positive"`` reals > 0, ``"small_int"`` small integers (forcing ties),
    ``"position"``: not data but the element's index, supplied by the schedule.
    """
    name: str
    vector: bool = False
    domain: str = "extended"

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"input name must be a str, got {type(self.name).__name__}")
        if not self.name.isidentifier() or keyword.iskeyword(self.name):
            raise ValueError(f"input name {self.name!r} is not a Python identifier (or is a "
                             f"keyword)")
        if not isinstance(self.vector, bool):
            raise TypeError(f"input {self.name!r}: vector must be True or False, got "
                            f"{type(self.vector).__name__}")
        if self.domain not in DOMAINS:
            raise ValueError(f"input {self.name!r}: domain must be one of {DOMAINS}, got {self.domain!r}")


def _as_field(f) -> Field:
    if isinstance(f, Field):
        return f
    if isinstance(f, str):
        return Field(f)
    raise TypeError(f"fields must be names or Field objects, got {type(f).__name__}")


def _as_input(i) -> Input:
    if isinstance(i, Input):
        return i
    if isinstance(i, str):
        return Input(i)
    raise TypeError(f"inputs must be names or Input objects, got {type(i).__name__}")


@dataclass(frozen=True)
class Monoid:
    """A declarative monoid: traced once into the IR, lowered by every backend.

    Parameters
    ----------
    name: a stable name (used in reprs, caches and generated kernel names).
    fields: the carrier's field names (or :class:`Field` objects).
    identity: one number per field (vector fields are filled with it).
    lift: ``lift(*inputs) -> tuple of field values``: the state of one element.
    combine: ``combine(a, b) -> tuple of field values``; ``a`` and ``b`` are states with
        one attribute per field (``a.m``); ``a`` holds the earlier elements.
    inputs: the names (or :class:`Input` objects) ``lift`` takes; default ``("x",)``.
    finalize: optional ``finalize(state, **params) -> value or tuple``.
    params: default values of ``finalize``'s keyword parameters, a mapping of names to
        numbers or ``(name, default)`` pairs (e.g. ``{"correction": 0.0}``).
    outputs: optional names of ``finalize``'s results.
    block_lift: optional ``block_lift(*inputs, valid) -> state`` computing the state of a
        whole block at once with ``ops.reduce_*`` (e.g. max then sum of exp); ``valid``
        is a boolean mask of the block's real elements. Kernels use it inside a tile so
        that ``combine`` only runs between tiles.
    block_scan: optional ``block_scan(*inputs, valid) -> state``: the inclusive prefix
        states of a block at once, one per element (a field may be a block reduction,
        which broadcasts: the state of element ``i`` may be the prefix's value in a
        representation shared by the whole block, as ``(block max, prefix sum of
        exp(x - block max))`` is for LOGSUMEXP: the twist applied once per block). It is
        written with ``ops.reduce_*`` and ``ops.scan_sum``, and requires ``scan_exact``.
        Scan kernels use it instead of a scan of ``combine`` inside a tile.
    scan_exact: ``scan_exact(state) -> bool``, required with ``block_scan``: whether a
        state built from ``block_scan`` (then combined with the carry of the earlier
        blocks) is as accurate as the sequential scan's. A shared representation can
        underflow where the sequential one would not (a prefix far below the block's max);
        where ``scan_exact`` is false for any element of a block, kernels rescan that
        block with ``combine``.
    commutative: whether ``a ⊕ b == b ⊕ a``; kernels that reorder need it, and
        :func:`check_laws` verifies it.
    doc: a one-paragraph description.
    """
    name: str
    fields: tuple
    identity: tuple
    lift: Callable
    combine: Callable
    inputs: tuple = ("x",)
    finalize: Callable | None = None
    params: tuple = ()
    outputs: tuple | None = None
    block_lift: Callable | None = None
    block_scan: Callable | None = None
    scan_exact: Callable | None = None
    commutative: bool = False
    doc: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError("name must be a non-empty string")
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass
        for k in ("fields", "inputs"):
            if not isinstance(getattr(self, k), (str, tuple, list, Field, Input)):
                raise TypeError(f"monoid {self.name!r}: {k} must be a name, a Field / Input "
                                f"or a tuple of them, got {type(getattr(self, k)).__name__}")
        fields = tuple(_as_field(f) for f in (self.fields if not isinstance(self.fields, (str, Field))
                                              else (self.fields,)))
        if not fields:
            raise ValueError(f"monoid {self.name!r}: fields must name at least one field")
        if len({f.name for f in fields}) != len(fields):
            raise ValueError(f"monoid {self.name!r}: field names must be unique")
        set_("fields", fields)
        inputs = tuple(_as_input(i) for i in (self.inputs if not isinstance(self.inputs, (str, Input))
                                              else (self.inputs,)))
        if len({i.name for i in inputs}) != len(inputs):
            raise ValueError(f"monoid {self.name!r}: input names must be unique, got "
                             f"{tuple(i.name for i in inputs)}")
        if (self.block_lift is not None or self.block_scan is not None) and any(
                i.name == "valid" for i in inputs):
            raise ValueError(f"monoid {self.name!r}: an input named 'valid' clashes with the "
                             f"mask that block_lift / block_scan take after the inputs")
        set_("inputs", inputs)
        identity = tuple(self.identity) if isinstance(self.identity, (tuple, list)) else (self.identity,)
        if len(identity) != len(fields):
            raise ValueError(f"monoid {self.name!r}: identity has {len(identity)} values for "
                             f"{len(fields)} fields {self.field_names}")
        for f, v in zip(fields, identity):
            if not isinstance(v, (int, float)) or (isinstance(v, float) and math.isnan(v)):
                raise TypeError(f"monoid {self.name!r}: identity of field {f.name!r} must be "
                                f"a number (not NaN), got {v!r}")
        set_("identity", identity)
        set_("params", _as_params(self.name, self.params))
        clash = sorted({p for p, _ in self.params} & {f.name for f in fields})
        if clash:
            raise ValueError(f"monoid {self.name!r}: params {clash} have the names of fields "
                             f"(finalize takes the fields and the params by name)")
        for k in ("lift", "combine"):
            if not callable(getattr(self, k)):
                raise TypeError(f"monoid {self.name!r}: {k} must be callable")
        for k in ("finalize", "block_lift", "block_scan", "scan_exact"):
            if getattr(self, k) is not None and not callable(getattr(self, k)):
                raise TypeError(f"monoid {self.name!r}: {k} must be callable or None")
        if (self.block_scan is None) != (self.scan_exact is None):
            raise ValueError(f"monoid {self.name!r}: block_scan and scan_exact go together "
                             f"(scan_exact says where block_scan's states are accurate)")
        if not isinstance(self.commutative, bool):
            raise TypeError(f"monoid {self.name!r}: commutative must be True or False")
        # trace eagerly so that errors show where the monoid is defined
        _ = (self.combine_graph, self.lift_graph, self.finalize_graph, self.block_lift_graph,
             self.block_scan_graph, self.scan_exact_graph)

    # --- structure --------------------------------------------------------------
    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs)

    @property
    def has_vector(self) -> bool:
        return any(f.vector for f in self.fields) or any(i.vector for i in self.inputs)

    @property
    def param_defaults(self) -> dict:
        return dict(self.params)

    @property
    def type_prefix(self) -> str:
        """The name in CamelCase, an identifier whatever characters the name holds: the
        prefix of the type names of the monoid's states (:attr:`State`) and results."""
        return _camel(self.name)

    @cached_property
    def State(self):
        """The namedtuple type of this monoid's states (fields in order)."""
        return namedtuple(f"{self.type_prefix}State", self.field_names)

    def __repr__(self) -> str:
        return (f"Monoid({self.name!r}, fields={self.field_names}, "
                f"inputs={self.input_names}, commutative={self.commutative})")

    def __hash__(self):
        return hash((self.name, self.combine_graph.key()))

    def __eq__(self, other):
        return (isinstance(other, Monoid) and self.name == other.name
                and self.combine_graph.key() == other.combine_graph.key()
                and self.lift_graph.key() == other.lift_graph.key())

    # --- traced graphs ----------------------------------------------------------
    @cached_property
    def combine_graph(self) -> Graph:
        a_vars = [Var("a_" + f.name, f.vector) for f in self.fields]
        b_vars = [Var("b_" + f.name, f.vector) for f in self.fields]
        S = self.State
        k = len(self.fields)

        def call(fn, nodes):
            return fn(S(*nodes[:k]), S(*nodes[k:]))
        g = trace(self.combine, a_vars + b_vars, f"{self.name}.combine", call, n_outputs=k)
        self._check_shapes(g, "combine")
        return g

    @cached_property
    def lift_graph(self) -> Graph:
        vars_ = [Var(i.name, i.vector) for i in self.inputs]
        g = trace(self.lift, vars_, f"{self.name}.lift", n_outputs=len(self.fields))
        self._check_shapes(g, "lift")
        return g

    @cached_property
    def finalize_graph(self) -> Graph:
        k = len(self.fields)
        vars_ = [Var(f.name, f.vector) for f in self.fields] + [Var(p) for p, _ in self.params]
        S = self.State
        names = [p for p, _ in self.params]
        if self.finalize is None:
            return trace(lambda *n: tuple(n[:k]), vars_, f"{self.name}.finalize")

        def call(fn, nodes):
            return fn(S(*nodes[:k]), **dict(zip(names, nodes[k:])))
        g = trace(self.finalize, vars_, f"{self.name}.finalize", call)
        if self.outputs is not None and len(self.outputs) != len(g.outputs):
            raise ValueError(f"monoid {self.name!r}: finalize returns {len(g.outputs)} values "
                             f"but outputs names {len(self.outputs)}")
        if self.outputs is not None and len(set(self.outputs)) != len(self.outputs):
            raise ValueError(f"monoid {self.name!r}: outputs names must be unique, got "
                             f"{tuple(self.outputs)}")
        return g

    def _block_graph(self, what: str) -> Graph | None:
        """The traced ``block_lift`` / ``block_scan``: ``(*inputs, valid) -> state``."""
        fn = getattr(self, what)
        if fn is None:
            return None
        vars_ = [Var(i.name, i.vector) for i in self.inputs] + [Var("valid")]
        g = trace(fn, vars_, f"{self.name}.{what}", n_outputs=len(self.fields))
        self._check_shapes(g, what)
        return g

    @cached_property
    def block_lift_graph(self) -> Graph | None:
        return self._block_graph("block_lift")

    @cached_property
    def block_scan_graph(self) -> Graph | None:
        return self._block_graph("block_scan")

    @cached_property
    def scan_exact_graph(self) -> Graph | None:
        if self.scan_exact is None:
            return None
        S = self.State
        g = trace(self.scan_exact, [Var(f.name, f.vector) for f in self.fields],
                  f"{self.name}.scan_exact", lambda fn, nodes: fn(S(*nodes)), n_outputs=1)
        if g.outputs[0].vector:
            raise ValueError(f"monoid {self.name!r}: scan_exact must give one scalar flag "
                             f"per state, not a vector")
        return g

    @property
    def output_names(self) -> tuple[str, ...]:
        if self.outputs is not None:
            return tuple(self.outputs)
        if self.finalize is None:
            return self.field_names
        n = len(self.finalize_graph.outputs)
        return ("result",) if n == 1 else tuple(f"out{i}" for i in range(n))

    def _check_shapes(self, g: Graph, what: str):
        for f, out in zip(self.fields, g.outputs):
            if out.vector and not f.vector:
                raise ValueError(f"monoid {self.name!r}: {what} gives a vector value for the "
                                 f"scalar field {f.name!r}")


def _as_params(name: str, params) -> tuple:
    """``params`` as a tuple of ``(name, default)`` pairs: from a mapping or pairs, names
    unique identifiers, defaults real numbers."""
    where = f"monoid {name!r}: params"
    if isinstance(params, Mapping):
        pairs = list(params.items())
    elif isinstance(params, (tuple, list)):
        pairs = list(params)
        for p in pairs:
            if not isinstance(p, (tuple, list)) or len(p) != 2:
                raise TypeError(f"{where} must be a mapping of names to default values or "
                                f"(name, default) pairs, got the entry {p!r}")
    else:
        raise TypeError(f"{where} must be a mapping of names to default values, e.g. "
                        f"{{'correction': 0.0}}, got {type(params).__name__}")
    for k, v in pairs:
        if not isinstance(k, str):
            raise TypeError(f"{where}: names must be strings, got {k!r}")
        if not k.isidentifier() or keyword.iskeyword(k):
            raise ValueError(f"{where}: {k!r} is not a Python identifier (or is a keyword)")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{where}: the default of {k!r} must be a number, got {v!r}")
    names = [k for k, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: a name appears twice in {names}")
    return tuple((k, v) for k, v in pairs)


def _camel(name: str) -> str:
    """``name`` in CamelCase, an identifier whatever characters the name holds (a name is
    free text: ``"my-sum"`` -> ``MySum``, ``"2 sum"`` -> ``M2Sum``): the prefix of the
    type names of a monoid's states and results."""
    words = "".join(c if c.isalnum() else " " for c in name).split()
    out = "".join(w[:1].upper() + w[1:] for w in words) or "Monoid"
    return out if out.isidentifier() else "M" + out
