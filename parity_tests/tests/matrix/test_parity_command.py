"""``attention-parity`` (the default verb): table, summary, JSON, exit statuses."""

import json
import runpy
import sys

import pytest
import torch

from parity_tests import cli
from parity_tests.matrix import harness
from parity_tests.matrix import run as run_parity

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_default_run_passes_and_prints_a_table_and_summary(capsys):
    assert cli.main(["--module", "CausalAttention"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:7] == ["module", "config", "mode", "dtype", "device", "check", "tensor"]
    assert any("W_query.weight" in line and line.rstrip().endswith("pass") for line in lines)
    assert "FAIL" not in out
    summary = lines[-1]
    assert summary.startswith(f"{len(lines) - 4} rows, {len(lines) - 4} passed, 0 failed in ")
    assert "(cpu; float64, float32)" in summary


def test_json_has_the_contract_shape(tmp_path, capsys):
    path = tmp_path / "parity.json"
    assert run_parity.main(["--quiet", "--module", "MultiHeadAttention", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert set(report) == {"rows", "summary"}
    row = report["rows"][0]
    for key in ("module", "config", "dtype", "device", "tensor", "error", "bound", "passed",
                "where", "mode", "check", "baseline"):
        assert key in row
    assert isinstance(row["passed"], bool) and isinstance(row["error"], float)
    tensors = {r["tensor"] for r in report["rows"]}
    assert {"output", "input", "W_query.weight", "out_proj.bias", "mask"} <= tensors
    assert {r["dtype"] for r in report["rows"]} == {"float64", "float32"}
    summary = report["summary"]
    assert summary["rows"] == len(report["rows"]) == summary["passed"] and summary["failed"] == 0
    assert summary["devices"] == ["cpu"] and summary["fault"] is None


def test_dtype_accepts_commas_repeats_and_aliases(tmp_path, capsys):
    path = tmp_path / "p.json"
    args = ["-q", "--module", "SelfAttention_v2", "--json", str(path)]
    assert run_parity.main(args + ["--dtype", "bf16,float64", "--dtype", "fp16"]) == 0
    rows = json.loads(path.read_text())["rows"]
    lacks = harness.unsupported_dtype("float16", "cpu")             # float16 before PyTorch 2.2
    assert {r["dtype"] for r in rows} == {"bfloat16", "float64"} | ({"float16"} if lacks is None else set())
    assert lacks is None or f"skipping float16 on cpu ({lacks})" in capsys.readouterr().err
    checks = {(r["dtype"], r["check"]) for r in rows}
    assert ("bfloat16", "torch vs golden") in checks and ("float64", "numpy vs torch") in checks


@pytest.mark.parametrize("args, message", [
    (["--dtype", "float8"], "--dtype must be among"),
    (["--module", "Attention"], "--module must be among"),
    (["--device", "tpu"], "invalid choice"),
])
def test_bad_arguments_exit_2_with_a_message(args, message, capsys):
    assert run_parity.main(args) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_without_a_gpu_is_a_clear_error(capsys):
    assert run_parity.main(["--device", "cuda"]) == 2
    assert "no CUDA device is available" in capsys.readouterr().err


def test_help_documents_faults_and_exit_statuses(capsys):
    assert run_parity.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--plant-fault" in out and "--list-faults" in out and "Exit status" in out


def test_list_faults(capsys):
    from parity_tests.common import faults
    assert run_parity.main(["--list-faults"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in faults.names())


def test_python_dash_m_runs_the_matrix(monkeypatch, capsys):
    """``python -m parity_tests`` (the contract's entry point) exits with main's status."""
    monkeypatch.setattr(sys, "argv", ["parity_tests", "--module", "SimplifiedSelfAttention", "-q"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("parity_tests", run_name="__main__")
    assert done.value.code == 0
    assert " passed, 0 failed in " in capsys.readouterr().out


@pytest.mark.cuda
@needs_cuda
def test_command_on_cuda_with_low_precision(tmp_path, capsys):
    dtypes = ["float64", "float32", "float16"] + (
        ["bfloat16"] if harness.dtype_supported("bfloat16", "cuda") else [])
    path = tmp_path / "cuda.json"
    status = run_parity.main(["-q", "--device", "cuda", "--dtype", ",".join(dtypes),
                              "--json", str(path)])
    report = json.loads(path.read_text())
    assert status == 0, run_parity.format_rows([r for r in report["rows"] if not r["passed"]])
    assert {r["device"] for r in report["rows"]} == {"cuda"}
    assert {r["dtype"] for r in report["rows"]} == set(dtypes)


@pytest.mark.cuda
@needs_cuda
def test_device_all_includes_cuda(tmp_path, capsys):
    path = tmp_path / "all.json"
    assert run_parity.main(["-q", "--device", "all", "--module", "MultiHeadAttention",
                            "--json", str(path)]) == 0
    assert {r["device"] for r in json.loads(path.read_text())["rows"]} == {"cpu", "cuda"}


def _summary_counts(out):
    """(rows, passed, failed) from the printed summary line."""
    line = next(l for l in out.splitlines()[::-1] if " rows, " in l)
    words = line.replace(",", "").split()
    return int(words[0]), int(words[2]), int(words[4])


def test_device_all_on_a_cpu_only_machine_runs_the_cpu(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = tmp_path / "all.json"
    assert run_parity.main(["--device", "all", "--module", "CausalAttention",
                            "--json", str(path)]) == 0
    out, err = capsys.readouterr()
    report = json.loads(path.read_text())
    assert report["summary"]["devices"] == ["cpu"]
    assert {r["device"] for r in report["rows"]} == {"cpu"} and report["rows"]
    assert "(cpu; float64, float32)" in out.splitlines()[-1] and "cuda" not in err


@pytest.mark.parametrize("fault", [None, "bias-grad-first-batch"])
def test_summary_counts_match_the_rows(fault, tmp_path, capsys):
    """The printed summary, the JSON summary and the rows themselves agree, with and
    without failing rows."""
    path = tmp_path / "rows.json"
    args = ["--module", "CausalAttention", "--json", str(path)]
    status = run_parity.main(args + (["--plant-fault", fault] if fault else []))
    out = capsys.readouterr().out
    report = json.loads(path.read_text())
    rows = report["rows"]
    failed = sum(not r["passed"] for r in rows)
    assert status == (1 if fault else 0) and (failed > 0) == bool(fault)
    expected = (len(rows), len(rows) - failed, failed)
    assert _summary_counts(out) == expected
    s = report["summary"]
    assert (s["rows"], s["passed"], s["failed"]) == expected
    table = out.split("\n\n")[1 if fault else 0].splitlines()[2:]   # after the planted-fault line
    assert len(table) == len(rows)                                    # one printed line per row
    assert sum(line.rstrip().endswith("pass") for line in table) == len(rows) - failed
    if fault:
        assert f"failing rows ({failed}):" in out
