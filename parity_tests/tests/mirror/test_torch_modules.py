"""torch_impl's modules beyond the chapter's printouts: weights that move between
classes, the fused kernel against the spelled-out attention, devices and dtypes."""

import pytest
import torch

from parity_tests.common import chapter_values as cv
from parity_tests.common.tolerances import FLOAT64_BOUND
from torch_impl import (
    CausalAttention,
    FusedMultiHeadAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
    SimplifiedSelfAttention,
)

# float64, same operations in a different order: agreement to rounding error.
FLOAT64_RTOL = FLOAT64_ATOL = FLOAT64_BOUND

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# One small instance of every module, with an input of the rank it takes.
MODULES = {
    "SimplifiedSelfAttention": (lambda: SimplifiedSelfAttention(), (6, 3)),
    "SelfAttention_v1": (lambda: SelfAttention_v1(3, 2), (6, 3)),
    "SelfAttention_v2": (lambda: SelfAttention_v2(3, 2, qkv_bias=True), (6, 3)),
    "CausalAttention": (lambda: CausalAttention(3, 2, 6, 0.1), (2, 5, 3)),
    "MultiHeadAttentionWrapper": (lambda: MultiHeadAttentionWrapper(3, 2, 6, 0.1, 2), (2, 5, 3)),
    "MultiHeadAttention": (lambda: MultiHeadAttention(3, 4, 6, 0.1, 2), (2, 5, 3)),
    "FusedMultiHeadAttention": (lambda: FusedMultiHeadAttention(3, 4, 6, 0.1, 2), (2, 5, 3)),
}


def forward_backward(module, x):
    """Output, and gradients of ``<out, g>`` for a random upstream ``g`` (never out.sum():
    softmax rows sum to 1, so that gradient is ~0 and would check almost nothing)."""
    x = x.detach().clone().requires_grad_(True)
    out = module(x)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out)
    out.backward(grad_out)
    grads = {"input": x.grad}
    grads.update({name: p.grad for name, p in module.named_parameters()})
    return out.detach(), grads


# --- Exercise 3.1 ---------------------------------------------------------------------

def test_exercise_3_1_v2_weights_in_v1_give_v1_the_same_outputs():
    inputs = torch.tensor(cv.INPUTS)
    torch.manual_seed(cv.SEED_V2)
    sa_v2 = SelfAttention_v2(cv.D_IN, cv.D_OUT)
    sa_v1 = SelfAttention_v1(cv.D_IN, cv.D_OUT)
    # nn.Linear stores W as (d_out, d_in): v1's (d_in, d_out) matrix is its transpose
    sd = sa_v2.state_dict()
    sa_v1.load_state_dict({name: sd[f"{name}.weight"].T for name in ("W_query", "W_key", "W_value")})
    assert not torch.allclose(sa_v1(inputs), torch.zeros(6, 2))
    torch.testing.assert_close(sa_v1(inputs), sa_v2(inputs))


# --- The fused kernel against the spelled-out attention ---------------------------------

# (batch, num_tokens, d_in, d_out, num_heads, context_length, qkv_bias)
FUSED_CASES = [
    (2, 6, 3, 4, 2, 6, False),     # the chapter's shapes, every position used
    (3, 5, 8, 12, 3, 9, True),     # fewer tokens than context_length, with biases
    (1, 1, 4, 4, 2, 4, False),     # one token: attends only to itself
    (2, 7, 6, 6, 1, 7, False),     # a single head
]


def _twins(d_in, d_out, num_heads, context_length, qkv_bias, dropout=0.0):
    torch.manual_seed(0)
    mha = MultiHeadAttention(d_in, d_out, context_length, dropout, num_heads, qkv_bias).double()
    fused = FusedMultiHeadAttention(d_in, d_out, context_length, dropout, num_heads, qkv_bias).double()
    fused.load_state_dict(mha.state_dict())
    return mha, fused


@pytest.mark.parametrize("b, T, d_in, d_out, H, ctx, bias", FUSED_CASES)
def test_fused_matches_multi_head_attention_outputs_and_every_gradient(b, T, d_in, d_out, H, ctx, bias):
    mha, fused = _twins(d_in, d_out, H, ctx, bias)
    x = torch.randn(b, T, d_in, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out, grads = forward_backward(mha, x)
    fused_out, fused_grads = forward_backward(fused, x)
    torch.testing.assert_close(fused_out, out, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)
    assert fused_grads.keys() == grads.keys()
    for name, grad in grads.items():
        # one token: its single attention weight is 1 whatever the scores, so the
        # query and key weights get exactly no gradient; everything else must get some
        scores_only = T == 1 and name.startswith(("W_query", "W_key"))
        assert (grad.abs().max() == 0) == scores_only, f"{name}: unexpected gradient {grad}"
        torch.testing.assert_close(fused_grads[name], grad, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL,
                                   msg=lambda m: f"gradient of {name}\n{m}")


def test_fused_matches_in_eval_mode_despite_dropout():
    mha, fused = _twins(3, 4, 2, 6, False, dropout=0.5)
    mha.eval(), fused.eval()
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    torch.testing.assert_close(fused(x), mha(x), rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)


def test_fused_applies_dropout_only_in_training_mode():
    _, fused = _twins(3, 4, 2, 6, False, dropout=0.5)
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    fused.train()
    assert not torch.allclose(fused(x), fused(x)), "training mode with p=0.5 drew no dropout"
    fused.eval()
    assert torch.equal(fused(x), fused(x))


def test_state_dict_loads_across_fused_and_multi_head_both_ways():
    torch.manual_seed(1)
    mha = MultiHeadAttention(3, 4, 6, 0.0, 2, qkv_bias=True)
    fused = FusedMultiHeadAttention(3, 4, 6, 0.0, 2, qkv_bias=True)
    assert list(fused.state_dict()) == list(mha.state_dict())
    assert "mask" in mha.state_dict()
    x = torch.randn(2, 6, 3)
    fused.load_state_dict(mha.state_dict(), strict=True)
    torch.testing.assert_close(fused(x), mha(x))
    torch.manual_seed(2)
    other = FusedMultiHeadAttention(3, 4, 6, 0.0, 2, qkv_bias=True)
    mha.load_state_dict(other.state_dict(), strict=True)
    torch.testing.assert_close(mha(x), other(x))


# --- Size -------------------------------------------------------------------------------

def test_gpt2_sized_multi_head_attention_parameter_count():
    mha = MultiHeadAttention(d_in=768, d_out=768, context_length=1024, dropout=0.0, num_heads=12)
    count = sum(p.numel() for p in mha.parameters())
    # W_query, W_key, W_value, out_proj weights (768 x 768 each) + out_proj bias
    assert count == 4 * 768 * 768 + 768 == 2_360_064
    assert "mask" not in dict(mha.named_parameters()), "the mask is a buffer, not a parameter"


# --- Devices and dtypes ---------------------------------------------------------------

@pytest.mark.parametrize("name", MODULES)
def test_forward_creates_no_tensor_off_the_module_device(name):
    """On the 'meta' device any tensor made on the CPU inside forward would refuse to mix."""
    make, shape = MODULES[name]
    module = make().to("meta")
    assert all(t.device.type == "meta" for t in module.state_dict().values())
    out = module(torch.empty(shape, device="meta"))
    assert out.device.type == "meta"


@pytest.mark.parametrize("name", MODULES)
def test_bfloat16_runs_forward_and_backward_on_cpu(name):
    make, shape = MODULES[name]
    torch.manual_seed(0)
    module = make().to(torch.bfloat16)
    out, grads = forward_backward(module, torch.rand(shape, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    for grad_name, grad in grads.items():
        assert grad.dtype == torch.bfloat16 and torch.isfinite(grad).all(), grad_name


@cuda
@needs_cuda
@pytest.mark.parametrize("name", MODULES)
def test_to_cuda_carries_the_mask_and_the_forward_runs_there(name):
    make, shape = MODULES[name]
    module = make().to("cuda")
    for key, tensor in module.state_dict().items():
        assert tensor.device.type == "cuda", f"{key} stayed on {tensor.device}"
    out = module(torch.rand(shape, device="cuda"))
    assert out.device.type == "cuda"


@cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", MODULES)
def test_low_precision_forward_and_backward_on_cuda(name, dtype):
    make, shape = MODULES[name]
    torch.manual_seed(0)
    module = make().to("cuda", dtype)
    out, grads = forward_backward(module, torch.rand(shape, device="cuda", dtype=dtype))
    assert out.dtype == dtype and torch.isfinite(out).all()
    for grad_name, grad in grads.items():
        assert grad.dtype == dtype and torch.isfinite(grad).all(), grad_name


@cuda
@needs_cuda
def test_fused_matches_multi_head_attention_on_cuda_in_float64():
    mha, fused = _twins(8, 12, 3, 9, True)
    mha, fused = mha.to("cuda"), fused.to("cuda")
    x = torch.randn(3, 5, 8, dtype=torch.float64, device="cuda")
    out, grads = forward_backward(mha, x)
    fused_out, fused_grads = forward_backward(fused, x)
    torch.testing.assert_close(fused_out, out, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL,
                                   msg=lambda m: f"gradient of {name}\n{m}")
