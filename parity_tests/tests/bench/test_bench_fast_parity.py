"""numpy_ref.fast.FastMultiHeadAttention against numpy_ref.MultiHeadAttention, the
PyTorch modules and finite differences: the speed-up changes no number that matters."""

import numpy as np
import pytest
import torch

import numpy_ref as nr
import numpy_ref.ops as ops
import torch_impl
from numpy_ref.fast import FastMultiHeadAttention
from parity_tests.common import faults
from parity_tests.common import tolerances as tol
from parity_tests.common.finite_diff import gradient_errors
from parity_tests.matrix.harness import relative_error, tensor_scales

D_IN, D_OUT, CONTEXT, HEADS, P = 6, 8, 16, 2, 0.25


def make_pair(block_size, qkv_bias=True, training=False, seed=0):
    ref = nr.MultiHeadAttention(D_IN, D_OUT, CONTEXT, P, HEADS, qkv_bias=qkv_bias, rng=seed)
    fast = FastMultiHeadAttention(D_IN, D_OUT, CONTEXT, P, HEADS, qkv_bias=qkv_bias, rng=seed)
    fast.block_size = block_size
    fast.load_state_dict(ref.state_dict())
    ref.train(training)
    fast.train(training)
    return ref, fast


def inputs(num_tokens, dtype=np.float64, batch=2, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, num_tokens, D_IN)).astype(dtype)
    dout = rng.normal(size=(batch, num_tokens, D_OUT)).astype(dtype)
    keep_mask = rng.random((batch, HEADS, num_tokens, num_tokens)) >= P
    return x, dout, keep_mask


def run(module, x, dout, keep_mask=None):
    """output, input gradient and every parameter gradient, by name."""
    out = {"output": module.forward(x, keep_mask=keep_mask)}
    out["input"] = module.backward(dout)
    out.update(module.grads)
    return out


def assert_close(tested, ref, bound):
    assert list(tested) == list(ref), "tensor names or order differ"
    scales = tensor_scales(ref)
    for name in ref:
        error, where = relative_error(tested[name], ref[name], scales[name])
        assert error <= bound, f"{name}: error {error:.2e} > {bound:.0e} at {where}"


# T below, at and across block boundaries; the last block ragged or full.
@pytest.mark.parametrize("num_tokens, block_size", [(1, 4), (3, 4), (8, 4), (13, 4), (13, 5), (16, 1)])
@pytest.mark.parametrize("training", [False, True])
def test_matches_the_reference_in_float64(num_tokens, block_size, training):
    ref, fast = make_pair(block_size, training=training)
    x, dout, keep_mask = inputs(num_tokens)
    assert_close(run(fast, x, dout, keep_mask), run(ref, x, dout, keep_mask), tol.float64_bound())


@pytest.mark.parametrize("torch_cls", [torch_impl.MultiHeadAttention,
                                       torch_impl.FusedMultiHeadAttention])
def test_matches_pytorch_in_float64(torch_cls):
    torch.manual_seed(0)
    tm = torch_cls(D_IN, D_OUT, CONTEXT, 0.0, HEADS, qkv_bias=True).double().eval()
    fast = FastMultiHeadAttention(D_IN, D_OUT, CONTEXT, 0.0, HEADS, qkv_bias=True, rng=0)
    fast.block_size = 4
    fast.load_state_dict(tm.state_dict())
    fast.eval()
    x, dout, _ = inputs(11)
    x_t = torch.from_numpy(x).requires_grad_(True)
    out_t = tm(x_t)
    out_t.backward(torch.from_numpy(dout))
    expected = {"output": out_t.detach().numpy(), "input": x_t.grad.numpy()}
    expected.update({n: p.grad.numpy() for n, p in tm.named_parameters()})
    assert_close(run(fast, x, dout), expected, tol.float64_bound())


def test_float32_is_as_accurate_as_the_reference():
    # Golden: the reference in float64 on the same float32 numbers.  The fast path's
    # float32 error may be at most what the tolerances allow the reference's own.
    ref, fast = make_pair(block_size=4)
    x, dout, _ = inputs(13, dtype=np.float32)
    golden = run(ref, x.astype(np.float64), dout.astype(np.float64))
    scales = tensor_scales(golden)
    ref32, fast32 = run(ref, x, dout), run(fast, x, dout)
    for name in golden:
        assert fast32[name].dtype == np.float32, name
        baseline, _ = relative_error(ref32[name], golden[name], scales[name])
        error, where = relative_error(fast32[name], golden[name], scales[name])
        bound = tol.low_precision_bound("float32", baseline)
        assert error <= bound, f"{name}: error {error:.2e} > {bound:.2e} at {where}"


def test_gradients_match_finite_differences():
    _, fast = make_pair(block_size=3, training=True)
    x, dout, keep_mask = inputs(7)
    errors = gradient_errors(fast, x, dout, keep_mask)
    assert max(errors.values()) <= tol.FINITE_DIFF_BOUND, errors


def test_dropout_draws_the_reference_keep_mask():
    # Without a given keep_mask both draw from the same seeded rng in the same order.
    ref, fast = make_pair(block_size=4, training=True, seed=3)
    x, dout, _ = inputs(10)
    assert_close(run(fast, x, dout), run(ref, x, dout), tol.float64_bound())


def test_other_mask_buffers_take_the_full_path():
    # Blocks skip only what the chapter's causal mask hides; any other buffer is honoured.
    ref, fast = make_pair(block_size=4)
    state = ref.state_dict()
    state["mask"] = np.zeros_like(state["mask"])          # nothing hidden
    ref.load_state_dict(state)
    fast.load_state_dict(state)
    x, dout, _ = inputs(9)
    got, expected = run(fast, x, dout), run(ref, x, dout)
    assert_close(got, expected, tol.float64_bound())
    causal = run(make_pair(block_size=4)[1], x, dout)
    assert np.max(np.abs(got["output"] - causal["output"])) > 1e-3  # it did change something


# The faults of numpy_ref.ops (the blockwise ones replace helpers FastMultiHeadAttention never calls).
NUMPY_FAULTS = [name for name, f in faults.FAULTS.items()
                if f.side == "numpy" and f.target is ops]


@pytest.mark.parametrize("fault", NUMPY_FAULTS)
def test_planted_faults_reach_the_fast_path(fault):
    # The blocks run the ops of numpy_ref.ops, so every planted NumPy fault must bite:
    # change some tensor, or fail outright (a block's (q, k) weights are not square,
    # so a forgotten transpose no longer fits).
    _, fast = make_pair(block_size=3, training=True)
    x, dout, keep_mask = inputs(7)
    sound = run(fast, x, dout, keep_mask)
    with faults.plant(fault):
        try:
            broken = run(fast, x, dout, keep_mask)
        except ValueError as error:
            assert "mismatch" in str(error), error
            return
    scales = tensor_scales(sound)
    worst = max(relative_error(broken[n], sound[n], scales[n])[0] for n in sound)
    assert worst > 1e-3, f"{fault} left the fast path unchanged (worst error {worst:.1e})"


def test_the_causal_mask_takes_the_blocked_path():
    """Same numbers are not enough: a fallback to the full (T, T) computation gives
    them too.  The blocks must be there, one per block_size queries."""
    _, fast = make_pair(block_size=4)
    x, dout, _ = inputs(13)
    fast.forward(x)
    spans = [block["span"] for block in fast._cache.get("blocks", [])]
    assert spans == [(0, 4), (4, 8), (8, 12), (12, 13)], "the blocked path was not taken"
    fast.backward(dout)


def test_the_blocked_path_keeps_about_half_the_memory():
    """Peak traced memory of forward + backward at T = 128, blocks of 16: the blocks
    keep (T^2 + T * 16) / 2 weights instead of T^2 (measured ratio 0.51; a fallback
    to the full computation measures 1.00)."""
    import tracemalloc

    def peak(module, x, dout):
        tracemalloc.start()
        try:
            module.forward(x)
            module.backward(dout)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    num_tokens = 128
    ref = nr.MultiHeadAttention(8, 8, num_tokens, 0.0, 2, rng=0).eval()
    fast = FastMultiHeadAttention(8, 8, num_tokens, 0.0, 2, rng=0).eval()
    fast.block_size = 16
    rng = np.random.default_rng(0)
    x, dout = rng.normal(size=(1, num_tokens, 8)), rng.normal(size=(1, num_tokens, 8))
    ratio = peak(fast, x, dout) / peak(ref, x, dout)
    assert ratio < 0.7, f"FastMultiHeadAttention peaks at {ratio:.2f} x the full computation"
