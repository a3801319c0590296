"""One field declaration for every typed config key, and the one pass that checks what a type cannot say.

Why metadata and not Enums or ``Literal``: OmegaConf 2.3 has no ``Literal`` type, and an Enum field
would change how a value prints (``config.yaml`` and ``--cfg job`` must not change, and code compares
``str(cfg.train.precision) == "bf16"``). So a choice is a ``str`` field whose allowed values, like a
numeric field's range, sit in the field's metadata; :func:`check` walks every field of a typed node
once and refuses a value outside them with the message every check in ``sdp`` uses (key, value, what
is allowed). Types (int, float, bool, ``Optional``) are OmegaConf's own: ``train.steps=abc`` never
gets here, it is refused while Hydra composes the config.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Iterable, Optional

from omegaconf import DictConfig, OmegaConf

from sdp.errors import fail

MISSING = "???"  # omegaconf.MISSING: the value comes from the YAML preset (conf/), never from the schema


def key(*, choices: Iterable[str] | None = None, at_least: float | None = None, above: float | None = None,
        at_most: float | None = None) -> Any:
    """A schema field: ``choices`` for a ``str`` key, a range for a number (``at_least`` inclusive,
    ``above`` exclusive, ``at_most`` inclusive). The default is MISSING: values live in ``conf/*.yaml``
    (with their comments); a YAML that forgets a key composes to ``???`` and fails where it is read."""
    meta = {"choices": tuple(choices) if choices is not None else None, "at_least": at_least, "above": above,
            "at_most": at_most}
    return dataclasses.field(default=MISSING, metadata=meta)


def allowed(*, meta: dict[str, Any], integer: bool) -> str:
    """What a field's metadata allows, in the words of :mod:`sdp.errors`' helpers."""
    if meta.get("choices") is not None:
        return f"allowed: {', '.join(map(str, meta['choices']))}"
    lo, above, hi = meta.get("at_least"), meta.get("above"), meta.get("at_most")
    if integer and lo is not None:
        return f"must be an integer >= {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")
    if above is not None and hi is not None:
        return f"must be a number in ({above:g}, {hi:g}]"
    if above is not None:
        return f"must be a number > {above:g}"
    return f"must be a number >= {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")


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
            fail(name, value, allowed(meta=meta, integer=hints[f.name] in (int, Optional[int])))
