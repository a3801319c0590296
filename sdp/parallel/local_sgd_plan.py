"""``sdp-plan``'s prediction for local SGD / DiLoCo (:mod:`sdp.parallel.local_sgd`): its memory and comm entries
and its peaks, kept beside the strategy as SDP's (``sdp_peaks.py``) are.

Why a rule of its own rather than DDP's: every worker holds DDP's replica, gradients and optimizer state, but
no reducer buckets, and adds the outer state (float32 global parameters, and the outer momentum when
``outer_momentum`` > 0) for the whole run; a synchronisation adds one flat float32 buffer of the parameter
change and the float buffers after the optimizer step; an evaluation between two synchronisations keeps a copy
of the replica's parameters and buffers while the global parameters are evaluated. Its comm is one all-reduce
of that flat buffer every ``inner_steps`` steps, i.e. its bytes / H per step and 1 / H collectives per step.
"""

from __future__ import annotations

import copy
from typing import Any

from omegaconf import DictConfig

from sdp.models.base import SDPModel
from sdp.parallel.job import JobFacts
from sdp.parallel.plan_entries import Entry, activations, nbytes, optim_bytes, rank_entry
from sdp.parallel.plan_peaks import rehearse
from sdp.subnet.holder_groups import predicted_process_groups


def _sizes(*, cfg: DictConfig, model: SDPModel) -> tuple[int, int, int]:
    """(float32 bytes of the parameters, bytes of the float buffers as the flat all-reduce carries them,
    outer state bytes)."""
    params = 4 * sum(p.numel() for p in model.parameters())
    state = model.state_dict(keep_vars=True)  # the persistent float buffers (sdp.parallel.local_sgd.synced_buffers)
    buffers = 4 * sum(b.numel() for n, b in model.named_buffers() if b.is_floating_point() and n in state)
    return params, buffers, params * (2 if float(cfg.outer_momentum) > 0 else 1)


def local_sgd_entries(*, cfg: DictConfig, job: JobFacts, model: SDPModel, facts: dict[str, Any]) -> list[Entry]:
    """Each rank's memory (replica, gradients, inner optimizer state + outer state as optimizer state, as
    ``state_bytes`` counts it) and comm: the flat all-reduce of the change and the buffers, / H per step."""
    world, params = job.world_size, list(model.parameters())
    acts = activations(model, model.example_input(job.batch_size).to("meta"), job=job)
    total = nbytes(params)
    change, buffers, outer = _sizes(cfg=cfg, model=model)
    every = int(cfg.inner_steps)
    optim = optim_bytes(held=total, tensors=len(params), optimizer=job.optimizer) + outer
    facts["inner_steps"] = every
    facts["sync_bytes"] = change + buffers
    facts["process_groups"] = predicted_process_groups(world_size=world, holder_sets=(), refresh=False)  # the world only
    entries = [rank_entry(rank=r, params=total, grads=total, optim=optim, acts=acts,
                          records=[("all_reduce", (change + buffers) / every, world)] if world > 1 else [])
               for r in range(world)]
    for _, comm in entries:  # one collective every H steps: 1 / H per step, as the run's mean counts it
        comm["collectives_per_step"] /= every
        for table in (comm["by_kind"], comm["by_group_size"]):
            for e in table.values():
                e["count"] /= every
    return entries


def local_sgd_peaks(*, cfg: DictConfig, job: JobFacts, model: SDPModel, eval_batch: int, steps: int,
                    eval_steps: frozenset[int]) -> list[dict[str, int]]:
    """The replica's rehearsal (DDP's without the reducer buckets) plus the outer state at every phase; the
    training peak is the larger of the backward's and the synchronisation's (the step's state + the flat
    buffer), where a synchronisation falls in the run; the evaluation peak adds the copy of the replica kept
    while the global parameters are evaluated, where an evaluation falls between two synchronisations
    (``eval_steps``: 1-based, after the step; the last step always synchronises)."""
    mine = copy.deepcopy(model)
    r = rehearse(module=mine, trainable=list(mine.parameters()), batch=job.batch_size, eval_batch=eval_batch,
                 optimizer=job.optimizer, example=model.example_input, precision=job.precision, device=job.device)
    change, buffers, outer = _sizes(cfg=cfg, model=model)
    every = int(cfg.inner_steps)
    synced = lambda n: n % every == 0 or n == steps  # noqa: E731
    train = max(r["train"], r["state"] + change + buffers)
    own = nbytes(mine.parameters()) + nbytes(mine.buffers())
    between = any(not synced(n) for n in eval_steps)
    one = {"setup_peak_bytes": r["setup"] + outer, "train_peak_bytes": train + outer,
           "eval_peak_bytes": r["eval"] + outer + (own if between else 0)}
    return [dict(one) for _ in range(job.world_size)]
