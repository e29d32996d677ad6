"""``check --merge``: a right merge passes in every dtype, each classic mistake fails
and is named, a merge that crashes or cheats fails with the reason, and the
command's exit statuses, JSON and refusals."""

import json

import numpy as np
import pytest
import torch

import merge_examples as ex
import parity_tests
from parity_tests import cli
from parity_tests.kernels import merge as merge_check

ALL_DTYPES = ["float64", "float32", "bfloat16", "float16"]
EXAMPLES = "parity_tests.tests.kernels.merge_examples"


def ids(report):
    return {r.diagnosis.id for r in report.failures}


def test_the_right_merge_passes_every_row_in_every_dtype():
    report = merge_check.check_merge(ex.merge, dtypes=ALL_DTYPES)
    assert report.passed, str(report)
    assert len(report.rows) == 4 * len(merge_check.CASES) * 4
    assert {r.tensor for r in report.rows} == set(merge_check.TENSORS)
    assert {r.case for r in report.rows} >= {"B2 H3 T17 D64 pair", "B1 H4 T9 D128 ring of 8",
                                             "B2 H2 T13 D40 tree of 5"}
    # the bound is a few baselines: float64 rows sit at rounding level
    assert max(r.bound for r in report.rows if r.dtype == "float64") < 1e-12


def test_the_plain_merges_of_the_baseline_pass_as_targets():
    for fn in (merge_check.plain_merge, merge_check.dense_merge):
        assert merge_check.check_merge(fn, dtypes=["float32"]).passed


def test_lse_in_base_2_is_named():
    report = merge_check.check_merge(ex.merge_base2, dtypes=["float32", "bfloat16"])
    assert not report.passed and report.diagnosis == "lse-base-2"
    assert ids(report) == {"lse-base-2"}
    assert all("lse in base 2: multiply by ln 2" in r.diagnosis.sentence for r in report.failures)
    assert {r.tensor for r in report.failures} == set(merge_check.TENSORS)


def test_the_forgotten_running_maximum_fails_at_large_lse_and_is_named():
    report = merge_check.check_merge(ex.merge_no_max, dtypes=["float32"])
    assert not report.passed and report.diagnosis == "merge-no-max"
    large = [r for r in report.rows if "±1000" in r.case]
    assert all(r.failed and r.diagnosis.id == "merge-no-max" for r in large)
    assert "forgets the running maximum" in large[0].diagnosis.sentence
    assert all(r.passed for r in report.rows if r.case == "B2 H3 T17 D64 pair")


def test_an_empty_partial_turned_into_nan_is_named():
    report = merge_check.check_merge(ex.merge_empty_nan, dtypes=["float32"])
    assert not report.passed and ids(report) == {"merge-empty-nan"}
    assert all("empty" in r.case for r in report.failures)
    assert all(r.passed for r in report.rows if "empty" not in r.case)
    out = next(r for r in report.failures if r.tensor == "out")
    assert "an empty partial turned into NaN" in out.diagnosis.sentence


def test_weights_not_normalised_are_named_on_out():
    report = merge_check.check_merge(ex.merge_not_normalised, dtypes=["float32"])
    outs = [r for r in report.failures if r.tensor == "out"]
    assert outs and all(r.diagnosis.id == "weights-not-normalised" for r in outs)
    assert all(r.passed for r in report.rows if r.tensor == "lse")


def test_the_merged_lse_detached_in_the_weights_is_named_on_dlse_parts():
    report = merge_check.check_merge(ex.merge_lse_detached, dtypes=["float32"])
    assert not report.passed and ids(report) == {"normaliser-detached"}, str(report)
    assert {r.tensor for r in report.failures} == {"dlse_parts"}
    assert "loses its -<dO, out> term" in report.failures[0].diagnosis.sentence


def _lse_sign_flipped(out_a, lse_a, out_b, lse_b):
    """ring-flash-attention's sigmoid form, its lse line's logsigmoid argument negated."""
    out, lse = ex.merge(out_a, lse_a, out_b, lse_b)
    both = torch.isfinite(lse_a) & torch.isfinite(lse_b)
    flipped = lse_a - torch.nn.functional.logsigmoid(torch.where(both, lse_b - lse_a, 0.0))
    return out, torch.where(both, flipped, lse)


def test_a_merged_lse_off_by_the_difference_of_the_two_is_named_on_out_and_lse():
    report = merge_check.check_merge(_lse_sign_flipped, dtypes=["float32"])
    assert not report.passed and report.diagnosis == "lse-off-by-difference", str(report)
    named = {r.tensor for r in report.failures if r.diagnosis.id == "lse-off-by-difference"}
    assert named == {"out", "lse"}, str(report)
    lse_row = next(r for r in report.failures if r.tensor == "lse")
    assert "each merge's lse off by lse_a - lse_b" in lse_row.diagnosis.sentence


def _softplus_without_abs(out_a, lse_a, out_b, lse_b):
    """The merged lse as max + log1p(exp(-d)), d = lse_a - lse_b, where log1p(exp(-|d|)) is meant."""
    out, lse = ex.merge(out_a, lse_a, out_b, lse_b)
    both = torch.isfinite(lse_a) & torch.isfinite(lse_b)
    d = torch.where(both, lse_a - lse_b, 0.0)
    return out, torch.where(both, torch.maximum(lse_a, lse_b) + torch.log1p(torch.exp(-d)), lse)


def test_a_merged_lse_off_on_one_side_only_is_named_with_the_side():
    report = merge_check.check_merge(_softplus_without_abs, dtypes=["float32"])
    assert not report.passed and report.diagnosis == "lse-off-one-side", str(report)
    lse_row = next(r for r in report.failures if r.tensor == "lse")
    assert "each merge's lse too large by lse_b - lse_a where lse_b > lse_a, right elsewhere" in \
        lse_row.diagnosis.sentence, lse_row.diagnosis.sentence


def _raises(out_a, lse_a, out_b, lse_b):
    raise RuntimeError("no kernel for D = 16")


def _float64_out(out_a, lse_a, out_b, lse_b):
    out, lse = ex.merge(out_a, lse_a, out_b, lse_b)
    return out.double(), lse


def _detached(out_a, lse_a, out_b, lse_b):
    return tuple(t.detach() for t in ex.merge(out_a, lse_a, out_b, lse_b))


def _out_alone(out_a, lse_a, out_b, lse_b):
    return ex.merge(out_a, lse_a, out_b, lse_b)[0]


def _three(out_a, lse_a, out_b, lse_b):
    return (*ex.merge(out_a, lse_a, out_b, lse_b), out_a)


def _in_place(out_a, lse_a, out_b, lse_b):
    out, lse = ex.merge(out_a, lse_a, out_b, lse_b)
    out_a.data.zero_()
    return out, lse


@pytest.mark.parametrize("fn, tensors, reason", [
    (_raises, merge_check.TENSORS, "raised RuntimeError: no kernel for D = 16"),
    (_float64_out, merge_check.TENSORS, "out is (2, 3, 17, 64) float64 on cpu; expected (2, 3, 17, 64) float32"),
    (_detached, ("dout_parts", "dlse_parts"), "no gradient"),
    (_in_place, merge_check.TENSORS, "changed its inputs in place"),
    (_out_alone, merge_check.TENSORS, "returned Tensor, not a pair (out, lse) of tensors"),
    (_three, merge_check.TENSORS, "returned tuple, not a pair (out, lse) of tensors"),
])
def test_a_merge_that_crashes_or_cheats_fails_with_the_reason(fn, tensors, reason):
    report = merge_check.check_merge(fn, dtypes=["float32"])
    first = [r for r in report.rows if r.case == merge_check.CASES[0].name]
    assert {r.tensor for r in first if r.failed} == set(tensors)
    assert all(r.note.startswith(reason) for r in first if r.failed)


def test_check_with_merge_true_dispatches():
    report = parity_tests.check(ex.merge, merge=True, dtypes="float32")
    assert report.passed and report.rows[0].tensor == "out"
    assert "merge of partial states" in report.summary()


def test_the_command_exit_statuses_and_json(tmp_path, capsys):
    path = tmp_path / "merge.json"
    assert cli.main(["check", "--merge", f"{EXAMPLES}:merge", "--dtype", "float32", "--json", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["case", "dtype", "tensor", "error", "baseline"]
    data = json.loads(path.read_text())
    assert data["summary"]["passed"] is True and len(data["rows"]) == 4 * len(merge_check.CASES)
    assert {"target", "case", "dtype", "tensor", "error", "bound", "passed", "diagnosis"} <= set(data["rows"][0])
    assert cli.main(["check", "--merge", f"{EXAMPLES}:merge_base2", "--dtype", "float32", "-q",
                     "--json", str(path)]) == 1
    out = capsys.readouterr().out
    assert "lse in base 2: multiply by ln 2" in out
    assert json.loads(path.read_text())["summary"]["diagnosis"] == "lse-base-2"


@pytest.mark.parametrize("argv, says", [
    (["sdpa-math", "--merge", f"{EXAMPLES}:merge"], "either TARGET or --merge"),
    (["--merge", f"{EXAMPLES}:merge", "--tokens", "17"], "--tokens"),
    (["--merge", "sdpa-math"], "module.path:callable"),
    (["--merge", f"{EXAMPLES}:nothing"], "has no attribute"),
    (["--merge", f"{EXAMPLES}:merge", "--dtype", "int8"], "dtypes must be among"),
])
def test_the_command_refuses_bad_arguments_with_status_2(argv, says, capsys):
    assert cli.main(["check", *argv]) == 2
    assert says in capsys.readouterr().err


def test_inputs_are_rounded_once_and_the_golden_is_their_float64_merge():
    case = merge_check.CASES[3]                                   # empty partials
    states, dout, dlse = merge_check.draw_case(case, 0)
    assert any(np.isnan(o).any() for o, _ in states) and any(np.isneginf(l).any() for _, l in states)
    t_states, t_dout, t_dlse = merge_check.rounded(states, dout, dlse, "bfloat16")
    assert t_states[0][0].dtype == torch.bfloat16 and t_states[0][1].dtype == torch.float32
    out, lse, dout_parts, dlse_parts = merge_check.golden(t_states, t_dout, t_dlse, case.order)
    assert np.isfinite(out).all() and np.isfinite(dout_parts).all() and np.isfinite(dlse_parts).all()
    assert dout_parts.shape == (case.parts,) + out.shape


def _lse_updated_before_out(out_a, lse_a, out_b, lse_b):
    """ring-flash-attention's sigmoid update with its two lines swapped: lse merged first, then
    out = out_a - sigmoid(lse_b - lse)(out_a - out_b) with that merged lse."""
    out, lse = ex.merge(out_a, lse_a, out_b, lse_b)
    both = torch.isfinite(lse_a) & torch.isfinite(lse_b)
    w = torch.sigmoid(torch.where(both, lse_b - lse, 0.0)).unsqueeze(-1).to(out_a.dtype)
    return torch.where(both.unsqueeze(-1), out_a - w * (out_a - out_b), out), lse


def test_a_weight_taken_from_the_merged_lse_is_named_with_its_piece():
    report = merge_check.check_merge(_lse_updated_before_out, dtypes=["float32"])
    assert not report.passed and report.diagnosis == "merged-lse-weight", str(report)
    out_row = next(r for r in report.failures if r.tensor == "out")
    assert "b's weight sigmoid(lse_b - lse) taken from the merged lse, where sigmoid(lse_b - lse_a) is meant" in \
        out_row.diagnosis.sentence, out_row.diagnosis.sentence


def test_b_s_output_gradient_weighed_by_a_s_weight_is_named():
    report = merge_check.check_merge(ex.merge_dout_b_weighed_by_a, dtypes=["float32"])
    assert not report.passed and report.diagnosis == "merge-dout-weight", str(report)
    douts = [r for r in report.failures if r.tensor == "dout_parts" and "empty" not in r.case]
    assert douts and all(r.diagnosis.id == "merge-dout-weight" and "dout_b = w_a dout where w_b dout is meant"
                         in r.diagnosis.sentence for r in douts), [r.diagnosis.sentence for r in douts]
    assert all(r.passed for r in report.rows if r.tensor in ("out", "lse"))


def test_the_merged_lse_s_gradient_handed_to_each_piece_whole_is_named():
    report = merge_check.check_merge(ex.merge_dlse_unweighted, dtypes=["float32"])
    assert not report.passed and ids(report) == {"dlse-unweighted"}, str(report)
    assert {r.tensor for r in report.failures} == {"dlse_parts"}
    assert "d lse / d lse_x is w_x, not 1" in report.failures[0].diagnosis.sentence
