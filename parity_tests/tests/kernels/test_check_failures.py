"""A callable that raises, exits, or returns the wrong dtype or device FAILS with what
happened; "not supported" is only a declared refusal (``targets.Unsupported``)."""

import pytest
import torch

import parity_tests
from parity_tests import cli
from parity_tests.kernels import targets
import crashing_kernels as bad

pytestmark = pytest.mark.usefixtures("without_input_classes")   # (conftest.py)

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


@pytest.mark.parametrize("kernel, features, note", [
    (bad.scales_q_in_place, [], "raised RuntimeError: a "),     # a leaf, or a view of one, that requires grad
    (bad.not_implemented, [], "raised NotImplementedError: head_dim 16 is not supported"),
    (bad.exits, [], "called sys.exit(3)"),
    (bad.computes_in_float64, [], "wrong dtype: output float64, expected float32"),
    (bad.on_the_meta_device, [], "wrong device: output meta, expected cpu"),
    (bad.returns_a_tuple, [], "returned tuple, expected a tensor"),
    (bad.returns_none, [], "returned NoneType, expected a tensor"),
    (bad.returns_numpy, [], "returned ndarray, expected a tensor"),
    (bad.returns_a_scalar, [], "wrong shape: output ()"),
    (bad.returns_out_alone, ["lse"], "with lse the target must return (out, lse), got Tensor"),
    (bad.returns_three, ["lse"], "with lse the target must return (out, lse), got tuple"),
    (bad.returns_lse_of_the_wrong_shape, ["lse"], "wrong lse: ("),          # (B, T, H) for (B, H, T)
    (bad.returns_lse_as_a_list, ["lse"], "wrong lse: list, expected shape ("),
    (bad.returns_lse_in_integers, ["lse"], "wrong lse dtype: torch.int32"),
], ids=lambda x: x.__name__ if callable(x) else None)
def test_a_kernel_that_raises_or_returns_the_wrong_kind_fails_every_row(kernel, features, note):
    report = parity_tests.check(kernel, tokens=["17"], features=features, **ONE)
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
    rows = len(parity_tests.check(bad.exits, tokens=["17"], head_dims=[16], dtypes=["float32"], causal="no").rows)
    assert out.splitlines()[-1].startswith(f"crashing_kernels:exits: {rows} rows, 0 pass, {rows} FAIL")


def test_a_report_whose_rows_all_failed_does_not_say_nothing_was_checked(capsys):
    report = parity_tests.check(bad.computes_in_float64, tokens=["17"], **ONE)
    assert "nothing was checked" not in str(report)
    assert cli.main(["check", "crashing_kernels:computes_in_float64", "--tokens", "17", "--head-dim",
                     "16", "--dtype", "float32", "--causal", "no", "-q"]) == 1
    assert "nothing was checked" not in capsys.readouterr().out


def test_a_report_of_only_refusals_says_nothing_was_checked():
    report = parity_tests.check("torch_impl-fused", dtypes=["float32"], tokens=["17"], causal="no")
    assert "nothing was checked" in str(report) and not report.passed


def test_a_closure_is_named_by_its_plain_function_name():
    def make():
        def attention(q, k, v, *, causal, scale):
            return bad.sdpa(q, k, v, causal=causal, scale=scale)
        return attention
    report = parity_tests.check(make(), tokens=["17"], **ONE)
    assert report.target == "attention" and report.rows[0].target == "attention"


def test_a_report_that_names_no_mistake_has_diagnosis_none():
    def off_by_a_constant(q, k, v, *, causal, scale):
        return bad.sdpa(q, k, v, causal=causal, scale=scale) + 0.2
    report = parity_tests.check(off_by_a_constant, tokens=["17"], **ONE)
    assert report.failures[0].diagnosis.id == "none"
    assert report.diagnosis is None                      # None, not the string 'none'
    assert report.as_dict()["summary"]["diagnosis"] is None


def test_a_kernel_that_hangs_fails_the_case_on_time():
    report = parity_tests.check(bad.hangs, tokens=["17"], timeout=0.1, **ONE)
    assert {r.verdict for r in report.rows} == {"FAIL"} and not report.passed
    assert report.rows[0].note == "timed out after 0.1 s"
    assert report.seconds < 30                           # the loop was stopped, not waited out


def test_timeout_on_the_command_line(capsys):
    argv = ["check", "crashing_kernels:hangs", "--tokens", "17", "--head-dim", "16", "--dtype",
            "float32", "--causal", "no", "-q", "--timeout", "0.1"]
    assert cli.main(argv) == 1
    assert "FAIL (timed out after 0.1 s)" in capsys.readouterr().out
    for bad_value in ("-1", "soon", "nan", "inf"):
        assert cli.main([*argv[:-1], bad_value]) == 2
        assert "--timeout" in capsys.readouterr().err
    with pytest.raises(ValueError, match="timeout must be a number of seconds"):
        parity_tests.check(bad.sdpa, tokens=["17"], timeout="soon", **ONE)


def test_a_time_limit_leaves_an_outer_alarm_in_place():
    import signal
    from parity_tests.kernels import runner
    if not hasattr(signal, "setitimer"):
        pytest.skip("no SIGALRM here")
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    signal.setitimer(signal.ITIMER_REAL, 60.0)
    try:
        with runner.time_limit(5.0):
            pass
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 50.0 < remaining <= 60.0 and signal.getsignal(signal.SIGALRM) is not signal.SIG_DFL
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert not fired


def _nan_rows(rows):
    def kernel(q, k, v, *, causal, scale):
        out = bad.sdpa(q, k, v, causal=causal, scale=scale)
        return out.index_fill(-2, torch.tensor(rows), float("nan")) if rows else out * float("nan")
    return kernel


@pytest.mark.parametrize("rows, said", [
    ([], "out has 544 NaN and 0 infinite entries of 544, in query rows 0 .. 16"),
    ([5], "out has 32 NaN and 0 infinite entries of 544, in query rows 5 (first at (b, h, row) = (0, 0, 5))"),
])
def test_nan_is_counted_and_located_not_called_dropout(rows, said):
    report = parity_tests.check(_nan_rows(rows), tokens=["17"], **ONE)
    out = report.failures[0]
    assert out.tensor == "out" and out.diagnosis.id == "non-finite"
    assert out.diagnosis.sentence.startswith(said), out.diagnosis.sentence
    assert "dropout" not in str(report)


def test_rows_that_see_no_key_are_said_to_expect_zeros():
    def my_attention(q, k, v, *, causal, scale):            # the README's, in (B, H, T, D)
        scores = (q @ k.transpose(-2, -1)) * scale
        tq, tk = scores.shape[-2:]
        seen = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)
        return torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1) @ v
    report = parity_tests.check(my_attention, tokens=["45x20"], align="bottom-right",
                                **{**ONE, "causal": "yes"})
    out = next(r for r in report.failures if r.tensor == "out")
    sentence = out.diagnosis.sentence
    assert out.diagnosis.id == "non-finite" and "in query rows 0 .. 24" in sentence
    assert ("query rows 0 .. 24 see no key (bottom-right causal mask with Tq = 45 > Tk = 20): the check "
            "expects zeros there, as SDPA and FlashAttention return") in sentence
    assert "dropout" not in str(report)


@pytest.mark.parametrize("kernel, tensor", [(bad.returns_infinity, "out"), (bad.nan_gradients, "dq")],
                         ids=["infinite-out", "nan-gradients"])
def test_a_kernel_returning_non_finite_values_fails_them_named(kernel, tensor):
    report = parity_tests.check(kernel, tokens=["17"], **ONE)
    row = next(r for r in report.rows if r.tensor == tensor)
    assert row.verdict == "FAIL" and row.diagnosis.id == "non-finite", row.diagnosis
    assert not report.passed

