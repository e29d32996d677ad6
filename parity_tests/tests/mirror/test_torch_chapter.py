"""torch_impl prints the chapter's numbers: every value it shows, to its 4 decimals.

Each test replays one of the chapter's listings with its seed, then compares
with the value transcribed in ``parity_tests.chapter_values``.
"""

import pytest
import torch

from parity_tests.common import chapter_values as cv
from torch_impl import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
    SimplifiedSelfAttention,
)

from parity_tests.chapter.replay_causal import draws_the_chapters_mask

# The chapter's dropout draws come from PyTorch's RNG: releases before cv.DROPOUT_MASK_FROM
# draw another mask (the replay says so with the release, and holds NumPy to PyTorch's mask).
chapters_mask = pytest.mark.skipif(
    not draws_the_chapters_mask(cv),
    reason=f"PyTorch {torch.__version__} draws another dropout mask than the chapter's "
           f"(PyTorch ≥ {cv.DROPOUT_MASK_FROM} draws it)")


def assert_printed(actual, printed, what):
    """``actual`` shows as ``printed`` to the chapter's 4 decimals (-inf where it prints -inf)."""
    expected = torch.tensor(printed, dtype=torch.float32)
    actual = actual.detach().to(torch.float32)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, chapter {tuple(expected.shape)}"
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=cv.PRINTED_ATOL,
                               msg=lambda m: f"{what} differs from the chapter's printout\n{m}")


@pytest.fixture
def inputs():
    return torch.tensor(cv.INPUTS)                                 # (6, 3)


@pytest.fixture
def batch(inputs):
    return torch.stack((inputs, inputs), dim=0)                    # (2, 6, 3)


# --- Section 3.3: simplified self-attention, no weights ------------------------------

def test_dot_products_with_query_journey(inputs):
    query = inputs[1]
    attn_scores_2 = torch.empty(inputs.shape[0])
    for i, x_i in enumerate(inputs):
        attn_scores_2[i] = torch.dot(x_i, query)
    assert_printed(attn_scores_2, cv.SIMPLE_ATTN_SCORES_2, "attn_scores_2")
    assert_printed(torch.dot(inputs[0], query), cv.SIMPLE_DOT_X1_QUERY, "x^1 . query")


def test_sum_normalised_and_softmax_weights(inputs):
    attn_scores_2 = inputs @ inputs[1]
    attn_weights_2_tmp = attn_scores_2 / attn_scores_2.sum()
    assert_printed(attn_weights_2_tmp, cv.SIMPLE_SUM_NORMALIZED_2, "sum-normalised weights")
    attn_weights_2 = torch.softmax(attn_scores_2, dim=0)
    assert_printed(attn_weights_2, cv.SIMPLE_ATTN_WEIGHTS_2, "softmax weights")
    context_vec_2 = attn_weights_2 @ inputs
    assert_printed(context_vec_2, cv.SIMPLE_CONTEXT_VEC_2, "context_vec_2")


def test_simplified_self_attention_module(inputs):
    attn_scores = inputs @ inputs.T
    assert_printed(attn_scores[:2], cv.SIMPLE_ATTN_SCORES_FIRST_ROWS, "attn_scores rows 1-2")
    all_context_vecs = SimplifiedSelfAttention()(inputs)
    assert_printed(all_context_vecs, cv.SIMPLE_ALL_CONTEXT_VECS, "all_context_vecs")


# --- Section 3.4: trainable weights --------------------------------------------------

def test_weights_step_by_step(inputs):
    torch.manual_seed(cv.SEED_WEIGHTS_STEP_BY_STEP)
    W_query = torch.nn.Parameter(torch.rand(cv.D_IN, cv.D_OUT), requires_grad=False)
    W_key   = torch.nn.Parameter(torch.rand(cv.D_IN, cv.D_OUT), requires_grad=False)
    W_value = torch.nn.Parameter(torch.rand(cv.D_IN, cv.D_OUT), requires_grad=False)
    query_2 = inputs[1] @ W_query
    keys    = inputs @ W_key
    values  = inputs @ W_value
    assert_printed(query_2, cv.QUERY_2, "query_2")
    attn_scores_2 = query_2 @ keys.T
    assert_printed(attn_scores_2, cv.ATTN_SCORES_2, "attn_scores_2")
    attn_weights_2 = torch.softmax(attn_scores_2 / keys.shape[-1]**0.5, dim=-1)
    assert_printed(attn_weights_2, cv.ATTN_WEIGHTS_2, "attn_weights_2")
    assert_printed(attn_weights_2 @ values, cv.CONTEXT_VEC_2, "context_vec_2")


def test_self_attention_v1_seed_123(inputs):
    torch.manual_seed(cv.SEED_V1)
    sa_v1 = SelfAttention_v1(cv.D_IN, cv.D_OUT)
    assert_printed(sa_v1(inputs), cv.SA_V1_OUTPUT, "SelfAttention_v1 output")
    # its second row is the step-by-step context_vec_2: same seed, same draw order
    assert_printed(sa_v1(inputs)[1], cv.CONTEXT_VEC_2, "SelfAttention_v1 row 2")


def test_self_attention_v2_seed_789(inputs):
    torch.manual_seed(cv.SEED_V2)
    sa_v2 = SelfAttention_v2(cv.D_IN, cv.D_OUT)
    assert_printed(sa_v2(inputs), cv.SA_V2_OUTPUT, "SelfAttention_v2 output")


# --- Section 3.5: causal mask and dropout, on sa_v2's weights --------------------------

@pytest.fixture
def sa_v2_scores(inputs):
    """The chapter's ``attn_scores`` and ``keys`` from ``sa_v2`` (seed 789)."""
    torch.manual_seed(cv.SEED_V2)
    sa_v2 = SelfAttention_v2(cv.D_IN, cv.D_OUT)
    queries = sa_v2.W_query(inputs)
    keys    = sa_v2.W_key(inputs)
    return queries @ keys.T, keys


def test_causal_mask_after_softmax(sa_v2_scores):
    attn_scores, keys = sa_v2_scores
    attn_weights = torch.softmax(attn_scores / keys.shape[-1]**0.5, dim=-1)
    assert_printed(attn_weights, cv.CAUSAL_ATTN_WEIGHTS_UNMASKED, "attn_weights before masking")
    context_length = attn_scores.shape[0]
    mask_simple = torch.tril(torch.ones(context_length, context_length))
    masked_simple = attn_weights * mask_simple
    assert_printed(masked_simple, cv.CAUSAL_MASKED_SIMPLE, "masked_simple")
    masked_simple_norm = masked_simple / masked_simple.sum(dim=-1, keepdim=True)
    assert_printed(masked_simple_norm, cv.CAUSAL_ATTN_WEIGHTS, "masked_simple_norm")


def test_causal_mask_before_softmax(sa_v2_scores):
    attn_scores, keys = sa_v2_scores
    context_length = attn_scores.shape[0]
    mask = torch.triu(torch.ones(context_length, context_length), diagonal=1)
    masked = attn_scores.masked_fill(mask.bool(), -torch.inf)
    # the chapter prints the raw scores here, not yet divided by sqrt(d_k)
    assert_printed(masked, cv.CAUSAL_MASKED_SCORES, "masked scores")
    attn_weights = torch.softmax(masked / keys.shape[-1]**0.5, dim=-1)
    assert_printed(attn_weights, cv.CAUSAL_ATTN_WEIGHTS, "attn_weights (-inf approach)")


@chapters_mask
def test_dropout_on_ones_seed_123():
    torch.manual_seed(cv.SEED_DROPOUT)
    dropout = torch.nn.Dropout(cv.DROPOUT_P)
    assert_printed(dropout(torch.ones(6, 6)), cv.DROPOUT_ON_ONES, "dropout(ones)")


@chapters_mask
def test_dropout_on_causal_weights_seed_123(sa_v2_scores):
    """The chapter warns these draws can vary by system; PyTorch 2.7 and later on CPU reproduce them."""
    attn_scores, keys = sa_v2_scores
    mask = torch.triu(torch.ones(*attn_scores.shape), diagonal=1)
    attn_weights = torch.softmax(attn_scores.masked_fill(mask.bool(), -torch.inf)
                                 / keys.shape[-1]**0.5, dim=-1)
    dropout = torch.nn.Dropout(cv.DROPOUT_P)
    torch.manual_seed(cv.SEED_DROPOUT)
    dropped = dropout(attn_weights)
    assert_printed(dropped, cv.DROPOUT_ON_CAUSAL_WEIGHTS, "dropout(attn_weights)")


def test_dropout_structure_holds_on_any_system():
    """What no system changes: survivors are exactly 1/(1-p) times their input, the rest 0."""
    attn_weights = torch.tensor(cv.CAUSAL_ATTN_WEIGHTS)
    torch.manual_seed(0)
    dropped = torch.nn.Dropout(cv.DROPOUT_P)(attn_weights)
    kept = dropped != 0
    assert kept.any() and not kept[attn_weights != 0].all(), "p=0.5 kept none or all"
    assert torch.equal(dropped[kept], attn_weights[kept] * 2.0)
    assert not kept[attn_weights == 0].any(), "dropout revived a masked (future) position"


@chapters_mask
def test_causal_attention_module_applies_the_chapters_mask_and_dropout(inputs):
    """CausalAttention with sa_v2's weights, p=0.5, seed 123: the weights its dropout
    sees and returns are the chapter's printed matrices."""
    torch.manual_seed(cv.SEED_V2)
    sa_v2 = SelfAttention_v2(cv.D_IN, cv.D_OUT)
    ca = CausalAttention(cv.D_IN, cv.D_OUT, len(cv.INPUTS), cv.DROPOUT_P)
    missing, unexpected = ca.load_state_dict(sa_v2.state_dict(), strict=False)
    assert missing == ["mask"] and unexpected == []             # every weight, not the mask
    seen = {}
    ca.dropout.register_forward_hook(lambda mod, args, out: seen.update(before=args[0], after=out))
    torch.manual_seed(cv.SEED_DROPOUT)
    ca(inputs[None])
    assert_printed(seen["before"][0], cv.CAUSAL_ATTN_WEIGHTS, "CausalAttention attn_weights")
    assert_printed(seen["after"][0], cv.DROPOUT_ON_CAUSAL_WEIGHTS, "CausalAttention dropped weights")


def test_causal_attention_seed_123_shape(batch):
    torch.manual_seed(cv.SEED_CAUSAL)
    assert list(batch.shape) == cv.BATCH_SHAPE
    ca = CausalAttention(cv.D_IN, cv.D_OUT, batch.shape[1], 0.0)
    assert list(ca(batch).shape) == cv.CAUSAL_CONTEXT_VECS_SHAPE


# --- Section 3.6.1: the wrapper -------------------------------------------------------

def test_multi_head_wrapper_seed_123(batch):
    torch.manual_seed(cv.SEED_WRAPPER)
    mha = MultiHeadAttentionWrapper(cv.D_IN, cv.D_OUT, batch.shape[1], 0.0, num_heads=2)
    context_vecs = mha(batch)
    assert list(context_vecs.shape) == cv.WRAPPER_CONTEXT_VECS_SHAPE
    assert_printed(context_vecs, cv.WRAPPER_CONTEXT_VECS, "MultiHeadAttentionWrapper output")


# Exercise 3.2 prints no numbers: these are this implementation's, pinned so a change shows.
EXERCISE_3_2_ONE_SEQUENCE = [
    [-0.5740, 0.2216],
    [-0.7320, 0.0155],
    [-0.7774, -0.0546],
    [-0.6979, -0.0817],
    [-0.6538, -0.0957],
    [-0.6424, -0.1065],
]


def test_exercise_3_2_two_dimensional_context_vectors(batch):
    def run():
        torch.manual_seed(cv.SEED_WRAPPER)
        mha = MultiHeadAttentionWrapper(cv.D_IN, 1, batch.shape[1], 0.0, num_heads=2)
        return mha(batch)

    context_vecs = run()
    assert list(context_vecs.shape) == cv.EXERCISE_3_2_SHAPE
    assert torch.equal(context_vecs, run()), "same seed, different output"
    assert_printed(context_vecs, [EXERCISE_3_2_ONE_SEQUENCE] * 2, "exercise 3.2 output")


# --- Section 3.6.2: the chapter stops before printing MultiHeadAttention's output -------
# These are this implementation's numbers with the chapter's seed, pinned so that a
# change in the order the layers are created (W_query, W_key, W_value, out_proj) shows.
MHA_SEED_123_ONE_SEQUENCE = [
    [0.3190, 0.4858],
    [0.2943, 0.3897],
    [0.2856, 0.3593],
    [0.2693, 0.3873],
    [0.2639, 0.3928],
    [0.2575, 0.4028],
]


def test_multi_head_attention_seed_123(batch):
    torch.manual_seed(cv.SEED_WRAPPER)
    mha = MultiHeadAttention(cv.D_IN, cv.D_OUT, batch.shape[1], 0.0, num_heads=2)
    assert_printed(mha(batch), [MHA_SEED_123_ONE_SEQUENCE] * 2, "MultiHeadAttention output")
