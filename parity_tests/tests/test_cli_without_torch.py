"""Without PyTorch importable, every verb says what is missing and how to install it.

Run in a subprocess where ``import torch`` fails as on a machine without PyTorch
(an import hook raises ModuleNotFoundError): exit status 2 and one line on
stderr naming torch and ``pip install``, no traceback.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

# An import hook that fails like a missing package (pytest walks sys.modules, so
# a None entry there would break it, not the import).
BLOCK_IMPORTS = (
    "import sys\n"
    "class Missing:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] in ('torch', 'hypothesis'):\n"
    "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
    "sys.meta_path.insert(0, Missing())\n")
# Each argv through the entry point in one such process: (status, stdout, stderr).
RUN_EACH = BLOCK_IMPORTS + """
import contextlib, io, json
from parity_tests.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as e:
            status = e.code
        except BaseException as e:
            import traceback
            traceback.print_exc(file=err)
            status = "Traceback"
    results.append((status, out.getvalue(), err.getvalue()))
print(json.dumps(results))
"""
ARGVS = [["--help"], [], ["--module", "CausalAttention"], ["chapter"], ["jacobian", "--help"],
         ["claims", "--seed", "1"],
         ["bench", "--tokens", "8", "--repeats", "1", "--d-model", "8", "--heads", "2"]]


@pytest.fixture(scope="module")
def without_torch():
    """{argv as text: (status, stdout, stderr)} for ARGVS and ``bench --help``."""
    argvs = ARGVS + [["bench", "--help"]]
    done = subprocess.run([sys.executable, "-c", RUN_EACH, json.dumps(argvs)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {" ".join(a): r for a, r in zip(argvs, json.loads(done.stdout))}


@pytest.mark.parametrize("argv", [" ".join(a) for a in ARGVS], ids=lambda a: a or "(no verb)")
def test_a_verb_without_torch_says_what_is_missing(without_torch, argv):
    status, out, err = without_torch[argv]
    assert status == 2, (status, err[-2000:])
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "torch" in lines[0] and "pip install" in lines[0], err
    assert out == ""


def test_bench_help_needs_no_torch(without_torch):
    """bench imports PyTorch only when it runs, so its help page still shows."""
    status, out, _ = without_torch["bench --help"]
    assert status == 0 and "usage: attention-parity bench" in out


def test_the_numpy_tests_need_neither_torch_nor_hypothesis(tmp_path):
    """The NumPy-only command of docs/architecture.md#tests, where only NumPy and pytest are installed."""
    script = (BLOCK_IMPORTS + "import pytest; sys.exit(pytest.main(['-q', '-p', "
              "'no:cacheprovider', 'parity_tests/tests/reference/test_numpy_modules.py']))")
    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")   # no hypothesis plugin
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=root, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "error" not in done.stdout.lower()
