"""``attention-parity bench``: speed and memory of NumPy's MultiHeadAttention.

One run times forward + backward (with a random upstream gradient) of four
implementations of the chapter's ``MultiHeadAttention``, all holding the same
weights (moved by the contract's ``state_dict`` transfer), on the CPU:

    numpy       numpy_ref.MultiHeadAttention            m.forward(x); m.backward(dout)
    numpy_fast  numpy_ref.fast.FastMultiHeadAttention   the same, causal query blocks
    eager       torch_impl.MultiHeadAttention           out = m(x); out.backward(dout)
    fused       torch_impl.FusedMultiHeadAttention      the same, attention by SDPA

Runs are interleaved (numpy, numpy_fast, eager, fused, numpy, ...) so that a
burst of noise on the machine hits all of them alike; each figure is a median.
NumPy's peak memory is read by ``tracemalloc`` (NumPy reports its data buffers
to it) on a separate, untimed run, and also expressed in units of one
(B, H, T, T) float32 matrix, the size of ``attn_weights``.  The load average
before and after is printed: on a busy machine the figures are noisy.  The growth exponent is the slope
of log(time) against log(T) over the largest token counts: 2 means the T x T
work dominates.

Figures are printed, never asserted: timings belong to a machine, not to a test.
"""

import argparse
import gc
import json
import os
import platform
import time
import tracemalloc

import numpy as np

from parity_tests.common import outputs
from parity_tests.common.verdicts import parse_verb_args

IMPLS = ("numpy", "numpy_fast", "eager", "fused")
NUMPY_IMPLS = ("numpy", "numpy_fast")
RATIOS = [(a, b) for a in NUMPY_IMPLS for b in ("eager", "fused")]
FIT_POINTS = 3   # the growth exponent is fitted over this many largest T
BLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="attention-parity bench",
        description="Time forward+backward of NumPy vs PyTorch MultiHeadAttention on the CPU.")
    p.add_argument("--tokens", type=_int_list, default=[128, 256, 512, 1024, 2048],
                   help="comma-separated token counts T (default: 128,256,512,1024,2048)")
    p.add_argument("--repeats", type=_positive_int, default=5,
                   help="timed runs per implementation and T, interleaved (default: 5)")
    p.add_argument("--batch", type=_positive_int, default=1, help="batch size B (default: 1)")
    p.add_argument("--d-model", type=_positive_int, default=768, help="d_in = d_out (default: 768)")
    p.add_argument("--heads", type=_positive_int, default=12, help="number of heads H (default: 12)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch.set_num_threads(N), and NumPy's BLAS limited to N threads when "
                        "threadpoolctl is installed (default: each library's own default)")
    p.add_argument("--seed", type=outputs.seed, default=0,
                   help="seed for weights and inputs, 0 .. 2**32 - 1 (default: 0)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args(argv)
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


# --- the four implementations, same weights -------------------------------------

def _classes():
    """The benchmarked classes, imported here so ``--help`` needs no torch."""
    import numpy_ref
    import numpy_ref.fast
    import torch_impl
    return {
        "numpy": numpy_ref.MultiHeadAttention,
        "numpy_fast": numpy_ref.fast.FastMultiHeadAttention,
        "eager": torch_impl.MultiHeadAttention,
        "fused": torch_impl.FusedMultiHeadAttention,
    }


def build_modules(args, context_length):
    """Eager module seeded by torch; fused and the NumPy ones loaded from its state_dict.
    NumPy entries are factories (the memory run wants a fresh module)."""
    import torch
    classes = _classes()
    torch.manual_seed(args.seed)
    shape = (args.d_model, args.d_model, context_length, 0.0, args.heads)
    eager = classes["eager"](*shape).eval()
    fused = classes["fused"](*shape).eval()
    fused.load_state_dict(eager.state_dict())

    def numpy_factory(cls):
        def make():
            m = cls(*shape, rng=args.seed)
            m.load_state_dict(eager.state_dict())
            m.eval()
            return m
        return make

    modules = {name: numpy_factory(classes[name]) for name in NUMPY_IMPLS}
    modules.update(eager=eager, fused=fused)
    return modules


def make_steps(modules, x, dout):
    """One callable per implementation: forward + backward, returning (out, dx) as arrays."""
    import torch
    dout_t = torch.from_numpy(dout)

    def numpy_step(make):
        m = make()
        def step():
            out = m.forward(x)
            return out, m.backward(dout)
        return step

    def torch_step(m):
        def step():
            m.zero_grad(set_to_none=True)
            x_t = torch.from_numpy(x).requires_grad_(True)
            out = m(x_t)
            out.backward(dout_t)
            return out.detach().numpy(), x_t.grad.numpy()
        return step

    steps = {name: numpy_step(modules[name]) for name in NUMPY_IMPLS}
    steps.update(eager=torch_step(modules["eager"]), fused=torch_step(modules["fused"]))
    return {name: steps[name] for name in IMPLS}


# --- measurements ----------------------------------------------------------------

def time_interleaved(steps, repeats):
    """Round-robin over the implementations, ``repeats`` times; seconds per run."""
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            gc.collect()
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return times


def numpy_peak_bytes(make_numpy, x, dout):
    """Peak bytes NumPy allocates during one forward + backward of a fresh module."""
    m = make_numpy()
    gc.collect()
    tracemalloc.start()
    try:
        m.forward(x)
        m.backward(dout)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak


def growth_exponent(tokens, seconds):
    """Least-squares slope of log(seconds) vs log(T) over the largest FIT_POINTS T."""
    if len(tokens) < 2:
        return None
    t = np.log(np.asarray(tokens[-FIT_POINTS:], dtype=float))
    s = np.log(np.asarray(seconds[-FIT_POINTS:], dtype=float))
    slope, _ = np.polyfit(t, s, 1)
    return float(slope)


def summarize(samples):
    s = np.asarray(samples)
    q1, q3 = np.percentile(s, [25, 75])
    return {"median_s": float(np.median(s)), "min_s": float(s.min()),
            "iqr_s": float(q3 - q1), "samples_s": [float(v) for v in s]}


def bench_one(args, modules, T, rng):
    """Warm-up (also used to check agreement), interleaved timing, NumPy's peak memory."""
    x = rng.standard_normal((args.batch, T, args.d_model)).astype(np.float32)
    dout = rng.standard_normal((args.batch, T, args.d_model)).astype(np.float32)
    steps = make_steps(modules, x, dout)
    warm = {name: step() for name, step in steps.items()}
    times = time_interleaved(steps, args.repeats)
    matrix_bytes = args.batch * args.heads * T * T * 4     # one (B, H, T, T) float32
    row = {"tokens": T}
    for name in IMPLS:
        row[name] = summarize(times[name])
        if name != "eager":
            row[name]["max_abs_diff_vs_eager"] = {
                "output": float(np.max(np.abs(warm[name][0] - warm["eager"][0]))),
                "input_grad": float(np.max(np.abs(warm[name][1] - warm["eager"][1]))),
            }
    for name in NUMPY_IMPLS:
        peak = numpy_peak_bytes(modules[name], x, dout)
        row[name]["peak_mib"] = peak / 2**20
        row[name]["peak_matrices"] = peak / matrix_bytes
    row["ratios"] = {f"{a}/{b}": row[a]["median_s"] / row[b]["median_s"] for a, b in RATIOS}
    return row


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
    try:
        modules = build_modules(args, context_length=max(args.tokens))
        threads = thread_info()
        rng = np.random.default_rng(args.seed)
        rows = [bench_one(args, modules, T, rng) for T in args.tokens]
    finally:
        if limiter is not None:
            limiter.restore_original_limits()
    tokens = [r["tokens"] for r in rows]
    machine["load_average_end"] = _load_average()
    return {
        "machine": machine,
        "threads": threads,
        "config": {"batch": args.batch, "d_in": args.d_model, "d_out": args.d_model,
                   "num_heads": args.heads, "dtype": "float32", "dropout": 0.0,
                   "repeats": args.repeats, "tokens": tokens, "seed": args.seed},
        "rows": rows,
        "growth_exponent": {name: growth_exponent(tokens, [r[name]["median_s"] for r in rows])
                            for name in IMPLS},
        "fit_tokens": tokens[-FIT_POINTS:],
        "runtime_s": time.perf_counter() - started,
    }


# --- the report --------------------------------------------------------------------

TIME_HEADERS = ["T"] + [f"{name} ms" for name in IMPLS] + [f"{a}/{b}" for a, b in RATIOS]
DETAIL_HEADERS = ["T", "impl", "median ms", "min ms", "IQR ms", "peak MiB",
                  "peak in (B,H,T,T) f32", "max|diff| out vs eager", "max|diff| dx vs eager"]


def _ms(seconds):
    ms = seconds * 1e3
    return f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def time_rows(result):
    return [[r["tokens"]] + [_ms(r[name]["median_s"]) for name in IMPLS]
            + [f"{r['ratios'][f'{a}/{b}']:.2f}" for a, b in RATIOS] for r in result["rows"]]


def detail_rows(result):
    rows = []
    for r in result["rows"]:
        for name in IMPLS:
            s = r[name]
            diff = s.get("max_abs_diff_vs_eager")
            rows.append([r["tokens"], name, _ms(s["median_s"]), _ms(s["min_s"]), _ms(s["iqr_s"]),
                         f"{s['peak_mib']:.1f}" if "peak_mib" in s else "-",
                         f"{s['peak_matrices']:.2f}" if "peak_matrices" in s else "-",
                         f"{diff['output']:.1e}" if diff else "-",
                         f"{diff['input_grad']:.1e}" if diff else "-"])
    return rows


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
        format_table(TIME_HEADERS, time_rows(result)),
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
    result = run(args)
    print(render(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
