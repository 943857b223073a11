"""The algebra layer: pure Python + NumPy.

* :class:`Monoid`, :class:`Field`, :class:`Input`: declarative monoids;
* :mod:`~flashfold.algebra.ops`: the math combines are written in;
* :mod:`~flashfold.algebra.ir` and :mod:`~flashfold.algebra.lower`: the traced IR and its
  per-backend lowerings (the NumPy one is here; Triton and SymPy register theirs);
* :mod:`~flashfold.algebra.evaluate`: a monoid's graphs run on NumPy arrays;
* :func:`check_laws`: randomized law checking with a tolerance from the error bound;
* :mod:`~flashfold.algebra.tolerances`: the tolerance of each dtype and the elementwise
  comparison the numeric checks use (:mod:`flashfold.testing` builds on it).
"""

from . import ops
from .evaluate import NumpyMonoid, numpy_monoid
from .ir import Graph, Node, Var, trace
from .laws import LawReport, check_laws
from .lower import Backend, compile_graph, function_source, get_backend, register_backend
from .monoid import Field, Input, Monoid

__all__ = ["ops", "Graph", "Node", "Var", "trace", "Backend", "compile_graph",
           "function_source", "get_backend", "register_backend", "Field", "Input", "Monoid",
           "NumpyMonoid", "numpy_monoid", "check_laws", "LawReport"]
