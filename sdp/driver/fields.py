"""One field declaration for every typed config key, and the one pass that checks what a type cannot say.

Why metadata and not Enums or ``Literal``: OmegaConf 2.3 has no ``Literal`` type, and an Enum field
would change how a value prints (``config.yaml`` and ``--cfg job`` must not change, and code compares
``str(cfg.train.precision) == "bf16"``). So a choice is a ``str`` field whose allowed values, like a
numeric field's range, sit in the field's metadata; :func:`check` walks every field of a typed node
once and refuses a value outside them with the message every check in ``sdp`` uses (key, value, what
is allowed). Types (int, float, bool, ``Optional``) are OmegaConf's own: ``train.steps=abc`` never
gets here, it is refused while Hydra composes the config. :func:`conform` is the same check for a node
whether or not a schema typed it: what a strategy's ``validate`` runs on its ``parallelism`` node, so a
plugin's own untyped YAML under a package strategy is held to the very same fields.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Iterable, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sdp.errors import ConfigError, fail

MISSING = "???"  # omegaconf.MISSING: the value comes from the YAML preset (conf/), never from the schema


def key(*, choices: Iterable[str] | None = None, at_least: float | None = None, above: float | None = None,
        at_most: float | None = None) -> Any:
    """A schema field: ``choices`` for a ``str`` key, a range for a number (``at_least`` inclusive,
    ``above`` exclusive, ``at_most`` inclusive). The default is MISSING: values live in ``conf/*.yaml``
    (with their comments); a YAML that forgets a key composes to ``???`` and fails where it is read."""
    meta = {"choices": tuple(choices) if choices is not None else None, "at_least": at_least, "above": above,
            "at_most": at_most}
    return dataclasses.field(default=MISSING, metadata=meta)


def allowed(*, meta: dict[str, Any], integer: bool, optional: bool = False) -> str:
    """What a field's metadata allows, in the words of :mod:`sdp.errors`' helpers (``optional``: null as well)."""
    if meta.get("choices") is not None:
        return f"allowed: {', '.join(['null'] * optional + [str(c) for c in meta['choices']])}"
    lo, above, hi = meta.get("at_least"), meta.get("above"), meta.get("at_most")
    if integer and lo is not None:
        what = f"an integer >= {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")
    elif above is not None and hi is not None:
        what = f"a number in ({above:g}, {hi:g}]"
    elif above is not None:
        what = f"a number > {above:g}"
    else:
        what = f"a number >= {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")
    return f"must be {'null or ' if optional else ''}{what}"


def ok(value: Any, meta: dict[str, Any]) -> bool:
    if meta.get("choices") is not None:
        return value in meta["choices"]
    lo, above, hi = meta.get("at_least"), meta.get("above"), meta.get("at_most")
    return ((lo is None or value >= lo) and (above is None or value > above)
            and (hi is None or value <= hi))


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
        if not ok(value, meta):
            fail(name, value, allowed(meta=meta, integer=hints[f.name] in (int, Optional[int]),
                                      optional=type(None) in typing.get_args(hints[f.name])))


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
