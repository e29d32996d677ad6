"""The chapter's formulas as plain PyTorch functions: the low-precision baseline.

``functional_forward(kind, params, x, ...)`` recomputes what each module computes
from a dict of its parameters (``named_parameters()`` names), with ordinary
``torch`` operations and autograd.  It shares no code with ``torch_impl`` or
``numpy_ref``: in bfloat16/float16 it is the "ordinary computation in that
dtype" whose drift from the float64 golden result sets the tolerance
(`parity_tests.tolerances`), and a mistake planted in either implementation
does not reach it.

Shape legend: B batch, T tokens, H heads, D head_dim.
"""

import torch
import torch.nn.functional as F

__all__ = ["functional_forward", "attend"]


def attend(queries, keys, values, *, scaled=True, causal=False, keep=None, p=0.0):
    """``softmax(mask(q k^T / sqrt(D))) v`` on the last two axes, with optional dropout keep-mask."""
    attn_scores = queries @ keys.transpose(-2, -1)               # (..., T, T)
    if scaled:
        attn_scores = attn_scores / keys.shape[-1] ** 0.5
    if causal:
        T = attn_scores.shape[-1]
        future = torch.ones(T, T, dtype=torch.bool, device=attn_scores.device).triu(1)
        attn_scores = attn_scores.masked_fill(future, float("-inf"))
    attn_weights = torch.softmax(attn_scores, dim=-1)
    if keep is not None:
        attn_weights = attn_weights * keep.to(attn_weights.dtype) / (1.0 - p)
    return attn_weights @ values                                 # (..., T, D)


def _qkv(params, x, prefix=""):
    """The three ``nn.Linear`` projections of ``x``, bias or not."""
    def linear(name):
        return F.linear(x, params[f"{prefix}{name}.weight"], params.get(f"{prefix}{name}.bias"))
    return linear("W_query"), linear("W_key"), linear("W_value")


def functional_forward(kind, params, x, num_heads=1, keep=None, p=0.0):
    """The output of module ``kind`` (see `harness.ModuleSpec`) with ``params`` on ``x``."""
    if kind == "simplified":
        return attend(x, x, x, scaled=False)                    # (T, d_in)
    if kind == "v1":
        return attend(x @ params["W_query"], x @ params["W_key"], x @ params["W_value"])
    if kind == "v2":
        return attend(*_qkv(params, x))
    if kind == "causal":
        return attend(*_qkv(params, x), causal=True, keep=keep, p=p)
    if kind == "wrapper":
        return torch.cat([attend(*_qkv(params, x, f"heads.{h}."), causal=True,
                                 keep=None if keep is None else keep[h], p=p)
                          for h in range(num_heads)], dim=-1)   # (B, T, H * d_out)
    if kind == "mha":
        B, T, _ = x.shape
        def split(t):                                           # (B, T, H*D) -> (B, H, T, D)
            return t.reshape(B, T, num_heads, -1).transpose(1, 2)
        queries, keys, values = (split(t) for t in _qkv(params, x))
        context_vec = attend(queries, keys, values, causal=True, keep=keep, p=p)
        context_vec = context_vec.transpose(1, 2).reshape(B, T, -1)   # (B, T, H*D)
        return F.linear(context_vec, params["out_proj.weight"], params["out_proj.bias"])
    raise ValueError(f"kind must be one of simplified, v1, v2, causal, wrapper, mha; got {kind!r}")
