"""Pieces more than one verb family uses, and nothing verb-specific:

- ``tolerances``      every bound the suite holds a comparison to, each with its reason
- ``finite_diff``     centred finite differences: the oracle that needs no PyTorch
- ``faults``          the catalogue of planted mistakes the checks must catch (with
                      ``blockwise_faults``), and ``swapped``, which plants them
- ``chapter_values``  the chapter's inputs, seeds and printed numbers
- ``tables``          plain-text tables
- ``verdicts``        rows of claim / computed / chapter / verdict, and a verb's argument step
- ``plots``           PNG heatmaps (matplotlib, the ``plot`` extra)
- ``outputs``         output paths and seeds, checked before any work
- ``options``         dtype names and comma-separated lists as every verb reads them
- ``help_text``       a module docstring as plain ``--help`` text
- ``seeding``         ``torch.manual_seed`` without its cost on a machine without accelerators
- ``flex``            FlexAttention as the targets call it: compiled on CUDA, untraced on the CPU
"""
