"""``sdp-plan``: per-rank memory and communication predicted before launch, for any strategy.

Same Hydra config as ``sdp-train``; nothing is launched and the model is built on the meta device,
so LLaMA-1B on 8 workers is planned in seconds. Every prediction reuses the code the strategy runs
(the SDP plan and masking, the owner-set buckets, the pipeline cut, FSDP's sharding rule) rather
than a second model of it, and activations come from a meta-device forward through the same
saved-tensor meter the trainer measures with. ``plan.output=<file>`` writes JSON with the
``memory.per_rank`` and ``comm.per_rank`` keys of ``summary.json``, so prediction and measurement
compare field by field (``tests/test_plan.py``); for SDP also ``plan`` (:meth:`Plan.summary`, as in
``summary.json``: the units with their holders, the holder sets, whether the worker-overlap graph is
connected, the fraction of unit pairs some worker trains together). A degenerate SDP plan (k = 1, a
disconnected overlap graph) is warned about as ``sdp-train`` does (:func:`sdp.subnet.plan.warn_degenerate`).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Callable

import hydra
import torch
from omegaconf import DictConfig

from sdp.metrics.activations import forward_saved_bytes
from sdp.metrics.comm import wire_bytes
from sdp.train import CONF_DIR  # also registers the ${sdp_uid:} resolver the config uses
from sdp.models.base import SDPModel
from sdp.subnet.sync import predicted_process_groups
from sdp.trainer import loss_fn
from sdp.registry import build

Record = tuple[str, float, int]  # (kind, payload bytes, group size) per step
MIB = 2**20


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optim_bytes(*, held: int, tensors: int, optim: DictConfig) -> int:
    """Optimizer state from its type, for ``held`` bytes of trained parameters in ``tensors`` tensors:
    SGD with momentum 1x, Adam(W) 2x plus a 4-byte step counter per tensor; plain SGD none."""
    target = str(optim.optimizer._target_).rsplit(".", 1)[-1]
    if target == "SGD":
        return held if float(optim.optimizer.get("momentum", 0) or 0) > 0 else 0
    if target in ("Adam", "AdamW"):
        return 2 * held + 4 * tensors
    raise ValueError(f"optim.optimizer._target_={optim.optimizer._target_!r}: sdp-plan knows SGD, Adam and AdamW")


def activations(module: torch.nn.Module, inputs: torch.Tensor, *, loss: bool = True) -> int:
    """Bytes saved for backward by one forward (+ loss) on the meta device, parameters excluded."""
    meta_loss = lambda out: loss_fn(out, torch.zeros(out.shape[:-1], dtype=torch.long, device="meta"))  # noqa: E731
    return forward_saved_bytes(module, inputs, loss=meta_loss if loss else None)


def comm_entry(records: list[Record]) -> dict[str, Any]:
    """The ``comm.per_rank`` fields of summary.json, from one step's records."""
    by_kind: dict[str, dict[str, float]] = {}
    by_group: dict[str, dict[str, float]] = {}
    for kind, payload, k in records:
        for table, key in ((by_kind, kind), (by_group, str(k))):
            e = table.setdefault(key, {"bytes": 0.0, "count": 0.0})
            e["bytes"] += payload
            e["count"] += 1
    return {"bytes_per_step": float(sum(p for _, p, _ in records)),
            "wire_bytes_per_step": sum(wire_bytes(kind=kd, payload=p, group_size=k) for kd, p, k in records),
            "collectives_per_step": float(len(records)), "by_kind": by_kind, "by_group_size": by_group}


def rank_entry(*, rank: int, params: int, grads: int, optim: int, acts: int, records: list[Record]) -> tuple[dict, dict]:
    mem = {"rank": rank, "param_bytes": params, "grad_bytes": grads, "optim_bytes": optim, "activation_bytes": acts}
    return mem, {"rank": rank, **comm_entry(records)}


# ---- strategies ---------------------------------------------------------------------------------
def ddp_buckets(sizes: list[int], *, cap_mb: float) -> int:
    """Bucket count of DDP's greedy packing in reverse parameter order (first bucket 1 MiB)."""
    count, used, cap = 0, 0, 1 * MIB
    for s in reversed(sizes):
        if used and used + s > cap:
            count, used, cap = count + 1, 0, int(cap_mb * MIB)
        used += s
    return count + (1 if used else 0)


def plan_ddp(*, cfg: DictConfig, model: SDPModel, world: int, facts: dict[str, Any]) -> list[tuple[dict, dict]]:
    """DDP family: full replica on every rank; one all-reduce of every gradient per step."""
    name = str(cfg.parallelism.name)
    if name == "ddp_ac":
        from sdp.parallel.ddp_ac import apply_checkpointing

        apply_checkpointing(model, every=int(cfg.parallelism.get("ac_every", 1)))
    params = list(model.parameters())
    acts = activations(model, model.example_input(int(cfg.train.batch_size)).to("meta"))
    sizes = [t.numel() * t.element_size() for t in params]
    n_buckets = ddp_buckets(sizes, cap_mb=float(cfg.parallelism.get("bucket_cap_mb", 25)))
    total = sum(sizes)
    records: list[Record] = [("all_reduce", total / n_buckets, world)] * n_buckets
    optim = optim_bytes(held=total, tensors=len(params), optim=cfg.optim)
    facts["process_groups"] = predicted_process_groups(world_size=world, holder_sets=(), refresh=False)  # the default only
    return [rank_entry(rank=r, params=total, grads=total, optim=optim, acts=acts, records=records) for r in range(world)]


def plan_sdp(*, cfg: DictConfig, model: SDPModel, world: int, facts: dict[str, Any]) -> list[tuple[dict, dict]]:
    """SDP: this rank's masked subnetwork (the strategy's own plan and masking applied on meta),
    owner-set gradient buckets and refresh broadcasts from :class:`sdp.subnet.sync.OwnerSetSync`."""
    from sdp.metrics.comm import CommCounter
    from sdp.parallel.sdp import plan_for
    from sdp.subnet import masking as M
    from sdp.subnet.sync import GroupSet, OwnerSetSync

    pc = cfg.parallelism
    mode = M.masking_mode(masking=str(pc.masking), refresh=str(pc.refresh))
    plan = plan_for(model=model, cfg=pc, world_size=world)
    facts["plan"] = plan.summary()  # as summary.json["plan"]: units -> holders, holder sets, connectivity
    pieces = M.pieces(model, plan)
    # the groups SDPStrategy creates (the same holder sets, the same rule): summary.json's process_groups
    facts["process_groups"] = predicted_process_groups(world_size=world, holder_sets={p.holders for p in pieces},
                                                       refresh=mode == "backward")
    groups = GroupSet(world_size=world, holder_sets=(), refresh=False)  # no process group is created
    out = []
    for r, mine, layout, trained in M.rank_subnetworks(model, plan, mode=mode, all_pieces=pieces):
        sync = OwnerSetSync(rank=r, pieces=pieces, layout=layout, groups=groups, comm=CommCounter(), mode=mode,
                            bucket_cap_mb=float(pc.bucket_cap_mb))
        records: list[Record] = [("all_reduce", sum(p.nbytes for p in items), len(h)) for h, items in sync.grad_buckets]
        records += [("broadcast", sum(p.nbytes for p in items) if r == min(h) else 0, len(groups.refresh_set(h)))
                    for h, items in sync.refresh_buckets]
        acts = activations(mine, mine.example_input(int(cfg.train.batch_size)).to("meta"))
        out.append(rank_entry(rank=r, params=nbytes(mine.parameters()), grads=nbytes(trained),
                              optim=optim_bytes(held=nbytes(trained), tensors=len(trained), optim=cfg.optim), acts=acts, records=records))
    return out


def shard_rows(rows: int, *, rank: int, shards: int) -> int:
    """Rows of dim 0 rank ``rank`` holds under FSDP2's ``torch.chunk`` rule (the last ranks may hold none)."""
    chunk = math.ceil(rows / shards)
    return max(0, min(chunk, rows - rank * chunk))


def plan_fsdp(*, cfg: DictConfig, model: SDPModel, world: int, facts: dict[str, Any]) -> list[tuple[dict, dict]]:
    """FSDP2: each block and the root (stem + head) is a unit; per step every unit is all-gathered
    (blocks twice when resharded after forward, the root once), its gradients reduce-scattered
    (padded to a multiple of the shard count), and under HSDP all-reduced across replicas."""
    pc = cfg.parallelism
    rep = int(pc.get("replicate", 1))
    shards = world // rep
    block_ids = {id(p) for b in model.blocks for p in b.parameters()}
    units = [(list(b.parameters()), 2 if bool(pc.get("reshard_after_forward", True)) else 1) for b in model.blocks]
    units.append(([p for p in model.parameters() if id(p) not in block_ids], 1))
    acts = activations(model, model.example_input(int(cfg.train.batch_size)).to("meta"))
    out = []
    for r in range(world):
        s = r % shards
        local = [p.numel() // max(p.shape[0], 1) * shard_rows(p.shape[0], rank=s, shards=shards) * p.element_size()
                 for p in model.parameters()]
        records: list[Record] = []
        for params, gathers in units:
            if not params:
                continue
            padded = sum(math.ceil(p.shape[0] / shards) * (p.numel() // max(p.shape[0], 1)) * p.element_size() for p in params)
            records += [("all_gather", padded * shards, shards)] * gathers + [("reduce_scatter", padded * shards, shards)]
            if rep > 1:
                records.append(("all_reduce", padded, rep))
        held = sum(local)
        optim = optim_bytes(held=held, tensors=len(local), optim=cfg.optim)
        out.append(rank_entry(rank=r, params=held, grads=held, optim=optim, acts=acts, records=records))
    return out


def plan_pipeline(*, cfg: DictConfig, model: SDPModel, world: int, facts: dict[str, Any]) -> list[tuple[dict, dict]]:
    """Pipeline: stage parameters of each rank (the strategy's own cut); per microbatch a stage
    receives its input and sends its input's gradient, sends its output and receives that gradient;
    with dp > 1 one all-reduce of the stage gradients. Activations: one microbatch's saved bytes times
    the microbatches in flight (1F1B: stages after this one + 1; GPipe: all)."""
    from sdp.parallel.pipeline import stage_of
    from sdp.parallel.pipeline_plan import make_plan

    pc, batch = cfg.parallelism, int(cfg.train.batch_size)
    plan = make_plan(cfg=pc, world_size=world, model=model, batch_size=batch)
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
            acts += in_flight * activations(m, inp, loss=s == plan.num_stages - 1)
        if plan.dp > 1:
            records.append(("all_reduce", nbytes(params), plan.dp))
        out.append(rank_entry(rank=r, params=nbytes(params), grads=nbytes(params),
                              optim=optim_bytes(held=nbytes(params), tensors=len(params), optim=cfg.optim), acts=acts,
                              records=records))
    return out


PLANNERS: dict[str, Callable[..., list[tuple[dict, dict]]]] = {
    "ddp": plan_ddp, "ddp_ac": plan_ddp, "ddp_stochastic_depth": plan_ddp, "ddp_layerdrop": plan_ddp,
    "sdp": plan_sdp, "fsdp": plan_fsdp, "pipeline": plan_pipeline,
}


def predict(cfg: DictConfig) -> dict[str, Any]:
    """Per-rank predicted memory and comm of ``cfg`` (validated first, as sdp-train does)."""
    from sdp.config import validate

    validate(cfg)
    name, world = str(cfg.parallelism.name), int(cfg.cluster.world_size)
    if name not in PLANNERS:
        raise ValueError(f"parallelism.name={name!r}: sdp-plan predicts {', '.join(PLANNERS)}")
    with torch.device("meta"):
        model = build(cfg.model)
    facts: dict[str, Any] = {}  # strategy-specific facts the planner records (SDP: its plan)
    entries = PLANNERS[name](cfg=cfg, model=model, world=world, facts=facts)
    add_peaks(cfg=cfg, model=model, entries=entries)
    return {**facts, "strategy": name, "model": str(cfg.model.get("name", "")), "world_size": world,
            "batch_size": int(cfg.train.batch_size), "optimizer": str(cfg.optim.optimizer._target_),
            "memory": {"per_rank": [m for m, _ in entries]}, "comm": {"per_rank": [c for _, c in entries]},
            "notes": ["activation_bytes: saved for backward by a meta-device forward at the per-rank batch; "
                      "stochastic depth / LayerDrop predicted with every block kept"]}


def add_peaks(*, cfg: DictConfig, model: SDPModel, entries: list[tuple[dict, dict]]) -> None:
    """Add the predicted set-up, train and eval peaks (:mod:`sdp.plan_peaks`) to each rank's memory entry."""
    from sdp.plan_peaks import predict_peaks

    peaks = predict_peaks(cfg=cfg, model=model, world=len(entries), state=[m for m, _ in entries])
    for (mem, _), p in zip(entries, peaks or [{}] * len(entries)):
        mem.update(p)


def sdp_frontier(cfg: DictConfig) -> dict[str, Any]:
    """The SDP plan's floor and Pareto frontier over every assignment (:mod:`sdp.subnet.frontier`)."""
    from dataclasses import asdict

    from sdp.parallel.sdp import plan_for
    from sdp.subnet.frontier import format_frontier, frontier

    if str(cfg.parallelism.name) != "sdp" or str(cfg.parallelism.masking) != "forward":
        raise ValueError(f"plan.frontier=true scores SDP with forward masking (backward masking keeps every parameter "
                         f"and activation on every worker), got parallelism.name={cfg.parallelism.name!r} "
                         f"masking={cfg.parallelism.get('masking')!r}")
    with torch.device("meta"):
        model = build(cfg.model)
    world = int(cfg.cluster.world_size)
    plan = plan_for(model=model, cfg=cfg.parallelism, world_size=world)
    result = frontier(plan=plan, full_activation_bytes=activations(model, model.example_input(2).to("meta")) / 2)
    title = (f"model={cfg.model.get('name', '')} world_size={world} coverage={cfg.parallelism.coverage} "
             f"level={plan.level} balance={dict(cfg.parallelism.balance)}")
    return {"assignments": result["assignments"], "connected_assignments": result["connected_assignments"],
            "floor": asdict(result["floor"]), "plan": asdict(result["plan"]),
            "frontier": [asdict(p) for p in result["frontier"]],
            "connected_frontier": [asdict(p) for p in result["connected_frontier"]],
            "text": format_frontier(result, title=title)}


def format_plan(plan: dict[str, Any]) -> str:
    lines = [f"sdp-plan: strategy={plan['strategy']} model={plan['model']} world_size={plan['world_size']} "
             f"batch_size/rank={plan['batch_size']} optimizer={plan['optimizer']}",
             "| rank | params MiB | grads MiB | optim MiB | activations MiB | model state MiB | comm MiB/step | wire MiB/step | collectives/step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m, c in zip(plan["memory"]["per_rank"], plan["comm"]["per_rank"]):
        state = m["param_bytes"] + m["grad_bytes"] + m["optim_bytes"]
        lines.append(f"| {m['rank']} | {m['param_bytes'] / MIB:.2f} | {m['grad_bytes'] / MIB:.2f} | {m['optim_bytes'] / MIB:.2f} | "
                     f"{m['activation_bytes'] / MIB:.2f} | {state / MIB:.2f} | {c['bytes_per_step'] / MIB:.2f} | "
                     f"{c['wire_bytes_per_step'] / MIB:.2f} | {c['collectives_per_step']:.0f} |")
    return "\n".join(lines)


def format_sdp_plan(summary: dict[str, Any]) -> str:
    """The SDP plan in a few lines: who holds what, how many holder sets, whether workers are connected."""
    sets = " ".join("{" + ",".join(map(str, h)) + "}" for h in summary["plan"].values())
    return "\n".join([
        f"SDP plan: level={summary['level']} assignment={summary['assignment']} k={summary['k']} of "
        f"{summary['world_size']} workers; {summary['units']} units; {summary['holder_sets']} distinct holder sets; "
        f"overlap graph {'connected' if summary['connected'] else 'DISCONNECTED: ' + str(summary['components'])}; "
        f"{summary['unit_pairs_trained_together']:.0%} of unit pairs trained together by some worker",
        f"holders (unit 0, 1, ...): {sets}"])


def plan_options(cfg: DictConfig) -> tuple[str | None, bool]:
    """The ``plan:`` node (read by sdp-plan only, so checked here, not by sdp-train's validation)."""
    from sdp.errors import boolean, require

    node = cfg.get("plan") or {}
    output, frontier = node.get("output"), node.get("frontier", False)
    require(output is None or (isinstance(output, str) and bool(output)), "plan.output", output, "null or a file path")
    boolean("plan.frontier", frontier)
    return output, frontier


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    output, with_frontier = plan_options(cfg)
    plan = predict(cfg)
    print(format_plan(plan), flush=True)
    if "plan" in plan:
        print(format_sdp_plan(plan["plan"]), flush=True)
    if with_frontier:
        plan["frontier"] = sdp_frontier(cfg)
        print(plan["frontier"].pop("text"), flush=True)
    if output:
        Path(str(output)).write_text(json.dumps(plan, indent=2))
        print(f"written: {output}")


def main() -> None:
    """Nothing is launched, so nothing is written either: no Hydra run directory unless asked for."""
    if not any(a.startswith(("hydra.run.dir=", "hydra.output_subdir=")) for a in sys.argv[1:]):
        sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    _hydra_main()


if __name__ == "__main__":
    main()
