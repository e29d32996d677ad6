"""``bias``: an additive bias broadcastable to (B, H, Tq, Tk), requiring grad: dbias is
checked in the bias's own shape (the sum over its broadcast axes).  Shapes (B, H, Tq, Tk),
(1, H, Tq, Tk), (B, 1, 1, Tk), (Tq, Tk).  Invited mistake: the gradient never reaches
the bias (dbias = 0)."""

from parity_tests.kernels.cases import Case
from parity_tests.kernels.features import Feature, Input, Shrinking


def cases(causal, plan):
    return [Case(2, 2, 45, 77, 64, causal, (("bias", s),))
            for s in ((2, 2, 45, 77), (1, 2, 45, 77), (2, 1, 1, 77), (45, 77))]


def draw(bias, rng):
    return {"bias": rng.standard_normal(bias)}


def mistakes(ctx, shape):
    return [ctx.H("bias-no-grad", "the bias without its gradient (dbias = 0)",
                  ctx.changed(dbias=0 * ctx.golden_raw["dbias"]), ("dbias",))] if "dbias" in ctx.golden_raw else []


def fit(case, shape):
    """The bias's shape for a case of new sizes: its broadcast (length-1) axes kept."""
    full = (case.batch, case.heads, case.tq, case.tk)
    return tuple(1 if s == 1 else full[i - len(shape) + 4] for i, s in enumerate(shape))


FEATURE = Feature("bias", "bias= tensor broadcastable to (B, H, Tq, Tk), requiring grad: dbias is checked",
                  cases=cases, label=lambda s: "bias" + "x".join(map(str, s)), draw=draw,
                  inputs=(Input("bias", grad=True, no_grad="bias-no-grad"),), mistakes=mistakes,
                  apply=lambda case, rng: case.with_feature("bias", (1, case.heads, case.tq, case.tk)),
                  shrinking=Shrinking(fit=fit))
