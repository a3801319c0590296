"""The frontier figures of a CPU study (sdp/bench/frontier.py, issue 38 item 3): each method's quality against its
training peak, wire bytes per token and predicted training time on two links, from run directories written by
hand (the committed runs predate the per-kind wire bytes: the rank's wire / payload ratio stands in)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sdp.bench.baseline_verdicts import baseline_lines
from sdp.bench.frontier import (GPU, LINKS, default_mfu, frontier_lines, frontier_points, plot_frontier, predicted_run_s,
                                traffic_unit)
from sdp.bench.study_report import Study
from sdp.metrics.hardware import gpus, links
from sdp.parallel import STRATEGIES
from sdp.planning.throughput import rank_times
from sdp.report.runs import load_run
from tests.test_report_study import study  # noqa: F401 - the fixture of a whole fake study

WIRE = {"ddp": 3.0e6, "sdp": 1.0e6}  # ring wire bytes per step (fullest rank) of the fixture's DDP and B-SDP runs


def add_comm_and_shape(study_dir: Path) -> None:
    """Give every main run of the fixture a text shape (8 x 64 tokens per rank), fp32 and per-rank comm as older
    runs recorded it (by kind: payload bytes and count only)."""
    for cfg_file in (study_dir / "runs" / "main").rglob("config.yaml"):
        cfg = yaml.safe_load(cfg_file.read_text())
        cfg["train"] |= {"batch_size": 8, "precision": "fp32"}
        cfg["dataset"] = {"kind": "text", "seq_len": 64}
        cfg_file.write_text(yaml.safe_dump(cfg))
        summary_file = cfg_file.parent / "summary.json"
        summary = json.loads(summary_file.read_text())
        wire = WIRE[cfg["parallelism"]["name"]]
        summary["comm"]["per_rank"] = [{"rank": r, "bytes_per_step": wire / 1.5, "wire_bytes_per_step": wire,
                                        "by_kind": {"all_reduce": {"bytes": wire / 1.5, "count": 1.0}}} for r in range(4)]
        summary_file.write_text(json.dumps(summary))


def test_frontier_points_and_predicted_time(study: Path) -> None:  # noqa: F811 - the fixture
    add_comm_and_shape(study)
    st = Study(study_dir=study, study="lm")
    points = frontier_points(st)
    tokens = 8 * 4 * 64
    assert points["DDP"]["wire_per_token"] == pytest.approx(WIRE["ddp"] / tokens), points["DDP"]
    assert points["B-SDP C=0.5"]["wire_per_token"] == pytest.approx(WIRE["sdp"] / tokens), points["B-SDP C=0.5"]
    assert points["B-SDP C=0.5"]["peak"] == pytest.approx(110 / 200), points["B-SDP C=0.5"]
    ddp = load_run(study / "runs" / "main" / "0")
    overlap = STRATEGIES.get("ddp").overlap
    for link in LINKS:
        one = rank_times(flops_per_step=10.0 / 4, peak_flops=gpus()[GPU].peak_flops["fp32"], mfu=default_mfu(),
                         by_kind={"all_reduce": {"wire_bytes": WIRE["ddp"], "count": 1.0}},
                         bus_bytes_per_s=links()[link].bus_bytes_per_s, overlap=overlap)["step_s"]
        assert predicted_run_s(ddp, link=link) == pytest.approx(100 * one), link  # the fixture's DDP: 100 steps
    assert points["DDP"]["time_eth_100g"] > points["DDP"]["time_nvlink"], points["DDP"]
    lines = frontier_lines(st)
    assert lines[2].startswith("| DDP | ") and len(lines) == 2 + len(points), lines
    assert plot_frontier(st, path=study / "frontier.png").stat().st_size > 0


def test_the_predicted_time_computes_activation_checkpointings_recomputation(study: Path) -> None:  # noqa: F811
    """A run with ``train.ac`` computes its recomputation every step (its budget records it apart, model FLOPs
    unchanged): the predicted time is that of the FLOPs plus the recomputed ones; a checkpointed run recorded before
    the budget kept them gives no time rather than DDP's."""
    add_comm_and_shape(study)
    path = study / "runs" / "main" / "0"
    cfg = yaml.safe_load((path / "config.yaml").read_text())
    cfg["train"] |= {"ac": "full", "ac_every": 1}
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert predicted_run_s(load_run(path), link="nvlink") is None
    summary = json.loads((path / "summary.json").read_text())
    summary["budget"]["recompute_flops_per_step"] = 3.0
    (path / "summary.json").write_text(json.dumps(summary))
    one = rank_times(flops_per_step=(10.0 + 3.0) / 4, peak_flops=gpus()[GPU].peak_flops["fp32"], mfu=default_mfu(),
                     by_kind={"all_reduce": {"wire_bytes": WIRE["ddp"], "count": 1.0}},
                     bus_bytes_per_s=links()["nvlink"].bus_bytes_per_s, overlap=STRATEGIES.get("ddp").overlap)["step_s"]
    assert predicted_run_s(load_run(path), link="nvlink") == pytest.approx(100 * one)


def test_wire_bytes_are_per_token_the_trainer_counted_whatever_the_dataset(study: Path) -> None:  # noqa: F811
    """A sequence dataset that is not ``kind: text`` (the automaton task has no ``kind``) still trains tokens: the
    per-token figure divides by the targets per sample the trainer recorded (``time.tokens_per_sample``), not by
    samples (the bug this guards: a 64x larger figure for the LM study's automaton task)."""
    add_comm_and_shape(study)
    for cfg_file in (study / "runs" / "main").rglob("config.yaml"):
        cfg = yaml.safe_load(cfg_file.read_text())
        cfg["dataset"] = {"name": "automaton", "seq_len": 64}
        cfg_file.write_text(yaml.safe_dump(cfg))
        summary_file = cfg_file.parent / "summary.json"
        summary = json.loads(summary_file.read_text())
        summary.setdefault("time", {})["tokens_per_sample"] = 48  # the trainer's count wins over the config's
        summary_file.write_text(json.dumps(summary))
    st = Study(study_dir=study, study="lm")
    assert frontier_points(st)["DDP"]["wire_per_token"] == pytest.approx(WIRE["ddp"] / (8 * 4 * 48))
    assert "wire bytes / token" in frontier_lines(st)[0], frontier_lines(st)[0]


def test_tokens_per_step_read_the_global_batch_the_trainer_recorded(study: Path) -> None:  # noqa: F811
    """Samples per step are the trainer's fact (``summary.global_batch``), not re-derived from the config: where the
    two differ (made up here to tell them apart) the recorded one counts; the config only for a summary without it."""
    add_comm_and_shape(study)
    for summary_file in (study / "runs" / "main").rglob("summary.json"):
        summary = json.loads(summary_file.read_text())
        summary["global_batch"] = 16  # the config says 8 x 4 = 32
        summary.setdefault("time", {})["tokens_per_sample"] = 48
        summary_file.write_text(json.dumps(summary))
    assert frontier_points(Study(study_dir=study, study="lm"))["DDP"]["wire_per_token"] == pytest.approx(
        WIRE["ddp"] / (16 * 48))


def test_a_study_of_classifiers_counts_its_traffic_per_sample(study: Path) -> None:  # noqa: F811
    """Without a sequence shape (no recorded targets per sample, no ``dataset.seq_len``: an image classifier) the
    wire bytes are per sample, and every line that names the unit says so."""
    assert traffic_unit(Study(study_dir=study, study="lm")) == "sample"
    add_comm_and_shape(study)
    st = Study(study_dir=study, study="lm")
    assert traffic_unit(st) == "token"
    assert not any("per sample" in line for line in baseline_lines(st, unit="nats")), baseline_lines(st, unit="nats")
