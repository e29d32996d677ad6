"""The chapter's six attention modules, as the chapter writes them.

Each class reads line for line like the chapter, so it can be read side by side
with ``numpy_ref``: same names (``keys``, ``queries``, ``values``,
``attn_scores``, ``attn_weights``, ``context_vec``, ``head_dim``), same order of
operations.  Three things are added, all outside the chapter's lines:

- one argument check at the top of every ``__init__`` and ``forward``
  (``torch_impl._checks``), so bad input is refused with a clear message;
- every class derives from ``_checks.CheckedModule``, an ``nn.Module`` whose
  ``load_state_dict`` checks every entry before it changes any weight (plain
  ``nn.Module`` would leave a half-loaded model behind a refusal);
- layers are created in the chapter's order (``W_query``, ``W_key``,
  ``W_value``, then ``out_proj``), so that after the chapter's
  ``torch.manual_seed`` the same random draws land in the same weights and the
  chapter's printed numbers come out.

Shape legend: ``b`` batch, ``T`` = ``num_tokens``, ``H`` = ``num_heads``,
``head_dim`` = ``d_out // num_heads``.

Everything a forward pass touches is a parameter or a buffer (the causal
``mask``), so ``module.to(device)`` moves it all and ``state_dict()`` saves it all.
"""

import torch
import torch.nn as nn

from torch_impl import _checks

__all__ = [
    "SimplifiedSelfAttention",
    "SelfAttention_v1",
    "SelfAttention_v2",
    "CausalAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadAttention",
]


def _causal_mask(context_length):
    """1 strictly above the diagonal: the future tokens each query must not see."""
    return torch.triu(torch.ones(context_length, context_length), diagonal=1)


class SimplifiedSelfAttention(_checks.CheckedModule):
    """Section 3.3: no trainable weights, ``q = k = v = x``, no scaling.

    ``x``: (T, d_in) -> context vectors (T, d_in).
    """

    def forward(self, x):
        _checks.check_input(x, ndim=2)
        attn_scores = x @ x.T                                  # (T, T)
        attn_weights = torch.softmax(attn_scores, dim=-1)      # each row sums to 1
        context_vec = attn_weights @ x                         # (T, d_in)
        return context_vec


class SelfAttention_v1(_checks.CheckedModule):
    """Section 3.4: ``W_query``, ``W_key``, ``W_value`` as (d_in, d_out) parameters, U[0, 1).

    ``x``: (T, d_in) -> (T, d_out).
    """

    def __init__(self, d_in, d_out):
        super().__init__()
        d_in, d_out = _checks.check_size("d_in", d_in), _checks.check_size("d_out", d_out)
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key   = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x):
        _checks.check_input(x, ndim=2, d_in=self.W_query.shape[0], weight=self.W_query)
        keys    = x @ self.W_key                               # (T, d_out)
        queries = x @ self.W_query
        values  = x @ self.W_value
        attn_scores  = queries @ keys.T                        # (T, T)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1]**0.5, dim=-1)
        context_vec  = attn_weights @ values                   # (T, d_out)
        return context_vec


class SelfAttention_v2(_checks.CheckedModule):
    """Section 3.4, with ``nn.Linear``: each weight is stored as (d_out, d_in), i.e. v1's W transposed.

    ``x``: (T, d_in) -> (T, d_out).
    """

    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        d_in, d_out = _checks.check_size("d_in", d_in), _checks.check_size("d_out", d_out)
        _checks.check_flag("qkv_bias", qkv_bias)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key   = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        _checks.check_input(x, ndim=2, d_in=self.W_query.in_features,
                            weight=self.W_query.weight)
        keys    = self.W_key(x)                                # (T, d_out)
        queries = self.W_query(x)
        values  = self.W_value(x)
        attn_scores  = queries @ keys.T                        # (T, T)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1]**0.5, dim=-1)
        context_vec  = attn_weights @ values                   # (T, d_out)
        return context_vec


class CausalAttention(_checks.CheckedModule):
    """Section 3.5: future tokens masked with -inf before the softmax, dropout on the weights.

    ``x``: (b, T, d_in) with T <= context_length -> (b, T, d_out).
    """

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        d_in, d_out = _checks.check_size("d_in", d_in), _checks.check_size("d_out", d_out)
        context_length = _checks.check_size("context_length", context_length)
        dropout = _checks.check_dropout(dropout)
        _checks.check_flag("qkv_bias", qkv_bias)
        self.d_out = d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key   = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        # A buffer, not a plain attribute: .to(device) moves it and state_dict() saves it.
        self.register_buffer('mask', _causal_mask(context_length))

    def forward(self, x):
        _checks.check_input(x, ndim=3, d_in=self.W_query.in_features,
                            context_length=self.mask.shape[0], weight=self.W_query.weight)
        b, num_tokens, d_in = x.shape
        keys    = self.W_key(x)                                # (b, T, d_out)
        queries = self.W_query(x)
        values  = self.W_value(x)

        attn_scores = queries @ keys.transpose(1, 2)           # (b, T, T)
        attn_scores.masked_fill_(                              # in place on a fresh tensor
            self.mask.bool()[:num_tokens, :num_tokens], -torch.inf
        )
        attn_weights = torch.softmax(attn_scores / keys.shape[-1]**0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)

        context_vec = attn_weights @ values                    # (b, T, d_out)
        return context_vec


class MultiHeadAttentionWrapper(_checks.CheckedModule):
    """Section 3.6.1: ``num_heads`` independent ``CausalAttention`` heads, concatenated.

    ``x``: (b, T, d_in) -> (b, T, num_heads * d_out).  Each head holds its own
    dropout (``heads[i].dropout``) and its own mask buffer.
    """

    def __init__(self, d_in, d_out, context_length,
                 dropout, num_heads, qkv_bias=False):
        super().__init__()
        num_heads = _checks.check_size("num_heads", num_heads)
        self.heads = nn.ModuleList(
            [CausalAttention(d_in, d_out, context_length, dropout, qkv_bias)
             for _ in range(num_heads)]
        )

    def forward(self, x):
        return torch.cat([head(x) for head in self.heads], dim=-1)


class MultiHeadAttention(_checks.CheckedModule):
    """Section 3.6.2: one projection of width d_out, split into heads of ``head_dim``.

    The finished class of the chapter: the heads are merged back to d_out and
    passed through ``out_proj`` (with bias), the layer GPT models reuse.

    ``x``: (b, T, d_in) with T <= context_length -> (b, T, d_out).
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        d_in = _checks.check_size("d_in", d_in)
        d_out, num_heads = _checks.check_heads(d_out, num_heads)
        context_length = _checks.check_size("context_length", context_length)
        dropout = _checks.check_dropout(dropout)
        _checks.check_flag("qkv_bias", qkv_bias)

        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key   = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)  # merges the heads' outputs
        self.dropout = nn.Dropout(dropout)
        self.register_buffer('mask', _causal_mask(context_length))

    def _check(self, x):
        _checks.check_input(x, ndim=3, d_in=self.W_query.in_features,
                            context_length=self.mask.shape[0], weight=self.W_query.weight)

    def forward(self, x):
        self._check(x)
        b, num_tokens, d_in = x.shape
        keys    = self.W_key(x)                                # (b, T, d_out)
        queries = self.W_query(x)
        values  = self.W_value(x)

        # Split d_out into H heads: a new reading of the same memory, no copy.
        keys    = keys.view(b, num_tokens, self.num_heads, self.head_dim)     # (b, T, H, head_dim)
        values  = values.view(b, num_tokens, self.num_heads, self.head_dim)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim)

        # Group by head rather than by token.
        keys    = keys.transpose(1, 2)                         # (b, H, T, head_dim)
        queries = queries.transpose(1, 2)
        values  = values.transpose(1, 2)

        attn_scores = queries @ keys.transpose(2, 3)           # (b, H, T, T)
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores.masked_fill_(mask_bool, -torch.inf)        # in place on a fresh tensor

        attn_weights = torch.softmax(attn_scores / keys.shape[-1]**0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)

        context_vec = (attn_weights @ values).transpose(1, 2)  # (b, T, H, head_dim)
        # transpose left the memory out of order: .contiguous() copies before .view()
        context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)  # (b, T, d_out)
        context_vec = self.out_proj(context_vec)
        return context_vec
