"""MultiHeadAttention on the blockwise ops: same API and numbers, O(T) memory.

``BlockwiseMultiHeadAttention`` has ``MultiHeadAttention``'s signature,
parameters, ``state_dict`` keys and dropout semantics; its attention runs
``numpy_ref.blockwise``'s tiles, one (batch, head) at a time, so no (T, T)
array exists anywhere, not even the chapter's ``mask`` buffer:

- ``mask``: ``state_dict()`` builds ``triu(ones(ctx, ctx), 1)`` on demand (4 B x
  ctx^2: 1 GiB at ctx = 16384, so it is not held); ``load_state_dict`` checks
  that the given one is that causal mask (any other would ask for attention this
  module does not compute) and keeps only its dtype.
- Dropout (training mode): each (B_r, B_c) tile's keep-mask is drawn from a
  generator seeded by (forward's seed, batch, head, first query, first key),
  so the backward draws it again instead of storing it.  ``keep_mask_of`` and
  ``last_keep_mask`` build the equivalent (B, H, T, T) mask at small T, which
  ``MultiHeadAttention.forward(x, keep_mask)`` reproduces exactly.  A
  ``keep_mask`` given to ``forward`` is used tile by tile, as in
  ``MultiHeadAttention``.
- Passes 1 and 8 are MultiHeadAttention's projections with the three input
  projections stacked into one (3 d_out, d_in) matrix: one matrix product, and
  the heads are read as column slices of its (B, T, 3 d_out) output, so neither
  the split nor the merge of heads copies anything.
- As in every module (see ``numpy_ref.module``): forward copies x and the
  parameters it uses, fingerprints a caller's keep_mask (checked by backward),
  and backward may run again, overwriting ``grads``.
- Memory (float32, batch 1, d = 768): forward + backward peak at about 8
  (T, d_out) arrays from T = 8192 on (measured 8.3 at 16384, 8.1 at 32768):
  x, queries/keys/values, the merged heads, the output, dx, and per thread one
  head's tiles, dcontext and dqkv; the weights' copies and gradients add a
  fixed ~7 MiB (3 arrays' worth at T = 1024).
"""

import threading
from collections.abc import Mapping

import numpy as np

from numpy_ref import ops
from numpy_ref import _parallel, blockwise as bw
from numpy_ref.blockwise import causal_visibility
from numpy_ref.attention import MultiHeadAttention
from numpy_ref.module import (
    _as_array, check_dropout, check_input, check_keep_mask, check_size, fingerprint,
)

__all__ = ["BlockwiseMultiHeadAttention"]

# From this many tokens on, heads run on a pool of one thread per usable CPU (None: never).
# Attention time measured on 2 idle cores, one thread -> two: T = 256 no gain,
# 512 0.08 -> 0.07 s, 1024 0.21 -> 0.16 s, 2048 0.56 -> 0.39 s, 4096 1.84 ->
# 1.02 s.  (With other programs busy on the machine the pool gained less, or
# lost up to 10 %.)  ``num_workers`` overrides the choice.
THREADS_FROM_TOKENS = 1024
MASK_CHECK_ROWS = 256        # rows of the loaded mask compared at a time
DX_CHUNK_ROWS = 1024         # rows of dx updated at a time in the backward


class BlockwiseMultiHeadAttention(MultiHeadAttention):
    """``MultiHeadAttention(d_in, d_out, context_length, dropout, num_heads,
    qkv_bias=False, *, rng=None)`` with blockwise attention.

    Class (or instance) attributes: ``block_q``, ``block_k`` (None: chosen by
    ``numpy_ref.blockwise.choose_tiles``) and ``num_workers`` (None: see
    THREADS_FROM_TOKENS).
    """

    block_q = None
    block_k = None
    num_workers = None

    def _setup(self, d_in, d_out, context_length, dropout, qkv_bias, rng):
        # MultiHeadAttention's sizes and checks, without the (ctx, ctx) buffer
        self._setup_sizes(d_in, d_out, context_length, dropout, qkv_bias, rng)
        self._mask_dtype = np.dtype(np.float32)

    # -- the mask buffer, on demand ---------------------------------------------

    def mask_buffer(self):
        """The chapter's ``triu(ones(ctx, ctx), diagonal=1)``, built now."""
        ones = np.ones((self.context_length, self.context_length), dtype=self._mask_dtype)
        return np.triu(ones, k=1)

    def state_dict(self):
        return {"mask": self.mask_buffer(), **super().state_dict()}

    def load_state_dict(self, state_dict):
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping of names to arrays, "
                            f"got {type(state_dict).__name__}")
        if "mask" not in state_dict:
            raise ValueError("state_dict is missing key(s) ['mask']")
        mask = _as_array(state_dict["mask"], "mask")
        ctx = self.context_length
        if not np.issubdtype(mask.dtype, np.floating):
            raise TypeError(f"state_dict['mask'] must hold floating-point numbers, "
                            f"got dtype {mask.dtype}")
        if mask.shape != (ctx, ctx):
            raise ValueError(f"state_dict['mask'] must have shape {(ctx, ctx)}, got {mask.shape}")
        causal = causal_visibility(ctx, ctx, True, 0)
        for r0 in range(0, ctx, MASK_CHECK_ROWS):               # no (ctx, ctx) temporary
            r1 = min(r0 + MASK_CHECK_ROWS, ctx)
            if not np.array_equal(mask[r0:r1] != 0, ~causal.mask(r0, r1, 0, ctx)):
                raise ValueError("state_dict['mask'] must be the causal mask "
                                 "triu(ones(ctx, ctx), diagonal=1): this module computes it")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "mask"})
        self._mask_dtype = mask.dtype

    # -- tiles, threads, dropout ------------------------------------------------

    def _tiles(self, num_tokens):
        auto_q, auto_k = bw.choose_tiles(num_tokens, num_tokens, self.d_out // self.num_heads)
        return (auto_q if self.block_q is None else check_size("block_q", self.block_q),
                auto_k if self.block_k is None else check_size("block_k", self.block_k))

    def _workers(self, num_tokens):
        if self.num_workers is not None:
            return check_size("num_workers", self.num_workers)
        if THREADS_FROM_TOKENS is None or num_tokens < THREADS_FROM_TOKENS:
            return 1
        return _parallel.usable_cpus()

    def _tile_keep(self, drop, b, h, dtype):
        """keep(q0, q1, k0, k1) -> the tile's keep-mask scaled by 1/(1-p), or None."""
        if drop is None:
            return None
        # p = 1 drops everything, as nn.Dropout(1.0): scale 0 rather than 1/0
        scale = dtype.type(1.0 / (1.0 - self.dropout) if self.dropout < 1.0 else 0.0)
        if drop["keep_mask"] is not None:
            full = drop["keep_mask"][b, h]
            return lambda q0, q1, k0, k1: full[q0:q1, k0:k1] * scale
        seed, p = drop["seed"], self.dropout

        def keep(q0, q1, k0, k1):
            tile_rng = np.random.default_rng((seed, b, h, q0, k0))
            return (tile_rng.random((q1 - q0, k1 - k0), dtype=np.float32) >= p) * scale
        return keep

    def keep_mask_of(self, seed, batch, num_tokens):
        """The (batch, H, T, T) keep-mask that tiles drawn with ``seed`` amount to
        (True outside the tiles visited: those weights are causal zeros)."""
        B_r, B_c = self._tiles(num_tokens)
        full = np.ones((batch, self.num_heads, num_tokens, num_tokens), dtype=bool)
        for b in range(batch):
            for h in range(self.num_heads):
                keep = self._tile_keep(dict(seed=seed, keep_mask=None), b, h, np.dtype(np.float64))
                vis = bw.causal_visibility(num_tokens, num_tokens, True, 0)
                for q0 in range(0, num_tokens, B_r):
                    q1 = min(q0 + B_r, num_tokens)
                    for k0, k1 in bw._key_tiles(vis, q0, q1, B_c):
                        full[b, h, q0:q1, k0:k1] = keep(q0, q1, k0, k1) != 0
        return full

    def last_keep_mask(self):
        """The keep-mask of the last forward, (B, H, T, T); None without dropout."""
        if self._cache is None:
            raise ValueError("last_keep_mask() called before forward")
        drop = self._cache["drop"]
        if drop is None or drop["keep_mask"] is not None:
            return None if drop is None else drop["keep_mask"]
        b, num_tokens, _ = self._cache["out_shape"]
        return self.keep_mask_of(drop["seed"], b, num_tokens)

    def _each_head(self, work, batch, num_tokens):
        """Run work(b, h) for every (batch, head) on ``numpy_ref._parallel``'s
        executor: ``_workers`` threads, one BLAS thread each (see _blas_threads)."""
        jobs = [(b, h) for b in range(batch) for h in range(self.num_heads)]
        _parallel.run_jobs(lambda job: work(*job), jobs, self._workers(num_tokens))

    # -- forward and backward ----------------------------------------------------

    def forward(self, x, keep_mask=None):
        check_dropout(self.dropout)         # a public attribute: it may have been set since
        x = check_input(x, 3, self.d_in, self.context_length)         # (B, T, d_in), a copy
        if x.dtype not in (np.float32, np.float64):                   # attention_forward's rule
            raise TypeError(f"x must be a float32 or float64 array (the blockwise tiles "
                            f"accumulate in x's dtype), got dtype {x.dtype}")
        b, num_tokens, _ = x.shape
        H, D, d_out = self.num_heads, self.d_out // self.num_heads, self.d_out
        drop, guards = None, []
        if self.training and self.dropout > 0.0:
            if keep_mask is not None:
                keep_mask = check_keep_mask(keep_mask, (b, H, num_tokens, num_tokens),
                                            "(batch, num_heads, num_tokens, num_tokens)")
                guards = [("keep_mask", keep_mask, fingerprint(keep_mask))]
            seed = None if keep_mask is not None else int(self.rng.integers(2**63))
            drop = dict(seed=seed, keep_mask=keep_mask)
        dtype = x.dtype
        p = self._parameters
        # copies in x's dtype: changing the parameters in place cannot reach the backward
        W_qkv = np.concatenate([p[f"{n}.weight"] for n in ("W_query", "W_key", "W_value")]
                               ).astype(dtype, copy=False)            # (3 d_out, d_in)
        b_qkv = None
        if self.qkv_bias:
            b_qkv = np.concatenate([p[f"{n}.bias"] for n in ("W_query", "W_key", "W_value")]
                                   ).astype(dtype, copy=False)
        W_out = p["out_proj.weight"].astype(dtype, copy=True)
        b_out = p["out_proj.bias"].astype(dtype, copy=True)
        # pass 1: queries, keys, values side by side                 (B, T, 3 d_out)
        qkv, _ = ops.linear_forward(x, W_qkv, b_qkv)
        # passes 2-7: each head's (T, D) column slices; the output is written
        # straight into its columns of the merged (B, T, d_out) context
        context_vec = np.empty((b, num_tokens, d_out), dtype=dtype)
        lse = np.empty((b, H, num_tokens), dtype=dtype)               # L per row
        B_r, B_c = self._tiles(num_tokens)
        scale = 1.0 / D**0.5

        def attend(bi, h):
            q, k, v = (qkv[bi, :, s * d_out + h * D: s * d_out + (h + 1) * D] for s in range(3))
            bw.forward_head(q, k, v, context_vec[bi, :, h * D:(h + 1) * D], lse[bi, h],
                            scale, True, 0, B_r, B_c, self._tile_keep(drop, bi, h, dtype))
        self._each_head(attend, b, num_tokens)
        # pass 8: out_proj
        out, _ = ops.linear_forward(context_vec, W_out, b_out)            # (B, T, d_out)
        self._cache = dict(out_shape=out.shape, dtype=dtype, guards=guards, x=x, W_qkv=W_qkv,
                           qkv=qkv, context_vec=context_vec, W_out=W_out, lse=lse, drop=drop,
                           tiles=(B_r, B_c), scale=scale)
        return out

    def backward(self, grad_out):
        """Passes 8-1 in reverse.  Every (T, D) head's gradients go straight into
        dx and the weight gradients (x fed the three projections: dx sums them),
        so neither dcontext_vec nor the (B, T, 3 d_out) dqkv is ever whole."""
        dout = self._check_grad_out(grad_out)                         # (B, T, d_out)
        c = self._cache
        b, num_tokens, d_out = c["out_shape"]
        D, dtype = d_out // self.num_heads, c["dtype"]
        x, W_qkv, qkv, context_vec, W_out = (c[n] for n in ("x", "W_qkv", "qkv",
                                                            "context_vec", "W_out"))
        lse, drop, (B_r, B_c), scale = c["lse"], c["drop"], c["tiles"], c["scale"]
        grads = {}
        # pass 8: out_proj's weight and bias
        grads["out_proj.weight"] = ops._rows(dout).T @ ops._rows(context_vec)
        grads["out_proj.bias"] = ops._rows(dout).sum(axis=0)
        dx = np.zeros(x.shape, dtype=dtype)                           # (B, T, d_in)
        dW_qkv = np.zeros(W_qkv.shape, dtype=dtype)                   # (3 d_out, d_in)
        db_qkv = np.zeros(3 * d_out, dtype=dtype)
        lock = threading.Lock()

        def attend_backward(bi, h):
            cols = slice(h * D, (h + 1) * D)
            # pass 8, this head's columns: dcontext_vec[..., cols] = dout @ W_out[:, cols]
            dcontext_h = dout[bi] @ W_out[:, cols]                    # (T, D)
            delta = bw._delta(dcontext_h, context_vec[bi, :, cols])   # D = rowsum(dO ∘ O)
            # passes 7-2: blockwise backward into this head's dq, dk, dv side by side
            rows = np.concatenate([np.arange(s * d_out + h * D, s * d_out + (h + 1) * D)
                                   for s in range(3)])                # its rows of W_qkv
            dqkv_h = np.empty((num_tokens, 3 * D), dtype=dtype)       # (T, 3 D)
            q, k, v = (qkv[bi, :, r0:r0 + D] for r0 in rows[::D])
            dq, dk, dv = (dqkv_h[:, s * D:(s + 1) * D] for s in range(3))
            bw.backward_head(dcontext_h, q, k, v, delta, lse[bi, h], dq, dk, dv, scale,
                             True, 0, B_r, B_c, self._tile_keep(drop, bi, h, dtype))
            # pass 1, this head's share: dW_qkv[rows] = dqkv_h^T x, dx += dqkv_h W_qkv[rows]
            W_h = W_qkv[rows]                                         # (3 D, d_in)
            dW_h = dqkv_h.T @ x[bi]
            with lock:
                dW_qkv[rows] += dW_h
                db_qkv[rows] += dqkv_h.sum(axis=0)
                for r0 in range(0, num_tokens, DX_CHUNK_ROWS):        # no (T, d_in) temporary
                    dx[bi, r0:r0 + DX_CHUNK_ROWS] += dqkv_h[r0:r0 + DX_CHUNK_ROWS] @ W_h
        self._each_head(attend_backward, b, num_tokens)
        for i, name in enumerate(("W_query", "W_key", "W_value")):
            grads[f"{name}.weight"] = dW_qkv[i * d_out:(i + 1) * d_out]
            if self.qkv_bias:
                grads[f"{name}.bias"] = db_qkv[i * d_out:(i + 1) * d_out]
        self.grads = self._ordered(grads)
        return dx
