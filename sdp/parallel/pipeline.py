"""Pipeline-parallel baseline: ``torch.distributed.pipelining`` with stages cut at block boundaries.

Why these choices:
- Manual split (torchtitan style), not the tracer: a stage is the stem (first stage), a contiguous
  run of blocks kept under their original names (``blocks.3...``, so gradients and state compare
  name by name with the unsplit model), and the head (last stage). Non-owned parts of the model are
  released; a meta-device skeleton of the whole model is kept for evaluation.
- Ranks form a (dp, pp) mesh: pipeline replicas of ``pp = world / dp`` consecutive ranks. The
  trainer splits the global batch over the dp replicas only; every rank of a replica loads the
  replica's batch, the first stage splits it into ``microbatches`` and the last computes the loss.
  With dp > 1 each stage's gradients are all-reduced over its dp group (one flat all-reduce).
- Gradients equal the unsplit model's: the loss is the mean per microbatch and the schedule divides
  the accumulated gradients by the microbatch count (``scale_grads``).
- BatchNorm inside a stage normalises with per-*microbatch* statistics, so a BatchNorm model's
  training differs from DDP unless a microbatch is the whole per-rank batch; LayerNorm models match.
- Evaluation assembles the full model on every rank: each stage's parameters and buffers are
  broadcast from their owner over the pipeline group (counted as ``eval`` traffic), then buffers are
  averaged like every other strategy's. Simplest correct choice: the trainer evaluates each rank's
  own validation shard with a plain module, which a stage-by-stage evaluation could not do.
- Communication (activation / gradient sends and receives, dp all-reduces) is counted by
  intercepting ``torch.distributed`` during the step (:func:`sdp.metrics.collectives.count_collectives`).
"""

from __future__ import annotations

import copy
import itertools
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from sdp.core.distctx import average_buffers, mesh_overrides
from sdp.errors import ConfigError, require
from sdp.metrics.collectives import count_collectives
from sdp.metrics.groups import mesh_process_groups
from sdp.metrics.timing import PhaseTimer
from sdp.models.base import SDPModel, count_params
from sdp.parallel.base import LossFn, OptimizerFactory, StepResult, Strategy
from sdp.parallel.job import JobFacts
from sdp.parallel.spec import StrategySpec, register
from sdp.parallel.pipeline_plan import PipelineConfig, PipelinePlan, check_layout, make_plan
from sdp.parallel.plan_entries import Entry, Record, activations, nbytes, optim_bytes, rank_entry


class StageModule(nn.Module):
    """Stem (first stage only) -> blocks[lo:hi] under their original indices -> head (last stage only).

    ``precision`` is the strategy's :meth:`~sdp.parallel.base.Strategy.autocast`: the schedule runs
    forward and backward inside one call, so the stage's forward enters the run's precision itself
    (the backward then runs outside it, as for every other strategy). The last stage returns float32
    logits so that the schedule's loss is computed in float32, as ``Strategy._forward_loss`` does."""

    def __init__(self, *, model: SDPModel, lo: int, hi: int, first: bool, last: bool,
                 precision: Callable[[], Any] = nullcontext) -> None:
        super().__init__()
        self.stem = model.stem if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(lo, hi)})
        self.head = model.head if last else None
        self.precision = precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        with self.precision():
            if self.stem is not None:
                x = self.stem(x)
            for block in self.blocks.values():
                x = block(x)
            if self.head is None:
                return x
            return self.head(x).float()


def meta_skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers live on the meta device (no memory)."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def stage_of(model: SDPModel, plan: PipelinePlan, s: int, *, precision: Callable[[], Any] = nullcontext) -> StageModule:
    return StageModule(model=model, lo=plan.bounds[s], hi=plan.bounds[s + 1], first=s == 0, last=s == plan.num_stages - 1,
                       precision=precision)


class PipelineStrategy(Strategy):
    """GPipe / 1F1B / interleaved 1F1B over ``world / dp`` ranks, optionally replicated dp times."""

    def setup(self, *, model: SDPModel, optimizer_factory: OptimizerFactory) -> None:
        ctx = self.ctx
        plan = self.prepared if self.prepared is not None else make_plan(  # the driver's cut (PipelineSpec.prepare)
            cfg=self.cfg, world_size=ctx.world_size, model=model, batch_size=self.job.batch_size)
        self.plan = plan
        # every dimension's groups get the job's timeout and NCCL options (sdp.core.distctx.mesh_overrides)
        self.mesh = init_device_mesh(ctx.device.type, (plan.dp, plan.pp), mesh_dim_names=("dp", "pp"),
                                     backend_override=mesh_overrides((plan.dp, plan.pp)))
        self.pp_group, self.dp_group = self.mesh.get_group("pp"), self.mesh.get_group("dp")
        self.pp_rank, self.dp_rank = self.mesh.get_local_rank("pp"), self.mesh.get_local_rank("dp")
        self.skeleton = meta_skeleton(model)
        self.stage_keys = [list(stage_of(self.skeleton, plan, s).state_dict()) for s in range(plan.num_stages)]
        self.stage_params = [count_params(stage_of(self.skeleton, plan, s)) for s in range(plan.num_stages)]
        self.stage_ids = plan.stages_of(self.pp_rank)
        stages = [stage_of(model, plan, s, precision=self.autocast).to(ctx.device) for s in self.stage_ids]
        self._release_unowned(model)
        self.module = nn.ModuleList(stages)
        self.pipe_stages = [PipelineStage(m, s, plan.num_stages, ctx.device, group=self.pp_group)
                            for m, s in zip(stages, self.stage_ids)]
        self.optimizer = optimizer_factory(self.module.parameters())
        self.schedule: Any = None
        self.microbatches = int(self.cfg.microbatches)

    def _release_unowned(self, model: SDPModel) -> None:
        """Drop this rank's references to other stages' modules so their memory is freed."""
        owned = {i for s in self.stage_ids for i in range(self.plan.bounds[s], self.plan.bounds[s + 1])}
        for i in range(len(model.blocks)):
            if i not in owned:
                model.blocks[i] = nn.Identity()
        if 0 not in self.stage_ids:
            model.stem = nn.Identity()
        if self.plan.num_stages - 1 not in self.stage_ids:
            model.head = nn.Identity()

    def data_parallel(self) -> tuple[int, int]:
        """Only pipeline replicas split the batch: all ranks of a replica see the same samples."""
        return self.dp_rank, self.plan.dp

    def _build_schedule(self, loss_fn: LossFn) -> Any:
        kind, mb = str(self.cfg.schedule), self.microbatches
        if kind == "gpipe":
            return ScheduleGPipe(self.pipe_stages[0], mb, loss_fn=loss_fn, scale_grads=True)
        if kind == "1f1b":
            return Schedule1F1B(self.pipe_stages[0], mb, loss_fn=loss_fn, scale_grads=True)
        return ScheduleInterleaved1F1B(self.pipe_stages, mb, loss_fn=loss_fn, scale_grads=True)

    def train_step(
        self, *, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn, timer: PhaseTimer, step: int
    ) -> StepResult:
        assert self.module is not None and self.optimizer is not None
        if self.schedule is None:
            self.schedule = self._build_schedule(loss_fn)
        first, last = 0 in self.stage_ids, self.plan.num_stages - 1 in self.stage_ids
        losses: list[torch.Tensor] = []
        with count_collectives(self.ctx.comm):
            with timer.phase("forward_backward"):  # all microbatches, interleaved, with stage sends
                self.schedule.step(*((inputs,) if first else ()), target=targets if last else None,
                                   losses=losses if last else None, return_outputs=False)
            self._note_grads()
            if self.plan.dp > 1:
                with timer.phase("comm"):  # not overlapped: after the schedule
                    self._sync_grads()
            with timer.phase("optimizer"):
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
        if not last:
            return StepResult(loss_sum=torch.zeros((), device=inputs.device), count=0)
        n = int(inputs.shape[0])
        return StepResult(loss_sum=torch.stack([l.detach() for l in losses]).sum() * (n // self.microbatches), count=n)

    def _sync_grads(self) -> None:
        """Average this rank's stage gradients over the pipeline replicas (one flat all-reduce)."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.plan.dp
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    @contextmanager
    def eval_module(self) -> Iterator[nn.Module]:
        """The whole model, assembled on every rank from the stage owners (see module docstring)."""
        comm = self.ctx.comm
        with comm.phase_as("eval"):
            with count_collectives(comm):
                full = self._assemble()
            average_buffers(full, ctx=self.ctx)  # records its own all-reduce
        full.eval()
        yield full

    @torch.no_grad()
    def _assemble(self) -> nn.Module:
        full = copy.deepcopy(self.skeleton).to_empty(device=self.ctx.device)
        dest = full.state_dict(keep_vars=True)
        mine = dict(zip(self.stage_ids, self.module))  # type: ignore[arg-type]
        for s, keys in enumerate(self.stage_keys):
            owner = self.plan.owner(s)
            src = mine[s].state_dict() if s in mine else None
            for dtype in sorted({dest[k].dtype for k in keys}, key=str):
                group_keys = [k for k in keys if dest[k].dtype == dtype]
                if src is not None:
                    flat = torch.cat([src[k].detach().reshape(-1) for k in group_keys])
                else:
                    flat = torch.empty(sum(dest[k].numel() for k in group_keys), dtype=dtype, device=self.ctx.device)
                dist.broadcast(flat, group=self.pp_group, group_src=owner)
                offset = 0
                for k in group_keys:
                    dest[k].data.copy_(flat[offset : offset + dest[k].numel()].view_as(dest[k]))
                    offset += dest[k].numel()
        return full

    # ---- checkpoint / resume ------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, dict[str, Any]]:
        """Everything under ``"local"``: a rank holds its own stages (parameters under their original
        names, buffers) and their optimizer state; the cut goes along to be checked on load."""
        assert self.module is not None and self.optimizer is not None
        return {"local": {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                          "extra": {"stages": list(self.stage_ids), "bounds": list(self.plan.bounds)}}}

    def load_checkpoint_state(self, state: dict[str, dict[str, Any]]) -> None:
        assert self.module is not None and self.optimizer is not None
        local = state["local"]
        now = {"stages": list(self.stage_ids), "bounds": list(self.plan.bounds)}
        require(local["extra"] == now, "parallelism.split_points", self.cfg.split_points,
                f"must cut the model as the checkpoint does to resume (saved {local['extra']}, now {now}; "
                f"set parallelism.split_points={local['extra']['bounds'][1:-1]})")
        self.module.load_state_dict(local["model"])
        self.optimizer.load_state_dict(local["optimizer"])

    def summary_extra(self) -> dict[str, Any]:
        return {
            "schedule": str(self.cfg.schedule),
            "microbatches": self.microbatches,
            "pp": self.plan.pp,
            "dp": self.plan.dp,
            "stages_per_rank": self.plan.stages_per_rank,
            "stage_bounds": list(self.plan.bounds),
            "stage_params": self.stage_params,
            "stage_owner_pp_rank": [self.plan.owner(s) for s in range(self.plan.num_stages)],
        }


@register("pipeline")
class PipelineSpec(StrategySpec):
    """The pipeline in the driver: its layout checked, its cut made once (:meth:`prepare`), its prediction."""

    label = "Pipeline"
    runtime = PipelineStrategy
    schema = PipelineConfig
    gloo_cuda_refusal = ("its stages send activations and gradients point to point (torch.distributed.pipelining), "
                         "which gloo does not do for CUDA tensors")
    overlap = None  # its step is a schedule of microbatches (bubble, stage cut): no step-time prediction

    @classmethod
    def validate(cls, *, cfg: DictConfig, job: JobFacts) -> None:
        if job.ac_every:  # its stages are cut from the blocks in setup: not rehearsed or tested with checkpointing
            raise ConfigError("train.ac=full is not supported with parallelism.name='pipeline': use train.ac=none")
        check_layout(cfg=cfg, world_size=job.world_size)

    @classmethod
    def prepare(cls, *, cfg: DictConfig, job: JobFacts, model: SDPModel) -> PipelinePlan:
        """The cut of the real model's structure (meta) into stages, checked: what every rank runs."""
        return make_plan(cfg=cfg, world_size=job.world_size, model=model, batch_size=job.batch_size)

    @classmethod
    def predict(cls, *, cfg: DictConfig, job: JobFacts, model: SDPModel, facts: dict[str, Any],
                prepared: Any = None) -> list[Entry]:
        """Stage parameters of each rank (the strategy's own cut); per microbatch a stage receives its
        input and sends its input's gradient, sends its output and receives that gradient; with dp > 1
        one all-reduce of the stage gradients. Activations: one microbatch's saved bytes times the
        microbatches in flight (1F1B: stages after this one + 1; GPipe: all)."""
        pc, batch, world = cfg, job.batch_size, job.world_size
        plan = prepared if prepared is not None else make_plan(cfg=pc, world_size=world, model=model, batch_size=batch)
        facts["process_groups"] = mesh_process_groups(world_size=world, shape=(plan.dp, plan.pp))  # setup's mesh
        mbs = int(pc.microbatches)
        mb_size = batch * plan.pp // mbs  # the replica's batch (batch x pp) split into microbatches
        x = model.example_input(mb_size).to("meta")
        boundary = [x]  # input of stage s, s = 0..num_stages
        with torch.no_grad():
            for s in range(plan.num_stages):
                boundary.append(stage_of(model, plan, s)(boundary[-1]))
        out = []
        for r in range(world):
            pp_rank = r % plan.pp
            stages = plan.stages_of(pp_rank)
            mods = [stage_of(model, plan, s) for s in stages]
            params = [p for m in mods for p in m.parameters()]
            records: list[Record] = []
            acts = 0
            for s, m in zip(stages, mods):
                if s > 0:
                    records += [("recv", nbytes([boundary[s]]), 2), ("send", nbytes([boundary[s]]), 2)] * mbs
                if s < plan.num_stages - 1:
                    records += [("send", nbytes([boundary[s + 1]]), 2), ("recv", nbytes([boundary[s + 1]]), 2)] * mbs
                inp = boundary[s].detach().requires_grad_(boundary[s].is_floating_point())
                in_flight = mbs if str(pc.schedule) == "gpipe" else min(mbs, plan.num_stages - s)
                acts += in_flight * activations(m, inp, job=job, loss=s == plan.num_stages - 1)
            if plan.dp > 1:
                records.append(("all_reduce", nbytes(params), plan.dp))
            out.append(rank_entry(rank=r, params=nbytes(params), grads=nbytes(params),
                                  optim=optim_bytes(held=nbytes(params), tensors=len(params), optimizer=job.optimizer), acts=acts,
                                  records=records))
        return out
