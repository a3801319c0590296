"""Subnetwork Data Parallelism (arXiv 2507.09029): each worker trains a subnetwork of the model.

Wiring: :mod:`sdp.subnet.plan` says who holds which unit, :mod:`sdp.subnet.masking` turns the full model into this
worker's subnetwork, :mod:`sdp.subnet.sync` averages gradients over holder sets, :mod:`sdp.subnet.assemble` rebuilds
the full model for evaluation, :mod:`sdp.subnet.redraw` moves the pieces that change hands at a re-draw (values, and
optimizer state: :mod:`sdp.subnet.carry`); what the ranks evaluate is :mod:`sdp.parallel.sdp_eval`'s.

The worker builds the model on the meta device and passes it to ``setup``: under forward masking, masking materialises
(on the CPU, seeded per module, :mod:`sdp.models.init`) only the tensors this rank holds, narrowing neuron-level
tensors as it goes, so no rank ever holds the full model and the device never sees a non-held parameter; backward
masking materialises everything (it keeps all values by definition). The values equal those of the full build, so C =
1 equals DDP bit for bit. Evaluation assembles the model one part at a time (stem, each block, head: built from its
holders, run, dropped), so it never holds the full model either (traffic: ``comm.phase = "eval"``, largest part:
``eval_assembled_bytes``). What the driver asks is :class:`SDPSpec`, whose plan every rank receives.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from torch import nn

from sdp.errors import require
from sdp.metrics.flops import BlockShare
from sdp.metrics.memory import measured_phase
from sdp.metrics.timing import PhaseTimer
from sdp.models import init
from sdp.models.base import SDPModel
from sdp.results.rundir import RunDir
from sdp.parallel.base import OptimizerFactory, Strategy
from sdp.parallel.job import JobFacts
from sdp.parallel.spec import Coverage, Overlap, StrategySpec, register
from sdp.parallel import sdp_calibrate, sdp_config, sdp_consolidate as SC, sdp_final, sdp_plan, sdp_redraw_plan, sdp_traffic
from sdp.parallel.sdp_eval import AssembledEval
from sdp.parallel.sdp_peaks import sdp_peaks
from sdp.parallel.sdp_plan import plan_for, plan_lists
from sdp.parallel.plan_entries import Entry
from sdp.subnet import masking as M
from sdp.subnet.assemble import split_blocks, tensor_map
from sdp.subnet import redraw as R
from sdp.subnet.plan import Plan
from sdp.subnet.holder_groups import GroupSet, check_same_plan, with_refresh_sets
from sdp.subnet.sync import OwnerSetSync


class SDPStrategy(SC.Consolidating, sdp_calibrate.Calibrated, AssembledEval, Strategy):
    """Forward or backward masking at block or neuron level, owner-set gradient averaging (on the ranks); evaluation:
    :class:`~sdp.parallel.sdp_eval.AssembledEval`."""

    materialises_held = True  # forward masking materialises only the held units and the shared parts

    # ---- set-up ---------------------------------------------------------------------------------
    def setup(self, *, model: SDPModel, optimizer_factory: OptimizerFactory) -> None:
        cfg, ctx = self.cfg, self.ctx
        self.mode = M.masking_mode(masking=str(cfg.masking), refresh=str(cfg.refresh))
        self.skeleton = copy.deepcopy(model).to("meta")
        self.groups: GroupSet | None = None
        self.redraws, self.eval_copy_bytes, self.block_costs = 0, 0, None  # block costs: at the first re-draw, then reused
        self.redraw_log: list[dict[str, Any]] = []  # the run's re-draws (a resumed run: the checkpoint's, then its own)
        self.rescale = sdp_config.resolve_rescale(cfg=cfg, eval_bn=self.job.eval_bn, model=model)
        if self.prepared is None:  # built outside the driver (tests, benchmarks): the same plan, drawn here
            self.prepared = plan_for(model=model, cfg=cfg, world_size=ctx.world_size)
        plan: Plan = self.prepared  # the driver's plan (SDPSpec.prepare): k and the holders come from it
        check_same_plan(identity=plan_lists(plan), draw=plan.draw, ctx=ctx)  # each process's own driver drew it (Slurm)
        if self.mode != "forward":
            init.materialise(model)  # backward masking keeps every value by definition
        self._mask(model, plan=plan)
        leftover = init.meta_tensors(model)
        assert not leftover, f"rank {ctx.rank}: {len(leftover)} tensors left on the meta device after masking: {leftover[:5]}"
        self.optimizer = optimizer_factory(self._trainable())

    def _mask(self, model: SDPModel, *, plan: Plan) -> None:
        """Prune ``model`` to this rank's subnetwork (on its current device), move it, re-point the layout
        at the moved tensors (:func:`sdp.subnet.masking.rebind`), wire sync."""
        pieces = M.pieces(model, plan)
        layout = M.apply(model, plan, rank=self.ctx.rank, masking=self.mode, all_pieces=pieces,
                         materialise=lambda name: init.materialise_module(model, name))
        self._wire(model, plan=plan, pieces=pieces, layout=layout)

    def _wire(self, model: SDPModel, *, plan: Plan, pieces: list[M.Piece], layout: dict[str, M.Local]) -> None:
        """Make ``model`` (masked for ``plan``: ``pieces``, ``layout``) the training module: scales, device,
        process groups (a re-draw: the new plan's), owner-set sync."""
        ctx = self.ctx
        self.plan, self.pieces, self.layout = plan, pieces, layout
        if self.rescale == "train" and self.mode == "forward":  # a split unit: groups / held groups on its split sub-branches only
            for b, split in split_blocks(plan).items():
                units = [u for u in range(len(plan.units)) if plan.units[u].block == b]
                run = [u for u in units if ctx.rank in plan.holders[u]]
                model.blocks[b].set_scale(len(units) / len(run) if split and run else plan.world_size / plan.k, split=split)
        self.module = model.to(ctx.device)
        self.layout = M.rebind(self.module, self.layout)  # the move replaced every buffer (BatchNorm statistics)
        sets, refresh = {p.holders for p in self.pieces}, with_refresh_sets(mode=self.mode)  # forward: fill's broadcasts
        if self.groups is None:
            self.groups = GroupSet(world_size=ctx.world_size, holder_sets=sets, refresh=refresh)
        else:  # a re-draw: new holder sets get their groups, unused ones are destroyed, in one order on every rank
            self.groups.redraw(holder_sets=sets, refresh=refresh)
        if getattr(self, "sync", None) is not None:
            self.sync.close()  # a re-draw: the old subnetwork's gradient hooks go
        self.sync = OwnerSetSync(rank=ctx.rank, pieces=self.pieces, layout=self.layout, groups=self.groups, comm=ctx.comm,
                                 mode=self.mode, bucket_cap_mb=float(self.cfg.bucket_cap_mb), overlap=bool(self.cfg.overlap))

    def _trainable(self) -> list[nn.Parameter]:
        assert self.module is not None
        return list(self.module.parameters() if self.mode == "global" else M.held_parameters(self.layout, self.pieces, self.ctx.rank))

    # ---- one step (train_step: the base template with these hooks) -------------------------------
    def _before_step(self, *, step: int, timer: PhaseTimer) -> None:
        self._consolidate_at(step=step, timer=timer)  # sdp_consolidate.Consolidating
        every = self.cfg.resample_every
        if every and step > 0 and step % int(every) == 0:
            with timer.phase("resample"):
                self._redraw(draw=step // int(every))

    def _sync_grads(self, *, timer: PhaseTimer) -> None:
        with timer.phase("comm"):  # with overlap: only the wait for the launched buckets (exposed comm)
            self.sync.reduce_grads()

    def _after_step(self, *, timer: PhaseTimer) -> None:
        if self.mode == "backward":
            with timer.phase("comm"):
                self.sync.refresh()

    def _redraw(self, *, draw: int, resumed: bool = False) -> None:
        """Re-draw the plan (ResIST style), moving only the pieces that change hands (:mod:`sdp.subnet.redraw`). Traffic:
        comm phase "resample"; peak: memory phase "redraw"; bytes per rank: ``strategy_info.redraw``. ``resumed``: the
        checkpoint's draw built empty for its values (:func:`~sdp.subnet.redraw.built_empty`): not a re-draw of the run,
        so nothing moves and nothing is logged (a resumed run's summary counts what the uninterrupted run's counts)."""
        assert self.optimizer is not None and self.module is not None and self.groups is not None
        ctx = self.ctx
        plan, self.block_costs = sdp_plan.next_plan(model=self.skeleton, cfg=self.cfg, world_size=ctx.world_size, draw=draw,
                                                    first=self.prepared, costs=self.block_costs)
        check_same_plan(identity=plan_lists(plan), draw=draw, ctx=ctx)  # derived on each rank: a divergence fails here, named
        self.sync.close()  # the old subnetwork's gradient hooks go
        self.sync = None
        if resumed:
            model, pieces, layout = R.built_empty(skeleton=self.skeleton, plan=plan, rank=ctx.rank, mode=self.mode,
                                                  device=ctx.device, replacing=self.module)
            self._wire(model, plan=plan, pieces=pieces, layout=layout)
            self.optimizer.param_groups[0]["params"] = self._trainable()
            return
        with ctx.comm.phase_as("resample"), measured_phase("redraw") as measured:
            model, pieces, layout = R.masked_on_meta(skeleton=self.skeleton, plan=plan, rank=ctx.rank, mode=self.mode)
            table = R.redraw(module=self.module, optimizer=self.optimizer, old=self.pieces, old_layout=self.layout,
                             new_model=model, new=pieces, new_layout=layout, rank=ctx.rank, world=ctx.world_size,
                             mode=self.mode, device=ctx.device, full=tensor_map(self.skeleton),
                             wire=R.Wire(ctx=ctx, groups=self.groups))
            leftover = init.meta_tensors(model)
            assert not leftover, f"rank {ctx.rank}: {len(leftover)} tensors left on the meta device by the re-draw: {leftover[:5]}"
            self._wire(model, plan=plan, pieces=pieces, layout=layout)
            self.optimizer.param_groups[0]["params"] = self._trainable()
        self.redraws += 1
        self.redraw_log.append({"draw": draw, "peak_bytes": measured["peak_bytes"], "sent_bytes": [t["sent_bytes"] for t in table],
                                "received_bytes": [t["received_bytes"] for t in table]})

    # ---- reporting ----------------------------------------------------------------------------------
    def summary_extra(self) -> dict[str, Any]:
        return {"plan": self.plan.summary(), "masking": str(self.cfg.masking), "refresh": str(self.cfg.refresh),
                "rescale": self.rescale, "consolidate": self._consolidation_summary(),
                "process_groups": sum(1 for g in self.groups.groups.values() if g is not None) if self.groups else 0,
                "eval_assembled_bytes": self.eval_copy_bytes, "redraws": self.redraws, "overlap": self.sync.overlap,
                "redraw": R.summary(count=self.redraws, log=self.redraw_log, world=self.ctx.world_size), **self.calibration_extra()}

    def save_artifacts(self, *, run_dir: Path) -> None:
        self.plan.save(RunDir(run_dir).plan)
    final_state = sdp_final.final_state  # train.save_final: each piece from its lowest holder, the plan and scales

    # ---- checkpoint / resume ------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, dict[str, Any]]:
        """Everything under ``"local"``: ranks hold different subnetworks. The module's own state dict
        is exactly what this rank stores: narrowed tensors (forward masking, deleted ones are absent),
        held/frozen parts of split tensors and frozen non-held tensors (backward masking, part of the
        model's state since this rank runs them), buffers. The plan, re-draw log and calibration go along as plain lists."""
        assert self.module is not None and self.optimizer is not None
        return {"local": {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(), "extra": {
            "plan": plan_lists(self.plan), "redraws": self.redraws, "redraw_log": self.redraw_log,
            **self.calibration_extra()}, **self._consolidation_state()}}

    def load_checkpoint_state(self, state: dict[str, dict[str, Any]]) -> None:
        """Rebuild the saved plan's subnetwork, then load values into it. A fixed plan must be the one
        this config builds (a changed coverage, level, assignment or model is refused); with
        ``resample_every`` the saved draw is built (:meth:`_redraw`, ``resumed``) and the run's re-draw log adopted."""
        assert self.optimizer is not None
        local, saved = state["local"], state["local"]["extra"]["plan"]
        if saved != plan_lists(self.plan):
            require(bool(self.cfg.resample_every) and saved["draw"] > 0, "parallelism", sdp_config.plan_keys(self.cfg),
                    f"must build the checkpoint's plan to resume (saved {saved}, now {plan_lists(self.plan)})")
            self._redraw(draw=int(saved["draw"]), resumed=True)  # empty: the state is loaded below
            require(saved == plan_lists(self.plan), "parallelism", sdp_config.plan_keys(self.cfg),
                    f"re-draw {saved['draw']} gives {plan_lists(self.plan)}, the checkpoint holds {saved}")
        self._load_consolidated(local)  # written after the consolidation switch: its structure (sdp_consolidate)
        assert self.module is not None
        self.module.load_state_dict(local["model"])
        self.optimizer.load_state_dict(local["optimizer"])
        self.redraws, self.redraw_log = int(local["extra"]["redraws"]), list(local["extra"].get("redraw_log", []))
        self.load_calibration(local["extra"])


@register("sdp")
class SDPSpec(StrategySpec):
    """SDP in the driver: keys, plan drawn once (:meth:`prepare`), label, k / n, FLOP fraction, sdp-plan (bodies: sdp_*.py)."""
    runtime, schema = SDPStrategy, sdp_config.SDPConfig
    label_keys = ("level", "masking")  # labels: B-SDP, B_β-SDP, N-SDP, N_β-SDP
    overlap = Overlap(kinds=("all_reduce",), window="backward", tail=1, switch="overlap")  # as DDP's buckets; refresh exposed
    post_training = classmethod(sdp_calibrate.post_training)  # assembly calibration, charged by the budget (sdp_calibrate)

    @classmethod
    def validate(cls, *, cfg: DictConfig, job: JobFacts) -> None:
        """Every SDP key (:func:`sdp.parallel.sdp_config.validate`); the plan itself is :meth:`prepare`'s."""
        sdp_config.validate(cfg=cfg, world_size=job.world_size)

    @classmethod
    def prepare(cls, *, cfg: DictConfig, job: JobFacts, model: SDPModel) -> Plan:
        """The plan, drawn once in the driver and handed to every rank (:func:`sdp.parallel.sdp_config.prepare`)."""
        return sdp_config.prepare(cfg=cfg, job=job, model=model)

    @classmethod
    def method_label(cls, *, cfg: DictConfig) -> str:
        """The paper's name of the level and masking (a subclass's own ``label`` wins)."""
        return cls.label or sdp_plan.LABELS.get((str(cfg.level), str(cfg.masking)), f"SDP ({cfg.level}, {cfg.masking})")

    @classmethod
    def coverage(cls, *, cfg: DictConfig, world_size: int, n_units: int | None, prepared: Any = None) -> Coverage | None:
        """C as configured, realised as k / n: the driver's plan's k, else (config alone: the report of a run
        without summary, a budget outside the driver) the plan's rule, :func:`sdp_config.holders`."""
        k = prepared.k if prepared is not None else sdp_config.holders(cfg=cfg, world_size=world_size)
        return Coverage(key="parallelism.coverage", symbol="C", value=cfg.coverage, fraction=k / world_size)

    @classmethod
    def flops_fraction(cls, *, cfg: DictConfig, coverage: Coverage, shares: dict[str, dict[int, BlockShare]],
                       prepared: Any = None) -> float:
        return sdp_plan.plan_fraction(plan=prepared, shares=shares[str(cfg.level)], masking=str(cfg.masking))

    @classmethod
    def predict(cls, *, cfg: DictConfig, job: JobFacts, model: SDPModel, facts: dict[str, Any],
                prepared: Any = None) -> list[Entry]:
        return sdp_plan.predict(cfg=cfg, job=job, model=model, plan=prepared, facts=facts)

    @classmethod
    def predict_peaks(cls, *, cfg: DictConfig, job: JobFacts, model: SDPModel, eval_batch: int, steps: int,
                      eval_steps: frozenset[int], state: list[dict[str, Any]], prepared: Any = None) -> list[dict[str, int]] | None:
        return sdp_peaks(cfg=cfg, job=job, model=model, plan=prepared, eval_batch=eval_batch, steps=steps, eval_steps=eval_steps)

    eval_traffic, phase_traffic, checkpoint_tensors = map(classmethod, sdp_traffic.PLAN_HOOKS)  # sdp-plan (sdp_traffic)
    later_phase = classmethod(SC.later_phase)  # the budget's consolidation phase (sdp_consolidate)

    # ---- SDP's own questions (sdp-plan asks them only of a strategy that has them) ----------------------
    @classmethod
    def plan_frontier(cls, *, cfg: DictConfig, job: JobFacts, model: SDPModel, prepared: Plan) -> dict[str, Any]:
        """``sdp-plan plan.frontier=true``: the floor and Pareto frontier of the plan (:func:`sdp_plan.plan_frontier`)."""
        return sdp_plan.plan_frontier(cfg=cfg, job=job, model=model, plan=prepared)

    @classmethod
    def format_facts(cls, facts: dict[str, Any]) -> list[str]:
        """Lines ``sdp-plan`` prints after its table: the plan, the re-draw rule, consolidation and calibration."""
        return [sdp_plan.format_plan_summary(facts["plan"]), *sdp_redraw_plan.format_redraw(facts), *sdp_traffic.format_phase_moves(facts)]
