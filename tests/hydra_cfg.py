"""The config ``sdp-train`` composes, for tests: the one place that opens Hydra on ``conf/``."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from sdp.train import CONF_DIR  # also registers the resolvers the config uses


def compose_config(*overrides: str, hydra: bool = False) -> DictConfig:
    """``config.yaml`` with ``overrides``; ``hydra=True`` keeps the ``hydra:`` node (launcher, sweeper)."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=hydra)
