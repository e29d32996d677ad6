"""Every planted mistake of the galleries, in the signature of any set of features.

A mistake is planted as a *core*: ``core(q, k, v, *, causal, scale, align, window, softcap,
alibi_slopes, bias, sinks, num_splits) -> (out, lse)`` on (B, H, T, D) tensors, k and v
with their own (fewer) heads.  The cores are the galleries' kernels: ``check_gallery``'s
(the chapter's mistakes: kv heads repeated for them, every feature ignored), the feature
gallery's ``attend`` with its mistake, and the serving examples' split-KV merges;
`kernel` wraps a core into the callable a set of features asks for (``paged``:
FlashAttention's kvcache form, ``varlen``: the packed layout, ``lse``: (out, lse)).
A mistake of a layout (the paged twins, the varlen ones) is planted where that layout is.
"""

import torch

import check_gallery
import feature_gallery
import fp8_gallery
import serving_examples


def _right_lse(q, k, v, **options):
    return feature_gallery.attend(q, k, v, **options)[1]


def _chapter(kernel):
    """A chapter kernel of ``check_gallery`` as a core: (B, H, T, D) with kv heads repeated
    for it; every feature ignored; lse the right one."""
    def core(q, k, v, *, causal, scale, num_splits=None, **options):
        group = q.shape[1] // k.shape[1]
        out = kernel(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), causal=causal, scale=scale)
        return out, _right_lse(q, k, v, causal=causal, scale=scale, **options)
    return core


def _featured(mistake):
    """The feature gallery's attention with ``mistake``."""
    def core(q, k, v, *, num_splits=None, **options):
        options["mistake"] = mistake
        return feature_gallery.attend(q, k, v, **options)
    return core


def _split(mistake):
    """The serving examples' split-KV merge with ``mistake`` (3 splits unless the case says)."""
    def core(q, k, v, *, causal, scale, align="top-left", num_splits=None, **options):
        out = serving_examples._split(q, k, v, causal, scale, num_splits or 3, align, mistake).to(q.dtype)
        return out, _right_lse(q, k, v, causal=causal, scale=scale, align=align, **options)
    return core


# name -> (core, the feature whose layout it needs, or None); the paged twins are
# serving_examples' own, planted by `kernel` as the ``mistake`` of its gather
PAGED_TWINS = ("past-seqlens", "off-by-one-page", "table-stride", "page-size", "last-page-dropped")
MISTAKES = {
    **{name: (_chapter(fn), None) for name, (fn, _) in check_gallery.GALLERY.items()},
    **{m: (_featured(m), "varlen" if m.startswith("varlen-") else None) for m in feature_gallery.FEATURE_GALLERY},
    "in-bfloat16": (_featured("in-bfloat16"), None),
    **{f"splits-{m}": (_split(m), None) for m in ("not-rescaled", "empty-nan", "base-2")},
    **{f"paged-{m}": (_featured(None), "paged") for m in PAGED_TWINS},
    # FP8's: the gallery's kernels themselves (a mistake in how the float8 inputs are read)
    **{m if m.startswith("fp8-") else f"fp8-{m}": (fp8_gallery.GALLERY[m], "fp8") for m in fp8_gallery.GALLERY},
    **{f"fp8_kv-{m}": (fp8_gallery.GALLERY_KV[m], "fp8_kv") for m in fp8_gallery.GALLERY_KV},
}


def plantable(name, features):
    """Whether mistake ``name`` can be planted in a kernel for ``features`` (FP8's kernels take
    GQA and nothing more)."""
    where = MISTAKES[name][1]
    if where in ("fp8", "fp8_kv"):
        return set(features) <= {where, "gqa"}
    return where in (None, *features)


def _per_token(x, descale, cu_seqlens):
    """Packed float8 ``x`` (total, H, D) dequantised: each token by its sequence's (B, Hkv) descale."""
    token = torch.arange(x.shape[0])
    sequence = torch.searchsorted(cu_seqlens.long(), token, right=True) - 1
    per = descale[sequence.clamp(0, descale.shape[0] - 1)]                   # (total, Hkv)
    return x.float() * per.repeat_interleave(x.shape[1] // descale.shape[1], 1)[:, :, None]


def kernel(name, features):
    """A callable with mistake ``name`` planted, in the signature ``features`` ask for."""
    core, where = MISTAKES[name]
    if where in ("fp8", "fp8_kv"):                 # FP8's own kernels, planted as they are
        return core
    mistake = name.split("-", 1)[1] if name.startswith("paged-") else name
    returns_lse = bool({"lse", "lse_grad"} & set(features))
    done = lambda out, lse: (out, lse) if returns_lse else out
    if "paged" in features:
        def fn(q, k_cache, v_cache, *, block_table, cache_seqlens, causal, scale, window=None, softcap=None,
               alibi_slopes=None, bias=None, sinks=None, num_splits=None, q_descale=None, k_descale=None,
               v_descale=None):
            if k_descale is not None:                # FP8's: each page's sequence gives its descale
                low = q.dtype if q_descale is None else torch.bfloat16
                owner = torch.zeros(k_cache.shape[0], dtype=torch.long)
                for b, n in enumerate(cache_seqlens.tolist()):
                    owner[block_table[b, : -(-n // k_cache.shape[1])].long()] = b
                q = q if q_descale is None else \
                    fp8_gallery.dequantised(q.transpose(1, 2), q_descale, q.shape[2]).transpose(1, 2).to(low)
                k_cache, v_cache = ((x.float() * s[owner][:, None, :, None]).to(low)
                                    for x, s in ((k_cache, k_descale), (v_cache, v_descale)))

            def one(qb, kb, vb, *, causal, scale, offset):       # (T, H, D) -> (out (T, H, D), lse (H, T))
                t = lambda x: x.transpose(0, 1)[None]
                out, lse = core(t(qb), t(kb), t(vb), causal=causal, scale=scale, align="bottom-right",
                                window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                                bias=None if bias is None else bias[:1, ..., : kb.shape[0]], num_splits=num_splits)
                return out[0].transpose(0, 1), lse[0]
            got = serving_examples._paged(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale,
                                          mistake=mistake if name.startswith("paged-") else None, lse=True,
                                          attend=one)
            return done(*got)
    elif "varlen" in features:
        def fn(q, k, v, *, causal, scale, align="top-left", window=None, softcap=None, alibi_slopes=None,
               sinks=None, num_splits=None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               q_descale=None, k_descale=None, v_descale=None):
            if k_descale is not None:                # FP8's: each token's sequence gives its descale
                low = q.dtype if q_descale is None else torch.bfloat16
                q, k, v = (x if s is None else _per_token(x, s, cu).to(low) for x, s, cu in
                           ((q, q_descale, cu_seqlens_q), (k, k_descale, cu_seqlens_k), (v, v_descale, cu_seqlens_k)))
            out, lse = feature_gallery.varlen(
                q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, mistake=mistake, core=lambda *a, mistake, **o: core(*a, **o),
                causal=causal, scale=scale, align=align, window=window, softcap=softcap,
                alibi_slopes=alibi_slopes, sinks=sinks, num_splits=num_splits)
            return done(out, lse)
    else:
        def fn(q, k, v, *, causal, scale, align="top-left", window=None, softcap=None, alibi_slopes=None,
               bias=None, sinks=None, num_splits=None, dropout_p=0.0, q_descale=None, k_descale=None,
               v_descale=None):
            low = q.dtype if q_descale is None else torch.bfloat16        # FP8's: dequantised first
            q, k, v = (x if s is None else fp8_gallery.dequantised(x, s, x.shape[1]).to(low)
                       for x, s in ((q, q_descale), (k, k_descale), (v, v_descale)))
            return done(*core(q, k, v, causal=causal, scale=scale, align=align, window=window, softcap=softcap,
                              alibi_slopes=alibi_slopes, bias=bias, sinks=sinks, num_splits=num_splits,
                              dropout_p=dropout_p))
    fn.__name__ = fn.__qualname__ = name.replace("-", "_").replace("/", "_")
    return fn

