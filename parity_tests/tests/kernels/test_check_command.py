"""``attention-parity check``: the table, --json, exit statuses, the reference pieces."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import parity_tests
from parity_tests import cli
from parity_tests.kernels import cases, dense, run, runner
from parity_tests.kernels.features import parse_features
from parity_tests.common import tolerances as tol

SMALL = ["--tokens", "17,45x77", "--head-dim", "16", "--heads", "2"]


def test_a_passing_target_exits_0_with_rows_and_json(tmp_path, capsys):
    path = tmp_path / "check.json"
    assert cli.main(["check", "sdpa-math", *SMALL, "--json", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["case", "dtype", "tensor", "error", "baseline"]
    # (2 lengths x 2 causal + the 7 cases every run draws, variations.py) x 4 tensors x 2 dtypes
    assert lines[-1].startswith("sdpa-math: 88 rows, 88 pass, 0 FAIL, 0 not supported")
    report = json.loads(path.read_text())
    row = report["rows"][0]
    for key in ("target", "case", "dtype", "device", "tensor", "error", "baseline", "bound",
                "ratio", "verdict", "passed", "where", "diagnosis"):
        assert key in row
    assert report["summary"]["passed"] is True and report["summary"]["factor"] == tol.CHECK_FACTOR


def test_a_failing_user_target_exits_1_with_its_diagnosis(tmp_path, capsys):
    path = tmp_path / "check.json"
    status = cli.main(["check", "parity_tests.kernels.planted.chapter:no_scale", *SMALL, "--dtype", "float32", "-q",
                       "--json", str(path)])
    out = capsys.readouterr().out
    assert status == 1
    assert "out matches the reference with no scale (1 instead of 1/sqrt(D)) to" in out
    failing = [r for r in json.loads(path.read_text())["rows"] if not r["passed"]]
    assert failing and all(r["diagnosis"]["id"] == "no-scale" for r in failing)


@pytest.mark.parametrize("argv", [
    ["nosuchtarget"], ["nomodule.anywhere:fn"], ["sdpa-math", "--tokens", "12y4"],
    ["sdpa-math", "--dtype", "float8"], ["sdpa-math", "--heads", "0"],
    ["sdpa-math", "--layout", "bthd"], ["sdpa-math", "--causal", "maybe"], [],
])
def test_bad_arguments_exit_2(argv, capsys):
    assert cli.main(["check", *argv]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_without_a_gpu_exits_2(capsys):
    assert cli.main(["check", "sdpa-math", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_help_lists_the_builtin_targets(capsys):
    assert cli.main(["check", "--help"]) == 0
    text = capsys.readouterr().out
    for name in ("sdpa-math", "sdpa-flash", "sdpa-efficient", "torch_impl-mha", "flex", "module.path:callable"):
        assert name in text


def test_importing_the_package_imports_no_torch():
    code = "import parity_tests, sys; assert 'torch' not in sys.modules; print(callable(parity_tests.check))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=".")
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr


def _dense(q, k, v, dout, scale, offset):
    """The plain float64 formulas, for rows that see at least one key."""
    S = q @ k.swapaxes(-1, -2) * scale
    i, j = np.arange(q.shape[-2])[:, None], np.arange(k.shape[-2])[None, :]
    S = np.where(j <= i + offset, S, -np.inf)
    P = np.exp(S - S.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    out = P @ v
    dS = P * (dout @ v.swapaxes(-1, -2) - (dout * out).sum(-1, keepdims=True))
    return out, dS @ k * scale, dS.swapaxes(-1, -2) @ q * scale, P.swapaxes(-1, -2) @ dout


def test_golden_pads_rows_that_see_no_key_with_zeros():
    case = cases.Case(1, 2, 9, 4, 8, True)            # bottom-right: rows 0..4 see nothing
    inputs = runner.draw(case)
    q, k, v, dout = (inputs[n] for n in ("q", "k", "v", "dout"))
    offset = case.offset("bottom-right")
    gold = runner.golden(inputs, runner.reference_options(case, "bottom-right", inputs))
    assert np.all(gold["out"][..., :5, :] == 0) and np.all(gold["dq"][..., :5, :] == 0)
    want = _dense(q[..., 5:, :], k, v, dout[..., 5:, :], case.scale, offset + 5)
    for got, exp in zip((gold["out"][..., 5:, :], gold["dq"][..., 5:, :], gold["dk"], gold["dv"]), want):
        np.testing.assert_allclose(got, exp, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("features", [(), (("bias", (1, 2, 70, 50)), ("sinks", "large")),
                                      (("bias", (2, 1, 1, 50)), ("alibi", True), ("window", (9, 3))),
                                      (("varlen", ((70, 33), (50, 12))),)], ids=str)
def test_baseline_in_chunks_is_the_dense_computation(features, monkeypatch):
    case = cases.Case(2, 2, 70, 50, 8, True, features)
    inputs = runner.draw(case, wanted=("lse_grad",))
    opts = runner.reference_options(case, "bottom-right", inputs)
    whole = runner.baseline(inputs, opts, "float64", "cpu")
    monkeypatch.setattr(dense, "CHUNK_ELEMENTS", 64 * 50 // 4)       # two chunks: 64 rows, then 6
    chunked = runner.baseline(inputs, opts, "float64", "cpu")
    gold = runner.golden(inputs, opts)
    assert set(whole) == set(chunked) == set(gold)
    for n in gold:
        np.testing.assert_allclose(whole[n], gold[n], rtol=1e-12, atol=1e-12, err_msg=n)
        np.testing.assert_allclose(chunked[n], gold[n], rtol=1e-12, atol=1e-12, err_msg=n)


def test_the_bound_refuses_an_unknown_dtype():
    assert tol.check_bound("float32", 1e-7) == tol.CHECK_FACTOR * 1e-7 + 8 * 2.0 ** -24
    with pytest.raises(ValueError, match="dtype"):
        tol.check_bound("int8", 1e-7)


def test_tokens_parse():
    assert cases.parse_tokens("128x512") == (128, 512) and cases.parse_tokens("7") == (7, 7)
    with pytest.raises(ValueError, match="tokens"):
        cases.parse_tokens("0x4")


def test_small_cases_run_on_one_torch_thread_and_the_count_is_restored(monkeypatch):
    """Below runner.ONE_THREAD_BELOW pairs the whole case (target included) runs on one
    PyTorch thread; a larger case on the process's own count, restored afterwards."""
    import parity_tests
    from parity_tests.kernels import runner
    seen = {}

    def fn(q, k, v, *, causal, scale):
        seen.setdefault(q.shape[-2], set()).add(torch.get_num_threads())
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(runner, "ONE_THREAD_BELOW", 64 * 64)
        assert parity_tests.check(fn, tokens=["17", "64"], head_dims=[16], heads=[1], dtypes=["float32"],
                                  causal="yes").passed
        assert seen[17] == {1} and seen[64] == {2} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_no_timeout_is_no_limit_from_the_python_api():
    """``check(..., timeout=None)`` (as 0) runs with no per-case limit rather than refusing it."""
    assert run._timeout(None) is None and run._timeout(0) is None and run._timeout(3) == 3.0
    report = parity_tests.check("sdpa-math", timeout=None, tokens=[9], head_dims=[8], heads=[1], dtypes="float32",
                                causal="no")
    assert report.passed and report.rows, str(report)


def test_features_given_as_one_comma_separated_string_are_split():
    """``check(features="a,b")`` as the command's ``--features a,b``: names split on commas,
    stripped, dashes read as underscores, repeats dropped, the registry's names kept."""
    assert parse_features("gqa, lse-grad,gqa") == ["gqa", "lse_grad"]
    assert parse_features("window") == ["window"]
    assert parse_features(["gqa", "window"]) == ["gqa", "window"]


def test_zero_by_theory_is_strictly_below_the_floor_of_the_largest_gradient():
    """A gradient is zero by theory when its reference is below SCALE_FLOOR x the case's largest
    gradient (tolerances.py): one just at the floor is measured as any other."""
    dv = np.ones((1, 1, 2, 4))
    gold = lambda dq, dk: {"out": dv, "dq": np.full_like(dv, dq), "dk": np.full_like(dv, dk), "dv": dv}
    floor = tol.SCALE_FLOOR * 1.0
    assert runner.zero_by_theory(gold(0.5 * floor, floor)) == {"dq"}
    assert runner.zero_by_theory(gold(floor, 2 * floor)) == set()
