"""torch_impl refuses bad input with a message that names the argument and what was expected."""

import numpy as np
import pytest
import torch

from torch_impl import (
    CausalAttention,
    FusedMultiHeadAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
    SimplifiedSelfAttention,
)

# --- Constructors: (call, exception, message) --------------------------------------------

BAD_CONSTRUCTIONS = [
    (lambda: SelfAttention_v1(0, 2), ValueError, r"d_in must be a positive integer, got 0"),
    (lambda: SelfAttention_v1(3, -2), ValueError, r"d_out must be a positive integer, got -2"),
    (lambda: SelfAttention_v1(3.0, 2), TypeError, r"d_in must be a positive integer, got float"),
    (lambda: SelfAttention_v2(3, True), TypeError, r"d_out must be a positive integer, got the bool"),
    (lambda: SelfAttention_v2(3, "2"), TypeError, r"d_out must be a positive integer, got str"),
    (lambda: CausalAttention(3, 2, 0, 0.0), ValueError, r"context_length must be a positive integer"),
    (lambda: CausalAttention(3, 2, 6, 1.01), ValueError, r"dropout must be in \[0, 1\], got 1.01"),
    (lambda: CausalAttention(3, 2, 6, -0.1), ValueError, r"dropout must be in \[0, 1\]"),
    (lambda: CausalAttention(3, 2, 6, float("nan")), ValueError, r"dropout must be in \[0, 1\]"),
    (lambda: CausalAttention(3, 2, 6, "0.1"), TypeError, r"dropout must be a number in \[0, 1\]"),
    # num_heads slipped by position into qkv_bias would silently turn biases on
    (lambda: CausalAttention(3, 2, 6, 0.0, 2), TypeError, r"qkv_bias must be True or False, got int"),
    (lambda: MultiHeadAttentionWrapper(3, 2, 6, 0.0, 0), ValueError, r"num_heads must be a positive integer"),
    (lambda: MultiHeadAttention(3, 5, 6, 0.0, 2), ValueError,
     r"d_out must be divisible by num_heads, got d_out=5 and num_heads=2"),
    (lambda: MultiHeadAttention(3, 4, 6, 0.0, 0), ValueError, r"num_heads must be a positive integer, got 0"),
    (lambda: MultiHeadAttention(3, 4, 6, 0.0, 2.0), TypeError, r"num_heads must be a positive integer"),
    (lambda: FusedMultiHeadAttention(3, 4, 6, 0.0, 3), ValueError, r"d_out must be divisible by num_heads"),
    (lambda: FusedMultiHeadAttention(3, 4, 6, 1.5, 2), ValueError, r"dropout must be in \[0, 1\]"),
]


@pytest.mark.parametrize("make, error, message", BAD_CONSTRUCTIONS)
def test_bad_constructor_arguments_are_refused(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_numpy_bool_is_a_bool_for_qkv_bias():
    assert SelfAttention_v2(3, 2, np.bool_(True)).W_query.bias is not None


def test_autocast_may_feed_another_dtype():
    mha = MultiHeadAttention(3, 4, 6, 0.0, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert mha(torch.ones(1, 4, 3, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_integer_like_sizes_are_accepted():
    mha = MultiHeadAttention(np.int64(3), np.int64(4), np.int64(6), 0, np.int64(2))
    assert mha.head_dim == 2 and isinstance(mha.head_dim, int)


# --- Forward: (module, input, exception, message) ------------------------------------------

def _modules():
    return {
        "simplified": SimplifiedSelfAttention(),
        "v1": SelfAttention_v1(3, 2),
        "v2": SelfAttention_v2(3, 2),
        "causal": CausalAttention(3, 2, 6, 0.0),
        "wrapper": MultiHeadAttentionWrapper(3, 2, 6, 0.0, 2),
        "mha": MultiHeadAttention(3, 4, 6, 0.0, 2),
        "fused": FusedMultiHeadAttention(3, 4, 6, 0.0, 2),
    }


TWO_D = ["simplified", "v1", "v2"]
THREE_D = ["causal", "wrapper", "mha", "fused"]

BAD_INPUTS = (
    [(name, [[0.1, 0.2, 0.3]], TypeError, r"x must be a torch.Tensor, got list") for name in TWO_D + THREE_D]
    + [(name, np.zeros((6, 3)), TypeError, r"x must be a torch.Tensor, got ndarray") for name in TWO_D]
    + [(name, torch.ones(6, 3, dtype=torch.int64), TypeError, r"x must hold floating-point numbers")
       for name in TWO_D]
    + [(name, torch.ones(2, 6, 3), ValueError, r"x must be 2-D \(num_tokens, d_in\), got 3-D") for name in TWO_D]
    + [(name, torch.ones(6, 3), ValueError, r"x must be 3-D \(batch, num_tokens, d_in\), got 2-D")
       for name in THREE_D]
    + [(name, torch.ones(6, 4), ValueError, r"x's last dimension must be d_in=3, got 4") for name in ["v1", "v2"]]
    + [(name, torch.ones(2, 6, 4), ValueError, r"x's last dimension must be d_in=3, got 4") for name in THREE_D]
    + [(name, torch.ones(2, 7, 3), ValueError, r"x has 7 tokens but context_length=6") for name in THREE_D]
    + [(name, torch.ones(0, 3), ValueError, r"x must hold at least one token") for name in TWO_D]
    + [(name, torch.ones(2, 0, 3), ValueError, r"x must hold at least one token") for name in THREE_D]
    # the chapter's code would fail inside the matmul: "expected m1 and m2 to have the same dtype"
    + [(name, torch.ones(6, 3, dtype=torch.float64), TypeError,
        r"x has dtype torch.float64 but the module's weights have torch.float32")
       for name in ["v1", "v2"]]
    + [(name, torch.ones(2, 6, 3, dtype=torch.float64), TypeError,
        r"x has dtype torch.float64 but the module's weights have torch.float32") for name in THREE_D]
    + [(name, torch.ones(2, 6, 3, device="meta"), ValueError,
        r"x is on meta but the module's weights are on cpu") for name in THREE_D]
)


@pytest.mark.parametrize("name, x, error, message", BAD_INPUTS,
                         ids=[f"{n}-{e.__name__}-{i}" for i, (n, _, e, _) in enumerate(BAD_INPUTS)])
def test_bad_inputs_are_refused(name, x, error, message):
    module = _modules()[name]
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(error, match=message):
        module(x)
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused call changed the module"


def test_fewer_tokens_than_context_length_and_nan_values_are_accepted():
    mha = MultiHeadAttention(3, 4, 6, 0.0, 2)
    assert mha(torch.ones(2, 4, 3)).shape == (2, 4, 4)
    x = torch.ones(1, 3, 3)
    x[0, 0, 0] = float("nan")
    assert torch.isnan(mha(x)).all(), "NaN in the first token reaches every later one"
