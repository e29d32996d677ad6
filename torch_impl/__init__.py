"""The chapter's attention modules in PyTorch, on any device.

The six classes of the chapter, read line for line like it, plus
``FusedMultiHeadAttention``: ``MultiHeadAttention``'s parameters with the
attention computed by ``torch.nn.functional.scaled_dot_product_attention``.
"""

from torch_impl.attention import (
    SimplifiedSelfAttention,
    SelfAttention_v1,
    SelfAttention_v2,
    CausalAttention,
    MultiHeadAttentionWrapper,
    MultiHeadAttention,
)
from torch_impl.fused import FusedMultiHeadAttention

__all__ = [
    "SimplifiedSelfAttention",
    "SelfAttention_v1",
    "SelfAttention_v2",
    "CausalAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadAttention",
    "FusedMultiHeadAttention",
]
