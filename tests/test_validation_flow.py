"""How the driver validates, beside the catalogue of refused inputs (tests/test_validation.py): what each strategy's
``validate`` is handed (its own node and the job's facts), that a bad model value stops ``sdp-train`` in one line
before any rank starts, that a renamed key on the command line names its new place, that the steps are checked once
the budget has set them, and that the model and the plan are built once per job and handed on by argument.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sdp.driver.config import validate
from sdp.errors import ConfigError
from sdp.parallel import STRATEGIES, JobFacts
from tests.hydra_cfg import compose_config
from tests.test_validation import BASE, compose_and_validate


def test_strategy_validate_receives_its_node_and_the_jobs_facts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every strategy's validate receives its own ``parallelism`` node and the job's facts (sdp.parallel.JobFacts: the
    pipeline needs the batch size, SDP the world size), read from the composed config, never the whole config."""
    seen = {}
    ddp = STRATEGIES.get("ddp")

    class Probe(ddp):  # type: ignore[misc, valid-type]
        @classmethod
        def validate(cls, *, cfg, job):  # type: ignore[no-untyped-def, override]
            seen["node"], seen["job"] = cfg, job
            if job.batch_size % 3:
                raise ConfigError(f"train.batch_size={job.batch_size} is invalid: probe wants a multiple of 3")

    monkeypatch.setitem(STRATEGIES._items, "ddp", Probe)
    with pytest.raises(ConfigError, match="train.batch_size=32"):
        compose_and_validate(["parallelism=ddp"])
    compose_and_validate(["parallelism=ddp", "train.batch_size=33", "seed=5", "train.precision=bf16"])
    assert isinstance(seen["job"], JobFacts) and "train" not in seen["node"] and seen["node"].name == "ddp", seen
    assert (seen["job"].batch_size, seen["job"].seed, seen["job"].precision) == (33, 5, "bf16"), seen["job"]


def test_bad_model_value_fails_in_the_driver_in_one_line(tmp_path: Path) -> None:
    """End to end: ``sdp-train`` with a model too narrow for the data's labels (the bare ``IndexError: Target
    .. is out of bounds`` of every spawned rank before) stops in the driver, naming the node, no rank started."""
    from tests.helpers import run_train

    job = run_train(tmp_path / "run", "experiment=smoke", "model.num_classes=5", check=False, timeout=120)
    assert job.proc.returncode == 2, (job.proc.returncode, job.output[-3000:])
    line = next((ln for ln in job.output.splitlines() if ln.startswith("sdp-train: ")), None)
    assert line is not None and "model (sdp.models.mlp.MLP) cannot be built" in line and "5 logits" in line, job.output[-3000:]
    assert "ChildFailedError" not in job.output and "IndexError" not in job.output, job.output[-3000:]
    assert not (tmp_path / "run" / "rank_logs").exists(), "no rank may start"


def test_stale_override_on_the_command_line_names_the_new_key() -> None:
    """``sdp-train parallelism.bn=average`` (no ``+``) would otherwise die in Hydra's struct check,
    which does not say where the setting went; ``sdp.driver.train.main`` asks this first."""
    from sdp.driver.config import renamed_overrides

    assert renamed_overrides(["model=mlp", "train.steps=3"]) is None
    for given in ("parallelism.bn=average", "+parallelism.bn=reestimate", "~parallelism.bn_batches"):
        message = renamed_overrides(["model=mlp", given])
        assert message is not None and "moved to eval.bn" in message and repr(given) in message, message
    message = renamed_overrides(["parallelism=fsdp", "parallelism.mixed_precision=true"])
    assert message is not None and "moved to train.precision" in message, message


def test_steps_are_checked_after_the_budget_has_set_them() -> None:
    """Under a FLOP budget train.steps is DDP's count and SDP runs more: a fault step beyond the
    configured steps but inside the resolved ones is accepted, one beyond both is refused, naming both."""
    from sdp.driver.budget import resolve_steps
    from sdp.driver.config import check_resolved

    def resolved(fault_step: int):  # noqa: ANN202
        cfg = compose_config(*BASE, "parallelism=sdp", "parallelism.coverage=0.5", "cluster.world_size=4",
                             "train.budget=flops", "train.steps=10", "train.debug.fault=nan_loss", f"train.debug.fault_step={fault_step}")
        validate(cfg)  # not refused before the budget is known
        cfg.train.steps, _ = resolve_steps(cfg)
        return cfg

    cfg = resolved(15)
    assert cfg.train.steps >= 15, cfg.train.steps
    check_resolved(cfg)
    cfg = resolved(99)
    with pytest.raises(ConfigError, match=rf"train.debug.fault_step=99.*train.steps={cfg.train.steps}"):
        check_resolved(cfg)


def test_the_driver_builds_the_model_and_the_plan_once_and_hands_them_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """One meta build and one plan per job, passed by argument (sdp.driver.preflight.Preflight) from validation
    to the budget: nothing is kept between calls, so a second job validated in the same process (another
    coverage) gets its own plan, and the budget reads the plan it is handed (k), not one left from earlier."""
    from sdp.driver import preflight
    from sdp.driver import budget as budgets

    sdp_spec = STRATEGIES.get("sdp")
    counts = {"model": 0, "plan": 0}
    real_meta, real_prepare = preflight.meta_model, sdp_spec.prepare.__func__

    def counted_meta(cfg):  # type: ignore[no-untyped-def]
        counts["model"] += 1
        return real_meta(cfg)

    def counted_prepare(cls, **kw):  # type: ignore[no-untyped-def]
        counts["plan"] += 1
        return real_prepare(cls, **kw)

    def no_build(node):  # type: ignore[no-untyped-def]
        raise AssertionError(f"the budget built {node.get('_target_')} again instead of reading the driver's build")

    monkeypatch.setattr(preflight, "meta_model", counted_meta)
    monkeypatch.setattr(sdp_spec, "prepare", classmethod(counted_prepare))
    monkeypatch.setattr(budgets, "build", no_build)
    run = [*BASE, "parallelism=sdp", "cluster.world_size=4", "train.budget=flops", "train.steps=40"]
    built = {}
    for coverage in (0.5, 0.75):
        cfg = compose_config(*run, f"parallelism.coverage={coverage}")
        before = dict(counts)
        built[coverage] = validate(cfg)
        info = budgets.apply(cfg, preflight=built[coverage])
        assert (counts["model"] - before["model"], counts["plan"] - before["plan"]) == (1, 1), counts
        assert isinstance(built[coverage].job, JobFacts) and built[coverage].job.world_size == 4, built[coverage].job
        assert info["coverage"] == built[coverage].prepared.k / 4 == coverage, (info, built[coverage].prepared.k)
    assert built[0.5].prepared is not built[0.75].prepared and built[0.5].model is not built[0.75].model
