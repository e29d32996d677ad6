"""The built-in targets with the features they can express.

- SDPA (``sdpa-*``): window, ALiBi and a bias become an additive ``attn_mask``
  (a boolean one for a window alone), GQA is ``enable_gqa=True`` (PyTorch 2.5 and later; before,
  a gqa case is not supported, and so is a case with a row that sees no key, where SDPA gave
  NaN), dropout its own
  ``dropout_p`` (drawn from torch's global RNG; the CPU flash kernel refuses p > 0, "not
  supported"); no softcap, sinks,
  lse or packed layout (their keywords are absent, so asking for them is a usage
  error).
- FlexAttention (``flex``): ``mask_mod`` for causal, window and the documents of
  a packed batch (``varlen``: q, k, v in the thd layout viewed as one sequence),
  ``score_mod`` for softcap, ALiBi and a bias; ``return_lse`` for lse.  Forward
  only on CPU, where it runs unfused and untraced (``common.flex``); compiled on CUDA.
- FlashAttention (``flash``, ``flash-varlen``, ``flash-kvcache``), when
  ``flash_attn`` imports, on CUDA: ``flash_attn_func`` (bthd),
  ``flash_attn_varlen_func`` (thd) and ``flash_attn_with_kvcache`` (decode,
  forward only; with ``paged`` its ``block_table`` and ``cache_seqlens`` -- pages of a
  multiple of 256 slots, FlashAttention 2's rule -- with ``splits`` its ``num_splits``),
  with their own ``window_size``, ``softcap``, ``alibi_slopes``;
  bottom-right only (a top-left causal case with Tq ≠ Tk is refused).
"""

import importlib.util
import math
import warnings

import torch
import torch.nn.functional as F

from parity_tests.common import capabilities
from parity_tests.common.flex import attend as flex_attend
from parity_tests.kernels.cases import offset_of
from parity_tests.kernels.dense import offsets, sees, visible

__all__ = ["sdpa", "flex", "flash_targets", "flash_unavailable", "SDPA_FEATURES", "FLEX_FEATURES"]

# The features each built-in expresses (``targets.Target.features``).
SDPA_FEATURES = frozenset({"gqa", "value_dim", "window", "alibi", "bias", "decode", "deterministic", "dropout"})
FLEX_FEATURES = frozenset({"gqa", "value_dim", "window", "softcap", "alibi", "bias", "varlen", "lse", "decode",
                           "deterministic"})
FLASH_FEATURES = {"flash": frozenset({"gqa", "value_dim", "window", "softcap", "alibi", "decode", "deterministic"}),
                  "flash-varlen": frozenset({"gqa", "window", "softcap", "alibi", "varlen", "deterministic"}),
                  "flash-kvcache": frozenset({"gqa", "window", "softcap", "alibi", "decode", "paged", "splits"})}


def _seen(tq, tk, causal, window, align, device):
    """(Tq, Tk) bool: True where query i sees key j (the contract's one rule, ``dense.visible``)."""
    return visible(torch.arange(tq, device=device), tk, causal=causal, offset=offset_of(tq, tk, align),
                   window=window, device=device)


def _alibi(slopes, tq, tk, align, dtype, device):
    """−slope_h · |i + offset − j|, (H, Tq, Tk)."""
    off = offset_of(tq, tk, align)
    i = torch.arange(tq, device=device, dtype=torch.float32)[:, None]
    j = torch.arange(tk, device=device, dtype=torch.float32)[None, :]
    return (-slopes.float()[:, None, None] * (i + off - j).abs()).to(dtype)


def sdpa(backend, unsupported):
    """``scaled_dot_product_attention`` restricted to ``backend`` (None: PyTorch's own choice),
    the features as masks."""
    def fn(q, k, v, *, causal, scale, align="top-left", window=None, alibi_slopes=None, bias=None, dropout_p=0.0):
        tq, tk = q.shape[-2], k.shape[-2]
        mask, is_causal = None, False
        if window is None and alibi_slopes is None and bias is None and (tq == tk or align == "top-left"):
            is_causal = causal
        elif alibi_slopes is None and bias is None:
            mask = _seen(tq, tk, causal, window, align, q.device)
        else:
            hidden = ~_seen(tq, tk, causal, window, align, q.device)
            mask = torch.zeros((), dtype=q.dtype, device=q.device).expand(tq, tk).masked_fill(hidden, -math.inf)
            if alibi_slopes is not None:
                mask = mask + _alibi(alibi_slopes, tq, tk, align, q.dtype, q.device)
            if bias is not None:
                mask = mask + bias
        gqa = q.shape[1] != k.shape[1]
        lacking = gqa and capabilities.lacks("enable_gqa")
        if mask is not None and not lacking and not (mask if mask.dtype == torch.bool else mask > -math.inf).any(-1).all():
            lacking = capabilities.lacks("sdpa_zero_rows")            # a row that sees no key
        try:
            restrict = capabilities.sdpa_backend(backend)
        except ValueError as e:
            lacking = str(e)
        if lacking:
            raise unsupported(lacking)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                with restrict:
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                                          scale=scale, dropout_p=dropout_p,
                                                          **({"enable_gqa": True} if gqa else {}))
            except RuntimeError as e:
                reasons = [str(w.message).splitlines()[0] for w in seen]
                raise unsupported("; ".join(reasons[-2:]) or str(e).splitlines()[0]) from None
    return fn


def _flex_call(q, k, v, scale, mask_mod, score_mod, lse, unsupported):
    if capabilities.lacks("flex_attention"):
        raise unsupported(capabilities.lacks("flex_attention"))
    from torch.nn.attention.flex_attention import create_block_mask
    tq, tk = q.shape[-2], k.shape[-2]
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, None, None, tq, tk, device=q.device)
    return flex_attend(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                       enable_gqa=q.shape[1] != k.shape[1], return_lse=lse)


def _documents(cu, device):
    """doc[t] and start[t] of each packed token t, from cu_seqlens."""
    lengths = (cu[1:] - cu[:-1]).long()
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    return doc, cu.long()[:-1][doc]


def flex(unsupported, lse=False):
    """FlexAttention with mask_mod / score_mod for the features; ``lse``: returns (out, lse)."""
    def fn(q, k, v, *, causal, scale, align="top-left", window=None, softcap=None, alibi_slopes=None,
           bias=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
        packed = cu_seqlens_q is not None
        if packed:                                   # (total, H, D) -> (1, H, total, D)
            q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
        tq, tk = q.shape[-2], k.shape[-2]
        if packed:
            doc_q, start_q = _documents(cu_seqlens_q, q.device)
            doc_k, start_k = _documents(cu_seqlens_k, q.device)
            lens_q, lens_k = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long(), (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
            doc_off = torch.tensor(offsets(tq, tk, lens_q.tolist(), lens_k.tolist(), align, len(lens_q)),
                                   device=q.device)
            place = lambda i, j: (i - start_q[i], j - start_k[j], doc_off[doc_q[i]])
        else:
            off = offset_of(tq, tk, align)
            place = lambda i, j: (i, j, off)
        mask_mod = None
        if causal or window is not None or packed:
            def mask_mod(b, h, i, j):
                li, lj, o = place(i, j)                      # within its document when packed
                ok = sees(li, lj, causal=causal, window=window, offset=o)
                return ok & (doc_q[i] == doc_k[j]) if packed else ok
        score_mod = None
        if softcap is not None or alibi_slopes is not None or bias is not None:
            full = None if bias is None else bias.expand(q.shape[0], q.shape[1], tq, tk)

            def score_mod(score, b, h, i, j):
                if softcap is not None:
                    score = softcap * torch.tanh(score / softcap)
                if alibi_slopes is not None:
                    li, lj, o = place(i, j)
                    score = score - alibi_slopes[h] * (li + o - lj).abs()
                if full is not None:
                    score = score + full[b, h, i, j]
                return score
        result = _flex_call(q, k, v, scale, mask_mod, score_mod, lse, unsupported)
        if not lse:
            return result[0].transpose(0, 1) if packed else result
        out, lse_ = result
        return (out[0].transpose(0, 1), lse_[0]) if packed else (out, lse_)
    return fn


def flash_unavailable():
    """Why FlashAttention's targets are not offered here, or None."""
    if importlib.util.find_spec("flash_attn") is None:
        return "flash_attn is not installed"
    try:
        import flash_attn  # noqa: F401
    except Exception as e:                           # noqa: BLE001 - any import failure is the reason
        return f"flash_attn does not import ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
    return None


def _flash_refuses(case, dtype, device, align):
    if case.seqlens is not None and len(set(case.seqlens[0])) > 1:
        return "flash_attn_func takes equal lengths: flash-varlen takes the packed batches"
    return _fa_refuses(case, dtype, device, align)


def _varlen_refuses(case, dtype, device, align):
    if case.seqlens is None:
        return "flash_attn_varlen_func takes the packed layout: run with --features varlen"
    return _fa_refuses(case, dtype, device, align)


def _kvcache_refuses(case, dtype, device, align):
    if not case.forward_only:
        return "flash_attn_with_kvcache is a decode kernel, forward only: run with --features decode"
    paged = case.get("paged")
    if paged and paged[0] % 256:
        return f"flash_attn_with_kvcache (FlashAttention 2) takes pages of a multiple of 256 slots, not {paged[0]}"
    return _fa_refuses(case, dtype, device, align)


def _fa_refuses(case, dtype, device, align):
    if device != "cuda":
        return "FlashAttention runs on CUDA only"
    if dtype not in ("float16", "bfloat16"):
        return "FlashAttention takes float16 and bfloat16 only"
    if case.causal and case.tq != case.tk and align == "top-left":
        return "FlashAttention's causal mask is bottom-right (run with --align bottom-right)"
    return None


def _fa_options(causal, scale, window, softcap, alibi_slopes):
    return dict(softmax_scale=scale, causal=causal, window_size=tuple(window) if window else (-1, -1),
                softcap=0.0 if softcap is None else float(softcap), alibi_slopes=alibi_slopes)


def flash_targets(make_target):
    """``{name: Target}`` for flash_attn's three entry points (``make_target(name, fn, layout,
    description, refuses)``)."""
    from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

    def func(q, k, v, *, causal, scale, window=None, softcap=None, alibi_slopes=None):
        return flash_attn_func(q, k, v, **_fa_options(causal, scale, window, softcap, alibi_slopes))

    def varlen(q, k, v, *, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               window=None, softcap=None, alibi_slopes=None):
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      **_fa_options(causal, scale, window, softcap, alibi_slopes))

    def kvcache(q, k_cache, v_cache, *, causal, scale, window=None, softcap=None, alibi_slopes=None,
                block_table=None, cache_seqlens=None, num_splits=0):
        """With ``paged``: the caches (num_pages, page_size, Hkv, D) and block_table; with
        ``splits``: num_splits (0: FlashAttention's own choice)."""
        with torch.no_grad():                        # an inference kernel: forward only
            return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table,
                                           num_splits=num_splits, **_fa_options(causal, scale, window, softcap,
                                                                                alibi_slopes))

    made = lambda name, fn, description, refuses: make_target(name, fn, "bthd", description, refuses,
                                                              FLASH_FEATURES[name])
    return {
        "flash": made("flash", func, "flash_attn_func (CUDA, flash_attn)", _flash_refuses),
        "flash-varlen": made("flash-varlen", varlen, "flash_attn_varlen_func (CUDA, flash_attn; --features varlen)",
                             _varlen_refuses),
        "flash-kvcache": made("flash-kvcache", kvcache,
                              "flash_attn_with_kvcache (CUDA, flash_attn; decode, forward only)", _kvcache_refuses),
    }
