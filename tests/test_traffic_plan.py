"""sdp-plan's traffic outside the training step against what 4-rank runs measure, byte for byte.

Each case runs a job on 4 gloo ranks (evaluations, and for SDP re-draws, the workers' own models and their
ensemble) and predicts the same config with ``sdp.planning.planner.predict``; every rank's
``comm.per_rank[r].outside_training`` (phase -> bytes, collectives over the run) must be equal, phase by phase:
an evaluation's assembly, BatchNorm re-estimation or averaging, sums and ensemble, and every re-draw.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import compose, run_job
from tests.helpers.marks import core_cases

RUN = ["train.steps=6", "train.warmup_steps=1", "train.eval_every=3", "train.checkpoint_every=0",
       "eval.subnetworks=true", "eval.ensemble=true", "cluster.world_size=4"]
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


@pytest.mark.dist
@pytest.mark.parametrize("case", core_cases(list(CASES), ids=list(CASES), core={"resnet_sdp_redraw"}))
def test_predicted_outside_training_equals_measured_per_rank_and_phase(case: str, tmp_path: Path) -> None:
    from sdp.planning.planner import predict

    overrides = [*RUN, *CASES[case]]
    summary, _ = run_job(overrides, run_dir=tmp_path / "run")
    plan = predict(compose(overrides))
    measured = [r["outside_training"] for r in summary["comm"]["per_rank"]]
    predicted = [r["outside_training"] for r in plan["comm"]["per_rank"]]
    assert "eval" in measured[0] and (case == "resnet_ddp" or "resample" in measured[0]), measured
    assert predicted == measured, f"{case}: predicted {predicted} != measured {measured}"
