"""``attention-parity backprop [--module NAME] [--dropout P] [--token N] [--plot DIR] [--json PATH]``

The chapter's six-token example ("Your journey starts with one step", d_in = 3,
the chapter's seeded weights, d_out = 2) run backwards through one module, pass
by pass, from the context vectors to dL/dx.  The loss is L = Σ G ⊙ z for the
small fixed G printed first, so dL/dz = G.  For each intermediate: its shape,
the formula of that step in the chapter's notation, numpy_ref's numbers (its own
backward, tapped), autograd's numbers for the same tensor (torch_impl's forward
with retain_grad), and their difference, 4 decimals, one row per token.  Each
intermediate must agree within the parity suite's float64 bound; exit status 0
when all do, 1 otherwise.

--token N zooms on query N (1-6, or its word): the softmax Jacobian of that row,
J = diag(w) − w wᵀ, and the product w ⊙ (g − ⟨w, g⟩), term by term.

--blockwise [--tile N] walks CausalAttention in tiles of N (default 2), the
FlashAttention-2 way, beside the dense computation; with --token N, that row's
D = rowsum(dO ∘ O) beside ⟨w, g⟩, term by term.
"""

import argparse
import json
import os
import sys

import numpy as np

from parity_tests.common.help_text import Parser, plain
from parity_tests.common import plots
from parity_tests.common.tolerances import FLOAT64_BOUND
from parity_tests.common.verdicts import parse_verb_args
from parity_tests.lab import blockwise_walk, example, steps, zoom

DECIMALS = 4


def parse_token(text):
    """``"2"`` or ``"journey"`` -> index 0..5; argparse reports the message."""
    words = [t.lower() for t in example.TOKENS]
    if text.lower() in words:
        return words.index(text.lower())
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= len(words):
        raise argparse.ArgumentTypeError(
            f"--token must be 1-{len(words)} or one of {', '.join(example.TOKENS)}; got {text!r}")
    return n - 1


def parse_dropout(text):
    try:
        p = float(text)
    except ValueError:
        p = -1.0
    if not 0.0 <= p < 1.0:
        raise argparse.ArgumentTypeError(f"--dropout must be a number in [0, 1), got {text!r}")
    return p


def parse_tile(text):
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"--tile must be a positive integer, got {text!r}")
    return n


def parse_args(argv):
    p = Parser(page="docs/lab.md#1-attention-parity-backprop-every-intermediate-gradient-step-by-step",
               prog="attention-parity backprop", description=plain(__doc__),
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--module", choices=example.MODULES, default="CausalAttention",
                   help="the chapter module to walk through (default: CausalAttention)")
    p.add_argument("--dropout", type=parse_dropout, default=0.0,
                   help="dropout rate of the causal modules, training mode, mask drawn after "
                        f"torch.manual_seed({example.DROPOUT_SEED}) (default 0.0, the chapter's)")
    p.add_argument("--token", type=parse_token, default=None, metavar="N",
                   help="zoom on query token N (1-6 or its word): the softmax Jacobian row by row")
    p.add_argument("--plot", metavar="DIR", default=None,
                   help="write PNG heatmaps of the gradients into DIR (needs matplotlib)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write every step as JSON to PATH ('-' for standard output)")
    p.add_argument("--blockwise", action="store_true",
                   help="walk CausalAttention in tiles, FlashAttention-2's way, beside the dense numbers")
    p.add_argument("--tile", type=parse_tile, default=None, metavar="N",
                   help=f"with --blockwise: tiles of N queries by N keys "
                        f"(default {blockwise_walk.DEFAULT_TILE})")
    args = p.parse_args(argv)
    if args.tile is not None and not args.blockwise:
        p.error("--tile: only with --blockwise")
    if args.blockwise and (args.module != "CausalAttention" or args.dropout or args.plot or args.json):
        p.error("--blockwise: walks CausalAttention without dropout; no --module, --dropout, --plot, --json")
    if args.dropout and not example.SPECS[args.module].has_dropout:
        p.error(f"--dropout: {args.module} has no dropout (only the causal modules do)")
    return args


# --- printing --------------------------------------------------------------------

def row_labels(key, a):
    """One label per printed row of ``a`` viewed as (rows, columns)."""
    if a.ndim <= 1:
        return [""]
    lead = a.shape[:-2]
    if a.shape[-2] != len(example.TOKENS) or key.endswith(("weight", "W_query", "W_key", "W_value")):
        names = [f"row {i}" for i in range(a.shape[-2])]
    else:
        names = list(example.TOKENS)
    labels = []
    for idx in np.ndindex(*lead):
        head = f"h{idx[-1]} " if len(idx) == 2 else ""        # (b, H, T, .): show the head
        labels += [head + n for n in names]
    return labels


def _cells(v):
    return " ".join(zoom.num(x) for x in v)


def format_matrix_pair(key, a, b):
    """numpy_ref | autograd | max |Δ| per row, side by side."""
    a2 = a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1)
    b2 = b.reshape(a2.shape)
    labels = row_labels(key, a)
    lw = max(len(s) for s in labels + ["token"])
    bw = a2.shape[1] * (DECIMALS + 5) - 1
    out = [f"    {'':<{lw}}  {'numpy_ref':<{bw}}   {'autograd':<{bw}}   max |Δ|"]
    for label, ra, rb in zip(labels, a2, b2):
        out.append(f"    {label:<{lw}}  {_cells(ra)}   {_cells(rb)}   {np.max(np.abs(ra - rb)):.1e}")
    return "\n".join(out)


def print_walk(w):
    print(f"backprop through {w.module} on the chapter's input "
          f"(\"Your journey starts with one step\", d_in = 3), float64"
          + (f", dropout p = {w.dropout} (training mode)" if w.dropout else ""))
    print(f"loss L = Σ G ⊙ z, so the upstream gradient dL/dz is G, shape {tuple(w.G.shape)}:")
    G2 = w.G.reshape(-1, w.G.shape[-1])
    for label, row in zip(row_labels("G", w.G), G2):
        print(f"    {label:<8} {_cells(row)}")
    print()
    for i, s in enumerate(w.steps, 1):
        print(f"[{i}] {s.label}   (autograd: {s.key})   shape {tuple(s.numpy.shape)}")
        print(f"    {s.formula}")
        print(format_matrix_pair(s.key, s.numpy, s.autograd))
        print(f"    error {s.error:.1e} <= {s.bound:.0e}: {'ok' if s.passed else 'FAIL'}")
        print()
    worst = max(w.steps, key=lambda s: s.error)
    n_ok = sum(s.passed for s in w.steps)
    print(f"{n_ok}/{len(w.steps)} intermediates agree with autograd within the float64 bound "
          f"{FLOAT64_BOUND:.0e} (largest error {worst.error:.1e}, {worst.key})")


def to_json(w):
    return {
        "module": w.module, "dropout": w.dropout, "upstream": w.G.tolist(),
        "bound": FLOAT64_BOUND, "passed": w.passed,
        "steps": [{"key": s.key, "label": s.label, "formula": s.formula,
                   "shape": list(s.numpy.shape), "numpy": s.numpy.tolist(),
                   "autograd": s.autograd.tolist(), "error": s.error,
                   "bound": s.bound, "passed": s.passed} for s in w.steps],
    }


def plot(w, directory):
    """One PNG per attention (w, dw, da) and one of G and dx."""
    paths = []
    by_key = {s.key: s for s in w.steps}
    for prefix, (weights, g) in w.softmax_rows.items():
        da = by_key.get(f"{prefix}scaled_scores", by_key.get(f"{prefix}attn_scores")).numpy
        heads = weights.reshape(-1, *weights.shape[-2:])
        for h in range(heads.shape[0]):
            tag = (prefix.rstrip(".") or "") + (f"h{h}" if heads.shape[0] > 1 else "")
            name = f"{w.module}_softmax{'_' + tag if tag else ''}.png"
            mats = [heads[h], g.reshape(heads.shape)[h], da.reshape(heads.shape)[h]]
            paths.append(plots.heatmaps(os.path.join(directory, name), mats,
                                        ["attn_weights w", "dL/dw", "dL/d(softmax input)"],
                                        suptitle=f"{w.module} {tag}".strip(),
                                        labels=example.TOKENS, cmap="coolwarm"))
    dx = by_key["x"].numpy
    paths.append(plots.heatmaps(os.path.join(directory, f"{w.module}_dx.png"),
                                [w.G.reshape(-1, w.G.shape[-1]), dx.reshape(-1, dx.shape[-1])],
                                ["G = dL/dz", "dL/dx"], suptitle=w.module, cmap="coolwarm"))
    return paths


def _blockwise(args):
    w = blockwise_walk.walk(args.tile or blockwise_walk.DEFAULT_TILE)
    blockwise_walk.print_walk(w)
    if args.token is not None:
        print()
        blockwise_walk.print_zoom(w, args.token)
    return 0 if w.passed else 1


def main(argv=None):
    args, status = parse_verb_args(parse_args, argv)
    if status is not None:            # --help, a refused argument, --plot without matplotlib
        return status
    if args.blockwise:
        return _blockwise(args)
    w = steps.walk(args.module, args.dropout)
    print_walk(w)
    if args.token is not None:
        print()
        zoom.print_zoom(w, args.token)
    if args.plot:
        plots.announce(plot(w, args.plot))
    if args.json:
        text = json.dumps(to_json(w), indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text)
    return 0 if w.passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
