"""Which catalogued mistake explains a wrong answer, and how closely.

Every tensor is compared on the scale of the case (`scale_floor`), the parity
suite's way: a gradient that is ~0 in exact arithmetic is not judged on its own
rounding noise.
"""

import numpy as np

from parity_tests.common.finite_diff import rel_error
from parity_tests.common.tolerances import SCALE_FLOOR
from parity_tests.lab import module_mistakes
from parity_tests.lab.mistakes import FUNCTION_MISTAKES


def scale_floor(reference):
    """SCALE_FLOOR times the largest magnitude among the reference's gradients."""
    grads = [np.max(np.abs(v)) for k, v in reference.items() if k != "output" and v is not None]
    return SCALE_FLOOR * float(max(grads))


def distance(a, b, floor):
    """rel_error of two tensors, inf when one is missing, shapes differ or a is not finite."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else np.inf
    if a.shape != b.shape or not np.all(np.isfinite(a)):
        return np.inf
    return rel_error(a, b, floor)


def candidates(ex, case):
    """[(mistake, tensors)] for exercise ``ex``, computed once per case."""
    if "candidates" not in case:
        out = []
        if ex.kind == "function":
            for m in FUNCTION_MISTAKES[ex.name]:
                out.append((m, dict(zip(ex.outputs, m.compute(*case["inputs"])))))
        else:
            for m in module_mistakes.mistakes_for(ex.entry):
                tensors = module_mistakes.candidate(m, ex.entry, case)
                if tensors is not None:
                    out.append((m, tensors))
        case["candidates"] = out
    return case["candidates"]


def rank(ex, case, learner):
    """[(residual, mistake)], best first: residual = the largest distance over every
    tensor of the reference between the learner's and the mistake's."""
    floor = scale_floor(case["reference"])
    ranked = []
    for mistake, tensors in candidates(ex, case):
        r = max(distance(learner.get(k), tensors.get(k), floor) for k in case["reference"])
        ranked.append((r, mistake))
    ranked.sort(key=lambda rm: rm[0])
    return ranked


def rank_tensor(ex, case, learner, name):
    """[(residual, mistake)] for one tensor alone, best first: when two mistakes were
    made at once no single one explains every tensor, but each may explain its own."""
    floor = scale_floor(case["reference"])
    ranked = [(distance(learner.get(name), tensors.get(name), floor), mistake)
              for mistake, tensors in candidates(ex, case)]
    ranked.sort(key=lambda rm: rm[0])
    return ranked
