"""Without PyTorch importable, every verb says what is missing and how to install it.

Run in a subprocess where ``import torch`` fails (``sys.modules["torch"] = None``
makes it raise ModuleNotFoundError, as on a machine without PyTorch): exit
status 2 and one line on stderr naming torch and ``pip install``, no traceback.
"""

import os
import pathlib
import subprocess
import sys

import pytest

BLOCK_TORCH = ("import sys; sys.modules['torch'] = None; "
               "from parity_tests.cli import main; sys.exit(main(sys.argv[1:]))")


# An import hook that fails like a missing package (pytest walks sys.modules, so
# a None entry there would break it, not the import).
BLOCK_IMPORTS = (
    "import sys\n"
    "class Missing:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] in ('torch', 'hypothesis'):\n"
    "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
    "sys.meta_path.insert(0, Missing())\n")


def _run_without_torch(argv):
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH, *argv],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv", [
    ["--help"], [], ["--module", "CausalAttention"], ["chapter"], ["jacobian", "--help"],
    ["claims", "--seed", "1"], ["bench", "--tokens", "8", "--repeats", "1", "--d-model", "8",
                                "--heads", "2"],
], ids=lambda a: " ".join(a) or "(no verb)")
def test_a_verb_without_torch_says_what_is_missing(argv):
    done = _run_without_torch(argv)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "torch" in lines[0] and "pip install" in lines[0], done.stderr
    assert done.stdout == ""


def test_bench_help_needs_no_torch():
    """bench imports PyTorch only when it runs, so its help page still shows."""
    done = _run_without_torch(["bench", "--help"])
    assert done.returncode == 0 and "usage: attention-parity bench" in done.stdout


def test_the_numpy_tests_need_neither_torch_nor_hypothesis(tmp_path):
    """The README's NumPy-only command, where only NumPy and pytest are installed."""
    script = (BLOCK_IMPORTS + "import pytest; sys.exit(pytest.main(['-q', '-p', "
              "'no:cacheprovider', 'parity_tests/tests/reference/test_numpy_ops.py']))")
    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")   # no hypothesis plugin
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=root, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "error" not in done.stdout.lower()
