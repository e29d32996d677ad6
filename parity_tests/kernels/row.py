"""One row of a check: one tensor of one case in one dtype on one device, its error, bound
and verdict (``report`` holds the rows; the case runner, ``runner``, fills them)."""

import math
from dataclasses import dataclass

__all__ = ["Row", "TIMED_FROM"]

# Below this many seconds of SDPA's, a case's time ratio is left out ("-"): a single call
# of a tenth of a millisecond is moved by a cache miss or an allocation (measured: the same
# kernel at 0.05 .. 3 ms on its first calls of a shape).
TIMED_FROM = 1e-3


@dataclass
class Row:
    target: str
    case: str
    dims: dict
    dtype: str
    device: str
    tensor: str
    align: str = "top-left"
    error: float = None
    baseline: float = None
    bound: float = None
    verdict: str = "pass"
    where: tuple = None
    note: str = ""
    diagnosis: object = None          # a diagnosis.Diagnosis for failing rows
    mean_error: float = None          # the mean error and the cosine with the reference
    cosine: float = None
    seconds: float = None             # the target's forward on the case (its second call)
    sdpa_seconds: float = None        # PyTorch's SDPA's best forward on the same case, where it expresses it
    sdpa_error: float = None          # SDPA's own error on out, in the same dtype (out's row only)
    split: dict = None                # the case's wall seconds: target, baseline, golden, diagnosis, other, wall
    case_def: object = None           # the cases.Case that ran (as handed to runner.run_case): --repro reruns it
    judge_defect: str = None          # the check's own baseline past a plain computation's error: the
    #                                   check's defect, not the kernel's (the run does not pass)
    inputs_error: float = None        # the inputs' own rounding (FP8's quantisation): the golden on the drawn
    #                                   inputs against the golden on the rounded, beside the verdict

    def __repr__(self):
        """One line: the case, dtype, tensor, error against bound and verdict (no arrays)."""
        num = lambda x: "-" if x is None else f"{x:.1e}"
        said = f" ({self.note})" if self.note else ""
        named = f"; {self.diagnosis.id}" if self.diagnosis is not None else ""
        return (f"<Row {self.target} {self.case} {self.dtype} {self.device} {self.tensor}: error {num(self.error)}, "
                f"bound {num(self.bound)}, {self.verdict}{said}{named}>")

    @property
    def passed(self):
        return self.verdict == "pass"

    @property
    def failed(self):
        return self.verdict == "FAIL"

    @property
    def speed(self):
        """The target's time over SDPA's on the same case (None where SDPA did not run, or
        took less than TIMED_FROM: a ratio of such times measures the machine's noise)."""
        if not self.seconds or not self.sdpa_seconds or self.sdpa_seconds < TIMED_FROM:
            return None
        return self.seconds / self.sdpa_seconds

    @property
    def ratio(self):
        if self.error is None or not self.bound:
            return None
        return self.error / self.bound if math.isfinite(self.error) else math.inf

    def as_dict(self):
        """The row for --json.  A figure that was not measured is null; one that is infinite or
        NaN (a non-finite output, a target that raised) is the string "inf" or "nan", since
        JSON has no such numbers and null would read as "not measured"."""
        num = lambda x: None if x is None else float(x) if math.isfinite(x) else ("nan" if math.isnan(x) else
                                                                                 "inf" if x > 0 else "-inf")
        return {"target": self.target, "case": self.case, **self.dims, "dtype": self.dtype,
                "device": self.device, "align": self.align, "tensor": self.tensor,
                "error": num(self.error), "baseline": num(self.baseline), "bound": num(self.bound),
                "ratio": num(self.ratio), "verdict": self.verdict, "passed": self.passed,
                "where": None if self.where is None else list(self.where), "note": self.note,
                "diagnosis": None if self.diagnosis is None else self.diagnosis.as_dict(),
                "mean_error": num(self.mean_error), "cosine": num(self.cosine), "seconds": num(self.seconds),
                "sdpa_seconds": num(self.sdpa_seconds), "sdpa_error": num(self.sdpa_error),
                "split": None if self.split is None else {k: num(v) for k, v in self.split.items()},
                "inputs_error": num(self.inputs_error), "judge_defect": self.judge_defect}
