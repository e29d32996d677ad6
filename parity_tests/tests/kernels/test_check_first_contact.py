"""What a new user meets first: a convention said once with the flag that fixes it, a file path
as a target, ``--json -``, ``str(report)`` and a printed row from Python, an infinite error in
the JSON."""

import json

import numpy as np
import pytest

import parity_tests
from parity_tests import cli
from parity_tests.kernels.diagnosis.diagnose import Diagnosis
from parity_tests.kernels.report import Report
from parity_tests.kernels.row import Row

SMALL = dict(tokens=["45x77", "17"], head_dims=[16], heads=[2], batch=[1], dtypes=["float32"])


def test_a_bottom_right_kernel_checked_top_left_is_told_the_flag_once():
    report = parity_tests.check(parity_tests.mistake("other-alignment"), **SMALL)
    assert not report.passed and len(report.failures) > 1
    lines = report.diagnosis_lines()
    assert len(lines) == 1
    assert f"every failing row ({len(report.failures)} of {len(report.rows)}) matches one convention: " \
           "bottom-right causal alignment (the check assumed top-left)" in lines[0]
    assert 'rerun with --align bottom-right (from Python: align="bottom-right")' in lines[0]
    assert str(report).count("rerun with --align") == 1
    fixed = parity_tests.check(parity_tests.mistake("other-alignment"), align="bottom-right", **SMALL)
    assert fixed.passed, str(fixed)


def test_failures_of_several_causes_keep_their_own_lines():
    rows = [_row("out", "other-alignment", "out matches the reference with bottom-right causal alignment"),
            _row("dq", "dq-missing-scale", "dq matches the reference with dq missing the scale")]
    report = Report("k", rows, settings={"align": "top-left"})
    assert report.convention() is None and len(report.diagnosis_lines()) == 2


@pytest.mark.parametrize("hid, fix", [("layout-bthd-as-bhtd", "rerun with --layout bthd"),
                                      ("lse-base-2", "lse is the natural log"),
                                      ("scale-ignored", "use the scale argument")])
def test_each_convention_names_its_fix(hid, fix):
    report = Report("k", [_row("out", hid, f"out matches the reference with {hid} to 1e-9 (bound 1e-6)")] * 3,
                    settings={"align": "top-left"})
    assert fix in report.convention() and "to 1e-9" not in report.convention()


@pytest.mark.slow                     # 1.4 s
def test_a_window_without_causal_mask_does_not_speak_of_one():
    report = parity_tests.check(parity_tests.mistake("window-other-alignment"), features=["window"],
                                causal="no", **SMALL)
    said = [d.sentence for _, d in report.diagnoses if d.id == "window-other-alignment"]
    assert said and not any("causal mask" in s for s in said), said
    assert all("(the check: top-left)" in s or "(the check: bottom-right)" in s for s in said), said


def _row(tensor, hid, sentence, error=1.0, diagnosis=True):
    d = Diagnosis(hid, sentence, error_map=np.ones((64, 8))) if diagnosis else None
    return Row(target="k", case="B1 H2 T17 D16 causal", dims={"tk": 17}, dtype="float32", device="cpu",
               tensor=tensor, error=error, bound=1e-6, verdict="FAIL", diagnosis=d, split={"wall": 1.0})


def test_str_of_a_report_points_to_python_and_the_command_to_json():
    rows = [_row("out", "no-scale" if i % 2 else "scale-1/D", f"out matches the reference with {i}") for i in range(45)]
    report = Report("k", rows, settings={"align": "top-left"})
    text = str(report)
    assert "... and 5 more (all of them in report.failures, or report.as_dict())" in text
    assert "--json" not in text
    assert "(all of them in --json)" in report.render()


def test_a_row_prints_in_one_short_line():
    row = _row("dq", "no-scale", "dq matches the reference with no scale")
    shown = repr(row)
    assert shown == "<Row k B1 H2 T17 D16 causal float32 cpu dq: error 1.0e+00, bound 1.0e-06, FAIL; no-scale>"
    assert "array" not in repr(row.diagnosis)


def test_an_infinite_error_is_not_written_as_not_measured():
    infinite = _row("out", "non-finite", "out is NaN", error=float("inf")).as_dict()
    unmeasured = Row(target="k", case="c", dims={}, dtype="float32", device="cpu", tensor="out",
                     verdict="not supported").as_dict()
    assert infinite["error"] == "inf" and infinite["ratio"] == "inf"
    assert unmeasured["error"] is None
    assert json.loads(json.dumps(infinite))["error"] == "inf"


KERNEL = """import torch.nn.functional as F


def attention(q, k, v, *, causal, scale):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
"""


def test_a_file_path_is_a_target(tmp_path, capsys, monkeypatch):
    path = tmp_path / "mykernels.py"
    path.write_text(KERNEL)
    monkeypatch.chdir(tmp_path.parent)
    report = parity_tests.check(f"{path}:attention", tokens=["17"], head_dims=[16], dtypes=["float32"], causal="yes")
    assert report.passed and report.target == f"{path}:attention"
    assert cli.main(["check", f"{path}:attention", "--tokens", "17", "--head-dim", "16", "--dtype", "float32",
                     "--causal", "yes", "-q"]) == 0
    capsys.readouterr()
    assert cli.main(["check", f"{tmp_path / 'absent.py'}:attention"]) == 2
    assert f"no file {tmp_path / 'absent.py'}" in capsys.readouterr().err


def test_json_dash_is_standard_output(capsys):
    status = cli.main(["check", "sdpa-math", "--tokens", "17", "--head-dim", "16", "--dtype", "float32",
                       "--causal", "yes", "-q", "--json", "-"])
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert status == 0 and data["summary"]["passed"] is True and data["rows"]
    assert "sdpa-math: " in err


def test_the_causal_masks_and_the_windows_alignment_are_one_flag():
    rows = [_row("out", "other-alignment", "out matches the reference with bottom-right causal alignment "
                 "(the check assumed top-left) to 1e-9 (bound 1e-6)"),
            _row("dq", "window-other-alignment", "dq matches the reference with the window placed bottom-right "
                 "(the causal mask and the check: top-left) to 1e-9 (bound 1e-6)")]
    said = Report("k", rows, settings={"align": "top-left"}).convention()
    assert said == ("every failing row (2 of 2) matches one convention: bottom-right alignment, of the causal mask "
                    "and the windows (the check assumed top-left); rerun with --align bottom-right (from Python: "
                    'align="bottom-right")')


def test_a_no_grad_kernel_is_checked_on_its_forward_with_forward_only():
    import torch
    import torch.nn.functional as F

    @torch.no_grad()
    def decode(q, k, v, *, causal, scale):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    small = dict(tokens=["17"], head_dims=[16], dtypes=["float32"], causal="yes")
    as_is = parity_tests.check(decode, **small)
    assert not as_is.passed and all("no gradient reached" in r.note for r in as_is.failures)
    report = parity_tests.check(decode, forward_only=True, **small)
    assert report.passed, str(report)
    assert {r.tensor for r in report.rows if r.passed} == {"out"}
    assert {r.note for r in report.unsupported} == {"forward only: forward only (forward_only=True)"}
    with pytest.raises(TypeError, match="forward_only must be True or False"):
        parity_tests.check(decode, forward_only="yes", **small)
    with pytest.raises(ValueError, match="forward_only applies to a kernel target"):
        parity_tests.check(decode, forward_only=True, world_size=2)


def test_forward_only_still_fails_a_wrong_forward():
    report = parity_tests.check(parity_tests.mistake("no-scale"), forward_only=True, tokens=["17"], head_dims=[16],
                                dtypes=["float32"], causal="yes")
    assert not report.passed and report.diagnosis == "no-scale"
    assert {r.tensor for r in report.failures} == {"out"}


def test_the_command_takes_forward_only(tmp_path, capsys, monkeypatch):
    (tmp_path / "infer.py").write_text("import torch\nimport torch.nn.functional as F\n\n\n@torch.no_grad()\n"
                                       "def decode(q, k, v, *, causal, scale):\n"
                                       "    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, "
                                       "scale=scale)\n")
    small = ["--tokens", "17", "--head-dim", "16", "--dtype", "float32", "--causal", "yes", "-q"]
    target = f"{tmp_path / 'infer.py'}:decode"
    assert cli.main(["check", target, *small]) == 1
    assert cli.main(["check", target, "--forward-only", *small]) == 0
    assert "7 pass, 0 FAIL, 21 not supported" in capsys.readouterr().out
    assert cli.main(["check", target, "--forward-only", "--world-size", "2"]) == 2
    assert "--forward-only applies to a kernel target" in capsys.readouterr().err
