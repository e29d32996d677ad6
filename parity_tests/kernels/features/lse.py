"""``lse``: the callable returns ``(out, lse)``, lse (B, H, Tq) (``(H, total_q)`` with
``thd``), natural log, judged on every row that sees a key (kernels store −inf, +inf
or 0 on the others: any of them, never NaN).  With ALiBi, FlashAttention's causal form
(+slope·j, each row's constant −slope·(i + o) left out) is accepted as well.  Invited
mistakes: lse in base 2, lse without the running maximum added back."""

import math

import numpy as np

from parity_tests.kernels.features import Calling, Feature


def mistakes(ctx, on=True):
    if "lse" not in ctx.present:
        return []
    lse = ctx.golden_raw["lse"]
    m = ctx.row_max()
    return [ctx.H("lse-base-2", "lse in base 2 (log2 of the sum instead of the natural log)",
                  ctx.changed(lse=lse / math.log(2.0)), ("lse",)),
            ctx.H("lse-no-max", "lse without the running maximum added back (log l instead of m + log l)",
                  ctx.changed(lse=np.where(np.isfinite(lse), lse - m, lse)), ("lse",))]


FEATURE = Feature("lse", "nothing new: the callable returns (out, lse), natural log", mistakes=mistakes,
                  calling=Calling(run_wide=True, returns_lse=True))
