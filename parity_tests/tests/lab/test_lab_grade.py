"""The grader: every solution grades as correct; every catalogued mistake, written
into a copy of a solution as a learner would write it, is named first, exactly;
files that fail get a clear message and no traceback of ours."""

import contextlib
import io
import json
import pathlib
import sys

import pytest

from parity_tests import cli
from parity_tests.lab import exercises_catalog as catalog
from parity_tests.lab import grade, mistakes, module_mistakes
from parity_tests.lab.mistakes import MATCH_BOUND

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from mutations import MUTATIONS, mutate  # noqa: E402
from sampled import one_in  # noqa: E402

SOLUTIONS = pathlib.Path(grade.template_path("softmax_backward", solution=True).__fspath__()).parent


def _grade(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(["grade"] + [str(a) for a in argv])
    return status, out.getvalue(), err.getvalue()


def _catalogue(exercise):
    ex = catalog.EXERCISES[exercise]
    if ex.kind == "function":
        return [m.name for m in mistakes.FUNCTION_MISTAKES[exercise]]
    return [m.name for m in module_mistakes.mistakes_for(ex.entry)]


@pytest.mark.parametrize("exercise", list(catalog.EXERCISES))
def test_the_solution_grades_as_correct(exercise, tmp_path):
    path = tmp_path / f"mine_{exercise}.py"
    path.write_text((SOLUTIONS / f"{exercise}.py").read_text())
    status, out, err = _grade([path])
    assert status == 0, out + err
    assert "result: correct" in out and "WRONG" not in out


@pytest.mark.parametrize("exercise", list(catalog.EXERCISES))
def test_every_catalogued_mistake_has_a_written_out_copy(exercise):
    assert sorted(MUTATIONS[exercise]) == sorted(_catalogue(exercise))


CASES = [(ex, name) for ex, table in MUTATIONS.items() for name in table]


@pytest.mark.parametrize("exercise, mistake", one_in(3, CASES),
                         ids=[f"{e}:{m}" for e, m in CASES])
def test_each_mistake_is_named_first(exercise, mistake, tmp_path):
    source = mutate((SOLUTIONS / f"{exercise}.py").read_text(), MUTATIONS[exercise][mistake])
    path = tmp_path / f"mine_{exercise}.py"
    path.write_text(source)
    report = tmp_path / "grade.json"
    status, out, err = _grade([path, "--json", report])
    assert status == 1, out + err
    (result,) = json.loads(report.read_text())["results"]
    first, second = result["diagnosis"][:2]
    assert first["mistake"] == mistake, out
    assert first["exact"] and first["residual"] <= MATCH_BOUND
    assert second["residual"] > 1e3 * max(first["residual"], 1e-15)   # a clear winner
    assert f"[{mistake}]" in out and "it breaks:" in out


def test_every_candidate_differs_from_the_reference():
    """A mistake that computes the right numbers could never be diagnosed."""
    from parity_tests.lab import diagnose
    for exercise in catalog.EXERCISES:
        case = catalog.case(exercise)
        ex = catalog.EXERCISES[exercise]
        for mistake, tensors in diagnose.candidates(ex, case):
            floor = diagnose.scale_floor(case["reference"])
            worst = max(diagnose.distance(tensors.get(k), v, floor)
                        for k, v in case["reference"].items())
            assert worst > 1e-3, f"{exercise}: {mistake.name} changes nothing"


def test_a_template_is_not_written_yet(tmp_path):
    out_path = tmp_path / "softmax_backward.py"
    status, out, _ = _grade(["--template", "softmax_backward", "--out", out_path])
    assert status == 0 and out_path.exists()
    status, out, err = _grade([out_path])
    assert status == 1
    assert "not written yet" in out and "Traceback" not in out + err


def test_template_never_overwrites(tmp_path):
    existing = tmp_path / "mine.py"
    existing.write_text("# my work\n")
    status, _, err = _grade(["--template", "linear_backward", "--out", existing])
    assert status == 2 and "exists" in err
    assert existing.read_text() == "# my work\n"


def test_list_names_every_template():
    status, out, _ = _grade(["--list"])
    assert status == 0
    for name in catalog.EXERCISES:
        assert name in out


@pytest.mark.parametrize("body, expected", [
    ("import numpy as np\nx = 1 / 0\n", "ZeroDivisionError"),
    ("def softmax_backward(w, g)\n    return w\n", "SyntaxError"),
    ("import no_such_module_here\n", "ModuleNotFoundError"),
    ("import sys\nsys.exit(3)\n", "SystemExit"),
])
def test_a_file_that_fails_to_import_gets_a_clear_message(body, expected, tmp_path):
    path = tmp_path / "broken.py"
    path.write_text(body)
    status, out, err = _grade([path])
    assert status == 1
    assert expected in out and "Traceback" not in out + err
    assert "broken.py" in out


def test_code_that_raises_is_reported_at_the_learners_line(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text("def softmax_backward(w, g):\n    return w @ g[:3]\n")
    status, out, err = _grade([path])
    assert status == 1 and "ValueError" in out
    assert "mine.py, line 2, in softmax_backward: return w @ g[:3]" in out
    assert "Traceback" not in out + err


def test_a_wrong_shape_is_wrong_and_still_diagnosed(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text("import numpy as np\n"
                    "def linear_backward(dout, x, W, b):\n"
                    "    return dout @ W, np.einsum('bto,bti->io', dout, x), dout.sum(axis=(0, 1))\n")
    status, out, _ = _grade([path])
    assert status == 1 and "[weight-grad-transposed]" in out


def test_a_name_and_a_signature_choose_the_exercise(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text((SOLUTIONS / "softmax_backward.py").read_text()
                    .replace("def softmax_backward", "def my_vjp"))
    assert _grade([f"{path}:my_vjp"])[0] == 0
    assert _grade([f"{path}:my_vjp", "--exercise", "softmax_backward"])[0] == 0


@pytest.mark.parametrize("argv", [[], ["no_such_file.py"], ["README"], ["{here}:nothing"],
                                  ["{here}", "--exercise", "nope"]])
def test_bad_usage_exits_2(argv, tmp_path):
    here = tmp_path / "empty.py"
    here.write_text("x = 1\n")
    argv = [a.replace("{here}", str(here)) for a in argv]
    status, out, err = _grade(argv)
    assert status == 2 and "Traceback" not in out + err
    status, out, err = _grade([here])
    assert status == 2 and "defines none of" in err


def test_float32_arithmetic_is_told_apart_from_a_mistake(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text("import numpy as np\n"
                    "def softmax_backward(w, g):\n"
                    "    w, g = w.astype(np.float32), g.astype(np.float32)\n"
                    "    return w * (g - np.sum(w * g, axis=-1, keepdims=True))\n")
    status, out, _ = _grade([path])
    assert status == 1 and "precision was lost" in out and "it breaks" not in out


def test_two_mistakes_at_once_are_named_tensor_by_tensor(tmp_path):
    edits = MUTATIONS["linear_backward"]
    source = mutate((SOLUTIONS / "linear_backward.py").read_text(),
                    edits["weight-grad-transposed"] + edits["bias-not-summed-over-batch"])
    path = tmp_path / "mine.py"
    path.write_text(source)
    report = tmp_path / "grade.json"
    status, out, _ = _grade([path, "--json", report])
    assert status == 1 and "tensor by tensor" in out
    (result,) = json.loads(report.read_text())["results"]
    assert result["by_tensor"]["dW"]["mistake"] == "weight-grad-transposed"
    assert result["by_tensor"]["db"]["mistake"] == "bias-not-summed-over-batch"
    assert "dx" not in result["by_tensor"]


# --- the learner's code runs in a process of its own, with a time limit -------------

@pytest.mark.parametrize("body, expected", [
    ("    while True:\n        pass\n", "no answer after 0.3 s"),
    ("    import os\n    os._exit(0)\n", "exit status 0"),
    ("    import sys\n    sys.exit(0)\n", "raised SystemExit"),
    ("    import os, signal\n    os.kill(os.getpid(), signal.SIGSEGV)\n", "SIGSEGV, a crash"),
], ids=["endless-loop", "os._exit(0)", "sys.exit(0)", "crash"])
def test_code_that_never_returns_ends_with_one_line_and_exit_1(body, expected, tmp_path):
    path = tmp_path / "mine.py"
    path.write_text("def softmax_backward(w, g):\n" + body)
    status, out, err = _grade([path, "--timeout", "0.3"])
    assert status == 1, out + err
    assert expected in out and "calling softmax_backward" in out
    assert "Traceback" not in out + err and "WRONG" in out


def test_an_endless_loop_at_import_is_stopped(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text("while True:\n    pass\n")
    status, out, err = _grade([path, "--timeout", "0.3"])
    assert status == 1 and "importing mine.py: no answer after 0.3 s" in out, out + err


def test_what_the_learners_code_prints_is_shown(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text((SOLUTIONS / "softmax_backward.py").read_text()
                    .replace("    return dx", "    print('dx has shape', dx.shape)\n    return dx"))
    status, out, _ = _grade([path])
    assert status == 0 and "dx has shape (6, 6)" in out


@pytest.mark.parametrize("value", ["0", "-1", "nan", "soon"])
def test_a_bad_timeout_is_bad_usage(value, tmp_path):
    status, out, err = _grade([tmp_path / "x.py", "--timeout", value])
    assert status == 2 and "--timeout" in err and "Traceback" not in out + err


# --- bad paths ------------------------------------------------------------------------

def test_template_into_a_missing_folder_is_one_line_exit_2(tmp_path):
    status, out, err = _grade(["--template", "softmax_backward", "--out",
                               tmp_path / "nonexistent" / "x.py"])
    assert status == 2 and "Traceback" not in out + err
    assert "--out" in err and "does not exist" in err and len(err.strip().splitlines()) == 1


def test_a_folder_given_as_file_is_reported_as_a_folder(tmp_path):
    status, out, err = _grade([tmp_path])
    assert status == 2 and "is a directory" in err and "no such file" not in err


# --- the nearest mistake is named only when it says something ---------------------------

@pytest.mark.parametrize("ret", ["1.001 * w * (g - wg)", "(w * (g - wg))[:, :5]"],
                         ids=["slightly-off", "wrong-shape"])
def test_a_nearest_mistake_further_than_the_answer_is_not_named(ret, tmp_path):
    path = tmp_path / "mine.py"
    path.write_text("import numpy as np\n"
                    "def softmax_backward(w, g):\n"
                    "    wg = np.sum(w * g, axis=-1, keepdims=True)\n"
                    f"    return {ret}\n")
    status, out, err = _grade([path])
    assert status == 1, out + err
    assert "the nearest is" not in out and "it breaks" not in out and "next:" not in out
    assert "no catalogued mistake is closer to your numbers than the right answer" in out


# --- shapes the exercise promises, and the learner's inputs left alone ------------------

@pytest.mark.parametrize("exercise, old, new", [
    ("softmax_backward", "axis=-1, keepdims", "axis=1, keepdims"),
    ("scores_backward", "np.swapaxes(dscores, -1, -2)", "np.swapaxes(dscores, 1, 2)"),
])
def test_axes_counted_from_the_front_fail_on_the_promised_shapes(exercise, old, new, tmp_path):
    source = (SOLUTIONS / f"{exercise}.py").read_text()
    assert old in source
    path = tmp_path / "mine.py"
    path.write_text(source.replace(old, new))
    report = tmp_path / "grade.json"
    status, out, err = _grade([path, "--json", report])
    assert status == 1, out + err
    (result,) = json.loads(report.read_text())["results"]
    assert all(r["passed"] for r in result["rows"])           # right on the chapter's shapes
    if "error" in result:                                     # numbers that do not broadcast
        assert "on other shapes" in result["error"] and "(..., Tq, Tk)" in out
    else:
        assert not result["probe"]["passed"] and "leading axes" in out


def test_a_maximum_not_carried_across_tiles_fails_on_a_row_whose_maximum_falls(tmp_path):
    """The chapter's row raises its maximum in every tile, where each tile's own maximum gives the
    right numbers; a row whose maximum falls (800, 0, 1, 2, ...) makes that overflow."""
    source = (SOLUTIONS / "online_softmax.py").read_text()
    old = "m_new = max(m, np.max(s_t))"
    assert old in source
    path = tmp_path / "mine.py"
    path.write_text(source.replace(old, "m_new = np.max(s_t)"))
    report = tmp_path / "grade.json"
    status, out, err = _grade([path, "--json", report])
    assert status == 1, out + err
    (result,) = json.loads(report.read_text())["results"]
    assert all(r["passed"] for r in result["rows"])           # right on the chapter's row
    assert not result["probe"]["passed"] and "(800.0, 0.0, 1.0, 2.0, -3.0, 5.0)" in out
    assert "carried across tiles" in out


@pytest.mark.parametrize("exercise, old, new", [
    ("softmax_backward", "dx = w * (g - wg)", "g -= wg\n    dx = w * g"),
    ("linear_backward", "dx = dout @ W", "dx = dout @ W\n    W *= 2.0"),
    ("causal_attention", "dx = ", "dout[...] = 0.0\n        dx = "),
])
def test_changing_an_input_in_place_is_wrong(exercise, old, new, tmp_path):
    source = (SOLUTIONS / f"{exercise}.py").read_text()
    assert old in source
    path = tmp_path / "mine.py"
    path.write_text(source.replace(old, new, 1))
    status, out, err = _grade([path])
    assert status == 1 and "in place" in out, out + err


# --- the bound is held on the case's scale, not a looser one -----------------------------

@pytest.mark.parametrize("factor, passed", [(1.1, False), (0.9, True)])
def test_the_float64_bound_is_held_on_the_scale_floor(factor, passed, tmp_path):
    """The largest entry of a right dx moved by factor × FLOAT64_BOUND × max|dx|:
    outside the bound grades wrong, inside correct.  max|dx| is 0.29 here, so a floor
    computed as SCALE_FLOOR / max (0.34) would let the first one pass."""
    from parity_tests.common.tolerances import FLOAT64_BOUND
    path = tmp_path / "mine.py"
    path.write_text((SOLUTIONS / "softmax_backward.py").read_text().replace(
        "    return dx",
        f"    k = np.argmax(np.abs(dx))\n"
        f"    dx.flat[k] += {factor * FLOAT64_BOUND!r} * abs(dx.flat[k])\n    return dx"))
    report = tmp_path / "grade.json"
    status, out, err = _grade([path, "--json", report])
    (row,) = json.loads(report.read_text())["results"][0]["rows"]   # the chapter's case
    assert row["passed"] is passed and status == (0 if passed else 1), out + err
