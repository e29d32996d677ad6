"""The planted mistakes and the correct kernels: ``parity_tests.mistakes()``,
``parity_tests.mistake(name)``, and what ``audit`` runs.

Each mistake is a kernel a real one could be, written plainly apart from the check's own
formulas (``dense``), in float64 so that only its mistake shows:

- ``chapter``   the chapter's mistakes and a blockwise kernel's (``(q, k, v, *, causal,
                scale)``): no causal mask, the mask one key off, the scale, a stale maximum,
                the backward's slips, split merges
- ``featured``  attention with every production feature (``attend``) and one mistake
                planted per feature mistake of the catalogue (windows, softcap, ALiBi,
                GQA, sinks, varlen, lse, dropout)
- ``serving``   a paged decode and a split-KV decode, right and with their slips
- ``correct``   the standard correct formulations every bound must pass (online softmax,
                exp2, P rounded to the input dtype, split-KV merged through the lse)
- ``fp8``       FP8 kernels in FlashAttention-3's convention and an FP8 KV cache's, right
                and with their slips (a descale missing or twice, P without its maximum, a
                narrow accumulator), planted as they are

Here, every mistake as a *core*: ``core(q, k, v, *, causal, scale, align, window, softcap,
alibi_slopes, bias, sinks, num_splits) -> (out, lse)`` on (B, H, T, D) tensors, k and v
with their own (fewer) heads: ``chapter``'s kernels with kv heads repeated for them and
every feature ignored, ``featured.attend`` with its mistake, ``serving``'s split-KV merges.
`kernel` wraps a core into the callable a set of features asks for (``paged``:
FlashAttention's kvcache form, ``varlen``: the packed layout, ``lse``: (out, lse)).
A mistake of a layout (the paged twins, the varlen ones) is planted where that layout is.
`MISTAKES` names each by the catalogue's id (``diagnosis/mistakes.py``, the features'
``mistakes``), or where the kernel is one instance of a broader id, by a name of its own.
"""

import inspect
from dataclasses import dataclass

import torch

from parity_tests.kernels.planted import chapter
from parity_tests.kernels.planted import featured
from parity_tests.kernels.planted import fp8
from parity_tests.kernels.planted import serving


def _right_lse(q, k, v, **options):
    return featured.attend(q, k, v, **options)[1]


def _chapter(kernel):
    """A kernel of ``chapter`` as a core: (B, H, T, D) with kv heads repeated
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
        return featured.attend(q, k, v, **options)
    return core


def _split(mistake):
    """The serving examples' split-KV merge with ``mistake`` (3 splits unless the case says)."""
    def core(q, k, v, *, causal, scale, align="top-left", num_splits=None, **options):
        out = serving._split(q, k, v, causal, scale, num_splits or 3, align, mistake).to(q.dtype)
        return out, _right_lse(q, k, v, causal=causal, scale=scale, align=align, **options)
    return core


# The chapter gallery's kernels by their public names: the catalogue's id where the kernel is
# that mistake, a name of its own where it is one instance of a broader id (``diagnosis``)
CHAPTER_NAMES = {"bottom_right": "other-alignment", "dropout_left_on": "dropout-left-on",
                 "one_head_wrong": "one-head-no-causal-mask", "bf16_denominator": "bf16-denominator",
                 "low_precision_accumulator": "low-precision-accumulator"}
PAGED_TWINS = ("past-seqlens", "off-by-one-page", "table-stride", "page-size", "last-page-dropped")


@dataclass(frozen=True)
class Planted:
    """One planted mistake: its ``core``, the feature whose layout it needs (``layout``: paged,
    varlen, or None), the features it needs to show at all (``needs``: a window's edge needs
    windows), and the diagnosis ``check`` names it by."""
    core: object
    layout: str = None
    needs: tuple = ()
    diagnosis: str = None


def _chapter_entry(name, fn, hid):
    return CHAPTER_NAMES.get(name, hid), Planted(_chapter(fn), diagnosis=hid)


MISTAKES = {
    **dict(_chapter_entry(name, fn, hid) for name, (fn, hid) in chapter.GALLERY.items()),
    **{m: Planted(_featured(m), "varlen" if m.startswith("varlen-") else None, tuple(needs), m)
       for m, needs in featured.FEATURE_GALLERY.items()},
    "in-bfloat16": Planted(_featured("in-bfloat16"), diagnosis="lower-precision"),
    **{hid: Planted(_split(m), None, ("splits",), hid)
       for m, hid in (("not-rescaled", "splits-not-rescaled"), ("empty-nan", "splits-empty-nan"),
                      ("empty-zero", "splits-empty-lse-zero"), ("base-2", "splits-lse-base-2"))},
    **{f"paged-{m}": Planted(_featured(None), "paged", ("paged",), f"paged-{m}") for m in PAGED_TWINS},
    # FP8's whole kernels (a slip in how the float8 inputs are read), their "layout" the FP8 form
    **{m if m.startswith("fp8-") else f"fp8-{m}": Planted(fn, "fp8", ("fp8",) + (("gqa",) if "head" in m else ()), m)
       for m, fn in fp8.GALLERY.items()},
    **{m.replace("fp8-", "fp8-kv-", 1): Planted(fn, "fp8_kv", ("fp8_kv",), m) for m, fn in fp8.GALLERY_KV.items()},
}
FP8_FORMS = ("fp8", "fp8_kv")     # kernels taking float8 inputs as they are, GQA their one other feature
# the right kernels of each FP8 form (FlashAttention-3's own formulation, P kept in float32, ...)
FP8_RIGHT = {"fp8": fp8.RIGHT, "fp8_kv": fp8.RIGHT_KV}


def mistakes():
    """The names of the planted mistakes, the catalogue's (``no-causal-mask``, ``stale-max``, ...)."""
    return list(MISTAKES)


def mistake(name, features=None):
    """Mistake ``name`` planted in a kernel with ``check``'s calling convention: ``fn(q, k, v, *,
    causal, scale, ...)`` on (B, H, T, D) tensors (FlashAttention's kvcache form with ``paged``,
    the packed one with ``varlen``), returning ``out``, or ``(out, lse)`` when ``features`` hold
    lse or lse_grad.  ``features``: the features it is called with (default: those it needs to
    show, ``fn.features``, so that ``check(fn, features=fn.features)`` runs it as planted).
    ``fn.diagnosis``: the catalogue's id of the mistake (where two ids describe the same
    arithmetic at some shapes, ``check`` may name the other: a split-KV merge without its
    rescale is ``splits-not-rescaled`` or ``split-no-rescale``)."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if name not in MISTAKES:
        raise ValueError(f"name: no planted mistake {name!r}; the catalogue's: {', '.join(MISTAKES)}")
    planted = MISTAKES[name]
    features = list(planted.needs if features is None else features)
    if not plantable(name, features):
        raise ValueError(f"features: {name!r} is planted in the {planted.layout} layout; "
                         f"features must hold {planted.layout!r}, got {features}")
    fn = kernel(name, features)
    fn.features, fn.diagnosis = features, planted.diagnosis
    return fn


def plantable(name, features):
    """Whether mistake ``name`` can be planted in a kernel for ``features`` (its layout's; an
    FP8 kernel's, with GQA at most beside it)."""
    layout = MISTAKES[name].layout
    if layout in FP8_FORMS:
        return layout in features and set(features) <= {layout, "gqa"}
    return layout in (None, *features)


def kernel(name, features):
    """A callable with mistake ``name`` planted, in the signature ``features`` ask for."""
    planted = MISTAKES[name]
    if planted.layout in FP8_FORMS:
        return _named(planted.core, name)
    return _wrap(planted.core, name, features, name)


def _named(fn, name):
    """A fresh callable of ``fn``'s signature, named after mistake ``name``."""
    def planted(*args, **kw):
        return fn(*args, **kw)
    planted.__signature__ = inspect.signature(fn)
    planted.__name__ = planted.__qualname__ = name.replace("-", "_")
    return planted


def right(features, name="float64-rounded"):
    """The right kernel in the signature ``features`` ask for: the featured attention computed in
    float64 and rounded once to the input dtype (lse in float32), the most accurate answer a
    kernel can give; ``splits``: the serving split-KV merge through the lse instead."""
    core = _split(None) if name == "split-kv-merged" else _featured(None)
    return _wrap(core, name, features, None)


def _per_token(x, descale, cu_seqlens):
    """Packed float8 ``x`` (total, H, D) dequantised: each token by its sequence's (B, Hkv) descale."""
    token = torch.arange(x.shape[0], device=x.device)
    sequence = torch.searchsorted(cu_seqlens.long(), token, right=True) - 1
    per = descale[sequence.clamp(0, descale.shape[0] - 1)]                   # (total, Hkv)
    return x.float() * per.repeat_interleave(x.shape[1] // descale.shape[1], 1)[:, :, None]


def _wrap(core, name, features, mistake):
    """``core`` as the callable ``features`` ask for (``mistake``: the one its layout plants)."""
    mistake = mistake.split("-", 1)[1] if mistake and mistake.startswith("paged-") else mistake
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
                    fp8.dequantised(q.transpose(1, 2), q_descale, q.shape[2]).transpose(1, 2).to(low)
                k_cache, v_cache = ((x.float() * s[owner][:, None, :, None]).to(low)
                                    for x, s in ((k_cache, k_descale), (v_cache, v_descale)))

            def one(qb, kb, vb, *, causal, scale, offset):       # (T, H, D) -> (out (T, H, D), lse (H, T))
                t = lambda x: x.transpose(0, 1)[None]
                out, lse = core(t(qb), t(kb), t(vb), causal=causal, scale=scale, align="bottom-right",
                                window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                                bias=None if bias is None else bias[:1, ..., : kb.shape[0]], num_splits=num_splits)
                return out[0].transpose(0, 1), lse[0]
            got = serving._paged(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale,
                                 mistake=mistake if name.startswith("paged-") else None, lse=True, attend=one)
            return done(*got)
    elif "varlen" in features:
        def fn(q, k, v, *, causal, scale, align="top-left", window=None, softcap=None, alibi_slopes=None,
               sinks=None, num_splits=None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               q_descale=None, k_descale=None, v_descale=None):
            if k_descale is not None:                # FP8's: each token's sequence gives its descale
                low = q.dtype if q_descale is None else torch.bfloat16
                q, k, v = (x if s is None else _per_token(x, s, cu).to(low) for x, s, cu in
                           ((q, q_descale, cu_seqlens_q), (k, k_descale, cu_seqlens_k), (v, v_descale, cu_seqlens_k)))
            out, lse = featured.varlen(
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
            q, k, v = (x if s is None else fp8.dequantised(x, s, x.shape[1]).to(low)
                       for x, s in ((q, q_descale), (k, k_descale), (v, v_descale)))
            return done(*core(q, k, v, causal=causal, scale=scale, align=align, window=window, softcap=softcap,
                              alibi_slopes=alibi_slopes, bias=bias, sinks=sinks, num_splits=num_splits,
                              dropout_p=dropout_p))
    fn.__name__ = fn.__qualname__ = name.replace("-", "_").replace("/", "_")
    return fn

