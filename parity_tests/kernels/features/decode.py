"""``decode``: Tq of 1 to a few queries against a long Tk (2500 .. 4109), bottom-right
(the last query sees every key): the output (and lse) only.  Invited mistake: the
decode queries placed top-left."""

from dataclasses import replace

from parity_tests.kernels.cases import Case
from parity_tests.kernels.features import Feature, Judging


def cases(causal, plan):
    out = [Case(2, 4, 1, 2500, 64, causal, (("decode", True),)), Case(1, 2, 5, 3077, 64, causal, (("decode", True),)),
           Case(1, 8, 8, 4109, 64, causal, (("decode", True),))]
    return [replace(c, align="bottom-right") for c in out] if plan.takes_align else out


def top_left(ctx):
    """A decode kernel's alignment mistake, named in its terms: the queries placed top-left."""
    if ctx.align == "bottom-right":
        return ("decode-top-left", "the decode queries placed top-left (query i sees keys j <= i; "
                "bottom-right is meant: the last query sees every key)")
    return None


FEATURE = Feature("decode", "Tq of 1 to a few queries against a long Tk, bottom-right; forward only",
                  cases=cases, label=lambda on: "decode",
                  judging=Judging(forward_only=True, alignment_mistake=top_left))
