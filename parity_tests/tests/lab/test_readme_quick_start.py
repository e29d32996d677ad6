"""The README's Quick start: a CPU-only reader learns about PyTorch's CPU build before
the first command that would fetch a CUDA one, and the test command it gives installs
what the notebook and plot tests need (or says that they are skipped)."""

import pathlib

README = pathlib.Path(__file__).resolve().parents[3] / "README.md"


def _quick_start():
    text = README.read_text()
    start = text.index("## Quick start")
    return text[start:text.index("\n## ", start + 1)]


def test_the_cpu_note_comes_before_the_commands():
    section = _quick_start()
    assert section.index("download.pytorch.org/whl/cpu") < section.index("```bash")


def test_the_test_command_runs_the_notebook_and_plot_tests():
    section = _quick_start()
    command = next(line for line in section.splitlines() if "&& pytest" in line)
    assert '".[test,plot]"' in command
