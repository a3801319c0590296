"""Logging never loses results: W&B failing to start never costs the run, and metrics.jsonl holds every
row the moment it is logged (a SIGKILL right after ``log`` keeps it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from sdp.results.loggers import JsonlLogger, WandbLogger


def wandb_cfg(mode: str) -> object:
    return OmegaConf.create({"mode": mode, "project": "sdp-test", "init_timeout_s": 3})


@pytest.mark.slow  # slow tier (CI time)
@pytest.mark.timeout(180)
def test_online_without_server_falls_back_to_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """A bad key against an unreachable server (port 9 refuses): bounded by init_timeout_s, then offline."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    lg = WandbLogger(cfg=wandb_cfg("online"), run_dir=tmp_path, config={"a": 1}, group="g", job_type="ddp", name="n")
    assert lg.mode_used == "offline"
    assert "W&B (online) could not start, trying offline" in capsys.readouterr().err
    lg.log({"step": 1, "loss": 0.5})
    lg.finish()
    assert list((tmp_path / "wandb").glob("offline-run-*")), "the offline copy exists, to sync later"


def test_when_nothing_starts_wandb_is_disabled_and_logging_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import wandb

    tried = []

    def broken_init(**kwargs):  # type: ignore[no-untyped-def]
        tried.append(kwargs["mode"])
        raise RuntimeError(f"no W&B in {kwargs['mode']} mode")

    monkeypatch.setattr(wandb, "init", broken_init)
    with pytest.warns(UserWarning, match="continuing with W&B disabled"):
        lg = WandbLogger(cfg=wandb_cfg("online"), run_dir=tmp_path, config={}, group="g", job_type="ddp", name="n")
    assert tried == ["online", "offline"] and lg.mode_used == "disabled"
    lg.log({"step": 1, "loss": 0.5})  # a no-op, not an error
    lg.finish()
    assert "continuing with W&B disabled" in capsys.readouterr().err


def test_metrics_rows_are_on_disk_before_finish(tmp_path: Path) -> None:
    lg = JsonlLogger(path=tmp_path / "metrics.jsonl")
    lg.log({"step": 1, "loss": float("nan")})
    on_disk = (tmp_path / "metrics.jsonl").read_text().splitlines()  # another reader, before finish()
    assert [json.loads(x) for x in on_disk] == [{"step": 1, "loss": "nan"}]
    lg.finish()
