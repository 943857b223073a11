"""The specification's worked examples, through the public API.

Numbers are as printed in seeds 003 (softmax of [2, 4, 1, 3], the block traces and the two
attention outputs) and 000 (the [3, 1] then [5, 2] trace), compared at the precision the
specification prints them.
"""

import numpy as np
import pytest

import flashfold as ff
from flashfold.cli import trace_blocks
from flashfold.monoids import ATTENTION, LOGSUMEXP


def printed(x, value, digits):
    """``x`` agrees with a number printed with ``digits`` decimals."""
    return abs(x - value) <= 0.5 * 10.0 ** -digits + 1e-12


def test_softmax_of_2_4_1_3():
    s = np.array([2.0, 4.0, 1.0, 3.0])
    st = ff.fold(LOGSUMEXP, s)
    assert st.m == 4.0 and printed(st.d, 1.553, 3)
    p = np.exp(s - st.m) / st.d
    for got, want in zip(p, [0.087, 0.644, 0.032, 0.237]):
        assert printed(got, want, 3)
    assert np.sum(p) == pytest.approx(1.0, abs=1e-15)


@pytest.mark.parametrize("scores,m_a,l_a,m,l", [
    ([2, 4, 1, 3], 4, 1.135, 4, 1.553),     # max in block A: no rescale
    ([1, 2, 5, 3], 2, 1.368, 5, 1.203),     # max in block B: rescale by e^-3
])
def test_block_traces(scores, m_a, l_a, m, l):
    rows, _, _ = trace_blocks(scores, 2)
    assert rows[0]["m"] == m_a and printed(rows[0]["l"], l_a, 3)
    assert rows[1]["m"] == m and printed(rows[1]["l"], l, 3)
    st = ff.fold(LOGSUMEXP, np.array(scores, float), blocks=[2, 2])
    assert st.m == m and printed(st.d, l, 3)


def test_attention_output_without_rescale():
    s = np.array([2.0, 4.0, 1.0, 3.0])
    v = np.array([[1, 0], [0, 1], [1, 1], [0, 0]], float)
    rows, out, _ = trace_blocks(s, 2, v)
    assert [printed(x, w, 3) for x, w in zip(rows[0]["o"], [0.135, 1.000])] == [True, True]
    assert [printed(x, w, 3) for x, w in zip(rows[1]["o"], [0.185, 1.050])] == [True, True]
    assert printed(out[0], 0.119, 3) and printed(out[1], 0.676, 3)
    o, _ = ff.finalize(ATTENTION, ff.fold(ATTENTION, (s, v), blocks=[2, 2]))
    assert printed(o[0], 0.119, 3) and printed(o[1], 0.676, 3)


def test_attention_output_with_rescale():
    s = np.array([1.0, 2.0, 5.0, 3.0])
    v = np.array([[1, 0], [0, 1], [2, 0], [0, 2]], float)
    rows, out, _ = trace_blocks(s, 2, v)
    assert printed(rows[1]["scale"], 0.050, 3)
    assert printed(rows[1]["l"], 1.203, 3)
    assert printed(rows[1]["o"][0], 2.018, 3) and printed(rows[1]["o"][1], 0.320, 3)
    # The walk-through prints [1.678, 0.266] from intermediates rounded to 3 decimals
    # (2.018 / 1.203); its own verification line prints [1.677, 0.266]. The exact value
    # 1.67712... sits between: within one unit of the last printed digit of both.
    assert abs(out[0] - 1.678) <= 1e-3 and printed(out[0], 1.677, 3)
    assert printed(out[1], 0.266, 3)


def test_trace_3_1_then_5_2():
    rows, _, _ = trace_blocks([3.0, 1.0, 5.0, 2.0], 2)
    assert rows[0]["m"] == 3 and printed(rows[0]["l"], 1.1353, 4)
    assert rows[1]["m"] == 5 and printed(rows[1]["scale"], 0.1353, 4)
    assert printed(rows[1]["l"], 1.2034, 4)
    direct = sum(np.exp(np.array([3, 1, 5, 2.0]) - 5))
    assert printed(direct, 1.2034, 4)


def test_check_your_understanding_rescales():
    # m = 3, l = 2.5, a block with max 7 arrives: scale e^-4 ~ 0.0183, l ~ 0.046
    a = LOGSUMEXP.State(np.array(3.0), np.array(2.5))
    from flashfold.algebra import numpy_monoid
    ex = numpy_monoid(LOGSUMEXP)
    m, d = ex.combine(tuple(a), (np.array(7.0), np.array(0.0)))
    assert m == 7 and printed(d, 0.046, 3)
    # [10, 20, 30] in blocks of one: rescale by e^-10 every time
    rows, _, _ = trace_blocks([10.0, 20.0, 30.0], 1)
    assert [r["m"] for r in rows] == [10, 20, 30]
    assert rows[0]["scale"] == 0.0
    assert rows[1]["scale"] == pytest.approx(4.54e-5, rel=1e-3)


def test_forgetting_to_rescale_the_accumulator_is_wrong_only_when_the_max_moves():
    """The specification's warning: tests with the max in the first block still pass."""
    def bad_merge(a, b):
        m = max(a[0], b[0])
        return m, a[1] * np.exp(a[0] - m) + b[1] * np.exp(b[0] - m), a[2] + b[2] * np.exp(b[0] - m)

    def run(s, v):
        st = [(s[i:i + 2].max(), np.exp(s[i:i + 2] - s[i:i + 2].max()).sum(),
               np.exp(s[i:i + 2] - s[i:i + 2].max()) @ v[i:i + 2]) for i in (0, 2)]
        m, l, o = bad_merge(*st)
        return o / l

    v = np.array([[1, 0], [0, 1], [2, 0], [0, 2]], float)
    good_first = np.array([5.0, 3.0, 1.0, 2.0])
    max_later = np.array([1.0, 2.0, 5.0, 3.0])
    for s, same in ((good_first, True), (max_later, False)):
        ref, _ = ff.finalize(ATTENTION, ff.fold(ATTENTION, (s, v)))
        assert np.allclose(run(s, v), ref) == same
