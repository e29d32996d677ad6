"""``check TARGET --repro DIR`` / ``Report.repro(dir)``: each failing cause shrunk to a small
case and written as a script that fails alone, and passes once the kernel is fixed."""

import ast
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import parity_tests
from parity_tests import cli
from parity_tests.kernels import repro, runner, targets
from parity_tests.kernels.cases import Case
from parity_tests.kernels.report import Report

from parity_tests.kernels.planted import chapter
from sampled import moved

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
SMALL = dict(tokens=[17], head_dims=[16], heads=[2], dtypes="float32")

# A right kernel, written apart from the check and the gallery: what a user's fix looks like.
FIXED = '''
import torch

def attention(q, k, v, *, causal, scale, align="top-left", softcap=None):
    out, lse = attention_lse(q, k, v, causal=causal, scale=scale, align=align, softcap=softcap)
    return out

def attention_lse(q, k, v, *, causal, scale, align="top-left", softcap=None):
    dt = q.dtype
    q, k, v = (t.double() for t in (q, k, v))
    S = q @ k.transpose(-1, -2) * scale
    if softcap:
        S = softcap * torch.tanh(S / softcap)
    tq, tk = S.shape[-2:]
    if causal:
        seen = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq if align == "bottom-right" else 0)
        S = S.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(S, -1)
    out = torch.softmax(S, -1).nan_to_num() @ v
    return out.to(dt), lse.float()
'''


def _run_script(path, *args, env=None, cwd=None):
    """The script alone in a fresh interpreter (the repository root on its path for numpy_ref,
    this folder for the gallery kernels its target imports)."""
    full = {n: x for n, x in os.environ.items() if n != "ATTENTION_REPRO_TARGET"}
    full.update({"PYTHONPATH": os.pathsep.join([ROOT, HERE]), **(env or {})})
    done = subprocess.run([sys.executable, path, *args], capture_output=True, text=True, env=full,
                          cwd=cwd or os.path.dirname(path), timeout=120)
    return done.returncode, done.stdout + done.stderr


def _run_here(path, *args):
    """The script in this process (PyTorch already imported: the slow tests run it alone)."""
    import contextlib
    import io
    import runpy
    argv, syspath, printed = sys.argv, list(sys.path), io.StringIO()
    sys.argv = [path, *args]
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(path, run_name="__main__")
        status = 0
    except SystemExit as e:
        status = e.code
    finally:
        sys.argv, sys.path[:] = argv, syspath
    return status, printed.getvalue()


def _printed(output):
    """``{tensor: (error, bound, verdict)}`` from the script's lines."""
    found = re.findall(r"^(\w+): error (\S+), bound (\S+), worst at \(batch, head, row\) \(.*\): (\w+)$",
                       output, re.M)
    return {n: (float(e), float(b), v) for n, e, b, v in found}


def _fixed(tmp_path):
    path = tmp_path / "fixed.py"
    path.write_text(FIXED)
    return path


def _imports(source):
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module.split(".")[0])
    return names


def _assert_small_script(found):
    """One cause, shrunk to B = 1 and T <= 64, written as a short script of allowed imports."""
    assert found.path is not None, found.line()
    assert found.case.batch == 1 and max(found.case.tq, found.case.tk) <= 64, found.line()
    source = open(found.path).read()
    assert len(source.splitlines()) <= 60
    assert _imports(source) - {"numpy", "torch", "numpy_ref"} <= set(sys.stdlib_module_names)
    assert "parity_tests" not in _imports(source)
    data = np.load(os.path.join(os.path.dirname(found.path), "inputs.npz"))
    assert {"q", "k", "v", "dout", "meta"} <= set(data.files)
    assert data["q"].shape[0] == 1 and data["q"].shape[2] == found.case.tq


def _one_case_report(spec, case, dtype="float32"):
    """The report of one case of ``spec`` (what ``check`` gives, without its whole grid)."""
    target = targets.resolve(spec)
    rows = runner.run_case(target, case, dtype, "cpu")
    return Report(target.name, rows, context={"target": target, "spec": spec, "align": "top-left", "seed": 0,
                                              "wanted": (), "timeout": None})


@pytest.mark.slow                     # 2 s; the command's own shrink-and-write stays in the default run
def test_no_scale_is_shrunk_written_fails_alone_and_passes_once_fixed(tmp_path):
    report = _one_case_report("parity_tests.kernels.planted.chapter:no_scale", Case(2, 2, 113, 203, 40, True))
    written = report.repro(tmp_path / "repro")
    assert [f.cause for f in written] == ["no-scale"]
    found = written[0]
    _assert_small_script(found)
    assert found.path == str(tmp_path / "repro" / "no-scale" / "repro.py")
    status, output = _run_script(found.path, cwd=str(tmp_path))
    assert status == 1, output
    printed = _printed(output)
    assert printed[found.tensor][2] == "FAIL"
    # the script measures as the check did: the error and bound of the shrunk case's row
    error, bound, _ = printed[found.tensor]
    assert error == pytest.approx(found.row.error, rel=1e-3) and bound == pytest.approx(found.row.bound, rel=1e-3)
    status, output = _run_here(found.path, f"{_fixed(tmp_path)}:attention")
    assert status == 0, output
    assert {v for _, _, v in _printed(output).values()} == {"pass"}


def test_the_command_prints_the_shrunk_case_and_its_script(tmp_path, capsys):
    out_dir = tmp_path / "r"
    status = cli.main(["check", "parity_tests.kernels.planted.chapter:backward_no_delta", "--tokens", "17", "--head-dim", "16",
                       "--heads", "2", "--dtype", "float32", "-q", "--repro", str(out_dir)])
    text = capsys.readouterr().out
    assert status == 1
    line = next(x for x in text.splitlines() if x.strip().startswith("backward-no-D: shrunk to"))
    assert re.search(r"shrunk to B1 H1 T\S+ D16 \w+ float32, still d[qk]: .*D = rowsum", line), line
    assert line.rstrip().split(" -> ")[1].startswith(str(out_dir / "backward-no-D" / "repro.py"))
    assert (out_dir / "backward-no-D" / "repro.py").is_file()


def test_an_unwritable_repro_dir_exits_2_before_any_case(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli.main(["check", "parity_tests.kernels.planted.chapter:no_scale", "--repro", str(blocker)]) == 2
    assert "--repro" in capsys.readouterr().err
    assert cli.main(["check", "--merge", "parity_tests.kernels.planted.chapter:no_scale", "--repro", str(tmp_path)]) == 2


def test_shrinking_takes_batch_heads_lengths_and_head_dim_down():
    target = targets.resolve(chapter.backward_no_delta)
    case, row, rows, runs, seconds, note = repro.shrink(target, Case(2, 3, 113, 203, 80, True), "dq",
                                                        "backward-no-D", "float32", "cpu")
    assert (case.batch, case.heads, case.head_dim) == (1, 1, 16)
    assert max(case.tq, case.tk) <= 4
    assert row.failed and row.diagnosis.id == "backward-no-D" and note.startswith(f"Tk {case.tk - 1} ")


def test_shrinking_passes_over_the_sizes_a_kernel_refuses():
    refuses = lambda case, dtype, device, align: None if case.tq % 16 == 0 and case.tk % 16 == 0 else \
        "T must be a multiple of 16"
    target = targets.Target("blocks", chapter.no_scale, refuses=refuses)
    case = repro.shrink(target, Case(1, 2, 64, 128, 32, False), "out", "no-scale", "float32", "cpu")[0]
    assert (case.tq, case.tk) == (16, 16)


def _noisy(q, k, v, *, causal, scale):
    """Right, plus a fixed ripple no catalogued mistake explains."""
    out = chapter.attention(q, k, v, causal=causal, scale=scale)
    return out + 1e-3 * torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view(out.shape)


def test_an_error_that_grows_with_length_keeps_its_lengths():
    target = targets.resolve(_noisy)
    start = Case(2, 2, 45, 77, 32, False)
    kept = repro.shrink(target, start, "out", "grows-with-length", "float32", "cpu")
    assert (kept[0].tq, kept[0].tk, kept[0].batch) == (45, 77, 1) and "grows with the key length" in kept[5]
    shrunk = repro.shrink(target, start, "out", "none", "float32", "cpu")[0]
    assert max(shrunk.tq, shrunk.tk) < 45


def test_a_report_without_failures_writes_nothing(tmp_path):
    report = Report("x", [], context={"target": None, "spec": None, "align": "top-left", "seed": 0,
                                      "wanted": [], "timeout": None})
    assert report.repro(tmp_path / "r") == [] and os.listdir(tmp_path / "r") == []
    with pytest.raises(ValueError, match="no kernel run"):
        Report("x", []).repro(tmp_path / "s")


# ----------------------------------------------------------------------------
# More kernels of the gallery, each script run alone twice

@pytest.mark.slow
@pytest.mark.parametrize("name, cause", [("mask_one_future", "mask-one-future"),
                                         ("backward_no_delta", "backward-no-D"),
                                         ("scale_one_over_d", "scale-1/D")])
def test_gallery_repros_fail_alone_and_pass_once_fixed(tmp_path, name, cause):
    report = parity_tests.check(f"parity_tests.kernels.planted.chapter:{name}", **SMALL)
    found = {f.cause: f for f in report.repro(tmp_path / "r")}[cause]
    _assert_small_script(found)
    assert os.path.dirname(found.path) == str(tmp_path / "r" / cause.replace("/", "-"))
    status, output = _run_script(found.path)
    assert status == 1 and _printed(output)[found.tensor][2] == "FAIL", output
    _fixed(tmp_path)
    status, output = _run_script(found.path, env={"ATTENTION_REPRO_TARGET": "fixed:attention",
                                                  "PYTHONPATH": os.pathsep.join([ROOT, HERE, str(tmp_path)])})
    assert status == 0, output


@pytest.mark.slow
def test_a_feature_repro_passes_its_keyword_and_returns_lse(tmp_path):
    (tmp_path / "planted.py").write_text("from parity_tests.kernels.planted.featured import kernel\n"
                                         "softcap_no_derivative = kernel('softcap-no-derivative')\n")
    sys.path.insert(0, str(tmp_path))
    try:
        report = parity_tests.check("planted:softcap_no_derivative", features=["softcap", "lse"], **SMALL)
    finally:
        sys.path.remove(str(tmp_path))
    found = {f.cause: f for f in report.repro(tmp_path / "r")}["softcap-no-derivative"]
    _assert_small_script(found)
    assert found.case.get("softcap") is not None
    env = {"PYTHONPATH": os.pathsep.join([ROOT, HERE, str(tmp_path)])}
    status, output = _run_script(found.path, env=env)
    assert status == 1 and _printed(output)[found.tensor][2] == "FAIL", output
    status, output = _run_script(found.path, f"{_fixed(tmp_path)}:attention_lse", env=env)
    assert status == 0, output


@pytest.mark.slow
def test_a_kernel_reading_views_as_contiguous_keeps_its_strides(tmp_path):
    (tmp_path / "views.py").write_text(
        "import torch\nfrom parity_tests.kernels.planted.chapter import attention\n"
        "def as_if_contiguous(q, k, v, *, causal, scale):\n"
        "    flat = lambda x: torch.as_strided(x, x.shape, torch.empty(x.shape).stride(), x.storage_offset())\n"
        "    return attention(*(flat(x) for x in (q, k, v)), causal=causal, scale=scale)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        report = parity_tests.check("views:as_if_contiguous", **SMALL)
    finally:
        sys.path.remove(str(tmp_path))
    found = {f.cause: f for f in report.repro(tmp_path / "r")}["ignores-strides"]
    assert found.case.get("strides") is not None and found.case.batch == 1, found.line()
    status, output = _run_script(found.path, env={"PYTHONPATH": os.pathsep.join([ROOT, HERE, str(tmp_path)])})
    assert status == 1, output
    status, output = _run_script(found.path, f"{_fixed(tmp_path)}:attention")
    assert status == 0, output


@pytest.mark.slow
def test_a_builtin_is_rebuilt_in_the_script(tmp_path):
    """A failing target named as a built-in SDPA backend: its script calls the real backend,
    which is right (exit 0), and the wrong kernel again when named (exit 1)."""
    wrong = targets.Target("sdpa-math", lambda q, k, v, *, causal, scale: chapter.no_scale(
        q, k, v, causal=causal, scale=scale))
    report = parity_tests.check(wrong, **SMALL)
    found = report.repro(tmp_path / "r")[0]
    assert 'with sdpa_backend("MATH"):' in open(found.path).read()
    status, output = _run_script(found.path)
    assert status == 0, output
    status, output = _run_script(found.path, "parity_tests.kernels.planted.chapter:no_scale")
    assert status == 1, output


@moved
def test_a_case_whose_call_the_script_cannot_rebuild_gets_no_script(tmp_path):
    # dropout's mask is seeded and read back from the kernel: a plain call in a script could
    # never pass, so no script is written, and the line says why (the features' declarations)
    from parity_tests.kernels.planted.featured import wrong_kernel
    fn, features = wrong_kernel("dropout-no-rescale")
    report = parity_tests.check(fn, features=features, **SMALL)
    found = [f for f in report.repro(str(tmp_path)) if f.case.get("dropout")]
    assert found and all(f.path is None and "dropout: the script calls the kernel plainly" in f.note
                         for f in found), [f.line() for f in found]
    assert not list(tmp_path.rglob("repro.py"))


def test_a_shrunk_case_refits_each_features_value():
    # Feature.fit: a bias keeps its broadcast axes, varlen's and paged's lengths fit the new sizes
    case = Case(2, 4, 40, 50, 16, True, (("bias", (1, 4, 40, 50)),))
    assert repro._resized(case, heads=2, tq=8, tk=10).get("bias") == (1, 2, 8, 10)
    case = Case(2, 2, 40, 50, 16, True, (("varlen", ((40, 17), (50, 3))),))
    assert repro._resized(case, batch=1, tq=20, tk=10).get("varlen") == ((20,), (10,))
    case = Case(2, 2, 1, 50, 16, True, (("paged", (16, (50, 7))),))
    assert repro._resized(case, tk=10).get("paged") == (16, (10, 7))


def test_the_script_docs_check_md_shows_is_the_one_written(tmp_path):
    # docs/check.md, "Handing a failure on": the script shown is what this version writes
    report = parity_tests.check("parity_tests.kernels.planted.chapter:backward_masked", tokens=["17", "45x77"],
                                head_dims=[32], dtypes=["float32"])
    (found,) = [f for f in report.repro(str(tmp_path)) if f.cause == "backward-masked"]
    with open(os.path.join(ROOT, "docs", "check.md")) as f:
        page = f.read()
    start = page.index('```python\n"""backward-masked:') + len("```python\n")
    with open(found.path) as f:
        assert page[start:page.index("```", start)] == f.read()


def test_a_gqa_case_shrinks_its_kv_heads_and_its_groups_as_the_feature_declares():
    """``Feature.head_counts``: a failing GQA case at Hq/Hkv = 8/4 shrinks to whole groups,
    fewest heads first; a case whose failure needs two kv heads keeps two."""
    from parity_tests.kernels.cases import Case
    case = Case(1, 8, 33, 33, 16, True, (("gqa", 4),))
    smallest = repro._heads(lambda c: True, case)
    assert (smallest.heads, smallest.hkv) == (1, 1)
    two_kv = repro._heads(lambda c: c.hkv >= 2, case)
    assert (two_kv.heads, two_kv.hkv) == (2, 2)
    assert repro._resized(case, {"gqa": 3}, heads=8) is None          # 8 query heads are no whole groups of 3


@moved
def test_a_cause_no_mistake_names_is_unnamed_in_its_folder_and_its_line(tmp_path):
    report = parity_tests.check(_noisy, tokens=["17"], head_dims=[16], dtypes=["float32"], causal="yes")
    assert not report.passed and {d.id for _, d in report.diagnoses} == {"none"}
    written = report.repro(tmp_path)
    assert written and all(w.line().startswith("unnamed: ") for w in written)
    assert os.listdir(tmp_path) == ["unnamed"]
    assert "unnamed: out of" in (tmp_path / "unnamed" / "repro.py").read_text()


def _wrong_past_a_tile_but_not_between(q, k, v, *, causal, scale):
    """Without the scale past one tile of 64 keys, except at Tk 70 .. 76 (right there): the
    failure does not shrink monotonically, as a kernel's cause may not."""
    tk = k.shape[-2]
    wrong = tk > 64 and not 70 <= tk <= 76
    return chapter.attention(q, k, v, causal=causal, scale=1.0 if wrong else scale)


def test_shrinking_tries_a_tile_plus_one_and_says_what_one_less_gives():
    target = targets.resolve(_wrong_past_a_tile_but_not_between)
    case, row, rows, runs, seconds, note = repro.shrink(target, Case(1, 1, 128, 128, 16, False), "out",
                                                        "no-scale", "float32", "cpu")
    assert case.tk == 65 and row.diagnosis.id == "no-scale"       # a bisection alone stops at 77
    assert "Tk 64 passes" in note


def _window_left_narrower(q, k, v, *, causal, scale, window=(-1, -1), align="top-left"):
    """The window's left edge one key narrower (``>`` for ``>=``): a 0-wide window sees no key."""
    tq, tk = q.shape[-2], k.shape[-2]
    o = tk - tq if align == "bottom-right" else 0
    i, j = torch.arange(tq)[:, None], torch.arange(tk)[None, :]
    left, right = window[0], 0 if causal else window[1]
    ok = torch.ones(tq, tk, dtype=torch.bool)
    if left >= 0:
        ok &= j > i + o - left
    if right >= 0:
        ok &= j <= i + o + right
    seen = ok.any(-1, keepdim=True)
    s = (q @ k.transpose(-1, -2)) * scale
    p = torch.softmax(torch.where(seen, s.masked_fill(~ok, float("-inf")), torch.zeros_like(s)), -1)
    return torch.where(seen, p, torch.zeros_like(p)) @ v


def test_zeros_a_named_mistake_gives_are_filed_under_it(tmp_path):
    target = targets.resolve(_window_left_narrower)
    cases = [Case(1, 1, 45, 77, 16, True, (("window", w),)) for w in ((0, 0), (5, 0))]     # 0-wide: no key seen
    rows = [r for c in cases for r in runner.run_case(target, c, "float32", "cpu", "top-left", 0, ("window",))]
    report = Report("narrower", rows, context={"target": target, "spec": None, "align": "top-left", "seed": 0,
                                                "wanted": ("window",), "timeout": None})
    zeros = [r for r in report.failures if r.diagnosis.id == "zeros"]
    assert zeros and all("window-left-narrower" in r.diagnosis.also for r in zeros)
    assert "(as window-left-narrower or window-other-alignment" in zeros[0].diagnosis.sentence
    assert [f.cause for f in report.repro(tmp_path)] == ["window-left-narrower"]
    assert not (tmp_path / "zeros").exists()


def test_a_builtin_sdpa_backend_with_a_keyworded_feature_gets_no_script():
    """The script rebuilds an SDPA backend without a feature's keywords (softcap): no script,
    and the note names the backend and the keyword; a plain case of it is writable."""
    sdpa = targets.Target("sdpa-math", lambda q, k, v, *, causal, scale: q)
    case = Case(1, 2, 8, 8, 16, True, (("softcap", 30.0),))
    why = repro._unwritable("no-scale", case, (), sdpa, None)
    assert why == "the script's sdpa-math is rebuilt without the keywords of softcap"
    assert repro._unwritable("no-scale", Case(1, 2, 8, 8, 16, True), (), sdpa, None) is None
