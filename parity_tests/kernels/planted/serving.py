"""Serving kernels written plainly, right and deliberately wrong, apart from the check's
own formulas: a paged decode (FlashAttention's kvcache form, keys gathered through the
block table) and a split-KV decode (partial states over key ranges, then merged).
Each computes in float64 and returns the input's dtype.

    python -m parity_tests check parity_tests.kernels.planted.serving:paged_decode \\
        --features paged --dtype float32
"""

import math

import torch


def _attend(q, k, v, *, causal, scale, offset):
    """q (Tq, Hq, D), k (n, Hkv, D), v (n, Hkv, Dv) -> (Tq, Hq, Dv): query i sees key j
    iff j <= i + offset when causal; a row that sees no key gives zeros."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("ihd,jhd->hij", q, k) * scale                 # (Hq, Tq, n)
    if causal:
        i = torch.arange(q.shape[0])[:, None]
        j = torch.arange(k.shape[0])[None, :]
        scores = scores.masked_fill(j > i + offset, -math.inf)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("hij,jhd->ihd", weights, v), torch.logsumexp(scores, dim=-1)    # lse (Hq, Tq)


def _paged(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale, mistake=None, lse=False, attend=None):
    """Each sequence's keys gathered from its pages, then plain attention, bottom-right
    (``attend``: in place of `_attend`, with its arguments)."""
    attend = attend or _attend
    page = k_cache.shape[1]
    flat_k = k_cache.double().reshape(-1, *k_cache.shape[2:])           # (num_pages · page, Hkv, D)
    flat_v = v_cache.double().reshape(-1, *v_cache.shape[2:])
    outs = []
    for b in range(q.shape[0]):
        n = int(cache_seqlens[b])
        if mistake == "past-seqlens":                    # every slot of every page the table lists
            n = block_table.shape[1] * page
        if mistake == "last-page-dropped":
            n = n // page * page
        pos = torch.arange(n)
        cut = 2 * page if mistake == "page-size" else page
        column = pos // cut + (1 if mistake == "off-by-one-page" else 0)
        if mistake == "offset-mod-tile":                 # the offset in the page taken modulo a key tile of 16
            slot = (block_table[b].long()[column] * page + pos % 16).clamp(max=flat_k.shape[0] - 1)
        elif mistake == "tile-in-one-page":              # a tile of 32 keys read on from its first key's slot
            first = pos - pos % 32
            slot = block_table[b].long()[first // page] * page + first % page + pos % 32
        elif mistake == "table-stride":                  # rows of the table max_pages - 1 apart
            slot = block_table.reshape(-1).long()[b * (block_table.shape[1] - 1) + column] * page + pos % cut
        elif mistake == "offset-mask":                   # pos & page where pos & (page - 1) is meant
            slot = block_table[b].long()[column] * page + (pos & page)
        elif mistake == "pages-sorted":                  # the sequence's page list sorted (torch.unique's order)
            used = -(-n // page)
            slot = torch.sort(block_table[b].long()[:used]).values[column] * page + pos % cut
        else:
            slot = block_table[b].long()[column] * page + pos % cut
        outs.append(attend(q[b].double(), flat_k[slot], flat_v[slot], causal=causal, scale=scale,
                           offset=n - q.shape[1]))
    out = torch.stack([o for o, _ in outs]).to(q.dtype)
    return (out, torch.stack([l for _, l in outs]).float()) if lse else out


def paged_decode(q, k_cache, v_cache, *, block_table, cache_seqlens, causal, scale):
    """q (B, Tq, Hq, D); k_cache, v_cache (num_pages, page_size, Hkv, D); block_table
    (B, max_pages) int32; cache_seqlens (B,) int32 -> out (B, Tq, Hq, Dv)."""
    return _paged(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale)


def paged_decode_with_lse(q, k_cache, v_cache, *, block_table, cache_seqlens, causal, scale):
    """The same returning (out, lse), lse (B, Hq, Tq) float32, natural log."""
    return _paged(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale, lse=True)


def paged_decode_past_seqlens(q, k_cache, v_cache, *, block_table, cache_seqlens, causal, scale):
    """Wrong: cache_seqlens ignored, every slot of the table's pages read."""
    return _paged(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale, "past-seqlens")


def paged_decode_off_by_one_page(q, k_cache, v_cache, *, block_table, cache_seqlens, causal, scale):
    """Wrong: logical page p read from block_table[b, p + 1]."""
    return _paged(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale, "off-by-one-page")


def paged_decode_table_stride(q, k_cache, v_cache, *, block_table, cache_seqlens, causal, scale):
    """Wrong: the block table's rows read max_pages - 1 entries apart."""
    return _paged(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale, "table-stride")


def paged_decode_page_size(q, k_cache, v_cache, *, block_table, cache_seqlens, causal, scale):
    """Wrong: positions cut into pages of twice the page size."""
    return _paged(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale, "page-size")


def paged_decode_last_page_dropped(q, k_cache, v_cache, *, block_table, cache_seqlens, causal, scale):
    """Wrong: only whole pages read, the last partial page dropped."""
    return _paged(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale, "last-page-dropped")


def paged_decode_tile_in_one_page(q, k_cache, v_cache, *, block_table, cache_seqlens, causal, scale):
    """Wrong: each tile of 32 keys read as 32 contiguous slots from its first key's page (a tile
    crossing a page boundary runs on into the slots after that page)."""
    return _paged(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale, "tile-in-one-page")


def paged_decode_pages_sorted(q, k_cache, v_cache, *, block_table, cache_seqlens, causal, scale):
    """Wrong: each sequence's pages read in ascending physical order, not the block table's."""
    return _paged(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale, "pages-sorted")


def paged_decode_offset_mask(q, k_cache, v_cache, *, block_table, cache_seqlens, causal, scale):
    """Wrong: the offset in a page taken as pos & page_size, the mask's - 1 left out."""
    return _paged(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale, "offset-mask")


def paged_decode_offset_mod_tile(q, k_cache, v_cache, *, block_table, cache_seqlens, causal, scale):
    """Wrong: the offset in a page taken as position % 16 (a key tile's size) instead of % the page size."""
    return _paged(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale, "offset-mod-tile")


def _partial(q, k, v, j0, j1, causal, scale, offset, mistake):
    """(out_s, lse_s, m_s, l_s) of keys j0 .. j1 - 1 alone, (B, H, Tq, ...)."""
    scores = (q @ k[:, :, j0:j1].transpose(-1, -2)) * scale                 # (B, H, Tq, j1 - j0)
    if causal:
        i = torch.arange(q.shape[2])[:, None]
        j = torch.arange(j0, j1)[None, :]
        scores = scores.masked_fill(j > i + offset, -math.inf)
    m = scores.amax(-1) if j1 > j0 else torch.full(scores.shape[:-1], -math.inf, dtype=scores.dtype)
    shift = m if mistake == "empty-nan" else torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - shift[..., None])
    l = p.sum(-1)
    acc = p @ v[:, :, j0:j1]
    if mistake == "empty-nan":
        out = acc / l[..., None]                         # 0/0 where the split sees no key
    else:
        out = torch.where(l[..., None] > 0, acc / torch.where(l > 0, l, 1.0)[..., None], 0.0)
    return out, shift + torch.log(l), m, l


def _split(q, k, v, causal, scale, num_splits, align, mistake=None):
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    tq, tk = q.shape[2], k.shape[2]
    offset = tk - tq if align == "bottom-right" else 0
    width = -(-tk // num_splits)
    ranges = [(min(s * width, tk), min((s + 1) * width, tk)) for s in range(num_splits)]
    if mistake == "aligned-alone":          # each range taken for a whole sequence: its own offset, from its start
        offsets = [j0 + (j1 - j0 - tq if align == "bottom-right" else 0) for j0, j1 in ranges]
    else:
        offsets = [offset] * num_splits
    parts = [_partial(q, k, v, j0, j1, causal, scale, o, mistake) for (j0, j1), o in zip(ranges, offsets)]
    if mistake == "last-dropped" and num_splits > 1:  # the merge's loop stops one split short
        parts = parts[:-1]
    outs = torch.stack([p[0] for p in parts])
    lses = torch.stack([p[1] for p in parts])                               # (S, B, H, Tq)
    if mistake == "empty-zero":                       # an empty split's partial never written: 0 and lse 0
        lses = torch.where(torch.isfinite(lses), lses, 0.0)
    if mistake == "not-rescaled":                     # Σ acc_s / Σ l_s, each against its own maximum
        ls = torch.stack([p[3] for p in parts])
        return (outs * ls[..., None]).sum(0) / torch.where(ls.sum(0) > 0, ls.sum(0), 1.0)[..., None]
    if mistake == "base-2":
        lse = torch.logsumexp(lses * math.log(2.0), 0) / math.log(2.0)        # log2 Σ 2^lse_s
        w = torch.exp2(lses - torch.where(torch.isfinite(lse), lse, 0.0))
    else:
        lse = torch.logsumexp(lses, 0)
        w = torch.exp(lses - torch.where(torch.isfinite(lse), lse, 0.0))     # exp(−inf) = 0: empty splits
    return (w[..., None] * outs).sum(0)


def split_decode(q, k, v, *, causal, scale, num_splits=1, align="top-left"):
    """Split-KV attention, (B, H, T, D): the keys cut into num_splits ranges, one partial
    state (out_s, lse_s) per range, merged as out = Σ exp(lse_s − lse) out_s with
    lse = logsumexp(lse_s)."""
    return _split(q, k, v, causal, scale, num_splits, align).to(q.dtype)


def split_decode_not_rescaled(q, k, v, *, causal, scale, num_splits=1, align="top-left"):
    """Wrong: the partials merged without exp(m_s − m)."""
    return _split(q, k, v, causal, scale, num_splits, align, "not-rescaled").to(q.dtype)


def split_decode_empty_nan(q, k, v, *, causal, scale, num_splits=1, align="top-left"):
    """Wrong: a split that sees no key gives 0/0 = NaN instead of weight 0."""
    return _split(q, k, v, causal, scale, num_splits, align, "empty-nan").to(q.dtype)


def split_decode_empty_zero(q, k, v, *, causal, scale, num_splits=1, align="top-left"):
    """Wrong: a split that sees no key returns early without writing its partial, so the merge reads
    the workspace's zeros: lse 0 (not −inf) and out 0, each a term exp(0) in the sum."""
    return _split(q, k, v, causal, scale, num_splits, align, "empty-zero").to(q.dtype)


def split_decode_last_dropped(q, k, v, *, causal, scale, num_splits=1, align="top-left"):
    """Wrong: the last split's partial state left out of the merge (its loop one split short)."""
    return _split(q, k, v, causal, scale, num_splits, align, "last-dropped").to(q.dtype)


def split_decode_aligned_alone(q, k, v, *, causal, scale, num_splits=1, align="top-left"):
    """Wrong: each split's causal mask placed as if its key range were the whole sequence."""
    return _split(q, k, v, causal, scale, num_splits, align, "aligned-alone").to(q.dtype)


def split_decode_base_2(q, k, v, *, causal, scale, num_splits=1, align="top-left"):
    """Wrong: natural-log partials merged in base 2."""
    return _split(q, k, v, causal, scale, num_splits, align, "base-2").to(q.dtype)
