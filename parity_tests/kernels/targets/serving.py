"""Built-in targets of the serving features: PyTorch's paged attention on FlexAttention.

``flex-paged``: ``torch.nn.attention.experimental._paged_attention.PagedAttention``
(PyTorch's paged attention for FlexAttention) on the ``paged`` feature's arguments: the
block table becomes its page table (logical page -> physical page, and back), the cache
one (1, Hkv, num_pages · page_size, D) sequence, the logical mask (the causal mask,
bottom-right, and cache_seqlens) converted to physical blocks by
``convert_logical_block_mask``.  Eager (unfused, untraced: ``common.flex``) on CPU, compiled
on CUDA; forward only.
On CPU the eager path computes the scores and ``P @ V`` over every physical slot and
masks afterwards, so the NaN of the unused slots reaches every row (0 × NaN): the check
names it (``paged-masked-nan``).
"""

import torch

from parity_tests.common.flex import attend as flex_attend
from parity_tests.kernels.dense import mask_mod, offsets

__all__ = ["flex_paged", "FLEX_PAGED_FEATURES"]

FLEX_PAGED_FEATURES = frozenset({"paged", "gqa", "value_dim", "decode"})


def flex_paged(unsupported):
    def fn(q, k_cache, v_cache, *, block_table, cache_seqlens, causal, scale):
        from torch.nn.attention.experimental._paged_attention import PagedAttention
        from torch.nn.attention.flex_attention import create_block_mask
        b, tq, h, _ = q.shape
        num, size, hkv, _ = k_cache.shape
        lens = cache_seqlens.long()
        paged = PagedAttention(num, size, b, device=q.device)
        for n in range(b):                          # the block table as PagedAttention's page table
            pages = block_table[n, : -(-int(lens[n]) // size)].long()
            paged.page_table[n, : len(pages)] = pages
            paged.physical_to_logical[n, pages] = torch.arange(len(pages), device=q.device)
        offset = torch.tensor(offsets(tq, None, [tq] * b, lens.tolist(), "bottom-right", b), device=q.device)
        logical = create_block_mask(mask_mod(causal=causal, offset=offset, nk=lens), b, None, tq,
                                    block_table.shape[1] * size, device=q.device, BLOCK_SIZE=(128, size))
        physical = paged.convert_logical_block_mask(logical, kv_len=lens)
        flat = lambda c: c.reshape(1, num * size, hkv, c.shape[-1]).transpose(1, 2).expand(b, -1, -1, -1)
        try:
            with torch.no_grad():
                out = flex_attend(q.transpose(1, 2), flat(k_cache), flat(v_cache), block_mask=physical,
                                  scale=scale, enable_gqa=h != hkv)
        except NotImplementedError as e:
            raise unsupported(str(e).split(". ")[0]) from None
        return out.transpose(1, 2)
    return fn


def refuses(case, dtype, device, align):
    if case.get("paged") is None:
        return "flex-paged takes the kvcache form: run with --features paged"
    return None
