"""Pure NumPy attention: every mechanism of the chapter, forward and hand-written backward.

Imports NumPy only.  Read each forward with its backward directly below it.
"""

from numpy_ref.softmax import (
    softmax,
    softmax_naive,
    softmax_jacobian,
    softmax_backward,
    sum_normalize,
    sum_normalize_jacobian,
)
from numpy_ref import ops
from numpy_ref.module import Module
from numpy_ref.attention import (
    SimplifiedSelfAttention,
    SelfAttention_v1,
    SelfAttention_v2,
    CausalAttention,
    MultiHeadAttentionWrapper,
    MultiHeadAttention,
)
from numpy_ref.fast import FastMultiHeadAttention
from numpy_ref.blockwise import attention_forward, attention_backward
from numpy_ref.blockwise_attention import BlockwiseMultiHeadAttention
from numpy_ref.reference import reference_attention
from numpy_ref.visibility import Visibility, alignment_offset, visible_mask
from numpy_ref.merge import merge_states, merge_states_backward

__all__ = [
    "softmax", "softmax_naive", "softmax_jacobian", "softmax_backward",
    "sum_normalize", "sum_normalize_jacobian", "ops", "Module",
    "SimplifiedSelfAttention", "SelfAttention_v1", "SelfAttention_v2",
    "CausalAttention", "MultiHeadAttentionWrapper", "MultiHeadAttention",
    "FastMultiHeadAttention", "attention_forward", "attention_backward",
    "BlockwiseMultiHeadAttention", "reference_attention",
    "Visibility", "alignment_offset", "visible_mask",
    "merge_states", "merge_states_backward",
]
