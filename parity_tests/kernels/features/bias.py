"""``bias``: an additive bias broadcastable to (B, H, Tq, Tk), requiring grad: dbias is
checked in the bias's own shape (the sum over its broadcast axes).  Shapes (B, H, Tq, Tk),
(1, H, Tq, Tk), (B, 1, 1, Tk), (Tq, Tk).  Invited mistakes: the gradient never reaches
the bias (dbias = 0); with a softcap, dbias taken after the cap's derivative (or as q·k's
gradient), where the bias, added after the cap, takes the softmax input's gradient."""

from parity_tests.kernels.cases import Case
from parity_tests.kernels.features import Feature, Input, Shrinking


def cases(causal, plan):
    return [Case(2, 2, 45, 77, 64, causal, (("bias", s),))
            for s in ((2, 2, 45, 77), (1, 2, 45, 77), (2, 1, 1, 77), (45, 77))]


def draw(bias, rng):
    return {"bias": rng.standard_normal(bias)}


def mistakes(ctx, shape):
    if "dbias" not in ctx.golden_raw:
        return []
    out = [ctx.H("bias-no-grad", "the bias without its gradient (dbias = 0)",
                 ctx.changed(dbias=0 * ctx.golden_raw["dbias"]), ("dbias",))]
    if ctx.opts.get("softcap"):           # the bias comes after the cap: dbias is dS, not the capped scores' gradient
        out += [ctx.H("dbias-after-softcap-derivative", "dbias taken from dS after the softcap's derivative, dS ∘ (1 - "
                      "tanh^2(S / c)), where the bias, added after the cap, takes dS itself",
                      ctx.fwd(bias_grad="after-cap-derivative"), ("dbias",)),
                ctx.H("dbias-as-qk-grad", "dbias taken as the gradient of q·k, dS ∘ (1 - tanh^2(S / c)) x scale, "
                      "where the bias, added after the cap and the scale, takes dS itself",
                      ctx.fwd(bias_grad="qk"), ("dbias",))]
    return out


def fit(case, shape):
    """The bias's shape for a case of new sizes: its broadcast (length-1) axes kept."""
    full = (case.batch, case.heads, case.tq, case.tk)
    return tuple(1 if s == 1 else full[i - len(shape) + 4] for i, s in enumerate(shape))


FEATURE = Feature("bias", "bias= tensor broadcastable to (B, H, Tq, Tk), requiring grad: dbias is checked",
                  cases=cases, label=lambda s: "bias" + "x".join(map(str, s)), draw=draw,
                  inputs=(Input("bias", grad=True, no_grad="bias-no-grad"),), mistakes=mistakes,
                  apply=lambda case, rng: case.with_feature("bias", (1, case.heads, case.tq, case.tk)),
                  shrinking=Shrinking(fit=fit))
