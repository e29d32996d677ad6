"""Running the learner's code in a process of its own, with a time limit.

`Learner(path)` forks a child process that imports the learner's file
(`loader.load`) and then calls their code on whatever inputs the grader sends;
the grader keeps the right answers and does all the judging.  Whatever the
learner's code does, looping forever, calling ``os._exit(0)``, killing the
interpreter, it ends the child and never the grader: a request that gets no
answer in ``timeout`` seconds, or whose child is gone, becomes a `LearnerError`
that says so in one line (exit status 1).  What the learner's code prints is
captured in the child and printed by the grader, in order.

The child only runs the learner's code on NumPy arrays; the grader's inputs and
the learner's tensors cross the pipe pickled.
"""

import contextlib
import faulthandler
import io
import multiprocessing
import signal
import sys

from parity_tests.lab import loader

TIMEOUT_S = 30.0     # per request: the exercises run in milliseconds, a loaded machine in seconds


def _how_it_ended(exitcode):
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}, a crash"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit status {exitcode}: os._exit() or the interpreter's own exit"


def _serve(conn, path, handlers):
    """The child: answer (request, *args) with (kind, value, printed) until the pipe closes."""
    faulthandler.disable()          # a crash of the learner's code is the grader's to report
    module = None
    while True:
        try:
            request, *args = conn.recv()
        except EOFError:
            return
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                if request == "load":
                    module = loader.load(path)
                    value = handlers["load"](module, *args)
                else:
                    value = handlers[request](module, *args)
            reply = ("ok", value)
        except loader.UsageError as e:
            reply = ("usage", str(e))
        except loader.LearnerError as e:
            reply = ("learner", str(e))
        conn.send(reply + (printed.getvalue(),))


class Learner:
    """The learner's file, imported in a child process: ``ask(doing, request, *args)``
    runs ``handlers[request](module, *args)`` there and returns its value.

    ``handlers`` are the grader's functions (run in the child); each turns the
    learner's exceptions into `loader.LearnerError` (`loader.call`)."""

    def __init__(self, path, handlers, timeout=TIMEOUT_S):
        self.path, self.timeout = path, timeout
        ctx = multiprocessing.get_context("fork")
        self._conn, child_end = ctx.Pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        self._proc = ctx.Process(target=_serve, args=(child_end, path, handlers), daemon=True)
        self._proc.start()
        child_end.close()

    def ask(self, doing, request, *args):
        self._conn.send((request, *args))
        if not self._conn.poll(self.timeout):
            self.close()
            raise loader.LearnerError(f"{doing}: no answer after {self.timeout:g} s (an endless "
                                      f"loop?), stopped; --timeout SECONDS allows longer")
        try:
            kind, value, printed = self._conn.recv()
        except EOFError:
            self._proc.join()
            raise loader.LearnerError(f"{doing}: your code ended the grading process "
                                      f"({_how_it_ended(self._proc.exitcode)}) before "
                                      f"returning") from None
        sys.stdout.write(printed)
        if kind == "usage":
            raise loader.UsageError(value)
        if kind == "learner":
            raise loader.LearnerError(value)
        return value

    def close(self):
        self._conn.close()
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
