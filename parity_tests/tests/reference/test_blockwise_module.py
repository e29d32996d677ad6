"""BlockwiseMultiHeadAttention held to MultiHeadAttention at float64 tightness (output,
dx, every weight gradient; eval and training with the equivalent keep-mask), to
finite differences; its state_dict without a held mask; its own copies of x and the
parameters; its tile-seeded dropout; and the blockwise faults caught at module level."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import numpy_ref as nr
from numpy_ref import blockwise as bw
from parity_tests.common.blockwise_faults import BLOCKWISE_FAULTS
from parity_tests.common.finite_diff import SCALE_FLOOR_FRACTION, gradient_errors, rel_error
from parity_tests.common.tolerances import FINITE_DIFF_BOUND, FLOOR_ULPS, LOW_PRECISION_FACTOR
from parity_tests.common.tolerances import UNIT_ROUNDOFF

TIGHT = 1e-12
N = settings.default.max_examples
def pair(d_in=6, d_out=8, ctx=24, dropout=0.0, heads=2, bias=True, tiles=(3, 4), seed=0):
    """(blockwise, reference) with the same weights, float64."""
    ref = nr.MultiHeadAttention(d_in, d_out, ctx, dropout, heads, bias, rng=seed)
    ref.load_state_dict({k: v.astype(np.float64) for k, v in ref.state_dict().items()})
    m = nr.BlockwiseMultiHeadAttention(d_in, d_out, ctx, dropout, heads, bias, rng=seed + 1)
    m.load_state_dict(ref.state_dict())
    m.block_q, m.block_k = tiles
    return m, ref


def run(m, x, dout, keep_mask=None):
    out = m.forward(x) if keep_mask is None else m.forward(x, keep_mask)
    dx = m.backward(dout)
    return {"output": out, "input": dx, **m.grads}


def module_errors(m, ref, x, dout, keep_mask=None):
    got = run(m, x, dout, keep_mask)
    want = run(ref, x, dout, keep_mask)
    assert list(got) == list(want)
    floor = SCALE_FLOOR_FRACTION * max(np.max(np.abs(w)) for w in want.values())
    return {n: rel_error(got[n], want[n], floor) for n in want}


def inputs(shape, d_out, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape), rng.standard_normal(shape[:2] + (d_out,))


@pytest.mark.parametrize("tiles", [(3, 4), (4, 3), (1, 1), (32, 32), (None, None)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_multihead_attention_eval(tiles, bias):
    m, ref = pair(bias=bias, tiles=tiles)
    x, dout = inputs((2, 13, 6), 8)
    errs = module_errors(m.eval(), ref.eval(), x, dout)
    assert max(errs.values()) <= TIGHT, errs


def test_matches_multihead_attention_training_with_its_keep_mask():
    m, ref = pair(dropout=0.4, tiles=(4, 3))
    x, dout = inputs((2, 11, 6), 8)
    out = m.forward(x)
    keep_mask = m.last_keep_mask()                           # (B, H, T, T)
    assert keep_mask.shape == (2, 2, 11, 11) and not keep_mask[..., np.tril_indices(11)[0], np.tril_indices(11)[1]].all()
    dx = m.backward(dout)
    want = run(ref, x, dout, keep_mask)
    assert rel_error(out, want["output"]) <= TIGHT
    assert rel_error(dx, want["input"]) <= TIGHT
    for name, g in m.grads.items():
        assert rel_error(g, want[name], 1e-3 * np.abs(dx).max()) <= TIGHT, name


def test_matches_multihead_attention_given_keep_mask():
    m, ref = pair(dropout=0.3, tiles=(2, 5))
    x, dout = inputs((2, 9, 6), 8)
    keep_mask = np.random.default_rng(1).random((2, 2, 9, 9)) >= 0.3
    errs = module_errors(m, ref, x, dout, keep_mask)
    assert max(errs.values()) <= TIGHT, errs


def test_dropout_draws_fresh_tiles_each_forward():
    """Fresh masks each forward, keeping about 1 - p; that the backward draws the
    same tiles again is shown by the gradients matching MultiHeadAttention's with
    last_keep_mask() (test above)."""
    m, _ = pair(dropout=0.5, tiles=(4, 4))
    x, _ = inputs((1, 16, 6), 8)
    m.forward(x)
    first = m.last_keep_mask()
    m.forward(x)
    second = m.last_keep_mask()
    lower = np.tril_indices(16)
    assert not np.array_equal(first[..., lower[0], lower[1]], second[..., lower[0], lower[1]])
    kept = second[..., lower[0], lower[1]].mean()
    assert 0.35 < kept < 0.65


@pytest.mark.parametrize("dropout,keep", [(0.0, False), (0.5, True)])
def test_finite_differences(dropout, keep):
    m, _ = pair(d_in=3, d_out=4, ctx=7, dropout=dropout, heads=2, tiles=(2, 3))
    x, dout = inputs((2, 7, 3), 4, seed=3)
    keep_mask = np.random.default_rng(4).random((2, 2, 7, 7)) >= 0.5 if keep else None
    if not keep:
        m.eval()
    errors = gradient_errors(m, x, dout, keep_mask)
    assert max(errors.values()) <= FINITE_DIFF_BOUND, errors


def test_float32_within_the_float32_baseline():
    m, ref = pair(d_in=16, d_out=24, ctx=64, heads=3, tiles=(8, 16))
    x, dout = inputs((2, 50, 16), 24, seed=5)
    gold = run(ref.eval(), x, dout)
    ref32 = nr.MultiHeadAttention(16, 24, 64, 0.0, 3, True).eval()
    ref32.load_state_dict({k: v.astype(np.float32) for k, v in ref.state_dict().items()})
    m.load_state_dict(ref32.state_dict())
    x32, dout32 = x.astype(np.float32), dout.astype(np.float32)
    base, got = run(ref32, x32, dout32), run(m.eval(), x32, dout32)
    floor = FLOOR_ULPS["float32"] * UNIT_ROUNDOFF["float32"]
    for name in gold:
        assert got[name].dtype == np.float32, name
        scale = SCALE_FLOOR_FRACTION * np.abs(gold["input"]).max()
        bound = LOW_PRECISION_FACTOR * rel_error(base[name], gold[name], scale) + floor
        assert rel_error(got[name], gold[name], scale) <= bound, name


def test_threads_give_the_same_numbers():
    m, _ = pair(tiles=(4, 4))
    x, dout = inputs((2, 13, 6), 8)
    m.num_workers = 1
    one = run(m.eval(), x, dout)
    m.num_workers = 2
    two = run(m, x, dout)
    assert all(np.array_equal(one[n], two[n]) for n in one)


def test_state_dict_without_holding_the_mask():
    m, ref = pair()
    sd, want = m.state_dict(), ref.state_dict()
    assert list(sd) == list(want)
    assert all(sd[k].shape == want[k].shape and np.array_equal(sd[k], want[k]) for k in sd)
    assert m._buffers == {}                                 # built on demand only
    ref.load_state_dict(sd)                                 # and back, both ways


def test_load_state_dict_refuses_another_mask_and_changes_nothing():
    m, ref = pair()
    before = m.state_dict()
    sd = {k: v + 1.0 for k, v in ref.state_dict().items()}
    sd["mask"] = np.zeros_like(sd["mask"])                  # attend everywhere: not causal
    with pytest.raises(ValueError, match="causal mask"):
        m.load_state_dict(sd)
    del sd["mask"]
    with pytest.raises(ValueError, match="missing key.*mask"):
        m.load_state_dict(sd)
    assert all(np.array_equal(before[k], v) for k, v in m.state_dict().items())


def test_immune_to_in_place_changes_between_forward_and_backward():
    m, _ = pair(tiles=(4, 4))
    x, dout = inputs((2, 10, 6), 8)
    want = run(m.eval(), x, dout)
    m.forward(x)
    x *= 3.0
    for _, p in m.named_parameters():
        p += 1.0
    dx = m.backward(dout)
    assert np.array_equal(dx, want["input"])
    assert all(np.array_equal(m.grads[n], want[n]) for n in m.grads)


def test_backward_misuse_is_refused_and_backward_repeats():
    m, _ = pair(dropout=0.5)
    x, dout = inputs((1, 5, 6), 8)
    with pytest.raises(ValueError, match="before forward"):
        m.backward(dout)
    m.forward(x)
    first = m.backward(dout), dict(m.grads)
    second = m.backward(dout), dict(m.grads)
    assert np.array_equal(first[0], second[0])
    assert all(np.array_equal(first[1][n], second[1][n]) for n in first[1])
    with pytest.raises(ValueError, match="context_length"):
        m.forward(np.zeros((1, 25, 6)))
    keep_mask = np.ones((1, 2, 5, 5), dtype=bool)
    m.forward(x, keep_mask)
    keep_mask[0, 0, 0, 0] = False
    with pytest.raises(ValueError, match="keep_mask was changed"):
        m.backward(dout)


def test_dropout_one_drops_every_weight():
    m, ref = pair(dropout=1.0)
    x, dout = inputs((2, 6, 6), 8)
    errs = module_errors(m, ref, x, dout)
    assert max(errs.values()) <= TIGHT, errs


@settings(max_examples=max(10, N // 5))
@given(T=st.integers(1, 20), heads=st.integers(1, 3), D=st.integers(1, 4),
       batch=st.integers(1, 2), bq=st.integers(1, 24), bk=st.integers(1, 24),
       bias=st.booleans(), seed=st.integers(0, 999))
def test_property_any_shape_heads_and_tiles(T, heads, D, batch, bq, bk, bias, seed):
    m, ref = pair(d_in=3, d_out=heads * D, ctx=20, heads=heads, bias=bias, tiles=(bq, bk),
                  seed=seed)
    x, dout = inputs((batch, T, 3), heads * D, seed)
    errs = module_errors(m.eval(), ref.eval(), x, dout)
    assert max(errs.values()) <= TIGHT, errs


@pytest.mark.parametrize("fault", list(BLOCKWISE_FAULTS))
def test_planted_blockwise_fault_fails_the_module_checks(fault, monkeypatch):
    """Each blockwise fault makes the module differ from MultiHeadAttention; inputs
    of scale 100 give scores that rise by thousands across key tiles, which a
    running maximum that is not updated needs before it overflows."""
    helper, make, _ = BLOCKWISE_FAULTS[fault]
    m, ref = pair(tiles=(4, 4))
    x, dout = inputs((2, 13, 6), 8)
    x *= 100.0 if fault == "blockwise-max-not-updated" else 1.0
    assert max(module_errors(m.eval(), ref.eval(), x, dout).values()) <= 1e-9
    monkeypatch.setattr(bw, helper, make(getattr(bw, helper)))
    with np.errstate(all="ignore"):
        errs = module_errors(m, ref, x, dout)
    worst = max(e if np.isfinite(e) else np.inf for e in errs.values())
    assert worst > 1e-3, f"{fault} went unnoticed: {errs}"


def test_one_dtype_rule_for_the_module_and_the_functions():
    """float16 is refused by both (the tiles' running sums would accumulate in
    float16), naming the argument; float32 and float64 work in both."""
    m = nr.BlockwiseMultiHeadAttention(4, 4, 8, 0.0, 2, rng=0)
    x = np.zeros((1, 3, 4), dtype=np.float16)
    with pytest.raises(TypeError, match="x must be a float32 or float64"):
        m.forward(x)
    q = np.zeros((3, 2), dtype=np.float16)
    with pytest.raises(TypeError, match="q must be a float32 or float64"):
        bw.attention_forward(q, q, q)
    for dtype in (np.float32, np.float64):
        assert m.forward(x.astype(dtype)).dtype == dtype
        assert bw.attention_forward(*[q.astype(dtype)] * 3)[0].dtype == dtype


@pytest.mark.parametrize("scale", ["a", [1.0], None.__class__, True])
def test_a_scale_that_is_not_a_number_is_refused_naming_it(scale):
    q = np.zeros((3, 2))
    with pytest.raises(TypeError, match="scale must be a real number or None"):
        bw.attention_forward(q, q, q, scale=scale)
