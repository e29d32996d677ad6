"""``attention-parity bench --check-split 1024,4096,16384,65536``: where a check's time goes.

For each length T, one causal case of ``attention-parity check`` (batch 1, one head,
D = 64, float32, on the CPU) is run twice through the check's own case runner
(``measure.run_case``): once with PyTorch's SDPA as the target (it passes), once with
SDPA called with ``scale=1.0`` (the 1/sqrt(D) scale left out: it fails, so the
diagnosis runs).  Each case's wall time is split into the target's calls, the float32
baseline, the float64 golden, the diagnosis and the rest (drawing the inputs, judging,
SDPA's forward as the yardstick).  The load average at the start and the end, and the
BLAS kernel NumPy ran (``bench.golden.blas_info``), are printed with the table:
figures of a shared machine are read with its load.
"""

import os
import resource
import time

import torch

from parity_tests.common.tables import format_table

__all__ = ["sdpa", "no_scale", "measure_split", "render_split"]

PARTS = ("target", "baseline", "golden", "diagnosis", "other")


def sdpa(q, k, v, *, causal, scale):
    """PyTorch's SDPA, its own choice of backend: the target that passes."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def no_scale(q, k, v, *, causal, scale):
    """SDPA without the 1/sqrt(D) scale (scale=1.0): the target that fails, diagnosed."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=1.0)


def _load():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def measure_split(tokens, head_dim=64):
    """{"rows": [{T, kernel, verdict, named (the diagnosis's id), wall and seconds by part,
    maxrss_gib}], load_start, load_end, blas}."""
    from parity_tests.bench.golden import blas_info
    from parity_tests.kernels import measure, targets
    from parity_tests.kernels.cases import Case
    result = {"load_start": _load(), "blas": blas_info(), "torch_threads": torch.get_num_threads(), "rows": []}
    for T in tokens:
        case = Case(1, 1, T, T, head_dim, True)
        for name, fn in (("sdpa", sdpa), ("no-scale", no_scale)):
            start = time.perf_counter()
            rows = measure.run_case(targets.resolve(fn), case, "float32", "cpu", timeout=None)
            wall = time.perf_counter() - start
            failed = [r for r in rows if r.failed]
            named = next((r.diagnosis.id for r in failed if r.diagnosis is not None), "-")
            result["rows"].append({"T": T, "kernel": name, "verdict": "FAIL" if failed else "pass",
                                   "named": named, "wall": wall, **{p: rows[0].split[p] for p in PARTS},
                                   "maxrss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20})
    result["load_end"] = _load()
    return result


def render_split(result):
    headers = ("T", "target kernel", "verdict", "named", "wall", *PARTS, "peak RSS so far")
    body = [(str(r["T"]), r["kernel"], r["verdict"], r["named"], f"{r['wall']:.2f} s",
             *(f"{r[p]:.2f} s" for p in PARTS), f"{r['maxrss_gib']:.2f} GiB") for r in result["rows"]]
    load = lambda x: "unknown" if x is None else ", ".join(f"{v:.2f}" for v in x)
    return "\n".join([
        "the check's wall time by part: one causal case, B 1, H 1, D 64, float32, cpu "
        "(target: PyTorch SDPA; and SDPA with scale=1.0, which fails and is diagnosed)",
        f"load average (1, 5, 15 min) at start: {load(result['load_start'])}",
        f"BLAS: {result['blas']}; torch threads: {result['torch_threads']}",
        "",
        format_table(headers, body),
        "",
        f"load average (1, 5, 15 min) at end: {load(result['load_end'])}",
    ])
