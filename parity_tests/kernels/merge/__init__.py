"""``attention-parity check --merge module:fn`` and ``parity_tests.check(fn, merge=True)``.

A merge ``fn(out_a, lse_a, out_b, lse_b) -> (out, lse)`` (torch tensors: out
(B, H, T, D), lse (B, H, T), natural log, an empty partial lse −inf with any
out) is held to ``numpy_ref.merge_states`` in float64, forward and backward.

Cases: the partial states of one attention (``numpy_ref.merge.split_states``:
``reference_attention`` on key ranges ``k[..., a:b, :]``) cut at random, merged
back by ``fn`` in the order a ring uses (a left fold) or a tree does (neighbours
pairwise); see `CASES`.  The rows of a case: ``out`` and ``lse`` of the merged
state, and the gradients of every partial's out and lse (``dout_parts``,
``dlse_parts``, stacked over the partials: out_a, out_b for two) given random
upstream gradients on out and lse, from autograd through ``fn``.

Inputs are rounded to the tested dtype (out in it, lse in float32 for bfloat16
and float16, as FlashAttention keeps it), and the golden result is the float64
merge of the rounded numbers.  Each tensor passes when its normwise relative
error is at most ``tolerances.check_bound(dtype, baseline)`` (lse and its
gradient with the floor of lse's dtype, float32 beside bfloat16 and float16):
the baseline is the larger error of two plain PyTorch merges in the same dtype
(the max-shifted one below and the dense ``logaddexp`` formula).  An lse of
−inf (an empty union) must come back −inf.  A failing row is diagnosed by
``merge_diagnosis``.
"""

import math
import sys
import time
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from numpy_ref import merge as ref
from parity_tests.common import options, outputs
from parity_tests.common import tolerances as tol
from parity_tests.kernels import targets
from parity_tests.kernels.merge.diagnosis import bad_entries, diagnose_case
from parity_tests.kernels.report import Report
from parity_tests.kernels.row import Row

__all__ = ["check_merge", "merge_main", "CASES", "plain_merge", "dense_merge"]

DTYPES = {"float64": torch.float64, "float32": torch.float32,
          "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_DTYPES = {"cpu": ("float32", "bfloat16"), "cuda": ("float32", "bfloat16", "float16")}
TENSORS = ("out", "lse", "dout_parts", "dlse_parts")


@dataclass(frozen=True)
class MergeCase:
    """B, H, T (query rows), D; ``parts`` partials of ``keys`` keys merged in ``order``;
    ``kind``: plain, empty (causal ranges that see no key, a range with no key at all,
    empty outs NaN or garbage), dominant (one range's scores +30) or large (lse ±1000)."""
    B: int
    H: int
    T: int
    D: int
    keys: int
    parts: int
    order: str
    kind: str = "plain"

    @property
    def name(self):
        how = "pair" if self.parts == 2 else f"{self.order} of {self.parts}"
        extra = {"plain": "", "empty": ", empty", "dominant": ", dominant", "large": ", lse ±1000"}
        return f"B{self.B} H{self.H} T{self.T} D{self.D} {how}{extra[self.kind]}"

    @property
    def dims(self):
        return {"b": self.B, "h": self.H, "tq": self.T, "tk": self.keys, "d": self.D,
                "parts": self.parts, "order": self.order, "kind": self.kind}


CASES = (
    MergeCase(2, 3, 17, 64, 40, 2, "ring"),
    MergeCase(1, 4, 9, 128, 70, 8, "ring"),
    MergeCase(2, 2, 13, 40, 50, 5, "tree"),
    MergeCase(2, 2, 11, 32, 30, 4, "ring", "empty"),
    MergeCase(1, 3, 12, 16, 36, 6, "tree", "empty"),
    MergeCase(1, 2, 16, 64, 48, 3, "tree", "dominant"),
    MergeCase(2, 2, 8, 64, 32, 4, "ring", "large"),
)


# ----------------------------------------------------------------------------
# The inputs of a case, in float64

def draw_case(case, seed):
    """``(states, dout, dlse)``: ``case.parts`` float64 states ``(out, lse)`` and the
    upstream gradients.  Rows of a partial that see no key hold NaN or garbage."""
    rng = np.random.default_rng([seed, zlib.crc32(case.name.encode())])
    B, H, T, D, Tk = case.B, case.H, case.T, case.D, case.keys
    q, k = rng.standard_normal((B, H, T, D)), rng.standard_normal((B, H, Tk, D))
    v = rng.standard_normal((B, H, Tk, D))
    bias = np.zeros((B, 1, 1, Tk))
    cuts = np.sort(np.concatenate([[0, Tk], rng.choice(np.arange(1, Tk), case.parts - 1, replace=False)]))
    if case.kind == "empty":         # causal (query i sees keys j <= 3i), and a range with no key
        bias = np.where(np.arange(Tk) > 3 * np.arange(T)[:, None], -np.inf, 0.0)[None, None]
        cuts[1] = 0
    elif case.kind == "dominant":    # the keys of the second range score 30 above the others
        bias = bias + np.where((np.arange(Tk) >= cuts[1]) & (np.arange(Tk) < cuts[2]), 30.0, 0.0)
    elif case.kind == "large":       # every score +1000 in batch 0, -1000 in batch 1
        bias = bias + np.array([1000.0, -1000.0])[:, None, None, None]
    states = ref.split_states(q, k, v, cuts.tolist(), bias=bias)
    for i, (out, lse) in enumerate(states):
        empty = np.isneginf(lse)[..., None]
        junk = np.nan if i % 2 == 0 else 7e3 * rng.standard_normal(out.shape)
        states[i] = (np.where(empty, junk, out), lse)
    return states, rng.standard_normal((B, H, T, D)), rng.standard_normal((B, H, T))


def lse_dtype(dtype):
    return torch.float64 if dtype == "float64" else torch.float32


def rounded(states, dout, dlse, dtype):
    """Everything rounded to what the merge receives: (torch states, dout, dlse) on CPU."""
    od, ld = DTYPES[dtype], lse_dtype(dtype)
    t_states = [(torch.tensor(o).to(od), torch.tensor(l).to(ld)) for o, l in states]
    return t_states, torch.tensor(dout).to(od), torch.tensor(dlse).to(ld)


def as64(t):
    return t.detach().to("cpu", torch.float64).numpy()


def golden(t_states, t_dout, t_dlse, order):
    """The float64 merge of the rounded inputs: (out, lse, dout_parts, dlse_parts)."""
    states = [(as64(o), as64(l)) for o, l in t_states]
    out, lse = ref.merge_many(states, order)
    grads = ref.merge_many_backward(as64(t_dout), as64(t_dlse), states, order)
    return out, lse, np.stack([g[0] for g in grads]), np.stack([g[1] for g in grads])


# ----------------------------------------------------------------------------
# Plain PyTorch merges: the baseline

def plain_merge(out_a, lse_a, out_b, lse_b, base2=False):
    """The merge as the online softmax writes it: m = max, α = exp(lse − m), empty terms 0.
    ``base2``: lse read as log2 and merged with exp2 (a mistake on natural-log states; the
    ranks' diagnosis simulates a ring that makes it)."""
    exp, log = (torch.exp2, torch.log2) if base2 else (torch.exp, torch.log)
    m = torch.maximum(lse_a, lse_b).detach()
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    alpha_a, alpha_b = exp(lse_a - m), exp(lse_b - m)
    total = alpha_a + alpha_b
    safe = torch.where(total == 0, torch.ones_like(total), total)
    lse = torch.where(total == 0, torch.full_like(total, -math.inf), m + log(safe))
    term = lambda alpha, o, l: alpha[..., None] * torch.where(torch.isneginf(l)[..., None], 0, o)
    out = (term(alpha_a, out_a, lse_a) + term(alpha_b, out_b, lse_b)) / safe[..., None]
    return out.to(out_a.dtype), lse


def dense_merge(out_a, lse_a, out_b, lse_b):
    """The contract's formula: lse = logaddexp, w = exp(lse_x − lse) (guarded for empties)."""
    both = torch.isneginf(lse_a) & torch.isneginf(lse_b)
    zero = lambda l: torch.where(both, torch.zeros_like(l), l)
    lse = torch.logaddexp(zero(lse_a), zero(lse_b))
    w_a, w_b = torch.exp(zero(lse_a) - lse), torch.exp(zero(lse_b) - lse)
    out = (w_a[..., None] * torch.where(torch.isneginf(lse_a)[..., None], 0, out_a)
           + w_b[..., None] * torch.where(torch.isneginf(lse_b)[..., None], 0, out_b))
    out = torch.where(both[..., None], torch.zeros_like(out), out)
    return out.to(out_a.dtype), torch.where(both, torch.full_like(lse, -math.inf), lse)


# ----------------------------------------------------------------------------
# Calling a merge: a fold over the partials, then autograd

class _Bad(Exception):
    """The merge returned something that is not a state of the inputs' kind."""


_BITS = {torch.float64: torch.int64, torch.float32: torch.int32,
         torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _one_line(e):
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}".rstrip(": ")


def _state(result, out_a, lse_a):
    """``result`` checked to be ``(out, lse)`` shaped, typed and placed like the inputs."""
    if not isinstance(result, (tuple, list)) or len(result) != 2 or \
            not all(isinstance(t, torch.Tensor) for t in result):
        raise _Bad(f"returned {type(result).__name__}, not a pair (out, lse) of tensors")
    for name, got, like in (("out", result[0], out_a), ("lse", result[1], lse_a)):
        if got.shape != like.shape or got.dtype != like.dtype or got.device != like.device:
            raise _Bad(f"{name} is {tuple(got.shape)} {str(got.dtype)[6:]} on {got.device}; "
                       f"expected {tuple(like.shape)} {str(like.dtype)[6:]} on {like.device}")
    return tuple(result)


def fold(fn, states, order):
    """Merge ``states`` with ``fn`` in ``order`` (``numpy_ref.merge.merge_plan``)."""
    work = list(states)
    for i, j in ref.merge_plan(len(work), order):
        work[i] = _state(fn(*work[i], *work[j]), *states[0])
    return work[0]


def run_merge(fn, t_states, t_dout, t_dlse, order, device):
    """``fn``'s fold and its gradients -> ``(forward, grads, reason)``: forward
    ``(out, lse)`` and grads ``(dout_parts, dlse_parts)`` as float64 arrays, None
    where they could not be had, and why."""
    leaves = [(o.to(device).requires_grad_(), l.to(device).requires_grad_()) for o, l in t_states]
    flat = [x for s in leaves for x in s]
    before = [x.detach().clone() for x in flat]
    try:
        out, lse = fold(fn, leaves, order)
    except _Bad as e:
        return None, None, str(e)
    except Exception as e:                             # noqa: BLE001 - any failure of the target
        return None, None, f"raised {_one_line(e)}"
    if any(not torch.equal(x.detach().view(_BITS[x.dtype]), b.view(_BITS[b.dtype]))
           for x, b in zip(flat, before)):
        return None, None, "changed its inputs in place"
    forward = (as64(out), as64(lse))
    pairs = [(t, g.to(device)) for t, g in ((out, t_dout), (lse, t_dlse)) if t.requires_grad]
    if not pairs:
        return forward, None, "no gradient: out and lse carry no autograd graph (detached?)"
    try:
        grads = torch.autograd.grad([t for t, _ in pairs], flat, [g for _, g in pairs], allow_unused=True)
    except Exception as e:                             # noqa: BLE001
        return forward, None, f"backward raised {_one_line(e)}"
    grads = [np.zeros(x.shape) if g is None else as64(g) for g, x in zip(grads, flat)]
    return forward, (np.stack(grads[0::2]), np.stack(grads[1::2])), None


# ----------------------------------------------------------------------------
# Judging

def error_of(got, gold, denom, tensor):
    """``(normwise relative error, (b, h, row) of the worst entry)``; inf on a bad entry."""
    bad = bad_entries(got, gold)
    if bad.any():
        return math.inf, _place(np.unravel_index(np.argmax(bad), bad.shape), tensor)
    diff = np.where(np.isneginf(gold), 0.0, np.abs(got - np.where(np.isneginf(gold), 0, gold)))
    return float(diff.max() / denom), _place(np.unravel_index(np.argmax(diff), diff.shape), tensor)


def _place(index, tensor):
    """(b, h, row) of an index into out (B, H, T, D), lse (B, H, T) or their stacks over the parts."""
    start = 1 if tensor.endswith("_parts") else 0
    return tuple(int(i) for i in index[start:start + 3])


def denominators(gold):
    """Per tensor: max |ref| (finite entries), gradients floored at SCALE_FLOOR x the case's largest."""
    top = {t: float(np.abs(np.where(np.isfinite(g), g, 0)).max()) for t, g in gold.items()}
    scale = max(top["dout_parts"], top["dlse_parts"])
    floor = lambda t: max(top[t], tol.SCALE_FLOOR * scale) if t.startswith("d") else top[t]
    return {t: max(floor(t), 1e-300) for t in gold}


def _baseline(t_states, t_dout, t_dlse, order, device, gold, denoms):
    """Per tensor, the larger error of the two plain merges (non-finite ones left out)."""
    worst = dict.fromkeys(TENSORS, 0.0)
    for plain in (plain_merge, dense_merge):
        forward, grads, _ = run_merge(plain, t_states, t_dout, t_dlse, order, device)
        for t, got in zip(TENSORS, (forward or (None, None)) + (grads or (None, None))):
            if got is not None:
                e = error_of(got, gold[t], denoms[t], t)[0]
                worst[t] = max(worst[t], e if math.isfinite(e) else 0.0)
    return worst


def run_case(target, case, dtype, device, seed):
    """The four rows of one case in one dtype, failing ones diagnosed."""
    states, dout, dlse = draw_case(case, seed)
    t_states, t_dout, t_dlse = rounded(states, dout, dlse, dtype)
    gold = dict(zip(TENSORS, golden(t_states, t_dout, t_dlse, case.order)))
    denoms = denominators(gold)
    base = _baseline(t_states, t_dout, t_dlse, case.order, device, gold, denoms)
    forward, grads, reason = run_merge(target.fn, t_states, t_dout, t_dlse, case.order, device)
    got = dict(zip(TENSORS, (forward or (None, None)) + (grads or (None, None))))
    rows = []
    for t in TENSORS:
        own = dtype if t in ("out", "dout_parts") else str(lse_dtype(dtype))[6:]   # lse: float32
        row = Row(target.name, case.name, case.dims, dtype, device, t, align="-",
                  baseline=base[t], bound=tol.check_bound(own, base[t]))
        if got[t] is None:
            row.verdict, row.note = "FAIL", reason
        else:
            row.error, row.where = error_of(got[t], gold[t], denoms[t], t)
            row.verdict = "pass" if row.error <= row.bound else "FAIL"
        rows.append(row)
    if any(r.failed and got[r.tensor] is not None for r in rows):
        inputs = [(as64(o), as64(l)) for o, l in t_states]
        diagnose_case(rows, got, gold, denoms, inputs, as64(t_dout), as64(t_dlse), case.order, dtype)
    return rows


class MergeReport(Report):
    """A `Report` whose summary names the merge check instead of a causal alignment."""

    def summary(self):
        rows = self.rows
        count = lambda v: sum(r.verdict == v for r in rows)
        s = self.settings
        return (f"{self.target}: {len(rows)} rows, {count('pass')} pass, {count('FAIL')} FAIL, "
                f"{count('not supported')} not supported in {self.seconds:.1f} s "
                f"({s.get('device')}; {', '.join(s.get('dtypes', []))}; merge of partial states)")


def resolve(target):
    """A `targets.Target` from a callable or ``"module.path:callable"``."""
    if isinstance(target, str) and ":" not in target:
        raise ValueError(f"merge target must be module.path:callable or a callable, got {target!r}")
    return targets.resolve(target)


def _dtypes(dtypes, device):
    if dtypes is None:
        return list(DEFAULT_DTYPES[device])
    names = [options.dtype_name(d) for d in ([dtypes] if isinstance(dtypes, str) else dtypes)]
    unknown = [d for d in names if d not in DTYPES]
    if unknown or not names:
        raise ValueError(f"dtypes must be among {', '.join(DTYPES)}; got {', '.join(unknown) or 'none'}")
    return list(dict.fromkeys(names))


def check_merge(fn, *, device="cpu", dtypes=None, seed=0):
    """Hold a merge ``fn(out_a, lse_a, out_b, lse_b) -> (out, lse)`` (a callable or
    ``"module.path:callable"``) to ``numpy_ref.merge_states``; returns a `Report`
    (``.passed``, ``.rows``, ``.failures``, ``.diagnoses``, ``.diagnosis``)."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda': no CUDA device is available (torch.cuda.is_available() is False)")
    names = _dtypes(dtypes, device)
    target = resolve(fn)
    start = time.perf_counter()
    rows = [r for d in names for case in CASES for r in run_case(target, case, d, device, seed)]
    return MergeReport(target.name, rows, time.perf_counter() - start,
                       {"device": device, "dtypes": names, "merge": True,
                        "factor": tol.CHECK_FACTOR, "floor_ulps": tol.CHECK_FLOOR_ULPS})


# ----------------------------------------------------------------------------
# The command: attention-parity check --merge module:fn

NOT_FOR_MERGE = ("tokens", "head_dim", "heads", "batch", "features", "long")


def merge_main(args):
    """``check --merge`` after `run.build_parser` parsed it -> exit status."""
    say = lambda text: print(f"attention-parity check: error: {text}", file=sys.stderr)
    if args.target:
        say(f"give either TARGET or --merge, not both (got {args.target!r} and --merge {args.merge!r})")
        return 2
    extra = [f"--{n.replace('_', '-')}" for n in NOT_FOR_MERGE if getattr(args, n, None)]
    if getattr(args, "layout", "bhtd") != "bhtd":
        extra.append("--layout")
    if extra:
        say(f"--merge runs its own cases; it takes --device, --dtype, --seed, --json and -q, not {', '.join(extra)}")
        return 2
    problem = args.json not in (None, "-") and outputs.output_file_problem("--json", args.json)
    if problem:
        say(problem)
        return 2
    try:
        report = check_merge(args.merge, device=args.device, seed=args.seed,
                             dtypes=options.split_list(args.dtype, "--dtype") or None)
    except (ValueError, TypeError) as e:
        say(e)
        return 2
    print(report.render(args.quiet), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        report.write_json(args.json)             # "-": standard output
    return 0 if report.passed else 1
