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
