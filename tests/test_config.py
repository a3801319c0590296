"""Config composition: every file under conf/ composes, and every ``_target_`` resolves/instantiates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.utils import get_object
from omegaconf import OmegaConf

import sdp.driver.train  # noqa: F401  (registers the sdp_uid resolver)
from sdp.driver.config import validate
from sdp.registry import build
from tests.hydra_cfg import compose_config

CONF = Path(sdp.driver.train.CONF_DIR)
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())
OPTIONS = [(g, f.stem) for g in GROUPS for f in sorted((CONF / g).glob("*.yaml"))]


def companions(group: str, option: str) -> list[str]:
    """Overrides a group option needs to compose with the defaults: an LM needs a text dataset
    (its vocab_size/seq_len come from the dataset), Swin-T needs 224-pixel RGB images."""
    if group == "model":
        text = (CONF / "model" / f"{option}.yaml").read_text()
        if "dataset.vocab_size" in text:
            return ["dataset=synthetic_text"]
        if option == "swin_t":
            return ["dataset=synthetic", "dataset.image_size=224"]
    if group == "dataset" and "vocab_size" in (CONF / "dataset" / f"{option}.yaml").read_text():
        return ["model=llama_tiny"]
    return []


def compose_with(*overrides: str):
    """Compose config.yaml; a dataset root that is required (``???``) is pointed at a missing dir."""
    cfg = compose_config(*overrides)
    if "root" in cfg.dataset.keys() and OmegaConf.is_missing(cfg.dataset, "root"):
        cfg.dataset.root = "/nonexistent/missing-root"
    return cfg


def targets(node, path=""):
    """Every (path, _target_) in a config tree."""
    if OmegaConf.is_dict(node):
        if "_target_" in node:
            yield path, node["_target_"]
        for k in node:
            yield from targets(node[k], f"{path}.{k}" if path else str(k))
    elif OmegaConf.is_list(node):
        for i, v in enumerate(node):
            yield from targets(v, f"{path}[{i}]")


def test_groups_present():
    for g in ("model", "dataset", "parallelism", "cluster", "optim", "experiment"):
        assert g in GROUPS, f"conf/{g}/ missing; have {GROUPS}"


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_resolves(group: str, option: str):
    cfg = compose_with(f"{group}={option}", *companions(group, option))
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    for path, target in targets(cfg):
        assert get_object(target) is not None, f"{path}._target_={target!r} does not resolve"


def test_default_config_validates():
    validate(compose_with())


@pytest.mark.parametrize("option", sorted(f.stem for f in (CONF / "model").glob("*.yaml")))
def test_every_model_instantiates(option: str):
    """Models are built on the meta device, so even billion-parameter configs cost nothing."""
    cfg = compose_with(f"model={option}", *companions("model", option))
    with torch.device("meta"):
        model = build(cfg.model)
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.parametrize("option", sorted(f.stem for f in (CONF / "dataset").glob("*.yaml")))
def test_every_dataset_target_instantiates_or_names_its_root(option: str, tmp_path: Path):
    """Datasets that read files are pointed at an empty dir and must fail naming it."""
    cfg = compose_with(f"dataset={option}", *companions("dataset", option))
    if "root" in cfg.dataset:
        cfg.dataset.root = str(tmp_path / "missing")
        assert "missing" in cfg.dataset.root
        from hydra.errors import InstantiationException

        with pytest.raises((FileNotFoundError, ValueError, InstantiationException)) as err:
            build(cfg.dataset)
        assert "missing" in str(err.value), f"error does not name the root: {err.value}"
    else:
        bundle = build(cfg.dataset)
        assert len(bundle.train) > 0 and len(bundle.val) > 0


def test_optimizer_partial_builds():
    cfg = compose_with()
    opt = build(cfg.optim.optimizer)([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, torch.optim.Optimizer)
