"""``--plot DIR``: PNGs of a known pixel size; without matplotlib, exit 2 and say
how to install it."""

import sys

import numpy as np
import pytest

from parity_tests.chapter import replay as chapter
from parity_tests.chapter import claims
from parity_tests.chapter import jacobian
from parity_tests.common import plots


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.fixture
def no_matplotlib(monkeypatch):
    """Make ``import matplotlib...`` fail as it does where it is not installed."""
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends",
                 "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize("verb", [chapter, jacobian, claims], ids=["chapter", "jacobian", "claims"])
def test_without_matplotlib_the_flag_exits_2_with_the_install_hint(verb, no_matplotlib, tmp_path, capsys):
    assert verb.main(["--plot", str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    assert "pip install 'attention-parity[plot]'" in err
    assert "pip install matplotlib" in err
    assert out == ""                                   # refused before any work
    assert not (tmp_path / "out").exists()


def test_without_matplotlib_and_without_the_flag_nothing_changes(no_matplotlib, capsys):
    assert jacobian.main([]) == 0


def test_jacobian_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert jacobian.main(["--plot", str(tmp_path)]) == 0
    png = tmp_path / "softmax_jacobian.png"
    assert png.stat().st_size > 1000
    assert png_size(png) == plots.pixel_size(2) == (900, 400)
    assert f"wrote {png}" in capsys.readouterr().out


def test_heatmap_sizes_and_the_directory_is_created(tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / "a" / "b"
    assert plots.check_available(str(target)) is None
    one = plots.heatmap(str(target / "one.png"), np.eye(3), "eye")
    assert png_size(target / "one.png") == plots.pixel_size(1) == (500, 400)
    assert one.endswith("one.png")
    assert plots.pixel_size(3) == (1300, 400)


def _captured_figures(monkeypatch, draw):
    """Every figure ``draw()`` asks `plots.heatmaps` for, built but not saved."""
    pytest.importorskip("matplotlib")
    figures = {}

    def capture(path, matrices, titles, suptitle=None, labels=None, vmin=None, vmax=None,
                cmap="viridis", axis_titles=("key", "query"), aspect="equal"):
        figures[path.rsplit("/", 1)[-1]] = (
            plots.figure(matrices, titles, suptitle, labels, vmin, vmax, cmap, axis_titles, aspect),
            labels)
        return path

    monkeypatch.setattr(plots, "heatmaps", capture)
    draw()
    return figures


def _axis_titles(fig):
    axes = [ax for ax in fig.axes if ax.get_images()]          # not the colour bar
    return [ax.get_xlabel() for ax in axes], axes[0].get_ylabel()


def test_every_chapter_plot_names_its_axes(monkeypatch, tmp_path):
    from parity_tests.chapter import replay_causal
    from parity_tests.common import chapter_values
    figures = _captured_figures(monkeypatch,
                                lambda: replay_causal.write_plots(str(tmp_path), chapter_values))
    assert set(figures) == {"attention_simplified.png", "attention_causal.png",
                            "attention_heads.png", "dropout_mask.png"}
    for name, (fig, labels) in figures.items():
        xlabels, ylabel = _axis_titles(fig)
        if name.startswith("attention"):
            assert set(xlabels) == {"key"} and ylabel == "query", name
            assert labels == plots.TOKENS
        else:                     # Dropout(0.5) on a matrix of ones: no tokens there
            assert set(xlabels) == {"column"} and ylabel == "row", name
            assert labels is None


def test_jacobian_plot_names_its_axes_and_says_when_a_panel_is_left_out(
        monkeypatch, tmp_path, capsys):
    figures = _captured_figures(monkeypatch, lambda: jacobian.main(
        ["--scores=-1,2,-3,0.5,-2,1,-4,3,-1.5,0.25", "--plot", str(tmp_path)]))
    fig, _ = figures["softmax_jacobian.png"]
    xlabels, ylabel = _axis_titles(fig)
    assert xlabels == ["score x_j"] and ylabel == "weight w_i"   # one panel: softmax only
    out = capsys.readouterr().out
    assert "shows the softmax Jacobian only" in out and "S = -4.7500 <= 0" in out


def test_claims_plot_names_its_axes(monkeypatch, tmp_path):
    monkeypatch.setattr(claims, "sections", lambda seed: [])     # the plot alone
    figures = _captured_figures(monkeypatch,
                                lambda: claims.main(["--plot", str(tmp_path)]))
    xlabels, ylabel = _axis_titles(figures["scaled_vs_unscaled.png"][0])
    assert set(xlabels) == {"key"} and ylabel == "query"
