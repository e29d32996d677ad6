"""The blockwise ops (numpy_ref.blockwise) held to the chapter's ops composed over the
full (Tq, Tk) matrix, to finite differences, across tile sizes; float32 against a
float64 golden result; rows that see no key; no T x T allocation; and the faults only
a blockwise code can make, each planted and caught."""

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from numpy_ref import blockwise as bw
from numpy_ref import ops
from numpy_ref.blockwise import attention_backward, attention_forward
from parity_tests.common.blockwise_faults import BLOCKWISE_FAULTS
from parity_tests.common.finite_diff import SCALE_FLOOR_FRACTION, eval_numerical_gradient_array
from parity_tests.common.finite_diff import rel_error
from parity_tests.common.tolerances import FINITE_DIFF_BOUND, FLOOR_ULPS, LOW_PRECISION_FACTOR
from parity_tests.common.tolerances import UNIT_ROUNDOFF

TIGHT = 1e-12                      # float64, blockwise vs full matrix (measured ~1e-15)
N = settings.default.max_examples


def chapter_attention(q, k, v, causal, causal_offset, dout):
    """The chapter's ops over the whole (Tq, Tk) matrix -> (out, lse, dq, dk, dv):
    scores, masked_fill, softmax, weighted sum, and their backwards."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    hidden = np.arange(Tk)[None, :] > np.arange(Tq)[:, None] + causal_offset
    hidden &= causal
    scores, scores_cache = ops.scores_forward(q, k)
    masked, mask_cache = ops.causal_mask_forward(scores, hidden)
    with np.errstate(invalid="ignore"):
        weights = ops.softmax(masked)
    out, sum_cache = ops.weighted_sum_forward(weights, v)
    lse = np.logaddexp.reduce(masked, axis=-1)          # log sum exp; -inf for no key
    dweights, dv = ops.weighted_sum_backward(dout, sum_cache)
    dscores = ops.causal_mask_backward(ops.softmax_backward(weights, dweights), mask_cache)
    dq, dk = ops.scores_backward(dscores, scores_cache)
    return out, lse, dq, dk, dv


def blockwise_attention(q, k, v, causal, causal_offset, dout, block_q, block_k):
    kw = dict(causal=causal, causal_offset=causal_offset, block_q=block_q, block_k=block_k)
    out, lse = attention_forward(q, k, v, **kw)
    return (out, lse) + attention_backward(dout, q, k, v, out, lse, **kw)


def draw(rng, lead, Tq, Tk, D, dtype=np.float64):
    q, k, v = (rng.standard_normal(lead + (T, D)).astype(dtype) for T in (Tq, Tk, Tk))
    return q, k, v, rng.standard_normal(lead + (Tq, D)).astype(dtype)


def errors(case, rng=None):
    """{tensor: relative error} of blockwise vs the chapter's ops, float64."""
    lead, Tq, Tk, D, causal, offset, bq, bk = case
    q, k, v, dout = draw(rng or np.random.default_rng(0), lead, Tq, Tk, D)
    ref = chapter_attention(q, k, v, causal, offset, dout)
    got = blockwise_attention(q, k, v, causal, offset, dout, bq, bk)
    return compare(got, ref)


def compare(got, ref):
    """Relative errors; a gradient that is zero in theory (one visible key: the
    softmax is constant) is measured on SCALE_FLOOR_FRACTION of the largest one."""
    floor = SCALE_FLOOR_FRACTION * max(np.max(np.abs(r)) for r in ref[2:])
    return {n: rel_error(g, r, floor if i >= 2 else 0.0)
            for i, (n, g, r) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), got, ref))}


# (leading axes, Tq, Tk, D, causal, causal_offset, B_r, B_c): lengths that break the
# tiles, tiles larger than T, one-row tiles, head dims that are not powers of two
CASES = {
    "full_113x203_D40": ((2,), 113, 203, 40, False, 0, 32, 64),
    "causal_128x217": ((1, 2), 128, 217, 8, True, 217 - 128, 32, 48),
    "causal_square_tiles_7x5": ((3,), 37, 37, 6, True, 0, 7, 5),
    "causal_top_left_Tq_lt_Tk": ((2,), 19, 41, 5, True, 0, 4, 8),
    "causal_tall_tiles": ((2,), 33, 33, 3, True, 0, 16, 3),
    "one_row_tiles": ((2,), 9, 11, 4, True, 2, 1, 1),
    "tiles_larger_than_T": ((2,), 6, 7, 4, True, 1, 64, 64),
    "automatic_tiles": ((2,), 260, 260, 16, True, 0, None, None),
    "single_token": ((1,), 1, 1, 3, True, 0, None, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_blockwise_matches_chapter_ops_float64(name):
    errs = errors(CASES[name])
    assert max(errs.values()) <= TIGHT, f"{name}: {errs}"


def test_tile_sizes_do_not_change_the_result():
    rng = np.random.default_rng(1)
    q, k, v, dout = draw(rng, (2,), 45, 45, 8)
    results = [blockwise_attention(q, k, v, True, 0, dout, bq, bk)
               for bq, bk in [(45, 45), (8, 16), (16, 8), (1, 45), (45, 1), (7, 13)]]
    for other in results[1:]:
        assert max(compare(other, results[0]).values()) <= TIGHT


@pytest.mark.parametrize("causal,offset", [(False, 0), (True, 0), (True, 3), (True, -2)])
def test_finite_differences(causal, offset):
    """The backward against centred differences of the forward (q, k, v and random dout);
    with offset -2 the first two rows see no key: out 0 there, whatever q, k, v."""
    rng = np.random.default_rng(2)
    q, k, v, dout = draw(rng, (2,), 5, 6, 3)
    kw = dict(causal=causal, causal_offset=offset, block_q=2, block_k=4)
    out, lse = attention_forward(q, k, v, **kw)
    grads = attention_backward(dout, q, k, v, out, lse, **kw)
    for name, x, g in zip("qkv", (q, k, v), grads):
        f = lambda: attention_forward(q, k, v, **kw)[0]
        numeric = eval_numerical_gradient_array(f, x, dout)
        assert rel_error(g, numeric) <= FINITE_DIFF_BOUND, name


def test_rows_that_see_no_key_follow_the_contract():
    """Rows with i + causal_offset < 0 see nothing: out 0, lse -inf, dq 0, and no
    share in dk, dv (FlashAttention's and SDPA's rule, the production
    reference's): the other rows' results are the chapter's ops on those rows alone."""
    rng = np.random.default_rng(3)
    q, k, v, dout = draw(rng, (2,), 7, 5, 4)
    got = blockwise_attention(q, k, v, True, -3, dout, 2, 2)
    assert (got[0][:, :3] == 0).all() and np.isneginf(got[1][:, :3]).all()
    assert (got[2][:, :3] == 0).all()
    assert all(np.isfinite(g).all() for i, g in enumerate(got) if i != 1)
    ref = chapter_attention(q[:, 3:], k, v, True, 0, dout[:, 3:])     # rows 3.. see keys 0..
    rows = (slice(None), slice(3, None))
    for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        g = g[rows] if name in ("out", "lse", "dq") else g
        assert np.allclose(g, r, rtol=TIGHT, atol=TIGHT), name


def test_float32_within_the_float32_baseline():
    """float32 blockwise vs the float64 golden result: at most LOW_PRECISION_FACTOR x
    the error of the chapter's ops run in float32, plus the float32 floor."""
    rng = np.random.default_rng(4)
    q, k, v, dout = draw(rng, (2,), 77, 90, 24)
    gold = chapter_attention(q, k, v, True, 13, dout)
    f32 = [a.astype(np.float32) for a in (q, k, v, dout)]
    base = chapter_attention(*f32[:3], True, 13, f32[3])
    got = blockwise_attention(*f32[:3], True, 13, f32[3], 16, 32)
    floor = FLOOR_ULPS["float32"] * UNIT_ROUNDOFF["float32"]
    for name, g, b, r in zip(("out", "lse", "dq", "dk", "dv"), got, base, gold):
        assert g.dtype == np.float32, name
        assert rel_error(g, r) <= LOW_PRECISION_FACTOR * rel_error(b, r) + floor, name


def test_no_t_by_t_allocation():
    """Peak memory of forward + backward stays a small multiple of one (T, D) array."""
    rng = np.random.default_rng(5)
    T, D = 2048, 16
    q, k, v, dout = draw(rng, (1,), T, T, D)
    tracemalloc.start()
    out, lse = attention_forward(q, k, v, causal=True, block_q=64, block_k=128)
    attention_backward(dout, q, k, v, out, lse, causal=True, block_q=64, block_k=128)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 12 * T * D * 8, f"peak {peak} bytes: a T x T array is {T * T * 8}"


@settings(max_examples=max(10, N // 4))
@given(lead=st.sampled_from([(), (1,), (3,), (2, 2)]), Tq=st.integers(1, 40),
       Tk=st.integers(1, 40), D=st.integers(1, 9), causal=st.booleans(),
       offset=st.integers(0, 8), bq=st.integers(1, 48), bk=st.integers(1, 48),
       seed=st.integers(0, 999))
def test_property_any_shape_and_tiles(lead, Tq, Tk, D, causal, offset, bq, bk, seed):
    errs = errors((lead, Tq, Tk, D, causal, offset, bq, bk), np.random.default_rng(seed))
    assert max(errs.values()) <= TIGHT, errs


@pytest.mark.parametrize("bad,match", [
    (dict(q=np.zeros((4, 3), dtype=np.int64)), "q must be a float32 or float64"),
    (dict(k=np.zeros((5, 2))), "k must be"),
    (dict(v=np.zeros((6, 3))), "v must be"),
    (dict(q=np.zeros((4, 3), dtype=np.float32)), "share one dtype"),
    (dict(block_q=0), "block_q must be a positive int"),
    (dict(block_k=2.5), "block_k must be a positive int"),
    (dict(scale=float("nan")), "scale must be"),
    (dict(causal_offset=1.5), "causal_offset must be an int"),
    (dict(causal="yes"), "causal must be True or False"),
])
def test_bad_input_is_refused(bad, match):
    args = dict(q=np.zeros((4, 3)), k=np.zeros((5, 3)), v=np.zeros((5, 3)))
    args.update(bad)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises((ValueError, TypeError), match=match):
        attention_forward(q, k, v, **args)


# -- faults only a blockwise code can make -----------------------------------------

def rising_scores_case():
    """Each key tile scores far above the last (q . k_j grows with j, up to ~2000): a
    maximum kept from the first tile lets exp overflow; the right one never does."""
    rng = np.random.default_rng(6)
    q = np.abs(rng.standard_normal((1, 8, 4))) + 1.0
    k = np.abs(rng.standard_normal((1, 24, 4))) * np.arange(1, 25)[None, :, None] * 40.0
    v, dout = rng.standard_normal((1, 24, 4)), rng.standard_normal((1, 8, 4))
    ref = chapter_attention(q, k, v, False, 0, dout)
    got = blockwise_attention(q, k, v, False, 0, dout, 4, 4)
    if not all(np.isfinite(g).all() for g in got):
        return np.inf
    return max(compare(got, ref).values())


# Scores of ~2000 amplify rounding a thousandfold (measured 8e-11): the
# rising-scores case is held to 1e-9, the others to TIGHT.
RISING_BOUND = 1e-9


BATTERY = ("causal_square_tiles_7x5", "causal_top_left_Tq_lt_Tk", "full_113x203_D40")


def battery():
    """The checks above as one number: the worst ratio of error to bound over a
    few cases and the rising-scores case (inf when anything is not finite)."""
    worst = rising_scores_case() / RISING_BOUND
    for name in BATTERY:
        errs = errors(CASES[name])
        worst = max([worst] + [e / TIGHT if np.isfinite(e) else np.inf for e in errs.values()])
    return worst


def test_the_fault_battery_passes_without_a_fault():
    assert battery() <= 1.0


@pytest.mark.parametrize("fault", list(BLOCKWISE_FAULTS))
def test_planted_blockwise_fault_is_caught(fault, monkeypatch):
    helper, make, _ = BLOCKWISE_FAULTS[fault]
    monkeypatch.setattr(bw, helper, make(getattr(bw, helper)))
    with np.errstate(all="ignore"):
        try:
            worst = battery()
        except (ValueError, IndexError):                        # a crash is caught too
            worst = np.inf
    assert worst > 1e6, f"{fault} went unnoticed (worst error / bound {worst})"
