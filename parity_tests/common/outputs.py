"""What every verb checks before it does any work: where it will write, and its seed.

A run that takes minutes and then cannot write its ``--json`` file (or its
``--plot`` directory) has wasted those minutes; so each output path is tried
*first*, by actually opening it, and a refusal is one line with exit status 2
(the status of a bad argument), never a traceback after the run.

    problem = output_file_problem("--json", path)     # None when PATH can be written
    problem = output_dir_problem("--plot", directory)  # creates DIR when missing
"""

import argparse
import os
import tempfile

SEED_MAX = 2**32 - 1      # NumPy's and PyTorch's seeds both accept 0 .. 2**32 - 1


def output_file_problem(flag, path):
    """``None`` when ``path`` can be written (it is created and, if new, removed
    again), else one line naming ``flag``, the path and why not."""
    if path is None:
        return None
    if path == "":
        return f"{flag}: expected a file path, got ''"
    if os.path.isdir(path):
        return f"{flag} {path}: is a directory; give a file path such as {os.path.join(path, 'out.json')}"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"{flag} {path}: directory {parent} does not exist (create it first)"
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        return f"{flag} {path}: cannot write there ({e.strerror or e})"
    if not existed:
        os.remove(path)
    return None


def output_dir_problem(flag, directory):
    """``None`` when files can be written into ``directory`` (created, with its
    parents, when missing), else one line naming ``flag``, the path and why not."""
    if directory is None:
        return None
    if directory == "":
        return f"{flag}: expected a directory, got ''"
    if os.path.exists(directory) and not os.path.isdir(directory):
        return f"{flag} {directory}: exists and is not a directory"
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        return f"{flag} {directory}: cannot write there ({e.strerror or e})"
    return None


def seed(text):
    """argparse type of ``--seed``: an integer in 0 .. 2**32 - 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}")
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(
            f"expected a seed in 0 .. 2**32 - 1 = {SEED_MAX}, got {text}")
    return value
