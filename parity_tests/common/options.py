"""Options several verbs share: dtype names as users type them, and comma-separated
lists in which a value naming nothing ('' or ',') is refused, never read as the
default."""

DTYPE_ALIASES = {"f64": "float64", "double": "float64", "fp64": "float64",
                 "f32": "float32", "float": "float32", "fp32": "float32",
                 "bf16": "bfloat16", "f16": "float16", "fp16": "float16", "half": "float16"}


def dtype_name(name):
    """``name`` as the suite spells dtypes: ``"bf16"`` / ``torch.bfloat16`` -> ``"bfloat16"``."""
    name = str(name).lower().removeprefix("torch.")
    return DTYPE_ALIASES.get(name, name)


def split_list(values, flag):
    """The items given to a repeatable, comma-separated option ``flag``
    (``None``: not given, ``[]``); ValueError for a value that names nothing."""
    items = []
    for value in values or []:
        parts = [v.strip() for v in value.split(",") if v.strip()]
        if not parts:
            raise ValueError(f"{flag} needs at least one name; got {value!r}")
        items += parts
    return items
