"""numpy_ref.variants' score ops as one list: forward in order, backward in
reverse, each op's backward against finite differences of the whole list, the
bias's gradient included; and a new op is one more list entry."""

import numpy as np
import pytest

from numpy_ref import variants
from parity_tests.common.finite_diff import eval_numerical_gradient_array, rel_error
from parity_tests.common.tolerances import FINITE_DIFF_BOUND

TILE = variants.Tile(3, 7, 2, 7)            # rows 3..6, keys 2..6 of some head


def _ops(bias, dbias=None):
    return variants.score_ops(softcap=1.7, slope=0.3, offset=2, bias=bias, dbias=dbias)


@pytest.mark.parametrize("bias_shape", [(4, 5), (1, 5), (4, 1)])
def test_the_list_backward_is_the_gradient_of_the_list_forward(bias_shape):
    rng = np.random.default_rng(0)
    S, dS = rng.standard_normal((2, 4, 5)) * 2
    full = rng.standard_normal((7 if bias_shape[0] > 1 else 1, 7 if bias_shape[1] > 1 else 1))
    dbias = np.zeros_like(full)
    ops = _ops(full, dbias)
    assert [type(op).__name__ for op in ops] == ["Softcap", "Alibi", "Bias"]
    out, saved = variants.scores_forward(ops, S.copy(), TILE)
    got = variants.scores_backward(ops, dS, saved, TILE)

    def f():
        return variants.scores_forward(_ops(full), S.copy(), TILE)[0]
    assert rel_error(got, eval_numerical_gradient_array(f, S, dS)) <= FINITE_DIFF_BOUND
    numeric = eval_numerical_gradient_array(f, full, dS)
    assert rel_error(dbias, numeric) <= FINITE_DIFF_BOUND
    assert np.count_nonzero(numeric) == np.count_nonzero(dbias) > 0   # only the tile's entries


class Double:
    """A made-up score change, ``S ← 2 S``: the whole of what a new op needs."""

    def forward(self, S, tile):
        return 2 * S, None

    def backward(self, dS, saved, tile):
        return 2 * dS


def test_a_new_op_is_one_list_entry_and_the_backward_walks_in_reverse():
    rng = np.random.default_rng(1)
    S, dS = rng.standard_normal((2, 4, 5))
    for ops in ([Double()] + _ops(None), _ops(None) + [Double()]):
        _, saved = variants.scores_forward(ops, S.copy(), TILE)
        got = variants.scores_backward(ops, dS, saved, TILE)

        def f():
            return variants.scores_forward(ops, S.copy(), TILE)[0]
        assert rel_error(got, eval_numerical_gradient_array(f, S, dS)) <= FINITE_DIFF_BOUND


def test_a_list_backward_that_skips_an_op_is_caught():
    rng = np.random.default_rng(2)
    S, dS = rng.standard_normal((2, 4, 5))
    ops = [Double()] + _ops(None)
    _, saved = variants.scores_forward(ops, S.copy(), TILE)
    skipped = variants.scores_backward(ops[1:], dS, saved[1:], TILE)   # Double's 2 lost

    def f():
        return variants.scores_forward(ops, S.copy(), TILE)[0]
    assert rel_error(skipped, eval_numerical_gradient_array(f, S, dS)) > 0.1
