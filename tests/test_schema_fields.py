"""What every schema declares (sdp/driver/schema*.py and each strategy's own, ``StrategySpec.schema``), read from the
dataclasses and the source rather than by composing: every field has a type and a docstring, every number a range,
every bool the strict node, each set of allowed values is written once in ``sdp/``, and every number or boolean a
built node's YAML sets (model, dataset, optimizer) is a field of its target's schema. How the typed config composes
and refuses values is tests/test_typed_config.py's."""

from __future__ import annotations

import ast
import dataclasses
import sys
import typing
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from sdp.driver import schema, schema_data, schema_models
from sdp.driver.schema import RootConfig
from sdp.parallel.spec import schemas
from tests.hydra_cfg import compose_config

REPO = Path(__file__).resolve().parent.parent
# the driver's schema modules and every module a strategy declares its schema in (read from the registry)
SCHEMA_MODULES = tuple(dict.fromkeys([schema, schema_models, schema_data,
                                      *(sys.modules[s.__module__] for s in schemas().values())]))


def string_literals(path: Path) -> list[tuple[frozenset[str], int]]:
    """(values, line) of every tuple, list or set literal of two or more strings in ``path``, and of every dict
    literal whose two or more keys are all strings (a mapping keyed by the allowed values declares them too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        items = node.keys if isinstance(node, ast.Dict) else node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else []
        if len(items) >= 2 and all(isinstance(v, ast.Constant) and isinstance(v.value, str) for v in items):
            out.append((frozenset(v.value for v in items), node.lineno))
    return out


def test_each_set_of_allowed_values_is_written_once() -> None:
    """A choice field's values are written once in ``sdp/``: in the field (``key(choices=(...))``), read by the code
    that acts on them with ``choices_of``, or, where that code sits below the schema's layer, in the code's tuple,
    which the field names (not a copy that a test keeps equal)."""
    choices = {}
    for cls, f, _ in schema_fields():
        values = f.metadata.get("choices")
        if values is not None and len(values) >= 2:
            choices.setdefault(frozenset(values), set()).add(f"{cls.__name__}.{f.name}")
    assert len(choices) >= 20, f"only {len(choices)} choice sets found: the walk misses schemas"
    written: dict[frozenset[str], list[str]] = {}
    for path in sorted((REPO / "sdp").rglob("*.py")):
        for values, line in string_literals(path):
            if values in choices:
                written.setdefault(values, []).append(f"{path.relative_to(REPO)}:{line}")
    again = {", ".join(sorted(choices[v])): where for v, where in written.items() if len(where) > 1}
    assert not again, f"allowed values written more than once (field: places): {again}"
    assert len(written) >= 20, f"only {len(written)} choice sets found written in sdp/: the scan misses literals"


def is_schema(obj: object) -> bool:
    """A schema dataclass: fields declared with ``key()`` / ``flag()`` (not a strategy module's other dataclasses)."""
    return dataclasses.is_dataclass(obj) and any("choices" in f.metadata for f in dataclasses.fields(obj))


def test_every_field_has_a_type_and_a_docstring() -> None:
    for module in SCHEMA_MODULES:
        tree = ast.parse(Path(module.__file__).read_text())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and is_schema(getattr(module, n.name))):
            body = cls.body
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.AnnAssign):
                    nxt = body[i + 1] if i + 1 < len(body) else None
                    documented = isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant)
                    assert documented, f"{module.__name__}.{cls.name}.{ast.unparse(stmt.target)} has no docstring"
    assert [f.name for f in dataclasses.fields(RootConfig)][:3] == ["seed", "plugins", "train"], "the root's key order"


def schema_fields() -> list[tuple[type, dataclasses.Field, object]]:
    """(dataclass, field, type hint) of every field of every schema module."""
    out = []
    for module in SCHEMA_MODULES:
        for cls in vars(module).values():
            if isinstance(cls, type) and is_schema(cls) and cls.__module__ == module.__name__:
                hints = typing.get_type_hints(cls)
                out += [(cls, f, hints[f.name]) for f in dataclasses.fields(cls)]
    return out


def test_every_boolean_field_is_strict() -> None:
    """Every ``bool`` field of every schema is declared with :func:`sdp.core.fields.flag` (a plain ``key()``
    would give OmegaConf's coercing node again), never null."""
    from sdp.core.fields import StrictBool

    bools = [(cls, f) for cls, f, hint in schema_fields() if hint is bool]
    assert len(bools) >= 25, f"only {len(bools)} bool fields found: the walk misses schemas"
    for cls, f in bools:
        node = OmegaConf.structured(cls)._get_node(f.name)
        assert type(node) is StrictBool and not node._is_optional(), (cls.__name__, f.name, type(node).__name__)


def test_every_numeric_field_has_a_range() -> None:
    from sdp.core.fields import Number

    numeric = {int, float, Number, typing.Optional[int], typing.Optional[Number], typing.List[int], typing.List[Number]}
    fields = [(cls, f) for cls, f, hint in schema_fields() if hint in numeric]
    assert len(fields) >= 80, f"only {len(fields)} numeric fields found: the walk misses schemas"
    for cls, f in fields:
        assert any(f.metadata.get(k) is not None for k in ("at_least", "above", "at_most", "below")), (cls.__name__, f.name)


BUILT = {"model": schema_models.MODELS, "dataset": schema_data.DATASETS, "optim": schema_models.OPTIMIZERS}


@pytest.mark.parametrize("group", sorted(BUILT))
def test_every_number_and_boolean_of_a_built_node_has_its_schema(group: str) -> None:
    """Each ``conf/<group>/*.yaml`` whose target has a schema: every key holding a number, a list of numbers or a
    boolean is a field of it (so it has a type and a range), and every field is an argument of the target."""
    import inspect

    from hydra.utils import get_object

    checked = 0
    for path in sorted((REPO / "conf" / group).glob("*.yaml")):
        text = "llama" in path.stem or (group == "dataset" and path.stem in ("synthetic_text", "fineweb"))
        pair = ("model=llama_tiny", "dataset=synthetic_text") if text else ("model=mlp", "dataset=synthetic_image")
        node = compose_config(*pair, f"{group}={path.stem}")[group]
        node = node.optimizer if group == "optim" else node
        given = OmegaConf.to_container(node, resolve=True)
        schema_cls = BUILT[group].get(given["_target_"])
        assert schema_cls is not None, f"conf/{group}/{path.name}: {given['_target_']} has no schema in {BUILT[group]}"
        declared = {f.name for f in dataclasses.fields(schema_cls)}
        params = inspect.signature(get_object(given["_target_"])).parameters
        assert declared <= set(params), (path.name, sorted(declared - set(params)))
        for k, v in ((k, v) for k, v in given.items() if not k.startswith("_")):  # _target_, _partial_: Hydra's
            values = v if isinstance(v, list) else [v]
            if values and all(isinstance(x, (int, float, bool)) for x in values):
                assert k in declared, f"conf/{group}/{path.name}: {k}={v!r} has no field in {schema_cls.__name__}"
                checked += 1
    assert checked >= 5, f"only {checked} keys checked: the walk misses keys"


def test_a_shared_key_is_declared_once() -> None:
    """Schemas whose keys mean the same extend the one that declares them (DDP's presets ``DDPConfig``, the drop
    baselines DDP's ``DDPReducerConfig``, the generated token datasets ``GeneratedTextArgs``), so a key is written
    once; a field a schema declares again, over its base's, must change the rule (a tighter range), not copy it."""
    from sdp.driver.schema_data import AutomatonArgs, GeneratedTextArgs, PointerArgs, SyntheticTextArgs
    from sdp.parallel.ddp import DDPConfig, DDPReducerConfig
    from sdp.parallel.ddp_ac import DDPACConfig
    from sdp.parallel.ddp_drop import DropConfig
    from sdp.parallel.powersgd import PowerSGDConfig

    families = {DDPConfig: (DDPACConfig, PowerSGDConfig), DDPReducerConfig: (DDPConfig, DropConfig),
                GeneratedTextArgs: (SyntheticTextArgs, PointerArgs, AutomatonArgs)}
    for base, members in families.items():
        apart = [m.__name__ for m in members if not issubclass(m, base)]
        assert not apart, f"{apart} repeat {base.__name__}'s keys instead of extending it"
    again = []
    for cls, f, _ in schema_fields():
        if f.name not in vars(cls).get("__annotations__", {}):
            continue  # inherited: declared once, in the base
        for base in cls.__mro__[1:]:
            above = {g.name: g for g in dataclasses.fields(base)} if is_schema(base) else {}
            if f.name in above and above[f.name].metadata == f.metadata:
                again.append(f"{cls.__name__}.{f.name} (as in {base.__name__})")
    assert not again, f"fields declared again with their base's rule: {again}"

