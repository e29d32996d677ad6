"""Kernels for ``check --invariance``: one that is the same bits whatever else runs, and the
mistakes that serving kernels make, each accurate (every accuracy row passes) and each
breaking one invariance at a boundary the check must name.

All are online softmax over key tiles, written so that a row's arithmetic depends only on
the tile widths and the order of the keys (serving kernels, forward only: autograd's own
reductions are not batch-invariant on the CPU): every score is a dot product summed over the head
dim (the same order whatever the shapes), every tile's sums are a pairwise tree over its keys
added to the running (m, l, acc), in float32: the tile widths set the rounding.

- `invariant`: tiles of 64 keys, always;
- `decode_tile_96`: tiles of 96 keys for a decode call (Tq = 1), 192 for a prefill
  (FlashAttention-3's FP8 decode and prefill, vLLM #54035): decode ≠ prefill from kv_len 97;
- `splits_from_batch`: split-KV with the split count chosen from the batch size
  (FlashAttention's ``num_splits`` heuristic): 2 splits up to 4 sequences, 1 beyond;
- `padded_block_max`: the batch padded to blocks of 4 sequences, each block's softmax shifted
  by the largest score of any of its sequences (the padding and the neighbours reach a row);
- `order_by_position`: the keys reduced in reverse order for a sequence at an odd position;
- `paged_invariant` and `paged_decode_tile_96`: the same, reading a paged cache;
- `varlen_invariant`, and `varlen_tiles_from_buffer_start`: packed (FlashAttention's varlen
  form), its key tiles laid from the packed buffer's start rather than each sequence's, so a
  sequence's tiles move with the lengths packed before it.
"""

import math

import torch

from parity_tests.kernels.targets import Unsupported

__all__ = ["invariant", "decode_tile_96", "splits_from_batch", "padded_block_max", "order_by_position",
           "varlen_invariant", "varlen_tiles_from_buffer_start", "paged_invariant", "paged_decode_tile_96"]


def _scores(q, k, scale):
    """(B, H, Tq, Tk) float32 scores, each summed over the head dim in one order."""
    return (q.float()[:, :, :, None, :] * k.float()[:, :, None, :, :]).sum(-1) * scale


def _visible(tq, tk, causal, device):
    if not causal:
        return torch.ones(tq, tk, dtype=torch.bool, device=device)
    i, j = torch.arange(tq, device=device)[:, None], torch.arange(tk, device=device)[None, :]
    return j <= i + (tk - tq)                                       # bottom-right, as FlashAttention


def _fold(s, v, lo, hi, tile, reverse=False, shift=None, offset=0):
    """(m, l, acc) over keys lo .. hi − 1 in tiles of ``tile``: each tile's maximum, then its
    sums.  ``shift``: a fixed maximum instead of the running one; ``offset``: the tiles laid
    from ``offset`` keys before ``lo`` (a grid fixed to a packed buffer's start)."""
    b, h, tq, _ = s.shape
    m = torch.full((b, h, tq, 1), -math.inf) if shift is None else shift
    l = torch.zeros(b, h, tq, 1)
    acc = torch.zeros(b, h, tq, v.shape[-1])
    starts = sorted({lo} | set(range(lo - offset % tile + tile, hi, tile)))
    tiles = [(t0, t1) for t0, t1 in zip(starts, starts[1:] + [hi]) if t1 > t0]
    for t0, t1 in (reversed(tiles) if reverse else tiles):
        if shift is None:
            new = torch.maximum(m, s[..., t0:t1].amax(-1, keepdim=True))
            safe = torch.where(torch.isinf(new), 0.0, new)
            rescale = torch.exp(torch.where(torch.isinf(m), -math.inf, m - safe))
            l, acc, m = l * rescale, acc * rescale, new
        safe = torch.where(torch.isinf(m), 0.0, m)
        p = torch.exp(s[..., t0:t1] - safe)                         # (B, H, Tq, tile)
        pv = p[..., None] * v[:, :, t0:t1, :].float()[:, :, None]    # (B, H, Tq, tile, D)
        if reverse:
            p, pv = p.flip(-1), pv.flip(-2)
        l, acc = l + _tree(p, -1)[..., None], acc + _tree(pv, -2)    # the tile's sums, as a tree
    return m, l, acc


def _tree(x, dim):
    """``x`` summed over ``dim`` pairwise, as a kernel's reduction does: elementwise additions
    only, so that a row's bits depend on the number of terms alone, not on the other rows."""
    x = x.movedim(dim, 0)
    while x.shape[0] > 1:
        if x.shape[0] % 2:
            x = torch.cat([x, torch.zeros_like(x[:1])])
        x = x[0::2] + x[1::2]
    return x[0]


def _attend(q, k, v, causal, scale, tile, splits=1, reverse=None, shift=None, offset=0):
    if q.requires_grad:
        raise Unsupported("a serving kernel: forward only")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = _scores(q, k, scale)
    s = s.masked_fill(~_visible(q.shape[2], k.shape[2], causal, q.device), -math.inf)
    tk = k.shape[2]
    splits = max(1, min(splits, tk))                               # no empty split
    bounds = [round(i * tk / splits) for i in range(splits + 1)]
    parts = []
    for lo, hi in zip(bounds, bounds[1:]):
        if reverse is None:
            parts.append(_fold(s, v, lo, hi, tile, shift=shift, offset=offset))
        else:                                                       # per batch entry
            per = [_fold(s[b:b + 1], v[b:b + 1], lo, hi, tile, reverse=reverse(b)) for b in range(q.shape[0])]
            parts.append(tuple(torch.cat(x) for x in zip(*per)))
    m = torch.stack([p[0] for p in parts]).amax(0)                  # the splits merged by their maxima
    safe = torch.where(torch.isinf(m), 0.0, m)
    weight = [torch.exp(torch.where(torch.isinf(p[0]), -math.inf, p[0] - safe)) for p in parts]
    l = sum(w * p[1] for w, p in zip(weight, parts))
    acc = sum(w * p[2] for w, p in zip(weight, parts))
    return torch.where(l > 0, acc / torch.where(l > 0, l, 1.0), 0.0).to(q.dtype)     # 0 where no key is seen


def invariant(q, k, v, *, causal, scale):
    return _attend(q, k, v, causal, scale, tile=64)


def decode_tile_96(q, k, v, *, causal, scale):
    return _attend(q, k, v, causal, scale, tile=96 if q.shape[2] == 1 else 192)


def splits_from_batch(q, k, v, *, causal, scale, num_splits=0):
    splits = num_splits or (2 if q.shape[0] <= 4 else 1)
    return _attend(q, k, v, causal, scale, tile=64, splits=splits)


def padded_block_max(q, k, v, *, causal, scale):
    b = q.shape[0]
    pad = -b % 4
    s = _scores(q, k, q.shape[-1] ** -0.5 if scale is None else scale)
    s = s.masked_fill(~_visible(q.shape[2], k.shape[2], causal, q.device), -math.inf)
    s = torch.cat([s, s[:1].expand(pad, -1, -1, -1)])              # padding: copies of the first
    block = s.amax(-1, keepdim=True).view(-1, 4, *s.shape[1:3], 1).amax(1, keepdim=True)
    shift = block.expand(-1, 4, -1, -1, -1).reshape(-1, *s.shape[1:3], 1)[:b]
    return _attend(q, k, v, causal, scale, tile=64, shift=shift)


def order_by_position(q, k, v, *, causal, scale):
    return _attend(q, k, v, causal, scale, tile=64, reverse=lambda b: b % 2 == 1)


def _per_sequence(q, k, v, cu_q, cu_k, attend):
    """A varlen call (thd, cu_seqlens) as one ``attend(q, k, v, start_k)`` per sequence."""
    four = lambda x, a, b: x[a:b].transpose(0, 1)[None]             # (T_b, H, D) -> (1, H, T_b, D)
    outs = [attend(four(q, cu_q[n], cu_q[n + 1]), four(k, cu_k[n], cu_k[n + 1]), four(v, cu_k[n], cu_k[n + 1]),
                   int(cu_k[n]))[0].transpose(0, 1) for n in range(len(cu_q) - 1)]
    return torch.cat(outs)


def varlen_invariant(q, k, v, *, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    return _per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k,
                         lambda q, k, v, start: _attend(q, k, v, causal, scale, tile=64))


def varlen_tiles_from_buffer_start(q, k, v, *, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k):
    return _per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k,
                         lambda q, k, v, start: _attend(q, k, v, causal, scale, tile=64, offset=start))


def _paged(kernel):
    """``kernel`` reading its keys from a paged cache (FlashAttention's kvcache form: q (B, Tq,
    H, D), caches (num_pages, page_size, H, D), ``block_table``, ``cache_seqlens``)."""
    def paged(q, k_cache, v_cache, *, block_table, cache_seqlens, causal, scale):
        size, outs = k_cache.shape[1], []
        for b, n in enumerate(cache_seqlens.tolist()):
            pages = block_table[b, :-(-n // size)].long()
            gather = lambda c: c[pages].reshape(-1, *c.shape[2:])[:n].transpose(0, 1)[None]   # (1, H, n, D)
            outs.append(kernel(q[b:b + 1].transpose(1, 2), gather(k_cache), gather(v_cache), causal=causal,
                               scale=scale).transpose(1, 2))
        return torch.cat(outs)
    paged.__name__ = paged.__qualname__ = f"paged_{kernel.__name__}"
    return paged


paged_invariant = _paged(invariant)
paged_decode_tile_96 = _paged(decode_tile_96)
