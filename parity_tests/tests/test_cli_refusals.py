"""Every verb refuses an output it cannot write, or a bad seed or name, before any work.

A refusal is exit status 2 (a bad argument, never 1: "a row failed") with one line
on stderr, and nothing on stdout: no row was computed and no time was spent.
"""

import os
import pathlib

import pytest

from parity_tests import cli
from verb_run import needs_matplotlib

BENCH_SMALL = ["--tokens", "8", "--repeats", "1", "--d-model", "8", "--heads", "2"]
SOLUTION = pathlib.Path(__file__).resolve().parents[1] / "lab" / "exercises" / "solutions" / "softmax_backward.py"
CHECK_SMALL = ["check", "sdpa-math", "--tokens", "4", "--dtype", "float32"]
JSON_VERBS = [[], ["bench", *BENCH_SMALL], CHECK_SMALL, ["backprop"],
              ["grade", str(SOLUTION)]]                                  # take --json PATH
PLOT_VERBS = [["chapter"], ["jacobian"], ["claims"], ["backprop"]]      # take --plot DIR


def _refused(capsys, argv):
    status = cli.main(argv)
    out, err = capsys.readouterr()
    assert status == 2, f"{argv} exited {status}"
    assert out == "", f"{argv} did work before refusing:\n{out[:300]}"
    return err


def _bad_files(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    bad = {
        "missing directory": (tmp_path / "missing" / "out.json", "does not exist"),
        "a directory": (tmp_path, "is a directory"),
        "below a file": (a_file / "out.json", "does not exist"),
    }
    if os.path.isdir("/proc/self"):                      # unwritable even for root
        bad["unwritable"] = ("/proc/attention-parity.json", "cannot write")
    return bad


@pytest.mark.parametrize("verb", JSON_VERBS, ids=["matrix", "bench", "check", "backprop", "grade"])
def test_json_path_that_cannot_be_written_is_refused_first(verb, tmp_path, capsys):
    for what, (path, message) in _bad_files(tmp_path).items():
        err = _refused(capsys, [*verb, "--json", str(path)])
        assert err.count("\n") == 1 and "--json" in err and message in err, (what, err)
    assert (tmp_path / "a_file").read_text() == "keep me"


def test_json_path_that_can_be_written_is_left_as_it_was(tmp_path):
    from parity_tests.common import outputs
    path = tmp_path / "new.json"
    assert outputs.output_file_problem("--json", str(path)) is None
    assert not path.exists()                             # the probe cleans up after itself


@needs_matplotlib
@pytest.mark.parametrize("verb", PLOT_VERBS, ids=lambda v: v[0])
def test_plot_dir_that_cannot_be_written_is_refused_first(verb, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    cases = [(a_file, "not a directory"), (a_file / "sub", "cannot write")]
    if os.path.isdir("/proc/self"):
        cases.append(("/proc/attention-parity-plots", "cannot write"))
    for path, message in cases:
        err = _refused(capsys, [*verb, "--plot", str(path)])
        assert err.count("\n") == 1 and "--plot" in err and message in err, (path, err)
    assert a_file.read_text() == "keep me"


@pytest.mark.parametrize("argv", [
    ["claims", "--seed", "-1"], ["claims", "--seed", str(2**70)], ["claims", "--seed", "x"],
    ["bench", *BENCH_SMALL, "--seed", "-1"], ["bench", *BENCH_SMALL, "--seed", str(2**32)],
    [*CHECK_SMALL, "--seed", "-1"], [*CHECK_SMALL, "--seed", str(2**32)],
])
def test_a_seed_out_of_range_is_refused(argv, capsys):
    err = _refused(capsys, argv)
    assert "--seed" in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["--dtype", ""], ["--dtype", ","], ["--dtype", " , "],
                                  ["--module", ""], ["--module", ","],
                                  ["--dtype", "float32", "--dtype", ""],
                                  ["check", "sdpa-math", "--dtype", ""],
                                  ["check", "sdpa-math", "--tokens", ","]])
def test_an_option_naming_nothing_is_refused_not_read_as_the_default(argv, capsys):
    err = _refused(capsys, argv)
    assert err.count("\n") == 1 and argv[-2] in err and "at least one name" in err


@pytest.mark.parametrize("source, said", [
    ("import sys\nsys.exit(5)\n", "importing 'broken_kernel' called sys.exit(5)"),
    ("raise RuntimeError('needs a GPU')\n", "importing 'broken_kernel' raised RuntimeError: needs a GPU"),
    ("def attention(:\n", "importing 'broken_kernel' raised SyntaxError: invalid syntax (broken_kernel.py, line 1)"),
])
def test_check_a_target_that_cannot_be_imported_is_one_line_and_exit_2(source, said, tmp_path,
                                                                       monkeypatch, capsys):
    (tmp_path / "broken_kernel.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    err = _refused(capsys, ["check", "broken_kernel:attention", "--tokens", "4"])
    assert err.count("\n") == 1 and said in err, err


def test_check_tokens_beyond_the_memory_free_are_refused_with_the_estimate(capsys, monkeypatch):
    from parity_tests.kernels import run
    monkeypatch.setattr(run, "available_memory", lambda device: (8 * 2 ** 30, None))   # 8 GiB free
    err = _refused(capsys, ["check", "sdpa-math", "--tokens", "2000000", "--dtype", "float32"])
    assert err.count("\n") == 1 and "B1 H2 T2000000 D64 causal in float32 needs about 69.6 GiB" in err, err
    assert "inputs 22.9 GiB + golden 15.3 GiB + baseline 20.0 GiB + target 11.4 GiB" in err
    assert "more than the 8.0 GiB this machine has free" in err
    assert cli.main([*CHECK_SMALL, "-q"]) == 0                    # a case that fits runs


@pytest.mark.parametrize("argv, page", [
    (["check", "no_such_module_here:attention", "--tokens", "4"], "docs/check.md#on-your-own-function"),
    (["check", "nonsense", "--tokens", "4"], "docs/check.md#targets"),
    (["check", "sdpa-math", "--features", "nosuch"], "docs/features.md#the-features"),
    (["check", "sdpa-math", "--world-size", "2"], "docs/ranks.md"),
    (["check", "sdpa-math", "--tokens", "abc"], "attention-parity check --help"),
    (["check", "sdpa-math", "--timeout", "soon"], "docs/check.md"),
    (["--plant-fault", "nosuch"], "docs/parity.md"),
    (["--dtype", "float7"], "docs/parity.md"),
    (["chapter", "--nope"], "docs/chapter.md"),
    (["bench", "--tokens", "x"], "docs/speed.md"),
    (["grade", "no_such_file.py"], "docs/lab.md#2-attention-parity-grade-check-your-own-backward-be-told-which-mistake-you-made"),
    (["backprop", "--nope"], "docs/lab.md#1-attention-parity-backprop-every-intermediate-gradient-step-by-step"),
])
def test_a_refusal_names_the_page_that_says_what_is_expected(argv, page, capsys):
    from test_docs_links import ROOT, anchors
    err = _refused(capsys, argv)                 # (argparse's own refusals print the usage above)
    assert err.rstrip().splitlines()[-1].endswith(f"(see {page})"), err
    if page.startswith("docs/"):
        path, _, anchor = page.partition("#")
        assert (ROOT / path).is_file() and (not anchor or anchor in anchors(ROOT / path)), page
