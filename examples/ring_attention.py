"""Ring attention, written plainly on ``torch.distributed``: the sequence is split across
ranks, and each rank attends its own queries to every rank's keys, one block at a time.

    python -m parity_tests check examples.ring_attention:attention --world-size 2

Each rank holds q, k, v ``(B, H, T_rank, D)`` for the rows at ``q_positions`` /
``k_positions`` (global indices: with head-tail sharding a rank's rows are not one
contiguous range).  Then:

1. `gather_blocks`: every rank's k, v and key positions, in ring order (own block first,
   then rank - 1, rank - 2, ...).  Shards may differ in length by a row (T = 67 on 2
   ranks), so each is padded to the longest, its padding marked with position -1.
   The gather is an autograd Function: its backward sums every rank's gradient of
   each block (``all_reduce``) and keeps the rank's own block, so dk and dv reach the
   rank that owns the keys.
2. For each block, `partial_attention`: the softmax over the keys of that block that
   the query sees (`visible`: causal ``k_pos <= q_pos`` from the *global* positions,
   the window, the padding), giving a partial output and its log-sum-exp; a row that
   sees nothing there has lse ``-inf`` and output 0.
3. `merge_states`, the online-softmax merge of two partials: with
   ``lse = logaddexp(lse_a, lse_b)``, ``out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b``.

Gradients come from autograd through all three.  Scores and merges run in float32 for
bfloat16/float16 inputs (as fused kernels do); the output is cast back.

`attention` returns the output; `attention_lse` returns ``(out, lse)`` (``--features lse``).
Keys beyond the required ones: ``window=(left, right)`` (``--features window``);
k and v may have fewer heads than q (``--features gqa``).
"""

import torch
import torch.distributed as dist

__all__ = ["attention", "attention_lse", "ring", "gather_blocks", "visible", "partial_attention",
           "merge_states"]


def attention(q, k, v, *, causal, scale, group, q_positions, k_positions, window=None):
    """This rank's shard of the output, (B, H, T_rank, Dv)."""
    out, _ = ring(q, k, v, causal=causal, scale=scale, group=group, q_positions=q_positions,
                  k_positions=k_positions, window=window)
    return out


def attention_lse(q, k, v, *, causal, scale, group, q_positions, k_positions, window=None):
    """``(out, lse)``: lse (B, H, T_rank), natural log, float32."""
    return ring(q, k, v, causal=causal, scale=scale, group=group, q_positions=q_positions,
                k_positions=k_positions, window=window)


def ring(q, k, v, *, causal, scale, group, q_positions, k_positions, window=None,
         gather=None, merge=None):
    """The whole computation; ``gather`` and ``merge`` replace `gather_blocks` and `merge_states`."""
    gather, merge = gather or gather_blocks, merge or merge_states
    work = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
    out = lse = None
    for k_s, v_s, pos_s in gather(k.to(work), v.to(work), k_positions, group):
        seen = visible(q_positions, pos_s, causal, window)             # (T_rank, T_block)
        o, l = partial_attention(q.to(work), k_s, v_s, seen, scale)
        out, lse = (o, l) if out is None else merge(out, lse, o, l)
    return out.to(q.dtype), lse


class _Gather(torch.autograd.Function):
    """(T_max, ...) on each rank -> (world, T_max, ...); backward: the summed gradient of own block."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)           # each block's gradient from every rank
        return grad[dist.get_rank(ctx.group)], None


def _pad(x, length, dim, value=0):
    extra = length - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def gather_blocks(k, v, k_positions, group, autograd_gather=_Gather.apply):
    """Every rank's (k, v, key positions), own block first, then rank - 1, rank - 2, ..."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    lengths = [torch.zeros(1, dtype=torch.int64, device=k.device) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([k.shape[2]], device=k.device), group=group)
    longest = int(max(n.item() for n in lengths))
    positions = [torch.empty(longest, dtype=torch.int64, device=k.device) for _ in range(world)]
    dist.all_gather(positions, _pad(k_positions.to(torch.int64), longest, 0, -1), group=group)
    ks = autograd_gather(_pad(k, longest, 2), group)                  # (world, B, Hkv, T_max, D)
    vs = autograd_gather(_pad(v, longest, 2), group)
    order = [(rank - step) % world for step in range(world)]
    return [(ks[s], vs[s], positions[s]) for s in order]


def visible(q_positions, k_positions, causal, window=None):
    """(Tq, Tk) bool: query at global position i sees key j (padding keys: position -1)."""
    i, j = q_positions[:, None], k_positions[None, :]
    seen = j >= 0
    if causal:
        seen = seen & (j <= i)
    if window is not None:
        left, right = window
        if left >= 0:
            seen = seen & (j >= i - left)
        if right >= 0 and not causal:
            seen = seen & (j <= i + right)
    return seen


def partial_attention(q, k, v, seen, scale):
    """Softmax attention over the keys ``seen`` allows -> (out, lse); lse -inf, out 0 where
    a row sees none.  k, v may have fewer heads than q (query head h reads h // (Hq / Hkv))."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    S = (q @ k.transpose(-1, -2)) * scale                              # (B, H, Tq, Tk)
    S = S.masked_fill(~seen, -torch.inf)
    m = S.amax(-1, keepdim=True).detach()                              # cancels: no gradient needed
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(S - m)                                               # 0 where unseen
    l = e.sum(-1)                                                      # ℓ
    any_seen = l > 0
    l_safe = torch.where(any_seen, l, torch.ones_like(l))
    out = (e @ v) / l_safe[..., None]
    lse = torch.where(any_seen, m[..., 0] + torch.log(l_safe), torch.full_like(l, -torch.inf))
    return out, lse


def merge_states(out_a, lse_a, out_b, lse_b):
    """The online-softmax merge of two partials over disjoint keys (either may be empty)."""
    m = torch.maximum(lse_a, lse_b).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)              # 0 for an empty side
    total = w_a + w_b
    seen = total > 0
    total = torch.where(seen, total, torch.ones_like(total))
    lse = torch.where(seen, m + torch.log(total), torch.full_like(total, -torch.inf))
    out = (w_a / total)[..., None] * out_a + (w_b / total)[..., None] * out_b
    return out, lse
