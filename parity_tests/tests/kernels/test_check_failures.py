"""A callable that raises, exits, or returns the wrong dtype or device FAILS with what
happened; "not supported" is only a declared refusal (``targets.Unsupported``)."""

import pytest

import parity_tests
from parity_tests import cli
from parity_tests.kernels import targets
import crashing_kernels as bad

ONE = dict(dtypes=["float32"], head_dims=[16], heads=[2], batch=[1], causal="no")


def _verdicts(report):
    return {(r.case.split()[0] if " " in r.case else r.case, r.tensor): (r.verdict, r.note)
            for r in report.rows}


def test_a_forward_that_raises_on_some_cases_fails_them():
    report = parity_tests.check(bad.forward_crashes_on_long_keys, tokens=["17", "45x113"], **ONE)
    assert not report.passed
    long = [r for r in report.rows if r.dims["tk"] == 113]
    assert {r.verdict for r in long} == {"FAIL"}
    assert all(r.note == "raised RuntimeError: no tile for Tk = 113" for r in long)
    assert {r.verdict for r in report.rows if r.dims["tk"] == 17} == {"pass"}


@pytest.mark.parametrize("kernel, note", [
    (bad.backward_crashes, "backward raised RuntimeError: backward not written yet"),
    (bad.detached, "no gradient reached q: the output does not require grad"),
])
def test_a_backward_that_cannot_run_fails_the_gradients(kernel, note):
    report = parity_tests.check(kernel, tokens=["17"], **ONE)
    rows = {r.tensor: r for r in report.rows}
    assert rows["out"].verdict == "pass" and not report.passed
    assert all(rows[n].verdict == "FAIL" for n in ("dq", "dk", "dv"))
    assert rows["dq"].note.startswith(note)


@pytest.mark.parametrize("kernel, note", [
    (bad.scales_q_in_place, "raised RuntimeError: a leaf Variable that requires grad"),
    (bad.not_implemented, "raised NotImplementedError: head_dim 16 is not supported"),
    (bad.exits, "called sys.exit(3)"),
    (bad.computes_in_float64, "wrong dtype: output float64, expected float32"),
    (bad.on_the_meta_device, "wrong device: output meta, expected cpu"),
])
def test_a_kernel_that_raises_or_returns_the_wrong_kind_fails_every_row(kernel, note):
    report = parity_tests.check(kernel, tokens=["17"], **ONE)
    assert {r.verdict for r in report.rows} == {"FAIL"} and not report.passed
    assert all(r.note.startswith(note) for r in report.rows), report.rows[0].note


def test_a_wrong_dtype_fails_in_bfloat16_too():
    report = parity_tests.check(bad.computes_in_float64, tokens=["17"], **{**ONE, "dtypes": ["bfloat16"]})
    assert {r.verdict for r in report.rows} == {"FAIL"}
    assert report.rows[0].note == "wrong dtype: output float64, expected bfloat16"


def test_only_a_declared_refusal_is_not_supported():
    def declares(q, k, v, *, causal, scale):
        raise targets.Unsupported("head_dim 16: this kernel takes 64 or 128")
    report = parity_tests.check(declares, tokens=["17"], **ONE)
    assert {r.verdict for r in report.rows} == {"not supported"} and not report.passed
    assert report.rows[0].note == "head_dim 16: this kernel takes 64 or 128"


def test_sys_exit_in_a_kernel_is_a_failing_row_and_exit_1(capsys):
    status = cli.main(["check", "crashing_kernels:exits", "--tokens", "17", "--head-dim", "16",
                       "--dtype", "float32", "--causal", "no", "-q"])
    out = capsys.readouterr().out
    assert status == 1
    assert "FAIL (called sys.exit(3))" in out
    assert out.splitlines()[-1].startswith("crashing_kernels:exits: 4 rows, 0 pass, 4 FAIL")
