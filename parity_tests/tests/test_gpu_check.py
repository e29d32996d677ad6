"""``scripts/gpu-check``: the GPU run in one command, tried here through its CPU dry run.

Each step is a subprocess with a deadline; a failing, timed-out or skipped step is
recorded in summary.json and the next one runs; the exit status is 1 when any step
failed.  The whole dry run takes about half a minute and is marked slow (so is the
real run on a machine without CUDA); the default tests run a step or two.
"""

import json
import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check"
EXIT_1 = f"{sys.executable} -c 'import sys; sys.exit(1)'"
SLEEP = f"{sys.executable} -c 'import time; time.sleep(30)'"


def gpu_check(out, *options):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *options], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    summary = json.loads((out / "summary.json").read_text())
    return proc, summary, {s["name"]: s for s in summary["steps"]}


@pytest.mark.slow                     # 2 s of subprocesses
def test_a_failing_step_is_recorded_and_the_next_one_still_runs(tmp_path):
    proc, summary, steps = gpu_check(tmp_path, "--dry-run", "--steps", "matrix", "--inject-step", EXIT_1)
    assert proc.returncode == 1, proc.stderr
    assert [s["name"] for s in summary["steps"]] == ["injected-1", "matrix"]
    assert steps["injected-1"]["status"] == "failed (exit 1)" and steps["injected-1"]["failed"]
    assert steps["matrix"]["status"] == "passed" and not steps["matrix"]["failed"]
    assert summary["failed"] == ["injected-1"] and summary["exit_status"] == 1
    assert summary["matrix"]["failed"] == 0 and summary["matrix"]["worst_ratio"]["float64"] < 1
    for key in ("dry_run", "budget_s", "started", "seconds", "check", "worst_ratio", "check_timing"):
        assert key in summary
    for s in summary["steps"]:
        assert {"command", "exit_code", "seconds", "limit_s", "line"} <= set(s)
    log = (tmp_path / "gpu-check.log").read_text()
    assert "=== injected-1" in log and "--- matrix: passed" in log
    assert "injected-1" in proc.stdout and "1 failed" in proc.stdout       # the printed table


def test_a_step_past_its_limit_is_killed_and_one_without_time_is_skipped(tmp_path):
    start = time.monotonic()
    proc, summary, steps = gpu_check(tmp_path, "--steps", "injected", "--budget", "1.0", "--min-step", "0.4",
                                     *[a for _ in range(3) for a in ("--inject-step", SLEEP)])
    assert time.monotonic() - start < 15
    assert proc.returncode == 1
    assert steps["injected-1"]["status"].startswith("timed out after")
    assert steps["injected-2"]["status"].startswith("timed out after")
    assert steps["injected-3"]["status"] == "skipped: out of time" and not steps["injected-3"]["failed"]


@pytest.mark.slow
def test_without_a_cuda_device_the_real_run_says_so_and_fails(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the real run would run")
    proc, summary, steps = gpu_check(tmp_path, "--steps", "info,matrix")
    assert proc.returncode == 1
    assert summary["device"]["cuda_available"] is False
    assert steps["matrix"]["status"] == "no CUDA device"
    assert "no CUDA device here" in proc.stdout


def test_steps_of_a_parallel_group_share_one_deadline(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from gpu_check_run import Runner, Step
    import io
    import tempfile
    done = []
    with tempfile.TemporaryDirectory() as out:
        runner = Runner(ROOT, pathlib.Path(out), io.StringIO(), time.monotonic() + 0.5, 0.1, {"g": 1}, {"g"}, 3,
                        lambda step, output: done.append(step))
        steps = [Step(f"s{i}", "g", [sys.executable, "-c", "import time; time.sleep(30)"]) for i in range(3)]
        start = time.monotonic()
        runner.run(steps)
    assert time.monotonic() - start < 1.4                        # side by side, not one after another
    assert {s.status[:9] for s in done} == {"timed out"} and len(done) == 3


def test_the_peak_is_the_datasheet_s_or_derived_or_unknown(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from gpu_probe import peak_bf16
    assert peak_bf16("NVIDIA H100 80GB HBM3", (9, 0), 132, 1980)[0] == 989.5
    assert peak_bf16("NVIDIA H100 PCIe", (9, 0), 114, 1755)[0] == 756.5
    tflops, how = peak_bf16("Some GPU", (9, 0), 132, 1830)                # 132 x 1.83 GHz x 4096
    assert tflops == pytest.approx(989.5, rel=1e-3) and how.startswith("derived")
    tflops, how = peak_bf16("Tesla V100", (7, 0), 80, 1530)               # no bf16 tensor cores known
    assert tflops is None and how.startswith("unknown")


def test_the_worst_ratio_is_taken_per_dtype_and_tensor(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gpu_check_figures as figures
    row = lambda dtype, tensor, ratio, case="c": {"dtype": dtype, "tensor": tensor, "ratio": ratio, "case": case}
    rows = [row("bfloat16", "dq", 0.5), row("bfloat16", "dq", 0.9, "long"), row("bfloat16", "out", None),
            row("float16", "dq", 0.2)]
    summary = {"rows": 4, "pass": 3, "fail": 0, "not_supported": 1, "passed": True, "seconds": 1.0}
    (tmp_path / "c.json").write_text(json.dumps({"rows": rows, "summary": summary}))
    found, line = figures.check(tmp_path / "c.json")
    assert found["worst_ratio"] == {"bfloat16": {"dq": 0.9, "out": None}, "float16": {"dq": 0.2}}
    assert found["worst"] == {"ratio": 0.9, "dtype": "bfloat16", "tensor": "dq", "case": "long"}
    assert line == "4 rows, 0 FAIL, 1 not supported; worst 0.90 of bound (bfloat16 dq)"


@pytest.mark.slow
def test_the_dry_run_records_every_step(tmp_path):
    proc, summary, steps = gpu_check(tmp_path, "--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary["dry_run"] is True and summary["failed"] == []
    groups = {s["group"] for s in summary["steps"]}
    assert groups == {"info", "targets", "pytest-cuda", "matrix", "check", "speed", "features", "long", "pytest-dirs"}
    for s in summary["steps"]:
        assert s["status"] in ("passed", "no CUDA device"), s
    assert set(summary["targets"]["targets"]) >= {"sdpa-math", "sdpa-efficient", "sdpa-cudnn"}
    assert steps["check sdpa-efficient"]["status"] == "no CUDA device"
    ratios = summary["worst_ratio"]["sdpa-math"]["float32"]
    assert set(ratios) == {"out", "dq", "dk", "dv"} and max(ratios.values()) < 1
    assert {"default grid", "features"} <= set(summary["check"]["sdpa-math"])
    assert summary["speed"]["best"]["tflops"] > 0 and summary["speed"]["golden_fwd_bwd_s"]
    assert "skipped" in steps["pytest -m cuda"]["line"]         # every CUDA test skips here, with its reason
    assert all(r["reason"] == "needs a CUDA device" for r in summary["pytest"]["pytest -m cuda"]["skipped"])
    assert "steps:" in proc.stdout and "no CUDA device" in proc.stdout
