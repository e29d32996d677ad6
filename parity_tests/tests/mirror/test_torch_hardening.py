"""What torch_impl promises beyond the chapter's lines (dropout = 1.0, all-or-nothing
load_state_dict), and how numpy_ref answers a torch.Tensor it cannot read."""

import numpy as np
import pytest
import torch

import numpy_ref
import torch_impl

# name -> (constructor arguments with dropout 1.0 where there is one, input shape)
CAUSAL = {
    "CausalAttention": ((3, 2, 6, 1.0), (2, 5, 3)),
    "MultiHeadAttentionWrapper": ((3, 2, 6, 1.0, 2), (2, 5, 3)),
    "MultiHeadAttention": ((3, 4, 6, 1.0, 2, True), (2, 5, 3)),
    "FusedMultiHeadAttention": ((3, 4, 6, 1.0, 2, True), (2, 5, 3)),
}
ALL = {
    "SimplifiedSelfAttention": ((), (5, 3)),
    "SelfAttention_v1": ((3, 2), (5, 3)),
    "SelfAttention_v2": ((3, 2, True), (5, 3)),
    **CAUSAL,
}


# --- dropout = 1.0, as nn.Dropout(1.0) ---------------------------------------------

@pytest.mark.parametrize("name", CAUSAL)
def test_dropout_one_drops_every_weight_on_both_sides(name):
    args, shape = CAUSAL[name]
    torch.manual_seed(0)
    torch_mod = getattr(torch_impl, name)(*args).double().train()
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    out = torch_mod(x)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    bias = getattr(getattr(torch_mod, "out_proj", None), "bias", None)
    expected = torch.zeros_like(out) if bias is None else bias.detach().expand_as(out)
    torch.testing.assert_close(out.detach(), expected, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, torch.zeros_like(x), rtol=0, atol=0)
    if name == "FusedMultiHeadAttention":
        return                                  # no NumPy twin of its own
    np_mod = getattr(numpy_ref, name)(*args, rng=0)
    np_mod.load_state_dict(torch_mod.state_dict())
    np.testing.assert_array_equal(np_mod(x.detach().numpy()), out.detach().numpy())
    np.testing.assert_array_equal(np_mod.backward(grad_out.numpy()), x.grad.numpy())
    for key, param in torch_mod.named_parameters():
        np.testing.assert_allclose(np_mod.grads[key], param.grad.numpy(), rtol=1e-12,
                                   atol=1e-15, err_msg=key)     # out_proj's sums in any order


# --- a torch.Tensor NumPy cannot read, passed to a NumPy module --------------------

@pytest.mark.parametrize("tensor", [
    torch.ones(5, 3, requires_grad=True),
    torch.ones(5, 3, dtype=torch.bfloat16),
], ids=["requires_grad", "bfloat16"])
def test_numpy_module_names_x_for_a_tensor_it_cannot_read(tensor):
    m = numpy_ref.SelfAttention_v2(3, 2, rng=0)
    with pytest.raises(TypeError, match=r"^x must be an array NumPy can read.*x\.detach\(\)"):
        m(tensor)


# --- load_state_dict: every key checked before any weight changes ------------------

def _module(name):
    torch.manual_seed(0)
    return getattr(torch_impl, name)(*ALL[name][0])


def _new_state(m):
    """Every entry of m's state, changed (so a partial load would show)."""
    return {k: torch.full_like(v, 7.0) for k, v in m.state_dict().items()}


def _snapshot(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def _assert_unchanged(m, before):
    after = m.state_dict()
    assert after.keys() == before.keys()
    for k in before:
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=0, msg=k)


def _spoil(name, how):
    """(module, state dict with one bad entry, the key the error must name)."""
    m = _module(name)
    sd = _new_state(m)
    last = list(sd)[-1] if sd else None
    if how == "unknown":
        sd["W_typo.weight"] = torch.zeros(2, 3)
        return m, sd, "W_typo.weight"
    if how == "missing":
        del sd[last]
        return m, sd, last
    if how == "shape":
        sd[last] = torch.zeros(tuple(sd[last].shape) + (1,))
        return m, sd, last
    sd[last] = "seven"                              # how == "type"
    return m, sd, last


@pytest.mark.parametrize("how, error", [("unknown", ValueError), ("missing", ValueError),
                                        ("shape", ValueError), ("type", TypeError)])
@pytest.mark.parametrize("name", ALL)
def test_a_refused_load_changes_nothing_and_names_the_key(name, how, error):
    if name == "SimplifiedSelfAttention" and how != "unknown":
        pytest.skip("no state to spoil")
    m, sd, key = _spoil(name, how)
    before = _snapshot(m)
    with pytest.raises(error, match=key.replace(".", r"\.")):
        m.load_state_dict(sd)
    _assert_unchanged(m, before)


@pytest.mark.parametrize("name", [n for n in ALL if n != "SimplifiedSelfAttention"])
def test_non_strict_load_skips_unknown_and_missing_keys_but_never_a_wrong_shape(name):
    m, sd, missing = _spoil(name, "missing")
    sd["W_typo.weight"] = torch.zeros(2, 3)
    before = _snapshot(m)
    result = m.load_state_dict(sd, strict=False)
    assert result.missing_keys == [missing] and result.unexpected_keys == ["W_typo.weight"]
    for k, v in m.state_dict().items():
        torch.testing.assert_close(v, before[k] if k == missing else sd[k], rtol=0, atol=0)
    m, sd, key = _spoil(name, "shape")
    before = _snapshot(m)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        m.load_state_dict(sd, strict=False)
    _assert_unchanged(m, before)


@pytest.mark.parametrize("name", ALL)
def test_a_good_load_from_tensors_or_numpy_arrays_loads_everything(name):
    m = _module(name)
    sd = _new_state(m)
    for state in (sd, {k: v.numpy() for k, v in sd.items()}):
        _module_reset = _module(name)
        _module_reset.load_state_dict(state)
        _assert_unchanged(_module_reset, sd)


def test_load_state_dict_refuses_a_non_mapping():
    with pytest.raises(TypeError, match="state_dict"):
        _module("MultiHeadAttention").load_state_dict([("W_query.weight", torch.zeros(4, 3))])


# --- train("False"): refused on both sides, mode unchanged -------------------------

@pytest.mark.parametrize("name", [n for n in ALL if n != "FusedMultiHeadAttention"])
def test_train_with_a_string_is_refused_on_both_sides(name):
    args = ALL[name][0]
    torch_mod = getattr(torch_impl, name)(*args).eval()
    np_mod = getattr(numpy_ref, name)(*args, rng=0).eval()
    with pytest.raises(ValueError, match="boolean"):    # PyTorch's own refusal
        torch_mod.train("False")
    with pytest.raises(TypeError, match="mode must be True or False"):
        np_mod.train("False")
    assert torch_mod.training is False and np_mod.training is False
