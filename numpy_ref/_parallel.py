"""Independent (batch, head) jobs spread over the CPUs this process may use.

Each job runs with one BLAS thread, so there are never more busy threads than
usable CPUs (``os.sched_getaffinity``): no oversubscription, and no BLAS
threads spinning on small tiles while another process wants the core.  Idle
workers wait on a queue (they do not spin).  Each job writes only its own
slices of the outputs and sums in the same order whatever the worker count,
so the results are bitwise the same for any ``workers``.

Starting the pool's threads and handing them jobs costs about a millisecond;
work smaller than ``INLINE_BELOW`` multiply-adds (``cost``) runs on the calling
thread instead (measured: finite differences on small inputs, thousands of
calls, were three-quarters thread start-up and waits).
"""

import os
from concurrent.futures import ThreadPoolExecutor

from numpy_ref import _blas_threads

__all__ = ["usable_cpus", "run_jobs", "map_jobs"]

INLINE_BELOW = 2 ** 24       # multiply-adds: less than a millisecond of work in all


def usable_cpus():
    """CPUs this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):                # not on every platform
        return max(1, os.cpu_count() or 1)


def run_jobs(work, jobs, workers=None, cost=None):
    """``work(job)`` for every job, on ``workers`` threads (default: usable CPUs,
    at most one per job), each BLAS call on one thread."""
    for _ in map_jobs(work, jobs, workers, cost):
        pass


def map_jobs(work, jobs, workers=None, cost=None):
    """``work(job)`` for every job, yielded in the order of ``jobs`` whatever
    order they finish in (so a caller reducing the results in that order gets
    the same bits for any ``workers``), each BLAS call on one thread.  Without
    a way to set the BLAS's threads the jobs run one after another with the
    BLAS as it is.  ``cost``: the jobs' multiply-adds in all, if known; below
    ``INLINE_BELOW`` they run on this thread (the default worker count only)."""
    jobs = list(jobs)
    if workers is None:
        workers = 1 if cost is not None and cost < INLINE_BELOW else usable_cpus()
    workers = max(1, min(int(workers), len(jobs)))
    if not _blas_threads.available():
        workers = 1
    with _blas_threads.blas_threads(1):
        if workers == 1:
            for job in jobs:
                yield work(job)
            return
        with ThreadPoolExecutor(max_workers=workers) as pool:
            yield from pool.map(work, jobs)
