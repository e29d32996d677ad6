"""Starter files for the backprop lab, and their solutions.

Each template has the interface the grader checks, a docstring with every shape,
the derivation's first line as a hint, and a body to fill in.  Copy one with
``attention-parity grade --template NAME`` (``--list`` shows them), fill it in,
then ``attention-parity grade NAME.py``.  ``solutions/`` holds a worked answer
for each: read it after trying.
"""
