"""``attention-parity bench``: speed and memory of the chapter's MultiHeadAttention.

One run times forward + backward (with a random upstream gradient) of the chosen
implementations (``--impl``; see `parity_tests.bench.impls`), all holding the
same weights, on the CPU.  By default the two that reach long sequences,
``blockwise`` (NumPy, O(T) memory) and ``fused`` (PyTorch's SDPA), at T from
1024 to 16384; the paths holding (B, H, T, T) arrays are skipped where those
would not fit.

Runs are interleaved (blockwise, fused, blockwise, ...) so that a burst of noise
on the machine hits all of them alike; each figure is a median.  Peak memory is
measured on a separate, untimed run and given in MiB, in (B, T, d_model) float32
arrays (x's size; the blockwise module's target is at most 10) and, for the
paths that hold them, in (B, H, T, T) float32 matrices.  NumPy's BLAS (library,
version, threads and the kernel OpenBLAS selected, via threadpoolctl) and the
BLAS environment are printed with the results: OPENBLAS_CORETYPE and
OPENBLAS_L2_SIZE change the kernel and its speed (compare a run under
``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE``).  The growth exponent is the
slope of log(time) against log(T) over the largest token counts: 2 means the
T x T work dominates.  The blockwise module chooses its tiles and threads per T
itself; the choice is printed.

Figures are printed, never asserted: timings belong to a machine, not to a test.
"""

import argparse
import gc
import json
import os
import platform
import sys
import time

import numpy as np

from parity_tests.bench import impls
from parity_tests.bench.impls import IMPLS, NUMPY_IMPLS, TORCH_IMPLS
from parity_tests.common import outputs
from parity_tests.common.help_text import Parser
from parity_tests.common.verdicts import parse_verb_args

FIT_POINTS = 3   # the growth exponent is fitted over this many largest T
BLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
DEFAULT_TOKENS = [1024, 2048, 4096, 8192, 16384]


def parse_args(argv):
    p = Parser(
        page="docs/speed.md", prog="attention-parity bench",
        description="Time forward+backward of NumPy vs PyTorch MultiHeadAttention on the CPU.")
    p.add_argument("--tokens", type=_int_list, default=None,
                   help="comma-separated token counts T (default: 1024,2048,4096,8192,16384; "
                        "with --golden 8192)")
    p.add_argument("--impl", type=_impl_list, default=list(impls.DEFAULT_IMPLS),
                   help=f"comma-separated implementations among {','.join(IMPLS)} "
                        f"(default: {','.join(impls.DEFAULT_IMPLS)}); those holding (T, T) "
                        f"arrays are skipped where these would not fit")
    p.add_argument("--repeats", type=_positive_int, default=5,
                   help="timed runs per implementation and T, interleaved (default: 5)")
    p.add_argument("--batch", type=_positive_int, default=1, help="batch size B (default: 1)")
    p.add_argument("--d-model", type=_positive_int, default=768, help="d_in = d_out (default: 768)")
    p.add_argument("--heads", type=_positive_int, default=12, help="number of heads H (default: 12)")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="dtype of weights, input and computation (default: float32)")
    p.add_argument("--no-memory", action="store_true",
                   help="skip the untimed memory run of each implementation")
    p.add_argument("--no-warmup", action="store_true",
                   help="no untimed first run (for one long run: does T = 32768 complete?)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch.set_num_threads(N), and NumPy's BLAS limited to N threads when "
                        "threadpoolctl is installed (default: each library's own default)")
    p.add_argument("--seed", type=outputs.seed, default=0,
                   help="seed for weights and inputs, 0 .. 2**32 - 1 (default: 0)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--golden", action="store_true",
                   help="instead: the float64 golden (numpy_ref.reference_attention, 2 heads of "
                        "D = 64, batch --batch) against a 2048^3 dgemm in the same process, best "
                        "of --repeats (parity_tests.bench.golden)")
    p.add_argument("--under-load", action="store_true",
                   help="instead: the golden's slowdown beside two busy processes (started and "
                        "stopped here) against PyTorch SDPA's on the same float64 attention, medians "
                        "of --repeats at each of --tokens (default 4096)")
    p.add_argument("--check-split", type=_int_list, metavar="T,...",
                   help="instead: where attention-parity check's time goes at these lengths (one causal "
                        "case, H 1, D 64, float32; SDPA and SDPA without its scale): target, baseline, golden, "
                        "diagnosis, other (parity_tests.bench.check_split)")
    args = p.parse_args(argv)
    if sum(map(bool, (args.golden, args.under_load, args.check_split))) > 1:
        p.error("--golden, --under-load and --check-split are separate runs: give one")
    if args.tokens is None:
        args.tokens = [8192] if args.golden else [4096] if args.under_load else DEFAULT_TOKENS
    if args.d_model % args.heads:
        p.error(f"--d-model ({args.d_model}) must be divisible by --heads ({args.heads})")
    return args


def _positive_int(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _int_list(text):
    try:
        values = [_positive_int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    if not values:
        raise argparse.ArgumentTypeError("expected at least one token count")
    return sorted(set(values))


def _impl_list(text):
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in IMPLS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected implementations among {','.join(IMPLS)}, "
                                         f"got {text!r}")
    return [n for n in IMPLS if n in names]


def ratio_pairs(names):
    """(NumPy impl, PyTorch impl) pairs whose time ratio is reported."""
    return [(a, b) for a in names if a in NUMPY_IMPLS for b in names if b in TORCH_IMPLS]


# --- measurements ----------------------------------------------------------------

# Pause before each timed run: a library's worker threads keep spinning for a
# while after it returns (OpenMP, OpenBLAS), and on a small machine they would
# slow down whichever implementation runs next.
SETTLE_S = 0.3


def time_interleaved(steps, repeats, settle=SETTLE_S):
    """Round-robin over the implementations, ``repeats`` times -> (seconds per
    run, the last run's (out, dx) of each)."""
    times = {name: [] for name in steps}
    results = {}
    for _ in range(repeats):
        for name, step in steps.items():
            results.pop(name, None)
            gc.collect()
            time.sleep(settle)
            start = time.perf_counter()
            results[name] = step()
            times[name].append(time.perf_counter() - start)
    return times, results


def growth_exponent(tokens, seconds):
    """Least-squares slope of log(seconds) vs log(T) over the largest FIT_POINTS T."""
    pairs = [(t, s) for t, s in zip(tokens, seconds) if s is not None][-FIT_POINTS:]
    if len(pairs) < 2:
        return None
    t, s = np.log(np.array(pairs, dtype=float)).T
    slope, _ = np.polyfit(t, s, 1)
    return float(slope)


def summarize(samples):
    s = np.asarray(samples)
    q1, q3 = np.percentile(s, [25, 75])
    return {"median_s": float(np.median(s)), "min_s": float(s.min()),
            "iqr_s": float(q3 - q1), "samples_s": [float(v) for v in s]}


def bench_one(args, params, T, rng):
    """Warm-up, interleaved timing (the last run's results checked for agreement),
    peak memory."""
    dtype = np.dtype(args.dtype)
    row = {"tokens": T, "skipped": {}}
    for name in args.impl:                      # estimated before anything is allocated
        why = impls.too_large(name, T, args.batch, args.heads, args.d_model)
        if why:
            row["skipped"][name] = why
    runnable = [name for name in args.impl if name not in row["skipped"]]
    if not runnable:
        row["ratios"] = {}
        return row
    x = rng.standard_normal((args.batch, T, args.d_model)).astype(dtype)
    dout = rng.standard_normal((args.batch, T, args.d_model)).astype(dtype)
    modules, steps = {}, {}
    for name in runnable:
        modules[name] = impls.build(name, args, T, params)
        steps[name] = impls.make_step(name, modules[name], x, dout)
    if not args.no_warmup:
        for step in steps.values():
            step()
    times, warm = time_interleaved(steps, args.repeats, 0.0 if T < 256 else SETTLE_S)
    reference = next((n for n in ("eager", "fused") + NUMPY_IMPLS if n in warm), None)
    array_bytes = args.batch * T * args.d_model * 4             # one (B, T, d) float32
    matrix_bytes = args.batch * args.heads * T * T * 4          # one (B, H, T, T) float32
    for name in steps:
        row[name] = summarize(times[name])
        row[name]["max_abs_diff_vs"] = reference
        row[name]["max_abs_diff"] = {
            "output": float(np.max(np.abs(warm[name][0] - warm[reference][0]))),
            "input_grad": float(np.max(np.abs(warm[name][1] - warm[reference][1]))),
        }
        if name == "blockwise":
            m = modules[name]
            row[name]["tiles"] = list(m._tiles(T))
            row[name]["workers"] = m._workers(T)
    del warm
    if not args.no_memory:
        for name, step in steps.items():
            peak = impls.peak_bytes(name, step)
            row[name]["peak_mib"] = peak / 2**20
            row[name]["peak_arrays"] = peak / array_bytes
            row[name]["peak_matrices"] = peak / matrix_bytes
    row["ratios"] = {f"{a}/{b}": row[a]["median_s"] / row[b]["median_s"]
                     for a, b in ratio_pairs(args.impl) if a in steps and b in steps}
    return row


def gemm_gflops(dtype, n=1024, repeats=3):
    """GFLOP/s of an (n, n) @ (n, n) product in ``dtype`` in this process, as the
    BLAS is set now (best of ``repeats``): the rate the implementations are held to."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(dtype) for _ in range(2))
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2.0 * n**3 / best / 1e9


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def model_flops(batch, T, d_model):
    """FLOPs of one causal forward + backward: 4 projections (2 B T d^2 each
    forward, twice that backward) and attention's 7 products of B H T^2 D / 2."""
    return 24.0 * batch * T * d_model**2 + 7.0 * batch * T * T * d_model


# --- the machine -------------------------------------------------------------------

def thread_info():
    """Threads of torch and of NumPy's BLAS (via threadpoolctl when installed)."""
    import torch
    info = {"torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads(),
            "numpy_blas": "unknown (threadpoolctl not installed)"}
    try:
        import threadpoolctl
    except ImportError:
        return info
    libs = [lib for lib in threadpoolctl.threadpool_info()
            if lib.get("user_api") == "blas" and "numpy" in lib.get("filepath", "")]
    if libs:
        lib = libs[0]
        info["numpy_blas"] = {k: lib.get(k) for k in
                              ("internal_api", "version", "num_threads", "architecture",
                               "threading_layer")}
    return info


def machine_info():
    import torch
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "env": {k: os.environ.get(k) for k in BLAS_ENV},
        "load_average_start": _load_average(),
    }


def _load_average():
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:                                     # not on every platform
        return None


def run(args):
    """Every measurement, as one JSON-ready dict."""
    import torch
    started = time.perf_counter()
    limiter = None
    if args.threads is not None:
        torch.set_num_threads(args.threads)
        try:
            import threadpoolctl
            limiter = threadpoolctl.threadpool_limits(limits=args.threads, user_api="blas")
        except ImportError:
            pass
    machine = machine_info()
    gc.freeze()                # what exists now (PyTorch's modules) is never garbage: each gc.collect
    try:                       # before a timed run scans only what the benchmark made
        params = impls.weights(args)
        threads = thread_info()
        gemm = gemm_gflops(np.dtype(args.dtype))
        rng = np.random.default_rng(args.seed)
        rows = [bench_one(args, params, T, rng) for T in args.tokens]
    finally:
        gc.unfreeze()
        if limiter is not None:
            limiter.restore_original_limits()
    tokens = [r["tokens"] for r in rows]
    machine["load_average_end"] = _load_average()
    return {
        "machine": machine,
        "threads": threads,
        "config": {"batch": args.batch, "d_in": args.d_model, "d_out": args.d_model,
                   "num_heads": args.heads, "dtype": args.dtype, "dropout": 0.0,
                   "repeats": args.repeats, "tokens": tokens, "seed": args.seed,
                   "impls": list(args.impl)},
        "rows": rows,
        "gemm_gflops": gemm,
        "growth_exponent": {name: growth_exponent(tokens, [r[name]["median_s"] if name in r
                                                           else None for r in rows])
                            for name in args.impl},
        "fit_tokens": tokens[-FIT_POINTS:],
        "runtime_s": time.perf_counter() - started,
    }


# --- the report --------------------------------------------------------------------

DETAIL_HEADERS = ["T", "impl", "median ms", "min ms", "IQR ms", "peak MiB",
                  "peak in (B,T,d) f32", "peak in (B,H,T,T) f32", "max|diff| out",
                  "max|diff| dx", "vs", "tiles, threads"]


def time_headers(names):
    return (["T"] + [f"{name} ms" for name in names]
            + [f"{a}/{b}" for a, b in ratio_pairs(names)])


def _ms(seconds):
    ms = seconds * 1e3
    return f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def _num(value, fmt):
    return "-" if value is None else format(value, fmt)


def time_rows(result):
    names = result["config"]["impls"]
    return [[r["tokens"]] + [_ms(r[n]["median_s"]) if n in r else "skipped" for n in names]
            + [_num(r["ratios"].get(f"{a}/{b}"), ".2f") for a, b in ratio_pairs(names)]
            for r in result["rows"]]


def detail_rows(result):
    rows = []
    for r in result["rows"]:
        for name in result["config"]["impls"]:
            if name not in r:
                rows.append([r["tokens"], name] + ["-"] * 9 + [r["skipped"].get(name, "")])
                continue
            s = r[name]
            diff = s["max_abs_diff"]
            choice = f"{s['tiles'][0]}x{s['tiles'][1]}, {s['workers']}" if "tiles" in s else ""
            rows.append([r["tokens"], name, _ms(s["median_s"]), _ms(s["min_s"]), _ms(s["iqr_s"]),
                         _num(s.get("peak_mib"), ".1f"), _num(s.get("peak_arrays"), ".2f"),
                         _num(s.get("peak_matrices"), ".3f"), f"{diff['output']:.1e}",
                         f"{diff['input_grad']:.1e}", s["max_abs_diff_vs"], choice])
    return rows


def gemm_line(result):
    """The GEMM rate of this process and the share of it each impl reaches."""
    c, gemm = result["config"], result["gemm_gflops"]
    parts = []
    for r in result["rows"]:
        flops = model_flops(c["batch"], r["tokens"], c["d_in"])
        shares = ", ".join(f"{n} {flops / r[n]['median_s'] / 1e9 / gemm:.0%}"
                           for n in c["impls"] if n in r)
        parts.append(f"T {r['tokens']}: {shares or '-'}")
    return (f"GEMM ({c['dtype']}, 1024^3, this process): {gemm:.1f} GFLOP/s; share of it "
            f"reached (causal forward + backward FLOPs / time): " + "; ".join(parts))


def render(result):
    from parity_tests.common.tables import format_table
    m, t, c = result["machine"], result["threads"], result["config"]
    blas = t["numpy_blas"]
    if isinstance(blas, dict):
        blas = (f"{blas['internal_api']} {blas['version']}, {blas['num_threads']} threads, "
                f"kernel {blas['architecture']}")
    env = ", ".join(f"{k}={v}" for k, v in m["env"].items() if v is not None) or "none set"
    fit = ", ".join(f"{name} {e:.2f}" if e is not None else f"{name} -"
                    for name, e in result["growth_exponent"].items())
    lines = [
        f"machine: {m['processor']}, {m['cpu_count']} cores, {m['platform']}; "
        f"load average {m.get('load_average_start')} at start, {m.get('load_average_end')} at end",
        f"versions: python {m['python']}, numpy {m['numpy']}, torch {m['torch']}",
        f"threads: torch {t['torch_threads']} (interop {t['torch_interop_threads']}); "
        f"numpy BLAS: {blas}",
        f"BLAS environment: {env}",
        f"shape: batch {c['batch']}, d_in = d_out = {c['d_in']}, {c['num_heads']} heads, "
        f"{c['dtype']}, eval mode (dropout 0); forward + backward with a random upstream "
        f"gradient; median of {c['repeats']} interleaved runs",
        "",
        format_table(time_headers(c["impls"]), time_rows(result)),
        "",
        gemm_line(result),
        "",
        f"growth exponent of time in T (log-log fit over T = "
        f"{', '.join(map(str, result['fit_tokens']))}): {fit}",
        "",
        format_table(DETAIL_HEADERS, detail_rows(result)),
        "",
        f"bench runtime: {result['runtime_s']:.1f} s",
    ]
    return "\n".join(lines)


def main(argv=None):
    args, status = parse_verb_args(parse_args, argv)    # --json PATH tried before the run
    if status is not None:
        return status
    refused = [f"{name} at T = {T} {why}"
               for T in ([] if args.golden or args.under_load or args.check_split else args.tokens)
               for name in args.impl if (why := impls.too_large(name, T, args.batch, args.heads, args.d_model))]
    if refused:                                 # a size that cannot fit: said before any work
        print("attention-parity bench: error: " + "; ".join(refused) + " (ask for fewer tokens or other --impl)",
              file=sys.stderr)
        return 2
    if args.check_split:
        from parity_tests.bench import check_split
        result = check_split.measure_split(args.check_split)
        print(check_split.render_split(result))
    elif args.golden:
        from parity_tests.bench import golden
        result = golden.golden_rates(args.tokens, args.batch, args.repeats, seed=args.seed)
        print(golden.render_golden(result))
    elif args.under_load:
        from parity_tests.bench import golden
        result = [golden.under_load(T, args.batch, args.repeats, seed=args.seed) for T in args.tokens]
        print("\n\n".join(golden.render_under_load(r) for r in result))
    else:
        result = run(args)
        print(render(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
