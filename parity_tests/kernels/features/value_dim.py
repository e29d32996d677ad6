"""``value_dim``: v with a head dim of its own (Dv ≠ Dqk): Dv 32 and 128 against Dqk 64,
and Dqk 192 with Dv 128 (MLA's shape)."""

from parity_tests.kernels.cases import Case
from parity_tests.kernels.features import Feature, Shrinking


def cases(causal, plan):
    return [Case(1, 2, 77, 77, 64, causal, (("value_dim", 32),)),
            Case(1, 2, 45, 77, 64, causal, (("value_dim", 128),)),
            Case(1, 2, 113, 113, 192, causal, (("value_dim", 128),))]


FEATURE = Feature("value_dim", "v with a head dim other than q's and k's", cases=cases,
                  apply=lambda case, rng: case.with_feature("value_dim", 32 if case.head_dim != 32 else 48),
                  shrinking=Shrinking(shape="v_dim"))
