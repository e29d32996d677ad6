"""``sinks``: one raw logit per head joining every row's softmax denominator, carrying no
value (gpt-oss): a large sink (log Tk + 1: most of the weight) and a small one; dsinks
is checked.  Invited mistakes: the sink left out of the softmax, its gradient dropped."""

import math

import numpy as np

from parity_tests.kernels.cases import Case
from parity_tests.kernels.features import Feature, Input, Judging


def cases(causal, plan):
    return [Case(1, 4, t, 77, 64, causal, (("sinks", s),)) for t in (77, 45) for s in ("large", "small")]


def draw(case, sinks, rng):
    base = math.log(case.tk) + 1.0 if sinks == "large" else -1.0
    return {"sinks": base + 0.5 * rng.standard_normal(case.heads)}


def mistakes(ctx, size):
    if "dsinks" not in ctx.golden_raw:
        return []
    zero = ctx.as_4d({"dsinks": 0 * ctx.golden_raw["dsinks"]})["dsinks"]
    ignored = ctx.fwd({"sinks": None})
    return [ctx.H("sink-ignored", "the sink left out of the softmax",
                  lambda grads=True: {**ignored(grads), "dsinks": zero}),
            ctx.H("sink-no-grad", "the sinks without their gradient (dsinks = 0)",
                  ctx.changed(dsinks=0 * ctx.golden_raw["dsinks"]), ("dsinks",))]


def reduced(sinks, inputs, golden):
    """dsinks_h = −Σ_{b,i} P_sink (D_i − dlse_i), P_sink = exp(sink_h − lse_i), D_i = Σ_d dO_id O_id:
    one number per head summed over every row, each term rounded in the kernel's own way (the
    sink column concatenated to the scores and autograd, or the sum written out): its bound is
    at least the rounding of a sum of these terms' sizes."""
    lse = golden["lse"]
    seen = np.isfinite(lse)
    p_sink = np.where(seen, np.exp(np.asarray(inputs["sinks"])[None, :, None] - np.where(seen, lse, 0.0)), 0.0)
    d = (inputs["dout"] * golden["out"]).sum(-1) - inputs.get("dlse", 0.0)
    return {"dsinks": np.abs(p_sink * d).sum(axis=(0, 2))}


FEATURE = Feature("sinks", "sinks= float32 tensor (H,), requiring grad: dsinks is checked",
                  cases=cases, label=lambda s: f"sinks {s}", draw=draw,
                  inputs=(Input("sinks", dtype="float32", grad=True, per_head=True, no_grad="sink-no-grad"),),
                  mistakes=mistakes,
                  apply=lambda case, rng: case.with_feature("sinks", "large"), judging=Judging(reduced=reduced))
