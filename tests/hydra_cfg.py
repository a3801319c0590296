"""The config ``sdp-train`` composes, for tests: the one place that opens Hydra on ``conf/``."""

from __future__ import annotations

import itertools

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from sdp.driver.train import CONF_DIR  # also registers the resolvers the config uses


def compose_config(*overrides: str, hydra: bool = False) -> DictConfig:
    """``config.yaml`` with ``overrides``; ``hydra=True`` keeps the ``hydra:`` node (launcher, sweeper)."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=hydra)


def sweep_params(experiment: str) -> dict[str, list[str]]:
    """An experiment's ``hydra.sweeper.params`` (its own and those of the experiments it includes),
    each value list split on commas as Hydra's basic sweeper does."""
    cfg = compose_config(f"experiment={experiment}", hydra=True)
    params = cfg.hydra.sweeper.get("params")
    params = OmegaConf.to_container(params) if params is not None else {}
    return {k: [v.strip() for v in str(vals).split(",") if v.strip()] for k, vals in params.items()}


def swept_jobs(experiment: str, *, skip: tuple[str, ...] = ()) -> list[list[str]]:
    """The overrides of every job ``sdp-train -m experiment=<experiment>`` launches (the cartesian
    product of its sweeper params, as Hydra's basic sweeper expands it), keys in ``skip`` left out."""
    params = {k: v for k, v in sweep_params(experiment).items() if k not in skip}
    return [[f"{k}={v}" for k, v in zip(params, values)] for values in itertools.product(*params.values())]
