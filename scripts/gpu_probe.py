"""The two measurements of ``scripts/gpu-check`` that no verb makes: the device, and SDPA's speed.

    python scripts/gpu_probe.py info  --json device.json
    python scripts/gpu_probe.py speed --device cuda --tokens 1024,2048,4096,8192,16384 --json speed.json

``info``: the GPU's name (``torch.cuda.get_device_name``), compute capability, SM
count, and its dense bfloat16 tensor-core peak: the datasheet figure when the name
is one of `DATASHEET`, else SMs x max SM clock x dense bf16 FLOPs per clock per SM of
its architecture (`FLOPS_PER_CLOCK`), else "unknown".

``speed``: ``attention-parity bench`` times the chapter's modules on the CPU only, so
the GPU's attention is timed here: forward + backward (and forward alone) of
``scaled_dot_product_attention`` with each backend, causal, at GPT-2-small's head
shape (B 1, H 12, D 64), against the check's golden result (``numpy_ref.blockwise``
in float64, forward + backward) at the same shape.  FLOPs are counted as
FlashAttention's benchmarks count them: forward 4 B H T^2 D, backward 2.5 x that,
halved for causal (forward + backward: 7 B H T^2 D).  Medians of ``--repeats`` runs
timed with CUDA events after a warm-up.  The JSON is rewritten after every T, so a
run cut short keeps what it measured.  Figures are printed, never asserted.
"""

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

# Dense bf16 tensor-core peaks, TFLOP/s, from NVIDIA's datasheets (the figure without
# sparsity); matched on the device name in this order.
DATASHEET = (("H200 NVL", 835.5), ("H200", 989.5), ("H100 NVL", 835.5), ("H100 PCIe", 756.5),
             ("H100", 989.5), ("GH200", 989.5), ("A100", 312.0), ("L40S", 362.1), ("L4", 121.0),
             ("A10G", 70.0), ("A10", 125.0))
# Dense bf16 FLOPs per clock per SM, by compute capability (A100: 108 SMs x 1.41 GHz x 2048 = 312 T).
FLOPS_PER_CLOCK = {(8, 0): 2048, (8, 6): 1024, (8, 7): 1024, (8, 9): 1024, (9, 0): 4096}
BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


def _max_sm_clock_mhz(props):
    """The SM clock the peak is counted at: PyTorch's, else nvidia-smi's max; None if neither says."""
    khz = getattr(props, "clock_rate", None)
    if khz:
        return khz / 1e3
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20).stdout
        return float(text.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def peak_bf16(name, capability, sms, clock_mhz):
    """``(TFLOP/s or None, how it was found)``."""
    for key, tflops in DATASHEET:
        if key.lower() in name.lower():
            return tflops, f"datasheet ({key}, dense bf16)"
    per_clock = FLOPS_PER_CLOCK.get(tuple(capability))
    if per_clock and clock_mhz:
        return (sms * clock_mhz * 1e6 * per_clock / 1e12,
                f"derived: {sms} SMs x {clock_mhz:.0f} MHz x {per_clock} bf16 FLOPs/clock/SM")
    return None, "unknown (neither a known name nor a known architecture and clock)"


def info():
    import torch
    import numpy
    out = {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
           "cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    for name in ("triton", "flash_attn", "scipy", "hypothesis", "matplotlib", "nbclient"):
        try:
            out[name] = getattr(__import__(name), "__version__", "installed")
        except Exception as e:                       # noqa: BLE001 - the reason is the answer
            out[name] = f"not available ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})"
    if not out["cuda_available"]:
        out.update(name=None, peak_bf16_tflops=None, peak_method="unknown (no CUDA device)")
        return out
    props = torch.cuda.get_device_properties(0)
    capability = torch.cuda.get_device_capability(0)
    clock = _max_sm_clock_mhz(props)
    peak, method = peak_bf16(torch.cuda.get_device_name(0), capability, props.multi_processor_count, clock)
    out.update(name=torch.cuda.get_device_name(0), capability=list(capability), sms=props.multi_processor_count,
               memory_gib=round(props.total_memory / 2**30, 1), max_sm_clock_mhz=clock,
               peak_bf16_tflops=peak, peak_method=method, device_count=torch.cuda.device_count())
    return out


def attention_flops(batch, heads, tokens, head_dim, backward=True):
    """FlashAttention's count, causal: forward 4 B H T^2 D / 2, backward 2.5 x forward."""
    forward = 4.0 * batch * heads * tokens * tokens * head_dim / 2
    return forward * (3.5 if backward else 1.0)


def _timer(device):
    import torch
    if device != "cuda":
        def cpu_time(fn):
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        return cpu_time

    def cuda_time(fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    return cuda_time


def time_sdpa(backend, q, k, v, dout, repeats, device):
    """``{"fwd_bwd_s", "fwd_s"}`` medians, or ``{"unsupported": why}`` (SDPA's warnings say why)."""
    import warnings
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    timed = _timer(device)

    def forward():
        with torch.no_grad(), sdpa_kernel([getattr(SDPBackend, backend)]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def step():
        q.grad = k.grad = v.grad = None
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(dout)
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for fn in (forward, step):               # warm-up (and the refusal, if any)
                fn()
        result = {"fwd_bwd_s": statistics.median(timed(step) for _ in range(repeats)),
                  "fwd_s": statistics.median(timed(forward) for _ in range(repeats))}
    except RuntimeError as e:                        # a backend that refuses, or out of memory
        why = [str(w.message).strip().splitlines()[0] for w in said if str(w.message).strip()]
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        result = {"unsupported": "; ".join(why[-2:])[:300] or first[:300]}
    q.grad = k.grad = v.grad = None
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def time_golden(q, k, v, dout):
    """Seconds of numpy_ref.blockwise forward + backward in float64, causal (one run)."""
    from numpy_ref import blockwise
    start = time.perf_counter()
    out, lse = blockwise.attention_forward(q, k, v, causal=True)
    blockwise.attention_backward(dout, q, k, v, out, lse, causal=True)
    return time.perf_counter() - start


def speed(args):
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("speed: --device cuda but no CUDA device is available")
    dtype = getattr(torch, args.dtype)
    b, h, d = args.batch, args.heads, args.head_dim
    result = {"device": args.device, "name": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
              "dtype": args.dtype, "batch": b, "heads": h, "head_dim": d, "causal": True,
              "repeats": args.repeats, "flops": "FlashAttention's count: causal fwd 2 B H T^2 D, fwd+bwd 3.5x",
              "rows": []}
    started = time.perf_counter()
    golden_prev = None
    for t in args.tokens:
        row = {"tokens": t, "backends": {}}
        g = torch.Generator().manual_seed(t)
        q, k, v, dout = (torch.randn(b, h, t, d, generator=g) for _ in range(4))
        qd, kd, vd, dd = (x.to(args.device, dtype, copy=True) for x in (q, k, v, dout))
        for x in (qd, kd, vd):
            x.requires_grad_(True)
        for backend in args.backends:
            if backend == "MATH" and t > args.math_max:
                row["backends"][backend] = {"unsupported": f"skipped above T = {args.math_max} (B H T^2 scores held)"}
                continue
            r = time_sdpa(backend, qd, kd, vd, dd, args.repeats, args.device)
            if "fwd_bwd_s" in r:
                r["fwd_bwd_tflops"] = attention_flops(b, h, t, d) / r["fwd_bwd_s"] / 1e12
                r["fwd_tflops"] = attention_flops(b, h, t, d, backward=False) / r["fwd_s"] / 1e12
            row["backends"][backend] = r
        left = args.time_limit - (time.perf_counter() - started)
        if golden_prev is not None and 4.5 * golden_prev > left:
            row["golden"] = {"skipped": f"predicted {4.5 * golden_prev:.0f} s, {left:.0f} s left of --time-limit"}
        else:
            golden_prev = time_golden(*(x.double().numpy() for x in (q, k, v, dout)))
            row["golden"] = {"fwd_bwd_s": golden_prev,
                             "vs": {n: golden_prev / r["fwd_bwd_s"] for n, r in row["backends"].items()
                                    if "fwd_bwd_s" in r}}
        result["rows"].append(row)
        result["seconds"] = time.perf_counter() - started
        _print_row(row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    return result


def _print_row(row):
    cells = []
    for name, r in row["backends"].items():
        short = name.split("_")[0].lower()
        cells.append(f"{short} {r['fwd_bwd_s'] * 1e3:.2f} ms {r['fwd_bwd_tflops']:.1f} TFLOP/s"
                     if "fwd_bwd_s" in r else f"{short} -")
    gold = row["golden"]
    cells.append(f"golden {gold['fwd_bwd_s']:.2f} s" if "fwd_bwd_s" in gold else "golden skipped")
    print(f"T {row['tokens']:>6}: " + "; ".join(cells), flush=True)


def _ints(text):
    return [int(t) for t in text.split(",") if t.strip()]


def main(argv=None):
    p = argparse.ArgumentParser(prog="gpu_probe.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    i = sub.add_parser("info", help="the device, its peak, the versions")
    i.add_argument("--json", metavar="PATH")
    s = sub.add_parser("speed", help="SDPA's backends against the blockwise golden result")
    s.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    s.add_argument("--tokens", type=_ints, default=[1024, 2048, 4096, 8192, 16384])
    s.add_argument("--backends", type=lambda x: x.split(","), default=list(BACKENDS))
    s.add_argument("--dtype", default="bfloat16")
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--heads", type=int, default=12)
    s.add_argument("--head-dim", type=int, default=64)
    s.add_argument("--repeats", type=int, default=5)
    s.add_argument("--math-max", type=int, default=8192, help="the math backend only up to this T")
    s.add_argument("--time-limit", type=float, default=0.8 * float(os.environ.get("GPU_CHECK_LIMIT_S", math.inf)),
                   help="seconds: a golden run predicted to overrun is skipped (default: 0.8 x the "
                        "GPU_CHECK_LIMIT_S gpu-check gives its steps, else none)")
    s.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.what == "info":
        result = info()
        print("\n".join(f"{k}: {v}" for k, v in result.items()))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    speed(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
