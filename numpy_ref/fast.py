"""MultiHeadAttention computed one block of queries at a time: same API, same numbers.

The causal mask hides every key after the query.  So the queries of a block
[q0, q1) see only the keys [0, q1): every score to the right of column q1 is
-inf, its softmax weight exactly 0, its gradient exactly 0.  Computing those
scores, exponentiating them and multiplying by them is wasted work, and
``MultiHeadAttention`` does all of it: about half of every (T, T) array.

``FastMultiHeadAttention`` runs the very same passes 2-6 (the ops of
``numpy_ref.ops``, through ``MultiHeadAttention._attend``) on each query block
against its key prefix::

    block [q0, q1):  queries[..., q0:q1, :]   keys[..., :q1, :]   values[..., :q1, :]
                     mask[q0:q1, :q1]         (only its last q1 - q0 columns hide anything)

    attn_scores, attn_weights of the block: (B, H, q1 - q0, q1)   instead of (B, H, T, T)

and the backward walks the blocks, each in reverse, adding each block's
gradient into the keys and values it saw (the prefix [0, q1)) and writing its
queries' rows.  The row softmax of a block row equals the full row's softmax
because the dropped columns held exp(-inf) = 0.

What it saves: the (T, T) work drops to about (T^2 + T * block_size) / 2, the
attention weights kept for the backward to the same, and the largest temporary
to one block.  Rounding may differ from ``MultiHeadAttention`` by the order of
the sums (last bits); tests hold the two together.

State between forward and backward is handled as in every module (see
``numpy_ref.module``): x and the parameters are copied by forward, a caller's
``keep_mask`` is fingerprinted once as a whole (not per block) and checked by
backward, and backward overwrites ``grads``.

Only the chapter's causal mask (strictly above the diagonal, the buffer
``triu(ones, 1)``) allows skipping; with any other mask buffer the forward falls
back to ``MultiHeadAttention``'s full (T, T) computation.
"""

import numpy as np

from numpy_ref.attention import MultiHeadAttention
from numpy_ref.module import check_size
from numpy_ref.visibility import visible_mask

__all__ = ["FastMultiHeadAttention"]


class FastMultiHeadAttention(MultiHeadAttention):
    """``MultiHeadAttention`` (same signature, parameters, state_dict, dropout
    draws) with attention computed per block of ``block_size`` queries.

    ``block_size`` (default 128) may be set on the class or on an instance; it
    must be a positive int, checked by every forward before any work."""

    block_size = 128

    def forward(self, x, keep_mask=None):
        check_size("block_size", self.block_size)
        return super().forward(x, keep_mask)

    def _attend(self, queries, keys, values, keep_mask, mask_bool=None):
        """Passes 2-6, block by block -> (context_vec, {"blocks": [...]})."""
        num_tokens = queries.shape[-2]
        mask_bool = self._buffers["mask"][:num_tokens, :num_tokens].astype(bool)
        if not _is_causal(mask_bool):
            return super()._attend(queries, keys, values, keep_mask, mask_bool)
        context_vec = np.empty(values.shape, dtype=values.dtype)        # (B, H, T, D)
        blocks = []
        for q0 in range(0, num_tokens, self.block_size):
            q1 = min(q0 + self.block_size, num_tokens)
            # the block's queries against the keys they may see: [0, q1)
            block_keep = None if keep_mask is None else keep_mask[..., q0:q1, :q1]
            block_context, block_caches = super()._attend(
                queries[..., q0:q1, :], keys[..., :q1, :], values[..., :q1, :],
                block_keep, mask_bool[q0:q1, :q1])                       # (B, H, q1-q0, D)
            context_vec[..., q0:q1, :] = block_context
            blocks.append(dict(span=(q0, q1), **block_caches))
        return context_vec, dict(blocks=blocks)

    def _attend_backward(self, dcontext_vec, c):
        """Passes 6-2 per block, in reverse within each block -> (dqueries, dkeys, dvalues)."""
        if "blocks" not in c:
            return super()._attend_backward(dcontext_vec, c)
        dqueries = np.empty(dcontext_vec.shape, dtype=dcontext_vec.dtype)  # (B, H, T, D)
        dkeys = np.zeros_like(dqueries)
        dvalues = np.zeros_like(dqueries)
        for block in c["blocks"]:
            q0, q1 = block["span"]
            dq_block, dk_block, dv_block = super()._attend_backward(
                dcontext_vec[..., q0:q1, :], block)
            dqueries[..., q0:q1, :] = dq_block      # each query row belongs to one block
            dkeys[..., :q1, :] += dk_block          # keys and values feed every later block
            dvalues[..., :q1, :] += dv_block
        return dqueries, dkeys, dvalues


def _is_causal(mask_bool):
    """True when the (T, T) mask hides exactly the keys after each query."""
    num_tokens = mask_bool.shape[-1]
    return np.array_equal(mask_bool, ~visible_mask(num_tokens, num_tokens, causal=True))
