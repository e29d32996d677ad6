"""``--plot DIR``: PNG heatmaps of what the verbs print as numbers.

matplotlib is an optional extra (``pip install "attention-parity[plot]"``).  It is
imported only when ``--plot`` is given, and drawn through the Agg canvas directly
(no pyplot, no display, no global backend switch).  Every figure has a fixed
size in pixels, `pixel_size(panels)`: 500 x 400 for one heatmap, 900 x 400 for two.
"""

import sys

import numpy as np

from parity_tests.common import outputs

INSTALL_HINT = ("--plot needs matplotlib, an optional extra: "
                "pip install 'attention-parity[plot]'  (or: pip install matplotlib)")
PANEL_INCHES = 4.0        # each heatmap is 4 x 4 inches, plus 1 inch for the colour bar
DPI = 100
TOKENS = ["Your", "journey", "starts", "with", "one", "step"]


def _matplotlib():
    """(Figure, FigureCanvasAgg), or None when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        return None
    return Figure, FigureCanvasAgg


def check_available(plot_dir):
    """Exit status 2 with one line when ``--plot`` was asked for and matplotlib is
    missing (the install hint) or the directory cannot be written; ``None`` when
    plotting can go ahead (the directory then exists) or was not asked for."""
    if plot_dir is None:
        return None
    if _matplotlib() is None:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    problem = outputs.output_dir_problem("--plot", plot_dir)     # created when missing
    if problem:
        print(f"attention-parity: error: {problem}", file=sys.stderr)
        return 2
    return None


def pixel_size(panels):
    """(width, height) in pixels of a figure of ``panels`` side-by-side heatmaps."""
    return (int((PANEL_INCHES * panels + 1) * DPI), int(PANEL_INCHES * DPI))


def _draw(ax, matrix, title, labels, vmin, vmax, cmap, first, axis_titles, aspect="equal"):
    m = np.asarray(matrix, dtype=float)
    im = ax.imshow(m, cmap=cmap, vmin=vmin, vmax=vmax, aspect=aspect, interpolation="nearest")
    ax.set_title(title, fontsize=9)
    xlabel, ylabel = axis_titles
    ax.set_xlabel(xlabel, fontsize=8)
    if first:
        ax.set_ylabel(ylabel, fontsize=8)
    rows, cols = m.shape
    if labels is not None and len(labels) == cols:
        ax.set_xticks(range(cols), labels, rotation=45, fontsize=7)
    if labels is not None and len(labels) == rows and first:
        ax.set_yticks(range(rows), labels, fontsize=7)
    elif not first:
        ax.set_yticks([])
    if rows * cols <= 100:             # small enough to read the numbers
        for i in range(rows):
            for j in range(cols):
                r, g, b, _ = im.cmap(im.norm(m[i, j]))
                light = 0.299 * r + 0.587 * g + 0.114 * b > 0.5
                ax.text(j, i, f"{m[i, j]:.2f}", ha="center", va="center", fontsize=6,
                        color="black" if light else "white")
    return im


def heatmaps(path, matrices, titles, suptitle=None, labels=None,
             vmin=None, vmax=None, cmap="viridis", axis_titles=("key", "query"), aspect="equal"):
    """Side-by-side heatmaps in one PNG of `pixel_size` pixels; returns ``path``.

    ``axis_titles`` = (columns, rows): what the axes are (attention weights:
    ("key", "query")); ``labels`` name the ticks (tokens) when they mean that."""
    fig = figure(matrices, titles, suptitle, labels, vmin, vmax, cmap, axis_titles, aspect)
    fig.savefig(path, dpi=DPI)
    return path


def figure(matrices, titles, suptitle=None, labels=None, vmin=None, vmax=None,
           cmap="viridis", axis_titles=("key", "query"), aspect="equal"):
    """The matplotlib Figure `heatmaps` saves."""
    Figure, FigureCanvasAgg = _matplotlib()
    width, height = pixel_size(len(matrices))
    # fixed margins (in inches, as fractions of the figure): cheaper than a layout engine
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI)
    fig.subplots_adjust(left=0.8 * DPI / width, right=1 - 1.0 * DPI / width,
                        bottom=0.2, top=0.86, wspace=0.15)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(matrices), squeeze=False)[0]
    for i, (ax, m, title) in enumerate(zip(axes, matrices, titles)):
        im = _draw(ax, m, title, labels, vmin, vmax, cmap, i == 0, axis_titles, aspect)
    fig.colorbar(im, ax=list(axes), shrink=0.7, fraction=0.046 / len(axes), pad=0.03)
    if suptitle:
        fig.suptitle(suptitle, fontsize=10)
    return fig


def heatmap(path, matrix, title, labels=None, vmin=None, vmax=None, cmap="viridis",
            axis_titles=("key", "query"), aspect="equal", suptitle=None):
    return heatmaps(path, [matrix], [title], suptitle=suptitle, labels=labels, vmin=vmin, vmax=vmax, cmap=cmap,
                    axis_titles=axis_titles, aspect=aspect)


def announce(paths):
    for p in paths:
        print(f"wrote {p}")
