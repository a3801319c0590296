"""sdp-bench one-model-scale (sdp/bench/one_model_scale.py): each phase over DDP's predicted peak against the 0.60x
target, the worker-depth row's half model, and the LM report's line (none before the suite was run). The grid here is
hand-made; the planner's own figures are the suite's run (benchmarks/results/one-model-scale)."""

from __future__ import annotations

import json
from pathlib import Path

from sdp.bench import one_model_scale as S
from sdp.bench.runs import compose


def _grid(peaks: dict[str, float]) -> dict:
    """As grid() writes it: each row's peak, model state and its ratio to DDP's peak."""
    ddp = peaks.get("DDP", 50.0)
    return {shape: {row: {"peak_gib": peaks.get(row, 50.0), "model_state_gib": 10.0, "x_ddp": peaks.get(row, 50.0) / ddp}
                    for row, _, _ in S.PHASES} for shape in S.SHAPES}


def test_each_phase_is_read_against_ddp_and_the_target() -> None:
    cons, ddp_ac = S.PHASES[1][0], "DDP+AC"
    results = {"grid": _grid({"DDP": 100.0, cons: 45.0, ddp_ac: 61.0}), "provenance": {"versions": {"git_commit": "abc"}}}
    text = S.render(results)
    assert f"| {cons} | 45.0 GiB | 0.450 | yes |" in text, text
    assert "| DDP+AC | 61.0 GiB | 0.610 | no |" in text, text  # above 0.60x: misses the target
    assert "| DDP | 100.0 GiB | 1.000 | no |" in text and "Commit: abc." in text, text
    assert S.size(0.0275) == "28.16 MiB", S.size(0.0275)


def test_the_worker_depth_row_has_half_the_blocks() -> None:
    for shape in S.SHAPES.values():
        full = int(compose(shape).model.n_layers)
        assert compose(S.half_depth(shape)).model.n_layers == full // 2, shape


def test_the_lm_report_line_reads_the_suites_result(tmp_path: Path) -> None:
    assert S.context_line(results_root=tmp_path) == []
    cons = S.PHASES[1][0]
    (tmp_path / S.RESULT).parent.mkdir(parents=True)
    (tmp_path / S.RESULT).write_text(json.dumps({"grid": _grid({"DDP": 100.0, cons: 45.0, "DDP+AC": 61.0,
                                                                "FSDP+AC": 18.0})}))
    own, gap, line = S.context_line(results_root=tmp_path)
    assert gap == "" and "at this study's own shape" in own and "consolidation 0.450x" in own, own
    shape = [s for s in S.SHAPES if s != S.CPU_SHAPE][0]
    assert f"{shape}: consolidation phase 0.450x (world-averaged 0.500x), DDP+AC 0.610x, FSDP+AC 0.180x" in line, line
    assert S.CPU_SHAPE not in line, line
    assert "(../../one-model-scale/one_model_scale.md)" in line and "not measured" in line, line


def test_the_fused_shape_is_its_twin_stepped_by_the_fused_kernel() -> None:
    """torchtitan's optimizer kernel (fused AdamW) is the only difference between the two 8B columns."""
    from omegaconf import OmegaConf

    fused = OmegaConf.to_container(compose(S.SHAPES["Llama-3.1-8B, fused AdamW"]))
    foreach = OmegaConf.to_container(compose(S.SHAPES["Llama-3.1-8B"]))
    assert fused["optim"]["optimizer"].pop("fused") is True, fused["optim"]
    assert fused == foreach
