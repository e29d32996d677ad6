"""The benchmarked implementations of the chapter's MultiHeadAttention, their steps
(forward + backward, returning (out, dx)) and their peak memory.

    numpy       numpy_ref.MultiHeadAttention                 full (B, H, T, T) arrays
    numpy_fast  numpy_ref.fast.FastMultiHeadAttention        causal query blocks
    blockwise   numpy_ref.BlockwiseMultiHeadAttention        tiles, O(T) memory
    eager       torch_impl.MultiHeadAttention                autograd, full arrays
    fused       torch_impl.FusedMultiHeadAttention           SDPA's kernel

All hold the same weights: a seeded torch_impl.MultiHeadAttention's parameters,
moved by ``load_state_dict``.  NumPy's peak is read by ``tracemalloc`` (NumPy
reports its buffers to it); PyTorch's by its profiler, adding up the memory each
operation allocates and frees in time order (approximate: a tensor freed outside
any operation, when the last reference goes, is not subtracted until later).
"""

import gc
import os
import tracemalloc


IMPLS = ("numpy", "numpy_fast", "blockwise", "eager", "fused")
NUMPY_IMPLS = ("numpy", "numpy_fast", "blockwise")
TORCH_IMPLS = ("eager", "fused")
DEFAULT_IMPLS = ("blockwise", "fused")

# Bytes per (T x T) entry per head of one forward + backward, for the paths that
# hold (B, H, T, T) arrays (measured at T = 1024..4096, float32): an impl is
# skipped at a T where this estimate exceeds MEMORY_SHARE of the machine.
BYTES_PER_SCORE = {"numpy": 9.0, "numpy_fast": 2.6, "eager": 16.0}
MEMORY_SHARE = 0.6
# (B, T, d) float32 arrays one forward + backward holds at its peak (the
# blockwise module: ~8 measured, see its docstring; the others about as many),
# plus the inputs x and dout and their float64 draws: estimated for every impl,
# before anything is allocated.
ARRAYS_PER_RUN = 10
INPUT_ARRAYS = 6             # x, dout (float32) and their float64 draws (2 each)


def classes():
    """The benchmarked classes, imported here so ``--help`` needs no torch."""
    import numpy_ref
    import numpy_ref.fast
    import torch_impl
    return {
        "numpy": numpy_ref.MultiHeadAttention,
        "numpy_fast": numpy_ref.fast.FastMultiHeadAttention,
        "blockwise": numpy_ref.BlockwiseMultiHeadAttention,
        "eager": torch_impl.MultiHeadAttention,
        "fused": torch_impl.FusedMultiHeadAttention,
    }


def estimate_bytes(name, T, batch, heads, d_model):
    """Estimated peak bytes of one forward + backward of ``name`` at T, inputs included."""
    need = (ARRAYS_PER_RUN + INPUT_ARRAYS) * 4.0 * batch * T * d_model
    return need + BYTES_PER_SCORE.get(name, 0.0) * batch * heads * T * T


def too_large(name, T, batch, heads, d_model=768):
    """None, or why ``name`` is not run at T: its estimated peak memory is more
    than MEMORY_SHARE of the machine's (decided before anything is allocated)."""
    need = estimate_bytes(name, T, batch, heads, d_model)
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    if need > MEMORY_SHARE * have:
        return (f"needs ~{need / 2**30:.1f} GiB (estimated), more than "
                f"{MEMORY_SHARE:.0%} of this machine's {have / 2**30:.0f} GiB")
    return None


def weights(args):
    """The shared weights: a seeded torch_impl.MultiHeadAttention's parameters."""
    import torch
    import torch_impl
    torch.manual_seed(args.seed)
    source = torch_impl.MultiHeadAttention(args.d_model, args.d_model, 1, 0.0, args.heads)
    return {n: p.detach().clone() for n, p in source.named_parameters()}


def build(name, args, context_length, params):
    """A fresh module ``name`` in eval mode holding ``params``, in args.dtype."""
    import torch
    cls = classes()[name]
    shape = (args.d_model, args.d_model, context_length, 0.0, args.heads)
    if name in TORCH_IMPLS:
        m = cls(*shape)
        state = m.state_dict()
        state.update(params)
        m.load_state_dict(state)
        return m.to(getattr(torch, args.dtype)).eval()
    m = cls(*shape, rng=args.seed)
    state = m.state_dict()                       # its own mask (built on demand if not held)
    state.update({n: p.numpy() for n, p in params.items()})
    m.load_state_dict(state)
    return m.eval()


def make_step(name, module, x, dout):
    """forward + backward of ``module`` -> (out, dx) as NumPy arrays."""
    if name in NUMPY_IMPLS:
        def step():
            out = module.forward(x)
            return out, module.backward(dout)
        return step
    import torch
    dout_t = torch.from_numpy(dout)

    def torch_step():
        module.zero_grad(set_to_none=True)
        x_t = torch.from_numpy(x).requires_grad_(True)
        out = module(x_t)
        out.backward(dout_t)
        return out.detach().numpy(), x_t.grad.numpy()
    return torch_step


def peak_bytes(name, step):
    """Peak bytes allocated during one (untimed) forward + backward."""
    gc.collect()
    if name in NUMPY_IMPLS:
        tracemalloc.start()
        try:
            step()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return peak
    return _torch_peak_bytes(step)


def _torch_peak_bytes(step):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = step()
    del result
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage),
                    key=lambda e: e.time_range.start)
    current = peak = 0
    for e in events:
        current += e.self_cpu_memory_usage
        peak = max(peak, current)
    return peak
