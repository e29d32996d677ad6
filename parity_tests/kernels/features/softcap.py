"""``softcap``: ``S ← c · tanh(S / c)`` on the scaled scores, before any bias: 50, and 1
on scores of spread ~4 (q drawn 4× larger), where tanh saturates.  Invited mistakes:
the cap applied before the scale, its derivative 1 − tanh² left out of the backward, taken at
the capped score or without the /c inside the square, or applied to dP alone (the row term D
outside it), the positive scores alone capped, a clip at ±c for c·tanh; and the convention of
applying it after ALiBi and the bias instead of before."""

from parity_tests.kernels.cases import Case
from parity_tests.kernels.features import Feature, Option


def cases(causal, plan):
    return [Case(1, 2, 77, 77, 64, causal, (("softcap", 50.0),)),
            Case(1, 2, 45, 77, 64, causal, (("softcap", 50.0),)),
            Case(1, 2, 77, 77, 64, causal, (("softcap", 1.0),))]


def draw(softcap, inputs):
    return {"q": inputs["q"] * 4.0} if softcap < 10 else {}     # scores of spread ~4: tanh saturates at 1


def mistakes(ctx, cap):
    grads = tuple(n for n in ctx.present if n.startswith("d"))
    return [ctx.H("softcap-before-scale", f"the softcap applied before the scale (c tanh(q.k / c) x scale, "
                  f"c = {cap:g})", ctx.fwd(softcap_first=True)),
            ctx.H("softcap-no-derivative", "the softcap's derivative 1 - tanh^2 left out of the backward",
                  ctx.fwd(softcap_no_grad=True), grads),
            ctx.H("softcap-derivative-of-capped", "the softcap's derivative taken at the capped score, "
                  "1 - tanh^2(c tanh(S / c) / c) (tanh applied twice), instead of 1 - tanh^2(S / c)",
                  ctx.fwd(softcap_derivative="of-capped"), grads),
            ctx.H("softcap-derivative-on-dp", "the softcap's derivative applied to dP alone, before the softmax's "
                  "backward: dS = P (1 - tanh^2) dP - P D, the row term D = rowsum(dO o O) left outside it, "
                  "instead of (1 - tanh^2) P (dP - D)", ctx.fwd(softcap_derivative="dp-only"), grads),
            ctx.H("softcap-derivative-capped-squared", "the softcap's derivative written 1 - (c tanh(S / c))^2, "
                  "the / c inside the square left out, instead of 1 - tanh^2(S / c)",
                  ctx.fwd(softcap_derivative="capped-squared"), grads),
            ctx.H("softcap-positive-only", f"the softcap applied to the positive scores only (c tanh(S / c) where "
                  f"S > 0, S itself below, c = {cap:g})", ctx.fwd(softcap_form="positive")),
            ctx.H("softcap-clamped", f"the scores clipped at ±c instead of capped by c tanh(S / c) (c = {cap:g})",
                  ctx.fwd(softcap_form="clamp"))] + after_bias(ctx, cap)


def after_bias(ctx, cap):
    """A convention rather than a slip: the cap applied after ALiBi and the bias, c tanh((S - slope |i + o - j|
    + bias) / c) (x-transformers' Attend adds its attention bias, ALiBi's included, before its softclamp),
    where the contract caps the scaled scores first.  Told apart only where ALiBi or a bias meets the cap."""
    added = [n for n, key in (("ALiBi", "alibi_slopes"), ("the bias", "bias")) if ctx.opts.get(key) is not None]
    if not added:
        return []
    return [ctx.H("softcap-after-bias", f"the softcap applied after {' and '.join(added)} (c tanh((S + biases) "
                  f"/ c), c = {cap:g}; x-transformers' order) instead of before them", ctx.fwd(softcap_last=True))]


FEATURE = Feature("softcap", "softcap=float, c·tanh(S/c) on the scaled scores",
                  cases=cases, label=lambda c: f"softcap {c:g}", draw=draw,
                  options=(Option("softcap", float),), mistakes=mistakes,
                  apply=lambda case, rng: case.with_feature("softcap", 30.0))
