"""PowerSGD gradient compression (Vogels et al. 2019) inside DDP: the gradient-compression baseline.

Every rank holds the whole model, as in DDP; each gradient bucket goes through torch's
``powerSGD_hook`` (``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``) with a ``PowerSGDState``
built from the preset's keys. Why that hook and not ``batched_powerSGD_hook``: the layer-wise hook
compresses each gradient matrix on its own (a tensor viewed as ``shape[0]`` x the rest), the algorithm of
the paper, so a matrix of n x m sends (n + m) r values and at full rank (r >= min(n, m)) its average is
exact (P spans the column space); the batched hook folds a whole bucket into one zero-padded square matrix
that mixes the rows of different layers, which torch's documentation says costs accuracy unless r = 1.

Communication is measured where the hook hands tensors to ``torch.distributed``, not computed: the hook
calls ``dist.all_reduce`` for each bucket (before ``start_iter`` the bucket whole; after it the
uncompressed tensors, then P, then Q), so the step runs under
:func:`sdp.metrics.collectives.count_collectives`, as FSDP2's does. ``sdp-plan`` predicts the same
records from the model's shapes with torch's own compression rule (:func:`compressed_step`).

State: the hook's error feedback (each rank's gradient minus the average it received: it differs by rank),
its P and Q memory (warm start), its step count and the generator that draws Q are each rank's own and go
under the checkpoint's ``local`` part; parameters and optimizer state stay ``shared`` (every rank applies
the same decompressed average, so replicas stay identical).

FLOPs: the compression's matmuls and orthogonalisations are not model FLOPs; every worker runs the whole
model, so the FLOP fraction is 1 (no coverage), as DDP's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from omegaconf import DictConfig
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, _should_compress, powerSGD_hook

from sdp.core.fields import Number, flag, key
from sdp.errors import require
from sdp.metrics.collectives import count_collectives
from sdp.models.base import SDPModel
from sdp.parallel.ddp import DDPConfig, DDPSpec, DDPStrategy, ddp_bucket_members
from sdp.parallel.job import JobFacts
from sdp.parallel.spec import Overlap, register
from sdp.parallel.plan_entries import Entry, Record, comm_entry, nbytes


def hook_state(*, cfg: DictConfig, seed: int) -> PowerSGDState:
    """The ``PowerSGDState`` of the ``parallelism`` node ``cfg`` over the default group; ``seed`` (the job's, the
    same on every rank) seeds the generator that draws Q, which must agree between ranks."""
    return PowerSGDState(process_group=None, matrix_approximation_rank=int(cfg.rank),
                         start_powerSGD_iter=int(cfg.start_iter), min_compression_rate=float(cfg.min_compression_rate),
                         use_error_feedback=bool(cfg.use_error_feedback), warm_start=bool(cfg.warm_start),
                         random_seed=int(seed))


def hook_buffers(state: PowerSGDState) -> dict[str, int]:
    """Bytes the hook keeps between steps: error feedback, P and Q memory (summed over buckets)."""
    return {"error_bytes": nbytes(state.error_dict.values()), "p_bytes": nbytes(state.p_memory_dict.values()),
            "q_bytes": nbytes(state.q_memory_dict.values())}


def state_dict(state: PowerSGDState) -> dict[str, Any]:
    """The hook's per-rank state as checkpoint values (tensors, numbers, containers: loaded ``weights_only``)."""
    kind, keys, pos, has_gauss, gauss = state.rng.get_state()
    assert kind == "MT19937", f"PowerSGDState.rng is a {kind} generator, expected MT19937"
    return {"iter": int(state.iter), "error": dict(state.error_dict), "p": dict(state.p_memory_dict),
            "q": dict(state.q_memory_dict), "rng": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                                                    "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "numel_before": int(state.total_numel_before_compression),
            "numel_after": int(state.total_numel_after_compression), "next_stats_report": int(state.next_stats_report)}


def load_state_dict(state: PowerSGDState, saved: dict[str, Any], *, device: torch.device) -> None:
    """Inverse of :func:`state_dict`, into the ``state`` DDP's hook already holds (DDP keeps that object)."""
    state.iter = int(saved["iter"])
    state.error_dict = {int(k): v.to(device) for k, v in saved["error"].items()}
    state.p_memory_dict = {int(k): v.to(device) for k, v in saved["p"].items()}
    state.q_memory_dict = {int(k): v.to(device) for k, v in saved["q"].items()}
    rng = saved["rng"]
    state.rng.set_state(("MT19937", rng["keys"].numpy().astype(np.uint32), rng["pos"], rng["has_gauss"], rng["gauss"]))
    state.total_numel_before_compression = int(saved["numel_before"])
    state.total_numel_after_compression = int(saved["numel_after"])
    state.next_stats_report = int(saved["next_stats_report"])


class PowerSGDStrategy(DDPStrategy):
    """DDP with the PowerSGD hook; its collectives counted by interception, its state checkpointed per rank."""

    def setup(self, *, model: SDPModel, optimizer_factory: Any) -> None:
        self.hook = hook_state(cfg=self.cfg, seed=self.job.seed)
        super().setup(model=model, optimizer_factory=optimizer_factory)

    def comm_hook(self) -> tuple[Any, Callable[..., Any]]:
        return self.hook, powerSGD_hook

    def _step_context(self) -> Any:
        """The hook's ``dist.all_reduce`` calls (its own, and those its futures' callbacks make) counted."""
        return count_collectives(self.ctx.comm)

    def checkpoint_state(self) -> dict[str, dict[str, Any]]:
        """DDP's state plus this rank's hook state (error feedback differs by rank)."""
        state = super().checkpoint_state()
        state["local"]["extra"] = {"powersgd": state_dict(self.hook)}
        return state

    def load_checkpoint_state(self, state: dict[str, dict[str, Any]]) -> None:
        """DDP's restore (its priming backward runs through the hook, counted as ``checkpoint`` traffic), then
        this rank's hook state over what the priming step left in it."""
        with count_collectives(self.ctx.comm):
            super().load_checkpoint_state(state)
        load_state_dict(self.hook, state["local"]["extra"]["powersgd"], device=self.ctx.device)

    def summary_extra(self) -> dict[str, Any]:
        rate, before, after = self.hook.compression_stats()
        return {"powersgd": {**hook_buffers(self.hook), "iter": int(self.hook.iter), "compression_rate": rate,
                             "numel_before": before, "numel_after": after}}  # this rank's (rank 0 in summary.json)


def compressed_step(params: list[torch.Tensor], *, cfg: DictConfig, world: int) -> tuple[list[Record], dict[str, int]]:
    """One compressed step's all-reduces and the hook's buffers for ``params`` (meta tensors do), from their
    shapes by torch's own rule (``_should_compress``, the matrix ``shape[0]`` x the rest at rank min(n, m, r)):
    per bucket (:func:`sdp.parallel.ddp.ddp_bucket_members`) the uncompressed tensors whole, then P (n r per
    compressed matrix), then Q (m r). Buffers: the error feedback, one bucket's length per bucket; P and Q
    memory under warm start (otherwise freed after each bucket)."""
    sizes = [t.numel() * t.element_size() for t in params]
    records: list[Record] = []
    p_total = q_total = 0
    for bucket in ddp_bucket_members(sizes, cap_mb=float(cfg.bucket_cap_mb)):
        whole = ps = qs = 0
        for i in bucket:
            t = params[i]
            n = t.shape[0] if t.dim() else 1
            m = t.numel() // n
            r = min(n, m, int(cfg.rank))
            if _should_compress(n, m, r, float(cfg.min_compression_rate))[0]:
                ps, qs = ps + n * r * t.element_size(), qs + m * r * t.element_size()
            else:
                whole += sizes[i]
        records += [("all_reduce", whole, world), ("all_reduce", ps, world), ("all_reduce", qs, world)]
        p_total, q_total = p_total + ps, q_total + qs
    warm = bool(cfg.warm_start)
    buffers = {"error_bytes": sum(sizes) if bool(cfg.use_error_feedback) else 0,
               "p_bytes": p_total if warm else 0, "q_bytes": q_total if warm else 0}
    return records, buffers


@dataclass
class PowerSGDConfig(DDPConfig):
    """``parallelism=powersgd``: DDP (its keys, :class:`~sdp.parallel.ddp.DDPConfig`) whose buckets are all-reduced
    through torch's PowerSGD comm hook (low-rank P and Q per gradient matrix, error feedback); ``start_iter`` >= 2
    with error feedback or warm start is a rule of several keys (:meth:`PowerSGDSpec.validate`)."""

    rank: int = key(at_least=1)
    """r >= 1: PowerSGDState.matrix_approximation_rank, the rank of each compressed gradient matrix."""
    warm_start: bool = flag()
    """Reuse the previous step's Q (true) | draw a new random Q every step (false)."""
    start_iter: int = key(at_least=0)
    """PowerSGDState.start_powerSGD_iter: steps of plain all-reduce before compression starts."""
    min_compression_rate: Number = key(at_least=0)
    """Compress a matrix only where (n + m) x r x this < n x m; the rest is all-reduced whole."""
    use_error_feedback: bool = flag()
    """Add each rank's compression error of the last step to its next gradient."""


@register("powersgd")
class PowerSGDSpec(DDPSpec):
    """PowerSGD in the driver: DDP's replica, its label with the rank, its compressed step's comm predicted."""

    label = "PowerSGD"
    schema: type = PowerSGDConfig  # DDPConfig's keys and its own
    label_keys = ("rank",)
    runtime = PowerSGDStrategy
    # a bucket's three all-reduces are issued when backward fills it; the last bucket's three only when backward ends
    overlap = Overlap(kinds=("all_reduce",), window="backward", tail=3)
    plan_note = "PowerSGD's comm predicted for a compressed step (after parallelism.start_iter; before it, DDP's)"

    @classmethod
    def method_label(cls, *, cfg: DictConfig) -> str:
        return f"PowerSGD r={cfg.rank}"

    @classmethod
    def validate(cls, *, cfg: DictConfig, job: JobFacts) -> None:
        """Each key's own rule is its schema's (:class:`PowerSGDConfig`, checked before this); torch's
        ``PowerSGDState`` needs ``start_iter`` >= 2 with error feedback or warm start (DDP rebuilds its buckets
        after step 1, which would invalidate the buffers the hook keyed by bucket)."""
        keeps = bool(cfg.use_error_feedback) or bool(cfg.warm_start)
        require(not keeps or int(cfg.start_iter) >= 2, "parallelism.start_iter", cfg.start_iter,
                f">= 2 with use_error_feedback={cfg.use_error_feedback} or warm_start={cfg.warm_start} (torch's PowerSGDState)")

    @classmethod
    def predict(cls, *, cfg: DictConfig, job: JobFacts, model: SDPModel, facts: dict[str, Any],
                prepared: Any = None) -> list[Entry]:
        """DDP's memory; the comm of a compressed step (:func:`compressed_step`); the hook's buffers in the
        plan's facts (``powersgd``: per rank, what ``strategy_info.powersgd`` measures)."""
        entries = super().predict(cfg=cfg, job=job, model=model, facts=facts, prepared=prepared)
        records, buffers = compressed_step(list(model.parameters()), cfg=cfg, world=job.world_size)
        vanilla = sum(c["bytes_per_step"] for _, c in entries[:1])
        facts["powersgd"] = {**buffers, "start_iter": int(cfg.start_iter), "uncompressed_bytes_per_step": vanilla}
        return [(mem, {"rank": mem["rank"], **comm_entry(records)}) for mem, _ in entries]
