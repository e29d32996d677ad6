"""``examples/triton_attention.py``, a FlashAttention-2 forward and backward in Triton,
checked on the CPU under Triton's interpreter; and its copy with the accumulator's rescale
dropped (``examples/triton_attention_bug.py``), failing with that named.

Each check runs in a subprocess: ``triton.jit`` reads ``TRITON_INTERPRET`` when the
kernels are defined, so the variable must be set before the module is imported.
Triton is the ``triton`` extra (``pip install -e ".[triton]"``); without it these skip.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
HAVE_TRITON = importlib.util.find_spec("triton") is not None

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed "
                                 "(the triton extra: pip install -e \".[triton]\")")]

# the example's tiles are 64 rows: T = 64 is one key tile, T = 128 two
SHAPES = ["--tokens", "64,128", "--head-dim", "32,64"]


def interpreted_check(target, json_path, *options, timeout=240):
    """``(exit status, output, the --json summary and rows)`` of ``check target`` run
    with ``TRITON_INTERPRET=1`` on the CPU."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "parity_tests", "check", target, "--device", "cpu",
                           "--json", str(json_path), "--quiet", *options],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if not json_path.exists():
        pytest.fail(f"check wrote no JSON (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    data = json.loads(json_path.read_text())
    return proc.returncode, proc.stdout + proc.stderr, data["summary"], data["rows"]


def test_the_triton_kernel_passes_under_the_interpreter(tmp_path):
    status, output, summary, rows = interpreted_check(
        "examples.triton_attention:attention", tmp_path / "check.json",
        "--dtype", "float16,bfloat16,float32", *SHAPES)
    assert status == 0 and summary["passed"], output
    assert summary["fail"] == 0 and summary["pass"] > 0, summary
    ran = [r for r in rows if r["verdict"] == "pass"]
    # every dtype, both lengths, both head dims, causal and not, every gradient
    assert {r["dtype"] for r in ran} == {"float16", "bfloat16", "float32"}
    assert {(r["tq"], r["head_dim"], r["causal"]) for r in ran} == {
        (t, d, c) for t in (64, 128) for d in (32, 64) for c in (False, True)}
    assert {r["tensor"] for r in ran} == {"out", "dq", "dk", "dv"}
    # the input classes met the kernel at the shapes it takes (T a multiple of 64)
    for words in ("strides fused", "strides padded", "scale 0.3", "inputs outliers", "inputs integers"):
        assert any(words in r["case"] and r["tq"] % 64 == 0 for r in ran), words
    # what it refuses is said with its reason, not failed
    assert summary["not_supported"] > 0
    assert summary["gaps"] == ["Tq > Tk (every case refused: Tq must equal Tk)"], summary["gaps"]


def test_the_dropped_rescale_fails_and_is_named(tmp_path):
    status, output, summary, rows = interpreted_check(
        "examples.triton_attention_bug:attention", tmp_path / "bug.json",
        "--dtype", "float16,bfloat16", "--tokens", "128", "--head-dim", "32")
    assert status == 1 and not summary["passed"], output
    assert summary["diagnosis"] == "acc-not-rescaled", summary
    failed = [r for r in rows if r["verdict"] == "FAIL"]
    assert {r["dtype"] for r in failed} == {"float16", "bfloat16"}
    outs = [r for r in failed if r["tensor"] == "out"]
    assert outs and all(r["diagnosis"]["id"] == "acc-not-rescaled" for r in outs), outs
    assert all("the output accumulator not rescaled by exp(m_old - m_new)" in r["diagnosis"]["sentence"]
               for r in outs)
    # dv = P^T dO needs only L (m and l are right), so it passes; out, dq and dk do not
    assert all(r["passed"] for r in rows if r["tensor"] == "dv" and r["verdict"] != "not supported")
    assert {r["tensor"] for r in failed} == {"out", "dq", "dk"}


def test_importing_the_example_asks_nothing_of_a_gpu_and_refusals_say_why():
    """Import with every CUDA query made to raise; then, without the interpreter, the
    kernel refuses the CPU, and under it, the shapes its tiles cannot take."""
    script = (
        "import torch\n"
        "def asked(*a, **k): raise AssertionError('a GPU was queried')\n"
        "for name in ('is_available', 'device_count', 'current_device', 'get_device_capability',\n"
        "             'get_device_properties', 'init'):\n"
        "    setattr(torch.cuda, name, asked)\n"
        "from examples.triton_attention import attention\n"
        "from parity_tests.kernels.targets import Unsupported\n"
        "x = lambda t, d=32, dtype=torch.float16: torch.randn(1, 1, t, d).to(dtype)\n"
        "for q, k in ((x(64), x(64)), (x(100), x(100)), (x(64), x(128)), (x(64, 40), x(64, 40)),\n"
        "             (x(64, dtype=torch.float64), x(64, dtype=torch.float64))):\n"
        "    try:\n"
        "        attention(q, k, k, causal=False, scale=0.5)\n"
        "        print('ran')\n"
        "    except Unsupported as e:\n"
        "        print(e)\n")
    said = {}
    for interpret in ("0", "1"):
        proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "TRITON_INTERPRET": interpret}, timeout=120)
        assert proc.returncode == 0, proc.stderr
        said[interpret] = proc.stdout.splitlines()
    assert said["0"][0] == "on the CPU the kernels run only under TRITON_INTERPRET=1"
    assert said["1"] == ["ran", "T must be a multiple of 64 (the tile)", "Tq must equal Tk",
                         "D must be one of 16, 32, 64, 128, the same for q, k and v",
                         "dtype must be float16, bfloat16 or float32, the same for q, k and v"]
