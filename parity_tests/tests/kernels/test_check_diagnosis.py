"""The diagnosis's own limits and what it may claim."""

import numpy as np
import pytest

import parity_tests
from parity_tests.kernels import cases, diagnosis
import crashing_kernels as bad

ONE = dict(dtypes=["float32"], head_dims=[16], heads=[2], batch=[1])


def test_a_case_of_exactly_dense_limit_pairs_is_diagnosed_densely():
    case = cases.Case(1, 2, 4096, 4096, 1, True)             # B H Tq Tk = 2^25 = DENSE_LIMIT
    assert case.batch * case.heads * case.tq * case.tk == diagnosis.DENSE_LIMIT
    whole = {"out": np.zeros((1, 2, 4096, 1))}
    sel, sub = diagnosis._subset(case, whole, whole, (whole["out"],) * 3, whole["out"])
    assert sel == (slice(None), slice(None)) and sub[0] is whole
    one_more = cases.Case(1, 2, 4096, 4097, 1, True)
    assert diagnosis._subset(one_more, whole, whole, (whole["out"],) * 3, whole["out"])[0] != sel
