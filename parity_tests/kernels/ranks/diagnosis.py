"""Name the mistake behind a tensor that fails across ranks.

First *where*: the rank that owns the worst row (a query row for out, lse and dq, a
key row for dk and dv), the chunk of the sharding it sits in (the key range, for dk and
dv), and the worst error on each rank.

Then *what*: the mistakes sharding invites, each recomputed from the same rounded
inputs in float64 (`simulate`: the ring written densely in PyTorch, block by block as
the ranks see them, gradients by autograd), with one thing changed:

- ``contiguous-mask``: causal blocks skipped as if the shards were contiguous -- the
  mask taken from each row's place in rank order instead of its global position (under
  head-tail sharding, rank 0's second chunk is the *end* of the sequence);
- ``no-lse-merge``: each partial normalised on its own and the partials added with
  equal weights (a constant per row, fitted: their sum or their mean), no lse merge;
- ``lse-base-2``: the merge weights and the merged lse computed with ``exp2``/``log2``
  on a natural-log lse;
- ``dkdv-not-reduced``: dk and dv not reduced back to the rank that owns the keys --
  each rank keeps only the share of its own queries;
- ``block-local-mask``: the blocks of other ranks that the causal mask does not hide whole
  given the own diagonal block's mask, block-local (row i of the shard sees the block's keys 0
  .. i), as a ring that passes ``causal`` to every step does (``causal and step == 0`` is meant);
- ``own-block-lse``: each block's backward given that block's own lse where the merged one
  is meant (`_own_block_lse_backward`): its P normalised within the block, D from the merged out.

Each hypothesis predicts the error's size and where it sits.  It is named only when
both match: the tensor is within its bound of the prediction (or within
``diagnosis.MATCH_SHARE`` of its own error), the predicted error is within a factor 2
of the tensor's, and the ranks whose rows fail are the ones the prediction fails.  A
hypothesis that predicts no failure of the tensor is not claimed, and the closest one is said
only where it leaves at most ``diagnosis.CLOSEST_SHARE`` of the error, within
``diagnosis.CLOSEST_WITHIN`` bounds (a guess as far from the tensor as the reference is says nothing).
"""

import os
from types import SimpleNamespace

import numpy as np
import torch

from parity_tests.kernels import runner
from parity_tests.kernels.dense import sees
from parity_tests.kernels.diagnosis.diagnose import CLOSEST_SHARE, CLOSEST_WITHIN, Diagnosis, _catalogue, explains
from parity_tests.kernels.merge import plain_merge

__all__ = ["owners", "chunks", "simulate", "diagnose", "HYPOTHESES", "DENSE_LIMIT"]

# Dense float64 recomputation: at most this many (query, key) pairs over the batch and heads.
DENSE_LIMIT = 2 ** 25

HYPOTHESES = (
    ("contiguous-mask", "causal blocks skipped as if the shards were contiguous (mask from rank order, "
                        "not global positions)", dict(mask="rank-order")),
    ("no-lse-merge", "each rank normalised its partials alone (no lse merge)", dict(merge="equal")),
    ("lse-base-2", "lse merged in base 2", dict(merge="base2")),
    ("dkdv-not-reduced", "dk/dv not reduced back to the rank that owns the keys", dict(reduce=False)),
    ("block-local-mask", "the blocks of other ranks masked as the own diagonal block (shard row i sees the "
                         "block's keys 0 .. i: causal passed to every step where the own block alone needs it)",
     dict(mask="block-local")),
)
# ... and the one of the backward alone, written out (`_own_block_lse_backward`)
OWN_BLOCK_LSE = ("own-block-lse", "each block's backward given its own block's lse where the merged one is meant "
                                  "(P normalised within the block; D from the merged out)")


def owners(positions):
    """owner[i] = the rank holding global row i."""
    owner = np.empty(sum(len(p) for p in positions), dtype=np.int64)
    for r, pos in enumerate(positions):
        owner[pos] = r
    return owner


def chunks(positions):
    """The contiguous runs of rows, in sequence order: [(start, stop, rank)]."""
    runs = []
    for r, pos in enumerate(positions):
        breaks = np.flatnonzero(np.diff(pos) != 1) + 1
        runs += [(int(p[0]), int(p[-1]) + 1, r) for p in np.split(pos, breaks) if len(p)]
    return sorted(runs)


def _rank_order(positions):
    """Each row's place when the shards are laid end to end in rank order."""
    out, at = [], 0
    for pos in positions:
        out.append(np.arange(at, at + len(pos), dtype=np.int64))
        at += len(pos)
    return out


# ---------------------------------------------------------------------------
# The ring, densely, in float64

def _visible(qpos, kpos, causal, window):
    """(len(qpos), len(kpos)) bool at the tokens' global positions (a ring's shards hold
    positions, not rows: the one rule, `dense.sees`, with offset 0)."""
    return sees(torch.from_numpy(qpos)[:, None], torch.from_numpy(kpos)[None, :], causal=causal, window=window)


def _partial(q, k, v, seen, scale):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    S = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~seen, -torch.inf)
    m = S.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(S - m)
    l = e.sum(-1)
    l_safe = torch.where(l > 0, l, torch.ones_like(l))
    lse = torch.where(l > 0, m[..., 0] + torch.log(l_safe), torch.full_like(l, -torch.inf))
    return (e @ v) / l_safe[..., None], lse


def _combine(partials, merge, weights):
    if merge == "sum":
        return sum(o for o, _ in partials), None
    state = partials[0]
    for p in partials[1:]:
        state = plain_merge(*state, *p, base2=merge == "base2")
    if merge == "equal":
        return weights[..., None] * sum(o for o, _ in partials), state[1]
    return state


def _block_mask(seen_at, r, s, case, mask):
    """Which keys of block s the query rows of shard r see: at their positions ``seen_at``, or
    (``mask="block-local"``) a block of another rank that the mask does not hide whole seen as the
    own diagonal block is, row i of the shard seeing the block's keys 0 .. i."""
    seen = _visible(seen_at[r], seen_at[s], case.causal, case.get("window"))
    if mask != "block-local" or s == r or not seen.any():
        return seen
    local = lambda pos: np.arange(len(pos), dtype=np.int64)
    return _visible(local(seen_at[r]), local(seen_at[s]), case.causal, case.get("window"))


def simulate(rounded, case, positions, *, mask="global", merge="lse", reduce=True, weights=None):
    """out, lse, dq, dk, dv (float64 arrays, global order) of the ring with one thing changed:
    ``mask`` "rank-order" or "block-local"; ``merge`` "base2", "equal" (``weights``: (B, H, T),
    a constant per row) or "sum" (forward only); ``reduce=False``.  Its own loop, not the golden's tiles:
    its blocks are the ranks' shards in the sharding's order, and autograd through each
    partial carries a wrong mask, merge or reduction into the gradients as the ring would."""
    q, k, v, dout = (torch.from_numpy(np.asarray(a, dtype=np.float64)) for a in rounded)
    n = len(positions)
    seen_at = _rank_order(positions) if mask == "rank-order" else positions
    q_leaf = q.clone().requires_grad_(True)
    k_leaves = [k.clone().requires_grad_(True) for _ in range(n)]      # rank r's copy of every block
    v_leaves = [v.clone().requires_grad_(True) for _ in range(n)]
    out, lse = torch.zeros_like(dout), torch.zeros(dout.shape[:-1], dtype=dout.dtype)
    loss = 0.0
    with torch.set_grad_enabled(merge != "sum"):
        for r, pos in enumerate(positions):
            idx = torch.from_numpy(pos)
            blocks = [(r - step) % n for step in range(n)]
            partials = [_partial(q_leaf[:, :, idx], k_leaves[r][:, :, positions[s]], v_leaves[r][:, :, positions[s]],
                                 _block_mask(seen_at, r, s, case, mask), case.scale) for s in blocks]
            w = None if weights is None else torch.from_numpy(weights[:, :, pos])
            o, l = _combine(partials, merge, w)
            out[:, :, idx] = o.detach()
            if l is not None:
                lse[:, :, idx] = l.detach()
            loss = loss + (o * dout[:, :, idx]).sum()
    result = {"out": out.numpy(), "lse": lse.numpy()}
    if merge == "sum":
        return result
    loss.backward()
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for s, pos in enumerate(positions):
        if reduce:
            dk, dv = dk + k_leaves[s].grad, dv + v_leaves[s].grad
        else:
            dk[:, :, pos], dv[:, :, pos] = k_leaves[s].grad[:, :, pos], v_leaves[s].grad[:, :, pos]
    return {**result, "dq": q_leaf.grad.numpy(), "dk": dk.numpy(), "dv": dv.numpy()}


def _own_block_lse_backward(rounded, case, positions, out):
    """dq, dk, dv (float64, global order) of a ring whose block backward recomputes P from the
    block's own lse (ring-flash-attention hands it the merged one): for each query shard r and
    key block s, P = exp(S − lse_s) with lse_s = logsumexp over the block's visible keys alone,
    D = rowsum(dO ∘ O) of the merged ``out``, dS = P ∘ (dO V_sᵀ − D); dq += scale dS K_s,
    dk_s += scale dSᵀ Q_r, dv_s += Pᵀ dO_r.  Each block's share is the right one divided by the
    block's share w_s = exp(lse_s − lse) of the row's softmax mass: a row whose visible keys lie
    in one block is exact, and out and lse are."""
    q, k, v, dout = (torch.from_numpy(np.asarray(a, dtype=np.float64)) for a in rounded)
    group = q.shape[1] // k.shape[1]
    K, V = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    D = (dout * torch.from_numpy(out)).sum(-1, keepdim=True)
    dq, dK, dV = torch.zeros_like(q), torch.zeros_like(K), torch.zeros_like(V)
    for pos in positions:
        i = torch.from_numpy(pos)
        for keys in positions:
            j = torch.from_numpy(keys)
            S = (q[:, :, i] @ K[:, :, j].transpose(-1, -2) * case.scale).masked_fill(
                ~_visible(pos, keys, case.causal, case.get("window")), -torch.inf)
            lse = torch.logsumexp(S, -1, keepdim=True)
            P = torch.exp(S - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))   # 0 where none seen
            dS = P * (dout[:, :, i] @ V[:, :, j].transpose(-1, -2) - D[:, :, i])
            dq[:, :, i] += case.scale * dS @ K[:, :, j]
            dK[:, :, j] += case.scale * dS.transpose(-1, -2) @ q[:, :, i]
            dV[:, :, j] += P.transpose(-1, -2) @ dout[:, :, i]
    per_kv = lambda x: x.reshape(x.shape[0], -1, group, *x.shape[2:]).sum(2)
    return {"dq": dq.numpy(), "dk": per_kv(dK).numpy(), "dv": per_kv(dV).numpy()}


def _equal_weights(got_out, rounded, case, positions):
    """The constant per row that best fits the kernel's out to the plain sum of its partials."""
    total = simulate(rounded, case, positions, merge="sum")["out"]
    num, den = (got_out * total).sum(-1), (total * total).sum(-1)
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), 1.0)


# ---------------------------------------------------------------------------
# Where, and what

def _four(a):
    return a[..., None] if a.ndim == 3 else a


def locate(n, a, ref, denom, positions):
    """One sentence: the rank, row and chunk of the worst error, and each rank's worst."""
    diff = np.abs(_four(a) - _four(ref)) / denom
    diff = np.where(np.isfinite(diff), diff, np.inf)
    per_rank = [float(diff[:, :, pos].max(initial=0.0)) for pos in positions]
    b, h, i, _ = np.unravel_index(int(np.argmax(diff)), diff.shape)
    start, stop, rank = next(c for c in chunks(positions) if c[0] <= i < c[1])
    kind = "key" if n in ("dk", "dv") else "query"
    ranks = ", ".join(f"rank {r} {e:.1e}" for r, e in enumerate(per_rank))
    return int(rank), (f"worst at rank {rank}, {kind} row {i} (batch {b}, head {h}; in its chunk of rows "
                       f"{start}..{stop - 1}); by rank: {ranks}")


def diagnose(failing, got, gold, den, bounds, rounded, case, positions, sharding, evidence=None):
    """``{tensor: Diagnosis}`` for each failing tensor; ``evidence(got)``, where given, the
    `diagnose.Evidence` of the tensors as one kernel's (`_read_as_one_kernel`)."""
    owner = owners(positions)
    found = {}
    for n in failing:
        rank, where = locate(n, got[n], gold[n], den[n], positions)
        bad = ~np.isfinite(got[n])
        if bad.any():
            rows = sorted({int(owner[i]) for i in np.nonzero(bad)[2]})
            found[n] = Diagnosis("non-finite", f"{n} has {int(bad.sum())} non-finite entries, on rank "
                                 f"{', '.join(map(str, rows))}; {where}")
            continue
        if case.batch * case.heads * case.tq * case.tk > DENSE_LIMIT:
            found[n] = Diagnosis("not-diagnosed", f"{where}; too large to recompute the sharding mistakes "
                                 f"(more than {DENSE_LIMIT} query-key pairs)")
    todo = [n for n in failing if n not in found]
    if not todo:
        return found
    predictions = _predictions(got, rounded, case, positions)
    for n in todo:
        found[n] = _best(n, got[n], gold[n], den[n], bounds[n], predictions, owner, positions, case)
    unnamed = [n for n in todo if found[n].id == "none"]
    if unnamed and evidence is not None:
        for n, d in _read_as_one_kernel(unnamed, failing, evidence(got)).items():
            if d.id not in ("none", "not-diagnosed"):
                found[n] = Diagnosis(d.id, f"{found[n].sentence}; read as one kernel over the whole sequence "
                                           f"(the ranks' rows in their global order): {d.sentence}",
                                     d.residual, d.bound)
    return found


def _read_as_one_kernel(names, failing, ev):
    """The single-device catalogue and readings (`diagnose._catalogue`) on the ranks' tensors put
    back in global order, as if one kernel had computed them: what no sharding mistake names
    may still be a mask, a key range or a backward term read there.  Nothing that calls the
    kernel again (a world of ranks) is tried."""
    rows = {n: SimpleNamespace(passed=n not in failing) for n in ev.arrays}     # all the catalogue asks of a row
    try:
        return _catalogue(names, rows, ev)
    except Exception:                     # the check's own defect: the sharding's reading stands
        if os.environ.get(runner.DIAGNOSIS_RAISES) == "1":
            raise
        return {}


def _predictions(got, rounded, case, positions):
    out = {}
    for hid, title, knobs in HYPOTHESES:
        if knobs.get("mask") and not (case.causal or case.get("window") is not None):
            continue                                   # nothing is masked: the mask cannot be wrong
        if knobs.get("merge") == "equal":
            knobs = dict(knobs, weights=_equal_weights(got["out"], rounded, case, positions))
        pred = simulate(rounded, case, positions, **knobs)
        pred["lse"] = np.where(np.isfinite(pred["lse"]), pred["lse"], 0.0)
        out[hid] = (title, pred)
    right = simulate(rounded, case, positions)
    right["lse"] = np.where(np.isfinite(right["lse"]), right["lse"], 0.0)
    hid, title = OWN_BLOCK_LSE
    out[hid] = (title, {**right, **_own_block_lse_backward(rounded, case, positions, right["out"])})
    return out


def mask_differences(case, positions):
    """Which query rows see which key ranges wrongly when the mask follows rank order."""
    runs, pseudo = chunks(positions), np.concatenate(_rank_order(positions))
    place = np.empty_like(pseudo)
    place[np.concatenate(positions)] = pseudo                        # global row -> rank-order place
    wrong = []
    for a0, a1, _ in runs:
        for b0, b1, _ in runs:
            i, j = np.arange(a0, a1), np.arange(b0, b1)
            right = _visible(i, j, case.causal, case.get("window"))
            taken = _visible(place[i], place[j], case.causal, case.get("window"))
            if bool((right & ~taken).any()):
                wrong.append(f"queries {a0}..{a1 - 1} skip keys {b0}..{b1 - 1}")
            if bool((taken & ~right).any()):
                wrong.append(f"queries {a0}..{a1 - 1} see future keys {b0}..{b1 - 1}")
    return ", ".join(wrong)


def _failing_ranks(a, ref, denom, bound, positions):
    """The ranks whose rows hold an error above the bound."""
    diff = np.abs(_four(a) - _four(ref)) / denom
    return {r for r, pos in enumerate(positions) if diff[:, :, pos].max(initial=0.0) > bound}


def _times_constant(n, a, ref, denom, bound, world_size):
    """(words, residual) where ``a`` is the reference times one factor c ≠ 1 (fitted by least squares)
    within the bound, c named where it is the world size or its inverse; else None."""
    a4, r4 = _four(a), _four(ref)
    c = float((a4 * r4).sum() / max((r4 * r4).sum(), 1e-300))
    residual = runner.tensor_errors(a4, c * r4, denom)[0]
    if residual > bound or abs(c - 1) <= 1e-3:
        return None
    why = {world_size: f" (the world size, {world_size}: a sum over the ranks taken where one rank's share is meant)",
           1 / world_size: f" (1 / the world size, {world_size}: a gradient averaged over the ranks where it is "
                           "summed)"}
    said = next((w for f, w in why.items() if abs(c - f) <= 1e-3 * f), "")
    return f"Matches the reference times {c:.4g}{said} (to {residual:.1e}, bound {bound:.1e})", residual


def _best(n, a, ref, denom, bound, predictions, owner, positions, case):
    err = runner.tensor_errors(_four(a), _four(ref), denom)[0]
    _, where = locate(n, a, ref, denom, positions)
    failing = _failing_ranks(a, ref, denom, bound, positions)
    best, closest = None, None
    for hid, (title, pred) in predictions.items():
        pred_err, pred_where = runner.tensor_errors(_four(pred[n]), _four(ref), denom)[:2]
        if pred_err <= bound:
            continue                                   # it predicts no failure of this tensor
        residual = runner.tensor_errors(_four(a), _four(pred[n]), denom)[0]
        same_place = _failing_ranks(pred[n], ref, denom, bound, positions) == failing
        same_size = 0.5 <= pred_err / err <= 2.0
        entry = (residual, hid, title, pred_err, pred_where)
        if explains(residual, err, bound) and same_place and same_size:
            best = min(best, entry) if best else entry
        elif closest is None or residual < closest[0]:
            closest = entry
    if best:
        residual, hid, title, pred_err, (_, _, pi) = best
        keys = f"; {mask_differences(case, positions)}" if hid == "contiguous-mask" else ""
        return Diagnosis(hid, f"{n}: {where}. Matches '{title}' (to {residual:.1e}, bound {bound:.1e}), "
                              f"which predicts {pred_err:.1e} on rank {', '.join(map(str, sorted(failing)))} "
                              f"(worst at rank {owner[pi]}, row {pi}){keys}", residual, bound)
    scaled = _times_constant(n, a, ref, denom, bound, len(positions))
    if scaled is not None:
        return Diagnosis("constant-factor", f"{n}: {where}. {scaled[0]}", scaled[1], bound)
    text = f"{n}: {where}. Matches none of the sharding mistakes"
    if closest and closest[0] <= min(CLOSEST_SHARE * err, CLOSEST_WITHIN * bound):
        text += f" (closest: '{closest[2]}', {closest[0]:.1e} away against {err:.1e} from the reference)"
    return Diagnosis("none", text, closest[0] if closest else float("nan"), bound)
