"""Where the time of a check across ranks goes: ``python -m parity_tests.kernels.ranks.bench``.

One causal case per length (one head of one sequence, D 64, head-tail sharding, float32),
through ``check_ranks``, split into: starting the ranks; the ranks' compute (the slower
rank's forward and backward, less its communication); communication as observed (the
slower rank's seconds inside the blocking collectives); the golden result (float64,
blockwise NumPy, in the parent); the baseline (plain PyTorch in float32, in the parent);
judging (reassembling, errors, bounds, diagnosis); other (drawing and rounding the inputs,
cutting the shards, sending them and the results through the pipes); and the peak resident
memory of the largest rank and of the parent (the parent's is a running peak).  Printed, never asserted: the figures
belong to the machine and to its load, which is printed with them.
"""

import os
import sys

from parity_tests.kernels.ranks import check_ranks

__all__ = ["benchmark"]

PARTS = ("start", "rank compute", "communication", "golden", "baseline", "judging")


def _load():
    try:
        return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "load average unknown"


def _parent_peak():
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def benchmark(tokens=(4096, 16384), world_size=2, dtype="float32", target="examples.ring_attention:attention",
              file=None):
    """Print the time split of one case per length; returns ``{T: {part: seconds}}``."""
    file = file or sys.stdout
    print(f"check across {world_size} ranks of {target}: B1 H1 D64 causal, head-tail, {dtype}; "
          f"{len(os.sched_getaffinity(0))} CPUs, {_load()} before", file=file)
    header = (f"{'T':>7}  " + "  ".join(f"{p:>13}" for p in PARTS + ("other",)) + f"  {'total':>8}  verdict"
              "  peak memory: rank, parent")
    print(header, file=file)
    figures = {}
    for t in tokens:
        report = check_ranks(target, world_size=world_size, sharding="head-tail", dtypes=[dtype], tokens=[t],
                             causal="yes", timeout=0)
        split = dict(report.settings["seconds_by_part"])
        split["other"] = report.seconds - sum(split.values())
        figures[t] = dict(split, total=report.seconds)
        verdict = "pass" if report.passed else "FAIL"
        gib = lambda n: f"{n / 2 ** 30:.2f} GiB"
        print(f"{t:>7}  " + "  ".join(f"{split[p]:>11.2f} s" for p in PARTS + ("other",)) + f"  {report.seconds:>6.1f} s  "
              f"{verdict:<7}  {gib(report.settings['rank_peak_bytes'])}, {gib(_parent_peak())}", file=file, flush=True)
    print(f"({_load()} after)", file=file)
    return figures


if __name__ == "__main__":
    lengths = tuple(int(a) for a in sys.argv[1:]) or (4096, 16384)
    benchmark(lengths)
