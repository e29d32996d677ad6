"""The backprop lab: for people learning backpropagation through attention by hand.

Two commands and a folder of exercises:

- ``attention-parity backprop`` (`walkthrough`): the chapter's six-token example
  run backwards, pass by pass, every intermediate gradient shown with its shape,
  its formula, ``numpy_ref``'s numbers, autograd's numbers and their difference;
  ``--token N`` zooms on one softmax row (`zoom`).
- ``attention-parity grade FILE[:NAME]`` (`grade`): checks a learner's own backward
  (a softmax backward, a scores backward, a linear layer backward, a softcap's
  backward, a sink's gradient, or a whole module) against the reference and finite differences, and when a tensor is
  wrong names the classic mistake that explains it (`mistakes`).
- ``exercises/``: starter files with the bodies to fill in, and their solutions;
  ``attention-parity grade --list`` and ``--template NAME`` hand them out.

Pieces: `example` (the chapter's input, seeded weights, upstream gradient),
`trace_numpy` / `trace_torch` (each side's intermediates), `steps` (the rows of
the walkthrough), `loader` (importing the learner's file), `exercises_catalog`
(what each exercise asks for and how it is checked).
"""
