"""N processes on ``torch.distributed``, started and stopped by the check itself (no torchrun).

`World` is the parent's handle on them:

- the parent opens a ``TCPStore`` server on 127.0.0.1 with port 0, so the system
  hands out a free port (no race between choosing a port and binding it) and nothing
  listens beyond this machine; each rank joins it as a client;
- it starts the N ranks with ``torch.multiprocessing``'s *spawn* context, each with a
  pipe of its own (tasks in, results out: NumPy arrays, so no tensor travels through
  shared memory) and a slot of a shared array saying what it is doing (`STATES`);
- each rank runs ``init_process_group`` (``gloo`` on CPU, ``nccl`` with one GPU per
  rank on CUDA), says it is ready, then runs one task per case (`run_task`);
- `World.run` waits for every rank's result, the pipes and the processes' sentinels
  together, within the case's time limit.  A rank that raises, exits or does not
  finish raises `RankFailure` with its number and why; the caller then closes the
  world at once (the others may be blocked in a collective that will never complete)
  and starts a fresh one for the next case;
- `World.close` asks each rank to leave, then terminates and kills what remains,
  and closes the store: no process, port or file is left.  (The one process that may
  outlive it is Python's own ``multiprocessing`` resource tracker, which every spawn
  starts once per interpreter.)

Communication "as observed": each rank wraps the blocking collectives of
``torch.distributed`` (`COLLECTIVES`) and adds up the seconds spent inside them,
waiting for the slower rank included.  An asynchronous operation counts only its
launch; the wait on its handle is not seen.
"""

import datetime
import os
import time
import traceback
from multiprocessing.connection import wait

import torch

__all__ = ["World", "RankFailure", "run_task", "usable_devices"]

STATES = {0: "starting", 1: "idle", 2: "in its own code", 3: "in a collective", 4: "done"}
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "send", "recv",
               "barrier", "gather", "scatter", "batch_isend_irecv")


class RankFailure(Exception):
    """A rank raised, exited or did not finish: ``ranks`` (their numbers) and ``reason``."""

    def __init__(self, ranks, reason):
        super().__init__(reason)
        self.ranks, self.reason = list(ranks), reason


def usable_devices(device):
    """How many ranks ``device`` can hold: CPUs this process may run on, or GPUs."""
    if device == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                               # not Linux
        return os.cpu_count() or 1


class World:
    """``world_size`` ranks on ``device``; ``start_timeout`` seconds to come up."""

    def __init__(self, world_size, device="cpu", start_timeout=120.0):
        import torch.distributed as dist
        import torch.multiprocessing as tmp
        self.world_size, self.device = world_size, device
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=start_timeout))
        ctx = tmp.get_context("spawn")
        self.states = ctx.RawArray("i", world_size)      # no lock: one writer per slot
        self.conns, self.procs = [], []
        threads = max(1, usable_devices("cpu") // world_size)
        try:
            for rank in range(world_size):
                mine, theirs = ctx.Pipe()
                p = ctx.Process(target=_rank_main, daemon=True, name=f"parity-rank-{rank}",
                                args=(rank, world_size, self.store.port, device, theirs, self.states,
                                      threads, start_timeout))
                p.start()
                theirs.close()
                self.conns.append(mine)
                self.procs.append(p)
            self._collect(["ready"] * world_size, start_timeout, "start")
        except BaseException:
            self.close(grace=0)
            raise

    def run(self, tasks, timeout):
        """Send rank r ``tasks[r]``; its result dicts in rank order, or `RankFailure`."""
        for rank, (conn, task) in enumerate(zip(self.conns, tasks)):
            try:
                conn.send(task)
            except (BrokenPipeError, ConnectionResetError, EOFError):
                raise RankFailure([rank], f"exited before its task ({self._exit(rank)})") from None
        return self._collect([None] * self.world_size, timeout, "case")

    def _collect(self, expected, timeout, stage):
        results, pending = [None] * self.world_size, set(range(self.world_size))
        deadline = None if not timeout else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            watched = {self.conns[r]: r for r in pending}
            watched.update({self.procs[r].sentinel: r for r in pending})
            ready = wait(list(watched), left)
            if not ready:
                raise RankFailure(*self._timed_out(sorted(pending), timeout, stage))
            for obj in ready:
                rank = watched[obj]
                if rank not in pending:
                    continue
                message = self._message(rank)
                kind, body = message
                if kind != "ok":
                    raise RankFailure([rank], body)
                if expected[rank] is not None and body != expected[rank]:
                    raise RankFailure([rank], f"sent {body!r} instead of {expected[rank]!r}")
                results[rank] = body
                pending.discard(rank)
        return results

    def _message(self, rank):
        """The rank's next message, or ("failed", why) when it has exited."""
        conn = self.conns[rank]
        try:
            if conn.poll():
                return conn.recv()
        except (EOFError, OSError):
            pass
        self.procs[rank].join(1.0)
        return "failed", f"exited ({self._exit(rank)}) without a result"

    def _exit(self, rank):
        code = self.procs[rank].exitcode
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def _timed_out(self, pending, timeout, stage):
        """(the ranks to blame, why): those still in their own code when some wait in a collective."""
        own = [r for r in pending if self.states[r] == 2]
        waiting = [r for r in pending if self.states[r] == 3]
        what = "to start" if stage == "start" else "to finish the case"
        names = lambda ranks: ", ".join(map(str, ranks))
        if own and waiting:
            return own, (f"timed out after {timeout:g} s, still in its own code (rank {names(waiting)} "
                         "waiting in a collective that never completes)")
        where = "; ".join(f"rank {r} {STATES.get(self.states[r], '?')}" for r in pending)
        return pending, f"timed out after {timeout:g} s waiting {what} ({where})"

    @property
    def closed(self):
        return not self.procs

    def close(self, grace=2.0):
        """Ask every rank to leave, and wait ``grace`` seconds; terminate, then kill, what has
        not; close the store.  After a failure the ranks may be stuck (in their own code, or
        in a collective that will never complete): ``grace=0`` stops them at once."""
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, EOFError, ValueError):
                pass
        deadline = time.monotonic() + grace
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self.conns:
            conn.close()
        for p in self.procs:
            p.close()
        self.conns, self.procs = [], []
        self.store = None                                # the server stops with its object

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------
# The rank's side (runs in the spawned process)

def _rank_main(rank, world_size, port, device, conn, states, threads, start_timeout):
    import torch.distributed as dist
    states[rank] = 0
    torch.set_num_threads(threads)
    if device == "cpu":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # gloo's own sockets on loopback
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=datetime.timedelta(seconds=start_timeout))
        kw = {}
        if device == "cuda":
            torch.cuda.set_device(rank)
            kw["device_id"] = torch.device("cuda", rank)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world_size, **kw)
    except BaseException as e:                          # noqa: BLE001 - said to the parent
        conn.send(("failed", f"could not join the process group: {_reason(e)}"))
        return
    timer = _time_collectives(dist, states, rank)
    states[rank] = 1
    conn.send(("ok", "ready"))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            break
        if task is None:
            break
        timer["seconds"] = 0.0
        try:
            result = run_task(task, rank, dist.group.WORLD, device, states, timer)
            message = ("ok", result)
        except BaseException as e:                      # noqa: BLE001 - sys.exit included
            message = ("failed", _reason(e))
            if type(e).__name__ == "Unsupported":       # targets.Unsupported: a declared refusal
                message = ("ok", {"unsupported": str(e)})
        states[rank] = 1
        conn.send(message)
    states[rank] = 4
    dist.destroy_process_group()


def _reason(e):
    if isinstance(e, SystemExit):
        return f"called sys.exit({e.code!r})"
    if isinstance(e, WrongResult):
        return str(e)
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    frames = traceback.extract_tb(e.__traceback__)
    at = f" ({os.path.basename(frames[-1].filename)}, line {frames[-1].lineno})" if frames else ""
    return f"raised {type(e).__name__}: {text}"[:200].rstrip(": ") + at


def _time_collectives(dist, states, rank):
    """Wrap the blocking collectives: their seconds added up in ``timer["seconds"]``."""
    timer = {"seconds": 0.0}

    def timed(f):
        def inner(*args, **kwargs):
            before, states[rank] = states[rank], 3
            start = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                timer["seconds"] += time.perf_counter() - start
                states[rank] = before
        inner.__wrapped__ = f
        return inner
    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, timed(getattr(dist, name)))
    return timer


class WrongResult(Exception):
    """The rank's answer is wrong in kind (type, shape, dtype, device, no gradient)."""


def _target(fn):
    if isinstance(fn, str) and ":" in fn:                # a file's path.py:callable, loaded here again
        from parity_tests.kernels import targets
        return targets.resolve(fn).fn
    if isinstance(fn, str):                              # a built-in, by name
        from parity_tests.kernels.ranks import builtin as rank_targets
        return rank_targets.builtin(fn)
    return fn


def run_task(task, rank, group, device, states, timer):
    """One case on one rank: call the target on its shard, backpropagate its shard of dO;
    ``{"out", "lse", "dq", "dk", "dv", "seconds", "comm"}`` (float64 NumPy arrays)."""
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    dtype = getattr(torch, task["dtype"])
    fn = _target(task["fn"])
    leaf = lambda a: torch.from_numpy(a).to(device=dev, dtype=dtype).requires_grad_(True)
    q, k, v = leaf(task["q"]), leaf(task["k"]), leaf(task["v"])
    pos = lambda a: torch.from_numpy(a).to(dev)
    kwargs = dict(causal=task["causal"], scale=task["scale"], group=group,
                  q_positions=pos(task["q_positions"]), k_positions=pos(task["k_positions"]),
                  **task["extra"])
    start = time.perf_counter()
    states[rank] = 2
    result = fn(q, k, v, **kwargs)
    out, lse = _split(result, task["lse"])
    _expect(out, "output", q.shape[:-1] + (v.shape[-1],), dtype, dev)
    if lse is not None:
        _expect(lse, "lse", q.shape[:-1], None, dev)
    if not out.requires_grad:
        raise WrongResult("the output does not require grad (detached, or computed without autograd)")
    out.backward(torch.from_numpy(task["dout"]).to(device=dev, dtype=out.dtype))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - start
    got = {"out": out, "lse": lse}
    for n, t in (("dq", q), ("dk", k), ("dv", v)):
        if t.grad is None:
            raise WrongResult(f"no gradient reached {n[1]}")
        _expect(t.grad, n, t.shape, dtype, dev)
        got[n] = t.grad
    arrays = {n: None if t is None else t.detach().to("cpu", torch.float64).numpy() for n, t in got.items()}
    return {**arrays, "seconds": seconds, "comm": timer["seconds"], "peak_bytes": _peak_bytes()}


def _peak_bytes():
    """This process's peak resident memory so far (Linux reports KiB), or 0 where unknown."""
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except (ImportError, OSError):
        return 0


def _split(result, wants_lse):
    if wants_lse:
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise WrongResult(f"with lse the target must return (out, lse), got {type(result).__name__}")
        return result
    if not isinstance(result, torch.Tensor):
        raise WrongResult(f"returned {type(result).__name__}, expected a tensor")
    return result, None


def _expect(t, what, shape, dtype, dev):
    if not isinstance(t, torch.Tensor):
        raise WrongResult(f"{what} is a {type(t).__name__}, expected a tensor")
    name = lambda x: str(x).replace("torch.", "")
    problems = [f"wrong {kind}: {what} {name(got)}, expected {name(want)}" for kind, got, want in (
        ("shape", tuple(t.shape), tuple(shape)), ("dtype", t.dtype, dtype or t.dtype),
        ("device", t.device.type, dev.type)) if got != want]
    if problems:
        raise WrongResult("; ".join(problems))

