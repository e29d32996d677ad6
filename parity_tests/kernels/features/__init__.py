"""The features production kernels add: one module each, and this registry listing them.

A feature (``Feature``) declares, in its own module, everything the check needs
to test it -- as FlexAttention splits "what changes the scores" from "which keys
are seen", each piece here is one function:

- ``name``, ``help``: its name on the command line and its line in ``--help``
  (and the table of docs/features.md);
- ``keywords``: what the callable receives on the feature's cases, its handed inputs and
  options included (a callable whose signature lacks one is a usage error before any case
  runs: `require`);
- ``cases(causal, plan)``: the cases it adds (a `cases.Case` carries the feature's
  value in ``case.features``);
- ``label(value)``: its part of a case's name;
- ``inputs``: its extra inputs (`Input`: a bias, sinks, slopes, dropout's keep mask), each
  declared once with how it is handed, rounded, differentiated and sliced;
- ``options``: its value as options (`Option`: a window, a softcap, ``dropout_p``,
  ``num_splits``), each declared once with whether the reference (and the dense formula, by
  the same name) and the callable receive it.

Its hooks on a case each receive one context, `At` (the case, the feature's value on it,
the inputs, the seed, device, dtype and alignment):

- ``draw(at)``: adds its inputs to ``at.inputs`` (the float64 arrays that ``q``, ``k``, ``v``,
  ``dout`` start), drawn from ``at.rng``;
- ``reference(at)``: the options it passes to ``numpy_ref.reference_attention`` (and,
  being the same names, to the dense baseline and the catalogue's mistakes); by default
  its declared inputs and options, by name;
- ``kwargs(at)``: the keywords the callable receives; by default its handed inputs (as the
  tensors ``at.tensors``) and its options, by name;
- ``mistakes(ctx, value)``: the mistakes it invites (``mistakes.Hypothesis``), each the
  reference recomputed with that mistake's options or knob;
- ``hand(at, args, kw) -> (args, kw)``: what the callable is handed instead, after the
  layout transform (``args``: ``{"q", "k", "v"}`` in call order; ``paged`` hands
  ``k_cache``, ``v_cache`` and a block table; ``dropout`` seeds torch there, just before
  each call);
- ``recover(at, caller)``: what it learns from the target itself, before the golden is
  computed (``dropout``: the kernel's mask, put into ``at.inputs``; ``at.opts`` the
  reference's options without it); returns what it found wrong, each with ``tensors``
  (those it fails), ``id`` and ``sentence``;
- ``lse_form(at, lse)``: another form of lse its kernels return (ALiBi's in FlashAttention).

and on the run and its shapes: ``apply(case, rng)``: the feature added to a case of another
shape, so that features meet each other (every pair requested, and all of them together)
and run at the lengths given with ``--tokens``; ``layout``: the layout it wants (``paged``:
``bthd``; ``varlen``: its own packed ``thd``, an object with `call.Dense`'s methods);
``widen(case)``: a run-wide feature's form of every case of the run (``paged`` pages each
one); ``forward_only``: its cases judge the forward alone; ``fit(case, value)`` and
``head_counts(case, value)``: its value made to fit a case of new sizes and the head counts
it allows (``check --repro`` shrinking a case: a bias's shape, the sequences' lengths, GQA's
groups); ``aligned`` and ``alignment_mistake``: its keys move with the alignment, and its
own name for the other alignment's mistake (``decode``: the queries placed top-left);
``sets``: the case's shape its value is (``Case.hkv``, ``dv``, ``seqlens``: GQA's kv heads,
value_dim's Dv, varlen's lengths).

Features that change how *every* case runs are ``run_wide``: their mistakes are tried on
every case of a run that asks for them, and what they change is a field the runner asks
(`asks`), never their name: ``returns_lse`` (the callable returns (out, lse), judged too),
``lse_gradient`` (a random gradient flows back through lse), ``repeats`` (each case is
called twice and compared bitwise), ``layout`` (``varlen``: FlashAttention's packed
``thd``; ``paged``: ``bthd``).
Which built-in targets express a feature is the target's own field
(``targets.Target.features``).
"""

import inspect
from dataclasses import dataclass, field, replace
from functools import partial
from importlib import import_module
from itertools import combinations

from parity_tests.kernels import cases, variations

__all__ = ["Feature", "Input", "Option", "At", "FEATURES", "REGISTRY", "INPUTS", "parse_features", "require", "asks",
           "layout", "declared_inputs", "handed_inputs", "differentiated_inputs", "feature_cases", "label", "ordered", "Plan", "help_line"]


@dataclass(frozen=True)
class Input:
    """An extra input a feature draws (or learns from the target) beside q, k, v."""
    name: str                  # its name in the inputs, the reference's options and the callable's keywords
    rounded: bool = True       # rounded to the tested dtype (False: float32, as kernels keep sinks and slopes)
    grad: bool = False         # the callable differentiates it: "d" + name is judged as a tensor
    handed: bool = True        # handed to the callable as a tensor (False: learnt from it, dropout's mask)
    ties: bool = True          # ties heads, batch entries or rows together: no slice is recomputed alone


@dataclass(frozen=True)
class Option:
    """A feature's value as one option: ``convert(value)`` is the reference's option (and the
    dense formula's) named ``name`` and the callable's keyword of that name, where declared."""
    name: str
    convert: object = lambda value: value
    reference: bool = True     # numpy_ref.reference_attention (and the dense formula) takes it
    keyword: bool = True       # the callable receives it


@dataclass
class At:
    """What a feature's hook receives about the case at hand, one context for every hook:
    the case and the feature's value on it; the float64 inputs (q, k, v, dout and the
    features', rounded to the dtype once drawn); the run's seed, device, dtype and alignment;
    ``rng``, the case's generator (``draw``); ``tensors``, the handed inputs as the callable
    gets them (``kwargs``); ``opts``, the reference's options (``recover``)."""
    case: object
    value: object = None
    inputs: dict = None
    seed: int = 0
    device: str = "cpu"
    dtype: str = None
    align: str = None
    rng: object = None
    tensors: dict = None
    opts: dict = None


def _declared_options(at, feature=None):
    return {**{i.name: at.inputs[i.name] for i in feature.inputs if i.name in at.inputs},
            **{o.name: o.convert(at.value) for o in feature.options if o.reference}}


def _declared_keywords(at, feature=None):
    return {**{i.name: at.tensors[i.name] for i in feature.inputs if i.handed and i.name in at.tensors},
            **{o.name: o.convert(at.value) for o in feature.options if o.keyword}}


@dataclass(frozen=True)
class Feature:
    name: str
    help: str
    keywords: tuple = ()
    cases: object = lambda causal, plan: []
    label: object = lambda value: ""
    draw: object = lambda at: None  # (`At`) adds its inputs to at.inputs, drawn from at.rng
    inputs: tuple = ()              # its extra inputs (`Input`)
    options: tuple = ()             # its value as options (`Option`): the reference's and the callable's
    reference: object = None        # (at) -> options; None: its inputs and options, by name
    kwargs: object = None           # (at) -> keywords; None: its handed inputs and options, by name
    mistakes: object = lambda ctx, value: []
    apply: object = None            # (case, rng) -> the case with this feature added, or None
    run_wide: bool = False          # changes how every case of the run is called or judged
    hand: object = None             # (at, args, kw) -> (args, kw): what the callable gets
    layout: object = None           # the layout it wants (None: the target's): a name ("bthd"), or the
    #                                 methods of call.Dense for another (varlen's packed thd)
    widen: object = None            # run-wide: case -> the case as this feature runs it
    forward_only: bool = False      # its cases judge out (and lse) alone
    recover: object = None          # (at, caller) -> findings: learnt from the target (at.opts: before it)
    fit: object = lambda case, value: value     # (case of new sizes, value) -> the value fitting it, or None
    excludes: tuple = ()            # the features it cannot be combined with, and why:
    excludes_why: str = ""
    random: bool = False            # its kernel draws from torch's global RNG (seeded by the check): moving
    #                                 the RNG is no remark, and SDPA's own draw is no yardstick for it
    returns_lse: bool = False       # run-wide: the callable returns (out, lse), and lse is judged
    lse_gradient: bool = False      # run-wide: a random gradient flows back through lse too
    repeats: bool = False           # run-wide: each case is called twice and compared bitwise
    aligned: bool = False           # its keys or weights move with the alignment of Tq ≠ Tk (a window, ALiBi)
    alignment_mistake: object = None  # (ctx) -> (id, says) naming the other alignment in its own terms, or None
    lse_form: object = None         # (at, lse) -> (lse, note, note_else): another lse
    #                                 kernels return for it, accepted when closer (ALiBi's FlashAttention form)
    head_counts: object = None      # (case, value) -> [(heads, value)], smallest first: what a shrunk case may take
    sets: str = None                # the case's shape its value is: "kv_heads" (GQA), "v_dim", "seqlens"

    def __post_init__(self):
        handed = tuple(i.name for i in self.inputs if i.handed) + tuple(o.name for o in self.options if o.keyword)
        object.__setattr__(self, "keywords", tuple(dict.fromkeys(self.keywords + handed)))
        if self.reference is None:
            object.__setattr__(self, "reference", partial(_declared_options, feature=self))
        if self.kwargs is None:
            object.__setattr__(self, "kwargs", partial(_declared_keywords, feature=self))


@dataclass(frozen=True)
class Plan:
    """What a feature's cases may depend on: the run's seed, whether the callable takes
    ``align`` (then both alignments are drawn), the run's own cases."""
    seed: int = 0
    takes_align: bool = False
    grid: tuple = field(default=())   # the run's own cases when --tokens chose their lengths


# The registry: one module per feature, in this order (help, parsing, the table of docs/features.md).
FEATURES = ("gqa", "value_dim", "window", "softcap", "alibi", "bias", "sinks", "varlen", "lse",
            "lse_grad", "decode", "deterministic", "paged", "splits", "dropout")


def ordered(values):
    """``{name: value}`` as the (name, value) tuple a `cases.Case` holds, in registry order
    (values of names outside the registry, such as the grid's own ``scale``, last)."""
    rank = {n: i for i, n in enumerate(FEATURES)}
    return tuple(sorted(values.items(), key=lambda kv: rank.get(kv[0], len(rank))))


def label(name, value):
    feature = REGISTRY.get(name)
    if feature is None:                                # the grid's own variations (variations.py)
        return variations.label(name, value)
    return feature.label(value)


def help_line():
    return "; ".join(f"{f.name}: {f.help}" for f in REGISTRY.values())


def parse_features(features):
    """A list of feature names (from a list or ``"a,b"``); ValueError naming an unknown one."""
    if features is None:
        return []
    if isinstance(features, str):
        features = features.split(",")
    names = [str(f).strip().replace("-", "_") for f in features if str(f).strip()]
    unknown = [f for f in names if f not in REGISTRY]
    if unknown:
        raise ValueError(f"features must be among {', '.join(FEATURES)}; got {', '.join(unknown)}")
    for f in names:                                    # what a feature declares it cannot meet
        clash = sorted(set(REGISTRY[f].excludes) & set(names))
        if clash:
            raise ValueError(f"features: {f} ({REGISTRY[f].excludes_why}) cannot be combined with "
                             + " or ".join(clash))
    return list(dict.fromkeys(names))


def _parameters(fn):
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None


def _accepts(fn, keyword):
    """Whether ``fn`` accepts ``keyword`` (yes when its signature cannot be read)."""
    params = _parameters(fn)
    if params is None:
        return True
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    p = params.get(keyword)
    return p is not None and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def declares(fn, feature):
    """Whether ``fn``'s signature names every keyword ``feature`` passes: the form of call it
    takes (a ``**kwargs`` does not say which)."""
    params = _parameters(fn) or {}
    return all(kw in params for kw in REGISTRY[feature].keywords)


def asks(features, field):
    """Whether any of ``features`` (names; the grid's own variations among them are not
    features) declares ``field``: what the runner asks instead of a feature's name."""
    return any(getattr(REGISTRY[n], field) for n in features if n in REGISTRY)


def layout(features):
    """The layout of q and out the features want (None: the target's); the first in registry
    order wins (varlen's packed thd before paged's bthd)."""
    return next((REGISTRY[n].layout for n in FEATURES if n in features and REGISTRY[n].layout), None)


def layout_name(layout):
    """A layout's name: ``"bthd"`` as it is, a declared layout's ``name`` (varlen's ``"thd"``)."""
    return layout if layout is None or isinstance(layout, str) else layout.name


def declared_inputs(features):
    """{name: `Input`} of the extra inputs ``features`` (names) declare."""
    return {i.name: i for n in features if n in REGISTRY for i in REGISTRY[n].inputs}


def handed_inputs(case):
    """{name: `Input`} of the extra inputs the callable is handed on ``case``."""
    return {n: i for n, i in declared_inputs(dict(case.features)).items() if i.handed}


def differentiated_inputs(case, present):
    """The extra inputs of ``case`` (those ``present`` among the drawn ones) whose gradient
    the callable gives, and the check judges as ``"d" + name``."""
    return [n for n, i in handed_inputs(case).items() if i.grad and n in present]


def require(target, features):
    """ValueError, before any case, for a feature the target cannot be given."""
    lse = [f for f in features if REGISTRY[f].returns_lse]
    if lse and target.returns_lse is False:
        raise ValueError(f"features: {lse[0]!r} needs a target that returns (out, lse), and {target.name} "
                         "returns out alone")
    for f in features:
        missing = [kw for kw in REGISTRY[f].keywords if not _accepts(target.fn, kw)]
        if missing:
            raise ValueError(f"features: {f!r} passes {', '.join(k + '=' for k in missing)} to the target, "
                             f"and {target.name}'s signature has no such keyword")
        if target.features is not None and f not in target.features and not REGISTRY[f].returns_lse:
            raise ValueError(f"features: {target.name} does not express {f!r} (it expresses "
                             f"{', '.join(sorted(target.features))})")


def both_alignments(cases, plan):
    """Each case with Tq ≠ Tk in both alignments, when the callable takes ``align``."""
    if not plan.takes_align:
        return cases
    out = []
    for c in cases:
        out += [replace(c, align="top-left"), replace(c, align="bottom-right")] if c.tq != c.tk else [c]
    return out


def feature_cases(features, causal, plan):
    """The added cases of every requested feature, in the order of ``FEATURES``, for each
    value of ``causal`` (a tuple of bools); then the features meeting each other (every
    pair, and all together), and each feature at the run's own lengths (``plan.grid``, from
    ``--tokens``) or, on the default grid, once at `LONG_T`."""
    own = [c for f in FEATURES if f in features for cz in causal for c in REGISTRY[f].cases(cz, plan)]
    meeting = [REGISTRY[f] for f in FEATURES if f in features and REGISTRY[f].apply is not None]
    groups = list(combinations(meeting, 2)) + ([tuple(meeting)] if len(meeting) > 2 else [])
    added = [_applied(cases.Case(2, 4, 61, 83, 64, cz), group, plan.seed) for cz in causal for group in groups]
    added += [_applied(c, (f,), plan.seed) for c in plan.grid for f in meeting]
    # on the default grid, each feature at its long length too, where an error that grows
    # with the distance shows (ALiBi's distances in bfloat16 are exact only up to 256)
    long = cases.Case(1, 2, LONG_T, LONG_T, 64, True in causal)
    added += [_applied(long, (f,), plan.seed) for f in meeting if not plan.grid
              and not any(min(c.tq, c.tk) >= LONG_T and c.get(f.name) is not None for c in own + added if c)]
    return own + [c for c in dict.fromkeys(added) if c is not None]


# The default grid's long length, at which every feature that can be added to a case
# (``apply``) is drawn once.
LONG_T = 1023


def _applied(case, group, seed):
    """``case`` with every feature of ``group`` added (None when one does not fit its shape)."""
    for f in group:
        case = case and f.apply(case, cases.case_rng(seed, case, f.name))
    return case


# Each module imports this one: the registry is filled last, and lends a case its views.
REGISTRY = {name: import_module(f"{__name__}.{name}").FEATURE for name in FEATURES}
INPUTS = declared_inputs(FEATURES)          # every feature's extra inputs, by name
cases.FEATURE_VIEWS.update(ordered=ordered, label=label,
                           forward_only=lambda name: name in REGISTRY and REGISTRY[name].forward_only,
                           sets=lambda name: REGISTRY[name].sets if name in REGISTRY else None)
