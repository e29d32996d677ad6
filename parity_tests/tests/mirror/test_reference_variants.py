"""numpy_ref.reference_attention against PyTorch: a dense float64 computation
differentiated by autograd on a random grid that mixes every variant (≤ 1e-12 on
every tensor), PyTorch's SDPA (``attn_mask``, ``enable_gqa``) and FlexAttention
(``score_mod``, ``mask_mod``) where they express the variant, and float32 within
the suite's derived bound."""

import numpy as np
import pytest

from numpy_ref import reference_attention
from parity_tests.common import tolerances as tol
from parity_tests.matrix import variants_dense as dense
from parity_tests.matrix.variants import compare, random_case
from needs import needs


def assert_close(got, ref, bound, label):
    errors = compare(got, ref)
    assert set(ref) <= set(got), (label, sorted(got), sorted(ref))
    assert max(errors.values()) <= bound, (label, errors)


@pytest.mark.parametrize("seed", range(40))
def test_dense_autograd_agrees_on_a_grid_mixing_the_variants(seed):
    q, k, v, dout, options, tiles = random_case(seed)
    got = reference_attention(q, k, v, dout, **options, **tiles)
    ref = dense.dense_attention(q, k, v, dout, **options)
    assert set(got) == set(ref)
    assert_close(got, ref, tol.VARIANTS_FLOAT64_BOUND, options)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(40, 1040))
def test_dense_autograd_agrees_on_a_thousand_more_cases(seed):
    test_dense_autograd_agrees_on_a_grid_mixing_the_variants(seed)


def _no_sdpa_variant(options):
    return {n: x for n, x in options.items() if n not in ("softcap", "sinks")}


@pytest.mark.parametrize("seed", range(12))
def test_sdpa_with_attn_mask_and_enable_gqa_agrees(seed):
    q, k, v, dout, options, _ = random_case(seed)
    options = _no_sdpa_variant(options)
    got = reference_attention(q, k, v, dout, **options)
    ref = dense.sdpa_attention(q, k, v, dout, **options)
    assert_close(got, ref, tol.VARIANTS_FLOAT64_BOUND, options)


@needs("flex_attention", "flex_any_head_dim")
@pytest.mark.parametrize("seed", range(12))
def test_flex_attention_forward_agrees(seed):
    q, k, v, _, options, _ = random_case(seed)
    options.pop("sinks", None)
    got = reference_attention(q, k, v, **options)
    ref = dense.flex_attention(q, k, v, **options)
    assert_close(got, ref, tol.VARIANTS_FLOAT64_BOUND, options)


def _float32_errors(seed):
    """(reference_attention's float32 error, dense PyTorch float32's error), each
    against the float64 reference run on the same rounded numbers."""
    q, k, v, dout, options, tiles = random_case(seed)
    rounded = [a.astype(np.float32) for a in (q, k, v, dout)]
    o32 = {n: (x.astype(np.float32) if isinstance(x, np.ndarray) and x.dtype.kind == "f" else x)
           for n, x in options.items()}
    golden = reference_attention(*[a.astype(np.float64) for a in rounded],
                                 **{n: (x.astype(np.float64) if isinstance(x, np.ndarray)
                                        and x.dtype.kind == "f" else x) for n, x in o32.items()})
    ours = reference_attention(*rounded, **o32, **tiles)
    plain = dense.dense_attention(*rounded, **o32)
    return compare(ours, golden), compare(plain, golden)


@pytest.mark.parametrize("seed", range(8))
def test_float32_stays_within_the_derived_bound(seed):
    ours, plain = _float32_errors(seed)
    for name, error in ours.items():
        bound = tol.low_precision_bound("float32", plain[name])
        assert error <= bound, (name, error, bound)
