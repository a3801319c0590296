"""One field declaration for every typed config key, and the one pass that checks what a type cannot say.

Why metadata and not Enums or ``Literal``: OmegaConf 2.3 has no ``Literal`` type, and an Enum field
would change how a value prints (``config.yaml`` and ``--cfg job`` must not change, and code compares
``str(cfg.train.precision) == "bf16"``). So a choice is a ``str`` field whose allowed values, like a
numeric field's range, sit in the field's metadata; :func:`check` walks every field of a typed node
once and refuses a value outside them with the message every check in ``sdp`` uses (key, value, what
is allowed). Types (int, float, ``Optional``) are OmegaConf's own: ``train.steps=abc`` never
gets here, it is refused while Hydra composes the config; a ``bool`` field (:func:`flag`) has a node of its own,
:class:`StrictBool`, since OmegaConf's takes ``2`` or ``off`` as a bool. :func:`conform` is the same check for a node
whether or not a schema typed it: what a strategy's ``validate`` runs on its ``parallelism`` node, so a
plugin's own untyped YAML under a package strategy is held to the very same fields. :func:`choices_of` is how
code that acts on a choice reads the allowed values from the field, so each set is written once.

Here, in the bottom layer, because every schema uses it: the driver's (``sdp/driver/schema*.py``) and each
strategy's own, declared in its module in ``sdp/parallel/`` (which must not import the driver).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Iterable, List, Optional, Union

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError
from omegaconf.nodes import BooleanNode

from sdp.errors import ConfigError, fail

MISSING = "???"  # omegaconf.MISSING: the value comes from the YAML preset (conf/), never from the schema
Number = Union[int, float]  # OmegaConf 2.3 keeps 25 as 25 and 0.5 as 0.5 (a float field would print 25.0)


def key(*, choices: Iterable[str] | None = None, at_least: float | None = None, above: float | None = None,
        at_most: float | None = None, below: float | None = None) -> Any:
    """A schema field: ``choices`` for a ``str`` key, a range for a number (``at_least`` / ``at_most`` inclusive,
    ``above`` / ``below`` exclusive; for a list of numbers, every element's). The default is MISSING: values live
    in ``conf/*.yaml`` (with their comments); a YAML that forgets a key composes to ``???`` and fails where it is read."""
    meta = {"choices": tuple(choices) if choices is not None else None, "at_least": at_least, "above": above,
            "at_most": at_most, "below": below}
    return dataclasses.field(default=MISSING, metadata=meta)


def choices_of(schema: type, name: str) -> tuple[str, ...]:
    """The values field ``name`` of ``schema`` allows: what code that acts on the key compares with, read from the
    one declaration (the field's ``choices``) rather than written again beside the code."""
    found = [f for f in dataclasses.fields(schema) if f.name == name]
    assert found and found[0].metadata.get("choices") is not None, \
        f"{schema.__name__}.{name} is not a choice field of {[f.name for f in dataclasses.fields(schema)]}"
    return found[0].metadata["choices"]


class StrictBool(BooleanNode):
    """The node of a ``bool`` field (:func:`flag`): true or false, nothing else. OmegaConf's own ``BooleanNode``
    turns ``2``, ``yes``, ``off`` or ``0`` into a bool without a word, so ``train.deterministic=2`` or
    ``parallelism.overlap=off`` ran as something the user may not have meant. Taken: a boolean (what YAML and
    Hydra's command line read ``true`` / ``false`` as, in any case) and the strings ``true`` / ``false`` in any
    case (what a quoted value or an ``${oc.env:...}`` interpolation gives), the same two words either way."""

    def _validate_and_convert_impl(self, value: Any) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ValidationError("Value '$VALUE' is not a valid bool (type $VALUE_TYPE): allowed: true, false")

    def __deepcopy__(self, memo: dict[int, Any]) -> "StrictBool":
        res = StrictBool()  # BooleanNode's own copy would come back as a plain (coercing) BooleanNode
        self._deepcopy_impl(res, memo)
        return res


def flag() -> Any:
    """A ``bool`` schema field: its node is a :class:`StrictBool` (MISSING until the YAML sets it, never null)."""
    return dataclasses.field(default_factory=lambda: StrictBool(value=MISSING, is_optional=False),
                             metadata={"choices": None, "at_least": None, "above": None, "at_most": None, "below": None})


def allowed(*, meta: dict[str, Any], integer: bool, optional: bool = False) -> str:
    """What a field's metadata allows, in the words of :mod:`sdp.errors`' helpers (``optional``: null as well)."""
    if meta.get("choices") is not None:
        return f"allowed: {', '.join(['null'] * optional + [str(c) for c in meta['choices']])}"
    lo, above, hi, below = (meta.get(k) for k in ("at_least", "above", "at_most", "below"))
    low, high = (lo, "[") if lo is not None else (above, "("), (hi, "]") if hi is not None else (below, ")")
    kind = "an integer" if integer else "a number"
    if low[0] is not None and high[0] is not None:
        what = f"{kind} in {low[1]}{low[0]:g}, {high[0]:g}{high[1]}"
    else:
        bounds = [f"{op} {v:g}" for op, v in ((">=", lo), (">", above), ("<=", hi), ("<", below)) if v is not None]
        what = f"{kind} {' and '.join(bounds)}"
    return f"must be {'null or ' if optional else ''}{what}"


def ok(value: Any, meta: dict[str, Any]) -> bool:
    if meta.get("choices") is not None:
        return value in meta["choices"]
    lo, above, hi, below = (meta.get(k) for k in ("at_least", "above", "at_most", "below"))
    return ((lo is None or value >= lo) and (above is None or value > above)
            and (hi is None or value <= hi) and (below is None or value < below))


def check(node: DictConfig, *, schema: type, prefix: str) -> None:
    """Every field of ``schema`` in ``node`` (e.g. ``cfg.train``, typed by it) against its metadata, nested
    nodes included; a key absent from an older recorded config (MISSING, or not there) and ``null`` are skipped."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        name = f"{prefix}.{f.name}" if prefix else f.name
        if f.name not in node or OmegaConf.is_missing(node, f.name):
            continue
        value = node[f.name]
        if isinstance(value, DictConfig) and dataclasses.is_dataclass(hints[f.name]):
            check(value, schema=hints[f.name], prefix=name)
            continue
        meta = dict(f.metadata)
        if value is None or not any(v is not None for v in meta.values()):
            continue
        hint = hints[f.name]
        integer = hint in (int, Optional[int], List[int])
        if isinstance(value, ListConfig):  # a list of numbers (model.blocks_per_stage, optim.optimizer.betas): each
            items = OmegaConf.to_container(value, resolve=True)
            if not all(v is not None and ok(v, meta) for v in items):
                fail(name, items, f"each element {allowed(meta=meta, integer=integer)}")
        elif not ok(value, meta):
            fail(name, value, allowed(meta=meta, integer=integer, optional=type(None) in typing.get_args(hint)))


def readable(exc: OmegaConfBaseException, *, prefix: str = "") -> ConfigError:
    """OmegaConf's refusal as one ConfigError line: key (under ``prefix``), value and type (its message names both)."""
    what = str(getattr(exc, "msg", None) or exc).splitlines()[0]
    key = ".".join(k for k in (prefix, getattr(exc, "full_key", None)) if k)
    return ConfigError(f"{key or '<config>'} is invalid: {what}")


def conform(node: DictConfig, *, schema: type, prefix: str) -> None:
    """:func:`check` of ``node`` whether or not ``schema`` typed it. Typed (every preset of ``conf/``: the driver's
    parse checked it already) it is only checked again; untyped (a plugin's own YAML under a package strategy,
    docs/strategies.md, whose keys no parse typed) its keys of ``schema`` are merged into the schema first, so a
    wrong type is OmegaConf's refusal named by key, as while composing; keys ``schema`` lacks are the strategy's."""
    kind = OmegaConf.get_type(node)
    if not (isinstance(kind, type) and issubclass(kind, schema)):
        given = OmegaConf.to_container(node, resolve=True)
        known = {f.name for f in dataclasses.fields(schema)}
        typed = OmegaConf.structured(schema)
        try:
            typed.merge_with({k: v for k, v in given.items() if k in known})
        except OmegaConfBaseException as exc:
            raise readable(exc, prefix=prefix) from None
        node = typed
    check(node, schema=schema, prefix=prefix)
