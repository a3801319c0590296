"""The typed config (sdp/driver/schema*.py and each strategy's own schema, ``StrategySpec.schema``): every preset
composes into its strategy's schema, a wrong type is refused by Hydra/OmegaConf while composing and a wrong choice
or range by the driver's one parse, each naming the key; recorded run configs (written before some keys existed)
still parse; each set of allowed values is written once in ``sdp/``. Single process, Hydra's compose API only."""

from __future__ import annotations

import ast
import dataclasses
import sys
import typing
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from sdp.driver import schema, schema_data, schema_models
from sdp.driver.schema import CLUSTERS, Eval, Optim, RootConfig, Train
from sdp.driver.typed import parse
from sdp.errors import ConfigError
from sdp.parallel import STRATEGIES
from sdp.parallel.spec import schemas
from tests.hydra_cfg import compose_config

REPO = Path(__file__).resolve().parent.parent
# the driver's schema modules and every module a strategy declares its schema in (read from the registry)
SCHEMA_MODULES = tuple(dict.fromkeys([schema, schema_models, schema_data,
                                      *(sys.modules[s.__module__] for s in schemas().values())]))
PRESET_FILES = sorted(p.stem for p in (REPO / "conf" / "parallelism").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESET_FILES)
def test_every_parallelism_preset_composes_into_its_schema(preset: str) -> None:
    cfg = compose_config(f"parallelism={preset}")
    kind = OmegaConf.get_type(cfg.parallelism)
    assert kind is STRATEGIES.get(str(cfg.parallelism.name)).schema, (preset, kind)
    assert OmegaConf.get_type(cfg.train) is Train and OmegaConf.get_type(cfg.eval) is Eval, preset
    assert OmegaConf.get_type(cfg.optim) is Optim and OmegaConf.get_type(cfg.cluster) is CLUSTERS["local"], preset
    assert OmegaConf.missing_keys(cfg) == set(), f"{preset}: keys the YAML does not set: {OmegaConf.missing_keys(cfg)}"
    typed = parse(cfg)
    assert typed.parallelism is cfg.parallelism and typed.train is cfg.train, "a composed config is used as it is"


@pytest.mark.parametrize("overrides", [["cluster=slurm"], ["cluster=slurm_gpu"], ["optim=adamw"], ["experiment=smoke"],
                                       ["experiment=cpu_study_lm", "variant=b_sdp_c100"]])
def test_other_groups_compose_typed(overrides: list[str]) -> None:
    cfg = compose_config(*overrides)
    assert OmegaConf.get_type(cfg.cluster) is CLUSTERS[str(cfg.cluster.name)], overrides
    assert OmegaConf.missing_keys(cfg) == set(), (overrides, OmegaConf.missing_keys(cfg))
    parse(cfg)


@pytest.mark.parametrize("override, key, words", [
    ("train.steps=abc", "train.steps", ["'abc'", "Integer"]),                      # int
    ("train.batch_size=3.5", "train.batch_size", ["3.5", "Integer"]),
    ("parallelism.coverage=high", "parallelism.coverage", ["'high'", "Union[int, float]"]),  # number
    ("cluster.timeout_s=soon", "cluster.timeout_s", ["'soon'", "Union[int, float]"]),
    ("train.deterministic=maybe", "train.deterministic", ["'maybe'", "bool"]),      # bool
    ("memory.tracker=sometimes", "memory.tracker", ["'sometimes'", "bool"]),
])
def test_a_wrong_type_is_refused_while_composing(override: str, key: str, words: list[str]) -> None:
    with pytest.raises(ConfigCompositionException) as info:
        compose_config("parallelism=sdp", override)
    message = f"{info.value} {info.value.__cause__}"
    for part in [key, *words]:
        assert part in message, f"{override}: expected {part!r} in: {message}"


@pytest.mark.parametrize("override, expect", [
    ("parallelism.masking=sideways", "parallelism.masking='sideways' is invalid: allowed: forward, backward"),
    ("train.precision=fp16", "train.precision='fp16' is invalid: allowed: fp32, bf16"),
    ("cluster.device=tpu", "cluster.device='tpu' is invalid: allowed: cpu, cuda"),
    ("parallelism.coverage=1.5", "parallelism.coverage=1.5 is invalid: must be a number in (0, 1]"),
    ("train.steps=0", "train.steps=0 is invalid: must be an integer >= 1"),
    ("parallelism.balance.flops=-1", "parallelism.balance.flops=-1 is invalid: must be a number >= 0"),
])
def test_a_wrong_choice_or_range_is_refused_by_the_parse(override: str, expect: str) -> None:
    cfg = compose_config("parallelism=sdp", override)  # a str or number of the right type: composes
    with pytest.raises(ConfigError) as info:
        parse(cfg)
    assert str(info.value) == expect, str(info.value)


@pytest.mark.parametrize("preset, change, expect", [
    ("sdp", {"groups": 0}, "parallelism.groups=0 is invalid: must be an integer >= 1"),
    ("sdp", {"groups": "many"}, "parallelism.groups is invalid: Value 'many' of type 'str' could not be converted to Integer"),
    ("sdp", {"resample_every": 0}, "parallelism.resample_every=0 is invalid: must be null or an integer >= 1"),
    ("sdp", {"balance": {"params": 1, "flops": -1, "activations": 1}}, "parallelism.balance.flops=-1 is invalid: must be a number >= 0"),
    ("ddp_ac", {"ac_every": 0}, "parallelism.ac_every=0 is invalid: must be an integer >= 1"),
    ("ddp_layerdrop", {"decay": "linear"}, "parallelism.decay='linear' is invalid: allowed: uniform"),
    ("ddp_stochastic_depth", {"survival_prob": 0}, "parallelism.survival_prob=0 is invalid: must be a number in (0, 1]"),
    ("fsdp", {"reshard_after_forward": "maybe"},
     "parallelism.reshard_after_forward is invalid: Value 'maybe' is not a valid bool (type str): allowed: true, false"),
    ("pipeline", {"schedule": "zb"}, "parallelism.schedule='zb' is invalid: allowed: gpipe, 1f1b, interleaved_1f1b"),
    ("local_sgd", {"inner_steps": 0}, "parallelism.inner_steps=0 is invalid: must be an integer >= 1"),
], ids=["sdp-range", "sdp-type", "sdp-optional", "sdp-nested", "ddp_ac", "layerdrop", "stochastic_depth", "fsdp", "pipeline",
        "local_sgd"])
def test_an_untyped_preset_under_a_package_strategy_is_held_to_its_schema(
        monkeypatch: pytest.MonkeyPatch, preset: str, change: dict, expect: str) -> None:
    """A plugin's own YAML that extends no schema (docs/strategies.md), under a package strategy's spec: the parse
    leaves it untyped (no schema has its name), and the strategy's ``validate`` holds the keys it shares with the
    package's preset to the same dataclass (sdp.core.fields.conform); its own keys are its strategy's."""
    from sdp.driver.config import validate
    from sdp.parallel import STRATEGIES

    plugin = type("UntypedPlugin", (STRATEGIES.get(preset),), {"name": "untyped_plugin_test"})
    monkeypatch.setitem(STRATEGIES._items, plugin.name, plugin)
    cfg = compose_config("experiment=smoke", "model=mlp", f"parallelism={preset}")
    node = {**OmegaConf.to_container(cfg.parallelism), "name": plugin.name, "own_key": 1}
    cfg.parallelism = OmegaConf.create(node)
    assert OmegaConf.get_type(cfg.parallelism) is dict and parse(cfg).parallelism is None, "the parse must leave it untyped"
    validate(cfg)  # the package preset's values and a key of its own: valid
    cfg.parallelism = OmegaConf.create({**node, **change})
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert str(info.value) == expect, str(info.value)


def test_a_plugins_own_schema_types_its_untyped_yaml(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin strategy that declares a schema of its own: its YAML cannot extend it (the schemas are stored before
    the driver imports ``plugins``), so the driver's parse types the node by ``parallelism.name``, read from the
    registry, with the same checks and one-line messages as a package preset's (before: no table named it, and
    nothing checked its keys)."""
    from sdp.core.fields import key
    from sdp.driver.config import validate
    from sdp.parallel.ddp import DDPConfig, DDPSpec

    @dataclasses.dataclass
    class OwnConfig(DDPConfig):
        order: str = key(choices=("forward", "reverse"))
        """A key of the plugin's own."""

    plugin = type("OwnSchemaPlugin", (DDPSpec,), {"name": "own_schema_plugin_test", "schema": OwnConfig})
    monkeypatch.setitem(STRATEGIES._items, plugin.name, plugin)
    cfg = compose_config("experiment=smoke", "model=mlp", "parallelism=ddp")
    node = {**OmegaConf.to_container(cfg.parallelism), "name": plugin.name, "order": "reverse"}
    cfg.parallelism = OmegaConf.create(node)
    assert OmegaConf.get_type(parse(cfg).parallelism) is OwnConfig, "the parse types the plugin's node by its name"
    validate(cfg)
    for change, expect in [({"order": "sideways"}, "parallelism.order='sideways' is invalid: allowed: forward, reverse"),
                           ({"bucket_cap_mb": 0}, "parallelism.bucket_cap_mb=0 is invalid: must be a number > 0")]:
        cfg.parallelism = OmegaConf.create({**node, **change})
        with pytest.raises(ConfigError) as info:
            validate(cfg)
        assert str(info.value) == expect, str(info.value)


def test_a_preset_of_another_family_refuses_keys_it_lacks() -> None:
    with pytest.raises(ConfigCompositionException, match="coverage"):
        compose_config("parallelism=ddp", "parallelism.coverage=0.5")


def test_values_print_as_written() -> None:
    """Union[int, float], not float: ``coverage: 1`` and ``bucket_cap_mb: 25`` stay ints (config.yaml unchanged)."""
    cfg = compose_config("experiment=cpu_study_lm", "variant=b_sdp_c100", "parallelism.bucket_cap_mb=0.01")
    assert repr(cfg.parallelism.coverage) == "1" and repr(cfg.parallelism.bucket_cap_mb) == "0.01"
    assert repr(compose_config("parallelism=ddp").parallelism.bucket_cap_mb) == "25"


RESULTS = REPO / "benchmarks" / "results"
# One recorded run per suite (benchmarks/results/<suite>/<sub>/<set>/...) and the studies' main runs: every era
# and shape of config.yaml, in seconds (sdp-rerun and train.skip_done read them).
RECORDED = sorted({*{p.relative_to(RESULTS).parts[:3]: p for p in sorted(RESULTS.rglob("config.yaml"), reverse=True)
                     if ".hydra" not in p.parts}.values(), *RESULTS.glob("cpu-study/*/runs/main/0/config.yaml")})


def test_recorded_run_configs_parse() -> None:
    """``sdp-rerun`` composes a run's config.yaml as written (untyped); the driver's parse types it. Some were
    written before a key existed (train.tf32, eval.ensemble): absent keys stay absent, nothing is refused."""
    assert len(RECORDED) >= 5, RECORDED
    older = []
    for path in RECORDED:
        cfg = OmegaConf.load(path)
        typed = parse(cfg)
        assert OmegaConf.get_type(typed.train) is Train, path
        older += [path] if "tf32" not in cfg.train else []
    assert older, "no recorded config predates train.tf32 any more: pick another key for this test"
    cfg = OmegaConf.load(older[0])
    cfg.train.steps = "abc"
    with pytest.raises(ConfigError, match=r"train.steps is invalid: Value 'abc' of type 'str' could not be converted to Integer"):
        parse(cfg)
    cfg = OmegaConf.load(older[0])
    cfg.train.nan_policy = "ignore"
    with pytest.raises(ConfigError, match=r"train.nan_policy='ignore' is invalid: allowed: stop, skip"):
        parse(cfg)


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


@pytest.mark.parametrize("given, expect", [("true", True), ("false", False), ("True", True), ("FALSE", False),
                                           ("'false'", False), ("'True'", True)])
def test_a_boolean_key_takes_the_words_true_and_false(given: str, expect: bool) -> None:
    """Unquoted (Hydra's grammar reads a boolean, any case) or quoted (a string: what an ``${oc.env:..}`` gives),
    the same two words mean the same thing."""
    cfg = compose_config("parallelism=sdp", f"train.deterministic={given}", f"parallelism.overlap={given}")
    assert cfg.train.deterministic is expect and cfg.parallelism.overlap is expect, (given, cfg.train.deterministic)


@pytest.mark.parametrize("key", ["train.deterministic", "eval.ensemble", "parallelism.overlap", "memory.tracker",
                                 "logger.progress"])
@pytest.mark.parametrize("given", ["2", "0", "1", "yes", "no", "off", "on", "y", "'1'"])
def test_a_boolean_key_refuses_anything_else(key: str, given: str) -> None:
    """OmegaConf's own bool node takes 2, yes, off, 0 ... as a bool without a word (``train.deterministic=2`` ran
    deterministic); a ``bool`` field of the schema (sdp.core.fields.StrictBool) refuses them, naming the key."""
    with pytest.raises(ConfigCompositionException) as info:
        compose_config("parallelism=sdp", f"{key}={given}")
    message = f"{info.value} {info.value.__cause__}"
    for part in (f"full_key: {key}", "is not a valid bool", "allowed: true, false"):
        assert part in message, f"{key}={given}: expected {part!r} in: {message}"


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
