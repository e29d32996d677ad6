"""The measured sections of ``attention-parity claims`` (1-5); see `claims`.

Each function returns rows ``(claim, computed, chapter, verdict)``.  Monte Carlo
estimates carry a 99.99% confidence interval from the normal approximation: for a
sample variance ``s^2`` of N draws, ``SE(s^2) = sqrt((m4 - s^4) / N)`` with
``m4`` the sample fourth central moment (valid for any distribution with a
finite fourth moment: products of normals, uniforms, ...).
"""

import numpy as np
import torch

import numpy_ref
from numpy_ref import ops
from parity_tests.common import chapter_values as cv
from parity_tests.common.verdicts import SKIP, fmt, loose, sci, verdict

F32 = np.float32


# --- 1. float32 exp ------------------------------------------------------------------

def bisect_float32(holds, good, bad):
    """The last float32 (walking from ``good`` towards ``bad``) where ``holds`` is
    true, given that it holds at ``good`` and not at ``bad``: bisection on float32
    values, finished one representable step at a time with ``np.nextafter``."""
    good, bad = F32(good), F32(bad)
    while np.nextafter(good, bad) != bad:
        mid = F32((float(good) + float(bad)) / 2)
        if mid == good or mid == bad:
            mid = np.nextafter(good, bad)
        good, bad = (mid, bad) if holds(mid) else (good, mid)
    return float(good)


def np_exp32(v):
    with np.errstate(over="ignore", under="ignore"):
        return np.exp(F32(v))


def torch_exp32(v):
    return torch.exp(torch.tensor(float(v), dtype=torch.float32)).item()


def naive_softmax_torch(x):
    """The chapter's ``softmax_naive``: ``exp(x) / exp(x).sum()``."""
    return torch.exp(x) / torch.exp(x).sum(dim=0)


def exp_rows(c):
    over = {name: bisect_float32(lambda v: np.isfinite(f(v)), 80, 100)
            for name, f in (("numpy", np_exp32), ("torch", torch_exp32))}
    under = {name: bisect_float32(lambda v: f(v) > 0, -90, -110)
             for name, f in (("numpy", np_exp32), ("torch", torch_exp32))}
    normal = bisect_float32(lambda v: np_exp32(v) >= np.finfo(F32).tiny, -80, -110)
    rows = [
        ("largest float32 x with finite exp(x) (numpy ; torch)",
         f"{over['numpy']:.5f} ; {over['torch']:.5f}  (ln FLT_MAX = {np.log(np.finfo(F32).max):.5f})",
         f"~ {c['exp_overflow_near']:g}",
         verdict(all(abs(v - c["exp_overflow_near"]) <= 0.5 for v in over.values()))),
        ("smallest float32 x with exp(x) > 0 (numpy ; torch)",
         f"{under['numpy']:.5f} ; {under['torch']:.5f}  (ln 2^-150 = {np.log(2.0) * -150:.5f})",
         f"~ {c['exp_underflow_near']:g}",
         verdict(all(abs(v - c["exp_underflow_near"]) <= 0.5 for v in under.values()))),
        ("smallest float32 x with exp(x) normal (>= FLT_MIN); below: subnormal, 0 under FTZ",
         f"{normal:.5f}  (ln FLT_MIN = {np.log(np.finfo(F32).tiny):.5f})", "-",
         verdict(abs(normal - np.log(np.finfo(F32).tiny)) <= 1e-5)),
    ]
    e89, e104 = torch_exp32(89.0), torch_exp32(-104.0)
    rows += [
        ("torch.exp(torch.tensor(89.0))", f"{e89} (numpy: {np_exp32(89.0)})", "inf",
         verdict(np.isinf(e89) and np.isinf(np_exp32(89.0)))),
        ("torch.exp(torch.tensor(-104.0))", f"{e104} (numpy: {np_exp32(-104.0)})", "0.",
         verdict(e104 == 0 and np_exp32(-104.0) == 0)),
        ("torch.exp(torch.tensor(-103.9)): still a subnormal", sci(torch_exp32(-103.9)), "-",
         verdict(torch_exp32(-103.9) > 0)),
    ]
    return rows + naive_vs_stable_rows()


def naive_vs_stable_rows():
    rows = []
    for x in ([89.0, 88.0, 0.0], [-104.0, -105.0, -106.0]):
        xn = np.array(x, dtype=F32)
        xt = torch.tensor(x, dtype=torch.float32)
        with np.errstate(all="ignore"):
            naive_np = numpy_ref.softmax_naive(xn)
        naive_t = naive_softmax_torch(xt).numpy()
        stable_np, stable_t = numpy_ref.softmax(xn), torch.softmax(xt, dim=0).numpy()
        rows.append((f"naive softmax of float32 {x} (numpy_ref ; torch)",
                     f"{fmt(naive_np)} ; {fmt(naive_t)}", "NaN",
                     verdict(np.isnan(naive_np).any() and np.isnan(naive_t).any())))
        ok = all(np.all(np.isfinite(s)) and abs(s.sum() - 1) < 1e-6 for s in (stable_np, stable_t))
        rows.append((f"stable softmax of float32 {x} (numpy_ref ; torch)",
                     f"{fmt(stable_np)} ; {fmt(stable_t)}", "finite, sums to 1",
                     verdict(ok and np.allclose(stable_np, stable_t, atol=1e-6))))
    return rows


# --- 2. variance of q.k, and saturation --------------------------------------------

def variance_ci(samples, z):
    """(s^2, low, high): sample variance with its normal-approximation CI (``z``: its quantile)."""
    s2 = samples.var()
    m4 = np.mean((samples - samples.mean()) ** 4)
    half = z * np.sqrt(max(m4 - s2**2, 0.0) / samples.size)
    return s2, s2 - half, s2 + half


def interval(v, lo, hi, digits=4):
    return f"{v:.{digits}g} [{lo:.{digits}g}, {hi:.{digits}g}]"


def variance_rows(c, rng, d_ks, n, z):
    rows = []
    for d in d_ks:
        q, k = rng.standard_normal((n, d)), rng.standard_normal((n, d))
        qk = np.einsum("nd,nd->n", q, k)                   # (n,)
        v, lo, hi = variance_ci(qk, z)
        sv, slo, shi = variance_ci(qk / np.sqrt(d), z)
        want, want_s = c["var_qk_per_dim"] * d, c["var_scaled_qk"]
        rows.append((f"d_k = {d}: Var(q.k) ; Var(q.k / sqrt(d_k))  (N = {n})",
                     f"{interval(v, lo, hi)} ; {interval(sv, slo, shi, 3)}",
                     f"{want:g} ; {want_s:g}",
                     verdict(lo <= want <= hi and slo <= want_s <= shi)))
        if d == 1024:
            want_sd = c["std_qk_at_1024"]
            rows.append(("d_k = 1024: standard deviation of q.k",
                         interval(np.sqrt(v), np.sqrt(lo), np.sqrt(hi)), f"~ {want_sd:g}",
                         verdict(np.sqrt(lo) <= want_sd <= np.sqrt(hi))))
    return rows


def attention_scores(rng, trials, tokens=6, d_k=1024):
    """q.k for ``trials`` queries against ``tokens`` keys each: (trials, tokens)."""
    q = rng.standard_normal((trials, d_k))
    keys = rng.standard_normal((trials, tokens, d_k))
    return np.einsum("mtd,md->mt", keys, q)


def mean_ci(x, z):
    half = z * x.std(ddof=1) / np.sqrt(x.size)
    return x.mean(), x.mean() - half, x.mean() + half


def collapse_rows(rng, trials, z, d_k=1024):
    scores = attention_scores(rng, trials, d_k=d_k)        # (trials, T)
    stats = {}
    for name, s in (("unscaled", scores), ("scaled", scores / np.sqrt(d_k))):
        w = numpy_ref.softmax(s)                            # float64
        J = numpy_ref.softmax_jacobian(w)                   # (trials, T, T)
        w32 = torch.softmax(torch.tensor(s, dtype=torch.float32), dim=-1)
        stats[name] = dict(top=mean_ci(w.max(axis=-1), z),
                           jn=mean_ci(np.linalg.norm(J, axis=(-2, -1)), z),
                           zero=float((w32 * (1 - w32) == 0).double().mean()))
    u, s = stats["unscaled"], stats["scaled"]
    ratio = u["jn"][0] / s["jn"][0]
    margin = bisect_float32(lambda g: torch.softmax(torch.tensor([0.0, -float(g)]), dim=0)[0] < 1,
                            1, 40)
    return [
        ("largest float32 margin x_1 - x_2 with softmax top weight < 1 exactly",
         f"{margin:.4f}  (ln 2^24 = {24 * np.log(2):.4f})", "-",
         verdict(abs(margin - 24 * np.log(2)) < 0.1)),
        ("mean max weight: unscaled ('~ one-hot') ; scaled",
         f"{interval(*u['top'], 3)} ; {interval(*s['top'], 3)}", ">= 0.9 ; <= 0.6",
         verdict(u["top"][1] >= 0.9 and s["top"][2] <= 0.6)),
        ("mean ||J_softmax||_F: unscaled ; scaled (gradient collapse)",
         f"{interval(*u['jn'], 3)} ; {interval(*s['jn'], 3)}  ratio {ratio:.3f}",
         "unscaled << scaled (ratio < 0.2)", verdict(ratio < 0.2)),
        ("w_i(1 - w_i) > 0 'never vanishes': share exactly 0 in float32 (unscaled ; scaled)",
         f"{u['zero']:.1%} ; {s['zero']:.1%}", "0% ('jamais')",
         loose(u["zero"] == 0, precise_holds=s["zero"] == 0 and u["zero"] > 0)),
    ]


def one_attention_example(seed, tokens=6, d_k=1024):
    """(unscaled, scaled) softmax weights of T x T random q.k, for the plot."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((tokens, d_k)), rng.standard_normal((tokens, d_k))
    s = q @ k.T                                             # (T, T)
    return numpy_ref.softmax(s), numpy_ref.softmax(s / np.sqrt(d_k))


# --- 3. masking ----------------------------------------------------------------------

def _mask_both_ways(scores):
    """(renormalised-after, -inf-before) causal weights from torch scores (T, T)."""
    T = scores.shape[-1]
    d_k = 2 ** 0.5
    after = torch.softmax(scores / d_k, dim=-1) * torch.tril(torch.ones(T, T, dtype=scores.dtype))
    after = after / after.sum(dim=-1, keepdim=True)
    mask = torch.triu(torch.ones(T, T), diagonal=1).bool()
    before = torch.softmax(scores.masked_fill(mask, -torch.inf) / d_k, dim=-1)
    return after, before


def chapter_scores(dtype):
    """sa_v2's attn_scores (seed 789), the chapter's causal example."""
    import torch_impl
    torch.manual_seed(cv.SEED_V2)
    sa_v2 = torch_impl.SelfAttention_v2(cv.D_IN, cv.D_OUT).to(dtype)
    x = torch.tensor(cv.INPUTS, dtype=dtype)
    with torch.no_grad():
        return sa_v2.W_query(x) @ sa_v2.W_key(x).T        # (6, 6)


def mask_rows():
    rows = []
    for dtype, tol in ((torch.float64, 1e-15), (torch.float32, 1e-6)):
        after, before = _mask_both_ways(chapter_scores(dtype))
        diff = (after - before).abs().max().item()
        rows.append((f"chapter's scores ({str(dtype)[6:]}): max |after - before|", sci(diff),
                     f"identical (<= {tol:g})", verdict(diff <= tol)))
    np_before = numpy_ref.softmax(np.where(np.triu(np.ones((6, 6)), 1) == 1, -np.inf,
                                           chapter_scores(torch.float64).numpy() / 2 ** 0.5))
    d_np = np.abs(np_before - _mask_both_ways(chapter_scores(torch.float64))[0].numpy()).max()
    rows.append(("numpy_ref.softmax with -inf vs torch renormalised (float64)", sci(d_np),
                 "identical (<= 1e-15)", verdict(d_np <= 1e-15)))
    s = chapter_scores(torch.float64).requires_grad_(True)
    after, _ = _mask_both_ways(s)
    g = torch.autograd.grad(after, s, torch.randn(6, 6, dtype=torch.float64))[0]
    leak = g.triu(diagonal=1).abs().max().item()
    rows.append(("no leak: d(renormalised weights)/d(future scores)", sci(leak), "0",
                 verdict(leak <= 1e-15)))
    return rows


# --- 4. dropout ----------------------------------------------------------------------

def dropout_rows(rng, z, n=200_000):
    rows = []
    x = rng.random(n) + 0.1                          # positive 'weights'
    for p in (0.1, 0.5, 0.8):
        kept_t = (torch.nn.Dropout(p)(torch.ones(n, dtype=torch.float64)) != 0).double().mean().item()
        keep_np = ops.draw_keep_mask(rng, (n,), p)
        half = z * np.sqrt(p * (1 - p) / n)
        in_ci = all(abs(k - (1 - p)) <= half for k in (kept_t, keep_np.mean()))
        rows.append((f"p = {p}: share kept (torch ; numpy_ref)",
                     f"{kept_t:.4f} ; {keep_np.mean():.4f}  (CI +-{half:.4f})",
                     f"{1 - p:g}", verdict(in_ci)))
        out, _ = ops.dropout_forward(x, keep_np, p)
        # ratio mean(out)/mean(x) = sum(m x) / ((1-p) sum x): its SE from the binomial mask
        se = np.sqrt(p / (1 - p) * np.sum(x**2)) / np.sum(x)
        r, r_raw = out.mean() / x.mean(), (x * keep_np).mean() / x.mean()
        rows.append((f"p = {p}: mean(dropout(x)) / mean(x) ; without 1/(1-p)",
                     f"{r:.4f} ; {r_raw:.4f}  (CI +-{z * se:.4f})", f"1 ; {1 - p:g}",
                     verdict(abs(r - 1) <= z * se and abs(r_raw - 1) > z * se)))
    t = torch.nn.Dropout(0.5)(torch.ones(10_000))
    rows.append(("survivors of Dropout(0.5) on ones are exactly 1/(1-p)",
                 fmt(np.unique(t.numpy())), "[0, 2]", verdict(set(np.unique(t.numpy())) <= {0.0, 2.0})))
    return rows


# --- 5. initialisation ---------------------------------------------------------------

def _linear_init_call():
    """The line of ``nn.Linear.reset_parameters`` that initialises the weight."""
    import inspect
    try:
        src = inspect.getsource(torch.nn.Linear.reset_parameters)
    except (OSError, TypeError):         # no source shipped
        return None
    return next((l.strip() for l in src.splitlines() if "(self.weight" in l), None)


def init_rows(c, rng, z, n=90_000):
    rows = []
    for d_in in (3, 64, 768):
        W = torch.nn.Linear(d_in, n // d_in).weight.detach().double().numpy().ravel()
        v, lo, hi = (t * d_in for t in variance_ci(W, z))
        bound = np.abs(W).max() * np.sqrt(d_in)
        rows.append((f"nn.Linear({d_in}, .) weights: Var * d_in ; max|W| * sqrt(d_in)",
                     f"{interval(v, lo, hi)} ; {bound:.4f}",
                     f"{c['linear_var_times_d_in']:.4f} ; <= 1",
                     verdict(lo <= c["linear_var_times_d_in"] <= hi and bound <= 1)))
    call = _linear_init_call()
    rows.append(("nn.Linear.reset_parameters: the weight's initialiser", call or "not found",
                 "Kaiming", SKIP if call is None else verdict("kaiming_uniform_" in call)))
    he = c["he_var_times_d_in"]
    rows.append(("'Kaiming (He, 2015)': He's Var * d_in = 2 (d_in = 768, above)",
                 interval(v, lo, hi), f"{he:g}",
                 loose(lo <= he <= hi, precise_holds=lo <= 1 / 3 <= hi)))
    # iid samples, as the CI presumes: output unit i of nn.Linear(768, n) (its own weight row
    # and bias, drawn by nn.Linear's initialiser) on its own x_i.  (One x batch through one
    # layer gives correlated entries, whose variance strays from its mean by more than the
    # iid interval: which draw fell outside depended on the PyTorch release.)
    layer = torch.nn.Linear(768, n // 10).double()
    x = torch.randn(n // 10, 768, dtype=torch.float64)
    y = ((layer.weight * x).sum(dim=1) + layer.bias).detach().numpy()
    sv, slo, shi = variance_ci(y, z)
    rows.append(("signal Var after nn.Linear(768, .), Var(x) = 1: 'maintenue constante'",
                 interval(sv, slo, shi), f"{c['linear_signal_var']:g}",
                 loose(slo <= c["linear_signal_var"] <= shi, precise_holds=slo <= 1 / 3 <= shi)))
    r = torch.rand(n, dtype=torch.float64).numpy()
    rv, rlo, rhi = variance_ci(r, z)
    rows.append(("torch.rand: Var ; min", f"{interval(rv, rlo, rhi)} ; {r.min():.2e}",
                 f"{c['rand_var']:.4f} ; >= 0 (all positive)",
                 verdict(rlo <= c["rand_var"] <= rhi and r.min() >= 0)))
    for d_in in (3, 768):
        # a fresh x and a fresh column of torch.rand weights per sample: iid draws
        x = torch.randn(2000, d_in, dtype=torch.float64)
        w = torch.rand(2000, d_in, dtype=torch.float64)
        sv, slo, shi = variance_ci((x * w).sum(dim=1).numpy(), z)
        rows.append((f"Var(x . w), w ~ torch.rand({d_in}): d_in * E[w^2] = d_in/3, grows with d_in",
                     interval(sv, slo, shi), f"'explose' ; {d_in / 3:.4g}",
                     verdict(slo <= d_in / 3 <= shi)))
    return rows
