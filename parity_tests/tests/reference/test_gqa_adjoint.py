"""numpy_ref.variants.gqa_forward / gqa_backward: the backward is the adjoint of
the forward (<gqa_forward(x), y> = <x, gqa_backward(y)>), both agree with the
kv_head map the reference reads through, and the reference's GQA gradients are
gqa_backward of the per-query-head ones.  A planted backward in torch.repeat's
head order fails each check."""

import numpy as np
import pytest

from numpy_ref import reference_attention, variants


def _planted_backward(dkv_per_q_head, num_kv_heads):
    """The adjoint of torch.repeat's order (h -> h % Hkv), not repeat_interleave's."""
    B, Hq, T, D = dkv_per_q_head.shape
    return dkv_per_q_head.reshape(B, Hq // num_kv_heads, num_kv_heads, T, D).sum(axis=1)


def adjoint_gap(backward, Hq, Hkv, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, Hkv, 5, 3))
    y = rng.standard_normal((2, Hq, 5, 3))
    lhs = np.vdot(variants.gqa_forward(x, Hq), y)
    rhs = np.vdot(x, backward(y, Hkv))
    return abs(lhs - rhs) / max(abs(lhs), 1.0)


@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (6, 3), (4, 1), (3, 3)])
def test_the_backward_is_the_adjoint_of_the_forward(Hq, Hkv):
    assert adjoint_gap(variants.gqa_backward, Hq, Hkv) <= 1e-14
    x = np.random.default_rng(1).standard_normal((2, Hkv, 5, 3))
    rep = variants.gqa_forward(x, Hq)
    for h in range(Hq):
        assert np.array_equal(rep[:, h], x[:, variants.kv_head(h, Hq, Hkv)])


@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (6, 3)])
def test_a_planted_backward_in_the_wrong_head_order_is_caught(Hq, Hkv):
    assert adjoint_gap(_planted_backward, Hq, Hkv) > 1e-3


def test_the_references_gqa_gradients_are_gqa_backward_of_per_head_ones():
    rng = np.random.default_rng(2)
    Hq, Hkv = 4, 2
    q = rng.standard_normal((2, Hq, 6, 3))
    k, v = (rng.standard_normal((2, Hkv, 7, 3)) for _ in range(2))
    dout = rng.standard_normal((2, Hq, 6, 3))
    options = dict(causal=True, align="bottom-right", softcap=2.0)
    shared = reference_attention(q, k, v, dout, **options)
    own = reference_attention(q, variants.gqa_forward(k, Hq), variants.gqa_forward(v, Hq),
                              dout, **options)
    assert np.allclose(shared["out"], own["out"], rtol=1e-14, atol=1e-14)
    for name in ("dk", "dv"):
        assert np.allclose(shared[name], variants.gqa_backward(own[name], Hkv),
                           rtol=1e-13, atol=1e-13)
        assert not np.allclose(shared[name], _planted_backward(own[name], Hkv), atol=1e-3)
