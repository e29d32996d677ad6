"""``fp8_kv``: an FP8 KV cache, as FlashInfer and vLLM keep one.  q in the tested dtype
(bfloat16 or float16), k and v in ``torch.float8_e4m3fn`` with ``k_descale`` and
``v_descale``, float32 (B, Hkv); out in q's dtype; forward only.  Quantised, judged and
bounded as ``fp8``'s k and v are (the golden on the dequantised inputs, the bound from the
baseline in the tested dtype and from P rounded to e4m3, the quantisation's own error beside
the verdict); its cases are ``fp8``'s, head dims 192 with Dv 128 among them (FlashInfer's
FP8-KV prefill was wrong there alone).  Invited mistakes: k's or v's descale not applied or
applied twice, taken by query head under GQA; P cast to e4m3 without its maximum; P V
accumulated across key tiles in bfloat16."""

from dataclasses import replace

from parity_tests.kernels.cases import Case
from parity_tests.kernels.features import Calling, Feature, Input, Judging
from parity_tests.kernels.features import fp8


def cases(causal, plan):
    own = [replace(c, features=(("fp8_kv", v),)) for c in fp8.cases(causal, plan) for _, v in c.features]
    return own + [Case(1, 4, 129, 129, 192, causal, (("value_dim", 128), ("fp8_kv", ("amax", 1.0))))]


def draw(case, fp8_kv, inputs):
    return fp8.drawn(case, *fp8_kv, inputs, names=("k", "v"))


def widen(case):
    """Every case of the run with its k and v in FP8 (``fp8.widen``'s slices)."""
    return case if case.get("fp8_kv") is not None else case.with_feature("fp8_kv", fp8.widen(case).get("fp8"))


def mistakes(ctx, value):
    if "k_descale" not in ctx.arrays:
        return []
    return fp8.descale_mistakes(ctx, ("k", "v")) + fp8.weight_mistakes(ctx)


FEATURE = Feature("fp8_kv", "an FP8 KV cache: k, v float8_e4m3fn with k_descale, v_descale (B, Hkv) float32; "
                  "q and out in the tested dtype; forward only",
                  cases=cases, label=lambda v: "fp8 kv" + fp8.label(v)[3:], draw=draw, mistakes=mistakes,
                  inputs=(*(Input(n, dtype=fp8.E4M3, scale=n + "_descale", ties=False) for n in ("k", "v")),
                          *(Input(n + "_descale", dtype="float32", to=("kernel",)) for n in ("k", "v"))),
                  excludes={"fp8": "q, k and v all in FP8"},
                  calling=Calling(run_wide=True, widen=widen),
                  judging=Judging(forward_only=True, dtypes=("bfloat16", "float16"), baselines=("fp8",),
                                  inputs_error=True))
