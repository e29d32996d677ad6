"""``attention-parity grade FILE[:NAME]``: check your own backward, and be told which
classic mistake you made.

FILE may define any of: ``softmax_backward(w, g)``, ``scores_backward(dscores,
queries, keys)``, ``linear_backward(dout, x, W, b)``, ``class CausalAttention``,
``class MultiHeadAttention`` (the interfaces of the templates: ``--list``).
Without NAME every one of them FILE defines is graded; with NAME only that one
(another name is graded as the exercise its signature fits, or ``--exercise``).

Each is run on the chapter's input with seeded weights and a random upstream
gradient, and every tensor it returns is compared with the reference
(``numpy_ref``) and with centred finite differences.  A wrong tensor is compared
with every mistake of the catalogue; the one whose numbers match best is named,
with its residual and the line of the derivation it breaks.

Exit status: 0 everything right, 1 something wrong (or the file fails to import
or raises), 2 bad usage.  FILE is imported as ``import`` would, in this process,
with no more rights than running it yourself.

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

from parity_tests.common import outputs
from parity_tests.common.help_text import plain
from parity_tests.common.tolerances import FINITE_DIFF_BOUND, FLOAT64_BOUND
from parity_tests.lab import diagnose, loader
from parity_tests.lab import exercises_catalog as catalog
from parity_tests.lab.mistakes import MATCH_BOUND

NEAR = 1e-4     # float32 arithmetic lands around 1e-7..1e-6 of the float64 reference


def parse_args(argv):
    p = argparse.ArgumentParser(prog="attention-parity grade", description=plain(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", nargs="?", metavar="FILE[:NAME]", help="your Python file")
    p.add_argument("--exercise", choices=list(catalog.EXERCISES),
                   help="grade NAME as this exercise (default: by its name or signature)")
    p.add_argument("--list", action="store_true", help="list the exercise templates")
    p.add_argument("--template", choices=list(catalog.EXERCISES), metavar="NAME",
                   help="copy template NAME to --out (default ./NAME.py) to fill in")
    p.add_argument("--out", metavar="PATH", help="where --template writes (never over a file)")
    p.add_argument("--json", metavar="PATH", help="also write the grades as JSON ('-': stdout)")
    return p.parse_args(argv)


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
    if os.path.exists(out):
        raise loader.UsageError(f"--out: {out} exists already; choose another path "
                                f"(your work is never written over)")
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
    """[(exercise, object)] to grade in the learner's module."""
    if name is not None:
        if not hasattr(module, name):
            raise loader.UsageError(f"NAME: the file defines no {name!r}")
        obj = getattr(module, name)
        if exercise:
            return [(catalog.EXERCISES[exercise], obj)]
        return [(catalog.BY_ENTRY.get(name) or _by_signature(name, obj), obj)]
    found = [(ex, getattr(module, entry)) for entry, ex in catalog.BY_ENTRY.items()
             if callable(getattr(module, entry, None))
             and (exercise is None or ex.name == exercise)]
    if not found:
        raise loader.UsageError("the file defines none of " + ", ".join(catalog.BY_ENTRY)
                                + "; give FILE:NAME to grade another name")
    return found


# --- grading one exercise ----------------------------------------------------------

def _shape(a):
    return "missing" if a is None else str(tuple(a.shape))


def check(ex, obj, path):
    """Grade one exercise -> a dict: rows (one per tensor), passed, and either the
    learner's error message or, when wrong, the ranked diagnosis."""
    case = catalog.case(ex.name)
    result = dict(exercise=ex.name, entry=ex.entry, summary=ex.summary,
                  inputs=case["described"], rows=[], passed=False)
    try:
        tensors = loader.call(catalog.run, path, f"calling {ex.entry}", ex, obj, case)
    except loader.LearnerError as e:
        result["error"] = str(e)
        return result
    floor = diagnose.scale_floor(case["reference"])
    for name, ref in case["reference"].items():
        mine = tensors.get(name)
        e_ref = diagnose.distance(mine, ref, floor)
        e_fd = diagnose.distance(mine, case["fd"][name], floor) if name != "output" else None
        ok = e_ref <= FLOAT64_BOUND and (e_fd is None or e_fd <= FINITE_DIFF_BOUND)
        result["rows"].append(dict(tensor=name, shape=_shape(mine), expected=_shape(ref),
                                   vs_reference=e_ref, vs_finite_differences=e_fd, passed=ok))
    extra = sorted(set(tensors) - set(case["reference"]))
    if extra:
        result["extra"] = extra
    result["passed"] = all(r["passed"] for r in result["rows"]) and not extra
    # right formulas, low precision: every tensor near the reference, none within float64's bound
    result["near"] = not result["passed"] and all(r["vs_reference"] <= NEAR for r in result["rows"])
    if not result["passed"]:
        ranked = diagnose.rank(ex, case, tensors)
        result["diagnosis"] = [_named(r, m) for r, m in ranked[:3]]
        if not result["diagnosis"][0]["exact"]:
            result["by_tensor"] = {}
            for row in result["rows"]:
                if not row["passed"]:
                    r, m = diagnose.rank_tensor(ex, case, tensors, row["tensor"])[0]
                    result["by_tensor"][row["tensor"]] = _named(r, m)
    return result


def _named(residual, mistake):
    return dict(mistake=mistake.name, title=mistake.title, breaks=mistake.breaks,
                residual=residual, exact=bool(residual <= MATCH_BOUND))


def _err(e):
    return "-" if e is None else ("inf" if e == float("inf") else f"{e:.1e}")


def print_result(r, path):
    print(f"== {r['entry']} from {path}: {r['summary']}")
    print(f"   inputs: {r['inputs']}")
    if "error" in r:
        print("   " + r["error"].replace("\n", "\n   "))
        print("   result: WRONG (your code raised)")
        return
    width = max([len("tensor")] + [len(row["tensor"]) for row in r["rows"]])
    print(f"   {'tensor':<{width}}  {'shape':<10} {'expected':<10} {'vs reference':<13} "
          f"{'vs finite diff.':<16} verdict")
    for row in r["rows"]:
        print(f"   {row['tensor']:<{width}}  {row['shape']:<10} {row['expected']:<10} "
              f"{_err(row['vs_reference']):<13} {_err(row['vs_finite_differences']):<16} "
              f"{'ok' if row['passed'] else 'WRONG'}")
    if r.get("extra"):
        print(f"   gradients with names the module does not have: {', '.join(r['extra'])}")
    if r["passed"]:
        print(f"   result: correct (every tensor within {FLOAT64_BOUND:.0e} of the reference "
              f"and {FINITE_DIFF_BOUND:.0e} of finite differences)")
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
    else:
        print(f"   no catalogued mistake matches exactly; the nearest is: {best['title']}  "
              f"[{best['mistake']}], residual {_err(best['residual'])}")
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
        else:
            print(f"   {name}: no catalogued mistake matches (nearest [{d['mistake']}], "
                  f"residual {_err(d['residual'])})")
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
        module = loader.load(path)
        todo = targets(module, name, args.exercise)
    except loader.UsageError as e:
        print(f"attention-parity grade: error: {e}", file=sys.stderr)
        return 2
    except loader.LearnerError as e:
        print(f"attention-parity grade: {e}")
        return 1
    results = []
    for ex, obj in todo:
        results.append(check(ex, obj, path))
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
