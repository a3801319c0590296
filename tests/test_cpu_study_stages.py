"""The LM study's baseline stage (issue 38, item 2; sdp/bench/cpu_study.py): every baseline runs FLOP-matched in
its own sweep, seeds 0-2, and once more in the peak and timing sweeps, appended after the methods already there
(so the committed sweeps' job numbers, which train.skip_done checks, stay as they were); each composes with the
study's experiment and passes the driver's validation before any rank would start."""

from __future__ import annotations

from pathlib import Path

import pytest

from sdp.bench import cpu_study, study_stages
from sdp.results.rundir import RunDir, checkpoint_meta


def _variants(args: list[str]) -> list[str]:
    return next(a for a in args if a.startswith("variant=")).removeprefix("variant=").split(",")


def test_the_baselines_have_a_sweep_and_are_appended_to_the_peak_and_timing_sweeps(tmp_path: Path) -> None:
    """The text study (now the record ``lm_text``): its sweeps as committed."""
    got = dict(cpu_study.stages(study="lm_text", out=tmp_path))
    sweeps = [args for name, args in got.items() if name.startswith("extras-") and
              _variants(args) == cpu_study.LM_BASELINES]
    assert len(sweeps) == 1 and "seed=0,1,2" in sweeps[0], list(got)
    before = [v for v in cpu_study.sweep_values("cpu_study_lm", "variant") if not v.endswith("_iters")] + ["fsdp"]
    for stage in ("peaks", "timing"):
        assert _variants(got[stage]) == before + cpu_study.LM_BASELINES, (stage, got[stage])


def test_the_lm_study_on_the_gated_task(tmp_path: Path) -> None:
    """The LM study runs on the gate's task: its DDP rows are the gate's runs, so no sweep of it runs DDP at the
    study's depth; one main sweep per seed (seed-<s>); B-SDP C = 0.5 in its own sweeps, seeds 0-4, final weights kept; DDP in the peak and timing
    sweeps; PowerSGD's plain all-reduce phase 10 % of DDP's steps, read from the experiment as composed."""
    from sdp.bench.gate import GATES
    from sdp.driver.config import validate
    from tests.helpers import compose

    got = dict(cpu_study.stages(study="lm", out=tmp_path))
    exp = cpu_study.STUDIES["lm"]["experiment"]
    assert compose([f"experiment={exp}"]).dataset.max_steps == compose([f"experiment={GATES['lm']['task']}"]).dataset.max_steps
    assert "ddp" not in cpu_study.sweep_values(exp, "variant"), cpu_study.sweep_values(exp, "variant")
    assert cpu_study.sweep_values(exp, "seed") == ["0", "1", "2"], cpu_study.sweep_values(exp, "seed")
    for seed in range(3):
        assert f"seed={seed}" in got[f"main-{seed}"] and got[f"main-{seed}"][-1].endswith(f"runs/main/seed-{seed}")
        assert "variant=b_sdp_c50" not in " ".join(got[f"main-{seed}"]) and "variant=b_sdp_c25" in " ".join(got[f"main-{seed}"])
    # B-SDP C = 0.5 once per seed 0-4, final weights kept: the main row and every section's fixed plan (no re-runs)
    for seed in range(5):
        kept = got[f"kept-{seed}"]
        assert {"variant=b_sdp_c50", "train.save_final=fp32", f"seed={seed}"} <= set(kept), kept
        assert kept[-1].endswith(f"runs/main/kept/seed-{seed}"), kept
    assert "main" not in got and "seeds" not in got, sorted(got)
    assert not any("variant=b_sdp_c50," in a or a == "variant=b_sdp_c50" for n, args in got.items()
                   if n.startswith(("remedies-", "onemodel-")) for a in args), "a re-run of the kept fixed plan"
    order = [n for n in got if n.startswith(("main-", "kept-"))]
    assert order == ["main-0", "kept-0", "main-1", "kept-1", "main-2", "kept-2", "kept-3", "kept-4"], order
    extras = [args for name, args in got.items() if name.startswith("extras-")]
    assert not any("ddp" in _variants(a) or "ddp_small_c50" in _variants(a) for a in extras), extras
    # every baseline but DDP+AC, whose losses are the gate's DDP runs by construction (baseline_verdicts.loss_twin)
    run = sorted(v for a in extras for v in _variants(a) if v in cpu_study.LM_BASELINES)
    assert run == sorted(set(cpu_study.LM_BASELINES) - {"ddp_ac"}), run
    (psgd,) = [a for a in extras if _variants(a) == ["powersgd_r4"]]
    start = int(next(a for a in psgd if a.startswith("parallelism.start_iter=")).split("=")[1])
    assert start == compose([f"experiment={exp}"]).train.steps // 10, psgd
    for stage in ("peaks", "timing"):
        assert "ddp" in _variants(got[stage]) and "ddp_small_c50" not in _variants(got[stage]), got[stage]
        assert _variants(got[stage])[-1] == "b_sdp_c50_ac", got[stage]  # appended: the earlier jobs keep their numbers
        small = got[f"{stage}-small"]  # the gate's small dense rows: FLOP budget (their row names), cut short
        assert _variants(small) == ["ddp_small_c50"] and "model.n_layers=4,2" in small, small
        assert not any(a.startswith("train.budget=") for a in small) and small[-1].endswith(f"runs/{stage}/small"), small
    one = [a.replace("model.n_layers=4,2", "model.n_layers=2") for a in got["peaks-small"]
           if not a.startswith(("hydra.", "train.skip_done"))]
    cfg = compose(one)
    assert (cfg.model.n_layers, cfg.train.budget, cfg.train.flops_reference.n_layers) == (2, "flops", 8), one
    validate(cfg, launching=False)
    assert len([n for n in got if n.startswith("onemodel-")]) == 5 and "remedies-3-R50" not in got, sorted(got)
    # the shuffle re-draw without branch scaling (LayerDrop's scale rule at SDP's memory): a preset, not a job of R50
    assert _variants(got["remedies-0-R50"]) == ["b_sdp_c50_roll50", "b_sdp_c50_shuffle50"]
    par = compose(["experiment=cpu_study_lm_automaton", "variant=b_sdp_c50_shuffle50_rn"]).parallelism
    assert (par.rescale, par.redraw, par.resample_every, par.coverage) == ("none", "shuffle", 50, 0.5), par
    # consolidation from the first step appended after lm_text's remedies: the sweep's earlier job numbers hold
    shared, lm = _variants(cpu_study.LM_SHARED["onemodel"]["remedies"]), _variants(got["onemodel-0-remedies"])
    assert lm == [*shared, "b_sdp_c50_cons100", "b_sdp_c50_cons50", "b_sdp_c50_cons100_rt", "b_sdp_c50_cons100_ld50_rn",
                  "b_sdp_c50_cons50_ld50_rn", "b_sdp_c50_cons50_wavg"], lm
    # world-averaged consolidation: b_sdp_c50_cons50 but for the key, and a peak run of its own mechanism
    wavg = compose(["experiment=cpu_study_lm_automaton", "variant=b_sdp_c50_cons50_wavg"]).parallelism
    plain = compose(["experiment=cpu_study_lm_automaton", "variant=b_sdp_c50_cons50"]).parallelism
    assert {k: v for k, v in wavg.items() if k != "consolidate_average"} == {k: v for k, v in plain.items()
                                                                              if k != "consolidate_average"}, (wavg, plain)
    assert (wavg.consolidate_average, plain.consolidate_average) == ("world", "holders"), wavg
    assert _variants(got["onemodelpeaks-wavg"]) == ["b_sdp_c50_cons50_wavg"], got["onemodelpeaks-wavg"]
    for variant, f, rescale in (("b_sdp_c50_cons100", 1.0, "auto"), ("b_sdp_c50_cons50", 0.5, "auto"),
                                ("b_sdp_c50_cons100_rt", 1.0, "train")):
        par = compose(["experiment=cpu_study_lm_automaton", f"variant={variant}"]).parallelism
        assert (par.consolidate, par.rescale) == (f, rescale), (variant, par)
    # the holder-averaging control (extras): consolidation with drops at C = 1, the C = 0.5 row's twin otherwise
    (control,) = [a for n, a in got.items() if n.startswith("extras-") and "b_sdp_c100_cons100_ld50_rn" in _variants(a)]
    assert "seed=0,1,2" in control, control
    par = compose(["experiment=cpu_study_lm_automaton", "variant=b_sdp_c100_cons100_ld50_rn"]).parallelism
    twin = compose(["experiment=cpu_study_lm_automaton", "variant=b_sdp_c50_cons100_ld50_rn"]).parallelism
    assert (par.coverage, twin.coverage) == (1.0, 0.5) and {k: v for k, v in par.items() if k != "coverage"} == \
        {k: v for k, v in twin.items() if k != "coverage"}, (par, twin)
    ac = compose(["experiment=cpu_study_lm_automaton", "variant=b_sdp_c50_ac"])
    assert (ac.train.ac, ac.parallelism.name, ac.parallelism.coverage) == ("full", "sdp", 0.5), ac.train


@pytest.mark.parametrize("experiment", ["cpu_study_lm", "cpu_study_lm_automaton"])
@pytest.mark.parametrize("variant", cpu_study.LM_BASELINES)
def test_each_baseline_validates_flop_matched_in_the_lm_study(variant: str, experiment: str) -> None:
    from sdp.driver.config import validate
    from tests.helpers import compose

    cfg = compose([f"experiment={experiment}", f"variant={variant}", "seed=0"])
    assert cfg.train.budget == "flops", cfg.train.budget
    validate(cfg, launching=False)


def test_a_stage_that_keeps_final_weights_is_followed_by_their_diagnosis(tmp_path: Path, monkeypatch) -> None:
    """kept-<s>'s runs are diagnosed once (sdp-bench diagnose) after the stage: runs with final weights and no
    diagnosis.json; a stage that keeps no weights diagnoses nothing."""
    import sdp.bench.diagnose as diag

    calls: list[Path] = []
    monkeypatch.setattr(diag, "diagnose", lambda run: calls.append(run) or (run / diag.DIAGNOSIS).write_text("{}"))
    sweep = tmp_path / "runs" / "main" / "kept" / "seed-0"
    for job, final in (("0", True), ("1", False)):
        (sweep / job).mkdir(parents=True)
        (sweep / job / "config.yaml").write_text("seed: 0\n")
        if final:
            (sweep / job / "final").mkdir()
    args = dict(cpu_study.stages(study="lm", out=tmp_path))["kept-0"]
    args = [a for a in args if not a.startswith("hydra.sweep.dir=")] + [f"hydra.sweep.dir={sweep}"]
    assert study_stages.diagnose_kept(args) == [sweep / "0"] and calls == [sweep / "0"], calls
    assert study_stages.diagnose_kept(args) == [] and len(calls) == 1, calls  # diagnosed already: skipped
    main = [a for a in dict(cpu_study.stages(study="lm", out=tmp_path))["main-0"] if not a.startswith("hydra.")]
    (sweep / "0" / diag.DIAGNOSIS).unlink()
    assert study_stages.diagnose_kept([*main, f"hydra.sweep.dir={sweep}"]) == [] and len(calls) == 1


def test_status_counts_each_stages_finished_stopped_and_left_jobs(tmp_path: Path) -> None:
    """--status: a sweep's jobs are the product of its comma lists (Hydra's basic sweeper); a job with summary.json
    is finished, a run directory without one unfinished (it goes on from its last checkpoint, or from step 0), the
    rest never started."""
    got = dict(cpu_study.stages(study="lm", out=tmp_path))
    assert study_stages.sweep_jobs(got["main-0"]) == 8, got["main-0"]  # 8 variants x 1 seed
    assert study_stages.sweep_jobs(["variant=a,b", "seed=0,1,2", "model.n_layers=4,12", "hydra.sweep.dir=x,y"]) == 12
    assert study_stages.sweep_jobs(["seed=0,1", "train.flops_reference={n_layers:8,dim:64}", "x=[1,2]"]) == 2
    sweep = tmp_path / "lm" / "runs" / "main" / "seed-0"
    for job in (0, 1, 3):
        (sweep / str(job)).mkdir(parents=True)
    for job in (0, 1):
        RunDir(sweep / str(job)).summary.write_text("{}")
    (sweep / "5").mkdir()
    ckpt = RunDir(sweep / "5").checkpoint(40)
    ckpt.mkdir(parents=True)
    checkpoint_meta(ckpt).write_text("{}")
    st = study_stages.stage_status(name="main-0", args=got["main-0"])
    assert (st.jobs, st.done, st.unfinished, st.left) == (8, [0, 1], {3: None, 5: 40}, 6), st
    lines = study_stages.status_lines(stages=list(got.items()), only=["main-0", "kept-0"])
    assert lines[0].startswith("main-0") and "2/8" in lines[0], lines
    assert "job 3 from step 0; job 5 from its checkpoint at step 40" in lines[0], lines
    assert lines[1].startswith("kept-0") and "0/1" in lines[1], lines
    assert lines[-1] == "7 of 9 jobs left in 2 of 2 stages", lines
    assert study_stages.selected("main-1", ["main"]) and not study_stages.selected("main-1", ["kept"])


def test_only_that_selects_no_stage_is_refused_before_anything_runs(tmp_path: Path) -> None:
    stages = cpu_study.stages(study="lm", out=tmp_path)
    study_stages.check_only(stages=stages, only=["main", "kept-1", "onemodel-0-remedies"])
    with pytest.raises(SystemExit, match=r"^--only mian,kept-9: no such stage; allowed: a kind \(.*main.*\)"):
        study_stages.check_only(stages=stages, only=["mian", "main-0", "kept-9"])


def test_rescale_none_is_one_check_run_and_rescale_train_every_seed(tmp_path: Path) -> None:
    """rescale=none trains the fixed plan bit for bit, so only seed 0 runs it (the check; every seed's loss is read
    from the kept weights); rescale=train runs seeds 0-2, seed 0 in extras-1 beside the check (its job numbers
    hold), seeds 1-2 in a stage of their own."""
    got = dict(cpu_study.stages(study="lm", out=tmp_path))
    rescale = {n: a for n, a in got.items() if n.startswith("extras-") and any(x.startswith("parallelism.rescale=") for x in a)}
    flat = {n: [x for x in a if x.startswith(("seed=", "parallelism.rescale="))] for n, a in rescale.items()}
    assert sorted(flat.values()) == [["seed=0", "parallelism.rescale=none,train"], ["seed=1,2", "parallelism.rescale=train"]], flat
    assert "extras-1" in flat and flat["extras-1"] == ["seed=0", "parallelism.rescale=none,train"], flat
    text = dict(cpu_study.stages(study="lm_text", out=tmp_path))  # the record keeps its sweeps as they were made
    assert ["seed=0,1,2", "parallelism.rescale=none,train"] in [
        [x for x in a if x.startswith(("seed=", "parallelism.rescale="))] for a in text.values()], text


def test_the_lm_study_drops_fsdps_own_check_and_keeps_every_other_stages_directory(tmp_path: Path) -> None:
    """extras-0 (FSDP, seed 0) is not a stage of the lm study (FSDP+AC's runs are its check); extras-1 and later keep
    their index, so the committed runs' directories and job numbers stay valid."""
    got = dict(cpu_study.stages(study="lm", out=tmp_path))
    assert "extras-0" not in got and "extras-1" in got and "extras-2" in got, sorted(got)
    assert got["extras-2"][-1] == f"hydra.sweep.dir={tmp_path / 'lm' / 'runs' / 'extras' / '2'}", got["extras-2"]
    assert "fsdp_ac" in _variants(got["extras-2"]), got["extras-2"]
    assert "extras-0" in dict(cpu_study.stages(study="image", out=tmp_path)), "the image study keeps FSDP's check"
