"""What one rank runs: join the process group, build data, model and strategy, train, report.

Called by the local launcher (torch elastic, one process per rank) or directly when the process is
already a rank of an external launcher (torchrun, Slurm). Receives the config resolved once by the
driver as a plain dict, so every rank trains on exactly the same settings.
"""

from __future__ import annotations

import hashlib
import os
import socket
import statistics
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from sdp.rank import evaluation, final_weights, rng
from sdp.rank.checkpoint import release_verdicts
from sdp.results import contract as results
from sdp.data.base import DataBundle
from sdp.rank.rankenv import attempt_id, format_layout, launcher_identity, nodes_of, set_backends, world_layout
from sdp.core.distctx import WHERE, init_world
from sdp.results.rundir import RunDir
from sdp.results.summary import Final, Summary
from sdp.results.loggers import JsonlLogger, Logger, MultiLogger, NullLogger, WandbLogger
from sdp.metrics.flops import throughput
from sdp.metrics.groups import device_memory, process_groups
from sdp.metrics.memory import PeakTracker
from sdp.metrics.timing import PhaseTimer
from sdp.models import init
from sdp.models.base import SDPModel
from sdp.registry import build, import_plugins
from sdp.parallel import STRATEGIES, DistContext, JobFacts, Strategy
from sdp.rank.trainer import Trainer, global_batch_size

def resolve_device(cluster: DictConfig, local_rank: int) -> tuple[torch.device, str]:
    """Device and backend: NCCL on CUDA, gloo on CPU (``cluster.backend=auto``).

    Ranks beyond the visible GPUs wrap around (``local_rank % n_gpus``): several gloo ranks may share
    one GPU, which still gives each rank its own CUDA memory figures (NCCL refuses that).
    """
    if cluster.device == "cuda":
        device = torch.device(f"cuda:{local_rank % max(torch.cuda.device_count(), 1)}")
    else:
        device = torch.device("cpu")
    backend = str(cluster.backend)
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    return device, backend


def build_model(cfg: DictConfig, data: DataBundle, *, meta: bool = False) -> SDPModel:
    """The model, identical on every rank and under every strategy: built on the meta device, then
    materialised module by module, each from a seed derived from ``cfg.seed`` and its name
    (:mod:`sdp.models.init`). ``meta=True`` leaves it on the meta device for a strategy that
    materialises only what this rank holds (``Strategy.materialises_held``: forward-masking SDP); the
    values it materialises equal those of the full build."""
    torch.manual_seed(int(cfg.seed))
    with torch.device("meta"):
        model = build(cfg.model)
    assert isinstance(model, SDPModel), f"model {type(model).__name__} is not an sdp.models.base.SDPModel"
    init.on_meta(model, seed=int(cfg.seed))
    if not meta:
        init.materialise(model)
    return model


def dataset_tensors(data: DataBundle) -> list[torch.Tensor]:
    """The tensors of an in-memory dataset (empty for file-backed ones, which load batch by batch)."""
    out: list[torch.Tensor] = []
    for split in (data.train, data.val):
        out.extend(t for t in getattr(split, "tensors", ()) if isinstance(t, torch.Tensor))
    return out


def make_logger(*, cfg: DictConfig, ctx: DistContext, run_dir: Path, config: dict[str, Any]) -> Logger:
    if ctx.rank != 0:
        return NullLogger()
    group = run_dir.parent.name if run_dir.name.isdigit() else run_dir.name
    return MultiLogger(
        JsonlLogger(path=RunDir(run_dir).metrics),
        WandbLogger(cfg=cfg.logger.wandb, run_dir=run_dir, config=config, group=group,
                    job_type=str(cfg.parallelism.name), name=run_dir.name),
    )


@record
def run_rank(config: dict[str, Any], run_dir: str, budget: dict[str, Any] | None = None,
             prepared: Any = None) -> Summary | None:
    """Entry point of every rank; returns the summary on rank 0 and None elsewhere.

    ``budget`` (the driver's step count resolution, :mod:`sdp.driver.budget`) goes into summary.json with the
    throughput figures derived from it, so rank 0 writes the file once and complete. ``prepared``: what
    the strategy built once in the driver (SDP's plan), handed to the strategy, which builds nothing of it again."""
    cfg = OmegaConf.create(config)
    import_plugins(cfg)  # a strategy defined outside sdp/ registers itself on import (as in the driver)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device, backend = resolve_device(cfg.cluster, local_rank)
    backends = set_backends(device=device, deterministic=bool(cfg.train.deterministic), tf32=bool(cfg.train.get("tf32", True)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    threads = cfg.cluster.get("threads_per_rank") or max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(int(threads))
    mem = cfg.get("memory") or {}
    budget_mb = mem.get("budget_mb")
    peak = PeakTracker(device=device, live=bool(mem.get("tracker", True)),
                       budget_bytes=int(float(budget_mb) * 2**20) if budget_mb is not None else None)
    # NCCL: bound to its device, the default communicator is created at once and every later new_group
    # (SDP's holder sets) is split from it, sharing its resources: split_share (sdp.core.distctx.comm_options).
    timeout = timedelta(seconds=float(cfg.cluster.timeout_s))
    init_world(backend=backend, timeout=timeout, device_id=device if backend == "nccl" else None)
    logger: Logger = NullLogger()
    out = Path(run_dir)
    try:
        # Under an external launcher every process composed its own config; rank 0's dir wins, and every rank must
        # resume what rank 0 resumes (rank 0 verified it: sdp.driver.checkpoint_resume.resolve_once).
        shared, resume = [run_dir, cfg.train.get("resume")], cfg.train.get("resume")
        dist.broadcast_object_list(shared, src=0)
        out = Path(shared[0])
        if resume != shared[1]:
            raise RuntimeError(f"rank {rank} resumes from train.resume={resume!r}, rank 0 from {shared[1]!r}: every rank "
                               "must resume the same checkpoint (a run directory every rank sees, hydra.run.dir=<dir>)")
        if rank == 0:  # every rank has joined: none reads the resume verdict any more
            release_verdicts(run_dir=out, attempt=attempt_id(), world_size=world, timeout_s=0)
        WHERE.keep_at(str(RunDir(out).failure_rank(rank)), rank=rank, world=world)  # survives an abort (sdp.core.distctx)
        ctx = DistContext(rank=rank, world_size=world, local_rank=local_rank, device=device, backend=backend)
        layout = world_layout(rank=rank, local_rank=local_rank, device=device, world_size=world, nodes=cfg.cluster.get("nodes"))
        if rank == 0:
            print(format_layout(layout), flush=True)
        # the code that runs is the code imported now: a commit made while the run trains must not be recorded
        started = results.versions() if rank == 0 else {}
        data: DataBundle = build(cfg.dataset)
        peak.ignore(dataset_tensors(data))  # the in-memory dataset is not the strategy's memory
        peak.start()  # the set-up peak: model build, masking, wrapping, optimizer
        spec = STRATEGIES.get(str(cfg.parallelism.name))
        strategy: Strategy = spec.runtime(cfg=cfg.parallelism, job=JobFacts.of(cfg, budget=budget), ctx=ctx, prepared=prepared)
        model = build_model(cfg, data, meta=strategy.materialises_held)
        rng.seed_rank_streams(int(cfg.seed) * 7919 + rank + 1)  # per-rank streams (dropout, stochastic depth)
        strategy.checkpoint_blocks(model=model)  # train.ac, before the strategy wraps, masks or shards the model
        strategy.setup(model=model, optimizer_factory=lambda params: build(cfg.optim.optimizer)(params))
        if rank == 0:
            strategy.save_artifacts(run_dir=out)
        logger = make_logger(cfg=cfg, ctx=ctx, run_dir=out, config=config)
        timer = PhaseTimer(device=device)
        trainer = Trainer(cfg=cfg, strategy=strategy, data=data, logger=logger, timer=timer, run_dir=out, peak=peak,
                          budget=budget)
        state = trainer.fit()
        final_weights.save(run_dir=out, strategy=strategy, dtype=str(cfg.train.get("save_final", "none")), step=state.step)
        summary = collect_summary(cfg=cfg, ctx=ctx, strategy=strategy, trainer=trainer, peak=peak, timer=timer, state=state,
                                  versions=started)
        if rank == 0:
            summary.run_dir, summary.budget, summary.nodes = str(out), budget, nodes_of(layout)
            summary.backends = backends  # before throughput: MFU's peak is TF32's when fp32 matmuls ran on it
            summary.time.update(throughput(summary=summary.to_json(), flops_per_step=(budget or {}).get("flops_per_step")))
            summary.write(RunDir(out))
            if isinstance(logger, MultiLogger):
                for lg in logger.loggers:
                    if isinstance(lg, WandbLogger):
                        lg.summary({"final": summary.final.to_json(), "time": summary.time})
        WHERE.release()  # nothing failed: no failure file
        return summary if rank == 0 else None
    except Exception as exc:
        # This rank's own account (the launcher's failure.json names the job's first failure).
        results.write_json(RunDir(out).failure_rank(rank), {"rank": rank, "error": type(exc).__name__, "message": str(exc),
                                                            "where": WHERE.describe()})
        raise
    finally:
        peak.stop()
        logger.finish()
        dist.destroy_process_group()


def param_digest(model: torch.nn.Module) -> str:
    """SHA-256 over the parameters this rank holds (local shards), to prove replicas agree bitwise."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        t = p.to_local() if hasattr(p, "to_local") else p
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def device_facts(device: torch.device) -> dict[str, Any]:
    """Where a rank computed (host, device, its name): MFU counts distinct devices, not ranks."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"host": socket.gethostname(), "device": str(device), "device_name": name}


def data_used(trainer: Trainer) -> dict[str, Any]:
    """Samples of the train and val splits the run used, and target tokens where samples are sequences."""
    data = trainer.data
    train, val = len(data.train), len(data.val)
    per = int(data.input_shape[0]) if data.task == "lm" else None  # one target per input token
    return {"train_samples": train, "val_samples": val,
            "train_tokens": train * per if per else None, "val_tokens": val * per if per else None}


def memory_record(*, rank: int, strategy: Strategy, activation_bytes: int | None, peak: PeakTracker,
                  device: torch.device, eval_assembled_bytes: int | None) -> dict[str, Any]:
    """This rank's ``memory`` entry of summary.json. The device's end-of-run snapshot
    (:func:`~sdp.metrics.groups.device_memory`: its total, and the use now) goes in first, so the
    tracker's ``cuda_device_used_bytes``, the largest use seen at any phase switch, is the one kept:
    the end value is lower whenever the allocator released memory before the run finished."""
    return {"rank": rank, **strategy.state_bytes(), "activation_bytes": activation_bytes, **device_memory(device),
            **peak.summary(), "eval_assembled_bytes": eval_assembled_bytes,
            "param_digest": param_digest(strategy.unwrapped())}


def run_facts(*, cfg: DictConfig, world_size: int, prepared: Any, precision: str, state: dict[str, Any]) -> dict[str, Any]:
    """The :class:`Summary` fields that follow from the config, the strategy's plan (``prepared``) and the trainer's
    counters (``state``: a :class:`~sdp.rank.trainer.TrainState` as a dict, as a checkpoint keeps it): what rank 0's
    summary and one the driver rebuilds from a finished run's checkpoint (:mod:`sdp.driver.finished`) share."""
    name, last = str(cfg.parallelism.name), state.get("last_eval") or {}
    return dict(
        strategy=name,
        # label, coverage: the report's method and C columns (SDP's k / n: the plan the ranks ran)
        **STRATEGIES.get(name).report_facts(cfg=cfg.parallelism, world_size=world_size, prepared=prepared,
                                                  ac=str(cfg.train.get("ac", "none"))),
        model=str(cfg.model.get("name", "")), dataset=str(cfg.dataset.get("name", "")), world_size=world_size,
        steps=state["step"], skipped_steps=state["skipped_steps"], global_batch=global_batch_size(cfg), seed=int(cfg.seed),
        precision=precision, eval_protocol=evaluation.protocol(cfg),
        final=Final.of({**last, "train_loss": state["last_loss"]}))


def collect_summary(
    *, cfg: DictConfig, ctx: DistContext, strategy: Strategy, trainer: Trainer, peak: PeakTracker, timer: PhaseTimer, state: Any,
    versions: dict[str, Any]
) -> Summary:
    """Gather every rank's measurements and fill the run's :class:`Summary` (meaningful on rank 0); ``versions``:
    the commit and tree state taken when the run started."""
    warmup = int(cfg.train.warmup_steps)
    extra = strategy.info()
    mine = {
        "rank": ctx.rank,
        "memory": memory_record(rank=ctx.rank, strategy=strategy, activation_bytes=trainer.activation_bytes, peak=peak,
                                device=ctx.device, eval_assembled_bytes=extra.get("eval_assembled_bytes")),
        "process_groups": {"rank": ctx.rank, **process_groups()},
        "comm": {"rank": ctx.rank, **ctx.comm.summary()},
        "time": {"rank": ctx.rank, **timer.summary(warmup=warmup), **device_facts(ctx.device)},
        "launcher": {"rank": ctx.rank, **launcher_identity()},
    }
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    per_rank_time = [g["time"] for g in gathered]
    medians = [t["step_s_median"] for t in per_rank_time if t["step_s_median"]]
    step_s = max(medians) if medians else None
    return Summary(
        **run_facts(cfg=cfg, world_size=ctx.world_size, prepared=strategy.prepared, precision=strategy.precision,
                    state=asdict(state)),
        dataset_notes=list(trainer.data.notes),
        data=data_used(trainer),
        memory_per_rank=[g["memory"] for g in gathered],
        comm_per_rank=[g["comm"] for g in gathered],
        process_groups_per_rank=[g["process_groups"] for g in gathered],
        time={
            "step_s_median": step_s,
            "samples_per_s": trainer.global_batch / step_s if step_s else None,
            "straggler_spread": (max(medians) / min(medians)) if medians else None,
            "tokens_per_sample": trainer.tokens_per_sample,
            "tokens_per_s": trainer.global_batch * trainer.tokens_per_sample / step_s if step_s and trainer.tokens_per_sample else None,
            "per_rank": per_rank_time,
            "warmup_steps": warmup,
            "median_of_rank_medians": statistics.median(medians) if medians else None,
        },
        launcher_per_rank=[g["launcher"] for g in gathered],
        strategy_info=extra,
        versions=versions,
        machine=results.machine(),
    )
