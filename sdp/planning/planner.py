"""``sdp-plan``: per-rank memory and communication predicted before launch, for any strategy.

Same Hydra config as ``sdp-train``; nothing is launched and the model is built on the meta device,
so a 1B-parameter model on 8 workers is planned in seconds. The strategy makes its own prediction
(:meth:`sdp.parallel.spec.StrategySpec.predict` and ``predict_peaks``, with the shared rules of
:mod:`sdp.parallel.plan_entries`), reusing the code it runs (its plan, masking, buckets, cut or sharding
rule) rather than a second model of it; activations come from a meta-device forward through the
same saved-tensor meter the trainer measures with. ``plan.output=<file>`` writes JSON with the
``memory.per_rank`` and ``comm.per_rank`` keys of ``summary.json``, so prediction and measurement
compare field by field (``tests/test_plan.py``), plus the facts the strategy adds (e.g. its unit
plan, as in ``summary.json``), which it also prints (a spec's own ``format_facts``, where it has one). Both
read what the driver built once for the ranks (the validation's :class:`sdp.driver.preflight.Preflight`: SDP's plan), so the
prediction is of the very plan a run trains. This module names no strategy: adding one needs no edit here.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from sdp.driver.config import validate, validate_strategy
from sdp.driver.messages import config_errors
from sdp.driver.preflight import Preflight, meta_model
from sdp.errors import positive_int, require
from sdp.models.base import SDPModel
from sdp.parallel import STRATEGIES, JobFacts, StrategySpec
from sdp.parallel.ac import apply_checkpointing
from sdp.driver.budget import apply as apply_budget
from sdp.parallel.plan_entries import Entry, communicators
from sdp.planning.plan_checkpoint import predict_checkpoints
from sdp.planning.plan_traffic import format_phases, predict_outside
from sdp.planning.throughput import format_throughput, predict as predict_throughput
from sdp.rank.schedule import Cadence
from sdp.driver.train import CONF_DIR  # also registers the ${sdp_uid:} resolver the config uses
from sdp.registry import build
from sdp.report.compare import mib

BASE_NOTE = "activation_bytes: saved for backward by a meta-device forward at the per-rank batch"
# The peaks a prediction may hold (sdp/parallel/plan_peaks.py; a re-draw's only with parallelism.resample_every,
# a calibration's only with parallelism.calibrate_steps, consolidation's with parallelism.consolidate),
# in the order a run reaches them: each is a column of the printed table where the plan has it.
PEAKS = (("setup_peak_bytes", "set-up peak MiB"), ("train_peak_bytes", "train peak MiB"),
         ("redraw_peak_bytes", "re-draw peak MiB"), ("consolidate_peak_bytes", "consolidation peak MiB"),
         ("calibrate_peak_bytes", "calibrate peak MiB"),
         ("eval_peak_bytes", "eval peak MiB"))
COMM_NOTE = ("groups: process groups per rank, the default one included; NCCL comm. MiB: their communicators' device "
             "memory outside the allocator (and outside the peaks), groups x cluster.comm_bytes_per_group, an "
             "assumption a GPU run calibrates (summary.json: cuda_device_used_bytes, process_groups); none on gloo")


def predict(cfg: DictConfig, *, built: Preflight | None = None) -> dict[str, Any]:
    """Per-rank predicted memory and comm of ``cfg`` (validated first, as sdp-train does, unless ``built``
    is that validation's result), made by the strategy (:meth:`~sdp.parallel.spec.StrategySpec.predict`) from
    what the driver prepared for the ranks."""
    built = built if built is not None else validate(cfg, launching=False)
    cadence, job = run_cadence(cfg, built=built)  # the job as the ranks get it: its budget resolved
    name, world = str(cfg.parallelism.name), int(cfg.cluster.world_size)
    spec, ready = STRATEGIES.get(name), built.prepared  # SDP's plan: the one validation drew
    with torch.device("meta"):
        model = build(cfg.model)  # a build of its own: a prediction may change it
    apply_checkpointing(model, every=job.ac_every, mode=job.ac_mode)  # train.ac: the blocks every rank checkpoints, for every strategy
    facts: dict[str, Any] = {}  # strategy-specific facts for the plan (e.g. its unit plan)
    entries = spec.predict(cfg=cfg.parallelism, job=job, model=model, facts=facts, prepared=ready)
    assert built.val_samples is not None, "sdp-plan's evaluation peak needs the validation set's size: validate(cfg) builds it"
    add_peaks(cfg=cfg, job=job, model=model, entries=entries, spec=spec, prepared=ready, val_samples=built.val_samples,
              cadence=cadence)
    outside, traffic_notes = predict_outside(cfg=cfg, job=job, spec=spec, model=model, prepared=ready, cadence=cadence,
                                             val_samples=built.val_samples)
    for (_, comm), phases in zip(entries, outside):
        comm["outside_training"] = phases  # as summary.json's: the whole run's bytes and collectives per phase
    checkpoint, checkpoint_notes = predict_checkpoints(cfg=cfg, job=job, spec=spec, model=model, prepared=ready,
                                                       cadence=cadence)
    per_group = cfg.cluster.comm_bytes_per_group  # read by sdp-plan only: checked here
    positive_int("cluster.comm_bytes_per_group", per_group, minimum=0)
    for (mem, _), comms in zip(entries, communicators(per_group=per_group, groups=facts.get("process_groups"), world=world)):
        mem.update(comms)
    return {**facts, "strategy": name, "model": str(cfg.model.get("name", "")), "world_size": world,
            "batch_size": int(cfg.train.batch_size), "optimizer": str(cfg.optim.optimizer._target_),
            "steps": cadence.steps, "memory": {"per_rank": [m for m, _ in entries]},
            "comm": {"per_rank": [c for _, c in entries]}, "checkpoint": checkpoint,
            "notes": ["; ".join([BASE_NOTE, *([spec.plan_note] if spec.plan_note else [])]), *traffic_notes,
                      *checkpoint_notes],
            "throughput": predict_throughput(cfg=cfg, built=built, spec=spec, comm=[c for _, c in entries])}


def run_cadence(cfg: DictConfig, *, built: Preflight) -> tuple[Cadence, JobFacts]:
    """The steps the run of ``cfg`` makes and those it evaluates after: its budget resolved into a copy of the config
    (:func:`sdp.driver.budget.apply`, as the driver resolves it into the config the ranks read), then the
    trainer's own :class:`~sdp.rank.schedule.Cadence` of it; and the job's facts as the ranks read them from that
    config (:meth:`JobFacts.of` with the budget: its steps and each training phase's, e.g. SDP's consolidation)."""
    run = copy.deepcopy(cfg)
    budget = apply_budget(run, preflight=built)
    return Cadence.of(train=run.train, budget=budget), JobFacts.of(run, budget=budget)


def eval_batch(*, eval_batch_size: int, val_samples: int, world: int) -> int:
    """The largest batch a rank evaluates: ``train.eval_batch_size``, or the rank's whole share of the
    validation set when that is smaller (:func:`sdp.data.base.val_batches` deals sample ``i`` to rank
    ``i mod world``, so rank 0's share, ``ceil(val_samples / world)``, is the largest; ``val_samples``: the
    size of the set the dataset built, :attr:`sdp.driver.preflight.Preflight.val_samples`)."""
    assert val_samples > 0 and world > 0 and eval_batch_size > 0, (val_samples, world, eval_batch_size)
    return min(int(eval_batch_size), math.ceil(int(val_samples) / world))


def predict_peaks(*, cfg: DictConfig, job: JobFacts, model: SDPModel, state: list[dict[str, Any]], spec: Any,
                  val_samples: int, cadence: Cadence, prepared: Any = None) -> list[dict[str, int]] | None:
    """Per rank ``setup_peak_bytes``, ``train_peak_bytes``, ``eval_peak_bytes`` from ``spec``'s
    :meth:`~sdp.parallel.spec.StrategySpec.predict_peaks` (None: a strategy without a peak rehearsal:
    pipeline). ``state``: the planner's per-rank memory entries (the held parameter, gradient and
    optimizer bytes that FSDP's rule starts from); ``val_samples``: the validation set's real size (what
    evaluation batches, :func:`eval_batch`); ``cadence``: the run's steps and the steps it evaluates after (its
    budget resolved); ``prepared``: what the driver built for the ranks."""
    batch = eval_batch(eval_batch_size=int(cfg.train.eval_batch_size), val_samples=val_samples, world=job.world_size)
    return spec.predict_peaks(cfg=cfg.parallelism, job=job, model=model, eval_batch=batch, steps=cadence.steps,
                              eval_steps=frozenset(cadence.eval_at), state=state, prepared=prepared)


def add_peaks(*, cfg: DictConfig, job: JobFacts, model: SDPModel, entries: list[Entry], spec: type[StrategySpec],
              prepared: Any, val_samples: int, cadence: Cadence) -> None:
    """Add the predicted set-up, train and eval peaks (:mod:`sdp.parallel.plan_peaks`) to each rank's memory entry
    (``val_samples``: the validation set's size; ``cadence``: the run's steps and evaluations, :func:`run_cadence`)."""
    assert len(entries) == job.world_size, f"one entry per rank: {len(entries)} entries, world_size={job.world_size}"
    peaks = predict_peaks(cfg=cfg, job=job, model=model, state=[m for m, _ in entries], spec=spec, prepared=prepared,
                          val_samples=val_samples, cadence=cadence)
    for (mem, _), p in zip(entries, peaks or [{}] * len(entries)):
        mem.update(p)


def frontier(cfg: DictConfig, *, built: Preflight | None = None) -> dict[str, Any]:
    """``plan.frontier=true``: the strategy's plan against every other; a question only SDP answers (its
    spec's own ``plan_frontier``), refused for any other strategy. ``built``: the validation's result; None
    (a recorded run's config, read by a report) builds the model and the plan only, without the checks of
    the data and the cluster (:func:`sdp.driver.config.validate_strategy`)."""
    spec = STRATEGIES.get(str(cfg.parallelism.name))
    own = getattr(spec, "plan_frontier", None)
    if own is None:
        raise ValueError(f"plan.frontier=true scores SDP with forward masking, got parallelism.name={spec.name!r}")
    built = built if built is not None else validate_strategy(cfg, model=meta_model(cfg))
    return own(cfg=cfg.parallelism, job=built.job, model=built.model, prepared=built.prepared)


def format_plan(plan: dict[str, Any]) -> str:
    """The printed table: per rank its memory (the peaks the plan holds, :data:`PEAKS`) and comm, then the notes
    (the communicators' and the plan's own: this strategy's caveat only)."""
    mem, comm = plan["memory"]["per_rank"], plan["comm"]["per_rank"]
    peaks = [(key, name) for key, name in PEAKS if any(m.get(key) is not None for m in mem)]
    header = ["rank", "params MiB", "grads MiB", "optim MiB", "activations MiB", "model state MiB",
              *(name for _, name in peaks), "groups", "NCCL comm. MiB", "comm MiB/step", "wire MiB/step", "collectives/step"]
    lines = [f"sdp-plan: strategy={plan['strategy']} model={plan['model']} world_size={plan['world_size']} "
             f"batch_size/rank={plan['batch_size']} optimizer={plan['optimizer']}",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for m, c in zip(mem, comm):
        state = m["param_bytes"] + m["grad_bytes"] + m["optim_bytes"]
        cells = [m["rank"], *map(mib, (m["param_bytes"], m["grad_bytes"], m["optim_bytes"], m["activation_bytes"], state)),
                 *(mib(m.get(key), missing="") for key, _ in peaks), m["process_groups"], mib(m["communicator_bytes"]),
                 mib(c["bytes_per_step"]), mib(c["wire_bytes_per_step"]), f"{c['collectives_per_step']:.0f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += [COMM_NOTE, *plan.get("notes", [])]
    return "\n".join(lines)


def plan_options(cfg: DictConfig) -> tuple[str | None, bool]:
    """The ``plan:`` node (read by sdp-plan only; its types are the schema's, sdp/driver/schema.py)."""
    output, frontier = cfg.plan.output, cfg.plan.frontier
    require(output is None or bool(output), "plan.output", output, "null or a file path")
    return output, bool(frontier)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    with config_errors(prog="sdp-plan", sweep=HydraConfig.get().mode == RunMode.MULTIRUN):  # a bad value: one line, exit 2
        output, with_frontier = plan_options(cfg)
        built = validate(cfg, launching=False)  # planning for a device needs none here
        plan = predict(cfg, built=built)
    print(format_plan(plan), flush=True)
    print(format_throughput(plan["throughput"]), flush=True)
    print(format_phases(plan), flush=True)
    for line in getattr(STRATEGIES.get(plan["strategy"]), "format_facts", lambda _facts: [])(plan):
        print(line, flush=True)  # the strategy's own facts (SDP: its plan), where it has any
    if with_frontier:
        plan["frontier"] = frontier(cfg, built=built)
        print(plan["frontier"].pop("text"), flush=True)
    if output:
        Path(str(output)).write_text(json.dumps(plan, indent=2))
        print(f"written: {output}")


def main() -> None:
    """Nothing is launched, so nothing is written either: no Hydra run directory unless asked for. An experiment
    whose YAML sets ``hydra.mode: MULTIRUN`` (a study's sweep) is planned as one job, its variant and seed as given
    (a sweep dir and the sweep's callbacks would write a directory and build reports of no runs); ``-m`` plans every
    job of a sweep, each into the sweep's directories as sdp-train would."""
    args = sys.argv[1:]
    if not any(a.startswith(("hydra.run.dir=", "hydra.output_subdir=")) for a in args):
        sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    if not any(a in ("-m", "--multirun") or a.startswith("hydra.mode=") for a in args):
        sys.argv += ["hydra.mode=RUN"]
    _hydra_main()


if __name__ == "__main__":
    main()
