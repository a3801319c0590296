"""Which W&B mode a job runs in: ``logger.wandb.mode`` where the config sets it, else W&B's own ``WANDB_MODE``
from the environment, else offline (sdp.results.loggers.wandb_mode). Before, the config always passed ``mode=``
to ``wandb.init``, which overrides ``WANDB_MODE``: ``WANDB_MODE=disabled sdp-train ...`` still wrote offline runs.
No network: ``wandb.init`` is replaced by a recorder."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sdp.errors import ConfigError
from sdp.results.loggers import WandbLogger, wandb_mode
from tests.hydra_cfg import compose_config


@pytest.fixture
def inits(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[dict[str, Any]]:
    """``wandb.init``'s keyword arguments, one dict per call; the run it returns logs nothing anywhere."""
    import wandb

    calls: list[dict[str, Any]] = []

    def fake_init(**kwargs: Any) -> Any:
        calls.append(kwargs)
        return SimpleNamespace(dir=str(tmp_path), log=lambda *a, **k: None, finish=lambda: None, summary={})

    monkeypatch.setattr(wandb, "init", fake_init)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return calls


def start(tmp_path: Path, *overrides: str) -> WandbLogger:
    """Rank 0's logger of the job that ``sdp-train <overrides>`` composes (the default config: its key as written)."""
    cfg = compose_config(*overrides)
    logger = WandbLogger(cfg=cfg.logger.wandb, run_dir=tmp_path, config={}, group="g", job_type="t", name="n")
    logger.finish()
    return logger


@pytest.mark.parametrize("env, expect", [("disabled", None), ("offline", "offline"), ("online", "online"),
                                         ("dryrun", "offline"), (None, "offline")])
def test_the_environment_decides_where_the_config_does_not(inits: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            env: str | None, expect: str | None) -> None:
    if env is not None:
        monkeypatch.setenv("WANDB_MODE", env)
    logger = start(tmp_path)
    assert [c["mode"] for c in inits] == ([expect] if expect else []), (env, inits)
    assert logger.mode_used == (expect or "disabled"), (env, logger.mode_used)


@pytest.mark.parametrize("key", ["offline", "disabled", "online"])
def test_the_key_set_on_the_command_line_wins(inits: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    """W&B's convention: an explicit mode (an argument of wandb.init; here the config key) wins over WANDB_MODE."""
    monkeypatch.setenv("WANDB_MODE", "disabled" if key != "disabled" else "offline")
    start(tmp_path, f"logger.wandb.mode={key}")
    assert [c["mode"] for c in inits] == ([] if key == "disabled" else [key]), (key, inits)


def test_project_and_entity_reach_wandb(inits: list, tmp_path: Path) -> None:
    start(tmp_path, "logger.wandb.mode=offline", "logger.wandb.project=proj-x", "logger.wandb.entity=team-y")
    assert (inits[0]["project"], inits[0]["entity"]) == ("proj-x", "team-y"), inits


def test_a_bad_wandb_mode_in_the_environment_is_refused_before_any_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value W&B would refuse in rank 0 is named by the driver's validation; a key set in the config is not
    affected by it (the variable is not read)."""
    from sdp.driver.config import validate

    monkeypatch.setenv("WANDB_MODE", "sometimes")
    with pytest.raises(ConfigError, match=r"WANDB_MODE='sometimes' .* is invalid: allowed: online, offline, disabled"):
        validate(compose_config("experiment=smoke", "model=mlp", "logger.wandb.mode=null"))
    assert wandb_mode("disabled") == "disabled"


def test_the_report_callback_follows_the_same_rule(inits: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sdp.report.callback import log_to_wandb

    report = SimpleNamespace(tables=[], out_dir=tmp_path)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert not log_to_wandb(report=report, wandb_cfg={"mode": None, "project": "p"}, sweep_dir=tmp_path) and not inits
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert log_to_wandb(report=report, wandb_cfg={"mode": None, "project": "p"}, sweep_dir=tmp_path)
    assert [c["mode"] for c in inits] == ["offline"], inits


def test_a_sweep_recorded_with_another_wandb_mode_is_the_same_job() -> None:
    """``train.skip_done`` compares configs minus the run-control keys: a sweep recorded when the default was
    ``offline`` (or run under another WANDB_MODE) is finished, not refused as another config."""
    from sdp.driver.sweep import first_difference

    now = {"train": {"steps": 4}, "logger": {"wandb": {"mode": None, "project": "sdp"}}}
    then = {"train": {"steps": 4}, "logger": {"wandb": {"mode": "offline", "project": "sdp"}}}
    assert first_difference(now=now, then=then) is None
    assert first_difference(now={**now, "train": {"steps": 5}}, then=then) == ("train.steps", 5, 4)
