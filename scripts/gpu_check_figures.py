"""The key figures of ``scripts/gpu-check``'s steps, read from what each step wrote.

Each reader takes a step's JSON (or its printed output) and returns ``(figures,
line)``: a dict for ``summary.json`` and one short line for the printed table.
They read only the standard library, so the summary is written even where PyTorch
does not import.
"""

import json
import math
import re

CHECK_TIMING = ("check's --json gives no separate golden and target times per case: each check run "
                "is recorded with check_seconds (its own count: golden, baseline and target together) "
                "and wall_s (the process: imports and CUDA start included); the speed step times the "
                "golden result against SDPA's backends separately")
PYTEST_LAST = re.compile(r"^=*\s*((?:\d+ [a-z]+(?:, )?)+).* in [\d.]+s")
SKIP_LINE = re.compile(r"^SKIPPED \[(\d+)\] (\S+?): (.*)$")


def _load(path):
    with open(path) as f:
        return json.load(f)


def _worse(a, b):
    """The larger ratio, None counting as nothing and NaN/inf (null in JSON) as nothing."""
    return b if a is None or (b is not None and b > a) else a


def check(path):
    """Worst error/bound per dtype and tensor of one ``check --json`` file."""
    data = _load(path)
    worst, top = {}, None
    for row in data["rows"]:
        ratio = row.get("ratio")
        per = worst.setdefault(row["dtype"], {})
        per[row["tensor"]] = _worse(per.get(row["tensor"]), ratio)
        if ratio is not None and (top is None or ratio > top[0]):
            top = (ratio, row["dtype"], row["tensor"], row["case"])
    s = data["summary"]
    figures = {"rows": s["rows"], "pass": s["pass"], "fail": s["fail"], "not_supported": s["not_supported"],
               "passed": s["passed"], "check_seconds": round(s["seconds"], 2), "dtypes": s.get("dtypes"),
               "features": s.get("features"), "worst_ratio": worst,
               "worst": None if top is None else {"ratio": top[0], "dtype": top[1], "tensor": top[2], "case": top[3]}}
    line = f"{s['rows']} rows, {s['fail']} FAIL, {s['not_supported']} not supported"
    if top is not None:
        line += f"; worst {top[0]:.2f} of bound ({top[1]} {top[2]})"
    return figures, line


def matrix(path):
    """Rows, failures and the worst error/bound per dtype of the parity matrix's --json."""
    data = _load(path)
    worst = {}
    for row in data["rows"]:
        if row.get("error") is not None and row.get("bound"):
            ratio = row["error"] / row["bound"] if math.isfinite(row["error"]) else None
            worst[row["dtype"]] = _worse(worst.get(row["dtype"]), ratio)
    s = data["summary"]
    figures = {"rows": s["rows"], "passed": s["passed"], "failed": s["failed"], "devices": s["devices"],
               "dtypes": s["dtypes"], "worst_ratio": worst}
    cells = ", ".join(f"{d} {r:.2f}" for d, r in worst.items() if r is not None)
    return figures, f"{s['rows']} rows, {s['failed']} failed; worst error/bound: {cells or '-'}"


def pytest(output):
    """pytest's last line (counts) and its skip reasons (-rs), from its printed output."""
    counts, skips = None, []
    for line in output.splitlines():
        m = SKIP_LINE.match(line.strip())
        if m:
            skips.append({"count": int(m.group(1)), "where": m.group(2), "reason": m.group(3)})
        m = PYTEST_LAST.match(line.strip())
        if m:
            counts = m.group(1).rstrip(", ")
    return {"counts": counts, "skipped": skips}, counts or "no pytest summary line"


def targets(output):
    """The built-in targets ``check --list`` names, and its note on what it left out."""
    names, notes = [], []
    for line in output.splitlines():
        if line.startswith("("):
            notes.append(line.strip("()"))
        elif line.strip():
            names.append(line.split()[0])
    return {"targets": names, "notes": notes}, f"{len(names)} targets: {', '.join(names)}"


def info(path):
    data = _load(path)
    if not data.get("cuda_available"):
        return data, f"no CUDA device; torch {data.get('torch')}, python {data.get('python')}"
    peak = data.get("peak_bf16_tflops")
    peak_text = f"{peak:.0f} TFLOP/s bf16 ({data['peak_method']})" if peak else data["peak_method"]
    cap = ".".join(map(str, data.get("capability", [])))
    return data, f"{data['name']} (sm {cap}, {data.get('sms')} SMs), peak {peak_text}; torch {data['torch']}"


def speed(path, peak=None):
    """The TFLOP/s each backend reaches per T, the best one, and the golden's time."""
    data = _load(path)
    tflops, seconds, golden, best = {}, {}, {}, None
    for row in data["rows"]:
        t = row["tokens"]
        for name, r in row["backends"].items():
            seconds.setdefault(name, {})[t] = r.get("fwd_bwd_s", r.get("unsupported"))
            if "fwd_bwd_tflops" in r:
                tflops.setdefault(name, {})[t] = r["fwd_bwd_tflops"]
                if best is None or r["fwd_bwd_tflops"] > best[0]:
                    best = (r["fwd_bwd_tflops"], name, t)
            else:
                tflops.setdefault(name, {})[t] = None
        golden[t] = row["golden"].get("fwd_bwd_s")
    figures = {"dtype": data["dtype"], "device": data["device"],
               "shape": {k: data[k] for k in ("batch", "heads", "head_dim")},
               "fwd_bwd_tflops": tflops, "fwd_bwd_s": seconds, "golden_fwd_bwd_s": golden, "peak_bf16_tflops": peak,
               "best": None if best is None else {"tflops": best[0], "backend": best[1], "tokens": best[2]}}
    if best is None:
        return figures, "no backend ran"
    line = f"{data['dtype']} best {best[0]:.3g} TFLOP/s ({best[1].split('_')[0].lower()}, T {best[2]})"
    if peak:
        figures["best"]["share_of_peak"] = best[0] / peak
        line += f", {best[0] / peak:.0%} of peak"
    done = [t for t, s in golden.items() if s is not None]
    if done:
        line += f"; golden T {done[-1]}: {golden[done[-1]]:.2f} s"
    return figures, line


def gather_checks(steps):
    """``(per target and run: the check figures with the run's wall time; per target, dtype and
    tensor: the worst error/bound over all its runs)`` from the steps that ran ``check``."""
    runs, worst = {}, {}
    for s in steps:
        if s.read != "check" or "figures" not in s.result:
            continue
        f = s.result["figures"]
        key = s.meta["run"] + (f" {f['dtypes'][0]}" if s.group == "long" and f.get("dtypes") else "")
        runs.setdefault(s.meta["target"], {})[key] = dict(f, wall_s=s.result["seconds"])
        for dtype, tensors in f["worst_ratio"].items():
            per = worst.setdefault(s.meta["target"], {}).setdefault(dtype, {})
            for tensor, ratio in tensors.items():
                per[tensor] = _worse(per.get(tensor), ratio)
    return runs, worst


def table(steps, seconds, budget):
    """The printed table (step, status, seconds, key figures) and a closing count."""
    rows = [("step", "status", "seconds", "key figures")]
    rows += [(s.name, s.status or "not reached", f"{s.result['seconds']:.1f}" if "seconds" in s.result else "-",
              s.result.get("line", "")) for s in steps]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:3], width)) + "  " + r[3] for r in rows]
    lines.insert(1, "  ".join("-" * w for w in width) + "  " + "-" * 11)
    count = lambda word: sum(1 for s in steps if (s.status or "").startswith(word))
    closing = (f"{len(steps)} steps: {count('passed')} passed, {count('failed')} failed, {count('timed out')} "
               f"timed out, {count('skipped')} skipped, {count('no CUDA')} no CUDA device in {seconds:.1f} s "
               f"(budget {budget:g} s)")
    return "\n".join(line.rstrip() for line in lines) + "\n\n" + closing
