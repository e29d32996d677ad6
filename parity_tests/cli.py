"""``attention-parity`` / ``python -m parity_tests``: one entry point, several verbs.

    attention-parity [--device ...] [--dtype ...] [--json PATH]   the parity matrix
    attention-parity bench     ...   NumPy vs PyTorch speed and memory
    attention-parity chapter   ...   the chapter's worked examples, replayed
    attention-parity jacobian  ...   the softmax Jacobian, derived and checked
    attention-parity claims    ...   the chapter's numeric claims, measured

Each verb lives in its own module with a ``main(argv) -> int`` and is imported
only when asked for, so ``--help`` of one verb never pays for another.
"""

import importlib
import sys

VERBS = {
    "bench": "parity_tests.bench",
    "chapter": "parity_tests.chapter",
    "jacobian": "parity_tests.jacobian",
    "claims": "parity_tests.claims",
}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in VERBS:
        module = importlib.import_module(VERBS[argv[0]])
        return module.main(argv[1:])
    from parity_tests import run_parity
    return run_parity.main(argv)


if __name__ == "__main__":
    sys.exit(main())
