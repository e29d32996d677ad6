"""``attention-parity``: run the parity matrix, print one row per compared tensor, exit 0 or 1.

    attention-parity                              cpu, float64 and float32
    attention-parity --device all --dtype float32,bfloat16
    attention-parity --json parity.json           a machine-readable copy
    attention-parity --plant-fault softmax-backward-no-sum   must exit 1

Exit status: 0 when every row passes, 1 when any row fails, 2 for bad arguments
(``--device cuda`` without a GPU, an unknown or empty dtype or module, a ``--json``
path that cannot be written: all checked before the run).
"""

import contextlib
import json
import math
import sys
import time

import torch

from parity_tests.common import faults, options, outputs
from parity_tests.matrix import harness, variants
from parity_tests.common import tolerances
from parity_tests.common.tables import format_table
from parity_tests.common.help_text import Parser

__all__ = ["main", "build_parser", "format_rows"]

HEADERS = ["module", "config", "mode", "dtype", "device", "check", "tensor",
           "error", "bound", "result"]


def build_parser():
    p = Parser(
        page="docs/parity.md", prog="attention-parity",
        description="Run every attention module of the chapter in NumPy (hand-written "
                    "backward) and in PyTorch (autograd) on the same weights, inputs and "
                    "random upstream gradient, and compare the output, the input gradient "
                    "and every parameter gradient. float64 is compared directly "
                    f"(bound {tolerances.FLOAT64_BOUND:g}); lower precisions against a float64 "
                    "golden result (see parity_tests/common/tolerances.py).",
        epilog="Exit status: 0 every row passed, 1 some row failed, 2 bad arguments "
               "(checked before the run, --json PATH included). "
               "--plant-fault NAME plants a known mistake (list them with --list-faults) "
               "and runs the same matrix: the command must then exit 1, which shows the "
               "checks can fail. More: docs/parity.md")
    p.add_argument("--device", choices=["cpu", "cuda", "all"], default="cpu",
                   help="cpu (default), cuda, or all available devices")
    p.add_argument("--dtype", action="append", metavar="DTYPE",
                   help="float64, float32, bfloat16, float16; repeat or separate with "
                        "commas (default: float64,float32)")
    p.add_argument("--module", action="append", metavar="NAME",
                   help="only these module classes (repeatable, comma-separated)")
    p.add_argument("--json", metavar="PATH", help='also write {"rows": [...], "summary": {...}} to PATH')
    p.add_argument("--quiet", "-q", action="store_true",
                   help="print only failing rows and the summary")
    p.add_argument("--plant-fault", metavar="NAME",
                   help="plant a named mistake before running (the run must fail); see --list-faults")
    p.add_argument("--list-faults", action="store_true", help="list the faults --plant-fault knows")
    return p


def _dtypes(values):
    dtypes = [options.dtype_name(d) for d in options.split_list(values, "--dtype")] or ["float64", "float32"]
    unknown = [d for d in dtypes if d not in harness.DTYPES]
    if unknown:
        raise ValueError(f"--dtype must be among {', '.join(harness.DTYPES)}; got {', '.join(unknown)}")
    return list(dict.fromkeys(dtypes))


def _devices(choice):
    if choice == "all":
        return harness.available_devices()
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available (torch.cuda.is_available() "
                    "is False); use --device cpu or --device all")
    return [choice]


def _modules(values):
    names = options.split_list(values, "--module")
    known = [s.name for s in harness.MODULES] + [variants.MODULE]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--module must be among {', '.join(known)}; got {', '.join(unknown)}")
    return names or None


def _fmt(x):
    return "-" if x is None else ("inf" if not math.isfinite(x) else f"{x:.2e}")


def _result(row):
    if row["passed"]:
        return "pass"
    how_far = "non-finite or missing" if not math.isfinite(row["error"]) else (
        f"{row['error'] / row['bound']:.1e} x bound" if row["bound"] > 0 else "differs")
    where = "" if row["where"] is None else f" at {tuple(row['where'])}"
    return f"FAIL {how_far}{where}"


def format_rows(rows):
    """The plain-text table of ``rows``."""
    return format_table(HEADERS, [[r["module"], r["config"], r["mode"], r["dtype"], r["device"],
                                   r["check"], r["tensor"], _fmt(r["error"]), _fmt(r["bound"]),
                                   _result(r)] for r in rows])


def _progress():
    """A one-line counter on stderr, only when a person is watching it."""
    if not sys.stderr.isatty():
        return None
    def show(i, n):
        end = "\n" if i == n else ""
        print(f"\r  case {i}/{n}", end=end, file=sys.stderr, flush=True)
    return show


def _json_row(row):
    row = dict(row)
    for key in ("error", "bound", "baseline"):
        if row[key] is not None and not math.isfinite(row[key]):
            row[key] = None            # JSON has no inf: null means missing or non-finite
    return row


def _write_json(path, rows, summary):
    with open(path, "w") as f:
        json.dump({"rows": [_json_row(r) for r in rows], "summary": summary}, f, indent=1)


def _list_faults():
    print(format_table(["fault", "side", "what it breaks"],
                       [[f.name, f.side, f.description] for f in faults.FAULTS.values()]))
    return 0


def _parse(argv):
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:          # --help (0) or a usage error (2): report, do not exit
        return None, int(e.code or 0)
    if args.plant_fault is not None and args.plant_fault not in faults.FAULTS:
        raise ValueError(f"--plant-fault must be one of {', '.join(faults.FAULTS)}; got {args.plant_fault!r}")
    return args, None


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, status = _parse(argv)
        if args is None:
            return status
        if args.list_faults:
            return _list_faults()
        dtypes, devices, modules = _dtypes(args.dtype), _devices(args.device), _modules(args.module)
        problem = outputs.output_file_problem("--json", args.json)   # before the run, not after
        if problem:
            raise ValueError(problem)
    except ValueError as e:          # an argument refused after parsing
        print(f"attention-parity: error: {e} (see docs/parity.md)", file=sys.stderr)
        return 2
    skipped = [f"{d} on {dev} ({harness.unsupported_dtype(d, dev)})" for dev in devices for d in dtypes
               if not harness.dtype_supported(d, dev)]
    if skipped:
        print(f"attention-parity: skipping {', '.join(skipped)}", file=sys.stderr)
    cases = harness.build_cases(dtypes, devices, modules)
    return _run(args, cases, dtypes, devices)


def _run(args, cases, dtypes, devices):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)         # tiny tensors: thread hand-offs cost more than they save
    planted = faults.plant(args.plant_fault) if args.plant_fault else contextlib.nullcontext()
    start = time.perf_counter()
    try:
        with planted:
            rows = harness.run_matrix(cases, _progress())
    finally:
        torch.set_num_threads(threads)
    summary = harness.summarize(rows, time.perf_counter() - start)
    summary.update(devices=devices, dtypes=dtypes, fault=args.plant_fault, tolerances={
        "float64_bound": tolerances.FLOAT64_BOUND, "low_precision_factor": tolerances.LOW_PRECISION_FACTOR,
        "floor_ulps": tolerances.FLOOR_ULPS, "scale_floor": tolerances.SCALE_FLOOR})
    _print(args, rows, summary)
    if args.json:
        _write_json(args.json, rows, summary)
    return 0 if summary["failed"] == 0 and rows else 1


def _print(args, rows, summary):
    if args.plant_fault:
        print(f"planted fault: {args.plant_fault} ({faults.FAULTS[args.plant_fault].description})\n")
    failing = [r for r in rows if not r["passed"]]
    if not args.quiet:
        print(format_rows(rows))
    if failing:
        print(f"\nfailing rows ({len(failing)}):" if not args.quiet else "failing rows:")
        print(format_rows(failing[:40]))
        if len(failing) > 40:
            print(f"... and {len(failing) - 40} more (all of them in --json)")
    print(f"\n{summary['rows']} rows, {summary['passed']} passed, {summary['failed']} failed "
          f"in {summary['seconds']:.1f} s ({', '.join(summary['devices'])}; "
          f"{', '.join(summary['dtypes'])})")
