"""The benchmark's output structure on a tiny shape.  Timings are never asserted."""

import json
import math

import pytest

from parity_tests.bench import run as bench
from parity_tests import cli

TINY = ["--tokens", "4,8", "--repeats", "1", "--d-model", "8", "--heads", "2"]


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
                           "fit_tokens", "runtime_s"}
    assert result["config"]["tokens"] == [4, 8]
    assert result["config"]["repeats"] == 1
    assert result["fit_tokens"] == [4, 8]
    assert result["machine"]["cpu_count"] >= 1
    assert result["threads"]["torch_threads"] >= 1


def test_each_row_has_every_implementation_and_figure(tiny_run):
    _, result = tiny_run
    assert [r["tokens"] for r in result["rows"]] == [4, 8]
    for row in result["rows"]:
        for name in bench.IMPLS:
            stats = row[name]
            assert len(stats["samples_s"]) == 1
            assert stats["median_s"] > 0 and stats["min_s"] > 0 and stats["iqr_s"] >= 0
            assert ("max_abs_diff_vs_eager" in stats) == (name != "eager")
        for name in bench.NUMPY_IMPLS:
            for key in ("peak_mib", "peak_matrices"):
                assert math.isfinite(row[name][key]) and row[name][key] > 0, (name, key)
        assert set(row["ratios"]) == {"numpy/eager", "numpy/fused",
                                      "numpy_fast/eager", "numpy_fast/fused"}
        assert all(math.isfinite(v) and v > 0 for v in row["ratios"].values())


def test_growth_exponent_is_fitted_for_every_implementation(tiny_run):
    _, result = tiny_run
    assert set(result["growth_exponent"]) == set(bench.IMPLS)
    assert all(math.isfinite(e) for e in result["growth_exponent"].values())


def test_benchmarked_modules_share_their_weights(tiny_run):
    # Same weights through the state_dict transfer: the four outputs agree to float32
    # rounding.  Different weights would differ by O(1).
    _, result = tiny_run
    for row in result["rows"]:
        for name in ("numpy", "numpy_fast", "fused"):
            assert row[name]["max_abs_diff_vs_eager"]["output"] < 1e-3, (row["tokens"], name)


def test_table_is_printed():
    result = {"machine": {"processor": "x86_64", "cpu_count": 2, "platform": "p",
                          "python": "3", "numpy": "2", "torch": "2", "env": {},
                          "load_average_start": 0.5, "load_average_end": 1.5},
              "threads": {"torch_threads": 2, "torch_interop_threads": 2,
                          "numpy_blas": "unknown (threadpoolctl not installed)"},
              "config": {"batch": 1, "d_in": 8, "d_out": 8, "num_heads": 2,
                         "dtype": "float32", "repeats": 1},
              "growth_exponent": {"numpy": 2.0, "numpy_fast": 1.75, "eager": None,
                                  "fused": 1.5},
              "fit_tokens": [4, 8], "runtime_s": 0.5, "rows": []}
    text = bench.render(result)
    assert text.splitlines()[0].startswith("machine: x86_64, 2 cores")
    assert "load average 0.5 at start, 1.5 at end" in text
    assert all(h in text for h in bench.TIME_HEADERS + bench.DETAIL_HEADERS)
    assert "numpy 2.00, numpy_fast 1.75, eager -, fused 1.50" in text


def test_full_run_prints_one_table_row_per_token_count(tiny_run):
    _, result = tiny_run
    rows = [line.split()[0] for line in bench.render(result).splitlines()
            if line[:1].isdigit()]
    per_t = 1 + len(bench.IMPLS)                           # timing table + detail rows
    assert rows.count("4") == per_t and rows.count("8") == per_t


@pytest.mark.parametrize("argv", [["--tokens", "0"], ["--tokens", "a,b"], ["--repeats", "0"],
                                  ["--d-model", "10", "--heads", "3"]])
def test_bad_options_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err
