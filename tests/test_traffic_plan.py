"""sdp-plan's traffic outside the training step and its checkpoint writes against what 4-rank runs measure, byte for byte.

Each case runs a job on 4 gloo ranks (evaluations, checkpoints, and for SDP re-draws, the workers' own models and
their ensemble) and predicts the same config with ``sdp.planning.planner.predict``, then holds, per rank:

- ``comm.per_rank[r].outside_training`` (phase -> bytes, collectives over the run) equal to summary.json's, phase by
  phase: an evaluation's assembly, BatchNorm re-estimation or averaging, sums and ensemble, and every re-draw (the
  optimizer-state descriptions' all-gather included);
- the plan's ``checkpoint.per_rank[r].checkpoints`` (each checkpoint's files, name -> bytes) equal to the tensor
  payload of the files the run wrote: the ``data/`` records of each ``torch.save`` zip, every storage once
  (:mod:`sdp.planning.plan_checkpoint` says why the rest of a file, its framing, is not predicted).

The cases share one run each (checkpoints, evaluations and re-draws in the same 6 steps); ``resnet_sdp_redraw`` is in
the default tier, the others are slow. Issue 39's consolidation switch and assembly calibration have a run each
(:func:`test_predicted_consolidation_and_calibration_traffic_equal_measured`, slow).
"""

from __future__ import annotations

import pickle
import re
import zipfile
from pathlib import Path

import pytest
import torch

from tests.helpers import compose, core_cases, run_job

RUN = ["train.steps=6", "train.warmup_steps=1", "train.eval_every=3", "train.checkpoint_every=3",
       "train.checkpoint_keep=0", "eval.subnetworks=true", "eval.ensemble=true", "cluster.world_size=4"]
RESNET = ["model=resnet18_cifar", "model.width=8", "dataset=digits", "train.batch_size=8", "train.eval_batch_size=64"]
LLAMA = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=16", "dataset.vocab_size=64",
         "train.batch_size=2", "train.eval_batch_size=4", "dataset.num_val=24", "optim=adamw"]
REDRAW = ["parallelism=sdp", "parallelism.resample_every=2"]
CASES = {
    "resnet_sdp_redraw": [*RESNET, *REDRAW],
    "resnet_sdp_bn_average": [*RESNET, *REDRAW, "eval.bn=average"],
    "llama_sdp_redraw": [*LLAMA, *REDRAW],
    "resnet_ddp": [*RESNET, "parallelism=ddp"],
}
DATA = re.compile(r"(^|/)data/\d+$")  # a storage's record in a torch.save zip


def payload(path: Path) -> int:
    """The tensor payload of a ``torch.save`` file: its storages' records, without the pickle and the zip framing."""
    with zipfile.ZipFile(path) as z:
        return sum(i.file_size for i in z.infolist() if DATA.search(i.filename))


def written(run_dir: Path, *, world: int) -> list[list[dict]]:
    """Per rank, each checkpoint the run wrote: its step and its files' tensor payload (rank 0 also ``shared.pt``)."""
    from sdp.rank.checkpoint import checkpoints
    from sdp.results.rundir import SHARED_FILE, rank_file

    out: list[list[dict]] = [[] for _ in range(world)]
    for step, path in checkpoints(run_dir):
        for r in range(world):
            names = [rank_file(r), *([SHARED_FILE] if r == 0 else [])]
            out[r].append({"step": step, "files": {n: payload(path / n) for n in names}})
    return out


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", core_cases(list(CASES), ids=list(CASES), core={"resnet_sdp_redraw"}))
def test_predicted_traffic_and_checkpoints_equal_measured_per_rank_and_phase(case: str, tmp_path: Path) -> None:
    from sdp.planning.planner import predict

    overrides = [*RUN, *CASES[case]]
    summary, _ = run_job(overrides, run_dir=tmp_path / "run")
    plan = predict(compose(overrides))
    measured = [r["outside_training"] for r in summary["comm"]["per_rank"]]
    predicted = [r["outside_training"] for r in plan["comm"]["per_rank"]]
    assert "eval" in measured[0] and (case == "resnet_ddp" or "resample" in measured[0]), measured
    assert predicted == measured, f"{case}: predicted {predicted} != measured {measured}"
    files = written(tmp_path / "run", world=4)
    assert [len(f) for f in files] == [2] * 4, f"{case}: checkpoints written per rank {files}"
    expected = [r["writes"] for r in plan["checkpoint"]["per_rank"]]
    assert expected == files, f"{case}: predicted checkpoint payload {expected} != written {files}"
    assert [r["bytes"] for r in plan["checkpoint"]["per_rank"]] == \
        [sum(sum(c["files"].values()) for c in f) for f in files], plan["checkpoint"]


PHASED = ["model=resnet18_cifar", "model.width=8", "dataset=digits", "train.batch_size=8", "train.eval_batch_size=64",
          "train.steps=6", "train.warmup_steps=1", "train.eval_every=0", "train.budget=iterations", "cluster.world_size=4",
          "parallelism=sdp"]
PHASES = {"consolidate": [*PHASED, "parallelism.consolidate=0.5"], "calibrate": [*PHASED, "parallelism.calibrate_steps=3"],
          # world-averaged consolidation: every block's all-reduce over the 4 ranks, refreshes as the holders' one
          "consolidate_world": [*PHASED, "parallelism.consolidate=0.5", "parallelism.consolidate_average=world"]}


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("phase", list(PHASES))
def test_predicted_consolidation_and_calibration_traffic_equal_measured(phase: str, tmp_path: Path) -> None:
    """Issue 39's remedies on 4 ranks (k = 2, BatchNorm statistics averaged over holders): sdp-plan predicts comm phase
    ``consolidate`` (the switch's broadcasts of the blocks each rank lacks, from their lowest holder) and ``calibrate``
    (the assembly's broadcasts, then one float32 all-reduce of the gates' gradients and the loss per step) as the run
    records them, per rank and byte for byte, besides its evaluation; with consolidation, the per-step fields are the
    mean of both phases' steps over the measured ones (the refresh broadcasts of backward masking added in phase 2),
    each phase's step in the plan's ``consolidate`` facts."""
    from sdp.planning.planner import predict

    overrides, phase = PHASES[phase], phase.removesuffix("_world")
    summary, _ = run_job(overrides, run_dir=tmp_path / "run")
    plan = predict(compose(overrides))
    measured = [r["outside_training"] for r in summary["comm"]["per_rank"]]
    predicted = [r["outside_training"] for r in plan["comm"]["per_rank"]]
    assert all(m.get(phase, {}).get("collectives") for m in measured), f"{phase}: not measured: {measured}"
    assert predicted == measured, f"{phase}: predicted {predicted} != measured {measured}"
    facts = plan[phase]["per_rank"]
    lacked = [f["switch"]["lacked_bytes"] if phase == "consolidate" else f["lacked_bytes"] for f in facts]
    assert all(lacked), f"{phase}: a rank lacks no block: {facts}"
    for pc, mc in zip(plan["comm"]["per_rank"], summary["comm"]["per_rank"]):
        for key in ("bytes_per_step", "wire_bytes_per_step", "collectives_per_step"):
            assert pc[key] == pytest.approx(mc[key], rel=1e-12), f"{phase} rank {mc['rank']} {key}: {pc[key]} != {mc[key]}"
    if phase == "consolidate":
        info = plan["consolidate"]
        assert info["phase_steps"] == [p["steps"] for p in summary["budget"]["phases"]], (info, summary["budget"])
        n1, n2 = info["measured_steps"]
        assert n1 + n2 == summary["comm"]["per_rank"][0]["measured_steps"] and n1 and n2, info
        for f, mc in zip(info["per_rank"], summary["comm"]["per_rank"]):
            total = n1 * f["train_bytes_per_step"] + n2 * f["consolidate_bytes_per_step"]
            assert f["consolidate_collectives_per_step"] > f["train_collectives_per_step"], f  # the refresh broadcasts
            assert round(mc["bytes_per_step"] * (n1 + n2)) == total, f"rank {mc['rank']}: measured {mc} vs phases {f}"


def test_described_state_pickles_alike_whatever_its_keys_history() -> None:
    """A re-draw's all-gather of optimizer-state descriptions (:func:`sdp.subnet.carry.descriptions`) moves as many
    bytes whether a piece's state keys are the optimizer's own strings or equal ones unpickled at an earlier re-draw
    (a received piece's): sdp-plan's rehearsal holds the former only, so the payload must not depend on it (it did:
    16 bytes more per SGD key set, 24 per AdamW one, so the prediction came out short from the second re-draw on)."""
    from sdp.parallel.sdp_plan import plan_for
    from sdp.registry import build
    from sdp.subnet import masking as M
    from sdp.subnet.carry import descriptions
    from sdp.subnet.redraw import masked_on_meta

    for optim in ("sgd", "adamw"):
        cfg = compose([*RESNET, "parallelism=sdp", "cluster.world_size=4", f"optim={optim}"])
        with torch.device("meta"):
            model = build(cfg.model)
        plan = plan_for(model=model, cfg=cfg.parallelism, world_size=4)
        module, pieces, layout = masked_on_meta(skeleton=model, plan=plan, rank=0, mode="forward")
        trained = list(M.held_parameters(layout, pieces, 0))
        opt = build(cfg.optim.optimizer)(trained)
        for t in trained:
            t.grad = torch.zeros_like(t)
        opt.step()  # every trained tensor has state
        own = {t: dict(s) for t, s in opt.state.items()}
        half = set(list(own)[::2])  # as a rank holds them after a re-draw: kept pieces and received ones
        received = {t: {pickle.loads(pickle.dumps(k)) if t in half else k: v for k, v in s.items()} for t, s in own.items()}
        assert any(k is not j for t in half for k, j in zip(received[t], own[t])), "the keys are not other objects"
        moving = [i for i, p in enumerate(pieces) if p.is_param and min(p.holders) == 0]
        sizes = []
        for state in (own, received):
            sent: list[int] = []
            descriptions(state=state, old=pieces, old_layout=layout, trainers=lambda p: p.holders, moving=moving, rank=0,
                         gather=lambda mine: sent.append(len(pickle.dumps(mine))) or [mine])  # noqa: B023
            sizes.append(sent[0])
        assert sizes[0] == sizes[1] and moving, f"{optim}: {len(moving)} pieces described in {sizes[0]} bytes from the " \
            f"optimizer's own keys, {sizes[1]} from unpickled ones"
