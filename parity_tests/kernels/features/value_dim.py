"""``value_dim``: v with a head dim of its own (Dv ≠ Dqk): Dv 32 and 128 against Dqk 64,
and Dqk 192 with Dv 128 (MLA's shape).  Invited mistake: a backward that reads dO, O and V
with q's head dim, so that dP = dO Vᵀ and D = rowsum(dO ∘ O) sum over the first min(D, Dv)
channels only, and dv's channels from D on are never written."""

from parity_tests.kernels.cases import Case
from parity_tests.kernels.features import Feature, Shrinking


def cases(causal, plan):
    return [Case(1, 2, 77, 77, 64, causal, (("value_dim", 32),)),
            Case(1, 2, 45, 77, 64, causal, (("value_dim", 128),)),
            Case(1, 2, 113, 113, 192, causal, (("value_dim", 128),))]


def mistakes(ctx, dv):
    """dO, O and V read over the first D channels in the backward: the right backward with dO's
    channels from D on zeroed (dP, D, and dv = Pᵀ dO without its channels from D on)."""
    d = ctx.case.head_dim
    if dv <= d or "dq" not in ctx.present:
        return []
    q, k, v, dout = ctx.inputs
    cut = dout.copy()
    cut[..., d:] = 0.0

    def predict(grads=True):
        return ctx.as_4d(ctx.dense(q, k, v, cut, ctx.opts, grads=grads))
    return [ctx.H("value-dim-backward-truncated", f"the backward's dP = dO Vᵀ and D = rowsum(dO ∘ O) over the "
                  f"first D = {d} of the Dv = {dv} channels (dO, O and V read with q's head dim; dv's channels "
                  f"from {d} on left 0)", predict, ("dq", "dk", "dv"))]


FEATURE = Feature("value_dim", "v with a head dim other than q's and k's", cases=cases, mistakes=mistakes,
                  apply=lambda case, rng: case.with_feature("value_dim", 32 if case.head_dim != 32 else 48),
                  shrinking=Shrinking(shape="v_dim"))
