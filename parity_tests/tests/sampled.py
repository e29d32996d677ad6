"""``one_in(n, params)``: a parametrised family's every ``n``-th case in the default run, the
rest under ``-m slow`` (CI runs both, so the whole family is still checked there).  Keeps the
default suite within its minute and a quarter while each family keeps a case in it.  ``MOVED``
marks a case or test moved to ``slow`` for time alone: it is judged as in the default run (the
``without_input_classes`` fixture still leaves the input classes out)."""

import pytest

MOVED = (pytest.mark.slow, pytest.mark.moved)


def one_in(n, params):
    """``params`` (plain values, tuples for several arguments, or ``pytest.param``s), every
    ``n``-th kept as it is and the others marked `MOVED`."""
    out = []
    for i, p in enumerate(params):
        if i % n == 0:
            out.append(p)
        elif isinstance(p, type(pytest.param(None))):
            out.append(pytest.param(*p.values, marks=[*p.marks, *MOVED], id=p.id))
        else:
            out.append(pytest.param(*(p if isinstance(p, tuple) else (p,)), marks=MOVED))
    return out


def moved(test):
    """A whole test moved to ``slow`` for time alone (`MOVED`)."""
    for mark in MOVED:
        test = mark(test)
    return test
