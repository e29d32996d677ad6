"""The blockwise reference spread over workers: same bits for any worker count,
one BLAS thread per worker, the worker count from the CPU affinity mask."""

import numpy as np
import pytest

from numpy_ref import _blas_threads, _parallel, blockwise as bw


def _run(q, k, v, dout, monkeypatch, workers):
    run_jobs = _parallel.run_jobs
    monkeypatch.setattr(_parallel, "run_jobs",
                        lambda work, jobs, w=None, cost=None: run_jobs(work, jobs, workers))
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


def _reference(monkeypatch, workers, bias_shape, rows_per_job=16):
    from numpy_ref import reference, reference_attention
    monkeypatch.setattr(_parallel, "usable_cpus", lambda: workers)
    monkeypatch.setattr(_parallel, "INLINE_BELOW", 0)             # small as it is: on the pool
    monkeypatch.setattr(reference, "ROWS_PER_JOB", rows_per_job)  # long heads split too
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 4, 53, 8))
    k, v = (rng.standard_normal((2, 2, 41, 8)) for _ in range(2))
    dout, dlse = rng.standard_normal((2, 4, 53, 8)), rng.standard_normal((2, 4, 53))
    return reference_attention(q, k, v, dout, dlse=dlse, causal=True, align="bottom-right",
                               softcap=3.0, bias=rng.standard_normal(bias_shape),
                               sinks=rng.standard_normal(4), block_q=8, block_k=16)


@pytest.mark.parametrize("bias_shape", [(53, 41), (1, 4, 1, 41), (2, 1, 53, 41)])
def test_the_reference_is_bitwise_independent_of_the_worker_count(monkeypatch, bias_shape):
    """Jobs of (batch, kv head, 16 query rows): dk, dv, the broadcast dbias and
    the batch-summed dsinks are per-job partials added in the jobs' order."""
    one = _reference(monkeypatch, 1, bias_shape)
    for workers in (2, 5):
        many = _reference(monkeypatch, workers, bias_shape)
        assert set(many) == set(one)
        for name in one:
            assert np.array_equal(one[name], many[name]), (workers, name)


def test_small_work_runs_on_the_calling_thread_and_large_work_on_the_pool(monkeypatch):
    import threading
    monkeypatch.setattr(_parallel, "usable_cpus", lambda: 2)

    def where(cost):                                  # the threads the jobs ran on
        return set(_parallel.map_jobs(lambda job: threading.get_ident(), range(4), cost=cost))
    assert where(_parallel.INLINE_BELOW - 1) == {threading.get_ident()}
    assert threading.get_ident() not in where(_parallel.INLINE_BELOW)
    assert threading.get_ident() not in where(None)


def test_map_jobs_yields_in_the_jobs_order_whatever_order_they_finish_in():
    import time
    got = list(_parallel.map_jobs(lambda j: time.sleep(0.01 * (5 - j)) or j, range(5), workers=3))
    assert got == list(range(5))


def test_splitting_a_head_into_row_jobs_changes_only_the_rounding(monkeypatch):
    split = _reference(monkeypatch, 2, (53, 41))
    whole = _reference(monkeypatch, 2, (53, 41), rows_per_job=10 ** 6)
    assert not np.array_equal(split["dk"], whole["dk"])          # summed in another order
    for name in whole:
        scale = max(np.abs(whole[name][np.isfinite(whole[name])]).max(), 1.0)
        assert np.allclose(split[name], whole[name], rtol=0, atol=1e-13 * scale), name
