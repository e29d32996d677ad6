"""``attention-parity`` / ``python -m parity_tests``: one entry point, several verbs.

``VERBS`` below is the one dispatch table: each verb names the module that holds
its ``main(argv) -> int`` and one line of help, from which ``attention-parity
--help`` is generated.  A new verb is one line there.  A verb's module is
imported only when asked for, so one verb's ``--help`` never pays for another.
With no verb, the command runs the parity matrix.
"""

import difflib
import importlib
import sys

# verb -> (module holding main(argv), one line for the top-level help)
VERBS = {
    "chapter": ("parity_tests.chapter.replay",
                "replay the chapter's worked examples with NumPy and PyTorch"),
    "jacobian": ("parity_tests.chapter.jacobian",
                 "the softmax Jacobian, derived and checked against autograd"),
    "claims": ("parity_tests.chapter.claims", "measure the chapter's numeric claims"),
    "bench": ("parity_tests.bench.run", "time NumPy vs PyTorch forward+backward, with memory"),
    "check": ("parity_tests.kernels.run", "hold any attention kernel to the float64 reference, diagnose failures"),
    "audit": ("parity_tests.kernels.audit",
              "which planted mistakes your test's tolerance lets through, which correct kernels it rejects"),
    "backprop": ("parity_tests.lab.walkthrough",
                 "the chapter's example backwards, every intermediate gradient, NumPy vs autograd"),
    "grade": ("parity_tests.lab.grade",
              "check your own backward pass and be told which classic mistake it makes"),
}
MATRIX = "parity_tests.matrix.run"      # no verb: the parity matrix

USAGE = "usage: attention-parity [VERB] [options]"


def verbs_help():
    """The top-level help's list of verbs, one line each."""
    width = max(len(v) for v in VERBS)
    lines = [f"  {'(none)':<{width}}  the parity matrix: every module, NumPy vs PyTorch "
             "(options below)"]
    lines += [f"  {verb:<{width}}  {line}" for verb, (_, line) in VERBS.items()]
    return ("verbs (attention-parity VERB --help for each):\n" + "\n".join(lines)
            + "\n\nEvery page: README.md and docs/ (docs/architecture.md for the code's layout)")


def _suggestion(word):
    """'did you mean ...' for a mistyped verb, or '' when nothing is close."""
    close = difflib.get_close_matches(word, list(VERBS), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


REQUIRED = ("torch", "numpy")     # a missing one is named, with how to install it


def _say_missing(name):
    print(f"attention-parity: error: this command needs {name}, which is not installed. "
          f"Install it first (see README.md#quick-start: pip install torch==<version>, or "
          f"PyTorch's CPU index on a machine without a GPU), then pip install -e .",
          file=sys.stderr)


def _load(module_name):
    """The verb's module, or None after saying what is missing (PyTorch, say)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name not in REQUIRED:
            raise
        _say_missing(e.name)
        return None


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "help":          # `help` and `help VERB` read as --help
        argv = argv[1:2] + ["--help"]
    if argv and argv[0] in VERBS:
        module = _load(VERBS[argv[0]][0])
        return 2 if module is None else _status(module.main, argv[1:])
    if argv and not argv[0].startswith("-"):
        print(f"{USAGE}\nattention-parity: error: unknown verb '{argv[0]}'"
              f"{_suggestion(argv[0])}\n{verbs_help()}", file=sys.stderr)
        return 2
    module = _load(MATRIX)
    if module is None:
        return 2
    if "-h" in argv or "--help" in argv:
        print(module.build_parser().format_help())
        print(verbs_help())
        return 0
    return _status(module.main, argv)


def _status(verb_main, argv):
    """A verb's exit status, also when its argument parser exits (--help: 0, refused: 2)
    and when a verb that imports PyTorch only to run (bench) finds it missing (2)."""
    try:
        return verb_main(argv)
    except ModuleNotFoundError as e:
        if e.name not in REQUIRED:
            raise
        _say_missing(e.name)
        return 2
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)


if __name__ == "__main__":
    sys.exit(main())
