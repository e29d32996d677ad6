"""The ring attention example with one mistake planted each, and ranks that misbehave.

Each rank imports these by name (the check sends them by reference), so every one is
a function at the top level of this module.
"""

import os
import time

import torch
import torch.distributed as dist

from examples import ring_attention as ring



def _run(q, k, v, kw, **knobs):
    out, _ = ring.ring(q, k, v, **kw, **knobs)
    return out


def local_positions(q, k, v, *, causal, scale, group, q_positions, k_positions):
    """The zig-zag mask computed from local positions: each rank numbers its rows as if the
    shards were laid end to end in rank order (right for contiguous sharding only)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([q.shape[2]]), group=group)
    first = int(sum(n.item() for n in lengths[:rank]))
    local = torch.arange(first, first + q.shape[2])
    return _run(q, k, v, dict(causal=causal, scale=scale, group=group, q_positions=local, k_positions=local))


def _merge_without_lse(out_a, lse_a, out_b, lse_b):
    """Each partial normalised alone, the two averaged where both saw keys: no lse weights."""
    _, lse = ring.merge_states(out_a, lse_a, out_b, lse_b)
    both = (torch.isfinite(lse_a) & torch.isfinite(lse_b))[..., None]
    return torch.where(both, (out_a + out_b) / 2, out_a + out_b), lse


def no_lse_merge(q, k, v, *, causal, scale, group, q_positions, k_positions):
    return _run(q, k, v, dict(causal=causal, scale=scale, group=group, q_positions=q_positions,
                              k_positions=k_positions), merge=_merge_without_lse)


def _merge_base2(out_a, lse_a, out_b, lse_b):
    """The merge with exp2/log2 on a natural-log lse."""
    m = torch.maximum(lse_a, lse_b).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_a, w_b = torch.exp2(lse_a - m), torch.exp2(lse_b - m)
    total = w_a + w_b
    seen = total > 0
    total = torch.where(seen, total, torch.ones_like(total))
    lse = torch.where(seen, m + torch.log2(total), torch.full_like(total, -torch.inf))
    return (w_a / total)[..., None] * out_a + (w_b / total)[..., None] * out_b, lse


def lse_base_2(q, k, v, *, causal, scale, group, q_positions, k_positions):
    return _run(q, k, v, dict(causal=causal, scale=scale, group=group, q_positions=q_positions,
                              k_positions=k_positions), merge=_merge_base2)


class _MergeOwnLseBackward(torch.autograd.Function):
    """The example's merge forward; its backward hands each partial dO unweighted and, to its lse,
    rowsum(dO ∘ (o − out)) plus the merged lse's own gradient.  Through `ring.partial_attention`'s
    autograd each block's dS is then P_b ∘ (dO V_bᵀ − rowsum(dO ∘ O)) with P_b = exp(S_b − lse_b):
    the block's backward given its own lse where the merged one is meant (D from the merged out)."""

    @staticmethod
    def forward(ctx, out_a, lse_a, out_b, lse_b):
        out, lse = ring.merge_states(out_a, lse_a, out_b, lse_b)
        ctx.save_for_backward(out_a, out_b, out)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        out_a, out_b, out = ctx.saved_tensors
        own = 0.0 if d_lse is None else d_lse
        return d_out, own + (d_out * (out_a - out)).sum(-1), d_out, own + (d_out * (out_b - out)).sum(-1)


def own_block_lse_backward(q, k, v, *, causal, scale, group, q_positions, k_positions):
    return _run(q, k, v, dict(causal=causal, scale=scale, group=group, q_positions=q_positions,
                              k_positions=k_positions), merge=_MergeOwnLseBackward.apply)


class _GatherKeepOwn(ring._Gather):
    """The example's all_gather whose backward keeps the rank's own slice: no reduction across ranks."""

    @staticmethod
    def backward(ctx, grad):
        return grad[dist.get_rank(ctx.group)], None


def block_local_mask(q, k, v, *, causal, scale, group, q_positions, k_positions):
    """``causal`` passed to every step: each other rank's block that the mask does not hide whole
    masked as the own diagonal block is (row i of the shard sees the block's keys 0 .. i)."""
    work = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
    out = lse = None
    for step, (k_s, v_s, pos_s) in enumerate(ring.gather_blocks(k.to(work), v.to(work), k_positions, group)):
        seen = ring.visible(q_positions, pos_s, causal)
        if step and causal and seen.any():
            local = torch.where(pos_s >= 0, torch.arange(len(pos_s)), -1)        # padding keys stay unseen
            seen = ring.visible(torch.arange(len(q_positions)), local, causal)
        o, l = ring.partial_attention(q.to(work), k_s, v_s, seen, scale)
        out, lse = (o, l) if out is None else ring.merge_states(out, lse, o, l)
    return out.to(q.dtype)


def _gather_keep_own(k, v, k_positions, group):
    return ring.gather_blocks(k, v, k_positions, group, autograd_gather=_GatherKeepOwn.apply)


def dkdv_not_reduced(q, k, v, *, causal, scale, group, q_positions, k_positions):
    return _run(q, k, v, dict(causal=causal, scale=scale, group=group, q_positions=q_positions,
                              k_positions=k_positions), gather=_gather_keep_own)


def raises_on_rank_1(q, k, v, *, causal, scale, group, q_positions, k_positions):
    if dist.get_rank(group) == 1:
        raise RuntimeError("no buffer for this shard")
    return ring.attention(q, k, v, causal=causal, scale=scale, group=group, q_positions=q_positions,
                          k_positions=k_positions)


def hangs_on_rank_1(q, k, v, *, causal, scale, group, q_positions, k_positions):
    if dist.get_rank(group) == 1:
        while True:
            time.sleep(0.05)
    return ring.attention(q, k, v, causal=causal, scale=scale, group=group, q_positions=q_positions,
                          k_positions=k_positions)


def exits_on_rank_1(q, k, v, *, causal, scale, group, q_positions, k_positions):
    if dist.get_rank(group) == 1:
        os._exit(3)
    return ring.attention(q, k, v, causal=causal, scale=scale, group=group, q_positions=q_positions,
                          k_positions=k_positions)


def single_device(q, k, v, *, causal, scale):
    """A kernel for one device: it cannot take the rank keywords."""
    return q


def scale_ignored(q, k, v, *, causal, scale, group, q_positions, k_positions):
    """Not a sharding mistake: 1/sqrt(D) left out. Nothing of the sharding catalogue may claim it."""
    return ring.attention(q, k, v, causal=causal, scale=1.0, group=group, q_positions=q_positions,
                          k_positions=k_positions)


class _Averaged(torch.autograd.Function):
    """The identity, its gradient divided by the world size (an all-reduce of dk, dv averaged)."""

    @staticmethod
    def forward(ctx, x, world):
        ctx.world = world
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g / ctx.world, None


def dkdv_averaged(q, k, v, *, causal, scale, group, q_positions, k_positions):
    """dk and dv averaged over the ranks where they are summed."""
    world = dist.get_world_size(group)
    return _run(q, _Averaged.apply(k, world), _Averaged.apply(v, world),
                dict(causal=causal, scale=scale, group=group, q_positions=q_positions, k_positions=k_positions))
