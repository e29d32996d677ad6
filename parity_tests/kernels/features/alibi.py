"""``alibi``: ``S ← S − slope_h · |i + o − j|`` with ALiBi's slopes (Press et al.:
2^(−8h/H), h = 1 .. H, for H a power of two) for 4, 6 (not a power of two) and 8
heads, both alignments when the callable takes ``align``.  Invited mistakes: the
sign flipped, the distance signed (no absolute value), the slopes in reverse head order or taken per kv head (with GQA), the
alignment's offset left out or with its sign flipped, the positions kept in bfloat16
(past 256)."""

import numpy as np
import torch

from parity_tests.kernels.cases import Case
from parity_tests.kernels.dense import alibi_slopes, offsets
from parity_tests.kernels.features import Feature, Input, Judging, both_alignments


def cases(causal, plan):
    return both_alignments([Case(1, 4, 113, 113, 64, causal, (("alibi", True),)),
                            Case(1, 6, 45, 77, 64, causal, (("alibi", True),)),
                            Case(2, 8, 77, 45, 32, causal, (("alibi", True),))], plan)


def draw(case):
    return {"alibi_slopes": np.array(alibi_slopes(case.heads))}


def mistakes(ctx, on):
    slopes = ctx.opts["alibi_slopes"]
    out = [ctx.H("alibi-sign", "the ALiBi bias with its sign flipped (S + slope |i - j|)",
                 ctx.fwd({"alibi_slopes": -slopes}))]
    if not ctx.opts.get("causal"):       # under a causal mask no seen key lies past the diagonal
        out.append(ctx.H("alibi-signed", "the ALiBi distance signed, i + offset - j without its absolute value "
                         "(right under a causal mask only: the keys past the diagonal given a bonus, not a penalty)",
                         ctx.fwd(alibi_signed=True)))
    if ctx.case.heads > 1:
        out.append(ctx.H("alibi-reversed", "the ALiBi slopes in reverse head order",
                         ctx.fwd({"alibi_slopes": slopes[::-1].copy()})))
    group = ctx.case.heads // ctx.case.hkv
    if group > 1:                        # GQA: query head h given kv head h // group's slope
        out.append(ctx.H("alibi-per-kv-head", f"the ALiBi slopes taken per kv head (query head h given slope "
                         f"h // {group}) instead of per query head",
                         ctx.fwd({"alibi_slopes": slopes[np.arange(ctx.case.heads) // group]})))
    if max(ctx.case.tq, ctx.case.tk) + max(abs(o) for o in ctx.offsets) > 256:     # bfloat16's integers end at 256
        out.append(ctx.H("alibi-positions-bfloat16", "the ALiBi positions, and |i - j|, in bfloat16 (positions past "
                         "256 rounded to its 8 bits)", ctx.fwd(positions_dtype=torch.bfloat16)))
    lens = ctx.case.seqlens or (None, None)
    if any(offsets(ctx.case.tq, ctx.case.tk, lens[0], lens[1], ctx.other_align, ctx.case.batch)):
        out.append(ctx.H("alibi-other-alignment", f"the ALiBi distance with the {ctx.other_align} alignment's offset "
                         f"while the mask keeps its own ({ctx.align}): |i + offset - j| with the other offset",
                         ctx.fwd(alibi_align=ctx.other_align)))
    if any(ctx.offsets):
        out += [ctx.H("alibi-no-offset", "the ALiBi distance |i - j| without the alignment's offset "
                      "(|i + offset - j| is meant)", ctx.fwd(alibi_no_offset=True)),
                ctx.H("alibi-offset-sign", "the ALiBi offset with its sign flipped (|i - offset - j| where "
                      "|i + offset - j| is meant)", ctx.fwd(alibi_offset_sign=-1))]
    return out


def flash_lse(case, align, inputs, lse):
    """lse in FlashAttention's causal ALiBi form: + slope_h · (i + offset) per row (its bias is
    slope · j, which differs from −slope · |i + o − j| by a constant per row on the keys a
    causal row sees, so out is the same and only lse moves)."""
    lens = case.seqlens or (None, None)
    offs = np.array(offsets(case.tq, case.tk, lens[0], lens[1], align, case.batch))
    i = np.arange(case.tq)[None, None, :] + offs[:, None, None]                  # (B, 1, Tq)
    return (lse + np.asarray(inputs["alibi_slopes"])[None, :, None] * i,
            "lse in FlashAttention's causal ALiBi form (+slope j)", "lse in the reference's ALiBi form")


FEATURE = Feature("alibi", "alibi_slopes= float32 tensor (H,), ALiBi's slopes",
                  cases=cases, label=lambda on: "alibi", draw=draw,
                  inputs=(Input("alibi_slopes", dtype="float32", per_head=True),), mistakes=mistakes,
                  apply=lambda case, rng: case.with_feature("alibi", True),
                  judging=Judging(aligned=True, lse_form=flash_lse))
