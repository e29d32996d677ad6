"""``lse_grad``: the callable returns ``(out, lse)`` and the check backpropagates a random
upstream gradient through lse as well as out (ring attention and split-KV merges do).
Since ``∂lse_i/∂S_ij = P_ij``, the backward's row term ``D_i`` becomes ``D_i − dlse_i``
(``numpy_ref.reference_attention``'s ``dlse``); dv does not change.  Invited mistake:
the lse gradient dropped (every gradient through the scores, dq, dk, a bias's, the sinks', as
if dlse were 0: each tensor is matched alone, so one gradient that leaves it out is named)."""

from parity_tests.kernels.features import Calling, Feature


def mistakes(ctx, on=True):
    if "dq" not in ctx.present:
        return []
    through_scores = tuple(n for n in ctx.present if n not in ("out", "lse", "dv"))
    return [ctx.H("lse-grad-dropped", "the gradient through lse dropped (as if only out had one)",
                  ctx.fwd(dlse=None), through_scores)]


FEATURE = Feature("lse_grad", "the callable returns (out, lse); a random gradient flows back through lse too",
                   mistakes=mistakes, calling=Calling(run_wide=True, returns_lse=True, lse_gradient=True))
