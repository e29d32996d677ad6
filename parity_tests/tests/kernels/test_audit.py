"""``attention-parity audit`` / ``parity_tests.audit``: an acceptance rule held to the planted
mistakes and the correct kernels.  Its lists agree with running each kernel under the rule by
hand; atol = rtol = 0 rejects the correct kernels; a very loose rule lets every mistake through
(those that raise or return NaN excepted: no tolerance accepts them); the suggested pair
rejects no correct kernel."""

import functools
import inspect
import json

import numpy as np
import pytest
import torch

import parity_tests
from parity_tests.common import capabilities
from parity_tests import cli
from parity_tests.kernels import audit as audit_mod
from parity_tests.kernels import audit_report
from parity_tests.kernels import planted, run, runner, targets
from parity_tests.kernels.planted import correct
from sampled import moved, one_in

# one length, causal: the plan adds its input classes (strides, scale, large logits, integers, Tq > Tk)
SMALL = dict(dtypes=["bfloat16"], tokens=["17"], head_dims=[16], heads=[2], batch=[1], causal="yes")
CLI_SMALL = ["--dtype", "bfloat16", "--tokens", "17", "--head-dim", "16", "--heads", "2", "--batch", "1",
             "--causal", "yes"]
# xformers' bfloat16 tolerance for its cutlass backward (atol 0.7, rtol 0.1): an outside rule
XFORMERS_BF16 = dict(atol=0.7, rtol=0.1)


def _assert_close(atol, rtol):
    def accept(out, ref):
        torch.testing.assert_close(out, ref.to(out.dtype), atol=atol, rtol=rtol)
    return accept


@functools.lru_cache(maxsize=None)
def _cases(reference, dtype="bfloat16"):
    """SMALL's plan as ``check`` draws it: (case, rounded inputs, the plain computation in
    ``dtype`` or float32 (``reference``)) for each of its cases."""
    plan = run._plan(planted.kernel("no-causal-mask", ()), "cpu", [dtype], ["17"], [16], [2], [1], "yes",
                     "top-left", "bhtd", False)
    ref_dtype = dtype if reference == "same-dtype" else "float32"
    out = []
    for case in plan.grid:
        case, rounded = runner.prepared(case, dtype)
        opts = runner.reference_options(case, "top-left", rounded)
        out.append((case, rounded, runner.baseline(rounded, opts, ref_dtype, "cpu")))
    return out


def by_hand(fn, accept, takes_align, reference, dtype="bfloat16"):
    """Whether ``accept`` passes ``fn``'s out, dq, dk, dv on every case of SMALL's plan, against
    the plain computation in ``dtype`` or float32 (``reference``): the kernel called directly,
    its gradients from autograd."""
    low = runner.DTYPES[dtype]
    ref_dtype = runner.DTYPES[dtype if reference == "same-dtype" else "float32"]
    for case, rounded, ref in _cases(reference, dtype):
        q, k, v = (torch.from_numpy(rounded[n]).to(low).requires_grad_() for n in ("q", "k", "v"))
        try:
            out = fn(q, k, v, causal=case.causal, scale=case.scale, **({"align": "top-left"} if takes_align else {}))
            out.backward(torch.from_numpy(rounded["dout"]).to(low))
        except Exception:                    # noqa: BLE001 - a test of it would error
            return False
        for n, got in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
            if got is None:
                return False
            try:
                said = accept(got.detach(), torch.from_numpy(ref[n]).to(ref_dtype))
            except AssertionError:
                return False
            if said is False:
                return False
    return True


def _hand_lists(report, accept, reference):
    """(accepted mistakes, rejected correct kernels) of ``report``'s kernels, run by hand."""
    accepted = {name for name in (k.name for k in report.mistakes)
                if by_hand(planted.kernel(name, ()), accept, True, reference)}
    rejected = set()
    for k in report.correct:
        fn = k.target.fn
        if not by_hand(fn, accept, "align" in inspect.signature(fn).parameters, reference):
            rejected.add(k.name)
    return accepted, rejected


@pytest.fixture(scope="module")
def xformers_report():
    return parity_tests.audit(_assert_close(**XFORMERS_BF16), **SMALL)


@pytest.fixture(scope="module")
def xformers_f32_report():
    return parity_tests.audit(_assert_close(**XFORMERS_BF16), reference="float32", **SMALL)


@pytest.mark.slow
@pytest.mark.parametrize("which, reference", [("xformers_report", "same-dtype"), ("xformers_f32_report", "float32")])
def test_the_audit_lists_agree_with_each_kernel_run_under_the_rule_by_hand(which, reference, request):
    report = request.getfixturevalue(which)
    accepted, rejected = _hand_lists(report, _assert_close(**XFORMERS_BF16), reference)
    assert {k.name for k in report.mistakes if k.accepted} == accepted
    assert {k.name for k in report.missed} == {k.name for k in report.shown} & accepted
    assert {k.name for k in report.rejected} == rejected
    assert len(report.mistakes) >= 20 and len(report.correct) >= 10
    assert report.passed == (not report.missed and not rejected)


@pytest.mark.slow                      # a whole audit of the catalogue: 2 s
def test_against_float32_the_outside_rule_passes_every_correct_kernel_and_misses_some_mistakes(xformers_f32_report):
    """The lists above are not empty or full: xformers' bfloat16 tolerance against a float32
    reference accepts every correct kernel here and lets a low-precision accumulator through,
    which check's bound catches."""
    report = xformers_f32_report
    # PyTorch's own SDPA backends vary with the release: on 2.1.2 this rule rejects the math
    # backend's bfloat16 dq on the outlier inputs (check passes it); the formulations never
    assert not [k.name for k in report.rejected if not k.name.startswith("sdpa-")]
    assert "low-precision-accumulator" in {k.name for k in report.missed}
    assert len(report.missed) < len(report.shown)


def test_a_rule_at_zero_tolerance_rejects_the_correct_kernels():
    report = parity_tests.audit(atol=0.0, rtol=0.0, mistakes=["no-scale", "stale-max"], **SMALL)
    assert {k.name for k in report.rejected} >= {n.replace("_", "-") for n in correct.CORRECT}
    assert not report.missed and not report.passed
    assert f"it rejects {len(report.rejected)} of {len(report.correct)} correct kernels" in report.sentence()


@pytest.mark.slow                     # 1 s
def test_a_very_loose_rule_lets_every_mistake_through_that_gives_finite_tensors():
    report = parity_tests.audit(atol=1e6, rtol=1e6, **SMALL)
    assert not report.rejected
    # no tolerance accepts a kernel that raises (the (B, T, H, D) reading on Tq != Tk) or gives NaN
    unacceptable = {k.name for k in report.mistakes if k.worst[0] == float("inf")}
    assert unacceptable == {"layout-bthd-as-bhtd", "backward-unmasked"}
    assert {k.name for k in report.mistakes if k.accepted} == {k.name for k in report.mistakes} - unacceptable
    assert {k.name for k in report.missed} == {k.name for k in report.shown} - unacceptable
    assert report.sentence().startswith(f"your rule misses {len(report.missed)} of {len(report.shown)} "
                                        "catalogued mistakes at these shapes (largest: ")


def test_a_mistake_that_does_not_show_at_these_shapes_is_not_counted_as_missed():
    """A backward that masks causally, run on causal cases only, computes the right answer."""
    report = parity_tests.audit(atol=1e6, rtol=1e6, mistakes=["backward-masked", "no-scale"], **SMALL)
    assert [k.name for k in report.unseen] == ["backward-masked"] and report.unseen[0].worst[0] < 1
    assert [k.name for k in report.missed] == ["no-scale"]
    assert report.sentence().startswith("your rule misses 1 of 1 catalogued mistakes")
    assert "1 more mistake does not show at these shapes, check's bound misses it too: backward-masked" in \
        report.sentence()


# Tq != Tk, causal and not: where the suggestion still misses a mistake
WIDER = {**SMALL, "tokens": ["45x77"], "head_dims": [64], "causal": "both"}


@pytest.fixture(scope="module")
def wider_report():
    return parity_tests.audit(**XFORMERS_BF16, **WIDER)


@pytest.mark.slow                      # a whole audit of the catalogue: 2.8 s
def test_the_suggested_pair_rejects_no_correct_kernel_and_misses_what_it_says(wider_report):
    pairs = wider_report.suggested["bfloat16"]
    assert set(pairs) == {"out", "dq", "dk", "dv"}

    def suggested(out, ref, tensor):
        atol, rtol = pairs[tensor]
        torch.testing.assert_close(out, ref.to(out.dtype), atol=atol, rtol=rtol)
    again = parity_tests.audit(suggested, **WIDER)
    assert not again.rejected
    assert sorted(k.name for k in again.missed) == sorted(wider_report.suggested_misses["bfloat16"])
    # the tightest pair tried: half its atol (at its rtol) rejects some correct kernel's tensor
    right = [k for k in wider_report.correct]
    for n, (atol, rtol) in pairs.items():
        gaps = [g for k in right for g in k.diffs[("bfloat16", n)]]
        assert audit_report._accepts(gaps, atol, rtol) and not audit_report._accepts(gaps, atol / 2, rtol)


@pytest.mark.slow                      # a whole audit of the catalogue: 2 s
def test_check_catches_what_the_loosest_elementwise_rule_misses(wider_report):
    missed = wider_report.suggested_misses["bfloat16"]
    by_name = {k.name: k for k in wider_report.mistakes}
    assert missed == ["low-precision-accumulator"] and by_name[missed[0]].caught_by_check
    assert all(k.caught_by_check for k in wider_report.mistakes if k.worst[0] > 1)
    assert not any(k.caught_by_check for k in wider_report.correct)


def test_one_golden_per_case_shared_by_every_kernel(monkeypatch):
    calls = []
    golden = runner.golden
    monkeypatch.setattr(runner, "golden", lambda *a, **kw: calls.append(1) or golden(*a, **kw))
    report = parity_tests.audit(atol=1.0, rtol=1.0, mistakes=["no-scale", "stale-max"], **SMALL)
    assert len(calls) == report.settings["cases"] and len(report.mistakes) == 2 and len(report.correct) >= 10


@moved
def test_a_float32_reference_is_offered_and_tighter():
    same = parity_tests.audit(atol=1e-2, rtol=1e-2, mistakes=["no-scale"], **SMALL)
    f32 = parity_tests.audit(atol=1e-2, rtol=1e-2, mistakes=["no-scale"], reference="float32", **SMALL)
    assert f32.settings["reference"] == "float32"
    assert len(f32.rejected) < len(same.rejected)


@pytest.mark.parametrize("kwargs, words", [
    (dict(atol=1.0), "atol and rtol"),
    (dict(cosine=2.0), "cosine must be in"),
    (dict(matched_ratio=0.0), "matched_ratio must be in"),
    (dict(atol="1", rtol=1), "atol must be a number"),
    (dict(atol=1, rtol=1, reference="float16"), "reference must be"),
    (dict(atol=1, rtol=1, mistakes=["no-such"]), "mistakes: no planted mistake 'no-such'"),
    (dict(atol=1, rtol=1, features=["dropout"]), "features: 'dropout' is not audited"),
    (dict(), "rule: give an acceptance rule"),
])
def test_bad_input_is_refused_naming_the_argument(kwargs, words):
    with pytest.raises((ValueError, TypeError), match=words):
        parity_tests.audit(**kwargs)


def test_a_rule_that_is_not_callable_is_a_type_error():
    with pytest.raises(TypeError, match="rule must be a callable"):
        parity_tests.audit("assert_close")


def test_the_command_writes_the_schema_and_exits_1_when_the_rule_misses_or_rejects(tmp_path, capsys):
    path = tmp_path / "audit.json"
    status = cli.main(["audit", "--atol", "1e6", "--rtol", "1e6", *CLI_SMALL, "--mistakes", "no-scale,stale-max",
                       "--json", str(path)])
    text = capsys.readouterr().out
    assert status == 1
    assert "your rule misses 2 of 2 catalogued mistakes" in text
    data = json.loads(path.read_text())
    assert [m["name"] for m in data["mistakes"]] == ["no-scale", "stale-max"]
    assert all(m["accepted"] is True and m["caught_by_check"] is True for m in data["mistakes"])
    assert all(set(c) >= {"name", "accepted"} for c in data["correct"])
    assert set(data["suggested"]) >= {"atol", "rtol"} and set(data["suggested"]["atol"]["bfloat16"]) == \
        {"out", "dq", "dk", "dv"}


def test_json_dash_writes_to_standard_output_alone(capsys):
    status = cli.main(["audit", "--atol", "0", "--rtol", "0", *CLI_SMALL, "--mistakes", "no-scale", "--json", "-"])
    data = json.loads(capsys.readouterr().out)
    assert status == 1 and data["mistakes"][0]["accepted"] is False and data["summary"]["passed"] is False


def test_the_command_refuses_half_a_rule(capsys):
    assert cli.main(["audit", "--atol", "1"]) == 2
    assert "--atol and --rtol: give both" in capsys.readouterr().err


# ----------------------------------------------------------------------------
# The planted mistakes as a public API

def test_the_catalogue_names_are_unique_and_the_issues_names_are_there():
    names = parity_tests.mistakes()
    assert len(names) == len(set(names)) >= 50
    assert {"no-causal-mask", "mask-one-future", "no-scale", "stale-max", "acc-not-rescaled",
            "window-left-wider", "gqa-repeat", "softcap-after-bias", "splits-not-rescaled",
            "paged-off-by-one-page", "dropout-no-rescale"} <= set(names)
    assert all(n == n.strip() and " " not in n and "_" not in n for n in names)


def test_a_mistake_is_a_kernel_check_names_by_its_id():
    fn = parity_tests.mistake("stale-max")
    assert fn.diagnosis == "stale-max" and fn.features == []
    report = parity_tests.check(fn, dtypes=["float32"], tokens=["100"], head_dims=[16], heads=[1], batch=[1],
                                causal="yes")
    assert not report.passed and report.diagnosis == "stale-max"


@pytest.mark.parametrize("name", one_in(3, ["lse-base-2", "paged-page-size", "dropout-no-rescale"]))
def test_a_feature_mistake_checked_with_its_features_is_named(name):
    fn = parity_tests.mistake(name)
    report = parity_tests.check(fn, features=fn.features, dtypes=["float32"], tokens=["45x77"], head_dims=[16],
                                heads=[2], batch=[1])
    assert not report.passed and report.diagnosis == fn.diagnosis == name


def test_a_feature_mistake_comes_with_the_features_it_needs():
    fn = parity_tests.mistake("window-swapped")
    assert fn.features == ["window"] and "window" in inspect.signature(fn).parameters
    lse = parity_tests.mistake("lse-base-2")
    q = torch.randn(1, 2, 5, 8)
    out, l = lse(q, q, q, causal=True, scale=0.3)
    assert out.shape == (1, 2, 5, 8) and l.shape == (1, 2, 5)
    assert torch.allclose(l * np.log(2.0), torch.logsumexp(
        (q @ q.transpose(-1, -2) * 0.3).double().masked_fill(torch.ones(5, 5).triu(1).bool(), -np.inf), -1).float(),
        atol=1e-5)


def test_an_unknown_mistake_lists_the_names():
    with pytest.raises(ValueError, match="name: no planted mistake 'stale_max'; the catalogue's: no-causal-mask"):
        parity_tests.mistake("stale_max")
    with pytest.raises(TypeError, match="name must be a str"):
        parity_tests.mistake(3)
    with pytest.raises(ValueError, match="features: 'paged-page-size' is planted in the paged layout"):
        parity_tests.mistake("paged-page-size", features=["gqa"])


def test_every_builtin_sdpa_backend_on_the_device_is_among_the_correct_kernels():
    names = {k.name for k in audit_mod._correct_kernels("cpu", ())}
    assert {n for n in targets.builtin_names("cpu") if n.startswith("sdpa-")} <= names
    assert {n.replace("_", "-") for n in correct.CORRECT} <= names


@pytest.mark.parametrize("atol, rtol", [(0.0, 0.0), (1e-2, 1e-2), (0.7, 0.1), (1e6, 1e6)])
def test_the_builtin_atol_rtol_rule_is_assert_close(atol, rtol):
    """The built-in rule decides as torch.testing.assert_close, infinities and NaN included."""
    rng = torch.Generator().manual_seed(0)
    ref = torch.randn(64, generator=rng, dtype=torch.float64) * 4
    ref[:3] = torch.tensor([float("inf"), -float("inf"), 0.0])
    rule = audit_mod.Rule(atol=atol, rtol=rtol)
    for scale in (0.0, 1e-3, 1e-2, 0.2, 3.0):
        out = (ref + scale * torch.randn(64, generator=rng, dtype=torch.float64)).to(torch.bfloat16)
        for o in (out, torch.where(torch.arange(64) == 5, float("nan"), out.float()).to(torch.bfloat16)):
            try:
                torch.testing.assert_close(o.double(), ref, atol=atol, rtol=rtol)
                expected = True
            except AssertionError:
                expected = False
            assert rule(o, ref, "bfloat16", "out") == expected


@pytest.mark.slow                     # 1.1 s
def test_with_features_the_correct_kernels_take_what_they_express_and_the_feature_mistakes_run():
    """With lse the formulations return an lse of their own; SDPA, which returns none, is left out;
    the answer computed in float64 takes every feature."""
    report = parity_tests.audit(atol=1e6, rtol=1e6, features=["lse"], mistakes=["lse-base-2", "lse-no-max"],
                                **SMALL)
    names = {k.name for k in report.correct}
    assert {"flash2-64", "float64-rounded"} <= names and not {n for n in names if n.startswith("sdpa-")}
    assert not report.rejected and all(k.cases == report.settings["cases"] for k in report.correct)
    assert {k.name for k in report.missed} == {"lse-base-2", "lse-no-max"}
    report = parity_tests.audit(atol=1e6, rtol=1e6, features=["window"], mistakes=["window-swapped"], **SMALL)
    plain = {k.name: k.cases for k in report.correct}
    assert plain["float64-rounded"] == report.settings["cases"] > plain["flash2-64"] > 0   # the windowed cases: not theirs
    # SDPA takes every windowed case where it gives zeros on a row that sees no key (PyTorch >= 2.5)
    full = report.settings["cases"] if capabilities.has("sdpa_zero_rows") else plain["sdpa-math"]
    assert 0 < plain["sdpa-math"] == full <= report.settings["cases"]
    assert [k.name for k in report.missed] == ["window-swapped"]
