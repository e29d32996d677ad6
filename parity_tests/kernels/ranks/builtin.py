"""Built-in targets across ranks.

``cp-ring``: PyTorch's own context-parallel SDPA
(``torch.distributed.tensor.experimental.context_parallel``): within it,
``scaled_dot_product_attention`` on each rank's shard runs a ring over the ranks.  It
shards the sequence itself, contiguously or head-tail (its load balancer), in equal
shards; other layouts are declared "not supported".

It does not run on CPU (tried with torch 2.13, gloo, 2 ranks): SDPA's CPU kernel,
``aten._scaled_dot_product_flash_attention_for_cpu``, has no DTensor sharding strategy
(``NotImplementedError``), and the math backend fails on a plain mask tensor mixed
with DTensors.  Its ring is written for the CUDA flash, memory-efficient and cuDNN
kernels, with NCCL.  The CUDA path below follows PyTorch's own use of the
dispatcher (the one ``context_parallel`` enables); it has not been run here (no GPU).
"""

__all__ = ["BUILTINS", "available", "builtin", "cp_ring", "CPU_REASON"]

BUILTINS = {"cp-ring": "PyTorch's context-parallel SDPA (torch.distributed.tensor.experimental), CUDA only"}

CPU_REASON = ("PyTorch's context-parallel SDPA has no CPU path: on CPU, SDPA calls "
              "aten._scaled_dot_product_flash_attention_for_cpu, for which DTensor registers no sharding "
              "strategy (NotImplementedError), and the math backend mixes a plain mask tensor with DTensors; "
              "its ring runs the CUDA flash, efficient and cuDNN kernels, with NCCL")


def available(name, device):
    """ValueError, with the reason, when the built-in cannot run on ``device``."""
    if name not in BUILTINS:
        raise ValueError(f"unknown built-in across ranks: {name!r}; known: {', '.join(BUILTINS)}")
    if device != "cuda":
        raise ValueError(f"target {name!r} does not run on {device}: {CPU_REASON}")


def builtin(name):
    """The callable a rank runs for the built-in ``name``."""
    available(name, "cuda")
    return cp_ring


def _layout(positions, n, rank, tokens):
    """"contiguous" or "head-tail" when ``positions`` are the equal shard CP expects, else None."""
    pos = positions.tolist()
    if tokens % (2 * n) == 0:
        c = tokens // (2 * n)
        if pos == list(range(rank * c, (rank + 1) * c)) + list(range((2 * n - 1 - rank) * c, (2 * n - rank) * c)):
            return "head-tail"
    if tokens % n == 0 and pos == list(range(rank * tokens // n, (rank + 1) * tokens // n)):
        return "contiguous"
    return None


_MESH = {}


def cp_ring(q, k, v, *, causal, scale, group, q_positions, k_positions):
    """SDPA on this rank's shard with PyTorch's context-parallel dispatcher enabled.  The
    dispatcher stays enabled for the rank's life, so that the backward (run after this
    returns) goes through the ring too."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from parity_tests.kernels.targets import Unsupported
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if k.shape[1] != q.shape[1]:
        raise Unsupported("cp-ring: k and v with fewer heads than q")
    layout = _layout(q_positions.cpu(), n, rank, q.shape[2] * n)
    if layout is None:
        raise Unsupported("cp-ring: PyTorch's CP takes equal shards, contiguous or head-tail (T divisible by 2N)")
    if "mesh" not in _MESH:
        _MESH["mesh"] = init_device_mesh(q.device.type, (n,))
        cp._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=_MESH["mesh"])
    cp._cp_options.enable_load_balance = layout == "head-tail"
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
