"""``deterministic``: each case runs twice and every tensor must be bitwise equal (atomic
adds and reductions in varying order break it)."""

from parity_tests.kernels.features import Calling, Feature

FEATURE = Feature("deterministic", "nothing new: each case runs twice and must give bitwise-equal results",
                  calling=Calling(run_wide=True, repeats=True))
