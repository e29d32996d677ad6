"""A third oracle: centred finite differences of the NumPy *forward*, in float64.

Finite differences need no backward code at all, so they are independent of both
hand-written NumPy backward passes and PyTorch's autograd.  Both sides' gradients
(and the fused kernel's) are held to them, with the same random upstream gradient
and, in training mode, the same keep-mask.
"""

import pytest
import torch

from parity_tests.matrix import harness
from parity_tests.common.finite_diff import numerical_grads
from parity_tests.matrix.run import format_rows
from parity_tests.common.tolerances import FINITE_DIFF_BOUND

SMALL = {
    False: harness.Config("fd 2-D", tokens=3, d_in=3, head_dim=2, qkv_bias=True),
    True: harness.Config("fd causal", tokens=3, d_in=3, head_dim=2, batch=2, num_heads=2,
                         context_length=4, qkv_bias=True),
}
CASES = [harness.Case(spec, SMALL[spec.batched], mode, "float64", "cpu")
         for spec in harness.MODULES for mode in spec.modes]


def _gradients(case):
    """(finite differences, torch's gradients, numpy's gradients), keyed input/param names."""
    x, grad_out, keep = harness.make_inputs(case)
    module = harness.build_torch(case)
    x_t, _ = harness._rounded(case, x)
    g_t, _ = harness._rounded(case, grad_out)
    keep_t = None if keep is None else torch.tensor(keep)
    torch_res = harness.run_torch(module, case, x_t, g_t, keep_t)
    np_res = harness.run_numpy(case, module.state_dict(), x, grad_out, keep)
    np_mod = harness.build_numpy(case)
    np_mod.load_state_dict(module.state_dict())
    np_mod.train() if case.mode == "train" else np_mod.eval()
    numeric = numerical_grads(np_mod, x, grad_out, keep_mask=keep)
    return numeric, torch_res, np_res


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.spec.name}-{c.mode}")
def test_both_sides_match_finite_differences(case):
    numeric, torch_res, np_res = _gradients(case)
    scales = harness.tensor_scales({"output": 0.0, **numeric})
    rows = []
    for check, tested in (("torch vs finite diff", torch_res), ("numpy vs finite diff", np_res)):
        for name, expected in numeric.items():
            error, where = harness.relative_error(tested.get(name), expected, scales[name])
            rows.append(harness._row(case, check, name, error, FINITE_DIFF_BOUND, None, where))
    assert {n for n in torch_res if n != "output"} == set(numeric)
    failing = [r for r in rows if not r["passed"]]
    assert not failing, "\n" + format_rows(failing)
