"""How ``scripts/gpu-check`` runs its steps: each a subprocess with a deadline.

Steps run in order, each within its weight's share of the time left (time an early
step does not use goes to the later ones), and at least ``min_step`` seconds; a
step that would start with less than that left is "skipped: out of time".  The
steps of a parallel group (``check`` on several targets, say) form one unit with
the group's weight: they run side by side, ``workers`` at a time, sharing its
deadline, each with ``cpus / workers`` BLAS threads.  A step past its deadline is
killed with every process it started ("timed out after N s"); its output up to
then is kept.
"""

import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field

POLL_S = 0.1


@dataclass
class Step:
    name: str
    group: str
    argv: list = None                # None: not run; `status` says why
    status: str = None
    json: str = None                 # the step's own JSON, relative to --out
    read: str = None                 # which figures reader applies
    meta: dict = field(default_factory=dict)
    result: dict = field(default_factory=dict)
    proc: object = None
    started: float = 0.0
    limit: float = 0.0

    @property
    def failed(self):
        return self.status is not None and self.status.startswith(("failed", "timed out"))


class Runner:
    def __init__(self, root, out, log, end, min_step, weights, parallel, workers, finished):
        self.root, self.out, self.log, self.end = root, out, log, end
        self.min_step, self.weights, self.parallel, self.workers = min_step, weights, parallel, workers
        self.finished = finished             # finished(step, output): figures, summary, progress

    def run(self, steps, pending=0.0):
        """Every step of ``steps``; ``pending``: the weight of steps still to be planned."""
        units = []
        for s in steps:                      # consecutive steps of a parallel group: one unit
            if units and s.group in self.parallel and units[-1][0].group == s.group:
                units[-1].append(s)
            else:
                units.append([s])
        live = [[s for s in u if s.status is None] for u in units]
        for i, unit in enumerate(units):
            left = self.end - time.monotonic()
            if live[i] and left < self.min_step:
                for s in live[i]:
                    s.status = "skipped: out of time"
            elif live[i]:
                rest = pending + sum(self.weights[u[0].group] for u in live[i:] if u)
                deadline = time.monotonic() + max(left * self.weights[unit[0].group] / rest, self.min_step)
                self._unit(live[i], deadline, self.workers if unit[0].group in self.parallel else 1)
            for s in unit:
                if s.proc is None:
                    self.log.write(f"\n=== {s.name}: {s.status}\n")
                    self.finished(s, None)

    def _unit(self, todo, deadline, workers):
        running = []
        try:
            self._drain(list(todo), running, deadline, workers)
        finally:                             # interrupted (Ctrl-C, SIGTERM): leave no step running
            for s in running:
                if s.proc and s.proc.poll() is None:
                    _kill(s.proc)

    def _drain(self, queue, running, deadline, workers):
        """Start the queued steps, ``workers`` at a time; finish each as it ends or at the deadline."""
        threads = max(1, (os.cpu_count() or 1) // workers) if workers > 1 else None
        first_wave = True
        while queue or running:
            while queue and len(running) < workers:
                s = queue.pop(0)
                if not first_wave and deadline - time.monotonic() < self.min_step:    # queued too long
                    s.status = "skipped: out of time"
                    continue
                self._start(s, deadline, threads)
                running.append(s)
            first_wave = False
            time.sleep(POLL_S)
            for s in list(running):
                if s.proc is False or s.proc.poll() is not None or time.monotonic() >= deadline:
                    self._finish(s)
                    running.remove(s)

    def _output_path(self, step):
        return self.out / "steps" / (re.sub(r"[^A-Za-z0-9_.-]+", "_", step.name) + ".txt")

    def _start(self, step, deadline, threads):
        if step.json:
            (self.out / step.json).unlink(missing_ok=True)     # a stale one would be read as this run's
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(self.root), os.environ.get("PYTHONPATH")])))
        if threads:
            env.update({k: str(threads) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")})
        step.argv = [f"{self.out}/{a}" if a.startswith("json/") else a for a in step.argv]
        step.limit = deadline - time.monotonic()
        env["GPU_CHECK_LIMIT_S"] = f"{step.limit:.1f}"                # a step may plan within it
        step.started = time.monotonic()
        path = self._output_path(step)
        path.parent.mkdir(exist_ok=True)
        with open(path, "w") as sink:
            try:
                step.proc = subprocess.Popen(step.argv, cwd=self.root, env=env, stdout=sink,
                                             stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as e:
                step.proc = False
                step.status = f"failed (cannot start: {e})"

    def _finish(self, step):
        code = None
        if step.proc is not False:
            code = step.proc.poll()
            if code is None:                                  # past the deadline
                _kill(step.proc)
                step.status = f"timed out after {step.limit:.0f} s"
            else:
                step.status = "passed" if code == 0 else f"failed (exit {code})"
        seconds = time.monotonic() - step.started
        path = self._output_path(step)
        output = path.read_text(errors="replace") if path.exists() else ""
        path.unlink(missing_ok=True)
        self.log.write(f"\n=== {step.name}: {shlex.join(step.argv)}  (limit {step.limit:.0f} s)\n{output}"
                       f"\n--- {step.name}: {step.status} in {seconds:.1f} s\n")
        self.log.flush()
        step.result.update(command=shlex.join(step.argv), exit_code=code, seconds=round(seconds, 1),
                           limit_s=round(step.limit, 1))
        self.finished(step, output)


def _kill(proc):
    """SIGKILL to the step and every process it started (its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:                        # it ended meanwhile
        pass
    proc.wait()
