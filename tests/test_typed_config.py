"""The typed config (sdp/driver/schema*.py and each strategy's own schema, ``StrategySpec.schema``): every preset
composes into its strategy's schema, a wrong type is refused by Hydra/OmegaConf while composing and a wrong choice
or range by the driver's one parse, each naming the key; a boolean key takes true or false only; recorded run configs
(written before some keys existed) still parse. Single process, Hydra's compose API only. What every schema's
declarations must hold (a docstring, a range, a strict bool, each set of allowed values written once) is
tests/test_schema_fields.py's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from sdp.driver.schema import CLUSTERS, Eval, Optim, Train
from sdp.driver.typed import parse
from sdp.errors import ConfigError
from sdp.parallel import STRATEGIES
from tests.hydra_cfg import compose_config

REPO = Path(__file__).resolve().parent.parent
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
