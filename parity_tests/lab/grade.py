"""``attention-parity grade FILE[:NAME]``: check your own backward, and be told which
classic mistake you made.

FILE may define any of: ``softmax_backward(w, g)``, ``scores_backward(dscores,
queries, keys)``, ``linear_backward(dout, x, W, b)``, ``softcap_backward(dS, S,
cap)``, ``sink_gradient(dO, O, p_sink)``, ``class CausalAttention``,
``class MultiHeadAttention`` (the interfaces of the templates: ``--list``).
Without NAME every one of them FILE defines is graded; with NAME only that one
(another name is graded as the exercise its signature fits, or ``--exercise``).

Each is run on the chapter's input with seeded weights and a random upstream
gradient, and every tensor it returns is compared with the reference
(``numpy_ref``) and with centred finite differences.  A wrong tensor is compared
with every mistake of the catalogue; the one whose numbers match best is named,
with its residual and the line of the derivation it breaks.

Where the interface promises any leading axes (``(..., n)``) a right answer is
tried on inputs of another shape too; an argument changed in place is wrong.

Exit status: 0 everything right, 1 something wrong (or the file fails to import,
raises, exits, crashes or runs longer than --timeout), 2 bad usage.  FILE is
imported as ``import`` would, in a process of its own (`sandbox`), with no more
rights than running it yourself.

    attention-parity grade --list                      the exercises
    attention-parity grade --template softmax_backward copy one here, to fill in
    attention-parity grade softmax_backward.py         grade it
"""

import argparse
import inspect
import json
import os
import shutil
import sys
from importlib import resources

import numpy as np

from parity_tests.common import outputs
from parity_tests.common.help_text import Parser, plain
from parity_tests.common.tolerances import FINITE_DIFF_BOUND, FLOAT64_BOUND
from parity_tests.lab import diagnose, loader, sandbox
from parity_tests.lab import exercises_catalog as catalog
from parity_tests.lab.mistakes import MATCH_BOUND

NEAR = 1e-4     # float32 arithmetic lands around 1e-7..1e-6 of the float64 reference


# The page that explains the verb (its --help and every usage error name it).
PAGE = "docs/lab.md#2-attention-parity-grade-check-your-own-backward-be-told-which-mistake-you-made"

def parse_args(argv):
    p = Parser(page=PAGE, prog="attention-parity grade", description=plain(__doc__),
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", nargs="?", metavar="FILE[:NAME]", help="your Python file")
    p.add_argument("--exercise", choices=list(catalog.EXERCISES),
                   help="grade NAME as this exercise (default: by its name or signature)")
    p.add_argument("--list", action="store_true", help="list the exercise templates")
    p.add_argument("--template", choices=list(catalog.EXERCISES), metavar="NAME",
                   help="copy template NAME to --out (default ./NAME.py) to fill in")
    p.add_argument("--out", metavar="PATH", help="where --template writes (never over a file)")
    p.add_argument("--json", metavar="PATH", help="also write the grades as JSON ('-': stdout)")
    p.add_argument("--timeout", type=_seconds, default=sandbox.TIMEOUT_S, metavar="SECONDS",
                   help=f"stop your code when importing it or one call of it takes longer "
                        f"(default {sandbox.TIMEOUT_S:g})")
    return p.parse_args(argv)


def _seconds(text):
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


# --- templates ---------------------------------------------------------------------

def template_path(name, solution=False):
    folder = resources.files("parity_tests.lab.exercises")
    return folder / ("solutions" if solution else "") / f"{name}.py"


def list_templates():
    print("exercises (attention-parity grade --template NAME copies one):")
    width = max(len(n) for n in catalog.EXERCISES)
    for ex in catalog.EXERCISES.values():
        print(f"  {ex.name:<{width}}  {ex.summary}")
    return 0


def copy_template(name, out):
    out = out or f"{name}.py"
    if os.path.exists(out) and not os.path.isdir(out):
        raise loader.UsageError(f"--out: {out} exists already; choose another path "
                                f"(your work is never written over)")
    problem = outputs.output_file_problem("--out", out)
    if problem:
        raise loader.UsageError(problem)
    with resources.as_file(template_path(name)) as src:
        shutil.copyfile(src, out)
    print(f"wrote {out}: fill in the body, then run  attention-parity grade {out}")
    return 0


# --- choosing what to grade ----------------------------------------------------------

def split_target(target):
    """'file.py:NAME' -> ('file.py', 'NAME'); 'file.py' -> ('file.py', None)."""
    path, sep, name = target.rpartition(":")
    if sep and path.endswith(".py") and name.isidentifier():
        return path, name
    return target, None


def _by_signature(name, obj):
    if inspect.isclass(obj):
        params = inspect.signature(obj).parameters
        return catalog.EXERCISES["multihead_attention" if "num_heads" in params
                                 else "causal_attention"]
    n = len([p for p in inspect.signature(obj).parameters.values()
             if p.default is inspect.Parameter.empty])
    by_count = {2: "softmax_backward", 3: "scores_backward", 4: "linear_backward"}
    if n not in by_count:
        raise loader.UsageError(f"{name} takes {n} arguments: no exercise fits; "
                                f"name it with --exercise (see --list)")
    return catalog.EXERCISES[by_count[n]]


def targets(module, name, exercise):
    """[(exercise name, attribute name)] to grade in the learner's module."""
    if name is not None:
        if not hasattr(module, name):
            raise loader.UsageError(f"NAME: the file defines no {name!r}")
        if exercise:
            return [(exercise, name)]
        return [((catalog.BY_ENTRY.get(name) or _by_signature(name, getattr(module, name))).name,
                 name)]
    found = [(ex.name, entry) for entry, ex in catalog.BY_ENTRY.items()
             if callable(getattr(module, entry, None))
             and (exercise is None or ex.name == exercise)]
    if not found:
        raise loader.UsageError("the file defines none of " + ", ".join(catalog.BY_ENTRY)
                                + "; give FILE:NAME to grade another name")
    return found


def _call(module, exercise, attribute, inputs, path, doing):
    """In the learner's process: their ``attribute`` run as ``exercise`` on ``inputs``."""
    return loader.call(catalog.run, path, doing, catalog.EXERCISES[exercise],
                       getattr(module, attribute), inputs)


HANDLERS = {"load": targets, "call": _call}     # what the learner's process is asked


def _inputs(case):
    """What the learner's code is given of a case: its inputs (a module's weights too)."""
    return {k: case[k] for k in ("inputs", "state") if k in case}


# --- grading one exercise ----------------------------------------------------------

def _shape(a):
    return "missing" if a is None else str(tuple(a.shape))


def _rows(tensors, case):
    floor = diagnose.scale_floor(case["reference"])
    rows = []
    for name, ref in case["reference"].items():
        mine = tensors.get(name)
        e_ref = diagnose.distance(mine, ref, floor)
        fd = case.get("fd", {}).get(name) if name != "output" else None
        e_fd = None if fd is None else diagnose.distance(mine, fd, floor)
        ok = e_ref <= FLOAT64_BOUND and (e_fd is None or e_fd <= FINITE_DIFF_BOUND)
        rows.append(dict(tensor=name, shape=_shape(mine), expected=_shape(ref),
                         vs_reference=e_ref, vs_finite_differences=e_fd, passed=ok))
    return rows


def check(ex, learner, attribute, path):
    """Grade one exercise -> a dict: rows (one per tensor), passed, and either the
    learner's error message or, when wrong, the ranked diagnosis."""
    case = catalog.case(ex.name)
    result = dict(exercise=ex.name, entry=ex.entry, summary=ex.summary,
                  inputs=case["described"], rows=[], passed=False)
    doing = f"calling {ex.entry}"
    try:
        tensors, changed = learner.ask(doing, "call", ex.name, attribute, _inputs(case), path,
                                       doing)
        result["rows"] = _rows(tensors, case)
        rows_pass = all(r["passed"] for r in result["rows"])
        probe = catalog.probe(ex.name) if rows_pass else None
        if probe is not None:                 # right here: right on the promised shapes too?
            doing += f" on other shapes ({probe['described']})"
            probe_tensors, probe_changed = learner.ask(doing, "call", ex.name, attribute,
                                                       _inputs(probe), path, doing)
            rows = _rows(probe_tensors, probe)
            result["probe"] = dict(inputs=probe["described"], rows=rows, advice=probe["advice"],
                                   passed=all(r["passed"] for r in rows))
            changed = sorted(set(changed) | set(probe_changed))
    except loader.LearnerError as e:
        result["error"] = str(e)
        return result
    if changed:
        result["changed_in_place"] = changed
    extra = sorted(set(tensors) - set(case["reference"]))
    if extra:
        result["extra"] = extra
    result["passed"] = (rows_pass and not extra and not changed
                        and result.get("probe", {}).get("passed", True))
    # right formulas, low precision: every tensor near the reference, none within float64's bound
    result["near"] = not rows_pass and all(r["vs_reference"] <= NEAR for r in result["rows"])
    if not rows_pass:
        error = max(r["vs_reference"] for r in result["rows"])
        ranked = diagnose.rank(ex, case, tensors)
        result["diagnosis"] = [_named(r, m, error) for r, m in ranked[:3]]
        if not result["diagnosis"][0]["exact"]:
            result["by_tensor"] = {}
            for row in result["rows"]:
                if not row["passed"]:
                    r, m = diagnose.rank_tensor(ex, case, tensors, row["tensor"])[0]
                    result["by_tensor"][row["tensor"]] = _named(r, m, row["vs_reference"])
    return result


def _named(residual, mistake, error):
    """One mistake's entry of the diagnosis; ``closer``: the learner's numbers are nearer
    to it than to the right answer (``error``), so naming it is a hint, not noise."""
    return dict(mistake=mistake.name, title=mistake.title, breaks=mistake.breaks,
                residual=residual, exact=bool(residual <= MATCH_BOUND),
                closer=bool(np.isfinite(residual) and residual < error))


def _err(e):
    return "-" if e is None else ("inf" if e == float("inf") else f"{e:.1e}")


def _print_rows(rows, width, sw):
    for row in rows:
        print(f"   {row['tensor']:<{width}}  {row['shape']:<{sw}} {row['expected']:<{sw}} "
              f"{_err(row['vs_reference']):<13} {_err(row['vs_finite_differences']):<16} "
              f"{'ok' if row['passed'] else 'WRONG'}")


def print_result(r, path):
    print(f"== {r['entry']} from {path}: {r['summary']}")
    print(f"   inputs: {r['inputs']}")
    if "error" in r:
        print("   " + r["error"].replace("\n", "\n   "))
        print("   result: WRONG (no answer from your code)")
        return
    width = max([len("tensor")] + [len(row["tensor"]) for row in r["rows"]])
    every = r["rows"] + r.get("probe", {}).get("rows", [])
    sw = max([10] + [len(row[k]) for row in every for k in ("shape", "expected")])
    print(f"   {'tensor':<{width}}  {'shape':<{sw}} {'expected':<{sw}} {'vs reference':<13} "
          f"{'vs finite diff.':<16} verdict")
    _print_rows(r["rows"], width, sw)
    if r.get("extra"):
        print(f"   gradients with names the module does not have: {', '.join(r['extra'])}")
    if r["passed"]:
        print(f"   result: correct (every tensor within {FLOAT64_BOUND:.0e} of the reference "
              f"and {FINITE_DIFF_BOUND:.0e} of finite differences)")
        return
    if r.get("changed_in_place"):
        print(f"   your code changed its argument {' and '.join(r['changed_in_place'])} in "
              f"place: the caller's array is changed too (compute into a new array: "
              f"a = a - b, not a -= b)")
    if all(row["passed"] for row in r["rows"]):
        if not r.get("probe", {}).get("passed", True):
            print(f"   right on the chapter's input, wrong on another; the interface "
                  f"promises {r['probe']['inputs']}:")
            _print_rows(r["probe"]["rows"], width, sw)
            print(f"   {r['probe']['advice']}")
        print("   result: WRONG")
        return
    if r["near"]:
        print(f"   every tensor is within {NEAR:.0e} of the reference, none within "
              f"{FLOAT64_BOUND:.0e}: the formulas look right and precision was lost "
              f"(float32 somewhere? the inputs are float64)")
        print("   result: WRONG")
        return
    best, *others = r["diagnosis"]
    if best["exact"]:
        print(f"   diagnosis: {best['title']}  [{best['mistake']}]")
        print(f"     your numbers are this mistake's, to a residual of {best['residual']:.1e}")
    elif any(d["exact"] for d in r["by_tensor"].values()):
        _print_by_tensor(r["by_tensor"])
        return
    elif best["closer"]:
        print(f"   no catalogued mistake matches exactly; the nearest is: {best['title']}  "
              f"[{best['mistake']}], residual {_err(best['residual'])}")
    else:
        print("   no catalogued mistake is closer to your numbers than the right answer is")
        print("   result: WRONG")
        return
    print(f"     it breaks: {best['breaks']}")
    if others:
        print("     next: " + "; ".join(f"{o['mistake']} ({_err(o['residual'])})" for o in others))
    print("   result: WRONG")


def _print_by_tensor(by_tensor):
    """More than one mistake at once: each wrong tensor with the mistake that explains it."""
    print("   no single catalogued mistake explains every tensor; tensor by tensor:")
    for name, d in by_tensor.items():
        if d["exact"]:
            print(f"   {name}: {d['title']}  [{d['mistake']}], residual {_err(d['residual'])}")
            print(f"     it breaks: {d['breaks']}")
        elif d["closer"]:
            print(f"   {name}: no catalogued mistake matches (nearest [{d['mistake']}], "
                  f"residual {_err(d['residual'])})")
        else:
            print(f"   {name}: no catalogued mistake is closer to it than the right answer is")
    print("   result: WRONG")


# --- the command ---------------------------------------------------------------------

def main(argv=None):
    try:
        args = parse_args([] if argv is None else list(argv))
    except SystemExit as e:
        return int(e.code or 0)
    try:
        if args.list:
            return list_templates()
        if args.template:
            return copy_template(args.template, args.out)
        if not args.target:
            raise loader.UsageError("give FILE[:NAME] to grade, or --list, or --template NAME")
        problem = args.json not in (None, "-") and outputs.output_file_problem("--json", args.json)
        if problem:                                   # before the learner's file runs
            raise loader.UsageError(problem)
        path, name = split_target(args.target)
        loader.check_path(path)
    except loader.UsageError as e:
        print(f"attention-parity grade: error: {e} (see {PAGE})", file=sys.stderr)
        return 2
    results = []
    with sandbox.Learner(path, HANDLERS, args.timeout) as learner:
        try:
            todo = learner.ask(f"importing {os.path.basename(path)}", "load", name, args.exercise)
        except loader.UsageError as e:
            print(f"attention-parity grade: error: {e} (see {PAGE})", file=sys.stderr)
            return 2
        except loader.LearnerError as e:
            print(f"attention-parity grade: {e}")
            return 1
        for exercise, attribute in todo:
            results.append(check(catalog.EXERCISES[exercise], learner, attribute, path))
            print_result(results[-1], path)
            print()
    if args.json:
        text = json.dumps({"file": path, "passed": all(r["passed"] for r in results),
                           "results": results}, indent=1, default=float)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text)
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
