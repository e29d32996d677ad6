"""The parity matrix under pytest: one test per module x config x mode x dtype x device.

The same cases and comparisons as ``attention-parity`` (`parity_tests.harness`);
a failure prints the failing rows with their error, bound and the index of the
largest difference.
"""

import dataclasses

import numpy as np
import pytest
import torch

from parity_tests.matrix import harness
from parity_tests.matrix.run import format_rows

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _params(device, dtypes, marks=()):
    return [pytest.param(case, id=f"{case.spec.name}-{case.config.label}-{case.mode}-"
                                  f"{case.dtype}-{case.device}".replace(" ", "_"), marks=marks)
            for case in harness.build_cases(dtypes, [device])]


CPU_CASES = _params("cpu", ("float64", "float32", "bfloat16", "float16"))
# The CPU cases moved to CUDA (built by hand: build_cases leaves out a device that
# is absent, and these should show up as skipped, not vanish).
CUDA_CASES = [pytest.param(dataclasses.replace(p.values[0], device="cuda"),
                           id=p.id[:-len("cpu")] + "cuda", marks=[pytest.mark.cuda, needs_cuda])
              for p in CPU_CASES]


def _check(case):
    rows = harness.run_case(case)
    failing = [r for r in rows if not r["passed"]]
    assert rows, f"no rows for {case}"
    assert not failing, f"{len(failing)} of {len(rows)} rows fail:\n" + format_rows(failing)


@pytest.mark.parametrize("case", CPU_CASES)
def test_parity_cpu(case):
    _check(case)


@pytest.mark.parametrize("case", CUDA_CASES)
def test_parity_cuda(case):
    if not harness.dtype_supported(case.dtype, "cuda"):
        pytest.skip(f"{case.dtype} is not supported on this GPU")
    _check(case)


@pytest.mark.parametrize("spec", harness.MODULES, ids=lambda s: s.name)
def test_every_tensor_is_compared(spec):
    """Rows cover exactly the output, the input gradient, every named parameter and
    every buffer: the comparison cannot drift out of step with the modules."""
    case = harness.Case(spec, spec.configs[-1], spec.modes[-1], "float64", "cpu")
    module = harness.build_torch(case)
    expected = ([n for n, _ in module.named_buffers()]
                + ["output", "input"] + [n for n, _ in module.named_parameters()])
    assert [r["tensor"] for r in harness.run_case(case)] == expected


def test_training_cases_use_dropout():
    """Training-mode cases really drop weights: the output differs from eval mode."""
    spec = next(s for s in harness.MODULES if s.name == "MultiHeadAttention")
    config = spec.configs[-1]
    outs = {}
    for mode in ("eval", "train"):
        case = harness.Case(spec, config, mode, "float64", "cpu")
        x, grad_out, keep = harness.make_inputs(case)
        x = torch.tensor(x)
        keep = None if keep is None else torch.tensor(keep)
        outs[mode] = harness.run_torch(harness.build_torch(case), case, x,
                                       torch.tensor(grad_out), keep)["output"]
    assert not keep.all()
    assert abs(outs["train"] - outs["eval"]).max() > 1e-3


def test_relative_error_reports_the_largest_difference():
    ref = np.array([[1.0, 2.0], [3.0, 4.0]])
    tested = ref.copy()
    tested[1, 0] += 0.4
    error, where = harness.relative_error(tested, ref)
    assert where == (1, 0) and error == pytest.approx(0.1)
    assert harness.relative_error(tested[:1], ref)[0] == float("inf")
    tested[0, 1] = np.nan
    assert harness.relative_error(tested, ref) == (float("inf"), (0, 1))
