"""``window``: FlashAttention's ``window_size=(left, right)``: query i sees key j iff
i + o − left ≤ j ≤ i + o + right (−1: unbounded; causal caps the right side at 0).
Windows drawn per case (seeded): 0-wide, left only, right only, both, and with a
causal mask the right side given as −1 (unbounded, capped by the mask); Tq = Tk,
Tq < Tk, Tq > Tk, both alignments when the callable takes ``align``.  Invited
mistakes: each edge one key off either way or ignored, the sides swapped, the window placed
with the other alignment than the causal mask."""

from parity_tests.kernels.cases import Case, case_rng
from parity_tests.kernels.features import Feature, Judging, Option, both_alignments


def _windows(tk, causal, rng):
    left, right = (int(x) for x in rng.integers(1, max(2, tk), size=2))
    if causal:
        return [(0, 0), (left, 0), (left, -1)]
    return [(0, 0), (left, -1), (-1, right), (left, right)]


def cases(causal, plan):
    out = []
    for tq, tk in ((113, 113), (45, 77), (77, 45)):
        shape = Case(1, 2, tq, tk, 64, causal)
        out += [Case(1, 2, tq, tk, 64, causal, (("window", w),))
                for w in _windows(tk, causal, case_rng(plan.seed, shape, "window"))]
    return both_alignments(out, plan)


def mistakes(ctx, window):
    left, right = window
    case, out = ctx.case, []
    edge = lambda side, w, what: ctx.H(f"window-{side}-{what}", f"the window one key {what} on its {side} edge "
                                       f"({w} for {window}: only the keys at the window's {side} edge differ)",
                                       ctx.fwd({"window": w}))
    if left >= 0:
        out.append(edge("left", (left + 1, right), "wider"))
        if left >= 1:
            out.append(edge("left", (left - 1, right), "narrower"))
        elif right == 0 or case.causal:         # 0-wide, narrower: no query sees a key
            zeros = {n: 0 * ctx.golden_raw[n] for n in ("out", "dq", "dk", "dv") if n in ctx.golden_raw}
            out.append(ctx.H("window-left-narrower", f"the window one key narrower on its left edge (no key "
                             f"left to see in {window}: zeros everywhere)", ctx.changed(**zeros), tuple(zeros)))
    if right >= 0 and not case.causal:
        out.append(edge("right", (left, right + 1), "wider"))
        if right >= 1:
            out.append(edge("right", (left, right - 1), "narrower"))
    ignored = lambda side, w: ctx.H(f"window-{side}-ignored", f"the window's {side} edge ignored ({w} for {window})",
                                    ctx.fwd({"window": w}))
    if left >= 0:
        out.append(ignored("left", (-1, right)))
    if right >= 0 and not case.causal:
        out.append(ignored("right", (left, -1)))
    if left != right and not (case.causal and right == -1):
        out.append(ctx.H("window-swapped", f"the window's sides swapped ({(right, left)} for {window})",
                         ctx.fwd({"window": (right, left)})))
    if case.tq != case.tk:
        told = "the causal mask and the check" if case.causal else "the check"
        out.append(ctx.H("window-other-alignment", f"the window placed {ctx.other_align} ({told}: {ctx.align})",
                         ctx.fwd(window_align=ctx.other_align)))
    return out


def apply(case, rng):
    return case.with_feature("window", _windows(case.tk, case.causal, rng)[-1])


FEATURE = Feature("window", "window=(left, right), FlashAttention's window_size",
                  cases=cases, label=lambda w: f"window({w[0]},{w[1]})",
                  options=(Option("window", tuple),), mistakes=mistakes, apply=apply,
                  judging=Judging(aligned=True))
