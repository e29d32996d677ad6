"""``check(..., features=[...])``: what the callable receives, what is judged, the
feature gallery's teeth, and the built-in targets with the features they express."""

import json
import re

import pytest
import torch

import parity_tests
from parity_tests import cli
from parity_tests.kernels import features as feat
from parity_tests.kernels import runner, targets
from parity_tests.kernels.cases import Case
from crashing_kernels import with_backward
from parity_tests.kernels.planted.featured import FEATURE_GALLERY, attend, kernel, one_unit_off_every_other_call, varlen, wrong_kernel
from needs import needs
from sampled import moved, one_in

pytestmark = pytest.mark.usefixtures("without_input_classes")   # (conftest.py)

# The grid part kept to one small case; the features' own cases are fixed.
SMALL = dict(tokens=["17"], head_dims=[16], heads=[2], batch=[1], dtypes=["float32"])
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _named_first(mistake, **options):
    fn, features = wrong_kernel(mistake)
    report = parity_tests.check(fn, features=features, **{**SMALL, **options})
    assert not report.passed
    assert report.diagnosis == mistake, [d.sentence for _, d in report.diagnoses][:6]
    return report


# One mistake of each feature (and the GQA x ALiBi pair), half of them in the default run;
# every mistake of the gallery, in both dtypes, under ``slow`` below.
ONE_PER_FEATURE = ["gqa-repeat", "window-right-narrower", "softcap-no-derivative", "alibi-no-offset",
                   "alibi-per-kv-head", "bias-no-grad", "sink-ignored", "lse-base-2", "decode-top-left",
                   "lse-grad-dropped"]            # varlen's: a wrong offset per sequence, in test_check_read_from_tensors


@pytest.mark.parametrize("mistake", one_in(3, ONE_PER_FEATURE))
def test_a_wrong_feature_kernel_fails_and_is_named(mistake):
    # a window's right edge exists without a causal mask only
    _named_first(mistake, causal="no" if mistake.startswith("window-right") else "yes")


def test_the_softcaps_derivative_applied_to_dp_alone_is_named():
    # dS = P ((1 - t^2) dP - D): out, lse and dv right, dq and dk off by P D t^2 (a half precision's size at c = 50)
    report = _named_first("softcap-derivative-on-dp", causal="yes")
    assert {r.tensor for r in report.failures} == {"dq", "dk"}
    assert all("dP alone" in d.sentence for _, d in report.diagnoses)


@pytest.mark.slow
@pytest.mark.parametrize("mistake", list(FEATURE_GALLERY))
def test_every_wrong_feature_kernel_fails_and_is_named_in_both_dtypes(mistake):
    _named_first(mistake, dtypes=["float32", "bfloat16"], causal="both")


def test_a_right_kernel_passes_its_features():
    features = ["gqa", "sinks", "lse"]
    report = parity_tests.check(kernel(), features=features, **{**SMALL, "dtypes": ["float32", "bfloat16"]},
                                causal="yes")
    assert report.passed, str(report)


@pytest.mark.slow
@pytest.mark.parametrize("features", [["gqa", "value_dim"], ["window"], ["softcap", "alibi"], ["bias"],
                                      ["sinks", "lse"], ["decode", "deterministic"]], ids=str)
def test_a_right_kernel_passes_every_feature(features):
    report = parity_tests.check(kernel(returns_lse="lse" in features), features=features,
                                **{**SMALL, "dtypes": ["float32", "bfloat16"]}, causal="both")
    assert report.passed, str(report)


@pytest.mark.slow
def test_a_right_packed_kernel_passes_varlen_with_lse():
    report = parity_tests.check(kernel(packed=True), features=["varlen", "lse", "window"],
                                **{**SMALL, "dtypes": ["float32", "bfloat16"]}, causal="both")
    assert report.passed, str(report)
    assert report.settings["layout"] == "thd"


def test_sdpa_passes_the_features_it_expresses_in_its_own_dtype():
    report = parity_tests.check("sdpa-math", features=["gqa", "alibi"],
                                **{**SMALL, "dtypes": ["float32", "bfloat16"]}, causal="yes")
    assert report.passed, str(report)


@needs("flex_attention")
def test_flex_passes_its_features_on_cpu():
    report = parity_tests.check("flex", features=["lse"], **SMALL, causal="yes")
    assert report.passed, str(report)
    judged = {r.tensor for r in report.rows if r.passed}
    refused = {r.tensor for r in report.rows if r.verdict == "not supported" and r.note.startswith("forward only")}
    assert {"out", "lse"} <= judged and judged | refused == {"out", "lse", "dq", "dk", "dv"}  # (2.5 to 2.9: both)


@pytest.mark.slow
@pytest.mark.parametrize("name, features", [
    ("sdpa-math", ["gqa", "value_dim", "window", "alibi", "bias", "decode", "deterministic"]),
    ("sdpa-flash", ["gqa", "window", "decode", "deterministic"]),
    ("flex", ["gqa", "window", "softcap", "alibi", "varlen", "lse", "decode"]),
    ("flex", ["bias"]),
])
def test_builtin_targets_pass_their_features_on_the_full_grid(name, features):
    report = parity_tests.check(name, features=features)
    assert report.passed, str(report)


def test_a_keyword_reaches_only_the_cases_of_its_feature():
    calls = []

    def recording(q, k, v, *, causal, scale, window=None, softcap=None):
        calls.append((q.shape, k.shape, window, softcap))
        return attend(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap)[0]
    report = parity_tests.check(recording, features=["window", "softcap", "gqa"], **SMALL, causal="no")
    assert report.passed, str(report)
    windows = [c for c in calls if c[2] is not None]
    caps = [c for c in calls if c[3] is not None]
    both = [c for c in calls if c[2] is not None and c[3] is not None]
    assert windows and caps and both                                # and where the features meet, both
    assert all(c[0][2] == 61 for c in both)                         # only there (features.feature_cases)
    assert {(0, 0)} <= {c[2] for c in windows}                      # the 0-wide window is there
    assert any(c[0][1] != c[1][1] for c in calls)                   # GQA: fewer kv heads
    assert all(c[0][1] == c[1][1] for c in calls if (c[2] is not None or c[3] is not None) and c[0][2] != 61)


def test_extra_inputs_are_handed_in_their_declared_dtypes_and_differentiated_where_declared():
    seen = {}

    def recording(q, k, v, *, causal, scale, alibi_slopes=None, bias=None, sinks=None):
        for name, x in (("bias", bias), ("sinks", sinks), ("alibi_slopes", alibi_slopes)):
            if x is not None:
                seen.setdefault(name, set()).add((x.dtype, x.requires_grad, q.dtype))
        return attend(q, k, v, causal=causal, scale=scale, alibi_slopes=alibi_slopes, bias=bias, sinks=sinks)[0]
    report = parity_tests.check(recording, features=["bias", "sinks", "alibi"],
                                **{**SMALL, "dtypes": ["float32", "bfloat16"]})
    assert report.passed, str(report)
    f32, bf16 = torch.float32, torch.bfloat16
    assert all(dt == q for dt, _, q in seen["bias"]) and bf16 in {dt for dt, _, _ in seen["bias"]}
    assert {dt for dt, _, _ in seen["sinks"]} == {dt for dt, _, _ in seen["alibi_slopes"]} == {f32}
    assert True in {g for _, g, _ in seen["bias"]} and True in {g for _, g, _ in seen["sinks"]}   # (the forward
    assert {g for _, g, _ in seen["alibi_slopes"]} == {False}                      # alone on a second call)
    assert {"dbias", "dsinks"} <= {r.tensor for r in report.rows}


def test_a_feature_the_signature_lacks_is_a_usage_error_before_any_case(capsys):
    calls = []

    def plain(q, k, v, *, causal, scale):
        calls.append(1)
        return attend(q, k, v, causal=causal, scale=scale)[0]
    with pytest.raises(ValueError, match="'window' passes window="):
        parity_tests.check(plain, features=["window"])
    with pytest.raises(ValueError, match="features must be among"):
        parity_tests.check(plain, features=["windows"])
    assert cli.main(["check", "sdpa-math", "--features", "softcap"]) == 2
    assert "softcap=" in capsys.readouterr().err
    assert cli.main(["check", "sdpa-math", "--features", "lse"]) == 2
    assert cli.main(["check", "sdpa-math", "--layout", "thd"]) == 2
    assert not calls


def test_varlen_hands_the_packed_layout_with_nan_past_the_end():
    seen = []

    def packed(q, k, v, *, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        seen.append((q.dim(), cu_seqlens_q.dtype, int(cu_seqlens_q[0]), int(cu_seqlens_q[-1]) == q.shape[0],
                     max_seqlen_q, bool(torch.isnan(q.as_strided((q.shape[0] + 1,) + q.shape[1:], q.stride())[-1]).all())))
        return varlen(q, k, v, causal=causal, scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)[0]
    report = parity_tests.check(packed, features=["varlen"], **SMALL, causal="yes")
    assert report.passed, str(report)
    assert all(s[:4] == (3, torch.int32, 0, True) and s[5] for s in seen)
    assert {s[4] for s in seen} >= {129, 17}


@pytest.mark.slow                     # 2.6 s (test_check_inputs reads one key past)
def test_a_kernel_that_reads_past_its_sequence_fails():
    def overreads(q, k, v, *, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        # each sequence's keys read as max_seqlen_k rows from its start: the neighbours' (and the NaN past the end)
        outs = []
        for n in range(len(cu_seqlens_q) - 1):
            a, b, c = int(cu_seqlens_q[n]), int(cu_seqlens_q[n + 1]), int(cu_seqlens_k[n])
            full = lambda x: x.as_strided((max_seqlen_k,) + x.shape[1:], x.stride(), x.storage_offset() + c * x.stride(0))
            kk, vv = full(k), full(v)
            outs.append(attend(q[a:b].transpose(0, 1)[None], kk.transpose(0, 1)[None], vv.transpose(0, 1)[None],
                               causal=causal, scale=scale)[0][0].transpose(0, 1))
        return torch.cat(outs)
    report = parity_tests.check(overreads, features=["varlen"], **SMALL, causal="no")
    assert not report.passed
    assert any(r.tensor == "out" and r.error == float("inf") for r in report.failures)


def test_lse_rows_that_see_no_key_are_not_judged_and_flash_attentions_alibi_form_is_accepted():
    def fa_style(q, k, v, *, causal, scale, align="top-left", alibi_slopes=None):
        out, lse = attend(q, k, v, causal=causal, scale=scale, align=align, alibi_slopes=alibi_slopes)
        lse = torch.where(torch.isfinite(lse), lse, torch.inf)          # FlashAttention 2 stores +inf
        if alibi_slopes is not None:
            tq, tk = q.shape[-2], k.shape[-2]
            i = torch.arange(tq) + (0 if align == "top-left" else tk - tq)
            lse = lse + alibi_slopes[:, None] * i                        # the row constants left out
        return out, lse
    report = parity_tests.check(fa_style, features=["alibi", "lse"], **SMALL, causal="yes")
    assert report.passed, str(report)
    notes = {r.note for r in report.rows if r.tensor == "lse" and "alibi" in r.case}
    assert notes == {"lse in FlashAttention's causal ALiBi form (+slope j)"}


def test_a_gradient_that_does_not_reach_bias_or_sinks_fails():
    def detached(q, k, v, *, causal, scale, bias=None, sinks=None):
        return attend(q, k, v, causal=causal, scale=scale, bias=None if bias is None else bias.detach(),
                      sinks=None if sinks is None else sinks.detach())[0]
    report = parity_tests.check(detached, features=["bias", "sinks"], **SMALL, causal="yes")
    failing = {r.tensor for r in report.failures}
    assert failing == {"dbias", "dsinks"}
    assert all("no gradient reached" in r.note for r in report.failures)


def test_every_tensor_is_judged_with_its_mean_error_and_cosine(tmp_path):
    path = tmp_path / "check.json"
    assert cli.main(["check", "parity_tests.kernels.planted.chapter:attention", "--features", "decode", "--tokens", "17",
                     "--head-dim", "16", "--dtype", "float32", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    decode = [r for r in rows if "decode" in r["features"]]
    assert decode and {r["tensor"] for r in decode} == {"out"}       # forward only
    assert all(r["mean_error"] <= r["error"] and r["cosine"] > 0.999999 for r in rows)


def test_a_nondeterministic_kernel_fails_deterministic():
    report = parity_tests.check(one_unit_off_every_other_call(), features=["deterministic"], **SMALL)
    assert not report.passed
    assert {r.diagnosis.id for r in report.failures} == {"not-deterministic"}


@pytest.mark.slow                     # 3 s of varlen and GQA diagnoses
def test_the_summaries_say_what_a_user_asks_first():
    report = _named_first("softcap-no-derivative", causal="yes")
    assert all(d.sentence.startswith("the output is right; only the backward is wrong: ")
               for _, d in report.diagnoses)

    def third_wrong(q, k, v, *, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        out = varlen(q, k, v, causal=causal, scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)[0]
        if len(cu_seqlens_q) > 4:
            a, b = int(cu_seqlens_q[3]), int(cu_seqlens_q[4])
            out = torch.cat([out[:a], 2 * out[a:b], out[b:]])
        return out
    report = parity_tests.check(third_wrong, features=["varlen"], **SMALL, causal="yes")
    outs = [d for r, d in report.diagnoses if r.tensor == "out"]
    assert outs and all(d.sentence.startswith("only sequence 3 of the batch") for d in outs)


@moved
def test_a_window_edge_is_named():
    report = _named_first("window-left-wider", causal="yes")
    assert "only the keys at the window's left edge differ" in report.diagnoses[0][1].sentence


@moved                      # every case of GQA's and the grid's fails: 3 s
def test_a_gradient_pointing_the_wrong_way_is_named_so():
    def turned_dq(q, k, v, *, causal, scale):           # -1/2 of dq for even rows, -1/4 for odd ones
        factors = torch.tensor([-0.5, -0.25]).repeat(q.shape[2])[:q.shape[2], None]
        return attend(with_backward(q, lambda g: g * factors), k, v, causal=causal, scale=scale)[0]
    report = parity_tests.check(turned_dq, features=["gqa"], **SMALL, causal="yes")
    dq = [d for r, d in report.diagnoses if r.tensor == "dq"]
    # said after what the catalogue found, not instead of it
    assert dq and all(d.id == "wrong-direction" and re.search(
        r"only the backward is wrong: dq matches none of the catalogued mistakes.*; dq points the wrong way "
        r"\(cosine -0\.9\d with the reference\); where: ", d.sentence) for d in dq), [d.sentence for d in dq]


@moved                      # every case of GQA's and the grid's fails: 3 s
def test_a_gradient_off_by_one_factor_is_named_with_it_and_said_to_point_the_wrong_way():
    def halved_dq(q, k, v, *, causal, scale):
        return attend(with_backward(q, lambda g: -0.5 * g), k, v, causal=causal, scale=scale)[0]
    report = parity_tests.check(halved_dq, features=["gqa"], **SMALL, causal="yes")
    dq = [d for r, d in report.diagnoses if r.tensor == "dq"]
    assert dq and all(d.id == "constant-factor" and re.search(
        r"only the backward is wrong: dq matches the reference with dq multiplied by one constant, -0\.5 to .*"
        r"; dq points the wrong way \(cosine -1\.00 with the reference\); where: ", d.sentence) for d in dq), \
        [d.sentence for d in dq]


def test_a_gradient_negated_is_named_before_it_is_said_to_point_the_wrong_way():
    def negated_dq(q, k, v, *, causal, scale):
        return attend(with_backward(q, lambda g: -g), k, v, causal=causal, scale=scale)[0]
    report = parity_tests.check(negated_dq, features=["gqa"], **SMALL, causal="yes")
    dq = [d for r, d in report.diagnoses if r.tensor == "dq"]
    assert dq and all(d.id == "gradient-negated" and "dq with its sign flipped" in d.sentence for d in dq)


def test_flash_attention_targets_are_skipped_with_the_reason_off_cuda():
    with pytest.raises(ValueError, match="FlashAttention.*not available here: it runs on CUDA only"):
        parity_tests.check("flash", features=["window"])


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name, features, align", [
    ("flash", ["gqa", "value_dim", "window", "softcap", "alibi", "decode"], "bottom-right"),
    ("flash-varlen", ["varlen", "window", "softcap", "alibi"], "bottom-right"),
    ("flash-kvcache", ["decode", "window", "softcap", "alibi"], "bottom-right"),
])
def test_flash_attention_targets_on_cuda(name, features, align):
    from parity_tests.kernels.targets.builtin import flash_unavailable
    if flash_unavailable():
        pytest.skip(flash_unavailable())
    report = parity_tests.check(name, device="cuda", dtypes=["bfloat16", "float16"], features=features, align=align)
    assert not report.failures, str(report)


def test_feature_names_are_the_contracts():
    assert feat.FEATURES == ("gqa", "value_dim", "window", "softcap", "alibi", "bias", "sinks", "varlen",
                             "lse", "lse_grad", "decode", "deterministic", "paged", "splits", "dropout", "fp8",
                             "fp8_kv")


@pytest.mark.slow                                      # T = 600 in two dtypes: 3 s
def test_alibi_positions_kept_in_bfloat16_are_named_past_256():
    fn = kernel("alibi-positions-bfloat16")                  # shows only where positions pass 256
    assert parity_tests.check(fn, features=["alibi", "lse"], **{**SMALL, "tokens": ["200"]}, causal="yes").passed
    # in bfloat16 too: the baseline forms its positions in float32 (in bfloat16 it erred as the
    # kernel does, and its bound let the kernel pass at T = 1023)
    report = parity_tests.check(fn, features=["alibi", "lse"], **{**SMALL, "tokens": ["600"],
                                                                 "dtypes": ["float32", "bfloat16"]}, causal="yes")
    long = [(r, d) for r, d in report.diagnoses if " T600 " in r.case]
    assert {r.dtype for r, _ in long} == {"float32", "bfloat16"}
    assert all(d.id == "alibi-positions-bfloat16" for _, d in long), [d.sentence for _, d in long]
    out = next(d for r, d in long if r.tensor == "out" and r.dtype == "float32")
    assert "confined to query rows 257 .. 599" in out.sentence


@pytest.mark.parametrize("mistake", ["softcap-positive-only", "softcap-clamped"])
def test_a_softcap_applied_asymmetrically_or_clipped_is_named(mistake):
    _named_first(mistake, causal="yes")


@pytest.mark.slow                     # 3 s of varlen diagnoses
def test_sequences_wrong_only_from_an_empty_one_on_are_said_so():
    def stops_at_an_empty_sequence(q, k, v, *, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k):             # `break` where `continue` was meant
        out = varlen(q, k, v, causal=causal, scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)[0]
        lq, lk = cu_seqlens_q.diff(), cu_seqlens_k.diff()
        empty = [b for b in range(len(lq)) if lq[b] == 0 or lk[b] == 0]
        if empty:
            out = torch.cat([out[:int(cu_seqlens_q[empty[0]])], 0 * out[int(cu_seqlens_q[empty[0]]):]])
        return out
    report = parity_tests.check(stops_at_an_empty_sequence, features=["varlen"], **SMALL, causal="yes")
    said = [d.sentence for r, d in report.diagnoses if r.tensor == "out"]
    assert said and any(", none before the empty sequence 2 (what an empty sequence shifting the ones after it "
                        "gives)" in s for s in said), said
    assert all("none before the empty sequence" in s for s in said if s.startswith("only sequence"))


@moved
def test_one_sequence_wrong_after_an_empty_one_is_not_read_as_a_shift():
    def third_sequence_off(q, k, v, *, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        out = varlen(q, k, v, causal=causal, scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)[0]
        if len(cu_seqlens_q) > 4:                       # sequence 3 alone, the last of its rows doubled
            last = int(cu_seqlens_q[4]) - 1
            out = torch.cat([out[:last], 2 * out[last:last + 1], out[last + 1:]])
        return out
    case = Case(5, 2, 129, 129, 16, True, (("varlen", ((37, 0, 1, 129, 65), (37, 0, 1, 129, 65))),))
    rows = runner.run_case(targets.resolve(third_sequence_off), case, "float32", "cpu", wanted=("varlen",))
    said = {r.tensor: r.diagnosis.sentence for r in rows if not r.passed}
    assert said["out"].startswith("only sequence 3 of the batch: "), said["out"]


def test_a_backward_reading_dout_with_the_query_head_dim_is_named():
    def truncated_backward(q, k, v, *, causal, scale):
        d = q.shape[-1]
        cut = lambda g: torch.cat([g[..., :d], 0 * g[..., d:]], -1)          # dO read over D channels
        return with_backward(attend(q, k, v, causal=causal, scale=scale)[0], cut)
    report = parity_tests.check(truncated_backward, features=["value_dim"], **SMALL, causal="yes")
    wide = [(r, d) for r, d in report.diagnoses if "D64/128" in r.case]
    assert wide and all(d.id == "value-dim-backward-truncated" for _, d in wide), [d.sentence for _, d in wide]
    assert {r.tensor for r, _ in wide} == {"dq", "dk", "dv"}


@pytest.mark.slow                     # every gradient: 2.5 s (out stays, varlen-neighbours)
def test_every_gradient_of_a_sequence_seeing_its_neighbours_is_named_so():
    report = _named_first("varlen-neighbours", causal="yes")
    grads = [(r, d) for r, d in report.diagnoses if r.tensor in ("dq", "dk", "dv")]
    assert grads and all(d.id == "varlen-neighbours" for _, d in grads), [d.sentence for _, d in grads]
