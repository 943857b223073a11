"""User-defined monoids that live only in the tests (not built-ins).

Imported by the tests and by ``flashfold check user_monoids:NAME`` in the CLI tests.
"""

from flashfold import Field, Input, Monoid, ops

#: (min, max) pair: commutative
MINMAX = Monoid(
    "minmax", fields=("lo", "hi"), identity=(ops.inf, -ops.inf),
    lift=lambda x: (x, x),
    combine=lambda a, b: (ops.minimum(a.lo, b.lo), ops.maximum(a.hi, b.hi)),
    commutative=True)

#: 2x2 matrix product, row-major [[a, b], [c, d]]: associative, NOT commutative.
#: An element x lifts to the unimodular matrix [[1 + x^2, x], [x, 1]]; two such matrices
#: commute only when their x are equal, so any reordering changes the product.
MATMUL2 = Monoid(
    "matmul2", fields=("a", "b", "c", "d"), identity=(1.0, 0.0, 0.0, 1.0),
    inputs=(Input("x", domain="finite"),),
    lift=lambda x: (1.0 + x * x, x, x, 1.0),
    combine=lambda p, q: (p.a * q.a + p.b * q.c, p.a * q.b + p.b * q.d,
                          p.c * q.a + p.d * q.c, p.c * q.b + p.d * q.d),
    commutative=False)

#: maximum prefix sum (sum, best prefix): associative, NOT commutative
MAX_PREFIX_SUM = Monoid(
    "max_prefix_sum", fields=("s", "best"), identity=(0.0, -ops.inf),
    inputs=(Input("x", domain="finite"),),
    lift=lambda x: (x, x),
    combine=lambda a, b: (a.s + b.s, ops.maximum(a.best, a.s + b.best)),
    finalize=lambda st: st.best,
    commutative=False)

#: the average "combine": commutative but NOT associative; check_laws must catch it
AVERAGE = Monoid(
    "average", fields=("x",), identity=(0.0,),
    inputs=(Input("x", domain="finite"),),
    lift=lambda x: (x,),
    combine=lambda a, b: ((a.x + b.x) / 2.0,),
    commutative=True)

#: subtraction: neither associative nor commutative
SUBTRACT = Monoid(
    "subtract", fields=("x",), identity=(0.0,),
    inputs=(Input("x", domain="finite"),),
    lift=lambda x: (x,),
    combine=lambda a, b: (a.x - b.x,),
    commutative=False)


def _merge_forgetting_rescale(a, b):
    m = ops.maximum(a.m, b.m)
    p = ops.where(ops.isinf(m), 0.0, m)
    return m, a.d * ops.exp(a.m - p) + b.d * ops.exp(b.m - p), a.o + b.o * ops.exp(b.m - p)


#: an attention merge that forgets to rescale the earlier accumulator (the spec's bug)
FORGOT_RESCALE = Monoid(
    "forgot_rescale", fields=("m", "d", Field("o", vector=True)), identity=(-ops.inf, 0.0, 0.0),
    inputs=("score", Input("value", vector=True, domain="finite")),
    lift=lambda s, v: (s, ops.where(s > -ops.inf, 1.0, 0.0), ops.where(s > -ops.inf, v, 0.0)),
    combine=_merge_forgetting_rescale,
    commutative=True)

NOT_A_MONOID = 42
