"""The blockwise reference spread over workers: same bits for any worker count,
one BLAS thread per worker, the worker count from the CPU affinity mask."""

import numpy as np
import pytest

from numpy_ref import _blas_threads, _parallel, blockwise as bw


def _run(q, k, v, dout, monkeypatch, workers):
    run_jobs = _parallel.run_jobs
    monkeypatch.setattr(_parallel, "run_jobs",
                        lambda work, jobs, w=None: run_jobs(work, jobs, workers))
    out, lse = bw.attention_forward(q, k, v, causal=True, block_q=32, block_k=48)
    grads = bw.attention_backward(dout, q, k, v, out, lse, causal=True, block_q=32, block_k=48)
    return (out, lse) + grads


def test_results_are_bitwise_independent_of_the_worker_count(monkeypatch):
    rng = np.random.default_rng(3)
    q, k, v, dout = (rng.standard_normal((2, 3, 97, 16)) for _ in range(4))
    one = _run(q, k, v, dout, monkeypatch, 1)
    for workers in (2, 5):
        many = _run(q, k, v, dout, monkeypatch, workers)
        for a, b in zip(one, many):
            assert np.array_equal(a, b)


def test_every_job_runs_once_and_an_error_reaches_the_caller():
    seen = []
    _parallel.run_jobs(seen.append, range(7), workers=3)
    assert sorted(seen) == list(range(7))

    def fails(job):
        if job == 2:
            raise RuntimeError("job 2")
    with pytest.raises(RuntimeError, match="job 2"):
        _parallel.run_jobs(fails, range(4), workers=2)


def test_the_worker_count_follows_the_affinity_mask(monkeypatch):
    monkeypatch.setattr(_parallel.os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert _parallel.usable_cpus() == 3


@pytest.mark.skipif(not _blas_threads.available(), reason="the BLAS's threads cannot be set")
def test_workers_run_their_products_on_one_blas_thread():
    _, getter = _blas_threads._get_functions()
    counts = []
    _parallel.run_jobs(lambda job: counts.append(getter()), range(4), workers=2)
    assert counts == [1, 1, 1, 1]
