"""Context-parallel attention across ranks: ``check_ranks(fn, world_size=N, ...)``.

The parent starts N ranks itself (`rank_world.World`: spawn, a store on 127.0.0.1, gloo
on CPU, NCCL on CUDA), and for each case:

1. draws q, k, v, dO in float64 and rounds them to the tested dtype once;
2. computes the golden result once (``numpy_ref.reference_attention``, float64,
   blockwise, O(T) memory) and the baseline (the plain PyTorch computation of the whole
   sequence in the tested dtype: ``runner.baseline``, the check's one dense formula);
3. gives rank r its shard along the sequence (`shard_positions`): *contiguous*, rows
   ``[r T / N, (r + 1) T / N)``, or *head-tail* (zig-zag), the sequence cut into 2N
   chunks and rank r holding chunks r and 2N - 1 - r, which balances causal work;
4. each rank calls ``fn(q, k, v, *, causal, scale, group, q_positions, k_positions)``
   (global row indices, int64) on its shard, backpropagates its shard of dO, and sends
   back out (and lse), dq, dk, dv for its rows;
5. the parent puts them back in global order and judges each tensor as ``runner`` does:
   error against the golden result <= ``tolerances.check_bound(dtype, baseline error)``,
   one `Row` per tensor, the case label naming the world size and the sharding.
   A failing tensor is located by rank and key range and tested against the mistakes
   sharding invites (``rank_diagnosis``).

A rank that raises, exits or hangs FAILS the case with its number and why; the other
ranks are stopped and a fresh world serves the next case.  ``timeout`` bounds each
case (a collective that never completes included).
"""

import inspect
import math
import os
import pickle
import sys
import time

import numpy as np
import torch

from parity_tests.common import options
from parity_tests.common import tolerances as tol
import parity_tests.kernels.runner as runner
import parity_tests.kernels.ranks.diagnosis as rank_diagnosis
from parity_tests.kernels.diagnosis import diagnose
from parity_tests.kernels import targets
from parity_tests.kernels.ranks import world as rank_world
from parity_tests.kernels.cases import Case
from parity_tests.kernels.features import declared
from parity_tests.kernels.report import Report
from parity_tests.kernels.row import Row

__all__ = ["check_ranks", "shard_positions", "rank_cases", "SHARDINGS", "RANK_FEATURES", "DEFAULT_TIMEOUT"]

SHARDINGS = ("contiguous", "head-tail")
RANK_FEATURES = ("gqa", "window", "lse")
CAUSAL = {"yes": (True,), "no": (False,), "both": (True, False)}
DEFAULT_TOKENS = (67, 256)               # 67: no sharding divides it
DEFAULT_TIMEOUT = 120.0
KEYWORDS = ("causal", "scale", "group", "q_positions", "k_positions")
# Dense baseline (with features or lse): at most this many (query, key) pairs.


def shard_positions(tokens, world_size, sharding):
    """Rank r's global row indices (int64 arrays, ascending), r = 0 .. N - 1."""
    n = world_size
    if sharding == "contiguous":
        cuts = [r * tokens // n for r in range(n + 1)]
        return [np.arange(cuts[r], cuts[r + 1], dtype=np.int64) for r in range(n)]
    cuts = [c * tokens // (2 * n) for c in range(2 * n + 1)]
    chunk = lambda c: np.arange(cuts[c], cuts[c + 1], dtype=np.int64)
    return [np.concatenate([chunk(r), chunk(2 * n - 1 - r)]) for r in range(n)]


def rank_cases(tokens=None, causal="both", features=()):
    """The cases: B1 H2 D32 at T = 67 and B2 H2 D64 at T = 256 (or the ``tokens`` given: B1 H2
    D32 below 128, B2 H2 D64 up to 1024, one head of one sequence with D64 beyond, as ``--long``),
    causal and not; with ``gqa`` H 4/2 and 4/1, with ``window`` two windows per mask."""
    masks = CAUSAL[causal]
    lengths = list(tokens) if tokens else list(DEFAULT_TOKENS)
    shape = lambda t: (1, 2, 32) if t < 128 else (2, 2, 64) if t <= 1024 else (1, 1, 64)
    cases = [Case(*shape(t)[:2], t, t, shape(t)[2], c) for t in lengths for c in masks]
    t = lengths[0]
    if "gqa" in features:
        cases += [Case(1, 4, t, t, 32, c, (("gqa", h),)) for h in (2, 1) for c in masks]
    if "window" in features:
        for c in masks:
            windows = [(t // 4, 0), (5, 0)] if c else [(t // 4, 8), (-1, 5)]
            cases += [Case(1, 2, t, t, 32, c, (("window", w),)) for w in windows]
    return cases


def _label(case, world_size, sharding):
    return f"{case} / {world_size} ranks {sharding}"


def _inputs(case, seed, dtype):
    """The case's q, k, v, dout rounded to ``dtype`` (``runner.draw``: seeded by the case's fields)."""
    drawn = runner.draw(case, seed)
    return {n: torch.from_numpy(drawn[n]).to(runner.DTYPES[dtype]).to(torch.float64).numpy()
            for n in ("q", "k", "v", "dout")}


def _denominators(gold):
    den = runner.denominators(gold)
    if "lse" in gold:
        den["lse"] = max(1.0, float(np.abs(gold["lse"]).max(initial=0.0)))
    return den


def _four(a):
    """lse (B, H, T) -> (B, H, T, 1), so that every tensor is judged alike."""
    return a[..., None] if a.ndim == 3 else a


# ---------------------------------------------------------------------------
# Options, refused before any work

def _world_size(world_size, device):
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    usable = rank_world.usable_devices(device)
    if world_size > usable:
        what = (f"{usable} usable CPU{'s' if usable != 1 else ''} (os.sched_getaffinity): one rank per "
                "core, or ranks would wait on each other's time slices and a hang could not be told from "
                "a slow rank" if device == "cpu" else f"{usable} CUDA device{'s' if usable != 1 else ''}: "
                "NCCL wants one GPU per rank")
        raise ValueError(f"world_size {world_size} is more than this machine can run: it has {what}")
    return world_size


def _shardings(sharding):
    names = [sharding] if isinstance(sharding, str) else list(sharding or ())
    bad = [s for s in names if s not in SHARDINGS]
    if bad or not names:
        raise ValueError(f"sharding must be among {', '.join(SHARDINGS)}; got {', '.join(map(str, bad)) or 'none'}")
    return list(dict.fromkeys(names))


def _dtypes(dtypes, device):
    if dtypes is None:
        return ["float32", "bfloat16"]
    names = [options.dtype_name(d) for d in ([dtypes] if isinstance(dtypes, str) else dtypes)]
    bad = [d for d in names if d not in runner.DTYPES]
    if bad or not names:
        raise ValueError(f"dtypes must be among {', '.join(runner.DTYPES)}; got {', '.join(bad) or 'none'}")
    return list(dict.fromkeys(names))


def _tokens(tokens, world_size):
    if tokens is None:
        return None
    out = []
    for t in ([tokens] if isinstance(tokens, (int, str)) else tokens):
        text = str(t).lower()
        parts = text.split("x")
        if len(parts) == 2 and parts[0] != parts[1]:
            raise ValueError(f"tokens: across ranks the check is self-attention (Tq = Tk), got {t!r}")
        try:
            n = int(parts[0])
        except ValueError:
            raise ValueError(f"tokens must be lengths T, got {t!r}") from None
        if n < 2 * world_size:
            raise ValueError(f"tokens must be at least 2 x world_size = {2 * world_size} "
                             f"(head-tail sharding cuts 2N chunks), got {n}")
        out.append(n)
    return out


def _features(features, fn, name):
    names = [f.strip().replace("-", "_") for f in (features.split(",") if isinstance(features, str)
                                                   else (features or ())) if f.strip()]
    bad = [f for f in names if f not in RANK_FEATURES]
    if bad:
        raise ValueError(f"features across ranks must be among {', '.join(RANK_FEATURES)}; got {', '.join(bad)}")
    needs = KEYWORDS + (("window",) if "window" in names else ())
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = None
    if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        missing = [kw for kw in needs if kw not in params]
        if missing:
            raise ValueError(f"target {name}: across ranks it is called with {', '.join(k + '=' for k in needs)} "
                             f"and its signature has no {', '.join(missing)}")
    return list(dict.fromkeys(names))


def _target(fn, device):
    """``(name, what each rank receives, the callable)``: a callable sent by reference, a built-in's
    name, or a file's ``path.py:callable`` (its path made absolute)."""
    from parity_tests.kernels.ranks import builtin as rank_targets
    if isinstance(fn, str) and fn in rank_targets.BUILTINS:
        rank_targets.available(fn, device)               # ValueError, with the reason, when not here
        return fn, fn, rank_targets.builtin(fn)
    if isinstance(fn, str):
        if ":" not in fn:
            raise ValueError(f"target across ranks must be module.path:callable or one of "
                             f"{', '.join(rank_targets.BUILTINS)}, got {fn!r}")
        name, fn = fn, targets.resolve(fn).fn
        path, attr = name.rsplit(":", 1)
        if path.endswith(".py"):                        # a file no rank can import by name: each loads it by path
            return name, f"{os.path.abspath(path)}:{attr}", fn
    elif callable(fn):
        name = targets.user_target(fn).name
    else:
        raise TypeError(f"target must be a callable or a name, got {type(fn).__name__}")
    try:
        pickle.dumps(fn)
    except Exception as e:                                # noqa: BLE001 - the reason, in one line
        raise ValueError(f"target {name}: each rank imports it by name in a new process, so it must be "
                         f"defined at the top level of a module (pickling it failed: {e})") from None
    return name, fn, fn


def _seconds(timeout):
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < math.inf:
        raise ValueError(f"timeout must be a number of seconds >= 0 (0: no limit), got {timeout!r}")
    return float(timeout) or None


# ---------------------------------------------------------------------------
# The check

def check_ranks(fn, *, world_size=2, sharding=SHARDINGS, device="cpu", dtypes=None, tokens=None,
                causal="both", features=(), seed=0, timeout=DEFAULT_TIMEOUT, progress=False, world=None):
    """Hold a context-parallel kernel to the float64 reference of the whole sequence; a `Report`.

    ``fn``: a callable defined at a module's top level (each rank imports it by name),
    ``"module.path:callable"``, or a built-in (``rank_targets.BUILTINS``), called on each rank as
    ``fn(q, k, v, *, causal, scale, group, q_positions, k_positions)``.  ``sharding``: names
    among `SHARDINGS`; ``features``: among `RANK_FEATURES` (``lse``: fn returns (out, lse));
    ``timeout``: seconds per case and sharding (0 or None: no limit).  ``world_size`` above the
    usable CPUs (GPUs on CUDA) is refused before any work.  ``world``: an open `rank_world.World`
    of that size to run on (several checks can share one; it is left open unless a failing
    case had to stop it); by default the check starts its own and stops it at the end."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda': no CUDA device is available (torch.cuda.is_available() is False)")
    world_size = _world_size(world_size, device)
    shardings, names = _shardings(sharding), _dtypes(dtypes, device)
    if causal not in CAUSAL:
        raise ValueError(f"causal must be 'yes', 'no' or 'both', got {causal!r}")
    lengths, limit = _tokens(tokens, world_size), _seconds(timeout)
    name, sent, local = _target(fn, device)
    wanted = _features(features, local, name)
    cases = rank_cases(lengths, causal, wanted)
    times = dict.fromkeys(("start", "rank compute", "communication", "golden", "baseline", "judging"), 0.0)
    if world is not None and (world.world_size, world.device) != (world_size, device):
        raise ValueError(f"world: {world.world_size} ranks on {world.device}, the check asks for "
                         f"{world_size} on {device}")
    ranks = _Ranks(world_size, device, limit, times, world)
    start, rows = time.perf_counter(), []
    try:
        for dtype in names:
            for case in cases:
                if progress:
                    print(f"\r  check {name} on {world_size} ranks: {dtype} {case}".ljust(79), end="",
                          file=sys.stderr, flush=True)
                rows += _run_case(ranks, name, sent, case, dtype, device, shardings, wanted, seed, times)
    finally:
        ranks.close()
        if progress:
            print(file=sys.stderr)
    settings = {"device": device, "dtypes": names, "align": "top-left", "world_size": world_size,
                "sharding": shardings, "features": wanted, "factor": tol.CHECK_FACTOR,
                "floor_ulps": tol.CHECK_FLOOR_ULPS, "seconds_by_part": times, "rank_peak_bytes": ranks.peak_bytes}
    return Report(name, rows, time.perf_counter() - start, settings)


class _Ranks:
    """The world: the caller's, or one started on first use and after each failure."""

    def __init__(self, world_size, device, timeout, times, world=None):
        self.world_size, self.device, self.timeout, self.times = world_size, device, timeout, times
        self.world = self.borrowed = world
        self.peak_bytes = 0                              # the largest rank's peak resident memory

    def run(self, tasks):
        try:
            if self.world is None or self.world.closed:
                t0 = time.perf_counter()
                self.world = rank_world.World(self.world_size, self.device, max(60.0, self.timeout or 0))
                self.times["start"] += time.perf_counter() - t0
            return self.world.run(tasks, self.timeout)
        except BaseException:
            if self.world is not None:                   # ranks may be stuck: stop them all, now
                self.world.close(grace=0)
            self.world = None
            raise

    def close(self):
        if self.world is not None and self.world is not self.borrowed:
            self.world.close()
        self.world = None


def _tasks(sent, case, dtype, rounded, positions, wants_lse):
    q, k, v, dout = rounded
    take = lambda a, pos: np.ascontiguousarray(a[:, :, pos])
    extra = {} if case.get("window") is None else {"window": tuple(case.get("window"))}
    return [{"fn": sent, "dtype": dtype, "causal": case.causal, "scale": case.scale, "lse": wants_lse,
             "q": take(q, pos), "k": take(k, pos), "v": take(v, pos), "dout": take(dout, pos),
             "q_positions": pos, "k_positions": pos, "extra": extra} for pos in positions]


def _assemble(results, positions, gold, names):
    got = {n: np.zeros_like(gold[n]) for n in names}
    for res, pos in zip(results, positions):
        for n in names:
            got[n][:, :, pos] = res[n]
    return got


def _run_case(ranks, name, sent, case, dtype, device, shardings, wanted, seed, times):
    """The rows of one case in one dtype, for each sharding."""
    wants_lse = declared(wanted, "returns_lse")
    inputs = _inputs(case, seed, dtype)
    rounded = [inputs[n] for n in ("q", "k", "v", "dout")]
    opts = runner.reference_options(case, "top-left", inputs)
    names = ["out"] + (["lse"] if wants_lse else []) + ["dq", "dk", "dv"]
    t0 = time.perf_counter()
    gold = runner.golden(inputs, opts)
    full = dict(gold)                                        # lse -inf where a row sees no key, kept
    t1 = time.perf_counter()
    base = runner.baseline(inputs, opts, dtype, device)
    times["golden"] += t1 - t0
    times["baseline"] += time.perf_counter() - t1
    unjudged = ~np.isfinite(gold["lse"])                     # rows that see no key
    for part in (gold, base):
        if "lse" in part:
            part["lse"] = np.where(unjudged, 0.0, part["lse"])
    gold = {n: gold[n] for n in names}
    den = _denominators(gold)
    base_err = {n: runner.tensor_errors(_four(base[n]), _four(gold[n]), den[n])[0] for n in names}
    bounds = {n: tol.check_bound(dtype, base_err[n]) for n in names}
    rows = []
    for sharding in shardings:
        positions = shard_positions(case.tq, ranks.world_size, sharding)
        row = lambda n, **kw: Row(target=name, case=_label(case, ranks.world_size, sharding),
                                  dims={**case.as_dict(), "world_size": ranks.world_size, "sharding": sharding},
                                  dtype=dtype, device=device, tensor=n, baseline=base_err[n], bound=bounds[n], **kw)
        try:
            results = ranks.run(_tasks(sent, case, dtype, rounded, positions, wants_lse))
        except rank_world.RankFailure as f:
            why = f"rank {', '.join(map(str, f.ranks))} {f.reason}"
            rows += [row(n, error=math.inf, verdict="FAIL", note=why,
                         diagnosis=rank_diagnosis.Diagnosis("rank-failed", f"{n}: {why}")) for n in names]
            continue
        refused = [r["unsupported"] for r in results if "unsupported" in r]
        if refused:
            rows += [row(n, verdict="not supported", note=refused[0]) for n in names]
            continue
        times["rank compute"] += max(r["seconds"] - r["comm"] for r in results)
        times["communication"] += max(r["comm"] for r in results)
        ranks.peak_bytes = max([ranks.peak_bytes] + [r["peak_bytes"] for r in results])
        t0 = time.perf_counter()
        got = _assemble(results, positions, gold, names)
        if wants_lse:
            got["lse"] = np.where(unjudged, 0.0, got["lse"])
        evidence = lambda got: diagnose.Evidence(
            case, "top-left", dtype, device, wanted, inputs, opts, {n: _four(gold[n]) for n in names}, full, den,
            bounds, {n: _four(got[n]) for n in names}, got, None, None)
        rows += _judge(row, got, gold, den, bounds, names, rounded, case, positions, sharding, evidence)
        times["judging"] += time.perf_counter() - t0
    return rows


def _judge(row, got, gold, den, bounds, names, rounded, case, positions, sharding, evidence=None):
    owner = rank_diagnosis.owners(positions)
    rows, failing = {}, []
    for n in names:
        err, where = runner.tensor_errors(_four(got[n]), _four(gold[n]), den[n])[:2]
        ok = err <= bounds[n]
        rows[n] = row(n, error=err, verdict="pass" if ok else "FAIL", where=where,
                      note="" if ok or where is None else f"rank {owner[where[2]]}")
        if not ok:
            failing.append(n)
    if failing:
        found = rank_diagnosis.diagnose(failing, got, gold, den, bounds, rounded, case, positions, sharding,
                                        evidence)
        for n, d in found.items():
            rows[n].diagnosis = d
    return [rows[n] for n in names]
