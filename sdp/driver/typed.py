"""The schemas in Hydra's ConfigStore, and the driver's one parse of a config into typed nodes.

:func:`register` runs before anything composes ``conf/`` (``sdp.driver.train`` calls it on import, and every
composer imports ``sdp.driver.train`` for ``CONF_DIR`` and the resolvers): the YAMLs name the stored schemas
in their defaults lists. :func:`parse` is what :func:`sdp.driver.config.validate` starts with: a config
composed from ``conf/`` is typed already (its nodes are returned as they are); a run's recorded
``config.yaml`` (``sdp-rerun`` composes it as it was written, without defaults lists) is merged into
the schemas here, so the same types apply; a key it lacks (written before the key existed) stays
absent, and the code that reads it keeps its fallback. Then :func:`sdp.core.fields.check` refuses a
choice or range outside a field's metadata. The ``parallelism`` schemas are the strategies' own
(:attr:`sdp.parallel.spec.StrategySpec.schema`, :func:`sdp.parallel.spec.schemas`): no table here names one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sdp.core import fields
from sdp.core.fields import readable
from sdp.driver.schema import CLUSTERS, Optim, RootConfig, Train
from sdp.driver.schema_data import DATASETS
from sdp.driver.schema_models import MODELS, OPTIMIZERS, OptimizerArgs
from sdp.parallel.spec import schemas


def stored() -> dict[str, Any]:
    """ConfigStore names (group schema/...) that conf/*.yaml extend, e.g. `- /schema/parallelism/sdp@_here_`:
    the driver's nodes and every registered strategy's schema (:func:`sdp.parallel.spec.schemas`)."""
    return {"schema/optim": Optim, **{f"schema/cluster/{name}": node for name, node in CLUSTERS.items()},
            **{f"schema/parallelism/{name}": node for name, node in schemas().items()}}


def open_node(schema: type) -> DictConfig:
    """An untyped node holding ``schema``'s fields as typed nodes: the root of the job, which its groups and an
    experiment's own keys must be able to join (a structured root would refuse them), with typed children."""
    typed, node = OmegaConf.structured(schema), OmegaConf.create({})
    for name in typed:
        node[name] = typed._get_node(name)
    return node


def register() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent: a second call stores the same nodes again)."""
    store = ConfigStore.instance()
    for path, node in {"schema/job": open_node(RootConfig), **stored()}.items():
        group, _, name = path.rpartition("/")
        store.store(group=group, name=name, node=node, provider="sdp")


@dataclass(frozen=True)
class Typed:
    """The typed nodes of one job: ``root`` holds seed, plugins, train, eval, memory, plan and logger;
    ``parallelism`` is None for a preset without a schema (a plugin strategy's own YAML)."""

    root: DictConfig
    cluster: DictConfig | None
    optim: DictConfig
    parallelism: DictConfig | None

    @property
    def train(self) -> DictConfig:
        return self.root.train


def schema_of(node: Any) -> type | None:
    kind = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    return kind if kind is not None and dataclasses.is_dataclass(kind) else None


def parse(cfg: DictConfig) -> Typed:
    """``cfg``'s typed nodes (see the module docstring); raises :class:`ConfigError` naming the key for a
    value of the wrong type, a choice it does not allow or a number outside its range."""
    wanted: dict[str, type | None] = {
        "cluster": schema_of(cfg.cluster) or CLUSTERS.get(str(cfg.cluster.get("name"))),
        "optim": schema_of(cfg.optim) or Optim,
        "parallelism": schema_of(cfg.parallelism) or schemas().get(str(cfg.parallelism.get("name")))}
    typed = {k: cfg[k] for k, schema in wanted.items() if schema is not None and schema_of(cfg[k]) is schema}
    root = cfg if schema_of(cfg.get("train")) is Train else None
    untyped = [k for k, schema in wanted.items() if schema is not None and k not in typed]
    if root is None or untyped:  # a recorded config.yaml: merge it into the schemas, as Hydra would have
        holder = open_node(RootConfig)
        for k in untyped:
            holder[k] = OmegaConf.structured(wanted[k])
        keys = ([f.name for f in dataclasses.fields(RootConfig)] if root is None else []) + untyped
        plain = {k: OmegaConf.to_container(cfg[k], resolve=True) if isinstance(cfg[k], DictConfig) else cfg[k]
                 for k in keys if k in cfg}
        try:
            holder.merge_with(plain)
        except OmegaConfBaseException as exc:
            raise readable(exc) from None
        root = root if root is not None else holder
        typed.update({k: holder[k] for k in untyped})
    fields.check(root, schema=RootConfig, prefix="")
    for k, schema in wanted.items():
        if k in typed:
            fields.check(typed[k], schema=schema, prefix=k)
    return Typed(root=root, cluster=typed.get("cluster"), optim=typed["optim"], parallelism=typed.get("parallelism"))


def check_built(cfg: DictConfig) -> None:
    """The nodes a ``_target_`` builds (``dataset``, ``model``, ``optim.optimizer``) held to their target's schema
    (:mod:`sdp.driver.schema_data`, :mod:`sdp.driver.schema_models`), naming the key: the dataset first, so a value
    the model interpolates from it is named where the user set it. A target without a schema is left to its build
    (an optimizer's ``lr`` is checked whatever the optimizer)."""
    for name, table, fallback in (("dataset", DATASETS, None), ("model", MODELS, None),
                                  ("optim.optimizer", OPTIMIZERS, OptimizerArgs)):
        node = OmegaConf.select(cfg, name)
        schema = table.get(str(node.get("_target_"))) or fallback if isinstance(node, DictConfig) else None
        if schema is not None:
            fields.conform(node, schema=schema, prefix=name)
