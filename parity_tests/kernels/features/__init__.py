"""The features production kernels add: one module each, and this registry listing them.

A feature (``Feature``) declares, in its own module, everything the check needs to test it.
As FlexAttention splits "what changes the scores" from "which keys a query sees", a feature
is a few declarations and a few functions, and the runner asks for them, never for its name.

The core, what every feature has:

- ``name``, ``help``: its name on the command line and its line in ``--help`` (and the table
  of docs/features.md);
- ``cases(causal, plan)``: the cases it adds (a `cases.Case` carries the feature's value in
  ``case.features``), and ``label(value)``: its part of a case's name;
- ``inputs``: its inputs (`Input`: a bias, sinks, slopes, FP8's descales; or q, k, v
  declared again, FP8's stored in float8), each saying where it goes, its dtype and whether
  it is differentiated;
- ``options``: its value as options (`Option`: a window, a softcap, ``dropout_p``), each
  saying where it goes;
- ``draw``: a hook (below) returning the inputs it draws or changes;
- ``mistakes(ctx, value)``: the mistakes it invites (``mistakes.Hypothesis``), each the
  reference recomputed with that mistake's options or knob;
- ``apply(case, rng)``: the feature added to a case of another shape, so that features meet
  each other (every pair requested, and all of them together) and run at ``--tokens``;
- ``excludes``: ``{feature: why}``, the features it cannot be combined with.

Optional groups, for what a few features need:

- `Calling`, how the kernel is called: ``layout``, ``widen``, ``hand``, ``reference``,
  ``arguments``, ``recover``; ``run_wide`` (it changes how every case of the run is called
  or judged: its mistakes are tried on every case), ``returns_lse``, ``lse_gradient``,
  ``repeats``, ``random``; ``keywords`` beyond its inputs and options;
- `Judging`, how a row is judged: ``forward_only``, ``dtypes`` (the dtypes its cases run
  in), ``baselines`` (the formulations it adds to the baseline's), ``aligned``,
  ``alignment_mistake``, ``lse_form``, ``reduced`` (a gradient summed over rows, bounded by
  that sum's rounding), ``inputs_error`` (the error of its inputs' own rounding, reported
  beside the verdict);
- `Shrinking`, how ``check --repro`` shrinks a case: ``fit``, ``head_counts``, ``shape``.

Hooks name the arguments they use (pluggy's way): ``def draw(value, inputs)`` receives
those two, by name; a hook naming an argument its call does not offer is a TypeError when
the feature is registered (`HOOKS` lists what each offers; the feature's own name is
``value`` too: ``def draw(softcap, inputs)``).  Which built-in targets express a feature
is the target's own field (``targets.Target.features``).
"""

import inspect
from dataclasses import dataclass, field, fields, replace
from importlib import import_module
from itertools import combinations

import numpy as np

from parity_tests.kernels import cases, variations

__all__ = ["Feature", "Input", "Option", "Calling", "Judging", "Shrinking", "HOOKS", "FEATURES", "REGISTRY",
           "INPUTS", "INPUT_GRADS", "NO_GRAD", "PER_HEAD", "CORE", "parse_features", "require", "declared", "layout",
           "declared_inputs", "handed_inputs", "differentiated_inputs", "stored_inputs", "per_head", "feature_cases",
           "label", "ordered", "Plan", "takes_form"]

# What each hook may name, by hook: exactly what its call offers.
HOOKS = {
    "draw": ("case", "value", "inputs", "rng", "seed"),               # -> {name: array} drawn or changed
    "reference": ("case", "value", "inputs", "align"),                # -> the reference's options
    "arguments": ("case", "value", "tensors", "inputs", "device", "dtype", "align"),   # -> the keywords
    # -> (args, kw); unread: what memory no one should read holds (NaN; 0 where the diagnosis asks)
    "hand": ("case", "value", "args", "kw", "inputs", "device", "dtype", "align", "unread"),
    "recover": ("case", "value", "inputs", "opts", "caller", "seed", "device", "dtype", "align"),
    "lse_form": ("case", "value", "inputs", "align", "lse"),
    "reduced": ("case", "value", "inputs", "golden", "align"),        # -> {tensor: the sizes its sum adds}
    "key_ranges": ("case", "value"),                                   # -> [(start, stop)] of the keys
}


class Hook:
    """A feature's function called with the arguments it names (`HOOKS`)."""

    def __init__(self, feature, hook, fn):
        offered = HOOKS[hook] + (feature,)
        params = inspect.signature(fn).parameters.values()
        for p in params:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name not in offered:
                raise TypeError(f"feature {feature!r}: its {hook} hook names {p.name!r}; {hook} offers "
                                f"{', '.join(HOOKS[hook])} (and {feature}, its value)")
        self.feature, self.hook, self.fn, self.names = feature, hook, fn, tuple(p.name for p in params)

    def __call__(self, **offered):
        missing = set(HOOKS[self.hook]) - set(offered)
        if missing:                                   # the runner's own defect: every call offers all
            raise TypeError(f"{self.hook} called without {', '.join(sorted(missing))}")
        if self.feature not in HOOKS[self.hook]:
            offered[self.feature] = offered["value"]
        return self.fn(**{n: offered[n] for n in self.names})


@dataclass(frozen=True)
class Input:
    """An input a feature adds beside q, k, v and dO (or one of those it declares again)."""
    name: str                  # its name in the inputs, the reference's options and the callable's keywords
    dtype: str = "case"        # "case": rounded to the tested dtype; "float32" (sinks, slopes, descales), or a
    #                            float8 dtype: stored in it, divided by ``scale`` (FP8's q, k, v)
    scale: str = None          # the input (B, Hkv) its stored values are multiplied by (FP8's descales)
    to: tuple = ("kernel", "reference")   # where it goes: the callable; the reference's options (and so the
    #                            dense baseline's and the catalogue's, which take the same)
    grad: bool = False         # the callable differentiates it: "d" + name is judged as a tensor
    ties: bool = True          # ties heads, batch entries or rows together: no slice is recomputed alone
    per_head: bool = False     # one value per query head, (H,) (else broadcastable to (B, H, Tq, Tk))
    no_grad: str = None        # with grad: the catalogue's id of its gradient never reaching it

    @property
    def handed(self):
        return "kernel" in self.to


@dataclass(frozen=True)
class Option:
    """A feature's value as one option: ``convert(value)`` is the reference's option (and the
    dense formula's) named ``name`` and the callable's keyword of that name, where ``to`` says."""
    name: str
    convert: object = lambda value: value
    to: tuple = ("kernel", "reference")


@dataclass(frozen=True)
class Calling:
    """How the kernel is called on the feature's cases (each field optional)."""
    keywords: tuple = ()       # what the callable receives beyond its inputs and options (varlen's cu_seqlens)
    reference: object = None   # hook -> the reference's options (None: its inputs and options, by name)
    arguments: object = None   # hook -> the callable's keywords (None: its handed inputs and options, by name)
    hand: object = None        # hook -> (args, kw): what the callable is handed instead, after the layout
    layout: object = None      # the layout it wants (None: the target's): a name ("bthd"), or the methods
    #                            of call.Strided for another (varlen's packed thd)
    widen: object = None       # run-wide: case -> the case as this feature runs it (paged pages every case)
    recover: object = None     # hook -> (inputs learnt from the target, findings): dropout's mask
    run_wide: bool = False     # changes how every case of the run is called or judged
    returns_lse: bool = False  # the callable returns (out, lse), and lse is judged
    lse_gradient: bool = False  # a random gradient flows back through lse too
    repeats: bool = False      # each case is called twice and compared bitwise
    random: bool = False       # its kernel draws from torch's global RNG (seeded by the check): moving
    #                            the RNG is no remark, and SDPA's own draw is no yardstick for it


@dataclass(frozen=True)
class Judging:
    """How the feature's rows are judged (each field optional)."""
    forward_only: bool = False  # its cases judge out (and lse) alone
    dtypes: tuple = None       # the tested dtypes its cases run in (None: any)
    baselines: tuple = ()      # formulations added to the baseline's (``dense.attention``'s ``weights``)
    aligned: bool = False      # its keys or weights move with the alignment of Tq ≠ Tk (a window, ALiBi)
    alignment_mistake: object = None   # (ctx) -> (id, says) naming the other alignment in its terms, or None
    lse_form: object = None    # hook -> (lse, note, note_else): another lse its kernels return, accepted
    #                            when closer (ALiBi's FlashAttention form)
    reduced: object = None     # hook -> {tensor: Σ |terms|}: a gradient it sums over rows into a few numbers
    #                            (dsinks), its bound at least that sum's rounding (`tolerances.reduction_floor`)
    inputs_error: bool = False  # the error of its inputs' own rounding (FP8's quantisation: the golden
    #                            on the drawn inputs against the golden on the rounded) beside the verdict
    key_ranges: object = None  # hook -> [(start, stop)]: the key ranges its kernels compute apart (split-KV's
    #                            splits), in order, so that keys a reading finds lost are said in those ranges


@dataclass(frozen=True)
class Shrinking:
    """How ``check --repro`` shrinks the feature's cases (each field optional)."""
    fit: object = lambda case, value: value   # (case of new sizes, value) -> the value fitting it, or None
    head_counts: object = None  # (case, value) -> [(heads, value)], smallest first: what a shrunk case may take
    shape: str = None          # the field of the case's shape its value is: "kv_heads" (GQA), "v_dim", "seqlens"


def _declared_options(case, value, inputs, align, feature=None):
    return {**{i.name: inputs[i.name] for i in feature.inputs
               if "reference" in i.to and i.name in inputs and i.name not in CORE},
            **{o.name: o.convert(value) for o in feature.options if "reference" in o.to}}


def _declared_keywords(case, value, tensors, inputs, device, dtype, align, feature=None):
    return {**{i.name: tensors[i.name] for i in feature.inputs
               if i.handed and i.name in tensors and i.name not in CORE},
            **{o.name: o.convert(value) for o in feature.options if "kernel" in o.to}}


@dataclass(frozen=True)
class Feature:
    name: str
    help: str
    cases: object = lambda causal, plan: []
    label: object = lambda value: ""
    inputs: tuple = ()              # its inputs (`Input`)
    options: tuple = ()             # its value as options (`Option`)
    draw: object = None             # hook -> {name: array}: the inputs it draws (from rng) or changes
    mistakes: object = lambda ctx, value: []
    apply: object = None            # (case, rng) -> the case with this feature added, or None
    excludes: dict = field(default_factory=dict)   # {feature: why} it cannot be combined with
    calling: Calling = Calling()
    judging: Judging = Judging()
    shrinking: Shrinking = Shrinking()

    def __post_init__(self):
        calling = self.calling
        if calling.reference is None:
            calling = replace(calling, reference=_bound(_declared_options, self))
        if calling.arguments is None:
            calling = replace(calling, arguments=_bound(_declared_keywords, self))
        hook = lambda name, fn: fn if fn is None or isinstance(fn, Hook) else Hook(self.name, name, fn)
        object.__setattr__(self, "draw", hook("draw", self.draw))
        object.__setattr__(self, "calling", replace(calling, **{n: hook(n, getattr(calling, n)) for n in
                                                                ("reference", "arguments", "hand", "recover")}))
        object.__setattr__(self, "judging", replace(self.judging, **{n: hook(n, getattr(self.judging, n)) for n in
                                                                  ("lse_form", "reduced", "key_ranges")}))

    @property
    def keywords(self):
        """What the callable receives on the feature's cases: its handed inputs, options and
        `Calling.keywords` (a callable whose signature lacks one is a usage error: `require`)."""
        handed = tuple(i.name for i in self.inputs if i.handed and i.name not in CORE) + \
            tuple(o.name for o in self.options if "kernel" in o.to)
        return tuple(dict.fromkeys(handed + self.calling.keywords))

    def declares(self, name):
        """The value of field ``name`` in whichever group has it (`Calling`, `Judging`, `Shrinking`)."""
        for group in (self.calling, self.judging, self.shrinking):
            if name in _FIELDS[type(group)]:
                return getattr(group, name)
        raise AttributeError(f"no feature group has a field {name!r}")


_FIELDS = {g: {f.name for f in fields(g)} for g in (Calling, Judging, Shrinking)}


def _bound(fn, feature):
    """``fn`` with ``feature`` given, its signature the hook's (so `Hook` reads its names)."""
    def bound(**kw):
        return fn(**kw, feature=feature)
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "feature"]
    bound.__signature__ = inspect.Signature(params)
    return bound


@dataclass(frozen=True)
class Plan:
    """What a feature's cases may depend on: the run's seed, whether the callable takes
    ``align`` (then both alignments are drawn), the run's own cases."""
    seed: int = 0
    takes_align: bool = False
    grid: tuple = field(default=())   # the run's own cases when --tokens chose their lengths


# The registry: one module per feature, in this order (help, parsing, the table of docs/features.md).
FEATURES = ("gqa", "value_dim", "window", "softcap", "alibi", "bias", "sinks", "varlen", "lse",
            "lse_grad", "decode", "deterministic", "paged", "splits", "dropout", "fp8", "fp8_kv")


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
            raise ValueError(f"features: {f} ({REGISTRY[f].excludes[clash[0]]}) cannot be combined with "
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


def takes_form(fn, feature):
    """Whether ``fn``'s signature names every keyword ``feature`` passes: the form of call it
    takes (a ``**kwargs`` does not say which)."""
    params = _parameters(fn) or {}
    return all(kw in params for kw in REGISTRY[feature].keywords)


def declared(features, field):
    """Whether any of ``features`` (names; the grid's own variations among them are not
    features) declares ``field`` (`Feature.declares`): what the runner asks instead of a
    feature's name."""
    return any(REGISTRY[n].declares(field) for n in features if n in REGISTRY)


def layout(features):
    """The layout of q and out the features want (None: the target's); the first in registry
    order wins (varlen's packed thd before paged's bthd)."""
    return next((REGISTRY[n].calling.layout for n in FEATURES if n in features and REGISTRY[n].calling.layout),
                None)


def layout_name(layout):
    """A layout's name: ``"bthd"`` as it is, a declared layout's ``name`` (varlen's ``"thd"``)."""
    return layout if layout is None or isinstance(layout, str) else layout.name


# The inputs every case has; a feature may declare them again (FP8 stores q, k, v in float8).
CORE = ("q", "k", "v", "dout")


def key_ranges(case):
    """(feature, [(start, stop)]) of the key ranges ``case``'s kernel computes apart, as the first of
    its features declaring `Judging.key_ranges` gives them; None where none does."""
    for name, value in case.features:
        hook = REGISTRY[name].judging.key_ranges if name in REGISTRY else None
        if hook is not None:
            return name, hook(case=case, value=value)
    return None


def declared_inputs(features):
    """{name: `Input`} of the extra inputs ``features`` (names) declare (not q, k, v, dO)."""
    return {i.name: i for n in features if n in REGISTRY for i in REGISTRY[n].inputs if i.name not in CORE}


def per_head(scale, heads):
    """A (B, Hkv) scale as (B, heads, 1, 1): query head h takes kv head h // (heads / Hkv)'s."""
    scale = np.asarray(scale, dtype=np.float64)
    return np.repeat(scale, heads // scale.shape[1], axis=1)[:, :, None, None]


def stored_inputs(case):
    """{name: `Input`} of q, k, v as ``case``'s features declare them again (FP8's, in float8)."""
    return {i.name: i for n, _ in case.features if n in REGISTRY for i in REGISTRY[n].inputs if i.name in CORE}


def handed_inputs(case):
    """{name: `Input`} of the extra inputs the callable is handed on ``case``."""
    return {n: i for n, i in declared_inputs(dict(case.features)).items() if i.handed}


def differentiated_inputs(case, present):
    """The extra inputs of ``case`` (those ``present`` among the drawn ones) whose gradient
    the callable gives, and the check judges as ``"d" + name``."""
    return [n for n, i in handed_inputs(case).items() if i.grad and n in present]


def require(target, features):
    """ValueError, before any case, for a feature the target cannot be given."""
    lse = [f for f in features if REGISTRY[f].calling.returns_lse]
    if lse and target.returns_lse is False:
        raise ValueError(f"features: {lse[0]!r} needs a target that returns (out, lse), and {target.name} "
                         "returns out alone")
    for f in features:
        missing = [kw for kw in REGISTRY[f].keywords if not _accepts(target.fn, kw)]
        if missing:
            raise ValueError(f"features: {f!r} passes {', '.join(k + '=' for k in missing)} to the target, "
                             f"and {target.name}'s signature has no such keyword")
        if target.features is not None and f not in target.features and not REGISTRY[f].calling.returns_lse:
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
    own = list(dict.fromkeys(c for f in FEATURES if f in features for cz in causal
                             for c in REGISTRY[f].cases(cz, plan)))
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
INPUT_GRADS = tuple("d" + n for n, i in INPUTS.items() if i.grad)    # dbias, dsinks: judged as tensors
NO_GRAD = {"d" + n: i.no_grad for n, i in INPUTS.items() if i.grad}  # their catalogue ids when none arrives
PER_HEAD = tuple(n for n, i in INPUTS.items() if i.per_head)         # (H,) inputs: sinks, slopes
cases.FEATURE_VIEWS.update(ordered=ordered, label=label,
                           forward_only=lambda name: name in REGISTRY and REGISTRY[name].judging.forward_only,
                           shape=lambda name: REGISTRY[name].shrinking.shape if name in REGISTRY else None)
