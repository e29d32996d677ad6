"""The default grid, as ``attention-parity check`` runs it (about 15 s per target
and dtype pair here): behind the ``slow`` marker, run with ``pytest -m slow``."""

import pytest

import parity_tests


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sdpa-math", "sdpa-flash"])
def test_the_default_grid_passes_in_float32_and_bfloat16(name):
    report = parity_tests.check(name)
    assert report.passed, str(report)
    assert {r.dtype for r in report.rows} == {"float32", "bfloat16"}
    assert {r.dims["tk"] for r in report.rows} >= {1, 17, 203, 1023, 2049}


@pytest.mark.slow
def test_a_wrong_kernel_fails_the_default_grid():
    from parity_tests.kernels.planted.chapter import GALLERY
    report = parity_tests.check(GALLERY["stale_max"][0], dtypes=["bfloat16"])
    assert not report.passed and report.diagnosis == "stale-max"
