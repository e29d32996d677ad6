"""The benchmark's output structure on a tiny shape.  Timings are never asserted."""

import json
import math

import pytest

from parity_tests import cli
from parity_tests.bench import impls
from parity_tests.bench import run as bench

TINY = ["--tokens", "4,8", "--repeats", "1", "--d-model", "8", "--heads", "2",
        "--impl", ",".join(impls.IMPLS)]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    status = cli.main(["bench", *TINY, "--json", str(path)])
    with open(path) as f:
        return status, json.load(f)


def test_bench_exits_zero_and_writes_every_section(tiny_run):
    status, result = tiny_run
    assert status == 0
    assert set(result) == {"machine", "threads", "config", "rows", "growth_exponent",
                           "fit_tokens", "runtime_s", "gemm_gflops"}
    assert result["gemm_gflops"] > 0
    assert result["config"]["tokens"] == [4, 8]
    assert result["config"]["repeats"] == 1
    assert result["config"]["impls"] == list(impls.IMPLS)
    assert result["fit_tokens"] == [4, 8]
    assert result["machine"]["cpu_count"] >= 1
    assert result["threads"]["torch_threads"] >= 1


def test_each_row_has_every_implementation_and_figure(tiny_run):
    _, result = tiny_run
    assert [r["tokens"] for r in result["rows"]] == [4, 8]
    for row in result["rows"]:
        assert row["skipped"] == {}
        for name in impls.IMPLS:
            stats = row[name]
            assert len(stats["samples_s"]) == 1
            assert stats["median_s"] > 0 and stats["min_s"] > 0 and stats["iqr_s"] >= 0
            assert stats["max_abs_diff_vs"] == "eager"
            for key in ("peak_mib", "peak_arrays", "peak_matrices"):
                assert math.isfinite(stats[key]) and stats[key] >= 0, (name, key)
        for name in impls.NUMPY_IMPLS:
            assert row[name]["peak_mib"] > 0
        assert row["blockwise"]["tiles"] == [row["tokens"]] * 2
        assert row["blockwise"]["workers"] >= 1
        assert set(row["ratios"]) == {f"{a}/{b}" for a in impls.NUMPY_IMPLS
                                      for b in impls.TORCH_IMPLS}
        assert all(math.isfinite(v) and v > 0 for v in row["ratios"].values())


def test_growth_exponent_is_fitted_for_every_implementation(tiny_run):
    _, result = tiny_run
    assert set(result["growth_exponent"]) == set(impls.IMPLS)
    assert all(math.isfinite(e) for e in result["growth_exponent"].values())


def test_benchmarked_modules_share_their_weights(tiny_run):
    # Same weights through the state_dict transfer: the outputs agree to float32
    # rounding.  Different weights would differ by O(1).
    _, result = tiny_run
    for row in result["rows"]:
        for name in impls.IMPLS:
            assert row[name]["max_abs_diff"]["output"] < 1e-3, (row["tokens"], name)


def test_defaults_reach_long_sequences():
    args = bench.parse_args([])
    assert args.tokens == [1024, 2048, 4096, 8192, 16384]
    assert args.impl == ["blockwise", "fused"] and args.dtype == "float32"
    assert bench.parse_args(["--impl", "fused,numpy"]).impl == ["numpy", "fused"]


def test_full_matrix_paths_are_skipped_where_they_cannot_fit():
    assert impls.too_large("numpy", 10**6, 1, 12) is not None
    assert impls.too_large("blockwise", 16384, 1, 12) is None
    assert impls.too_large("numpy", 64, 1, 12) is None


def test_memory_is_estimated_for_every_impl_and_refused_before_allocating():
    """blockwise at 2M tokens (inputs alone ~6 GiB each) is refused with the
    estimate; a row where every impl is refused allocates nothing."""
    import tracemalloc
    import numpy as np
    why = impls.too_large("blockwise", 2 * 10**6, 1, 12)
    assert why is not None and "GiB (estimated)" in why
    args = bench.parse_args(["--tokens", "2000000", "--impl", "numpy,blockwise"])
    tracemalloc.start()
    try:
        row = bench.bench_one(args, None, 2 * 10**6, np.random.default_rng(0))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert set(row["skipped"]) == {"numpy", "blockwise"}
    assert peak < 2**20


def test_gemm_line_gives_each_impl_its_share_of_the_gemm_rate():
    result = {"config": {"batch": 1, "d_in": 8, "dtype": "float32", "impls": ["blockwise"]},
              "gemm_gflops": 1.0,
              "rows": [{"tokens": 4, "blockwise": {"median_s": bench.model_flops(1, 4, 8) / 0.5e9}}]}
    assert "1.0 GFLOP/s" in bench.gemm_line(result) and "blockwise 50%" in bench.gemm_line(result)


def test_table_is_printed():
    result = {"machine": {"processor": "x86_64", "cpu_count": 2, "platform": "p",
                          "python": "3", "numpy": "2", "torch": "2", "env": {},
                          "load_average_start": 0.5, "load_average_end": 1.5},
              "threads": {"torch_threads": 2, "torch_interop_threads": 2,
                          "numpy_blas": "unknown (threadpoolctl not installed)"},
              "config": {"batch": 1, "d_in": 8, "d_out": 8, "num_heads": 2,
                         "dtype": "float32", "repeats": 1, "impls": ["blockwise", "fused"]},
              "growth_exponent": {"blockwise": 1.75, "fused": None},
              "fit_tokens": [4, 8], "runtime_s": 0.5, "rows": [], "gemm_gflops": 10.0}
    text = bench.render(result)
    assert text.splitlines()[0].startswith("machine: x86_64, 2 cores")
    assert "load average 0.5 at start, 1.5 at end" in text
    headers = bench.time_headers(["blockwise", "fused"]) + bench.DETAIL_HEADERS
    assert all(h in text for h in headers) and "blockwise/fused" in text
    assert "blockwise 1.75, fused -" in text


def test_full_run_prints_one_table_row_per_token_count(tiny_run):
    _, result = tiny_run
    rows = [line.split()[0] for line in bench.render(result).splitlines()
            if line[:1].isdigit()]
    per_t = 1 + len(impls.IMPLS)                           # timing table + detail rows
    assert rows.count("4") == per_t and rows.count("8") == per_t


@pytest.mark.parametrize("argv", [["--tokens", "0"], ["--tokens", "a,b"], ["--repeats", "0"],
                                  ["--d-model", "10", "--heads", "3"], ["--impl", "nope"],
                                  ["--dtype", "float16"]])
def test_bad_options_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.slow                     # 2.3 s of timed runs
def test_golden_bench_prints_its_rate_the_dgemm_rate_the_share_and_the_blas(capsys):
    """``bench --golden`` on a tiny T: every figure it promises is printed (none asserted)."""
    assert cli.main(["bench", "--golden", "--tokens", "64", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "T 64: golden" in out and "GFLOP/s; dgemm 2048^3 float64" in out and "share" in out
    assert "BLAS:" in out and "OPENBLAS_CORETYPE" in out and "load average" in out


@pytest.mark.slow                     # 1.5 s of a loaded benchmark
def test_under_load_prints_both_slowdowns_and_leaves_no_busy_process(capsys, monkeypatch):
    """``bench --under-load`` on a tiny T: the golden and SDPA timed idle and beside the
    busy processes, the ratio of their slowdowns printed, the busy processes gone after."""
    from parity_tests.bench import golden
    from processes import children
    before, results, measure = children(), [], golden.under_load

    def recorded(*args, **kwargs):                              # the command's own run, kept
        results.append(measure(*args, **kwargs))
        return results[-1]
    monkeypatch.setattr(golden, "under_load", recorded)
    assert cli.main(["bench", "--under-load", "--tokens", "64", "--repeats", "1"]) == 0
    assert children() == before                                 # the spinners were stopped
    (r,) = results
    for name in ("golden", "torch"):
        assert r[name]["idle_s"] > 0 and r[name]["loaded_s"] > 0
        assert r[name]["slowdown"] == r[name]["loaded_s"] / r[name]["idle_s"]
    assert r["ratio"] == r["golden"]["slowdown"] / r["torch"]["slowdown"]
    assert r["golden"]["idle_share"] > 0 and r["golden"]["loaded_share"] > 0
    out = capsys.readouterr().out
    assert "2 busy processes beside them" in out and "golden's slowdown / torch's:" in out
    assert "GFLOP/s idle, share" in out and "GFLOP/s loaded, share" in out
    assert "BLAS:" in out and "load average" in out
    assert bench.main(["--golden", "--under-load"]) == 2
    assert "separate runs: give one" in capsys.readouterr().err


def test_a_size_that_cannot_fit_exits_2_with_the_estimate_before_any_work(capsys):
    assert bench.main(["--tokens", "64,2000000", "--impl", "blockwise"]) == 2
    err = capsys.readouterr().err
    assert "blockwise at T = 2000000 needs ~" in err and "GiB (estimated)" in err


@pytest.mark.slow          # two full checks at T = 256: 4-5 s
def test_check_split_at_256_tokens_adds_up_to_each_case_s_wall_time(capsys, tmp_path):
    from parity_tests.bench import check_split
    path = tmp_path / "split.json"
    assert cli.main(["bench", "--check-split", "256", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "load average (1, 5, 15 min) at start:" in out and "at end:" in out and "BLAS:" in out
    table = [line.split()[:4] for line in out.splitlines()]
    assert ["256", "sdpa", "pass", "-"] in table and ["256", "no-scale", "FAIL", "no-scale"] in table
    result = json.loads(path.read_text())
    sdpa, wrong = result["rows"]
    assert (sdpa["kernel"], sdpa["verdict"], sdpa["named"], sdpa["diagnosis"]) == ("sdpa", "pass", "-", 0.0)
    assert (wrong["kernel"], wrong["verdict"], wrong["named"]) == ("no-scale", "FAIL", "no-scale")
    assert wrong["target"] > 0 and wrong["diagnosis"] > 0 and result["blas"]
    for r in (sdpa, wrong):
        parts = sum(r[p] for p in check_split.PARTS)
        assert all(r[p] >= 0 for p in check_split.PARTS)
        assert abs(parts - r["case_wall"]) <= 1e-6 * r["case_wall"]         # other: the rest, by definition
        assert r["case_wall"] <= r["wall"], (r["case_wall"], r["wall"])     # the case within its process's timing
