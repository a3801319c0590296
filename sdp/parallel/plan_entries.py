"""The per-rank entries ``sdp-plan`` writes, and the rules every strategy's prediction shares.

Each strategy predicts its own memory and communication (:meth:`sdp.parallel.spec.StrategySpec.predict`,
run in the driver on the meta device); this module holds what those predictions have in common: the
optimizer-state rule, the meta-device activation meter, and the shape of one rank's ``memory`` and
``comm`` entries (the ``memory.per_rank`` and ``comm.per_rank`` fields of ``summary.json``, so
prediction and measurement compare field by field). It imports no strategy, so strategies can.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

import torch
from omegaconf import DictConfig

from sdp.core.loss import loss_fn
from sdp.metrics.activations import forward_saved_bytes
from sdp.metrics.comm import wire_bytes
from sdp.parallel.device_forward import device_forward, device_optimizer
from sdp.registry import build

if TYPE_CHECKING:
    from sdp.parallel.job import JobFacts

Record = tuple[str, float, int]  # (kind, payload bytes, group size) per step
Entry = tuple[dict, dict]  # one rank's (memory entry, comm entry)
MIB = 2**20


@dataclass(frozen=True)
class EvalTraffic:
    """What a strategy's evaluated models move in one evaluation (comm phase "eval"), per rank, besides what the
    protocol moves (:mod:`sdp.planning.plan_traffic`): ``build``, making the evaluated model once (its
    ``eval_module``: DDP's buffer average, SDP's assembly); ``partwise``, it is built once per evaluation pass
    (:mod:`sdp.rank.eval_parts`) rather than once; ``own``, making each worker's own model (its
    ``subnetwork_module``), None where workers have none (no workers' or ensemble evaluation)."""

    build: list[list[Record]]
    partwise: bool
    own: list[list[Record]] | None


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optim_bytes(*, held: int, tensors: int, optimizer: DictConfig) -> int:
    """Optimizer state from its type (``optimizer``: the ``optim.optimizer`` node), for ``held`` bytes of trained
    parameters in ``tensors`` tensors: SGD with momentum 1x, Adam(W) 2x plus a 4-byte step counter per tensor;
    plain SGD none."""
    target = str(optimizer._target_).rsplit(".", 1)[-1]
    if target == "SGD":
        return held if float(optimizer.get("momentum", 0) or 0) > 0 else 0
    if target in ("Adam", "AdamW"):
        return 2 * held + 4 * tensors
    raise ValueError(f"optim.optimizer._target_={optimizer._target_!r}: sdp-plan knows SGD, Adam and AdamW")


def activations(module: torch.nn.Module, inputs: torch.Tensor, *, job: JobFacts | None, loss: bool = True) -> int:
    """Bytes saved for backward by one forward (+ loss) on the meta device, parameters excluded, as the
    job's ranks save them: under ``train.precision``'s autocast and with ``cluster.device``'s attention
    kernel (:func:`sdp.parallel.device_forward.device_forward`). ``job=None``: a plain meta forward, the
    scale of the SDP units' own activation costs (:mod:`sdp.subnet.units`), which are facts of the model."""
    meta_loss = lambda out: loss_fn(out, torch.zeros(out.shape[:-1], dtype=torch.long, device="meta"))  # noqa: E731
    with device_forward(precision=job.precision, device=job.device) if job is not None else nullcontext():
        return forward_saved_bytes(module, inputs, loss=meta_loss if loss else None)


def comm_entry(records: list[Record], *, weights: list[float] | None = None) -> dict[str, Any]:
    """The ``comm.per_rank`` fields of summary.json, from one step's records (``by_kind`` also with each kind's
    ring wire bytes, what :mod:`sdp.planning.throughput` times). ``weights``: each record's share of a step, where
    the run's steps differ and summary.json's fields are their mean (:func:`measured_mean`); default 1 each."""
    weights = [1.0] * len(records) if weights is None else weights
    assert len(weights) == len(records), f"{len(weights)} weights for {len(records)} records"
    by_kind: dict[str, dict[str, float]] = {}
    by_group: dict[str, dict[str, float]] = {}
    for (kind, payload, k), w in zip(records, weights):
        for table, key in ((by_kind, kind), (by_group, str(k))):
            e = table.setdefault(key, {"bytes": 0.0, "count": 0.0})
            e["bytes"] += w * payload
            e["count"] += w
        kind_entry = by_kind[kind]
        kind_entry["wire_bytes"] = kind_entry.get("wire_bytes", 0.0) + w * wire_bytes(kind=kind, payload=payload, group_size=k)
    return {"bytes_per_step": float(sum(w * p for (_, p, _), w in zip(records, weights))),
            "wire_bytes_per_step": sum(w * wire_bytes(kind=kd, payload=p, group_size=k) for (kd, p, k), w in zip(records, weights)),
            "collectives_per_step": float(sum(weights)), "by_kind": by_kind, "by_group_size": by_group}


def measured_steps(*, phase_steps: tuple[int, ...], warmup: int) -> list[int]:
    """How many of each training phase's steps (``phase_steps``, in order) a run measures: all but the first
    ``warmup`` steps of the run (``train.warmup_steps``: the comm counter's ``measuring``, :mod:`sdp.rank.trainer`)."""
    out, start = [], 0
    for n in phase_steps:
        out.append(max(0, start + n - max(start, warmup)))
        start += n
    return out


def measured_mean(phases: list[tuple[int, list[Record]]]) -> tuple[list[Record], list[float]]:
    """The records and weights (:func:`comm_entry`) of a run whose measured steps are ``n`` steps of each phase's
    one-step records, ``(n, records)`` in ``phases``: summary.json's per-step fields are the mean over the measured
    steps (:meth:`sdp.metrics.comm.CommCounter.summary`; none measured: 0, as it reports)."""
    total = sum(n for n, _ in phases)
    if not total:
        return [], []
    records = [r for n, recs in phases if n for r in recs]
    return records, [n / total for n, recs in phases if n for _ in recs]


def communicators(*, per_group: int, groups: dict[str, Any] | None, world: int) -> list[dict[str, int]]:
    """Per rank, the process groups it is a member of (the default group included) and the device memory
    their NCCL communicators take outside the allocator: ``per_group`` (``cluster.comm_bytes_per_group``)
    per group. ``groups``: the strategy's prediction of summary.json's ``process_groups`` (its
    ``per_rank`` counts); None, a strategy that declares none, is taken to use the default group only.

    Why a constant per group: NCCL sizes a communicator's buffers from its own settings (protocol
    buffers per channel and peer, ``NCCL_BUFFSIZE`` and kin), not from the model, so what the planner
    can predict is how the cost scales with the group count (DDP 1, SDP one per holder set); the
    constant itself is a planning assumption that a GPU run calibrates (summary.json's
    ``cuda_device_used_bytes`` beside ``process_groups``)."""
    counts = [int(r["count"]) for r in groups["per_rank"]] if groups is not None else [1] * world
    assert len(counts) == world, f"process_groups predicts {len(counts)} ranks for a world of {world}"
    return [{"process_groups": c, "communicator_bytes": c * per_group} for c in counts]


def rank_entry(*, rank: int, params: int, grads: int, optim: int, acts: int, records: list[Record],
               weights: list[float] | None = None) -> Entry:
    mem = {"rank": rank, "param_bytes": params, "grad_bytes": grads, "optim_bytes": optim, "activation_bytes": acts}
    return mem, {"rank": rank, **comm_entry(records, weights=weights)}


# ---- checkpoint payloads: what each strategy's checkpoint_tensors hands sdp-plan (sdp.planning.plan_checkpoint) ----
def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes ``torch.save`` writes for ``tensors``' data: each storage once (tied and viewed tensors share one),
    whole (a view saves its base's storage); meta tensors alike."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen.setdefault(storage._cdata, storage.nbytes())
    return sum(seen.values())


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nest of dicts, lists and tuples (a ``checkpoint_state`` or ``state_dict``)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v)]
    return []


def optimizer_state(*, optimizer: DictConfig, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """The tensors of ``optimizer.state_dict()`` after a step on ``params`` (the ``optim.optimizer`` node's optimizer;
    meta parameters give meta moments, Adam's step counters stay on the CPU as in a run, fused's on the device as in
    a run: :func:`~sdp.parallel.device_forward.device_optimizer`), as a checkpoint saves it."""
    opt = device_optimizer(factory=build(optimizer), params=params)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in params:
        p.grad = None
    return tensors_of(opt.state_dict()["state"])


def replica_parts(*, model: torch.nn.Module, optimizer: DictConfig, replicas_identical: bool) -> dict[str, list[torch.Tensor]]:
    """:meth:`sdp.parallel.base.Strategy.checkpoint_state`'s layout of a rank that holds ``model`` whole: parameters
    and optimizer state ``"shared"`` where the replicas are identical, else ``"local"``; buffers ``"local"``."""
    buffers = {id(b) for b in model.buffers()}
    state = list(model.state_dict(keep_vars=True).values())
    replica = [t for t in state if id(t) not in buffers] + optimizer_state(optimizer=optimizer, params=list(model.parameters()))
    local = [t for t in state if id(t) in buffers]
    return {"shared": replica, "local": local} if replicas_identical else {"local": replica + local}
