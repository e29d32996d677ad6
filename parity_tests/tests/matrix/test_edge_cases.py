"""Numerical edge cases, on both sides: huge scores, the first causal row, NaN input."""

import numpy as np
import pytest
import torch

from parity_tests.matrix import harness

SPECS = {s.name: s for s in harness.MODULES}


def _pair(name, config, dtype="float64", mode="eval"):
    """(case, torch module, numpy module holding the same weights), same dtype."""
    case = harness.Case(SPECS[name], config, mode, dtype, "cpu")
    module = harness.build_torch(case).train(mode == "train")
    np_mod = harness.build_numpy(case)
    np_mod.load_state_dict(module.state_dict())
    np_mod.train() if mode == "train" else np_mod.eval()
    return case, module, np_mod


def _both(module, np_mod, x, grad_out):
    """Output and input gradient on each side: ((out, dx) torch, (out, dx) numpy)."""
    xt = torch.tensor(x, requires_grad=True)
    out = module(xt)
    out.backward(torch.tensor(grad_out, dtype=out.dtype))
    np_out = np_mod.forward(x)
    np_dx = np_mod.backward(grad_out)
    return (out.detach().numpy(), xt.grad.numpy()), (np_out, np_dx)


@pytest.mark.parametrize("name", ["SimplifiedSelfAttention", "MultiHeadAttention"])
def test_scores_of_1e4_in_float32_stay_finite(name):
    """Scores of +-1e4 overflow a naive exp in float32 (exp(89) = inf); the stable
    softmax must keep outputs and gradients finite on both sides."""
    rng = np.random.default_rng(0)
    if name == "SimplifiedSelfAttention":
        config = harness.Config("big", tokens=5, d_in=4, head_dim=4)
        x = (rng.standard_normal((5, 4)) * 60).astype(np.float32)       # x x^T ~ +-1e4
    else:
        config = harness.Config("big", tokens=5, d_in=4, head_dim=2, batch=2, num_heads=2)
        x = (rng.standard_normal((2, 5, 4)) * 60).astype(np.float32)
    case, module, np_mod = _pair(name, config, "float32")
    if name == "MultiHeadAttention":
        with torch.no_grad():
            module.W_query.weight.mul_(8.0)
            module.W_key.weight.mul_(8.0)
        np_mod.load_state_dict(module.state_dict())
        scores = (module.W_query(torch.tensor(x)) @ module.W_key(torch.tensor(x)).mT).abs().max()
        assert scores > 1e4
    else:
        assert np.abs(x @ x.T).max() > 1e4
    grad_out = rng.standard_normal(np_mod.forward(x).shape).astype(np.float32)
    for side, (out, dx) in zip(("torch", "numpy"), _both(module, np_mod, x, grad_out)):
        assert out.dtype == np.float32, side
        assert np.isfinite(out).all() and np.isfinite(dx).all(), side
    grads = {n: p.grad for n, p in module.named_parameters()}
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert all(np.isfinite(g).all() for g in np_mod.grads.values())


@pytest.mark.parametrize("name", ["CausalAttention", "MultiHeadAttention", "FusedMultiHeadAttention"])
def test_first_causal_row_attends_only_to_itself(name):
    """Token 0 sees only itself: its attention weight is exactly 1, so its context
    vector is exactly its value vector (before out_proj), and a one-token input
    gives the query and key weights exactly zero gradient (J = w(1 - w) = 0)."""
    config = harness.Config("first row", tokens=4, d_in=3, head_dim=2, batch=2, num_heads=2)
    case, module, np_mod = _pair(name, config)
    x = np.random.default_rng(1).standard_normal((2, 4, 3))
    with torch.no_grad():
        out = module(torch.tensor(x))
        values = module.W_value(torch.tensor(x))
        if hasattr(module, "out_proj"):
            values = module.out_proj(values)
    assert torch.equal(out[:, 0], values[:, 0])
    state = np_mod.state_dict()
    np_values = x @ state["W_value.weight"].T                          # (B, T, d_out)
    if "out_proj.weight" in state:
        np_values = np_values @ state["out_proj.weight"].T + state["out_proj.bias"]
    np.testing.assert_array_equal(np_mod.forward(x)[:, 0], np_values[:, 0])

    one = x[:, :1]
    grad_out = np.random.default_rng(2).standard_normal(np_mod.forward(one).shape)
    _both(module, np_mod, one, grad_out)
    for key in ("W_query.weight", "W_key.weight"):
        assert not module.get_parameter(key).grad.any(), f"torch {key}"
        assert not np_mod.grads[key].any(), f"numpy {key}"
    assert np.abs(np_mod.grads["W_value.weight"]).max() > 0


@pytest.mark.parametrize("name", ["SelfAttention_v2", "CausalAttention", "MultiHeadAttention"])
def test_nan_input_propagates_on_both_sides(name):
    """A NaN in the input is not refused and not hidden: it reaches the output and
    the gradients, in the same places on both sides; other sequences stay finite."""
    spec = SPECS[name]
    config = spec.configs[-1]
    case, module, np_mod = _pair(name, config)
    x, grad_out, _ = harness.make_inputs(case)
    x[..., 2, 1] = np.nan                            # token 2 (of every sequence for 2-D)
    if spec.batched:
        x[1:] = np.nan_to_num(x[1:])                 # only the first sequence gets the NaN
    (out, dx), (np_out, np_dx) = _both(module, np_mod, x, grad_out)
    assert np.isnan(out).any() and np.isnan(dx).any()
    np.testing.assert_array_equal(np.isnan(np_out), np.isnan(out))
    np.testing.assert_array_equal(np.isnan(np_dx), np.isnan(dx))
    if spec.batched:
        assert np.isfinite(out[1:]).all() and np.isfinite(np_out[1:]).all()
    assert np.isnan(np_mod.grads["W_query.weight"]).any()
    assert torch.isnan(module.W_query.weight.grad).any()
