"""``bias``: an additive bias broadcastable to (B, H, Tq, Tk), requiring grad: dbias is
checked in the bias's own shape (the sum over its broadcast axes).  Shapes (B, H, Tq, Tk),
(1, H, Tq, Tk), (B, 1, 1, Tk), (Tq, Tk).  Invited mistakes: the gradient never reaches
the bias (dbias = 0); with a softcap, dbias taken after the cap's derivative (or as q·k's
gradient), where the bias, added after the cap, takes the softmax input's gradient; a
broadcast bias read through its own view's strides, not its expansion's."""

import numpy as np

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
                 ctx.changed(dbias=0 * ctx.golden_raw["dbias"]), ("dbias",))] + _own_strides(ctx, shape)
    if ctx.opts.get("softcap"):           # the bias comes after the cap: dbias is dS, not the capped scores' gradient
        out += [ctx.H("dbias-after-softcap-derivative", "dbias taken from dS after the softcap's derivative, dS ∘ (1 - "
                      "tanh^2(S / c)), where the bias, added after the cap, takes dS itself",
                      ctx.fwd(bias_grad="after-cap-derivative"), ("dbias",)),
                ctx.H("dbias-as-qk-grad", "dbias taken as the gradient of q·k, dS ∘ (1 - tanh^2(S / c)) x scale, "
                      "where the bias, added after the cap and the scale, takes dS itself",
                      ctx.fwd(bias_grad="qk"), ("dbias",))]
    return out


def _own_strides(ctx, shape):
    """The bias read through the strides of its own 4-D view where those of its expansion to (B,
    H, Tq, Tk) are meant: a size-1 axis then strides by the product of the sizes after it (0 is
    meant), so its broadcast copies read other rows of the storage, and past its end 0 (a load
    masked at the allocation's end); dbias scattered back at the same offsets (an atomic add)."""
    bias = np.asarray(ctx.opts["bias"])
    case = ctx.case
    full = (case.batch, case.heads, case.tq, case.tk)
    own = (1,) * (4 - bias.ndim) + bias.shape
    if own == full or ctx.rows is not None:
        return []
    strides = [int(np.prod(own[a + 1:])) for a in range(4)]
    offset = sum(np.arange(n).reshape([-1 if a == b else 1 for b in range(4)]) * strides[a]
                 for a, n in enumerate(full))
    inside = offset < bias.size
    read = np.where(inside, bias.reshape(-1)[np.minimum(offset, bias.size - 1)], 0.0)
    q, k, v, dout = ctx.inputs

    def predict(grads=True):
        got = ctx.dense(q, k, v, dout, {**ctx.opts, "bias": read}, grads=grads)
        if grads and "dbias" in got:
            dbias = np.zeros(bias.size)
            np.add.at(dbias, offset[inside], np.asarray(got["dbias"])[inside])
            got = {**got, "dbias": dbias.reshape(bias.shape)}
        return ctx.as_4d(got)
    return [ctx.H("bias-own-strides", f"the bias of shape {tuple(shape)} read through the strides of its own view "
                  f"{own}, {tuple(strides)}, where those of its expansion to {full} are meant (0 on each broadcast "
                  "axis): its broadcast copies read other rows of the storage, and 0 past its end", predict)]


def fit(case, shape):
    """The bias's shape for a case of new sizes: its broadcast (length-1) axes kept."""
    full = (case.batch, case.heads, case.tq, case.tk)
    return tuple(1 if s == 1 else full[i - len(shape) + 4] for i, s in enumerate(shape))


FEATURE = Feature("bias", "bias= tensor broadcastable to (B, H, Tq, Tk), requiring grad: dbias is checked",
                  cases=cases, label=lambda s: "bias" + "x".join(map(str, s)), draw=draw,
                  inputs=(Input("bias", grad=True, no_grad="bias-no-grad"),), mistakes=mistakes,
                  apply=lambda case, rng: case.with_feature("bias", (1, case.heads, case.tq, case.tk)),
                  shrinking=Shrinking(fit=fit))
