"""Where one case of ``attention-parity check`` spends its time, by part.

``python -m parity_tests.kernels.time_split T KERNEL`` runs one causal case (batch 1,
one head, D = 64, float32, CPU) through the check's own case runner (``runner.run_case``)
with KERNEL ``sdpa`` (PyTorch's SDPA, its own choice of backend: it passes) or
``no-scale`` (SDPA called with ``scale=1.0``: the 1/sqrt(D) scale left out, so the case
fails and the diagnosis runs), and prints one JSON object: the verdict, the diagnosis's
id, the case's wall seconds split into target, baseline, golden, diagnosis and other
(``runner.Split``), and the process's peak resident memory.  One case per process, so
that the peak is the case's own; ``attention-parity bench --check-split`` runs it for
each length and kernel and prints the table.
"""

import json
import resource
import sys
import time

import torch

from parity_tests.kernels.runner import SPLIT_PARTS

__all__ = ["KERNELS", "measure_one", "main"]

PARTS = SPLIT_PARTS + ("other",)


def sdpa(q, k, v, *, causal, scale):
    """PyTorch's SDPA, its own choice of backend: the target that passes."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def no_scale(q, k, v, *, causal, scale):
    """SDPA without the 1/sqrt(D) scale (scale=1.0): the target that fails, diagnosed."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=1.0)


KERNELS = {"sdpa": sdpa, "no-scale": no_scale}


def measure_one(T, kernel, head_dim=64):
    """{T, kernel, verdict, named (the diagnosis's id or "-"), wall and seconds by part,
    maxrss_gib (this process's peak so far)}."""
    from parity_tests.kernels import runner, targets
    from parity_tests.kernels.cases import Case
    from parity_tests.kernels.runner import one_thread_if_small
    case = Case(1, 1, T, T, head_dim, True)
    start = time.perf_counter()
    with one_thread_if_small(case, "cpu"):                         # as the check runs it
        rows = runner.run_case(targets.resolve(KERNELS[kernel]), case, "float32", "cpu", timeout=None)
    wall = time.perf_counter() - start
    failed = [r for r in rows if r.failed]
    named = next((r.diagnosis.id for r in failed if r.diagnosis is not None), "-")
    return {"T": T, "kernel": kernel, "verdict": "FAIL" if failed else "pass", "named": named, "wall": wall,
            **{p: rows[0].split[p] for p in PARTS}, "case_wall": rows[0].split["wall"],
            "torch_threads": torch.get_num_threads(),
            "maxrss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or not argv[0].isdigit() or int(argv[0]) < 1 or argv[1] not in KERNELS:
        print(f"usage: python -m parity_tests.kernels.time_split T {{{','.join(KERNELS)}}}", file=sys.stderr)
        return 2
    print(json.dumps(measure_one(int(argv[0]), argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
