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
