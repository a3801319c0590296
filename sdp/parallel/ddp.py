"""DDP baseline: torch ``DistributedDataParallel`` with a comm hook that counts every bucket it
all-reduces, so DDP's communication is measured exactly like SDP's."""

from __future__ import annotations

import warnings
import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from omegaconf import DictConfig

from sdp.core.fields import Number, flag, key
from sdp.metrics.comm import CommCounter
from sdp.models.base import SDPModel
from sdp.parallel.base import OptimizerFactory, Strategy
from sdp.parallel.job import JobFacts
from sdp.parallel.spec import Overlap, StrategySpec, register
from sdp.parallel.plan_entries import MIB, Entry, EvalTraffic, Record, activations, nbytes, optim_bytes, rank_entry
from sdp.parallel.plan_peaks import rehearse
from sdp.parallel.plan_entries import replica_parts
from sdp.subnet.holder_groups import predicted_process_groups


class _CountingState:
    """State of the counting hook: where to record, and the group DDP reduces over."""

    def __init__(self, *, comm: CommCounter, process_group: Any = None) -> None:
        self.comm = comm
        self.process_group = process_group
        self.group_size = dist.get_world_size(process_group)


def counting_allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]
    """DDP's default all-reduce (sum then divide by world size), recorded bucket by bucket.

    Unannotated on purpose: DDP compares the hook's annotations with ``dist.GradBucket`` and
    ``torch.futures.Future`` objects, which postponed (string) annotations would fail.
    """
    buf = bucket.buffer()
    state.comm.record(kind="all_reduce", payload=buf.numel() * buf.element_size(), group_size=state.group_size)
    return default_hooks.allreduce_hook(state.process_group, bucket)


def wrap_ddp(model: torch.nn.Module, *, cfg: Any, comm: CommCounter, device: torch.device, process_group: Any = None,
             hook: tuple[Any, Callable[..., Any]] | None = None) -> DistributedDataParallel:
    """The DDP wrapper every DDP-family strategy shares (plain, AC, stochastic depth, LayerDrop, PowerSGD).
    ``hook``: (state, comm hook) to register instead of the counting all-reduce (DDP takes one hook only;
    a strategy passing its own counts that hook's collectives itself, :mod:`sdp.parallel.powersgd`)."""
    with warnings.catch_warnings():
        # torch 2.14 deprecates broadcast_buffers in favour of forward_sync_buffers, whose False still
        # syncs at init; rank-local BatchNorm buffers (what we want) need broadcast_buffers=False.
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        ddp = _ddp(model, cfg=cfg, device=device, process_group=process_group)
    ddp.register_comm_hook(*(hook or (_CountingState(comm=comm, process_group=process_group), counting_allreduce_hook)))
    return ddp


def _ddp(model: torch.nn.Module, *, cfg: Any, device: torch.device, process_group: Any) -> DistributedDataParallel:
    sync_in_place(model, process_group=process_group, buffers=bool(cfg.broadcast_buffers))
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=process_group,
        broadcast_buffers=bool(cfg.broadcast_buffers),
        bucket_cap_mb=float(cfg.bucket_cap_mb),
        gradient_as_bucket_view=True,
        find_unused_parameters=bool(cfg.find_unused_parameters),
        init_sync=False,  # done by sync_in_place
    )


def sync_in_place(model: torch.nn.Module, *, process_group: Any, buffers: bool) -> None:
    """Rank 0's parameters (and with ``buffers`` its buffers) on every rank, broadcast tensor by tensor into the
    tensors themselves: what DDP's own initial sync does, without its flat copy. Why: DDP flattens them into
    broadcast buckets (up to 250 MB) that gloo's worker thread may free only after the reducer has allocated its
    gradient buckets, so the set-up peak was params + buckets or, under load, one flat copy more (the flaky
    DDP set-up cases of tests/test_plan_peaks.py: measured 1.5x the predicted peak on one rank at a time)."""
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    with torch.no_grad():
        for t in [*model.parameters(), *(model.buffers() if buffers else ())]:
            dist.broadcast(t.data, src=src, group=process_group)


def prime_buckets(ddp: DistributedDataParallel, *, example: torch.Tensor, comm: CommCounter) -> None:
    """One forward/backward of zeros so DDP records its gradient-ready order, as the first step of a
    fresh run does; the next forward then rebuilds buckets exactly as the uninterrupted run did at
    its step 2. Without it a resumed run trains its first step with the initial bucket layout, and on
    more than 2 ranks gloo's ring sums elements in an order that depends on their bucket offset, so the
    curve drifts in the last bits. Call before the checkpoint is loaded (the forward touches BatchNorm
    statistics and RNG streams, which the load then overwrites); its all-reduce is counted as
    ``checkpoint`` traffic, not training."""
    with comm.phase_as("checkpoint"):
        out = ddp(example)
        (out.float().sum() * 0).backward()
        ddp.zero_grad(set_to_none=False)


def ddp_bucket_members(sizes: list[int], *, cap_mb: float) -> list[list[int]]:
    """The tensors (indices into ``sizes``, bytes per parameter) of each bucket of DDP's greedy packing in
    reverse parameter order (first bucket 1 MiB), bucket 0 first."""
    buckets: list[list[int]] = [[]]
    used, cap = 0, 1 * MIB
    for i in reversed(range(len(sizes))):
        if used and used + sizes[i] > cap:
            buckets, used, cap = buckets + [[]], 0, int(cap_mb * MIB)
        buckets[-1].append(i)
        used += sizes[i]
    return buckets if used else buckets[:-1]


def ddp_buckets(sizes: list[int], *, cap_mb: float) -> int:
    """Bucket count of DDP's greedy packing (:func:`ddp_bucket_members`)."""
    return len(ddp_bucket_members(sizes, cap_mb=cap_mb))


class DDPStrategy(Strategy):
    """Every rank holds the full model; gradients are averaged over the world each step."""

    replicas_identical = True  # the averaged gradient updates every replica alike: one checkpoint copy ("shared")

    def setup(self, *, model: SDPModel, optimizer_factory: OptimizerFactory) -> None:
        model.to(self.ctx.device)
        self.module = wrap_ddp(model, cfg=self.cfg, comm=self.ctx.comm, device=self.ctx.device, hook=self.comm_hook())
        self.optimizer = optimizer_factory(self.module.parameters())

    def comm_hook(self) -> tuple[Any, Callable[..., Any]] | None:
        """(state, DDP comm hook) to all-reduce the buckets with; None (DDP): the counting all-reduce."""
        return None

    # train_step: the base template; DDP's all-reduce overlaps with the backward phase (no _sync_grads).

    def load_checkpoint_state(self, state: dict[str, dict[str, Any]]) -> None:
        assert isinstance(self.module, DistributedDataParallel)
        model = self.unwrapped()
        prime_buckets(self.module, example=model.example_input(2).to(self.ctx.device), comm=self.ctx.comm)
        super().load_checkpoint_state(state)


def ddp_peaks(*, job: JobFacts, model: SDPModel, eval_batch: int, prepare: Callable[[SDPModel], Any]) -> list[dict[str, int]]:
    """The DDP family's peak rehearsal: the replica's (``prepare``: what the strategy's ``setup`` does to
    the model before wrapping it, e.g. activation checkpointing); the reducer's buckets from the start."""
    mine = copy.deepcopy(model)
    prepare(mine)
    r = rehearse(module=mine, trainable=list(mine.parameters()), batch=job.batch_size, eval_batch=eval_batch,
                 optimizer=job.optimizer, example=model.example_input, precision=job.precision, device=job.device)
    buckets = nbytes(mine.parameters())
    one = {"setup_peak_bytes": r["setup"] + buckets, "train_peak_bytes": r["train"], "eval_peak_bytes": r["eval"]}
    return [dict(one) for _ in range(job.world_size)]


@dataclass
class DDPReducerConfig:
    """The keys of torch's DDP wrapper that every preset running it shares (``ddp``, ``ddp_ac``, ``powersgd``, the
    drop baselines): declared once, so each means the same in all; a preset's schema adds its own keys after them."""

    name: str = key()
    """The strategy, looked up in sdp.parallel.STRATEGIES."""
    bucket_cap_mb: Number = key(above=0)
    """Gradient bucket size in MiB."""
    broadcast_buffers: bool = flag()
    """Broadcast BatchNorm buffers from rank 0 every forward (false: ranks keep their own)."""


@dataclass
class DDPConfig(DDPReducerConfig):
    """``parallelism=ddp``: DistributedDataParallel, every rank holds the whole model (and the presets that are DDP
    with one more setting: ``ddp_ac``, ``powersgd``). The drop baselines lack ``find_unused_parameters``: their
    strategy sets it from the survival probability."""

    find_unused_parameters: bool = flag()
    """Only for models with parameters unused in some steps."""


@register("ddp")
class DDPSpec(StrategySpec):
    """The DDP family in the driver: a full replica on every rank."""

    label = "DDP"
    runtime = DDPStrategy
    schema = DDPConfig
    # its reducer all-reduces each bucket as backward fills it; the last bucket (the first layers) is ready
    # only when backward ends
    overlap = Overlap(kinds=("all_reduce",), window="backward", tail=1)

    @classmethod
    def prepare_for_plan(cls, *, model: SDPModel, cfg: DictConfig) -> None:
        """What ``setup`` does to the model before wrapping it, applied to the planner's meta model
        (``cfg``: the parallelism node). Plain DDP: nothing."""

    @classmethod
    def eval_traffic(cls, *, cfg: DictConfig, job: JobFacts, model: SDPModel, step: int,
                     prepared: Any = None) -> EvalTraffic | None:
        """The default ``eval_module``'s: every floating-point buffer averaged over the world in one all-reduce
        (:func:`sdp.core.distctx.average_buffers`); no workers' own models."""
        floats = [b for b in model.buffers() if b.is_floating_point()]
        build = [("all_reduce", nbytes(floats), job.world_size)] if floats and job.world_size > 1 else []
        return EvalTraffic(build=[list(build) for _ in range(job.world_size)], partwise=False, own=None)

    @classmethod
    def checkpoint_tensors(cls, *, cfg: DictConfig, job: JobFacts, model: SDPModel, step: int,
                           prepared: Any = None) -> list[dict[str, list[torch.Tensor]]] | None:
        """Every rank a whole replica, laid out by :meth:`Strategy.checkpoint_state` (parameters and optimizer state in
        rank 0's ``shared.pt`` where the runtime declares its replicas identical; buffers in each rank's file)."""
        parts = replica_parts(model=model, optimizer=job.optimizer, replicas_identical=cls.runtime.replicas_identical)
        return [parts] * job.world_size

    @classmethod
    def predict(cls, *, cfg: DictConfig, job: JobFacts, model: SDPModel, facts: dict[str, Any],
                prepared: Any = None) -> list[Entry]:
        """DDP family: full replica on every rank; one all-reduce of every gradient per step."""
        cls.prepare_for_plan(model=model, cfg=cfg)
        world, params = job.world_size, list(model.parameters())
        acts = activations(model, model.example_input(job.batch_size).to("meta"), job=job)
        sizes = [t.numel() * t.element_size() for t in params]
        n_buckets = ddp_buckets(sizes, cap_mb=float(cfg.bucket_cap_mb))
        total = sum(sizes)
        records: list[Record] = [("all_reduce", total / n_buckets, world)] * n_buckets
        optim = optim_bytes(held=total, tensors=len(params), optimizer=job.optimizer)
        facts["process_groups"] = predicted_process_groups(world_size=world, holder_sets=(), refresh=False)  # the default only
        return [rank_entry(rank=r, params=total, grads=total, optim=optim, acts=acts, records=records) for r in range(world)]

    @classmethod
    def predict_peaks(cls, *, cfg: DictConfig, job: JobFacts, model: SDPModel, eval_batch: int, steps: int,
                      eval_steps: frozenset[int], state: list[dict[str, Any]], prepared: Any = None) -> list[dict[str, int]] | None:
        return ddp_peaks(job=job, model=model, eval_batch=eval_batch, prepare=lambda m: cls.prepare_for_plan(model=m, cfg=cfg))
