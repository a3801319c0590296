"""The ensemble of the workers' subnetworks (``eval.ensemble``, sdp/rank/eval_ensemble.py): the cross-entropy and
arg-max of the mean of their predicted probabilities. At C = 1 every worker's subnetwork is the full model,
so the ensemble is DDP's evaluation; at C = 0.5 it equals a single-process reference computed from the
workers' gathered probabilities; its evaluation peak per rank stays within one batch of probabilities of
the workers' own evaluation (each rank runs its own subnetwork; the probabilities are all-reduced chunk by
chunk, never kept for the validation set, never a second model on a rank; a language model's ensemble moves
two float64 values per token, never the vocabulary's probabilities). Backward masking: no ensemble."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.nn import functional as F

RESNET = ["model=resnet18_cifar", "model.width=4", "dataset=digits", "dataset.image_size=8", "train.batch_size=8",
          "train.steps=3", "train.warmup_steps=0", "train.eval_every=0", "optim=sgd", "train.eval_batch_size=32"]
LLAMA = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=16", "model.n_layers=4", "optim=adamw",
         "train.batch_size=4", "train.steps=4", "train.warmup_steps=0", "train.eval_every=0", "train.eval_batch_size=8"]


def _ctx() -> Any:
    from sdp.parallel import DistContext

    return DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def test_one_worker_ensemble_is_its_cross_entropy_chunk_by_chunk_and_survives_underflow() -> None:
    """One worker: the ensemble is the model; the chunked log-space loss equals cross-entropy, and a target
    whose float32 probability underflows (logit 200 below the best) still gives a finite loss."""
    from sdp.rank.eval_ensemble import add_batch

    torch.manual_seed(0)
    out, target = torch.randn(3, 5, 7), torch.randint(0, 7, (3, 5))  # an LM batch: (B, T, V)
    out[0, 0] = 0.0
    out[0, 0, target[0, 0]] = -200.0  # exp(-200) is 0 in float32 (and -log of it inf)
    assert torch.softmax(out[0, 0], -1)[target[0, 0]] == 0, "the case must underflow in float32"
    totals = torch.zeros(3, dtype=torch.float64)
    add_batch(totals, out, target, ctx=_ctx(), argmax=True, chunk=4)  # 15 rows in chunks of 4: the last chunk is short
    ce = F.cross_entropy(out.reshape(-1, 7).double(), target.reshape(-1), reduction="sum")
    correct = (out.argmax(-1) == target).sum()
    assert math.isfinite(totals[0]) and torch.allclose(totals[0], ce, rtol=1e-6), (totals, ce)
    assert totals[1] == correct and totals[2] == 15, (totals, correct)


def test_a_run_recorded_before_the_key_is_the_same_job_only_where_no_ensemble_is_evaluated() -> None:
    """``train.skip_done``: the key added after the CPU study's runs keeps a DDP or backward-masked run (nothing
    to ensemble) and a run with the key off, and re-runs a forward-masked SDP run, which now has a new figure."""
    from sdp.driver import sweep

    for preset, same in (("ddp", True), ("sdp_block_bwd", True), ("sdp", False)):
        now = sweep.flatten(config_of([f"parallelism={preset}"]))
        then = {k: v for k, v in now.items() if k != "eval.ensemble"}  # recorded before the key
        diff = sweep.first_difference(now=now, then=then)
        assert (diff is None) == same, (preset, diff)
        off = sweep.flatten(config_of([f"parallelism={preset}", "eval.ensemble=false"]))
        assert sweep.first_difference(now=off, then=then) is None, preset


def config_of(overrides: list[str]) -> dict[str, Any]:
    from tests.helpers import config_dict

    return config_dict(overrides)  # as a run's config.yaml records it


def _rows(rank: int, world: int, configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from sdp.results.loggers import NullLogger
    from sdp.metrics.timing import PhaseTimer
    from sdp.rank.trainer import Trainer
    from tests.helpers import make_strategy

    out = {}
    for name, config in configs.items():
        strategy, data, cfg = make_strategy(config, rank, world)
        out[name] = Trainer(cfg=cfg, strategy=strategy, data=data, logger=NullLogger(),
                            timer=PhaseTimer(device=strategy.ctx.device)).fit().last_eval
    return out


@pytest.mark.dist
@pytest.mark.core
@pytest.mark.timeout(300)
def test_at_full_coverage_the_ensemble_is_ddps_evaluation() -> None:
    """BatchNorm ResNet, 2 ranks: at C = 1 every worker's (calibrated) subnetwork is DDP's model, so the mean
    of their probabilities is its probability; backward masking and DDP report no ensemble."""
    from tests.helpers import config_dict, spawn

    configs = {"ddp": config_dict([*RESNET, "parallelism=ddp", "cluster.world_size=2"]),
               "sdp": config_dict([*RESNET, "parallelism=sdp", "parallelism.coverage=1.0", "cluster.world_size=2"]),
               "bwd": config_dict([*RESNET, "parallelism=sdp_block_bwd", "parallelism.coverage=0.5", "cluster.world_size=2"])}
    assert configs["sdp"]["eval"]["ensemble"] is True, "the ensemble is on by default"
    got = spawn(_rows, world=2, args=(configs,))
    for r, rows in enumerate(got):
        ddp, sdp = rows["ddp"], rows["sdp"]
        print(f"rank {r} C=1: ensemble loss {sdp['eval_loss_ensemble']:.8f} acc {sdp['eval_accuracy_ensemble']:.4f}"
              f" | DDP loss {ddp['eval_loss']:.8f} acc {ddp['eval_accuracy']:.4f}"
              f" | workers' {sdp['eval_loss_workers']:.8f} | assembled {sdp['eval_loss']:.8f}")
        assert sdp["eval_loss_ensemble"] == pytest.approx(ddp["eval_loss"], rel=1e-6, abs=0), (r, sdp, ddp)
        assert sdp["eval_accuracy_ensemble"] == ddp["eval_accuracy"], (r, sdp, ddp)
        assert got[0]["sdp"]["eval_loss_ensemble"] == sdp["eval_loss_ensemble"], "every rank has the same ensemble"
        for name in ("ddp", "bwd"):
            assert "eval_loss_ensemble" not in rows[name], f"{name} has no subnetworks, so no ensemble: {rows[name]}"


def _half(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    """The trainer's row; this rank's subnetwork's probabilities on the whole validation set, calibrated as
    the trainer calibrates it (the reference); the live-tensor peak of the subnetworks' pass without and
    with the ensemble; the rows of one batch."""
    from sdp.rank import evaluation
    from sdp.data.base import val_batches
    from sdp.results.loggers import NullLogger
    from sdp.metrics.live import LiveTensorTracker
    from sdp.metrics.timing import PhaseTimer
    from sdp.rank.trainer import Trainer
    from tests.helpers import make_strategy

    strategy, data, cfg = make_strategy(config, rank, world)
    trainer = Trainer(cfg=cfg, strategy=strategy, data=data, logger=NullLogger(), timer=PhaseTimer(device=strategy.ctx.device))
    row = trainer.fit().last_eval
    ctx, bs = strategy.ctx, int(cfg.train.eval_batch_size)
    probs, targets, batch_rows = [], [], 0
    with strategy.subnetwork_module() as own, evaluation.applied(
            own, bn=str(cfg.eval.bn), shards=[s() for s in trainer.calibration(every_replica=True)], ctx=ctx, average=False) as m:
        for j in range(world):
            for x, y in val_batches(data, rank=j, world_size=world, batch_size=bs, num_workers=0):
                out = m(x)
                batch_rows = max(batch_rows, y.numel())
                probs.append(torch.softmax(out.reshape(-1, out.shape[-1]).double(), -1))
                targets.append(y.reshape(-1))
    peaks = {}
    for ensemble in (False, True):
        tracker = LiveTensorTracker()
        with tracker, strategy.subnetwork_module() as own:
            evaluation.own_totals(own, bn=str(cfg.eval.bn), calibration=trainer.calibration(every_replica=True), ctx=ctx,
                                  data=data, world_size=world, batch_size=bs, num_workers=0, ensemble=ensemble)
        peaks[ensemble] = tracker.peak
    return {"row": row, "probs": torch.cat(probs), "targets": torch.cat(targets), "peaks": peaks, "batch_rows": batch_rows}


@pytest.mark.dist
@pytest.mark.timeout(420)
@pytest.mark.parametrize("model", [RESNET, LLAMA], ids=["resnet-bn", "llama"])
def test_at_half_coverage_the_ensemble_is_the_mean_of_the_workers_probabilities(model: list[str]) -> None:
    from tests.helpers import config_dict, spawn

    config = config_dict([*model, "parallelism=sdp", "parallelism.coverage=0.5", "cluster.world_size=2"])
    got = spawn(_half, world=2, args=(config,))
    probs, targets = torch.stack([g["probs"] for g in got]), got[0]["targets"]  # (workers, rows, classes)
    assert all(torch.equal(g["targets"], targets) for g in got), "every rank evaluates the same samples"
    assert not torch.allclose(probs[0], probs[1]), "C = 0.5: the workers' subnetworks must differ"
    mean = probs.mean(0)
    ref_loss = -mean.gather(1, targets[:, None]).log().mean().item()
    ref_acc = (mean.argmax(-1) == targets).double().mean().item()
    own = [-p.gather(1, targets[:, None]).log().mean().item() for p in probs]  # each worker's own loss
    classify = config["dataset"]["name"] == "digits"
    for r, g in enumerate(got):
        row = g["row"]
        print(f"rank {r} C=0.5 {config['model']['name']}: ensemble loss {row['eval_loss_ensemble']:.6f} "
              f"(reference {ref_loss:.6f}) acc {row.get('eval_accuracy_ensemble')} (reference {ref_acc:.4f}) | "
              f"workers' {row['eval_loss_workers']:.6f} acc {row.get('eval_accuracy_workers')} | assembled {row['eval_loss']:.6f} "
              f"acc {row.get('eval_accuracy')} | pass peak without / with ensemble {g['peaks'][False]} / {g['peaks'][True]} B")
        assert row["eval_loss_workers"] == pytest.approx(sum(own) / len(own), rel=1e-5), (row, own)  # the same subnetworks
        assert row["eval_loss_ensemble"] == pytest.approx(ref_loss, rel=1e-5), (row, ref_loss)
        if classify:
            assert row["eval_accuracy_ensemble"] == pytest.approx(ref_acc, abs=1e-12), (row, ref_acc)
        else:
            assert row.get("eval_accuracy_ensemble") is None, row  # a language model's row has no accuracy
        batch_probs = g["batch_rows"] * probs.shape[-1] * 4  # one batch of float32 probabilities
        extra = g["peaks"][True] - g["peaks"][False]
        assert extra <= batch_probs, f"rank {r}: the ensemble adds {extra} B to the pass's peak, over one batch of " \
                                     f"probabilities ({batch_probs} B): {g['peaks']}"


def _ensemble_traffic(rank: int, world: int, task: str) -> dict[str, Any]:
    """:func:`sdp.rank.evaluation.own_totals` of this rank's own tiny model (seeded by rank: the workers differ)
    on a validation set of ``task``, with and without the ensemble: its totals, the eval-phase bytes and
    collectives each recorded, and this rank's probabilities on every validation row (the full-probability
    reference the test computes)."""
    from torch import nn
    from torch.utils.data import TensorDataset

    from sdp.data.base import DataBundle, val_batches
    from sdp.parallel import DistContext
    from sdp.rank.evaluation import own_totals

    vocab, rows = (50, 6) if task == "lm" else (4, 16)  # few classes: the ensemble's arg-max is right on some rows
    torch.manual_seed(1000 + rank)
    if task == "lm":  # (rows, seq) tokens, next-token targets
        x, y = torch.randint(0, vocab, (2, rows, 5)).unbind(0)
        model: nn.Module = nn.Sequential(nn.Embedding(vocab, 8), nn.Linear(8, vocab))
    else:  # (rows, features) inputs, class targets
        x, y = torch.randn(rows, 8), torch.randint(0, vocab, (rows,))
        model = nn.Linear(8, vocab)
    g = torch.Generator().manual_seed(7)  # the same validation set on every rank
    x = torch.randint(0, vocab, x.shape, generator=g) if task == "lm" else torch.randn(x.shape, generator=g)
    y = torch.randint(0, vocab, y.shape, generator=g)
    data = DataBundle(train=TensorDataset(x, y), val=TensorDataset(x, y), task=task, num_classes=vocab,
                      input_shape=tuple(x.shape[1:]))
    out: dict[str, Any] = {}
    for ensemble in (False, True):
        ctx = DistContext(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
        with torch.no_grad():
            own, ens = own_totals(model, bn="reestimate", calibration=[lambda: iter(())] * world, ctx=ctx, data=data,
                                  world_size=world, batch_size=4, num_workers=0, ensemble=ensemble)
        out[ensemble] = {"own": own, "ens": ens, **ctx.comm.summary()["outside_training"].get("eval", {"bytes": 0, "collectives": 0})}
    with torch.no_grad():
        out["probs"] = torch.cat([torch.softmax(model(xb).double(), -1).reshape(-1, vocab)
                                  for j in range(world) for xb, _ in val_batches(data, rank=j, world_size=world, batch_size=4)])
        out["targets"] = torch.cat([yb.reshape(-1) for j in range(world)
                                    for _, yb in val_batches(data, rank=j, world_size=world, batch_size=4)])
    out["batches"] = sum(1 for j in range(world) for _ in val_batches(data, rank=j, world_size=world, batch_size=4))
    return out


@pytest.mark.dist
@pytest.mark.core
@pytest.mark.timeout(120)
@pytest.mark.parametrize("task", ["lm", "classification"])
def test_a_language_models_ensemble_moves_two_values_per_token_and_a_classifiers_its_probabilities(task: str) -> None:
    """The ensemble's loss (the log of the workers' mean probability of each target) equals the full-probability
    computation's (every worker's whole softmax gathered), and the bytes it adds to the evaluation's comm records
    are exact: 2 x 8 per token (the log-probabilities' MAX and SUM) for an LM, which reports no ensemble accuracy
    and so never all-reduces the vocabulary's probabilities (2 TB per rank at FineWeb scale); a classifier adds
    its probabilities (rows x classes x 4) for the arg-max it reports."""
    from tests.helpers import spawn

    world = 2
    got = spawn(_ensemble_traffic, world=world, args=(task,))
    probs, targets = torch.stack([g["probs"] for g in got]), got[0]["targets"]
    assert not torch.allclose(probs[0], probs[1]), "the workers' models must differ"
    mean = probs.mean(0)
    ref_loss = -mean.gather(1, targets[:, None]).log().sum().item()
    ref_correct = (mean.argmax(-1) == targets).sum().item()
    tokens, classes, batches = targets.numel(), probs.shape[-1], got[0]["batches"]  # one chunk per batch here
    expect = 2 * 8 * tokens + (tokens * classes * 4 if task == "classification" else 0)
    for r, g in enumerate(got):
        ens = g[True]["ens"]
        added = g[True]["bytes"] - g[False]["bytes"]
        calls = g[True]["collectives"] - g[False]["collectives"]
        print(f"rank {r} {task}: ensemble loss sum {ens[0].item():.10f} (full probabilities {ref_loss:.10f}), correct "
              f"{ens[1].item()} (reference {ref_correct}), {tokens} tokens x {classes} classes: +{added} B in {calls} collectives")
        assert ens[2].item() == tokens and torch.equal(g[True]["own"], g[False]["own"]), (r, g)
        assert ens[0].item() == pytest.approx(ref_loss, rel=1e-6), (r, ens, ref_loss)  # float32 log-softmax
        assert ens[1].item() == (ref_correct if task == "classification" else 0), (r, ens, ref_correct)
        assert added == expect, f"rank {r} {task}: the ensemble recorded {added} B, expected {expect} B ({tokens} tokens, " \
                                f"{classes} classes)"
        assert calls == batches * (3 if task == "classification" else 2), (r, calls, batches)
        assert torch.equal(ens, got[0][True]["ens"]), "every rank has the same ensemble totals"
