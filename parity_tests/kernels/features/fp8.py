"""``fp8``: FlashAttention-3's FP8 forward.  The callable receives q, k, v in
``torch.float8_e4m3fn`` and ``q_descale``, ``k_descale``, ``v_descale``: float32 (B, Hkv), the
real value being the stored one times its descale (query head h takes kv head
h // (Hq/Hkv)'s, q's descale included); it returns out in bfloat16 (a wrong dtype FAILS);
forward only.

Every case of the run is quantised (``widen``): each (batch, kv head) slice of q (its group
of query heads), k and v divided by its own descale, amax / 448, and rounded to e4m3
(`features.Input`'s ``scale``).  The golden is ``numpy_ref.reference_attention`` on the
dequantised inputs (stored × descale, exact in float64); the bound comes from the baseline in
bfloat16 on those inputs and from FlashAttention-3's own formulation (``dense.fp8_weights``:
P = exp(S − m) rounded to e4m3 before P V, divided by l after), the larger of the two
(``tolerances``, "FP8").  Beside the verdict, each row reports what the quantisation itself
costs: the golden on the dequantised inputs against the golden on the drawn ones.

Cases: the tile boundary plus one (97 = 96 + 1, 129 = 128 + 1), head dims 64 and 128; slices
2^6 apart in magnitude (``wide``: a descale taken from another slice is far off; every GQA
case of the run is drawn so); a slice of v whose one outlier entry puts the rest of it into
e4m3's subnormals (``outlier``); logits ×8 and ×32 (softmax rows near one-hot, where exp(S)
without the maximum leaves e4m3's range); a long case, not causal whatever the run's mask (64
queries against Tk = 32769, 257 key tiles of 128: an accumulator in a reduced precision loses
more the more tiles it sums).  q is drawn 4 times larger and k 4 times smaller than the
scores need, so that q's descale is never k's.  Invited mistakes: a descale not applied, or
applied twice (q, k or v), or every descale inverted (TransformerEngine's convention); k's
channels past v's head dim read without k_descale (an MLA cache's rope part); the descales
indexed by query head (h % Hkv) under GQA; P cast to e4m3 without the row maximum
subtracted, with FlashAttention-3's offset of 8 (log2 units) taken as a natural exponent,
normalised before the cast, or with a descale folded in before it; P V accumulated across key
tiles in 8 significant bits (bfloat16's, or truncated as Hopper's FP8 tensor cores keep it: the
long case shows it).
An output in float8 or float32 FAILS on its dtype (``output-dtype``)."""

import itertools
import math

import numpy as np
import torch

from parity_tests.kernels import dense
from parity_tests.kernels.cases import Case
from parity_tests.kernels.features import Calling, Feature, Input, Judging, per_head

E4M3 = "float8_e4m3fn"
E4M3_MAX = 448.0            # e4m3's largest finite value (it has no infinity)
WIDE = 2.0 ** 6             # the ``wide`` slices' magnitudes apart
OUTLIER = 2.0 ** 16         # the ``outlier`` entry over the rest of its slice: the rest falls below e4m3's
#                             smallest normal 2^-6 once divided by the descale
Q_OVER_K = 4.0              # q drawn this much larger than k: a q_descale left out is told from k's
LONG_T = 32769              # 256 key tiles of 128, and one key more (64 queries: a long decode chunk)
TILES = (64, 128)           # the key tiles tried for an accumulator kept in bfloat16


def descales(x, kv_heads):
    """(B, Hkv) float32: each kv head's slice of ``x`` (for q, its group of query heads)
    amax / 448; 1 for a slice of zeros."""
    amax = np.abs(x).reshape(x.shape[0], kv_heads, -1).max(-1)
    return np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32).astype(np.float64)


def slices(case, factors):
    """(B, Hkv) factors, slice by slice, repeating ``factors``."""
    n = case.batch * case.hkv
    return np.resize(np.asarray(factors, dtype=np.float64), n).reshape(case.batch, case.hkv)


def drawn(case, kind, logits, inputs, names=("q", "k", "v")):
    """q, k, v as an FP8 case draws them (the module's docstring), and their descales."""
    x = {n: inputs[n].copy() for n in ("q", "k", "v")}
    x["q"] *= logits * Q_OVER_K              # the scores unchanged (but for ``logits``), the descales apart
    x["k"] /= Q_OVER_K
    if kind == "wide":                       # scores unchanged: q's slice up where k's is down
        f = slices(case, (1 / WIDE, 1.0, WIDE))
        x["q"] *= per_head(f, case.heads)
        x["k"] /= per_head(f, case.hkv)
        x["v"] *= per_head(f, case.hkv)
    elif kind == "outlier":                  # v's slice (0, 0) shrunk but for one entry (in q or k: logits)
        peak = np.abs(x["v"][0, 0]).max()
        x["v"][0, 0] /= OUTLIER
        x["v"][0, 0, 0, 0] = peak
    return {**x, **{n + "_descale": descales(x[n], case.hkv) for n in names}}


def cases(causal, plan):
    fp8 = lambda kind="amax", logits=1.0: (("fp8", (kind, logits)),)
    return [Case(2, 4, 97, 97, 64, causal, fp8()), Case(1, 4, 129, 129, 128, causal, fp8("wide")),
            Case(1, 4, 77, 129, 64, causal, fp8("outlier")), Case(1, 2, 129, 129, 64, causal, fp8(logits=8.0)),
            Case(1, 2, 129, 129, 64, causal, fp8(logits=32.0)), Case(1, 1, 64, LONG_T, 64, False, fp8())]


def label(value):
    kind, logits = value
    return "fp8" + ("" if kind == "amax" else f" {kind}") + ("" if logits == 1 else f" logits x{logits:g}")


def draw(case, fp8, inputs):
    return drawn(case, *fp8, inputs)


def widen(case):
    """Every case of the run in FP8: per-slice descales from each slice's amax, the slices of a
    GQA case 2^6 apart (``wide``: a descale read at the wrong head is far off)."""
    kind = "wide" if case.hkv < case.heads else "amax"
    return case if case.get("fp8") is not None else case.with_feature("fp8", (kind, 1.0))


# ----------------------------------------------------------------------------
# The catalogue's FP8 mistakes

def descale_mistakes(ctx, names):
    """A descale not applied, applied twice, another input's of its shape applied instead (a line
    copied from the one before), every descale inverted (the inputs divided by them: another
    library's scale convention), or taken by query head (h % Hkv) under GQA."""
    q, k, v, _ = ctx.inputs
    x = {"q": q, "k": k, "v": v}
    given = {n: ctx.arrays[n + "_descale"] for n in names}
    scale = {n: per_head(given[n], x[n].shape[1]) for n in names}
    out = []
    for n in names:
        out += [ctx.H(f"fp8-{n}-descale-missing", f"{n}_descale not applied (the stored float8 {n} read as its "
                      "real value)", ctx.fwd(inputs={n: x[n] / scale[n]}), ("out",)),
                ctx.H(f"fp8-{n}-descale-twice", f"{n}_descale applied twice", ctx.fwd(inputs={n: x[n] * scale[n]}),
                      ("out",))]
        for m in (m for m in names if m != n and given[m].shape == given[n].shape):
            other = per_head(given[m], x[n].shape[1])
            out.append(ctx.H(f"fp8-{n}-descale-from-{m}", f"{n} dequantised with {m}_descale instead of {n}_descale "
                             f"(its line copied from {m}'s)", ctx.fwd(inputs={n: x[n] / scale[n] * other}), ("out",)))
    dqk, dv = x["k"].shape[-1], x["v"].shape[-1]
    if "k" in names and dqk > dv:             # MLA: the rope channels past Dv kept apart, in another format
        rope = np.arange(dqk) >= dv
        out.append(ctx.H("fp8-k-descale-missing-past-dv", f"k's channels {dv} .. {dqk - 1} (past v's head dim: "
                         "an MLA cache's rope part) read without k_descale, its first channels with it",
                         ctx.fwd(inputs={"k": np.where(rope, x["k"] / scale["k"], x["k"])}), ("out",)))
    out.append(ctx.H("fp8-descales-inverted", f"{', '.join(n + '_descale' for n in names)} taken as quantisation "
                     "scales: each input divided by its descale instead of multiplied (TransformerEngine's scale "
                     "convention given FlashAttention-3's descales)",
                     ctx.fwd(inputs={n: x[n] / scale[n] ** 2 for n in names}), ("out",)))
    group = ctx.case.heads // ctx.case.hkv
    if group > 1:                            # (B, Hkv) read at query head h: h % Hkv, as a repeat would
        heads = ctx.case.heads
        wide = {n: x[n] if n == "q" else np.repeat(x[n], group, axis=1) for n in x}      # per query head
        wrong = {n: wide[n] / per_head(ctx.arrays[n + "_descale"], heads)
                 * np.tile(ctx.arrays[n + "_descale"], (1, group))[:, :, None, None] for n in names}
        for which, said in (((names[0],), f"{names[0]}_descale"), (names, "the descales")):
            given = {n: wrong[n] if n in which else wide[n] for n in x}
            if not any(n in which for n in ("k", "v")):
                given = {"q": given["q"]}    # k and v as they are: a group per kv head
            out.append(ctx.H("fp8-descale-query-head", f"{said} indexed by query head (h % Hkv: query head h "
                             f"given kv head h % {ctx.case.hkv}'s) instead of by its kv head h // {group}",
                             ctx.fwd(inputs=given), ("out",)))
    return out


def narrow(x, truncate):
    """float64 ``x`` kept in 8 significant bits, bfloat16's: rounded to nearest, or truncated
    toward zero as a tensor core's narrow accumulator is (the low 16 bits of its float32 cleared)."""
    x = x.to(torch.float32)
    if truncate:
        return (x.view(torch.int32) & -65536).view(torch.float32).double()
    return x.to(torch.bfloat16).double()


def tiles_in_bf16(ctx, block, truncate):
    """out with P V accumulated key tile by key tile (``block`` keys) in 8 significant bits
    (`narrow`): FlashAttention's loop, acc = narrow(acc · e^{m_old − m_new} + Σ_{j∈tile}
    e^{S_j − m_new} v_j), out = acc / l, in float64 otherwise (the options' masks; no score
    change).  Its error grows with the number of tiles, truncated ones about linearly."""
    def predict(grads=False):
        q, k, v, _ = (torch.as_tensor(a) for a in ctx.inputs)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        S = ctx.opts["scale"] * q @ k.transpose(-1, -2)
        first = (ctx.rows or (0,))[0]
        rows = torch.arange(first, first + q.shape[2])
        lq, lk = ctx.opts.get("seqlens_q"), ctx.opts.get("seqlens_k")
        seen = torch.stack([dense.visible(rows, k.shape[2], causal=ctx.opts["causal"], offset=o,
                                          window=ctx.opts.get("window"), nq=None if lq is None else int(lq[b]),
                                          nk=None if lk is None else int(lk[b]))
                            for b, o in enumerate(ctx.offsets)])[:, None]
        S = S.masked_fill(~seen, -torch.inf)
        acc = torch.zeros(q.shape[:3] + (v.shape[-1],), dtype=torch.float64)
        m = torch.full(q.shape[:3] + (1,), -torch.inf, dtype=torch.float64)
        l = torch.zeros_like(m)
        for t0 in range(0, k.shape[2], block):
            St = S[..., t0:t0 + block]
            new = torch.maximum(m, St.amax(-1, keepdim=True))
            base = torch.where(torch.isfinite(new), new, 0.0)
            alpha = torch.where(torch.isfinite(m), torch.exp(m - base), 0.0)
            E = torch.exp(St - base)
            acc = narrow(acc * alpha + E @ v[..., t0:t0 + block, :], truncate)
            l, m = l * alpha + E.sum(-1, keepdim=True), new
        return ctx.as_4d({"out": (acc / torch.where(l > 0, l, 1.0)).numpy()})
    return predict


MAX_TILES = ((64, 32), (64, 64), (128, 32), (128, 64), (128, 128))   # (query, key) tiles: the maximum before the mask


def max_before_mask(ctx, block_m, block_n, offset):
    """out of FlashAttention-3's loop whose running maximum is taken over each key tile before
    its mask: m = max(m, rowmax(S_tile)) over every key of each tile a query tile of ``block_m``
    visits (causal: up to its last row's reach), E = exp(S − m + offset) masked after, rounded to
    e4m3 for E V, l = Σ E unrounded.  The maximum cancels in exact arithmetic; in e4m3 a row
    whose hidden keys score far above its visible ones has their weights in the subnormals or
    0.  None where no row's maximum moves, or on a block of rows."""
    if ctx.rows is not None:
        return None
    q, k, v, _ = (torch.as_tensor(a) for a in ctx.inputs)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    S = ctx.opts["scale"] * q @ k.transpose(-1, -2)
    rows, tk = torch.arange(q.shape[2]), k.shape[2]
    seen = torch.stack([dense.visible(rows, tk, causal=True, offset=o) for o in ctx.offsets])[:, None]
    reach = (rows // block_m * block_m + block_m - 1).clamp(max=q.shape[2] - 1)        # a query tile's last row
    last = torch.stack([(reach + o).clamp(-1, tk - 1) for o in ctx.offsets])[:, None, :, None]
    visited = torch.arange(tk) // block_n * block_n <= last                            # the key tiles it walks
    moved = torch.where(visited, S, -torch.inf).amax(-1) > torch.where(seen, S, -torch.inf).amax(-1)
    if not moved.any():
        return None

    def predict(grads=False):
        acc = torch.zeros(q.shape[:3] + (v.shape[-1],), dtype=torch.float64)
        m = torch.full(q.shape[:3] + (1,), -torch.inf, dtype=torch.float64)
        l = torch.zeros_like(m)
        for t0 in range(0, tk, block_n):
            St = torch.where(visited[..., t0:t0 + block_n], S[..., t0:t0 + block_n], -torch.inf)
            new = torch.maximum(m, St.amax(-1, keepdim=True))
            base = torch.where(torch.isfinite(new), new, 0.0)
            alpha = torch.where(torch.isfinite(m), torch.exp(m - base), 0.0)
            E = torch.exp(St - base + offset) * seen[..., t0:t0 + block_n]
            acc = acc * alpha + E.to(torch.float8_e4m3fn).double() @ v[..., t0:t0 + block_n, :]
            l, m = l * alpha + E.sum(-1, keepdim=True), new
        return ctx.as_4d({"out": (acc / torch.where(l > 0, l, 1.0)).numpy()})
    return predict


def mistakes(ctx, fp8):
    if "q_descale" not in ctx.arrays:
        return []
    return descale_mistakes(ctx, ("q", "k", "v")) + weight_mistakes(ctx)


def weight_mistakes(ctx):
    """P cast to e4m3 without the row maximum subtracted, with FlashAttention-3's offset of 8 taken
    in the wrong base, normalised before the cast, or with a descale folded in before it (its weights rounded on another part of e4m3's grid: toward its
    subnormals); P V accumulated in bfloat16 tile by tile."""
    out = [ctx.H("fp8-p-without-max", "P cast to float8 e4m3 without the row maximum subtracted (exp(S) "
                 "saturates at 448 and vanishes below 2^-9)", ctx.fwd(weights="fp8-no-max"), ("out",)),
           ctx.H("fp8-p-offset-in-base-e", "P = exp(S - m + 8) cast to float8 e4m3: FlashAttention-3's max offset of "
                 "8, meant in log2 units (2^8 = 256, under 448), taken as a natural exponent (e^8 = 2981: the largest "
                 "weights saturate at 448 while l counts them whole)",
                 ctx.fwd(weights="fp8", fp8_prescale=math.exp(8)), ("out",)),
           ctx.H("fp8-p-normalised", "P divided by its row sum l before its cast to float8 e4m3 instead of after P V "
                 "(the weights rounded at their own scale, the small ones to e4m3's subnormals)",
                 ctx.fwd(weights="fp8", fp8_prescale="normalised"), ("out",))]
    for n in (n for n in ("q_descale", "k_descale", "v_descale") if n in ctx.arrays):
        folded = torch.as_tensor(per_head(ctx.arrays[n], ctx.case.heads))          # (B, Hq, 1, 1)
        hid = f"fp8-p-times-{n.replace('_', '-')}"
        out.append(ctx.H(hid, f"{n} folded into P before its cast to float8 e4m3 (P x {n} rounded: the weights "
                         "pushed toward e4m3's subnormals)", ctx.fwd(weights="fp8", fp8_prescale=folded), ("out",)))
    plain = all(ctx.opts.get(n) is None for n in ("softcap", "alibi_slopes", "bias", "sinks"))
    if plain and ctx.opts["causal"] and ctx.opts.get("window") is None and ctx.opts.get("seqlens_k") is None:
        for (bm, bn), offset in itertools.product(MAX_TILES, (0.0, 8 * math.log(2))):
            predict = max_before_mask(ctx, bm, bn, offset) if bn < ctx.case.tk else None
            if predict is not None:
                out.append(ctx.H("fp8-max-before-mask", f"each row's running maximum taken over whole key tiles "
                                 f"before the causal mask (query tiles of {bm}, key tiles of {bn}"
                                 f"{', P offset by 2^8' if offset else ''}): the mask applied to P after exp, so a "
                                 "row whose hidden keys score above its visible ones has their e4m3 weights "
                                 "flushed toward 0", predict, ("out",)))
    if plain and ctx.case.tk > min(TILES):
        out += [ctx.H("fp8-pv-narrow-accumulator", f"P V accumulated across key tiles of {b} in 8 significant bits "
                      f"({how}: an accumulator narrower than float32, its error growing with the keys)",
                      tiles_in_bf16(ctx, b, truncate), ("out",))
                for b in TILES if b < ctx.case.tk
                for truncate, how in ((True, "truncated as a tensor core's"), (False, "bfloat16"))]
    return out


FEATURE = Feature("fp8", "FlashAttention-3's FP8: q, k, v float8_e4m3fn, q_descale, k_descale, v_descale "
                  "(B, Hkv) float32; out bfloat16; forward only",
                  cases=cases, label=label, draw=draw, mistakes=mistakes,
                  inputs=(*(Input(n, dtype=E4M3, scale=n + "_descale", ties=False) for n in ("q", "k", "v")),
                          *(Input(n + "_descale", dtype="float32", to=("kernel",)) for n in ("q", "k", "v"))),
                  excludes={"fp8_kv": "q, k and v all in FP8"},
                  calling=Calling(run_wide=True, widen=widen),
                  judging=Judging(forward_only=True, dtypes=("bfloat16",), baselines=("fp8",), inputs_error=True))
