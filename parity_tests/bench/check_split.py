"""``attention-parity bench --check-split 1024,4096,16384,65536``: where a check's time goes.

For each length T, one causal case of ``attention-parity check`` (batch 1, one head,
D = 64, float32, on the CPU) is run twice, each in a process of its own
(``python -m parity_tests.kernels.time_split``, so that its peak memory is its own):
with PyTorch's SDPA as the target (it passes), and with SDPA called with ``scale=1.0``
(the 1/sqrt(D) scale left out: it fails, so the diagnosis runs).  Each case's wall time
is split into the target's calls, the float32 baseline, the float64 golden, the diagnosis
and the rest (drawing the inputs, judging, SDPA's forward as the yardstick).  The load
average at the start and the end, and the BLAS kernel NumPy runs (``golden.blas_info``),
are printed with the table: figures of a shared machine are read with its load.
"""

import json
import subprocess
import sys

from parity_tests.bench.golden import blas_info, blas_words, load_average
from parity_tests.common.tables import format_table

__all__ = ["PARTS", "KERNELS", "measure_split", "render_split"]

PARTS = ("target", "baseline", "golden", "diagnosis", "other")
KERNELS = ("sdpa", "no-scale")


def _one(T, kernel):
    done = subprocess.run([sys.executable, "-m", "parity_tests.kernels.time_split", str(T), kernel],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"check_split {T} {kernel} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_split(tokens):
    """{"rows": [one row per T and kernel: verdict, named, wall and seconds by part,
    maxrss_gib], "load_start", "load_end", "blas"}."""
    result = {"load_start": load_average(), "blas": blas_info(), "rows": []}
    for T in tokens:
        for kernel in KERNELS:
            result["rows"].append(_one(T, kernel))
    result["load_end"] = load_average()
    return result


def render_split(result):
    headers = ("T", "target kernel", "verdict", "named", "wall", *PARTS, "peak RSS")
    body = [(str(r["T"]), r["kernel"], r["verdict"], r["named"], f"{r['case_wall']:.2f} s",
             *(f"{r[p]:.2f} s" for p in PARTS), f"{r['maxrss_gib']:.2f} GiB") for r in result["rows"]]
    load = lambda x: "unknown" if x is None else ", ".join(f"{v:.2f}" for v in x)
    threads = result["rows"][0]["torch_threads"] if result["rows"] else "-"
    return "\n".join([
        "the check's wall time by part: one causal case, B 1, H 1, D 64, float32, cpu, each in its own "
        "process (target: PyTorch SDPA; and SDPA with scale=1.0, which fails and is diagnosed)",
        f"load average (1, 5, 15 min) at start: {load(result['load_start'])}",
        f"BLAS: {blas_words(result['blas'])}; torch threads: {threads} (1 below 2^22 pairs, as the check runs them)",
        "",
        format_table(headers, body),
        "",
        f"load average (1, 5, 15 min) at end: {load(result['load_end'])}",
    ])
