"""``attention-parity check TARGET`` and ``parity_tests.check(target, **options)``.

    attention-parity check sdpa-math                   PyTorch's math backend, default grid
    attention-parity check sdpa-flash --dtype bf16     the CPU flash kernel in bfloat16
    attention-parity check mypkg.attn:my_attention --layout bthd --tokens 128x512,4096
    attention-parity check --list                      the built-in targets on this device

Exit status: 0 every row passes (rows a target refuses are "not supported", not
passes; at least one row must pass, unless the target is a built-in the installed PyTorch
lacks: ``Target.unavailable``), 1 some row fails or an invariance asked for breaks
(``--invariance``), 2 bad arguments, 3 the check's own baseline is past what a plain
computation makes (``tolerances.judge_limit``: a defect of the check, not of the kernel).
"""

import argparse
import os
import sys
import textwrap
import time
from typing import NamedTuple

import torch

import parity_tests.kernels.cases as cases_mod
import parity_tests.kernels.features as feat
import parity_tests.kernels.runner as runner
from parity_tests.kernels import variations
from parity_tests.kernels.invariance import MODES, check_invariance, parse_modes
import parity_tests.kernels.targets as targets
from parity_tests.kernels.report import Report, find_growth, find_overflow, find_precision_refuted, find_strides
from parity_tests.common import options, outputs
from parity_tests.common import tolerances as tol
from parity_tests.common.help_text import Parser

__all__ = ["check", "main", "build_parser"]

DEFAULT_DTYPES = {"cpu": ("float32", "bfloat16"), "cuda": ("float32", "bfloat16", "float16")}
CAUSAL = {"yes": (True,), "no": (False,), "both": (True, False)}


def _dtypes(dtypes, device):
    if dtypes is None:
        return list(DEFAULT_DTYPES[device])
    if isinstance(dtypes, str):
        dtypes = [dtypes]
    names = [options.dtype_name(d) for d in dtypes]
    unknown = [d for d in names if d not in runner.DTYPES]
    if unknown or not names:
        raise ValueError(f"dtypes must be among {', '.join(runner.DTYPES)}; got {', '.join(unknown) or 'none'}")
    return list(dict.fromkeys(names))


def exit_status(report):
    """0 the run passes; 3 the check's own baseline is wrong (whatever the kernel did); 1 else."""
    return 0 if report.passed else 3 if report.judge_defects else 1


def _dtypes_of(wanted, names, default):
    """The dtypes among ``names`` that every feature of ``wanted`` runs in (`Judging.dtypes`:
    FP8's kernels return bfloat16); ValueError when none is left of dtypes asked for."""
    for f in wanted:
        allowed = feat.REGISTRY[f].judging.dtypes
        if allowed is None:
            continue
        kept = [d for d in names if d in allowed]
        if not kept and not default:
            raise ValueError(f"dtypes: {f} runs in {' or '.join(allowed)} (the dtype its kernels return), "
                             f"not {', '.join(names)}")
        names = kept or [allowed[0]]
    return names


def _device(device):
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda': no CUDA device is available (torch.cuda.is_available() is False)")
    return device


def _timeout(timeout):
    """Seconds per case, or None for no limit (None or 0)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < float("inf"):
        raise ValueError(f"timeout must be a number of seconds >= 0 (0: no limit), got {timeout!r}")
    return float(timeout) or None


def _progress_line(name, total, start):
    def show(i, label):
        end = "\n" if i == total else ""
        print(f"\r  check {name}: {i}/{total} {label:<45} {time.perf_counter() - start:6.1f} s",
              end=end, file=sys.stderr, flush=True)
    return show


def check(target, *, device="cpu", dtypes=None, tokens=None, head_dims=None, heads=None, batch=None,
          causal="both", align="top-left", layout="bhtd", long=False, seed=0, progress=False,
          features=None, timeout=runner.DEFAULT_TIMEOUT, merge=False, world_size=None,
          sharding=("contiguous", "head-tail"), invariance=None, forward_only=False):
    """Hold ``target`` (a built-in name, ``"module.path:callable"`` or a callable taking
    ``(q, k, v, *, causal, scale)``) to the float64 reference; returns a `Report`
    (``.passed``, ``.rows``, ``.failures``, ``.diagnoses``, ``.diagnosis``).

    ``tokens``: lengths ``T`` or ``(Tq, Tk)`` / ``"TqxTk"``; ``causal``: "yes", "no"
    or "both"; ``align``: where a causal mask sits when Tq != Tk, "top-left"
    (SDPA's ``is_causal``) or "bottom-right" (FlashAttention's); ``features``: names among
    ``features.FEATURES`` (gqa, value_dim, window, softcap, alibi, bias, sinks, varlen, lse,
    lse_grad, decode, deterministic), each adding its cases on top of the grid; ``timeout``: seconds the
    target may take on one case (default ``runner.DEFAULT_TIMEOUT``, 0 or None: no limit),
    past which the case FAILS "timed out" -- a pure-Python loop is stopped, one long call
    into C only when it returns (``runner.time_limit``).
    ``merge=True``: ``target`` is a merge of partial states, ``fn(out_a, lse_a, out_b, lse_b)
    -> (out, lse)``, held to ``numpy_ref.merge_states`` (``parity_tests.kernels.merge``).

    ``invariance``: modes among "batch", "decode", "chunks", "splits" (``kernels.invariance``):
    the kernel compared with itself, bitwise, beside the accuracy rows (``report.invariance``);
    a broken one fails the report.

    ``forward_only=True``: judge the output (and lse) alone, the gradients "not supported" -- for an
    inference kernel (under ``torch.no_grad()``, or with no backward), which otherwise FAILS
    every gradient row ("no gradient reached q").

    ``world_size``: run ``target`` across that many ranks, ``sharding`` "contiguous" and/or
    "head-tail" (``ranks.check_ranks``, which takes device, dtypes, tokens, causal, features,
    seed and timeout from here).
    """
    if not isinstance(forward_only, bool):
        raise TypeError(f"forward_only must be True or False, got {type(forward_only).__name__}")
    if invariance and (merge or world_size is not None):
        raise ValueError("invariance compares a kernel target with itself (not with merge or world_size)")
    if forward_only and (merge or world_size is not None):
        raise ValueError("forward_only applies to a kernel target (not with merge or world_size)")
    if world_size is not None:
        return _check_across_ranks(target, world_size, sharding, device, dtypes, tokens, causal, features,
                                   seed, timeout, progress)
    if merge:                                 # merge of partial states: its own cases
        from parity_tests.kernels.merge import check_merge
        return check_merge(target, device=device, dtypes=dtypes, seed=seed)
    limit = _timeout(timeout)
    modes = parse_modes(invariance)
    plan = _plan(target, device, dtypes, tokens, head_dims, heads, batch, causal, align, layout, long,
                 features, seed)
    if forward_only:
        plan = plan._replace(target=_forward_only(plan.target))
    report = _run(plan, align, seed, progress, limit, spec=target)
    return _with_invariance(report, plan, modes, align, head_dims, seed)


def _forward_only(tgt):
    """``tgt`` refusing the calls that ask for gradients (its inputs require grad): the caller then
    judges its forward alone, each gradient "not supported (forward only ...)"."""
    import dataclasses
    import functools

    def refusing(fn):
        if fn is None:
            return None

        @functools.wraps(fn)                  # its signature, for the keywords it takes
        def forward(*args, **kw):
            if torch.is_grad_enabled() and any(getattr(a, "requires_grad", False) for a in args):
                raise targets.Unsupported("forward only (forward_only=True)")
            return fn(*args, **kw)
        return forward
    return dataclasses.replace(tgt, fn=refusing(tgt.fn), lse_fn=refusing(tgt.lse_fn))


def _with_invariance(report, plan, modes, align, head_dims, seed):
    """``report`` with ``modes``' findings (``kernels.invariance``), at the run's first head dim."""
    if modes:
        head_dim = ([head_dims] if isinstance(head_dims, int) else head_dims or [64])[0]
        report.invariance = check_invariance(plan.target, modes, plan.dtypes, plan.device, align, int(head_dim),
                                             seed=seed)
    return report


def _plan(target, device, dtypes, tokens, head_dims, heads, batch, causal, align, layout, long,
          features=None, seed=0):
    """The target, the dtypes and the cases; ValueError/TypeError for a bad option."""
    device = _device(device)
    names = _dtypes(dtypes, device)
    if causal not in CAUSAL:
        raise ValueError(f"causal must be 'yes', 'no' or 'both', got {causal!r}")
    if align not in targets.ALIGNMENTS:
        raise ValueError(f"align must be 'top-left' or 'bottom-right', got {align!r}")
    listify = lambda x: [x] if isinstance(x, (int, str)) else x
    grid = cases_mod.build_grid(tokens=listify(tokens), head_dims=listify(head_dims), heads=listify(heads),
                                batch=listify(batch), causal=CAUSAL[causal], long=long, device=device)
    wanted = feat.parse_features(features)
    names = _dtypes_of(wanted, names, dtypes is None)
    packed = [f for f in wanted if feat.layout_name(feat.REGISTRY[f].calling.layout) == "thd"]  # FlashAttention's packed layout
    if layout == "thd":
        if not packed:
            raise ValueError("layout 'thd' (FlashAttention's varlen layout) goes with the feature varlen")
        layout = "bhtd"
    elif packed and layout != "bhtd":
        raise ValueError(f"layout: {packed[0]} runs every case in the thd layout, not {layout!r}")
    tgt = targets.resolve(target, device, layout)
    # inputs as kernels meet them, in every run: each class at its own shape, then at the grid's
    shapes = list(dict.fromkeys((c.batch, c.heads, c.tq, c.tk, c.head_dim) for c in grid))
    classes = variations.grid_cases(CAUSAL[causal], shapes)
    added = [tried[0] for _, tried in classes]
    if wanted:
        feat.require(tgt, wanted)                          # a usage error, before any case runs
        plan = feat.Plan(seed=seed, takes_align=tgt.takes_align,
                         grid=tuple(grid) if tokens is not None else ())    # the user's lengths
        added += feat.feature_cases(wanted, CAUSAL[causal], plan)
    grid = grid + added
    _refuse_what_does_not_fit(grid, names, device)
    return CheckPlan(tgt, device, names, grid, wanted, classes)


class CheckPlan(NamedTuple):
    """What a run does: the target, device, dtypes, the cases, the features asked for, and
    the input classes as ``[(name, [case, fallback, ...])]`` (``variations.grid_cases``; the
    first of each is in ``grid``)."""
    target: object
    device: str
    dtypes: list
    grid: list
    wanted: tuple
    classes: list


def available_memory(device):
    """``(host bytes, device bytes)`` free now; None where it cannot be told."""
    host = None
    try:
        with open("/proc/meminfo") as f:
            host = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        try:
            host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    gpu = torch.cuda.mem_get_info()[0] if device == "cuda" else None
    return host, gpu


def _refuse_what_does_not_fit(grid, dtypes, device):
    """ValueError, before any work, when the largest case needs more memory than is free."""
    host_free, device_free = available_memory(device)
    gib = lambda n: f"{n / 2 ** 30:.1f} GiB"
    for case in grid:
        for d in dtypes:
            parts = runner.case_memory(case, d, device)
            for i, (free, where) in enumerate(((host_free, "this machine has"), (device_free, f"{device} has"))):
                need = sum(p[i] for p in parts.values())
                if free is not None and need > free:
                    terms = " + ".join(f"{name} {gib(p[i])}" for name, p in parts.items() if p[i])
                    raise ValueError(
                        f"tokens: the case {case} in {d} needs about {gib(need)} ({terms}, not counting "
                        f"the target's own workspace), more than the {gib(free)} {where} free; "
                        "ask for fewer tokens, heads or batch")


# A case's seconds per (query, key) pair on the CPU, target SDPA, golden, baseline and
# yardstick together, a causal case past dense.LONG_FROM keys counting half its pairs (its
# baseline skips the keys no row of a chunk sees).  Measured on a 2-core CPU at load 1 .. 2,
# float32: T = 16384 causal 11.7 s, not causal 13.4 s (5e-8 s a pair), T = 65536 causal
# 122.5 s (5.7e-8 s a counted pair); bfloat16 at 16384 causal 9.5 s.  A run estimated past
# ESTIMATE_FROM seconds says so first.
SECONDS_PER_PAIR = {"cpu": 5.5e-8, "cuda": 2e-9}
ESTIMATE_FROM = 60.0
# the process before any case: Python, NumPy, PyTorch (measured: 0.3 .. 0.5 GiB)
BASE_BYTES = 0.4 * 2 ** 30


def estimate(plan):
    """(seconds, peak host bytes, the longest case) a run is expected to take: each case's
    pairs at SECONDS_PER_PAIR, its memory by ``runner.case_memory`` over BASE_BYTES."""
    device, names, grid = plan.device, plan.dtypes, plan.grid
    seconds, peak, longest = 0.0, 0.0, None
    for case in grid:
        pairs = case.batch * case.heads * case.tq * case.tk
        pairs /= 2 if case.causal and case.tk > runner.dense.LONG_FROM else 1
        for d in names:
            s = pairs * SECONDS_PER_PAIR[device]
            seconds += s
            peak = max(peak, BASE_BYTES + sum(p[0] for p in runner.case_memory(case, d, device).values()))
            if longest is None or s > longest[0]:
                longest = (s, case, d)
    return seconds, peak, longest


def estimate_line(plan):
    """The one line a run past ESTIMATE_FROM seconds prints first, or None."""
    seconds, peak, (_, case, dtype) = estimate(plan)
    if seconds < ESTIMATE_FROM:
        return None
    when = f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"
    return (f"estimated {when}, {peak / 2 ** 30:.1f} GiB peak for {len(plan.grid) * len(plan.dtypes)} cases "
            f"(the longest: {case} in {dtype})")


def _run(plan, align, seed, progress, timeout=runner.DEFAULT_TIMEOUT, spec=None):
    tgt, device, names, wanted = plan.target, plan.device, plan.dtypes, plan.wanted
    work = [(case, d) for d in names for case in plan.grid]
    fallbacks = {tried[0]: (name, tried[1:]) for name, tried in plan.classes}
    start = time.perf_counter()
    show = _progress_line(tgt.name, len(work), start) if progress else None
    rows, classes_run, refusals = [], {}, {}
    run_one = lambda case, d: _run_one(tgt, case, d, device, align, seed, wanted, timeout)
    for i, (case, d) in enumerate(work, 1):
        if show:
            show(i - 1, f"({d}, {case})")
        got = run_one(case, d)
        if case in fallbacks:                 # an input class: at the first shape the kernel takes
            name, rest = fallbacks[case]
            got, ran, reasons = _first_accepted(case, d, got, rest, run_one)
            classes_run[name] = classes_run.get(name, False) or ran
            refusals.setdefault(name, []).extend(reasons)
        rows += got
    if show:
        show(len(work), "")
    find_growth(rows)
    find_precision_refuted(rows)
    find_overflow(rows)
    find_strides(rows)
    gaps = [f"{name} (every case refused: {'; '.join(dict.fromkeys(refusals[name]))})"
            for name, ran in classes_run.items() if not ran]
    return Report(tgt.name, rows, time.perf_counter() - start,
                  {"device": device, "dtypes": names, "align": _one_alignment(rows, align),
                   "layout": feat.layout_name(feat.layout(wanted)) or tgt.layout, "features": wanted,
                   "factor": tol.CHECK_FACTOR, "floor_ulps": tol.CHECK_FLOOR_ULPS}, gaps,
                  {"target": tgt, "spec": _repro_spec(tgt, spec), "align": align, "seed": seed, "wanted": wanted,
                   "timeout": timeout}, tgt.unavailable)


def _repro_spec(tgt, spec):
    """How a repro script imports the target: the name or ``module.path:callable`` the check
    was given, else the callable's own module and name when they import back to it."""
    from parity_tests.kernels.repro import importable_name
    return spec if isinstance(spec, str) else importable_name(tgt.fn)


def _run_one(tgt, case, dtype, device, align, seed, wanted, timeout):
    with runner.one_thread_if_small(case, device):
        return runner.run_case(tgt, case, dtype, device, align, seed, wanted, timeout)


def _refused(rows):
    return all(r.verdict == "not supported" for r in rows)


def _first_accepted(case, dtype, rows, rest, run_one):
    """(rows, ran, refusals) of an input class: ``rows`` of its own ``case`` when the kernel
    takes it, else those of the first of ``rest`` (the grid's shapes) it takes, noting the
    refusal; the first case's rows when it takes none."""
    if not _refused(rows):
        return rows, True, []
    reasons = [rows[0].note]
    for fallback in rest:
        moved = run_one(fallback, dtype)
        if not _refused(moved):
            t = f"T{case.tq}" if case.tq == case.tk else f"T{case.tq}x{case.tk}"
            note = f"moved from {t} D{case.head_dim}, refused"
            for r in moved:
                r.note = "; ".join(x for x in (r.note, note) if x)
            return moved, True, reasons
        reasons.append(moved[0].note)
    return rows, False, reasons


def _one_alignment(rows, align):
    """The alignment every row ran in (paged runs all bottom-right), else the run's own."""
    used = {r.align for r in rows}
    return used.pop() if len(used) == 1 else align


def build_parser():
    cpu = targets.builtin_names("cpu")
    cuda_only = {n: d for n, d in targets.builtin_names("cuda").items() if n not in cpu}
    listing = textwrap.fill(", ".join(cpu), 86, initial_indent="  ", subsequent_indent="  ")
    cuda = list(cuda_only) + [n for n in targets.FLASH if n not in cuda_only]
    listing += "\n" + textwrap.fill("on CUDA: " + ", ".join(cuda) + " (flash*: with flash_attn)", 86,
                                    initial_indent="  ", subsequent_indent="  ")
    p = Parser(
        page="docs/check.md", prog="attention-parity check", formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="attention-parity check [options] TARGET  (or --list, or --merge module:fn)",
        description=textwrap.fill(
            "Hold an attention kernel to the float64 NumPy reference: out, dq, dk, dv on a grid "
            "of shapes, each held to error <= k x baseline + floor, the baseline a plain PyTorch "
            f"computation in the same dtype (k = {tol.CHECK_FACTOR:g}). A failing tensor is "
            "diagnosed and located. How it judges: docs/check.md#how-it-judges", 88),
        epilog=f"targets built in (check --list for this device):\n{listing}\n"
               "  module.path:callable  your function fn(q, k, v, *, causal, scale) -> out "
               "(docs/check.md#on-your-own-function)\n\n"
               "Reading a diagnosis: docs/check.md#reading-a-diagnosis. Exit status: 0 every row "
               "passed,\n1 a row failed or an invariance broke (or none ran), 2 bad arguments, 3 the "
               "check's own defect.")
    p.add_argument("target", nargs="?", help="a built-in name, module:callable or file.py:callable")
    p.add_argument("--list", action="store_true", help="list the built-in targets on --device")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", action="append", metavar="DTYPE",
                   help="float32, bfloat16, float16, float64, comma-separated (default float32,bfloat16; "
                        "on cuda also float16)")
    p.add_argument("--tokens", action="append", metavar="T|TqxTk", help="sequence lengths, e.g. 128x512,4096")
    p.add_argument("--head-dim", action="append", metavar="D", help="head dims, e.g. 64,80,128")
    p.add_argument("--heads", action="append", metavar="H")
    p.add_argument("--batch", action="append", metavar="B")
    p.add_argument("--causal", choices=list(CAUSAL), default="both")
    p.add_argument("--align", choices=list(targets.ALIGNMENTS), default="top-left",
                   help="the causal mask when Tq != Tk: top-left (SDPA's, default) or bottom-right (FlashAttention's)")
    p.add_argument("--layout", choices=["bhtd", "bthd", "thd"], default="bhtd",
                   help="the layout a callable takes: (B, H, T, D) (default), (B, T, H, D), or packed (varlen)")
    p.add_argument("--features", action="append", metavar="F,...",
                   help="production features (docs/features.md): " + ", ".join(feat.FEATURES))
    p.add_argument("--long", action="store_true",
                   help="add one head of D = 64 at T = 16384 and 65536 (docs/check.md#long-cases)")
    p.add_argument("--seed", type=outputs.seed, default=0,
                   help="seed of the inputs drawn, 0 .. 2**32 - 1 (default: 0)")
    p.add_argument("--timeout", type=_seconds, default=runner.DEFAULT_TIMEOUT, metavar="SECONDS",
                   help="seconds the target may take on one case before it FAILS 'timed out' "
                        f"(default: {runner.DEFAULT_TIMEOUT:g}; 0: no limit)")
    p.add_argument("--merge", metavar="module:fn",
                   help="check a merge of partial states fn(out_a, lse_a, out_b, lse_b) -> (out, lse) "
                        "instead of a kernel (docs/serving.md#merging-partial-states)")
    p.add_argument("--world-size", type=int, metavar="N",
                   help="run the target across N ranks, one shard each (docs/ranks.md)")
    p.add_argument("--sharding", action="append", metavar="S,...",
                   help="with --world-size: contiguous, head-tail (both)")
    p.add_argument("--invariance", action="append", metavar="M,...",
                   help=f"also the kernel against itself, bitwise: {','.join(MODES)} (docs/check.md#invariance)")
    p.add_argument("--forward-only", action="store_true", help="judge the output alone (an inference kernel)")
    p.add_argument("--json", metavar="PATH", help='also write {"rows": [...], ...} to PATH (-: stdout)')
    p.add_argument("--plot", metavar="DIR", help="heat maps of each failing tensor's error to DIR")
    p.add_argument("--repro", metavar="DIR", help="shrink each failing cause to its smallest case and write "
                   "DIR/<cause>/repro.py and inputs.npz (see docs/check.md#handing-a-failure-on)")
    p.add_argument("--quiet", "-q", action="store_true", help="print only failing rows and the summary")
    return p


def _seconds(text):
    """argparse type of --timeout: a number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0 (0: no limit), got {text!r}")
    return value


def _split(values, flag, convert=str):
    """A comma-separated option's items (None when not given), converted."""
    items = options.split_list(values, flag)
    try:
        return [convert(v) for v in items] or None
    except ValueError:
        raise ValueError(f"{flag} expects integers, got {', '.join(items)}") from None



def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.list:
        for name, text in targets.builtin_names(args.device).items():
            print(f"{name:<17} {text}")
        if args.device == "cuda" and "flash" not in targets.builtin_names("cuda"):
            from parity_tests.kernels.targets.builtin import flash_unavailable
            print(f"(FlashAttention's {', '.join(targets.FLASH)} skipped: {flash_unavailable()})")
        return 0
    if args.invariance and (args.merge or args.world_size is not None):
        print("attention-parity check: error: --invariance compares a kernel target with itself "
              "(not --merge or --world-size)", file=sys.stderr)
        return 2
    if args.forward_only and (args.merge or args.world_size is not None):
        print("attention-parity check: error: --forward-only applies to a kernel target "
              "(not --merge or --world-size)", file=sys.stderr)
        return 2
    if args.repro is not None and (args.merge or args.world_size is not None):
        print("attention-parity check: error: --repro shrinks the cases of a kernel target "
              "(not --merge or --world-size)", file=sys.stderr)
        return 2
    if args.merge:                            # merge of partial states: parity_tests.kernels.merge
        from parity_tests.kernels.merge import merge_main
        return merge_main(args)
    if not args.target:
        print("attention-parity check: error: TARGET is required (see --help or --list)", file=sys.stderr)
        return 2
    problem = (args.json not in (None, "-") and outputs.output_file_problem("--json", args.json)   # before the run
               or args.repro is not None and outputs.output_dir_problem("--repro", args.repro))
    if problem:
        print(f"attention-parity check: error: {problem}", file=sys.stderr)
        return 2
    from parity_tests.common import plots
    status = plots.check_available(args.plot)
    if status is not None:
        return status
    if args.world_size is not None:
        return _main_across_ranks(args)
    try:
        modes = parse_modes(_split(args.invariance, "--invariance"))
        plan = _plan(args.target, args.device, _split(args.dtype, "--dtype"),
                     _split(args.tokens, "--tokens"), _split(args.head_dim, "--head-dim", int),
                     _split(args.heads, "--heads", int), _split(args.batch, "--batch", int),
                     args.causal, args.align, args.layout, args.long, _split(args.features, "--features"), args.seed)
    except (ValueError, TypeError) as e:
        return _usage_error(e)
    if args.forward_only:
        plan = plan._replace(target=_forward_only(plan.target))
    line = estimate_line(plan)
    if line:
        print(line, file=sys.stderr, flush=True)
    report = _run(plan, args.align, args.seed, sys.stderr.isatty(), _timeout(args.timeout), spec=args.target)
    report = _with_invariance(report, plan, modes, args.align, _split(args.head_dim, "--head-dim", int), args.seed)
    # --json -: the JSON alone on standard output, what a reader sees on standard error
    print(report.render(args.quiet), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        report.write_json(args.json)
    if args.repro is not None:
        _print_repros(report, args.repro)
    if args.plot:
        from parity_tests.common import plots
        plots.announce(report.plot(args.plot))
    return exit_status(report)


# The page that explains what a refused argument should be, by the first word of the refusal.
ERROR_PAGES = {"target": "docs/check.md#targets", "features": "docs/features.md#the-features",
               "invariance": "docs/check.md#invariance",
               "timeout": "docs/check.md#time-and-memory-limits"}


def _usage_error(e, page=None):
    """Exit status 2 and one line: the refusal, and the page that says what is expected
    (``page``, or the one for the argument the refusal names, or ``--help``)."""
    said = str(e)
    first, _, rest = said.partition(" ")
    if page is None and first == "target" and ":" in rest.split(" ", 1)[0]:   # target 'mod:fn': ...
        page = "docs/check.md#on-your-own-function"
    page = page or ERROR_PAGES.get(first, "attention-parity check --help")
    print(f"attention-parity check: error: {said} (see {page})", file=sys.stderr)
    return 2


def _print_repros(report, directory):
    if not report.failures:
        print(f"\nrepro: nothing to shrink, no row failed (nothing written to {directory})")
        return
    print("\nrepro:")
    for found in report.repro(directory):
        print("  " + found.line(), flush=True)


# ---------------------------------------------------------------------------
# Across ranks (--world-size N): parity_tests.kernels.ranks does the work

def _check_across_ranks(target, world_size, sharding, device, dtypes, tokens, causal, features, seed,
                        timeout, progress):
    from parity_tests.kernels.ranks import check_ranks
    return check_ranks(target, world_size=world_size, sharding=sharding, device=device, dtypes=dtypes,
                       tokens=tokens, causal=causal, features=features or (), seed=seed, timeout=timeout,
                       progress=progress)


def _main_across_ranks(args):
    try:
        report = check(args.target, world_size=args.world_size,
                       sharding=_split(args.sharding, "--sharding") or ("contiguous", "head-tail"),
                       device=args.device, dtypes=_split(args.dtype, "--dtype"), tokens=_split(args.tokens, "--tokens"),
                       causal=args.causal, features=_split(args.features, "--features"), seed=args.seed,
                       timeout=args.timeout, progress=sys.stderr.isatty())
    except (ValueError, TypeError) as e:
        return _usage_error(e, "docs/ranks.md")
    to = sys.stderr if args.json == "-" else sys.stdout          # --json -: the JSON alone on stdout
    print(report.table() if not args.quiet else report._text("--json").rsplit("\n", 1)[0], file=to)
    if report.diagnoses and not args.quiet:
        print("\ndiagnosis:\n" + "\n".join(report.diagnosis_lines(more="--json")), file=to)
    print("\n" + report.summary(), file=to)
    if args.json:
        report.write_json(args.json)
    if args.plot:
        from parity_tests.common import plots
        plots.announce(report.plot(args.plot))
    return exit_status(report)
