"""``gqa``: k and v with fewer heads than q (MQA included); query head h reads kv head
h // (Hq / Hkv).  Cases Hq/Hkv = 4/1, 6/2, 8/4.  Invited mistakes: kv heads tiled
(h % Hkv) instead of interleaved, dk, dv of a kv head taken from one query head of its
group instead of summed over the group (the adjoint of the repeat is a sum), and the
bottom-right offset computed with the rows the group's heads are packed into (Tq x G)."""

import numpy as np

from parity_tests.kernels.cases import Case, halvings
from parity_tests.kernels.features import Feature, Shrinking


def cases(causal, plan):
    return [Case(2, 4, 77, 77, 64, causal, (("gqa", 1),)), Case(1, 6, 45, 77, 40, causal, (("gqa", 2),)),
            Case(1, 8, 113, 203, 64, causal, (("gqa", 4),))]


def mistakes(ctx, kv_heads):
    case = ctx.case
    group = case.heads // kv_heads
    out = []
    if group == 1:
        return out
    if kv_heads > 1:
        out.append(ctx.H("gqa-repeat", "kv heads mapped with repeat (query head h reads kv head h % Hkv) "
                         "instead of repeat_interleave (h // (Hq/Hkv))", ctx.fwd(kv_map="repeat")))
    if case.causal and ctx.align == "bottom-right":      # the query heads packed as rows of their kv head
        tqs = [int(t) for t in case.seqlens[0]] if case.seqlens else [case.tq] * case.batch
        out.append(ctx.H("gqa-packed-rows-offset", f"the bottom-right offset Tk - Tq computed with the packed rows "
                         f"Tq x {group} for Tq (the group's query heads packed as rows of their kv head, as "
                         f"FlashAttention-3's PackGQA does): the causal diagonal {group - 1} x Tq keys earlier",
                         ctx.fwd(shift=[-(group - 1) * t for t in tqs])))
    if "dk" in ctx.golden_raw:
        q, k, v, dout = ctx.inputs
        cache = {}

        def one_head(r):
            def predict(grads=True):
                if "wide" not in cache:       # every query head with a kv head of its own
                    cache["wide"] = ctx.dense(q, np.repeat(k, group, 1), np.repeat(v, group, 1), dout, ctx.opts)
                w = cache["wide"]
                return ctx.as_4d({**ctx.golden_raw, "dk": w["dk"][:, r::group], "dv": w["dv"][:, r::group]})
            return predict
        for r in sorted({0, group - 1}):
            out.append(ctx.H("gqa-grad-one-head", f"dk, dv of each kv head taken from query head {r} of its "
                             f"group alone (not summed over the group's {group} heads)", one_head(r), ("dk", "dv")))
    return out


def apply(case, rng):
    return case.with_feature("gqa", case.heads // 2 if case.heads % 2 == 0 else 1) if case.heads > 1 else None


def head_counts(case, kv_heads):
    """A shrunk case keeps whole groups: (heads, kv heads) with fewer kv heads or smaller
    groups, fewest heads first (the larger group first among equals)."""
    group = case.heads // kv_heads
    pairs = sorted({(kv * g, -g, kv) for kv in halvings(kv_heads) + [kv_heads] for g in halvings(group) + [group]}
                   - {(case.heads, -group, kv_heads)})
    return [(h, kv) for h, _, kv in pairs]


def fit(case, kv_heads):
    """The kv heads, when the query heads are still whole groups of them."""
    return kv_heads if kv_heads <= case.heads and case.heads % kv_heads == 0 else None


FEATURE = Feature("gqa", "k and v with fewer heads than q (MQA included)", cases=cases, mistakes=mistakes,
                  apply=apply, shrinking=Shrinking(fit=fit, head_counts=head_counts, shape="kv_heads"))
