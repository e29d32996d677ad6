"""``MultiHeadAttention`` with the attention computed by PyTorch's fused kernel.

``torch.nn.functional.scaled_dot_product_attention`` computes, in one call,
what ``MultiHeadAttention.forward`` spells out in five lines::

    attn_scores  = queries @ keys.transpose(2, 3)             # (b, H, T, T)
    attn_scores.masked_fill_(mask_bool, -torch.inf)
    attn_weights = torch.softmax(attn_scores / head_dim**0.5, dim=-1)
    attn_weights = self.dropout(attn_weights)
    context_vec  = attn_weights @ values                      # (b, H, T, head_dim)

with ``is_causal=True`` standing for the mask (the same lower triangle, top-left
aligned since queries and keys have the same length) and the default scale
``1 / sqrt(head_dim)``.  On a GPU it dispatches to FlashAttention or
memory-efficient kernels that never build the (T, T) matrix.

Everything else — the parameters, the ``mask`` buffer, the ``state_dict`` keys —
is inherited unchanged, so weights load across ``MultiHeadAttention`` and
``FusedMultiHeadAttention`` both ways.  The buffer is unused here but kept so
that ``load_state_dict(..., strict=True)`` accepts either model's checkpoint.
"""

import torch.nn.functional as F

from torch_impl.attention import MultiHeadAttention

__all__ = ["FusedMultiHeadAttention"]


class FusedMultiHeadAttention(MultiHeadAttention):
    """``MultiHeadAttention(d_in, d_out, context_length, dropout, num_heads, qkv_bias=False)``.

    Dropout is the fused kernel's own (rate ``self.dropout.p``, active only in
    training mode): it draws a different keep-mask from ``nn.Dropout``, so only
    dropout-free results match ``MultiHeadAttention`` exactly.
    """

    def forward(self, x):
        self._check(x)
        b, num_tokens, d_in = x.shape
        keys    = self.W_key(x)                                # (b, T, d_out)
        queries = self.W_query(x)
        values  = self.W_value(x)

        keys    = keys.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)     # (b, H, T, head_dim)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values  = values.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)

        dropout_p = self.dropout.p if self.training else 0.0
        context_vec = F.scaled_dot_product_attention(          # (b, H, T, head_dim)
            queries, keys, values, dropout_p=dropout_p, is_causal=True
        )

        context_vec = context_vec.transpose(1, 2)              # (b, T, H, head_dim)
        context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)  # (b, T, d_out)
        context_vec = self.out_proj(context_vec)
        return context_vec
