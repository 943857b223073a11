"""``flashfold.ops``: the math monoids, score modifications and masks are written in.

See :mod:`flashfold.algebra.ops` for the list; this module re-exports it so that user
code reads ``from flashfold import ops``.
"""

from .algebra.ops import *  # noqa: F401,F403
from .algebra.ops import __all__  # noqa: F401
