"""The parity matrix: which modules, shapes, modes, dtypes and devices, and how each is compared.

Used by the command (``attention-parity``, `parity_tests.run_parity`) and by the
pytest suite alike, so both check exactly the same thing.

One *case* is a module x config x mode x dtype x device.  For each case the
PyTorch module is built from a seed, its ``state_dict()`` is loaded into the NumPy
module (the contract's one-line transfer), both run forward on the same input
and backward from the same *random* upstream gradient (never ``out.sum()``:
softmax rows sum to 1, so that gradient is ~0 and checks almost nothing), and
every result is compared: ``"output"``, ``"input"`` (the input gradient) and each
parameter's gradient under its ``named_parameters()`` name.  Each comparison is
one *row* (a dict; see `ROW_KEYS`).

How rows are judged depends on the dtype (reasons in `parity_tests.tolerances`):
float64 compares NumPy with PyTorch directly ("numpy vs torch"); lower
precisions compare each side with a float64 golden result computed from the same
rounded numbers ("torch vs golden", "numpy vs golden").  In bfloat16 and float16,
where NumPy has no side of its own, the golden result is itself checked against
PyTorch in float64 on the same numbers ("golden vs torch f64"), so a fault in the
NumPy code fails those runs too.

Training mode uses dropout p > 0 with the *same* keep-mask on both sides: NumPy
takes it as ``forward(x, keep_mask=...)``; on the PyTorch side each
``nn.Dropout`` is swapped for `KeepMaskDropout` holding the same mask.
"""

import copy
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

import numpy_ref
import torch_impl
from parity_tests.common import capabilities
from parity_tests.common import tolerances as tol
from parity_tests.common.seeding import manual_seed
from parity_tests.matrix import variants
from parity_tests.matrix.functional import functional_forward

__all__ = [
    "Config", "ModuleSpec", "Case", "MODULES", "DTYPES", "ROW_KEYS", "DROPOUT_P",
    "KeepMaskDropout", "available_devices", "dtype_supported", "build_cases",
    "build_numpy", "buffer_rows", "golden_rows", "run_case", "run_matrix", "relative_error", "tensor_scales", "summarize",
]

# Every row has these keys (`baseline` is None for float64 rows).
ROW_KEYS = ("module", "config", "mode", "dtype", "device", "check", "tensor",
            "error", "bound", "baseline", "passed", "where")

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# Dropout rate of the training-mode cases; 1/(1 - 0.25) = 4/3 is not a power of
# two, so the rescaling is rounded and a missing or doubled rescale shows.
DROPOUT_P = 0.25


@dataclass(frozen=True)
class Config:
    """One shape of input and module.  ``head_dim`` is ``d_out`` for one-head modules."""

    label: str
    tokens: int
    d_in: int
    head_dim: int
    batch: int = 1
    num_heads: int = 1
    context_length: int = 0       # 0: exactly `tokens`
    qkv_bias: bool = False
    input_scale: float = 1.0      # x is drawn from N(0, input_scale^2)
    dtypes: tuple = ()            # the dtypes this config runs in; () = all

    @property
    def ctx(self):
        return self.context_length or self.tokens


@dataclass(frozen=True)
class ModuleSpec:
    """A PyTorch class, the NumPy class it is held against, and how to build and feed them."""

    name: str                     # torch_impl class (the row's `module`)
    reference: str                # numpy_ref class
    kind: str                     # simplified | v1 | v2 | causal | wrapper | mha
    configs: tuple
    modes: tuple = ("eval",)
    torch_name: str = ""          # torch_impl class when it is not `name`
    numpy_attrs: tuple = ()       # (attribute, value) set on the NumPy module after building

    @property
    def batched(self):
        return self.kind in ("causal", "wrapper", "mha")


# 2-D modules: (tokens, d_in) -> (tokens, d_out); head_dim is d_out.
CONFIGS_2D = (
    Config("one token", tokens=1, d_in=3, head_dim=2),
    Config("head dim 1", tokens=4, d_in=3, head_dim=1, qkv_bias=True),
    Config("d_in 5 > d_out 3, bias", tokens=6, d_in=5, head_dim=3, qkv_bias=True),
    Config("d_in 2 < d_out 4", tokens=5, d_in=2, head_dim=4),
)
# Causal modules: (batch, tokens, d_in); d_out is head_dim (CausalAttention),
# head_dim per head (wrapper) or num_heads * head_dim (MultiHeadAttention).
CONFIGS_CAUSAL = (
    Config("one token, B=1", tokens=1, d_in=4, head_dim=2, num_heads=2, context_length=4),
    Config("head dim 1, bias", tokens=4, d_in=3, head_dim=1, batch=2, num_heads=3, qkv_bias=True),
    Config("T 5 < ctx 8, bias", tokens=5, d_in=6, head_dim=3, batch=2, num_heads=2,
           context_length=8, qkv_bias=True),
    Config("d_in 5 != d_out, B=3", tokens=6, d_in=5, head_dim=4, batch=3, num_heads=2),
)

# Blockwise attention: lengths that are not multiples of the (3, 4) tiles, so the
# online softmax rescales and diagonal tiles are masked (one token and other
# edges are in reference/test_blockwise_*.py); and large inputs whose
# scores rise by thousands from one key tile to the next (a running maximum that
# is not updated overflows there, and only there).
CONFIGS_BLOCKWISE = (
    Config("T 13, tiles 3x4, bias", tokens=13, d_in=5, head_dim=3, batch=2, num_heads=2,
           context_length=16, qkv_bias=True),
    # float64 only: with scores of thousands, the float32 L = m + log ℓ is rounded by
    # ~1e-4 (as in every FlashAttention), which a nearly one-hot softmax exposes
    Config("T 9, large scores", tokens=9, d_in=4, head_dim=2, num_heads=2, input_scale=100.0,
           dtypes=("float64",)),
)
BLOCKWISE_TILES = (("block_q", 3), ("block_k", 4))

MODULES = (
    ModuleSpec("SimplifiedSelfAttention", "SimplifiedSelfAttention", "simplified", CONFIGS_2D),
    ModuleSpec("SelfAttention_v1", "SelfAttention_v1", "v1", CONFIGS_2D),
    ModuleSpec("SelfAttention_v2", "SelfAttention_v2", "v2", CONFIGS_2D),
    ModuleSpec("CausalAttention", "CausalAttention", "causal", CONFIGS_CAUSAL, ("eval", "train")),
    ModuleSpec("MultiHeadAttentionWrapper", "MultiHeadAttentionWrapper", "wrapper",
               CONFIGS_CAUSAL, ("eval", "train")),
    ModuleSpec("MultiHeadAttention", "MultiHeadAttention", "mha", CONFIGS_CAUSAL, ("eval", "train")),
    # SDPA draws its own dropout mask inside the kernel and cannot be handed one,
    # so the fused module is compared in eval mode only.
    ModuleSpec("FusedMultiHeadAttention", "MultiHeadAttention", "mha", CONFIGS_CAUSAL),
    # numpy_ref's blockwise module held to torch_impl.MultiHeadAttention (rows say
    # "BlockwiseMultiHeadAttention"), with small tiles so that tiling shows.
    ModuleSpec("BlockwiseMultiHeadAttention", "BlockwiseMultiHeadAttention", "mha",
               CONFIGS_BLOCKWISE, ("eval", "train"), torch_name="MultiHeadAttention",
               numpy_attrs=BLOCKWISE_TILES),
)


@dataclass(frozen=True)
class Case:
    spec: ModuleSpec
    config: Config
    mode: str
    dtype: str
    device: str

    @property
    def seed(self):
        """Same weights and inputs for every dtype and device of a module/config/mode."""
        return zlib.crc32(f"{self.spec.name}|{self.config.label}|{self.mode}".encode())


class KeepMaskDropout(nn.Module):
    """Dropout with a given keep-mask (True = kept), survivors scaled by 1/(1 - p)."""

    def __init__(self, keep, p):
        super().__init__()
        self.keep, self.p = keep, p

    def forward(self, attn_weights):
        if not self.training:
            return attn_weights
        return attn_weights * self.keep.to(attn_weights.dtype) * (1.0 / (1.0 - self.p))


def available_devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def dtype_supported(dtype, device):
    """float64/float32 everywhere; bfloat16/float16 on CUDA, and on CPU (PyTorch runs matmul,
    softmax and their backward in both there, slowly; fine for these sizes; float16's
    matmul from PyTorch 2.2)."""
    return unsupported_dtype(dtype, device) is None


def unsupported_dtype(dtype, device):
    """Why ``dtype`` cannot run on ``device`` here, or None."""
    if dtype not in DTYPES or device not in ("cpu", "cuda"):
        return f"unknown dtype or device {dtype!r}, {device!r}"
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    if device == "cuda" and dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        return "this GPU has no bfloat16"
    return capabilities.dtype_lacks(dtype, device)


def build_cases(dtypes=("float64", "float32"), devices=("cpu",), modules=None):
    """Every case of the matrix, optionally restricted to some module class names."""
    specs = [s for s in MODULES if modules is None or s.name in modules]
    cases = [Case(spec, config, mode, dtype, device)
             for device in devices for dtype in dtypes if dtype_supported(dtype, device)
             for spec in specs for config in spec.configs for mode in spec.modes
             if not config.dtypes or dtype in config.dtypes]
    if modules is None or variants.MODULE in modules:      # the production variants' family
        cases += variants.build_cases(dtypes, devices)
    return cases


# ----------------------------------------------------------------- building

def _ctor_args(spec, c):
    """Positional constructor arguments, the chapter's order."""
    if spec.kind == "simplified":
        return ()
    if spec.kind == "v1":
        return (c.d_in, c.head_dim)
    if spec.kind == "v2":
        return (c.d_in, c.head_dim, c.qkv_bias)
    if spec.kind == "causal":
        return (c.d_in, c.head_dim, c.ctx, DROPOUT_P, c.qkv_bias)
    if spec.kind == "wrapper":
        return (c.d_in, c.head_dim, c.ctx, DROPOUT_P, c.num_heads, c.qkv_bias)
    return (c.d_in, c.num_heads * c.head_dim, c.ctx, DROPOUT_P, c.num_heads, c.qkv_bias)


def _shapes(spec, c):
    """(input, output, keep-mask or None) shapes."""
    T, B, H = c.tokens, c.batch, c.num_heads
    if not spec.batched:
        d_out = c.d_in if spec.kind == "simplified" else c.head_dim
        return (T, c.d_in), (T, d_out), None
    if spec.kind == "causal":
        return (B, T, c.d_in), (B, T, c.head_dim), (B, T, T)
    if spec.kind == "wrapper":
        return (B, T, c.d_in), (B, T, H * c.head_dim), (H, B, T, T)
    return (B, T, c.d_in), (B, T, H * c.head_dim), (B, H, T, T)


def make_inputs(case):
    """float64 input, upstream gradient and (training mode) keep-mask, from the case's seed."""
    rng = np.random.default_rng(case.seed)
    x_shape, out_shape, keep_shape = _shapes(case.spec, case.config)
    x = rng.standard_normal(x_shape) * case.config.input_scale
    grad_out = rng.standard_normal(out_shape)
    keep = None
    if case.mode == "train" and keep_shape is not None:
        keep = rng.random(keep_shape) >= DROPOUT_P
    return x, grad_out, keep


def build_torch(case):
    """The PyTorch module, initialised from the case's seed, in the case's dtype and device."""
    manual_seed(case.seed)
    cls = getattr(torch_impl, case.spec.torch_name or case.spec.name)
    module = cls(*_ctor_args(case.spec, case.config))
    return module.to(device=case.device, dtype=DTYPES[case.dtype])


def install_keep_mask(module, kind, keep, p):
    """Swap each ``nn.Dropout`` for a `KeepMaskDropout` applying ``keep`` (per head in the wrapper)."""
    if kind == "wrapper":
        for h, head in enumerate(module.heads):
            head.dropout = KeepMaskDropout(keep[h], p)
    else:
        module.dropout = KeepMaskDropout(keep, p)


# ----------------------------------------------------------------- running

def _to_numpy(t):
    return None if t is None else t.detach().to("cpu", torch.float64).numpy()


def run_torch(module, case, x, grad_out, keep):
    """Forward and backward of a PyTorch module; results as float64 arrays.

    ``x``, ``grad_out`` are tensors already in the case's dtype and device.
    """
    module.train(case.mode == "train")
    if keep is not None:
        install_keep_mask(module, case.spec.kind, keep, DROPOUT_P)
    x = x.detach().clone().requires_grad_(True)
    out = module(x)
    out.backward(grad_out)
    results = {"output": _to_numpy(out), "input": _to_numpy(x.grad)}
    results.update({n: _to_numpy(p.grad) for n, p in module.named_parameters()})
    return results


def build_numpy(case):
    """A fresh NumPy module of the case's reference class, with its own initial state."""
    cls = getattr(numpy_ref, case.spec.reference)
    args = _ctor_args(case.spec, case.config)
    module = cls(*args, rng=0) if args else cls()
    for attribute, value in case.spec.numpy_attrs:
        setattr(module, attribute, value)
    return module


def run_numpy(case, state, x, grad_out, keep):
    """Forward and backward of a NumPy module holding ``state``; computes in ``x``'s dtype."""
    module = build_numpy(case)
    if state:
        try:
            module.load_state_dict(state)
        except ValueError:
            # a NumPy module that refuses the PyTorch state (the blockwise module
            # refuses a mask other than the causal one): every tensor missing,
            # so every row of the case fails
            return {}
    module.train() if case.mode == "train" else module.eval()
    out = module.forward(x, keep_mask=keep) if keep is not None else module.forward(x)
    dx = module.backward(grad_out)
    results = {"output": out, "input": dx}
    results.update(module.grads)
    return {k: np.asarray(v, dtype=np.float64) for k, v in results.items()}


def run_functional(case, module, x, grad_out, keep):
    """The chapter's formulas as plain PyTorch autograd, in the case's dtype and device."""
    params = {n: p.detach().clone().requires_grad_(True) for n, p in module.named_parameters()}
    x = x.detach().clone().requires_grad_(True)
    out = functional_forward(case.spec.kind, params, x, case.config.num_heads,
                             keep if case.mode == "train" else None, DROPOUT_P)
    out.backward(grad_out)
    results = {"output": _to_numpy(out), "input": _to_numpy(x.grad)}
    results.update({n: _to_numpy(p.grad) for n, p in params.items()})
    return results


# ----------------------------------------------------------------- comparing

def relative_error(tested, ref, scale=0.0):
    """``(max|tested - ref| / max(max|ref|, scale), index of the largest difference)``.

    A missing tensor, a shape mismatch or any NaN/inf difference is an infinite
    error (it can never pass); its ``where`` is the first offending index.
    """
    if tested is None or ref is None:
        return float("inf"), None
    a, b = np.asarray(tested, np.float64), np.asarray(ref, np.float64)
    if a.shape != b.shape:
        return float("inf"), None
    if a.size == 0:
        return 0.0, None
    diff = np.abs(a - b)
    bad = ~np.isfinite(diff)
    if bad.any():
        return float("inf"), tuple(int(i) for i in np.argwhere(bad)[0])
    where = tuple(int(i) for i in np.unravel_index(np.argmax(diff), diff.shape))
    denom = max(float(np.max(np.abs(b))), scale, np.finfo(np.float64).tiny)
    return float(diff[where]) / denom, where


def tensor_scales(ref):
    """Per tensor, the floor of its denominator: SCALE_FLOOR x the case's largest of its kind."""
    def peak(v):
        v = np.asarray(v, np.float64)
        return float(np.max(np.abs(v))) if v.size and np.isfinite(v).all() else 0.0
    grad_peak = max((peak(v) for k, v in ref.items() if k != "output"), default=0.0)
    return {k: tol.SCALE_FLOOR * (peak(v) if k == "output" else grad_peak) for k, v in ref.items()}


def _names(ref, tested):
    """Tensor names in a stable order: output, input, then parameters as named_parameters."""
    return list(ref) + [k for k in tested if k not in ref]


def _row(case, check, tensor, error, bound, baseline, where):
    return {
        "module": case.spec.name, "config": case.config.label, "mode": case.mode,
        "dtype": case.dtype, "device": case.device, "check": check, "tensor": tensor,
        "error": error, "bound": bound, "baseline": baseline,
        "passed": bool(np.isfinite(error) and error <= bound),
        "where": None if where is None else list(where),
    }


def _rounded(case, array):
    """``array`` in the case's dtype and device, and those same numbers in float64 NumPy."""
    t = torch.tensor(array, dtype=DTYPES[case.dtype], device=case.device)
    return t, _to_numpy(t)


def buffer_rows(case, module):
    """The buffers (causal masks) each side builds for itself, compared exactly.

    The weight transfer copies buffers too, so a wrong mask on one side would
    reach the other and agree with itself; these rows compare the NumPy module's
    *own* mask, before any transfer, with the PyTorch module's.
    """
    own = build_numpy(case).state_dict()
    rows = []
    for name, buf in module.named_buffers():
        error, where = relative_error(own.get(name), _to_numpy(buf))
        rows.append(_row(case, "numpy vs torch", name, error, tol.BUFFER_BOUND, None, where))
    return rows


def run_case(case):
    """Every row of one case: buffers, then output, input and parameter gradients."""
    if isinstance(case, variants.VariantCase):
        return variants.run_case(case)
    x, grad_out, keep = make_inputs(case)
    module = build_torch(case)
    rows = buffer_rows(case, module)
    x_t, x64 = _rounded(case, x)
    g_t, g64 = _rounded(case, grad_out)
    keep_t = None if keep is None else torch.tensor(keep, device=case.device)
    torch_res = run_torch(module, case, x_t, g_t, keep_t)

    if case.dtype == "float64" and case.device == "cpu":
        state = module.state_dict()      # the contract's one-line transfer, as users write it
    else:
        state = {k: v.detach().to("cpu", torch.float64) for k, v in module.state_dict().items()}

    if case.dtype == "float64":
        numpy_res = run_numpy(case, state, x64, g64, keep)
        scales = tensor_scales(torch_res)
        for name in _names(torch_res, numpy_res):
            error, where = relative_error(numpy_res.get(name), torch_res.get(name),
                                          scales.get(name, 0.0))
            rows.append(_row(case, "numpy vs torch", name, error, tol.float64_bound(), None, where))
        return rows

    # (check, tested results, the ordinary computations whose drift is its baseline)
    sides = [("torch vs golden", torch_res, ("functional",))]
    if case.dtype == "float32":
        # Two ordinary float32 computations exist: NumPy's (independent code and
        # kernels) and plain PyTorch's; the torch side is held to the larger drift of
        # the two (see tolerances: they differ by up to 20x on some weight gradients).
        # NumPy's own rows do not depend on the device, so they come with cpu only.
        sides = [("torch vs golden", torch_res, ("numpy", "functional"))]
        if case.device == "cpu":
            sides.append(("numpy vs golden", None, ("functional",)))
    kinds = {kind for _, _, ks in sides for kind in ks}
    draws = [_baseline_draw(case, module, x_t, g_t, keep, keep_t, kinds, k)
             for k in range(tol.BASELINE_DRAWS)]
    golden, scales, _ = draws[0]         # the case itself, in float64 from the rounded numbers
    # NumPy computes the golden result, and a fault in it would move the golden, the
    # tested side's error and the baselines alike, unseen (in bfloat16 and float16
    # NumPy has no side of its own; in float32 the torch side's baseline includes
    # plain PyTorch's drift from the golden).  So the golden is checked first,
    # against PyTorch in float64 on the same rounded numbers.
    rows += golden_rows(case, module, golden, x_t, g_t, keep_t)
    for check, tested, ks in sides:
        tested = draws[0][2]["numpy"] if tested is None else tested
        for name in _names(golden, tested):
            s = scales.get(name, 0.0)
            error, where = relative_error(tested.get(name), golden.get(name), s)
            baseline = max(relative_error(ordinary[kind].get(name), gold.get(name),
                                          draw_scales.get(name, 0.0))[0]
                           for gold, draw_scales, ordinary in draws for kind in ks)
            bound = tol.low_precision_bound(case.dtype, baseline)
            rows.append(_row(case, check, name, error, bound, baseline, where))
    return rows


def golden_rows(case, module, golden, x_t, g_t, keep_t):
    """The golden result against the PyTorch module run in float64 on the same
    rounded numbers, at the float64 bound: the NumPy side's check in a dtype NumPy
    does not have.  Check ``"golden vs torch f64"``."""
    module64 = copy.deepcopy(module).to(torch.float64)
    res64 = run_torch(module64, case, x_t.to(torch.float64), g_t.to(torch.float64), keep_t)
    scales = tensor_scales(res64)
    rows = []
    for name in _names(res64, golden):
        error, where = relative_error(golden.get(name), res64.get(name), scales.get(name, 0.0))
        rows.append(_row(case, "golden vs torch f64", name, error, tol.float64_bound(), None, where))
    return rows


def _nudged(t, rng):
    """``t`` with every entry moved one step (ulp of its dtype) up or down at random."""
    up = torch.from_numpy(rng.random(tuple(t.shape)) < 0.5).to(t.device)
    toward = torch.where(up, float("inf"), float("-inf")).to(dtype=t.dtype, device=t.device)
    return torch.nextafter(t.detach(), toward)


def _baseline_draw(case, module, x_t, g_t, keep, keep_t, kinds, k):
    """One draw of the ordinary computations' rounding error: ``(golden, scales,
    {kind: results})`` for the case itself (k = 0), or (k > 0) for the case with
    every weight, input and upstream-gradient entry nudged one ulp at random.

    A nudged problem has the same size and conditioning but fresh rounding
    errors in every intermediate; its golden result is recomputed, so only the
    ordinary computation's rounding is measured.  Why several draws: see
    `tolerances.BASELINE_DRAWS`.
    """
    if k > 0:
        rng = np.random.default_rng([case.seed, k])
        module = copy.deepcopy(module)
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(_nudged(p, rng))
        x_t, g_t = _nudged(x_t, rng), _nudged(g_t, rng)
    state64 = {n: v.detach().to("cpu", torch.float64) for n, v in module.state_dict().items()}
    golden = run_numpy(case, state64, _to_numpy(x_t), _to_numpy(g_t), keep)
    ordinary = {}
    if "functional" in kinds:
        ordinary["functional"] = run_functional(case, module, x_t, g_t, keep_t)
    if case.dtype == "float32":           # NumPy has float32 (not bfloat16 or float16)
        state32 = {n: v.detach().cpu().numpy() for n, v in module.state_dict().items()}
        ordinary["numpy"] = run_numpy(case, state32, x_t.cpu().numpy(), g_t.cpu().numpy(), keep)
    return golden, tensor_scales(golden), ordinary


def run_matrix(cases, progress=None):
    """Rows of every case; ``progress(i, n)`` is called after each case if given."""
    rows = []
    for i, case in enumerate(cases):
        rows.extend(run_case(case))
        if progress is not None:
            progress(i + 1, len(cases))
    return rows


def summarize(rows, seconds=None):
    failed = sum(not r["passed"] for r in rows)
    summary = {"rows": len(rows), "passed": len(rows) - failed, "failed": failed}
    if seconds is not None:
        summary["seconds"] = round(seconds, 3)
    return summary
