"""The CPU-scale reproduction (issue 17): every run of one study, then its report, in one command.

    sdp-bench cpu-study --study lm       # LLaMA, 8 blocks, the automaton task the depth gate chose
                                         # (conf/experiment/cpu_study_lm_automaton.yaml)
    sdp-bench cpu-study --study lm_text  # the first LM study, on stdlib text (conf/experiment/cpu_study_lm.yaml): a
                                         # record; its task failed the gate (the lm report's first section)
    sdp-bench cpu-study --study image    # ResNet-18 width 16, digits (conf/experiment/cpu_study_image.yaml)
    sdp-bench cpu-study --study lm --render-only   # the report again from the committed runs
    sdp-bench cpu-study --study lm --status        # per stage: jobs finished, stopped, left (runs nothing)

(``python benchmarks/cpu_study.py ...``, the command the committed reports name, runs the same.)

Each study is a few Hydra multiruns of the real ``sdp-train``, one per stage below (resumable: ``train.skip_done=true`` skips a
finished job and resumes a checkpointed one when the command is run again):

- ``runs/gate`` (LM, issue 38): the depth gate, run first: DDP at 2, 4 and 8 blocks FLOP-matched to the 8-block
  model, on the study's task and each candidate task (:mod:`sdp.bench.gate`: the tasks, the rule, the report's
  first section); one run per sweep (``gate-<task>-s<seed>-L<blocks>``, each can be run alone with ``--only``);
  the gate's runs of the study's own task are its DDP rows, at every depth;
- ``runs/main``: the experiment's own sweep (every method x seeds 0-2, FLOP-matched, plus the same-iteration rows;
  the LM study: every method but DDP, one sweep per seed, ``runs/main/seed-<s>``, stage ``main-<s>``);
  ``runs/main/seeds-3-4``: the same sweep for seeds 3 and 4 (issue 17: 5 seeds where 3 do not meet the interval
  target; a separate sweep directory so that the first sweep's job numbers, and ``train.skip_done``, stay valid;
  the image study runs them for DDP and B-SDP C = 0.5 only, the pair the target is about);
  ``runs/main/kept/seed-<s>`` (LM, stages ``kept-<s>``, seeds 0-4): B-SDP C = 0.5 out of the main sweep, with its final
  weights kept (``train.save_final``): the main row, and the fixed plan the re-draw and one-model sections compare
  with (:attr:`sdp.bench.study_report.Study.kept`), run once instead of once per section; each stage whose runs keep
  their weights is followed by ``sdp-bench diagnose`` of them (:func:`sdp.bench.study_stages.diagnose_kept`);
- ``runs/extras``: FSDP (a check against DDP: the same updates up to float summation order, one seed; the lm study
  reads FSDP+AC's runs instead, FSDP's losses bit for bit) and, for the LM, B-SDP C = 0.5 with the other
  rescale rules (``parallelism.rescale=none,train``; the main row's ``auto`` resolves to ``eval``; the lm study runs
  rescale=train on seeds 0-2 and rescale=none on seed 0 only, the check: its training is the fixed plan's bit for
  bit, so every seed's rescale=none loss is read from the kept weights, :func:`sdp.bench.verdicts.unscaled_lines`) and
  the baselines of :data:`LM_BASELINES` (DDP+AC, FSDP+AC, local SGD, DiLoCo, PowerSGD; seeds 0-2, but in the lm
  study DDP+AC, whose losses are its DDP rows' by construction; their peaks and step times in ``runs/peaks`` and
  ``runs/timing`` as every method's, with B-SDP C = 0.5 + AC's in the lm study: its losses are B-SDP C = 0.5's by
  construction); ``lm_text`` also the small dense model
  (``variant=ddp_small_c50``, seeds 0-2: DDP at one worker's depth, FLOP-matched; the LM study's are the gate's);
- ``runs/depth`` (LM): B-SDP C = 0.5 with 4 and 12 blocks, seeds 0-2: the assembly gap against depth;
- ``runs/remedies`` (LM, issue 28; the image study: the LM's best two rules, seeds 0-2): B-SDP C = 0.5 with plan
  re-draws (``parallelism.redraw=shuffle|rolling``, every 50 and 200 steps) and, where no main row kept its weights
  (``lm_text``, image), its fixed plan again (the ensemble column), one sweep per seed and period (``seed-<s>/R50``);
  ``runs/remedies/peaks``: each re-draw rule once for 20 steps with the tracker on and one re-draw at step 10 (its peak);
  ``runs/remedies/timing``: the fixed plan and each rule once for 110 steps with two re-draws, tracker off, nothing
  else running (the step time: median step plus one re-draw's seconds over R);
- ``runs/peaks``: every method once more for 20 steps with the live-tensor tracker on (``memory.tracker=true``):
  the training peak of a step does not depend on how long the run is;
- ``runs/timing``: every method for 60 steps, seed 0, tracker off, no subnetwork evaluation: the step times
  (median of the steps after warm-up), measured with nothing else running, so that the long sweeps'
  wall-clock never enters a ratio (the report's seconds to target = steps to target x this step time);
  ``runs/peaks/small`` and ``runs/timing/small`` (LM): the same for the gate's small dense models (DDP at 4 and 2
  blocks under their FLOP budget, 20 and 60 steps of the 8-block model's FLOPs: 2x and 4x as many steps);
- ``runs/onemodel`` (LM, issue 39, run after every other stage): B-SDP C = 0.5 with its fixed plan and its
  final weights kept (``seed-<s>/fixed``, ``lm_text`` only: the LM study's are ``runs/main/kept``) and the remedies that
  keep one model (``seed-<s>/remedies``: consolidation over the last 10/20/30 % of the budget, with distillation,
  assembly calibration; ``lm``: also over 50 % and all of it, and all of it at branch scale 1), seeds 0-4, one
  stage per seed and group (``onemodel-<s>-fixed``, ``onemodel-<s>-remedies``);
  ``runs/onemodel/peaks``: one PEAK_STEPS-step run per mechanism with the tracker on, every phase inside it
  (``onemodelpeaks-cons``: the consolidation switch near the middle; ``onemodelpeaks-cal``: calibration after the
  last step). The report's section: :mod:`sdp.bench.one_model`.

The report (:mod:`sdp.bench.verdicts`) is written from the run directories only. One more sweep of
a kind a study has is one more list under its key in :data:`STUDIES` (``extras``: any overrides); a new
kind of stage is a key there and a line in :func:`stages`.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from sdp.bench.gate import gate_stages
from sdp.bench.runs import ROOT, parser
from sdp.bench.study_stages import check_only, run_stages, status_lines
from sdp.bench.verdicts import write_index, write_report

PEAK_STEPS, TIMING_STEPS = 20, 60
# The consolidation share f of a peak run (train.budget=iterations): sdp.driver.budget.split_phases puts the switch at
# s1 = round(steps (1 - f) r2 / ((1 - f) r2 + f r1)), r1 phase 1's FLOP fraction per step and r2 consolidation's
# (sdp.parallel.sdp_consolidate.later_phase_fraction): s1 = steps / 2 at f = r2 / (r1 + r2), which is about 0.7 for
# block-level C = 0.5 on the LM study's model with or without distillation (summary.json budget.phases gives the
# steps of each phase: the report marks a phase that did not run as not measured)
PEAK_CONSOLIDATE = 0.7
PEAK_CALIBRATE_STEPS = 5  # calibration's peak is that of one step (its gates' Adam state is a few floats)

# issue 38's baselines: activation checkpointing on DDP and FSDP, local SGD and DiLoCo (H = 8), PowerSGD (rank 4)
LM_BASELINES = ["ddp_ac", "fsdp_ac", "local_sgd_h8", "diloco_h8", "powersgd_r4"]


def _lm_record() -> dict:
    """``lm_text``: the LM study as first run, on byte-level stdlib text (every stage of the issues before 38)."""
    return {"experiment": "cpu_study_lm",
            "header": "**A record.** This study's task (byte-level stdlib text) did not pass the depth gate of issue 38 "
                      "(its row in the gate of [the LM study](../lm/REPORT.md)): on it more optimizer steps are worth "
                      "as much as more blocks, so its verdicts say little about depth. The LM study now runs on the "
                      "task its gate chose (that task's verdict: the LM report's first section); these runs are kept "
                      "as they were made.\n",
            "seeds": [],  # every method at seeds 3-4 (runs/main/seeds-3-4)
            "extras": [["variant=fsdp", "seed=0"],
                       ["variant=b_sdp_c50", "seed=0,1,2", "parallelism.rescale=none,train"],
                       # issue 38: the small dense model, DDP on one B-SDP C = 0.5 worker's 4 of 8 blocks, FLOP-matched
                       ["variant=ddp_small_c50", "seed=0,1,2"],
                       # issue 38: the baselines a reviewer asks for, FLOP-matched by model FLOPs (AC's recomputation
                       # is not charged: DDP+AC runs DDP's steps; the budget records it for the step time)
                       [f"variant={','.join(LM_BASELINES)}", "seed=0,1,2"]],
            "peak_extras": LM_BASELINES,  # their training peaks and step times too (runs/peaks, runs/timing)
            **{k: LM_SHARED[k] for k in ("depth", "remedies", "remedy_timing", "onemodel", "onemodel_peaks")},
            "onemodel_seeds": 5}


# The LM studies' stages that do not depend on their task (as lm_text ran them; the lm study drops the fixed-plan
# re-runs, its kept-<s> stages give them): B-SDP C = 0.5 at other depths; issue 28's plan re-draws (shuffled and
# rolling, every 50 and 200 steps) and the fixed plan once more (its ensemble column), one sweep per seed and period;
# issue 39's one model at DDP's quality: per seed, the fixed plan with its final weights kept (what sdp-bench diagnose
# reads) and the remedies (consolidation over the last 10/20/30 % of the budget, with distillation,
# and assembly calibration; consolidation + calibration is not a row: the driver refuses the pair,
# sdp/bench/one_model.py says why), and one peak run per mechanism (a phase's peak depends on neither f nor the
# calibration steps), each phase inside it: PEAK_CONSOLIDATE puts the switch near PEAK_STEPS / 2, calibration
# follows the last step
LM_SHARED = {
    "depth": ["variant=b_sdp_c50", "seed=0,1,2", "model.n_layers=4,12"],
    "remedies": {"R50": "variant=b_sdp_c50,b_sdp_c50_roll50,b_sdp_c50_shuffle50",
                 "R200": "variant=b_sdp_c50_roll200,b_sdp_c50_shuffle200"},
    "remedy_timing": "variant=b_sdp_c50,b_sdp_c50_roll50,b_sdp_c50_shuffle50",
    "onemodel": {"fixed": ["variant=b_sdp_c50", "train.save_final=fp32"],
                 "remedies": ["variant=b_sdp_c50_cons10,b_sdp_c50_cons20,b_sdp_c50_cons30,"
                              "b_sdp_c50_cons20_kd50,b_sdp_c50_cal"]},
    "onemodel_peaks": {"cons": ["variant=b_sdp_c50_cons20,b_sdp_c50_cons20_kd50",
                                f"parallelism.consolidate={PEAK_CONSOLIDATE}"],
                       "cal": ["variant=b_sdp_c50_cal", f"parallelism.calibrate_steps={PEAK_CALIBRATE_STEPS}"]},
}

# In the sweeps below the seed is the outer loop, so that a stage stopped early has every rule (every depth)
# for the seeds it finished: a row with fewer seeds than its neighbours pairs over fewer seeds, not other ones.
STUDIES = {
    # issue 38: the LM study on the task its depth gate chose (sdp.bench.gate.GATES). Its DDP rows, at every
    # depth, are the gate's runs (5 seeds; DDP-4 and DDP-2 are the small dense models of B-SDP C = 0.5 and 0.25), so
    # its sweeps run the other methods; seeds 3-4 for B-SDP C = 0.5 only, the pair of the interval target; 3 seeds for
    # issue 28's re-draws, 5 for issue 39's one-model remedies (its target is over 5 seeds)
    "lm": {"experiment": "cpu_study_lm_automaton",
           # B-SDP C = 0.5, seeds 0-4, with its final weights kept: run once, out of the main sweep (stages kept-<s>,
           # runs/main/kept/seed-<s>), it is the main table's row, issue 28's and issue 39's fixed plan and the
           # weights sdp-bench diagnose reads, so neither section re-runs it
           "main_per_seed": True, "kept": ["variant=b_sdp_c50", "train.save_final=fp32"],
           # extras-0 (FSDP's check) is not run: FSDP+AC's runs (extras-2) have FSDP's losses bit for bit, checkpointing
           # recomputing the same forward (tests/test_ac.py), so the check reads them (sdp.bench.verdicts.fsdp_lines);
           # None keeps the later stages' directories (extras/<i>) and job numbers
           "extras": [None,
                      # rescale=train trains otherwise; rescale=none trains the fixed plan bit for bit (the scale
                      # acts at evaluation only), so its loss is read from the kept weights of every seed (sdp-bench
                      # diagnose's scale sweep, sdp.bench.verdicts.unscaled_lines) and seed 0's run is the check
                      ["variant=b_sdp_c50", "seed=0", "parallelism.rescale=none,train"],
                      # the baselines a reviewer asks for, but DDP+AC: its recomputation is not charged, so it runs
                      # DDP's steps and every loss and collective of DDP's runs (the gate's 5 seeds) by construction
                      # (sdp.bench.baseline_verdicts.loss_twin); its measured peak is in runs/peaks
                      [f"variant={','.join(b for b in LM_BASELINES if b not in ('ddp_ac', 'powersgd_r4'))}", "seed=0,1,2"],
                      # PowerSGD's plain all-reduce phase at 10 % of DDP's 8000 steps (torch's advice for
                      # start_powerSGD_iter; conf/variant/powersgd_r4.yaml's default suits a 1000-step run)
                      ["variant=powersgd_r4", "seed=0,1,2", "parallelism.start_iter=800"],
                      # issue 39's diagnosis: LayerDrop keeping exactly an SDP worker's 4 blocks per batch (a fixed
                      # depth, re-composed every batch, no holder sets), beside layerdrop_c50's varying depth
                      ["variant=layerdrop_c50_exact", "seed=0,1,2"],
                      # issue 39's holder-averaging control: consolidation from the first step with LayerDrop inside
                      # at C = 1 (every block averaged over all ranks, as DDP+LayerDrop's), beside C = 0.5's onemodel job 8
                      ["variant=b_sdp_c100_cons100_ld50_rn", "seed=0,1,2"],
                      # rescale=train's other seeds (appended: extras-1's job numbers hold)
                      ["variant=b_sdp_c50", "seed=1,2", "parallelism.rescale=train"]],
           "peak_extras": ["ddp", *LM_BASELINES, "b_sdp_c50_ac"],  # + DDP (not in the main sweep), B-SDP C=0.5+AC last
           "small_dense": "model.n_layers=4,2",  # the gate's DDP-4 and DDP-2 (B-SDP C = 0.5 and 0.25's worker depth)
           **LM_SHARED, "remedy_seeds": 3, "onemodel_seeds": 5,
           # (runs/remedies/seed-0/R50/2 holds b_sdp_c50_shuffle50_rn, seed 0: the shuffle re-draw without branch
           # scaling. Its training equals job 1's bit for bit, the scale rule acting at evaluation only, so it is not
           # a job of the sweep: another scale rule is read from kept weights, sdp-bench diagnose)
           "remedies": {"R50": "variant=b_sdp_c50_roll50,b_sdp_c50_shuffle50", "R200": LM_SHARED["remedies"]["R200"]},
           "onemodel": {"remedies": [LM_SHARED["onemodel"]["remedies"][0]  # appended: the earlier job numbers hold
                                     + ",b_sdp_c50_cons100,b_sdp_c50_cons50,b_sdp_c50_cons100_rt,b_sdp_c50_cons100_ld50_rn"
                                     ",b_sdp_c50_cons50_ld50_rn,b_sdp_c50_cons50_wavg"]},
           # the world-averaged consolidation's peak has its own mechanism (every gradient computed, freed once reduced)
           "onemodel_peaks": {**LM_SHARED["onemodel_peaks"], "wavg": ["variant=b_sdp_c50_cons50_wavg",
                                                                     f"parallelism.consolidate={PEAK_CONSOLIDATE}"]}},
    "lm_text": _lm_record(),
    "image": {"experiment": "cpu_study_image",
              "extras": [["variant=fsdp", "seed=0"]],
              # seeds 3-4 for the pair of the image interval target only (the CPU time of the session; the other
              # rows keep seeds 0-2: widening this list renumbers the sweep, which skip_done refuses, clearly)
              "seeds": ["variant=ddp,b_sdp_c50"],
              # issue 28: the LM study's best two re-draw rules by assembled - DDP over seeds 0-2 (rolling and
              # shuffle every 200), and the fixed plan again for its ensemble column; 3 seeds
              "remedies": {"R200": "variant=b_sdp_c50,b_sdp_c50_roll200,b_sdp_c50_shuffle200"},
              "remedy_seeds": 3,
              "remedy_timing": "variant=b_sdp_c50,b_sdp_c50_roll50,b_sdp_c50_shuffle50"},
}
REMEDY_TIMING_STEPS = 110  # re-draws at steps 50 and 100 of the *_50 variants, then ten more steps
MORE_SEEDS = (3, 4)  # beyond the experiment YAML's seeds 0-2


def sweep_values(experiment: str, key: str) -> list[str]:
    """The values of ``key`` (variant, seed) the experiment's own sweep runs (read from its YAML, so the list lives
    in one place)."""
    doc = yaml.safe_load((ROOT / "conf" / "experiment" / f"{experiment}.yaml").read_text())
    return str(doc["hydra"]["sweeper"]["params"][key]).split(",")


def stages(*, study: str, out: Path) -> list[tuple[str, list[str]]]:
    spec = STUDIES[study]
    exp = spec["experiment"]
    peak_variants = [v for v in sweep_values(exp, "variant") if not v.endswith("_iters")] + ["fsdp", *spec.get("peak_extras", [])]
    common = [f"experiment={exp}", "train.skip_done=true"]
    out_runs = out / study / "runs"
    result = gate_stages(study=study, out_runs=out_runs, common=common[1:])
    if spec.get("main_per_seed"):  # one sweep per seed (the seed the outer loop: a stage is a seed of every method)
        kept = spec.get("kept", [])  # a main row run in its own sweeps (kept-<s>), out of the main one
        variants = [v for v in sweep_values(exp, "variant") if f"variant={v}" not in kept]

        def keep(seed: object) -> list[tuple[str, list[str]]]:  # the kept row's stage of a seed (none without one)
            return [(f"kept-{seed}", [*common, *kept, f"seed={seed}",
                                      f"hydra.sweep.dir={out_runs / 'main' / 'kept' / f'seed-{seed}'}"])] if kept else []
        for seed in sweep_values(exp, "seed"):  # main-<s> then kept-<s>: a stopped study has whole seeds
            result += [(f"main-{seed}", [*common, f"variant={','.join(variants)}", f"seed={seed}",
                                         f"hydra.sweep.dir={out_runs / 'main' / f'seed-{seed}'}"]), *keep(seed)]
        result += [stage for seed in MORE_SEEDS for stage in keep(seed)]
    else:
        result.append(("main", [*common, f"hydra.sweep.dir={out_runs / 'main'}"]))
    if "seeds" in spec:
        result += [("seeds", [*common, *spec["seeds"], f"seed={','.join(map(str, MORE_SEEDS))}",
                             f"hydra.sweep.dir={out_runs / 'main' / 'seeds-3-4'}"])]
    result += [(f"extras-{i}", [*common, *extra, f"hydra.sweep.dir={out_runs / 'extras' / str(i)}"])
               for i, extra in enumerate(spec["extras"]) if extra is not None]  # None: a stage dropped, its index kept
    if "depth" in spec:
        result.append(("depth", [*common, *spec["depth"], f"hydra.sweep.dir={out_runs / 'depth'}"]))
    # the short runs (one seed, a fixed number of steps, one evaluation): the training peak with the tracker on, and
    # the step time with nothing else measured; ``select``: the variants (and keys) they run
    def short(*select: str) -> list[str]:
        return [*common, *select, "seed=0", "train.budget=iterations", "train.eval_points=1"]

    peak_run = [f"train.steps={PEAK_STEPS}", "memory.tracker=true"]

    def timing_run(steps: int) -> list[str]:
        return [f"train.steps={steps}", "memory.tracker=false", "eval.subnetworks=false"]

    if "remedies" in spec:
        # seeds 0-2 of every period first, then seeds 3-4: a study stopped early has whole rows of 3 seeds
        seeds = range(spec.get("remedy_seeds", 5))
        order = sorted(((seed, group) for seed in seeds for group in spec["remedies"]),
                       key=lambda sg: (sg[0] >= 3, list(spec["remedies"]).index(sg[1]), sg[0]))
        result += [(f"remedies-{seed}-{group}", [*common, spec["remedies"][group], f"seed={seed}",
                                                 f"hydra.sweep.dir={out_runs / 'remedies' / f'seed-{seed}' / group}"])
                   for seed, group in order]
        # a re-draw's time does not depend on its period either: each rule alone for REMEDY_TIMING_STEPS steps with
        # two re-draws (every 50), tracker off and no subnetwork evaluation, as runs/timing does for the main table
        result.append(("remedytiming", [*short(spec["remedy_timing"]), *timing_run(REMEDY_TIMING_STEPS),
                                        f"hydra.sweep.dir={out_runs / 'remedies' / 'timing'}"]))
        # a re-draw's peak does not depend on its period: one re-draw (at step PEAK_STEPS // 2) inside a peak run
        rules = f"parallelism.redraw={spec.get('redraw_rules', 'shuffle,rolling')}"
        result.append(("remedypeaks", [*short("variant=b_sdp_c50", rules), *peak_run,
                                       f"parallelism.resample_every={PEAK_STEPS // 2}",
                                       f"hydra.sweep.dir={out_runs / 'remedies' / 'peaks'}"]))
    once = short(f"variant={','.join(peak_variants)}")
    result.append(("peaks", [*once, *peak_run, f"hydra.sweep.dir={out_runs / 'peaks'}"]))
    result.append(("timing", [*once, *timing_run(TIMING_STEPS), f"hydra.sweep.dir={out_runs / 'timing'}"]))
    if "small_dense" in spec:  # the gate's shallower DDP rows (the small dense models): their peaks and step times, from
        # runs under their own FLOP budget (train.flops_reference needs it) cut short: the row names match the gate's
        small = [*common, "variant=ddp_small_c50", spec["small_dense"], "seed=0", "train.eval_points=1"]
        result.append(("peaks-small", [*small, *peak_run, f"hydra.sweep.dir={out_runs / 'peaks' / 'small'}"]))
        result.append(("timing-small", [*small, *timing_run(TIMING_STEPS), f"hydra.sweep.dir={out_runs / 'timing' / 'small'}"]))
    if "onemodel" in spec:  # issue 39 (sdp.bench.one_model), after the stages above (their order kept): each seed's
        # sweeps, then one peak run per mechanism
        result += [(f"onemodel-{seed}-{group}", [*common, *select, f"seed={seed}",
                                                 f"hydra.sweep.dir={out_runs / 'onemodel' / f'seed-{seed}' / group}"])
                   for seed in range(spec["onemodel_seeds"]) for group, select in spec["onemodel"].items()]
        result += [(f"onemodelpeaks-{group}", [*short(*select), *peak_run,
                                               f"hydra.sweep.dir={out_runs / 'onemodel' / 'peaks' / group}"])
                   for group, select in spec["onemodel_peaks"].items()]
    return result


def main(argv: list[str] | None = None) -> int:
    ap = parser(suite="cpu-study", doc=__doc__)
    ap.add_argument("--study", choices=sorted(STUDIES), required=True)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu-study")
    ap.add_argument("--only", default=None, help="comma-separated stages to run: gate,main,kept,seeds,extras,depth,remedies,remedytiming,remedypeaks,peaks,"
                    "timing,onemodel,onemodelpeaks (default all; a kind takes every stage of it, e.g. main: the LM study's main-0..2, "
                    "peaks: peaks-small too), or one stage by its full name (e.g. gate-cpu_study_lm-s0-L4, main-1)")
    ap.add_argument("--render-only", action="store_true", help="write the report from existing runs")
    ap.add_argument("--status", action="store_true", help="list each stage's finished, stopped and left jobs; run nothing")
    args = ap.parse_args(argv)
    todo, only = stages(study=args.study, out=args.out), args.only.split(",") if args.only else None
    check_only(stages=todo, only=only)
    if args.status:
        print("\n".join(status_lines(stages=todo, only=only)))
        return 0
    if not args.render_only:
        seconds = run_stages(study=args.study, stages=todo, only=only)
        print(f"[{args.study}] all stages: {seconds / 60:.1f} min wall", flush=True)
    files = [*write_report(study_dir=args.out / args.study, study=args.study,
                           header=STUDIES[args.study].get("header", "")), write_index(out=args.out)]
    print("\n".join(f"wrote {f}" for f in files))
    return 0

