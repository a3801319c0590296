"""FSDP2 baseline: ``fully_shard`` on every block, then on the root, over an explicit device mesh.

Why these choices:
- Per-block sharding (bottom-up, root last) is the FSDP2 recipe: each block is one all-gather /
  reduce-scatter group, so at most one block's full parameters live outside their shards at a time.
- The mesh is always explicit (``init_device_mesh(device.type, ...)``): with a gloo default group on
  a machine with GPUs, ``fully_shard`` without a CPU mesh moves parameters to CUDA (pytorch #132471).
- Reductions are forced to SUM followed by a division (``set_force_sum_reduction_for_comms``): gloo's
  reduce-scatter with AVG has summed instead of averaging (pytorch #162338, silent). The gradient test
  in ``tests/test_fsdp.py`` compares the gathered gradients with a single-process reference.
- The model arrives on the meta device (``materialises_held``) and is sharded there; each rank then
  allocates its shards only and fills them module by module with the full build's seeded values
  (:func:`sdp.models.init.materialise_sharded`), so no rank ever holds the whole fp32 model and FSDP
  still starts from exactly the parameters DDP and SDP start from (``tests/test_fsdp_meta.py``).
- ``parallelism.replicate`` > 1 is HSDP: a 2-D mesh (replicate, shard), parameters sharded within a
  shard group and all-reduced across replicas.
- Precision comes from ``train.precision`` (:func:`sdp.core.precision.fsdp_policies`): bf16 all-gathers
  and computes in bf16 and reduce-scatters in float32, BatchNorm layers sharded apart in float32;
  the forward runs under the same autocast as every other strategy (``Strategy._forward_loss``).
- Communication is counted by intercepting the ``torch.distributed`` collectives FSDP issues
  (:func:`sdp.metrics.collectives.count_collectives`); memory counts local shards (``to_local``).
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from omegaconf import DictConfig
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from sdp.core.distctx import average_buffers, mesh_overrides
from sdp.core.fields import flag, key
from sdp.errors import require
from sdp.metrics.collectives import count_collectives
from sdp.metrics.groups import mesh_process_groups
from sdp.models import init
from sdp.models.base import SDPModel
from sdp.core.precision import DTYPES, fsdp_policies
from sdp.parallel.base import OptimizerFactory, Strategy
from sdp.parallel.job import JobFacts
from sdp.parallel.spec import Overlap, StrategySpec, register
from sdp.parallel.plan_entries import Entry, Record, activations, nbytes, optim_bytes, rank_entry
from sdp.parallel.plan_peaks import rehearse


def fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    """Every ``fully_shard``-ed module under ``module`` (root included), in ``modules()`` order."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def shard_rows(rows: int, *, rank: int, shards: int) -> int:
    """Rows of dim 0 rank ``rank`` holds under FSDP2's ``torch.chunk`` rule (the last ranks may hold none)."""
    chunk = math.ceil(rows / shards)
    return max(0, min(chunk, rows - rank * chunk))


def mesh_layout(*, replicate: int, world: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The mesh's shape and dimension names: (replicate, shard) under HSDP, else (shard,)."""
    if replicate > 1:
        return (replicate, world // replicate), ("replicate", "shard")
    return (world,), ("shard",)


class FSDPStrategy(Strategy):
    """Parameters, gradients and optimizer state sharded over the shard dimension of the mesh."""

    # the worker builds the model on meta; setup shards it there and materialises only this rank's shards
    materialises_held = True

    def setup(self, *, model: SDPModel, optimizer_factory: OptimizerFactory) -> None:
        ctx = self.ctx
        self.reshard_after_forward = bool(self.cfg.reshard_after_forward)
        shape, names = mesh_layout(replicate=int(self.cfg.replicate), world=ctx.world_size)
        # every dimension's groups get the job's timeout and NCCL options (sdp.core.distctx.mesh_overrides)
        self.mesh = init_device_mesh(ctx.device.type, shape, mesh_dim_names=names, backend_override=mesh_overrides(shape))
        policy, norm_policy = fsdp_policies(precision=self.precision)  # train.precision (sdp/core/precision.py)
        # On the meta device (the worker's build): shard first, then give each rank storage for its
        # shards only and fill them with the full build's seeded values (sdp.models.init), so the set-up
        # peak is one shard set plus one module, never the full model. A materialised model (built
        # directly, as tests do) is moved whole, as before.
        template = init.skeleton(model) if init.meta_tensors(model) else None
        if template is None:
            model.to(ctx.device)
        if norm_policy is not None:  # bf16: BatchNorm layers sharded on their own, in float32
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    fully_shard(m, mesh=self.mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=norm_policy)
        for block in model.blocks:
            fully_shard(block, mesh=self.mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=policy)
        # None: FSDP2's default for the root, which keeps its (stem + head) parameters after forward
        # because backward needs them first; an explicit True would re-gather them at once.
        fully_shard(model, mesh=self.mesh, reshard_after_forward=None, mp_policy=policy)
        if template is not None:
            model.to_empty(device=ctx.device)
            init.materialise_sharded(model, skeleton=template)
        for m in fsdp_modules(model):
            m.set_force_sum_reduction_for_comms(True)  # per module (not recursive): SUM, then divide
        self.module = model
        self.optimizer = optimizer_factory(model.parameters())  # after sharding: holds the DTensor shards

    def _step_context(self) -> Any:
        """The base template step with FSDP's collectives intercepted and counted: the forward phase
        includes each block's parameter all-gather, the backward phase the re-gathers and the gradient
        reduce-scatters, the optimizer phase is local (every rank updates its own shards)."""
        return count_collectives(self.ctx.comm)

    @contextmanager
    def eval_module(self) -> Iterator[nn.Module]:
        """The FSDP module itself, unsharded once for the whole evaluation.

        Why unshard up front instead of letting each forward all-gather: ranks evaluate different
        numbers of validation batches when the set does not split evenly, and per-forward
        all-gathers would then wait for a rank that has finished. One all-gather per block (counted
        as ``eval`` traffic), resharding disabled during evaluation, and the usual buffer average.
        """
        assert self.module is not None
        model = self.module
        comm = self.ctx.comm
        modules = fsdp_modules(model)
        try:
            with comm.phase_as("eval"):
                with count_collectives(comm):
                    model.set_reshard_after_forward(False)  # type: ignore[operator]
                    for m in modules:
                        m.unshard()
                average_buffers(model, ctx=self.ctx)  # records its own all-reduce (not intercepted twice)
            model.eval()
            yield model
        finally:
            model.train()
            for m in modules:
                m.reshard()
            self._restore_reshard_policy()

    def _restore_reshard_policy(self) -> None:
        """Blocks back to the configured policy; the root to FSDP2's default of not resharding
        after forward (its parameters are needed first in backward anyway)."""
        model: Any = self.module
        model.set_reshard_after_forward(self.reshard_after_forward, recurse=True)
        model.set_reshard_after_forward(False, recurse=False)

    # ---- checkpoint / resume ------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, dict[str, Any]]:
        """Parameters and optimizer state as DTensor shards (``"sharded"``, saved and loaded with
        ``torch.distributed.checkpoint`` by every rank; HSDP alike, its replicas dedup on save).
        Buffers are plain, rank-local tensors (BatchNorm statistics, never synchronised in training):
        DCP would keep one rank's copy of a non-DTensor value, so they go under ``"local"``."""
        assert self.module is not None and self.optimizer is not None
        model, optim = get_state_dict(self.module, self.optimizer)
        buffers = {name for name, _ in self.module.named_buffers()}
        return {"sharded": {"model": {k: v for k, v in model.items() if k not in buffers}, "optimizer": optim},
                "local": {"buffers": {k: v for k, v in model.items() if k in buffers}}}

    def load_checkpoint_state(self, state: dict[str, dict[str, Any]]) -> None:
        assert self.module is not None and self.optimizer is not None
        set_state_dict(self.module, self.optimizer,
                       model_state_dict={**state["sharded"]["model"], **state["local"]["buffers"]},
                       optim_state_dict=state["sharded"]["optimizer"])

    def summary_extra(self) -> dict[str, Any]:
        return {
            "mesh_shape": list(self.mesh.shape),
            "mesh_dims": list(self.mesh.mesh_dim_names or ()),
            "reshard_after_forward": self.reshard_after_forward,
            "param_dtype": "bf16" if self.precision == "bf16" else "fp32", "reduce_dtype": "fp32",
            "sharded_modules": len(fsdp_modules(self.module)) if self.module is not None else 0,
        }


def compute_replica(model: SDPModel, *, precision: str) -> SDPModel:
    """A copy of ``model`` with the parameters FSDP2 computes with: under ``train.precision=bf16`` its
    ``MixedPrecisionPolicy`` (:func:`sdp.core.precision.fsdp_policies`) all-gathers every parameter in bf16
    but BatchNorm's (sharded apart in float32); buffers keep their dtype. Why the planner needs it: FSDP2's
    forward runs embedding and norms on bf16 parameters (bf16 outputs where DDP's are float32) and saves
    no autocast weight casts (the parameters are bf16 already), so its activations are not DDP's."""
    replica = copy.deepcopy(model)
    if precision == "fp32":
        return replica
    dtype = DTYPES[precision]
    for m in replica.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            continue
        for name, p in list(m._parameters.items()):
            if p is not None and p.is_floating_point():
                m._parameters[name] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
    return replica


def fsdp_peaks(*, job: JobFacts, model: SDPModel, eval_batch: int, state: list[dict[str, Any]]) -> list[dict[str, int]]:
    """FSDP2 on top of the compute replica's rehearsal (:func:`compute_replica`: parameters in the policy's
    ``param_dtype``): the model is sharded on the meta device and each rank materialises its shards only
    (set-up: the shards, the unsharded buffers and one module's full tensors in flight,
    :func:`sdp.models.init.materialise_sharded`, which builds that module on the CPU: host memory on a GPU run,
    outside the device's peak, as an H200 measured); a training step holds the sharded float32 state, the
    replica's activation transient, the root unsharded, and for the largest block its unsharded
    parameters twice (running + prefetched) and its unsharded gradients, all in ``param_dtype``, and its
    reduce-scatter input in ``reduce_dtype`` (float32); evaluation unshards every unit (the full
    parameters in ``param_dtype``) with one all-gather buffer in flight. The training rule is an upper bound: at the
    peak the CPU tracker finds the largest block about three times, not four (``tests/test_plan_peaks.py``)."""
    compute = compute_replica(model, precision=job.precision)
    full = rehearse(module=compute, trainable=list(compute.parameters()), batch=job.batch_size,
                    eval_batch=eval_batch, optimizer=job.optimizer, example=model.example_input,
                    precision=job.precision, device=job.device)
    block_ids = {id(p) for b in compute.blocks for p in b.parameters()}
    root = nbytes(p for p in compute.parameters() if id(p) not in block_ids)
    largest = max((nbytes(b.parameters()) for b in compute.blocks), default=0)  # in param_dtype
    largest_reduce = max((nbytes(b.parameters()) for b in model.blocks), default=0)  # float32
    params_full = nbytes(compute.parameters())
    one_module = max((nbytes(t for t in [*m._parameters.values(), *m._buffers.values()] if t is not None)
                      for m in model.modules()), default=0)
    buffers = nbytes(model.buffers())
    out = []
    for mem in state:
        held = mem["param_bytes"] + mem["grad_bytes"] + mem["optim_bytes"]
        out.append({"setup_peak_bytes": mem["param_bytes"] + buffers + (one_module if job.device == "cpu" else 0),
                    "train_peak_bytes": held + (full["train"] - full["state"]) + root + 3 * largest + largest_reduce,
                    "eval_peak_bytes": held + params_full + (full["eval"] - full["state"]) + largest})
    return out


@dataclass
class FSDPConfig:
    """``parallelism=fsdp``: FSDP2, parameters, gradients and optimizer state sharded over ranks."""

    name: str = key()
    """The strategy, looked up in sdp.parallel.STRATEGIES."""
    reshard_after_forward: bool = flag()
    """Free each block's gathered parameters after its forward (ZeRO-3) | keep them until backward."""
    replicate: int = key(at_least=1)
    """> 1: HSDP, shard within groups of world_size / replicate ranks (must divide cluster.world_size)."""


@register("fsdp")
class FSDPSpec(StrategySpec):
    """FSDP2 in the driver: the mesh's validation, its traffic and sharded state, its peak rule."""

    label = "FSDP"
    runtime = FSDPStrategy
    schema = FSDPConfig
    # FSDP2 prefetches the next unit's all-gather during forward and backward and reduce-scatters (HSDP:
    # all-reduces) behind backward; the root's all-gather (before any compute) and last reduce-scatter are not
    overlap = Overlap(kinds=("all_gather", "reduce_scatter", "all_reduce"), window="step", tail=2)

    @classmethod
    def validate(cls, *, cfg: DictConfig, job: JobFacts) -> None:
        """The mesh (each key's own rule is :class:`FSDPConfig`'s): ``replicate`` divides the world."""
        replicate = cfg.replicate
        require(job.world_size % replicate == 0, "parallelism.replicate", replicate,
                f"must divide cluster.world_size={job.world_size} (HSDP mesh = replicate x shard)")

    @classmethod
    def predict(cls, *, cfg: DictConfig, job: JobFacts, model: SDPModel, facts: dict[str, Any],
                prepared: Any = None) -> list[Entry]:
        """FSDP2: each block and the root (stem + head) is a unit; per step every unit is all-gathered in
        ``param_dtype`` (bf16 under ``train.precision=bf16``, BatchNorm's float32; blocks twice when resharded
        after forward, the root once), its gradients reduce-scattered in float32 (padded to a multiple of the
        shard count), and under HSDP all-reduced across replicas; activations from :func:`compute_replica`."""
        pc, world = cfg, job.world_size
        rep = int(pc.replicate)
        shards = world // rep
        block_ids = {id(p) for b in model.blocks for p in b.parameters()}
        units = [(list(b.parameters()), 2 if bool(pc.reshard_after_forward) else 1) for b in model.blocks]
        units.append(([p for p in model.parameters() if id(p) not in block_ids], 1))
        compute = compute_replica(model, precision=job.precision)
        acts = activations(compute, compute.example_input(job.batch_size).to("meta"), job=job)
        gathered = {id(p): q.element_size() for p, q in zip(model.parameters(), compute.parameters())}
        facts["process_groups"] = mesh_process_groups(world_size=world, shape=mesh_layout(replicate=rep, world=world)[0])
        out = []
        for r in range(world):
            s = r % shards
            local = [p.numel() // max(p.shape[0], 1) * shard_rows(p.shape[0], rank=s, shards=shards) * p.element_size()
                     for p in model.parameters()]
            records: list[Record] = []
            for params, gathers in units:
                if not params:
                    continue
                rows = [math.ceil(p.shape[0] / shards) * (p.numel() // max(p.shape[0], 1)) for p in params]
                padded = sum(n * p.element_size() for n, p in zip(rows, params))  # float32: reduce_dtype
                cast = sum(n * gathered[id(p)] for n, p in zip(rows, params))  # param_dtype
                records += [("all_gather", cast * shards, shards)] * gathers + [("reduce_scatter", padded * shards, shards)]
                if rep > 1:
                    records.append(("all_reduce", padded, rep))
            held = sum(local)
            optim = optim_bytes(held=held, tensors=len(local), optimizer=job.optimizer)
            out.append(rank_entry(rank=r, params=held, grads=held, optim=optim, acts=acts, records=records))
        return out

    @classmethod
    def predict_peaks(cls, *, cfg: DictConfig, job: JobFacts, model: SDPModel, eval_batch: int, steps: int,
                      eval_steps: frozenset[int], state: list[dict[str, Any]], prepared: Any = None) -> list[dict[str, int]] | None:
        return fsdp_peaks(job=job, model=model, eval_batch=eval_batch, state=state)
