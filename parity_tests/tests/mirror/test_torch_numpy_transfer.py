"""Weights move between torch_impl and numpy_ref in one line, both ways, and the
moved weights give the same outputs (float64, eval mode)."""

import numpy as np
import pytest
import torch

import numpy_ref
import torch_impl
from parity_tests.common.tolerances import FLOAT64_BOUND

# float64 on both sides, the same operations: agreement to rounding error.
FLOAT64_RTOL = FLOAT64_ATOL = FLOAT64_BOUND

# name: (constructor arguments, input shape)
CASES = {
    "SimplifiedSelfAttention": ((), (6, 3)),
    "SelfAttention_v1": ((3, 2), (6, 3)),
    "SelfAttention_v2": ((3, 2, True), (6, 3)),
    "CausalAttention": ((3, 2, 6, 0.5), (2, 5, 3)),
    "MultiHeadAttentionWrapper": ((3, 2, 6, 0.5, 2), (2, 6, 3)),
    "MultiHeadAttention": ((3, 4, 6, 0.5, 2, True), (2, 4, 3)),
}


def _pair(name, seed):
    args, shape = CASES[name]
    torch.manual_seed(seed)
    torch_mod = getattr(torch_impl, name)(*args).double().eval()
    rng = {"rng": seed + 1} if args else {}      # SimplifiedSelfAttention() has no weights
    np_mod = getattr(numpy_ref, name)(*args, **rng)
    np_mod.eval()
    x = np.random.default_rng(seed + 2).standard_normal(shape)
    return torch_mod, np_mod, x


def _assert_same_outputs(torch_mod, np_mod, x, what):
    expected = torch_mod(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(np_mod(x), expected, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL, err_msg=what)


@pytest.mark.parametrize("name", CASES)
def test_torch_weights_load_into_numpy_in_one_line(name):
    torch_mod, np_mod, x = _pair(name, seed=10)
    np_mod.load_state_dict(torch_mod.state_dict())
    _assert_same_outputs(torch_mod, np_mod, x, f"{name}: torch -> numpy")


@pytest.mark.parametrize("name", CASES)
def test_numpy_weights_load_into_torch_in_one_line(name):
    torch_mod, np_mod, x = _pair(name, seed=20)
    torch_mod.load_state_dict({k: torch.from_numpy(v) for k, v in np_mod.state_dict().items()})
    _assert_same_outputs(torch_mod, np_mod, x, f"{name}: numpy -> torch")


@pytest.mark.parametrize("name", ["MultiHeadAttention", "MultiHeadAttentionWrapper"])
def test_round_trip_torch_numpy_torch_changes_no_weight(name):
    torch_mod, np_mod, _ = _pair(name, seed=30)
    original = {k: v.clone() for k, v in torch_mod.state_dict().items()}
    np_mod.load_state_dict(torch_mod.state_dict())
    for p in torch_mod.parameters():
        torch.nn.init.zeros_(p)
    torch_mod.load_state_dict({k: torch.from_numpy(v) for k, v in np_mod.state_dict().items()})
    assert list(torch_mod.state_dict()) == list(original)
    for key, value in torch_mod.state_dict().items():
        assert torch.equal(value, original[key]), f"{key} changed on the round trip"


def test_fused_weights_load_into_numpy():
    torch.manual_seed(40)
    fused = torch_impl.FusedMultiHeadAttention(3, 4, 6, 0.0, 2).double().eval()
    np_mod = numpy_ref.MultiHeadAttention(3, 4, 6, 0.0, 2, rng=41)
    np_mod.load_state_dict(fused.state_dict())
    x = np.random.default_rng(42).standard_normal((2, 6, 3))
    _assert_same_outputs(fused, np_mod, x, "FusedMultiHeadAttention -> numpy")


def test_parameters_that_require_grad_load_into_numpy():
    # named_parameters() hands out tensors that require grad: NumPy detaches them
    torch.manual_seed(50)
    torch_mod = torch_impl.MultiHeadAttention(3, 4, 6, 0.0, 2)
    np_mod = numpy_ref.MultiHeadAttention(3, 4, 6, 0.0, 2, rng=51)
    np_mod.load_state_dict({**torch_mod.state_dict(), **dict(torch_mod.named_parameters())})
    for key, value in torch_mod.state_dict().items():
        np.testing.assert_array_equal(np_mod.state_dict()[key], value.numpy(), err_msg=key)


def test_unreadable_tensor_refused_naming_its_key_and_nothing_changes():
    torch_mod = torch_impl.MultiHeadAttention(3, 4, 6, 0.0, 2).to(torch.bfloat16)
    np_mod = numpy_ref.MultiHeadAttention(3, 4, 6, 0.0, 2, rng=52)
    before = np_mod.state_dict()
    with pytest.raises(TypeError, match=r"state_dict\['mask'\]"):
        np_mod.load_state_dict(torch_mod.state_dict())      # NumPy has no bfloat16
    for key, value in np_mod.state_dict().items():
        np.testing.assert_array_equal(value, before[key], err_msg=key)
