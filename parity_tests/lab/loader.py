"""Importing the learner's file the way ``import`` would, and reporting its errors.

The file is loaded with ``importlib`` from its path, with its folder first on
``sys.path`` (as ``python FILE`` would have it, so its own imports work), with
this process's rights: nothing more than running it yourself (the grader calls
this in a child process of its own, `sandbox`).  An exception while importing or calling it is turned into a
`LearnerError` whose message names the exception and the lines of the learner's
file it went through; the grader's own frames are left out.
"""

import importlib.util
import os
import sys
import traceback


class LearnerError(Exception):
    """The learner's code failed; the message says where, in their file."""


class UsageError(Exception):
    """The command was given something it cannot grade (exit status 2)."""


def describe(exc, path, doing):
    """'<doing> raised <Type>: <message>' and the learner's frames, innermost last."""
    path = os.path.abspath(path)
    if isinstance(exc, NotImplementedError):
        head = f"{doing}: not written yet ({exc or 'NotImplementedError'}); then grade again"
    elif isinstance(exc, SyntaxError) and exc.filename and os.path.abspath(exc.filename) == path:
        return (f"{doing} failed: SyntaxError: {exc.msg}\n"
                f"  {os.path.basename(path)}, line {exc.lineno}: {(exc.text or '').strip()}")
    else:
        head = f"{doing} raised {type(exc).__name__}: {exc}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if os.path.abspath(f.filename) == path]
    lines = [f"  {os.path.basename(f.filename)}, line {f.lineno}, in {f.name}: {f.line}"
             for f in frames]
    return "\n".join([head] + lines)


def check_path(path):
    """UsageError unless ``path`` is a .py file that exists."""
    if os.path.isdir(path):
        raise UsageError(f"FILE: {path} is a directory; give a Python file in it, "
                         f"such as {os.path.join(path, 'softmax_backward.py')}")
    if not os.path.isfile(path):
        raise UsageError(f"FILE: no such file: {path}")
    if not path.endswith(".py"):
        raise UsageError(f"FILE must be a Python file ending in .py, got {path}")


def load(path):
    """The learner's file as a module object; UsageError if it is not a .py file that
    exists, LearnerError if importing it raises."""
    check_path(path)
    stem = os.path.splitext(os.path.basename(path))[0]
    name = stem if stem.isidentifier() and stem not in sys.modules else f"_graded_{abs(hash(path))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except KeyboardInterrupt:
        raise
    except BaseException as e:                 # SystemExit too: a script's exit() at import
        sys.modules.pop(name, None)
        raise LearnerError(describe(e, path, f"importing {os.path.basename(path)}")) from None
    finally:
        if sys.path and sys.path[0] == folder:
            sys.path.pop(0)
    return module


def call(fn, path, doing, *args, **kwargs):
    """``fn(*args, **kwargs)``; an exception becomes a LearnerError."""
    try:
        return fn(*args, **kwargs)
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        raise LearnerError(describe(e, path, doing)) from None
