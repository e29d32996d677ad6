"""``attention-parity bench --golden``: the float64 golden at the machine's GEMM speed.

Times ``numpy_ref.reference_attention`` forward + backward (random upstream
gradient, float64, B × 2 heads of D = 64, not causal) and a 2048³ float64
matrix product in the same process, interleaved (dgemm, golden, dgemm, ...)
so that a burst of load on a shared machine hits both; each figure is the best
of its runs.  The share is the golden's GFLOP/s over the dgemm's: how close
the check's reference runs to what the BLAS can do on this machine.

FLOPs are counted as FlashAttention-2 counts them: 7 products of
2·B·H·Tq·Tk·D (2 forward, 5 backward, the backward's recompute of q kᵀ
included), half that when causal.  The golden keeps each query tile's weights
from its forward instead of recomputing them, so it performs 6 of the 7.

Under load (``--under-load``, `under_load`): the same golden and PyTorch's
SDPA on the same attention (float64, forward + backward, PyTorch's own thread
count) and the 2048³ dgemm, interleaved, first on the machine as it is, then
with ``busy`` Python processes spinning beside them, started and stopped here;
the golden's share of the dgemm's rate is given for both.  Each side's
slowdown is its median time under load over its median time before; the
golden is fair when its slowdown is not much more than PyTorch's (a thread that
spins while it waits, or more threads than CPUs, shows as a much larger one).

Figures are printed, never asserted; the load average is printed with them.
"""

import os
import statistics
import subprocess
import sys
import time

import numpy as np

__all__ = ["golden_rates", "render_golden", "under_load", "render_under_load", "blas_info", "blas_words",
           "load_average"]

HEADS, HEAD_DIM, GEMM_N = 2, 64, 2048


def _best(fn, repeats):
    best = np.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def load_average():
    """(1, 5, 15 min) load averages, rounded, or None where the platform has none."""
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except OSError:                                     # not on every platform
        return None


def blas_info():
    """NumPy's BLAS as threadpoolctl sees it, and OPENBLAS_CORETYPE."""
    info = {"OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE")}
    try:
        import threadpoolctl
    except ImportError:
        return info | {"blas": "unknown (threadpoolctl not installed)"}
    libs = [lib for lib in threadpoolctl.threadpool_info() if lib.get("user_api") == "blas"]
    if libs:
        info["blas"] = {k: libs[0].get(k) for k in ("internal_api", "version", "architecture",
                                                    "num_threads")}
    return info


def blas_words(info):
    """`blas_info` as one phrase: library, version, kernel, threads; OPENBLAS_CORETYPE."""
    blas, core = info.get("blas"), info["OPENBLAS_CORETYPE"]
    if isinstance(blas, dict):
        blas = (f"{blas['internal_api']} {blas['version']}, kernel {blas['architecture']}, "
                f"{blas['num_threads']} threads")
    return f"{blas}; OPENBLAS_CORETYPE {'= ' + core if core else 'not set'}"


def golden_rates(tokens, batch=1, repeats=3, causal=False, seed=0):
    """{T: GFLOP/s of the golden, the dgemm's, the share, seconds} for each T."""
    from numpy_ref import _parallel, reference_attention
    rng = np.random.default_rng(seed)
    a, b = (rng.standard_normal((GEMM_N, GEMM_N)) for _ in range(2))
    a @ b                                                           # warm the BLAS
    result = {"load_start": load_average(), "blas": blas_info(), "workers": _parallel.usable_cpus(),
              "shape": dict(batch=batch, heads=HEADS, head_dim=HEAD_DIM, causal=causal,
                            dtype="float64"), "rows": []}
    for T in tokens:
        q, k, v, dout = (rng.standard_normal((batch, HEADS, T, HEAD_DIM)) for _ in range(4))
        gemm_s, golden_s = np.inf, np.inf
        for _ in range(repeats):
            gemm_s = min(gemm_s, _best(lambda: a @ b, 2))
            golden_s = min(golden_s, _best(lambda: reference_attention(
                q, k, v, dout, causal=causal), 1))
        flops = 7 * 2.0 * batch * HEADS * T * T * HEAD_DIM * (0.5 if causal else 1.0)
        gemm = 2.0 * GEMM_N ** 3 / gemm_s / 1e9
        golden = flops / golden_s / 1e9
        result["rows"].append(dict(tokens=T, golden_s=golden_s, golden_gflops=golden,
                                   dgemm_gflops=gemm, share=golden / gemm))
    result["load_end"] = load_average()
    return result


def render_golden(result):
    s = result["shape"]
    lines = [f"golden: numpy_ref.reference_attention, float64 forward + backward, batch "
             f"{s['batch']}, {s['heads']} heads, D {s['head_dim']}, causal {s['causal']}; "
             f"{result['workers']} workers (usable CPUs), one BLAS thread each",
             f"BLAS: {blas_words(result['blas'])}",
             f"load average (1, 5, 15 min): {result['load_start']} at start, "
             f"{result['load_end']} at end"]
    for r in result["rows"]:
        lines.append(f"T {r['tokens']}: golden {r['golden_s']:.2f} s, "
                     f"{r['golden_gflops']:.1f} GFLOP/s; dgemm {GEMM_N}^3 float64 "
                     f"{r['dgemm_gflops']:.1f} GFLOP/s; share {r['share']:.2f}")
    lines.append("(FLOPs: FlashAttention-2's 7 products of 2·B·H·T²·D, the backward's "
                 "recompute included; the golden keeps its weights and performs 6)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# Under load: the golden's slowdown beside busy processes, and PyTorch's

SPIN = "while True:\n    pass"          # one busy process: a CPU's worth of pure Python


def _attention_pair(T, batch, seed):
    """(golden, torch): zero-argument callables running float64 forward + backward of
    the same attention (B × 2 heads, T × D 64, random upstream gradient)."""
    import torch

    from numpy_ref import reference_attention
    rng = np.random.default_rng(seed)
    q, k, v, dout = (rng.standard_normal((batch, HEADS, T, HEAD_DIM)) for _ in range(4))

    def golden():
        reference_attention(q, k, v, dout)

    def sdpa():
        qt, kt, vt = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)
        out.backward(torch.from_numpy(dout))
    return golden, sdpa


def _times(fns, repeats):
    """{name: [seconds, ...]}: the callables interleaved, ``repeats`` rounds."""
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def under_load(T=4096, batch=1, repeats=5, busy=2, seed=0):
    """The golden's, PyTorch's and a dgemm's medians idle and beside ``busy`` spinning
    processes; the golden's GFLOP/s and share of the dgemm's rate in both."""
    import torch
    golden, sdpa = _attention_pair(T, batch, seed)
    a = np.random.default_rng(seed).standard_normal((GEMM_N, GEMM_N))
    fns = {"golden": golden, "torch": sdpa, "dgemm": lambda: a @ a}
    _times(fns, 1)                                                  # warm all three
    result = {"tokens": T, "batch": batch, "busy": busy, "repeats": repeats, "blas": blas_info(),
              "torch_threads": torch.get_num_threads(), "load_start": load_average()}
    idle = _times(fns, repeats)
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
    try:
        time.sleep(0.5)                                             # let them take their CPUs
        loaded = _times(fns, repeats)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    result["load_end"] = load_average()
    flops = 7 * 2.0 * batch * HEADS * T * T * HEAD_DIM
    for name in fns:
        x, y = statistics.median(idle[name]), statistics.median(loaded[name])
        result[name] = dict(idle_s=x, loaded_s=y, slowdown=y / x)
    for phase in ("idle", "loaded"):
        gemm = 2.0 * GEMM_N ** 3 / result["dgemm"][phase + "_s"]
        result["golden"][phase + "_gflops"] = flops / result["golden"][phase + "_s"] / 1e9
        result["golden"][phase + "_share"] = flops / result["golden"][phase + "_s"] / gemm
    result["ratio"] = result["golden"]["slowdown"] / result["torch"]["slowdown"]
    return result


def render_under_load(r):
    lines = [f"under load: float64 forward + backward, batch {r['batch']}, {HEADS} heads, T {r['tokens']}, "
             f"D {HEAD_DIM}; golden numpy_ref.reference_attention vs torch SDPA "
             f"({r['torch_threads']} threads); {r['busy']} busy processes beside them; "
             f"medians of {r['repeats']}, interleaved",
             f"BLAS: {blas_words(r['blas'])}; load average (1, 5, 15 min): {r['load_start']} at start, "
             f"{r['load_end']} at end (the busy processes' included)",
             f"{'':8}{'idle s':>9}{'loaded s':>10}{'slowdown':>10}"]
    for name in ("golden", "torch", "dgemm"):
        x = r[name]
        lines.append(f"{name:8}{x['idle_s']:9.2f}{x['loaded_s']:10.2f}{x['slowdown']:9.2f}x")
    g = r["golden"]
    lines.append(f"golden: {g['idle_gflops']:.1f} GFLOP/s idle, share {g['idle_share']:.2f} of the dgemm's "
                 f"rate; {g['loaded_gflops']:.1f} GFLOP/s loaded, share {g['loaded_share']:.2f}")
    lines.append(f"golden's slowdown / torch's: {r['ratio']:.2f}")
    return "\n".join(lines)
