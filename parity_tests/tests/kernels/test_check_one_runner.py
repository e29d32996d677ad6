"""One judge: every case, plain or featured, goes through one runner with one golden,
and a mistake is named whichever features the case carries."""

import math

import numpy as np
import pytest

import parity_tests
from parity_tests.kernels import dense, runner
from parity_tests.kernels.cases import Case
from parity_tests.kernels.features import REGISTRY, Plan
from parity_tests.kernels.planted.featured import attend, kernel

pytestmark = pytest.mark.usefixtures("without_input_classes")   # (conftest.py)

SMALL = dict(tokens=["17"], head_dims=[16], heads=[2], batch=[1], dtypes=["float32"])


def _errors(report):
    return {(r.case, r.tensor): (r.error, r.baseline, r.bound) for r in report.rows}


def test_a_plain_case_is_judged_the_same_with_and_without_features():
    right = kernel(returns_lse=False)
    plain = parity_tests.check(right, **SMALL, causal="both")
    featured = parity_tests.check(right, **SMALL, causal="both", features=["deterministic"])
    assert plain.passed and featured.passed, str(featured)
    same = _errors(plain)
    assert same and all(_errors(featured)[key] == value for key, value in same.items())


def test_inputs_are_seeded_by_the_case_fields_not_its_label(monkeypatch):
    case = Case(1, 2, 5, 7, 8, True, (("window", (2, 1)),))
    before = runner.draw(case, seed=3)
    monkeypatch.setattr(Case, "__str__", lambda self: "renamed")
    after = runner.draw(case, seed=3)
    assert all(np.array_equal(before[n], after[n]) for n in before)
    assert not np.array_equal(runner.draw(case, seed=4)["q"], before["q"])


def _stale(**knobs):
    def fn(q, k, v, *, causal, scale, align="top-left", window=None, softcap=None, alibi_slopes=None):
        return attend(q, k, v, causal=causal, scale=scale, align=align, window=window, softcap=softcap,
                      alibi_slopes=alibi_slopes, mistake=knobs.get("mistake", "stale-max"))[0]
    return fn


@pytest.mark.parametrize("features, align", [(["gqa"], "top-left")] + [     # the others with -m slow
    pytest.param(f, a, marks=pytest.mark.slow) for f, a in ((["window"], "top-left"), (["window"], "bottom-right"),
                                                            (["alibi"], "bottom-right"))])
def test_a_stale_running_maximum_is_named_on_featured_cases(features, align):
    report = parity_tests.check(_stale(), features=features, **SMALL, causal="yes", align=align)
    featured = [(r, d) for r, d in report.diagnoses if r.dims["features"]]
    assert featured, str(report)
    named = [d.id for r, d in featured if r.tensor == "out"]
    assert named.count("stale-max") >= len(named) / 2, [d.sentence for _, d in featured][:4]


def test_a_kernel_computing_in_bfloat16_is_named_on_a_softcap_case():
    report = parity_tests.check(_stale(mistake="in-bfloat16"), features=["softcap"], **SMALL, causal="no")
    softcapped = [d.id for r, d in report.diagnoses if "softcap" in r.dims["features"]]
    # named on the softcap cases, and never given another cause (at softcap 1 the exponentials of a
    # true bfloat16 kernel drift further than torch's bfloat16 softmax, which works in float32 inside)
    assert softcapped.count("lower-precision") >= len(softcapped) / 2, softcapped
    assert set(softcapped) <= {"lower-precision", "none"}, softcapped


def _bthd(q, k, v, *, causal, scale, align="top-left", window=None, softcap=None, alibi_slopes=None,
          bias=None, sinks=None):
    """A right kernel in flash_attn_func's (B, T, H, D) layout."""
    out, lse = attend(*(t.transpose(1, 2) for t in (q, k, v)), causal=causal, scale=scale, align=align,
                      window=window, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, sinks=sinks)
    return out.transpose(1, 2), lse


BTHD_FORMS = ["gqa", "value_dim", "window", "softcap", "alibi", "bias", "sinks", "lse", "decode", "deterministic"]


def test_a_right_bthd_kernel_passes_features_with_a_bthd_form():
    report = parity_tests.check(_bthd, layout="bthd", features=["gqa", "window", "lse"], **SMALL, causal="yes")
    assert report.passed, str(report)
    with pytest.raises(ValueError, match="varlen runs every case in the thd layout"):
        parity_tests.check(_bthd, layout="bthd", features=["varlen"])


@pytest.mark.slow
def test_a_right_bthd_kernel_passes_every_feature_with_a_bthd_form():
    report = parity_tests.check(_bthd, layout="bthd", features=BTHD_FORMS, **SMALL, causal="yes")
    assert report.passed, str(report)


def test_alibi_slopes_are_the_papers():
    for heads in (1, 2, 4, 8, 16):
        assert dense.alibi_slopes(heads) == [2.0 ** (-8.0 * h / heads) for h in range(1, heads + 1)]
    # not a power of two: the 4 of H = 4, then every other one of H = 8
    assert dense.alibi_slopes(6) == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]


def test_causal_windows_include_an_unbounded_right_side():
    drawn = {c.get("window") for c in REGISTRY["window"].cases(True, Plan())}
    assert any(w[1] == -1 for w in drawn) and (0, 0) in drawn

    def window_replaces_the_mask(q, k, v, *, causal, scale, window=None):
        return attend(q, k, v, causal=causal and window is None, scale=scale, window=window)[0]
    report = parity_tests.check(window_replaces_the_mask, features=["window"], **SMALL, causal="yes")
    unbounded = [d.id for r, d in report.diagnoses if r.tensor == "out" and ",-1)" in r.case]
    assert unbounded and set(unbounded) == {"no-causal-mask"}, unbounded


def test_every_feature_case_is_seeded_and_labelled_apart():
    plan = Plan(seed=0, takes_align=True)
    cases = list(dict.fromkeys(c for f in REGISTRY.values() for cz in (True, False) for c in f.cases(cz, plan)))
    assert len({str(c) for c in cases}) == len(cases)
    assert len({runner.draw(c)["q"].tobytes() for c in cases}) == len(cases)


@pytest.mark.parametrize("align", ["top-left", "bottom-right"])
def test_the_offset_is_the_alignments(align):
    case = Case(1, 1, 5, 9, 4, True, align=align)
    assert case.offset("top-left") == (0 if align == "top-left" else 4)
    assert math.isclose(case.scale, 0.5)


def test_lse_grad_backpropagates_through_lse():
    right = parity_tests.check(kernel(), features=["lse_grad", "sinks"], **SMALL, causal="yes")
    assert right.passed, str(right)
    assert {r.tensor for r in right.rows} >= {"out", "lse", "dq", "dk", "dv", "dsinks"}
    # the upstream gradient on lse changes dq and dk: a kernel that ignores it is caught and named
    wrong = parity_tests.check(kernel("lse-grad-dropped"), features=["lse_grad"], **SMALL, causal="yes")
    assert {r.tensor for r in wrong.failures} == {"dq", "dk"}, str(wrong)
    assert wrong.diagnosis == "lse-grad-dropped", str(wrong)
    assert parity_tests.check(kernel("lse-grad-dropped"), features=["lse"], **SMALL, causal="yes").passed


def test_lse_grad_backpropagates_through_the_packed_layout():
    # with varlen, lse is (H, total_q): the upstream gradient on it is packed and transposed to match
    right = parity_tests.check(kernel(packed=True), features=["varlen", "lse_grad"], **SMALL, causal="yes")
    assert right.passed, str(right)
    assert right.settings["layout"] == "thd"
    assert {r.tensor for r in right.rows} == {"out", "lse", "dq", "dk", "dv"}
    wrong = parity_tests.check(kernel("lse-grad-dropped", packed=True), features=["varlen", "lse_grad"], **SMALL,
                               causal="yes")
    assert {r.tensor for r in wrong.failures} == {"dq", "dk"}, str(wrong)
    assert wrong.diagnosis == "lse-grad-dropped", str(wrong)


def test_requested_features_meet_and_run_at_the_users_lengths():
    plan = Plan(seed=0, grid=(Case(1, 2, 4096, 4096, 64, True),))
    from parity_tests.kernels.features import feature_cases
    added = feature_cases(["gqa", "alibi", "softcap", "bias"], (True,), plan)
    combos = {tuple(n for n, _ in c.features) for c in added if len(c.features) > 1}
    assert {("gqa", "alibi"), ("softcap", "alibi"), ("alibi", "bias"), ("gqa", "softcap", "alibi", "bias")} <= combos
    assert any(c.tq == 4096 and c.get("alibi") for c in added)            # ALiBi at the user's length


def test_alibi_slopes_per_kv_head_fail_where_gqa_meets_alibi():
    report = parity_tests.check(kernel("alibi-per-kv-head", returns_lse=False), features=["gqa", "alibi"],
                                **SMALL, causal="yes")
    failing = {r.case for r in report.failures}
    assert failing and all("/" in c.split()[1] and "alibi" in c for c in failing), failing    # GQA x ALiBi only
    assert report.diagnosis == "alibi-per-kv-head", str(report)


def test_a_window_drawn_at_the_users_length_fits_its_keys():
    from parity_tests.kernels.features import feature_cases
    for tk in (2, 3):
        plan = Plan(seed=0, grid=(Case(1, 2, tk, tk, 16, False),))
        windows = [c.get("window") for c in feature_cases(["window"], (False,), plan) if c.tk == tk and c.get("window")]
        assert windows and all(-1 <= side < tk for w in windows for side in w), windows
