"""FP8 attention (``--features fp8``, FlashAttention-3's convention, and ``fp8_kv``): right
kernels written from the convention alone pass; each catalogued FP8 mistake FAILS on the case
that shows it and is named; the quantisation's own error is reported beside the verdict; the
declarations FP8 needs (its dtypes, its baseline, its inputs in float8) are what the runner asks."""

import math

import numpy as np

import pytest
import torch

import parity_tests
from parity_tests.kernels import dense, run, runner, targets
from parity_tests.kernels.cases import Case
from parity_tests.kernels.diagnosis import mistakes
from parity_tests.kernels.features import REGISTRY, Plan, fp8
from parity_tests.kernels.planted import fp8 as fp8_gallery
from parity_tests.common import capabilities
from needs import needs_dtype
from sampled import one_in

# the KV form's dtypes where this PyTorch multiplies in each on the CPU (float16: 2.2 and later)
KV_DTYPES = [d for d in ("bfloat16", "float16") if not capabilities.dtype_lacks(d, "cpu")]


def own_case(feature, label, causal=True):
    """The feature's own case whose name ends in ``label``."""
    return next(c for c in REGISTRY[feature].cases(causal, Plan()) if str(c).endswith(label))


def run_cases(fn, features, cases, dtypes=None, seed=0):
    plan = run._plan(fn, "cpu", dtypes, None, None, None, None, "both", "top-left", "bhtd", False, features, seed)
    return run._run(plan._replace(grid=cases, classes=[]), "top-left", seed, False)


@pytest.mark.slow                     # every case: 3 s (the FP8 KV twin stays)
def test_a_right_fp8_kernel_passes_every_case_with_gqa():
    """FlashAttention-3's own formulation (the others, and 20 seeds: ``-m slow``)."""
    report = parity_tests.check(fp8_gallery.fa3, features=["fp8", "gqa"], causal="yes")
    assert report.passed, str(report)
    rows = report.rows
    assert {r.dtype for r in rows} == {"bfloat16"} and {r.tensor for r in rows} == {"out"}
    assert any("H8/4" in r.case and "fp8 wide" in r.case for r in rows)        # GQA's slices 2^6 apart
    # the quantisation's own error beside the verdict: real, and never the verdict's
    assert all(r.inputs_error is not None and "quantisation alone" in r.note for r in rows)
    assert max(r.inputs_error for r in rows) > max(r.error for r in rows)


def test_an_fp8_cache_reports_its_quantisation_beside_the_verdict():
    """The KV cache alone in FP8 (one case, the default run): the error its quantisation makes
    on its own is on the row, beside (and larger than) the right kernel's."""
    case = min(REGISTRY["fp8_kv"].cases(True, Plan()), key=lambda c: c.tq * c.tk)
    report = run_cases(fp8_gallery.RIGHT_KV["fa3"], ["fp8_kv"], [case], dtypes=["bfloat16"])
    assert report.passed and [r.tensor for r in report.rows] == ["out"], str(report)
    row = report.rows[0]
    assert row.inputs_error is not None and row.inputs_error > row.error and "quantisation alone" in row.note


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=needs_dtype("float16"))])
def test_a_right_fp8_kv_kernel_passes_with_flashinfers_head_dims(dtype):
    report = parity_tests.check(fp8_gallery.RIGHT_KV["fa3"], features=["fp8_kv", "value_dim"], dtypes=[dtype],
                                causal="no")
    assert report.passed, str(report)
    assert any("D192/128" in r.case for r in report.rows)            # FlashInfer's FP8-KV head dims
    plan = run._plan(fp8_gallery.RIGHT_KV["fa3"], "cpu", None, None, None, None, None, "yes", "top-left", "bhtd",
                     False, ["fp8_kv"])
    assert plan.dtypes == ["bfloat16"]                               # the CPU's default dtypes, FP8's kept


FP8_SHOWN_ON = {"fp8-q-descale-missing": "fp8", "fp8-k-descale-missing": "fp8", "fp8-v-descale-missing": "fp8",
                "fp8-q-descale-twice": "fp8", "fp8-k-descale-twice": "fp8", "fp8-v-descale-twice": "fp8",
                "fp8-p-without-max": "fp8 logits x32", "output-dtype": "fp8", "fp8-p-times-v-descale": "fp8",
                "fp8-p-offset-in-base-e": "fp8", "fp8-descales-inverted": "fp8",
                "fp8-max-before-mask": "fp8 logits x32"}


@pytest.mark.parametrize("mistake", one_in(2, [pytest.param(m, marks=pytest.mark.slow) if "accumulator" in m else m
                                                for m in fp8_gallery.GALLERY]))   # the accumulator: 257 key tiles, 5 s
def test_each_fp8_mistake_fails_and_is_named(mistake):
    if mistake == "fp8-descale-query-head":
        cases = [Case(1, 6, 45, 77, 40, True, (("gqa", 2),))]          # widened: slices 2^6 apart
        features = ["fp8", "gqa"]
    elif mistake == "fp8-p-normalised":                                # weights ~1/Tk: in e4m3's subnormals
        cases = [Case(1, 2, 4, 2049, 64, False, (("fp8", ("amax", 1.0)),))]
        features = ["fp8"]
    elif mistake == "fp8-pv-narrow-accumulator":                       # the long case: 257 key tiles
        cases = [c for c in REGISTRY["fp8"].cases(False, Plan()) if c.tk > 30000]
        features = ["fp8"]
    else:
        cases = [own_case("fp8", FP8_SHOWN_ON[mistake])]
        features = ["fp8"]
    report = run_cases(fp8_gallery.GALLERY[mistake], features, cases)
    assert not report.passed
    named = {mistake}
    if mistake in ("fp8-p-without-max", "fp8-p-offset-in-base-e") and \
            torch.tensor([500.0]).to(torch.float8_e4m3fn).isnan().all():
        named = {"non-finite"}                # PyTorch 2.1's cast: NaN past 448 (later ones saturate)
    if mistake == "fp8-k-descale-twice":       # k's descale ~1/(4 448): its scores times that are flat
        assert all(r.diagnosis.also == (mistake,) for r in report.failures), str(report)
        named = {"scores-flat"}
    assert {r.diagnosis.id for r in report.failures} == named, str(report)


@pytest.mark.parametrize("tiles, offset", [((64, 32), 0.0), ((128, 64), 8 * math.log(2))])
def test_a_maximum_taken_before_the_causal_mask_is_named_with_its_tiles_and_offset(tiles, offset):
    kernel = fp8_gallery.fp8_kernel(max_before_mask=dict(block_m=tiles[0], block_n=tiles[1], offset=offset))
    report = run_cases(kernel, ["fp8"], [own_case("fp8", "fp8 logits x8"), own_case("fp8", "fp8 logits x32")])
    assert report.failures
    for row in report.failures:
        words = f"key tiles of {tiles[1]}{', P offset by 2^8' if offset else ''})"   # (query tiles 64, 128: alike here)
        assert row.diagnosis.id == "fp8-max-before-mask" and words in row.diagnosis.sentence, row.diagnosis.sentence


@pytest.mark.parametrize("mistake", [pytest.param(m, marks=pytest.mark.slow) if "accumulator" in m else m
                                     for m in fp8_gallery.GALLERY_KV])
def test_each_fp8_kv_mistake_fails_and_is_named(mistake):
    cases = [c for c in REGISTRY["fp8_kv"].cases(False, Plan())
             if (c.tk > 30000) == (mistake == "fp8-pv-narrow-accumulator") and c.tq == 97]
    if mistake == "fp8-k-descale-missing-past-dv":                  # FlashInfer's MLA head dims: D192/128
        cases = [c for c in REGISTRY["fp8_kv"].cases(False, Plan()) if c.get("value_dim")]
    cases = cases or [c for c in REGISTRY["fp8_kv"].cases(False, Plan()) if c.tk > 30000]
    report = run_cases(fp8_gallery.GALLERY_KV[mistake], ["fp8_kv"], cases, dtypes=["bfloat16"])
    assert not report.passed
    if mistake == "fp8-k-descale-twice":       # k's descale ~1/(4 448): its scores times that are flat
        assert all(r.diagnosis.also == (mistake,) for r in report.failures), str(report)
        mistake = "scores-flat"
    assert {r.diagnosis.id for r in report.failures} == {mistake}, str(report)


def test_kv_descales_off_by_a_factor_each_are_named_with_both_factors():
    right = fp8_gallery.RIGHT_KV["fa3"]

    def halved(q, k, v, *, k_descale, v_descale, **kw):          # e4m3fn bytes read as e4m3fnuz: each value halved
        return right(q, k, v, k_descale=k_descale / 2, v_descale=v_descale / 2, **kw)
    cases = [c for c in REGISTRY["fp8_kv"].cases(False, Plan()) if c.tq == 97]
    report = run_cases(halved, ["fp8_kv"], cases, dtypes=["bfloat16"])
    assert report.failures and report.diagnosis == "scores-scaled", str(report)
    sentence = report.failures[0].diagnosis.sentence
    assert "its scores multiplied by 0.5" in sentence and "(2^-1) and its output by 0.5" in sentence, sentence


def test_the_inputs_reach_the_kernel_in_float8_exactly_as_the_golden_reads_them():
    case, rounded = runner.prepared(Case(1, 4, 9, 11, 16, True, (("gqa", 2), ("fp8", ("wide", 1.0)))),
                                    "bfloat16", 0, ["fp8", "gqa"])
    seen = {}

    def spy(q, k, v, *, causal, scale, q_descale, k_descale, v_descale):
        if not seen:                                                  # the first call: the case's own inputs
            seen.update(q=q, k=k, v=v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
        return fp8_gallery.fa3(q, k, v, causal=causal, scale=scale, q_descale=q_descale, k_descale=k_descale,
                               v_descale=v_descale)
    assert run_cases(spy, ["fp8", "gqa"], [case]).passed
    assert {seen[n].dtype for n in "qkv"} == {torch.float8_e4m3fn}
    assert all(seen[n + "_descale"].dtype == torch.float32 and tuple(seen[n + "_descale"].shape) == (1, 2)
               for n in "qkv")
    for n, heads in (("q", 4), ("k", 2), ("v", 2)):                   # stored × descale = the golden's input
        scale = seen[n + "_descale"].double().repeat_interleave(heads // 2, 1)[:, :, None, None]
        real = (seen[n].double() * scale).numpy()                     # exact in float64
        assert np.array_equal(real, rounded[n])
    # q's descale is per kv head: its group of query heads shares it, the largest of them at 448
    amax = seen["q"].float().abs().amax(dim=(2, 3)).view(1, 2, 2)
    assert amax.amax(-1).tolist() == [[448.0, 448.0]]


def test_fp8_runs_in_bfloat16_and_says_so_when_asked_for_another_dtype():
    with pytest.raises(ValueError, match="fp8 runs in bfloat16"):
        parity_tests.check(fp8_gallery.fa3, features=["fp8"], dtypes=["float32"])
    with pytest.raises(ValueError, match="fp8_kv.*cannot be combined with fp8|fp8.*cannot be combined"):
        parity_tests.check(fp8_gallery.fa3, features=["fp8", "fp8_kv"])


def test_the_fp8_baseline_is_what_widens_the_bound():
    """Without FlashAttention-3's own formulation among the baseline's, its right kernel FAILS:
    the e4m3 rounding of P is the largest error a right FP8 kernel makes (measured over the
    default grid with gqa: 0.3 of the bound at worst with it; without it 1.2 .. 1.6 on the
    integer inputs, 0.95 .. 1.02 on the long case, seeds 0 .. 2)."""
    cases = [Case(1, 2, 45, 45, 64, False, (("inputs", "integers"),))]
    assert run_cases(fp8_gallery.fa3, ["fp8"], cases).passed
    feature = REGISTRY["fp8"]
    from dataclasses import replace
    stripped = replace(feature, judging=replace(feature.judging, baselines=()))
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(REGISTRY, "fp8", stripped)
        assert not run_cases(fp8_gallery.fa3, ["fp8"], cases).passed


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(20))
def test_right_fp8_kernels_pass_at_every_seed(seed):
    """Every right kernel of the gallery, causal and not, GQA, both dtypes of the KV form."""
    for fn in fp8_gallery.RIGHT.values():
        report = parity_tests.check(fn, features=["fp8", "gqa"], causal="both", seed=seed)
        assert report.passed, str(report)
    for fn in fp8_gallery.RIGHT_KV.values():
        report = parity_tests.check(fn, features=["fp8_kv", "gqa"], dtypes=KV_DTYPES, seed=seed)
        assert report.passed, str(report)


def test_the_bf16_tile_accumulator_prediction_keeps_the_causal_mask():
    """``fp8-pv-narrow-accumulator``'s prediction is masked attention: row 0 of a causal case
    sees key 0 alone, and every row is the masked softmax's within bfloat16's rounding."""
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 2, 8, 16)) for _ in range(4))
    case = Case(1, 2, 8, 8, 16, True)
    opts = {"scale": 0.25, "causal": True}
    ctx = mistakes.Context(case, "top-left", (q, k, v, dout), None, opts, {}, lambda d: d, ())
    for truncate in (False, True):
        out = fp8.tiles_in_bf16(ctx, 4, truncate)()["out"]
        want = dense.attention(*(torch.as_tensor(x) for x in (q, k, v)), causal=True, scale=0.25)[0].numpy()
        np.testing.assert_allclose(out[:, :, 0], v[:, :, 0], rtol=2 ** -6, atol=1e-6)
        np.testing.assert_allclose(out, want, rtol=0, atol=0.05)


@needs_dtype("float16")
def test_keys_weighed_otherwise_one_to_a_tile_are_not_read_as_tiles_weighed():
    # q rounded to e4m3 without a scale: on outlier inputs a few rows, each tile weighed by one key
    def q_as_the_cache(q, k, v, *, causal, scale, k_descale, v_descale):
        kd, vd = (x.float() * s.float()[:, :, None, None] for x, s in ((k, k_descale), (v, v_descale)))
        q8 = q.clamp(-448, 448).to(torch.float8_e4m3fn).float()      # saturated: 2.1 casts past 448 to NaN
        return torch.nn.functional.scaled_dot_product_attention(q8, kd, vd, is_causal=causal, scale=scale).to(q.dtype)
    case = Case(1, 2, 77, 77, 64, False, (("inputs", "outliers"),))
    rows = runner.run_case(targets.resolve(q_as_the_cache), case, "float16", "cpu", wanted=("fp8_kv",))
    out = next(r for r in rows if r.tensor == "out")
    assert not out.passed and out.diagnosis.id != "tiles-weighted", out.diagnosis.sentence
