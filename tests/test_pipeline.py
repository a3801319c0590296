"""Pipeline baseline: planning and validation (no ranks), each stage's gradients after one step equal
the unsplit model's on the same global batch, sends are counted, and losses match DDP.

The equivalence runs use the MLP (LayerNorm): BatchNorm in a pipeline stage normalises per
microbatch, which is a different computation from DDP's per-rank batch, so a BatchNorm model cannot
match DDP unless a microbatch is the whole per-rank batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from sdp.driver.config import validate
from sdp.errors import ConfigError
from sdp.metrics.timing import PhaseTimer
from sdp.models.resnet import ResNetCIFAR
from sdp.core.distctx import DistContext
from sdp.core.fields import conform
from sdp.parallel.pipeline import PipelineStrategy
from sdp.parallel.job import JobFacts
from sdp.parallel.pipeline_plan import PipelineConfig, balanced_bounds, make_plan
from sdp.core.loss import loss_fn
from tests.helpers import CORE, CapturingSGD, compose, core_cases, global_batch, reference_grads, run_job, small_mlp, spawn, train_losses

CPU = torch.device("cpu")
DEPTH, PER_RANK = 4, 8


def pp_cfg(**kw: object) -> object:
    base = {"name": "pipeline", "schedule": "1f1b", "microbatches": 4, "stages_per_rank": 1, "dp": 1, "split_points": None}
    return OmegaConf.create({**base, **kw})


# ---- planning and validation (single process) ----------------------------------------------------
def test_balanced_bounds_minimise_the_heaviest_stage() -> None:
    assert balanced_bounds(weights=[5, 1, 1, 1, 1, 5], allowed=range(1, 6), stages=2) == (0, 3, 6)
    assert balanced_bounds(weights=[1, 1, 1, 1], allowed=[1, 2, 3], stages=4) == (0, 1, 2, 3, 4)
    assert balanced_bounds(weights=[1, 1, 1, 9], allowed=[2], stages=2) == (0, 2, 4)  # only allowed cuts


def test_resnet18_balanced_cut_is_even_by_parameters() -> None:
    with torch.device("meta"):
        model = ResNetCIFAR(num_classes=10, width=64)
    plan = make_plan(cfg=pp_cfg(microbatches=4), world_size=4, model=model, batch_size=32)
    assert plan.num_stages == 4 and plan.bounds[0] == 0 and plan.bounds[-1] == 8


@pytest.mark.parametrize(
    "kw,world,message",
    [
        ({"microbatches": 1}, 2, "parallelism.microbatches=1"),                       # < stages
        ({"microbatches": 5}, 2, "must divide the per-replica batch"),               # 16 % 5
        ({"dp": 3}, 4, "parallelism.dp=3"),                                           # pp x dp != world
        ({"dp": 2}, 2, "needs >= 2 ranks"),                                           # pp = 1
        ({"schedule": "interleaved_1f1b", "stages_per_rank": 3, "microbatches": 8}, 2, "only 4 blocks"),
        ({"schedule": "1f1b", "stages_per_rank": 2}, 2, "one stage per rank"),
        ({"schedule": "zb"}, 2, "parallelism.schedule='zb'"),
        ({"split_points": [3, 1]}, 2, "parallelism.split_points"),
    ],
)
def test_invalid_settings_name_the_key(kw: dict, world: int, message: str) -> None:
    """As the driver checks: each key against the schema (a schedule's name), then the plan's rules of several keys."""
    cfg = pp_cfg(**kw)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        conform(cfg, schema=PipelineConfig, prefix="parallelism")
        make_plan(cfg=cfg, world_size=world, model=small_mlp(depth=DEPTH), batch_size=PER_RANK)


def test_validate_before_launch_sees_model_and_batch() -> None:
    cfg = compose(["parallelism=pipeline", "model=mlp", "model.depth=2", "cluster.world_size=2",
                       "parallelism.schedule=interleaved_1f1b", "parallelism.stages_per_rank=2"])
    with pytest.raises(ConfigError, match="only 2 blocks"):
        validate(cfg)


# ---- gradients equal the unsplit model (2 and 4 ranks) --------------------------------------------
def _grad_worker(rank: int, world: int, kw: dict, out: str) -> None:
    ctx = DistContext(rank=rank, world_size=world, local_rank=rank, device=CPU, backend="gloo")
    strategy = PipelineStrategy(cfg=pp_cfg(**kw), job=JobFacts(batch_size=PER_RANK), ctx=ctx)
    strategy.setup(model=small_mlp(depth=DEPTH), optimizer_factory=lambda ps: CapturingSGD(ps))
    replica, replicas = strategy.data_parallel()
    x, y = global_batch(PER_RANK * world)
    n = x.shape[0] // replicas
    sl = slice(replica * n, (replica + 1) * n)
    res = strategy.train_step(inputs=x[sl], targets=y[sl], loss_fn=loss_fn, timer=PhaseTimer(device=CPU), step=0)
    names = [name.split(".", 1)[1] for name, _ in strategy.module.named_parameters()]
    grads = dict(zip(names, strategy.optimizer.captured, strict=True))
    ctx.comm._step.clear()  # the first step also exchanged stage shapes; count a steady step
    strategy.train_step(inputs=x[sl], targets=y[sl], loss_fn=loss_fn, timer=PhaseTimer(device=CPU), step=1)
    kinds: dict[str, int] = {}
    for kind, _, _ in ctx.comm._step:
        kinds[kind] = kinds.get(kind, 0) + 1
    torch.save({"grads": grads, "kinds": kinds,
                "stages": strategy.stage_ids, "loss": (float(res.loss_sum), res.count)}, f"{out}.{rank}")


@pytest.mark.dist
@pytest.mark.timeout(600)  # 4 spawned ranks re-import torch: minutes on a loaded 2-core box
@pytest.mark.parametrize(
    "world,kw",
    core_cases([(2, {"schedule": "gpipe"}), (2, {"schedule": "1f1b"}),
                (2, {"schedule": "interleaved_1f1b", "stages_per_rank": 2}), (4, {"schedule": "1f1b", "dp": 2})],
               ids=["gpipe", "1f1b", "interleaved2x2", "1f1b-pp2-dp2"], core={"1f1b"}),
)
def test_stage_grads_equal_unsplit_reference(tmp_path: Path, world: int, kw: dict) -> None:
    out = str(tmp_path / "pp")
    spawn(_grad_worker, world=world, args=(kw, out), timeout_s=540)
    x, y = global_batch(PER_RANK * world)
    ref = reference_grads(small_mlp(depth=DEPTH), x, y)
    per_rank = [torch.load(f"{out}.{r}") for r in range(world)]
    seen: set[str] = set()
    for r, res in enumerate(per_rank):
        for name, g in res["grads"].items():
            err = (g - ref[name]).abs().max().item()
            assert err < 1e-5, f"rank {r} {name}: max |pipeline - reference| = {err:.2e}"
        seen |= set(res["grads"])
        pp = world // kw.get("dp", 1)
        stages = pp * kw.get("stages_per_rank", 1)
        # one activation send per microbatch per stage boundary out of each owned stage, one gradient back
        sends = sum(4 for s in res["stages"] if s < stages - 1) + sum(4 for s in res["stages"] if s > 0)
        assert res["kinds"].get("send") == sends and res["kinds"].get("recv") == sends, (r, res["kinds"])
        assert res["kinds"].get("all_reduce", 0) == (1 if kw.get("dp", 1) > 1 else 0), res["kinds"]
    assert seen == set(ref), f"stages hold {sorted(seen)} but the model has {sorted(ref)}"
    total = sum(res["loss"][0] for res in per_rank)
    count = sum(res["loss"][1] for res in per_rank)
    assert count == x.shape[0]
    with torch.no_grad():
        assert abs(total / count - float(loss_fn(small_mlp(depth=DEPTH)(x), y))) < 1e-5


# ---- whole runs: losses match DDP ------------------------------------------------------------------
COMMON = ["model=mlp", "dataset=digits", "train.steps=5", "train.batch_size=8", "train.eval_every=0", "train.warmup_steps=1"]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[float]]:
    summary, rows = run_job(["parallelism=ddp", *COMMON], world=2, run_dir=tmp_path_factory.mktemp("ddp"))
    return summary, train_losses(rows)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_batchnorm_pipeline_matches_ddp_when_microbatch_is_the_rank_batch(tmp_path: Path) -> None:
    """microbatches = pp (dp = 1): microbatch m is exactly DDP rank m's slice, so BatchNorm sees the same
    statistics and training losses agree (running statistics still differ: updated per microbatch)."""
    common = ["model=resnet18_cifar", "model.width=4", "dataset=synthetic", "dataset.image_size=8",
              "train.steps=4", "train.batch_size=8", "train.eval_every=0", "train.warmup_steps=1"]
    _, ddp_rows = run_job(["parallelism=ddp", *common], world=2, run_dir=tmp_path / "ddp")
    _, pp_rows = run_job(["parallelism=pipeline", "parallelism.microbatches=2", *common], world=2, run_dir=tmp_path / "pp")
    for step, (a, b) in enumerate(zip(train_losses(ddp_rows), train_losses(pp_rows), strict=True)):
        assert abs(a - b) < 1e-5, f"step {step + 1}: ddp {a:.7f} vs pipeline {b:.7f}"


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", [pytest.param("gpipe", marks=CORE), "1f1b"])
def test_pipeline_losses_match_ddp(tmp_path: Path, ddp_run: tuple[dict, list[float]], schedule: str) -> None:
    ddp, ddp_losses = ddp_run
    pp, rows = run_job(["parallelism=pipeline", f"parallelism.schedule={schedule}", *COMMON], world=2, run_dir=tmp_path)
    losses = train_losses(rows)
    assert len(losses) == len(ddp_losses) == 5
    for step, (a, b) in enumerate(zip(ddp_losses, losses)):
        assert abs(a - b) < 1e-5, f"step {step + 1}: ddp {a:.7f} vs pipeline/{schedule} {b:.7f}"
    assert abs(ddp["final"]["eval_loss"] - pp["final"]["eval_loss"]) < 1e-4, (ddp["final"], pp["final"])
    comm = pp["comm"]["per_rank"]
    assert all(c["by_kind"]["send"]["count"] == 4 for c in comm), comm  # 4 microbatches each way
    mem = pp["memory"]["per_rank"]
    assert mem[0]["param_bytes"] + mem[1]["param_bytes"] == ddp["memory"]["per_rank"][0]["param_bytes"], mem
